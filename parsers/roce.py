"""decode_frame: one captured frame -> RoceFrame, the full RoCEv2 decode.

    link layer (Ethernet [+ tags] | raw IP | Linux SLL/SLL2)
    -> IPv4 | IPv6 [+ extension headers] -> UDP dst 4791 -> BTH
    -> extension headers the opcode calls for -> payload -> pad -> ICRC

A remotely mirrored frame arrives wrapped: IPv4 | IPv6 -> GRE -> [ERSPAN type II or
III header] -> the mirrored Ethernet frame (or, ERSPAN III FT=2, its IP packet).  Such
a frame decodes as the INNER frame: eth, vlan, ip, src, dst, udp and every *_offset
describe the mirrored RoCE packet (offsets still count from the start of `data`, so
`payload` and the ICRC check work unchanged), `encap` keeps the tunnel (GRE, ERSPAN
header, outer Ethernet and IP), and `erspan_type` / `erspan_session` say which type
and mirror session it came from.  Only one level is unwrapped; the inner frame ends
where the outer IP packet does.

decode_frame never raises: every frame gets a FrameClass, and `reason` says why it got
it when that is not obvious.  Classes, checked in this order (first match wins):

    MALFORMED       the headers are there but impossible: wrong IP version for the link
                    type, UDP length beyond the IP packet or too small for BTH + ICRC,
                    extension headers + pad longer than the packet, payload bytes on
                    an opcode that carries none, or data that is not bytes at all.  This
                    wins over TRUNCATED: the bytes that were captured already say so.
    TRUNCATED       caplen < origlen, or the bytes end before the headers or before the
                    length the IP/UDP headers announce.  Fields are still filled in as
                    far as the bytes go, so a snap-length-cut RoCE frame still shows
                    its BTH (`is_roce` tells whether UDP dst 4791 was seen).
    OTHER           not RoCEv2: non-IP, not UDP, UDP to a port other than 4791, an IP
                    fragment, a link type this module does not decode, or GRE that
                    carries something other than a mirrored frame.
    UNKNOWN_OPCODE  UDP/4791 whose BTH opcode is not in parsers.opcodes (the ICRC is
                    still checked: it does not depend on the opcode).
    BAD_ICRC        a known opcode whose ICRC does not match.
    ROCE_ACK        feedback with no data: RC ACKNOWLEDGE (ACK/NAK/RNR NAK), ATOMIC
                    ACKNOWLEDGE, and CNP (congestion notification: it flows back to the
                    sender like an ACK and moves no data).
    ROCE_DATA       every other known opcode: sends, RDMA writes, read requests and
                    responses, atomics, UD sends.

Addresses: RoceFrame.src / .dst are `ipaddress.IPv4Address` / `IPv6Address` objects
(str() gives the canonical text, e.g. 'fe80::1'); None when there is no IP header.
"""
from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field

from . import icrc as _icrc
from .aeth import AETH
from .bth import BTH
from .frame import (LINKTYPE_ETHERNET, LINKTYPE_IPV4, LINKTYPE_IPV6, LINKTYPE_LINUX_SLL,
                       LINKTYPE_LINUX_SLL2, LINKTYPE_RAW)
from .deth import DETH
from .erspan import Encap, Unsupported, decapsulate
from .ethernet import ETH_TYPE_IPV4, ETH_TYPE_IPV6, Ethernet, parse_tags
from .gre import GRE, PROTO_GRE
from .header import Malformed, NeedData
from .immdt import ImmDt
from .ipv4 import PROTO_UDP, IPv4
from .ipv6 import IPv6
from .opcodes import EXT_LEN, Opcode, lookup
from .reth import RETH
from .sll import SLL, SLL2
from .udp import ROCEV2_PORT, UDP

BTH_LEN = BTH.LEN
ICRC_LEN = 4


class FrameClass(str, enum.Enum):
    """What a frame is.  A str enum, so counts keyed by it serialise as JSON as-is."""
    ROCE_DATA = "roce_data"
    ROCE_ACK = "roce_ack"
    OTHER = "other"
    TRUNCATED = "truncated"
    BAD_ICRC = "bad_icrc"
    UNKNOWN_OPCODE = "unknown_opcode"
    MALFORMED = "malformed"

    def __str__(self):
        return self.value


@dataclass(slots=True)
class RoceFrame:
    cls: FrameClass
    data: bytes
    linktype: int
    reason: str = ""
    eth: Ethernet | None = None          # Ethernet header with .tags (linktype 1 only)
    vlan: list = field(default_factory=list)   # VlanTag objects, outermost first
    ip: IPv4 | IPv6 | None = None
    src: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
    dst: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
    udp: UDP | None = None
    bth: BTH | None = None
    opcode: Opcode | None = None
    reth: RETH | None = None
    aeth: AETH | None = None
    immdt: ImmDt | None = None
    deth: DETH | None = None
    ip_offset: int | None = None
    udp_offset: int | None = None
    bth_offset: int | None = None
    payload_offset: int | None = None    # first payload byte in `data`
    payload_len: int | None = None       # excludes pad and ICRC
    icrc_offset: int | None = None
    icrc_ok: bool | None = None          # None: not computed (not RoCE, or cut off)
    encap: Encap | None = None           # GRE/ERSPAN wrapping, when the frame had one
    erspan_type: int | None = None       # 1, 2 or 3; None: not ERSPAN
    erspan_session: int | None = None    # ERSPAN II/III session id (type I has none)

    @property
    def is_roce(self) -> bool:
        """UDP to port 4791 was seen (whatever the class)."""
        return self.udp is not None and self.udp.dport == ROCEV2_PORT

    @property
    def tunnel_fault(self) -> str | None:
        """Why a GRE packet, a remote mirror session's most likely, was left unopened:
        "gre_fragment", an IP fragment (the frame it wraps is lost: the path from the
        switch fragments the tunnel), or "gre_unopened", no mirror this decoder opens
        (`reason` says which). None for every other frame."""
        if self.cls is not FrameClass.OTHER or self.ip is None or self.ip.proto != PROTO_GRE:
            return None
        return "gre_fragment" if self.ip.is_fragment else "gre_unopened"

    @property
    def sport(self) -> int | None:
        """UDP source port: RoCEv2 flow entropy, constant per QP on most NICs."""
        return self.udp.sport if self.udp is not None else None

    @property
    def payload(self) -> bytes:
        if self.payload_offset is None or self.payload_len is None:
            return b""
        return self.data[self.payload_offset:self.payload_offset + self.payload_len]


def decode_frame(data, linktype: int = LINKTYPE_ETHERNET, origlen: int | None = None) -> RoceFrame:
    """Decode one captured frame; never raises.  `origlen` is the on-the-wire length from
    the capture record (a frame shorter than it is TRUNCATED)."""
    f = RoceFrame(FrameClass.OTHER, data, linktype)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        f.cls, f.reason = FrameClass.MALFORMED, f"frame data is {type(data).__name__}, not bytes"
        return f
    try:
        _decode(f, data, linktype)
    except NeedData as e:
        f.cls, f.reason = FrameClass.TRUNCATED, str(e)
    except Malformed as e:
        f.cls, f.reason = FrameClass.MALFORMED, str(e)
    except Exception as e:  # the contract is "never raises"; say loudly that it was a bug
        f.cls, f.reason = FrameClass.MALFORMED, f"decoder error: {type(e).__name__}: {e}"
    if origlen is not None and len(data) < origlen and f.cls is not FrameClass.MALFORMED:
        f.cls = FrameClass.TRUNCATED
        f.reason = f"captured {len(data)} of {origlen} bytes" + (f"; {f.reason}" if f.reason else "")
    return f


def _link(f: RoceFrame, data, linktype: int) -> tuple[int | None, int]:
    """(EtherType or IP version marker, offset of the network header)."""
    if linktype == LINKTYPE_ETHERNET:
        f.eth = Ethernet.unpack(data)
        f.vlan = f.eth.tags
        return f.eth.ethertype, f.eth.hdr_len
    if linktype in (LINKTYPE_RAW, LINKTYPE_IPV4, LINKTYPE_IPV6):
        if not data:
            raise NeedData("empty raw-IP frame")
        version = data[0] >> 4
        want = {LINKTYPE_IPV4: 4, LINKTYPE_IPV6: 6}.get(linktype, version)
        if version != want:
            raise Malformed(f"IP version {version} on link type {linktype}")
        return {4: ETH_TYPE_IPV4, 6: ETH_TYPE_IPV6}.get(version), 0
    if linktype in (LINKTYPE_LINUX_SLL, LINKTYPE_LINUX_SLL2):
        hdr = (SLL if linktype == LINKTYPE_LINUX_SLL else SLL2).unpack(data)
        f.vlan, ethertype, offset = parse_tags(data, hdr.LEN, hdr.protocol)
        return ethertype, offset
    return None, 0


def _decode(f: RoceFrame, data, linktype: int) -> None:
    ethertype, off = _link(f, data, linktype)
    _network(f, data, ethertype, off, linktype)


def _network(f: RoceFrame, data, ethertype: int | None, off: int, linktype: int,
             inner: bool = False) -> None:
    """IP and everything above it; `inner` once an ERSPAN wrapping has been removed."""
    if ethertype == ETH_TYPE_IPV4:
        ip = IPv4.unpack(data, off)
        proto = ip.proto
    elif ethertype == ETH_TYPE_IPV6:
        ip = IPv6.unpack(data, off)
        proto = ip.proto
    else:
        f.reason = (f"link type {linktype} not decoded" if ethertype is None
                    else f"EtherType {ethertype:#06x}" + (" inside the mirror tunnel" if inner else ""))
        return
    f.ip, f.ip_offset, f.src, f.dst = ip, off, ip.src_addr, ip.dst_addr
    if proto == PROTO_GRE and not inner:
        _decapsulate(f, data, ip, off, linktype)
        return
    if proto != PROTO_UDP:
        f.reason = f"IP protocol {proto}"
        return
    if ip.is_fragment:
        f.reason = "IP fragment"
        return
    ip_end = off + ip.total_len     # Ethernet may pad past this; the IP length rules
    udp_off = off + ip.hdr_len
    f.udp = udp = UDP.unpack(data, udp_off)
    f.udp_offset = udp_off
    if udp.dport != ROCEV2_PORT:
        f.reason = f"UDP port {udp.dport}"
        return
    udp_end = udp_off + udp.ulen
    if udp_end > ip_end:
        raise Malformed(f"UDP length {udp.ulen} overruns the IP packet ({ip_end - udp_off} B)")
    if udp.ulen < UDP.LEN + BTH_LEN + ICRC_LEN:
        raise Malformed(f"UDP length {udp.ulen} too small for BTH and ICRC")

    # BTH and extension headers are read from whatever was captured, so that a frame
    # cut by the snap length still says what it was.
    bth_off = udp_off + UDP.LEN
    f.bth = bth = BTH.unpack(data, bth_off)
    f.bth_offset = bth_off
    f.opcode = op = lookup(bth.opcode)
    f.icrc_offset = icrc_off = udp_end - ICRC_LEN
    if op.known:
        # Lengths come from the headers alone, so impossible ones are MALFORMED even
        # when the capture is cut short.
        payload_off = bth_off + BTH_LEN + op.ext_len
        payload_len = icrc_off - bth.padcnt - payload_off
        if payload_len < 0:
            raise Malformed(f"{op.name}: headers ({BTH_LEN + op.ext_len} B) and pad ({bth.padcnt}) "
                            f"exceed the UDP payload ({udp.ulen - UDP.LEN - ICRC_LEN} B before ICRC)")
        if payload_len and not op.payload:
            raise Malformed(f"{op.name} carries no payload but has {payload_len} bytes")
        _extension_headers(f, data, bth_off + BTH_LEN, op)
    if ip_end > len(data):
        raise NeedData(f"IP packet ends at byte {ip_end}, frame has {len(data)}")

    f.icrc_ok = _icrc.verify(data, off, udp_off, icrc_off)
    if not op.known:
        f.cls, f.reason = FrameClass.UNKNOWN_OPCODE, f"opcode {bth.opcode:#04x}"
        return
    f.payload_offset, f.payload_len = payload_off, payload_len
    if not f.icrc_ok:
        f.cls, f.reason = FrameClass.BAD_ICRC, (f"ICRC {_icrc.stored(data, icrc_off):#010x}, "
                                                f"expected {_icrc.compute(data, off, udp_off, icrc_off):#010x}")
    elif op.is_ack:
        f.cls = FrameClass.ROCE_ACK
    else:
        f.cls = FrameClass.ROCE_DATA


def _decapsulate(f: RoceFrame, data, ip, off: int, linktype: int) -> None:
    """Unwrap GRE [+ ERSPAN] and decode the mirrored frame in place of the outer one."""
    if ip.is_fragment:
        f.reason = "IP fragment (GRE)"    # a mirror tunnel should never fragment
        return
    outer_end = off + ip.total_len
    gre_off = off + ip.hdr_len
    gre = GRE.unpack(data, gre_off, end=outer_end)
    # The mirrored frame ends where the outer packet does; cutting the buffer there (a
    # prefix, so offsets are unchanged) keeps an Ethernet trailer out of the inner frame.
    inner = data[:outer_end] if outer_end < len(data) else data
    try:
        enc = decapsulate(inner, gre, gre_off)
    except Unsupported as e:
        f.reason = str(e)
        return
    except NeedData as e:
        if outer_end <= len(data):   # every byte of the outer packet is there
            raise Malformed(f"ERSPAN header runs past the end of its IP packet: {e}") from e
        raise
    enc.outer_eth, enc.outer_vlan, enc.outer_ip, enc.outer_ip_offset = f.eth, f.vlan, ip, off
    if gre.c and outer_end <= len(data):
        enc.gre_checksum_ok = gre.checksum_ok(data, gre_off, outer_end)
    f.encap, f.erspan_type, f.erspan_session = enc, enc.erspan_type, enc.session
    f.eth, f.vlan, f.ip, f.ip_offset, f.src, f.dst = None, [], None, None, None, None
    try:
        if enc.inner_is_ip:
            if enc.inner_offset >= len(inner):
                raise NeedData("ERSPAN type III IP packet is cut off")
            version = inner[enc.inner_offset] >> 4
            ethertype = {4: ETH_TYPE_IPV4, 6: ETH_TYPE_IPV6}.get(version)
            if ethertype is None:
                raise Malformed(f"ERSPAN type III says IP follows, but IP version is {version}")
            _network(f, inner, ethertype, enc.inner_offset, linktype, inner=True)
        else:
            f.eth = Ethernet.unpack(inner, enc.inner_offset)
            f.vlan = f.eth.tags
            _network(f, inner, f.eth.ethertype, enc.inner_offset + f.eth.hdr_len, linktype, inner=True)
    except NeedData as e:
        if enc.truncated:
            raise NeedData(f"{e} (the mirroring switch truncated the frame: ERSPAN T bit)") from e
        raise


_DECODED = {"RETH": ("reth", RETH), "AETH": ("aeth", AETH), "IMMDT": ("immdt", ImmDt),
            "DETH": ("deth", DETH)}


def _extension_headers(f: RoceFrame, data, off: int, op: Opcode) -> None:
    for name in op.headers:
        if name in _DECODED:
            attr, cls = _DECODED[name]
            setattr(f, attr, cls.unpack(data, off))
        off += EXT_LEN[name]


__all__ = ["decode_frame", "RoceFrame", "FrameClass"]
