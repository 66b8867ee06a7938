"""DDP's module buffers (BatchNorm running statistics, ...) from its broadcasts.

DDP (broadcast_buffers, the default) broadcasts rank 0's buffers at the start of every
forward that follows a synced backward, and at the first: torch's broadcast_coalesced
flattens each group of the plan's `buffers.broadcasts` into one tensor, one broadcast
each, in order. The payloads are those flat tensors, little-endian.

Which buffers a checkpoint of iteration k holds: BatchNorm updates its running
statistics in the forward, so after iteration k rank 0 holds the buffers of forward k
(of its last micro-batch with accumulation); they are first on the wire in the
broadcast at the start of forward k+1. A checkpoint of iteration k is therefore
committed once iteration k+1's forward has broadcast them; the last iteration of a job
(no later forward) is never committed with buffers (`buffers_not_seen`).
"""
from __future__ import annotations

import torch

from ckptd.core.plan import Plan


def unflatten_buffers(plan: Plan, payloads: list[bytes]) -> dict[str, torch.Tensor]:
    """Each buffer by name from the payloads of DDP's buffer broadcasts (their sizes
    checked by the caller against plan.buffer_broadcast_bytes())."""
    out = {}
    for names, raw in zip(plan.buffers.broadcasts, payloads):
        flat = torch.frombuffer(bytearray(raw), dtype=getattr(torch, plan.buffer(names[0]).dtype))
        at = 0
        for n in names:
            b = plan.buffer(n)
            out[n] = flat[at:at + b.numel].view(b.shape).clone()
            at += b.numel
    return out
