"""What following NCCL's connection state costs the fast path (issue 12 items 3-4).

With several QPs whose rotation carries over iterations, a QP's timeline is iteration 0
then a cycle of up to `qps` rebuilt layouts (Plan.timeline_schedules), and the kernel finds
a packet's iteration by walking that cycle; 2.14-2.15 add a 0-byte WRITE_WITH_IMM per part;
plan collectives add small messages. Each case synthesizes the same job (model, ranks,
iterations, seed) and replays it on the fast path `--repeat` times; printed: frames per
second (best of the repeats) and the ratio to the first case.

    python -m benchmarks.connstate [--model small] [--iterations 8] [--repeat 3]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ckptd.core.checkpoint import load_checkpoint
from ckptd.core.plan import load_plan
from ckptd.fast.pipeline import fast_replay
from ckptd.pipeline import ReplayOptions
from ckptd.testing.synth import SynthOptions, synthesize

CASES = [  # name, SynthOptions changes
    ("2.22, 1 QP", dict(nccl_version="2.22", qps=1)),
    ("2.22, 3 QPs (rotation period 3)", dict(nccl_version="2.22", qps=3)),
    ("2.29, 4 QPs, LL (rotation period 2)", dict(nccl_version="2.29", qps=4, protocol="ll")),
    ("2.29, 1 QP, LL", dict(nccl_version="2.29", qps=1, protocol="ll")),
    ("2.14, 2 QPs (write + 0-byte imm)", dict(nccl_version="2.14", qps=2)),
    ("2.22, 3 QPs + loss allreduces", dict(nccl_version="2.22", qps=3,
                                           collectives={"before": [[1, "float32"]], "after": [[4, "float32"]]})),
    ("2.22, 1 QP (again: how noisy the machine is)", dict(nccl_version="2.22", qps=1)),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    base = None
    print(f"{'case':46s} {'period':>6s} {'frames':>8s} {'frames/s':>10s} {'ratio':>6s}")
    for name, kw in CASES:
        with tempfile.TemporaryDirectory() as d:
            opts = SynthOptions(out=d, ranks=2, channels=2, mtu=1024, mirrors=2, model=a.model,
                                iterations=a.iterations, seed=1, noise=False, **{"protocol": "simple", **kw})
            synthesize(opts)
            plan = load_plan(Path(d) / "plan.json")
            paths = sorted(str(p) for p in (Path(d) / "mirrors").glob("*.pcap"))
            best = None
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                pipe = fast_replay(plan, paths, load_checkpoint(Path(d) / "init.pt"), ReplayOptions())
                dt = time.perf_counter() - t0
                assert all(r.status == "committed" for r in pipe.reports), [r.status for r in pipe.reports]
                best = dt if best is None else min(best, dt)
            frames = sum(c["frames"] for c in pipe.classes)
            rate = frames / best
            base = base or rate
            print(f"{name:46s} {plan.rotation_period():6d} {frames:8d} {rate:10.0f} {rate / base:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
