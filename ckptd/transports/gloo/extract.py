"""Place, for TCP/gloo: from captured frames to ckptd.transports.base.Placement objects.

    frame -> parsers.tcp.decode_tcp_frame -> ckptd.transports.gloo.tcpstream (one byte stream per
    direction, mirror streams merged) -> ckptd.transports.gloo.framing.GlooFramer (messages) -> ranks of
    each connection -> allreduce tag -> (iteration, bucket) -> GlooRingSchedule ->
    Placement of every allgather element that arrived

The same assembler, shadow and checkpoint stages as for NCCL/RoCE take the placements:
ckptd.pipeline.Pipeline uses it in place of the RoCE transport when the plan says
`"transport": "gloo"`; assemble, apply and keep are the same.

Ranks of a connection. With one address per rank (the plan's), a rank is its address.
On one host (all ranks 127.0.0.1) a rank is learned from the connection setup: the
connecting side writes its rank as the 8-byte sequence number (gloo context.cc: the
pair identifier it presents is its own rank), so every connecting endpoint is known,
and the rank that owns a listening port is the one rank that neither connects to it nor
owns another listening port (isInitiator: the larger address connects).

Allreduce tags. Every collective of the process group takes the next tag, DDP's own
broadcasts and allgathers included; the n-th allreduce tag on the wire is the n-th
bucket allreduce (iteration 0 has len(plan.buckets(0)) of them, later ones
len(plan.buckets(1))). A tag's place in that order is fixed once a tag MAP_LAG higher
has been seen (ProcessGroupGloo runs at most a few collectives at once) or at flush.

The rebuilt layout. After iteration 0 DDP rebuilds its buckets and rank 0 broadcasts
the new layout (reducer.cpp sync_bucket_indices; ckptd.transports.gloo.framing.decode_rebuilt_buckets):
two gloo broadcasts of int32s, the flattened parameter indices plus the bucket count,
then the bucket sizes. The first pair of broadcast tags that decodes as a layout of
the plan's parameters is it. Allreduce number len(plan.buckets(0)) (iteration 1's
first bucket) is not numbered until that layout is known (or REBUILD_WAIT tags later,
or at flush; with find_unused_parameters DDP never rebuilds: not waited for). With
`"rebuilt": "learn"` the plan takes the wire's layout
(Plan.learn_rebuilt); with a rebuilt layout in the plan the two are compared, and on a
mismatch (`rebuilt_mismatch`) no data of iteration >= 1 is placed
(`rebuilt_mismatch_dropped`), so nothing after iteration 0 is committed.

A capture gap that hides whole collectives. Every collective shows its tag on some
captured connection, so a tag value never seen between two seen ones was a collective
whose messages were all lost. An allreduce has messages on every ring direction: one
that framed past the tag with no framing loss there (a witness) shows it was not one
(a broadcast, say). So does their count, where only DDP's broadcasts lie between two
rounds and exactly as many tags as those are missing there (`_others_before`: the
count seen at earlier round boundaries, or the rebuilt layout's two broadcasts of a
job without buffers). Otherwise an unseen tag may have been an allreduce, and every later
allreduce's number (so its iteration and bucket) is no longer known. Numbering stops
there (`count_lost`): nothing after it is placed, and the iterations from that round
on are reported unrecoverable with the reason (`why_unplaced`), never stepped one
iteration off.

find_unused_parameters. Every round of bucket allreduces ends with one more allreduce,
DDP's used-parameter map (int32, one element per parameter): Plan.layout_buckets lists it
as the round's last bucket, so it is numbered, checked against gloo's ring and placed
like a bucket (its reduced payload into the iteration's assembly, copies compared).

Module buffers (a plan with buffers.captured). DDP broadcasts rank 0's buffers at the
start of each forward after a synced backward (ckptd.core.buffers): the buffers after
iteration k are the len(buffers.broadcasts) broadcast tags right after iteration k's
last allreduce tag (after iteration 0, after the two rebuilt-layout tags), each a
complete payload of its group's size (`buffers_after`). Anything else there (a lost
or partial payload, a collective of the trainer's own in between) leaves the
iteration's buffers unknown, so its checkpoint is not committed.
"""
from __future__ import annotations

from bisect import bisect_right, insort
from collections import Counter, defaultdict
from dataclasses import dataclass

from parsers.capfile import CapturedFrame
from parsers.tcp import decode_tcp_frame

from ckptd.transports.base import MAX_EXAMPLES, Placement, Transport
from ckptd.transports.gloo.framing import (BROADCAST_PREFIX, NOTIFY_SEND_READY, SLOT_PREFIXES, GlooFramer, GlooMessage,
                   GlooRingSchedule, Header, decode_rebuilt_buckets)
from ckptd.core.plan import BucketLayout, Plan
from ckptd.core.schedule import AG, RS
from ckptd.transports.gloo.tcpstream import HOLE_WINDOW, TcpReassembler

MAP_LAG = 8
REBUILD_WAIT = 64  # tags past iteration 1's first allreduce before giving up on the broadcast


def _where(key) -> str:
    """A TCP direction, for messages: src:port -> dst:port."""
    return f"{key[0]}:{key[1]} -> {key[2]}:{key[3]}"


@dataclass
class _Data:
    key: tuple
    src: int
    dst: int
    index: int  # within its tag on its direction; -1: not known yet (after a framing loss)
    msg: GlooMessage
    epoch: int = 0  # framing losses on its direction before it


def _whole_elements(have: list[tuple[int, int, int]], e: int) -> list[tuple[int, int, int]]:
    """The whole elements of a payload's delivered byte ranges, by the mirror stream that
    delivered them. Adjacent ranges from different streams join: an element whose bytes
    came partly from one stream and partly from another is whole (it counts for the
    stream that delivered its first byte)."""
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(have):
        j = i
        while j + 1 < len(have) and have[j + 1][0] == have[j][1]:
            j += 1  # a run of adjacent ranges
        cur = -(-have[i][0] // e) * e
        end = have[j][1] // e * e
        for _, en, stream in have[i:j + 1]:
            hi = min(end, -(-en // e) * e)  # with the element this range begins
            if hi > cur:
                out.append((cur, hi, stream))
                cur = hi
        i = j + 1
    return out


class RankMap:
    """(address, port) endpoint -> rank, from the plan or from the connection setup."""

    def __init__(self, plan: Plan):
        self.nranks = plan.nranks
        addrs = list(plan.addresses)
        self.by_addr = {a: r for r, a in enumerate(addrs)} if len(set(addrs)) == len(addrs) else {}
        self.endpoint: dict[tuple[str, int], int] = {}
        self.listeners: dict[tuple[str, int], set[int]] = defaultdict(set)

    def rank(self, addr: str, port: int) -> int | None:
        if self.by_addr:
            return self.by_addr.get(addr)
        return self.endpoint.get((addr, port))

    def connected(self, src: tuple[str, int], dst: tuple[str, int], seq: int) -> str | None:
        """The connector at src presented sequence number seq to the listener at dst."""
        if not 0 <= seq < self.nranks:
            return f"sequence number {seq} is not a rank (0..{self.nranks - 1})"
        if self.by_addr:
            mine = self.by_addr.get(src[0])
            if mine is not None and mine != seq:
                return f"{src[0]} is rank {mine} in the plan but presented {seq}"
            return None
        self.endpoint[src] = seq
        self.listeners[dst].add(seq)
        self._deduce()
        return None

    def _deduce(self):
        owners = {ep: self.endpoint[ep] for ep in self.listeners if ep in self.endpoint}
        changed = True
        while changed:
            changed = False
            taken = set(owners.values())
            for ep, clients in self.listeners.items():
                if ep in owners:
                    continue
                cand = set(range(self.nranks)) - clients - taken
                if len(cand) == 1:
                    owners[ep] = self.endpoint[ep] = cand.pop()
                    changed = True


class GlooExtractor(Transport):
    """The Transport for gloo over TCP (see ckptd.transports.base)."""

    name = "gloo"

    def __init__(self, plan: Plan, hole_window: int = HOLE_WINDOW, map_lag: int = MAP_LAG):
        self.plan = plan
        self.nranks = plan.nranks
        # by wire layout: 0 DDP's first (the job's first allreduce round), 1 the rebuilt,
        # 2 the first without the used map (static_graph's round 1; _lay)
        # The job's own allreduces on DDP's group, as the plan lists them (collectives):
        # gloo numbers them with the buckets' by one tag counter. "start" ones come once
        # before round 0; "before"/"after" ones in every round, around its buckets, and a
        # round's schedule holds them there (checked, never placed)
        self.own_before, self.own_after = plan.other_collectives(1)  # (Buckets: gloo plans list allreduces alone)
        self.own_start = len(plan.collectives.get("start", ()))
        self.sched = [self._schedule(plan.layout_buckets(plan.buckets_first, plan.has_map(0))),
                      self._schedule(plan.layout_buckets(plan.buckets_rebuilt)),
                      self._schedule(plan.layout_buckets(plan.buckets_first, plan.has_map(1)))]
        self.per_step = plan.allreduces_per_step
        self.nb = [len(s.buckets) for s in self.sched]  # allreduces a round, the job's own included
        self.lengths = self.sched[0].lengths() | self.sched[1].lengths() | self.sched[2].lengths()
        self.reasm = TcpReassembler(hole_window)
        self.ranks = RankMap(plan)
        self.framers: dict[tuple, GlooFramer] = {}
        self.bounded: Counter = Counter()  # direction -> framing losses whose tags are bounded
        self.uncertain_upto: dict[tuple, int] = {}  # direction -> tags <= this are unplaceable
        self.waiting: dict[tuple, list[GlooMessage]] = defaultdict(list)  # ranks not known yet
        self.rankless: Counter = Counter()  # direction -> its messages never placed: ranks not known
        self.tags: list[int] = []  # allreduce tags seen, sorted
        self.tagset: set[int] = set()
        self.mapped: dict[int, int] = {}  # tag -> allreduce number
        self.next_number = 0
        self.map_pos = 0  # tags[:map_pos] are numbered
        self.data: dict[int, list[_Data]] = defaultdict(list)  # tag -> data awaiting its mapping
        self.counter: Counter = Counter()  # (direction, tag) -> data messages so far
        # (direction, tag) -> data messages after a framing loss that cut the tag: indexed
        # from the tag's end once it is numbered, if no later loss on that direction
        self.tail: dict[tuple, list[_Data]] = defaultdict(list)
        self.dir_top: dict[tuple, int] = {}  # direction -> highest tag framed on it
        self.map_lag = map_lag
        self.counters: Counter = Counter()
        self.examples: list[str] = []
        self.other_slots: Counter = Counter()
        self.done = -1
        self.supplied: dict[tuple[int, int], int] = Counter()  # (stream, iteration) -> AG bytes
        self.expected_ag = [self._expected_ag(sc) for sc in self.sched]
        self.nparams = len(plan.parameters)
        self.bcast: dict[int, bytes] = {}  # broadcast tag -> payload (small complete ones)
        # where their copies lay on the wire, by tag ((direction, first byte, end): mirror
        # copies that disagree are found by range, as the allgather's are), and where two
        # receivers' copies differed (rank 0 sends each the same bytes)
        self.bcast_spans: dict[int, list[tuple]] = defaultdict(list)
        self.bcast_clash: dict[int, str] = {}
        self.rebuilt_payloads: dict[int, bytes] = {}  # the two the layout came from, by tag
        self.rebuilt: str = "pending"  # pending | ok | mismatch | not_seen | never
        self.rebuilt_tag: int | None = None  # the indices broadcast's tag
        self.wire_rebuilt: tuple[BucketLayout, ...] | None = None
        if self.nparams == 0 or self.nranks < 2:
            self.rebuilt = "not_seen"  # a bare collective: no DDP, nothing broadcast
        elif plan.find_unused_parameters:
            self.rebuilt = "never"  # DDP does not rebuild (nor broadcast) its buckets then
        self.number_tag: dict[int, int] = {}  # allreduce number -> its tag
        # tags of every collective seen (any slot, data or notification), pruned below
        # the last numbered allreduce tag; and per framing loss the tags it may have held
        self.seen_tags: set[int] = set()
        self.loss_tags: dict[tuple, list[tuple[int, int]]] = defaultdict(list)  # by direction
        self.dir_last: dict[tuple, int] = {}  # direction -> tag of the last message framed on it
        self.dir_first: dict[tuple, int] = {}  # ring direction -> its first allreduce tag
        # an allreduce that broke the schedule where its framing was sure (a message
        # framed from its direction's start, whole): (allreduce number, tag, the first
        # training iteration its misnumbering reaches, what broke); nothing is placed from
        # that number on, since the count no longer says which iteration an allreduce is
        self.misfit: tuple[int, int, int, str] | None = None
        # where numbering stopped: (first allreduce number not known, the unseen tags,
        # the last tag numbered)
        self.count_lost: tuple[int, list[int], int] | None = None
        # collectives between two rounds of allreduces, by boundary kind (_boundary), as
        # seen whole; None once two boundaries of a kind differed (a job's own collectives)
        self.between: dict[str, int | None] = {}
        # module buffers: the payload size of each of DDP's broadcasts, and the complete
        # payloads of that size seen, by tag (dropped once taken)
        self.buffer_sizes = plan.buffer_broadcast_bytes() if plan.buffers.captured else []
        self.buffer_payloads: dict[int, bytes] = {}
        self.buffer_spans: dict[int, list[tuple]] = defaultdict(list)  # as bcast_spans
        self.buffer_clash: dict[int, str] = {}
        # where each iteration's allgather messages (final values, the used map) lay on
        # the wire, (direction, first byte, end, bucket): the reassembler keeps the first copy of a
        # byte, so mirror copies that disagree there are found by range (copies_conflict)
        self.spans: dict[int, list[tuple]] = defaultdict(list)

    # -- input ---------------------------------------------------------------------
    def feed_frame(self, stream: int, fr: CapturedFrame, classes: Counter) -> list[Placement]:
        seg, why = decode_tcp_frame(fr.data, fr.linktype, fr.origlen)
        if seg is None:
            self.counters["not_tcp"] += 1
            classes["other"] += 1
            return []
        self.counters["tcp_segments"] += 1
        classes["tcp"] += 1
        out: list[Placement] = []
        for key, piece in self.reasm.feed(seg, stream):
            self._messages(key, self._framer(key).feed(piece), out)
        return out

    def flush(self) -> list[Placement]:
        out: list[Placement] = []
        for key, piece in self.reasm.flush():
            self._messages(key, self._framer(key).feed(piece), out)
        for key, fr in list(self.framers.items()):
            self._messages(key, fr.flush(), out)
        for key in list(self.waiting):
            for m in self.waiting.pop(key):
                self._note(key, m, "ranks_unknown")
                self.rankless[key] += 1
        self._map(out, final=True)
        for key in list(self.tail):  # every direction has ended: its tail groups are whole
            self._from_the_end(key, out, final=True)
        # by iteration (stable): a later iteration's placement handed over first finalizes
        # the ones FINALIZE_LAG behind it, and their tail groups placed after it were late
        out.sort(key=lambda p: p.iteration)
        return out

    def idle(self) -> list[Placement]:
        """Quiet capture: every collective that started has shown its tag, so the tags
        seen can be numbered without waiting for MAP_LAG later ones (a killed job sends
        none). Messages still being framed are placed when they complete."""
        out: list[Placement] = []
        self._map(out, quiet=True)  # (the rebuilt layout is still waited for)
        return out

    def _framer(self, key) -> GlooFramer:
        fr = self.framers.get(key)
        if fr is None:
            d = self.reasm.dirs[key]
            pre = None if not d.syn else bool(d.initiator)
            fr = self.framers[key] = GlooFramer(pre, self._plausible)
        return fr

    def _plausible(self, h: Header) -> bool:
        return h.length in self.lengths

    # -- messages ------------------------------------------------------------------
    def _messages(self, key, msgs: list[GlooMessage], out: list[Placement]):
        fr = self.framers[key]
        if fr.sequence is not None and not fr.first_header and not fr.not_gloo \
                and not getattr(fr, "_told", False):
            fr._told = True
            why = self.ranks.connected((key[0], key[1]), (key[2], key[3]), fr.sequence)
            if why:
                self._example("bad_sequence", f"{key}: {why}")
            for k in list(self.waiting):
                if self._ranks(k) is not None:
                    pend = self.waiting.pop(k)
                    self._messages(k, pend, out)
        if not msgs:
            return
        rk = self._ranks(key)
        if rk is None:
            self.waiting[key].extend(msgs)
            return
        if self.waiting.get(key):  # ranks learned some other way: the held messages first
            msgs = self.waiting.pop(key) + msgs
        for m in msgs:
            self._message(key, rk, m, out)
        self._map(out)

    def _ranks(self, key):
        s = self.ranks.rank(key[0], key[1])
        d = self.ranks.rank(key[2], key[3])
        return None if s is None or d is None else (s, d)

    def _bound_losses(self, key, m: GlooMessage):
        """The first message framed after a framing loss on its direction bounds the tags
        of the messages lost in it: none above the highest tag seen anywhere by now, nor
        above this message's tag plus MAP_LAG (collectives overlap by fewer). A data
        message of a tag up to that bound, after the loss, cannot count its index from
        the tag's start. Bounded here, in the direction's own order, not when the framer
        reports the loss: messages held for their ranks (a connection setup not yet
        seen) come through here later, and the tags seen at the report may not yet
        include theirs (a lost header then shifted every later index of its tag by one,
        and a wrong payload was placed)."""
        lost = self.framers[key].lost
        k = self.bounded[key]
        while k < len(lost) and lost[k][0] < m.offset:
            k += 1
        if k > self.bounded[key]:
            self.bounded[key] = k
            top = max(self.tags[-1] if self.tags else -1, m.header.tag + self.map_lag)
            self.uncertain_upto[key] = max(self.uncertain_upto.get(key, -1), top)
            # the lost messages followed the last one framed here, give or take the
            # collectives that overlap it (MAP_LAG)
            self.loss_tags[key].append((self.dir_last.get(key, 0) - self.map_lag, top))

    def _message(self, key, rk, m: GlooMessage, out):
        h = m.header
        self._bound_losses(key, m)
        self.dir_last[key] = h.tag
        self.seen_tags.add(h.tag)
        if self.count_lost is not None and h.tag > self.count_lost[2]:
            self.counters["after_count_lost"] += h.is_allreduce and h.is_data
            return  # nothing after the numbering stopped can be placed: not kept either
        if h.is_allreduce:
            self.dir_first.setdefault(key, h.tag)
        if h.tag > self.dir_top.get(key, -1):
            self.dir_top[key] = h.tag
            for k in [k for k in self.tail if k[0] == key and self._past(key, k[1])]:
                self._from_the_end(k, out)
        if not h.is_allreduce:
            self.other_slots[SLOT_PREFIXES.get(h.prefix, hex(h.prefix))] += 1
            if h.prefix == BROADCAST_PREFIX and h.is_data:
                self._broadcast(key, m)
                self._buffer_broadcast(key, m)
            return
        t = h.tag
        if t not in self.tagset:
            if self.map_pos and t < self.tags[self.map_pos - 1]:
                self._example("late_tag", f"allreduce tag {t} first seen after a higher tag was mapped")
                return
            self.tagset.add(t)
            insort(self.tags, t)
        if not h.is_data:
            self.counters["notify_send_ready" if h.opcode == NOTIFY_SEND_READY else "notify_recv_ready"] += 1
            return
        src, dst = rk
        if dst != (src - 1) % self.nranks:
            self._example("off_ring", f"{key}: allreduce data from rank {src} to rank {dst}; "
                                      f"gloo's ring sends only to rank {(src - 1) % self.nranks}")
            return
        idx = self.counter[(key, t)]
        self.counter[(key, t)] += 1
        if t <= self.uncertain_upto.get(key, -1):
            lost = self.framers[key].lost
            epoch = bisect_right([lo for lo, _ in lost], m.offset)
            self.tail[(key, t)].append(_Data(key, src, dst, -1, m, epoch))
            return
        d = _Data(key, src, dst, idx, m)
        if t in self.mapped:  # numbered already (after a quiet spell): place it now
            self._place_numbered(t, self.mapped[t], [d], out)
        else:
            self.data[t].append(d)

    # -- the rebuilt layout ------------------------------------------------------------
    def _broadcast(self, key, m: GlooMessage):
        """Keep small broadcast payloads; the rebuilt layout is two of them. Once it is
        resolved, later copies of those two are still compared (layout_conflict)."""
        h = m.header
        if h.tag in self.rebuilt_payloads and m.complete:  # (a partial copy's holes read as zeros)
            self._keep_copy(key, m, self.rebuilt_payloads, self.bcast_spans, self.bcast_clash, "broadcast")
        if self.rebuilt != "pending" or h.length > 4 * (self.nparams + 1) or h.length % 4:
            return
        if not m.complete:
            self.counters["broadcast_partial"] += 1
            return
        self._keep_copy(key, m, self.bcast, self.bcast_spans, self.bcast_clash, "broadcast")
        self._resolve_rebuilt()

    def _buffer_broadcast(self, key, m: GlooMessage):
        """Keep complete payloads of a buffer broadcast's size, by tag."""
        h = m.header
        if h.length not in self.buffer_sizes:
            return
        if not m.complete:
            self.counters["buffer_broadcast_partial"] += 1
            return
        self._keep_copy(key, m, self.buffer_payloads, self.buffer_spans, self.buffer_clash, "buffer broadcast")

    def _keep_copy(self, key, m: GlooMessage, payloads: dict, spans: dict, clash: dict, what: str):
        """The first complete copy of a broadcast's payload is kept, by tag; where another
        receiver's copy differs, the tag is a clash: which is rank 0's is not known."""
        tag = m.header.tag
        if key in {s[0] for s in spans[tag]}:
            return  # the direction's own message again (a resent frame is the reassembler's)
        spans[tag].append((key, m.offset, m.offset + 48 + len(m.payload)))
        have = payloads.setdefault(tag, bytes(m.payload))
        if have != m.payload and tag not in clash:  # every receiver gets the root's bytes
            clash[tag] = f"{_where(key)}: {what} tag {tag} differs from another receiver's copy"
            self._example("broadcast_conflict", clash[tag])

    def _broadcast_clash(self, tags, spans: dict, clash: dict) -> str | None:
        """Where copies of the broadcasts of `tags` disagreed: two receivers', or mirror
        copies of one message (compared by the reassembler, which delivered the first)."""
        for t in tags:
            if t in clash:
                return clash[t]
            for key, lo, hi in spans.get(t, ()):
                for s, e, stream in self.reasm.dirs[key].conflicts:
                    if s < hi and lo < e:
                        return f"stream {stream}: {_where(key)} bytes [{s}, {e}) (broadcast tag {t})"
        return None

    def layout_conflict(self, iteration: int) -> str | None:
        """Where copies of the broadcast the plan's rebuilt layout was learned from
        disagreed, for an iteration placed in that layout; else None. The layout came
        from the first copy: which is rank 0's is not known."""
        if self.rebuilt_tag is None or not self.plan.rebuilt_learn or \
                self.plan.last_wire_iteration(iteration) < self.plan.rebuild_round:
            return None
        return self._broadcast_clash((self.rebuilt_tag, self.rebuilt_tag + 1), self.bcast_spans, self.bcast_clash)

    def _buffer_tags(self, iteration: int) -> range | None:
        """The tags of DDP's buffer broadcasts at the forward after training iteration
        `iteration`, once its last allreduce is numbered."""
        w = self.plan.last_wire_iteration(iteration)
        t = self.number_tag.get(self._round_start(w + 1) - 1)
        if t is None:
            return None
        start = t + 1
        if w == self.plan.rebuild_round - 1 and self.rebuilt_tag == start:
            start += 2  # the rebuilt layout's two broadcasts come first (Reducer::rebuild_buckets)
        return range(start, start + len(self.buffer_sizes))

    def buffers_after(self, iteration: int) -> list[bytes] | None:
        """The payloads of DDP's buffer broadcasts that carry rank 0's buffers after
        `iteration`, or None while (or if) they are not all seen whole."""
        tags = self._buffer_tags(iteration)
        if tags is None or any(t not in self.buffer_payloads for t in tags) or self.buffers_conflict(iteration):
            return None
        got = [self.buffer_payloads[t] for t in tags]
        return got if [len(p) for p in got] == self.buffer_sizes else None

    def take_buffers(self, iteration: int) -> list[bytes] | None:
        """buffers_after, and forget the payloads up to those (a long job keeps none)."""
        got = self.buffers_after(iteration)
        tags = self._buffer_tags(iteration)
        if tags is not None:
            for kept in (self.buffer_payloads, self.buffer_spans, self.buffer_clash):
                for t in [t for t in kept if t < tags.stop]:
                    del kept[t]
        if got is None:
            self.counters["buffers_not_seen"] += 1
        return got

    def buffers_conflict(self, iteration: int) -> str | None:
        """Where copies of DDP's broadcasts of the buffers after `iteration` disagreed
        (never resolved by which came first), or None."""
        tags = self._buffer_tags(iteration)
        return None if tags is None else self._broadcast_clash(tags, self.buffer_spans, self.buffer_clash)

    def copies_conflict(self, iteration: int) -> tuple[int, int, str] | None:
        """Where mirror copies of the bytes of `iteration`'s allgather messages disagreed
        (the reassembler compares every copy of a byte and places the first one
        delivered, so which is right is not known; the pipeline never commits it): (the
        bucket, the stream whose copy differed, where), else None. Forgets the iteration's
        spans."""
        for key, lo, hi, b in self.spans.pop(iteration, ()):
            for s, e, stream in self.reasm.dirs[key].conflicts:
                if s < hi and lo < e:
                    return b, stream, f"{_where(key)} bytes [{s}, {e})"
        return None

    def _resolve_rebuilt(self):
        for t in sorted(self.bcast):
            if self.bcast.get(t + 1) is None or len(self.bcast[t]) != 4 * (self.nparams + 1):
                continue
            got = decode_rebuilt_buckets(self.bcast[t], self.bcast[t + 1], self.nparams)
            if isinstance(got, str):
                continue
            names = [p.name for p in self.plan.parameters]
            self.wire_rebuilt = tuple(BucketLayout(params=tuple(names[i] for i in b)) for b in got)
            self.rebuilt_tag = t
            self.rebuilt_payloads = {t: self.bcast[t], t + 1: self.bcast[t + 1]}
            self.bcast.clear()
            for u in [u for u in self.bcast_spans if u not in self.rebuilt_payloads]:
                del self.bcast_spans[u]
            if self.plan.rebuilt_learn:
                self.plan.learn_rebuilt(self.wire_rebuilt)
                self._set_rebuilt_schedule()
                self.counters["rebuilt_learned"] += 1
                self.rebuilt = "ok"
            elif tuple(self.plan.buckets_rebuilt) == self.wire_rebuilt:
                self.counters["rebuilt_checked"] += 1
                self.rebuilt = "ok"
            else:
                self.rebuilt = "mismatch"
                self._example("rebuilt_mismatch", "DDP's rebuilt buckets (broadcast tags "
                              f"{t}, {t + 1}) are {[list(b.params) for b in self.wire_rebuilt]}; "
                              f"the plan says {[list(b.params) for b in self.plan.buckets_rebuilt]}: "
                              "no iteration after 0 is placed")
            return

    def _set_rebuilt_schedule(self):
        self.sched[1] = sc = self._schedule(self.plan.layout_buckets(self.plan.buckets_rebuilt))
        self.nb[1] = len(sc.buckets)
        self.lengths |= sc.lengths()
        self.expected_ag[1] = self._expected_ag(sc)

    def _schedule(self, buckets: list) -> GlooRingSchedule:
        """A round's allreduces: the job's own before the gradient buckets, the buckets,
        its own after them."""
        return GlooRingSchedule(self.nranks, [*self.own_before, *buckets, *self.own_after])

    def _expected_ag(self, sc: GlooRingSchedule) -> int:
        """The allgather bytes of a round's gradient buckets (not the job's own)."""
        real = slice(len(self.own_before), len(sc.buckets) - len(self.own_after))
        return sum(s.nbytes for per in sc.sends.values() for sends in per[real] for s in sends if s.phase == AG)

    def _map(self, out: list[Placement], final: bool = False, quiet: bool = False):
        """Number the allreduce tags that can no longer be preceded by an unseen one
        (final: the capture ended; quiet: it has been idle, more may come)."""
        top = self.tags[-1] if self.tags else -1
        while self.map_pos < len(self.tags) and self.count_lost is None:
            t = self.tags[self.map_pos]
            if not (final or quiet) and t + self.map_lag > top:
                break
            if self._unseen_lost(t, final):
                break
            if self.next_number == self._round_start(self.plan.rebuild_round) and self.rebuilt == "pending":
                if not final and t + REBUILD_WAIT > top:
                    break  # iteration 1's layout is not known yet
                self.rebuilt = "not_seen"
                self.counters["rebuilt_not_seen"] += 1
                if self.plan.rebuilt_learn:
                    self._example("rebuilt_unknown", "DDP's rebuilt-bucket broadcast was not "
                                  "decoded and the plan says learn: no iteration after 0 is placed")
            self.map_pos += 1
            self.mapped[t] = n = self.next_number
            self.number_tag[n] = t
            self.next_number += 1
            self._place_numbered(t, n, self.data.pop(t, []), out)

    def _unseen_lost(self, t: int, final: bool) -> bool:
        """Whether t must wait to be numbered: a tag between the last numbered allreduce
        tag and t was never seen where a framing loss may have held it, and no ring
        direction witnesses that it was no allreduce (_witness). Waiting while one
        still may; else numbering stops for good (count_lost) and the data held for
        later tags is dropped."""
        # before the first allreduce (number 0): from the first tag the capture saw. The
        # collectives before that are DDP's start-up ones (_start_seen: no allreduce)
        prev = self.tags[self.map_pos - 1] if self.map_pos else min(self.seen_tags, default=t)
        if self.map_pos and not self.map_pos % 1024:  # a long job keeps what is still needed
            self.seen_tags = {u for u in self.seen_tags if u > prev}
            for k, spans in self.loss_tags.items():
                self.loss_tags[k] = [(lo, hi) for lo, hi in spans if hi > prev]
        unseen = [u for u in range(prev + 1, t) if u not in self.seen_tags
                  and any(lo <= u <= hi for spans in self.loss_tags.values() for lo, hi in spans)]
        kind = self._boundary(self.next_number)
        if not unseen:
            if kind:  # a boundary seen whole: how many collectives lie between rounds
                seen = t - prev - 1
                self.between[kind] = seen if self.between.get(kind, seen) == seen else None
            return False
        if kind and t - prev - 1 == self._others_before(kind):
            self.counters["unseen_tags_not_allreduce"] += len(unseen)  # DDP's own, by count
            return False
        verdicts = [self._witness(u, final) for u in unseen]
        if all(v == "no" for v in verdicts):
            self.counters["unseen_tags_not_allreduce"] += len(unseen)
            return False
        if "wait" in verdicts:
            return True
        self.count_lost = (self.next_number, [u for u, v in zip(unseen, verdicts) if v != "no"], prev)
        self.counters["after_count_lost"] += sum(len(self.data.pop(u, [])) for u in self.tags[self.map_pos:])
        self.counters["after_count_lost"] += sum(len(v) for k, v in self.tail.items() if k[1] >= t)
        for k in [k for k in self.tail if k[1] >= t]:
            del self.tail[k]
        return True

    def _boundary(self, n: int) -> str | None:
        """The kind of round boundary right before allreduce number n: "rebuild" (DDP's
        rebuilt layout is broadcast there), "plain", or None (within a round, or n is 0)."""
        rr = self.plan.rebuild_round
        start = self._round_start(rr)
        if n <= self.own_start or (n not in [self._round_start(w) for w in range(1, rr)] and
                                   (n < start or (n - start) % self.nb[1])):
            return None
        rebuilds = self.nparams and self.nranks > 1 and not self.plan.find_unused_parameters
        return "rebuild" if rebuilds and n == start else "plain"

    def _others_before(self, kind: str) -> int | None:
        """How many collectives DDP runs between two rounds at a boundary of this kind,
        where known: as seen at earlier boundaries; for the rebuild of a model without
        buffers, the layout's two broadcasts (Reducer::rebuild_buckets)."""
        if kind in self.between:
            return self.between[kind]
        return 2 if kind == "rebuild" and not self.plan.buffers.tensors else None

    def _witness(self, u: int, final: bool) -> str:
        """Whether unseen tag u was an allreduce: "no" where a ring direction framed from
        before u to past it (MAP_LAG past: collectives overlap) with no framing loss that
        may have held u; "wait" where one still may (not at the end, and not REBUILD_WAIT
        tags on); else "lost"."""
        top = self.tags[-1] if self.tags else -1
        lag = 0 if final else self.map_lag
        could = False
        for key, first in self.dir_first.items():
            if first >= u or any(lo <= u <= hi for lo, hi in self.loss_tags.get(key, ())):
                continue
            if self.dir_top.get(key, -1) > u + lag:
                return "no"
            could = True
        return "wait" if could and not final and top <= u + REBUILD_WAIT else "lost"

    def why_unplaced(self, iteration: int) -> str | None:
        """Why nothing (more) of training iteration `iteration` was placed, where the
        numbering stopped at or before it, or the layout it would be placed in is not known;
        else None."""
        if self.plan.last_wire_iteration(iteration) >= self.plan.rebuild_round:
            if self.rebuilt == "mismatch":  # (it said "no packet of it was captured")
                return ("DDP's rebuilt buckets, broadcast after iteration 0, are not the plan's (see the rejects): "
                        "nothing after iteration 0 is placed;")
            if self.rebuilt == "not_seen" and self.plan.rebuilt_learn:
                return ("DDP's rebuilt-bucket broadcast was not seen whole and the plan says learn: the layout "
                        "of the iterations after 0 is not known;")
        first = self.unplaced_from()
        if first is None or iteration < first:
            return None
        if self.misfit is not None and first == self.misfit[2]:
            n, tag, _, what = self.misfit
            return (f"gloo allreduce tag {tag} (number {n}) does not fit the plan's schedule ({what}): the job's "
                    "allreduces are not the ones the plan lists (a collective of its own it does not list, or one "
                    "listed it does not run), so no later allreduce can be told its iteration and bucket;")
        unseen = self.count_lost[1]
        tags = f"{unseen[0]}" if len(unseen) == 1 else f"{unseen[0]}..{unseen[-1]}"
        return (f"a capture gap hid whole collectives (gloo tag(s) {tags}, never seen where bytes were lost): "
                "whether they were allreduces is not known, so no later allreduce can be told its "
                "iteration and bucket;")

    def unplaced_from(self) -> int | None:
        """The first training iteration the numbering did not reach the end of, where
        it stopped (count_lost); else None."""
        lost = None if self.count_lost is None else self._round_of(self.count_lost[0])[0] // self.per_step
        return min((x for x in (lost, self.misfit and self.misfit[2]) if x is not None), default=None)

    def _position(self, n: int, count: int) -> tuple[int | None, int, int, int | None] | None:
        """(training iteration or None, wire layout, index in the round's schedule,
        bucket or None) of allreduce number n: wire iteration w (the w-th round of bucket
        allreduces), which is training iteration w // K's last micro-batch when
        w % K == K - 1 (K = allreduces_per_step). The earlier micro-batches' allreduces
        are checked against the schedule but not placed: DDP hands each micro-batch
        param.grad (the previous reduced value plus this backward's), so the last round
        carries exactly the gradient the step uses. Bucket None: one of the job's own
        allreduces (checked, not placed). None: nothing of it is placed (count messages
        dropped; the job's own at the start, which no schedule holds, too)."""
        if n < self.own_start:
            self.counters["own_allreduce_messages"] += count
            return None
        w, i = self._round_of(n)
        rr = self.plan.rebuild_round
        if w >= rr and (self.rebuilt == "mismatch"
                        or (self.rebuilt == "not_seen" and self.plan.rebuilt_learn)):
            self.counters["rebuilt_mismatch_dropped" if self.rebuilt == "mismatch"
                          else "rebuilt_unknown_dropped"] += count
            return None
        lay, first = self._lay(w), len(self.own_before)
        it = w // self.per_step if w % self.per_step == self.per_step - 1 else None
        if not first <= i < self.nb[lay] - len(self.own_after):
            return it, lay, i, None
        # (static_graph: the used map first on the wire, last in the assembly)
        b = self.plan.wire_order(0)[i - first] if w == 0 else i - first
        return it, lay, first + b, b

    def _misfit(self, n: int, tag: int, lay: int, k: int, what: str):
        """Allreduce number n broke the schedule, its message framed from its direction's
        start: the count is off from n on (the plan lists another job's collectives). The
        first training iteration that reaches: n's round's, or the next one's where n
        follows the round's buckets (one of the job's own after them)."""
        w = self._round_of(n)[0] + (k >= self.nb[lay] - len(self.own_after))
        first = w // self.per_step
        if self.misfit is None or n < self.misfit[0]:
            self.misfit = (n, tag, first, what)

    def _round_of(self, n: int) -> tuple[int, int]:
        """(wire round, index within it) of allreduce number n (past the job's own start
        ones)."""
        rr = self.plan.rebuild_round
        start = self._round_start(rr)
        if n >= start:
            return rr + (n - start) // self.nb[1], (n - start) % self.nb[1]
        w = 0
        while w + 1 < rr and n >= self._round_start(w + 1):
            w += 1
        return w, n - self._round_start(w)

    def _lay(self, w: int) -> int:
        """The schedule (self.sched) of wire round w."""
        return 0 if w == 0 else 2 if w < self.plan.rebuild_round else 1

    def _round_start(self, w: int) -> int:
        """The number of wire round w's first allreduce."""
        rr = self.plan.rebuild_round
        if w < rr:
            return self.own_start + sum(self.nb[self._lay(v)] for v in range(w))
        return self.own_start + sum(self.nb[self._lay(v)] for v in range(rr)) + (w - rr) * self.nb[1]

    def _place_numbered(self, t: int, n: int, data: list[_Data], out: list[Placement]):
        """Place the data messages of allreduce number n (tag t), and the groups held
        after a framing loss whose direction has gone past the tag."""
        pos = self._position(n, len(data))
        if pos is not None:
            for d in data:
                self._place(*pos, d, out, n=n)
        for key in [k for k in self.tail if k[1] == t]:
            self._from_the_end(key, out)

    def _past(self, key, t: int) -> bool:
        """Direction key has framed a message of a tag more than MAP_LAG above t: no more
        messages of tag t follow on it (the bound the numbering of tags assumes)."""
        return self.dir_top.get(key, -1) > t + self.map_lag

    def _from_the_end(self, key: tuple, out: list[Placement], final: bool = False):
        """Data messages of one tag on one direction that followed a framing loss there:
        their index counts back from the tag's last message (the schedule gives how many
        there are) when no framing was lost on that direction after them: then every
        later message of the tag was framed. Earlier groups (between two losses) stay
        unplaced. Only once the tag is numbered and its direction has gone past it (or
        the capture ended): a later message of the tag still to come, or in a hole not
        yet given up, shifts every index counted from the end. (A quiet capture numbers
        its tags before they end: tests/test_gloo_live.py with 2% loss placed a group at
        the wrong index in about 1 run of 10, and its last iteration, copies in conflict,
        was never committed.) At the end of the capture, a tag its direction has not gone
        past is placed only if the direction's last bytes were seen (`tail_seen`): a loss
        there is no framing loss, since nothing is framed after it, and a group one
        message short has every index off by one (2 of 84 real captures with 12 segments
        lost placed payloads one message off)."""
        (dkey, t) = key
        past = self._past(dkey, t)
        if t not in self.mapped or not (final or past):
            return
        if not past and not self.reasm.dirs[dkey].tail_seen():
            self.counters["after_framing_loss"] += len(self.tail.pop(key))
            self.counters["tail_unseen"] += 1
            return
        held = self.tail.pop(key)
        pos = self._position(self.mapped[t], len(held))
        if pos is None:
            return
        it, lay, k, b = pos
        last = held[-1].epoch
        if last < len(self.framers[dkey].lost):
            self.counters["after_framing_loss"] += len(held)
            return
        group = [d for d in held if d.epoch == last]
        self.counters["after_framing_loss"] += len(held) - len(group)
        n = len(self.sched[lay].connection_sends(group[0].src, k))
        for j, d in enumerate(group):
            d.index = n - len(group) + j
        self.counters["indexed_from_end"] += len(group)
        for d in group:
            self._place(it, lay, k, b, d, out)

    def _place(self, it: int | None, lay: int, k: int, b: int | None, d: _Data, out: list[Placement],
               n: int | None = None):
        """Check one data message against allreduce k of wire layout `lay`'s schedule and
        place its allgather elements into bucket b of training iteration `it` (it None:
        an earlier micro-batch of a step, b None: one of the job's own allreduces; checked
        and counted only)."""
        sched = self.sched[lay]
        sends = sched.connection_sends(d.src, k)
        h = d.msg.header
        what = f"bucket {b}" if b is not None else f"the job's own allreduce (plan collectives, {k})"
        if self.misfit is not None and (n is None or n >= self.misfit[0]):
            self.counters["after_misfit"] += 1
            return
        if d.index >= len(sends):
            self._example("schedule_mismatch", f"{d.key} iteration {it} {what}: data message "
                          f"{d.index} of tag {h.tag}, the schedule has {len(sends)}")
            return
        send = sends[d.index]
        if h.length != send.nbytes:
            self._example("schedule_mismatch", f"{d.key} iteration {it} {what} message {d.index}: "
                          f"{h.length} bytes, the schedule says {send.nbytes}")
            if n is not None and d.epoch == 0 and not d.msg.resync and self.framers[d.key].from_start:
                self._misfit(n, h.tag, lay, k, f"{h.length} bytes where it says {send.nbytes}")
            return
        if b is None:
            self.counters["own_allreduce_messages"] += 1
            return
        self.counters["rs_messages" if send.phase == RS else "ag_messages"] += 1
        if not d.msg.complete:
            self.counters["partial_messages"] += 1
        if send.phase != AG:
            return
        if it is None:
            self.counters["earlier_micro_batch_messages"] += 1
            return
        self.spans[it].append((d.key, d.msg.offset, d.msg.offset + 48 + len(d.msg.payload), b))
        e = sched.buckets[k].dtype.itemsize
        for lo, hi, stream in _whole_elements(d.msg.have, e):
            self.supplied[(stream, it)] += hi - lo
            out.append(Placement(stream, it, AG, b, send.start + lo // e,
                                 bytes(d.msg.payload[lo:hi]), d.src, d.index))

    def _note(self, key, m: GlooMessage, reason: str):
        self.counters[reason] += 1

    def _example(self, reason: str, detail: str):
        self.counters[reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(detail)

    # -- reports -------------------------------------------------------------------
    def stream_loss(self, stream: int, iteration: int) -> float | None:
        """Share of the iteration's allgather bytes this stream was not the first to
        deliver (1.0 - supplied / expected); None if it supplied none."""
        got = self.supplied.pop((stream, iteration), 0)
        if not got:
            return None
        return 1.0 - got / self.expected_ag[self._lay(self.plan.last_wire_iteration(iteration))]

    def diagnostics(self) -> list[str]:
        out = []
        if self.misfit is not None:
            out.append(f"allreduces numbered up to number {self.misfit[0]} (tag {self.misfit[1]}), which broke the "
                       f"schedule: {self.counters['after_misfit']} later allreduce message(s) not placed")
        if self.count_lost is not None:
            n, unseen, prev = self.count_lost
            out.append(f"allreduces numbered up to tag {prev}, then tag(s) {unseen[0]}"
                       + (f"..{unseen[-1]}" if len(unseen) > 1 else "") + " were never seen where bytes were "
                       f"lost: {self.counters['after_count_lost']} later allreduce message(s) not placed (gloo "
                       "numbers each allreduce by its place in the group's count, which the gap hid)")
        out += [f"unmatched connection: {e}" for e in self.unmatched_flows()]
        if self.rebuilt == "mismatch":
            out.append("rebuilt buckets: the order DDP broadcast differs from the plan's")
        for (sa, sp, da, dp), holes in self.holes().items():
            out.append(f"connection {sa}:{sp} -> {da}:{dp}: {len(holes)} byte range(s) no stream delivered")
        for (sa, sp, da, dp), d in self.reasm.dirs.items():
            if d.counts["truncated_segments"]:  # else only a loss shows, with no cause
                out.append(f"connection {sa}:{sp} -> {da}:{dp}: {d.counts['truncated_segments']} segment(s) cut short "
                           "by the capture's snapshot length: their bytes past it were never captured (capture "
                           "whole frames: tcpdump -s 0)")
            if d.counts["unchecked_copy_bytes"]:  # the first copy stands unverified by it
                out.append(f"connection {sa}:{sp} -> {da}:{dp}: {d.counts['unchecked_copy_bytes']} bytes of a mirror "
                           "copy came too late to be compared with the copy delivered")
        return out

    def suspects(self) -> list[str]:
        """Transport.suspects: gloo names the job's own collectives in cmd_replay instead."""
        return []

    def unmatched_flows(self) -> list[str]:
        """The directions whose gloo messages were never placed because the ranks at their
        ends are not known: no connection setup seen (its SYN and the connector's rank),
        and the plan's rank addresses do not tell them apart (none is bound by guesswork)."""
        return [f"{_where(key)}: {n} gloo message(s) not placed: the ranks at its ends are not known (its "
                "connection setup was not captured, and no one rank of the plan has each address)"
                for key, n in sorted(self.rankless.items())]

    def join_iteration(self, force: bool = False) -> int | None:
        return None  # refused at construction (transport_for): TCP gives no positions to join by

    def forget_before(self, iteration: int) -> None:
        return None

    def holes(self) -> dict[tuple, list[tuple[int, int]]]:
        return {k: d.missing() for k, d in self.reasm.dirs.items() if d.missing()}
