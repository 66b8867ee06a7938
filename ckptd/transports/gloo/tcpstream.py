"""TCP reassembly, one byte stream per direction (4-tuple), from any number of mirror streams.

Every segment is placed at its stream offset (sequence number minus the initial one,
unwrapped modulo 2^32 around the delivery frontier), so reordering, retransmissions
with new segment boundaries and duplicates (the same segment seen by several mirrors)
all land on the same bytes. Bytes that arrive twice must agree: a disagreement is a
conflict, recorded with its exact range, and the first copy is kept. A copy arriving
after its bytes were delivered is compared too, against the last `RETAIN` bytes handed
out (older ones are counted, `unchecked_copy_bytes`).

Delivery is in order: the bytes contiguous at the frontier are handed out at once as
`Piece(offset, data, stream)`. A hole (bytes no stream has delivered) holds back what
lies beyond it until either another stream fills it or it is given up: when every
mirror stream that carries this direction has delivered bytes `REORDER_WINDOW` beyond
it (none of them will fill it: a mirror reorders little), when more than `hole_window`
bytes wait beyond it, or at `flush`. Giving a hole up early matters: what lies behind
it reaches the assembler before its iteration is finalized. A given-up hole is handed out as
`Piece(offset, None, stream=-1, length)` with its exact range and stays a hole: a copy
of those bytes that arrives later is counted as late, never spliced back in, and no
byte is ever invented.

Without the SYN (a capture that starts mid-connection) offset 0 is the first byte seen;
segments before it are counted (`before_start`) and dropped.

A loss in a direction's last bytes leaves no hole: nothing follows it. The other
direction's acknowledgments show it: `acked` is the furthest byte the receiver
acknowledged, and `tail_seen()` says whether the bytes seen reach exactly that far.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field

from parsers.tcp import ACK, FIN, RST, SYN, TcpSegment

SEQ_MOD = 1 << 32
HOLE_WINDOW = 8 << 20  # bytes waiting beyond a hole before it is given up
REORDER_WINDOW = 256 << 10  # every stream this far past a hole: no stream will fill it
# delivered bytes kept per direction, to compare later mirror copies with: as far as a
# hole waits for another stream (a mirror copy lagging further is counted, unchecked)
RETAIN = HOLE_WINDOW


def seq_diff(a: int, b: int) -> int:
    """a - b in sequence space, as a signed 32-bit distance."""
    d = (a - b) % SEQ_MOD
    return d - SEQ_MOD if d >= 1 << 31 else d


@dataclass(slots=True)
class Piece:
    offset: int  # stream offset of the first byte
    data: bytes | None  # None: a hole of `length` bytes that no stream delivered
    stream: int  # mirror stream that supplied the bytes (-1 for a hole)
    length: int = 0

    def __post_init__(self):
        if self.data is not None:
            self.length = len(self.data)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class Direction:
    """One direction of one TCP connection."""

    key: tuple[str, int, str, int]
    hole_window: int = HOLE_WINDOW
    base: int | None = None  # sequence number of stream offset 0
    syn: bool = False
    initiator: bool | None = None  # True: this side sent the SYN (it connected); False: SYN-ACK
    fin_at: int | None = None  # stream offset of the FIN
    rst: bool = False
    delivered: int = 0  # everything before this offset has been handed out (bytes or hole)
    starts: list[int] = field(default_factory=list)  # pending intervals, sorted, disjoint
    chunks: list[tuple[bytes, int]] = field(default_factory=list)  # (bytes, stream) of each
    pending: int = 0  # bytes held beyond the frontier
    holes: list[tuple[int, int]] = field(default_factory=list)  # given-up [start, end)
    conflicts: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, stream)
    counts: Counter = field(default_factory=Counter)
    by_stream: Counter = field(default_factory=Counter)  # new bytes each stream supplied first
    highest: int = 0  # end of the furthest byte seen
    reach: dict[int, int] = field(default_factory=dict)  # stream -> end of its furthest byte
    ack_seq: int | None = None  # furthest acknowledgment number the other direction sent
    # the pieces delivered last, RETAIN bytes in all, from index recent_head on (older
    # entries wait to be cut off in bulk): their offsets ascending, for bisect
    recent_starts: list = field(default_factory=list)
    recent: list = field(default_factory=list)
    recent_head: int = 0
    recent_bytes: int = 0

    # -- input ---------------------------------------------------------------------
    def add(self, seg: TcpSegment, stream: int) -> list[Piece]:
        """Take one segment; returns the pieces it makes deliverable (in order)."""
        tcp = seg.tcp
        self.counts["segments"] += 1
        if tcp.flags & RST:
            self.rst = True
        if tcp.flags & SYN:
            self.initiator = not tcp.flags & ACK
            self._syn(tcp.seq)
            return self._release()
        if self.base is None:
            if not len(seg.payload):
                return []
            self.base = tcp.seq  # mid-stream start: the first byte seen is offset 0
        off = self.delivered + seq_diff(tcp.seq, (self.base + self.delivered) % SEQ_MOD)
        if tcp.flags & FIN:
            self.fin_at = off + len(seg.payload)
        if seg.truncated:
            self.counts["truncated_segments"] += 1  # the captured prefix still counts
        data = bytes(seg.payload)
        if data:
            self.reach[stream] = max(self.reach.get(stream, 0), off + len(data))
            self._insert(off, data, stream)
        return self._release()

    def _syn(self, seq: int):
        base = (seq + 1) % SEQ_MOD
        if self.syn:
            if base != self.base:
                self.counts["syn_mismatch"] += 1
            return
        self.syn = True
        if self.base is not None and base != self.base:
            if self.delivered == 0 and not self.holes:
                shift = seq_diff(self.base, base)  # data seen before the SYN: rebase it
                self.starts = [s + shift for s in self.starts]
                self.highest += shift
            else:
                self.counts["late_syn"] += 1
                return
        self.base = base

    def _insert(self, off: int, data: bytes, stream: int):
        end = off + len(data)
        # a copy of bytes handed out already: compared wherever they were delivered (a
        # segment that also covers a given-up hole was skipped whole, and its copy of the
        # delivered bytes beside the hole never compared)
        for lo, hi in self._outside_holes(max(off, 0), min(end, self.delivered)):
            self._compare_delivered(lo, data[lo - off:hi - off], stream)
        if end <= self.delivered:
            self.counts["duplicate_bytes" if off >= 0 and not self._in_hole(off, end) else
                        "late_bytes"] += len(data)
            return
        if off < 0 and not self.syn and self.delivered == 0:
            self.counts["before_start"] += 1
        if off < self.delivered:
            if self._in_hole(off, self.delivered):
                self.counts["late_bytes"] += self.delivered - off
            else:
                self.counts["duplicate_bytes"] += self.delivered - off
            data, off = data[self.delivered - off:], self.delivered
        self.highest = max(self.highest, end)
        # walk the pending intervals this one overlaps; keep what is new, compare the rest
        i = max(0, bisect_right(self.starts, off) - 1)
        cur = off
        new: list[tuple[int, bytes]] = []
        while cur < end:
            if i < len(self.starts) and self.starts[i] + len(self.chunks[i][0]) <= cur:
                i += 1
                continue
            nxt = self.starts[i] if i < len(self.starts) else end
            if nxt > cur:  # a gap in what is pending: new bytes
                stop = min(nxt, end)
                new.append((cur, data[cur - off:stop - off]))
                cur = stop
                continue
            s, (old, _) = self.starts[i], self.chunks[i]
            stop = min(s + len(old), end)
            if old[cur - s:stop - s] != data[cur - off:stop - off]:
                self.conflicts.append((cur, stop, stream))
                self.counts["conflict_bytes"] += stop - cur
            else:
                self.counts["duplicate_bytes"] += stop - cur
            cur = stop
            i += 1
        for s, b in new:
            j = bisect_left(self.starts, s)
            self.starts.insert(j, s)
            self.chunks.insert(j, (b, stream))
            self.pending += len(b)
            self.by_stream[stream] += len(b)
        if new and off > self.delivered and self.starts and self.starts[0] > self.delivered:
            self.counts["out_of_order_segments"] += 1

    def _compare_delivered(self, off: int, data: bytes, stream: int):
        """A copy of bytes already handed out: where they are still retained, a
        disagreement is a conflict (recorded; the first copy stays what was delivered)."""
        end = off + len(data)
        head = self.recent_head
        kept = self.recent_starts[head] if head < len(self.recent) else self.delivered
        if off < kept:  # handed out before what is retained: no longer comparable
            self.counts["unchecked_copy_bytes"] += min(end, kept) - off
        i = max(bisect_right(self.recent_starts, off, head) - 1, head)  # the piece holding `off`
        while i < len(self.recent) and self.recent_starts[i] < end:
            s, old = self.recent_starts[i], self.recent[i]
            lo, hi = max(off, s), min(end, s + len(old))
            if lo < hi and old[lo - s:hi - s] != data[lo - off:hi - off]:
                self.conflicts.append((lo, hi, stream))
                self.counts["conflict_bytes"] += hi - lo
            i += 1

    def acknowledged(self, ack: int):
        """The other direction acknowledged every byte before sequence number `ack`."""
        if self.ack_seq is None or seq_diff(ack, self.ack_seq) > 0:
            self.ack_seq = ack

    @property
    def acked(self) -> int | None:
        """Stream offset up to which the receiver acknowledged the bytes (None: unknown)."""
        if self.ack_seq is None or self.base is None:
            return None
        return self.delivered + seq_diff(self.ack_seq, (self.base + self.delivered) % SEQ_MOD)

    def tail_seen(self) -> bool:
        """Whether the last byte seen is the last byte sent, as far as the capture shows:
        the FIN follows it, or the receiver acknowledged exactly the bytes up to it. An
        acknowledgment beyond it means the direction's last bytes were lost; none that
        reaches it leaves the end unknown."""
        if self.fin_at is not None:  # (the FIN's acknowledgment is one past it)
            return self.fin_at == self.highest
        return self.acked == self.highest

    def _in_hole(self, lo: int, hi: int) -> bool:
        return any(s < hi and lo < e for s, e in self.holes[-64:])

    def _outside_holes(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi) less the given-up holes (the recent ones _in_hole looks at), in order."""
        out = []
        for s, e in self.holes[-64:]:  # ascending: each is given up after the one before
            if e <= lo or s >= hi:
                continue
            if s > lo:
                out.append((lo, s))
            lo = max(lo, e)
        if lo < hi:
            out.append((lo, hi))
        return out

    # -- output --------------------------------------------------------------------
    def _release(self, give_up: bool = False) -> list[Piece]:
        out: list[Piece] = []
        while self.starts:
            s = self.starts[0]
            if s > self.delivered:
                if not (give_up or self.pending > self.hole_window
                        or min(self.reach.values()) >= s + REORDER_WINDOW):
                    break
                out.append(Piece(self.delivered, None, -1, s - self.delivered))
                self.holes.append((self.delivered, s))
                self.counts["hole_bytes"] += s - self.delivered
                self.delivered = s
            data, stream = self.chunks[0]
            self.starts.pop(0)
            self.chunks.pop(0)
            self.pending -= len(data)
            # merge runs from the same stream into one piece
            if out and out[-1].data is not None and out[-1].stream == stream and out[-1].end == s:
                out[-1] = Piece(out[-1].offset, out[-1].data + data, stream)
            else:
                out.append(Piece(s, data, stream))
            self.delivered = s + len(data)
            self.recent_starts.append(s)
            self.recent.append(data)
            self.recent_bytes += len(data)
            while self.recent_bytes - len(self.recent[self.recent_head]) >= RETAIN:
                self.recent_bytes -= len(self.recent[self.recent_head])
                self.recent_head += 1
            if self.recent_head > len(self.recent) // 2:  # cut the dropped ones off in bulk
                del self.recent_starts[:self.recent_head], self.recent[:self.recent_head]
                self.recent_head = 0
        return out

    def flush(self) -> list[Piece]:
        """Give up every hole: hand out all that is pending."""
        return self._release(give_up=True)

    def missing(self) -> list[tuple[int, int]]:
        """Holes given up so far plus the gaps still pending, [start, end) each."""
        gaps, cur = [], self.delivered
        for s, (b, _) in zip(self.starts, self.chunks):
            if s > cur:
                gaps.append((cur, s))
            cur = s + len(b)
        return list(self.holes) + gaps


class TcpReassembler:
    """All directions of all connections; `feed` returns (key, piece) in delivery order."""

    def __init__(self, hole_window: int = HOLE_WINDOW):
        self.hole_window = hole_window
        self.dirs: dict[tuple[str, int, str, int], Direction] = {}

    def direction(self, key) -> Direction:
        d = self.dirs.get(key)
        if d is None:
            d = self.dirs[key] = Direction(key, self.hole_window)
        return d

    def feed(self, seg: TcpSegment, stream: int = 0) -> list[tuple[tuple, Piece]]:
        key = seg.key
        if seg.tcp.flags & ACK:
            self.direction((key[2], key[3], key[0], key[1])).acknowledged(seg.tcp.ack)
        return [(key, p) for p in self.direction(key).add(seg, stream)]

    def flush(self) -> list[tuple[tuple, Piece]]:
        return [(k, p) for k, d in self.dirs.items() for p in d.flush()]
