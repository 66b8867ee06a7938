"""Whether a state holds NaN or inf: a job that diverged.

A job whose loss blows up steps NaN or inf into its weights and, unless it checks,
trains on: every later state is NaN too, and the shadow reproduces it bit for bit (it is
the trainer's state, so it is committed). What an operator then needs is the newest
checkpoint from before the divergence. So the shadow says from which iteration on its
parameters are not finite, a replay and the daemon report it, and retention
(ckptd.core.keep) never prunes the newest finite checkpoint it wrote: with the default
keep_last of 10, ten diverged iterations would otherwise have pruned every good one.

A step never makes a non-finite parameter finite again (NaN and inf stay NaN or inf
through every torch.optim update), so the shadow checks each parameter after a step only
until the first one is found.
"""
from __future__ import annotations

import math

import numpy as np
import torch

# summed in float32: a float16 sum of finite values overflows to inf all the time
_WIDER_NP = {torch.float16: np.float32}


def is_finite(t: torch.Tensor) -> bool:
    """No element is NaN or inf. A sum propagates both (NaN + x is NaN, inf + x is inf or
    NaN) and reads the tensor once at memory speed, where torch.isfinite(t).all() (a
    bool per element, then a reduction) takes 10x as long, more than an AdamW step of the
    same parameters (benchmarks/RESULTS.md, session 27). numpy's sum, not torch's: it
    runs on the calling thread only, where torch's would wake its OpenMP pool, whose
    threads then spin on the other cores (twice the check's own CPU in a replay). Only
    when the sum is not finite, which finite values can also make (1e38 + 1e38), is each
    element looked at."""
    t = t.detach()  # a trainer's parameter: no autograd node for the sum
    if t.is_complex():
        t = torch.view_as_real(t)  # each part a float
    if not t.is_floating_point():
        return True
    if t.numel() == 0:
        return True
    if t.dtype == torch.bfloat16 or t.device.type != "cpu":  # numpy has no bfloat16, nor a GPU's memory
        total = float(t.sum(dtype=torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None))
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # both are the answer, not a fault
            total = float(np.add.reduce(t.reshape(-1).numpy(), dtype=_WIDER_NP.get(t.dtype)))
    if math.isfinite(total):
        return True
    return bool(torch.isfinite(t).all())


def first_nonfinite(named) -> str | None:
    """The name of the first tensor of (name, tensor) pairs holding NaN or inf; None if
    every one is finite."""
    for name, t in named:
        if not is_finite(t):
            return name
    return None


def nonfinite_in(ckpt: dict) -> str | None:
    """The first model entry of a checkpoint holding NaN or inf; None if all are finite."""
    return first_nonfinite((ckpt.get("model") or {}).items())


def diverged_state(where, name: str, iteration) -> str:
    """The words for a checkpoint whose model holds NaN or inf: restore's and export's
    warning, restore(finite=True)'s refusal and the lines of what it passed over."""
    return f"{where}: {name} holds NaN or inf (iteration {iteration}: the job had diverged by then)"



def refused_state(where, name: str, iteration) -> str:
    """restore(finite=True)'s refusal of a source that gives that one state only (a file,
    the daemon's latest)."""
    return (f"{diverged_state(where, name, iteration)}; with finite=True only a finite state is restored: "
            "a checkpoint directory gives its newest finite one")
