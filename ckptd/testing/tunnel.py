"""Remote mirroring as a switch does it: a captured frame wrapped in Ethernet / IPv4 /
GRE (S) / ERSPAN type II, for benchmarks and tests of mirror sessions that reach ckptd
over a routed network (parsers/erspan.py decodes this; scapy's ERSPAN_II checks it in
tests/test_erspan.py)."""
from __future__ import annotations

import struct

_ETH = bytes.fromhex("020000000102" "020000000101" "0800")  # collector <- switch, IPv4


def erspan2(frame: bytes, session: int, seq: int) -> bytes:
    """`frame` as ERSPAN type II session `session` (0-1023) sends it, GRE sequence `seq`,
    from 10.200.0.1 to the collector 10.200.0.9."""
    gre = struct.pack(">HHI", 0x1000, 0x88BE, seq & 0xFFFFFFFF)
    hdr = struct.pack(">HHI", 1 << 12, session & 0x3FF, seq & 0xFFFFF)   # Ver 1, session, index
    body = gre + hdr + frame
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(body), 0, 0x4000, 64, 47, 0,
                     bytes([10, 200, 0, 1]), bytes([10, 200, 0, 9]))
    return _ETH + ip + body


__all__ = ["erspan2"]
