"""Where the live daemon's CPU per frame goes (issue 16): the daemon in this process on
issue 16's scenario, fed by one `tcpreplay --pps` (or txring) per mirror port, its CPU split by
thread and by stage.

    python -m benchmarks.daemon_cpu [--model default] [--pps 8000] [--iterations 6]
                                    [--reps 2] [--perf perf.data]

The workload, the veth pairs and the senders are benchmarks.capture_rate's (imported,
not copied): 4 ranks, Simple, 4 KiB MTU, 3 mirror ports. Each rep starts a fresh
Daemon (rings of --ring-mib per interface in --block-kb blocks, the fast pipeline,
checkpoints into a fresh `out` under /dev/shm) on a thread of this process, replays
--iterations whole iterations at --pps per port, waits until they are all committed,
then reads:
- CPU-seconds per million kernel frames (with --warm N: per million frames delivered
  after the N-th commit, i.e. without the start-up costs), all threads of this process
  (utime + stime from /proc/self/task/*/stat; the harness's own threads are idle), and
  split by thread (the daemon's loop, the apply thread, the persistence writer, HTTP,
  the digest pool);
- the daemon loop's thread CPU split by stage (time.thread_time around each stage,
  which costs two clock reads per call): taking batches from the rings (indexing,
  poll), run_batch (kernel + the Python it stops for + commits done inline), the
  status snapshots; and the kernel's own seconds (FastPipeline.kernel_seconds, wall);
- each checkpoint file written compared with the trainer's (bit-exact), kernel drops.
--fine adds run_batch's parts (kernel, drain, ...), read_batch, and the apply thread's
(optimizer step, memory tier copy); --offline-batch FRAMES runs the loop's work without
the network (offline_turns), with --icrc-ahead as a coordinator fed by capture workers
(the batches carry the workers' ICRC verdicts); --cprofile profiles the loop's thread.
With --tcpdump, each rep is followed by the same traffic into 3 `tcpdump -w` (equal
ring memory), whose CPU per million frames is printed beside it.
With --perf, `perf record -g` (or py-spy, for a .txt file) samples this process during
the replay of the last rep.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from benchmarks.capture_rate import (TCPDUMP_FILTER, Links, Trial, ensure_synth, load_workload, replay,
                                     trial_tcpdump)
from benchmarks.machine import machine

CLK_TCK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[int, float]:
    """native thread id -> utime + stime seconds, every thread of this process."""
    out = {}
    for d in Path("/proc/self/task").iterdir():
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(d.name)] = (int(f[11]) + int(f[12])) / CLK_TCK
    return out


def thread_names() -> dict[int, str]:
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    for d in Path("/proc/self/task").iterdir():
        try:
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        names.setdefault(int(d.name), f"[{comm}]")
    return names


def group(name: str) -> str:
    """Thread names without their numbers: pools count as one."""
    for prefix in ("ckptd-digest", "ckptd-http", "netns:", "ThreadPoolExecutor", "Thread-"):
        if name.startswith(prefix):
            return prefix.rstrip("-_:")
    return name


class StageClock:
    """thread_time() spent in wrapped callables of the daemon loop's thread."""

    def __init__(self):
        self.seconds = Counter()
        self.calls = Counter()

    def wrap(self, name, fn):
        def timed(*a, **kw):
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[name] += time.thread_time() - t0
                self.calls[name] += 1
        return timed

    def wrap_gen(self, name, gen):
        it = iter(gen)
        while True:
            t0 = time.thread_time()
            try:
                x = next(it)
            except StopIteration:
                self.seconds[name] += time.thread_time() - t0
                return
            self.seconds[name] += time.thread_time() - t0
            self.calls[name] += 1
            yield x


def one_rep(a, wl, links, paths, n, tmp: Path, perf: str | None) -> dict:
    import logging
    from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
    from ckptd.live.daemon import Daemon, DaemonConfig, InterfaceConfig
    logging.getLogger("ckptd").setLevel(logging.CRITICAL)
    out = tmp / "ckpt"
    shutil.rmtree(out, ignore_errors=True)
    ifs = [InterfaceConfig(name=f"mirror{k}", ifname=f"rx{k}", netns=links.cap_ns, block_size=a.block_kb * 1024,
                           block_nr=a.ring_mib * 1024 // a.block_kb) for k in range(len(paths))]
    d = Daemon(DaemonConfig(plan=str(wl.run / "plan.json"), init=str(wl.run / "init.pt"), out=str(out),
                            interfaces=ifs, listen="127.0.0.1:0", **a.extra))
    clock, apply_clock = StageClock(), StageClock()
    d._ring_batches = (lambda f: lambda: clock.wrap_gen("rings", f()))(d._ring_batches)
    d._publish = clock.wrap("publish", d._publish)
    d.pipe.run_batch = clock.wrap("run_batch", d.pipe.run_batch)
    if a.fine:  # inside run_batch (each wrapper costs ~2 us a call more)
        ex = d.pipe.extract
        ex.run = clock.wrap(" kernel run", ex.run)
        ex.drain = clock.wrap(" drain", ex.drain)
        d.pipe._sync_iterations = clock.wrap(" sync_iterations", d.pipe._sync_iterations)
        d.pipe.pipeline.advance_clock = clock.wrap(" pipeline.advance_clock", d.pipe.pipeline.advance_clock)
        d.pipe._python_frame = clock.wrap(" python_frame", d.pipe._python_frame)
        d.pipe.pipeline.after_placement = clock.wrap(" after_placement", d.pipe.pipeline.after_placement)
        # the apply thread's parts (its own clock: another thread)
        sh = d.pipe.pipeline.shadow
        sh.apply_buckets = apply_clock.wrap("shadow.apply_buckets", sh.apply_buckets)
        sh._step = apply_clock.wrap(" optimizer step", sh._step)
        if d.memory is not None:
            d.memory.commit = apply_clock.wrap("memory tier copy", d.memory.commit)
    box = {}
    def body():
        if a.cprofile:  # the daemon loop's thread only, deterministic (slows it down)
            import cProfile
            prof = cProfile.Profile()
            box["rc"] = prof.runcall(d.run, install_signals=False)
            prof.dump_stats(a.cprofile)
        else:
            box["rc"] = d.run(install_signals=False)
    th = threading.Thread(target=body, name="daemon")
    th.start()
    while (len(d.captures) < len(ifs) or d.snapshot.get().get("state") != "running") and th.is_alive():
        time.sleep(0.01)
    if a.fine:  # the rings are open now; ring_batches looks read_batch up at each call
        for c in d.captures:
            c.read_batch = clock.wrap("  read_batch (index)", c.read_batch)
    cpu0, load0 = thread_cpu(), os.getloadavg()[0]
    rec = None
    if perf and perf.endswith(".txt"):  # py-spy's collapsed stacks, by thread
        rec = subprocess.Popen(["py-spy", "record", "-p", str(os.getpid()), "-r", "200", "-f", "raw", "--threads",
                                "--nonblocking", "-o", perf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif perf:
        rec = subprocess.Popen(["perf", "record", "-q", "-g", "-o", perf, "-p", str(os.getpid())],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sender = threading.Thread(target=lambda: box.setdefault("sent", replay(links, paths, a.pps, a.sender)),
                              name="sender")
    sender.start()
    frames0, base = 0, (Counter(), Counter(), 0.0)
    if a.warm:  # count from the commit of iteration warm-1 on: the steady state, without start-up costs
        while sum(r.status == "committed" for r in d.pipe.reports) < a.warm and sender.is_alive():
            time.sleep(0.005)
        cpu0, frames0 = thread_cpu(), d.frames
        base = (Counter(clock.seconds), Counter(apply_clock.seconds), d.pipe.kernel_seconds)
    sender.join()
    sent, secs = box["sent"].frames, box["sent"].seconds
    still, last = time.time(), None
    while time.time() - still < 3:
        done = sum(r.status == "committed" for r in d.pipe.reports)
        if done >= n:
            break
        if (d.frames, done) != last:
            last, still = (d.frames, done), time.time()
        time.sleep(0.02)
    cpu1, names = thread_cpu(), thread_names()
    if rec is not None:
        rec.send_signal(2)
        rec.wait()
    by_thread = Counter()
    for tid, c in cpu1.items():
        by_thread[group(names.get(tid, "?"))] += c - cpu0.get(tid, 0.0)
    frames = d.frames - frames0
    stages = {**(clock.seconds - base[0]), **{f"apply: {k}": v for k, v in (apply_clock.seconds - base[1]).items()}}
    calls = {**clock.calls, **{f"apply: {k}": v for k, v in apply_clock.calls.items()}}
    kernel_s = d.pipe.kernel_seconds - base[2]
    d.stop.set()
    th.join(120)
    reps = list(d.pipe.reports)
    committed = [r.iteration for r in reps if r.status == "committed"]
    files = [it for it in committed if (out / checkpoint_name(it)).exists()]  # the persistence tier's
    exact = sum(not diff_checkpoints(load_checkpoint(out / checkpoint_name(it)),
                                     load_checkpoint(wl.run / "reference" / checkpoint_name(it))) for it in files)
    st = [c.stats() for c in d.captures]
    shutil.rmtree(out, ignore_errors=True)
    return {"sent": sent, "secs": secs, "packets": sum(s["packets"] for s in st), "drops": sum(s["drops"] for s in st),
            "counted": frames if a.warm else sum(s["packets"] for s in st),
            "committed": len(committed), "files": len(files), "exact": exact, "rc": box.get("rc"), "by_thread": by_thread,
            "stages": stages, "calls": calls, "kernel_s": kernel_s, "load": (load0, os.getloadavg()[0]),
            "statuses": Counter(r.status for r in reps)}


def offline_turns(wl, paths, frames: int, reps: int, icrc_ahead: bool = False) -> list[tuple[float, float, float]]:
    """The daemon loop's work without the network: each port's capture cut into batches
    of `frames` (a ring block's worth), fed to FastPipeline.run_batch a port at a time in
    turn, as ring_batches hands them over. (thread CPU-s of the loop, process CPU-s, the
    kernel's seconds) per rep: the loop less the kernel is the Python around it (stops,
    clocks, counters, commits), measured without tcpreplay's noise. icrc_ahead: every
    batch carries the ICRC verdicts a capture worker would have sent with it (checked
    before the clock starts), so the loop is the coordinator's with `capture_workers`."""
    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.core.plan import load_plan
    from ckptd.fast.batches import Batch, load_capture
    from ckptd.fast.pipeline import FastPipeline
    from ckptd.pipeline import ReplayOptions
    ports = [load_capture(str(p), k)[0] for k, p in enumerate(paths)]
    cuts = []
    for b in ports:
        cuts.append([Batch(b.buf, *(getattr(b, f)[i:i + frames] for f in
                                    ("offsets", "caplen", "origlen", "stream", "linktype", "frame_no", "ts")))
                     for i in range(0, len(b), frames)])
    turns = [c[i] for i in range(max(map(len, cuts))) for c in cuts if i < len(c)]
    if icrc_ahead:
        from ckptd.fast.icrc import icrc_checker
        checker = icrc_checker()
        for b in turns:
            b.icrc_checked = checker.check_icrc(b.buf, b.offsets, b.caplen, b.origlen, b.linktype)
    out = []
    for _ in range(reps):
        pipe = FastPipeline(load_plan(wl.run / "plan.json"), load_checkpoint(wl.run / "init.pt"), len(paths),
                            ReplayOptions())
        t0, p0 = time.thread_time(), time.process_time()
        for b in turns:
            pipe.run_batch(b)
        pipe.finish()
        out.append((time.thread_time() - t0, time.process_time() - p0, pipe.kernel_seconds))
    return out


def report(label: str, r: dict) -> str:
    m = r["counted"] / 1e6
    total = sum(r["by_thread"].values())
    lines = [f"{label}: {r['sent']} frames sent in {r['secs']:.2f} s, kernel {r['packets']}, drops {r['drops']}, "
             f"committed {r['committed']} (checkpoint files {r['files']}, bit-exact {r['exact']}), rc {r['rc']}, "
             f"statuses {dict(r['statuses'])}, load {r['load'][0]:.2f}->{r['load'][1]:.2f}",
             f"  all threads: {total:.2f} CPU-s over {r['counted']} frames = {total / m:.2f} s per M frames"]
    for name, c in r["by_thread"].most_common():
        if c >= 0.005:
            lines.append(f"    thread {name:24s} {c:6.2f} s = {c / m:5.2f} s/M")
    for name, c in sorted(r["stages"].items(), key=lambda x: -x[1]):
        lines.append(f"    loop stage {name:18s} {c:6.2f} s = {c / m:5.2f} s/M ({r['calls'][name]} calls)")
    lines.append(f"    kernel (wall, inside run_batch) {r['kernel_s']:.2f} s = {r['kernel_s'] / m:.2f} s/M")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--pps", type=float, default=8000, help="per mirror port")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ring-mib", type=int, default=32)
    ap.add_argument("--block-kb", type=int, default=1024)
    ap.add_argument("--perf", help="perf record -g into this file during the last rep (a .txt name: py-spy's "
                    "collapsed Python stacks by thread instead)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a DaemonConfig field (Python literal), e.g. persist_every=1")
    ap.add_argument("--offline-batch", type=int, metavar="FRAMES",
                    help="no network: the captures in batches of FRAMES per port in turn (offline_turns)")
    ap.add_argument("--icrc-ahead", action="store_true",
                    help="with --offline-batch: the batches carry ICRC verdicts, as capture workers send them")
    ap.add_argument("--warm", type=int, default=0, metavar="N",
                    help="count CPU and frames only after N iterations committed (the steady state)")
    ap.add_argument("--fine", action="store_true", help="time run_batch's parts too")
    ap.add_argument("--cprofile", help="cProfile the daemon loop's thread into this file (last rep's wins)")
    ap.add_argument("--tcpdump", action="store_true",
                    help="after each rep, the same traffic into 3 `tcpdump -w` (capture_rate's trial_tcpdump)")
    ap.add_argument("--sender", choices=("tcpreplay", "txring"), default="tcpreplay",
                    help="capture_rate's senders (its default is txring where built)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--turn-kib", type=int, metavar="KIB",
                    help="the turn (ring bytes the in-process loop takes per ring, a capture worker's slot) instead "
                         "of the plan's (ckptd.live.ring.turn_bytes), to compare sizes in one run")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "ckptd-capture-rate"))
    a = ap.parse_args(argv)
    a.tcpdump_filter = TCPDUMP_FILTER
    import ast
    a.extra = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in a.set)}
    if a.turn_kib:  # the daemon asks ring.turn_bytes when it opens its rings or workers
        import ckptd.live.ring
        ckptd.live.ring.turn_bytes = lambda least, kib=a.turn_kib: kib << 10
    print(f"machine: {machine()}; load average {os.getloadavg()}; config {a.extra}"
          f"{f'; turn {a.turn_kib} KiB' if a.turn_kib else ''}", flush=True)
    wl = load_workload(ensure_synth(a, a.iterations))
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-dcpu-", dir="/dev/shm"))
    try:
        paths = wl.write(a.iterations, tmp)
        if a.offline_batch:
            m = wl.frames_for(a.iterations) / 1e6
            for loop, proc, kernel in offline_turns(wl, paths, a.offline_batch, a.reps, a.icrc_ahead):
                print(f"offline, batches of {a.offline_batch} frames{', ICRCs checked ahead' if a.icrc_ahead else ''}: loop thread {loop / m:.3f} s per M frames "
                      f"(kernel {kernel / m:.3f}, the rest {(loop - kernel) / m:.3f}), process {proc / m:.3f}; "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
            return
        with Links(len(wl.frames)) as links:
            for rep in range(a.reps):
                r = one_rep(a, wl, links, paths, a.iterations, tmp, a.perf if rep == a.reps - 1 else None)
                print(report(f"rep {rep}", r), flush=True)
                if a.tcpdump:
                    t = Trial("tcpdump", a.pps, a.iterations, len(paths))
                    load0 = os.getloadavg()[0]
                    trial_tcpdump(links, a, t, paths, tmp)
                    print(f"tcpdump {rep}: kernel {t.packets}, drops {t.drops}, {t.cpu_s:.2f} CPU-s = "
                          f"{t.cpu_per_mframe:.2f} s per M frames, load {load0:.2f}->{os.getloadavg()[0]:.2f}",
                          flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
