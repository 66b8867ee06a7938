"""Place: which schedule message and byte range a RoCE packet is.

A flow is (source IP, destination IP, destination QP). The plan names the NICs'
addresses, so a flow's link (sender NIC port -> receiver NIC port, each NIC named by the
rank that owns it, `Plan.port_of`) is known at once; a NIC has one port unless NCCL merges
several (then QP q of a connection runs between port q % ndevs of both ends, `Plan.qp_link`). Only ring connections between ranks of
different nodes use a NIC (`Plan.network_connections`); NVLink/PCIe hops inside a node
are never expected. On one-GPU hosts a link is a hop (sender rank -> receiver rank);
where ranks share a NIC, or send through another GPU's NIC (PXN), one link can carry
the connections of several rank pairs. Which connection, channel and QP of its link a
flow is, and which PSN its first message started at, are learned from the traffic
(`FlowBinder`): every RDMA message head carries its length
(RETH DMA length, and the immediate NCCL writes), and the schedule says which
lengths each QP's messages have. A flow binds to the (channel, QP) whose message
sequence explains every head seen, at the earliest message that does; flows that
no candidate explains are some other traffic between the same hosts and are counted,
not used. When several QPs of a link carry identical sequences, they are told apart
by QP number: NCCL connects channels in order, so the receiver's QPNs grow with the
channel.

Joining a running job (`join_from` set): the first packets seen are somewhere in the
middle of the job, so nothing about them says "iteration 0". But NCCL connects every QP
at PSN 0 (net_ib.cc: ncclIbRtrQp rq_psn = 0, ncclIbRtsQp sq_psn = 0; every flow of the
FlowCheck captures starts at 0), so a packet's PSN *is* its position in its QP's
timeline, modulo 2**24: the schedule then names its iteration, message and packet, and
the message lengths and immediates seen must agree. Positions are read as the smallest
ones at or after iteration `join_from`'s start (PSNs wrap every 2**24 packets per QP).
Each flow's first whole iteration is the one whose first packet position is at or after
its earliest packet seen; the pipeline joins at the latest of these over all flows.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

import numpy as np

from ckptd.core import ll128
from ckptd.core.algorithms import CollectiveRefused
from ckptd.core.plan import Plan
from ckptd.core.psn import PSN_MOD, psn_diff, psn_unwrap
from ckptd.core.schedule import LL_LINE, RS, FlowSchedule, Message
from ckptd.core.tree import TreeSchedule

# Opcodes NCCL's data QPs use (RC RDMA WRITE family); the clear-to-send QPs carry only
# WRITE_ONLY (10) without an immediate, ACKs are 17.
WRITE_FIRST, WRITE_MIDDLE, WRITE_LAST, WRITE_LAST_IMM, WRITE_ONLY, WRITE_ONLY_IMM = 6, 7, 8, 9, 10, 11
DATA_OPCODES = {WRITE_FIRST, WRITE_MIDDLE, WRITE_LAST, WRITE_LAST_IMM, WRITE_ONLY_IMM}
# Where sends go as WRITE + 0-byte WRITE_WITH_IMM (RingConfig.ar_writes), data parts of
# one MTU or less are WRITE_ONLY too; a WRITE_ONLY of RingConfig.cts_bytes is still the
# clear-to-send (such a data part is never that short: is_cts)
HEAD_OPCODES = {WRITE_FIRST, WRITE_ONLY, WRITE_ONLY_IMM}
IMM_OPCODES = {WRITE_LAST_IMM, WRITE_ONLY_IMM}

ACK = 17


def carries_data(cfg, opcode: int, dma_len: int | None) -> bool:
    """Whether a RoCE write packet can be part of the job's sends (not a clear-to-send)."""
    if opcode in DATA_OPCODES:
        return True
    return opcode == WRITE_ONLY and cfg.ar_writes and dma_len != cfg.cts_bytes
PENDING_LIMIT = 20000  # packets held per hop while its flows are not yet bound
MIN_HEADS = 3  # message heads a flow must show before it is bound by its lengths alone
ACK_WINDOW = 4096  # how far before a flow's first packet its ACKs are looked for
RECENT_ACKS = 4096  # ACKs remembered per hop while its flows are unbound
ACKS_WITHOUT_DATA = 4096  # a hop's ACKs seen with none of its data: its data is not mirrored
MISMATCHED_HEADS = 16  # message heads kept per bound flow that the schedule rejected
# a flow first seen this many packets past PSN 0 had carried traffic before the capture
# (a flow's first few packets may be lost on every mirror, and still it began there)
MID_JOB_PSN = 16
LINES_SAMPLE = 16  # packets of a flow whose lines name its protocol (FlowBinder._lines)
LL128_LINE = ll128.LINE_WORDS * 8
PROTOCOL_LOOKS = {"ll": "LL (16-byte lines, a flag in every second 32-bit word)",
                  "ll128": "LL128 (128-byte lines, a flag in every 16th 64-bit word)",
                  "simple": "Simple (no flag words)"}
PROTOCOL_ENV = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}


def wire_protocol(payload) -> str:
    """Which NCCL protocol's lines a data packet of 128 bytes or more carries: LL puts the
    step's flag in words 1 and 3 of every 16-byte line (prims_ll.h:132 storeLL@v2.19.4-1),
    LL128 in word 15 of every 128-byte line (ckptd.core.ll128); a flag is the connection's
    step + 1, never 0 before 2**32 steps, so zeros, and data, read as Simple. An LL128 flag
    word's upper half is 0 (a step below 2**32); LL's lines put a flag there, so LL lines
    whose data repeat at the LL128 flag's place (DDP's int32 used map: one count again
    and again) do not read as LL128."""
    n = len(payload)
    if n < LL128_LINE or n % LL_LINE:
        return "simple"
    words = np.frombuffer(payload, "<u4")
    if (words == words[0]).all():
        return "simple"  # one value repeated reads as any protocol: data
    if n % LL128_LINE == 0:
        flags = np.frombuffer(payload, "<u8")[ll128.FLAG_WORD::ll128.LINE_WORDS]
        if flags[0] and not flags[0] >> 32 and (flags == flags[0]).all():
            return "ll128"
    words = words.reshape(-1, 4)
    if words[0, 1] and (words[:, 1] == words[0, 1]).all() and (words[:, 3] == words[0, 1]).all():
        return "ll"
    return "simple"


def reduce_scatter_only(sched: FlowSchedule) -> FlowSchedule:
    """The QP's messages with its allgather sends left out: what the wire carries when
    the job reduce-scatters instead of allreducing (FSDP/ZeRO). NCCL's ring
    ReduceScatter sends the same chunks as the first half of a ring allreduce loop and
    then reduces the last one in place (src/device/reduce_scatter.h:52-64@v2.19.4-1:
    send, recvReduceSend x (n-2), recvReduceCopy), so the final values never leave."""
    out = FlowSchedule(sched.src, sched.dst, sched.channel, sched.qp)
    for m in sched.messages:
        if m.send.phase == RS:
            out.add(m)
    return out


@dataclass
class Packet:
    """What Place needs of one decoded RoCE write packet."""

    stream: int
    frame_no: int
    src: str
    dst: str
    dqp: int
    opcode: int
    psn: int
    dma_len: int | None
    imm: bytes | None
    payload: memoryview
    sport: int = 0  # UDP source port: one per RC connection, the same both ways

    @property
    def flow(self):
        return (self.src, self.dst, self.dqp)


@dataclass
class Location:
    iteration: int
    message: Message
    index: int  # packet index within the message
    sched: FlowSchedule
    pos: int  # packet position in the flow since the first message of iteration 0


class FlowTimeline:
    """A QP's message sequence over all iterations: the opening iterations' layouts
    (`opening`: iteration 0's, and with static_graph iteration 1's, the first layout
    again: Plan.timeline_prefix), then the rebuilt iterations, which cycle through
    `cycle` (one schedule per QP rotation, Plan.timeline_schedules; a single one with
    one QP). `opening` may be one FlowSchedule (iteration 0's)."""

    def __init__(self, opening, cycle: list[FlowSchedule]):
        self.opening = [opening] if isinstance(opening, FlowSchedule) else list(opening)
        self.cycle = list(cycle)
        self.cycle_npkts = sum(fs.npkts for fs in self.cycle)
        self.opening_npkts = sum(fs.npkts for fs in self.opening)

    @property
    def first(self) -> FlowSchedule:
        """Iteration 0's schedule."""
        return self.opening[0]

    @property
    def npkts_any(self) -> int:
        """Packets of the opening iterations and of one cycle: 0 for a QP that never carries any."""
        return self.opening_npkts + self.cycle_npkts

    @property
    def layouts(self) -> list[FlowSchedule]:
        return self.opening + self.cycle

    def schedule_of(self, iteration: int) -> FlowSchedule:
        p = len(self.opening)
        return self.opening[iteration] if iteration < p else self.cycle[(iteration - p) % len(self.cycle)]

    def locate(self, pos: int) -> tuple[int, FlowSchedule, int, int] | None:
        """(iteration, schedule, message index, packet index) at flow position pos."""
        if pos < 0:
            return None
        if pos < self.opening_npkts:
            local = pos
            for it, fs in enumerate(self.opening):
                if local < fs.npkts:
                    m, i = fs.locate(local)
                    return it, fs, m, i
                local -= fs.npkts
        if self.cycle_npkts == 0:
            return None
        p = len(self.opening)
        turns, local = divmod(pos - self.opening_npkts, self.cycle_npkts)
        for k, fs in enumerate(self.cycle):
            if local < fs.npkts:
                m, i = fs.locate(local)
                return p + turns * len(self.cycle) + k, fs, m, i
            local -= fs.npkts
        raise AssertionError("unreachable: local < cycle_npkts")

    def iteration_start(self, iteration: int) -> int:
        p = len(self.opening)
        if iteration < p:
            return sum(fs.npkts for fs in self.opening[:iteration])
        turns, k = divmod(iteration - p, len(self.cycle))
        return self.opening_npkts + turns * self.cycle_npkts + sum(fs.npkts for fs in self.cycle[:k])

    def head_at(self, pos: int) -> Message | None:
        """The message starting exactly at pos, if one does."""
        loc = self.locate(pos)
        if loc is None or loc[3] != 0:
            return None
        return loc[1].message(loc[2])


@dataclass
class FlowBinding:
    key: tuple[str, str, int]
    conn: tuple[int, int, int]  # (sender, receiver, channel)
    qp: int
    timeline: FlowTimeline
    base: int  # unwrapped PSN of the first packet of iteration 0's first message
    last: int  # unwrapped PSN of the newest packet, the anchor for unwrapping the next
    first_whole: int = 0  # first iteration whose every packet came after the first seen
    # (sender port, receiver port), a port = (its NIC by owner rank, port index): Plan.qp_link
    link: tuple[tuple[int, int], tuple[int, int]] = ((-1, 0), (-1, 0))
    mismatched: list = field(default_factory=list)  # (position, DMA length) of heads the schedule rejected
    first_psn: int = 0  # the earliest PSN seen of the flow, its ACKs' included (_placed_inside)


class DataPlane(Protocol):
    """Tables a faster data plane places packets from (ckptd.fast's batch kernel): the
    reference stages make every decision and record it here as they make it, the way a
    DPDK control plane writes a forwarding table. With none attached they just decide."""

    def bind_flow(self, b: FlowBinding) -> FlowBinding:
        """A flow was bound; returns the binding to keep (its PSN anchor may live in the
        data plane's table from now on)."""

    def unrelated_flow(self, flow: tuple[str, str, int]) -> None:
        """Packets of this flow are counted as unrelated from now on."""

    def unrelated_acks(self, src: str, dst: str) -> None:
        """ACKs from src to dst can teach the binder nothing (any more): only counted."""

    def flag_base(self, conn: tuple[int, int, int], base: int) -> None:
        """The LL flag base of a connection was learned."""

    def examples_full(self) -> None:
        """The extractor keeps no more rejection examples: rejections are only counted."""


@dataclass
class _Candidate:
    packets: list = field(default_factory=list)
    heads: list = field(default_factory=list)  # (rel, dma_len) of FIRST/ONLY packets
    imms: list = field(default_factory=list)  # (rel, imm bytes) of *_WITH_IMM packets
    first_psn: int | None = None
    sport: int = 0
    min_rel: int = 0


class FlowBinder:
    """Learns which (connection, QP) every data flow is and where its PSNs start.

    Keyed by link (sender port, receiver port), each port (its NIC named by the owner
    rank, port index; always 0 but on merged NICs), which for one-GPU hosts is the hop
    (sender rank, receiver rank): `expected[link]` lists the (sender, receiver, channel,
    QP) slots the link's flows can bind to (Plan.qp_link: each QP on its own pair of
    ports)."""

    def __init__(self, plan: Plan, join_from: int | None = None):
        self.plan = plan
        self.join_from = join_from  # None: the capture starts before the job's first message
        layouts, p = plan.timeline_schedules(), plan.timeline_prefix
        opening, cycle = layouts[:p], layouts[p:]
        self.imm_big_endian = plan.ring.imm_big_endian
        wire = plan.network_connections
        self.timelines = {k: FlowTimeline([s.flows[k] for s in opening], [s.flows[k] for s in cycle])
                          for k in opening[0].flows if k[:3] in wire}
        # Only QPs of network hops that carry at least one message can ever be seen;
        # slots in channel order, then QP (the order NCCL connects them in).
        self.expected: dict[tuple[tuple[int, int], tuple[int, int]], list[tuple[int, int, int, int]]] = {}
        for (s, d, c, q), tl in sorted(self.timelines.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][:2])):
            if tl.npkts_any:
                self.expected.setdefault(plan.qp_link((s, d, c), q), []).append((s, d, c, q))
        self.bound: dict[tuple, FlowBinding] = {}
        self.unrelated: set[tuple] = set()
        self.pending: dict[tuple[int, int], dict[tuple, _Candidate]] = {}
        self.acks: dict[tuple[int, int], deque] = {}
        self.ack_count: Counter = Counter()  # per link, while none of its data was seen
        self.acks_ignored: set[tuple[int, int]] = set()
        self.off_ring: dict[tuple, set] = {}  # data flows between job ports that form no link
        self.strangers: dict[str, set[int]] = {}  # address not in the plan -> ranks it sent to/got from
        self.unexplained: list[tuple[tuple[int, int], _Candidate]] = []  # flows no slot explains
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.mtu_seen: Counter = Counter()  # payload length of unbound flows' FIRST/MIDDLE packets
        self.data_plane: DataPlane | None = None  # told of every decision (Extractor.set_data_plane)

    def _unrelated(self, flow):
        self.unrelated.add(flow)
        if self.data_plane is not None:
            self.data_plane.unrelated_flow(flow)

    def _acks_unused(self, hop):
        """This hop's ACKs can teach nothing any more: the data plane only counts them."""
        if self.data_plane is not None:
            self.data_plane.unrelated_acks(self.plan.port_address(hop[1]), self.plan.port_address(hop[0]))

    # -- learning -----------------------------------------------------------------
    def hop_of(self, pkt: Packet) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The link (pair of ports) a data packet travels, if the plan expects traffic on it."""
        s, d = self.plan.port_of(pkt.src), self.plan.port_of(pkt.dst)
        if s is None or d is None:
            if (s is None) != (d is None) and (pkt.opcode in IMM_OPCODES or pkt.dma_len is not None):
                # RDMA data between a port of the job and an address the plan lacks
                self.strangers.setdefault(pkt.src if s is None else pkt.dst, set()).add((s or d)[0])
            return None
        if (s, d) not in self.expected:
            if pkt.opcode in IMM_OPCODES or pkt.dma_len is not None:
                self.off_ring.setdefault((s, d), set()).add(pkt.flow)
            return None
        return s, d

    def note_ack(self, pkt: Packet):
        """An ACK from receiver to sender proves the data PSN it acknowledges was sent.

        That is what tells a flow whose first message was lost on every mirror from
        one whose first message we saw: its first data packet then comes after an
        ACK, and no alignment may put the job's first message after that PSN. An ACK
        belongs to the data flow of the same link with the same UDP source port (RoCE
        derives the port from both QPNs, so both directions of a connection share it)."""
        hop = (self.plan.port_of(pkt.dst), self.plan.port_of(pkt.src))
        if hop not in self.expected:
            if self.data_plane is not None:  # for good: the plan has no such hop
                self.data_plane.unrelated_acks(pkt.src, pkt.dst)
            return
        if self.acks_useless(hop):
            return
        if hop not in self.pending and not self._bound_count(hop):
            self.ack_count[hop] += 1
            if self.ack_count[hop] >= ACKS_WITHOUT_DATA:
                # a mirror that sees only this direction (a port's transmit side): the
                # data they acknowledge never shows up, so stop keeping them, for good
                self.acks_ignored.add(hop)
                self.acks.pop(hop, None)
                self._acks_unused(hop)
                return
        self.acks.setdefault(hop, deque(maxlen=RECENT_ACKS)).append((pkt.sport, pkt.psn))
        for cand in self.pending.get(hop, {}).values():
            self._ack_evidence(cand, pkt.sport, pkt.psn)

    @staticmethod
    def _ack_evidence(cand: "_Candidate", sport: int, psn: int):
        rel = psn_diff(psn, cand.first_psn)
        if sport == cand.sport and -ACK_WINDOW <= rel < 0:
            cand.min_rel = min(cand.min_rel, rel)

    def offer(self, hop, pkt: Packet) -> list[tuple[FlowBinding, Packet]]:
        """Hold a packet of a not-yet-bound flow; returns packets released by a binding."""
        if self._hop_full(hop):
            self._unrelated(pkt.flow)  # every QP of this hop is bound: not the job's
            return []
        flows = self.pending.setdefault(hop, {})
        if pkt.opcode in (WRITE_FIRST, WRITE_MIDDLE):  # the path MTU long, every one (wire_mtu)
            self.mtu_seen[len(pkt.payload)] += 1
        cand = flows.get(pkt.flow)
        if cand is None:
            cand = flows[pkt.flow] = _Candidate(first_psn=pkt.psn, sport=pkt.sport)
            for sport, psn in self.acks.get(hop, ()):
                self._ack_evidence(cand, sport, psn)
        rel = psn_diff(pkt.psn, cand.first_psn)
        cand.min_rel = min(cand.min_rel, rel)
        cand.packets.append(pkt)
        if pkt.dma_len is not None:
            cand.heads.append((rel, pkt.dma_len))
        if pkt.imm is not None:
            cand.imms.append((rel, pkt.imm))
        ready = sum(len(c.heads) >= MIN_HEADS for c in flows.values())
        held = sum(len(c.packets) for c in flows.values())
        if ready >= len(self.expected[hop]) - self._bound_count(hop) or held > PENDING_LIMIT:
            return self._bind(hop, final=held > PENDING_LIMIT)
        return []

    def acks_useless(self, hop) -> bool:
        """Whether this hop's ACKs can teach the binder nothing any more."""
        return hop in self.acks_ignored or self._hop_full(hop)

    def _bound_count(self, hop) -> int:
        return sum(1 for b in self.bound.values() if b.link == hop)

    def _hop_full(self, hop) -> bool:
        return self._bound_count(hop) == len(self.expected[hop])

    def flush(self) -> list[tuple[FlowBinding, Packet]]:
        """End of input: bind what can be bound with the evidence there is; refuse by
        name traffic that is no ring allreduce at all."""
        out = []
        for hop in list(self.pending):
            out += self._bind(hop, final=True)
        if not self.bound:
            self._refuse_unbound()
        return out

    # -- what is not a ring allreduce ---------------------------------------------
    def note_mismatch(self, b: FlowBinding, pos: int, pkt: Packet):
        """A message head of a bound flow that its schedule rejected. When the flow's
        rejected heads are just where a reduce-scatter-only job puts its messages,
        the job is not allreducing: refuse it by name (CollectiveRefused)."""
        if pkt.dma_len is None or len(b.mismatched) >= MISMATCHED_HEADS:
            return
        b.mismatched.append((pos, pkt.dma_len))
        # a flow first seen inside the job was placed by its lengths alone: its rejected
        # heads say the capture began later than it was placed (a --join hint,
        # began_inside), not that the job shards
        if len(b.mismatched) >= MIN_HEADS and not self._placed_inside(b):
            rs = self._rs_timeline(b.conn + (b.qp,))
            if all(self._head_ok(rs, p, n) for p, n in b.mismatched):
                self._refuse_reduce_scatter(b.link)

    def _rs_timeline(self, slot) -> FlowTimeline:
        tl = self.timelines[slot]
        return FlowTimeline([reduce_scatter_only(fs) for fs in tl.opening], [reduce_scatter_only(fs) for fs in tl.cycle])

    def _refuse_reduce_scatter(self, hop):
        raise CollectiveRefused(
            f"the traffic of link {self._link_name(hop)} is a ring reduce-scatter with no allgather "
            "(FSDP/ZeRO-style sharding): each reduced shard stays on its owner, so the reduced "
            "gradients never cross the wire; ckptd needs DDP's allreduce (NCCL_ALGO=Ring)")

    def _tree_timelines(self) -> dict[tuple[tuple[int, int], tuple[int, int]], list[FlowTimeline]]:
        """Per link (pair of ports, Plan.qp_link), the message sequences of NCCL Tree's QPs on it, had the job run the
        plan's buckets as Tree (ckptd.core.tree): each timeline starts at iteration 0
        and cycles through the plan's rebuilt layouts (with several QPs, the tree's own
        QP rotation is counted from its first send)."""
        plan = self.plan
        layouts = [s.buckets for s in plan.timeline_schedules()]
        sent: Counter = Counter()
        trees = []
        for buckets in layouts:
            t = TreeSchedule(plan.ring, buckets, plan.node_names, send_base=sent)
            sent.update({conn: t.steps(conn) for conn in t.conns})
            trees.append(t)
        out: dict[tuple[tuple[int, int], tuple[int, int]], list[FlowTimeline]] = {}
        p = plan.timeline_prefix
        for key in trees[0].flows:
            tl = FlowTimeline([t.flows[key] for t in trees[:p]], [t.flows[key] for t in trees[p:]])
            if tl.npkts_any:
                out.setdefault(plan.qp_link(key[:3], key[3]), []).append(tl)
        return out

    def _refuse_unbound(self):
        """Nothing of the plan's ring allreduce was bound: refuse by name when the
        traffic positively is something else. Flows that merely match nothing (a plan
        that does not fit, a capture that starts mid-job) keep their diagnostics.

        Tree traffic on ring links (2 nodes, or tree edges that are ring hops) is told
        by its message sequence: NCCL Tree sends each channel's chunks up and down every
        edge, one message a chunk, which no ring schedule does; a flow whose every head
        and immediate sit where a tree QP of its link has them is Tree."""
        trees = None
        for hop, cand in self.unexplained:
            if len(cand.heads) < MIN_HEADS:
                continue
            if len(cand.heads) >= 2 * MIN_HEADS:
                for slot in self.expected[hop]:
                    base_rel = self._align(self._rs_timeline(slot), cand)
                    if base_rel is not None and not self._explains(self.timelines[slot], cand, base_rel):
                        self._refuse_reduce_scatter(hop)
            trees = self._tree_timelines() if trees is None else trees
            if any(self._align(tl, cand) is not None for tl in trees.get(hop, ())):
                raise CollectiveRefused(
                    f"the traffic of link {self._link_name(hop)} is NCCL's Tree allreduce, not ring: its "
                    "message lengths are the plan's buckets cut into tree chunks, each sent up and down "
                    "the tree, and in Tree the final values never cross the ring's links; run the job "
                    "with NCCL_ALGO=Ring")
        self._refuse_unbound_protocol()
        nic_links = {(s[0], d[0]) for s, d in self.expected}
        crossed = sorted(h for h in self.off_ring if (h[0][0], h[1][0]) in nic_links)
        if crossed:
            names = self.link_names(crossed)
            raise CollectiveRefused(
                f"no flow matches the plan, and the job's data flows between ports of ring neighbours that "
                f"no QP of the plan pairs ({names}): list each merged NIC's ranks[].ports in NCCL's "
                "device order (QP q runs between port q % ndevs of both ends)")
        if self.off_ring:
            names = self.link_names(sorted(self.off_ring))
            raise CollectiveRefused(
                f"no flow matches the plan's ring allreduce, and RDMA writes flow between NICs of the job "
                f"that are ring neighbours in no channel ({names}): that is Tree, CollNet or NVLS traffic, "
                "not ring allreduce; run the job with NCCL_ALGO=Ring")

    def link_names(self, hops: list) -> str:
        """The first four links by name, for a one-line message."""
        return ", ".join(self._link_name(h) for h in hops[:4]) + (" ..." if len(hops) > 4 else "")

    @staticmethod
    def _lines(cand: _Candidate) -> str | None:
        """The one protocol whose lines all of a flow's held packets of 128 bytes or more
        carry (wire_protocol), if there are MIN_HEADS of them and they agree."""
        big = (p.payload for p in cand.packets if len(p.payload) >= LL128_LINE)
        seen = [wire_protocol(payload) for payload in islice(big, LINES_SAMPLE)]
        return seen[0] if len(seen) >= MIN_HEADS and len(set(seen)) == 1 else None

    def _refuse_protocol(self, hop, wire: str):
        plan = self.plan.ring.protocol
        why = "NCCL_PROTO, or NCCL cannot run LL128 on those GPUs" if plan == "ll128" else "NCCL_PROTO"
        raise CollectiveRefused(
            f"the traffic of link {self._link_name(hop)} is NCCL's {PROTOCOL_LOOKS[wire]} while the plan says "
            f"protocol {plan}: the job ran with another protocol ({why}); write the plan with protocol {wire}, "
            f"or run the job with NCCL_PROTO={PROTOCOL_ENV[plan]}")

    def _refuse_unbound_protocol(self):
        """Nothing bound: flag words of another protocol than the plan's in any flow
        refuse it (data never shows them); a plan of LL or LL128 whose every flow
        shows none (unrelated flows are Simple-looking too) is Simple traffic."""
        plan = self.plan.ring.protocol
        verdicts = [(hop, self._lines(cand)) for hop, cand in self.unexplained]
        for hop, wire in verdicts:
            if wire in ("ll", "ll128") and wire != plan:
                self._refuse_protocol(hop, wire)
        if plan != "simple" and verdicts and all(wire == "simple" for _, wire in verdicts):
            self._refuse_protocol(verdicts[0][0], "simple")

    def _bind(self, hop, final: bool) -> list[tuple[FlowBinding, Packet]]:
        """Bind the flows that showed enough heads (all of them when final), in QPN
        order, each to the first free slot whose schedule explains it."""
        flows = self.pending.get(hop, {})
        taken = {b.conn + (b.qp,) for b in self.bound.values() if b.link == hop}
        released = []
        for key in sorted(flows, key=lambda k: k[2]):  # QPN order = channel order
            cand = flows[key]
            if not final and len(cand.heads) < MIN_HEADS:
                continue
            fits = []
            for slot in self.expected[hop]:
                if slot in taken:
                    continue
                tl = self.timelines[slot]
                base_rel = self._align(tl, cand) if self.join_from is None else self._align_at_origin(tl, cand)
                if base_rel is not None:
                    fits.append((slot, tl, base_rel))
            if not final and len(fits) > 1 and any(k[2] < key[2] and len(c.heads) < MIN_HEADS
                                                   for k, c in flows.items()):
                # Its heads so far fit several slots (QPs whose message sequences start
                # alike, as rotated QPs' do): QPN order decides, so wait until the flows
                # of lower QPN that are still short of heads can be placed too.
                continue
            del flows[key]
            wire = self._lines(cand) if fits else None
            if wire is not None and wire != self.plan.ring.protocol:
                # its lengths fit the plan's schedule, its lines are another protocol's
                self._refuse_protocol(hop, wire)
            for slot, tl, base_rel in fits[:1]:
                first_head = min(rel for rel, _ in cand.heads) - base_rel
                if self.join_from is None and first_head > 0:
                    it, _, k, _ = tl.locate(first_head)
                    self.notes.append(f"a flow starts at message {k} of iteration {it} of the schedule: "
                                      "its first messages reached no mirror (lengths and ACKs place it)")
                taken.add(slot)
                base = cand.first_psn + base_rel  # unbounded: first_psn sits in [0, 2**24)
                b = FlowBinding(key, slot[:3], slot[3], tl, base, cand.first_psn,
                                self._first_whole(tl, cand.min_rel - base_rel), hop,
                                first_psn=(cand.first_psn + cand.min_rel) % PSN_MOD)
                if self.data_plane is not None:
                    b = self.data_plane.bind_flow(b)
                self.bound[key] = b
                if self._hop_full(hop):
                    self._acks_unused(hop)
                released += [(b, p) for p in cand.packets]
                break
            else:
                if cand.heads and not self._hop_full(hop):
                    where = "in the plan's schedule" if self.join_from is None else \
                        ("at the positions their PSNs give (joining assumes the QP has carried "
                         "nothing but the plan's iterations since NCCL connected it at PSN 0)")
                    self.errors.append(
                        f"flow {key[0]} -> {key[1]} QP {key[2]:#x}: its message lengths "
                        f"{[h[1] for h in sorted(cand.heads)[:6]]} match no free channel/QP "
                        f"of link {self._link_name(hop)} {where}")
                    self.unexplained.append((hop, cand))
                self._unrelated(key)
        if not flows:
            self.pending.pop(hop, None)
        return released

    def unseen_ports(self) -> list[str]:
        """Merged NICs: the port pairs of which no QP's flow was seen while another port pair
        of the same two NICs was, i.e. ports not mirrored (or every copy lost). What they
        carried is reported missing, never taken from another port."""
        seen = {b.link for b in self.bound.values()}
        nic_pairs_seen = {(s[0], d[0]) for s, d in seen}
        return [f"{self._link_name(hop)}: none of its {len(slots)} QP(s) seen, while other ports of "
                "these NICs were: its switch ports are not mirrored (or every copy was lost)"
                for hop, slots in self.expected.items()
                if hop not in seen and (hop[0][0], hop[1][0]) in nic_pairs_seen]

    def strangers_in_place(self) -> list[str]:
        """Addresses the plan does not list that exchanged RDMA data with the job's ports
        while some rank of the plan was on no flow at all: a rank whose ranks[].addr is
        not the job's. Its links' data was only counted as unrelated, and coverage and
        loss, which count matched flows, did not show it."""
        on_flows = {r for b in self.bound.values() for r in (b.link[0][0], b.link[1][0])}
        # a rank on no flow whose link to a rank that talked with the address is a network
        # hop of the plan: the ranks of unmirrored links are on no flow either, and no suspect
        partners = {r for rs in self.strangers.values() for r in rs}
        unseen = sorted({r for s, d in self.expected for r, other in ((s[0], d[0]), (d[0], s[0]))
                         if other in partners} - on_flows)
        if not (self.strangers and unseen):
            return []
        shown = ", ".join(f"{a} (with rank(s) {', '.join(map(str, sorted(rs)))})"
                          for a, rs in sorted(self.strangers.items())[:4])
        return [f"RDMA data between the job's ports and addresses the plan does not list: {shown}; while "
                f"rank(s) {', '.join(map(str, unseen))} of the plan were on no flow: their ranks[].addr may not "
                "be the job's"]

    def _link_name(self, hop) -> str:
        (s, _), (d, _) = hop
        if self.plan.ring.ndevs > 1:
            return (f"port {self.plan.port_address(hop[0])} (rank {s}'s NIC) -> "
                    f"port {self.plan.port_address(hop[1])} (rank {d}'s NIC)")
        return f"rank {s} -> {d}" if self.plan.one_host_per_rank else \
            f"NIC {self.plan.addresses[s]} (rank {s}) -> NIC {self.plan.addresses[d]} (rank {d})"

    def _align(self, tl: FlowTimeline, cand: _Candidate) -> int | None:
        """Relative PSN of message 0 of iteration 0 for this flow, if the schedule
        explains every message head and immediate the flow showed."""
        if not cand.heads:
            return None
        heads = sorted(cand.heads)
        rel0, len0 = heads[0]
        # the first head seen is a message of iteration 0, or of the first rotation
        # cycle: with several QPs, a QP may carry nothing until a later iteration
        for it, fs in enumerate(tl.layouts):
            origin = tl.iteration_start(it)
            cols = fs.columns()  # (every message of the layout, read as arrays)
            for start in cols["m_start"][cols["m_wire_len"] == len0].tolist():
                base_rel = rel0 - origin - start
                if base_rel > cand.min_rel:
                    continue  # a packet of this flow would lie before the job's first message
                if self._explains(tl, cand, base_rel):
                    return base_rel
        return None

    def _align_at_origin(self, tl: FlowTimeline, cand: _Candidate) -> int | None:
        """Joining: the relative PSN of message 0 of iteration 0 when the QP started at
        PSN 0 (NCCL), taking the first position at or after iteration join_from's start
        for the earliest packet seen; None if the heads or immediates disagree."""
        if not cand.heads:
            return None
        earliest = (cand.first_psn + cand.min_rel) % PSN_MOD
        floor = tl.iteration_start(self.join_from)
        wraps = max(0, -(-(floor - earliest) // PSN_MOD))
        # the job's wire rounds (join_from counts them: allreduces_per_step a training
        # iteration); a join_from past them is refused by the caller (Plan.past_the_job)
        its = None if self.plan.iterations is None else self.plan.iterations * self.plan.allreduces_per_step
        if its is not None and self.join_from < its and earliest + wraps * PSN_MOD >= tl.iteration_start(its):
            # past the job's last iteration: a capture from before join_from (from the job's
            # start, PSN 0) was placed a PSN wrap later, at iteration ~932068 of a 3-iteration job
            return None
        base_rel = cand.min_rel - (earliest + wraps * PSN_MOD)
        return base_rel if self._explains(tl, cand, base_rel) else None

    def _explains(self, tl: FlowTimeline, cand: _Candidate, base_rel: int) -> bool:
        """Whether every message head and immediate the flow showed sits where the
        timeline, started at relative PSN base_rel, has them."""
        return all(self._head_ok(tl, rel - base_rel, n) for rel, n in cand.heads) and \
            all(self._imm_ok(tl, rel - base_rel, imm) for rel, imm in cand.imms)

    @staticmethod
    def _first_whole(tl: FlowTimeline, pos: int) -> int:
        """The first iteration that starts at or after flow position pos."""
        loc = tl.locate(pos)
        if loc is None:
            return 0
        it = loc[0]
        return it if tl.iteration_start(it) == pos else it + 1

    def wire_mtu(self) -> str | None:
        """Where the packets of unbound flows show another path MTU than the plan's
        (every packet of a message but its last carries exactly the MTU): why no flow
        fits the schedule, which the MTU cuts into packets (and PSNs). Else None."""
        if not self.mtu_seen:
            return None
        mtu, n = self.mtu_seen.most_common(1)[0]
        if mtu == self.plan.ring.mtu:
            return None
        return (f"{n} packets of the flows left unmatched carry {mtu} bytes, each the first or a middle one of "
                f"its message, so the path MTU is {mtu}: the plan's ring.mtu is {self.plan.ring.mtu}")

    def began_inside(self) -> bool:
        """Not joining, flows broke the schedule, and every flow was first seen inside the
        job (_placed_inside): the capture began mid-job, and the flows were placed by
        their lengths alone (where --join places them by their PSNs). One stream begun
        late beside one from the start is not it: most packets fit there."""
        return (self.join_from is None and any(b.mismatched for b in self.bound.values())
                and all(self._placed_inside(b) for b in self.bound.values()))

    def _placed_inside(self, b: FlowBinding) -> bool:
        """A flow first seen (its ACKs included) MID_JOB_PSN or more packets after PSN 0,
        where NCCL connects every QP (as joining assumes): it had carried the job's
        traffic before the capture began, so placing it by its lengths from the job's
        start (without --join) says nothing of the job. A plan of another ring places a
        flow seen from its start wrongly too, and is no capture begun mid-job."""
        return b.first_psn >= MID_JOB_PSN

    def unbound_links(self) -> list[str]:
        """The links (one name each) some of whose flows are not bound yet."""
        return [f"rank {a[0]} -> rank {b[0]}" for a, b in self.expected if not self._hop_full((a, b))]

    def join_iteration(self, force: bool = False) -> int | None:
        """Joining: the first iteration every flow was seen from its start, once every
        flow the plan expects is bound (or, with force, over the flows bound so far)."""
        if not self.bound or (not force and any(not self._hop_full(h) for h in self.expected)):
            return None
        return max(b.first_whole for b in self.bound.values())

    @staticmethod
    def _head_ok(tl: FlowTimeline, pos: int, dma_len: int) -> bool:
        msg = tl.head_at(pos)
        return msg is not None and msg.wire_len == dma_len

    def _imm_ok(self, tl: FlowTimeline, pos: int, imm: bytes) -> bool:
        loc = tl.locate(pos)
        if loc is None:
            return False
        msg = loc[1].message(loc[2])
        return loc[3] == msg.npkts - 1 and msg.imm is not None and \
            imm == msg.imm.to_bytes(4, "big" if self.imm_big_endian else "little")

    # -- placing ------------------------------------------------------------------
    def locate(self, b: FlowBinding, psn: int) -> Location | None:
        """Where a bound flow's packet lies; None if before the job's first message."""
        u = psn_unwrap(psn, b.last)
        b.last = max(b.last, u)
        loc = b.timeline.locate(u - b.base)
        if loc is None:
            return None
        it, sched, m, i = loc
        return Location(it, sched.message(m), i, sched, u - b.base)
