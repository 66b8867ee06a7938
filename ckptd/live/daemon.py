"""`ckptd run --config FILE`: the long-running daemon on a mirror-port host.

The same pipeline as `ckptd replay` (ckptd.pipeline), fed by capture rings instead of
files; the daemon's features plug in around that one loop:

    capture   ckptd.live.ring.RingCapture per configured interface (one per mirror port)
    fast      with `fast` (the default for RoCE plans) ckptd.fast.pipeline.FastPipeline runs
              the pipeline: ring blocks go to its Cython kernel as Batches (same reports
              and checkpoints as the reference Pipeline, which gloo plans always use)
    status    ckptd.live.status: /status and /metrics, from snapshots the loop publishes
    keep      checkpoint files, written by the pipeline as iterations commit
    logs      one JSON object per line on stderr, warnings only unless asked

SIGINT/SIGTERM stop it cleanly: capture stops, what the rings already hold is
processed, complete iterations are committed, the iteration in flight is reported as
abandoned (with how much of it was missing), and the last exact checkpoint stays.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.checkpoint import checkpoint_name, load_checkpoint
from ckptd.pipeline import IterationReport, Pipeline, ReplayOptions
from ckptd.core.plan import PlanError, load_plan
from ckptd.live.status import Snapshot, StatusServer
from ckptd.errors import CkptdError

log = logging.getLogger("ckptd")
SNAPSHOT_EVERY = 4096  # frames between status snapshots while an iteration is in flight
SOURCE_CHUNK = 128  # fast path: frames per Batch from a frame-by-frame source (tests, replays)
KEEP_REPORTS = 1000
DROPS_LOOK_S = 0.05  # the rings' drop counters are read at most this often (and at each loss)


class ConfigError(CkptdError, ValueError):
    """A daemon config that cannot be used; the message names the file and the key."""


@dataclass
class InterfaceConfig:
    name: str  # the mirror stream's name (as in the plan's mirrors, ideally)
    ifname: str
    netns: str | None = None
    block_size: int = 1 << 22
    block_nr: int = 64
    frame_size: int = 16384
    retire_ms: int = 20
    snaplen: int = 65535
    fanout_group: int | None = None  # several interfaces' rings can share one fanout group
    fanout_mode: str = "hash"
    cpu: int | None = None  # capture_workers: the CPU this interface's worker is pinned to


@dataclass
class DaemonConfig:
    plan: str
    init: str
    out: str
    interfaces: list[InterfaceConfig]
    listen: str = "127.0.0.1:9187"
    log_level: str = "warning"
    resume: str | None = None
    dump_gradients: str | None = None
    fast: bool | None = None  # None: the fast path when the plan's transport is "roce"
    join: bool = False  # the job may already be running: align by PSN arithmetic
    join_from: int | None = None  # joining: an iteration the job has surely reached
    capture_workers: bool = False  # one capture process per interface (ckptd.live.workers)
    busy_poll: bool = False  # capture workers spin on their ring instead of sleeping in poll(2)
    cpus: list[int] | None = None  # the daemon's own process (the coordinator) is pinned to these
    extra: dict = field(default_factory=dict)


def load_config(path: str | Path) -> DaemonConfig:
    """YAML (.yaml/.yml) or TOML (.toml); docs/DAEMON.md documents every key."""
    path = Path(path)
    try:
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib
            doc = tomllib.loads(text)
        else:
            import yaml
            doc = yaml.safe_load(text)
    except Exception as e:
        raise ConfigError(f"{path}: cannot read config: {e}") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the config must be a mapping")
    base = path.parent

    def need(key):
        if key not in doc:
            raise ConfigError(f"{path}: missing {key!r}")
        return doc[key]

    def rel(p):
        return None if p is None else str((base / p) if not Path(p).is_absolute() else Path(p))

    ifs = []
    for i, x in enumerate(need("interfaces") or []):
        if not isinstance(x, dict) or "ifname" not in x:
            raise ConfigError(f"{path}: interfaces[{i}] needs at least 'ifname'")
        unknown = set(x) - set(InterfaceConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"{path}: interfaces[{i}] has unknown keys {sorted(unknown)}")
        ifs.append(InterfaceConfig(**{"name": x.get("name", x["ifname"]), **x}))
    if not ifs:
        raise ConfigError(f"{path}: 'interfaces' lists no mirror port to capture")
    known = {"plan", "init", "out", "interfaces", "listen", "log_level", "resume", "dump_gradients",
             "fast", "join", "join_from", "capture_workers", "busy_poll", "cpus"}
    unknown = set(doc) - known
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    fast = doc.get("fast")
    if fast is not None and not isinstance(fast, bool):
        raise ConfigError(f"{path}: 'fast' must be true or false, not {fast!r}")
    join, join_from = doc.get("join", False), doc.get("join_from")
    if not isinstance(join, bool):
        raise ConfigError(f"{path}: 'join' must be true or false, not {join!r}")
    if join_from is not None and (isinstance(join_from, bool) or not isinstance(join_from, int)):
        raise ConfigError(f"{path}: 'join_from' must be an iteration number, not {join_from!r}")
    workers = _capture_config(path, doc, ifs)
    return DaemonConfig(plan=rel(need("plan")), init=rel(need("init")), out=rel(need("out")),
                        interfaces=ifs, listen=str(doc.get("listen", "127.0.0.1:9187")),
                        log_level=str(doc.get("log_level", "warning")),
                        resume=rel(doc.get("resume")), dump_gradients=rel(doc.get("dump_gradients")),
                        fast=fast, join=join or join_from is not None, join_from=join_from, **workers)


def _capture_config(path, doc: dict, ifs: list[InterfaceConfig]) -> dict:
    """capture_workers, busy_poll, cpus and the interfaces' cpu, checked."""
    out = {}
    for key in ("capture_workers", "busy_poll"):
        v = doc.get(key, False)
        if not isinstance(v, bool):
            raise ConfigError(f"{path}: {key!r} must be true or false, not {v!r}")
        out[key] = v
    ncpu = os.cpu_count() or 1

    def cpu_ok(c):
        return isinstance(c, int) and not isinstance(c, bool) and 0 <= c < ncpu
    cpus = doc.get("cpus")
    if cpus is not None and (not isinstance(cpus, list) or not cpus or not all(map(cpu_ok, cpus))):
        raise ConfigError(f"{path}: 'cpus' must be a list of CPU numbers 0..{ncpu - 1}, not {cpus!r}")
    out["cpus"] = cpus
    for k, i in enumerate(ifs):
        if i.cpu is not None and not cpu_ok(i.cpu):
            raise ConfigError(f"{path}: interfaces[{k}].cpu must be a CPU number 0..{ncpu - 1}, not {i.cpu!r}")
        if i.cpu is not None and not out["capture_workers"]:
            raise ConfigError(f"{path}: interfaces[{k}].cpu pins a capture worker: set capture_workers: true")
    if out["busy_poll"] and not out["capture_workers"]:
        raise ConfigError(f"{path}: busy_poll applies to capture workers: set capture_workers: true")
    if out["capture_workers"] and doc.get("fast") is False:
        raise ConfigError(f"{path}: capture_workers feed the fast path: they cannot be used with fast: false")
    return out


class JsonFormatter(logging.Formatter):
    def format(self, record):
        doc = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        return json.dumps(doc)


def setup_logging(level: str):
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    log.handlers[:] = [h]
    log.setLevel(level.upper())
    log.propagate = False


class Daemon:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        try:
            self.plan = load_plan(cfg.plan)
        except PlanError as e:
            raise ConfigError(str(e)) from e
        self.start_state = load_checkpoint(cfg.init)
        self.names = [i.name for i in cfg.interfaces]
        self.stop = threading.Event()
        self.snapshot = Snapshot()
        self.captures: list = []  # RingCapture, or WorkerCapture with capture_workers
        self.workers = None  # ckptd.live.workers.CaptureWorkers with capture_workers
        self.frames = 0
        self.by_status: dict[str, int] = {}
        self.last_report: IterationReport | None = None
        self.unrecovered: list[dict] = []
        self.started = time.time()
        self._join_logged = False
        self.drop_iterations: set[int] = set()  # iterations in flight while the kernel dropped
        self._drops_seen = 0  # kernel drops over all rings at the last look
        self._drops_done = -1  # the pipeline's last finished iteration at the last look
        self._drops_looked = 0.0  # time.monotonic() of the last look
        opts = ReplayOptions(out=cfg.out, resume=cfg.resume, dump_gradients=cfg.dump_gradients,
                             join=cfg.join, join_from=cfg.join_from)
        self.fast = (self.plan.transport == "roce") if cfg.fast is None else bool(cfg.fast)
        if self.fast and self.plan.transport != "roce":
            raise ConfigError(f"fast: true needs a RoCE plan; this plan's transport is "
                              f"{self.plan.transport} (set fast: false)")
        if cfg.capture_workers and not self.fast:
            raise ConfigError("capture_workers feed the fast path, which decodes RoCE only; "
                              f"this plan's transport is {self.plan.transport}")
        if self.fast:
            from ckptd.fast.pipeline import FastPipeline
            self.pipe = FastPipeline(self.plan, self.start_state, len(cfg.interfaces), opts,
                                     on_iteration=self._on_iteration, keep_reports=KEEP_REPORTS)
        else:
            self.pipe = Pipeline(self.plan, self.start_state, len(cfg.interfaces), opts,
                                 on_iteration=self._on_iteration, keep_reports=KEEP_REPORTS)

    # -- feature hooks on the core loop ----------------------------------------------
    def _on_iteration(self, rep: IterationReport):
        self._mark_kernel_drops(rep)
        self.by_status[rep.status] = self.by_status.get(rep.status, 0) + 1
        self.last_report = rep
        fields = {"iteration": rep.iteration, "status": rep.status, "packets": rep.packets,
                  "coverage": [round(c, 6) for c in rep.coverage], "note": rep.note.strip()}
        if rep.commit_lag is not None:
            fields["commit_lag_s"] = round(rep.commit_lag, 6)
        if rep.write_seconds is not None:
            fields["write_s"] = round(rep.write_seconds, 6)
        if rep.status == "committed":
            log.info("committed", extra={"fields": fields})
        else:
            fields["missing"] = [{"bucket": m.bucket, "start": m.start, "end": m.end,
                                  "params": [list(p) for p in m.params][:8]} for m in rep.missing[:50]]
            self.unrecovered.append(fields)
            del self.unrecovered[:-100]
            log.warning("iteration not recovered", extra={"fields": fields})
        self._publish()

    def _counting(self, source):
        for k, fr in source:
            self.frames += 1
            if self.frames % SNAPSHOT_EVERY == 0:
                self._watch_drops()
                self._publish()
            yield k, fr
        self._watch_drops(force=True)

    # -- kernel ring drops -------------------------------------------------------------
    def _watch_drops(self, force: bool = False):
        """Look at the rings' kernel drop counters (PACKET_STATISTICS). Drops since the
        last look may have hit any iteration in flight since then, or the next one,
        whose first frames may be the ones lost: all of them are remembered, so that
        those that end incomplete are reported as lost to kernel drops, not abandoned."""
        if not self.captures:
            return
        now = time.monotonic()
        if not force and now - self._drops_looked < DROPS_LOOK_S:
            return
        self._drops_looked = now
        total = sum(c.stats()["drops"] for c in self.captures)
        if total > self._drops_seen:
            off = self.pipe.offset
            self.drop_iterations.update(range(self._drops_done + 1 + off, self.pipe.highest + 2 + off))
            self._drops_seen = total
        self._drops_done = self.pipe.done

    def _mark_kernel_drops(self, rep: IterationReport):
        """An iteration that did not commit and was in flight while a ring dropped frames
        lost data to the kernel: status `dropped` (exit status 4), whatever else it
        would have been called (a stop mid-iteration calls it abandoned). The counters
        are read again first: the drops may have happened in the batch that ends it."""
        if rep.status in ("abandoned", "unrecoverable"):
            self._watch_drops(force=True)
        if rep.status in ("abandoned", "unrecoverable") and rep.iteration in self.drop_iterations:
            drops = {c.ifname: c.stats()["drops"] for c in self.captures if c.stats()["drops"]}
            rep.note = (f"{rep.status}: the kernel dropped frames while it was in flight "
                        f"(ring drops so far: {drops}); {rep.note.strip()}")
            rep.status = "dropped"

    def _frame_batches(self, source):
        """Fast path, a frame-by-frame source (tests, replays): Batches of SOURCE_CHUNK
        frames, in order."""
        from ckptd.fast.batches import batch_from_frames
        chunk: list = []
        for item in source:
            chunk.append(item)
            if len(chunk) == SOURCE_CHUNK:
                yield batch_from_frames(chunk)
                chunk = []
        if chunk:
            yield batch_from_frames(chunk)

    def _ring_batches(self):
        """Fast path on the capture rings: each retired block as a Batch indexed in
        place (ckptd.live.ring.ring_batches), or as the capture workers copy it out
        (ckptd.live.workers); the block or slot is given back when the next one is
        asked for, i.e. once run_batch has placed it. Kernel drops are looked at
        before each batch."""
        from ckptd.live.ring import ring_batches
        if self.workers is not None:
            batches = self.workers.batches(self.stop, self.pipe.errors)
        else:
            batches = ring_batches(self.captures, self.stop, self.pipe.errors)
        reported = len(self.pipe.errors)
        for _, batch in batches:
            self._watch_drops()
            if len(self.pipe.errors) > reported:  # e.g. a capture worker died: say so now
                for e in self.pipe.errors[reported:]:
                    log.error("capture error", extra={"fields": {"error": e}})
                reported = len(self.pipe.errors)
                self._publish()
            yield batch
        self._watch_drops(force=True)

    def _run_fast(self, batches):
        for batch in batches:
            before = self.frames
            self.frames += len(batch)
            self.pipe.run_batch(batch)
            if self.frames // SNAPSHOT_EVERY != before // SNAPSHOT_EVERY:
                self._publish()
        self.pipe.finish(abandon=True)

    def _publish(self, state: str = "running"):
        if self.pipe.joined is not None and not self._join_logged:
            self._join_logged = True
            log.info("joined the running job", extra={"fields": {
                "iteration": self.pipe.joined, "packets_before": self.pipe.before_join}})
        committed = [r for r in self.pipe.reports if r.status == "committed"]
        last = self.last_report
        streams = []
        for k, name in enumerate(self.names):
            cls = self.pipe.classes[k]
            streams.append({"name": name, "frames": cls.get("frames", 0),
                            "classes": {c: v for c, v in cls.items() if c != "frames"},
                            "coverage": last.coverage[k] if last and last.coverage else None,
                            "loss": last.loss[k] if last and last.loss else None})
        doc = {
            "state": state, "uptime_s": round(time.time() - self.started, 3),
            "last_committed": committed[-1].iteration if committed else -1,
            "last_checkpoint": (str(Path(self.cfg.out) / checkpoint_name(committed[-1].iteration))
                                if committed else None),
            "commit_lag_s": committed[-1].commit_lag if committed else None,
            "checkpoint_write_s": committed[-1].write_seconds if committed else None,
            "iterations_by_status": dict(self.by_status),
            "shadow_stopped_after": self.pipe.stopped_after,
            "join": ({"joining": self.pipe.joining, "joined_at": self.pipe.joined,
                      "packets_before": self.pipe.before_join} if self.cfg.join else None),
            "streams": streams,
            "capture": {c.ifname: {k: st[k] for k in ("packets", "drops", "delivered", "worker") if k in st}
                        for c, st in ((c, c.stats()) for c in self.captures)},
            "extraction": dict(self.pipe.extract.counters),
            "pipeline": self._pipeline_stats(),
            "unrecoverable": self.unrecovered[-20:],
        }
        self.snapshot.publish(doc)

    def _pipeline_stats(self) -> dict:
        if not self.fast:
            return {"fast": False}
        p = self.pipe
        return {"fast": True, "kernel_frames": p.kernel_frames,
                "python_frames": sum(p.stops.values()) - p.stops.get("complete", 0)
                - p.stops.get("conflicts_full", 0),
                "kernel_seconds": round(p.kernel_seconds, 6), "stops": dict(p.stops)}

    # -- running ---------------------------------------------------------------------
    def open_captures(self):
        if self.cfg.capture_workers:
            self._open_workers()
            return
        from ckptd.live.ring import RingCapture
        for i in self.cfg.interfaces:
            fanout = None if i.fanout_group is None else (i.fanout_group, i.fanout_mode)
            self.captures.append(RingCapture(i.ifname, i.netns, block_size=i.block_size,
                                             block_nr=i.block_nr, frame_size=i.frame_size,
                                             retire_ms=i.retire_ms, snaplen=i.snaplen,
                                             fanout=fanout,
                                             # the kernel filter passes RoCEv2 and GRE only
                                             bpf=self.plan.transport == "roce"))

    # -- capture workers (ckptd.live.workers) ----------------------------------------
    def _open_workers(self):
        """One capture process per interface; then the coordinator (this process, all
        its threads) is pinned to `cpus`, after the workers started so that a worker
        without a `cpu` of its own keeps the machine's CPUs."""
        from ckptd.live.workers import CaptureWorkers
        self.workers = CaptureWorkers(self.cfg.interfaces, bpf=self.plan.transport == "roce",
                                      busy_poll=self.cfg.busy_poll)
        self.captures = list(self.workers.captures)
        if self.cfg.cpus:
            for tid in os.listdir("/proc/self/task"):
                try:
                    os.sched_setaffinity(int(tid), self.cfg.cpus)
                except OSError:
                    pass  # a thread that has just ended
        log.info("capture workers", extra={"fields": {
            "workers": [{"interface": c.ifname, "pid": c.pid} for c in self.captures],
            "busy_poll": self.cfg.busy_poll, "cpus": self.cfg.cpus}})

    def run(self, source=None, install_signals: bool = True) -> int:
        """Capture until stopped. `source` replaces the capture rings (tests, replays)."""
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self.stop.set())
        server = StatusServer(self.snapshot, self.cfg.listen).start()
        self.address = server.address
        try:
            if source is None:
                from ckptd.live.ring import ring_source
                self.open_captures()
                if not self.fast:
                    source = ring_source(self.captures, self.stop, self.pipe.errors)
            self._publish()
            log.info("capturing", extra={"fields": {"interfaces": self.names, "listen": self.cfg.listen,
                                                    "fast": self.fast}})
            if self.fast:
                self._run_fast(self._ring_batches() if source is None else self._frame_batches(source))
            else:
                self.pipe.run(self._counting(source), abandon=True)
        finally:
            self._publish("stopped")
            for c in self.captures:
                st = c.stats()
                if st["drops"]:
                    log.warning("kernel dropped frames", extra={"fields": st})
                c.close()
            server.stop()
        committed = [r for r in self.pipe.reports if r.status == "committed"]
        abandoned = [r.iteration for r in self.pipe.reports if r.status == "abandoned"]
        dropped = [r.iteration for r in self.pipe.reports if r.status == "dropped"]
        log.warning("stopped", extra={"fields": {
            "last_committed": committed[-1].iteration if committed else -1,
            "joined_at": self.pipe.joined, "abandoned": abandoned, "dropped": dropped,
            "unrecovered": [u["iteration"] for u in self.unrecovered
                            if u["status"] not in ("abandoned", "dropped")]}})
        for e in self.pipe.errors:
            log.error("capture error", extra={"fields": {"error": e}})
        return self._exit_status()

    def _exit_status(self) -> int:
        """0: every iteration seen committed or was merely in flight at the stop;
        3: an iteration could not be recovered (the capture had no copy of some of its
        data); 4: an iteration lost data to kernel ring drops (rings too small, or the
        daemon too slow for the link: docs/DAEMON.md, sizing). 4 wins: it names what
        the operator can fix."""
        statuses = {u["status"] for u in self.unrecovered}
        if "dropped" in statuses:
            return 4
        return 3 if statuses - {"abandoned"} else 0
