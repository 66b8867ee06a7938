"""IPv6 header (RFC 8200) and the extension headers a UDP packet may sit behind.

Hop-by-hop (0), routing (43) and destination options (60) share one layout (next
header u8, length u8 in 8-byte units not counting the first 8) and are skipped.
The fragment header (44) is fixed at 8 bytes; it is skipped too but recorded,
because a fragment is not a whole RoCE packet.
"""
from __future__ import annotations

import ipaddress

from .header import Header, Malformed, NeedData

EXT_HOP_BY_HOP = 0
EXT_ROUTING = 43
EXT_FRAGMENT = 44
EXT_DEST_OPTS = 60
_SKIPPABLE = frozenset({EXT_HOP_BY_HOP, EXT_ROUTING, EXT_DEST_OPTS})


class IPv6(Header):
    FIELDS = (
        ("version", 4),
        ("tc", 8),           # traffic class; masked out of the RoCE ICRC
        ("flow", 20),        # flow label; masked out of the RoCE ICRC
        ("plen", 16),        # payload length, extension headers included
        ("nxt", 8),          # next header right after this fixed header
        ("hlim", 8),         # hop limit; masked out of the RoCE ICRC
        ("src", 128),
        ("dst", 128),
    )

    def __init__(self, **values):
        values.setdefault("version", 6)
        values.setdefault("hlim", 64)
        super().__init__(**values)
        self.ext_headers = []       # [(type, offset from IPv6 start, length)]
        self.proto = self.nxt       # upper-layer protocol after the extension headers
        self.fragment = None        # (offset in bytes, more-fragments flag) if fragmented

    @classmethod
    def unpack(cls, buf, offset=0):
        ip = super().unpack(buf, offset)
        if ip.version != 6:
            raise Malformed(f"IPv6 version field is {ip.version}")
        ip.ext_headers, ip.fragment = [], None
        nxt, pos = ip.nxt, offset + cls.LEN
        while nxt in _SKIPPABLE or nxt == EXT_FRAGMENT:
            if pos + 8 > len(buf):
                raise NeedData(f"IPv6 extension header {nxt} at offset {pos} is cut off")
            if nxt == EXT_FRAGMENT:
                size = 8
                word = int.from_bytes(buf[pos + 2:pos + 4], "big")
                ip.fragment = (word & 0xFFF8, word & 1)
            else:
                size = (buf[pos + 1] + 1) * 8
            ip.ext_headers.append((nxt, pos - offset, size))
            nxt = buf[pos]
            pos += size
        if pos - offset - cls.LEN > ip.plen:
            raise Malformed(f"IPv6 extension headers ({pos - offset - cls.LEN} B) exceed "
                            f"payload length {ip.plen}")
        ip.proto = nxt
        return ip

    @property
    def hdr_len(self) -> int:
        return self.LEN + sum(size for _, _, size in self.ext_headers)

    @property
    def total_len(self) -> int:
        """Bytes from the start of this header to the end of the packet (a jumbogram,
        payload length 0, is not supported and reads as header only)."""
        return self.LEN + self.plen

    @property
    def payload_len(self) -> int:
        return self.total_len - self.hdr_len

    @property
    def is_fragment(self) -> bool:
        # An "atomic fragment" (offset 0, M=0) is a whole packet, so it does not count.
        return self.fragment is not None and self.fragment != (0, 0)

    @property
    def src_addr(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.src)

    @property
    def dst_addr(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.dst)
