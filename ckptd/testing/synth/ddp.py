"""DDP's gradient bucketing, the way torch.nn.parallel.DistributedDataParallel does it.

The first iteration uses buckets assigned over the parameters in reverse registration
order (DDP._ddp_init_helper: a small first bucket, then bucket_cap_mb), reversed so
the last layers reduce first. After the first backward, Reducer::rebuild_buckets
reassigns them in the order gradients became ready. Both layouts go into the plan.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed.constants._DEFAULT_FIRST_BUCKET_BYTES


def first_buckets(params: list[torch.Tensor], cap_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES):
    """Bucket index lists for iteration 0, in allreduce order."""
    idx, _ = dist._compute_bucket_assignment_by_size(params, [min(first_bytes, cap_bytes), cap_bytes])
    return list(reversed(idx))


def grad_ready_order(model: torch.nn.Module, batch: torch.Tensor) -> list[int]:
    """Indices into the trainable parameters (the reducer's: requires_grad) in the order
    their gradients are accumulated by one backward. A frozen one gets no gradient."""
    params = [p for p in model.parameters() if p.requires_grad]
    order: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
             for i, p in enumerate(params)]
    try:
        model.zero_grad(set_to_none=True)
        model.loss(batch).backward()
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
    return order


def rebuilt_buckets(params: list[torch.Tensor], order: list[int], cap_bytes: int,
                    first_bytes: int = FIRST_BUCKET_BYTES):
    """Bucket index lists from iteration 1 on (Reducer::rebuild_buckets)."""
    idx, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], [min(first_bytes, cap_bytes), cap_bytes],
        tensor_indices=order)
    return idx
