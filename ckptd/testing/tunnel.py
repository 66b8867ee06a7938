"""Remote mirroring as a switch does it: a captured frame wrapped in Ethernet / IPv4 or
IPv6 / GRE [/ ERSPAN header], for benchmarks and tests of mirror sessions that reach
ckptd over a routed network (parsers/erspan.py decodes these; scapy's GRE and ERSPAN
layers check that decoder in tests/test_erspan.py)."""
from __future__ import annotations

import struct

_MACS = bytes.fromhex("020000000102" "020000000101")  # collector <- switch
_V6 = (b"\xfd" + b"\0" * 14 + b"\x01", b"\xfd" + b"\0" * 14 + b"\x09")


def gre_tunnel(inner: bytes, proto: int, header: bytes = b"", *, flags: int = 0x1000, seq: int = 0,
               outer_v: int = 4, trailer: bytes = b"") -> bytes:
    """`header` + `inner` in GRE protocol `proto` with `flags` (the words they announce:
    C a checksum and offset of 0, K the key 0x1234, S the sequence number `seq`), from the
    switch 10.200.0.1 (fd00::1) to the collector 10.200.0.9 (fd00::9); `trailer`: Ethernet
    padding past the IP packet."""
    words = b"".join(w for bit, w in ((0x8000, b"\0\0\0\0"), (0x2000, struct.pack(">I", 0x1234)),
                                      (0x1000, struct.pack(">I", seq & 0xFFFFFFFF))) if flags & bit)
    body = struct.pack(">HH", flags, proto) + words + header + inner
    if outer_v == 4:
        ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(body), 0, 0x4000, 64, 47, 0,
                         bytes([10, 200, 0, 1]), bytes([10, 200, 0, 9]))
        return _MACS + b"\x08\x00" + ip + body + trailer
    ip = struct.pack(">IHBB16s16s", 6 << 28, len(body), 47, 64, *_V6)
    return _MACS + b"\x86\xdd" + ip + body + trailer


def erspan2(frame: bytes, session: int, seq: int) -> bytes:
    """`frame` as ERSPAN type II session `session` (0-1023) sends it, GRE sequence `seq`."""
    hdr = struct.pack(">HHI", 1 << 12, session & 0x3FF, seq & 0xFFFFF)   # Ver 1, session, index
    return gre_tunnel(frame, 0x88BE, hdr, flags=0x1000, seq=seq)


def ip_fragments(packet: bytes, at: int = 1000) -> list[bytes]:
    """An IPv4 tunnel packet of gre_tunnel's (Ethernet, a 20-byte IP header) as a router on
    a path of a smaller MTU forwards it: two fragments, the second `at` bytes (a multiple
    of 8) into the IP payload."""
    eth, ip, body = packet[:14], packet[14:34], packet[34:]

    def fragment(part: bytes, offset: int, more: bool) -> bytes:
        hdr = bytearray(ip)
        struct.pack_into(">H", hdr, 2, 20 + len(part))
        struct.pack_into(">H", hdr, 6, (0x2000 if more else 0) | offset // 8)  # MF, offset in 8s
        return eth + bytes(hdr) + part
    return [fragment(body[:at], 0, True), fragment(body[at:], at, False)]


__all__ = ["erspan2", "gre_tunnel", "ip_fragments"]
