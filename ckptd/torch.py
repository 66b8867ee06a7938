"""The trainer's side: the plan and initial state, written by the training script itself.

    import ckptd.torch
    ckptd.torch.write_plan(ddp_model, optimizer, "ckptd/plan.json", scheduler=scheduler, scaler=scaler)

called on every rank after DDP, the optimizer, the lr scheduler and the GradScaler are
built and before the first forward. Everything is read from the live objects, not
re-derived: DDP's bucket layout from its reducer (the first one now; the rebuilt one
when DDP rebuilds it in iteration 1's forward: a forward hook then rewrites the plan),
the communication hook, the wire dtype, the optimizer's class and param groups as torch
filled them in, the scheduler's class and arguments (checked by replaying it; a
scheduler of Python code or nesting others, LambdaLR, SequentialLR, ..., as the lrs it
sets over the job's iterations: lr_per_step), the
GradScaler's settings, the backend (gloo or nccl) and the NCCL settings of the
environment. Rank 0 writes the plan and the initial state (`init.pt` beside the plan,
a ckptd checkpoint of iteration -1); `ckptd replay --plan plan.json --init init.pt` and
`ckptd run` read both as they are.

What ckptd cannot reproduce bit for bit is refused here with a CkptdError naming the
reason (FSDP and ZeRO shard the state, unknown communication hooks change the wire,
some optimizers and schedulers have no deterministic functional form), rather than
let the shadow drift.

Every import is absolute: inside this module `torch` is the torch package.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import json
import os
import socket
import struct
import time
import weakref
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ckptd.core.checkpoint import save_checkpoint
from ckptd.core.optim import LOSS_DRIVEN, UNREPLAYABLE, GroupSchedule, full_groups
from ckptd.core.plan import (COLLECTIVE_WHEN, DTYPES, OPTIMIZER_CLASSES, dtype_name, BucketLayout, ModuleBuffers,
                             Optimizer, Parameter, Plan, PlanError, collectives_from_json)
from ckptd.core.schedule import RingConfig, ib_ar_settings
from ckptd.core.wrappers import unwrap
from ckptd import own_collectives
from ckptd.errors import CkptdError, one_line

PLAN_VERSION_NOTE = "written by ckptd.torch.write_plan"
_KIND_OF_CLASS = {v: k for k, v in OPTIMIZER_CLASSES.items()}


class TrainerError(CkptdError, ValueError):
    """A training job whose state ckptd cannot reproduce exactly; the message says why."""


def _refuse_sharding(model, optimizer):
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    kind = type(model).__name__
    if isinstance(model, FullyShardedDataParallel | FSDPModule):
        raise TrainerError("FSDP shards parameters and optimizer state across ranks: no rank's "
                           "allreduce carries whole gradients, so ckptd cannot shadow it")
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TrainerError(f"write_plan needs the DistributedDataParallel model, got {kind}")
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        raise TrainerError("ZeroRedundancyOptimizer shards the optimizer state (ZeRO): each rank "
                           "steps its own shard and broadcasts parameters, which ckptd does not decode")


# DDP's Python hooks and what they put on the wire (ckptd.core.plan.COMM_HOOKS)
def _comm_hook(ddp) -> str:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    known = {default_hooks.allreduce_hook: "allreduce", default_hooks.fp16_compress_hook: "fp16_compress",
             default_hooks.bf16_compress_hook: "bf16_compress"}
    hooks = list(getattr(ddp, "_comm_hooks", []))
    logged = ddp._get_ddp_logging_data().get("comm_hook", "")
    if not hooks:
        if logged:  # a built-in C++ hook (_register_builtin_comm_hook)
            raise TrainerError(f"DDP comm hook {logged!r} is not one ckptd decodes "
                               "(default allreduce, fp16_compress_hook, bf16_compress_hook)")
        return "allreduce"
    hook, state = hooks[-1]
    name = known.get(getattr(hook, "__wrapped__", hook))
    if name is None or state is not None and state is not ddp.process_group:
        raise TrainerError(f"DDP comm hook {getattr(hook, '__name__', hook)!r} is not one ckptd decodes "
                           "(default allreduce, fp16_compress_hook, bf16_compress_hook with the default "
                           "process group): its wire format is unknown")
    return name


def _refuse_ddp_modes(ddp):
    if getattr(ddp, "mixed_precision", None) is not None:
        raise TrainerError("DDP's own mixed_precision keeps low-precision parameter copies; use "
                           "torch.autocast with a GradScaler or a compression hook instead")
    if getattr(ddp, "_has_rebuilt_buckets", False):
        raise TrainerError("DDP has already rebuilt its buckets: call write_plan before the "
                           "first forward, so the first iteration's layout is still DDP's")
    if getattr(ddp, "static_graph", False) and getattr(ddp, "_static_graph_delay_allreduce_enqueued", False):
        raise TrainerError("DDP (static_graph=True) has already run a backward: call write_plan before the "
                           "first forward, so iteration 0's used-parameter map is on the wire ckptd reads")


def _named_parameters(ddp) -> list[tuple[str, torch.Tensor]]:
    """DDP's module's named_parameters() less its parameters_to_ignore, named as the plain
    model names them: DDP(torch.compile(m)) holds m under torch.compile's wrapper, whose
    names carry `_orig_mod.`, as do DDP's own (parameters_to_ignore, named_module_buffers);
    the plan, init.pt and every checkpoint use m's (ckptd.core.wrappers)."""
    return _split_ignored(ddp)[0]


def _split_ignored(ddp) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(the parameters DDP keeps, those in its parameters_to_ignore), named as the plain
    model names them (_named_parameters)."""
    plain, prefix = unwrap(ddp.module)
    ignore = set(getattr(ddp, "parameters_to_ignore", ()))
    kept, ignored = [], []
    for n, p in plain.named_parameters():
        (ignored if prefix + n in ignore else kept).append((n, p))
    return kept, ignored


def _names(ddp) -> tuple[list[str], list[torch.Tensor]]:
    """DDP's parameters, the reducer's, in its order (the rebuilt-bucket broadcast's
    indices count these): those that require grad."""
    by_id = {id(p): n for n, p in _named_parameters(ddp)}
    params = _reducer_params(ddp)
    return [by_id[id(p)] for p in params], params


def _frozen(ddp, params: list[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    """The model's parameters other than `params` (_names': the reducer's), less DDP's
    parameters_to_ignore, in module order: requires_grad=False, so DDP's reducer leaves
    them out (no bucket, nothing on the wire) and nothing steps them; DDP's constructor
    broadcasts them with the rest (ddp_collectives)."""
    trained = {id(p) for p in params}
    named = [(n, p) for n, p in _named_parameters(ddp) if id(p) not in trained]
    return [n for n, _ in named], [p for _, p in named]


def _refuse_sparse(model):
    """A parameter with sparse gradients, by DDP's own test (its _build_params_for_reducer:
    an Embedding or EmbeddingBag with sparse=True): DDP allreduces them apart from its
    buckets. For write_plan and `ckptd plan` alike (the latter read the buckets of such a
    model and failed inside with torch's "Expected a proper Tensor but got None")."""
    sparse = next((f"{m}.weight" if m else "weight" for m, mod in unwrap(model)[0].named_modules()
                   if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.sparse
                   and mod.weight.requires_grad), None)
    if sparse is not None:
        raise TrainerError(f"parameter {sparse} has sparse gradients (an Embedding with sparse=True): DDP "
                           "allreduces those apart from its buckets, which ckptd does not decode; use sparse=False")


def _refuse_odd_buffers(model):
    """A module buffer of a dtype the plan cannot record (bool, complex, float8) is refused
    by name before DDP's constructor: its broadcast of a float8 buffer raised torch's
    "Invalid scalar type", which named no buffer."""
    odd = next(((n, b) for n, b in unwrap(model)[0].named_buffers() if dtype_name(b.dtype) not in DTYPES), None)
    if odd is not None:
        raise TrainerError(f"buffer {odd[0]} has dtype {dtype_name(odd[1].dtype)}: ckptd records "
                           f"{', '.join(DTYPES)}")


def _layout(ddp, names_of: dict[int, str]) -> tuple[BucketLayout, ...]:
    """The reducer's buckets now, in allreduce order, each in buffer order."""
    out = []
    for b in sorted(ddp.reducer._get_zeros_like_grad_buckets(), key=lambda b: b.index()):
        out.append(BucketLayout(params=tuple(names_of[id(p)] for p in b.parameters())))
    return tuple(out)


def _jsonable(v, where: str):
    if isinstance(v, Counter):
        return sorted(v.elements())
    if isinstance(v, tuple | list):
        return [_jsonable(x, where) for x in v]
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    raise TrainerError(f"{where}: value {v!r} ({type(v).__name__}) cannot be recorded in a plan")


def _optimizer(optimizer, names_of: dict[int, str], ddp_names: list[str],
               frozen_of: dict[int, str] | None = None,
               ignored_of: dict[int, str] | None = None) -> tuple[str, list[dict]]:
    """The optimizer's kind and param groups by name. A frozen parameter (frozen_of) may be
    in a group as the trainer built it: torch's step skips a parameter whose grad is None,
    and a frozen one's always is (DDP does not reduce it), so it is recorded and never
    stepped; only Adagrad makes state for it, at construction, which init.pt carries."""
    cls = type(optimizer)
    kind = _KIND_OF_CLASS.get(cls.__name__)
    if kind is None or getattr(torch.optim, cls.__name__, None) is not cls:
        raise TrainerError(f"optimizer {cls.__module__}.{cls.__name__} has no deterministic functional "
                           f"form ckptd reproduces (supported: torch.optim {', '.join(OPTIMIZER_CLASSES.values())})")
    groups, seen = [], {}
    for i, g in enumerate(optimizer.param_groups):
        names = []
        for p in g["params"]:
            n = names_of.get(id(p)) or (frozen_of or {}).get(id(p))
            if n is None and id(p) in (ignored_of or {}):  # DDP neither reduces nor broadcasts it
                raise TrainerError(f"optimizer group {i} holds parameter {ignored_of[id(p)]}, which DDP ignores "
                                   "(parameters_to_ignore): its gradient is this rank's own, never on the wire; "
                                   "leave it out of the optimizer ckptd records")
            if n is None:
                raise TrainerError(f"optimizer group {i} holds a tensor that is not a parameter of the DDP model")
            if n in seen or n in names:
                where = f"group {seen[n]} and group {i}" if n in seen else f"group {i} twice"
                raise TrainerError(f"parameter {n} is in optimizer {where}: torch would step it twice")
            names.append(n)
        seen.update(dict.fromkeys(names, i))
        hyper = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                raise TrainerError(f"optimizer group {i}: {k} is a tensor; ckptd needs Python numbers")
            hyper[k] = _jsonable(v, f"optimizer group {i} {k}")
        if kind == "adagrad":  # Adagrad's state starts from the constructor's value, not the group's
            hyper["initial_accumulator_value"] = optimizer.defaults["initial_accumulator_value"]
        groups.append({"params": names, **hyper})
    left = [n for n in ddp_names if n not in seen]
    if left:
        raise TrainerError(f"parameters {left[:3]} are trained by DDP but not in the optimizer")
    return kind, groups


_SCHED_SKIP = ("self", "optimizer", "last_epoch", "verbose")


def _scheduler(scheduler, optimizer, args: dict | None) -> dict | None:
    if scheduler is None:
        if args:  # meant for a scheduler the call forgot: its lrs would not be replayed
            raise TrainerError("scheduler_args given without a scheduler: pass the lr scheduler too")
        return None
    cls = type(scheduler)
    name = cls.__name__
    if getattr(torch.optim.lr_scheduler, name, None) is not cls:
        raise TrainerError(f"lr scheduler {cls.__module__}.{name} is not a torch.optim.lr_scheduler class")
    if name in UNREPLAYABLE:
        raise TrainerError(f"lr scheduler {name} cannot be replayed: {UNREPLAYABLE[name]}")
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise TrainerError(f"lr scheduler {name} drives another optimizer than the one given to write_plan: "
                           "its steps would not move this optimizer's lr")
    if args is not None and not isinstance(args, dict):
        raise TrainerError(f"scheduler_args must be a dict of {name}'s constructor arguments, "
                           f"not {type(args).__name__}")
    if scheduler.last_epoch != 0:
        raise TrainerError(f"lr scheduler {name} has stepped {scheduler.last_epoch} times: call "
                           "write_plan before the first step")
    if args is None:
        args = {}
        for k, prm in inspect.signature(cls.__init__).parameters.items():
            if k in _SCHED_SKIP or prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD):
                continue
            if callable(getattr(scheduler, k, None)) and prm.default is None:
                continue  # a default function the scheduler picked itself (CyclicLR's scale_fn)
            if hasattr(scheduler, k):
                args[k] = _jsonable(getattr(scheduler, k), f"lr scheduler {name} {k}")
            elif isinstance(getattr(scheduler, k + "s", None), list):  # CyclicLR's base_lrs, max_lrs
                args[k] = _jsonable(getattr(scheduler, k + "s"), f"lr scheduler {name} {k}")
            elif all(k in g for g in optimizer.param_groups):  # OneCycleLR's max_lr, momenta
                args[k] = [_jsonable(g[k], f"lr scheduler {name} {k}") for g in optimizer.param_groups]
            elif prm.default is inspect.Parameter.empty:
                raise TrainerError(f"lr scheduler {name}: argument {k!r} is not readable from the "
                                   "scheduler; pass scheduler_args={...} to write_plan")
    return {"class": name, "args": args}


def _norm_type(norm_type) -> float:
    """write_plan's grad_norm_type as torch's clip_grad_norm_ takes it (a number, or
    'inf'), as the plan's float; the plan's check names a value out of range."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float, str)):
        raise TrainerError(f"grad_norm_type must be a number or 'inf' (clip_grad_norm_'s norm_type), "
                           f"not {type(norm_type).__name__}")
    try:
        return float(norm_type)
    except (ValueError, OverflowError):
        raise TrainerError(f"grad_norm_type {norm_type!r} is not a number or 'inf' (clip_grad_norm_'s "
                           "norm_type)") from None


def _lr_per_step(lrs, scheduler, groups) -> tuple:
    """The lrs a trainer sets by hand (`for g in opt.param_groups: g["lr"] = f(step)`),
    as data: a function of the step is Python code the daemon cannot run, its values
    for the steps the job will take are not."""
    if lrs is None:
        return ()
    if scheduler is not None:
        raise TrainerError("lr_per_step and a scheduler both set the lr: give one")
    if callable(lrs) or isinstance(lrs, (str, bytes)):
        raise TrainerError(f"lr_per_step must be the list of lrs per step, not {type(lrs).__name__}: "
                           "pass [f(step) for step in range(steps)]")
    out = []
    for i, x in enumerate(lrs):
        vals = list(x) if isinstance(x, (list, tuple)) else [x]
        try:
            vals = [float(v) for v in vals]
        except (TypeError, ValueError):
            raise TrainerError(f"lr_per_step[{i}] is {x!r}: a number or one per param group") from None
        if isinstance(x, (list, tuple)) and len(vals) != len(groups):
            raise TrainerError(f"lr_per_step[{i}] has {len(vals)} lrs for {len(groups)} param groups")
        if not all(math.isfinite(v) and v >= 0 for v in vals):
            raise TrainerError(f"lr_per_step[{i}] is {x!r}: lrs must be finite and >= 0")
        out.append(vals if isinstance(x, (list, tuple)) else vals[0])
    if not out:
        raise TrainerError("lr_per_step is empty: give the lr of every step the job takes")
    return tuple(out)


def _stepped_for_lrs(scheduler) -> bool:
    """Whether the scheduler records its lrs by being stepped (lr_per_step) rather than
    being rebuilt by class and arguments: torch's classes that nest schedulers or call
    Python code (UNREPLAYABLE but for the loss-driven one) and any LRScheduler class of
    the trainer's own (its step may be anything, but a function of the step count)."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return False
    cls = type(scheduler)
    if getattr(torch.optim.lr_scheduler, cls.__name__, None) is not cls:
        return True
    return cls.__name__ in UNREPLAYABLE and cls.__name__ not in LOSS_DRIVEN


def _has_stepped(scheduler) -> bool:
    if not hasattr(scheduler, "last_epoch"):  # ChainedScheduler: its schedulers count
        return any(_has_stepped(s) for s in getattr(scheduler, "_schedulers", ()))
    return scheduler.last_epoch != 0


def _scheduler_lrs(scheduler, optimizer, iterations, args, lr_per_step) -> tuple | None:
    """The lr of each step 0..iterations-1 of a scheduler that is not rebuilt by class
    and arguments (_stepped_for_lrs), as lr_per_step: the trainer's own scheduler object
    stepped through the job, so the floats are torch's; the values as of now (a lambda
    that reads outside state is read now). None for any other scheduler."""
    cls = type(scheduler)
    name = cls.__name__ if getattr(torch.optim.lr_scheduler, cls.__name__, None) is cls \
        else f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):  # a subclass too
        raise TrainerError(f"lr scheduler {name} cannot be replayed: {UNREPLAYABLE['ReduceLROnPlateau']}")
    if not _stepped_for_lrs(scheduler):
        return None
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise TrainerError(f"lr scheduler {name} drives another optimizer than the one given to write_plan: "
                           "its steps would not move this optimizer's lr")
    if lr_per_step is not None:
        raise TrainerError("lr_per_step and a scheduler both set the lr: give one")
    if args is not None:
        raise TrainerError(f"scheduler_args given for lr scheduler {name}: its lrs are recorded by stepping "
                           "it (lr_per_step), not rebuilt from arguments; leave scheduler_args out")
    if iterations is None:
        raise TrainerError(f"lr scheduler {name} is recorded as the lr of every step: pass "
                           "iterations=<the number of optimizer steps the job takes> to write_plan")
    if _has_stepped(scheduler):
        raise TrainerError(f"lr scheduler {name} has stepped already: call write_plan before the first step")
    return tuple(_step_through(scheduler, optimizer, iterations, name))


# scheduler.step() before any optimizer.step(): what stepping through the lrs is
_STEP_ORDER_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


def _step_through(scheduler, optimizer, iterations: int, name: str) -> list:
    """Steps the trainer's scheduler iterations-1 times, reading the lr of every group
    before each step as the optimizer would use it, then puts the scheduler (its
    state_dict, nested schedulers' included) and the param groups back as they were,
    and checks that they are."""
    import copy
    import warnings
    groups = optimizer.param_groups
    kept = [[(k, v if k == "params" else copy.deepcopy(v)) for k, v in g.items()] for g in groups]
    try:
        keep = copy.deepcopy(scheduler.state_dict(), {id(optimizer): optimizer})
        before = copy.deepcopy(scheduler.state_dict(), {id(optimizer): optimizer})
    except Exception as e:  # noqa: BLE001 -- a scheduler holding what cannot be copied
        raise TrainerError(f"lr scheduler {name}: its state_dict cannot be copied to put it back after "
                           f"stepping it for its lrs ({type(e).__name__}: {e})") from None
    lrs, why = [], None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_STEP_ORDER_WARNING)
            for step in range(iterations):
                if step:
                    scheduler.step()
                now = []
                for i, (g, was) in enumerate(zip(groups, kept)):
                    lr = g["lr"]
                    if isinstance(lr, torch.Tensor) or not isinstance(lr, int | float) \
                            or not math.isfinite(lr) or lr < 0:
                        why = f"sets group {i}'s lr to {lr!r} at step {step}: ckptd records finite lrs >= 0"
                        break
                    moved = [k for k, v in was if k not in ("params", "lr", "initial_lr")
                             and _jsonable_or_none(g.get(k)) != _jsonable_or_none(v)]
                    if moved:
                        why = (f"moves group {i}'s {moved[0]} at step {step}: only the lr of a scheduler that "
                               "is not rebuilt by class is recorded (lr_per_step)")
                        break
                    now.append(float(lr))
                if why:
                    break
                lrs.append(now[0] if len(set(now)) == 1 else now)
    except Exception as e:  # noqa: BLE001 -- the scheduler's own code: said in one line, with the step
        why = f"fails at step {len(lrs)} ({type(e).__name__}: {one_line(e)[:200]})"
    finally:
        scheduler.load_state_dict(keep)
        for g, was in zip(groups, kept):
            g.clear()
            g.update(was)
    if not _same(scheduler.state_dict(), before):
        raise TrainerError(f"lr scheduler {name}: its state after stepping it for its lrs could not be put back "
                           "as it was (its state_dict differs)")
    if why:
        raise TrainerError(f"lr scheduler {name} {why}")
    return lrs


def _same(a, b) -> bool:
    """Deep equality, floats bit for bit, objects without an __eq__ of their own by their
    attributes (the copies a state_dict is put back from)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(_bits(a), _bits(b))
    if a is b:
        return True
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return _same(vars(a), vars(b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- an __eq__ that cannot answer: not the same
        return False


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# Scheduler steps _check_ahead compares: what the scheduler does later (its arguments or a
# function it was handed that its state does not show: CyclicLR's scale_fn) shows there.
SCHEDULER_LOOKAHEAD = 1000


def _check_replay(opt: Optimizer, names: list[str], optimizer, scheduler,
                  lookahead: int = SCHEDULER_LOOKAHEAD):
    """The replayed scheduler must reproduce the trainer's hyperparameters and internal
    state now; anything a replay gets wrong shows here, before any iteration."""
    from ckptd.core.optim import OptimizerError
    try:
        replay = GroupSchedule(opt, full_groups(opt, names))
        now = replay.at(0)
    except OptimizerError as e:
        raise TrainerError(str(e)) from e
    for i, (mine, real) in enumerate(zip(now, optimizer.param_groups)):
        for k, v in real.items():
            if k in ("params", "initial_lr") or (k == "lr" and opt.lr_per_step):
                continue  # a hand-set lr is written into the groups inside the loop
            if _jsonable(v, k) != _jsonable(mine.get(k), k):
                if isinstance(v, float) and not math.isfinite(v):  # (nan != nan: torch's SGD takes a nan momentum)
                    raise TrainerError(f"optimizer.param_groups[{i}] {k} is {v!r}: it must be a finite number")
                if not opt.lr_scheduler:
                    raise TrainerError(f"optimizer.param_groups[{i}] {k}: the plan's groups replay it as "
                                       f"{mine.get(k)!r}, the trainer's is {v!r}")
                raise TrainerError(f"lr scheduler {opt.lr_scheduler['class']}: replayed group {i} {k} "
                                   f"is {mine.get(k)!r}, the trainer's is {v!r}; pass scheduler_args")
    if scheduler is not None and replay.sched is not None:
        a, b = scheduler.state_dict(), replay.sched.state_dict()
        for k in a:
            if callable(a[k]):
                continue
            if _jsonable_or_none(a[k]) != _jsonable_or_none(b.get(k)):
                raise TrainerError(f"lr scheduler {opt.lr_scheduler['class']}: replayed {k} is "
                                   f"{b.get(k)!r}, the trainer's is {a[k]!r}; pass scheduler_args")
        _check_ahead(replay, optimizer, scheduler, opt.lr_scheduler["class"], lookahead)


def _check_ahead(replay: GroupSchedule, optimizer, scheduler, name: str, steps: int):
    """The trainer's own scheduler, stepped on a copy that drives a stand-in optimizer
    (the trainer's hyperparameters, one-element parameters), against the replay for the
    job's first `steps` steps: a scheduler whose state agrees now but whose steps would not
    (an argument or a function not read back) is refused here, not found in a checkpoint."""
    import copy
    import warnings
    stand_in = type(replay.dummy)([{**copy.deepcopy({k: v for k, v in g.items() if k != "params"}),
                                    "params": [torch.zeros(1)]} for g in optimizer.param_groups],
                                  **{k: v for k, v in optimizer.defaults.items()
                                     if k in inspect.signature(type(replay.dummy).__init__).parameters})
    try:
        twin = copy.deepcopy(scheduler, {id(optimizer): stand_in})
    except Exception as e:  # noqa: BLE001 -- a scheduler holding what cannot be copied
        raise TrainerError(f"lr scheduler {name} cannot be checked by stepping a copy of it "
                           f"({type(e).__name__}: {e}); it is not one ckptd replays") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scheduler.step() with no optimizer.step()
        for step in range(1, steps):
            try:
                twin.step()
            except Exception:  # noqa: BLE001 -- the trainer's own scheduler fails here too (OneCycleLR past total_steps)
                return
            try:
                mine = replay.at(step)
            except Exception as e:  # noqa: BLE001 -- said in one line, with the step
                raise TrainerError(f"lr scheduler {name}: the replay fails at step {step} where the trainer's "
                                   f"does not ({type(e).__name__}: {e}); pass scheduler_args") from None
            for i, (g, real) in enumerate(zip(mine, stand_in.param_groups)):
                for k, v in real.items():
                    if k in ("params", "initial_lr"):
                        continue
                    if _jsonable_or_none(v) != _jsonable_or_none(g.get(k)):
                        raise TrainerError(f"lr scheduler {name}: at step {step} the replayed group {i} {k} is "
                                           f"{g.get(k)!r}, the trainer's would be {v!r} (an argument or function "
                                           "not read back from the scheduler); pass scheduler_args, or use a "
                                           "scheduler without Python functions")


def _jsonable_or_none(v):
    try:
        return _jsonable(v, "")
    except TrainerError:
        return repr(v)


def _scaler(scaler) -> dict | None:
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TrainerError(f"scaler must be a torch.amp.GradScaler (or None), not {type(scaler).__name__}")
    if scaler is None or not scaler.is_enabled():
        return None
    return {"init_scale": float(scaler._init_scale), "growth_factor": float(scaler._growth_factor),
            "backoff_factor": float(scaler._backoff_factor), "growth_interval": int(scaler._growth_interval)}


def _local_address(backend: str) -> str:
    """The address this rank's collective traffic uses: its interface's (GLOO_/NCCL_
    SOCKET_IFNAME) or the host's."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME")
    if ifname and "," not in ifname:
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                req = struct.pack("256s", ifname.encode()[:15])
                return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError as e:
                raise TrainerError(f"interface {ifname} has no IPv4 address: {e}") from e
    return socket.gethostbyname(socket.gethostname())


def _nccl_version() -> tuple[int, int]:
    try:
        major, minor = torch.cuda.nccl.version()[:2]
    except (AttributeError, RuntimeError, TypeError):
        major, minor = 2, 19
    return major, minor


def _ring(backend: str, world: int) -> RingConfig:
    env = os.environ
    if backend == "gloo":
        return RingConfig(world, (tuple(range(world)),))
    if env.get("NCCL_ALGO", "ring").lower() not in ("ring", "allreduce:ring"):
        raise TrainerError(f"NCCL_ALGO={env['NCCL_ALGO']}: ckptd decodes NCCL's ring allreduce only")
    major, minor = _nccl_version()
    split = env.get("NCCL_IB_SPLIT_DATA_ON_QPS")
    return RingConfig(world, (tuple(range(world)),), protocol=env.get("NCCL_PROTO", "simple").lower(),
                      nccl_version=(major, minor), max_threads=int(env.get("NCCL_NTHREADS", 512)),
                      buffsize=int(env["NCCL_BUFFSIZE"]) if "NCCL_BUFFSIZE" in env else None,
                      qps_per_connection=int(env.get("NCCL_IB_QPS_PER_CONNECTION", 1)),
                      # a flag to NCCL; the plan's field is a bool (an int 1 wrote a plan load_plan refused)
                      split_data_on_qps=int(split) != 0 if split is not None else None,
                      **ib_ar_settings((major, minor), env))


def _refuse_sync_batchnorm(ddp):
    """SyncBatchNorm allreduces its batch statistics in every training forward and backward,
    on DDP's group unless given its own: between the gradient buckets, in the backward
    too, where no plan can list them."""
    group = getattr(ddp, "process_group", None)
    for name, mod in unwrap(ddp)[0].named_modules():
        if not isinstance(mod, torch.nn.SyncBatchNorm):
            continue
        own = mod.process_group
        if own is None or own is dist.GroupMember.WORLD:
            own = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        if group is None or own is group:
            raise TrainerError(f"{name or 'the model'} is a SyncBatchNorm on DDP's process group: it allreduces "
                               "its batch statistics in every training forward and backward, among the gradient "
                               "buckets, where no plan can list them; give it a group of its own "
                               "(SyncBatchNorm(..., process_group=dist.new_group())) or use BatchNorm (DDP "
                               "broadcasts its buffers)")


def build_plan(ddp, optimizer, scheduler=None, scaler=None, max_grad_norm: float | None = None,
               addresses: list[str] | None = None, iterations: int | None = None,
               scheduler_args: dict | None = None, without_buffers: bool = False,
               lr_per_step=None,
               allreduces_per_step: int = 1, collectives: dict | None = None, *,
               grad_norm_type=2.0, clip_grad_value: float | None = None) -> Plan:
    """The plan of this job as it stands now (no file written, no collective called
    unless `addresses` is None)."""
    if iterations is not None and (not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1):
        raise TrainerError(f"iterations must be an integer >= 1 (or None), not {iterations!r}")
    _refuse_sharding(ddp, optimizer)
    _refuse_ddp_modes(ddp)
    _refuse_sparse(ddp)
    _refuse_odd_buffers(ddp)
    _refuse_sync_batchnorm(ddp)
    hook = _comm_hook(ddp)
    names, params = _names(ddp)
    names_of = {id(p): n for n, p in zip(names, params)}
    frozen, frozen_params = _frozen(ddp, params)
    first = _layout(ddp, {id(p): n for n, p in _named_parameters(ddp)})
    reduced = {n for b in first for n in b.params}
    changed = sorted(reduced.symmetric_difference(names))
    if changed:  # DDP's reducer took its parameters when it was built, by requires_grad then
        n = changed[0]
        raise TrainerError(f"parameter {n} changed requires_grad after DDP was built (DDP "
                           f"{'reduces' if n in reduced else 'does not reduce'} it): set requires_grad "
                           "before wrapping the model in DistributedDataParallel")
    dtypes = {dtype_name(p.dtype) for p in params}
    odd = sorted(dtypes - set(DTYPES))
    if odd:
        raise TrainerError(f"parameters of dtype {odd[0]}: ckptd decodes {', '.join(DTYPES)}")
    for n, p in zip(frozen, frozen_params):  # carried, not decoded: any dtype the plan can name
        if dtype_name(p.dtype) not in DTYPES:
            raise TrainerError(f"frozen parameter {n} has dtype {dtype_name(p.dtype)}: "
                               f"ckptd records {', '.join(DTYPES)}")
    if len(dtypes) > 1:
        raise TrainerError(f"parameters of several dtypes {sorted(dtypes)}: not supported")
    try:
        backend = dist.get_backend(ddp.process_group)
    except (ValueError, RuntimeError):
        raise TrainerError("DDP's process group is not initialised (destroyed before write_plan?)") from None
    if backend not in ("gloo", "nccl"):
        raise TrainerError(f"process group backend {backend!r}: ckptd decodes gloo and nccl")
    buffers = _buffers(ddp, backend, without_buffers)
    world = dist.get_world_size(ddp.process_group)
    if addresses is None:
        addresses = exchange_addresses(_local_address(backend), ddp.process_group)
    _check_addresses(addresses, world)
    kind, groups = _optimizer(optimizer, names_of, names, dict(zip(map(id, frozen_params), frozen)),
                              {id(p): n for n, p in _split_ignored(ddp)[1]})
    if _scaler(scaler) and any(g.get("fused") for g in groups):
        raise TrainerError("a GradScaler with fused=True hands the scale to the fused step; "
                           "ckptd reproduces AMP with foreach or for-loop optimizers")
    stepped = _scheduler_lrs(scheduler, optimizer, iterations, scheduler_args, lr_per_step)
    if stepped is not None:  # its lrs, as data: the plan has no scheduler then
        scheduler, lr_per_step = None, stepped
    with _by_argument():
        opt = Optimizer(kind=kind, lr=float(groups[0]["lr"]), groups=tuple(groups),
                        lr_scheduler=_scheduler(scheduler, optimizer, scheduler_args), grad_scaler=_scaler(scaler),
                        max_grad_norm=max_grad_norm, grad_norm_type=_norm_type(grad_norm_type),
                        clip_grad_value=clip_grad_value, lr_per_step=_lr_per_step(lr_per_step, scheduler, groups))
    _check_replay(opt, names, optimizer, scheduler,
                  SCHEDULER_LOOKAHEAD if iterations is None else min(iterations, SCHEDULER_LOOKAHEAD))
    transport = "gloo" if backend == "gloo" else "roce"
    if not isinstance(allreduces_per_step, int) or allreduces_per_step < 1:
        raise TrainerError(f"allreduces_per_step must be an integer >= 1, not {allreduces_per_step!r}")
    # static_graph: DDP's reducer goes by it, find_unused_parameters or not (its wire is the
    # same either way, as checked: docs/TRAINING.md), so the plan says static_graph only
    static = bool(getattr(ddp, "static_graph", False))
    unused = bool(ddp.find_unused_parameters) and not static
    if static:
        _check_static_graph(backend, allreduces_per_step)
    if unused:
        _check_find_unused(allreduces_per_step)
    if world < 2:
        raise TrainerError(f"the process group has {world} rank: ckptd needs at least 2 ranks (it rebuilds "
                           "the state from their allreduces; one rank puts none on the wire)")
    ring = _ring(backend, world)
    with _by_argument():
        # find_unused_parameters: DDP never rebuilds its buckets (Reducer::should_rebuild_buckets)
        return Plan(plan_parameters(names, params),
                    first, first, ring, opt, tuple(addresses), (), iterations,
                    transport, rebuilt_learn=transport == "gloo" and not unused, comm_hook=hook, buffers=buffers,
                    static_graph=static,
                    allreduces_per_step=allreduces_per_step, bucket_limits=_ddp_limits(ddp),
                    collectives=with_own_collectives(
                        _ddp_collectives(ddp, ring, addresses) if transport == "roce" else {},
                        collectives_from_json(collectives or {})),
                    frozen=Parameter.each_of(zip(frozen, frozen_params)), find_unused_parameters=unused,
                    tied=tied_parameters(unwrap(ddp.module)[0], names + frozen))


def with_own_collectives(ddp: dict, own: dict) -> dict:
    """Plan.collectives: DDP's own (NCCL), then the job's (write_plan's `collectives`) at
    each place: a start-up one after DDP's constructor, a `before` one (a loss allreduced
    before backward) after DDP's per-forward buffer broadcast."""
    return {when: (*ddp.get(when, ()), *own.get(when, ())) for when in COLLECTIVE_WHEN
            if ddp.get(when) or own.get(when)}


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The order of t's dimensions in memory, outermost first, where it is dense but not
    contiguous (channels_last, a transposed view); None otherwise. DDP lays a dense
    parameter's gradient into its bucket in that order (reducer.cpp
    initialize_bucket_views: as_strided with the parameter's strides; the grad layout
    contract), any other row-major (narrow().view(sizes)), as a contiguous one's."""
    if t.is_contiguous():
        return None
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))
    return order if t.permute(order).is_contiguous() else None


def plan_parameters(names: list[str], params: list[torch.Tensor]) -> tuple[Parameter, ...]:
    """The plan's parameters, each with the memory order the shadow reads its gradient by."""
    return tuple(Parameter(n, tuple(p.shape), dtype_name(p.dtype), _memory_order(p)) for n, p in zip(names, params))


def tied_parameters(module: torch.nn.Module, names: list[str]) -> tuple[tuple[str, str], ...]:
    """The plan's `tied`: every other name of a parameter among `names` (named_parameters()
    keeps a tensor's first name only; state_dict() keeps all), mapped to that first name."""
    first: dict[int, str] = {}
    out = []
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            first[id(p)] = n
        elif first[id(p)] in names:
            out.append((n, first[id(p)]))
    return tuple(out)


def _check_find_unused(allreduces_per_step: int):
    """find_unused_parameters=True: one allreduce per step (docs/TRAINING.md)."""
    if allreduces_per_step != 1:
        raise TrainerError("find_unused_parameters=True with allreduces_per_step > 1 is not supported: a "
                           "parameter unused in the last micro-batch keeps an earlier one's reduced gradient")


def _check_static_graph(backend: str, allreduces_per_step: int):
    """static_graph=True: one allreduce per step (docs/TRAINING.md), on gloo and NCCL alike."""
    if allreduces_per_step != 1:
        raise TrainerError("static_graph=True with allreduces_per_step > 1 is not supported")


def _check_unused_grads(ddp, names: list[str], params: list[torch.Tensor]):
    """An optimizer step pre-hook (find_unused_parameters): a parameter no rank used this
    iteration keeps its .grad untouched (Reducer::finalize_bucket_dense). After the usual
    zero_grad() (set_to_none=True) that is None and torch's step skips it, as the shadow
    does; after zero_grad(set_to_none=False) it is a zero tensor, which torch's step does
    step (moments decay, weight decay, the step count grows), and the wire cannot tell the
    two apart. So that case is refused here, at the first step it would change anything,
    on every rank alike (the map is the reduced one, every rank's grads the same)."""
    def check(optimizer, args, kwargs):
        try:
            used = ddp.reducer._get_local_used_map()
        except (AttributeError, RuntimeError):
            return
        if used.numel() != len(params):
            return
        for i in (used == 0).nonzero().flatten().tolist():  # a step's cost in the trainer: only the unused
            n, p = names[i], params[i]
            if p.grad is not None:
                raise TrainerError(f"parameter {n} was used on no rank this iteration but has a gradient tensor "
                                   "(zero_grad(set_to_none=False)?): torch steps it with that gradient, which is "
                                   "not on the wire; call zero_grad() with set_to_none=True (the default)")
    return check


# A plan's check names the plan's field; the trainer gave write_plan an argument, or built
# an object, that ended up there: the error names that instead.
_ARGUMENT_OF_FIELD = (("optimizer.max_grad_norm", "max_grad_norm"), ("optimizer.grad_norm_type", "grad_norm_type"),
                      ("optimizer.clip_grad_value", "clip_grad_value"), ("optimizer.grad_scaler.", "scaler's "),
                      ("optimizer.lr_per_step", "lr_per_step"), ("optimizer.lr_scheduler", "scheduler"),
                      ("bucket_limits", "DDP's bucket_cap_mb (bucket_limits)"), ("optimizer.", "optimizer "))


@contextlib.contextmanager
def _by_argument():
    """PlanError from building the plan as a TrainerError naming write_plan's argument."""
    try:
        yield
    except PlanError as e:
        msg = str(e)
        for field, argument in _ARGUMENT_OF_FIELD:
            if msg.startswith(field):
                msg = argument + msg[len(field):]
                break
        raise TrainerError(msg) from None


def _check_addresses(addresses, world: int):
    import ipaddress
    if isinstance(addresses, (str, bytes)) or not isinstance(addresses, (list, tuple)):
        raise TrainerError(f"addresses must be a list of each rank's IP address, not {type(addresses).__name__}")
    if len(addresses) != world:
        raise TrainerError(f"addresses lists {len(addresses)} addresses for a world of {world} ranks")
    for r, a in enumerate(addresses):
        try:
            ipaddress.ip_address(a)
        except ValueError:
            raise TrainerError(f"addresses[{r}] is {a!r}, not an IPv4 or IPv6 address") from None


_EXCHANGES: dict[tuple[int, ...], int] = {}  # group's global ranks -> exchanges this process made


def exchange_addresses(local: str, group=None) -> list[str]:
    """Every group rank's `local` value, by group rank, through the job's c10d store
    (torch.distributed.distributed_c10d._get_default_store): each rank sets one key and
    reads the others' (store.get waits for them), so nothing goes on the communicator:
    dist.all_gather_object would put two allgathers on NCCL's (size, then data) that the
    plan would have to model. The key holds the group's global ranks and a per-process
    count of exchanges in that group, so a later call never reads an earlier call's value
    (every rank calls this the same number of times, as with a collective)."""
    from torch.distributed import distributed_c10d as c10d
    store = c10d._get_default_store()
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else c10d._get_default_group()))
    n = _EXCHANGES.get(ranks, 0)
    _EXCHANGES[ranks] = n + 1
    prefix = f"ckptd/addresses/{','.join(map(str, ranks))}/{n}/"
    store.set(prefix + str(dist.get_rank()), local.encode())
    return [store.get(prefix + str(r)).decode() for r in ranks]


_PLAN_WRITES: dict[tuple[int, ...], int] = {}  # group's global ranks -> write_plan calls this process made
# group's global ranks -> the counts of write_plan calls after which this process ran a
# forward of a model it wrote the plan of (it went on to train)
_TRAINED_AFTER: dict[tuple[int, ...], set[int]] = {}
_READ_GRACE_S = 10  # how long a failed rank waits for the others to read its error
_POLL_MAX_S = 1.0  # the longest pause between two looks at the store while polling


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


class _PlanCall:
    """One write_plan call's agreement between the group's ranks, through the job's c10d
    store (never the communicator: nothing on the wire the plan would have to model),
    one key prefix per call (numbered per process and group as exchange_addresses numbers
    its keys, so every rank calls write_plan equally often, as with a collective).

    Every rank's outcome counts: each rank publishes its own (ok with a value, or its
    one-line error) and waits for every other's (`agree`), so a rank that failed alone
    no longer leaves the others to go on into the first allreduce and hang there until
    the process group's timeout (by default 30 minutes on gloo, 10 on NCCL). Then rank
    0 alone writes, and the others learn through `outcome` / `wait` whether it could."""

    def __init__(self, group):
        from torch.distributed import distributed_c10d as c10d
        self.ranks = tuple(dist.get_process_group_ranks(group))  # global ranks, by group rank
        self.store = c10d._get_default_store()
        self.rank = dist.get_rank()
        self.others = [r for r in self.ranks if r != self.rank]
        self.group_key = f"ckptd/write_plan/{','.join(map(str, self.ranks))}/"
        self.n = _PLAN_WRITES.get(self.ranks, 0)  # this call's number: the calls made before it
        _PLAN_WRITES[self.ranks] = self.n + 1
        self.prefix = f"{self.group_key}{self.n}/"

    @classmethod
    def of(cls, ddp_model) -> _PlanCall | None:
        """The call's agreement, or None where there is nobody to agree with (no DDP
        model, no live process group): build_plan's checks then raise on this rank."""
        group = getattr(ddp_model, "process_group", None)
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel) or group is None:
            return None
        try:
            return cls(group)
        except (ValueError, RuntimeError):
            return None

    def agree(self, step: str, work):
        """Every rank: run work() -> (value, payload: str); publish "ok" and the payload,
        or this rank's error, under `step`'s key; wait for every other rank's. Return
        (value, every rank's payload by group rank). Where any rank failed every rank
        raises: the failed rank its own error, the others a TrainerError naming the
        failed ranks and the first one's error."""
        key = f"{self.prefix}{step.replace(' ', '_')}/"
        try:
            value, payload = work()
            mine, failure = {"ok": payload}, None
        except Exception as e:
            mine, failure = {"error": one_line(e)}, e
        self.store.set(key + str(self.rank), json.dumps(mine).encode())
        if failure is not None:
            # Its own error is what this rank raises; it does not wait for the others'
            # outcomes (one may never come), only, for a while, for them to read its own.
            self._let_them_read(key)
            raise failure
        records = self._gather(key, step)
        failed = [(r, rec["error"]) for r, rec in zip(self.ranks, records) if "error" in rec]
        if failed:
            self._let_them_read(key)
            (first, error), more = failed[0], len(failed) > 1
            raise TrainerError(f"write_plan failed on {_ranks_text(r for r, _ in failed)}"
                               + (f" (rank {first}: {error})" if more else f": {error}"))
        return value, [rec["ok"] for rec in records]

    def _let_them_read(self, key: str):
        """Before raising: say this rank read the round's outcomes, and wait (a while)
        for the others to have read them too. Where this rank hosts the store (rank 0
        with tcp://, or env:// outside torchrun) its exit takes the store along."""
        try:
            self.store.set(f"{key}read/{self.rank}", b"")
            if self.others:
                self.store.wait([f"{key}read/{r}" for r in self.others], timedelta(seconds=_READ_GRACE_S))
        except RuntimeError:
            pass  # a rank that does not read (gone, or not in write_plan) ends at its store timeout

    def _gather(self, key: str, step: str) -> list[dict]:
        """Every rank's record under `key`, by group rank: wait up to the store's timeout
        (the process group's); a rank that went on to train after fewer write_plan calls
        than this one is told apart at once."""
        keys = [key + str(r) for r in self.ranks]
        timeout = self.store.timeout
        try:
            if self.n and self.n not in _TRAINED_AFTER.get(self.ranks, ()):
                self._poll(keys, timeout)  # a call right after another: another rank may have made only one
            else:
                self.store.wait(keys, timeout)
            return [json.loads(v) for v in self.store.multi_get(keys)]
        except RuntimeError as e:  # the store's timeout (DistStoreError), or its server gone
            try:
                missing = [r for r, k in zip(self.ranks, keys) if not self.store.check([k])]
            except RuntimeError:
                missing = []
            where = (f"c10d store key {keys[self.ranks.index(missing[0])]!r}" if len(missing) == 1 else
                     f"c10d store keys {key + '<rank>'!r}")
            raise TrainerError(f"rank {self.rank} had no word from {_ranks_text(missing) if missing else 'the others'}"
                               f" on whether they could {step} ({where}, waited up to "
                               f"{timeout.total_seconds():.0f} s; every rank calls write_plan, equally often): "
                               f"{one_line(e)}") from None

    def _poll(self, keys: list[str], timeout: timedelta):
        """Wait for `keys`, looking between whiles whether a rank went on to train after
        this process's previous call (self.n calls) while this one is its next: it will
        not come (its call count is not this rank's), and this rank would wait out the
        timeout. (A rank that never calls write_plan at all cannot be told apart from a
        slow one: that is waited for up to the timeout.)"""
        trained = f"{self.group_key}trained_after/{self.n}"
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 0.01
        while not self.store.check(keys):
            if self.store.check([trained]):
                went = [r for r in self.others if self.store.check([f"{trained}/{r}"])]
                raise TrainerError(f"{_ranks_text(went)} went on to train after {self.n} write_plan "
                                   f"call{'s' if self.n > 1 else ''}, while rank {self.rank} made call "
                                   f"{self.n + 1} without training in between: every rank calls write_plan "
                                   "equally often, at the same points (as with a collective)")
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"wait timeout after {timeout.total_seconds():.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)

    def trains(self):
        """This rank's first forward after its write_plan calls: say after how many
        calls it went on to train (best effort), for _poll on a rank that made more."""
        k = _PLAN_WRITES[self.ranks]
        done = _TRAINED_AFTER.setdefault(self.ranks, set())
        if k in done:
            return
        done.add(k)
        try:
            self.store.set(f"{self.group_key}trained_after/{k}/{self.rank}", b"")
            self.store.set(f"{self.group_key}trained_after/{k}", b"")
        except RuntimeError:
            pass  # best effort: a rank that made more calls then waits out its timeout, as before

    @contextlib.contextmanager
    def outcome(self, step: str):
        """Rank 0: publish how the block went ("" or its error), then let an error go on."""
        key = self.prefix + step.replace(" ", "_")
        try:
            yield
        except Exception as e:
            self.store.set(key, one_line(e).encode())
            # Where rank 0 hosts the store (tcp://, or env:// outside torchrun) its exit
            # takes the store along: let the others read the error first, for a while.
            try:
                self.store.wait([f"{key}/read/{r}" for r in self.others], timedelta(seconds=_READ_GRACE_S))
            except RuntimeError:
                pass  # a rank that does not read (gone, or not in write_plan) ends at its store timeout
            raise
        self.store.set(key, b"")

    def wait(self, step: str):
        """Another rank: wait (up to the store's timeout, the process group's) for rank
        0's outcome of `step`; raise its error as this rank's."""
        key = self.prefix + step.replace(" ", "_")
        try:
            error = self.store.get(key).decode()
        except RuntimeError as e:  # the store's timeout (DistStoreError), or its server gone
            raise TrainerError(f"rank {dist.get_rank()} had no word from rank 0 on whether it could {step} "
                               f"(c10d store key {key!r}, waited up to {self.store.timeout.total_seconds():.0f} s): "
                               f"{one_line(e)}") from None
        if error:
            self.store.set(f"{key}/read/{dist.get_rank()}", b"")
            raise TrainerError(f"rank 0 could not {step}: {error}")


def _digests(plan: Plan) -> dict[str, str]:
    """A digest of each of the plan's top-level fields: what every rank must describe
    alike (parameters, buckets, optimizer, ring, addresses, ...). No field is one rank's
    own (the plan names no rank of its own; the addresses are every rank's, exchanged)."""
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16]
            for k, v in plan.to_json().items()}


_FIELD_WORDS = {"ranks": "addresses"}  # a plan field as the mismatch message names it


def _refuse_different_jobs(call: _PlanCall, digests: list[str]):
    """Every rank described its job alike (`digests`, by group rank), or every rank
    raises the same TrainerError naming the ranks whose description is not rank 0's,
    and the fields that differ: rank 0's plan would not describe what they do."""
    differ = [(r, d) for r, d in zip(call.ranks, digests) if d != digests[0]]
    if not differ:
        return
    shown = differ[:3]
    try:
        ref, *theirs = (json.loads(v) for v in call.store.multi_get(
            [f"{call.prefix}fields/{r}" for r in (call.ranks[0], *(r for r, _ in shown))]))
        fields = [" in its " + ", ".join(_FIELD_WORDS.get(k, k) for k in sorted(set(ref) | set(f))
                                          if ref.get(k) != f.get(k)) for f in theirs]
    except RuntimeError:
        fields = [""] * len(shown)
    parts = [f"rank {r}{f' differs from rank {call.ranks[0]}' if not i else ''}{f}"
             for i, ((r, _), f) in enumerate(zip(shown, fields))]
    more = f" (and {len(differ) - len(shown)} more ranks)" if len(differ) > len(shown) else ""
    call._let_them_read(f"{call.prefix}check_the_plan/")
    raise TrainerError(f"the ranks describe different jobs: {'; '.join(parts)}{more} (the plan would be "
                       f"rank {call.ranks[0]}'s: every rank builds the same "
                       "model, optimizer and scheduler and passes write_plan the same arguments)")


# DistributedDataParallel.broadcast_bucket_size (torch/nn/parallel/distributed.py:1020@2.13):
# both the constructor's _sync_module_states and the per-forward buffer broadcast use it
DDP_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def coalesced_broadcasts(tensors, bucket_bytes: int = DDP_BROADCAST_BUCKET_BYTES, root: int = 0) -> tuple:
    """torch.distributed._broadcast_coalesced's broadcasts of `tensors` as Plan.collectives
    entries: c10d's broadcast_coalesced buckets them with compute_bucket_assignment_by_size
    (one dtype a bucket, a bucket closed once it reaches bucket_bytes, buckets in order of
    their first tensor) and issues one ncclBroadcast of each flattened bucket. A dtype the
    plan has no name for goes as its bytes (uint8): NCCL broadcasts bytes anyway."""
    tensors = list(tensors)
    if not tensors:
        return ()
    groups, _ = dist._compute_bucket_assignment_by_size(tensors, [bucket_bytes])
    out = []
    for g in groups:
        dtype = dtype_name(tensors[g[0]].dtype)
        count = sum(tensors[i].numel() for i in g)
        if dtype not in DTYPES:
            count, dtype = count * tensors[g[0]].element_size(), "uint8"
        if count:
            out.append((count, dtype, "broadcast", root))
    return tuple(out)


def verify_collectives(params) -> tuple:
    """The collectives of DDP's constructor check (init_sync: distributed.py:1062-1064@2.13
    -> torch/distributed/utils.py:281-286 -> c10d verify_params_across_processes,
    torch/csrc/distributed/c10d/reducer.cpp) on the reducer's parameters, as Plan.collectives
    entries: an allgather of the parameter count, one int64 a rank
    (at::tensor({params.size()}, kLong) -> process_group->allgather; ProcessGroupNCCL issues
    one ncclAllGather of count 1 for equal-size outputs), then a broadcast from rank 0 of
    every parameter's sizes and strides, 2 * dim int64 each (process_group->broadcast,
    rootRank 0); an empty broadcast (only 0-dim parameters) never reaches the wire."""
    params = list(params)
    if not params:
        return ()
    out = [(1, "int64", "allgather")]
    meta = sum(2 * p.dim() for p in params)
    if meta:
        out.append((meta, "int64", "broadcast", 0))
    return tuple(out)


def _reducer_params(ddp) -> list:
    """DistributedDataParallel._build_params_for_reducer's parameters (distributed.py:1523@2.13):
    those that require grad, less parameters_to_ignore, shared ones once."""
    try:
        return list(ddp._build_params_for_reducer()[0])
    except AttributeError:
        return [p for _, p in _named_parameters(ddp) if p.requires_grad]


def _ddp_collectives(ddp, ring: RingConfig, addresses) -> dict:
    """ddp_collectives of a built DDP: its kept parameters, the reducer's, and its module
    buffers where it syncs them (forward_sync_buffers). The constructor syncs buffers
    when init_sync_buffers, which DDP does not keep: taken as forward_sync_buffers (they
    differ only where forward_sync_buffers=False was passed explicitly)."""
    bufs = [b.detach() for _, b in _module_buffers(ddp)] if ddp.forward_sync_buffers else []
    return ddp_collectives([p.detach() for _, p in _named_parameters(ddp)], _reducer_params(ddp), bufs,
                           ddp.broadcast_bucket_size, ring, one_rank_per_node(addresses), os.environ)


def one_rank_per_node(hosts) -> bool:
    """Whether every rank is on a node of its own (`hosts`: each rank's node, or its
    address where nodes are not known): where NCCL 2.23+ may run an allgather as PAT."""
    hosts = list(hosts)
    return len(set(hosts)) == len(hosts) > 1


def model_collectives(model: torch.nn.Module, ring: RingConfig, one_rank_per_node: bool, env) -> dict:
    """ddp_collectives of DistributedDataParallel(model) as built with its defaults
    (broadcast_buffers=True, no parameters_to_ignore): `ckptd plan --model`, which has
    the plain model only."""
    return ddp_collectives([p.detach() for _, p in model.named_parameters()],
                           [p for p in model.parameters() if p.requires_grad],
                           [b.detach() for _, b in model.named_buffers()], DDP_BROADCAST_BUCKET_BYTES, ring,
                           one_rank_per_node, env)


def ddp_collectives(params, reducer_params, buffers, bucket_bytes: int, ring: RingConfig,
                    one_rank_per_node: bool, env) -> dict:
    """DDP's own collectives on an NCCL communicator, as Plan.collectives: "start", the
    constructor's verify collectives (verify_collectives), then its _sync_module_states
    (torch/distributed/utils.py:289-330@2.13: every named parameter, then every named
    buffer, from rank 0); "before", with buffers, the buffer broadcast at the start of
    every forward that follows a synced backward, and the first (_pre_forward ->
    _sync_buffers -> _default_broadcast_coalesced, distributed.py:1781,2405-2451@2.13), so
    once an iteration before its allreduces. NCCL 2.23+ may run an allgather as PAT on
    one rank per node unless NCCL_ALGO keeps it on Ring or NCCL_PAT_ENABLE=0
    (graph/tuning.cc:108-113@v2.23.4-1): refused, not modelled. `env`: the job's NCCL_ALGO
    and NCCL_PAT_ENABLE (os.environ in the trainer, or what its NCCL log says)."""
    verify = verify_collectives(reducer_params)
    if verify and tuple(ring.nccl_version) >= (2, 23) and str(env.get("NCCL_PAT_ENABLE", "2")).strip() != "0" \
            and one_rank_per_node:
        from ckptd.core.algorithms import ALGORITHMS, enabled
        if "PAT" in enabled(env.get("NCCL_ALGO"), ALGORITHMS, "AllGather"):
            raise TrainerError("NCCL 2.23+ with one rank per node may run DDP's start-up allgather as PAT, "
                               "which ckptd does not model: set NCCL_ALGO=Ring or NCCL_PAT_ENABLE=0")
    out = {}
    start = verify + coalesced_broadcasts(list(params) + list(buffers), bucket_bytes)
    if start:
        out["start"] = start
    if buffers:
        out["before"] = coalesced_broadcasts(buffers, bucket_bytes)
    return out


def _ddp_limits(ddp) -> dict | None:
    """The bucket size limits DDP was built with (bytes): the first layout's, and the
    rebuild's (the C++ reducer's default when DDP passes none: the first bucket's cap,
    then bucket_cap_mb); the plan records them and its layouts are checked against them."""
    cfg = getattr(ddp, "_bucket_config", None)
    if cfg is None:
        return None
    first, rebuild = cfg.compute_bucket_size_limits(static_graph=bool(getattr(ddp, "static_graph", False)),
                                                    find_unused_parameters=ddp.find_unused_parameters)
    rebuild = list(rebuild) or [cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap]
    if min(int(x) for x in [*first, *rebuild]) < 1:  # torch takes bucket_cap_mb=0 (a bucket a parameter)
        raise TrainerError("DDP was built with bucket_cap_mb=0: the plan's bucket size limits are at least 1 "
                           "byte (buckets.limits); give bucket_cap_mb a size > 0 (e.g. 1e-6 for a bucket a "
                           "parameter)")
    return {"first": [int(x) for x in first], "rebuilt": [int(x) for x in rebuild]}


def _module_buffers(ddp) -> list[tuple[str, torch.Tensor]]:
    """DDP's module buffers in the order it broadcasts them (its named_module_buffers:
    module.named_buffers() less the ignored, a dict in that order), named as the plain
    model names them (_named_parameters)."""
    cut = len(unwrap(ddp.module)[1])
    return [(n[cut:], b) for n, b in getattr(ddp, "named_module_buffers", {}).items()]


def _buffers(ddp, backend: str, without_buffers: bool) -> ModuleBuffers:
    """The module buffers and DDP's broadcasts of them, decoded (captured) on gloo and on
    NCCL (there they are also the "before" broadcasts, ddp_collectives). Where they
    cannot be (broadcast_buffers=False: rank 0's are never on the wire)
    the caller must accept that with without_buffers=True, so no checkpoint silently
    lacks what the model holds."""
    named = _module_buffers(ddp)
    if not named:
        return ModuleBuffers()
    listed = ", ".join(n for n, _ in named[:3]) + ("..." if len(named) > 3 else "")
    if hasattr(ddp, "buffer_hook"):
        raise TrainerError("a DDP buffer comm hook (register_buffer_comm_hook) changes how buffers "
                           "are synced; ckptd decodes DDP's default broadcast only")
    tensors = Parameter.each_of(named)
    if not ddp.forward_sync_buffers:
        captured = False  # each rank keeps its own: rank 0's are never on the wire
        why = "DDP was built with broadcast_buffers=False (forward_sync_buffers=False): rank 0's buffers are never on the wire"
    else:
        captured, why = not without_buffers, ""
    if not captured and not without_buffers:
        raise TrainerError(f"the model has buffers ({listed}) that ckptd cannot capture here: {why}; "
                           "pass without_buffers=True to accept checkpoints without them")
    return ModuleBuffers(tensors, _broadcast_groups(named, ddp.broadcast_bucket_size), captured)


def model_buffers(model: torch.nn.Module) -> ModuleBuffers:
    """_buffers of DistributedDataParallel(model) as built with its defaults
    (broadcast_buffers=True): captured (`ckptd plan --model`)."""
    named = [(n, b.detach()) for n, b in model.named_buffers()]
    if not named:
        return ModuleBuffers()
    return ModuleBuffers(Parameter.each_of(named), _broadcast_groups(named, DDP_BROADCAST_BUCKET_BYTES), True)


def _broadcast_groups(named, bucket_bytes: int) -> tuple[tuple[str, ...], ...]:
    """The names in each of DDP's coalesced buffer broadcasts: torch's broadcast_coalesced
    buckets them with this very function (by dtype, at most bucket_bytes each), one
    broadcast per bucket, in this order."""
    groups, _ = dist._compute_bucket_assignment_by_size([b for _, b in named], [bucket_bytes])
    return tuple(tuple(named[i][0] for i in g) for g in groups)


def initial_state(ddp, optimizer, scaler=None) -> tuple[dict, dict]:
    """(model, optimizer) of the ckptd checkpoint format, by parameter name: the state the
    shadow starts from (and, after a step, the trainer's own state to compare with)."""
    names, params = _names(ddp)
    frozen, frozen_params = _frozen(ddp, params)
    names_of = {id(p): n for n, p in zip(names + frozen, params + frozen_params)}
    state = {names_of[id(p)]: {k: v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
             for p, st in optimizer.state.items() if id(p) in names_of}
    opt = {"lr": optimizer.param_groups[0]["lr"], "state": state}
    if scaler is not None and scaler.is_enabled() and scaler._scale is not None:
        opt["grad_scaler"] = {"scale": scaler._scale.detach().clone(),
                              "growth_tracker": scaler._growth_tracker.detach().clone()}
    model = {n: p.detach().clone() for n, p in zip(names + frozen, params + frozen_params)}
    model.update((n, b.detach().clone()) for n, b in _module_buffers(ddp))
    return model, opt


def write_plan(ddp_model, optimizer, path, scheduler=None, scaler=None, *,
               max_grad_norm: float | None = None, grad_norm_type=2.0, clip_grad_value: float | None = None,
               init: str | Path | None = None,
               addresses: list[str] | None = None, iterations: int | None = None,
               scheduler_args: dict | None = None, without_buffers: bool = False,
               lr_per_step=None,
               allreduces_per_step: int = 1, collectives: dict | None = None) -> Plan:
    """Record this job for ckptd; call on every rank before the first forward.

    `collectives`: the job's own collectives on DDP's process group, in the plan's JSON
    form (docs/PLAN.md), e.g. a loss allreduced after each step:
    `{"after": [{"op": "allreduce", "count": 1, "dtype": "float32"}]}` ("before": before
    the gradients' allreduces, "start": once before the first iteration). On gloo only
    allreduces are listed. DDP's own are recorded without them.

    `allreduces_per_step`: with gradient accumulation that lets DDP allreduce every
    micro-batch (no `no_sync()`), the micro-batches per optimizer step (gloo and NCCL);
    under `no_sync()` it stays 1 (one allreduce per step).

    `max_grad_norm`: the max_norm of the trainer's torch.nn.utils.clip_grad_norm_ over
    model.parameters() (after scaler.unscale_ with AMP), `grad_norm_type` its norm_type
    (default 2.0; float('inf') or 'inf' for the largest |g|). `clip_grad_value`: the
    clip_value of the trainer's torch.nn.utils.clip_grad_value_ over model.parameters()
    instead (one of the two). `lr_per_step`: the lr the loop
    writes into the param groups before each step when there is no scheduler (a list
    of numbers, or of one lr per group). A scheduler not rebuilt by class and arguments
    (LambdaLR, MultiplicativeLR, SequentialLR, ChainedScheduler, a class of your own) is
    stepped here through `iterations` steps (required then) and recorded as those lrs;
    it is left as it was. Rank 0 writes the plan to
    `path` and the initial state to `init` (default: init.pt beside the plan); when DDP
    rebuilds its buckets (iteration 1's forward) the plan is rewritten with that layout.
    Where any rank fails in write_plan (its arguments, its model or optimizer), where
    the ranks describe different jobs, or where rank 0 could not write (or rewrite) the
    plan, every rank raises TrainerError, and no plan is written that the ranks did not
    agree on."""
    call = _PlanCall.of(ddp_model)
    if call is None:  # no DDP model, or its group is gone: nobody to agree with; build_plan's checks say why
        build_plan(ddp_model, optimizer, scheduler, scaler, max_grad_norm, addresses or [], iterations,
                   grad_norm_type=grad_norm_type, clip_grad_value=clip_grad_value)
        raise TrainerError("write_plan needs the DistributedDataParallel model of a live process group")

    # Every rank's own checks count: rank 0 writes only after every rank said it could
    # describe the job and all described the same one. Writing only after the agreement
    # (rather than writing first and removing the file where another rank failed) is what
    # keeps it atomic: no reader ever sees a plan the job did not agree on, and a rank 0
    # that dies or is killed in between leaves none behind.
    def where_to():  # 1: the arguments every rank checks alike, and this rank's address
        plan_path = _out_path(path, "path")
        init_path = _out_path(init, "init") if init is not None else plan_path.with_name("init.pt")
        if init_path.resolve() == plan_path.resolve():
            raise TrainerError(f"init and path are the same file ({plan_path}): the plan would overwrite "
                               "the initial state")
        try:
            backend = dist.get_backend(ddp_model.process_group)
        except (ValueError, RuntimeError):
            raise TrainerError("DDP's process group is not initialised (destroyed before write_plan?)") from None
        return (plan_path, init_path), (_local_address(backend) if addresses is None else "")
    (path, init), exchanged = call.agree("exchange addresses", where_to)

    def describe():  # 2: the plan as this rank sees its job
        if addresses is None and "" in exchanged:
            raise TrainerError(f"{_ranks_text(r for r, a in zip(call.ranks, exchanged) if not a)} passed "
                               f"write_plan addresses and rank {call.rank} did not: pass them on every rank or none")
        built = build_plan(ddp_model, optimizer, scheduler, scaler, max_grad_norm,
                           list(exchanged) if addresses is None else addresses, iterations,
                           scheduler_args, without_buffers, lr_per_step, allreduces_per_step, collectives,
                           grad_norm_type=grad_norm_type, clip_grad_value=clip_grad_value)
        fields = _digests(built)  # read by the others only where the ranks' digests differ
        call.store.set(f"{call.prefix}fields/{call.rank}", json.dumps(fields).encode())
        return built, hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    plan, digests = call.agree("check the plan", describe)
    _refuse_different_jobs(call, digests)

    rank = dist.get_rank(ddp_model.process_group)
    if rank == 0:  # 3: rank 0 writes; the others learn whether it could
        with call.outcome("write the plan"):
            for f in (path, init):
                if f.is_dir():
                    raise TrainerError(f"{f} is a directory: write_plan writes a file there")
            model, opt = initial_state(ddp_model, optimizer, scaler)
            for f, what, write in ((init, "the initial state", lambda: save_checkpoint(init, -1, model, opt)),
                                   (path, "the plan", lambda: _save(plan, path))):
                try:
                    f.parent.mkdir(parents=True, exist_ok=True)
                    write()
                except FileExistsError:
                    raise TrainerError(f"cannot write {what} to {f}: {f.parent} is not a directory") from None
                except OSError as e:
                    raise TrainerError(f"cannot write {what} to {f}: {e.strerror or e}") from None
    else:
        call.wait("write the plan")
    names, params = _names(ddp_model)
    names_of = {id(p): n for n, p in zip(names, params)}
    _refuse_shared_group(ddp_model, path)
    own = own_collectives.watch(ddp_model.process_group, collectives_from_json(collectives or {}), plan.transport,
                                lambda: _bucket_bytes(plan), TrainerError)
    _watch_rounds(ddp_model, optimizer, params, allreduces_per_step, scaler, on_round=own.round_begins)
    _check_grads_as_planned(optimizer, params, plan.optimizer, scaler)
    if plan.find_unused_parameters or plan.static_graph:
        optimizer.register_step_pre_hook(_check_unused_grads(ddp_model, names, params))

    def after_forward(module, inputs, output):
        call.trains()  # once: a rank that made more write_plan calls learns this one went on
        if not getattr(module, "_has_rebuilt_buckets", False):
            return
        handle.remove()
        # Every rank runs this forward (DDP's rebuild syncs the layout from rank 0 in it),
        # so the others can wait here for rank 0's rewrite: a rank 0 that failed would
        # otherwise leave them in the next allreduce until the process group's timeout.
        if rank != 0:
            call.wait("rewrite the plan")
            return
        with call.outcome("rewrite the plan"):
            rebuilt = _layout(module, names_of)
            object.__setattr__(plan, "buckets_rebuilt", rebuilt)
            object.__setattr__(plan, "rebuilt_learn", False)
            used = _static_used_map(module) if plan.static_graph else None
            if used is not None and len(used) == len(plan.parameters):  # DDP's kept map: a resumed shadow needs it
                object.__setattr__(plan, "static_used_map", used)
            try:
                _save(plan, path)
            except OSError as e:
                raise TrainerError(f"cannot rewrite the plan at {path} with DDP's rebuilt buckets: "
                                   f"{e.strerror or e}") from None

    handle = ddp_model.register_forward_hook(after_forward)
    return plan


# Per process group, the DDP models with a plan that ran a synchronising forward on it,
# in the order they began, with their plans' paths. Two models trained by turns on one
# group interleave their bucket allreduces on one wire (gloo numbers them by one counter,
# NCCL runs them on the same rings), which no plan can tell apart: each replay would step
# every round of both, committing wrong checkpoints. One model trained after another
# (a second phase) is let be: the first's replay needs its plan's iterations to end it.
_SYNCING: dict[int, list[tuple[weakref.ref, Path]]] = {}


def _refuse_shared_group(ddp, path: Path):
    """A forward pre-hook: refuse a model's synchronising forward on a group where another
    model with a plan has trained since this one began."""
    def before_forward(module, inputs):
        if not (torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True)):
            return
        group = getattr(module, "process_group", None)
        models = _SYNCING.setdefault(id(group), [])
        models[:] = [(r, p) for r, p in models if r() is not None and getattr(r(), "process_group", None) is group]
        if models and models[-1][0]() is module:
            return
        if any(r() is module for r, _ in models):
            raise TrainerError(f"another DDP model (its plan: {models[-1][1]}) trains on the same process group "
                               "by turns with this one: their bucket allreduces interleave on the wire and no plan "
                               "can tell them apart; give each model a process group of its own (dist.new_group)")
        models.append((weakref.ref(module), path))
    ddp.register_forward_pre_hook(before_forward)


def _bucket_bytes(plan: Plan) -> set[int]:
    """The wire bytes of each gradient bucket's allreduce, in either of DDP's layouts."""
    return {b.count * b.dtype.itemsize for lay in {plan.buckets_first, plan.buckets_rebuilt}
            for b in plan.layout_buckets(lay, used_map=False)}


def _watch_rounds(ddp, optimizer, params: list[torch.Tensor], allreduces_per_step: int, scaler=None,
                  on_round=None):
    """Count the synchronising backward passes (DDP allreduces its buckets in each) between
    optimizer steps, and refuse a step after any other number than the plan's
    `allreduces_per_step`: an accumulation loop without no_sync() that did not say so (or
    said another K) puts K rounds on the wire per step, and the shadow would step each,
    committing wrong checkpoints that look good. DDP decides at the forward whether its
    backward synchronises (grad enabled and not under no_sync()); a forward with no
    backward after it (an evaluation under grad) is not counted. Every rank counts the
    same (DDP's rounds are collective), so every rank refuses at the same step. With a
    GradScaler the count ends at scaler.update(), which the AMP loop calls once a step
    whether the step ran or was skipped (inf: scaler.step() calls no optimizer.step())."""
    seen = {"pending": False, "rounds": 0}

    def before_forward(module, inputs):
        seen["pending"] = torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True)

    def after_accumulate(param):  # the first parameter of each backward claims the round
        if seen["pending"]:
            seen["pending"] = False
            seen["rounds"] += 1
            if on_round is not None:
                with contextlib.suppress(Exception):  # never fail the job's backward pass
                    on_round()

    def before_step(opt, args, kwargs):
        rounds, seen["rounds"] = seen["rounds"], 0
        if rounds and rounds != allreduces_per_step:
            raise TrainerError(f"this optimizer step follows {rounds} synchronising backward passes (DDP "
                               f"allreduces) and the plan says {allreduces_per_step} a step: pass write_plan "
                               f"allreduces_per_step={rounds}, or accumulate under model.no_sync() for all but "
                               "the last micro-batch; ckptd would step every round")

    ddp.register_forward_pre_hook(before_forward)
    for p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(after_accumulate)
    if scaler is None:
        optimizer.register_step_pre_hook(before_step)
        return
    update = scaler.update  # the instance's own: this scaler's steps only

    def counted_update(*args, **kwargs):
        before_step(optimizer, args, kwargs)
        return update(*args, **kwargs)
    scaler.update = counted_update


CHECKED_STEPS = 8  # the first steps: a loop that clips (or edits .grad) does so from its first step


def _check_grads_as_planned(optimizer, params: list[torch.Tensor], opt: Optimizer, scaler=None):
    """For the first CHECKED_STEPS optimizer steps: the gradients the step takes must be
    the reduced ones as the plan transforms them (the scaler's unscale_, the declared
    clipping), or every rank raises TrainerError at the step. ckptd steps the reduced
    gradients it sees on the wire through the plan's transforms; a loop that clips without
    saying so (or with another bound or norm than declared, or declares clipping it does not
    do) or edits .grad otherwise had the shadow step other gradients than the trainer:
    wrong checkpoints that look good.

    At the end of each backward pass, after DDP has written the reduced gradients, one norm
    of them is taken and carried through what the plan says comes next: unscale_ (x 1/scale),
    clip_grad_norm_ (x min(1, max_norm / (norm + 1e-6)), torch's own coefficient) or
    clip_grad_value_ (the norm of the clamped gradients, taken then). At the step the same
    norm of the gradients must match it. DDP writes the reduced gradients in a callback the
    autograd engine runs at the end of the backward pass, queued when the last bucket is
    ready; a callback queued from the first gradient's hook runs before it, so that one
    queues the callback that measures, which then runs after DDP's (the engine runs
    callbacks queued by callbacks, in order). Two norm passes a checked step; the
    gradients are the reduced ones, so every rank decides alike."""
    state = {"left": CHECKED_STEPS, "queued": False, "expected": None}
    norm_type = opt.grad_norm_type if opt.max_grad_norm is not None else 2.0
    engine = torch.autograd.Variable._execution_engine

    def grads():
        return [p.grad for p in params if p.grad is not None]

    def expected_norm() -> float | None:  # the reduced gradients, as the plan transforms them
        gs = grads()
        if not gs:
            return None
        inv = 1.0 / float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
        with torch.no_grad():
            if opt.clip_grad_value is not None:
                v = opt.clip_grad_value
                gs = [(g * inv if inv is not None else g).clamp(-v, v) for g in gs]
                return float(torch.nn.utils.get_total_norm(gs, norm_type))
            n = float(torch.nn.utils.get_total_norm(gs, norm_type)) * (1.0 if inv is None else inv)
        if opt.max_grad_norm is not None:
            n *= min(1.0, opt.max_grad_norm / (n + 1e-6))
        return n

    def measure():
        state["queued"] = False
        try:
            state["expected"] = expected_norm()
        except Exception:  # a check of ours must never fail the job's backward pass
            state["expected"] = None

    def after_accumulate(param):  # the first gradient of a backward pass
        if state["left"] > 0 and not state["queued"]:
            state["queued"] = True
            try:
                engine.queue_callback(lambda: engine.queue_callback(measure))
            except RuntimeError:  # an engine that takes no callbacks: no check, never a failed backward
                state["left"] = 0

    def before_step(optimizer, args, kwargs):
        expected, state["expected"] = state["expected"], None
        if state["left"] <= 0 or expected is None:
            return
        state["left"] -= 1
        if state["left"] == 0:  # the last checked step: no hook stays on the job's backward passes
            for h in handles:
                h.remove()
        gs = grads()
        with torch.no_grad():
            got = float(torch.nn.utils.get_total_norm(gs, norm_type)) if gs else 0.0
        if not (math.isfinite(got) and math.isfinite(expected)):
            return  # an overflow: the scaler skips the step, and the shadow with it
        # 2%: 16-bit gradients clipped or unscaled in their own dtype, each element rounded
        # by up to 2**-8 of itself; float32 ones round only in the norms (1e-7)
        tol = 2e-2 if any(g.element_size() < 4 for g in gs) else 1e-4
        if abs(got - expected) <= tol * max(expected, got) + 1e-30:
            return
        p = "inf" if norm_type == math.inf else f"{norm_type:g}"
        if opt.max_grad_norm is not None:
            said = (f"clip_grad_norm_(model.parameters(), {opt.max_grad_norm:g}"
                    + (")" if norm_type == 2.0 else f", norm_type={p})"))
        elif opt.clip_grad_value is not None:
            said = f"clip_grad_value_(model.parameters(), {opt.clip_grad_value:g})"
        else:
            said = "no clipping"
        raise TrainerError(
            f"the gradients at this optimizer step are not the reduced ones as the plan transforms them: "
            f"their {p}-norm is {got:.6g} where the plan's {said}"
            f"{' after scaler.unscale_' if scaler is not None else ''} leaves {expected:.6g}; the loop clips "
            "otherwise than write_plan was told (pass max_grad_norm=, grad_norm_type= or clip_grad_value= "
            "as the loop clips)"
            + ("" if scaler is not None else ", unscales them with a GradScaler write_plan was not given (scaler=)")
            + " or changes .grad itself, and ckptd would step other gradients than the trainer")

    handles = [prm.register_post_accumulate_grad_hook(after_accumulate) for prm in params if prm.requires_grad]
    handles.append(optimizer.register_step_pre_hook(before_step))


def _static_used_map(ddp) -> tuple[int, ...] | None:
    """static_graph, after iteration 0: per parameter, 1 where some rank used it. The
    reducer's host copy of the map is the reduced one where this rank left a parameter
    unused (finalize_bucket_dense copies it over then), else still this rank's own (all
    used here, so used somewhere): either way nonzero means used by some rank."""
    try:
        used = ddp.reducer._get_local_used_map()
    except (AttributeError, RuntimeError):
        return None
    return tuple(int(bool(x)) for x in used.tolist())


def _out_path(path, arg: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(os.fspath(path)).strip():
        raise TrainerError(f"{arg} must be a file path, not {path!r}")
    return Path(path)


def _save(plan: Plan, path: Path):
    doc = plan.to_json()
    doc["written_by"] = PLAN_VERSION_NOTE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


class _LossOf(torch.nn.Module):
    """A model whose .loss(batch) is its training step, as one forward DDP can wrap."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        return self.model.loss(batch)


# The DDP that ddp_layouts made last, kept until its next call. Dropping it at once can
# deadlock (torch 2.13): a gloo worker thread drops its finished allreduce last, and that
# needs the GIL (the work captured a Python object), while this thread holds the GIL in
# ~ProcessGroupGloo joining that worker. Seen once in a run of .ci/run, and in 2 of 4
# loops of 300-2000 calls under load (none in 3 loops of 1,000 since). By the next call
# the workers have long dropped everything.
_LAST_DDP: list = []


def ddp_layouts(model: torch.nn.Module, bucket_cap_mb: float, batch=None, limits_out: dict | None = None
                ) -> tuple[tuple[BucketLayout, ...], tuple[BucketLayout, ...] | None]:
    """DDP's own first and rebuilt bucket layouts for `model`, offline (`ckptd plan`):
    the model is wrapped in a real DistributedDataParallel on a one-rank gloo group in
    this process, and the layouts are read from its reducer. Bucketing does not depend
    on the world size. The rebuilt layout needs one forward and backward on `batch`
    (the order gradients become ready; the loss is model.loss(batch) if the model has
    one, else model(batch).sum()) and the next forward (where DDP rebuilds); None
    without a batch. `limits_out` (a dict) receives the bucket size limits that DDP
    used (the plan's buckets.limits)."""
    _refuse_sparse(model)
    _refuse_odd_buffers(model)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        has_loss = callable(getattr(model, "loss", None))
        ddp = torch.nn.parallel.DistributedDataParallel(_LossOf(model) if has_loss else model,
                                                        bucket_cap_mb=bucket_cap_mb,
                                                        find_unused_parameters=False)
        _LAST_DDP[:] = [ddp]  # the one before goes now (see _LAST_DDP)
        names_of = {id(p): n for n, p in unwrap(model)[0].named_parameters()}
        first = _layout(ddp, names_of)
        if limits_out is not None:
            limits_out.update(_ddp_limits(ddp) or {})
        rebuilt = None
        if batch is not None:
            out = ddp(batch)
            (out if has_loss else out.float().sum()).backward()
            ddp(batch)
            if not getattr(ddp, "_has_rebuilt_buckets", False):
                raise TrainerError("DDP did not rebuild its buckets after one backward")
            rebuilt = _layout(ddp, names_of)
            model.zero_grad(set_to_none=True)
        return first, rebuilt
    finally:
        if own:
            dist.destroy_process_group()
