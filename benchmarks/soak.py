"""Soak: many iterations through the daemon's loop (ckptd.live.daemon.Daemon: pipeline, shadow,
status snapshots, HTTP server), checking resident memory and that no iteration gets stuck.

    python -m benchmarks.soak [--iterations 1000] [--model tiny] [--loss 1e-3]

Gradients are random (the optimizer and shadow still run for real); frames are built
per iteration and fed straight to the daemon as its capture rings would, so nothing
accumulates on disk (checkpoints are written to a temporary directory and deleted as
the run goes, as a retention policy would). Prints RSS after warm-up and at the end, and the growth ratio.
"""
from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from ckptd.core.checkpoint import save_checkpoint
from ckptd.live.daemon import Daemon, DaemonConfig, InterfaceConfig
from ckptd.testing.synth import SynthOptions, Wire, impair, make_plan
from ckptd.testing.synth.model import build_model
from ckptd.testing.synth.ring import reduce_iteration
from parsers.frame import CapturedFrame


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--loss", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    a = ap.parse_args()
    opts = SynthOptions(out="", ranks=4, channels=2, protocol="simple", mtu=4096, mirrors=3,
                        iterations=a.iterations, model=a.model, loss=a.loss, noise=True)
    rng = random.Random(0)
    model = build_model(a.model, 0)
    plan = make_plan(opts, model, rng)
    wire = Wire(plan, opts, rng)
    work = Path(tempfile.mkdtemp(prefix="ckptd-soak-"))
    plan.save(work / "plan.json")
    save_checkpoint(work / "init.pt", -1, {n: p.detach().clone() for n, p in model.named_parameters()}, None)
    daemon = Daemon(DaemonConfig(plan=str(work / "plan.json"), init=str(work / "init.pt"),
                                 out=str(work / "ck"), listen="127.0.0.1:0",
                                 interfaces=[InterfaceConfig(m.name, f"soak{k}")
                                             for k, m in enumerate(plan.mirrors)]))
    nprng = np.random.default_rng(0)
    stats = {m.name: {"frames": 0, "lost": 0, "corrupted": 0, "duplicated": 0, "reordered": 0}
             for m in plan.mirrors}
    samples = {}

    def source():
        idx = [0] * len(plan.mirrors)
        ts = 0
        for t in range(a.iterations):
            sched = plan.schedule(t)
            local = [[(nprng.standard_normal(b.count).astype(np.float32) * 1e-3) for b in sched.buckets]
                     for _ in range(plan.nranks)]
            _, payloads = reduce_iteration(sched, local)
            frames = wire.iteration_frames(sched, payloads)
            for k, m in enumerate(plan.mirrors):
                seen = [(ts + i, f) for i, (s, d, f) in enumerate(frames) if m.sees(s, d)]
                for when, f in impair(seen, opts, rng, stats[m.name]):
                    idx[k] += 1
                    yield k, CapturedFrame(idx[k], when, 1, len(f), len(f), f)
            ts += len(frames) + 1000
            for old in (work / "ck").glob("iter_*.pt"):  # keep the newest few only
                if int(old.stem[5:]) < t - 3:
                    old.unlink()
            if t in (a.warmup, a.iterations - 1) or t % 100 == 0:
                samples[t] = rss_mb()

    t0 = time.time()
    daemon.run(source=source(), install_signals=False)
    dt = time.time() - t0
    committed = daemon.by_status.get("committed", 0)
    stuck = [u["iteration"] for u in daemon.unrecovered]
    w, end = samples[a.warmup], samples[a.iterations - 1]
    print(f"iterations {sum(daemon.by_status.values())}, committed {committed}, "
          f"not committed {stuck[:10]}")
    print(f"frames lost on mirrors: {sum(s['lost'] for s in stats.values())}")
    print("RSS MiB by iteration: " + ", ".join(f"{t}:{v:.1f}" for t, v in sorted(samples.items())))
    print(f"RSS after warm-up (iteration {a.warmup}) {w:.1f} MiB, at the end {end:.1f} MiB, "
          f"growth {100 * (end / w - 1):+.2f}% (target <= +1%)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB, "
          f"{dt:.1f}s, {dt / a.iterations * 1000:.1f} ms/iteration")


if __name__ == "__main__":
    main()
