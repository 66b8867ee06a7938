"""Huge pages for the capture workers' shared-memory slots: does the worker's copy get
cheaper, and does start-up fault less?

    flock /tmp/bench.lock python -m benchmarks.hugepages [--passes 200] [--rounds 3]
        [--block-kib 1024] [--frame-bytes 3000] [--slot-kib 4096]

A ring-sized buffer (64 MiB, ordinary pages, standing in for the TPACKET ring mapping)
is cut into blocks of --block-kib holding --frame-bytes frames; ckptd.live.workers'
own copy (_copy_blocks) moves one slot's worth of consecutive blocks into the next slot
of a SharedArea, slot after slot, as a worker does. Per kind of page backing the area
(ckptd.live.hugemem: hugetlb when vm.nr_hugepages has room, thp when shmem_enabled
honours MADV_HUGEPAGE, and 4k), alternating in each round:
- start-up: minor page faults and seconds of the first pass over all slots (a fresh area);
- steady state: CPU-seconds per million frames over --passes passes over all slots;
- ShmemHugePages (/proc/meminfo) while the area is mapped: whether THP took.
Kinds the machine cannot give are skipped and said so.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np

from benchmarks.machine import machine
from ckptd.live.ring import TURN_BYTES

RING = 64 << 20


def ring_batch(block: int, frame: int, blocks: int):
    """Consecutive ring blocks full of frames, as a Batch over a ring-sized buffer."""
    from ckptd.fast.batches import Batch
    per = (block - 64) // (frame + 80)  # tpacket3_hdr + sockaddr_ll before each frame, as the kernel packs
    offs = np.array([b * block + 64 + k * (frame + 80) + 80 for b in range(blocks) for k in range(per)], np.int64)
    n = len(offs)
    buf = np.random.default_rng(1).integers(0, 255, RING, np.uint8)
    ones = np.ones(n, np.int64)
    return Batch(buf, offs, ones * frame, ones * frame, np.zeros(n, np.int32), np.ones(n, np.int32),
                 np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64))


def area_for(pages: str, block: int, slot: int):
    """A fresh SharedArea of a worker's size backed by `pages`, or None where the machine has none."""
    from ckptd.live import hugemem
    from ckptd.live.workers import SLOTS, _layout
    mode = "off" if pages == "4k" else "on"
    hugetlb = hugemem._hugetlb_fd
    if pages == "thp":  # past a reserved hugetlb pool, which `on` would take first
        hugemem._hugetlb_fd = _no_pool
    try:
        a = hugemem.SharedArea(SLOTS * _layout(block, slot)[2] + SLOTS, mode)
    except OSError:
        return None
    finally:
        hugemem._hugetlb_fd = hugetlb
    if a.pages != pages:
        a.close()
        return None
    return a


def _no_pool(nbytes):
    raise OSError("hugetlb pool bypassed")


def shmem_huge_kib() -> int:
    """ShmemHugePages of /proc/meminfo: shared memory in transparent huge pages now."""
    return next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("ShmemHugePages:"))


def one(pages: str, batch, block: int, slot: int, passes: int):
    from ckptd.live.workers import SLOTS, _copy_blocks, _slot_views, slot_blocks
    a = area_for(pages, block, slot)
    if a is None:
        return None
    views = [_slot_views(a, s, block, slot) for s in range(SLOTS)]
    nblk = slot_blocks(block, slot)
    cuts = np.flatnonzero(np.diff(batch.offsets // block)) + 1
    starts = np.concatenate(([0], cuts))[::nblk].tolist() + [len(batch)]
    pieces = [_slice(batch, lo, hi) for lo, hi in zip(starts, starts[1:])]  # one slot's worth each
    ring_blocks = RING // block

    def sweep():
        n = 0
        for k, p in enumerate(pieces):
            n += _copy_blocks(p, block, ring_blocks, *views[k % SLOTS][:2])  # data, meta
        return n
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(-(-SLOTS // len(pieces))):
        sweep()
    first = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, time.perf_counter() - t0)
    thp_kib = shmem_huge_kib()
    c0, frames = time.process_time(), 0
    for _ in range(passes):
        frames += sweep()
    cpu = time.process_time() - c0
    views = None  # its arrays hold the area's buffer: let go before closing
    a.close()
    return first, cpu / frames * 1e6, thp_kib


def _slice(b, lo, hi):
    from ckptd.fast.batches import Batch
    return Batch(b.buf, b.offsets[lo:hi], b.caplen[lo:hi], b.origlen[lo:hi], b.stream[lo:hi], b.linktype[lo:hi],
                 b.frame_no[lo:hi], b.ts[lo:hi])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hugepages", description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--frame-bytes", type=int, default=3000)
    ap.add_argument("--slot-kib", type=int, default=TURN_BYTES >> 10,
                    help="a slot's bytes: the daemon's is the plan's turn (ckptd.live.ring.turn_bytes), at most this")
    a = ap.parse_args(argv)
    from ckptd.live.hugemem import thp_policy
    from ckptd.live.workers import SLOTS, slot_blocks
    block, slot = a.block_kib << 10, a.slot_kib << 10
    batch = ring_batch(block, a.frame_bytes, SLOTS * slot_blocks(block, slot))
    print(machine())
    hp = {k: v for k, v in (line.split(":") for line in open("/proc/meminfo") if line.startswith("HugePages_"))}
    print(f"{len(batch)} frames of {a.frame_bytes} bytes in {SLOTS * slot_blocks(block, slot)} blocks of {a.block_kib} KiB; "
          f"shmem THP: {thp_policy()}; HugePages_Free: {hp['HugePages_Free'].strip()}")
    print("| pages | round | start-up minor faults | start-up ms | CPU-s per M frames (copy) | ShmemHugePages KiB | load |")
    print("|---|---|---|---|---|---|---|")
    kinds = ["4k", "hugetlb", "thp"]
    for r in range(a.rounds):
        for pages in (kinds if r % 2 == 0 else kinds[::-1]):
            got = one(pages, batch, block, slot, a.passes)
            load = open("/proc/loadavg").read().split()[0]
            if got is None:
                print(f"| {pages} | {r} | (none on this machine) | | | | {load} |")
                continue
            (faults, secs), per_m, thp_kib = got
            print(f"| {pages} | {r} | {faults} | {secs * 1e3:.1f} | {per_m:.3f} | {thp_kib} | {load} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
