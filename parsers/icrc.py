"""RoCEv2 invariant CRC (IBA annex A17.3.3; linux rxe_icrc.c; scapy.contrib.roce).

The ICRC is a plain CRC-32 (zlib's) over a copy of the packet in which every field a
router may legitimately rewrite in flight is set to all ones, so that the end-to-end
check survives forwarding:

    8 bytes of 0xFF                       (stand-in for the InfiniBand LRH)
    IP header      IPv4: TOS, TTL, header checksum -> 0xFF..
                   IPv6: traffic class, flow label, hop limit -> 0xFF..
    UDP header     checksum -> 0xFFFF
    BTH            byte 4 (FECN, BECN, reserved) -> 0xFF
    rest of the packet up to, not including, the ICRC

The result is stored little-endian in the last 4 bytes of the UDP payload.
Extension headers and IPv4 options, when present, are covered unmasked.
"""
from __future__ import annotations

import struct
import zlib

_LRH_STANDIN = b"\xff" * 8
_LRH_CRC = zlib.crc32(_LRH_STANDIN)   # the prefix is constant: fold it in once


def masked_region(buf, ip_off: int, udp_off: int, icrc_off: int) -> bytearray:
    """The bytes the ICRC covers (without the 8-byte prefix), with the variant fields
    masked.  ip_off/udp_off: where the IP and UDP headers start; icrc_off: where the
    4 ICRC bytes start (UDP start + UDP length - 4)."""
    region = bytearray(buf[ip_off:icrc_off])
    udp = udp_off - ip_off
    version = region[0] >> 4
    if version == 4:
        region[1] = 0xFF                  # TOS (DSCP/ECN)
        region[8] = 0xFF                  # TTL
        region[10:12] = b"\xff\xff"       # header checksum (changes with TTL)
    elif version == 6:
        region[0] |= 0x0F                 # traffic class, high nibble
        region[1:4] = b"\xff\xff\xff"     # traffic class low nibble + flow label
        region[7] = 0xFF                  # hop limit
    else:
        raise ValueError(f"IP version {version} at offset {ip_off}")
    region[udp + 6:udp + 8] = b"\xff\xff"  # UDP checksum
    region[udp + 8 + 4] = 0xFF             # BTH byte 4: FECN, BECN, reserved
    return region


def compute(buf, ip_off: int, udp_off: int, icrc_off: int) -> int:
    """The ICRC the packet should carry."""
    return zlib.crc32(masked_region(buf, ip_off, udp_off, icrc_off), _LRH_CRC)


def stored(buf, icrc_off: int) -> int:
    """The ICRC the packet does carry (little-endian on the wire)."""
    return struct.unpack_from("<I", buf, icrc_off)[0]


def verify(buf, ip_off: int, udp_off: int, icrc_off: int) -> bool:
    return compute(buf, ip_off, udp_off, icrc_off) == stored(buf, icrc_off)


def pack(icrc: int) -> bytes:
    return struct.pack("<I", icrc)
