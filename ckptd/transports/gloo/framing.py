"""Gloo over TCP: message framing and the ring allreduce schedule.

Framing (gloo/transport/tcp/pair.h `struct Op`, pair.cc): one TCP connection per pair
of ranks; the side with the larger address connects (device.cc isInitiator) and first
writes an 8-byte little-endian sequence number (device.cc connectAsInitiator; with
PyTorch's one context per device it is the connecting rank, context.cc). Then each
direction is a stream of whole messages: a 48-byte preamble of six little-endian u64
(nbytes, opcode, slot, offset, length, roffset) followed by nbytes - 48 payload bytes.
nbytes counts the whole message: SEND_BUFFER (0) and SEND_UNBOUND_BUFFER (1) carry
`length` payload bytes (nbytes = 48 + length); NOTIFY_SEND_READY (2) and
NOTIFY_RECV_READY (3) carry none (nbytes = 48) but their `length` is the size of the
send or recv they announce (pair.cc sendNotifySendReady/sendNotifyRecvReady).

Ring allreduce (gloo/allreduce.cc `ring`): slot = (0x04 << 56) | (tag << 24) (types.cc
Slot::build); for T bytes, P ranks, element size e, maxSegmentSize 1 MiB
(allreduce.h kMaxSegmentSize): N = roundUp(max(ceil(T / maxSeg), 2P), P) segments,
k = N / P per rank, segment bytes S = roundUp(ceil(T / N), e). Rank r sends only to
r - 1: reduce-scatter step i (i < N - k) sends segment ((r+1)k + i) mod N, then
allgather step i sends segment (rk + i) mod N (the final reduced value); a segment
that lies past T (length <= 0) is not sent. Every send is one SEND_UNBOUND_BUFFER,
announced by one NOTIFY_SEND_READY, and the sends of one slot on a connection leave in
issue order (pair.cc localPendingSend_ is a FIFO per slot).
"""
from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ckptd.core.schedule import AG, RS, Bucket

HEADER = struct.Struct("<6Q")
HEADER_LEN = HEADER.size  # 48
PREAMBLE_LEN = 8
SEND_BUFFER, SEND_UNBOUND_BUFFER, NOTIFY_SEND_READY, NOTIFY_RECV_READY = 0, 1, 2, 3
OPCODE_NAMES = ("SEND_BUFFER", "SEND_UNBOUND_BUFFER", "NOTIFY_SEND_READY", "NOTIFY_RECV_READY")
ALLREDUCE_PREFIX = 0x04
SLOT_PREFIXES = {0x01: "gather", 0x02: "allgather", 0x03: "reduce", 0x04: "allreduce",
                 0x05: "scatter", 0x06: "broadcast", 0x07: "barrier", 0x08: "alltoall"}
MAX_SEGMENT = 1 << 20
MAX_MESSAGE = 1 << 34  # a preamble announcing more is not one


@dataclass(frozen=True, slots=True)
class Header:
    nbytes: int
    opcode: int
    slot: int
    offset: int
    length: int
    roffset: int

    @classmethod
    def unpack(cls, buf, off: int = 0) -> "Header":
        return cls(*HEADER.unpack_from(buf, off))

    def pack(self) -> bytes:
        return HEADER.pack(self.nbytes, self.opcode, self.slot, self.offset, self.length, self.roffset)

    @property
    def prefix(self) -> int:
        return self.slot >> 56

    @property
    def tag(self) -> int:
        return (self.slot >> 24) & 0xFFFFFFFF

    @property
    def is_data(self) -> bool:
        return self.opcode in (SEND_BUFFER, SEND_UNBOUND_BUFFER)

    @property
    def is_allreduce(self) -> bool:
        return self.prefix == ALLREDUCE_PREFIX and self.slot & 0xFFFFFF == 0

    def well_formed(self) -> bool:
        """What any gloo preamble satisfies (used while the stream is in sync)."""
        if self.opcode == SEND_UNBOUND_BUFFER:
            return self.nbytes == HEADER_LEN + self.length and self.offset == 0 and self.roffset == 0
        if self.opcode == SEND_BUFFER:
            return self.nbytes == HEADER_LEN + self.length
        if self.opcode in (NOTIFY_SEND_READY, NOTIFY_RECV_READY):
            return self.nbytes == HEADER_LEN
        return False


def slot_of(prefix: int, tag: int) -> int:
    return (prefix << 56) | ((tag & 0xFFFFFFFF) << 24)


def message(opcode: int, slot: int, payload: bytes = b"", length: int | None = None) -> bytes:
    """A whole gloo message as gloo writes it (tests and synthetic streams)."""
    if opcode in (SEND_BUFFER, SEND_UNBOUND_BUFFER):
        return Header(HEADER_LEN + len(payload), opcode, slot, 0, len(payload), 0).pack() + payload
    return Header(HEADER_LEN, opcode, slot, 0, len(payload) if length is None else length, 0).pack()


# -- framing -----------------------------------------------------------------------
@dataclass
class GlooMessage:
    offset: int  # stream offset of the preamble
    header: Header
    payload: bytearray  # nbytes - 48 bytes; where `have` says nothing arrived, zeros
    have: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, stream) in payload
    resync: bool = False  # the first message found after the framing was lost

    @property
    def complete(self) -> bool:
        return sum(e - s for s, e, _ in self.have) == len(self.payload)


class GlooFramer:
    """Cuts one direction's reassembled byte stream (tcpstream.Piece objects) into
    GlooMessages. A hole inside a payload is carried as missing bytes of that message
    (the next preamble's place is known); a hole that swallows a preamble loses the
    framing, and it is found again only on a preamble that is provably one: well
    formed, an allreduce slot, a length `plausible` accepts, and (while the stream
    holds that much) followed by another well-formed preamble right where it ends.
    """

    def __init__(self, preamble: bool | None, plausible: Callable[[Header], bool]):
        # preamble: True, the stream starts with the connector's 8-byte sequence number;
        # False, with a message; None, unknown (capture began mid-connection): resync.
        self.plausible = plausible
        self.pos = 0  # stream offset of the next byte this framer expects
        self.synced = preamble is not None
        self.from_start = self.synced  # framed from the connection's first byte
        self.need_preamble = bool(preamble)
        self.sequence: int | None = None  # the connector's sequence number
        self.hbuf = bytearray()  # preamble / header bytes gathered so far
        self.cur: GlooMessage | None = None
        self.scan = bytearray()  # bytes held while looking for a header after a loss
        self.scan_at = 0  # stream offset of scan[0]
        self.counts: Counter = Counter()
        self.lost: list[tuple[int, int]] = []  # stream ranges whose framing is unknown
        self.not_gloo = False
        self.first_header = True

    def feed(self, piece, final: bool = False) -> list[GlooMessage]:
        out: list[GlooMessage] = []
        if self.not_gloo:
            return out
        if piece is None:
            if not self.synced:
                self._resync(out, final=True)
            return out
        if piece.data is None:
            self._hole(piece.offset, piece.end, out)
            return out
        data, off = memoryview(piece.data), piece.offset
        if off != self.pos:  # the reassembler hands out every offset in order
            raise ValueError(f"framer expected offset {self.pos}, got {off}")
        self.pos = off + len(data)
        if not self.synced:
            self.scan += data
            self._resync(out, final)
            return out
        self._consume(data, off, piece.stream, out)
        return out

    def _consume(self, data: memoryview, off: int, stream: int, out: list):
        i = 0
        while i < len(data) and not self.not_gloo:
            if self.need_preamble:
                take = min(PREAMBLE_LEN - len(self.hbuf), len(data) - i)
                self.hbuf += data[i:i + take]
                i += take
                if len(self.hbuf) == PREAMBLE_LEN:
                    self.sequence = struct.unpack("<q", self.hbuf)[0]
                    self.hbuf.clear()
                    self.need_preamble = False
                continue
            if self.cur is None:
                take = min(HEADER_LEN - len(self.hbuf), len(data) - i)
                self.hbuf += data[i:i + take]
                i += take
                if len(self.hbuf) < HEADER_LEN:
                    continue
                h = Header.unpack(self.hbuf)
                start = off + i - HEADER_LEN
                self.hbuf.clear()
                if not h.well_formed() or h.nbytes > MAX_MESSAGE:
                    if self.first_header:  # the connection does not speak gloo
                        self.not_gloo = True
                        return
                    self.counts["bad_header"] += 1
                    self.synced = False
                    self.scan = bytearray(data[i - HEADER_LEN + 1:])
                    self.scan_at = off + i - HEADER_LEN + 1
                    self._resync(out, False)
                    return
                self.first_header = False
                self.cur = GlooMessage(start, h, bytearray(h.nbytes - HEADER_LEN))
                self.counts[OPCODE_NAMES[h.opcode]] += 1
            msg = self.cur
            body_at = msg.offset + HEADER_LEN
            pstart = off + i - body_at
            take = min(len(msg.payload) - pstart, len(data) - i)
            if take:
                msg.payload[pstart:pstart + take] = data[i:i + take]
                if msg.have and msg.have[-1][1] == pstart and msg.have[-1][2] == stream:
                    s, _, st = msg.have[-1]
                    msg.have[-1] = (s, pstart + take, st)
                else:
                    msg.have.append((pstart, pstart + take, stream))
                i += take
            if body_at + len(msg.payload) <= off + i:
                out.append(msg)
                self.cur = None

    def _hole(self, lo: int, hi: int, out: list):
        self.counts["hole_bytes"] += hi - lo
        if lo != self.pos:
            raise ValueError(f"framer expected offset {self.pos}, got a hole at {lo}")
        self.pos = hi
        if self.synced and self.cur is not None and not self.hbuf:
            end = self.cur.offset + HEADER_LEN + len(self.cur.payload)
            if hi <= end:  # inside one payload: the framing survives
                if hi == end:
                    out.append(self.cur)
                    self.cur = None
                return
            out.append(self.cur)  # the rest of this message is gone, and what followed
            self.cur = None
        elif not self.synced and self.scan:
            self._resync(out, final=True)  # nothing beyond the hole can join these bytes
        self.synced = False
        self.hbuf.clear()
        self.need_preamble = False
        self.lost.append((lo, hi))
        self.counts["framing_lost"] += 1
        self.scan = bytearray()
        self.scan_at = hi

    def _resync(self, out: list, final: bool):
        """Look for a provable preamble in the held bytes; resume framing there."""
        buf = self.scan
        p = 0
        while True:
            p = self._find(buf, p)
            if p < 0:
                keep = max(0, len(buf) - HEADER_LEN)  # a header may start in the last bytes
                self.scan_at += keep
                del buf[:keep]
                return
            h = Header.unpack(buf, p)
            nxt = p + h.nbytes
            if nxt + HEADER_LEN <= len(buf):
                ok = Header.unpack(buf, nxt).well_formed()
            else:
                ok = final or len(buf) - p > (1 << 24)  # nothing more will come to check against
                if not ok:
                    self.scan_at += p
                    del buf[:p]
                    return
            if ok:
                self.counts["resync"] += 1
                self.synced = True
                self.first_header = False
                rest = bytes(buf[p:])
                at = self.scan_at + p
                self.scan = bytearray()
                n0 = len(out)
                self._consume(memoryview(rest), at, -2, out)
                for m in out[n0:n0 + 1]:
                    m.resync = True
                self._restream(out[n0:] + ([self.cur] if self.cur is not None else []))
                return
            p += 1

    def _find(self, buf: bytearray, start: int) -> int:
        """Offset of the next candidate preamble at or after start, or -1."""
        p = start
        while True:
            q = buf.find(b"\x00\x00\x00", p + 16)  # the slot's low 24 bits are zero
            if q < 0 or q - 16 + HEADER_LEN > len(buf):
                return -1
            c = q - 16
            if buf[c + 23] == ALLREDUCE_PREFIX:
                h = Header.unpack(buf, c)
                if h.opcode in (SEND_UNBOUND_BUFFER, NOTIFY_SEND_READY, NOTIFY_RECV_READY) \
                        and h.well_formed() and h.is_allreduce and self.plausible(h):
                    return c
            p = c + 1

    @staticmethod
    def _restream(msgs):
        # bytes replayed from the scan buffer were not attributed to a stream
        for m in msgs:
            m.have = [(s, e, 0 if st == -2 else st) for s, e, st in m.have]

    def flush(self) -> list[GlooMessage]:
        out: list[GlooMessage] = []
        if not self.synced and self.scan:
            self._resync(out, final=True)
        if self.cur is not None:
            out.append(self.cur)  # incomplete: the stream ended inside it
            self.cur = None
        return out


# -- the ring schedule ---------------------------------------------------------------
def ring_segments(nbytes: int, nranks: int, itemsize: int, max_segment: int = MAX_SEGMENT
                  ) -> tuple[int, int, int]:
    """(N segments, k per rank, S segment bytes) of gloo's ring for nbytes."""
    max_seg = itemsize * max(1, max_segment // itemsize)
    n = max(-(-nbytes // max_seg), 2 * nranks)
    n = -(-n // nranks) * nranks
    s = -(-(-(-nbytes // n)) // itemsize) * itemsize
    return n, n // nranks, s


@dataclass(frozen=True, slots=True)
class GlooSend:
    """One SEND_UNBOUND_BUFFER of a ring allreduce on connection src -> dst."""

    bucket: int
    phase: int  # RS or AG
    index: int  # position among this slot's data messages on the connection
    segment: int
    start: int  # first element within the bucket
    count: int  # elements
    nbytes: int
    own: bool  # reduce-scatter sends that carry only the sender's own values


class GlooRingSchedule:
    """Which data messages each connection (r -> r - 1) carries for each bucket."""

    def __init__(self, nranks: int, buckets: list[Bucket], max_segment: int = MAX_SEGMENT):
        self.nranks, self.buckets = nranks, list(buckets)
        self.sends: dict[tuple[int, int], list[list[GlooSend]]] = {}
        for r in range(nranks):
            self.sends[(r, (r - 1) % nranks)] = [self._bucket(r, b, bk, max_segment)
                                                 for b, bk in enumerate(self.buckets)]

    def _bucket(self, r: int, b: int, bk: Bucket, max_segment: int) -> list[GlooSend]:
        e, total = bk.dtype.itemsize, bk.nbytes
        if total == 0 or self.nranks < 2:
            return []
        n, k, s = ring_segments(total, self.nranks, e, max_segment)
        out: list[GlooSend] = []
        for phase, first in ((RS, (r + 1) * k), (AG, r * k)):
            for i in range(n - k):
                seg = (first + i) % n
                length = min(s, total - seg * s)
                if length > 0:
                    out.append(GlooSend(b, phase, len(out), seg, seg * s // e, length // e, length,
                                        phase == RS and i < k))
        return out

    def connection_sends(self, src: int, bucket: int) -> list[GlooSend]:
        return self.sends[(src, (src - 1) % self.nranks)][bucket]

    def lengths(self) -> set[int]:
        return {s.nbytes for per in self.sends.values() for sends in per for s in sends}

    def ag_copies(self, b: int):
        """How many allgather copies of each element of bucket b cross the ring (tests)."""
        import numpy as np
        seen = np.zeros(self.buckets[b].count, np.int32)
        for per in self.sends.values():
            for s in per[b]:
                if s.phase == AG:
                    seen[s.start:s.start + s.count] += 1
        return seen


# -- DDP's rebuilt-bucket broadcast ------------------------------------------------------
BROADCAST_PREFIX = 0x06


def decode_rebuilt_buckets(indices: bytes, sizes: bytes, nparams: int) -> list[list[int]] | str:
    """The rebuilt bucket layout rank 0 broadcasts after iteration 0, or why these two
    payloads are not it.

    torch/csrc/distributed/c10d/reducer.cpp Reducer::sync_bucket_indices (called from
    rebuild_buckets in iteration 1's forward) broadcasts two int32 tensors from rank 0,
    one collective (one tag) each: first the flattened parameter indices of every
    bucket followed by the number of buckets (total + 1 ints), then the number of
    parameters in each bucket. Indices count DDP's parameters (the plan's order).
    On the wire (gloo broadcast, slot prefix 0x06) each is one SEND_UNBOUND_BUFFER of
    little-endian ints on the connections from the root to the other ranks.
    """
    if len(indices) != 4 * (nparams + 1) or len(sizes) % 4 or not sizes:
        return f"lengths {len(indices)}, {len(sizes)} do not fit {nparams} parameters"
    idx = list(struct.unpack(f"<{nparams + 1}i", indices))
    nb = idx.pop()
    sz = list(struct.unpack(f"<{len(sizes) // 4}i", sizes))
    if nb != len(sz) or nb < 1:
        return f"{nb} buckets announced, {len(sz)} bucket sizes sent"
    if any(s < 1 for s in sz) or sum(sz) != nparams:
        return f"bucket sizes {sz} do not add up to {nparams} parameters"
    if sorted(idx) != list(range(nparams)):
        return "the indices are not each parameter once"
    out, at = [], 0
    for s in sz:
        out.append(idx[at:at + s])
        at += s
    return out
