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


class SelectionError(CkptdError, ValueError):
    """The request cannot be met; the message says for which channel and why."""


@dataclass(frozen=True)
class Point:
    rank: int
    direction: str   # "rx" | "tx", at the switch port
    switch: str
    port: str

    def link(self, ring: RingConfig, channel: int) -> tuple[int, int]:
        r = ring.rings[channel]
        i = r.index(self.rank)
        if self.direction == "rx":
            return self.rank, r[(i + 1) % len(r)]
        return r[(i - 1) % len(r)], self.rank

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


@dataclass
class Selection:
    ring: RingConfig
    cabling: Cabling
    links_wanted: int
    min_streams: int
    chosen: list[tuple[Point, Collector]]
    sessions: list[Session] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def sessions_on(self, switch: str) -> list[Session]:
        return [s for s in self.sessions if s.switch.name == switch]

    def switches(self) -> list[Switch]:
        used = {s.switch.name for s in self.sessions}
        return [s for s in self.cabling.switches if s.name in used]

    def to_json(self) -> dict:
        """The selection as data: sessions, per-channel links and chunk coverage, and
        the plan `mirrors` entries when every stream is one port (the plan's model)."""
        cov = coverage(self.ring, self.chosen)
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
        if all(len(ps) == 1 for ps in streams.values()):
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


def coverage(ring: RingConfig, chosen) -> list[dict]:
    """Per channel: the distinct mirrored links, and for every chunk the streams
    (collector names, sorted) that see it."""
    out = []
    for ch in range(ring.channels):
        links, chunks = [], {r: set() for r in range(ring.nranks)}
        for p, c in chosen:
            link = p.link(ring, ch)
            if link not in links:
                links.append(link)
            for owner in link_chunks(ring, ch, link[0]):
                chunks[owner].add(c.name)
        out.append({"links": links, "chunks": {k: sorted(v) for k, v in chunks.items()}})
    return out


def _score(ring, chosen, want_links, min_streams) -> int:
    """Goal units met: each channel's distinct links up to the wanted number, and each
    chunk's streams up to min_streams."""
    return sum(min(len(ch["links"]), want_links)
               + sum(min(len(v), min_streams) for v in ch["chunks"].values())
               for ch in coverage(ring, chosen))


def _gain(ring, cov, point, col, want_links, min_streams) -> tuple[int, int]:
    """(goal units, new copies) that adding (point, col) to a selection with coverage
    `cov` brings; incremental, so that large rings stay fast."""
    met = extra = 0
    for ch, c in enumerate(cov):
        link = point.link(ring, ch)
        if link not in c["links"] and len(c["links"]) < want_links:
            met += 1
        for owner in link_chunks(ring, ch, link[0]):
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
    for sw in cabling.switches:
        index = 0
        for col in cabling.collectors:
            pts = [p for p, c in chosen if c.name == col.name and p.switch == sw.name]
            if not pts:
                continue
            by_dir = {"rx": [], "tx": [], "both": []}
            for port in dict.fromkeys(p.port for p in pts):
                dirs = {p.direction for p in pts if p.port == port}
                rank = next(p.rank for p in pts if p.port == port)
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
    return sessions


def _session_name(collector: str, direction: str, part: int) -> str:
    # SONiC's YANG allows [a-zA-Z0-9][-a-zA-Z0-9_]{0,31}: keep names inside that everywhere.
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in collector)
    name = f"ckptd_{safe}_{direction}" + (f"{part + 1}" if part else "")
    return name[:32]


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
    used = sum(1 for _, c in chosen if c.name == col.name)
    if used >= col.capacity:
        return f"collector {col.name} already takes {used} link direction(s) (capacity {col.capacity})"
    if sw.max_sessions is not None:
        n = len([s for s in build_sessions(cabling, chosen + [(point, col)]) if s.switch.name == sw.name])
        if n > sw.max_sessions:
            return f"{sw.name} would need {n} mirror sessions, it allows {sw.max_sessions}"
    return None


# -- the search ----------------------------------------------------------------------
def candidate_points(ring: RingConfig, cabling: Cabling) -> tuple[list[Point], list[str]]:
    """RX points, then TX points, in an order that spreads over switches (round robin)
    and otherwise follows channel 0's ring, so a one-switch job gets consecutive links."""
    skipped = []
    per_switch: dict[str, list[int]] = {}
    for r in ring.rings[0]:
        rp = cabling.rank(r)
        if rp is None:
            skipped.append(f"rank {r} is not in the cabling file: its port cannot be mirrored")
            continue
        per_switch.setdefault(rp.switch, []).append(r)
    order, lists = [], list(per_switch.values())
    for i in range(max((len(x) for x in lists), default=0)):
        order += [x[i] for x in lists if i < len(x)]
    pts = [Point(r, d, cabling.rank(r).switch, cabling.rank(r).port) for d in ("rx", "tx") for r in order]
    return pts, skipped


def select_mirrors(ring: RingConfig, cabling: Cabling, links: int = 3, min_streams: int = 2) -> Selection:
    if links < 1 or min_streams < 1:
        raise SelectionError("links and min_streams must be at least 1")
    n = ring.nranks
    extra_ranks = sorted(r.rank for r in cabling.ranks if r.rank >= n)
    if extra_ranks:
        raise SelectionError(f"the cabling file places ranks {extra_ranks}, but the plan has ranks 0..{n - 1}: "
                             "is it the cabling of another job?")
    want = min(links, n)
    notes = []
    if links > n:
        notes.append(f"a ring of {n} ranks has only {n} directed links: mirroring {n}, not {links}")
    if n == 2 and min_streams > 1:
        notes.append("with 2 ranks every chunk crosses one link only: a second stream has to mirror "
                     "that link again at its other end")
    points, skipped = candidate_points(ring, cabling)
    failures = []
    for policy in ("spread", "pack"):
        chosen, why = _greedy(ring, cabling, points, want, min_streams, policy)
        if why is None:
            sel = Selection(ring, cabling, want, min_streams, chosen, build_sessions(cabling, chosen), notes)
            cov = coverage(ring, chosen)
            extra = max(len(c["links"]) for c in cov) - want
            if extra > 0:
                sel.notes.append(f"{extra} more link(s) than asked in some channel, to reach "
                                 f"{min_streams} streams per chunk")
            return sel
        failures.append((chosen, why))
    chosen, why = failures[0]
    raise SelectionError(_explain(ring, cabling, chosen, want, min_streams, why, skipped))


def _greedy(ring, cabling, points, want, min_streams, policy):
    chosen: list[tuple[Point, Collector]] = []
    goal = _goal(ring, want, min_streams)
    while True:
        if _score(ring, chosen, want, min_streams) >= goal:
            return chosen, None
        cov = coverage(ring, chosen)
        best, best_key, blocked = None, None, []
        for i, p in _window(points, {p for p, _ in chosen}):
            for j, col in enumerate(cabling.collectors):
                reason = _why_not(cabling, chosen, p, col)
                if reason:
                    blocked.append((reason, f"{p.rank} {p.direction}"))
                    continue
                gain = _gain(ring, cov, p, col, want, min_streams)
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


def _explain(ring, cabling, chosen, want, min_streams, blocked, skipped) -> str:
    lines = [f"cannot mirror {want} link(s) per ring with every chunk seen by {min_streams} "
             f"stream(s) (collectors); nothing was written."]
    if chosen:
        lines.append("best found: " + "; ".join(f"{p} -> {c.name}" for p, c in chosen))
    for ch, cov in enumerate(coverage(ring, chosen)):
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
