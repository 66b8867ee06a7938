"""ERSPAN: the header a switch puts between GRE and a remotely mirrored frame.

draft-foschiano-erspan-03 (the only written spec) defines three types, told apart by
the GRE protocol and flags, not by a field of their own:

    GRE proto 0x88BE, no sequence number  type I: the mirrored Ethernet frame follows
                                          GRE directly (no ERSPAN header at all)
    GRE proto 0x88BE, S bit set           type II: 8-byte header, version field 1
        Ver(4)=1 VLAN(12) | COS(3) En(2) T(1) Session ID(10) | Reserved(12) Index(20)
    GRE proto 0x22EB                      type III: 12-byte header, version field 2
        Ver(4)=2 VLAN(12) | COS(3) BSO(2) T(1) Session ID(10) | Timestamp(32) |
        SGT(16) | P(1) FT(5) Hw ID(6) D(1) Gra(2) O(1)
        [8-byte platform-specific sub-header when O=1: Platf ID(6), 58 bits of info]

Type III's FT says what follows: 0 an Ethernet frame, 2 an IP packet with its
Ethernet header stripped.  T=1 means the switch cut the mirrored frame short (so the
inner lengths announce more than is there).  Plain transparent Ethernet bridging over
GRE (proto 0x6558, Linux gretap and some "GRE mirror" switch modes) carries the frame
like type I and is accepted too, with no ERSPAN type.

Field layouts were checked against scapy.contrib.erspan and wireshark's
packet-erspan.c (read, not copied).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .gre import GRE
from .header import Header, Malformed

GRE_PROTO_ERSPAN = 0x88BE       # types I and II
GRE_PROTO_ERSPAN3 = 0x22EB      # type III
GRE_PROTO_TEB = 0x6558          # transparent Ethernet bridging
FT_ETHERNET, FT_IP = 0, 2       # type III frame types


class Unsupported(ValueError):
    """A well-formed GRE payload that is not a mirrored frame this module decodes."""


class ERSPAN2(Header):
    FIELDS = (
        ("ver", 4),          # 1
        ("vlan", 12),        # VLAN of the mirrored frame
        ("cos", 3),          # its class of service
        ("en", 2),           # its tagging: 0 untagged, 1 ISL, 2 802.1Q kept, 3 VLAN kept
        ("t", 1),            # the mirrored frame was truncated
        ("session_id", 10),  # the mirror session: tells streams apart at one collector
        ("reserved", 12),
        ("index", 20),       # port index / direction, platform-defined
    )
    VERSION = 1


class ERSPAN3(Header):
    FIELDS = (
        ("ver", 4),          # 2
        ("vlan", 12),
        ("cos", 3),
        ("bso", 2),          # bad/short/oversized frame indication
        ("t", 1),
        ("session_id", 10),
        ("timestamp", 32),   # units given by gra
        ("sgt", 16),         # security group tag
        ("p", 1),            # frame is an Ethernet protocol frame
        ("ft", 5),           # what follows: 0 Ethernet, 2 IP
        ("hw_id", 6),        # ERSPAN engine id
        ("d", 1),            # direction at the source port: 0 ingress, 1 egress
        ("gra", 2),          # timestamp granularity: 0 100 us, 1 100 ns, 2 IEEE 1588
        ("o", 1),            # platform-specific sub-header follows
    )
    VERSION = 2


class ERSPAN3Platform(Header):
    FIELDS = (
        ("platf_id", 6),
        ("info", 58),        # meaning depends on platf_id; kept as one number
    )


@dataclass
class Encap:
    """How a mirrored frame was wrapped, and where the frame itself starts.

    erspan_type is 1, 2 or 3, or None for transparent Ethernet over GRE.  The outer_*
    fields are filled by parsers.roce (they describe the packet the switch sent)."""

    gre: GRE
    gre_offset: int
    erspan_type: int | None
    header: ERSPAN2 | ERSPAN3 | None
    platform: ERSPAN3Platform | None
    inner_offset: int
    inner_is_ip: bool = False       # type III FT=2: no inner Ethernet header
    outer_eth: object = None        # parsers.ethernet.Ethernet of the capture link, if any
    outer_vlan: list = field(default_factory=list)
    outer_ip: object = None         # parsers.ipv4.IPv4 | parsers.ipv6.IPv6
    outer_ip_offset: int | None = None
    gre_checksum_ok: bool | None = None   # None: the GRE header has no checksum

    @property
    def session(self) -> int | None:
        return self.header.session_id if self.header is not None else None

    @property
    def truncated(self) -> bool:
        return bool(self.header is not None and self.header.t)

    @property
    def direction(self) -> str | None:
        """'ingress'/'egress' at the mirrored port: only type III says."""
        if isinstance(self.header, ERSPAN3):
            return "egress" if self.header.d else "ingress"
        return None


def decapsulate(buf, gre: GRE, gre_offset: int) -> Encap:
    """The Encap of the GRE packet whose header `gre` starts at gre_offset.

    Raises Unsupported for GRE payloads that are not mirrored frames, Malformed for an
    ERSPAN header that contradicts its type, NeedData when the bytes end inside it."""
    off = gre_offset + gre.hdr_len
    if gre.version != 0:
        raise Unsupported(f"GRE version {gre.version} (enhanced GRE, PPTP) carries no mirror")
    if gre.proto == GRE_PROTO_TEB:
        return Encap(gre, gre_offset, None, None, None, off)
    if gre.proto == GRE_PROTO_ERSPAN:
        if not gre.s:
            return Encap(gre, gre_offset, 1, None, None, off)
        hdr = _versioned(ERSPAN2, buf, off, "II")
        return Encap(gre, gre_offset, 2, hdr, None, off + ERSPAN2.LEN)
    if gre.proto == GRE_PROTO_ERSPAN3:
        hdr = _versioned(ERSPAN3, buf, off, "III")
        off += ERSPAN3.LEN
        platform = None
        if hdr.o:
            platform = ERSPAN3Platform.unpack(buf, off)
            off += ERSPAN3Platform.LEN
        if hdr.ft not in (FT_ETHERNET, FT_IP):
            raise Unsupported(f"ERSPAN type III frame type {hdr.ft} (only 0 Ethernet and 2 IP are defined)")
        return Encap(gre, gre_offset, 3, hdr, platform, off, inner_is_ip=hdr.ft == FT_IP)
    raise Unsupported(f"GRE protocol {gre.proto:#06x} is not ERSPAN")


def _versioned(cls, buf, off: int, name: str):
    hdr = cls.unpack(buf, off)
    if hdr.ver != cls.VERSION:
        raise Malformed(f"ERSPAN type {name} header has version {hdr.ver}, expected {cls.VERSION}")
    return hdr


__all__ = ["ERSPAN2", "ERSPAN3", "ERSPAN3Platform", "Encap", "Unsupported", "decapsulate",
           "GRE_PROTO_ERSPAN", "GRE_PROTO_ERSPAN3", "GRE_PROTO_TEB"]
