"""Mirrored NCCL traffic of a large data-parallel job, written bucket by bucket.

`ckptd synth` trains a real model and builds each iteration's frames in memory with one
Python call per frame (~45 us each): right for a few million parameters, far too slow
and too big for hundreds of millions. `BulkSynth` writes the same kind of capture for a
model of any size while holding only one bucket's worth of data:

    gradients   each rank's gradients of one bucket, random float32 seeded by
                (seed, iteration, bucket, rank); no model exists, only the plan
    reduce      NCCL's ring summation order (ckptd.testing.synth.ring: chunk c starts at ring
                index c+1 and its owner adds last), chunk by chunk, keeping only the
                partial sums a mirrored link carries and the final values
    frames      the QPs of ckptd.testing.synth.Wire (same QP numbering, every QP starting at
                PSN 0 as NCCL connects them) and its per-send sequence: clear-to-send
                write, its ACK, the data message, the receiver's ACK. The full-MTU
                middle packets of a message are built as rows of one array and their
                ICRCs computed row by row with zlib, so a packet costs ~2 us of Python
                instead of ~45; first and last packets go through ckptd.testing.synth.wire
    capture     every frame goes to the pcap of each mirror (plan.mirrors) that sees
                it, reduce-scatter frames included; frames no mirror sees are never
                built (their PSNs and ACK sequence numbers still advance)

Within a bucket the connections take turns send by send, the way the ring pipelines;
timestamps grow by 100 ns per frame across all files, so merging the files by time
gives the generation order back. Simple protocol only, no loss, duplicates, reordering
or unrelated flows: a clean capture for measuring the replay.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from parsers import icrc
from parsers.bth import BTH
from parsers.pcap import ChunkedFile, PcapWriter
from parsers.reth import RETH

from ckptd.core.plan import Plan
from ckptd.core.psn import PSN_MASK, PSN_MOD, psn_add
from ckptd.core.schedule import AG, RingSchedule, npkts
from ckptd.testing.synth import ITERATION_GAP_NS, SynthOptions, Wire
from ckptd.testing.synth.wire import OP_WRITE_FIRST, OP_WRITE_LAST_IMM, OP_WRITE_MIDDLE, QueuePair, imm_bytes, roce_frame

OP_WRITE_LAST = 8
FRAME_NS = 100  # timestamp step between consecutive frames (any file)
_LRH_CRC = zlib.crc32(b"\xff" * 8)  # the ICRC's constant 8-byte prefix, folded once
_RANDOM_CHUNK = 1 << 22  # elements drawn at a time (bounded temporaries)
_PCAP_RECORD = 16


# -- gradients and the ring's reduction -------------------------------------------------------
def rank_gradients(seed: int, iteration: int, bucket: int, nranks: int, count: int,
                   out: np.ndarray) -> np.ndarray:
    """out[r, :count] = rank r's gradients of the bucket (float32), for every rank.

    Random bits with the exponent forced into 2^-15..2^-8 and a random sign: gradient-
    like magnitudes, every mantissa bit random, no NaN or infinity. Integers are drawn
    (about 4x faster than normals here) in bounded chunks into `out`, which the caller
    reuses across buckets so its pages are touched once."""
    bits = out.view(np.uint32)
    for r in range(nranks):
        rng = np.random.default_rng((seed, iteration, bucket, r))
        row = bits[r, :count]
        for lo in range(0, count, _RANDOM_CHUNK):
            hi = min(count, lo + _RANDOM_CHUNK)
            row[lo:hi] = rng.integers(0, 1 << 32, hi - lo, dtype=np.uint32)
        np.bitwise_and(row, np.uint32(0x83FF_FFFF), out=row)
        np.bitwise_or(row, np.uint32(0x3800_0000), out=row)
    return out.view(np.float32)


@dataclass
class ReducedBucket:
    """One bucket after the ring: the final values, and the partial sums the mirrored
    reduce-scatter sends carry, keyed (channel, offset, nelem, chunk, ring index)."""

    final: np.ndarray
    partials: dict = field(default_factory=dict)

    def payload(self, channel: int, send, ring_index: int) -> np.ndarray:
        sl = slice(send.offset, send.offset + send.nelem)
        if send.phase == AG or send.nelem == 0:
            return self.final[sl]
        return self.partials[(channel, send.offset, send.nelem, send.chunk, ring_index)]


def reduce_bucket(sched: RingSchedule, bucket: int, sends: dict, local: np.ndarray,
                  keep: dict[int, set[int]]) -> ReducedBucket:
    """The ring allreduce of one bucket in NCCL's summation order.

    sends: connection -> its sends of this bucket; local[r] rank r's values; keep:
    channel -> ring indices whose reduce-scatter partial sums are wanted (the senders
    some mirror sees). Same arithmetic as ckptd.testing.synth.ring.reduce_iteration (in-place
    float32 adds give the same bits as `acc + x`), but each chunk's chain is walked once
    and only the wanted partial sums are copied out."""
    cfg = sched.cfg
    n = cfg.nranks
    count = sched.buckets[bucket].count
    out = ReducedBucket(np.empty(count, np.float32))
    covered = np.zeros(count, bool)
    done = set()
    for (_, _, ch), conn_sends in sends.items():
        want = keep.get(ch, set())
        for s in conn_sends:
            key = (ch, s.offset, s.nelem, s.chunk)
            if s.nelem == 0 or key in done:
                continue
            done.add(key)
            sl = slice(s.offset, s.offset + s.nelem)
            first = (s.chunk + 1) % n
            acc = local[cfg.rank_at(ch, first)][sl].copy()
            if first in want:
                out.partials[key + (first,)] = acc.copy()
            for k in range(2, n + 1):
                idx = (s.chunk + k) % n
                np.add(acc, local[cfg.rank_at(ch, idx)][sl], out=acc)
                if k < n and idx in want:
                    out.partials[key + (idx,)] = acc.copy()
            out.final[sl] = acc  # the chunk's owner added last: the final sum
            covered[sl] = True
    if not covered.all():
        raise AssertionError(f"schedule leaves bucket {bucket} elements unreduced")
    return out


# -- frames ---------------------------------------------------------------------------------
class MessageFrames:
    """Writes one RDMA WRITE message's frames as pcap records, the middle packets as rows
    of one array: byte for byte what QueuePair.write returns (tests check it)."""

    def __init__(self, mtu: int):
        self.mtu = mtu
        self.rows = np.zeros((0, 0), np.uint8)
        self.templates: dict[int, tuple] = {}

    def _template(self, qp: QueuePair) -> tuple:
        """A middle packet's header as the ICRC sees it (masked) and as it is sent,
        the columns that differ, and where the PSN sits."""
        key = id(qp)
        t = self.templates.get(key)
        if t is None:
            bth = BTH(opcode=OP_WRITE_MIDDLE, pkey=0xFFFF, dest_qp=qp.dest_qp, psn=0)
            frame = roce_frame(qp.src, qp.dst, qp.sport, bth, b"", bytes(self.mtu))
            hdr = len(frame) - self.mtu - 4
            ip_off = 14
            udp_off = ip_off + (20 if qp.src.ip.version == 4 else 40)
            masked = bytes(frame[:ip_off]) + bytes(icrc.masked_region(frame, ip_off, udp_off,
                                                                      len(frame) - 4)[:hdr - ip_off])
            real = np.frombuffer(frame[:hdr], np.uint8)
            masked = np.frombuffer(masked, np.uint8)
            t = self.templates[key] = (hdr, ip_off, masked, real, np.flatnonzero(masked != real),
                                       udp_off + 8 + 9)
        return t

    def write(self, qp: QueuePair, payload: np.ndarray, va: int, rkey: int, imm: bytes | None,
              sinks: list[PcapWriter], ts: int) -> tuple[int, int]:
        """The message's frames to every sink, from timestamp ts; advances qp.psn.
        Returns (frames, bytes of frames)."""
        mtu = self.mtu
        n = npkts(len(payload), mtu)
        if n <= 2:
            pkts = qp.write(payload.tobytes(), mtu, va=va, rkey=rkey, imm=imm)
            for i, (f, _, _) in enumerate(pkts):
                for w in sinks:
                    w.write(f, ts + FRAME_NS * i)
            return len(pkts), sum(len(f) for f, _, _ in pkts)
        psn0 = qp.psn
        first = roce_frame(qp.src, qp.dst, qp.sport,
                           BTH(opcode=OP_WRITE_FIRST, pkey=0xFFFF, dest_qp=qp.dest_qp, psn=psn0),
                           RETH(va=va, rkey=rkey, dma_len=len(payload)).pack(), payload[:mtu].tobytes())
        last_op = OP_WRITE_LAST_IMM if imm is not None else OP_WRITE_LAST
        last = roce_frame(qp.src, qp.dst, qp.sport,
                          BTH(opcode=last_op, pkey=0xFFFF, dest_qp=qp.dest_qp, ack_req=1,
                              psn=psn_add(psn0, n - 1)),
                          imm or b"", payload[(n - 1) * mtu:].tobytes())
        rows = self._middle_rows(qp, payload, psn0, n, ts)
        for w in sinks:
            w.write(first, ts)
            w.f.write(memoryview(rows))
            w.write(last, ts + FRAME_NS * (n - 1))
        qp.psn = psn_add(psn0, n)
        return n, len(first) + len(last) + (n - 2) * (rows.shape[1] - _PCAP_RECORD)

    def _middle_rows(self, qp: QueuePair, payload: np.ndarray, psn0: int, n: int, ts: int) -> np.ndarray:
        """Packets 1..n-2 as pcap records (record header + frame), one per row."""
        mtu = self.mtu
        hdr, ip_off, masked, real, fix, psn_col = self._template(qp)
        m = n - 2
        width = _PCAP_RECORD + hdr + mtu + 4
        if self.rows.shape[0] < m or self.rows.shape[1] != width:
            self.rows = np.zeros((max(m, self.rows.shape[0]), width), np.uint8)
        rows = self.rows[:m]
        h = _PCAP_RECORD
        rows[:, h:h + hdr] = masked
        psn = (psn0 + 1 + np.arange(m, dtype=np.int64)) & PSN_MASK
        rows[:, h + psn_col] = psn >> 16
        rows[:, h + psn_col + 1] = (psn >> 8) & 0xFF
        rows[:, h + psn_col + 2] = psn & 0xFF
        rows[:, h + hdr:h + hdr + mtu] = payload[mtu:(n - 1) * mtu].reshape(m, mtu)
        lo, hi = h + ip_off, h + hdr + mtu
        crcs = np.fromiter((zlib.crc32(r, _LRH_CRC) for r in rows[:, lo:hi]), np.uint32, m)
        rows[:, hi:hi + 4].view("<u4")[:, 0] = crcs
        rows[:, h + fix] = real[fix]  # unmask: the fields as sent
        rec = rows[:, :h].view("<u4")
        when = ts + FRAME_NS * (1 + np.arange(m, dtype=np.int64))
        rec[:, 0] = when // 1_000_000_000
        rec[:, 1] = when % 1_000_000_000
        rec[:, 2] = rec[:, 3] = width - h
        return rows


# -- the job --------------------------------------------------------------------------------
@dataclass
class StreamStats:
    frames: int = 0
    bytes: int = 0  # frame bytes (what the pcap records hold)


class BulkSynth:
    """Writes N iterations of the plan's allreduce traffic, as captured by each of
    plan.mirrors, to one pcap per mirror (paths in the order of plan.mirrors).

    `run(iterations, on_bucket)` calls on_bucket(iteration, bucket, final values) after
    each bucket, so a caller can step its own optimizer on exactly the gradients the
    allgather carries; the array is fresh per bucket (the caller may keep it)."""

    def __init__(self, plan: Plan, paths: list[str | Path], seed: int = 0):
        cfg = plan.ring
        if cfg.protocol != "simple":
            raise ValueError("BulkSynth writes the Simple protocol only")
        if plan.collectives:
            raise ValueError("BulkSynth writes the gradient allreduces only (no plan collectives)")
        if not plan.one_host_per_rank:
            raise ValueError("BulkSynth writes one-GPU-per-host jobs only (use ckptd synth --nodes)")
        if plan.ring.ndevs > 1:
            raise ValueError("BulkSynth writes one port per NIC only (use ckptd synth --merged-nics)")
        if len(paths) != len(plan.mirrors):
            raise ValueError(f"{len(plan.mirrors)} mirrors in the plan, {len(paths)} paths")
        self.plan, self.seed = plan, seed
        self.rng = random.Random(seed)
        self.wire = Wire(plan, SynthOptions(out="", noise=False), self.rng)
        for qp in list(self.wire.data_qp.values()) + [q for qps in self.wire.cts_qps.values() for q in qps]:
            qp.psn = 0  # NCCL connects every QP with sq_psn = 0 (net_ib.cc ncclIbRtsQp)
        self.scheds = plan.timeline_schedules()
        self.paths = [Path(p) for p in paths]
        self.stats = [StreamStats() for _ in paths]
        self.messages = [self._messages(s) for s in self.scheds]
        self.frames = MessageFrames(cfg.mtu)
        self.ts = 1_700_000_000 * 10**9
        mirrors = plan.mirrors
        conns = sorted(self.scheds[0].sends)
        # (from rank, to rank) -> the mirrors that see frames going that way
        self.sees = {}
        for s, d, _ in conns:
            for a, b in ((s, d), (d, s)):
                self.sees[(a, b)] = [k for k, m in enumerate(mirrors) if m.sees(a, b)]
        # connections any mirror sees a frame of (data one way, CTS writes and ACKs back)
        self.conns = [c for c in conns if self.sees[c[:2]] or self.sees[(c[1], c[0])]]
        self.keep: dict[int, set[int]] = {}
        for s, d, ch in conns:
            if self.sees[(s, d)]:
                self.keep.setdefault(ch, set()).add(cfg.ring_index(ch, s))
        self._check_coverage()

    @staticmethod
    def _messages(sched: RingSchedule) -> dict:
        """(connection, send step) -> [(qp index, Message)] in QP order."""
        out: dict = {}
        for (s, d, c, q), fs in sched.flows.items():
            for m in fs.messages:
                out.setdefault(((s, d, c), m.send.step), []).append((q, m))
        return out

    def _check_coverage(self):
        """Every allgather element must reach at least one mirror (else no replay can
        commit): checked on the schedule, before writing anything."""
        for sched in self.scheds:
            for b, bucket in enumerate(sched.buckets):
                seen = np.zeros(bucket.count, bool)
                for conn, sends in sched.sends.items():
                    if self.sees[conn[:2]]:
                        for s in sends:
                            if s.bucket == b and s.phase == AG:
                                seen[s.offset:s.offset + s.nelem] = True
                if not seen.all():
                    raise ValueError(f"the plan's mirrors miss allgather elements of bucket {b}: "
                                     "choose ports or directions that see more of the ring")

    # -- writing ----------------------------------------------------------------------------
    def run(self, iterations: int,
            on_bucket: Callable[[int, int, np.ndarray], None] | None = None,
            progress: Callable[[int, int], None] | None = None) -> list[StreamStats]:
        plan = self.plan
        nb_max = max(b.count for s in self.scheds for b in s.buckets)
        local = np.zeros((plan.nranks, nb_max), np.float32)  # reused: pages touched once
        files = [ChunkedFile(p) for p in self.paths]
        self.writers = [PcapWriter(f) for f in files]
        try:
            for t in range(iterations):
                layout = plan.layout_index(t)
                sched = self.scheds[layout]
                by_bucket = self._sends_by_bucket(sched)
                for b, bucket in enumerate(sched.buckets):
                    values = rank_gradients(self.seed, t, b, plan.nranks, bucket.count, local)
                    red = reduce_bucket(sched, b, by_bucket[b], values, self.keep)
                    self._write_bucket(layout, by_bucket[b], red)
                    if on_bucket:
                        on_bucket(t, b, red.final)
                    if progress:
                        progress(t, b)
                self.ts += ITERATION_GAP_NS
        finally:
            for f in files:
                f.close()
        return self.stats

    @staticmethod
    def _sends_by_bucket(sched: RingSchedule) -> list[dict]:
        out = [{c: [] for c in sched.sends} for _ in sched.buckets]
        for conn, sends in sched.sends.items():
            for s in sends:
                out[s.bucket][conn].append(s)
        return out

    def _write_bucket(self, layout: int, sends: dict, red: ReducedBucket):
        """The connections take turns, one send each, as the ring pipelines."""
        queues = [(c, sends[c]) for c in self.conns if sends[c]]
        for k in range(max((len(s) for _, s in queues), default=0)):
            for conn, conn_sends in queues:
                if k < len(conn_sends):
                    self._send(layout, conn, conn_sends[k], red)

    def _emit(self, src: int, dst: int, frame: bytes):
        for k in self.sees[(src, dst)]:
            self.writers[k].write(frame, self.ts)
            self.stats[k].frames += 1
            self.stats[k].bytes += len(frame)
        self.ts += FRAME_NS

    def _send(self, layout: int, conn, s, red: ReducedBucket):
        """One NCCL send (ckptd.testing.synth.Wire.iteration_frames): the receiver's clear-to-send
        write and the sender's ACK of it, then the data message(s) and their ACKs."""
        src, dst, ch = conn
        cfg = self.plan.ring
        cts = self.wire.cts_qps[conn][0]
        if self.sees[(dst, src)]:
            fifo = self.rng.randbytes(cfg.cts_bytes)
            for f, _, _ in cts.write(fifo, 4096, va=0x7f00_0000_0000 + 64 * (s.step % 8),
                                     rkey=0x1234, imm=None):
                self._emit(dst, src, f)
        else:
            cts.psn = psn_add(cts.psn, 1)
        self._ack(cts, src, dst, (cts.psn - 1) % PSN_MOD)
        sinks = self.sees[(src, dst)]
        for q, m in self.messages[layout][(conn, s.step)]:
            qp = self.wire.data_qp[conn + (q,)]
            if sinks:
                data = red.payload(ch, s, cfg.ring_index(ch, src)).view(np.uint8)
                part = data[m.wire_offset:m.wire_offset + m.wire_len]
                nf, nbytes = self.frames.write(
                    qp, part, va=0x7e00_0000_0000 + (s.step % 8) * cfg.step_bytes + m.wire_offset,
                    rkey=0x5678, imm=None if m.imm is None else imm_bytes(m.imm, cfg.imm_big_endian),
                    sinks=[self.writers[k] for k in sinks], ts=self.ts)
                for k in sinks:
                    self.stats[k].frames += nf
                    self.stats[k].bytes += nbytes
                self.ts += FRAME_NS * nf
            else:
                qp.psn = psn_add(qp.psn, m.npkts)
            self._ack(qp, dst, src, (qp.psn - 1) % PSN_MOD)

    def _ack(self, qp: QueuePair, frm: int, to: int, psn: int):
        """The responder's ACK (frm -> to); built only when a mirror sees it."""
        if self.sees[(frm, to)]:
            self._emit(frm, to, qp.ack(psn=psn))
        else:
            qp.msn = (qp.msn + 1) & 0xFFFFFF


__all__ = ["BulkSynth", "MessageFrames", "ReducedBucket", "rank_gradients", "reduce_bucket"]
