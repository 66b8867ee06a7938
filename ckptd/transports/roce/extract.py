"""Extract: from a RoCE write packet to the gradient elements it carries.

Each packet of a bound flow is checked against the message the schedule says it is
part of (opcode, payload length, RETH DMA length, immediate); a packet that does not
fit is rejected and counted, never placed. Allgather payload becomes a `Placement`
(iteration, bucket, first element, raw element bytes); for LL the 16-byte lines are
de-interleaved and their flags must equal the connection's step counter, which is
learned from the first packet of the connection and then checked on every line.

Module buffers (a plan with buffers.captured): DDP's per-forward buffer
broadcasts are collectives.before broadcasts (Plan.buffer_others); the one in iteration
i carries rank 0's buffers after forward i-1 (ckptd.core.buffers), so its payload is
kept for iteration i-1 (`buffers_after`). A broadcast forwards the root's bytes
unchanged, so every hop's copy, on every mirror, is the value: copies are unpacked like
gradient packets (LL, LL128 flags checked) and must agree byte for byte; a disagreement
is a conflict of iteration i-1 (`buffers_conflict`), never resolved by arrival order.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from ckptd.transports.roce.flows import (ACK, HEAD_OPCODES, IMM_OPCODES, WRITE_FIRST, WRITE_LAST, WRITE_LAST_IMM,
                                         WRITE_MIDDLE, WRITE_ONLY, WRITE_ONLY_IMM, DataPlane, FlowBinder,
                                         FlowBinding, Location, Packet)
from ckptd.core.plan import Plan, _np_dtype
from ckptd.core import ll128
from ckptd.core.schedule import AG, LL_LINE
from ckptd.transports.base import MAX_EXAMPLES, Placement, Transport

def ll_unpack(payload, expected_flag: int | None) -> tuple[bytes, int | None, bool]:
    """(data bytes, the flag seen, all flags equal expected) for whole LL lines."""
    words = np.frombuffer(payload, "<u4").reshape(-1, 4)
    if len(words) == 0:
        return b"", expected_flag, True
    flag = int(words[0, 1])
    want = flag if expected_flag is None else expected_flag
    ok = bool((words[:, 1] == want).all() and (words[:, 3] == want).all())
    return words[:, 0::2].tobytes(), flag, ok


class Extractor(Transport):
    # each stream's copy of a packet is placed and compared in the iteration's assembly,
    # so its placements show how far that stream's copies have come (Pipeline._copies_due)
    places_every_copy = True

    def __init__(self, plan: Plan, join_from: int | None = None):
        self.plan = plan
        self.cfg = plan.ring
        # Wire rounds (Location.iteration) are the communicator's rounds of bucket
        # allreduces: with allreduces_per_step K > 1 training iteration i is rounds
        # i*K .. i*K+K-1, and only the last is placed (Plan.step_of_round)
        self.per_step = plan.allreduces_per_step
        self.binder = FlowBinder(plan, None if join_from is None else join_from * self.per_step)
        # wire rounds 0 .. P-1 open the job (Plan.timeline_prefix: 2 with static_graph),
        # P on are the rebuilt layout's; per kind (min(round, P)): itemsizes, buffer broadcasts
        self.prefix = p = plan.timeline_prefix
        scheds = [plan.schedule(k) for k in range(p + 1)]
        self.itemsize = {k: [b.dtype.itemsize for b in s.buckets] for k, s in enumerate(scheds)}
        self.flag_base: dict[tuple[int, int, int], int] = {}
        self.counters: Counter = Counter()
        self.examples: list[str] = []
        # (stream, iteration) -> {flow: set of packet positions received intact}
        self.received: dict[tuple[int, int], dict[tuple, set]] = {}
        self.done = -1  # the pipeline's newest finalized (wire) iteration
        self.data_plane: DataPlane | None = None
        # DDP's buffer broadcasts: {layout 0 | 1: {others index: group}}, each group's
        # payload bytes and itemsize; per iteration whose buffers they carry, each
        # group's (bytes, which bytes are known), and the first disagreement
        self.buffer_of = {k: plan.buffer_others(k) for k in range(p + 1)}
        self.buffer_sizes = plan.buffer_broadcast_bytes() if plan.buffers.captured else []
        self.buffer_itemsize = [np.dtype(_np_dtype(d)).itemsize for _, d in plan.buffer_broadcast_entries()]
        self.buffer_data: dict[int, list] = {}
        self.buffer_conflicts: dict[int, str] = {}

    def set_data_plane(self, data_plane: DataPlane):
        """Record every decision from now on in a data plane's tables (ckptd.fast)."""
        self.data_plane = self.binder.data_plane = data_plane

    def _reject(self, reason: str, pkt: Packet, detail: str):
        self.counters[reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"stream {pkt.stream} frame {pkt.frame_no} "
                                 f"({pkt.src} -> {pkt.dst} QP {pkt.dqp:#x} PSN {pkt.psn}): {detail}")
            if len(self.examples) == MAX_EXAMPLES and self.data_plane is not None:
                self.data_plane.examples_full()

    def feed(self, pkt: Packet) -> list[Placement]:
        """All placements a packet (and any packets its arrival releases) yield."""
        if pkt.opcode == ACK:
            self.counters["acks"] += 1
            self.binder.note_ack(pkt)
            return []
        b = self.binder.bound.get(pkt.flow)
        if b is not None:
            return self._place(b, pkt)
        if pkt.flow in self.binder.unrelated:
            self.counters["unrelated"] += 1
            return []
        hop = self.binder.hop_of(pkt)
        if hop is None:  # between addresses that form no hop of the job
            self.counters["unrelated"] += 1
            if self.data_plane is not None:
                self.data_plane.unrelated_flow(pkt.flow)
            return []
        out = []
        for bb, p in self.binder.offer(hop, pkt):
            out += self._place(bb, p)
        return out

    def idle(self) -> list[Placement]:
        return []  # RoCE places by PSN as packets come: nothing waits for later traffic

    def flush(self) -> list[Placement]:
        out = []
        for bb, p in self.binder.flush():
            out += self._place(bb, p)
        return out

    def _global_step(self, conn, iteration: int, step: int) -> int:
        return self.plan.sends_before(iteration, conn) + step

    def _place(self, b: FlowBinding, pkt: Packet) -> list[Placement]:
        loc = self.binder.locate(b, pkt.psn)
        if loc is None:
            self._reject("before_start", pkt, "PSN lies before the flow's first message")
            return []
        bad = self._check(loc, pkt)
        if bad:
            self._reject("schedule_mismatch", pkt, bad)
            self.binder.note_mismatch(b, loc.pos, pkt)
            return []
        step = self.plan.step_of_round(loc.iteration)  # None: an earlier micro-batch's round
        if step is not None and step > self.done:  # bookkeeping ends when the iteration is finalized
            self.received.setdefault((pkt.stream, step), {}).setdefault(
                b.key, set()).add(loc.pos)
        msg, send = loc.message, loc.message.send
        cfg = self.cfg
        woff = msg.wire_offset + loc.index * cfg.mtu  # wire byte offset within the send
        payload = pkt.payload
        if cfg.protocol == "ll":
            if len(payload) % LL_LINE:
                self._reject("schedule_mismatch", pkt, f"LL payload of {len(payload)} bytes is not whole lines")
                return []
            gstep = self._global_step(b.conn, loc.iteration, send.step)
            base = self.flag_base.get(b.conn)
            expected = None if base is None else (base + gstep + 1) & 0xFFFFFFFF
            data, flag, ok = ll_unpack(payload, expected)
            if not ok:
                self._reject("ll_flag_mismatch", pkt, f"LL flags differ from the expected {expected}")
                return []
            if base is None and flag is not None:
                self.flag_base[b.conn] = (flag - gstep - 1) & 0xFFFFFFFF
                if self.data_plane is not None:
                    self.data_plane.flag_base(b.conn, self.flag_base[b.conn])
            runs = [(woff // 2, data)]
        elif cfg.protocol == "ll128":
            if woff % (ll128.LINE_WORDS * 8) or len(payload) % (ll128.LINE_WORDS * 8):
                self._reject("schedule_mismatch", pkt, f"LL128 payload of {len(payload)} bytes is not whole lines")
                return []
            gstep = self._global_step(b.conn, loc.iteration, send.step)
            base = self.flag_base.get(b.conn)
            expected = None if base is None else (base + gstep + 1) & ll128.FLAG_MASK
            runs, flag, ok = ll128.decode(payload, woff, expected)
            if not ok:  # a line whose flag is not this step's is not intact: none of it is placed
                self._reject("ll_flag_mismatch", pkt, f"LL128 flags differ from the expected {expected}")
                return []
            if base is None and flag is not None:
                self.flag_base[b.conn] = (flag - gstep - 1) & ll128.FLAG_MASK
                if self.data_plane is not None:
                    self.data_plane.flag_base(b.conn, self.flag_base[b.conn])
        else:
            runs = [(woff, bytes(payload))]
        if send.bucket < 0:  # another collective on the communicator (Plan.collectives): no gradient
            self.counters["other_collective_packets"] += 1
            g = self.buffer_of[min(loc.iteration, self.prefix)].get(-1 - send.bucket)
            k = self.plan.buffers_step_of_round(loc.iteration)
            if g is not None and k is not None and k > self.done:
                self._keep_buffer(k, g, send, runs, pkt)
            return []
        itemsize = self.itemsize[min(loc.iteration, self.prefix)][send.bucket]
        total = send.nelem * itemsize  # LL and LL128 pad the last line or block: drop what is not data
        runs = [(doff, data[:max(0, total - doff)]) for doff, data in runs]
        if any(doff % itemsize or len(data) % itemsize for doff, data in runs):
            self._reject("schedule_mismatch", pkt, "payload does not split into whole elements")
            return []
        self.counters["ag_packets" if send.phase == AG else "rs_packets"] += 1
        if step is None:  # matched and counted; the step's last round carries its gradient
            self.counters["earlier_micro_batch_packets"] += 1
            return []
        return [Placement(pkt.stream, step, send.phase, send.bucket,
                          send.offset + doff // itemsize, data, b.conn[0], send.ring_step)
                for doff, data in runs if data]

    def _keep_buffer(self, k: int, g: int, send, runs, pkt: Packet):
        """Bytes of buffer broadcast group g carrying rank 0's buffers after iteration k:
        kept where new, compared where known (copies must agree)."""
        size, isz = self.buffer_sizes[g], self.buffer_itemsize[g]
        per = self.buffer_data.get(k)
        if per is None:  # (iterations finalized without taking theirs, e.g. no shadow: dropped)
            for old in [x for x in self.buffer_data if x <= self.done]:
                del self.buffer_data[old]
                self.buffer_conflicts.pop(old, None)
            per = self.buffer_data[k] = [None] * len(self.buffer_sizes)
        if per[g] is None:
            per[g] = (np.zeros(size, np.uint8), np.zeros(size, bool))
        data, have = per[g]
        total = send.nelem * isz  # LL and LL128 pad the last line or block
        for doff, raw in runs:
            raw = raw[:max(0, total - doff)]
            if not raw:
                continue
            lo = send.offset * isz + doff
            new = np.frombuffer(raw, np.uint8)
            old, seen = data[lo:lo + len(new)], have[lo:lo + len(new)]
            if (old[seen] != new[seen]).any():
                self.counters["buffer_broadcast_conflict"] += 1
                if k not in self.buffer_conflicts:
                    self.buffer_conflicts[k] = (f"stream {pkt.stream} frame {pkt.frame_no}: module buffer "
                                                f"broadcast group {g}, bytes [{lo}, {lo + len(new)})")
                self._reject_example(pkt, "buffer broadcast copy differs from another intact copy")
                continue
            old[:] = new
            seen[:] = True
        self.counters["buffer_broadcast_packets"] += 1

    def _reject_example(self, pkt: Packet, detail: str):
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"stream {pkt.stream} frame {pkt.frame_no} "
                                 f"({pkt.src} -> {pkt.dst} QP {pkt.dqp:#x} PSN {pkt.psn}): {detail}")
            if len(self.examples) == MAX_EXAMPLES and self.data_plane is not None:
                self.data_plane.examples_full()

    def buffers_after(self, iteration: int) -> list[bytes] | None:
        """The payloads of DDP's buffer broadcasts carrying rank 0's buffers after
        `iteration` (sent in iteration+1's forward), once every byte of each is known and
        no copy disagreed; else None."""
        if iteration in self.buffer_conflicts:
            return None
        per = self.buffer_data.get(iteration)
        out = []
        for g, size in enumerate(self.buffer_sizes):
            if size == 0:
                out.append(b"")
                continue
            if per is None or per[g] is None or not per[g][1].all():
                return None
            out.append(per[g][0].tobytes())
        return out

    def buffers_conflict(self, iteration: int) -> str | None:
        """Where copies of the buffers after `iteration` disagreed, or None."""
        return self.buffer_conflicts.get(iteration)

    def take_buffers(self, iteration: int) -> list[bytes] | None:
        """buffers_after, and forget the buffers up to that iteration."""
        got = self.buffers_after(iteration)
        for k in [k for k in self.buffer_data if k <= iteration]:
            del self.buffer_data[k]
        if self.buffer_conflicts.pop(iteration, None) is None and got is None:
            self.counters["buffers_not_seen"] += 1
        return got

    def forget_before(self, iteration: int):
        """Joining: bookkeeping of the iterations before the one joined ends."""
        for key in [k for k in self.received if k[1] < iteration]:
            del self.received[key]
        for k in [k for k in self.buffer_data if k < iteration]:
            del self.buffer_data[k]

    def stream_loss(self, stream: int, iteration: int) -> float | None:
        """Fraction of the packets of the flows this stream saw in an iteration that had
        not reached it intact (lost, corrupted or rejected) by the time the iteration
        was finalized; None if it saw none. Forgets the iteration's bookkeeping."""
        flows = self.received.pop((stream, iteration), None)
        if not flows:
            return None
        expected = 0
        w = self.plan.last_wire_iteration(iteration)  # (earlier micro-batches' rounds are not kept)
        for key, got in flows.items():
            tl = self.binder.bound[key].timeline
            expected += tl.schedule_of(w).npkts
        return 1.0 - sum(len(g) for g in flows.values()) / expected

    def _check(self, loc: Location, pkt: Packet) -> str | None:
        """Why a packet cannot be the message the schedule puts at its PSN, or None."""
        msg, i, mtu = loc.message, loc.index, self.cfg.mtu
        last = msg.npkts - 1
        if msg.npkts == 1:
            want = {WRITE_ONLY if msg.imm is None else WRITE_ONLY_IMM}
        elif i == 0:
            want = {WRITE_FIRST}
        elif i == last:
            want = {WRITE_LAST if msg.imm is None else WRITE_LAST_IMM}
        else:
            want = {WRITE_MIDDLE}
        if pkt.opcode not in want:
            return f"opcode {pkt.opcode} where the schedule has {sorted(want)} (iteration " \
                   f"{loc.iteration}, packet {i} of a {msg.wire_len}-byte message)"
        size = min(mtu, msg.wire_len - i * mtu)
        if len(pkt.payload) != size:
            return f"payload {len(pkt.payload)} bytes, schedule says {size}"
        if pkt.opcode in HEAD_OPCODES and pkt.dma_len != msg.wire_len:
            return f"RETH DMA length {pkt.dma_len}, schedule says {msg.wire_len}"
        if pkt.opcode in IMM_OPCODES:
            want_imm = msg.imm.to_bytes(4, "big" if self.cfg.imm_big_endian else "little")
            if pkt.imm != want_imm:
                return f"immediate {pkt.imm.hex()}, schedule says {want_imm.hex()}"
        return None
