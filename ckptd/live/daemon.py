"""`ckptd run --config FILE`: the long-running daemon on a mirror-port host.

The same pipeline as `ckptd replay` (ckptd.pipeline), fed by capture rings instead of
files; the daemon's features plug in around that one loop:

    capture   ckptd.live.ring.RingCapture per configured interface (one per mirror port)
    fast      with `fast` (the default for RoCE plans) ckptd.fast.pipeline.FastPipeline runs
              the pipeline: ring blocks go to its Cython kernel as Batches (same reports
              and checkpoints as the reference Pipeline, which gloo plans always use)
    status    ckptd.live.status: /status and /metrics, from snapshots the loop publishes,
              served by ckptd.live.serve (bounded workers, caps, timeouts, token)
    memory    ckptd.live.memory_tier: the latest two committed states, as /checkpoint
    persist   ckptd.live.persist: checkpoint files and manifest, by a writer thread
              (persist_sync: written by the pipeline as iterations commit, ckptd.core.keep)
    logs      one JSON object per line on stderr, warnings only unless asked

SIGINT/SIGTERM stop it cleanly: capture stops, what the rings already hold is
processed, complete iterations are committed, the iteration in flight is reported as
abandoned (with how much of it was missing), and the last exact checkpoint stays.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import ipaddress
import json
import logging
import mmap
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.core.checkpoint import CheckpointError, CheckpointWriteError, checkpoint_name, load_checkpoint
from ckptd.core.docload import strict_yaml
from ckptd.core.memory import available_memory, require_memory
from ckptd.core.store import READ_ONLY_PROTOCOLS
from ckptd.pipeline import AGREE_WINDOW_MS, SILENT_STREAM_WINDOWS, IterationReport, Pipeline, ReplayOptions
from ckptd.core.plan import PlanError, load_plan
from ckptd.core.readfile import read_bounded
from ckptd.core.streams import stream_faults
from ckptd.live.ring import _TPACKET3_HDRLEN as TPACKET3_MIN_FRAME, FANOUT_MODES
from ckptd.live.memory_tier import MemoryTier
from ckptd.live.notice import Notifier, NoticeConfig, notice_config
from ckptd.live.status import LoopClock, Snapshot, checkpoint_routes, routes
from parsers.frame import MAX_SNAPLEN
from ckptd.errors import CkptdError, one_line, show, unknown_keys

log = logging.getLogger("ckptd")
SNAPSHOT_S = 0.05  # seconds between status snapshots while frames flow (and one at each report)
SOURCE_CHUNK = 128  # fast path: frames per Batch from a frame-by-frame source (tests, replays)
KEEP_REPORTS = 1000
DROPS_LOOK_S = 0.05  # the rings' drop counters are read at most this often (and at each loss)
NIC_LOOK_S = 0.5  # the interfaces' (ckptd.live.nic) at most this often
# A ring found this full (blocks handed over and waiting, of all its blocks) is logged once,
# ahead of the drops that come when it is full: the loop fell behind for a while
RING_WARN_FILL = 0.75
DEFAULT_RING_MEMORY = 2 << 30  # max_ring_memory: every capture ring together
MAX_CONFIG_BYTES = 16 << 20  # a config file larger than this is not one
MAX_TOKEN_BYTES = 64 << 10  # nor a token file
MAX_BLOCK_SIZE = 1 << 28
MAX_BLOCK_NR = 1 << 16


# the least a RoCEv2 data frame adds to its payload: Ethernet 14, IPv4 20, UDP 8, BTH 12,
# RETH 16 (the first packet of a write), ICRC 4
ROCE_FRAME_OVERHEAD = 14 + 20 + 8 + 12 + 16 + 4


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
    # only this ERSPAN II/III session (0-1023): several sessions reaching one collector
    # interface are captured as streams of their own (ckptd.live.ring.erspan_session_filter)
    erspan_session: int | None = None


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
    huge_pages: str = "auto"  # the capture workers' shared memory: auto, on, off (ckptd.live.hugemem)
    cpus: list[int] | None = None  # the daemon's own process (the coordinator) is pinned to these
    keep_last: int = 10  # retention: the newest K checkpoints stay
    keep_every: int | None = None  # retention: and every M-th iteration's, for good
    agree_window_ms: float = AGREE_WINDOW_MS  # copies compared before a commit (ckptd.pipeline)
    max_ring_memory: int = DEFAULT_RING_MEMORY  # all capture rings together, bytes
    user: str | None = None  # drop to this user once the capture sockets are open
    group: str | None = None
    # once the rings are open (netns entered): every capability dropped in every thread
    # and capture worker (ckptd.live.privilege). False here keeps programmatic and test
    # daemons as they were; a config file (load_config) defaults it to True
    drop_capabilities: bool = False
    token_file: str | None = None  # HTTP bearer token (required off loopback)
    status_details: bool = False  # /status with absolute paths and parameter names
    source: str | None = None  # the config file it was read from (load_config), for messages
    http_workers: int = 8  # worker threads answering requests
    max_connections: int = 1024  # open HTTP connections at once; more are refused (503)
    read_timeout_s: float = 10.0  # a request head must arrive whole within this
    memory_tier: bool = True  # keep the latest two committed states in memory, serve /checkpoint
    persist_every: int | None = 10  # persistence tier: write every N-th committed iteration ...
    persist_interval_s: float | None = 60  # ... or after this many seconds, whichever first
    persist_sync: bool = False  # write every commit's file in the commit path instead (old default)
    persist_url: str | None = None  # the persistence tier writes here (fsspec URL) instead of `out`
    persist_options: dict | None = None  # fsspec storage options for persist_url (credentials, endpoint)
    notice: NoticeConfig | None = None  # tell the job about unrecoverable iterations (ckptd.live.notice)
    extra: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        """`<config file>: ` in front of a message about one of its keys (nothing without a file)."""
        return f"{self.source}: " if self.source else ""


QUIET_S = 0.5  # a capture this long without a frame is quiet (Daemon._counting)
LOG_LEVELS = ("debug", "info", "warning", "error")
# IFNAMSIZ is 16 with the NUL; a netns name is a file under /run/netns.
_IFNAME = re.compile(r"[A-Za-z0-9_.@-]{1,15}")  # (the kernel's dev_valid_name refuses ':' too)
_NETNS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_UNIX_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
_SIZE = re.compile(r"\s*([0-9]{1,20})\s*([KMG]i?B?)?\s*", re.IGNORECASE)  # ASCII digits, and few: int() of 5000 raises
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


class _Keys:
    """Typed reads of one config mapping: a wrong type or value is a ConfigError naming
    the file and the key (interfaces[1].block_size), never a TypeError later. A value is
    shown with errors.show, never repr'd whole: a YAML alias bomb of a few lines is
    billions of nodes to walk (it hung `ckptd run` at 3 GB)."""

    def __init__(self, path, doc: dict, prefix: str = ""):
        self.path, self.doc, self.prefix = path, doc, prefix

    def fail(self, key, why):
        raise ConfigError(f"{self.path}: '{self.prefix}{key}' {why}")

    def _get(self, key, default):
        """A key set to null (or left empty in YAML) takes its default, as if absent: an
        explicit null must not switch off what the default switches on."""
        v = self.doc.get(key)
        return default if v is None else v

    def str(self, key, default=None, pattern=None, what="", required=False):
        if key not in self.doc:
            if required:
                raise ConfigError(f"{self.path}: missing '{self.prefix}{key}'")
            return default
        v = self.doc[key]
        if v is None and not required:
            return default
        if not isinstance(v, str) or not v:
            self.fail(key, f"must be a non-empty string, not {show(v)}")
        if "\0" in v:
            self.fail(key, "holds a NUL byte")
        if pattern is not None and (not pattern.fullmatch(v) or v in (".", "..")):
            self.fail(key, f"{v!r} is not {what}"[:200])
        return v

    def int(self, key, lo, hi, default=None, what="an integer"):
        v = self._get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key, f"must be {what} in {lo}..{hi}, not {show(v)}")
        if not lo <= v <= hi:
            self.fail(key, f"is {show(v)}; it must be in {lo}..{hi}")
        return v

    def size(self, key, lo, hi, default):
        """Bytes: an integer, or a string with a binary unit (4M, 4MiB, 512K, 1G)."""
        v = self._get(key, default)
        if isinstance(v, str) and (m := _SIZE.fullmatch(v)):
            v = int(m.group(1)) * _SIZE_UNITS[(m.group(2) or "")[:1].lower()]
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(key, f"must be a size in bytes (an integer, or with a unit: 4M, 512K), not {show(v)}")
        if not lo <= v <= hi:
            shown = show(v)  # never str() of an int past 4300 digits (0xfff... in YAML): ValueError
            self.fail(key, f"is {shown}{' bytes' if shown.isdigit() else ''}; it must be in {lo}..{hi}")
        return v

    def bool(self, key, default):
        v = self._get(key, default)
        if not isinstance(v, bool) and v is not None:
            self.fail(key, f"must be true or false, not {show(v)}")
        return v


def parse_listen(text: str, where: str = "listen") -> tuple[str, int]:
    """HOST:PORT with HOST an IPv4 address, [IPv6] in brackets, or a host name; port
    0..65535 (0: any free port). ConfigError naming `where` for anything else."""
    if not isinstance(text, str):
        raise ConfigError(f"{where} must be HOST:PORT, not {show(text)}")
    shown = show(text)  # a megabyte string is still a short line
    host, sep, port = text.rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where} {shown} is not HOST:PORT with a port in 0..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ConfigError(f"{where} {shown}: {show(host[1:-1])} is not an IPv6 address") from None
        return host[1:-1], int(port)
    try:
        ipaddress.IPv4Address(host)
        return host, int(port)
    except ValueError:
        pass
    if ":" in host:
        raise ConfigError(f"{where} {shown}: put an IPv6 address in brackets, [::1]:9187")
    if re.fullmatch(r"[0-9.]+", host):
        raise ConfigError(f"{where} {shown}: {show(host)} is not an IPv4 address (four numbers 0-255)")
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", host):
        raise ConfigError(f"{where} {shown}: {show(host)} is not an address or host name")
    return host, int(port)


def _interface(path, i: int, x) -> InterfaceConfig:
    if not isinstance(x, dict) or "ifname" not in x:
        raise ConfigError(f"{path}: interfaces[{i}] needs at least 'ifname'")
    if why := unknown_keys(f"{path}: interfaces[{i}]", x, InterfaceConfig.__dataclass_fields__):
        raise ConfigError(why)
    k = _Keys(path, x, f"interfaces[{i}].")
    page = mmap.PAGESIZE
    if isinstance(x["ifname"], str) and ":" in x["ifname"]:
        # an old-style alias label (eth0:1): no device has ':' in its name, and the kernel
        # takes the label for the device before it, so a second entry captured every frame
        # of the first one's device again, counted twice as a stream of its own
        k.fail("ifname", f"{show(x['ifname'])} is an address alias label, not a device: it captures "
               f"{show(x['ifname'].split(':', 1)[0])}; name the device")
    ifname = k.str("ifname", pattern=_IFNAME, what="an interface name (1-15 of A-Z a-z 0-9 _ . @ -)",
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
        k.fail("fanout_mode", f"{show(mode)} is not one of {', '.join(FANOUT_MODES)}")
    return InterfaceConfig(
        name=k.str("name", ifname, pattern=_NETNS, what="a stream name (A-Z a-z 0-9 _ . -)"),
        ifname=ifname,
        netns=k.str("netns", None, pattern=_NETNS, what="a network namespace name "
                    "(A-Z a-z 0-9 _ . -, as `ip netns add` takes)"),
        block_size=block_size, block_nr=k.int("block_nr", 1, MAX_BLOCK_NR, 64),
        frame_size=frame_size, retire_ms=k.int("retire_ms", 1, 60_000, 20),
        snaplen=k.int("snaplen", 64, MAX_SNAPLEN, 65535),
        fanout_group=k.int("fanout_group", 0, 0xFFFF), fanout_mode=mode,
        erspan_session=k.int("erspan_session", 0, 0x3FF),
        cpu=x.get("cpu"))  # checked with the other capture-worker keys (_capture_config)


def load_config(path: str | Path) -> DaemonConfig:
    """YAML (.yaml/.yml) or TOML (.toml, any case); docs/DAEMON.md documents every key. Every value
    is checked here, before any file, socket or ring is opened."""
    path = Path(path)
    try:
        # bounded, and a FIFO nobody writes into is an error after a wait: read_text()
        # hung the daemon on it for ever, before a line of log
        text = read_bounded(path, MAX_CONFIG_BYTES, "a config").decode()
        if path.suffix.lower() == ".toml":
            import tomllib
            doc = tomllib.loads(text)
        else:
            doc = strict_yaml(text)
    except Exception as e:
        raise ConfigError(f"{path}: cannot read config: {one_line(e)}") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the config must be a mapping")
    base = path.parent
    known = {"plan", "init", "out", "interfaces", "listen", "log_level", "resume", "dump_gradients",
             "fast", "join", "join_from", "keep_last", "keep_every", "max_ring_memory", "user", "group",
             "capture_workers", "busy_poll", "huge_pages", "cpus", "agree_window_ms", "token_file", "status_details",
             "http_workers", "max_connections", "read_timeout_s", "memory_tier", "persist_every",
             "persist_interval_s", "persist_sync", "persist_url", "persist_options", "notice",
             "drop_capabilities"}
    if why := unknown_keys(str(path), doc, sorted(known)):
        raise ConfigError(why)
    k = _Keys(path, doc)

    def rel(key, required=False):
        p = k.str(key, required=required)
        if p is not None and "://" in p:  # it was read as the relative path "<config dir>/http:/..."
            k.fail(key, f"{show(p)} is a URL: {key} takes a local file or directory (the daemon restarts "
                   "from its own persisted state, `persist_url`, by itself)")
        return None if p is None else str((base / p) if not Path(p).is_absolute() else Path(p))

    raw_ifs = doc.get("interfaces")
    if not isinstance(raw_ifs, list) or not raw_ifs:
        raise ConfigError(f"{path}: 'interfaces' lists no mirror port to capture")
    ifs = [_interface(path, i, x) for i, x in enumerate(raw_ifs)]
    for i, x in enumerate(ifs):
        # one interface more than once: in one fanout group (each frame to one ring), or
        # each entry one ERSPAN session of its own (each frame to the ring of its session)
        again = [j for j in range(i) if (ifs[j].netns, ifs[j].ifname) == (x.netns, x.ifname)]
        clash = next((j for j in again if None in (ifs[j].erspan_session, x.erspan_session)
                      or ifs[j].erspan_session == x.erspan_session), None)
        # a fanout group hands each frame to one member before that member's filter runs:
        # members that filter on different sessions would drop each other's frames
        mixed = next((j for j in again if x.fanout_group is not None and ifs[j].fanout_group == x.fanout_group
                      and ifs[j].erspan_session != x.erspan_session), None)
        # the kernel joins a socket to a fanout group (per network namespace) only on the
        # group's one device and in its one mode (af_packet.c fanout_add: EINVAL otherwise)
        member = next((j for j in range(i) if x.fanout_group is not None and ifs[j].fanout_group == x.fanout_group
                       and ifs[j].netns == x.netns), None)
        if member is not None and ifs[member].ifname != x.ifname:
            raise ConfigError(f"{path}: interfaces[{i}] ({x.ifname}) and interfaces[{member}] "
                              f"({ifs[member].ifname}) share fanout_group {x.fanout_group}: a fanout group "
                              "spreads one interface's frames over several rings; give each interface its own")
        if member is not None and ifs[member].fanout_mode != x.fanout_mode:
            raise ConfigError(f"{path}: interfaces[{i}] and interfaces[{member}] share fanout_group "
                              f"{x.fanout_group} with fanout_mode {x.fanout_mode} and {ifs[member].fanout_mode}: "
                              "a group has one mode; give them the same one")
        if mixed is not None:
            raise ConfigError(f"{path}: interfaces[{i}] and interfaces[{mixed}] share fanout_group "
                              f"{x.fanout_group} on {x.ifname} but not erspan_session ({x.erspan_session} and "
                              f"{ifs[mixed].erspan_session}): the group would hand a frame to a ring whose "
                              "filter drops it; give each session its own group")
        if clash is not None and (x.fanout_group is None or ifs[clash].fanout_group != x.fanout_group):
            raise ConfigError(f"{path}: interfaces[{i}] captures {x.ifname}"
                              + (f" in netns {x.netns}" if x.netns else "")
                              + (f" (erspan_session {x.erspan_session})" if x.erspan_session is not None else "")
                              + f" again (as interfaces[{clash}]): every frame would be counted twice; share "
                              "it with one fanout_group instead, or give each entry its own erspan_session")
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
    token_file = rel("token_file")
    if token_file is not None:
        read_token(token_file, f"{path}: token_file")
    log_level = k.str("log_level", "warning")
    if log_level not in LOG_LEVELS:
        k.fail("log_level", f"{show(log_level)} is not one of {', '.join(LOG_LEVELS)}")
    fast, join = k.bool("fast", None), k.bool("join", False)
    join_from = k.int("join_from", 0, 1 << 31, what="an iteration number")
    user, group = (k.str(key, None, _UNIX_NAME, "a user or group name") for key in ("user", "group"))
    if group is not None and user is None:
        k.fail("group", "needs `user` too")
    workers = _capture_config(path, doc, ifs)
    persist_url = _persist_url(k)
    if persist_url is not None and k.bool("persist_sync", False):
        k.fail("persist_url", "is written by the persistence tier: persist_sync writes to `out` only")
    return DaemonConfig(source=str(path), plan=rel("plan", True), init=rel("init", True), out=rel("out", True),
                        interfaces=ifs, listen=listen, log_level=log_level,
                        resume=_existing(k, "resume", rel("resume")), dump_gradients=rel("dump_gradients"),
                        fast=fast, join=join or join_from is not None, join_from=join_from,
                        keep_last=k.int("keep_last", 1, 1 << 31, 10),
                        keep_every=k.int("keep_every", 1, 1 << 31),
                        agree_window_ms=k.int("agree_window_ms", 0, 60_000, int(AGREE_WINDOW_MS),
                                              what="milliseconds"),
                        max_ring_memory=cap, user=user, group=group, token_file=token_file,
                        drop_capabilities=k.bool("drop_capabilities", True),
                        status_details=k.bool("status_details", False),
                        http_workers=k.int("http_workers", 1, 256, 8),
                        max_connections=k.int("max_connections", 1, 1 << 20, 1024),
                        read_timeout_s=k.int("read_timeout_s", 1, 3600, 10, what="seconds"),
                        memory_tier=k.bool("memory_tier", True),
                        persist_every=k.int("persist_every", 1, 1 << 31, 10, what="a number of iterations"),
                        persist_interval_s=k.int("persist_interval_s", 1, 1 << 31, 60, what="seconds"),
                        persist_sync=k.bool("persist_sync", False), persist_url=persist_url,
                        persist_options=_persist_options(k, persist_url),
                        notice=notice_config(str(path), doc.get("notice")), **workers)


def _persist_url(k: _Keys) -> str | None:
    """An fsspec URL (memory://, file:///x, s3://bucket/prefix): the protocol must be one
    fsspec has (its backend installed); nothing is contacted here."""
    from ckptd.core.store import redact
    url = k.doc.get("persist_url")
    if url is None:
        return None
    if not isinstance(url, str) or "://" not in url:
        k.fail("persist_url", "must be a URL such as memory://ckpts, file:///var/lib/ckptd or s3://bucket/prefix")
    import fsspec
    protocol, rest = url.split("://", 1)
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", protocol):
        k.fail("persist_url", f"{redact(url)[:100]!r} has no protocol before '://' (memory://, file:///..., s3://...)")
    if protocol.lower() in ("file", "local") and not rest.startswith("/"):
        k.fail("persist_url", f"{redact(url)[:100]!r}: a file:// URL takes an absolute path (file:///var/lib/ckptd), "
               "not one relative to wherever the daemon was started")
    if protocol.lower() in READ_ONLY_PROTOCOLS:
        k.fail("persist_url", f"{redact(url)[:100]!r}: fsspec reads {protocol}:// but never writes there, so no "
               "checkpoint could be persisted (file:///..., s3://, gs://, memory://, ...)")
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as e:
        k.fail("persist_url", f"{redact(url)}: {redact(one_line(e))}")
    return url


MAX_PERSIST_OPTION_VALUES = 10_000


def _persist_options(k: _Keys, url: str | None) -> dict | None:
    """fsspec storage options for persist_url: a mapping of names to YAML scalars, lists
    and mappings, passed to the filesystem as they are (s3fs: key, secret, token,
    endpoint_url, client_kwargs, config_kwargs, ...). Messages name the key, never a value."""
    opts = k.doc.get("persist_options")
    if opts is None:
        return None
    if url is None:
        k.fail("persist_options", "needs persist_url (they are that filesystem's options)")
    if not isinstance(opts, dict):
        k.fail("persist_options", f"must be a mapping of storage options, not a {type(opts).__name__}")

    seen = [0]  # values walked: YAML aliases can make a few lines billions of them (it hung)

    def check(v, where):
        seen[0] += 1
        if seen[0] > MAX_PERSIST_OPTION_VALUES:
            k.fail("persist_options", f"holds more than {MAX_PERSIST_OPTION_VALUES} values (YAML aliases?)")
        if isinstance(v, dict):
            for name, x in v.items():
                if not isinstance(name, str) or not name:
                    k.fail(where, "has a key that is not a non-empty string")
                check(x, f"{where}.{name}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                check(x, f"{where}[{i}]")
        elif v is not None and not isinstance(v, (str, int, float, bool)):
            k.fail(where, f"must be a string, number, boolean, list or mapping, not a {type(v).__name__}")
    check(opts, "persist_options")
    return opts


def read_token(path: str, where: str) -> str:
    """The bearer token: the file's one line (at least 16 characters)."""
    try:
        # a FIFO nobody writes into: an error, not a hang; a larger file is refused, not cut
        tok = read_bounded(path, MAX_TOKEN_BYTES, "a token file").strip()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read {path}: {e.strerror or e}") from None
    # HTTP headers are bytes: clients send a non-ASCII token in whatever encoding they
    # like (curl UTF-8, urllib latin-1), so only printable ASCII matches reliably
    if len(tok) < 16 or any(not 0x21 <= c <= 0x7E for c in tok):
        raise ConfigError(f"{where}: {path} must hold one token of at least 16 printable ASCII "
                          "characters without spaces")
    tok = tok.decode("ascii")
    return tok


def http_server(cfg: DaemonConfig, routes: dict):
    """The status server on cfg.listen (ckptd.live.serve). Off loopback it needs a token:
    /checkpoint hands out the model, /status the job's shape."""
    from ckptd.live.serve import HttpServer, is_loopback, resolved
    host, port = parse_listen(cfg.listen)
    token = read_token(cfg.token_file, "token_file") if cfg.token_file else None
    if token is None and not is_loopback(host):
        if not resolved(host):  # (an address resolves to itself, without a lookup)
            # a name that does not resolve was "not a loopback address: set token_file"
            raise ConfigError(f"listen {cfg.listen}: the host name {host} does not resolve")
        raise ConfigError(f"listen {cfg.listen} is not a loopback address: set token_file "
                          "(clients then send Authorization: Bearer <token>)")
    try:
        return HttpServer(routes, host, port, token=token, workers=cfg.http_workers,
                          max_connections=cfg.max_connections,
                          read_timeout_s=cfg.read_timeout_s).start()
    except OSError as e:
        raise ConfigError(f"listen {cfg.listen}: cannot serve /status there: "
                          f"{e.strerror or e}") from None


def _existing(k: "_Keys", key: str, p: str | None) -> str | None:
    """A path that must be there when the daemon starts (`resume`: a checkpoint, or a
    directory of the trainer's checkpoints), named by its key when it is not."""
    if p is not None and not os.path.lexists(p):
        k.fail(key, f"{p}: no such file or directory (a checkpoint, or a directory of the trainer's checkpoints)")
    return p


def _capture_config(path, doc: dict, ifs: list[InterfaceConfig]) -> dict:
    """capture_workers, busy_poll, huge_pages, cpus and the interfaces' cpu, checked."""
    out = {}
    for key in ("capture_workers", "busy_poll"):
        v = doc.get(key)
        v = False if v is None else v  # null or empty: the default, as for every key
        if not isinstance(v, bool):
            raise ConfigError(f"{path}: {key!r} must be true or false, not {show(v)}")
        out[key] = v
    ncpu = os.cpu_count() or 1

    def cpu_ok(c):
        return isinstance(c, int) and not isinstance(c, bool) and 0 <= c < ncpu
    cpus = doc.get("cpus")
    if cpus is not None and (not isinstance(cpus, list) or not cpus or not all(map(cpu_ok, cpus))):
        bad = next((c for c in cpus if not cpu_ok(c)), cpus) if isinstance(cpus, list) and cpus else cpus
        raise ConfigError(f"{path}: 'cpus' must be a list of CPU numbers 0..{ncpu - 1}, not {show(cpus)}"
                          + (f" ({show(bad)} is not one)" if bad is not cpus else ""))
    out["cpus"] = cpus
    for k, i in enumerate(ifs):
        if i.cpu is not None and not cpu_ok(i.cpu):
            raise ConfigError(f"{path}: interfaces[{k}].cpu must be a CPU number 0..{ncpu - 1}, not {show(i.cpu)}")
        if i.cpu is not None and not out["capture_workers"]:
            raise ConfigError(f"{path}: interfaces[{k}].cpu pins a capture worker: set capture_workers: true")
    if out["busy_poll"] and not out["capture_workers"]:
        raise ConfigError(f"{path}: busy_poll applies to capture workers: set capture_workers: true")
    from ckptd.live.hugemem import HUGE_PAGES
    hp = "auto" if doc.get("huge_pages") is None else doc["huge_pages"]
    hp = {True: "on", False: "off"}.get(hp, hp) if isinstance(hp, bool) else hp  # YAML reads on/off as booleans
    if hp not in HUGE_PAGES:
        raise ConfigError(f"{path}: 'huge_pages' must be one of {', '.join(HUGE_PAGES)}, not {show(doc['huge_pages'])}")
    if hp == "on" and not out["capture_workers"]:
        raise ConfigError(f"{path}: huge_pages applies to capture workers' shared memory: set capture_workers: true")
    out["huge_pages"] = hp
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


@contextlib.contextmanager
def made_dirs_removed_on_failure(cfg: DaemonConfig):
    """The directories a start makes (`out`, `dump_gradients`, their missing parents),
    removed again where still empty when the start fails: a missing interface or a port
    in use left an empty `out` behind, as if a run had been there and written nothing.
    One that was there before is never touched, nor one that holds anything."""
    made: list[Path] = []
    for d in (cfg.out, cfg.dump_gradients):
        p = Path(d) if d else None
        while p is not None and not os.path.lexists(p) and p not in made:
            made.append(p)
            p = p.parent if p.parent != p else None
    try:
        yield
    except BaseException:
        for p in sorted(made, key=lambda p: len(p.parts), reverse=True):  # the innermost first
            with contextlib.suppress(OSError):   # rmdir: empty only; a file written there keeps it
                p.rmdir()
        raise


class Daemon:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        for key in ("plan", "init"):  # named by its key (and file), not as a bare path
            if not os.path.exists(getattr(cfg, key)):
                raise ConfigError(f"{cfg.where}'{key}' {getattr(cfg, key)}: "
                                  "no such file")
        try:
            self.plan = load_plan(cfg.plan)
        except PlanError as e:
            raise ConfigError(str(e)) from e
        if past := self.plan.past_the_job(cfg.join_from, cfg.plan):
            raise ConfigError(f"{cfg.where}'join_from' {cfg.join_from}: {past}")
        self._refuse_foreign_checkpoints()
        self._refuse_short_snaplen()
        ncopies = MemoryTier.copies(writer=not cfg.persist_sync) if cfg.memory_tier else 0
        require_memory(self.plan.shadow_bytes() + ncopies * self.plan.state_bytes(), f"shadowing the plan {cfg.plan}"
                       + (f" with the memory tier's {ncopies} copies (memory_tier: false to go without)"
                          if ncopies else ""))
        if cfg.user is not None:  # an unknown user is refused before anything is opened
            from ckptd.live.privilege import resolve
            resolve(cfg.user, cfg.group)
        # a trainer's file that does not name its parameters is indexed in its optimizer's order
        self.start_state = load_checkpoint(cfg.init, self.plan.state_names)
        self.plan.check_start(self.start_state, cfg.init)
        if extra := self.plan.not_in_plan(self.start_state, cfg.init, cfg.plan):
            log.warning("%s: no checkpoint will carry it", extra)
        self.names = [i.name for i in cfg.interfaces]
        # /status `capture` and the metrics' `interface` label: the interface's name, or, for
        # the rings that share one (a fanout group, ERSPAN sessions), `<ifname>:<stream>`
        shared = collections.Counter(i.ifname for i in cfg.interfaces)
        self.capture_keys = [i.ifname if shared[i.ifname] == 1 else f"{i.ifname}:{i.name}" for i in cfg.interfaces]
        self.stop = threading.Event()
        self.snapshot = Snapshot()
        self.captures: list = []  # RingCapture, or WorkerCapture with capture_workers
        # what each interface lost before any ring saw it, by (ifname, netns) (ckptd.live.nic)
        self.nic_counters: dict[tuple, object] = {}
        self.workers = None  # ckptd.live.workers.CaptureWorkers with capture_workers
        self.frames = 0
        self.by_status: dict[str, int] = {}
        self.last_report: IterationReport | None = None
        self.last_committed: IterationReport | None = None  # (kept, not searched for: the status reads it)
        self.last_finite: int | None = None  # the newest iteration committed with finite parameters
        self.diverged: dict | None = None  # since when the committed parameters hold NaN or inf
        self.loop = LoopClock()
        self.unrecovered: list[dict] = []
        self.capture_ended = False  # every capture failed, with no stop asked for (exit 6)
        self.errors_logged = 0  # capture errors logged as they came (the rest are at the stop)
        self.unrecovered_statuses: set[str] = set()
        self.started = time.time()
        self.notifier = Notifier(cfg.notice) if cfg.notice is not None else None
        self._join_logged = False
        self._faults_logged: set[tuple[int, str]] = set()  # (stream, class) of stream_faults logged
        self._written_off_logged: set[int] = set()  # streams logged as taken for stopped
        self._unverified_logged: set[int] = set()  # iterations logged as unverified
        self.drop_iterations: set[int] = set()  # iterations in flight while the kernel dropped
        self._drops_seen: list[int] = []  # kernel drops per ring at the last look
        self._nic_drops: dict[tuple, tuple[float, int]] = {}  # (ifname, netns): (read at, frames lost)
        # per ring that dropped: the wall clock (ns) of the look that saw it; open until the
        # ring's stream has placed frames from after it (see _watch_drops)
        self._drop_gaps: dict[int, int] = {}
        self._drops_done = -1  # the pipeline's last finished iteration at the last look
        self._drops_looked = 0.0  # time.monotonic() of the last look
        self._ring_warned: set[int] = set()  # rings logged as nearly full (RING_WARN_FILL)
        self._published_at, self._published_frames = 0.0, 0  # the last status snapshot's
        # the checkpoint files: written in the commit path (persist_sync), else by the
        # persistence tier's thread (ckptd.live.persist) from copies taken at the commit
        # a restart: the own newest persisted state first, then `resume` (the trainer's
        # checkpoints: after an outage longer than that state covers, ckptd.live.notice)
        self.restarted_from = self._own_newest() if cfg.join else None
        opts = ReplayOptions(out=cfg.out if cfg.persist_sync else None,
                             restart=self.restarted_from[1] if self.restarted_from else None,
                             resume=cfg.resume, dump_gradients=cfg.dump_gradients,
                             join=cfg.join, join_from=cfg.join_from, keep_last=cfg.keep_last,
                             keep_every=cfg.keep_every, retry_writes=True,
                             agree_window_ms=cfg.agree_window_ms,
                             stream_names=tuple(i.name for i in cfg.interfaces))
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
            # the first iterations' buffers now: placing them must not wait on fresh pages
            # while the rings fill (ckptd.fast.pipeline.FastPipeline.reserve_iterations)
            self.pipe.reserve_iterations()
        else:
            self.pipe = Pipeline(self.plan, self.start_state, len(cfg.interfaces), opts,
                                 on_iteration=self._on_iteration, keep_reports=KEEP_REPORTS)
        self.memory = MemoryTier() if cfg.memory_tier else None
        self.persist = None
        if not cfg.persist_sync:
            from ckptd.live.persist import PersistTier
            try:
                self.persist = PersistTier(self.persist_target, cfg.persist_every, cfg.persist_interval_s,
                                           cfg.keep_last, cfg.keep_every, self.plan_hash(),
                                           options=cfg.persist_options)
            except (CheckpointError, CheckpointWriteError) as e:  # a directory that cannot be made: named by its key
                key = "persist_url" if cfg.persist_url else "out"
                raise ConfigError(f"{cfg.where}'{key}': {e}") from e
        shadow = getattr(self.pipe, "pipeline", self.pipe).shadow
        if shadow is not None:
            shadow.prepare_state()  # nor in the first step
            if self.memory is not None:  # nor in a commit
                self.memory.reserve(*shadow.state_template(), writer=self.persist is not None)
        self._newest = None  # the newest committed state's copy handed to a tier (HeldState)
        self.pipe.on_commit.append(self._committed)

    def _refuse_short_snaplen(self):
        """A snaplen that cuts the plan's full data frames (a RoCE write of path MTU
        bytes: Ethernet, IPv4, UDP, BTH, RETH, the payload, the ICRC, at the least) loses
        every iteration, found only once frames came in: refused at start."""
        if self.plan.transport != "roce":
            return
        least = self.plan.ring.mtu + ROCE_FRAME_OVERHEAD
        for k, i in enumerate(self.cfg.interfaces):
            if i.snaplen < least:
                raise ConfigError(f"{self.cfg.where}'interfaces[{k}].snaplen' "
                                  f"{i.snaplen} cuts the plan's data frames (ring.mtu {self.plan.ring.mtu}: at least "
                                  f"{least} bytes each, more with VLAN tags, IPv6 or ERSPAN): every iteration would "
                                  "be lost; leave snaplen out (65535)")

    def _refuse_foreign_checkpoints(self):
        """Checkpoints in the directory the daemon writes that it did not write (a
        trainer's, with `resume` the same directory; a replay's): retention pruned them
        as its own and a commit of the same iteration replaced one, without a word, and
        restore(out) took the newest of them. Refused before anything is captured."""
        from ckptd.core.manifest import unlisted_checkpoints
        from ckptd.core.store import open_store
        key = "persist_url" if self.cfg.persist_url else "out"
        store = open_store(self.persist_target, self.cfg.persist_options)
        if not store.local or not store.path.is_dir():
            return  # (a remote listing may be slow or down at start; an `out` in the way is refused later)
        try:
            foreign = unlisted_checkpoints(store)
        except (CheckpointError, OSError) as e:
            raise ConfigError(f"{self.cfg.where}'{key}' {store.path}: {e}") from e
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise ConfigError(
                f"{self.cfg.where}'{key}' {store.path} holds checkpoints this "
                f"daemon did not write ({shown}: no manifest.json there lists them); retention would delete them "
                "and commits overwrite them: give it a directory of its own, or move them away"
                + (" (persist_sync writes no manifest: its own files of an earlier run count as others')"
                   if self.cfg.persist_sync else ""))

    @property
    def persist_target(self) -> str:
        """Where the persistence tier writes: `persist_url`, else the `out` directory."""
        return self.cfg.persist_url or self.cfg.out

    def _own_newest(self) -> tuple[int, str] | None:
        """A restart: the newest state this daemon persisted before (the persistence
        tier's manifest in `out` or at `persist_url`, verified against it), as the state
        to join from (before `resume`): (iteration, file). A state read from
        a URL is written to `out` (restart-iter_NNNNNN.pt) for the pipeline to resume from."""
        from ckptd.core.checkpoint import CheckpointError, checkpoint_name, save_checkpoint
        from ckptd.core.store import credentials_in, open_store, redact
        from ckptd.core.manifest import newest_verified
        try:
            store = open_store(self.persist_target, self.cfg.persist_options)
            got = newest_verified(store)
            if got is None:
                return None
            doc, entry = got
            path = (store.path / entry["file"]) if store.local else \
                Path(self.cfg.out) / f"restart-{checkpoint_name(entry['iteration'])}"
            if not store.local:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                save_checkpoint(path, doc["iteration"], doc["model"], doc.get("optimizer"))
        except (CheckpointError, OSError, ValueError) as e:
            log.warning("cannot restart from the persisted state",
                        extra={"fields": {"error": redact(one_line(e), credentials_in(self.cfg.persist_options))}})
            return None
        log.info("restarting from the persisted state", extra={"fields": {
            "iteration": entry["iteration"], "from": store.where(entry["file"])}})
        return entry["iteration"], str(path)

    def plan_hash(self) -> str:
        return hashlib.sha256(Path(self.cfg.plan).read_bytes()).hexdigest()[:16]

    def _committed(self, iteration: int, model: dict, optimizer: dict | None):
        """The commit path's tiers: the memory tier copies every commit; the persistence
        tier gets that copy when a write is due (without a memory tier, a copy is taken
        only then)."""
        from ckptd.live.memory_tier import HeldState, copy_state
        held = None
        if self.memory is not None:
            held = self.memory.commit(iteration, model, optimizer)
        if self.persist is not None and self.persist.due(iteration):
            held = held or HeldState(iteration, copy_state(model), copy_state(optimizer), time.time(), 0.0)
            self.persist.offer(held)
        self._newest = held or self._newest

    # -- feature hooks on the core loop ----------------------------------------------
    def _on_iteration(self, rep: IterationReport):
        self._mark_kernel_drops(rep)
        if self.notifier is not None:
            self.notifier.on_iteration(rep)
        self.by_status[rep.status] = self.by_status.get(rep.status, 0) + 1
        self.last_report = rep
        if rep.status == "committed":
            self.last_committed = rep
            self._watch_divergence(rep)
        fields = {"iteration": rep.iteration, "status": rep.status, "packets": rep.packets,
                  "coverage": [round(c, 6) for c in rep.coverage], "note": rep.note.strip()}
        if rep.commit_lag is not None:
            fields["commit_lag_s"] = round(rep.commit_lag, 6)
        if rep.write_seconds is not None:
            fields["write_s"] = round(rep.write_seconds, 6)
        if rep.through is not None:  # not-captured: the gap's last iteration
            fields["through"] = rep.through
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
            self.unrecovered_statuses.add(fields["status"])  # the list keeps the newest 100 only
            del self.unrecovered[:-100]
            log.warning("iteration not recovered", extra={"fields": fields})
        self._publish()

    def _watch_divergence(self, rep: IterationReport):
        """A committed iteration whose parameters hold NaN or inf: the job diverged (the
        shadow is exact: the trainer holds them too). Said once, with the newest finite
        commit, which retention keeps (ckptd.core.finite)."""
        if not rep.nonfinite:
            self.last_finite = rep.iteration
            self.diverged = None  # a resync or restart onto a finite state
            return
        if self.diverged is None:
            self.diverged = {"since": rep.iteration, "parameter": rep.nonfinite,
                             "newest_finite_committed": self.last_finite}
            log.warning("the job diverged: its parameters hold NaN or inf", extra={"fields": self.diverged})
            if self.notifier is not None:
                self.notifier.on_diverged(self.diverged)
            self._persist_last_finite()

    def _persist_last_finite(self):
        """Once the job diverged: the newest finite committed state on disk, if the memory
        tier still holds it and `persist_every` skipped it (retention then keeps it). The
        trainer is to go back to it, and the next commit would push it out of memory."""
        it = self.last_finite
        if self.persist is None or self.memory is None or it is None:
            return
        if it in {e["iteration"] for e in self.persist.entries}:
            return  # (one handed over but not yet written may be superseded: written twice is harmless)
        held = self.memory.get(it)
        if held is not None:
            self.persist.write_older(held)

    def _log_new_errors(self):
        """A worker died, a link went down: said now, not at the stop (both loops)."""
        if len(self.pipe.errors) > self.errors_logged:
            for e in self.pipe.errors[self.errors_logged:]:
                log.error("capture error", extra={"fields": {"error": e}})
            self.errors_logged = len(self.pipe.errors)
            self._publish()

    def _counting(self, source):
        """Frames to the pipeline, counted. A quiet tick from the rings ((-1, None)) moves
        the capture clock on (the agreement window); after QUIET_S without a frame the
        transport places what it held back for want of later traffic (a paused or
        killed job sends none), so the last iterations commit now, not at the stop."""
        settled_ns = (max((i.retire_ms for i in self.cfg.interfaces), default=0) + 5) * 1_000_000
        last = time.monotonic()
        for k, fr in source:
            self._log_new_errors()
            if fr is None:
                quiet = time.monotonic() - last >= QUIET_S
                self.pipe.idle(time.time_ns() - settled_ns, place_held=quiet)
                if self._snapshot_due(quiet=True):
                    self._publish()
                if quiet:
                    last = time.monotonic()  # once per quiet spell, then every QUIET_S
                continue
            last = time.monotonic()
            self.frames += 1
            if self._snapshot_due():
                self._watch_drops()
                self._publish()
            yield k, fr
        self._watch_drops(force=True)

    # -- kernel ring drops -------------------------------------------------------------
    def _watch_drops(self, force: bool = False):
        """Look at the rings' kernel drop counters (PACKET_STATISTICS) and their
        interfaces' (frames lost before any ring: ckptd.live.nic). Frames a ring
        dropped since the last look may belong to any iteration in flight since then or
        to later ones that no frame of has been read yet (a long stall loses whole
        iterations; the ring still holds frames from before the gap). So after a ring
        drops, every iteration up to the newest seen is remembered at each look until
        that ring's stream has placed frames captured after the look that saw the drops
        (Pipeline.stream_time; the idle clock counts too): then its gap is behind.
        Iterations remembered that end incomplete are reported as lost to kernel drops,
        not abandoned or unrecoverable."""
        if not self.captures:
            return
        now = time.monotonic()
        if not force and now - self._drops_looked < DROPS_LOOK_S:
            return
        self._drops_looked = now
        stats = [c.stats() for c in self.captures]
        # a ring's losses: its own drops, and its interface's (frames lost before any ring)
        per_ring = [st["drops"] + self._interface_drops(c, now, force) for c, st in zip(self.captures, stats)]
        self._warn_full_rings(stats)
        seen = self._drops_seen or [0] * len(per_ring)
        for k, (d, before) in enumerate(zip(per_ring, seen)):
            if d > before:
                self._drop_gaps[k] = time.time_ns()
        self._drops_seen = per_ring
        if self._drop_gaps:
            off = self.pipe.offset
            self.drop_iterations.update(range(self._drops_done + 1 + off, self.pipe.highest + 2 + off))
            clock = self.pipe.stream_time  # per stream; a ring per stream, else the slowest
            per_stream = len(clock) == len(per_ring)
            self._drop_gaps = {k: t for k, t in self._drop_gaps.items()
                               if (clock[k] if per_stream else min(clock)) < t}
        self._drops_done = self.pipe.done

    def _interface_drops(self, capture, now: float, force: bool = False) -> int:
        """Frames the capture's interface lost before any ring saw them (ckptd.live.nic),
        read at most every NIC_LOOK_S unless forced (a host's /proc/net/dev can be long)."""
        key = (capture.ifname, getattr(capture, "netns", None))
        last = self._nic_drops.get(key)
        if last is not None and not force and now - last[0] < NIC_LOOK_S:
            return last[1]
        st = self._interface_stats(capture)
        lost = (st["dropped"] + st["fifo"]) if st else 0
        self._nic_drops[key] = (now, lost)
        return lost

    def _warn_full_rings(self, stats: list[dict]):
        """Log a ring the first time its high-water mark (RingCapture.stats ready_peak)
        reaches RING_WARN_FILL of its blocks: the operator hears of a loop that falls
        behind before it costs frames, with what to do about it."""
        for k, st in enumerate(stats):
            nr, peak = st.get("block_nr"), st.get("ready_peak", 0)
            if k not in self._ring_warned and nr and peak >= RING_WARN_FILL * nr:
                self._ring_warned.add(k)
                log.warning("capture ring nearly full", extra={"fields": {
                    "interface": st["ifname"], "ready_peak": peak, "blocks": nr, "drops": st["drops"],
                    "hint": "the capture loop fell behind for a while: a full ring drops frames; give "
                            "the daemon CPUs of its own (cpus), capture workers, or more ring "
                            "(block_nr; docs/DAEMON.md, sizing)"}})

    def _mark_kernel_drops(self, rep: IterationReport):
        """An iteration that did not commit and was in flight while a ring (or its
        interface) dropped frames lost data to the kernel: status `dropped` (exit
        status 4), whatever else it would have been called (a stop mid-iteration calls
        it abandoned). The counters are read again first: the drops may have happened
        in the batch that ends it."""
        if rep.status in ("abandoned", "unrecoverable"):
            self._watch_drops(force=True)
        if rep.status in ("abandoned", "unrecoverable") and rep.iteration in self.drop_iterations:
            drops = {key: c.stats()["drops"] for key, c in zip(self.capture_keys, self.captures)
                     if c.stats()["drops"]}
            nic = {key: lost for key, c in zip(self.capture_keys, self.captures)
                   if (lost := self._interface_drops(c, time.monotonic()))}
            where = ", ".join(([f"ring drops so far: {drops}"] if drops else [])
                              + ([f"dropped by the interface before any ring: {nic}"] if nic else []))
            rep.note = (f"{rep.status}: the kernel dropped frames while it was in flight "
                        f"({where}); {rep.note.strip()}")
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
        from ckptd.live.ring import ring_batches, turn_bytes
        if self.workers is not None:
            batches = self.workers.batches(self.stop, self.pipe.errors, on_poll=self.loop.polled, idle=True)
        else:
            batches = ring_batches(self.captures, self.stop, self.pipe.errors, idle=True,
                                   on_poll=self.loop.polled, turn=turn_bytes(self.plan.least_link_bytes()))
        # frames wait in a ring block for at most retire_ms before it is handed over: all
        # frames older than that have been placed when the rings are quiet
        settled_ns = (max(i.retire_ms for i in self.cfg.interfaces) + 5) * 1_000_000
        for _, batch in batches:
            self._log_new_errors()
            if batch is None:  # the mirror ports are quiet: the capture clock moves on
                self.pipe.advance_clock([time.time_ns() - settled_ns] * len(self.captures))
                if self._snapshot_due(quiet=True):
                    self._publish()
                continue
            self._watch_drops()
            yield batch
        self._watch_drops(force=True)

    def _run_fast(self, batches):
        for batch in batches:
            self.frames += len(batch)
            self.pipe.run_batch(batch)
            if self._snapshot_due():
                self._publish()
        self.pipe.finish(abandon=True)

    def _snapshot_due(self, quiet: bool = False) -> bool:
        """Whether the capture loop should publish a status snapshot now: SNAPSHOT_S after
        the last one while frames flow; when the rings have gone quiet, as soon as frames
        came since the last one (so the status holds every frame placed). A snapshot
        costs ~130 us (every stream's and ring's counters): at line rate one per 4,096
        frames was 5% of the loop's CPU; twenty a second tell as much."""
        if quiet:
            return self.frames != self._published_frames
        return time.monotonic() - self._published_at >= SNAPSHOT_S

    def _publish(self, state: str = "running"):
        self._published_at, self._published_frames = time.monotonic(), self.frames
        if self.pipe.joined is not None and not self._join_logged:
            self._join_logged = True
            log.info("joined the running job", extra={"fields": {
                "iteration": self.pipe.joined, "packets_before": self.pipe.before_join}})
            if self.pipe.join_unbound:
                log.warning("joined before every flow was seen: the joined iteration may lack their packets",
                            extra={"fields": {"iteration": self.pipe.joined,
                                              "links": ", ".join(self.pipe.join_unbound)}})
        self._watch_written_off()
        committed = self.last_committed
        keeper = self.pipe.keeper or (self.persist.keeper if self.persist else None)
        last = self.last_report
        streams = []
        for k, name in enumerate(self.names):
            cls = self.pipe.classes[k]
            for kind, line in stream_faults(name, cls).items():
                if (k, kind) not in self._faults_logged:  # once: /status streams[].classes keeps counting
                    self._faults_logged.add((k, kind))
                    log.warning(f"{line} (so far: /status counts on, the stop logs the total)",
                                extra={"fields": {"stream": name, "class": kind}})
            streams.append({"name": name, "frames": cls.get("frames", 0),
                            "classes": {c: v for c, v in cls.items() if c != "frames"},
                            "coverage": last.coverage[k] if last and last.coverage else None,
                            "loss": last.loss[k] if last and last.loss else None})
        doc = {
            "state": state, "uptime_s": round(time.time() - self.started, 3),
            "last_committed": committed.iteration if committed else -1,
            "last_checkpoint": (keeper.store.where(checkpoint_name(keeper.last_persisted))
                                if keeper and keeper.last_persisted is not None else None),
            "checkpoints": (self.persist.status() if self.persist else keeper.status() if keeper else None),
            "commit_lag_s": committed.commit_lag if committed else None,
            "checkpoint_write_s": committed.write_seconds if committed else None,
            "iterations_by_status": dict(self.by_status),
            # copies of iterations already finalized: not compared with what was committed
            # (a stream more than agree_window_ms behind the others shows here first)
            "late_copies": self.pipe.late,
            # committed without a stream taken for stopped, whose copies of them came after
            # (Pipeline.copies_seen): never compared, and every later state stems from them
            "unverified": sorted(self.pipe.unverified),
            "unverified_from": self.pipe.unverified_from,  # every later checkpoint too
            "shadow_stopped_after": self.pipe.stopped_after,
            "diverged": self.diverged,
            "join": ({"joining": self.pipe.joining, "joined_at": self.pipe.joined,
                      "packets_before": self.pipe.before_join, "unbound": list(self.pipe.join_unbound),
                      "restarted_from": self.restarted_from[0] if self.restarted_from else None}
                     if self.cfg.join else None),
            "streams": streams,
            "capture": {key: {**{k: st[k] for k in ("packets", "drops", "delivered", "worker") if k in st},
                              "ring": {"blocks": st.get("block_nr"), "ready_peak": st.get("ready_peak")},
                              "interface": self._interface_stats(c)}
                        for key, c, st in ((key, c, c.stats()) for key, c in zip(self.capture_keys, self.captures))},
            "extraction": dict(self.pipe.extract.counters),
            "pipeline": self._pipeline_stats(),
            "loop": self.loop.sample(),
            "unrecoverable": self.unrecovered[-20:],
            "notice": self.notifier.stats() if self.notifier is not None else None,
        }
        self.snapshot.publish(doc)

    def routes(self) -> dict:
        ckpt = None
        if self.memory is not None:
            from ckptd.core.formats import trainer_hyper
            names = self.plan.state_names
            plan_hash = self.plan_hash()

            def hyper_for(held):  # the hyperparameters move with the schedule: each state its own
                return trainer_hyper(self.plan, held.checkpoint()) if held.optimizer is not None else None
            ckpt = checkpoint_routes(self.memory, names, hyper_for, plan_hash,
                                     unverified_from=lambda: self.pipe.unverified_from)
        return routes(self.snapshot, self.cfg.status_details, ckpt, live=self._live_status)

    def _live_status(self) -> dict:
        """Read at each /status request: the memory tier takes its copy off the commit
        path (on the optimizer's thread), after the snapshot of that commit was published.
        The clock too: snapshots are taken while frames flow, and on a quiet link the last
        one's uptime_s stood still, so a monitor could not tell a quiet daemon from a hung
        one; `snapshot_age_s` says how old the rest of the document is."""
        clock = {"uptime_s": round(time.time() - self.started, 3),
                 "snapshot_age_s": round(time.monotonic() - self.snapshot.published, 3)}
        if self.memory is None:
            return {**clock, "memory": None}
        held = self.memory.latest()
        return {**clock, "memory": {"iterations": self.memory.iterations(),
                                    "copy_s": round(held.copy_seconds, 6) if held else None}}

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

    def drop_privileges(self, hand_over: bool = True) -> list[str]:
        """The capture sockets are open (netns entered). With `user` configured: become
        that user with CAP_NET_RAW alone, or no capability with drop_capabilities; else
        with drop_capabilities: stay root without any capability (ckptd.live.privilege),
        in every thread. The directories the daemon writes that root owns are handed to
        the user first (hand_over False, for --check: only returned)."""
        if self.cfg.user is None:
            if self.cfg.drop_capabilities:
                from ckptd.live.privilege import drop_capabilities
                drop_capabilities()
            return []
        from ckptd.live.privilege import drop_privileges
        return drop_privileges(self.cfg.user, self.cfg.group,
                               [d for d in (self.cfg.out, self.cfg.dump_gradients, self._persist_dir()) if d],
                               keep_net_raw=not self.cfg.drop_capabilities, hand_over=hand_over)

    def _check_writable(self, handed: tuple[str, ...] = ()):
        """Every local directory the daemon writes takes a file, as the daemon now runs
        (its user, its capabilities dropped): a daemon that could never write a checkpoint
        stops at the start with one line, not after hours of failed writes. `handed`: root
        owned ones that --check did not hand to the user (a start does): the user must
        reach them and their mode let their owner write."""
        import stat
        import tempfile
        who = f"as user {self.cfg.user}" if self.cfg.user else \
            "as root without capabilities" if self.cfg.drop_capabilities and os.geteuid() == 0 else \
            f"as uid {os.geteuid()}"
        for key, d in (("out", self.cfg.out), ("dump_gradients", self.cfg.dump_gradients),
                       ("persist_url", self._persist_dir())):
            if not d:
                continue
            try:
                if d in handed:
                    mode = os.stat(d).st_mode  # (an ancestor the user may not search: EACCES)
                    if (mode & (stat.S_IWUSR | stat.S_IXUSR)) != stat.S_IWUSR | stat.S_IXUSR:
                        raise ConfigError(f"{key} {d}: the daemon cannot write there ({who}): a start hands it "
                                          f"to the user, and its mode {stat.filemode(mode)} lets no owner write")
                    continue
                Path(d).mkdir(parents=True, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix=".ckptd-probe-", dir=d)
                os.close(fd)
                os.unlink(probe)
            except OSError as e:
                raise ConfigError(f"{key} {d}: the daemon cannot write there ({who}): "
                                  f"{e.strerror or e}") from None

    def _lock_out(self):
        """An exclusive lock on the `out` directory for as long as the daemon runs: two
        daemons with one `out` deleted each other's temporary files as a crash's leftovers
        (a write failed, "No such file or directory"), and each one's manifest listed only
        its own commits, so the next start refused the other's as foreign. Released when
        the process ends, however it ends."""
        import fcntl
        fd = os.open(self.cfg.out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"{self.cfg.where}'out' {self.cfg.out} is in use by another ckptd daemon (it holds "
                              "the directory's lock): give each daemon an `out` of its own") from None
        self._out_fd = fd

    def _unlock_out(self):
        fd, self._out_fd = getattr(self, "_out_fd", None), None
        if fd is not None:
            os.close(fd)

    def _persist_dir(self) -> str | None:
        """persist_url naming a local directory (file://): it is the daemon's to write too."""
        from ckptd.core.store import open_store
        if not self.cfg.persist_url:
            return None
        store = open_store(self.cfg.persist_url)
        return str(store.path) if store.local else None

    def _persist_newest(self):
        """On a clean stop: the persistence tier writes the newest committed state (if not
        yet) and finishes. persist_sync, after writes failed: one more try for the newest
        committed state (the shadow holds it), so a disk that came back is used before exit."""
        if self.persist is not None:
            newest = self._newest
            shadow = self.pipe.shadow
            last = self.last_committed
            if (shadow is not None and last is not None and shadow.iteration == last.iteration
                    and (newest is None or newest.iteration != shadow.iteration)):
                from ckptd.live.memory_tier import HeldState
                newest = HeldState(shadow.iteration, shadow.model_state(), shadow.optimizer_state(),
                                   time.time(), 0.0)
            self.persist.close(newest)
            return
        keeper, shadow = self.pipe.keeper, self.pipe.shadow
        if keeper is None or not keeper.failing or shadow is None:
            return
        if shadow.iteration == keeper.newest_unpersisted:
            keeper.write(shadow.iteration, shadow.model_state(copy=False),
                         shadow.optimizer_state(copy=False), force=True)

    # -- running ---------------------------------------------------------------------
    def _interface_stats(self, capture) -> dict | None:
        counters = self.nic_counters.get((capture.ifname, getattr(capture, "netns", None)))
        return counters.stats() if counters is not None else None

    def open_captures(self):
        from ckptd.live.nic import open_counters
        for i in self.cfg.interfaces:  # in the namespace, while the daemon may still enter it
            key = (i.ifname, i.netns)
            if key not in self.nic_counters:
                self.nic_counters[key] = open_counters(i.ifname, i.netns)
        if self.cfg.capture_workers:
            self._open_workers()
            return
        from ckptd.live.ring import CaptureSetupError, RingCapture
        for k, i in enumerate(self.cfg.interfaces):
            fanout = None if i.fanout_group is None else (i.fanout_group, i.fanout_mode)
            try:
                self.captures.append(RingCapture(i.ifname, i.netns, block_size=i.block_size,
                                                 block_nr=i.block_nr, frame_size=i.frame_size,
                                                 retire_ms=i.retire_ms, snaplen=i.snaplen,
                                                 fanout=fanout, erspan_session=i.erspan_session,
                                                 # the kernel filter passes RoCEv2 and GRE only
                                                 bpf=self.plan.transport == "roce"))
            except CaptureSetupError as e:  # which config entry: the message names the interface
                raise CaptureSetupError(e.errno, f"{self.cfg.where}interfaces[{k}]: {e}") from e

    def check(self) -> None:
        """`ckptd run --check`: what a start does before its first frame, then stop. The
        constructor has loaded and checked the config, the plan and init, and reserved the
        shadow; here the status server binds its address, the captures open as in `run`
        (every interface's ring: the interface, its namespace, the ring memory, the fanout
        group, the filter; with capture_workers the worker processes and their shared
        memory) and close again, the privileges are dropped as configured (handing the
        user no directory), and the directories the daemon writes must take a file. Nothing is captured, served or
        written but that probe (and `out` made, as a start makes it)."""
        http_server(self.cfg, self.routes()).stop()   # the address is free, the token readable
        try:
            self.open_captures()
            # changing nothing: the directories a start hands to `user` stay root's here
            self._check_writable(tuple(self.drop_privileges(hand_over=False)))
        finally:
            for c in self.captures:
                c.close()
            self._close_interfaces(warn=False)
            if self.persist is not None:
                self.persist.close()

    def _close_interfaces(self, warn: bool):
        """Close the interfaces' counters; with `warn`, first log each interface that lost
        frames before any capture ring saw them (the NIC's ring or FIFO, the driver, the
        stack): those frames are missing from the streams, whatever the rings say."""
        for (ifname, netns), counters in self.nic_counters.items():
            if counters is None:
                continue
            st = counters.stats() if warn else None
            if st and (st["dropped"] or st["fifo"]):
                log.warning("the interface dropped frames before any capture ring saw them", extra={"fields": {
                    "ifname": ifname, "netns": netns, **st}})
            counters.close()

    # -- capture workers (ckptd.live.workers) ----------------------------------------
    def _open_workers(self):
        """One capture process per interface; then the coordinator (this process, all
        its threads) is pinned to `cpus`, after the workers started so that a worker
        without a `cpu` of its own keeps the machine's CPUs."""
        from ckptd.live.ring import CaptureSetupError, turn_bytes
        from ckptd.live.workers import CaptureWorkers
        try:
            self.workers = CaptureWorkers(self.cfg.interfaces, bpf=self.plan.transport == "roce",
                                          busy_poll=self.cfg.busy_poll, huge_pages=self.cfg.huge_pages,
                                          drop_capabilities=self.cfg.drop_capabilities,
                                          icrc=self.fast,  # the fast path's kernel then skips the CRC
                                          slot_bytes=turn_bytes(self.plan.least_link_bytes()))  # as ring_batches
        except CaptureSetupError as e:
            if not self.cfg.source:
                raise
            raise CaptureSetupError(e.errno, f"{self.cfg.source}: {e.strerror or e}") from e
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

    @staticmethod
    @contextlib.contextmanager
    def _startup_objects_frozen():
        """The objects made before the capture loop (torch's, the plan, the schedules, the
        shadow model: ~200k) kept out of the cyclic collector's walks while it runs: a
        full collection over them held the GIL for 60-160 ms, on whichever thread set it
        off, and the loop fell behind the rings (benchmarks/RESULTS.md). What the loop
        makes is collected as before. They go back at the end (tests run many daemons in
        one process)."""
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()

    def run(self, source=None, install_signals: bool = True) -> int:
        """Capture until stopped. `source` replaces the capture rings (tests, replays)."""
        if install_signals:
            self.install_signals()
        self.server = server = http_server(self.cfg, self.routes())
        self.address = server.address
        live = source is None
        try:
            if source is None:
                from ckptd.live.ring import ring_source
                self.open_captures()
                self.drop_privileges()
                if not self.fast:
                    source = ring_source(self.captures, self.stop, self.pipe.errors, idle=True,
                                         on_poll=self.loop.polled)
            self._check_writable()
            self._lock_out()
            self._publish()
            host, port = self.address[:2]
            bound = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # the port listen: ...:0 got
            log.info("capturing", extra={"fields": {"interfaces": self.names, "listen": bound,
                                                    "fast": self.fast}})
            with self._startup_objects_frozen():
                self.loop.start()
                if self.fast:
                    self._run_fast(self._ring_batches() if source is None else self._frame_batches(source))
                else:
                    self.pipe.run(self._counting(source), abandon=True)
            # the rings' loop ends on a stop, or when no capture is left (every ring or
            # capture worker failed): then the daemon is blind while the job goes on
            self.capture_ended = live and not self.stop.is_set()
            self._persist_newest()
        finally:
            if self.notifier is not None:  # before the last snapshot: it counts what was not sent
                self.notifier.close()
            self._publish("stopped")
            for c in self.captures:
                st = c.stats()
                if st["drops"]:
                    log.warning("kernel dropped frames", extra={"fields": st})
                c.close()
            self._close_interfaces(warn=True)
            server.stop()
            self._unlock_out()
        abandoned = [r.iteration for r in self.pipe.reports if r.status == "abandoned"]
        dropped = [r.iteration for r in self.pipe.reports if r.status == "dropped"]
        log.warning("stopped", extra={"fields": {
            "last_committed": self.last_committed.iteration if self.last_committed else -1,
            "joined_at": self.pipe.joined, "abandoned": abandoned, "dropped": dropped,
            "unverified": sorted(self.pipe.unverified),
            "diverged_since": self.diverged["since"] if self.diverged else None,
            "unrecovered": [u["iteration"] for u in self.unrecovered
                            if u["status"] not in ("abandoned", "dropped")]}})
        for k, kind in sorted(self._faults_logged):  # logged with the count when first seen: the total
            line = stream_faults(self.names[k], self.pipe.classes[k]).get(kind)
            if line:
                log.warning(f"{line} (in all)", extra={"fields": {"stream": self.names[k], "class": kind,
                                                                  "frames": self.pipe.classes[k][kind]}})
        for e in self.pipe.errors[self.errors_logged:]:  # (those logged as they came are not again)
            log.error("capture error", extra={"fields": {"error": e}})
        self._watch_written_off()  # (what came since the last snapshot)
        if self.pipe.late:  # their iteration was finalized: a disagreement among them is never seen
            log.warning("copies arrived after their iteration was finalized and were not compared with what was "
                        "committed: a mirror stream more than agree_window_ms behind the others can hide a "
                        "disagreement this way (raise agree_window_ms)", extra={"fields": {
                            "late_copies": self.pipe.late, "unverified": sorted(self.pipe.unverified),
                            "agree_window_ms": self.cfg.agree_window_ms}})
        if any(u["status"] not in ("abandoned", "dropped", "not-captured") for u in self.unrecovered):
            # what replay prints under its table: why packets were rejected (the first few),
            # flows no connection explains, a capture begun mid-job (`join: true`), suspects.
            # The notes alone called a mid-job start copies "in conflict"
            ex = self.pipe.extract
            for line in [f"rejected: {e}" for e in ex.examples[:5]] + ex.diagnostics() + ex.suspects():
                line = line.replace("replay with --join (or --join-from N)", "set join: true (or join_from: N)")
                log.warning("diagnosis", extra={"fields": {"detail": line}})
        if self.capture_ended:
            last = max((r.iteration for r in self.pipe.reports), default=None)
            log.error("capture ended without a stop: every mirror port's capture failed (the capture errors above "
                      "say why); the job's iterations after the last reported were not captured", extra={
                          "fields": {"last_reported": last}})
        if (lost := self._unpersisted()) is not None:
            from ckptd.core.store import redact
            log.error("the newest committed checkpoint was not written", extra={"fields": {
                "iteration": lost, "to": redact(self.persist_target)}})
        return self._exit_status()

    def _unpersisted(self) -> int | None:
        """After the stop: the newest committed iteration, if its checkpoint could not be
        written (the persistence tier's last try at the stop included)."""
        keeper = self.persist.keeper if self.persist is not None else self.pipe.keeper
        last = self.last_committed
        if last is None or keeper is None or keeper.last_persisted == last.iteration:
            return None
        return last.iteration

    def _watch_written_off(self):
        """Log once each stream the pipeline takes for stopped while it owed copies
        (Pipeline._copies_due), and each iteration found unverified (its copies came
        after all): the operator hears of both as they happen."""
        pipe = self.pipe
        for k in [k for k in self._written_off_logged if k not in pipe.written_off]:
            self._written_off_logged.discard(k)  # back in step; logged again if it stops again
        for k in pipe.written_off:
            if k not in self._written_off_logged:
                self._written_off_logged.add(k)
                log.warning(f"stream {self.names[k]} carried no packet of the job for {SILENT_STREAM_WINDOWS} "
                            "agreement windows while it owed copies: taken for stopped, iterations commit without "
                            "its copies (if they come after all, those iterations are reported unverified)",
                            extra={"fields": {"stream": self.names[k], "agree_window_ms": self.cfg.agree_window_ms}})
        new = sorted(set(pipe.unverified) - self._unverified_logged)
        if new:  # (the line names every one so far: each error says all that is known)
            self._unverified_logged |= set(new)
            log.error(f"{pipe.unverified_note()} (/status unverified; exit 3)",
                      extra={"fields": {"iterations": new}})

    def _exit_status(self) -> int:
        """0: every iteration seen committed or was merely in flight at the stop;
        3: an iteration could not be recovered (the capture had no copy of some of its
        data); 4: an iteration lost data to kernel ring drops (rings too small, or the
        daemon too slow for the link: docs/DAEMON.md, sizing) or to its interface's
        (ckptd.live.nic); 5: the newest committed checkpoint could not be written. 4 and
        5 win over 3: they name what the operator can fix (3 also where committed
        iterations are unverified: Pipeline.copies_seen); 6: capture ended without a stop
        (every ring or capture worker failed), which wins over all: nothing after it is
        known."""
        if self.capture_ended:
            return 6
        statuses = self.unrecovered_statuses
        if "dropped" in statuses:
            return 4
        if self._unpersisted() is not None:
            return 5
        if self.pipe.unverified:  # committed, then copies came that were never compared
            return 3
        # not-captured: ran before this daemon saw the job (reported, and noticed)
        return 3 if statuses - {"abandoned", "not-captured"} else 0
