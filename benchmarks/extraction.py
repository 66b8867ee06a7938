"""Extraction throughput of the fast path, side by side with a memcpy and with the dpkt-
and scapy-based extractors a user would otherwise write.

    python -m benchmarks.extraction [--reps 7] [--scapy-frames 1500] [--configs simple-4096,...]
    python -m benchmarks.extraction --replay [--reps 5]     # end-to-end `ckptd replay` only

For Simple, LL and LL128, path MTU 1024 and 4096, one and three mirror streams, from memory
(the captures are read and indexed first, not timed), pinned to one core:

    memcpy        numpy copy of the capture buffer (the in-memory pcap bytes), in one call
                  and in 64 MiB calls: glibc switches to non-temporal stores above 192 MiB
                  (x86_non_temporal_threshold), which doubles a single large copy here
    kernel        time inside cython_ext.batch.BatchKernel.run: decode, ICRC, flow lookup,
                  PSN -> schedule, checks, LL flags, copy into the iteration buffers,
                  coverage; the GIL is released
    end-to-end    ckptd.fast.pipeline.FastPipeline.run_batch + finish without a shadow model:
                  the kernel plus every frame handed to the reference path (flow binding
                  warm-up, new iterations, bucket completion) and the reference's
                  per-iteration finalize (coverage, loss, missing ranges, reports);
                  steady: the same from the first completed bucket on (flow binding,
                  which goes through the reference packet by packet, is done by then)
    dpkt, scapy   benchmarks/minimal_extractors.py on the same pcap bytes (scapy on the
                  first --scapy-frames frames of each file)

--replay: what `ckptd replay` does by default (ckptd.fast.pipeline.fast_replay: files
read in chunks on the reader thread, kernel, shadow model with the optimizer step,
reports; no checkpoint files written) on benchmarks.captures.replay_scenario (8 ranks,
3 streams, 4 iterations, ~446 MB), timed from the call to its return (the pipeline's
construction included, the plan and the starting state loaded before), side by side
with a memcpy of the same bytes; not pinned (the reader thread has a core of its own
where the machine has one).

each with the ICRC checked by the folding CRC (VPCLMULQDQ) and with the NIC trusted
(ICRC off). GB/s counts captured frame bytes. Every variant runs --reps times,
interleaved with the memcpy, and the best time counts: on a shared machine the best run
is the one least disturbed. The inputs (benchmarks/captures.py) are synthesized on the
first run.
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import time
from pathlib import Path

import numpy as np

from benchmarks.captures import CONFIGS, capture, erspan_mirrors, mirrors, replay_scenario
from benchmarks.minimal_extractors import extract_dpkt, extract_scapy
from ckptd.fast.batches import load_captures
from ckptd.core.checkpoint import load_checkpoint
from ckptd.fast.icrc import crc_choices, isal_crc_address
from ckptd.fast.pipeline import FastPipeline, fast_replay
from ckptd.pipeline import ReplayOptions
from ckptd.core.plan import load_plan
from cython_ext import batch as kernel
from benchmarks.machine import machine


def pin_one_core():
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[-1]})
    return cpus[-1]


def crc_table(reps: int) -> list[str]:
    """CRC-32 implementations on frame-sized calls (64 MiB of random bytes)."""
    buf = np.frombuffer(np.random.default_rng(0).bytes(64 << 20), np.uint8)
    ext = isal_crc_address()
    impls = [("zlib", 0)] + [(n, kernel.CRC_IMPLS.index(n)) for n in ("clmul", "vclmul") if n in crc_choices()]
    if ext:
        impls.append(("isal", kernel.CRC_IMPLS.index("external")))
    rows = ["| CRC-32, GB/s, one core | " + " | ".join(n for n, _ in impls) + " |",
            "|---|" + "---|" * len(impls)]
    for size in (1024, 4096):
        offs = np.arange(0, len(buf) - size + 1, size, dtype=np.int64)
        lens = np.full(len(offs), size, np.int64)
        cells = []
        for _, impl in impls:
            best = min(_timed(lambda: kernel.crc32_frames(buf, offs, lens, impl, ext or 0)) for _ in range(reps))
            cells.append(f"{len(offs) * size / best / 1e9:.1f}")
        rows.append(f"| {size} B calls | " + " | ".join(cells) + " |")
    return rows


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _timed_pipeline(plan, nstreams, trust: bool, crc: str) -> FastPipeline:
    """A FastPipeline noting when the first bucket completed (or iteration finalized),
    and how many frames had been seen by then: the end of the warm-up."""
    pipe = FastPipeline(plan, None, nstreams, ReplayOptions(), trust_icrc=trust, crc=crc)
    pipe.first_final = None
    inner = pipe.pipeline
    after_placement, finalize = inner.after_placement, inner._finalize

    def mark():
        if pipe.first_final is None:
            pipe.first_final = (time.perf_counter(), sum(c["frames"] for c in inner.classes))

    def marked(fn):
        def call(arg):
            mark()
            return fn(arg)
        return call
    inner.after_placement, inner._finalize = marked(after_placement), marked(finalize)
    return pipe


def run_fast(plan, batch, nstreams, trust: bool, crc: str = "auto"):
    """(end-to-end seconds, kernel seconds, steady-state bytes/s, pipeline)"""
    pipe = _timed_pipeline(plan, nstreams, trust, crc)
    t = time.perf_counter()
    pipe.run_batch(batch)
    pipe.finish()
    end = time.perf_counter()
    t0, frames0 = pipe.first_final
    steady = int(batch.caplen[frames0:].sum()) / (end - t0)
    return end - t, pipe.kernel_seconds, steady, pipe


def bench_config(protocol: str, mtu: int, nstreams: int, reps: int, scapy_frames: int) -> dict:
    d = capture(protocol, mtu)
    plan = load_plan(d / "plan.json")
    paths = mirrors(d)[:nstreams]
    batch, errors = load_captures(paths)
    assert not errors, errors
    nbytes, nframes = batch.nbytes, len(batch)
    dst = np.empty_like(batch.buf)
    np.copyto(dst, batch.buf)  # fault the destination in
    chunk = 64 << 20

    def chunked():
        for lo in range(0, len(batch.buf), chunk):
            np.copyto(dst[lo:lo + chunk], batch.buf[lo:lo + chunk])

    times: dict[str, list[float]] = {}
    steady: dict[str, float] = {}
    pipe = None
    for _ in range(reps):
        times.setdefault("memcpy", []).append(_timed(lambda: np.copyto(dst, batch.buf)))
        times.setdefault("memcpy64", []).append(_timed(chunked))
        for key, trust, crc in (("icrc", False, "auto"), ("trust", True, "auto"), ("zlib", False, "zlib")):
            e2e, kern, rate, pipe = run_fast(plan, batch, nstreams, trust, crc)
            times.setdefault(f"e2e-{key}", []).append(e2e)
            times.setdefault(f"kernel-{key}", []).append(kern)
            steady[key] = max(steady.get(key, 0.0), rate)
    best = {k: min(v) for k, v in times.items()}
    out = dict(config=f"{protocol} {mtu}", streams=nstreams, frames=nframes, mb=nbytes / 1e6,
               memcpy=batch.buf.nbytes / best.pop("memcpy"), memcpy64=batch.buf.nbytes / best.pop("memcpy64"),
               stops=dict(pipe.stops), statuses=[r.status for r in pipe.reports],
               **{f"steady-{k}": v for k, v in steady.items()})
    for k, t in best.items():
        out[k] = nbytes / t
    # the user's alternatives, on the same files (not interleaved: they take seconds)
    dpkt_t, dpkt_frames = 0.0, 0
    scapy_t, scapy_frames_done, scapy_bytes = 0.0, 0, 0
    for p in paths:
        data = Path(p).read_bytes()
        t = time.perf_counter()
        _, counts = extract_dpkt(data, protocol == "ll")
        dpkt_t += time.perf_counter() - t
        dpkt_frames += counts["frames"]
        if scapy_frames:
            t = time.perf_counter()
            _, counts = extract_scapy(data, protocol == "ll", scapy_frames)
            scapy_t += time.perf_counter() - t
            scapy_frames_done += counts["frames"]
            scapy_bytes += nbytes * counts["frames"] / nframes  # same mix of frame sizes
    out["dpkt"] = nbytes / dpkt_t
    out["scapy"] = scapy_bytes / scapy_t if scapy_frames else None
    return out


def bench_replay(reps: int, from_disk: bool = False, erspan: bool = False) -> list[str]:
    """fast_replay of the replay scenario against a memcpy of the same bytes, interleaved;
    best of reps. from_disk: the files are dropped from the page cache and read back by
    one untimed replay first, as a replay of captures not in memory leaves them: through
    the mapping, in 2 MiB page-cache pages where the kernel and file system allow it
    (cython_ext/filemap.pyx), which a replay then maps with one entry per 2 MiB. Files
    still in the page cache from being written are held in whatever pages the writes
    made (small ones for small writes), and map a 4 KiB page at a time. erspan: the same
    captures wrapped as remote mirror sessions deliver them, a second row, interleaved."""
    d = replay_scenario()
    variants = {"bare": mirrors(d)}
    if erspan:
        variants["ERSPAN II"] = erspan_mirrors(d)
    if from_disk:
        for paths in variants.values():
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            fast_replay(load_plan(d / "plan.json"), paths, load_checkpoint(d / "init.pt"), ReplayOptions())
    bufs = {v: np.concatenate([np.fromfile(p, np.uint8) for p in paths]) for v, paths in variants.items()}
    dsts = {v: np.empty_like(b) for v, b in bufs.items()}
    for v in bufs:
        np.copyto(dsts[v], bufs[v])
    chunk = 64 << 20

    def chunked(buf, dst):
        for lo in range(0, len(buf), chunk):
            np.copyto(dst[lo:lo + chunk], buf[lo:lo + chunk])

    times: dict[tuple, list[float]] = {}
    statuses = {}
    for _ in range(reps):
        for v, paths in variants.items():
            buf, dst = bufs[v], dsts[v]
            times.setdefault((v, "memcpy"), []).append(_timed(lambda: np.copyto(dst, buf)))
            times.setdefault((v, "memcpy64"), []).append(_timed(lambda: chunked(buf, dst)))
            plan, start = load_plan(d / "plan.json"), load_checkpoint(d / "init.pt")
            pipe = None
            gc.collect()  # the last rep's garbage is not this replay's (a `ckptd replay` starts clean)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            pipe = fast_replay(plan, paths, start, ReplayOptions())
            times.setdefault((v, "replay"), []).append(time.perf_counter() - t)
            # minor faults, mostly mapping the captures: how the page cache holds them
            # (~220 where it has 2 MiB folios, ~7k in 4 KiB pages; see the docstring)
            times.setdefault((v, "faults"), []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
            times.setdefault((v, "kernel"), []).append(pipe.kernel_seconds)
            statuses[v] = ([r.status for r in pipe.reports], pipe.stops["encapsulated"],
                           sum(c["frames"] for c in pipe.classes))
    rows = ["| scenario | frames | MB | memcpy GB/s: one call (64 MiB calls) | replay s (median) | replay GB/s | "
            "x memcpy one call (x 64 MiB) | kernel s | minor faults (fewest) | iterations | "
            "frames decapsulated by the reference |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        best = {k: min(t) for (w, k), t in times.items() if w == v}
        n = len(bufs[v])
        mc, mc64, e2e = n / best["memcpy"], n / best["memcpy64"], n / best["replay"]
        reps_v = sorted(times[(v, "replay")])
        st, encapsulated, frames = statuses[v]
        rows.append(f"| 8 ranks, 3 streams, 4 iterations, {v} | {frames} | {n / 1e6:.0f} | {mc / 1e9:.1f} ({mc64 / 1e9:.1f}) | "
                    f"{best['replay']:.3f} ({reps_v[len(reps_v) // 2]:.3f}) | "
                    f"{e2e / 1e9:.2f} | **{e2e / mc:.3f}** ({e2e / mc64:.3f}) | {best['kernel']:.3f} | "
                    f"{min(times[(v, 'faults')])} | {st.count('committed')}/{len(st)} committed | {encapsulated} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--replay", action="store_true", help="only the end-to-end replay table")
    ap.add_argument("--from-disk", action="store_true",
                    help="with --replay: drop the captures from the page cache and let one untimed replay "
                         "read them back first (the page cache as a replay of files on disk leaves it)")
    ap.add_argument("--erspan", action="store_true",
                    help="with --replay: also the same captures wrapped in IPv4/GRE/ERSPAN II (a remote mirror)")
    ap.add_argument("--scapy-frames", type=int, default=1500, help="frames per file for scapy (0: skip)")
    ap.add_argument("--configs", default=",".join(f"{p}-{m}" for p, m in CONFIGS))
    ap.add_argument("--streams", default="1,3")
    a = ap.parse_args()
    if a.replay:
        cache = "read from disk by a replay first" if a.from_disk else "as found"
        print(f"machine: {machine()}; not pinned; captures in the page cache {cache}\n")
        for line in bench_replay(a.reps, a.from_disk, a.erspan):
            print(line)
        return
    cpu = pin_one_core()
    print(f"machine: {machine()}; pinned to cpu {cpu}")
    print(f"ICRC: {crc_choices()[0]} (available: {', '.join(crc_choices())})\n")
    for line in crc_table(a.reps):
        print(line)
    print()
    rows = []
    head = ("| config | streams | frames | MB | memcpy GB/s (64 MiB calls) | kernel GB/s (Mpps) | x memcpy "
            "(x 64 MiB) | kernel ICRC off | x memcpy | kernel zlib ICRC | end-to-end GB/s | steady GB/s | "
            "x memcpy | end-to-end ICRC off | dpkt MB/s | kernel / dpkt | end-to-end / dpkt | scapy MB/s | "
            "kernel / scapy |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for cfg in a.configs.split(","):
        protocol, mtu = cfg.split("-")
        for n in (int(x) for x in a.streams.split(",")):
            r = bench_config(protocol, int(mtu), n, a.reps, a.scapy_frames)
            mc, mc64 = r["memcpy"], r["memcpy64"]
            k = r["kernel-icrc"]
            line = (f"| {r['config']} | {n} | {r['frames']} | {r['mb']:.0f} | {mc / 1e9:.1f} ({mc64 / 1e9:.1f}) | "
                    f"{k / 1e9:.2f} ({r['frames'] / (r['mb'] * 1e6 / k) / 1e6:.2f}) | {k / mc:.2f} ({k / mc64:.2f}) | "
                    f"{r['kernel-trust'] / 1e9:.2f} | {r['kernel-trust'] / mc:.2f} | "
                    f"{r['kernel-zlib'] / 1e9:.2f} | {r['e2e-icrc'] / 1e9:.2f} | {r['steady-icrc'] / 1e9:.2f} | "
                    f"{r['e2e-icrc'] / mc:.2f} | {r['e2e-trust'] / 1e9:.2f} | {r['dpkt'] / 1e6:.0f} | "
                    f"{k / r['dpkt']:.0f} | {r['e2e-icrc'] / r['dpkt']:.0f} | "
                    + (f"{r['scapy'] / 1e6:.2f} | {k / r['scapy']:.0f} |" if r["scapy"] else "- | - |"))
            print(line, flush=True)
            rows.append((r, line))
    print("\nstops (frames handed to the reference path) and statuses, last run of each:")
    for r, _ in rows:
        print(f"  {r['config']} x{r['streams']}: {r['stops']} {r['statuses']}")


if __name__ == "__main__":
    main()
