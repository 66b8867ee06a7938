"""What the daemon serves: /status (JSON), /metrics (Prometheus) and, from the memory
tier, /checkpoint; over ckptd.live.serve.HttpServer, 127.0.0.1 by default.

The daemon's loop publishes a snapshot (a plain dict) after every iteration and every
few thousand frames; the HTTP thread only ever reads the latest snapshot, so a scrape
never blocks or races the capture path.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ckptd.core.raw_layout import MEDIA_TYPE
from ckptd.live.serve import Response, text

CHUNK = 1 << 23
# an absolute path's directories (its file name stays); not a URL's path (s3://b/p/x)
_DIRS = re.compile(r"(?<![\w:/.])(/[^\s/:]+)+/")


class Snapshot:
    def __init__(self):
        self._lock = threading.Lock()
        self._doc: dict = {"state": "starting"}
        self.published = time.monotonic()  # when the last one was published

    def publish(self, doc: dict):
        with self._lock:
            self._doc = doc
            self.published = time.monotonic()

    def get(self) -> dict:
        with self._lock:
            return self._doc


class LoopClock:
    """Where the capture loop's time goes, for /status `loop`: the wall time since it
    started, its thread's CPU time, the time it slept in poll(2) for want of traffic
    (`idle_s`), and the rest (`waiting_s`): runnable or blocked on something other than
    traffic -- the GIL while another thread of the daemon runs Python (the optimizer's,
    the persistence writer's), or a CPU that other work holds. `runqueue_s` is the time
    the kernel kept it runnable with no CPU to run on (/proc/thread-self/schedstat's run
    delay; None where the kernel keeps none): other processes or threads held every CPU
    it may use. It overlaps the others: a wake-up from poll(2) that waits for a CPU is in
    `idle_s` (poll's clock), one in the middle of work in `waiting_s`; so
    wall - cpu - runqueue is the time it slept, for traffic, the GIL or a commit. A loop
    whose rings drop frames while it is runnable without a CPU a large share of its time
    needs cores of its own (`cpus`), not a bigger ring (docs/DAEMON.md). Sampled on the
    loop's own thread (its CPU clock and its schedstat are per thread), read by anyone."""

    def __init__(self):
        self._thread: int | None = None
        self._t0 = self._c0 = 0.0
        self._r0: float | None = None
        self.idle_s = 0.0
        self._last: dict | None = None

    def start(self):
        self._thread = threading.get_ident()
        self._t0, self._c0, self._r0 = time.monotonic(), time.thread_time(), run_delay()
        self.idle_s = 0.0

    def polled(self, seconds: float):
        self.idle_s += seconds

    def sample(self) -> dict | None:
        """The figures now, if called on the loop's thread; else the last ones."""
        if self._thread is not None and threading.get_ident() == self._thread:
            wall, cpu = time.monotonic() - self._t0, time.thread_time() - self._c0
            delay = run_delay()
            self._last = {"wall_s": round(wall, 6), "cpu_s": round(cpu, 6), "idle_s": round(self.idle_s, 6),
                          "waiting_s": round(max(0.0, wall - cpu - self.idle_s), 6),
                          "runqueue_s": (round(delay - self._r0, 6) if delay is not None and self._r0 is not None
                                         else None)}
        return self._last


def run_delay() -> float | None:
    """Seconds the calling thread has spent runnable, waiting for a CPU (the second field
    of /proc/thread-self/schedstat, in ns), or None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class _Collector:
    """Prometheus metrics read from the snapshot at scrape time."""

    def __init__(self, snap: Snapshot):
        self.snap = snap

    def collect(self):
        doc = self.snap.get()
        g = GaugeMetricFamily("ckptd_last_committed_iteration", "Last iteration committed exactly (-1: none)")
        g.add_metric([], doc.get("last_committed", -1))
        yield g
        c = CounterMetricFamily("ckptd_iterations", "Iterations finalized, by outcome", labels=["status"])
        for status, n in doc.get("iterations_by_status", {}).items():
            c.add_metric([status], n)
        yield c
        c = CounterMetricFamily("ckptd_late_copies", "Copies of iterations already finalized, never compared with "
                                "what was committed (a mirror stream more than agree_window_ms behind the others?)")
        c.add_metric([], doc.get("late_copies", 0))
        yield c
        first = doc.get("unverified_from")
        g = GaugeMetricFamily("ckptd_unverified_from_iteration", "The first committed iteration a mirror stream's "
                              "copies came after, never compared; every later one stems from it (-1: none)")
        g.add_metric([], -1 if first is None else first)
        yield g
        div = doc.get("diverged")
        g = GaugeMetricFamily("ckptd_diverged_since_iteration", "The first committed iteration whose parameters "
                              "hold NaN or inf (-1: they are finite)")
        g.add_metric([], div["since"] if div else -1)
        yield g
        yield from _checkpoint_metrics(doc.get("checkpoints"))
        notice = doc.get("notice")
        if notice:
            c = CounterMetricFamily("ckptd_notice_events", "Announcements (unrecoverable iterations, a divergence) "
                                    "by outcome: sent, failed (after every retry), dropped (queue full)",
                                    labels=["outcome"])
            for outcome in ("sent", "failed", "dropped"):
                c.add_metric([outcome], notice.get(outcome, 0))
            yield c
        lag = GaugeMetricFamily("ckptd_commit_lag_seconds", "Last iteration's last packet to its commit")
        lag.add_metric([], doc.get("commit_lag_s") or 0.0)
        yield lag
        frames = CounterMetricFamily("ckptd_stream_frames", "Frames captured per mirror stream", labels=["stream"])
        loss = GaugeMetricFamily("ckptd_stream_loss_ratio", "Packet loss seen on the last iteration", labels=["stream"])
        cov = GaugeMetricFamily("ckptd_stream_coverage_ratio", "Gradient coverage of the last iteration", labels=["stream"])
        for s in doc.get("streams", []):
            frames.add_metric([s["name"]], s.get("frames", 0))
            loss.add_metric([s["name"]], s.get("loss") or 0.0)
            cov.add_metric([s["name"]], s.get("coverage") or 0.0)
        yield frames
        yield loss
        yield cov
        drops = CounterMetricFamily("ckptd_capture_drops", "Kernel ring drops (PACKET_STATISTICS)", labels=["interface"])
        pkts = CounterMetricFamily("ckptd_capture_packets", "Kernel ring packets", labels=["interface"])
        fill = GaugeMetricFamily("ckptd_ring_peak_fill_ratio", "The most of a capture ring ever found filled "
                                 "and waiting for the daemon (1: full, frames were dropped)", labels=["interface"])
        lost = CounterMetricFamily("ckptd_interface_dropped", "Frames the interface lost before any capture "
                                   "ring saw them (rx_dropped + rx_missed_errors + rx_fifo_errors, /proc/net/dev) "
                                   "since the daemon started", labels=["interface"])
        for name, st in doc.get("capture", {}).items():
            drops.add_metric([name], st.get("drops", 0))
            pkts.add_metric([name], st.get("packets", 0))
            ring = st.get("ring") or {}
            if ring.get("blocks"):
                fill.add_metric([name], ring["ready_peak"] / ring["blocks"])
            nic = st.get("interface")
            if nic:
                lost.add_metric([name], nic["dropped"] + nic["fifo"])
        yield drops
        yield pkts
        yield fill
        yield lost
        loop = doc.get("loop")
        if loop:  # /status `loop` (LoopClock): rate(...) of a part is its share of a second
            parts = CounterMetricFamily("ckptd_loop_seconds", "The capture loop's time since it started: cpu, idle "
                                        "(poll(2)), waiting (the rest); runqueue (runnable with no CPU) overlaps them",
                                        labels=["part"])
            for part in ("cpu", "idle", "waiting", "runqueue"):
                if loop.get(f"{part}_s") is not None:
                    parts.add_metric([part], loop[f"{part}_s"])
            yield parts


def _checkpoint_metrics(st: dict | None):
    """The checkpoint writes (/status `checkpoints`), so that a full or unreachable disk
    can be alerted on like a capture drop: the shadow stays exact in memory meanwhile, and
    only the log and /status said so."""
    if not st:
        return
    g = GaugeMetricFamily("ckptd_checkpoint_writes_failing", "1 while checkpoint writes fail (retried with "
                          "back-off), else 0")
    g.add_metric([], 1 if st.get("state") == "failing" else 0)
    yield g
    g = GaugeMetricFamily("ckptd_last_persisted_iteration", "The newest iteration whose checkpoint is written "
                          "(-1: none yet)")
    g.add_metric([], -1 if st.get("last_persisted") is None else st["last_persisted"])
    yield g
    c = CounterMetricFamily("ckptd_checkpoint_write_failures", "Checkpoint write attempts that failed")
    c.add_metric([], st.get("write_failures", 0))
    yield c
    c = CounterMetricFamily("ckptd_checkpoints_not_persisted", "Commits whose own checkpoint was never written")
    c.add_metric([], st.get("not_persisted", 0))
    yield c


def redact(doc: dict) -> dict:
    """/status without the host's absolute paths or the model's parameter names (a
    non-loopback listener may be reachable by more than the operator); `status_details:
    true` serves the document whole."""
    doc = dict(doc)
    if doc.get("last_checkpoint"):
        doc["last_checkpoint"] = os.path.basename(doc["last_checkpoint"])
    if doc.get("checkpoints") and doc["checkpoints"].get("last_error"):
        doc["checkpoints"] = dict(doc["checkpoints"], last_error=_DIRS.sub("", doc["checkpoints"]["last_error"]))
    if doc.get("checkpoints") and doc["checkpoints"].get("store") and "://" not in doc["checkpoints"]["store"]:
        doc["checkpoints"] = dict(doc["checkpoints"], store="local directory")  # a URL (persist_url) stays
    doc["unrecoverable"] = [dict(u, note=_DIRS.sub("", u.get("note", "")),
                                 missing=[{k: v for k, v in m.items() if k != "params"}
                                          for m in u.get("missing", [])])
                            for u in doc.get("unrecoverable", [])]
    return doc


def routes(snap: Snapshot, details: bool = False, checkpoints=None, live=None) -> dict:
    """The daemon's routes for ckptd.live.serve.HttpServer: /status, /metrics, and with a
    memory tier (`checkpoints`: path -> handler) /checkpoint and /checkpoint/<iteration>.
    `live()`, if given, adds fields read at request time to /status."""
    registry = CollectorRegistry()
    registry.register(_Collector(snap))

    def status(_, __):
        doc = snap.get()
        if live is not None:
            doc = {**doc, **live()}
        doc = doc if details else redact(doc)
        return Response(200, json.dumps(doc, indent=1).encode(), "application/json")

    def metrics(_, __):
        return Response(200, generate_latest(registry), "text/plain; version=0.0.4")
    return {"/status": status, "/metrics": metrics, **(checkpoints or {})}


def checkpoint_routes(tier, names: list[str], hyper_for, plan_hash: str | None,
                      unverified_from=lambda: None) -> dict:
    """GET /checkpoint: the latest committed state; /checkpoint/<iteration>: that one, if
    the memory tier still holds it (the latest or the one before). The body is a torch.save
    of the trainer format (ckptd.core.formats.torch_doc), sent in chunks; the headers name
    the iteration (X-Ckptd-Iteration) and the body's SHA-256 (X-Ckptd-SHA256). A request
    with `Accept: application/x-ckptd-raw` (ckptd.restore's) gets the raw layout instead
    (ckptd.core.raw_layout: a JSON header, then each tensor's bytes, straight from the
    held tensors: nothing encoded, nothing copied). `unverified_from()`: the first
    iteration found unverified (Pipeline.copies_seen), or None: that state and every
    later one is refused, 409, never handed to a trainer as good."""
    def send(held, headers):
        if held is None:
            return text(404, "no committed iteration in memory yet")
        first = unverified_from()
        if first is not None and held.iteration >= first:
            return text(409, f"iteration {held.iteration} is unverified: iteration {first} was committed without "
                             "a mirror stream's copies, which came after and were never compared, and every later "
                             "state stems from it (/status unverified)")
        if MEDIA_TYPE in headers.get("accept", ""):  # the lr its step used, as in ckptd's files
            head, parts = held.raw(names, (held.optimizer or {}).get("lr"), plan_hash)
            return Response(200, _raw_chunks(head, parts), MEDIA_TYPE,
                            length=len(head) + sum(p.nbytes for p in parts),
                            headers={"X-Ckptd-Iteration": str(held.iteration)})
        # torch's param_groups and scheduler state after the state's step (formats.trainer_hyper)
        data, digest = held.encoded(names, lambda: hyper_for(held), plan_hash)
        view = memoryview(data)
        return Response(200, (view[i:i + CHUNK] for i in range(0, len(view), CHUNK)),
                        "application/octet-stream", length=len(data),
                        headers={"X-Ckptd-Iteration": str(held.iteration), "X-Ckptd-SHA256": digest})

    def latest(_, headers):
        return send(tier.latest(), headers)

    def one(arg, headers):
        if not re.fullmatch(r"[0-9]{1,18}", arg):  # ASCII digits only: int() takes others
            return text(404, f"/checkpoint/{arg[:40]}: not an iteration number")
        held = tier.get(int(arg))
        if held is None:
            return text(404, f"iteration {int(arg)} is not in memory (held: {tier.iterations()})")
        return send(held, headers)
    return {"/checkpoint": latest, "/checkpoint/": one}


def _raw_chunks(head: bytes, parts: list[memoryview]):
    yield head
    for p in parts:
        for i in range(0, p.nbytes, CHUNK):
            yield p[i:i + CHUNK]
