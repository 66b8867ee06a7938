"""Live capture rate: the highest send rate at which the daemon keeps zero kernel drops,
and the same for `tcpdump -w`, measured side by side on one test network.

    python -m benchmarks.capture_rate [--model small] [--duration 8] [--block-kb 256 --block-nr 8]
                                      [--only daemon] [--pipeline fast|reference]

A synthesized job (4 ranks, 2 channels, Simple, 4 KiB RoCE MTU, 3 mirror ports that
see every frame, no injected loss) is replayed by the hosts of a NetLab (namespaces, a
bridge, tc mirror rules), each host sending its own frames with `timing="rate"`.  At
each rate step the same frames (iterations 0..n-1, about `rate x duration` frames)
are sent twice: once to a fresh ckptd Daemon (TPACKET_V3 rings on the three mirror
capture interfaces, the real pipeline behind them, checkpoints written, running in a
child process so that it does not share the sender's GIL), once to three
`ip netns exec <ckpt ns> tcpdump -i <mirror> -w /dev/shm/... -B <ring KiB>`, one per
mirror interface, with the daemon's filter.  A capturer passes a step when its
kernel counters show zero drops.  Rates double from --start-pps until a capturer
drops (or the sender cannot reach the target: then the result is a lower bound),
then each capturer's bracket is bisected.

The rings are deliberately small: 8 blocks of 256 KiB per interface, where the
daemon's default is 64 of 4 MiB, and tcpdump -B 2048 (KiB), which libpcap 1.10 lays
out the same way (TPACKET_V3, 256 KiB blocks).  A step sends many times what a ring
holds, so a capturer slower than the arrival rate must overflow it.  A ring of R frames can still hide a deficit of up to
R / duration frames/s per interface; the report prints that bound.

Rates are host send rates summed over the 4 hosts (`lab.send` paces each host to
pps_per_host); the capture host receives each mirrored frame once per mirror that
sees it (about 1.5 x the sent frames here), also printed.  The Python sender tops out
around 100 k packets/s on a small machine: a step whose achieved rate is below 90 % of
its target is marked "sender-limited", and a capturer that never dropped is then
reported as ">= that rate".
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from benchmarks.machine import machine

SENDER_OK = 0.90            # achieved / target below this: the sender, not the capture, limits
TCPDUMP_FILTER = "udp dst port 4791 or ip proto 47 or ip6 proto 47"  # what ckptd's BPF passes (untagged)


# -- the workload ------------------------------------------------------------------------
def synth_options(a, iterations: int):
    from ckptd.testing.synth import SynthOptions
    return SynthOptions(out=str(Path(a.work) / f"{a.model}-s{a.seed}-i{iterations}"), ranks=4,
                        channels=2, protocol="simple", mtu=4096, mirrors=3, iterations=iterations,
                        model=a.model, seed=a.seed, write_hosts=True)


def ensure_synth(a, iterations: int) -> Path:
    """Synthesize (or reuse) a scenario with at least `iterations` iterations."""
    from ckptd.testing.synth import synthesize
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    for d in sorted(work.glob(f"{a.model}-s{a.seed}-i*")):
        if (d / "synth.json").exists() and int(d.name.rsplit("-i", 1)[1]) >= iterations:
            return d
    opts = synth_options(a, iterations)
    t0 = time.time()

    def progress(t, n):
        if t % 20 == 19 or t == n - 1:
            print(f"  synthesized {t + 1}/{n} iterations ({time.time() - t0:.0f} s)", flush=True)
    synthesize(opts, progress=progress)
    return Path(opts.out)


@dataclass
class Workload:
    run: Path
    frames: dict                   # rank -> [bytes], in send order
    cut: dict                      # rank -> [index where iteration t starts], len = iterations + 1
    mirror_frames: list            # [iterations + 1] cumulative frames over all mirrors
    mirror_bytes: list
    iterations: int
    mirrors: int
    avg_mirror_slot: float         # mean bytes a mirrored frame takes in a TPACKET_V3 ring

    def frames_for(self, n: int) -> dict:
        return {r: f[:self.cut[r][n]] for r, f in self.frames.items()}

    def sent_frames(self, n: int) -> int:
        return sum(c[n] for c in self.cut.values())

    def per_iteration(self) -> float:
        return self.sent_frames(self.iterations) / self.iterations


def load_workload(run: Path) -> Workload:
    """Host frames split at iteration boundaries (the synthesizer stamps frames 100 ns
    apart within an iteration and leaves 5 ms between iterations), and how many frames
    and bytes the mirrors see in the first n iterations."""
    from ckptd.core.plan import load_plan
    from parsers.pcap import read_pcap
    plan = load_plan(run / "plan.json")
    raw = {r: [(f.ts_ns, f.data) for f in read_pcap(run / "hosts" / f"rank{r}.pcap")]
           for r in range(plan.nranks)}
    stamps = sorted({ts for fr in raw.values() for ts, _ in fr})
    starts = [stamps[0]] + [b for a_, b in zip(stamps, stamps[1:]) if b - a_ > 1_000_000]
    n = len(starts)
    frames, cut = {}, {}
    for r, fr in raw.items():
        frames[r] = [d for _, d in fr]
        its = [bisect.bisect_right(starts, ts) - 1 for ts, _ in fr]
        cut[r] = [bisect.bisect_left(its, t) for t in range(n + 1)]
    del raw
    mf, mb = [0] * (n + 1), [0] * (n + 1)
    slot = 0
    for pcap in sorted((run / "mirrors").glob("*.pcap")):
        for f in read_pcap(pcap):
            t = bisect.bisect_right(starts, f.ts_ns) - 1
            mf[t + 1] += 1
            mb[t + 1] += len(f.data)
            slot += (len(f.data) + 68 + 15) // 16 * 16  # tpacket3 header + sockaddr_ll, aligned
    for t in range(n):
        mf[t + 1] += mf[t]
        mb[t + 1] += mb[t]
    return Workload(run, frames, cut, mf, mb, n, len(plan.mirrors), slot / max(1, mf[n]))


# -- the daemon, in a child process ----------------------------------------------------------
def _daemon_worker(conn):
    """Runs in a spawned child: one fresh Daemon per ("start", cfg) command."""
    import logging
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    logging.getLogger("ckptd").setLevel(logging.CRITICAL)  # drops are read from counters
    from ckptd.live.daemon import Daemon, DaemonConfig, InterfaceConfig
    daemon = thread = None
    box = {}

    def stats():
        caps = [c.stats() for c in list(daemon.captures)]
        reps = list(daemon.pipe.reports)
        return {"capture": {c["ifname"]: {k: c[k] for k in ("packets", "drops", "freeze_q_cnt", "delivered")}
                            for c in caps},
                "committed": sum(r.status == "committed" for r in reps),
                "statuses": {s: sum(r.status == s for r in reps) for s in {r.status for r in reps}},
                "frames": daemon.frames, "errors": list(daemon.pipe.errors),
                "running": thread.is_alive(), "snapshot_capture": daemon.snapshot.get().get("capture")}
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "start":
                ifs = [InterfaceConfig(**i) for i in arg.pop("interfaces")]
                daemon = Daemon(DaemonConfig(interfaces=ifs, **arg))
                box.clear()
                thread = threading.Thread(target=lambda: box.setdefault("rc", daemon.run(install_signals=False)),
                                          name="daemon", daemon=True)
                thread.start()
                deadline = time.time() + 30
                while (len(daemon.captures) < len(ifs) or daemon.snapshot.get().get("state") != "running") \
                        and thread.is_alive() and time.time() < deadline:
                    time.sleep(0.01)
                conn.send(("ok", stats()))
            elif cmd == "stats":
                conn.send(("ok", stats()))
            elif cmd == "stop":
                daemon.stop.set()
                thread.join(120)
                st = stats()  # counters survive close()
                st["rc"] = box.get("rc")
                conn.send(("ok", st))
            elif cmd == "quit":
                conn.send(("ok", None))
                return
        except BaseException as e:  # noqa: BLE001 -- reported to the parent
            conn.send(("error", f"{type(e).__name__}: {e}"))


class DaemonProc:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_daemon_worker, args=(child,), name="ckptd-daemon", daemon=True)
        self.proc.start()
        child.close()

    def call(self, cmd, arg=None, timeout=180):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise RuntimeError(f"daemon worker did not answer {cmd!r} in {timeout} s")
        kind, val = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"daemon worker, {cmd}: {val}")
        return val

    def close(self):
        try:
            if self.proc.is_alive():
                self.call("quit", timeout=10)
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# -- one trial -------------------------------------------------------------------------------
@dataclass
class Trial:
    capturer: str
    target_pps: float              # all hosts together
    iterations: int
    sent: int = 0
    sent_bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    failed: int = 0
    expected: int = 0              # frames the mirror links should deliver (all mirrors)
    expected_bytes: int = 0
    arrived: int = 0               # rx_packets on the capture interfaces
    packets: int = 0               # passed the capture's filter (kernel count, drops included)
    drops: int = 0
    committed: int | None = None   # daemon only
    note: str = ""

    @property
    def pps(self):
        return self.sent / self.seconds if self.seconds else 0.0

    @property
    def gbps(self):
        return self.sent_bytes * 8 / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def mirror_pps(self):
        return self.expected / self.seconds if self.seconds else 0.0

    @property
    def mirror_gbps(self):
        return self.expected_bytes * 8 / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def sender_limited(self):
        return self.pps < SENDER_OK * self.target_pps

    @property
    def ok(self):
        return self.drops == 0 and self.packets > 0


def rx_packets(lab) -> int:
    from pyroute2 import IPRoute
    names = {m.capture_ifname for m in lab.mirrors}
    with IPRoute(netns=lab.ckpt_ns, flags=0) as ipr:
        return sum((l.get_attr("IFLA_STATS64") or {}).get("rx_packets", 0)
                   for l in ipr.get_links() if l.get_attr("IFLA_IFNAME") in names)


def send(lab, wl: Workload, t: Trial, pps_per_host: float):
    before = rx_packets(lab)
    res = lab.send(wl.frames_for(t.iterations), timing="rate", pps=pps_per_host)
    t.sent = sum(r.sent for r in res.values())
    t.sent_bytes = sum(r.bytes for r in res.values())
    t.seconds = max(r.seconds for r in res.values())
    t.retries = sum(r.retries for r in res.values())
    t.failed = sum(r.failed for r in res.values())
    time.sleep(0.3)  # the last frames through the bridge and the mirrors
    t.arrived = rx_packets(lab) - before
    t.expected = wl.mirror_frames[t.iterations]
    t.expected_bytes = wl.mirror_bytes[t.iterations]


def trial_daemon(lab, wl, a, dp: DaemonProc, t: Trial, pps_per_host: float, tmp: Path):
    out = tmp / "ckpt"
    shutil.rmtree(out, ignore_errors=True)
    cfg = {"plan": str(wl.run / "plan.json"), "init": str(wl.run / "init.pt"), "out": str(out),
           "listen": "127.0.0.1:0", "fast": a.pipeline == "fast",
           "interfaces": [{"name": m.name, "ifname": m.capture_ifname, "netns": lab.ckpt_ns,
                           "block_size": a.block_kb * 1024, "block_nr": a.block_nr}
                          for m in lab.mirrors]}
    st = dp.call("start", cfg)
    if not st["running"]:
        raise RuntimeError(f"daemon did not start: {st}")
    time.sleep(0.2)
    try:
        send(lab, wl, t, pps_per_host)
        # Drain: wait until every iteration committed, or nothing moves for 3 s.
        last, still, deadline = None, time.time(), time.time() + 120
        while time.time() < deadline:
            st = dp.call("stats")
            now = (st["frames"], st["committed"])
            if st["committed"] >= t.iterations:
                break
            if now != last:
                last, still = now, time.time()
            elif time.time() - still > 3:
                break
            time.sleep(0.1)
    finally:
        st = dp.call("stop")
        shutil.rmtree(out, ignore_errors=True)
    t.packets = sum(c["packets"] for c in st["capture"].values())
    t.drops = sum(c["drops"] for c in st["capture"].values())
    t.committed = st["committed"]
    snap = st.get("snapshot_capture") or {}
    snap_drops = sum(c.get("drops", 0) for c in snap.values())
    if snap_drops != t.drops:
        t.note += f" snapshot drops {snap_drops}"
    if st["errors"]:
        t.note += f" capture errors {st['errors'][:2]}"
    if t.drops == 0 and t.committed < t.iterations:
        t.note += f" no drops but only {t.committed}/{t.iterations} committed ({st['statuses']})"


_TCPDUMP_STATS = re.compile(r"(\d+) packets? (captured|received by filter|dropped by kernel)")


def trial_tcpdump(lab, wl, a, t: Trial, pps_per_host: float, tmp: Path):
    procs, files = [], []
    buf_kib = a.block_kb * a.block_nr
    try:
        for m in lab.mirrors:
            path = Path("/dev/shm") / f"{lab.prefix}-{m.capture_ifname}.pcap"
            files.append(path)
            cmd = ["ip", "netns", "exec", lab.ckpt_ns, "tcpdump", "-i", m.capture_ifname, "-n",
                   "-w", str(path), "-B", str(buf_kib)] + (a.tcpdump_filter.split() if a.tcpdump_filter else [])
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for p in procs:  # ready once it says "listening on"
            said = [p.stderr.readline()]
            while said[-1] and "listening on" not in said[-1]:
                said.append(p.stderr.readline())
            if not said[-1]:
                raise RuntimeError(f"tcpdump did not start: {' '.join(p.args)}: {''.join(said).strip()}")
        time.sleep(0.2)
        send(lab, wl, t, pps_per_host)
        # tcpdump's ring retires a partly filled block after its 1000 ms timeout; stop
        # after that, so the last frames are written rather than left in the ring.
        time.sleep(1.3)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        errs = []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=60)[1])
            except subprocess.TimeoutExpired:
                p.kill()
                errs.append(p.communicate()[1])
        written = sum(f.stat().st_size for f in files if f.exists())
        for f in files:
            f.unlink(missing_ok=True)
    counts = {"captured": 0, "received by filter": 0, "dropped by kernel": 0}
    for e in errs:
        for n, what in _TCPDUMP_STATS.findall(e):
            counts[what] += int(n)
    t.packets = counts["received by filter"]
    t.drops = counts["dropped by kernel"]
    if counts["captured"] + t.drops != t.packets:
        t.note += f" ({t.packets - t.drops - counts['captured']} received but not written at stop)"
    t.note += f" wrote {written / 2**20:.0f} MiB"


# -- the search ------------------------------------------------------------------------------
class Search:
    def __init__(self, lab, wl, a, dp, tmp, hosts: int):
        self.lab, self.wl, self.a, self.dp, self.tmp, self.hosts = lab, wl, a, dp, tmp, hosts
        self.trials: list[Trial] = []
        self.t0 = time.time()

    def iterations_for(self, total_pps: float) -> int:
        want = total_pps * self.a.duration / self.wl.per_iteration()
        return max(2, min(self.wl.iterations, math.ceil(want)))

    def run(self, capturers: list[str], total_pps: float) -> dict[str, Trial]:
        out = {}
        n = self.iterations_for(total_pps)
        per_host = total_pps / self.hosts
        for c in capturers:
            t = Trial(c, total_pps, n)
            if c == "daemon":
                trial_daemon(self.lab, self.wl, self.a, self.dp, t, per_host, self.tmp)
            else:
                trial_tcpdump(self.lab, self.wl, self.a, t, per_host, self.tmp)
            if t.failed:
                t.note += f" sender gave up on {t.failed} frames"
            if t.arrived != t.expected:
                t.note += f" mirror links delivered {t.arrived} of {t.expected} frames"
            self.trials.append(t)
            out[c] = t
            print(f"  [{time.time() - self.t0:5.0f} s] {row(t)}", flush=True)
        return out

    def search(self, capturers: list[str]):
        a = self.a
        best = {c: None for c in capturers}      # highest passing trial
        fail = {c: None for c in capturers}      # lowest failing target
        capped = {c: False for c in capturers}   # passed at a sender-limited step
        rate = a.start_pps * self.hosts
        active = list(capturers)
        print("doubling:", flush=True)
        while active and rate <= a.max_pps:
            res = self.run(active, rate)
            for c, t in res.items():
                if t.ok:
                    best[c] = t
                    if t.sender_limited:
                        capped[c] = True
                        active.remove(c)
                else:
                    fail[c] = rate
                    active.remove(c)
            rate *= 2
        print("bisection:", flush=True)
        for _ in range(a.bisect):
            groups: dict[float, list[str]] = {}
            for c in capturers:
                if capped[c] or fail[c] is None:
                    continue
                lo = best[c].target_pps if best[c] else 0.0
                hi = fail[c]
                if lo and hi / lo <= 1 + a.tolerance:
                    continue
                mid = math.sqrt(lo * hi) if lo else hi / 2
                mid = round(mid / 100) * 100
                groups.setdefault(mid, []).append(c)
            if not groups:
                break
            for mid, cs in sorted(groups.items()):
                res = self.run(cs, mid)
                for c, t in res.items():
                    if t.ok:
                        best[c] = t
                        if t.sender_limited:
                            capped[c] = True
                    else:
                        fail[c] = mid
        return best, fail, capped


def row(t: Trial) -> str:
    flag = " sender-limited" if t.sender_limited else ""
    com = f" committed {t.committed}/{t.iterations}" if t.committed is not None else ""
    return (f"{t.capturer:7s} target {t.target_pps:8.0f} pps  sent {t.pps:8.0f} pps {t.gbps:5.2f} Gb/s"
            f" in {t.seconds:4.1f} s (mirrored {t.mirror_pps:8.0f} pps {t.mirror_gbps:5.2f} Gb/s)"
            f"  kernel {t.packets} pkts, drops {t.drops}{com}{flag}{t.note}")


def result_line(c, best, fail, capped) -> str:
    t = best[c]
    if t is None:
        return f"{c}: dropped already at the first step ({fail[c]:.0f} pps)"
    if capped[c]:
        return (f"{c}: >= {t.pps:.0f} pps, {t.gbps:.2f} Gb/s sent ({t.mirror_pps:.0f} pps, "
                f"{t.mirror_gbps:.2f} Gb/s captured) -- the sender's limit, no drops there")
    hi = f", drops at {fail[c]:.0f} pps target" if fail[c] else " (search ended at --max-pps)"
    return (f"{c}: {t.pps:.0f} pps, {t.gbps:.2f} Gb/s sent ({t.mirror_pps:.0f} pps, "
            f"{t.mirror_gbps:.2f} Gb/s captured) with zero drops{hi}")


def markdown(trials: list[Trial]) -> str:
    lines = ["| capturer | target pps | sent pps | sent Gb/s | captured pps | captured Gb/s | s | kernel packets | drops | committed | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in trials:
        note = ("sender-limited; " if t.sender_limited else "") + t.note.strip()
        com = f"{t.committed}/{t.iterations}" if t.committed is not None else ""
        lines.append(f"| {t.capturer} | {t.target_pps:.0f} | {t.pps:.0f} | {t.gbps:.2f} | {t.mirror_pps:.0f} | "
                     f"{t.mirror_gbps:.2f} | {t.seconds:.1f} | {t.packets} | {t.drops} | {com} | {note} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help="synth model size (tiny|small|default)")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of traffic per step at its target rate")
    ap.add_argument("--start-pps", type=float, default=1000, help="first step, per host (4 hosts)")
    ap.add_argument("--max-pps", type=float, default=400_000, help="highest total rate the doubling tries")
    ap.add_argument("--pool-pps", type=float, default=100_000,
                    help="synthesize enough frames for this total rate x duration (faster targets send the pool)")
    ap.add_argument("--bisect", type=int, default=4, help="bisection rounds after the doubling")
    ap.add_argument("--tolerance", type=float, default=0.1, help="stop bisecting when hi/lo <= 1 + this")
    ap.add_argument("--block-kb", type=int, default=256, help="ring block size (KiB)")
    ap.add_argument("--block-nr", type=int, default=8, help="blocks per ring (ring = block-kb x block-nr per interface; tcpdump -B the same)")
    ap.add_argument("--tcpdump-filter", default=TCPDUMP_FILTER, help="'' for none")
    ap.add_argument("--only", choices=("daemon", "tcpdump"), help="measure one capturer only")
    ap.add_argument("--pipeline", choices=("fast", "reference"), default="fast",
                    help="the daemon's pipeline: fast (FastPipeline, its default for RoCE) or reference (Pipeline)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "ckptd-capture-rate"),
                    help="synthesized scenarios are kept here and reused")
    ap.add_argument("--json", help="also write every trial here")
    a = ap.parse_args(argv)

    from ckptd.testing import netlab
    from ckptd.testing.netlab import NetLab
    reason = netlab.lab_unavailable()
    if reason:
        sys.exit(f"capture_rate needs network namespaces: {reason}")
    capturers = [a.only] if a.only else ["daemon", "tcpdump"]
    if "tcpdump" in capturers and not shutil.which("tcpdump"):
        sys.exit("tcpdump is not installed (apt-get install -y tcpdump), or pass --only daemon")

    t_start = time.time()
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}"
          + (f"; daemon pipeline: {a.pipeline}" if "daemon" in capturers else ""), flush=True)
    # Frames per iteration of this scenario: from a short synth (cheap), then the pool.
    probe = load_workload(ensure_synth(a, 4))
    need = math.ceil(a.pool_pps * a.duration / probe.per_iteration()) + 1
    print(f"workload: {a.model} model, {probe.per_iteration():.0f} host frames per iteration; "
          f"synthesizing {need} iterations", flush=True)
    wl = load_workload(ensure_synth(a, need))
    ring_bytes = a.block_kb * 1024 * a.block_nr
    ring_frames = ring_bytes / wl.avg_mirror_slot
    print(f"pool: {wl.iterations} iterations, {wl.sent_frames(wl.iterations)} host frames, "
          f"{wl.mirror_frames[-1]} mirrored frames, mean frame {wl.mirror_bytes[-1] / wl.mirror_frames[-1]:.0f} B; "
          f"ring {a.block_nr} x {a.block_kb} KiB per interface, ~{ring_frames:.0f} frames "
          f"(all {wl.mirrors} rings together can hide a deficit of ~{ring_frames * wl.mirrors / a.duration:.0f} "
          f"captured pps over a {a.duration:g} s step)"
          f" [{time.time() - t_start:.0f} s]", flush=True)

    dp = DaemonProc() if "daemon" in capturers else None
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-caprate-", dir="/dev/shm"))
    prefix = netlab.unique_prefix()
    try:
        from ckptd.core.plan import load_plan
        with NetLab(load_plan(wl.run / "plan.json"), prefix=prefix) as lab:
            lab.learn(wl.frames)
            s = Search(lab, wl, a, dp, tmp, hosts=len(lab.hosts))
            best, fail, capped = s.search(capturers)
    finally:
        if dp:
            dp.close()
        shutil.rmtree(tmp, ignore_errors=True)
        left = netlab.down(prefix, exact=True)
        if left:
            print(f"removed leftover namespaces {left}", file=sys.stderr)

    print(f"\nsteps ({len(s.trials)} trials, {time.time() - t_start:.0f} s in all; "
          f"load average now {os.getloadavg()[0]:.2f}):")
    for t in s.trials:
        print("  " + row(t))
    print()
    for c in capturers:
        print(result_line(c, best, fail, capped))
    if len(capturers) == 2 and best["daemon"] and best["tcpdump"]:
        r = best["daemon"].pps / best["tcpdump"].pps
        how = {(False, False): "", (False, True): " at most (tcpdump reached the sender's limit)",
               (True, False): " at least (the daemon reached the sender's limit)",
               (True, True): " (both reached the sender's limit: no ranking)"}[(capped["daemon"], capped["tcpdump"])]
        print(f"daemon / tcpdump: {r:.2f}{how}")
    print("\n" + markdown(s.trials))
    if a.json:
        Path(a.json).write_text(json.dumps({
            "machine": machine(), "args": vars(a),
            "trials": [{**t.__dict__, "pps": t.pps, "gbps": t.gbps, "mirror_pps": t.mirror_pps,
                        "mirror_gbps": t.mirror_gbps, "sender_limited": t.sender_limited, "ok": t.ok}
                       for t in s.trials],
            "best": {c: (best[c].__dict__ if best[c] else None) for c in capturers},
            "capped": capped, "fail": fail}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
