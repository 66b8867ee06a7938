"""The persistence writer's priority: the daemon's kernel drops at a fixed send rate with
the writer (and its hashing threads) at nice 10, ckptd's default (ckptd.live.persist
PERSIST_NICE), against nice 0, the capture loop's own, alternating in one run.

    flock /tmp/bench.lock flock /tmp/netlab.lock python -m benchmarks.persist_priority \\
        --model default --pps 60000 --reps 3 [--persist-every 1] [--duration 2]

The test network, the workload and the trial are benchmarks/capture_rate.py's (a
synthesized 4-rank job, 3 mirror ports as veth pairs, one txring sender per port, a fresh
daemon in a spawned child per trial, each committed checkpoint written compared with the
trainer's); only the persistence tier's schedule (--persist-every, default: a checkpoint
at every commit, the heaviest) and the writer's nice value change between trials. What
is printed per trial: kernel drops, iterations committed (bit-exact), the daemon's CPU per
million frames (the capture path; the optimizer and persistence), and the rings' peak.
A lower priority for the writer is worth having where it lowers the drops at the same rate
on cores the senders share, and costs nothing where the cores are free.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import capture_rate as cr
from benchmarks.machine import machine


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="synth model size (tiny|small|default)")
    ap.add_argument("--pps", type=float, default=60_000, help="send rate per port (3 ports)")
    ap.add_argument("--duration", type=float, default=2.0, help="seconds of traffic per trial")
    ap.add_argument("--reps", type=int, default=3, help="trials of each nice value, alternating")
    ap.add_argument("--nice", default="10,0", help="the writer's nice values to alternate")
    ap.add_argument("--persist-every", type=int, default=1, help="the daemon's persist_every")
    ap.add_argument("--ring-mib", type=int, default=32, help="ring memory per interface")
    ap.add_argument("--block-kb", type=int, default=1024, help="the ring's block size (KiB)")
    ap.add_argument("--workers", action="store_true", help="the daemon with capture_workers: true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ckptd-capture-rate"),
                    help="synthesized scenarios are kept here and reused (capture_rate's)")
    a = ap.parse_args(argv)
    try:
        nices = [int(x) for x in a.nice.split(",")]
    except ValueError:
        sys.exit(f"--nice: comma-separated whole numbers, not {a.nice!r}")
    # what capture_rate's trial reads from its options
    a.verify, a.sender, a.erspan = "chain", cr.default_sender(), False
    from ckptd.testing import netlab
    reason = netlab.lab_unavailable()
    if reason:
        sys.exit(f"persist_priority needs network namespaces: {reason}")
    print(f"machine: {machine()}; persist_every {a.persist_every}; {a.pps:,.0f} frames/s per port; "
          f"sender {a.sender}; capture_workers {a.workers}", flush=True)
    probe = cr.load_workload(cr.ensure_synth(a, 4))
    n = max(2, round(a.pps * a.duration / probe.per_iteration()))
    wl = cr.load_workload(cr.ensure_synth(a, n))
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-persist-nice-", dir="/dev/shm"))
    paths = wl.write(n, tmp)
    dp = cr.DaemonProc()
    trials = {v: [] for v in nices}
    try:
        with cr.Links(len(paths)) as links:
            for rep in range(a.reps):
                for v in (nices if rep % 2 == 0 else nices[::-1]):
                    a.persist_nice = v
                    t = cr.Trial("daemon", a.pps, n, len(paths))
                    cr.trial_daemon(links, wl, a, dp, t, paths, tmp)
                    trials[v].append(t)
                    print(f"  rep {rep} nice {v:>3}: {cr.row(t)}", flush=True)
    finally:
        dp.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| writer nice | trials | drops (each) | committed exact (each) | rings' peak (each) "
          "| sent frames/s (median) | capture path CPU s per M frames (median) | optimizer + persistence (median) |")
    print("|---:|---:|---|---|---|---:|---:|---:|")
    for v, ts in trials.items():
        med = statistics.median
        print(f"| {v} | {len(ts)} | {', '.join(str(t.drops) for t in ts)} | "
              f"{', '.join(f'{t.exact}/{t.iterations}' for t in ts)} | "
              f"{', '.join('' if t.ring_peak is None else f'{t.ring_peak:.0%}' for t in ts)} | "
              f"{med(t.pps for t in ts):,.0f} | "
              f"{med(t.per_mframe(t.capture_cpu_s) for t in ts):.2f} | "
              f"{med(t.per_mframe(t.shadow_cpu_s) for t in ts):.2f} |")
    print(f"\n{time.strftime('%H:%M UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
