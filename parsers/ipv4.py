"""IPv4 header (RFC 791), options kept as raw bytes."""
from __future__ import annotations

import ipaddress

from .header import Header, Malformed, NeedData

PROTO_TCP = 6
PROTO_UDP = 17


class IPv4(Header):
    FIELDS = (
        ("version", 4),
        ("ihl", 4),          # header length in 32-bit words, >= 5
        ("tos", 8),          # DSCP and ECN; masked out of the RoCE ICRC
        ("total_len", 16),   # header + payload, bytes
        ("id", 16),
        ("rf", 1),
        ("df", 1),
        ("mf", 1),
        ("frag_off", 13),    # in 8-byte units
        ("ttl", 8),          # masked out of the RoCE ICRC
        ("proto", 8),
        ("checksum", 16),    # masked out of the RoCE ICRC
        ("src", 32),
        ("dst", 32),
    )

    def __init__(self, options: bytes = b"", **values):
        values.setdefault("version", 4)
        values.setdefault("ihl", 5 + (len(options) + 3) // 4)
        values.setdefault("ttl", 64)
        super().__init__(**values)
        self.options = options

    @classmethod
    def unpack(cls, buf, offset=0):
        ip = super().unpack(buf, offset)
        if ip.version != 4:
            raise Malformed(f"IPv4 version field is {ip.version}")
        if ip.ihl < 5:
            raise Malformed(f"IPv4 IHL {ip.ihl} < 5")
        if ip.total_len < ip.hdr_len:
            raise Malformed(f"IPv4 total length {ip.total_len} < header length {ip.hdr_len}")
        end = offset + ip.hdr_len
        if end > len(buf):
            raise NeedData(f"IPv4 options end at {end}, buffer has {len(buf)}")
        ip.options = bytes(buf[offset + cls.LEN:end])
        return ip

    @property
    def hdr_len(self) -> int:
        return self.ihl * 4

    @property
    def payload_len(self) -> int:
        return self.total_len - self.hdr_len

    @property
    def is_fragment(self) -> bool:
        """True for every piece of a fragmented datagram (RoCE sets DF and never fragments)."""
        return bool(self.mf or self.frag_off)

    @property
    def src_addr(self) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Address(self.src)

    @property
    def dst_addr(self) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Address(self.dst)

    def pack(self) -> bytes:
        return super().pack() + self.options.ljust(self.hdr_len - self.LEN, b"\0")

    def header_checksum(self) -> int:
        """RFC 1071 checksum of this header with its checksum field taken as zero."""
        saved, self.checksum = self.checksum, 0
        raw = self.pack()
        self.checksum = saved
        total = sum(int.from_bytes(raw[i:i + 2], "big") for i in range(0, len(raw), 2))
        while total >> 16:
            total = (total & 0xFFFF) + (total >> 16)
        return ~total & 0xFFFF
