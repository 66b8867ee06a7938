"""Which switch ports to mirror, in which direction, to which checkpoint host.

The ring facts (reasoned from ckptd.core.schedule.ring_steps, not assumed): in allgather the
directed link s -> next(s) of a channel carries the final value of every chunk except
the one next(s) finishes reducing.  So one mirrored link misses one chunk, two distinct
links of a ring miss different chunks and together see everything, and M distinct
links see every chunk at least M-1 times.

A switch port sees two directed links per channel: its RX (frames the switch receives,
i.e. what the rank sends) is rank -> next(rank), its TX (what the rank receives) is
prev(rank) -> rank.  Mirroring RX on k different ranks gives k distinct links in EVERY
channel whatever the channels' ring orders, which is why RX points come first.  A
mirror "point" is (rank, rx|tx); a "stream" is one collector (a capture NIC): copies
that reach the same collector drop together when its port is congested, so the goal
counts streams, not copies: every chunk of every channel seen by >= min_streams
streams, with >= `links` distinct mirrored links per ring (capped at the ring's size).

Multi-GPU nodes (a plan with nodes, `network_links`): only hops between nodes reach a
NIC, so only they can be mirrored. A point is then a NIC's switch port, named by the
rank that owns the NIC (Plan.rank_of); per channel its RX carries the network hops
whose frames leave that NIC and its TX those that enter it (none, one, or, where
ranks share a NIC, several). The ring facts above hold for every hop, NVLink or not,
so an element is recoverable exactly when mirrored network hops carry it: two
mirrored network hops of a ring (distinct receivers) still see every chunk, and the
distinct links wanted are capped at the ring's network hops, not its size.

The search is greedy and explains itself: add the (point, collector) pair that raises
coverage most, while the switch can take it (direction supported, a SPAN destination
on the same switch or an ERSPAN collector with an IP, collector capacity, session and
source-port limits); stop when the goal is met, or fail naming each channel's deficit
and why each remaining point could not be added.  Two tie-break policies are tried
(spread over collectors, then pack into sessions already made).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ckptd.core.schedule import AG, RingConfig, ring_steps

from .cabling import Cabling, Collector, Switch
from ckptd.errors import CkptdError

NIC_SENSE = {"rx": "tx", "tx": "rx", "both": "both"}   # switch-port direction -> plan Mirror


# (channel, NIC owner rank, "rx"|"tx") -> the network hops that port direction carries
NetworkLinks = dict


def network_links(plan) -> NetworkLinks:
    """Which ring hops each NIC's switch port carries, per channel and direction: RX
    (frames the switch receives from the NIC) the hops sent through it, TX those
    received on it. Only hops between nodes (Plan.network_connections)."""
    out: dict = {}
    for src, dst, c in sorted(plan.network_connections, key=lambda k: (k[2], plan.ring.rings[k[2]].index(k[0]))):
        snic, dnic = plan.link_of((src, dst, c))
        out.setdefault((c, snic, "rx"), []).append((src, dst))
        out.setdefault((c, dnic, "tx"), []).append((src, dst))
    return {k: tuple(v) for k, v in out.items()}


class SelectionError(CkptdError, ValueError):
    """The request cannot be met; the message says for which channel and why."""


@dataclass(frozen=True)
class Point:
    """A NIC's switch port(s) in one direction: a merged NIC's QPs spread over all of
    its ports (Plan.qp_link), so a point mirrors every one of them."""
    rank: int
    direction: str   # "rx" | "tx", at the switch port
    switch: str
    port: str
    ports: tuple[str, ...] = ()  # every switch port of a merged NIC (port first); (): port alone

    @property
    def switch_ports(self) -> tuple[str, ...]:
        return self.ports or (self.port,)

    def link(self, ring: RingConfig, channel: int) -> tuple[int, int]:
        r = ring.rings[channel]
        i = r.index(self.rank)
        if self.direction == "rx":
            return self.rank, r[(i + 1) % len(r)]
        return r[(i - 1) % len(r)], self.rank

    def links(self, ring: RingConfig, channel: int, network: "NetworkLinks | None") -> tuple[tuple[int, int], ...]:
        """The ring hops (sender, receiver) this port direction carries in a channel:
        the rank's own link on one-GPU hosts, the NIC's network hops otherwise."""
        if network is None:
            return (self.link(ring, channel),)
        return network.get((channel, self.rank, self.direction), ())

    def __str__(self):
        return f"rank {self.rank} {self.direction} ({self.switch} {self.port})"


@dataclass
class Session:
    """One mirror session: source ports of one switch, one direction, one destination."""

    name: str
    switch: Switch
    collector: Collector
    direction: str              # rx | tx | both
    ports: list[str]
    ranks: list[int]
    index: int                  # 1-based on its switch: NX-OS session id, Comware group id
    # ERSPAN sessions: 1-based over the whole selection, so that the sessions reaching one
    # collector from several switches differ (NX-OS erspan-id; the daemon's erspan_session)
    erspan_id: int | None = None


@dataclass
class Selection:
    ring: RingConfig
    cabling: Cabling
    links_wanted: int
    min_streams: int
    chosen: list[tuple[Point, Collector]]
    sessions: list[Session] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    network: NetworkLinks | None = None  # plans with nodes/NICs: the hops each NIC port carries

    def sessions_on(self, switch: str) -> list[Session]:
        return [s for s in self.sessions if s.switch.name == switch]

    def switches(self) -> list[Switch]:
        used = {s.switch.name for s in self.sessions}
        return [s for s in self.cabling.switches if s.name in used]

    def to_json(self) -> dict:
        """The selection as data: sessions, per-channel links and chunk coverage, and
        the plan `mirrors` entries when every stream is one port (the plan's model)."""
        cov = coverage(self.ring, self.chosen, self.network)
        streams = {}
        for p, c in self.chosen:
            streams.setdefault(c.name, []).append(p)
        doc = {
            "links_wanted": self.links_wanted, "min_streams": self.min_streams,
            "sessions": [{"name": s.name, "switch": s.switch.name, "type": s.switch.mode.upper(),
                          "direction": s.direction, "source_ports": s.ports, "ranks": s.ranks,
                          "collector": s.collector.name,
                          "destination": s.collector.ip if s.switch.mode == "erspan" else s.collector.port}
                         for s in self.sessions],
            "channels": [{"channel": ch, "ring": list(self.ring.rings[ch]),
                          "links": [f"{a}>{b}" for a, b in cov[ch]["links"]],
                          "streams_per_chunk": {str(k): v for k, v in sorted(cov[ch]["chunks"].items())}}
                         for ch in range(self.ring.channels)],
            "notes": self.notes,
        }
        if all(len(ps) == 1 and len(ps[0].switch_ports) == 1 for ps in streams.values()):
            doc["plan_mirrors"] = [{"name": name, "rank": ps[0].rank, "direction": NIC_SENSE[ps[0].direction]}
                                   for name, ps in streams.items()]
        return doc


# -- ring coverage -------------------------------------------------------------------
@lru_cache(maxsize=65536)
def link_chunks(ring: RingConfig, channel: int, src: int) -> frozenset[int]:
    """Ranks whose chunk's final value crosses src -> next(src) in allgather.

    A chunk is named by the rank that finishes reducing it.  ring_steps speaks in ring
    indices, which count from rank 0 along the ring (RingConfig.ring_index/rank_at,
    done inline here because this runs for every candidate on large rings)."""
    order, n = ring.rings[channel], ring.nranks
    zero = order.index(0)          # ring indices count from rank 0 (RingConfig.ring_index)
    idx = (order.index(src) - zero) % n
    return frozenset(order[(zero + k) % n] for phase, k in ring_steps(n, idx) if phase == AG)


def coverage(ring: RingConfig, chosen, network: NetworkLinks | None = None) -> list[dict]:
    """Per channel: the distinct mirrored links, and for every chunk the streams
    (collector names, sorted) that see it."""
    out = []
    for ch in range(ring.channels):
        links, chunks = [], {r: set() for r in range(ring.nranks)}
        for p, c in chosen:
            for link in p.links(ring, ch, network):
                if link not in links:
                    links.append(link)
                for owner in link_chunks(ring, ch, link[0]):
                    chunks[owner].add(c.name)
        out.append({"links": links, "chunks": {k: sorted(v) for k, v in chunks.items()}})
    return out


def _score(ring, chosen, want_links, min_streams, network=None) -> int:
    """Goal units met: each channel's distinct links up to the wanted number, and each
    chunk's streams up to min_streams."""
    return sum(min(len(ch["links"]), want_links)
               + sum(min(len(v), min_streams) for v in ch["chunks"].values())
               for ch in coverage(ring, chosen, network))


def _gain(ring, cov, point, col, want_links, min_streams, network=None) -> tuple[int, int]:
    """(goal units, new copies) that adding (point, col) to a selection with coverage
    `cov` brings; incremental, so that large rings stay fast."""
    met = extra = 0
    for ch, c in enumerate(cov):
        new_links = [x for x in dict.fromkeys(point.links(ring, ch, network)) if x not in c["links"]]
        met += min(len(new_links), max(0, want_links - len(c["links"])))
        gained: set[int] = set()
        for link in point.links(ring, ch, network):
            gained |= link_chunks(ring, ch, link[0])
        for owner in gained:
            streams = c["chunks"][owner]
            if col.name not in streams:
                extra += 1
                if len(streams) < min_streams:
                    met += 1
    return met, extra


def _goal(ring, want_links, min_streams) -> int:
    return ring.channels * (want_links + ring.nranks * min_streams)


# -- sessions ------------------------------------------------------------------------
def build_sessions(cabling: Cabling, chosen) -> list[Session]:
    """Group points into sessions: per switch and collector; a port mirrored both ways
    to one collector becomes one BOTH source where the switch can; then one session
    per direction (SONiC has one direction per session), split at max_source_ports."""
    sessions = []
    parts: dict[int, int] = {}  # id(session) -> its part of a split (max_source_ports)
    for sw in cabling.switches:
        index = 0
        for col in cabling.collectors:
            pts = [p for p, c in chosen if c.name == col.name and p.switch == sw.name]
            if not pts:
                continue
            by_dir = {"rx": [], "tx": [], "both": []}
            for port in dict.fromkeys(sp for p in pts for sp in p.switch_ports):
                dirs = {p.direction for p in pts if port in p.switch_ports}
                rank = next(p.rank for p in pts if port in p.switch_ports)
                if dirs == {"rx", "tx"} and sw.supports("both"):
                    by_dir["both"].append((port, rank))
                else:
                    for d in sorted(dirs):
                        by_dir[d].append((port, rank))
            for d in ("rx", "tx", "both"):
                srcs = by_dir[d]
                step = sw.max_source_ports or len(srcs) or 1
                for i in range(0, len(srcs), step):
                    part = srcs[i:i + step]
                    index += 1
                    sessions.append(Session(_session_name(col.name, d, i // step), sw, col, d,
                                            [p for p, _ in part], [r for _, r in part], index))
                    parts[id(sessions[-1])] = i // step
    _distinct_names(sessions, parts)
    for n, s in enumerate((s for s in sessions if s.switch.mode == "erspan"), 1):
        s.erspan_id = n
    return sessions


def _session_name(collector: str, direction: str, part: int, tag: str = "") -> str:
    """ckptd_<collector>[tag]_<direction>[part]. SONiC's YANG allows
    [a-zA-Z0-9][-a-zA-Z0-9_]{0,31}: names stay inside that everywhere, the collector's
    part cut short, never the direction and part (they were cut off the end)."""
    safe = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "-_") else "_" for ch in collector)
    suffix = f"_{direction}" + (f"{part + 1}" if part else "")
    return f"ckptd_{safe[:32 - len('ckptd_') - len(tag) - len(suffix)]}{tag}{suffix}"


def _distinct_names(sessions: list[Session], parts: dict[int, int]):
    """Sessions of one switch that got one name (collectors `ck.a` and `ck_a`, long names
    alike in their first 20 characters) take a tag of their collector's name's hash: a
    switch keeps one session per name (SONiC's MIRROR_SESSION table kept the last, EOS
    merged both into one session), and the configs mirrored fewer links than the
    selection said, exit 0."""
    import hashlib
    from collections import Counter
    seen = Counter((s.switch.name, s.name) for s in sessions)
    for s in sessions:
        if seen[(s.switch.name, s.name)] > 1:
            tag = "-" + hashlib.sha256(s.collector.name.encode()).hexdigest()[:6]
            s.name = _session_name(s.collector.name, s.direction, parts[id(s)], tag)
    clash = next((k for k, n in Counter((s.switch.name, s.name) for s in sessions).items() if n > 1), None)
    if clash:  # (a hash collision: not met in practice, never written)
        raise SelectionError(f"two mirror sessions on {clash[0]} would both be named {clash[1]}: rename a collector")


def _why_not(cabling: Cabling, chosen, point: Point, col: Collector) -> str | None:
    """Why (point, collector) cannot be added now; None when it can."""
    sw = cabling.switch(point.switch)
    if not sw.supports(point.direction):
        return f"{sw.name} cannot mirror {point.direction.upper()} (directions: {', '.join(sw.directions)})"
    if sw.mode == "span" and col.switch != sw.name:
        if not any(c.switch == sw.name for c in cabling.collectors):
            return f"{sw.name} mirrors locally (SPAN) and no collector port is on {sw.name}"
        return f"{sw.name} mirrors locally (SPAN) and collector {col.name} is not on it"
    if sw.mode == "erspan" and col.ip is None:
        return f"{sw.name} sends ERSPAN and collector {col.name} has no ip"
    # a port runs at line rate: a merged NIC's point is as many link directions as ports
    used = sum(len(p.switch_ports) for p, c in chosen if c.name == col.name)
    if used + len(point.switch_ports) > col.capacity:
        if len(point.switch_ports) > 1:
            return (f"collector {col.name} takes {used} port direction(s) and rank {point.rank}'s merged NIC "
                    f"has {len(point.switch_ports)} ports (capacity {col.capacity})")
        return f"collector {col.name} already takes {used} link direction(s) (capacity {col.capacity})"
    if sw.max_sessions is not None:
        n = len([s for s in build_sessions(cabling, chosen + [(point, col)]) if s.switch.name == sw.name])
        if n > sw.max_sessions:
            return f"{sw.name} would need {n} mirror sessions, it allows {sw.max_sessions}"
    return None


# -- the search ----------------------------------------------------------------------
def candidate_points(ring: RingConfig, cabling: Cabling, network: NetworkLinks | None = None
                     ) -> tuple[list[Point], list[str]]:
    """RX points, then TX points, in an order that spreads over switches (round robin)
    and otherwise follows channel 0's ring, so a one-switch job gets consecutive links.
    With multi-GPU nodes, only the ports of NICs that carry network hops."""
    skipped = []
    per_switch: dict[str, list[int]] = {}
    nics = None if network is None else {nic for _, nic, _ in network}
    for r in ring.rings[0]:
        if nics is not None and r not in nics:
            continue  # no NIC of its own carries a hop between nodes
        rp = cabling.rank(r)
        if rp is None:
            skipped.append(f"rank {r} is not in the cabling file: its port cannot be mirrored")
            continue
        per_switch.setdefault(rp.switch, []).append(r)
    order, lists = [], list(per_switch.values())
    for i in range(max((len(x) for x in lists), default=0)):
        order += [x[i] for x in lists if i < len(x)]
    pts = [Point(r, d, cabling.rank(r).switch, cabling.rank(r).port, cabling.rank(r).ports)
           for d in ("rx", "tx") for r in order]
    return pts, skipped


def select_mirrors(ring: RingConfig, cabling: Cabling, links: int = 3, min_streams: int = 2,
                   network: NetworkLinks | None = None) -> Selection:
    """network: network_links(plan) for a plan with multi-GPU nodes (None: every rank
    its own host, every hop on the wire)."""
    if links < 1 or min_streams < 1:
        raise SelectionError("links and min_streams must be at least 1")
    n = ring.nranks
    extra_ranks = sorted(r.rank for r in cabling.ranks if r.rank >= n)
    if extra_ranks:
        raise SelectionError(f"the cabling file places ranks {extra_ranks}, but the plan has ranks 0..{n - 1}: "
                             "is it the cabling of another job?")
    hops = n if network is None else min(
        len({x for (c, _, d), v in network.items() if c == ch and d == "rx" for x in v})
        for ch in range(ring.channels))
    want = min(links, hops)
    notes = []
    if links > hops:
        what = f"a ring of {n} ranks has only {n} directed links" if network is None else \
            f"a ring has only {hops} hops between nodes (the others are NVLink/PCIe inside a node)"
        notes.append(f"{what}: mirroring {hops}, not {links}")
    if hops == 2 and min_streams > 1:
        notes.append("with 2 mirrorable links per ring every chunk crosses one of them only: a second "
                     "stream has to mirror that link again at its other end")
    points, skipped = candidate_points(ring, cabling, network)
    failures = []
    for policy in ("spread", "pack"):
        chosen, why = _greedy(ring, cabling, points, want, min_streams, policy, network)
        if why is None:
            sel = Selection(ring, cabling, want, min_streams, chosen, build_sessions(cabling, chosen), notes,
                            network)
            cov = coverage(ring, chosen, network)
            extra = max(len(c["links"]) for c in cov) - want
            if extra > 0:
                sel.notes.append(f"{extra} more link(s) than asked in some channel, to reach "
                                 f"{min_streams} streams per chunk")
            return sel
        failures.append((chosen, why))
    chosen, why = failures[0]
    raise SelectionError(_explain(ring, cabling, chosen, want, min_streams, why, skipped, network))


def _greedy(ring, cabling, points, want, min_streams, policy, network=None):
    chosen: list[tuple[Point, Collector]] = []
    goal = _goal(ring, want, min_streams)
    while True:
        if _score(ring, chosen, want, min_streams, network) >= goal:
            return chosen, None
        cov = coverage(ring, chosen, network)
        best, best_key, blocked = None, None, []
        for i, p in _window(points, {p for p, _ in chosen}):
            for j, col in enumerate(cabling.collectors):
                reason = _why_not(cabling, chosen, p, col)
                if reason:
                    blocked.append((reason, f"{p.rank} {p.direction}"))
                    continue
                gain = _gain(ring, cov, p, col, want, min_streams, network)
                if gain[0] <= 0:
                    continue
                load = sum(1 for _, c in chosen if c.name == col.name)
                reuse = any(c.name == col.name and q.switch == p.switch for q, c in chosen)
                tie = (load, i, j) if policy == "spread" else (not reuse, i, -load, j)
                key = (-gain[0], -gain[1]) + tie
                if best_key is None or key < best_key:
                    best, best_key = (p, col), key
        if best is None:
            return chosen, blocked
        chosen.append(best)


def _window(points, used, width: int = 4):
    """The first few unused points of each (switch, direction): points of one switch
    and direction are interchangeable for the limits and nearly so for coverage, and
    looking at all of them would make the search quadratic in the ring size."""
    seen: dict[tuple[str, str], int] = {}
    for i, p in enumerate(points):
        if p in used:
            continue
        key = (p.switch, p.direction)
        if seen.get(key, 0) < width:
            seen[key] = seen.get(key, 0) + 1
            yield i, p


def _explain(ring, cabling, chosen, want, min_streams, blocked, skipped, network=None) -> str:
    lines = [f"cannot mirror {want} link(s) per ring with every chunk seen by {min_streams} "
             f"stream(s) (collectors); nothing was written."]
    if chosen:
        lines.append("best found: " + "; ".join(f"{p} -> {c.name}" for p, c in chosen))
    for ch, cov in enumerate(coverage(ring, chosen, network)):
        problems = []
        if len(cov["links"]) < want:
            problems.append(f"{len(cov['links'])} distinct mirrored link(s), {want} wanted")
        short: dict[tuple, list[int]] = {}
        for owner, streams in sorted(cov["chunks"].items()):
            if len(streams) < min_streams:
                short.setdefault(tuple(streams), []).append(owner)
        for streams, owners in short.items():
            who = (f"chunk of rank {owners[0]}" if len(owners) == 1
                   else f"chunks of ranks {', '.join(map(str, owners))}")
            problems.append(f"{who} reach{'es' if len(owners) == 1 else ''} "
                            + (f"only {len(streams)} stream(s) [{', '.join(streams)}]" if streams else "no stream"))
        if problems:
            lines.append(f"channel {ch} (ring {'>'.join(map(str, ring.rings[ch]))}): " + "; ".join(problems))
    lines.append("(a chunk crosses every link of its ring except the one into the rank that reduces it; "
                 "a stream is a collector)")
    caps = ", ".join(f"{c.name} ({c.capacity})" for c in cabling.collectors)
    limits = ", ".join(f"{s.name} {s.mode.upper()} {s.max_sessions or 'unlimited'} session(s)"
                       for s in cabling.switches)
    lines.append(f"cabling offers collectors (capacity in link directions): {caps}; switches: {limits}")
    lines += [f"note: {s}" for s in skipped]
    if blocked:
        lines.append("why no further mirror could be added (mirror points as 'rank direction', "
                     "the first few of each switch and direction):")
        groups: dict[str, list[str]] = {}
        for reason, point in blocked:
            groups.setdefault(reason, [])
            if point not in groups[reason]:
                groups[reason].append(point)
        for reason, pts in groups.items():
            more = f" and {len(pts) - 8} more" if len(pts) > 8 else ""
            lines.append(f"  {reason}: {', '.join(pts[:8])}{more}")
    else:
        lines.append("every remaining mirror point adds nothing (all ranks' ports are already used)")
    return "\n".join(lines)
