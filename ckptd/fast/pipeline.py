"""The fast path: the batch kernel (cython_ext/batch.pyx) behind the reference pipeline.

    source    ckptd.fast.batches: files read in chunks on a reader thread, frames indexed
              (offsets, lengths, stream ids) and merged in capture-time order -> Batch
    decode    \\
    place      > BatchKernel.run, one pass over a Batch without the GIL, writing straight
    assemble  /  into the open IterationAssembly arrays
    apply, keep   ckptd.pipeline.Pipeline's own, unchanged

The pure-Python path (ckptd.pipeline, ckptd.transports.roce.extract, ckptd.transports.roce.flows, ckptd.core.assemble) stays
the reference, and this module leans on it for every decision the kernel cannot make
alone. The kernel stops at a frame that needs one, before changing anything for it:

    unknown_flow    FlowBinder (Extractor.feed) binds the flow, holds it, or calls it
                    unrelated; the kernel then learns the binding or the verdict
    ack             an ACK of a hop whose flows are not all bound (FlowBinder.note_ack)
    iteration       a packet of an iteration the kernel does not track, or an allgather
                    placement into one the pipeline has not opened, or a reduce-scatter
                    placement beyond the highest iteration (Pipeline._assemble moves on)
    flag_base       LL, a connection whose flag base the Extractor has not learned yet
    example         a rejection while the Extractor still keeps examples (the first 20)
    rs_dump         reduce-scatter step 0 while gradients are dumped
    range           a placement past its bucket's end (the reference raises)
    encapsulated    GRE/ERSPAN: parsers.roce unwraps it (the kernel does not)

and after a frame that completed a bucket (`complete`), so that the pipeline steps the
shadow and commits exactly when the reference would. Python runs the reference path on
that one frame (RoceTransport.feed_frame, or Extractor.feed on the packet the kernel
decoded; Pipeline._assemble), copies what changed into the kernel's tables (bindings,
PSN anchors, flag bases, live iterations) and resumes at the next frame. So every frame
is processed in capture order by exactly one of the two, and buffers, coverage,
conflicts, counters, loss, reports and their timing come out as the reference's
(tests/test_fastpath.py compares them all).

Entry points: `fast_replay` (ckptd.pipeline.replay's twin), `FastPipeline.run_batch` for
batches from any source (a capture-ring block is a Batch too), `FastExtractor` for the
decode + place stage alone.
"""
from __future__ import annotations

import ctypes
import gc
import ipaddress
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from cython_ext import batch as _kernel
from parsers import icrc
from parsers.capfile import CapturedFrame
from parsers.opcodes import EXT_LEN, OPCODES
from parsers.roce import _DECODED, FrameClass, decode_frame

from ckptd.core.assemble import IterationAssembly
from ckptd.fast.batches import CHUNK_BYTES, Batch, ReaderStage, batch_from_frames, stream_batches
from ckptd.transports.base import MAX_EXAMPLES
from ckptd.transports.roce.flows import ACK, FlowBinding, Packet
from ckptd.pipeline import IterationReport, Pipeline, ReplayOptions
from ckptd.transports.roce.transport import RoceTransport
from ckptd.core.plan import Plan
from ckptd.core.schedule import AG

CLASS_NAMES = _kernel.CLASS_NAMES
COUNTER_NAMES = _kernel.COUNTER_NAMES
STOP_NAMES = _kernel.STOP_NAMES
MAX_SLOTS = _kernel.MAX_SLOTS
CONFLICT_CAP = _kernel.CONFLICT_CAP
FLOW_BOUND, FLOW_UNRELATED = 1, 2
ACK_QP = 0xFFFFFFFF  # dest-QP field of the kernel's ACK keys (per address pair)
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


def reduction_constants() -> tuple[int, int, int, int]:
    """The kernel's final 128 -> 32 bit reduction: reflect64(x^95 mod P),
    reflect64(x^63 mod P), reflect33(floor(x^64 / P)) and reflect33(P)."""
    poly = 0x104C11DB7
    k95, _ = fold_constants(32)   # x^(32+63) = x^95
    k63, _ = fold_constants(0)    # x^63
    mu, a = 0, 1 << 64
    while a.bit_length() >= poly.bit_length():
        shift = a.bit_length() - poly.bit_length()
        mu |= 1 << shift
        a ^= poly << shift

    def reflect33(v):
        return int(f"{v:033b}"[::-1], 2)

    return k95, k63, reflect33(mu), reflect33(poly)


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


# -- the flow table the kernel reads ----------------------------------------------------------
def flow_key(src: str, dst: str, dqp: int) -> bytes:
    """The kernel's 40-byte flow key: IP version, pad, dest QP (LE), source, destination."""
    a, b = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    return (bytes([a.version, 0, 0, 0]) + dqp.to_bytes(4, "little")
            + a.packed.ljust(16, b"\0") + b.packed.ljust(16, b"\0"))


def flow_hash(key: bytes) -> int:
    """The kernel's hash of a flow key (BatchKernel.lookup_flow)."""
    h = 0
    for i in range(0, len(key), 8):
        h = ((h ^ int.from_bytes(key[i:i + 8], "little")) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
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
        i = flow_hash(key) & mask
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


# -- the extractor -------------------------------------------------------------------------
class FastExtractor(RoceTransport):
    """The RoCE transport (ckptd.transports.roce.transport.RoceTransport: ckptd.transports.roce.extract.Extractor) with a
    batch entry point served by the kernel.

    It *is* the reference (binder, flag bases, counters, examples, received positions all
    live in the inherited attributes; `feed` and `feed_frame` are the reference methods);
    the kernel keeps copies of what it needs and its counts are folded back in by
    `drain`. The iterations it tracks are set with `track_iteration` (and their
    IterationAssembly, once open, with `attach`).
    """

    def __init__(self, plan: Plan, nstreams: int, *, trust_icrc: bool = False, crc: str = "auto",
                 dump_rs: bool = False, join_from: int | None = None):
        if getattr(plan, "transport", "roce") != "roce":
            raise ValueError(f"the fast path decodes RoCEv2; this plan's transport is {plan.transport}")
        super().__init__(plan, join_from)
        self.nstreams = nstreams
        self.sched = compile_schedule(plan)
        self.kernel = _kernel.BatchKernel(nstreams)
        self.kernel.trust_icrc = trust_icrc
        self.kernel.dump_rs = dump_rs
        self.crc = crc if crc != "auto" else crc_choices()[0]
        self.kernel.set_crc(*crc_setting(self.crc))
        nconn = len(self.sched.conns)
        self.conn_ix = {c: i for i, c in enumerate(self.sched.conns)}
        self.fb_known = np.zeros(max(nconn, 1), np.uint8)
        self.fb_value = np.zeros(max(nconn, 1), np.int64)
        nb = self.sched.arrays["b_count"].shape[1]
        self.slot_iter = np.full(MAX_SLOTS, -1, np.int64)
        self.slot_layout = np.zeros(MAX_SLOTS, np.int64)
        self.slot_has_asm = np.zeros(MAX_SLOTS, np.int64)
        self.slot_ptr = np.zeros((MAX_SLOTS, nb, 2 + nstreams), np.int64)
        self.slot_recv = np.zeros(MAX_SLOTS, np.int64)
        self.slot_counts = np.zeros((MAX_SLOTS, 3), np.int64)
        self.slot_bucket = np.zeros((MAX_SLOTS, nb, 2), np.int64)
        self.class_counts = np.zeros((max(nstreams, 1), len(CLASS_NAMES)), np.int64)
        self.counter_array = np.zeros(len(COUNTER_NAMES), np.int64)
        self.conflict_buf = np.zeros((CONFLICT_CAP, 5), np.int64)
        self.slots: dict[int, int] = {}  # iteration -> slot
        self.slot_recv_maps: dict[int, np.ndarray] = {}  # slot -> received map (kept alive)
        self.slot_asm: dict[int, object] = {}  # slot -> IterationAssembly, once open
        self.kernel.set_tables(
            **opcode_tables(), **self.sched.arrays, mtu=plan.ring.mtu, ll=plan.ring.protocol == "ll",
            fb_known=self.fb_known, fb_value=self.fb_value, slot_iter=self.slot_iter,
            slot_layout=self.slot_layout, slot_has_asm=self.slot_has_asm, slot_ptr=self.slot_ptr,
            slot_recv=self.slot_recv, slot_counts=self.slot_counts, slot_bucket=self.slot_bucket,
            classes=self.class_counts,
            counters=self.counter_array, conflicts=self.conflict_buf)
        self.table = FlowTable()
        self.kernel.set_flow_table(*self.table.arrays())
        self._table_flows = 0
        self.entry_binding: dict[int, FlowBinding] = {}
        self._seen_bound = -1
        self._seen_unrelated = 0
        self._seen_flag_bases = 0
        self._ack_hops_done: set = set()
        self._batch = None
        self._addr_text: dict[bytes, tuple[str, str]] = {}

    # -- the batch ---------------------------------------------------------------------------
    def classify(self, batch: Batch) -> list[str]:
        """decode_frame's class of every frame ('encapsulated' for GRE), by the kernel."""
        names = CLASS_NAMES + ("encapsulated",)
        return [names[c] for c in self.kernel.classify(batch.buf, batch.offsets, batch.caplen,
                                                       batch.origlen, batch.linktype).tolist()]

    def run(self, batch: Batch, start: int = 0, end: int | None = None) -> tuple[int, str, int]:
        """Kernel pass over frames start..end-1 until the first one Python must handle
        (see BatchKernel.run). Returns (index, reason, flow entry)."""
        if self._batch is not batch:
            self.kernel.set_batch(batch.buf, batch.offsets, batch.caplen, batch.origlen,
                                  batch.stream, batch.linktype)
            self._batch = batch
        i, reason, flow = self.kernel.run(start, len(batch) if end is None else end)
        return i, STOP_NAMES[reason], flow

    def packet(self, batch: Batch, i: int) -> tuple[str, Packet]:
        """The frame `run` stopped at, as ckptd.transports.roce.transport.decode_roce would return it,
        built from what the kernel decoded (its class equals decode_frame's): (class name,
        Packet). Only for RoCE data and ACK frames; GRE frames go through decode_roce."""
        cls, ver, ip_off, udp_off, bth_off, pay_off, pay_len, opcode = self.kernel.last_frame()
        off, n = int(batch.offsets[i]), int(batch.caplen[i])
        data = batch.buf[off:off + n].tobytes()
        src, dst = self._address(data, ip_off, ver)
        bth = data[bth_off:bth_off + 12]
        dqp, psn = int.from_bytes(bth[5:8], "big"), int.from_bytes(bth[9:12], "big")
        sport = int.from_bytes(data[udp_off:udp_off + 2], "big")
        stream, frame_no = int(batch.stream[i]), int(batch.frame_no[i])
        if opcode == ACK:
            return CLASS_NAMES[cls], Packet(stream, frame_no, src, dst, dqp, ACK, psn, None, None,
                                            memoryview(b""), sport)
        ext = bth_off + 12
        dma_len = imm = None
        for name in OPCODES[opcode].headers:
            if name == "RETH":
                dma_len = int.from_bytes(data[ext + 12:ext + 16], "big")
            elif name == "IMMDT":
                imm = data[ext:ext + 4]
            ext += EXT_LEN[name]
        return CLASS_NAMES[cls], Packet(stream, frame_no, src, dst, dqp, opcode, psn, dma_len, imm,
                                        memoryview(data)[pay_off:pay_off + pay_len], sport)

    def _address(self, data: bytes, ip_off: int, ver: int) -> tuple[str, str]:
        # the canonical text of the addresses, as str(ipaddress) gives it (cached)
        raw = data[ip_off + 12:ip_off + 20] if ver == 4 else data[ip_off + 8:ip_off + 40]
        pair = self._addr_text.get(raw)
        if pair is None:
            h = len(raw) // 2
            pair = self._addr_text[raw] = (str(ipaddress.ip_address(raw[:h])),
                                           str(ipaddress.ip_address(raw[h:])))
        return pair

    def drain(self, classes: list[Counter]) -> int:
        """Fold the kernel's counts into the reference's: Extractor.counters, the
        pipeline's per-stream classes, each open IterationAssembly's packets, bytes,
        covered count and conflicts. Returns the late placements (Pipeline.late)."""
        late = 0
        counts = self.counter_array.tolist()
        if any(counts):
            for name, v in zip(COUNTER_NAMES, counts):
                if v:
                    if name == "late":
                        late = v
                    else:
                        self.counters[name] += v
            self.counter_array[:] = 0
        for s, row in enumerate(self.class_counts.tolist()):
            if row[0]:  # frames
                for name, v in zip(CLASS_NAMES, row):
                    if v:
                        classes[s][name] += v
        self.class_counts[:] = 0
        if not self.slot_counts[:, 0].any() and not self.kernel.nconflicts:
            return late
        now = time.monotonic()
        for slot, asm in self.slot_asm.items():
            packets, nbytes, _ = self.slot_counts[slot].tolist()
            if packets:
                asm.packets += packets
                asm.bytes += nbytes
                asm.last_packet = now  # Pipeline._assemble stamps every placement
                fresh = self.slot_bucket[slot, :len(asm.buckets), 0]
                for b in np.flatnonzero(fresh).tolist():
                    asm.bucket_covered[b] += int(fresh[b])
                asm.ncovered += int(fresh.sum())
                fresh[:] = 0
        self.slot_counts[:, :2] = 0
        for it, s, b, lo, hi in self.conflict_buf[:self.kernel.nconflicts].tolist():
            self.slot_asm[self.slots[it]].conflicts.append((s, b, lo, hi))
        self.kernel.nconflicts = 0
        return late

    # -- keeping the kernel's copies right -------------------------------------------------
    def before_python(self, entry: int):
        """The reference is about to handle a frame of flow `entry` (-1: not known to
        the kernel, or not parsed by it): give the binding(s) the kernel's PSN anchor."""
        if entry < 0:
            self.sync_all_out()
        elif entry in self.entry_binding:
            self.entry_binding[entry].last = int(self.table.fe_last[entry])

    def after_python(self, entry: int, packets: list[Packet]):
        """Copy what the reference changed: PSN anchors, new bindings, flows it calls
        unrelated, hops whose ACKs it no longer needs, learned LL flag bases, and
        whether it still keeps examples."""
        if entry < 0:
            for e, b in self.entry_binding.items():
                self.table.fe_last[e] = b.last
        elif entry in self.entry_binding:
            self.table.fe_last[entry] = self.entry_binding[entry].last
        binder = self.binder
        if len(binder.bound) != self._seen_bound:
            for key, b in binder.bound.items():
                k = flow_key(*key)
                if k not in self.table.index:
                    e = self.table.add(k, FLOW_BOUND, self.sched.index[b.conn + (b.qp,)], b.base, b.last)
                    self.entry_binding[e] = b
            self._ack_hops_useless()
            self._seen_bound = len(binder.bound)
        if len(binder.unrelated) != self._seen_unrelated:
            for key in binder.unrelated:
                self._add_unrelated(key)
            self._seen_unrelated = len(binder.unrelated)
        for p in packets:
            if p.opcode == ACK:
                s, d = self.plan.rank_of(p.dst), self.plan.rank_of(p.src)
                if (s, d) not in binder.expected:  # FlowBinder.note_ack ignores it for good
                    self._add_unrelated((p.src, p.dst, ACK_QP))
                elif (s, d) in binder.acks_ignored:
                    self._ack_hops_useless()
            elif p.flow not in binder.bound and binder.hop_of(p) is None:
                self._add_unrelated(p.flow)  # between addresses that form no hop of the job
        if len(self.table.index) != self._table_flows:  # added (the arrays may be new)
            self.kernel.set_flow_table(*self.table.arrays())
            self._table_flows = len(self.table.index)
        if len(self.flag_base) != self._seen_flag_bases:
            for conn, base in self.flag_base.items():
                c = self.conn_ix[conn]
                self.fb_known[c], self.fb_value[c] = 1, base
            self._seen_flag_bases = len(self.flag_base)
        self.kernel.examples_open = len(self.examples) < MAX_EXAMPLES

    def _ack_hops_useless(self):
        """ACKs of a hop whose flows are all bound, or whose data no mirror shows, teach
        the binder nothing (FlowBinder.acks_useless): the kernel counts them alone."""
        for hop in self.binder.expected:
            if hop not in self._ack_hops_done and self.binder.acks_useless(hop):
                self._ack_hops_done.add(hop)
                self._add_unrelated((self.plan.addresses[hop[1]], self.plan.addresses[hop[0]], ACK_QP))

    def _add_unrelated(self, key):
        k = flow_key(*key)
        if k not in self.table.index:
            self.table.add(k, FLOW_UNRELATED)

    def sync_all_out(self):
        """Every bound flow's binding gets the kernel's PSN anchor."""
        for e, b in self.entry_binding.items():
            b.last = int(self.table.fe_last[e])

    # -- iterations the kernel tracks ------------------------------------------------------
    def track_iteration(self, iteration: int) -> bool:
        """Keep a received map for a live iteration; False when all slots are taken (its
        packets then keep going through the reference path)."""
        if iteration in self.slots:
            return True
        free = np.flatnonzero(self.slot_iter < 0)
        if not len(free):
            return False
        slot = int(free[0])
        layout = min(iteration, 1)
        recv = np.zeros((self.nstreams, int(self.sched.arrays["recv_total"][layout])), np.uint8)
        self.slot_recv[slot] = recv.ctypes.data if recv.size else 0
        self.slot_layout[slot] = layout
        self.slot_has_asm[slot] = 0
        self.slot_counts[slot] = 0
        self.slot_bucket[slot] = 0
        self.slot_iter[slot] = iteration
        self.slots[iteration] = slot
        self.slot_recv_maps[slot] = recv
        return True

    def attach(self, iteration: int, asm):
        """Let the kernel place into an open iteration's IterationAssembly."""
        slot = self.slots[iteration]
        if slot in self.slot_asm:
            return
        for b in range(len(asm.buckets)):
            self.slot_ptr[slot, b, 0] = asm.data[b].ctypes.data
            self.slot_ptr[slot, b, 1] = asm.covered[b].ctypes.data
            for s in range(self.nstreams):
                self.slot_ptr[slot, b, 2 + s] = asm.by_stream[s][b].ctypes.data
        self.slot_asm[slot] = asm
        self.slot_has_asm[slot] = 1

    def refresh(self, notify: Callable[[object], bool]):
        """Elements each attached assembly's buckets still miss (Python may have placed
        some), and whether the pipeline wants to act after any placement into it."""
        for slot, asm in self.slot_asm.items():
            nb = len(asm.buckets)
            self.slot_bucket[slot, :nb, 1] = [b.count - c for b, c in zip(asm.buckets, asm.bucket_covered)]
            self.slot_counts[slot, 2] = notify(asm)

    def release(self, iteration: int):
        """Stop tracking a finalized iteration; returns its assembly, if it had one."""
        slot = self.slots.pop(iteration)
        self.slot_iter[slot] = -1
        self.slot_has_asm[slot] = 0
        self.slot_ptr[slot] = 0
        self.slot_recv[slot] = 0
        self.slot_counts[slot] = 0
        self.slot_bucket[slot] = 0
        del self.slot_recv_maps[slot]
        return self.slot_asm.pop(slot, None)

    def stream_loss(self, stream: int, iteration: int) -> float | None:
        """Extractor.stream_loss over the positions both paths received."""
        flows = self.received.pop((stream, iteration), None) or {}
        slot = self.slots.get(iteration)
        if slot is None and not flows:
            return None
        layout = min(iteration, 1)
        py: dict[int, tuple[set, int]] = {}
        for key, got in flows.items():
            b = self.binder.bound[key]
            py[self.sched.index[b.conn + (b.qp,)]] = (got, b.timeline.iteration_start(iteration))
        recv = self.slot_recv_maps[slot][stream] if slot is not None else None
        expected = received = 0
        for t in range(len(self.sched.keys)):
            n = self.sched.npkts(layout, t)
            lo = int(self.sched.arrays["tl_recv_off"][layout, t])
            bits = recv[lo:lo + n] if recv is not None else np.zeros(n, np.uint8)
            mine = py.get(t)
            if mine is None and not bits.any():
                continue
            if mine is not None:
                got, first = mine
                bits = bits.copy()
                bits[np.fromiter((p - first for p in got), np.int64, len(got))] = 1
            expected += n
            received += int(np.count_nonzero(bits))
        if not expected:
            return None
        return 1.0 - received / expected


# -- the pipeline ----------------------------------------------------------------------------
class ArrayPool:
    """Zeroed arrays for IterationAssembly, reused across iterations.

    A fresh array costs a page fault per page when first written, and in a VM that runs
    at 0.6-1.5 GB/s, against ~14 GB/s to zero memory already mapped: without reuse, the
    first writes into each iteration's ~2 x gradient-size buffers cost more than decoding
    all of its traffic. An array comes back only when nothing else refers to it."""

    def __init__(self):
        self.free: dict[tuple, list[np.ndarray]] = {}

    def take(self, like: np.ndarray) -> np.ndarray:
        """A zeroed array shaped like `like` (returned as is when none is free: np.zeros
        memory is not touched yet, so that costs nothing extra)."""
        free = self.free.get((like.shape, like.dtype.str))
        if not free:
            return like
        a = free.pop()
        a.fill(0)
        return a

    def give_back(self, arrays: list[np.ndarray]):
        for a in arrays:
            # referrers: the caller's list, this loop, getrefcount's argument
            if sys.getrefcount(a) <= 3 and a.base is None:
                self.free.setdefault((a.shape, a.dtype.str), []).append(a)


def trusted_frame(fr: CapturedFrame) -> CapturedFrame:
    """The frame as trust-the-NIC mode sees it: a RoCE frame whose ICRC is wrong gets the
    right one, so the reference decode (which always checks) classifies it as the kernel
    does when it skips the check. Payload bytes are untouched."""
    f = decode_frame(fr.data, fr.linktype, fr.origlen)
    if f.cls is not FrameClass.BAD_ICRC:
        return fr
    data = bytearray(fr.data)
    data[f.icrc_offset:f.icrc_offset + 4] = icrc.pack(
        icrc.compute(data, f.ip_offset, f.udp_offset, f.icrc_offset))
    return CapturedFrame(fr.index, fr.ts_ns, fr.linktype, fr.caplen, fr.origlen, bytes(data),
                         fr.interface_id)


class FastPipeline(Pipeline):
    """ckptd.pipeline.Pipeline with decode, place and assemble done by the kernel.

    `run_batch` for each Batch, then `finish`; or `run(frames)` with the reference's
    signature. Finalize, apply and keep are the reference's, unchanged.
    """

    def __init__(self, plan: Plan, start: dict | None, nstreams: int, opts: ReplayOptions,
                 on_iteration: Callable[[IterationReport], None] | None = None, *,
                 trust_icrc: bool = False, crc: str = "auto"):
        super().__init__(plan, start, nstreams, opts, on_iteration)
        self.extract = FastExtractor(plan, nstreams, trust_icrc=trust_icrc, crc=crc,
                                     dump_rs=bool(opts.dump_gradients), join_from=self.join_wire)
        self.trust_icrc = trust_icrc
        self.pool = ArrayPool()
        self.stops: Counter = Counter()  # why frames went to the reference path
        self.kernel_frames = 0  # frames the kernel handled itself
        self.kernel_seconds = 0.0  # time spent in the kernel (the rest is the reference path)

    def run(self, frames: Iterable[tuple[int, CapturedFrame]], abandon: bool = False) -> list[IterationReport]:
        chunk = []
        for item in frames:
            chunk.append(item)
            if len(chunk) == BATCH_FRAMES:
                self.run_batch(batch_from_frames(chunk))
                chunk = []
        if chunk:
            self.run_batch(batch_from_frames(chunk))
        return self.finish(abandon)

    def run_batch(self, batch: Batch):
        """Every frame of the batch, in order. The cyclic garbage collector is paused
        meanwhile: while flows are being bound the binder holds thousands of packets, and
        each full collection would walk torch's and numpy's object graphs too (the hot path
        makes no reference cycles; collection resumes afterwards)."""
        paused = gc.isenabled()
        gc.disable()
        try:
            self._run_batch(batch)
        finally:
            if paused:
                gc.enable()

    def _run_batch(self, batch: Batch):
        ex = self.extract
        i, n = 0, len(batch)
        while i < n:
            t0 = time.perf_counter()
            j, reason, entry = ex.run(batch, i, n)
            self.kernel_seconds += time.perf_counter() - t0
            self._count_late(ex.drain(self.classes))
            self.kernel_frames += j - i
            i = j
            if reason == "end":
                break
            self.stops[reason] += 1
            if reason == "complete":
                self._after_placement(entry)  # frame i-1 completed a bucket of iteration `entry`
            elif reason != "conflicts_full":  # (drained: resume at the same frame)
                self._python_frame(batch, i, entry, reason)
                i += 1
            self._sync_iterations()

    def finish(self, abandon: bool = False) -> list[IterationReport]:
        """End of input: Pipeline.run's ending (flush the binder, finalize or abandon
        what is open, dump what is kept)."""
        self.extract.sync_all_out()
        Pipeline.run(self, [], abandon=abandon)
        self._sync_iterations()
        return self.reports

    def _wants_every_placement(self, asm) -> bool:
        """Would the reference act on a placement into asm that completes no bucket?
        Only when asm is the next iteration and a whole bucket waits to be stepped."""
        return (asm.iteration == self.done + 1 and self._bucketwise()
                and self.next_bucket < len(asm.buckets) and asm.bucket_complete(self.next_bucket))

    def _python_frame(self, batch: Batch, i: int, entry: int, reason: str):
        """The reference path, for one frame (Pipeline.run's loop body): a wrapped (GRE)
        frame goes through RoceTransport.feed_frame; one the kernel decoded becomes its
        Packet at once (what decode_roce would return) and goes to Extractor.feed."""
        ex = self.extract
        ex.before_python(entry)
        stream = int(batch.stream[i])
        classes = self.classes[stream]
        classes["frames"] += 1
        if reason == "encapsulated":
            fr = batch.frame(i)
            packets = []  # the kernel never looks such a flow up: nothing to register
            placements = ex.feed_frame(stream, trusted_frame(fr) if self.trust_icrc else fr, classes)
        else:
            cls, pkt = ex.packet(batch, i)
            classes[cls] += 1
            packets = [pkt]
            placements = ex.feed(pkt)
        for pl in placements:
            if pl.phase == AG and pl.iteration > self.done and pl.iteration not in self.open:
                # what _assemble would create, with recycled arrays
                self.open[pl.iteration] = self._new_assembly(pl.iteration)
            self._assemble(pl)
        ex.after_python(entry, packets)

    def _new_assembly(self, it: int) -> IterationAssembly:
        asm = IterationAssembly(it, self.plan.buckets(it), self.nstreams)
        asm.data = [self.pool.take(a) for a in asm.data]
        asm.covered = [self.pool.take(a) for a in asm.covered]
        asm.by_stream = [[self.pool.take(a) for a in maps] for maps in asm.by_stream]
        return asm

    def _recycle(self, asm: IterationAssembly):
        # referrers of a finished assembly: the caller's variable and getrefcount's argument.
        # Iteration 0's arrays follow DDP's first bucket layout, which never comes back.
        if sys.getrefcount(asm) <= 3 and asm.iteration > 0:
            arrays = asm.data + asm.covered + [a for maps in asm.by_stream for a in maps]
            asm.data, asm.covered, asm.by_stream = [], [], []
            self.pool.give_back(arrays)

    def _sync_iterations(self):
        """The kernel tracks the live iterations (done < it <= highest) and places into
        those the pipeline has opened; finalized ones are released (after _finalize read
        their per-stream loss)."""
        ex, k = self.extract, self.extract.kernel
        for it in [it for it in ex.slots if it <= self.done]:
            asm = ex.release(it)
            if asm is not None:
                self._recycle(asm)
            del asm
        for it in range(self.done + 1, self.highest + 1):
            if not ex.track_iteration(it):
                break
            if it in self.open:
                ex.attach(it, self.open[it])
        ex.refresh(self._wants_every_placement)
        k.done, k.highest = self.done, self.highest


def fast_replay(plan: Plan, paths: list[str], start: dict | None, opts: ReplayOptions,
                on_iteration=None, *, trust_icrc: bool = False, crc: str = "auto",
                chunk_bytes: int | None = None) -> FastPipeline:
    """ckptd.pipeline.replay through the kernel: the same reports, checkpoints and dumps.
    The files are read in chunks on a thread of their own (ckptd.fast.batches.ReaderStage);
    how often either side waited is kept in pipe.read_waits."""
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"{p}: no such capture file")
    pipe = FastPipeline(plan, start, len(paths), opts, on_iteration, trust_icrc=trust_icrc, crc=crc)
    reader = ReaderStage(stream_batches([str(p) for p in paths], pipe.errors,
                                        chunk_bytes or CHUNK_BYTES))
    pipe.yield_to_commit = reader.pause
    try:
        for batch in reader:
            pipe.run_batch(batch)
    finally:
        reader.close()
    pipe.read_waits = {"reader_waited": reader.full_waits, "extraction_waited": reader.empty_waits}
    pipe.finish()
    return pipe


__all__ = ["FastExtractor", "FastPipeline", "fast_replay", "compile_schedule", "crc_choices",
           "trusted_frame"]
