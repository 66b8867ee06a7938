"""NCCL's ring allreduce, done in numpy in NCCL's summation order.

Chunk c is first sent by the rank at ring index c+1 (its own value), each next rank
adds its value to what it received, and the rank at index c adds last and sends the
final value on (src/device/all_reduce.h runRing). Floating-point addition is not
associative, so this order is what makes the synthesized gradients bit-identical to
what a real ring would produce.
"""
from __future__ import annotations

import numpy as np
import torch

from ckptd.core.schedule import RS, AllGather, Broadcast, RingSchedule


def _add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One ring hop's sum. uint16 buckets are bfloat16 words (a bf16 compression hook;
    numpy has no bfloat16): added as bfloat16, as the reduction kernel does."""
    if a.dtype != np.uint16:
        return a + b
    s = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) + \
        torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)
    return s.view(torch.int16).numpy().view(np.uint16)


def reduce_iteration(sched: RingSchedule, local: list[list[np.ndarray]], others=None):
    """local[rank][bucket] -> (final buckets, payload of every send per connection).

    payloads[(src, dst, channel)][i] is the data (numpy array) of that connection's
    i-th send: a partial sum in reduce-scatter, a final value in allgather.
    others[rank][k]: each rank's values for the schedule's other allreduces
    (RingSchedule.others), reduced the same way, or for a Broadcast forwarded unchanged
    from its root (device/broadcast.h:30-44@v2.22.3-1), or for an AllGather each rank's
    block forwarded unchanged (device/all_gather.h:12-53@v2.22.3-1); their final values are
    not returned."""
    cfg = sched.cfg

    def values(rank: int, bucket: int) -> np.ndarray:
        return local[rank][bucket] if bucket >= 0 else others[rank][-1 - bucket]
    n = cfg.nranks
    final = [np.empty(b.count, b.dtype) for b in sched.buckets]
    covered = [np.zeros(b.count, bool) for b in sched.buckets]
    payloads: dict[tuple[int, int, int], list[np.ndarray]] = {}
    memo: dict[tuple, dict[int, np.ndarray]] = {}
    for conn, sends in sched.sends.items():
        src, _, ch = conn
        me = cfg.ring_index(ch, src)
        out = payloads[conn] = []
        for s in sends:
            if s.nelem == 0:
                out.append(np.empty(0, sched.bucket_of(s).dtype))
                continue
            if s.bucket < 0 and isinstance(bc := sched.bucket_of(s), Broadcast):
                out.append(values(bc.root, s.bucket)[s.offset:s.offset + s.nelem])
                continue
            if s.bucket < 0 and isinstance(ag := sched.bucket_of(s), AllGather):
                owner, at = divmod(s.offset, ag.count)
                out.append(values(owner, s.bucket)[at:at + s.nelem])
                continue
            key = (s.bucket, ch, s.offset, s.nelem, s.chunk)
            partial = memo.get(key)
            if partial is None:
                sl = slice(s.offset, s.offset + s.nelem)
                first = (s.chunk + 1) % n
                acc = values(cfg.rank_at(ch, first), s.bucket)[sl].copy()
                partial = {first: acc}
                for k in range(2, n + 1):
                    idx = (s.chunk + k) % n
                    acc = _add(acc, values(cfg.rank_at(ch, idx), s.bucket)[sl])
                    partial[idx] = acc
                memo[key] = partial
            if s.phase == RS:
                out.append(partial[me])
            else:
                value = partial[s.chunk]  # the chunk's owner added last: the final sum
                out.append(value)
                if s.bucket < 0:
                    continue
                final[s.bucket][s.offset:s.offset + s.nelem] = value
                covered[s.bucket][s.offset:s.offset + s.nelem] = True
    for b, cov in enumerate(covered):
        if not cov.all():
            raise AssertionError(f"schedule leaves bucket {b} elements unreduced")
    return final, payloads
