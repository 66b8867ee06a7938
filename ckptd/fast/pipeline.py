"""The fast path: the batch kernel (cython_ext/batch.pyx) behind the reference pipeline.

    source    ckptd.fast.batches: files mapped, indexed in place a chunk at a time on a
              reader thread (offsets, lengths, stream ids) and merged in capture-time
              order by index -> Batch
    decode    \\
    place      > BatchKernel.run, one pass over a Batch without the GIL, writing straight
    assemble  /  into the iteration buffers it lends the pipeline's IterationAssembly
    apply, keep   ckptd.pipeline.Pipeline's own, unchanged (FastPipeline wraps one)

The pure-Python path (ckptd.pipeline, ckptd.transports.roce.extract, ckptd.transports.roce.flows, ckptd.core.assemble) stays
the reference, and this module leans on it for every decision the kernel cannot make
alone. The kernel stops at a frame that needs one, before changing anything for it:

    unknown_flow    FlowBinder (Extractor.feed) binds the flow, holds it, or calls it
                    unrelated; the kernel then learns the binding or the verdict
    ack             an ACK of a hop whose flows are not all bound (FlowBinder.note_ack)
    iteration       a packet of an iteration the kernel does not track, or an allgather
                    placement into one the pipeline has not opened, or a reduce-scatter
                    placement beyond the highest iteration (Pipeline.place moves on)
    flag_base       LL, a connection whose flag base the Extractor has not learned yet
    example         a rejection while the Extractor still keeps examples (the first 20)
    rs_dump         reduce-scatter step 0 while gradients are dumped
    range           a placement past its bucket's end (the reference raises)
    scattered       LL128, a packet not made of whole 1024-B half blocks (MTU < 1024, or a
                    QP's share of a split send): its data words are not one run
    encapsulated    GRE/ERSPAN: parsers.roce unwraps it (the kernel does not)

and after a frame that completed a bucket (`complete`), so that the pipeline steps the
shadow and commits exactly when the reference would. Python runs the reference path on
that one frame (RoceTransport.feed_frame, or Extractor.feed on the packet the kernel
decoded; Pipeline.place) and resumes at the next frame. The kernel owns its tables; the
reference writes each decision into them as it makes it (the DataPlane protocol of
ckptd.transports.roce.flows, implemented by KernelTables: bindings, unrelated flows and
ACKs, flag bases), and a bound flow's PSN anchor exists only in the kernel
(KernelBinding), so nothing is copied back and forth. So every frame is processed in
capture order by exactly one of the two, and buffers, coverage, conflicts, counters,
loss, reports and their timing come out as the reference's (tests/test_fastpath.py
compares them all).

Entry points: `fast_replay` (ckptd.pipeline.replay's twin), `FastPipeline.run_batch` for
batches from any source (a capture-ring block is a Batch too), `FastExtractor` for the
decode + place stage alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import ipaddress
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from cython_ext import batch as _kernel
from parsers import icrc
from parsers.capfile import CapturedFrame
from parsers.opcodes import EXT_LEN, OPCODES
from parsers.roce import FrameClass, decode_frame

from ckptd.core.assemble import IterationAssembly
from ckptd.fast.batches import (CHUNK_BYTES, Batch, ReaderStage, batch_from_frames, reader_cpu, release_mapped,
                                stream_batches)
from ckptd.fast.icrc import crc_choices, crc_setting, icrc_checker, opcode_tables
from ckptd.transports.roce.flows import ACK, FlowBinding, Packet
from ckptd.pipeline import IterationReport, Pipeline, ReplayOptions, clock_shifts, shadow_start
from ckptd.transports.roce.transport import RoceTransport
from ckptd.core.plan import Plan

CLASS_NAMES = _kernel.CLASS_NAMES
STOP_NAMES = _kernel.STOP_NAMES
FLOW_BOUND, FLOW_UNRELATED = _kernel.FLOW_KINDS["bound"], _kernel.FLOW_KINDS["unrelated"]
BATCH_FRAMES = 1 << 16  # frames per batch when frames come one by one (Pipeline.run)


# -- compiled schedule ------------------------------------------------------------------------
@dataclass
class CompiledSchedule:
    """FlowTimeline/FlowSchedule as flat arrays: per timeline (one QP of one connection)
    and layout (Plan.timeline_schedules: 0 .. P-1 the opening iterations, P =
    Plan.timeline_prefix, 1 or 2 with static_graph; then each QP rotation of the rebuilt
    iterations, P ... P + period - 1), its messages in order."""

    keys: list  # timeline index -> (src, dst, channel, qp)
    conns: list  # connection index -> (src, dst, channel)
    index: dict  # (src, dst, channel, qp) -> timeline index
    arrays: dict  # name -> numpy array, the kernel's set_tables arguments

    def npkts(self, layout: int, t: int) -> int:
        return int(self.arrays["tl_npkts"][layout, t])


def compile_schedule(plan: Plan) -> CompiledSchedule:
    layouts = plan.timeline_schedules()
    p = plan.timeline_prefix
    s0 = layouts[0]
    keys = sorted(s0.flows)
    conns = sorted(s0.conns)
    conn_ix = {c: i for i, c in enumerate(conns)}
    T, L = len(keys), len(layouts)
    tl_npkts = np.zeros((L, T), np.int64)
    tl_mlo = np.zeros((L, T), np.int64)
    tl_mhi = np.zeros((L, T), np.int64)
    tl_recv_off = np.zeros((L, T), np.int64)
    recv_total = np.zeros(L, np.int64)
    parts: list[dict] = []  # every timeline's message columns (FlowSchedule.columns), in table order
    keep_parts: list[np.ndarray] = []  # DDP's buffer broadcasts (other collectives -1-bucket): the reference keeps them
    nmsgs = 0
    for layout, sched in enumerate(layouts):
        kept = list(plan.buffer_others(min(layout, p)))
        for t, key in enumerate(keys):
            fs = sched.flows[key]
            cols = fs.columns()
            parts.append(cols)
            b = cols["m_bucket"]
            keep_parts.append((b < 0) & np.isin(-1 - b, kept) if kept else np.zeros(len(b), bool))
            tl_mlo[layout, t] = nmsgs
            nmsgs += len(b)
            tl_mhi[layout, t] = nmsgs
            tl_npkts[layout, t] = fs.npkts
            tl_recv_off[layout, t] = recv_total[layout]
            recv_total[layout] += fs.npkts
    names = [f"m_{f}" for f in ("bucket", "offset", "nelem", "phase", "step", "ring_step")] + \
        ["m_start", "m_npkts", "m_wire_len", "m_wire_offset", "m_has_imm"]
    arrays = {n: np.concatenate([c[n] for c in parts]) if parts else np.zeros(0, np.int64)  # int64 columns
              for n in names}
    imm = np.concatenate([c["m_imm"] for c in parts]) if parts else np.zeros(0, np.int64)
    arrays["m_imm"] = imm.astype(np.uint32)
    if plan.ring.imm_big_endian:  # the kernel reads the immediate's 4 wire bytes little-endian
        arrays["m_imm"] = arrays["m_imm"].byteswap()
    arrays["m_keep"] = (np.concatenate(keep_parts) if keep_parts else np.zeros(0, bool)).astype(np.int64)
    nb = max(max(len(s.buckets) for s in layouts), 1)
    b_itemsize = np.ones((L, nb), np.int64)
    b_count = np.zeros((L, nb), np.int64)
    for layout, sched in enumerate(layouts):
        for b, bucket in enumerate(sched.buckets):
            b_itemsize[layout, b] = bucket.dtype.itemsize
            b_count[layout, b] = bucket.count
    arrays.update(
        tl_conn=np.array([conn_ix[k[:3]] for k in keys], np.int64), tl_npkts=tl_npkts,
        tl_mlo=tl_mlo, tl_mhi=tl_mhi, tl_recv_off=tl_recv_off, recv_total=recv_total,
        # [opening round 0 .. P-1, then a rebuilt round, connection]: sends (Plan.opening_sends)
        conn_steps=np.array([[plan.opening_sends()[c][k] for c in conns] for k in range(p + 1)],
                            np.int64).reshape(p + 1, len(conns)),
        tl_cycle=tl_npkts[p:].sum(axis=0), b_itemsize=b_itemsize, b_count=b_count,
        b_nbuckets=np.array([len(s.buckets) for s in layouts], np.int64))
    return CompiledSchedule(keys, conns, {k: i for i, k in enumerate(keys)}, arrays)


# -- the kernel's tables, as the reference's data plane ---------------------------------------
class KernelBinding(FlowBinding):
    """A FlowBinding whose PSN anchor (`last`) lives in the kernel's flow table: the
    kernel and the reference move the same anchor, whichever of them places a packet."""

    def __init__(self, b: FlowBinding, kernel, entry: int):
        for f in dataclasses.fields(FlowBinding):
            if f.name != "last":
                setattr(self, f.name, getattr(b, f.name))
        self.kernel, self.entry = kernel, entry

    @property
    def last(self) -> int:
        return self.kernel.anchor(self.entry)

    @last.setter
    def last(self, value: int):
        self.kernel.set_anchor(self.entry, value)


class KernelTables:
    """The kernel's tables written by the reference stages' decisions (the DataPlane of
    ckptd.transports.roce.flows): bound flows with their timeline, PSN base and anchor,
    unrelated flows and ACKs, LL flag bases, whether examples are still kept."""

    def __init__(self, kernel, sched: "CompiledSchedule"):
        self.kernel, self.sched = kernel, sched
        self.conn_ix = {c: i for i, c in enumerate(sched.conns)}
        self._packed: dict[str, bytes] = {}

    def key(self, src: str, dst: str, dqp: int) -> bytes:
        return _kernel.flow_key(self._addr(src), self._addr(dst), dqp)

    def _addr(self, a: str) -> bytes:
        p = self._packed.get(a)
        if p is None:
            p = self._packed[a] = ipaddress.ip_address(a).packed
        return p

    def bind_flow(self, b: FlowBinding) -> FlowBinding:
        e = self.kernel.add_flow(self.key(*b.key), FLOW_BOUND, self.sched.index[b.conn + (b.qp,)],
                                 b.base, b.last)
        return KernelBinding(b, self.kernel, e)

    def unrelated_flow(self, flow):
        self.kernel.add_flow(self.key(*flow), FLOW_UNRELATED)

    def unrelated_acks(self, src: str, dst: str):
        self.kernel.add_flow(self.key(src, dst, _kernel.ACK_FLOW_QP), FLOW_UNRELATED)

    def flag_base(self, conn, base: int):
        self.kernel.set_flag_base(self.conn_ix[conn], base)

    def examples_full(self):
        self.kernel.examples_open = False


# -- the extractor -------------------------------------------------------------------------
class FastExtractor(RoceTransport):
    """The RoCE transport (ckptd.transports.roce.transport.RoceTransport) with a batch
    entry point served by the kernel.

    It *is* the reference (binder, flag bases, counters, examples, received positions of
    the packets it places itself; `feed` and `feed_frame` are the reference methods),
    with the kernel as its data plane: every decision the reference makes is written
    into the kernel's tables as it is made (KernelTables), and a bound flow's PSN anchor
    lives only there (KernelBinding). The kernel's counts are folded in by `drain`.
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
        self.kernel.set_tables(**opcode_tables(), **self.sched.arrays, per_step=plan.allreduces_per_step,
                               mtu=plan.ring.mtu,
                               protocol=plan.ring.protocol,
                               cts_bytes=plan.ring.cts_bytes if plan.ring.ar_writes else -1)
        self.set_data_plane(KernelTables(self.kernel, self.sched))
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
        (see BatchKernel.run). Returns (index, reason, flow entry or iteration)."""
        if self._batch is not batch:
            self.kernel.set_batch(batch.buf, batch.offsets, batch.caplen, batch.origlen,
                                  batch.stream, batch.linktype, batch.icrc_checked)
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

    def drain(self, classes: list[Counter], assemblies: dict[int, IterationAssembly]) -> int:
        """Fold the kernel's counts into the reference's: Extractor.counters, the
        pipeline's per-stream classes, each open IterationAssembly's packets, bytes,
        covered count and conflicts (BatchKernel.drain). Returns the late placements
        (Pipeline.late)."""
        return self.kernel.drain(self.counters, classes, assemblies, time.monotonic())

    def stream_loss(self, stream: int, iteration: int) -> float | None:
        """Extractor.stream_loss over the positions both paths received."""
        flows = self.received.pop((stream, iteration), None) or {}
        recv = self.kernel.received(iteration)
        if recv is None and not flows:
            return None
        w = self.plan.last_wire_iteration(iteration)  # the step's last wire round: the one kept
        layout = self.plan.layout_index(w)
        py: dict[int, tuple[set, int]] = {}
        for key, got in flows.items():
            b = self.binder.bound[key]
            py[self.sched.index[b.conn + (b.qp,)]] = (got, b.timeline.iteration_start(w))
        expected = received = 0
        for t in range(len(self.sched.keys)):
            n = self.sched.npkts(layout, t)
            lo = int(self.sched.arrays["tl_recv_off"][layout, t])
            bits = recv[stream, lo:lo + n] if recv is not None else np.zeros(n, np.uint8)
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
@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector paused meanwhile. Building the pipeline makes tens of
    thousands of schedule objects and binding flows holds thousands of packets, and each
    full collection they set off walks torch's and numpy's object graphs too: 0.09 s more
    on every other replay of issue 16's scenario (benchmarks/RESULTS.md). Neither makes
    reference cycles; collection resumes afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


# iterations open together in a steady run: the one being finalized and the next, whose
# allgather has begun (tests/test_fastpath.py checks a run allocates no more than this)
OPEN_AT_ONCE = 2


class FastPipeline:
    """The kernel in front of a ckptd.pipeline.Pipeline: decode, place and assemble run in
    the kernel; finalize, apply and keep are the pipeline's, unchanged.

    `run_batch` for each Batch, then `finish`; or `run(frames)` with the reference's
    signature. The pipeline is `self.pipeline` (built with this extractor as its
    transport and the kernel's iteration buffers as its assemblies); its state and
    results (reports, classes, extract, late, errors, joined, ...) read through this
    object too.
    """

    def __init__(self, plan: Plan, start: dict | None, nstreams: int, opts: ReplayOptions,
                 on_iteration: Callable[[IterationReport], None] | None = None, *,
                 trust_icrc: bool = False, crc: str = "auto", keep_reports: int | None = None):
        def transport(plan, join_from):
            return FastExtractor(plan, nstreams, trust_icrc=trust_icrc, crc=crc,
                                 dump_rs=bool(opts.dump_gradients), join_from=join_from)
        self.pipeline = Pipeline(plan, start, nstreams, opts, on_iteration, keep_reports,
                                 make_transport=transport, open_assembly=self._open_assembly,
                                 close_assembly=self._close_assembly)
        self.extract: FastExtractor = self.pipeline.extract
        self.kernel = self.extract.kernel
        self.plan, self.nstreams = plan, nstreams
        self.trust_icrc = trust_icrc
        self.stops: Counter = Counter()  # why frames went to the reference path
        self.kernel_frames = 0  # frames the kernel handled itself
        self.kernel_seconds = 0.0  # time spent in the kernel (the rest is the reference path)

    def __getattr__(self, name):
        # the pipeline's state and results (reports, classes, late, errors, joined, ...)
        if name == "pipeline":
            raise AttributeError(name)
        return getattr(self.pipeline, name)

    @property
    def on_iteration(self):
        return self.pipeline.on_iteration

    @on_iteration.setter
    def on_iteration(self, fn):
        self.pipeline.on_iteration = fn

    @property
    def yield_to_commit(self):
        return self.pipeline.yield_to_commit

    @yield_to_commit.setter
    def yield_to_commit(self, fn):
        self.pipeline.yield_to_commit = fn

    # -- driving -------------------------------------------------------------------------
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
        """Every frame of the batch, in order (the cyclic collector paused: collector_paused)."""
        with collector_paused():
            self._run_batch(batch)

    def _run_batch(self, batch: Batch):
        self._place_batch(batch)
        if len(batch):  # every frame placed: the streams' clocks move on (agreement windows)
            self.advance_clock(self.kernel.stream_newest(batch.stream, batch.ts))

    def advance_clock(self, stream_time: list[int]):
        """Pipeline.advance_clock, then the kernel's tables follow what it committed."""
        self.pipeline.advance_clock(stream_time)
        self._sync_iterations()

    def _place_batch(self, batch: Batch):
        ex, pipe = self.extract, self.pipeline
        i, n = 0, len(batch)
        while i < n:
            t0 = time.perf_counter()
            j, reason, entry = ex.run(batch, i, n)
            self.kernel_seconds += time.perf_counter() - t0
            pipe.count_late(ex.drain(pipe.classes, pipe.open))
            for stream, it, k, low in self.kernel.progress():
                pipe.copies_seen(stream, it, int(batch.ts[k]), low)
            self.kernel_frames += j - i
            i = j
            if reason == "end":
                break
            self.stops[reason] += 1
            if reason == "complete":
                pipe.now_ns = int(batch.ts[i - 1])  # when it became complete (the agreement window)
                pipe.after_placement(entry)  # frame i-1 completed a bucket of iteration `entry`
            elif reason != "conflicts_full":  # (drained: resume at the same frame)
                pipe.now_ns = int(batch.ts[i])
                self._python_frame(batch, i, reason)
                i += 1
            self._sync_iterations()

    def finish(self, abandon: bool = False) -> list[IterationReport]:
        """End of input: the pipeline's ending (flush the binder, finalize or abandon
        what is open, dump what is kept)."""
        self.pipeline.finish(abandon)
        self._sync_iterations()
        return self.pipeline.reports

    def _python_frame(self, batch: Batch, i: int, reason: str):
        """The reference path, for one frame (Pipeline.run's loop body): a wrapped (GRE)
        frame goes through RoceTransport.feed_frame; one the kernel decoded becomes its
        Packet at once (what decode_roce would return) and goes to Extractor.feed. The
        reference records its decisions in the kernel's tables as it makes them."""
        ex, pipe = self.extract, self.pipeline
        stream = int(batch.stream[i])
        classes = pipe.classes[stream]
        classes["frames"] += 1
        if reason == "encapsulated":
            fr = batch.frame(i)
            placements = ex.feed_frame(stream, trusted_frame(fr) if self.trust_icrc else fr, classes)
        else:
            cls, pkt = ex.packet(batch, i)
            classes[cls] += 1
            placements = ex.feed(pkt)
        for pl in placements:
            pipe.place(pl)

    # -- iteration buffers: the kernel's, lent to the pipeline ---------------------------
    def reserve_iterations(self, at_once: int = OPEN_AT_ONCE) -> int:
        """Makes the kernel's buffers for the iterations a run starts with, every page
        written, before any frame arrives; bytes the kernel now keeps. Enough for
        `at_once` consecutive iterations open together anywhere in the layouts' rotation
        (the opening iterations have layouts of their own: Plan.timeline_prefix): what a steady run allocates anyway, now
        instead of while its first iterations' frames wait in the capture rings: fresh
        pages cost a fault each, 13-24 us on a VM that hands freed memory back to its host
        (docs/DAEMON.md), and a 2.6M-parameter model's buffers took ~8.6k of them."""
        k, pipe = self.kernel, self.pipeline
        first = pipe.join_wire if pipe.opts.join else 0
        period = k.nlayouts - k.nprefix
        need: Counter = Counter()
        for s in range(first, first + period + k.nprefix + 1):
            for layout, n in Counter(k.layout_of(it) for it in range(s, s + at_once)).items():
                need[layout] = max(need[layout], n)
        for layout, n in sorted(need.items()):
            k.reserve(layout, n)
        return k.buffer_bytes()["kept"]

    def _open_assembly(self, it: int) -> IterationAssembly:
        buckets = self.plan.buckets(it)
        if self.kernel.track_iteration(it):
            return IterationAssembly(it, buckets, self.nstreams, buffers=self.kernel.open_iteration(it))
        return IterationAssembly(it, buckets, self.nstreams)  # every slot taken: the reference's own

    def _close_assembly(self, asm: IterationAssembly):
        """The pipeline is done with an iteration (its per-stream loss is read): the
        kernel takes its received map and buffers back for a later iteration."""
        if self.kernel.slot_of(asm.iteration) >= 0:
            self.kernel.close_iteration(asm.iteration)
            asm.data, asm.covered, asm.by_stream = [], [], []  # the kernel's again

    def _sync_iterations(self):
        """The kernel tracks the live iterations (done < it <= highest) and places into
        those the pipeline has opened; it stops after a placement the pipeline must act
        on (a bucket's last element, or any while a whole bucket waits to be stepped:
        only ever in the next iteration to finalize)."""
        pipe = self.pipeline
        nxt = pipe.open.get(pipe.done + 1)
        every = nxt is not None and pipe.wants_every_placement(nxt)
        self.kernel.sync(pipe.done, pipe.highest, pipe.open, pipe.done + 1 if every else -1)


def fast_replay(plan: Plan, paths: list[str], start: dict | None, opts: ReplayOptions,
                on_iteration=None, *, trust_icrc: bool = False, crc: str = "auto",
                chunk_bytes: int | None = None, own_start: bool = False) -> FastPipeline:
    """ckptd.pipeline.replay through the kernel: the same reports, checkpoints and dumps
    (and `start` left as it was, unless own_start hands it over).
    The files are mapped and indexed in chunks on a thread of their own
    (ckptd.fast.batches.stream_batches, ReaderStage), which also checks the ICRCs; how
    often either side waited is kept in pipe.read_waits."""
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"{p}: no such capture file")
    # The collector stays paused up to the last report: once resumed, the allocations
    # counted while it was off set off a collection at once, and a full one walks every
    # object of torch and numpy (8 ms for a middle one, 80 ms for a full one, against a
    # 0.15 s replay of issue 16's scenario).
    with collector_paused():
        return _fast_replay(plan, paths, shadow_start(start, own_start), opts, on_iteration, trust_icrc, crc,
                            chunk_bytes)


def _fast_replay(plan, paths, start, opts, on_iteration, trust_icrc, crc, chunk_bytes) -> "FastPipeline":
    # The reader starts first: it maps, indexes and faults in the files and checks the
    # ICRCs on the other core while this one builds the pipeline (schedule, tables, shadow).
    errors: list[str] = []
    shifts = clock_shifts([str(p) for p in paths], opts, errors)
    batches = stream_batches([str(p) for p in paths], errors, chunk_bytes or CHUNK_BYTES,
                             None if trust_icrc else icrc_checker(crc), shifts)
    reader = ReaderStage(batches, release=release_mapped, cpu=reader_cpu())
    try:
        pipe = FastPipeline(plan, start, len(paths), opts, on_iteration, trust_icrc=trust_icrc, crc=crc)
        pipe.pipeline.errors = errors  # the reader's reports are the pipeline's
        pipe.yield_to_commit = reader.pause
        for batch in reader:
            pipe.run_batch(batch)
    finally:
        reader.close()
    pipe.read_waits = {"reader_waited": reader.full_waits, "extraction_waited": reader.empty_waits}
    pipe.finish()
    return pipe


__all__ = ["FastExtractor", "FastPipeline", "fast_replay", "compile_schedule",
           "trusted_frame"]
