"""TCP header (RFC 9293) and decode_tcp_frame: a whole captured frame -> TcpSegment.

The link and network layers (Ethernet/VLAN, raw IP, Linux SLL/SLL2, IPv4/IPv6, one level
of GRE/ERSPAN mirror tunnel) are decoded by parsers.roce.decode_frame, which leaves a TCP
frame classified OTHER with its IP header filled in; this module reads the TCP header
and payload from there. The checksum is never checked: frames captured on veth or lo
carry partial checksums (the kernel leaves the rest to a NIC that never sees them).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .frame import LINKTYPE_ETHERNET
from .header import Header, Malformed, NeedData
from .ipv4 import PROTO_TCP

FIN, SYN, RST, PSH, ACK, URG, ECE, CWR = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80


class TCP(Header):
    FIELDS = (
        ("sport", 16),
        ("dport", 16),
        ("seq", 32),
        ("ack", 32),
        ("data_offset", 4),  # header length in 32-bit words, >= 5
        ("reserved", 3),
        ("ae", 1),           # accurate ECN (was NS)
        ("flags", 8),        # CWR ECE URG ACK PSH RST SYN FIN
        ("window", 16),
        ("checksum", 16),    # often partial in captures: never checked
        ("urgent", 16),
    )

    def __init__(self, options: bytes = b"", **values):
        values.setdefault("data_offset", 5 + (len(options) + 3) // 4)
        super().__init__(**values)
        self.options = options

    @classmethod
    def unpack(cls, buf, offset=0, end: int | None = None):
        tcp = super().unpack(buf, offset)
        if tcp.data_offset < 5:
            raise Malformed(f"TCP data offset {tcp.data_offset} < 5")
        hend = offset + tcp.hdr_len
        if end is not None and hend > end:
            raise Malformed(f"TCP header ({tcp.hdr_len} B) overruns its IP packet ({end - offset} B)")
        if hend > len(buf):
            raise NeedData(f"TCP options end at {hend}, buffer has {len(buf)}")
        tcp.options = bytes(buf[offset + cls.LEN:hend])
        return tcp

    @property
    def hdr_len(self) -> int:
        return self.data_offset * 4

    def pack(self) -> bytes:
        return super().pack() + self.options.ljust(self.hdr_len - self.LEN, b"\0")

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)

    def flag_names(self) -> str:
        names = ("FIN", "SYN", "RST", "PSH", "ACK", "URG", "ECE", "CWR")
        return "|".join(n for i, n in enumerate(names) if self.flags >> i & 1) or "-"


def tcp_options(raw: bytes) -> dict[int, bytes]:
    """kind -> value of each option (NOP and END skipped); stops at a malformed option."""
    out, i = {}, 0
    while i < len(raw):
        kind = raw[i]
        if kind == 0:
            break
        if kind == 1:
            i += 1
            continue
        if i + 1 >= len(raw) or raw[i + 1] < 2 or i + raw[i + 1] > len(raw):
            break
        out[kind] = bytes(raw[i + 2:i + raw[i + 1]])
        i += raw[i + 1]
    return out


@dataclass(slots=True)
class TcpSegment:
    src: ipaddress.IPv4Address | ipaddress.IPv6Address
    dst: ipaddress.IPv4Address | ipaddress.IPv6Address
    tcp: TCP
    payload: memoryview  # exactly the bytes the IP length says, as far as captured
    truncated: bool = False  # the capture cut the payload short (payload is a prefix)

    @property
    def key(self) -> tuple[str, int, str, int]:
        """(src, sport, dst, dport): one direction of one connection."""
        return (str(self.src), self.tcp.sport, str(self.dst), self.tcp.dport)

    @property
    def seq(self) -> int:
        return self.tcp.seq

    @property
    def flags(self) -> int:
        return self.tcp.flags


def decode_tcp_frame(data, linktype: int = LINKTYPE_ETHERNET, origlen: int | None = None
                     ) -> tuple[TcpSegment | None, str]:
    """(segment, "") for a TCP frame; (None, why not) otherwise. Never raises."""
    from .roce import decode_frame  # the shared link/network decode (and tunnels)

    f = decode_frame(data, linktype, origlen)
    if f.ip is None:
        return None, f.reason or "no IP header"
    if f.ip.proto != PROTO_TCP:
        return None, f"IP protocol {f.ip.proto}"
    if f.ip.is_fragment:
        return None, "IP fragment"
    buf = f.data if f.encap is None else data
    off = f.ip_offset + f.ip.hdr_len
    ip_end = f.ip_offset + f.ip.total_len
    try:
        tcp = TCP.unpack(buf, off, end=ip_end)
    except (NeedData, Malformed) as e:
        return None, f"TCP: {e}"
    start = off + tcp.hdr_len
    end = min(ip_end, len(buf))
    payload = memoryview(buf)[start:max(start, end)]
    return TcpSegment(f.src, f.dst, tcp, payload, truncated=end < ip_end), ""


__all__ = ["TCP", "TcpSegment", "decode_tcp_frame", "tcp_options",
           "FIN", "SYN", "RST", "PSH", "ACK", "URG", "ECE", "CWR"]
