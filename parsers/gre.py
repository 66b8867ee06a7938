"""GRE header (RFC 1701, RFC 2784, RFC 2890; version 1 = RFC 2637 enhanced GRE).

    C R K S s Recur(3) Flags(5) Ver(3) | Protocol Type (16)
    [Checksum (16) | Offset (16)]      present when C or R
    [Key (32)]                         present when K
    [Sequence Number (32)]             present when S
    [Acknowledgment Number (32)]       version 1 only, present when the A flag is set
    [Routing: SREs ...]                present when R, ends with a null SRE

Mirroring switches set whichever of C, K and S their platform likes (ERSPAN type II
and III need S; type I must not have it), so the optional words are parsed from the
flags rather than assumed.  RFC 2784 deprecated the routing bit, but an RFC 1701
sender may still set it, so the source route entries are walked and skipped instead of
rejecting the frame: each SRE is address family u16, SRE offset u8, SRE length u8 and
`length` bytes of routing information; a null SRE (family 0, length 0) ends the list.
"""
from __future__ import annotations

from .header import Header, Malformed, NeedData

PROTO_GRE = 47           # IP protocol number / IPv6 next header
_ACK_FLAG = 0x10         # top bit of the 5 flag bits: enhanced GRE (version 1) ack present
_MAX_SRES = 64           # a real source route is a handful of entries; stop a malicious loop


class GRE(Header):
    FIELDS = (
        ("c", 1),            # checksum present
        ("r", 1),            # routing present (RFC 1701; deprecated by RFC 2784)
        ("k", 1),            # key present
        ("s", 1),            # sequence number present
        ("ssr", 1),          # strict source route
        ("recur", 3),        # recursion control
        ("flags", 5),        # version 1: A (ack present) in the top bit
        ("version", 3),      # 0 = GRE, 1 = enhanced GRE (PPTP)
        ("proto", 16),       # EtherType of the payload
    )

    checksum = offset = key = seq = ack = None
    routing: tuple = ()      # ((address family, SRE offset, routing information), ...)
    _len = 4

    @classmethod
    def unpack(cls, buf, offset=0, end: int | None = None):
        """Read the header and every optional field its flags announce.  `end` is
        where the enclosing IP packet ends: a header that runs past it is Malformed,
        one that only runs past the captured bytes is NeedData."""
        end = len(buf) if end is None else end
        if offset + cls.LEN > end:
            raise Malformed(f"GRE header at {offset} runs past the packet end at {end}")
        g = super().unpack(buf, offset)
        if g.version > 1:
            raise Malformed(f"GRE version {g.version} (only 0 and 1 exist)")
        pos = offset + cls.LEN

        def take(nbytes: int) -> bytes:
            nonlocal pos
            if pos + nbytes > end:
                raise Malformed(f"GRE header (flags {g.flag_text}) runs past the packet end at {end}")
            if pos + nbytes > len(buf):
                raise NeedData(f"GRE optional fields end at {pos + nbytes}, buffer has {len(buf)}")
            pos += nbytes
            return bytes(buf[pos - nbytes:pos])

        def word(nbytes: int) -> int:
            return int.from_bytes(take(nbytes), "big")

        if g.c or g.r:
            g.checksum, g.offset = word(2), word(2)
        if g.k:
            g.key = word(4)
        if g.s:
            g.seq = word(4)
        if g.version == 1 and g.flags & _ACK_FLAG:
            g.ack = word(4)
        if g.r:
            sres = []
            for _ in range(_MAX_SRES):
                family, sre_off, sre_len = word(2), word(1), word(1)
                if family == 0 and sre_len == 0:
                    break
                sres.append((family, sre_off, take(sre_len)))
            else:
                raise Malformed(f"GRE routing: no null SRE within {_MAX_SRES} entries")
            g.routing = tuple(sres)
        g._len = pos - offset
        return g

    @property
    def hdr_len(self) -> int:
        return self._len

    @property
    def flag_text(self) -> str:
        """The present bits as letters, e.g. 'KS' (handy in reasons and tests)."""
        return "".join(n for n, b in (("C", self.c), ("R", self.r), ("K", self.k), ("S", self.s)) if b) or "-"

    def checksum_ok(self, buf, offset: int, end: int) -> bool | None:
        """RFC 2784: the ones' complement sum over the GRE header and payload
        (buf[offset:end]) is all ones when the checksum is right.  None when C is clear."""
        if not self.c:
            return None
        # Ones' complement addition of 16-bit words is addition modulo 0xFFFF (2**16 is
        # 1 mod 0xFFFF), so the whole region read as one big integer gives the same
        # residue in one C-speed operation.  A right checksum makes the sum 0xFFFF, i.e.
        # residue 0 from a region that is not all zeros.
        data = bytes(buf[offset:end])
        if len(data) % 2:
            data += b"\0"
        n = int.from_bytes(data, "big")
        return n != 0 and n % 0xFFFF == 0

__all__ = ["GRE", "PROTO_GRE"]
