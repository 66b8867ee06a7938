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

import ipaddress
import json
import logging
import mmap
import re
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.checkpoint import checkpoint_name, load_checkpoint
from ckptd.core.memory import available_memory, require_memory
from ckptd.pipeline import IterationReport, Pipeline, ReplayOptions
from ckptd.core.plan import PlanError, load_plan
from ckptd.live.ring import _TPACKET3_HDRLEN as TPACKET3_MIN_FRAME, FANOUT_MODES
from ckptd.live.status import Snapshot, StatusServer
from parsers.frame import MAX_SNAPLEN
from ckptd.errors import CkptdError

log = logging.getLogger("ckptd")
SNAPSHOT_EVERY = 4096  # frames between status snapshots while an iteration is in flight
BATCH_MAX_FRAMES = 1 << 15  # fast path: ready ring blocks are joined into one Batch up to this
SOURCE_CHUNK = 128  # fast path: frames per Batch from a frame-by-frame source (tests, replays)
KEEP_REPORTS = 1000
DEFAULT_RING_MEMORY = 2 << 30  # max_ring_memory: every capture ring together
MAX_BLOCK_SIZE = 1 << 28
MAX_BLOCK_NR = 1 << 16


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
    keep_last: int = 10  # retention: the newest K checkpoints stay
    keep_every: int | None = None  # retention: and every M-th iteration's, for good
    max_ring_memory: int = DEFAULT_RING_MEMORY  # all capture rings together, bytes
    user: str | None = None  # drop to this user once the capture sockets are open
    group: str | None = None
    extra: dict = field(default_factory=dict)


LOG_LEVELS = ("debug", "info", "warning", "error")
# IFNAMSIZ is 16 with the NUL; a netns name is a file under /run/netns.
_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")
_NETNS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_UNIX_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
_SIZE = re.compile(r"\s*(\d+)\s*([KMG]i?B?)?\s*", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


class _Keys:
    """Typed reads of one config mapping: a wrong type or value is a ConfigError naming
    the file and the key (interfaces[1].block_size), never a TypeError later."""

    def __init__(self, path, doc: dict, prefix: str = ""):
        self.path, self.doc, self.prefix = path, doc, prefix

    def fail(self, key, why):
        raise ConfigError(f"{self.path}: '{self.prefix}{key}' {why}")

    def str(self, key, default=None, pattern=None, what="", required=False):
        if key not in self.doc:
            if required:
                raise ConfigError(f"{self.path}: missing '{self.prefix}{key}'")
            return default
        v = self.doc[key]
        if v is None and not required:
            return default
        if not isinstance(v, str) or not v:
            self.fail(key, f"must be a non-empty string, not {v!r}"[:200])
        if pattern is not None and (not pattern.fullmatch(v) or v in (".", "..")):
            self.fail(key, f"{v!r} is not {what}"[:200])
        return v

    def int(self, key, lo, hi, default=None, what="an integer"):
        v = self.doc.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key, f"must be {what} in {lo}..{hi}, not {v!r}"[:200])
        if not lo <= v <= hi:
            self.fail(key, f"is {v}; it must be in {lo}..{hi}")
        return v

    def size(self, key, lo, hi, default):
        """Bytes: an integer, or a string with a binary unit (4M, 4MiB, 512K, 1G)."""
        v = self.doc.get(key, default)
        if isinstance(v, str) and (m := _SIZE.fullmatch(v)):
            v = int(m.group(1)) * _SIZE_UNITS[(m.group(2) or "")[:1].lower()]
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key, f"must be a size in bytes (an integer, or with a unit: 4M, 512K), not {v!r}"[:200])
        if not lo <= v <= hi:
            self.fail(key, f"is {v} bytes; it must be in {lo}..{hi}")
        return v

    def bool(self, key, default):
        v = self.doc.get(key, default)
        if not isinstance(v, bool) and v is not None:
            self.fail(key, f"must be true or false, not {v!r}"[:200])
        return v


def parse_listen(text: str, where: str = "listen") -> tuple[str, int]:
    """HOST:PORT with HOST an IPv4 address, [IPv6] in brackets, or a host name; port
    0..65535 (0: any free port). ConfigError naming `where` for anything else."""
    if not isinstance(text, str):
        raise ConfigError(f"{where} must be HOST:PORT, not {text!r}")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where} {text!r} is not HOST:PORT with a port in 0..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ConfigError(f"{where} {text!r}: {host[1:-1]!r} is not an IPv6 address") from None
        return host[1:-1], int(port)
    try:
        ipaddress.IPv4Address(host)
        return host, int(port)
    except ValueError:
        pass
    if ":" in host:
        raise ConfigError(f"{where} {text!r}: put an IPv6 address in brackets, [::1]:9187")
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", host):
        raise ConfigError(f"{where} {text!r}: {host!r} is not an address or host name")
    return host, int(port)


def _interface(path, i: int, x) -> InterfaceConfig:
    if not isinstance(x, dict) or "ifname" not in x:
        raise ConfigError(f"{path}: interfaces[{i}] needs at least 'ifname'")
    unknown = set(x) - set(InterfaceConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"{path}: interfaces[{i}] has unknown keys {sorted(unknown)}")
    k = _Keys(path, x, f"interfaces[{i}].")
    page = mmap.PAGESIZE
    ifname = k.str("ifname", pattern=_IFNAME, what="an interface name (1-15 of A-Z a-z 0-9 _ . : @ -)",
                   required=True)
    frame_size = k.size("frame_size", TPACKET3_MIN_FRAME, 1 << 20, 16384)
    if frame_size % 16:
        k.fail("frame_size", f"{frame_size} must be a multiple of 16 (TPACKET_ALIGNMENT)")
    block_size = k.size("block_size", page, MAX_BLOCK_SIZE, 1 << 22)
    if block_size % page or block_size < frame_size:
        k.fail("block_size", f"{block_size} must be a multiple of the page size ({page}) and at "
               f"least frame_size ({frame_size})")
    mode = k.str("fanout_mode", "hash")
    if mode not in FANOUT_MODES:
        k.fail("fanout_mode", f"{mode!r} is not one of {', '.join(FANOUT_MODES)}")
    return InterfaceConfig(
        name=k.str("name", ifname, pattern=_NETNS, what="a stream name (A-Z a-z 0-9 _ . -)"),
        ifname=ifname,
        netns=k.str("netns", None, pattern=_NETNS, what="a network namespace name "
                    "(A-Z a-z 0-9 _ . -, as `ip netns add` takes)"),
        block_size=block_size, block_nr=k.int("block_nr", 1, MAX_BLOCK_NR, 64),
        frame_size=frame_size, retire_ms=k.int("retire_ms", 1, 60_000, 20),
        snaplen=k.int("snaplen", 64, MAX_SNAPLEN, 65535),
        fanout_group=k.int("fanout_group", 0, 0xFFFF), fanout_mode=mode)


def load_config(path: str | Path) -> DaemonConfig:
    """YAML (.yaml/.yml) or TOML (.toml); docs/DAEMON.md documents every key. Every value
    is checked here, before any file, socket or ring is opened."""
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
        raise ConfigError(f"{path}: cannot read config: {_one_line(e)}") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the config must be a mapping")
    base = path.parent
    known = {"plan", "init", "out", "interfaces", "listen", "log_level", "resume", "dump_gradients",
             "fast", "join", "join_from", "keep_last", "keep_every", "max_ring_memory", "user", "group"}
    unknown = set(doc) - known
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(map(str, unknown))} (known: {sorted(known)})")
    k = _Keys(path, doc)

    def rel(key, required=False):
        p = k.str(key, required=required)
        return None if p is None else str((base / p) if not Path(p).is_absolute() else Path(p))

    raw_ifs = doc.get("interfaces")
    if not isinstance(raw_ifs, list) or not raw_ifs:
        raise ConfigError(f"{path}: 'interfaces' lists no mirror port to capture")
    ifs = [_interface(path, i, x) for i, x in enumerate(raw_ifs)]
    seen: dict[tuple, int] = {}
    for i, x in enumerate(ifs):
        where = (x.netns, x.ifname)
        if where in seen and (x.fanout_group is None or ifs[seen[where]].fanout_group != x.fanout_group):
            raise ConfigError(f"{path}: interfaces[{i}] captures {x.ifname}"
                              + (f" in netns {x.netns}" if x.netns else "")
                              + f" again (as interfaces[{seen[where]}]): every frame would be counted "
                              "twice; share it with one fanout_group instead")
        seen.setdefault(where, i)
    names = [x.name for x in ifs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: interface names {names} are not unique")
    cap = k.size("max_ring_memory", 1 << 20, 1 << 40, DEFAULT_RING_MEMORY)
    ring_bytes = sum(x.block_size * x.block_nr for x in ifs)
    if ring_bytes > cap:
        raise ConfigError(f"{path}: the capture rings need {ring_bytes} bytes (block_size x "
                          f"block_nr, all interfaces), more than max_ring_memory {cap}: lower "
                          "interfaces[].block_nr or raise max_ring_memory")
    avail = available_memory()
    if avail is not None and ring_bytes > avail // 2:
        raise ConfigError(f"{path}: the capture rings need {ring_bytes} bytes (block_size x block_nr, "
                          f"all interfaces), more than half the memory available ({avail}): lower "
                          "interfaces[].block_nr")
    listen = k.str("listen", "127.0.0.1:9187")
    parse_listen(listen, f"{path}: listen")
    log_level = k.str("log_level", "warning")
    if log_level not in LOG_LEVELS:
        k.fail("log_level", f"{log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    fast, join = k.bool("fast", None), k.bool("join", False)
    join_from = k.int("join_from", 0, 1 << 31, what="an iteration number")
    user, group = (k.str(key, None, _UNIX_NAME, "a user or group name") for key in ("user", "group"))
    if group is not None and user is None:
        k.fail("group", "needs `user` too")
    return DaemonConfig(plan=rel("plan", True), init=rel("init", True), out=rel("out", True),
                        interfaces=ifs, listen=listen, log_level=log_level,
                        resume=rel("resume"), dump_gradients=rel("dump_gradients"),
                        fast=fast, join=join or join_from is not None, join_from=join_from,
                        keep_last=k.int("keep_last", 1, 1 << 31, 10),
                        keep_every=k.int("keep_every", 1, 1 << 31),
                        max_ring_memory=cap, user=user, group=group)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


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
        require_memory(self.plan.shadow_bytes(), f"shadowing the plan {cfg.plan}")
        if cfg.user is not None:  # an unknown user is refused before anything is opened
            from ckptd.live.privilege import resolve
            resolve(cfg.user, cfg.group)
        self.start_state = load_checkpoint(cfg.init)
        self.plan.check_start(self.start_state, cfg.init)
        self.names = [i.name for i in cfg.interfaces]
        self.stop = threading.Event()
        self.snapshot = Snapshot()
        self.captures: list = []
        self.frames = 0
        self.by_status: dict[str, int] = {}
        self.last_report: IterationReport | None = None
        self.unrecovered: list[dict] = []
        self.started = time.time()
        self._join_logged = False
        opts = ReplayOptions(out=cfg.out, resume=cfg.resume, dump_gradients=cfg.dump_gradients,
                             join=cfg.join, join_from=cfg.join_from, keep_last=cfg.keep_last,
                             keep_every=cfg.keep_every, retry_writes=True)
        self.fast = (self.plan.transport == "roce") if cfg.fast is None else bool(cfg.fast)
        if self.fast and self.plan.transport != "roce":
            raise ConfigError(f"fast: true needs a RoCE plan; this plan's transport is "
                              f"{self.plan.transport} (set fast: false)")
        if self.fast:
            from ckptd.fast.pipeline import FastPipeline
            self.pipe = FastPipeline(self.plan, self.start_state, len(cfg.interfaces), opts,
                                     on_iteration=self._on_iteration)
            self.pipe.reports = deque(maxlen=KEEP_REPORTS)  # as Pipeline's keep_reports
        else:
            self.pipe = Pipeline(self.plan, self.start_state, len(cfg.interfaces), opts,
                                 on_iteration=self._on_iteration, keep_reports=KEEP_REPORTS)

    # -- feature hooks on the core loop ----------------------------------------------
    def _on_iteration(self, rep: IterationReport):
        self.by_status[rep.status] = self.by_status.get(rep.status, 0) + 1
        self.last_report = rep
        fields = {"iteration": rep.iteration, "status": rep.status, "packets": rep.packets,
                  "coverage": [round(c, 6) for c in rep.coverage], "note": rep.note.strip()}
        if rep.commit_lag is not None:
            fields["commit_lag_s"] = round(rep.commit_lag, 6)
        if rep.write_seconds is not None:
            fields["write_s"] = round(rep.write_seconds, 6)
        if rep.status == "committed":
            fields["persisted"] = rep.persisted
            if rep.persisted is False:
                log.warning("committed, not persisted", extra={"fields": fields})
            else:
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
                self._publish()
            yield k, fr

    def _batches(self, source):
        """Fast path: the source's frames as Batches, in order. A `_BLOCK_END` item (see
        _BlockEnds) closes a ring block: the batch goes to the kernel then, unless another
        block is already waiting, in which case blocks are joined (up to BATCH_MAX_FRAMES),
        so a busy link gets big batches and a quiet one no added latency. A plain
        frame-by-frame source is cut every SOURCE_CHUNK frames."""
        from ckptd.fast.batches import batch_from_frames
        chunk: list = []
        marked = False
        for item in source:
            if item[1] is _BLOCK_END:
                marked = True
                if chunk and (len(chunk) >= BATCH_MAX_FRAMES
                              or not any(c.ready() for c in self.captures if not c._closed)):
                    yield batch_from_frames(chunk)
                    chunk = []
                continue
            chunk.append(item)
            if len(chunk) >= (BATCH_MAX_FRAMES if marked else SOURCE_CHUNK):
                yield batch_from_frames(chunk)
                chunk = []
        if chunk:
            yield batch_from_frames(chunk)

    def _run_fast(self, source):
        for batch in self._batches(source):
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
        keeper = self.pipe.keeper
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
            "last_checkpoint": (str(Path(self.cfg.out) / checkpoint_name(keeper.last_persisted))
                                if keeper and keeper.last_persisted is not None else None),
            "checkpoints": keeper.status() if keeper else None,
            "commit_lag_s": committed[-1].commit_lag if committed else None,
            "checkpoint_write_s": committed[-1].write_seconds if committed else None,
            "iterations_by_status": dict(self.by_status),
            "shadow_stopped_after": self.pipe.stopped_after,
            "join": ({"joining": self.pipe.joining, "joined_at": self.pipe.joined,
                      "packets_before": self.pipe.before_join} if self.cfg.join else None),
            "streams": streams,
            "capture": {c.ifname: {"packets": st["packets"], "drops": st["drops"],
                                   "delivered": st["delivered"]}
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

    # -- environment: signals, the write path ---------------------------------------------
    def install_signals(self):
        """SIGINT/SIGTERM stop cleanly; SIGHUP (a closed terminal, `systemctl reload`) is
        logged and otherwise ignored: it must never end a capture (restart to reload)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop.set())
        signal.signal(signal.SIGHUP, lambda *_: log.warning(
            "SIGHUP ignored: the config is read at start; restart the daemon to change it"))

    def drop_privileges(self):
        """With `user` configured: the capture sockets are open (netns entered), so
        become that user with CAP_NET_RAW alone (ckptd.live.privilege)."""
        if self.cfg.user is None:
            return
        from ckptd.live.privilege import drop_privileges
        drop_privileges(self.cfg.user, self.cfg.group,
                        [d for d in (self.cfg.out, self.cfg.dump_gradients) if d])

    def _persist_newest(self):
        """On a clean stop after writes failed: one more try for the newest committed
        state (the shadow holds it), so a disk that came back is used before exit."""
        keeper, shadow = self.pipe.keeper, self.pipe.shadow
        if keeper is None or not keeper.failing or shadow is None:
            return
        if shadow.iteration == keeper.newest_unpersisted:
            keeper.write(shadow.iteration, shadow.model_state(copy=False),
                         shadow.optimizer_state(copy=False), force=True)

    # -- running ---------------------------------------------------------------------
    def open_captures(self):
        from ckptd.live.ring import RingCapture
        for i in self.cfg.interfaces:
            fanout = None if i.fanout_group is None else (i.fanout_group, i.fanout_mode)
            self.captures.append(RingCapture(i.ifname, i.netns, block_size=i.block_size,
                                             block_nr=i.block_nr, frame_size=i.frame_size,
                                             retire_ms=i.retire_ms, snaplen=i.snaplen,
                                             fanout=fanout,
                                             # the kernel filter passes RoCEv2 and GRE only
                                             bpf=self.plan.transport == "roce"))

    def run(self, source=None, install_signals: bool = True) -> int:
        """Capture until stopped. `source` replaces the capture rings (tests, replays)."""
        if install_signals:
            self.install_signals()
        try:
            server = StatusServer(self.snapshot, self.cfg.listen).start()
        except OSError as e:
            raise ConfigError(f"listen {self.cfg.listen}: cannot serve /status there: "
                              f"{e.strerror or e}") from None
        self.address = server.address
        try:
            if source is None:
                from ckptd.live.ring import ring_source
                self.open_captures()
                self.drop_privileges()
                if self.fast:  # each block's frames, then _BLOCK_END
                    source = ring_source([_BlockEnds(c) for c in self.captures], self.stop,
                                         self.pipe.errors)
                else:
                    source = ring_source(self.captures, self.stop, self.pipe.errors)
            self._publish()
            log.info("capturing", extra={"fields": {"interfaces": self.names, "listen": self.cfg.listen,
                                                    "fast": self.fast}})
            if self.fast:
                self._run_fast(source)
            else:
                self.pipe.run(self._counting(source), abandon=True)
            self._persist_newest()
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
        log.warning("stopped", extra={"fields": {
            "last_committed": committed[-1].iteration if committed else -1,
            "joined_at": self.pipe.joined, "abandoned": abandoned, "unrecovered": [u["iteration"] for u in self.unrecovered
                                                    if u["status"] != "abandoned"]}})
        for e in self.pipe.errors:
            log.error("capture error", extra={"fields": {"error": e}})
        return 0 if not any(u["status"] not in ("abandoned",) for u in self.unrecovered) else 3


class _BlockEndMark:
    def __repr__(self):
        return "_BLOCK_END"


_BLOCK_END = _BlockEndMark()


class _BlockEnds:
    """A RingCapture whose read_block appends a (stream, _BLOCK_END) marker, so that
    ring_source (unchanged: round robin, errors, the drain on stop) tells the fast
    daemon where each block ends; ring_source yields it as (k, _BLOCK_END)."""

    def __init__(self, capture):
        self._capture = capture

    def __getattr__(self, name):
        return getattr(self._capture, name)

    def read_block(self, timeout=0.0):
        block = self._capture.read_block(timeout)
        return block + [_BLOCK_END] if block else block
