"""Assemble: per-iteration gradient buffers, filled from any number of mirror streams.

Every allgather packet that survives checking is copied into its iteration's bucket
buffers, and the elements it covers are marked in that stream's coverage map. Two
intact copies of one element must agree bit for bit; if they do not, the iteration is
poisoned (something is wrong with the plan or the capture) and is never committed.
An iteration is complete when the union of all streams covers every element.

Coverage maps are bitmaps, one bit per element (element k is bit k % 8 of byte k // 8):
at 330M parameters a byte per element per map would cost more than the gradient buffer.
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass, field

import numpy as np

from ckptd.core.schedule import Bucket

# Mirror copies of one packet reach the capture host at different times (another switch
# port, another queue): 9-11 ms apart were seen. An iteration commits only once every
# stream's capture clock has passed this much beyond the moment it became complete, so
# those copies are compared first (docs/ARCHITECTURE.md "Copies must agree").
AGREE_WINDOW_MS = 50.0

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bitmap(n: int) -> np.ndarray:
    """A clear coverage bitmap for n elements."""
    return np.zeros((n + 7) // 8, np.uint8)


def bits_get(bm: np.ndarray, start: int, end: int) -> np.ndarray:
    """Elements [start, end) of a bitmap, as bools."""
    lo = start >> 3
    return np.unpackbits(bm[lo:(end + 7) >> 3], bitorder="little")[start - 8 * lo:end - 8 * lo].view(bool)


def bits_set(bm: np.ndarray, start: int, end: int):
    """Mark elements [start, end) covered."""
    lo, hi = start >> 3, (end + 7) >> 3
    bits = np.unpackbits(bm[lo:hi], bitorder="little")
    bits[start - 8 * lo:end - 8 * lo] = 1
    bm[lo:hi] = np.packbits(bits, bitorder="little")


def bits_count(bm: np.ndarray) -> int:
    """Set bits, 64 at a time (5x faster than byte by byte at 25 MB buckets)."""
    whole = len(bm) // 8 * 8
    return int(np.bitwise_count(bm[:whole].view(np.uint64)).sum()) + int(np.bitwise_count(bm[whole:]).sum())


def ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of True in a boolean array."""
    if not mask.any():
        return []
    d = np.diff(np.concatenate(([0], mask.view(np.int8), [0])))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


@dataclass
class Missing:
    bucket: int
    start: int
    end: int
    params: list[tuple[str, int, int]]  # (name, first element, end) within each parameter


@dataclass
class IterationAssembly:
    iteration: int
    buckets: list[Bucket]
    nstreams: int
    data: list[np.ndarray] = field(init=False)  # raw bit patterns, so compares are exact
    covered: list[np.ndarray] = field(init=False)
    by_stream: list[list[np.ndarray]] = field(init=False)
    conflicts: list[tuple[int, int, int, int]] = field(default_factory=list)  # (stream, bucket, start, end)
    packets: int = 0
    bytes: int = 0
    ncovered: int = 0  # elements covered so far, kept as packets land: completeness is O(1)
    last_packet: float = 0.0  # monotonic time of the newest placement (commit lag)
    # (data, covered, by_stream) lent by someone else (the fast path's kernel), zeroed
    # and shaped as these would be; None: allocated here
    buffers: InitVar[tuple | None] = None

    def __post_init__(self, buffers):
        self.total = sum(b.count for b in self.buckets)
        self.bucket_covered = [0] * len(self.buckets)
        if buffers is not None:
            self.data, self.covered, self.by_stream = buffers
            return
        self.data = [np.zeros(b.count, _BITS[b.dtype.itemsize]) for b in self.buckets]
        self.covered = [bitmap(b.count) for b in self.buckets]
        self.by_stream = [[bitmap(b.count) for b in self.buckets] for _ in range(self.nstreams)]

    def place(self, stream: int, bucket: int, start: int, raw: bytes | memoryview):
        """Copy raw little-endian element bytes to bucket[start:...]."""
        vals = np.frombuffer(raw, self.data[bucket].dtype.newbyteorder("<"))
        end = start + len(vals)
        if end > len(self.data[bucket]):
            raise IndexError(f"bucket {bucket}: elements [{start}, {end}) past its end")
        cov = bits_get(self.covered[bucket], start, end)
        dst = self.data[bucket][start:end]
        if cov.any() and not np.array_equal(dst[cov], vals[cov]):
            self.conflicts.append((stream, bucket, start, end))
            return
        dst[:] = vals
        new = len(cov) - int(np.count_nonzero(cov))
        self.ncovered += new
        self.bucket_covered[bucket] += new
        bits_set(self.covered[bucket], start, end)
        bits_set(self.by_stream[stream][bucket], start, end)
        self.packets += 1
        self.bytes += len(raw)

    @property
    def complete(self) -> bool:
        return not self.conflicts and self.ncovered == self.total

    def bucket_complete(self, b: int) -> bool:
        return not self.conflicts and self.bucket_covered[b] == self.buckets[b].count

    def coverage(self, stream: int | None = None) -> float:
        total = sum(b.count for b in self.buckets)
        maps = self.covered if stream is None else self.by_stream[stream]
        return (sum(bits_count(m) for m in maps) / total) if total else 1.0

    def streams_covering(self, bucket: int, start: int, end: int) -> list[int]:
        """The streams that placed any of the elements [start, end) of a bucket."""
        return [s for s, maps in enumerate(self.by_stream) if bits_get(maps[bucket], start, end).any()]

    def missing(self, param_ranges) -> list[Missing]:
        """Exact element ranges no stream delivered, with the parameters they fall in."""
        out = []
        for b in range(len(self.buckets)):
            for s, e in ranges(~self.covered_elements(b)):
                hit = [(n, max(s, ps) - ps, min(e, pe) - ps) for n, ps, pe in param_ranges(b)
                       if ps < e and s < pe]
                out.append(Missing(b, s, e, hit))
        return out

    def covered_elements(self, b: int) -> np.ndarray:
        """Bucket b's coverage as one bool per element."""
        return bits_get(self.covered[b], 0, self.buckets[b].count)

    def gradients(self) -> list[np.ndarray]:
        """The reduced buckets, as their element type."""
        return [self.gradient(b) for b in range(len(self.buckets))]

    def gradient(self, b: int) -> np.ndarray:
        return self.data[b].view(self.buckets[b].dtype)
