"""DDP's bucketing rule (torch/csrc/distributed/c10d/reducer.cpp,
compute_bucket_assignment_by_size), to check a plan's layouts against the limits DDP
was built with (the plan's `buckets.limits`, docs/PLAN.md).

Parameters are taken in order; each goes to the open bucket of its dtype (one device
here); a bucket is closed as soon as its bytes reach its limit -- per dtype the first
limit of the list, then the next, the last one repeating -- and the buckets still open
at the end follow. Without a ready order (the first layout: registration order) the
buckets are sorted by their smallest parameter index, and DDP allreduces them reversed;
the rebuilt layout is computed the same way on the gradient-ready order, unsorted.
"""
from __future__ import annotations

from collections.abc import Sequence


def assign(sizes: Sequence[int], dtypes: Sequence[str], limits: Sequence[int],
           indices: Sequence[int] | None = None) -> list[list[int]]:
    """compute_bucket_assignment_by_size: bucket -> parameter indices. `sizes` in bytes;
    `indices` (the ready order's parameter indices) as torch's tensor_indices."""
    result: list[list[int]] = []
    open_: dict[str, list[int]] = {}
    filled: dict[str, int] = {}
    step: dict[str, int] = {}
    for i, (size, dt) in enumerate(zip(sizes, dtypes)):
        idx = indices[i] if indices else i
        open_.setdefault(dt, []).append(idx)
        filled[dt] = filled.get(dt, 0) + size
        k = step.setdefault(dt, 0)
        if filled[dt] >= limits[k]:
            result.append(open_.pop(dt))
            filled[dt] = 0
            step[dt] = min(k + 1, len(limits) - 1)
    result.extend(b for b in open_.values() if b)
    if not indices:
        result.sort(key=min)
    return result


def first_layout(sizes: Sequence[int], dtypes: Sequence[str], limits: Sequence[int]) -> list[list[int]]:
    """The first iteration's buckets in allreduce order (DDP reverses the assignment)."""
    return list(reversed(assign(sizes, dtypes, limits)))


def rebuilt_problem(layout: Sequence[Sequence[int]], sizes: Sequence[int], dtypes: Sequence[str],
                    limits: Sequence[int]) -> tuple[int, str] | None:
    """None if some gradient-ready order makes DDP rebuild exactly `layout` (buckets of
    parameter indices, in allreduce order) with these limits; else (bucket index, why).
    Each dtype's buckets take the limits in turn; a bucket that reached its limit was
    closed by its last parameter (before it, below the limit) and is allreduced in the
    order of closing; a bucket below its limit is one still open at the end: at most
    one per dtype, its dtype's last, after every closed bucket."""
    last: dict[str, int] = {}  # each dtype's last bucket
    for i, b in enumerate(layout):
        if not b:
            return i, "is empty"
        dts = {dtypes[p] for p in b}
        if len(dts) != 1:
            return i, f"mixes dtypes {sorted(dts)}"
        last[dts.pop()] = i
    seen: dict[str, int] = {}
    open_seen = False
    for i, b in enumerate(layout):
        dt = dtypes[b[0]]
        k = seen.get(dt, 0)
        limit = limits[min(k, len(limits) - 1)]
        seen[dt] = k + 1
        total = sum(sizes[p] for p in b)
        before = total - sizes[b[-1]]
        if before >= limit:
            return i, (f"is split too late: {before} bytes before its last parameter already reach "
                       f"the limit {limit}")
        if total < limit and last[dt] != i:
            return i, f"is split too early: {total} bytes, below the limit {limit}, and not its dtype's last bucket"
        if total >= limit and open_seen:
            return i, f"closes (reaching the limit {limit}) after a bucket left open below its limit"
        open_seen = open_seen or total < limit
    return None
