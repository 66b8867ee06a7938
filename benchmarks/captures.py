"""Benchmark inputs: synthesized mirror captures, made once and kept in a temp directory.

    python -m benchmarks.captures            # make (or list) the four default captures

Each capture is `ckptd synth` of the 2.6M-parameter "default" model over a 2-rank ring,
one channel, 3 mirror ports with 0.1% loss each, 3 iterations: about 63-130 MB per
mirror. They live under $CKPTD_BENCH_DIR (default: <tmp>/ckptd-bench); the first run
takes a few minutes per protocol/MTU, later runs reuse them.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ckptd.testing.synth import SynthOptions, synthesize

CONFIGS = [("simple", 4096), ("ll", 4096), ("ll128", 4096), ("simple", 1024), ("ll", 1024), ("ll128", 1024)]


def bench_dir() -> Path:
    return Path(os.environ.get("CKPTD_BENCH_DIR") or Path(tempfile.gettempdir()) / "ckptd-bench")


def capture(protocol: str, mtu: int, model: str = "default", iterations: int = 3) -> Path:
    """The directory of one benchmark capture (plan.json, mirrors/mirror{0,1,2}.pcap),
    synthesized if it is not there yet."""
    d = bench_dir() / f"{protocol}-{mtu}-{model}-{iterations}it"
    if not (d / "synth.json").exists():
        t = time.perf_counter()
        print(f"synthesizing {d} ...", flush=True)
        synthesize(SynthOptions(out=str(d), model=model, ranks=2, channels=1, protocol=protocol,
                                mtu=mtu, mirrors=3, wrap_mirrors=True, loss=1e-3, iterations=iterations, seed=1))
        print(f"  done in {time.perf_counter() - t:.0f} s", flush=True)
    return d


def replay_scenario() -> Path:
    """The end-to-end replay scenario of issue 16: `ckptd synth --ranks 8 --model default
    --mirrors 3 --iterations 4 --loss 1e-3` (2.6M parameters, 2 channels, Simple, MTU
    4096; ~446 MB of mirror captures), with the trainer's init.pt and checkpoints."""
    d = bench_dir() / "replay-8ranks-default-4it"
    if not (d / "synth.json").exists():
        t = time.perf_counter()
        print(f"synthesizing {d} ...", flush=True)
        synthesize(SynthOptions(out=str(d), model="default", ranks=8, mirrors=3, loss=1e-3,
                                iterations=4, seed=1))
        print(f"  done in {time.perf_counter() - t:.0f} s", flush=True)
    return d


def mirrors(d: Path) -> list[str]:
    return sorted(str(p) for p in (d / "mirrors").glob("*.pcap"))


def erspan_mirrors(d: Path) -> list[str]:
    """d's mirror captures as remote mirror sessions deliver them (ckptd.testing.tunnel:
    IPv4/GRE/ERSPAN II around every frame, session = the stream), written once beside."""
    from ckptd.testing.tunnel import erspan2
    from parsers.pcap import read_pcap, write_pcap
    out = d / "mirrors-erspan"
    paths = [out / Path(p).name for p in mirrors(d)]
    if not all(p.exists() for p in paths):
        out.mkdir(exist_ok=True)
        for k, (src, dst) in enumerate(zip(mirrors(d), paths)):
            write_pcap(dst, [(f.ts_ns or 0, erspan2(bytes(f.data), k, i)) for i, f in enumerate(read_pcap(src))])
    return [str(p) for p in paths]


if __name__ == "__main__":
    for protocol, mtu in CONFIGS:
        d = capture(protocol, mtu)
        size = sum(Path(p).stat().st_size for p in mirrors(d))
        print(f"{d}: {size / 1e6:.0f} MB in {len(mirrors(d))} mirror files")
