"""The job's own collectives on DDP's process group, call by call, against the plan.

gloo numbers every allreduce of a process group by one counter, DDP's bucket allreduces
and the job's own (`dist.all_reduce(loss)`) alike, and NCCL runs them all on the same
rings; the plan lists the job's own (`collectives`: once at the start, before and after
the gradient buckets of every round), and the replay skips exactly those. One the plan
does not list, made where it is not listed, is taken for DDP's traffic: where its size
differs from every bucket's the iteration it falls in is not committed, and the replay
names it; where it is exactly a bucket's size nothing on the wire tells it apart from
that bucket, and the shadow would step it as gradients, committing wrong checkpoints
that look good.

So `write_plan` watches the calls: `torch.distributed.all_reduce` (and, on NCCL, where
every collective shifts the rings, `broadcast`, `all_gather` and
`all_gather_into_tensor`, and `barrier`, which NCCL makes an allreduce of one float32)
on DDP's group are matched in order against what the plan
lists between two rounds (the `after` of one, then the `before` of the next; the first
round's `start` too, unless it ran before write_plan). A call that does not fit is
refused at the call, before it reaches the wire, where it is an allreduce of a bucket's
size (TrainerError: every rank makes the same calls, so every rank refuses the same
one); any other is warned about once (its iteration is not committed, nothing wrong
is), and so is a listed one the loop did not make. DDP's own calls through the Python
API (its compression hooks, `_delayed_all_reduce_hook`) are its buckets, not the job's.
"""
from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ckptd.core.plan import collective_entry, collective_json, dtype_name

# torch.distributed's functions -> the plan's op names
OPS = {"all_reduce": "allreduce", "broadcast": "broadcast", "all_gather": "allgather",
       "all_gather_into_tensor": "allgather", "barrier": "barrier"}
# ProcessGroupNCCL::barrier allreduces one float32 zero on the communicator; gloo's
# barrier is an algorithm of its own, no allreduce
NCCL_BARRIER = ("allreduce", 1, "float32", None)
# DDP's bucket allreduces when a comm hook makes them through the Python API
_DDP_CALLERS = ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks",)
_DDP_FUNCTIONS = ("_delayed_all_reduce_hook",)

_WATCHED: dict[int, "OwnCollectives"] = {}  # id(process group) -> its watcher
_INSTALLED = False


def _call(op: str, sig: inspect.Signature, args, kwargs) -> tuple[object, tuple[str, int, str, int | None]]:
    """(group, (op, count, dtype, root)) of one call, as a plan entry would say it."""
    a = sig.bind(*args, **kwargs).arguments
    group = a.get("group")
    if op == "barrier":
        return group, ("barrier", 0, "", None)
    if op == "allreduce" or op == "broadcast":
        t = a["tensor"]
    elif "input_tensor" in a:
        t = a["input_tensor"]
    else:
        t = a["tensor"]
    root = a.get("src") if op == "broadcast" else None
    return group, (op, int(t.numel()), dtype_name(t.dtype), None if root is None else int(root))


def _seen(op: str, sig: inspect.Signature, args, kwargs, caller):
    if caller.f_globals.get("__name__") in _DDP_CALLERS or caller.f_code.co_name in _DDP_FUNCTIONS:
        return
    try:
        group, call = _call(op, sig, args, kwargs)
        if group is None or group is dist.GroupMember.WORLD:
            group = c10d._get_default_group()
    except Exception:  # a call torch itself will refuse: not ours to judge
        return
    watcher = _WATCHED.get(id(group))
    if watcher is not None and watcher.group() is group:
        watcher.called(call, caller)


def _install():
    """Wrap torch.distributed's collectives once (both names: torch code calls either);
    a call on a group no plan watches goes straight through."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    for name, op in OPS.items():
        real = getattr(c10d, name)
        sig = inspect.signature(real)

        def watched(*args, _real=real, _op=op, _sig=sig, **kwargs):
            if _WATCHED:
                _seen(_op, _sig, args, kwargs, sys._getframe(1))
            return _real(*args, **kwargs)
        functools.update_wrapper(watched, real)
        setattr(c10d, name, watched)
        setattr(dist, name, watched)


def _text(e: tuple) -> str:
    op, n, d, root = e
    return f"{'a' if op == 'broadcast' else 'an'} {op} of {n} {d}" + (f" from rank {root}" if root is not None else "")


def _json(e: tuple) -> str:
    return repr(collective_json(*e))


class OwnCollectives:
    """One DDP model's group: its calls matched against the plan's listed ones."""

    def __init__(self, group, own: dict, transport: str, bucket_bytes: Callable[[], set[int]], error: type):
        self.group = weakref.ref(group)
        self.ops = {"allreduce"} if transport == "gloo" else {"allreduce", "broadcast", "allgather"}  # gloo: its count
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.error = error

        def listed(key):
            return [e for e in map(collective_entry, own.get(key, ())) if e[0] in self.ops]
        before, start = listed("before"), listed("start")
        self.between = listed("after") + before
        self.ways = [start + before, before] if start else [before]  # start may have run before write_plan
        self.rounds = 0
        self.warned: set = set()

    def called(self, call: tuple, caller):
        what = ""
        if call[0] == "barrier" and self.transport != "gloo":
            call, what = NCCL_BARRIER, "a barrier (on NCCL an allreduce of 1 float32)"
        if call[0] not in self.ops:
            return
        what = what or _text(call)
        fits = [w[1:] for w in self.ways if w and w[0] == call]  # (a broadcast's root too: root None elsewhere)
        if fits:
            self.ways = fits
            return
        nbytes = call[1] * torch.empty(0, dtype=getattr(torch, call[2])).element_size()
        where = (f"after {self.rounds} round{'s' if self.rounds > 1 else ''} of gradient allreduces" if self.rounds
                 else "before the first round of gradient allreduces")
        if call[0] == "allreduce" and nbytes in self.bucket_bytes():
            raise self.error(
                f"{what} on DDP's process group ({where}) is not in write_plan's collectives, and it "
                f"is exactly a gradient bucket's size ({nbytes} bytes): ckptd would take it for that bucket and "
                f"step wrong gradients; list it where the loop makes it (collectives={{'before' or 'after': "
                f"[{_json(call)}]}}) or make it on a group of its own (dist.new_group)")
        self._warn(("unlisted", call), f"{what} on DDP's process group ({where}) is not in write_plan's "
                   f"collectives: the iteration it falls in will not be committed; list it where the loop makes "
                   f"it ({_json(call)}) or make it on a group of its own (dist.new_group)", caller)

    def round_begins(self):
        """DDP's next round of bucket allreduces begins: what was listed before it must have been made."""
        if not any(len(w) == 0 for w in self.ways):
            left = min(self.ways, key=len)
            self._warn(("missing", left[0]), f"write_plan's collectives list {_text(left[0])} on DDP's process "
                       f"group before round {self.rounds + 1}'s gradient allreduces, and the loop did not make "
                       "it: the iterations around it will not be committed; list the collectives as the loop "
                       "makes them", None)
        self.rounds += 1
        self.ways = [list(self.between)]

    def _warn(self, key, text: str, caller):
        if key in self.warned:
            return
        self.warned.add(key)
        msg = "ckptd: " + text
        if caller is not None:
            warnings.warn_explicit(msg, RuntimeWarning, caller.f_code.co_filename, caller.f_lineno)
        else:
            warnings.warn(msg, RuntimeWarning, stacklevel=2)


def watch(group, own: dict, transport: str, bucket_bytes: Callable[[], set[int]], error: type) -> OwnCollectives:
    """Watch the job's own collectives on `group` from now on (see the module's text)."""
    _install()
    w = OwnCollectives(group, own, transport, bucket_bytes, error)
    _WATCHED[id(group)] = w
    return w
