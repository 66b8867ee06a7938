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

import torch

# summed in float32: a float16 sum of finite values overflows to inf all the time
_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def is_finite(t: torch.Tensor) -> bool:
    """No element is NaN or inf. A sum propagates both (NaN + x is NaN, inf + x is inf or
    NaN) and reads the tensor once at memory speed: 0.47 ms per million float32 values
    on one core here, where torch.isfinite(t).all() (a bool per element, then a
    reduction) takes 10x as long, more than an AdamW step of the same parameters
    (benchmarks/RESULTS.md, session 27). Only when the sum is not finite, which finite
    values can also make (1e38 + 1e38), is each element looked at."""
    if not t.is_floating_point() and not t.is_complex():
        return True
    if t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum(dtype=_WIDER.get(t.dtype)))):
        return True
    return bool(torch.isfinite(t).all())


def first_nonfinite(named) -> str | None:
    """The name of the first tensor of (name, tensor) pairs holding NaN or inf; None if
    every one is finite."""
    for name, t in named:
        if not is_finite(t):
            return name
    return None
