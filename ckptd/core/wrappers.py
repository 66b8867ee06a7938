"""Wrapped models and the names they give: DistributedDataParallel (and DataParallel) hold
the model as `.module`, torch.compile as `._orig_mod`, so a wrapper's named_parameters()
and state_dict() carry `module.`, `_orig_mod.` or both stacked (`module._orig_mod.`).

ckptd names every tensor as the plain model does (a plan, its checkpoints, exports):
what a user's `model.load_state_dict` takes and `model.named_parameters()` says. So
ckptd.torch reads names from the unwrapped module, ckptd.restore unwraps the model it is
given, and a trainer's file saved from a wrapper (`torch.save({"model":
ddp.state_dict(), ...})`) is read with the prefix its keys all carry taken off, as
torch.nn.modules.utils.consume_prefix_in_state_dict_if_present does for one prefix, but
only where every key carries it (torch's helper strips it from each key that has it).
"""
from __future__ import annotations

import sys

import torch

from ckptd.core.checkpoint import CheckpointError
from ckptd.errors import show

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's and DataParallel's; torch.compile's


def unwrap(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the module a stack of wrappers holds, the prefix the outermost wrapper's names
    carry): DDP(torch.compile(m)) is (m, "module._orig_mod."), m itself (m, "")."""
    prefix = ""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model, prefix = model.module, prefix + "module."
        elif _is_compiled(model):
            model, prefix = model._orig_mod, prefix + "_orig_mod."
        else:
            return model, prefix


def _is_compiled(model) -> bool:
    # torch.compile's OptimizedModule; no model is one before torch.compile imported its
    # module, and importing torch._dynamo here would cost seconds for nothing
    frames = sys.modules.get("torch._dynamo.eval_frame")
    return frames is not None and isinstance(model, frames.OptimizedModule)


def _carried(keys: list[str]) -> list[str]:
    """The wrapper prefixes every key carries, outermost first."""
    out = []
    while keys:
        w = next((w for w in WRAPPER_PREFIXES if all(k.startswith(w) for k in keys)), None)
        if w is None:
            return out
        out.append(w)
        keys = [k[len(w):] for k in keys]
    return out


def wrapper_prefix(keys, names: list[str] | None, where, what: str = "model keys") -> str:
    """The wrapper prefix to take off `keys` (a trainer's state_dict keys, or its
    optimizer's parameter names) so they are the names `names` are in (the plan's, the
    model's; None: not known): the prefixes every key carries, less those every one of
    `names` carries too (a plain model whose only child is called `module` keeps it).
    Never decided per key: keys of which some carry a wrapper's prefix and others not are
    refused (CheckpointError naming `where`), unless `names` show a child module of that
    name (some of them start with it)."""
    keys = list(keys)
    if not all(isinstance(k, str) for k in keys):
        return ""  # not names at all: check_checkpoint says which
    carried = _carried(keys)
    own = _carried(list(names)) if names else []
    prefix = "".join(carried[:max(0, len(carried) - len(own))])
    rest = [k[len(prefix):] for k in keys]
    for w in WRAPPER_PREFIXES:
        some = [k for k in rest if k.startswith(w)]
        if some and len(some) < len(rest) and not any(n.startswith(w) for n in names or ()):
            other = next(k for k in rest if not k.startswith(w))
            raise CheckpointError(
                f"{where}: {what} mix a wrapper's prefix: {len(some)} of {len(rest)} start with {w!r} "
                f"({show(prefix + some[0])}), {show(prefix + other)} does not; save the unwrapped "
                f"model's state_dict (ddp.module, torch.compile's _orig_mod), or strip it from every key")
    return prefix
