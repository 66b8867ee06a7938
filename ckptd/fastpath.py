"""The fast path: the batch kernel (cython_ext/batch.pyx) behind the reference pipeline.

    source    load_captures: pcap/pcapng files read into one buffer, frames indexed
              (offsets, lengths, stream ids) and merged in capture-time order -> Batch
    decode    \\
    place      > BatchKernel.run, one pass over a Batch without the GIL
    assemble  /  (writes straight into the open IterationAssembly arrays)
    apply, keep   unchanged: ckptd.pipeline.Pipeline does them

The pure-Python path (ckptd.pipeline, ckptd.extract, ckptd.flows, ckptd.assemble) stays
the reference, and this module leans on it for every decision the kernel cannot make
alone. The kernel stops at a frame that needs one, before changing anything for it:

    unknown flow          FlowBinder (Extractor.feed) binds it, or calls it unrelated
    iteration not open    Pipeline._assemble opens it (and may finalize older ones)
    LL flag base unknown  Extractor learns it from this packet
    rejection             while Extractor still records examples (the first 20)
    reduce-scatter step 0 while gradients are dumped (Pipeline keeps those placements)

Python then runs the reference path on that one frame (parsers.roce.decode_frame,
Extractor.feed, Pipeline._assemble), copies what changed into the kernel's tables
(new bindings, PSN anchors, flag bases, open iterations) and resumes at the next frame.
So every frame is processed in capture order by exactly one of the two, and buffers,
coverage, conflicts, counters and per-stream loss come out as the reference's.

Entry points: `fast_replay` (ckptd.pipeline.replay's twin), `FastPipeline.run_batch` for
batches from any source (a capture ring block is a Batch too), `FastExtractor` for the
extractor alone.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from cython_ext import batch as _kernel
from parsers.capture import CaptureError, CapturedFrame, capture_format, open_capture
from parsers.opcodes import EXT_LEN, OPCODES
from parsers.pcap import MAGIC_NS, MAGIC_US
from parsers.roce import _DECODED, FrameClass, decode_frame

from .extract import MAX_EXAMPLES, Extractor
from .flows import DATA_OPCODES, FlowBinding, Packet
from .pipeline import IterationReport, Pipeline, ReplayOptions, decode
from .plan import Plan

CLASS_NAMES = _kernel.CLASS_NAMES
COUNTER_NAMES = _kernel.COUNTER_NAMES
STOP_NAMES = _kernel.STOP_NAMES
MAX_SLOTS = _kernel.MAX_SLOTS
CONFLICT_CAP = _kernel.CONFLICT_CAP
FLOW_BOUND, FLOW_UNRELATED = 1, 2
STOP_CONFLICTS_FULL = STOP_NAMES.index("conflicts_full")
BATCH_FRAMES = 1 << 16  # frames per batch when frames come one by one (Pipeline.run)


# -- ICRC implementation ---------------------------------------------------------------------
def isal_crc_address() -> int | None:
    """Address of ISA-L's crc32_gzip_refl (same contract as zlib's crc32) if the `isal`
    package is installed: it links ISA-L statically and exports the symbol."""
    try:
        import isal.isal_zlib as m
        lib = ctypes.CDLL(m.__file__)
        return ctypes.cast(lib.crc32_gzip_refl, ctypes.c_void_p).value
    except (ImportError, OSError, AttributeError):
        return None


def crc_choices() -> list[str]:
    """ICRC implementations this machine can run, fastest first."""
    cpu = _kernel.cpu_features()
    out = [name for name, ok in (("vclmul", cpu["vclmul"]), ("clmul", cpu["clmul"])) if ok]
    if isal_crc_address():
        out.append("isal")
    return out + ["zlib"]


def crc_setting(name: str) -> tuple[int, int]:
    """(kernel implementation index, external address) for a CRC name or 'auto'."""
    if name == "auto":
        name = crc_choices()[0]
    if name == "isal":
        addr = isal_crc_address()
        if not addr:
            raise ValueError("crc 'isal' needs the isal package (pip install isal)")
        return _kernel.CRC_IMPLS.index("external"), addr
    if name not in _kernel.CRC_IMPLS or name == "external":
        raise ValueError(f"unknown crc {name!r}: auto, {', '.join(crc_choices())}")
    if name != "zlib" and name not in crc_choices():
        raise ValueError(f"crc {name!r} needs CPU features this machine lacks")
    return _kernel.CRC_IMPLS.index(name), 0


def fold_constants(distance_bits: int) -> tuple[int, int]:
    """(K_lo, K_hi) the kernel folds a 128-bit lane forward by `distance_bits` with:
    reflect64(x^(D+63) mod P), reflect64(x^(D-1) mod P), P the CRC-32 polynomial.
    Kept here so the constants in batch.pyx can be checked (tests/test_fastpath.py)."""
    poly = 0x104C11DB7

    def xpow(k):
        r = 1
        for _ in range(k):
            r <<= 1
            if r >> 32:
                r ^= poly
        return r

    def reflect64(r):
        return sum(((r >> j) & 1) << (63 - j) for j in range(32))

    return reflect64(xpow(distance_bits + 63)), reflect64(xpow(distance_bits - 1))


# -- opcode table (parsers/opcodes.py) ------------------------------------------------------
def opcode_tables() -> dict[str, np.ndarray]:
    """Per opcode: known, may carry payload, is feedback (ACK/CNP), extension header
    bytes, and where the last header decode_frame decodes (RETH/AETH/ImmDt/DETH) ends:
    a capture cut before that is TRUNCATED."""
    known = np.zeros(256, np.uint8)
    payload = np.zeros(256, np.uint8)
    is_ack = np.zeros(256, np.uint8)
    ext_len = np.zeros(256, np.int64)
    decoded_end = np.zeros(256, np.int64)
    for code, op in OPCODES.items():
        known[code], payload[code], is_ack[code] = 1, op.payload, op.is_ack
        ext_len[code] = op.ext_len
        off = 0
        for name in op.headers:
            if name in _DECODED:
                decoded_end[code] = off + EXT_LEN[name]
            off += EXT_LEN[name]
    return dict(op_known=known, op_payload=payload, op_is_ack=is_ack, op_ext_len=ext_len,
                op_decoded_end=decoded_end)


# -- compiled schedule ------------------------------------------------------------------------
@dataclass
class CompiledSchedule:
    """FlowTimeline/FlowSchedule as flat arrays: per timeline (one QP of one connection)
    and layout (0: iteration 0's buckets, 1: the rebuilt ones), its messages in order."""

    keys: list  # timeline index -> (src, dst, channel, qp)
    conns: list  # connection index -> (src, dst, channel)
    index: dict  # (src, dst, channel, qp) -> timeline index
    arrays: dict  # name -> numpy array, the kernel's set_tables arguments

    def npkts(self, layout: int, t: int) -> int:
        return int(self.arrays["tl_npkts"][layout, t])


def compile_schedule(plan: Plan) -> CompiledSchedule:
    s0, s1 = plan.schedule(0), plan.schedule(1)
    keys = sorted(s0.flows)
    conns = sorted(s0.sends)
    conn_ix = {c: i for i, c in enumerate(conns)}
    T = len(keys)
    order = "big" if plan.ring.imm_big_endian else "little"
    cols = {k: [] for k in ("m_start", "m_npkts", "m_wire_len", "m_wire_offset", "m_bucket",
                            "m_offset", "m_nelem", "m_phase", "m_step", "m_ring_step", "m_imm")}
    tl_npkts = np.zeros((2, T), np.int64)
    tl_mlo = np.zeros((2, T), np.int64)
    tl_mhi = np.zeros((2, T), np.int64)
    tl_recv_off = np.zeros((2, T), np.int64)
    recv_total = np.zeros(2, np.int64)
    for layout, sched in enumerate((s0, s1)):
        for t, key in enumerate(keys):
            fs = sched.flows[key]
            tl_mlo[layout, t] = len(cols["m_start"])
            for msg, start in zip(fs.messages, fs.starts):
                s = msg.send
                cols["m_start"].append(start)
                cols["m_npkts"].append(msg.npkts)
                cols["m_wire_len"].append(msg.wire_len)
                cols["m_wire_offset"].append(msg.wire_offset)
                cols["m_bucket"].append(s.bucket)
                cols["m_offset"].append(s.offset)
                cols["m_nelem"].append(s.nelem)
                cols["m_phase"].append(s.phase)
                cols["m_step"].append(s.step)
                cols["m_ring_step"].append(s.ring_step)
                # the immediate as its 4 wire bytes read little-endian, as the kernel reads them
                cols["m_imm"].append(int.from_bytes(msg.imm.to_bytes(4, order), "little"))
            tl_mhi[layout, t] = len(cols["m_start"])
            tl_npkts[layout, t] = fs.npkts
            tl_recv_off[layout, t] = recv_total[layout]
            recv_total[layout] += fs.npkts
    arrays = {k: np.array(v, np.uint32 if k == "m_imm" else np.int64) for k, v in cols.items()}
    nb = max(len(s0.buckets), len(s1.buckets), 1)
    b_itemsize = np.ones((2, nb), np.int64)
    b_count = np.zeros((2, nb), np.int64)
    for layout, sched in enumerate((s0, s1)):
        for b, bucket in enumerate(sched.buckets):
            b_itemsize[layout, b] = bucket.dtype.itemsize
            b_count[layout, b] = bucket.count
    arrays.update(
        tl_conn=np.array([conn_ix[k[:3]] for k in keys], np.int64), tl_npkts=tl_npkts,
        tl_mlo=tl_mlo, tl_mhi=tl_mhi, tl_recv_off=tl_recv_off, recv_total=recv_total,
        conn_steps=np.array([[s0.steps(c) for c in conns], [s1.steps(c) for c in conns]],
                            np.int64).reshape(2, len(conns)),
        b_itemsize=b_itemsize, b_count=b_count)
    return CompiledSchedule(keys, conns, {k: i for i, k in enumerate(keys)}, arrays)


# -- source: batches of frames ---------------------------------------------------------------
@dataclass
class Batch:
    """Many frames in one buffer: the unit the kernel works on. A capture file read into
    memory and a capture-ring block are both one of these."""

    buf: np.ndarray  # uint8
    offsets: np.ndarray  # int64, where each frame starts in buf
    caplen: np.ndarray  # int64, bytes captured
    origlen: np.ndarray  # int64, bytes on the wire
    stream: np.ndarray  # int32, mirror stream
    linktype: np.ndarray  # int32, LINKTYPE_* of the frame's interface
    frame_no: np.ndarray  # int64, frame number in its file (1-based, as Wireshark)
    ts: np.ndarray  # int64, ns (0 where the capture has none)

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def nbytes(self) -> int:
        return int(self.caplen.sum())

    def frame(self, i: int) -> CapturedFrame:
        off, n = int(self.offsets[i]), int(self.caplen[i])
        return CapturedFrame(int(self.frame_no[i]), int(self.ts[i]), int(self.linktype[i]), n,
                             int(self.origlen[i]), self.buf[off:off + n].tobytes())


def batch_from_frames(frames: Iterable[tuple[int, CapturedFrame]]) -> Batch:
    """A Batch of (stream, frame) pairs, in the order given."""
    frames = list(frames)
    sizes = np.array([len(fr.data) for _, fr in frames], np.int64)
    offsets = np.zeros(len(frames), np.int64)
    if len(frames):
        offsets[1:] = np.cumsum(sizes)[:-1]
    buf = np.frombuffer(b"".join(fr.data for _, fr in frames), np.uint8) if frames \
        else np.zeros(0, np.uint8)
    return Batch(buf, offsets, sizes, np.array([fr.origlen for _, fr in frames], np.int64),
                 np.array([s for s, _ in frames], np.int32),
                 np.array([fr.linktype for _, fr in frames], np.int32),
                 np.array([fr.index for _, fr in frames], np.int64),
                 np.array([fr.ts_ns or 0 for _, fr in frames], np.int64))


_PCAP_MAGICS = {MAGIC_US.to_bytes(4, "little"): (False, 1000), MAGIC_US.to_bytes(4, "big"): (True, 1000),
                MAGIC_NS.to_bytes(4, "little"): (False, 1), MAGIC_NS.to_bytes(4, "big"): (True, 1)}


def load_capture(path, stream: int = 0) -> tuple[Batch, str | None]:
    """One capture file in memory as a Batch, and the CaptureError/OSError message that
    ended it early (None when it read to the end), as file_source would report it.

    A clean pcap is indexed in place by the kernel (no per-frame Python); pcapng, and a
    pcap with a broken record, go through the reference readers in parsers/."""
    try:
        fmt = capture_format(path)
        if fmt == "pcap":
            data = np.fromfile(path, np.uint8)
            head = data[:24].tobytes()
            if len(head) == 24 and head[:4] in _PCAP_MAGICS:
                big, tick = _PCAP_MAGICS[head[:4]]
                linktype = int.from_bytes(head[20:24], "big" if big else "little") & 0xFFFF
                cap = max(0, (len(data) - 24) // 16)
                arrs = [np.empty(cap, np.int64) for _ in range(5)]
                n, clean = _kernel.index_pcap(data, 24, big, 0, *arrs)
                if clean:
                    offsets, caplen, origlen, sec, frac = (a[:n] for a in arrs)
                    return Batch(data, offsets, caplen, origlen, np.full(n, stream, np.int32),
                                 np.full(n, linktype, np.int32), np.arange(1, n + 1, dtype=np.int64),
                                 sec * 1_000_000_000 + frac * tick), None
    except (CaptureError, OSError) as e:
        return batch_from_frames([]), str(e)
    frames, error = [], None
    try:
        for fr in open_capture(path):
            frames.append((stream, fr))
    except (CaptureError, OSError) as e:
        error = str(e)
    return batch_from_frames(frames), error


def merge_batches(batches: list[Batch]) -> Batch:
    """Frames of several streams in the order ckptd.pipeline.file_source yields them
    (heapq.merge by (time, stream, frame number))."""
    if len(batches) == 1:
        return batches[0]
    which, idx = _kernel.merge_order([b.ts for b in batches])
    base = np.cumsum([0] + [len(b.buf) for b in batches])[:-1]
    buf = np.concatenate([b.buf for b in batches]) if batches else np.zeros(0, np.uint8)

    def take(name, shift=False):
        cat = np.concatenate([getattr(b, name) + (base[k] if shift else 0) for k, b in enumerate(batches)])
        starts = np.cumsum([0] + [len(b) for b in batches])[:-1]
        return cat[starts[which] + idx]

    return Batch(buf, take("offsets", True), take("caplen"), take("origlen"), take("stream"),
                 take("linktype"), take("frame_no"), take("ts"))


def load_captures(paths: list[str]) -> tuple[Batch, list[str]]:
    """Every file (one per stream), merged; and the errors that cut files short."""
    loaded = [load_capture(p, k) for k, p in enumerate(paths)]
    return merge_batches([b for b, _ in loaded]), [e for _, e in loaded if e]


# -- the flow table the kernel reads ----------------------------------------------------------
def flow_key(src: str, dst: str, dqp: int) -> bytes:
    """The kernel's 40-byte flow key: IP version, pad, dest QP (LE), source, destination."""
    a, b = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    return (bytes([a.version, 0, 0, 0]) + dqp.to_bytes(4, "little")
            + a.packed.ljust(16, b"\0") + b.packed.ljust(16, b"\0"))


def _fnv1a(key: bytes) -> int:
    h = 1469598103934665603
    for c in key:
        h = ((h ^ c) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


class FlowTable:
    """Open-addressing table of flows the kernel may handle itself: bound ones (their
    timeline, PSN base and anchor) and ones the reference called unrelated."""

    def __init__(self, capacity: int = 64):
        self.index: dict[bytes, int] = {}
        self._alloc(capacity)

    def _alloc(self, capacity: int):
        old = getattr(self, "fe_key", None)
        n = len(self.index)
        self.capacity = capacity
        self.fe_key = np.zeros((capacity, 40), np.uint8)
        cols = {name: np.full(capacity, -1 if name == "fe_msg" else 0, np.int64)
                for name in ("fe_kind", "fe_tl", "fe_base", "fe_last", "fe_msg")}
        if old is not None:
            self.fe_key[:n] = old[:n]
            for name in cols:
                cols[name][:n] = getattr(self, name)[:n]
        for name, arr in cols.items():
            setattr(self, name, arr)
        size = 1
        while size < 4 * capacity:
            size *= 2
        self.ft_slots = np.full(size, -1, np.int64)
        for key, e in self.index.items():
            self._insert(key, e)

    def _insert(self, key: bytes, e: int):
        mask = len(self.ft_slots) - 1
        i = _fnv1a(key) & mask
        while self.ft_slots[i] >= 0:
            i = (i + 1) & mask
        self.ft_slots[i] = e

    def add(self, key: bytes, kind: int, tl: int = 0, base: int = 0, last: int = 0) -> int:
        """Add a flow; returns its entry. May reallocate the arrays: hand them to the
        kernel again after adding."""
        if len(self.index) == self.capacity:
            self._alloc(self.capacity * 2)
        e = len(self.index)
        self.fe_key[e] = np.frombuffer(key, np.uint8)
        self.fe_kind[e], self.fe_tl[e], self.fe_base[e], self.fe_last[e] = kind, tl, base, last
        self.fe_msg[e] = -1
        self.index[key] = e
        self._insert(key, e)
        return e

    def arrays(self):
        return (self.ft_slots, self.fe_key, self.fe_kind, self.fe_tl, self.fe_base, self.fe_last,
                self.fe_msg, len(self.index))


