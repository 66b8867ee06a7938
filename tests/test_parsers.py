"""parsers/: header decoders, ICRC, RoCE frame classification, pcap/pcapng readers.

Reference frames are built with scapy (scapy.contrib.roce computes the ICRC itself), so
every field check compares our decoder with an independent encoder.  scapy has no RETH,
ImmDt or DETH layer: those bytes are built here with struct, in front of the payload.
"""
from __future__ import annotations

import io
import ipaddress
import random
import struct
from collections import Counter

import pytest

pytest.importorskip("scapy")
from scapy.contrib.roce import AETH as S_AETH  # noqa: E402
from scapy.contrib.roce import BTH as S_BTH  # noqa: E402
from scapy.contrib.roce import cnp as s_cnp  # noqa: E402
from scapy.layers.inet import IP, UDP as S_UDP  # noqa: E402
from scapy.layers.inet6 import IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrHopByHop, IPv6ExtHdrRouting  # noqa: E402
from scapy.layers.l2 import CookedLinux, CookedLinuxV2, Dot1Q, Ether  # noqa: E402
from scapy.packet import Raw, bind_layers  # noqa: E402

from parsers import icrc  # noqa: E402
from parsers.aeth import AETH  # noqa: E402
from parsers.bth import BTH  # noqa: E402
from parsers.capfile import CaptureError, CapturedFrame, open_capture  # noqa: E402
from parsers.ethernet import Ethernet  # noqa: E402
from parsers.immdt import ImmDt  # noqa: E402
from parsers.ipv4 import IPv4  # noqa: E402
from parsers.opcodes import OPCODES, lookup  # noqa: E402
from parsers.pcap import PcapWriter, iter_pcap, write_pcap  # noqa: E402
from parsers.pcapng import iter_pcapng  # noqa: E402
from parsers.reth import RETH  # noqa: E402
from parsers.roce import FrameClass, decode_frame  # noqa: E402

# scapy dissects 0x8100 and 0x88a8 tags but not the pre-standard 0x9100 QinQ TPID.
bind_layers(Ether, Dot1Q, type=0x9100)
bind_layers(Dot1Q, Dot1Q, type=0x9100)

MAC_A, MAC_B = "02:00:00:00:00:0a", "02:00:00:00:00:0b"
V4_SRC, V4_DST = "192.168.1.10", "192.168.1.20"
V6_SRC, V6_DST = "fe80::e42:a1ff:fe9f:58f8", "fe80::ac0:ebff:fe8c:282c"


def reth_bytes(va, rkey, dma_len):
    return struct.pack(">QII", va, rkey, dma_len)


def ip_layer(version, **kw):
    if version == 4:
        return IP(src=V4_SRC, dst=V4_DST, tos=kw.get("tos", 0), ttl=kw.get("ttl", 64), flags="DF")
    return IPv6(src=V6_SRC, dst=V6_DST, tc=kw.get("tc", 0), fl=kw.get("fl", 0), hlim=kw.get("hlim", 64))


def l2(tags=()):
    """Ethernet with VLAN tags [(tpid, vid), ...], outermost first."""
    if not tags:
        return Ether(src=MAC_A, dst=MAC_B)
    pkt = Ether(src=MAC_A, dst=MAC_B, type=tags[0][0])
    for i, (_, vid) in enumerate(tags):
        nxt = tags[i + 1][0] if i + 1 < len(tags) else None
        pkt = pkt / (Dot1Q(vlan=vid, prio=i % 8, type=nxt) if nxt else Dot1Q(vlan=vid, prio=i % 8))
    return pkt


def roce(version=4, tags=(), opcode=0x0A, after_bth=b"", payload=b"", padcnt=0, sport=49152, **bth):
    """bytes of an Ethernet/IP/UDP/BTH/<after_bth><payload><pad>/ICRC frame, ICRC by scapy."""
    b = S_BTH(opcode=opcode, padcount=padcnt, **bth)
    return bytes(l2(tags) / ip_layer(version) / S_UDP(sport=sport, dport=4791) / b
                 / Raw(after_bth + payload + b"\0" * padcnt))


# --------------------------------------------------------------------------- headers

def test_header_pack_unpack_roundtrip():
    bth = BTH(opcode=0x0B, se=1, migreq=1, padcnt=3, tver=0, pkey=0x8001, fecn=1, becn=0,
              dest_qp=0xABCDEF, ack_req=1, psn=0xFFFFFE)
    raw = bth.pack()
    assert len(raw) == 12
    assert BTH.unpack(raw) == bth
    assert raw.hex() == "0bf08001" "80abcdef" "80fffffe"
    assert RETH.unpack(reth_bytes(0x7F3D64028820, 0x1FDB9A, 65536)).fields() == \
        {"va": 0x7F3D64028820, "rkey": 0x1FDB9A, "dma_len": 65536}
    aeth = AETH.unpack(bytes.fromhex("60123456"))
    assert (aeth.syndrome, aeth.msn, aeth.kind, aeth.nak_reason) == (0x60, 0x123456, "NAK", "PSN_SEQUENCE_ERROR")
    assert AETH.unpack(bytes.fromhex("1f000001")).kind == "ACK"
    imm = ImmDt.unpack(bytes.fromhex("409c0000"))   # README: 40000 little-endian
    assert (imm.raw, imm.le, imm.be) == (bytes.fromhex("409c0000"), 40000, 0x409C0000)
    with pytest.raises(ValueError):
        BTH(psn=1 << 24).pack()


def test_opcode_table():
    assert lookup(0x06).name == "RC_RDMA_WRITE_FIRST" and lookup(0x06).headers == ("RETH",)
    assert lookup(0x0B).headers == ("RETH", "IMMDT")
    assert lookup(0x09).headers == ("IMMDT",) and lookup(0x09).ends_message
    assert lookup(0x11).is_ack and lookup(0x11).headers == ("AETH",) and not lookup(0x11).payload
    assert lookup(0x0C).headers == ("RETH",) and not lookup(0x0C).payload
    assert lookup(0x10).headers == ("AETH",) and lookup(0x10).payload
    assert lookup(0x64).name == "UD_SEND_ONLY" and lookup(0x64).headers == ("DETH",)
    assert lookup(0x65).headers == ("DETH", "IMMDT")
    assert lookup(0x2A).name == "UC_RDMA_WRITE_ONLY" and lookup(0x2A).transport == "UC"
    assert lookup(0x81).name == "CNP" and lookup(0x81).is_ack
    # UC has no reads or ACKs; 0xAA (seen in rdma32.pcapng) is not a known opcode
    for code in (0x2C, 0x31, 0x66, 0xAA, 0xFF, 0x15):
        assert not lookup(code).known and code not in OPCODES
    assert lookup(0xAA).name == "UNKNOWN_0xaa(XRC)"
    starts = {c for c, op in OPCODES.items() if op.starts_message}
    assert {0x00, 0x04, 0x06, 0x0A, 0x0B, 0x0C, 0x64}.issubset(starts)
    assert not starts & {0x01, 0x02, 0x07, 0x08, 0x09, 0x11}


# --------------------------------------------------------------------------- decode vs scapy

TAGS = {
    "untagged": (),
    "dot1q": ((0x8100, 100),),
    "qinq_88a8": ((0x88A8, 200), (0x8100, 100)),
    "qinq_9100": ((0x9100, 300), (0x8100, 100)),
    "triple": ((0x88A8, 1), (0x9100, 2), (0x8100, 4094)),
}


def check_against_scapy(frame: bytes, d):
    """Every BTH/UDP/IP field of our decode equals scapy's dissection of the same bytes."""
    s = Ether(frame)
    sb = s[S_BTH]
    assert d.bth.opcode == sb.opcode
    assert d.bth.se == sb.solicited
    assert d.bth.migreq == sb.migreq
    assert d.bth.padcnt == sb.padcount
    assert d.bth.tver == sb.version
    assert d.bth.pkey == sb.pkey
    assert d.bth.fecn == sb.fecn
    assert d.bth.becn == sb.becn
    assert d.bth.dest_qp == sb.dqpn
    assert d.bth.ack_req == sb.ackreq
    assert d.bth.psn == sb.psn
    assert d.udp.sport == s[S_UDP].sport and d.udp.ulen == s[S_UDP].len
    ip = s[IP] if IP in s else s[IPv6]
    assert d.src == ipaddress.ip_address(ip.src) and d.dst == ipaddress.ip_address(ip.dst)
    # scapy's icrc field is the last 4 bytes read big-endian; ours reads them little-endian
    assert icrc.stored(frame, d.icrc_offset) == int.from_bytes(sb.icrc.to_bytes(4, "big"), "little")
    assert d.icrc_offset == len(frame) - 4


@pytest.mark.parametrize("version", [4, 6])
@pytest.mark.parametrize("tags", list(TAGS.values()), ids=list(TAGS))
@pytest.mark.parametrize("padcnt", [0, 1, 2, 3])
def test_write_only_matches_scapy(version, tags, padcnt):
    payload = bytes(range(36 - padcnt))        # payload + pad = 36: 4-byte aligned, as NICs pad
    frame = roce(version, tags, 0x0A, reth_bytes(0x7F3D64028820, 0x1FDB9A, len(payload)),
                 payload, padcnt=padcnt, dqpn=2323, psn=0xFFFFFF, solicited=1, ackreq=1, pkey=0x7FFF,
                 sport=52389)
    d = decode_frame(frame)
    assert d.cls is FrameClass.ROCE_DATA, d.reason
    assert d.icrc_ok is True
    check_against_scapy(frame, d)
    assert [t.vid for t in d.vlan] == [vid for _, vid in tags]
    assert [t.tpid for t in d.vlan] == [tpid for tpid, _ in tags]
    assert d.eth.ethertype == (0x0800 if version == 4 else 0x86DD)
    assert d.eth.pack() == frame[:d.eth.hdr_len]         # header round-trips exactly
    assert (d.reth.va, d.reth.rkey, d.reth.dma_len) == (0x7F3D64028820, 0x1FDB9A, len(payload))
    assert d.payload_len == len(payload) and d.payload == payload
    assert d.immdt is None and d.aeth is None
    assert d.sport == 52389 and d.bth.psn == 0xFFFFFF
    assert isinstance(d.src, ipaddress.IPv4Address if version == 4 else ipaddress.IPv6Address)


@pytest.mark.parametrize("version", [4, 6])
def test_each_opcode_layout(version):
    """Extension headers land where the opcode table says, for every kind of packet."""
    reth = reth_bytes(0x1000, 0x42, 4096)
    imm = bytes.fromhex("409c0000")
    deth = struct.pack(">I", 0x80010000) + b"\0" + (0x123456).to_bytes(3, "big")   # qkey, resv, src QP
    cases = [
        (0x06, reth, b"A" * 1024, dict(reth=True)),
        (0x07, b"", b"B" * 1024, {}),
        (0x08, b"", b"C" * 100, {}),
        (0x09, imm, b"D" * 64, dict(imm=True)),
        (0x0B, reth + imm, b"", dict(reth=True, imm=True)),   # zero-length write with imm
        (0x0C, reth, b"", dict(reth=True)),
        (0x04, b"", b"E" * 10, {}),
        (0x05, imm, b"F" * 8, dict(imm=True)),
        (0x10, bytes.fromhex("00000007"), b"G" * 16, dict(aeth=True)),
        (0x0E, b"", b"H" * 16, {}),
        (0x64, deth, b"I" * 40, dict(deth=True)),
        (0x65, deth + imm, b"J" * 40, dict(deth=True, imm=True)),
        (0x2A, reth, b"K" * 12, dict(reth=True)),
    ]
    for opcode, ext, payload, has in cases:
        pad = (-len(payload)) % 4
        frame = roce(version, (), opcode, ext, payload, padcnt=pad, dqpn=7, psn=9)
        d = decode_frame(frame)
        name = lookup(opcode).name
        assert d.cls is FrameClass.ROCE_DATA, (name, d.reason)
        assert d.icrc_ok, name
        assert d.payload == payload, name
        assert (d.reth is not None) == bool(has.get("reth")), name
        assert (d.immdt is not None) == bool(has.get("imm")), name
        assert (d.aeth is not None) == bool(has.get("aeth")), name
        assert (d.deth is not None) == bool(has.get("deth")), name
        if d.reth:
            assert (d.reth.va, d.reth.rkey, d.reth.dma_len) == (0x1000, 0x42, 4096)
        if d.immdt:
            assert (d.immdt.raw, d.immdt.le) == (imm, 40000)
        if d.deth:
            assert (d.deth.qkey, d.deth.src_qp) == (0x80010000, 0x123456)
        if d.aeth:
            assert d.aeth.msn == 7


@pytest.mark.parametrize("version", [4, 6])
def test_ack_and_cnp_from_scapy(version):
    frame = bytes(l2() / ip_layer(version) / S_UDP(dport=4791)
                  / S_BTH(opcode=0x11, dqpn=2081, psn=23) / S_AETH(syndrome=0x1F, msn=0x10203))
    d = decode_frame(frame)
    assert d.cls is FrameClass.ROCE_ACK and d.icrc_ok
    check_against_scapy(frame, d)
    assert (d.aeth.syndrome, d.aeth.msn, d.aeth.kind) == (0x1F, 0x10203, "ACK")
    assert d.payload_len == 0
    frame = bytes(l2() / ip_layer(version) / S_UDP(dport=4791) / s_cnp(0x99))
    d = decode_frame(frame)
    assert d.cls is FrameClass.ROCE_ACK and d.icrc_ok and d.opcode.name == "CNP"
    assert d.bth.becn == 1 and d.bth.dest_qp == 0x99 and d.payload_len == 0


@pytest.mark.parametrize("version", [4, 6])
def test_icrc_masking_and_flipped_bytes(version):
    frame = roce(version, ((0x8100, 5),), 0x0A, reth_bytes(1, 2, 40), b"x" * 40, dqpn=5)
    d = decode_frame(frame)
    assert d.icrc_ok and d.cls is FrameClass.ROCE_DATA
    ip, udp, bth = d.ip_offset, d.udp_offset, d.bth_offset

    # Fields a router may change are masked: rewriting them keeps the ICRC valid.
    variant = bytearray(frame)
    if version == 4:
        variant[ip + 1] = 0x03          # TOS: ECN CE
        variant[ip + 8] = 1             # TTL
        variant[ip + 10:ip + 12] = b"\x12\x34"
    else:
        variant[ip] = 0x6F              # traffic class high nibble
        variant[ip + 1:ip + 4] = b"\xab\xcd\xef"   # traffic class low + flow label
        variant[ip + 7] = 1             # hop limit
    variant[udp + 6:udp + 8] = b"\x00\x00"   # UDP checksum
    variant[bth + 4] |= 0xC0            # FECN + BECN
    dv = decode_frame(bytes(variant))
    assert dv.icrc_ok and dv.cls is FrameClass.ROCE_DATA
    assert dv.bth.fecn == 1 and dv.bth.becn == 1

    # Any other byte from the IP header to the end is covered: flipping it breaks the ICRC.
    masked = set()
    if version == 4:
        masked |= {ip + 1, ip + 8, ip + 10, ip + 11}
    else:
        masked |= {ip, ip + 1, ip + 2, ip + 3, ip + 7}
    masked |= {udp + 6, udp + 7, bth + 4}
    # Skip the bytes that change how the frame parses (lengths, version, ports,
    # opcode): they give other classes, checked elsewhere.
    structural = set(range(ip, ip + 4)) | {ip + 4, ip + 5} | set(range(udp, udp + 6)) | {bth}
    if version == 4:
        structural |= {ip + 2, ip + 3, ip + 6, ip + 7, ip + 9}
    else:
        structural |= {ip + 4, ip + 5, ip + 6}
    for pos in range(ip, len(frame)):
        if pos in masked:
            continue
        bad = bytearray(frame)
        bad[pos] ^= 0x01 if pos != bth + 1 else 0x80   # bth+1 low bits are padcnt/tver
        db = decode_frame(bytes(bad))
        if pos in structural:
            assert db.icrc_ok is not True, pos
        else:
            assert db.icrc_ok is False and db.cls is FrameClass.BAD_ICRC, (pos, db.cls, db.reason)


def test_icrc_compute_matches_stored():
    frame = roce(6, (), 0x07, b"", b"z" * 256, dqpn=1, psn=2)
    d = decode_frame(frame)
    assert icrc.compute(frame, d.ip_offset, d.udp_offset, d.icrc_offset) == icrc.stored(frame, d.icrc_offset)
    assert icrc.pack(icrc.stored(frame, d.icrc_offset)) == frame[-4:]


def test_ipv6_extension_headers_skipped():
    inner = S_UDP(sport=1, dport=4791) / S_BTH(opcode=0x0A, dqpn=3, psn=4, icrc=0) / Raw(reth_bytes(5, 6, 8) + b"12345678")
    for ext in (IPv6ExtHdrHopByHop(), IPv6ExtHdrRouting(), IPv6ExtHdrDestOpt(),
                IPv6ExtHdrHopByHop() / IPv6ExtHdrDestOpt()):
        frame = bytearray(bytes(l2() / IPv6(src=V6_SRC, dst=V6_DST) / ext / inner))
        d = decode_frame(bytes(frame))
        assert d.is_roce and d.bth.dest_qp == 3 and d.reth.dma_len == 8 and d.payload == b"12345678"
        assert d.udp_offset == 14 + 40 + len(bytes(ext))
        assert len(d.ip.ext_headers) == (2 if ext.payload else 1)
        # scapy leaves the ICRC to us here (its compute needs UDP directly on IP):
        assert d.icrc_ok is False and d.cls is FrameClass.BAD_ICRC
        frame[-4:] = icrc.pack(icrc.compute(frame, d.ip_offset, d.udp_offset, d.icrc_offset))
        assert decode_frame(bytes(frame)).cls is FrameClass.ROCE_DATA


def test_linktypes_raw_sll_sll2():
    body = IPv6(src=V6_SRC, dst=V6_DST) / S_UDP(dport=4791) / S_BTH(opcode=0x0A, dqpn=77) / Raw(reth_bytes(1, 2, 4) + b"abcd")
    body4 = IP(src=V4_SRC, dst=V4_DST) / S_UDP(dport=4791) / S_BTH(opcode=0x0A, dqpn=77) / Raw(reth_bytes(1, 2, 4) + b"abcd")
    cases = [
        (101, bytes(body)), (101, bytes(body4)), (229, bytes(body)), (228, bytes(body4)),
        (113, bytes(CookedLinux(pkttype=4, proto=0x86DD) / body)),
        (113, bytes(CookedLinux(pkttype=0, proto=0x8100) / Dot1Q(vlan=9) / body4)),
        (276, bytes(CookedLinuxV2(proto=0x86DD, ifindex=3) / body)),
        (1, bytes(l2() / body)),
    ]
    for lt, frame in cases:
        d = decode_frame(frame, lt)
        assert d.cls is FrameClass.ROCE_DATA and d.icrc_ok, (lt, d.reason)
        assert d.bth.dest_qp == 77 and d.payload == b"abcd"
    assert decode_frame(bytes(body4), 229).cls is FrameClass.MALFORMED   # IPv4 on the IPv6 link type
    assert decode_frame(bytes(body), 147).cls is FrameClass.OTHER      # a link type we do not decode


def test_other_traffic():
    from scapy.layers.inet import TCP
    from scapy.layers.l2 import ARP
    for pkt in (l2() / IP(src=V4_SRC, dst=V4_DST) / TCP(dport=29500) / Raw(b"hello"),
                l2() / IPv6(src=V6_SRC, dst=V6_DST) / S_UDP(dport=319) / Raw(b"\0" * 44),
                l2() / ARP(),
                Ether(src=MAC_A, dst=MAC_B, type=0x88CC) / Raw(b"\x02\x07" + b"\0" * 40),
                l2(((0x8100, 5),)) / IP(src=V4_SRC, dst=V4_DST, flags="MF") / S_UDP(dport=4791) / Raw(b"\0" * 40)):
        d = decode_frame(bytes(pkt))
        assert d.cls is FrameClass.OTHER, (pkt.summary(), d.reason)
        assert d.icrc_ok is None


def test_unknown_opcode_and_malformed():
    frame = roce(6, (), 0x0A, reth_bytes(1, 2, 4), b"abcd", dqpn=1)
    unk = bytearray(frame)
    ip_off = 14
    bth = ip_off + 40 + 8
    unk[bth] = 0xAA
    d = decode_frame(bytes(unk))
    assert d.cls is FrameClass.UNKNOWN_OPCODE and d.icrc_ok is False and d.opcode.known is False
    unk[-4:] = icrc.pack(icrc.compute(unk, ip_off, ip_off + 40, len(unk) - 4))
    d = decode_frame(bytes(unk))
    assert d.cls is FrameClass.UNKNOWN_OPCODE and d.icrc_ok is True   # ICRC needs no opcode

    # payload bytes on an ACK: impossible
    ack = bytes(l2() / IP(src=V4_SRC, dst=V4_DST) / S_UDP(dport=4791) / S_BTH(opcode=0x11) / Raw(b"\0" * 8))
    assert decode_frame(ack).cls is FrameClass.MALFORMED
    # WRITE_FIRST too short to hold its RETH
    short = bytes(l2() / IP(src=V4_SRC, dst=V4_DST) / S_UDP(dport=4791) / S_BTH(opcode=0x06) / Raw(b"\0" * 8))
    assert decode_frame(short).cls is FrameClass.MALFORMED
    # pad count larger than the payload there is
    padded = bytes(l2() / IP(src=V4_SRC, dst=V4_DST) / S_UDP(dport=4791) / S_BTH(opcode=0x07, padcount=3) / Raw(b"\0\0"))
    assert decode_frame(padded).cls is FrameClass.MALFORMED
    # UDP length claiming more than the IP packet holds
    bad = bytearray(frame)
    bad[14 + 40 + 4:14 + 40 + 6] = (len(frame) - 14 - 40 + 4).to_bytes(2, "big")
    assert decode_frame(bytes(bad)).cls is FrameClass.MALFORMED


def test_ethernet_padding_beyond_ip_length_is_ignored():
    frame = roce(4, (), 0x11, bytes.fromhex("00000001"), b"", dqpn=9)   # 62 bytes
    d = decode_frame(frame + b"\0" * 8 + b"FCS!")
    assert d.cls is FrameClass.ROCE_ACK and d.icrc_ok and d.icrc_offset == len(frame) - 4


# --------------------------------------------------------------------------- truncation, garbage

@pytest.mark.parametrize("version", [4, 6])
@pytest.mark.parametrize("tags", [(), ((0x88A8, 2), (0x8100, 3))], ids=["untagged", "qinq"])
def test_every_truncation_is_truncated(version, tags):
    frame = roce(version, tags, 0x0B, reth_bytes(1, 2, 24) + b"imm!", b"p" * 24, dqpn=11, psn=12)
    assert decode_frame(frame, origlen=len(frame)).cls is FrameClass.ROCE_DATA
    for n in range(len(frame)):
        for origlen in (None, len(frame)):
            d = decode_frame(frame[:n], origlen=origlen)
            assert d.cls is FrameClass.TRUNCATED, (n, origlen, d.cls, d.reason)
            assert d.icrc_ok is None
    # cut after the BTH: still known to be RoCE, the BTH is read
    cut = len(frame) - 30
    d = decode_frame(frame[:cut], origlen=len(frame))
    assert d.is_roce and d.bth.dest_qp == 11 and d.bth.psn == 12 and "captured" in d.reason
    # caplen < origlen classifies TRUNCATED even if the packet happens to be whole
    assert decode_frame(frame, origlen=len(frame) + 4).cls is FrameClass.TRUNCATED


def test_garbage_never_raises():
    rng = random.Random(1234)
    seeds = [roce(v, t, op, ext, pl, padcnt=(-len(pl)) % 4, dqpn=5)
             for v in (4, 6) for t in ((), ((0x8100, 1),))
             for op, ext, pl in ((0x0A, reth_bytes(1, 2, 3), b"abc"), (0x11, b"\0\0\0\1", b""),
                                 (0x09, b"immd", b"x" * 17))]
    counts = Counter()
    for lt in (1, 101, 113, 228, 229, 276, 0, 65535):
        for _ in range(300):
            junk = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 120)))
            d = decode_frame(junk, lt)
            counts[d.cls] += 1
            assert isinstance(d.cls, FrameClass) and not d.reason.startswith("decoder error"), d.reason
    for seed in seeds:
        for _ in range(400):
            b = bytearray(seed)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            b = bytes(b[:rng.randrange(len(b) + 1)]) if rng.random() < 0.3 else bytes(b)
            d = decode_frame(b, 1, origlen=len(seed) if rng.random() < 0.5 else None)
            counts[d.cls] += 1
            assert isinstance(d.cls, FrameClass) and not d.reason.startswith("decoder error"), d.reason
    for weird in (None, 12345, "text", [1, 2, 3]):
        assert decode_frame(weird).cls is FrameClass.MALFORMED   # wrong types still get a class
    assert len(counts) >= 5        # the fuzzing reached most classes


# --------------------------------------------------------------------------- pcap / pcapng

FRAMES = [(1_700_000_000_123_456_789, b"\x01" * 60), (1_700_000_001_000_000_001, b"\x02" * 1500),
          (1_700_000_002_999_999_999, b"")]


def hand_pcap(order, nanosecond, linktype=1, records=FRAMES, origlen_extra=0):
    magic = 0xA1B23C4D if nanosecond else 0xA1B2C3D4
    out = struct.pack(order + "IHHiIII", magic, 2, 4, 0, 0, 65535, linktype)
    for ts, data in records:
        sec, ns = divmod(ts, 10**9)
        out += struct.pack(order + "IIII", sec, ns if nanosecond else ns // 1000, len(data),
                           len(data) + origlen_extra) + data
    return out


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("nanosecond", [True, False])
def test_pcap_hand_built(tmp_path, order, nanosecond):
    path = tmp_path / "x.pcap"
    path.write_bytes(hand_pcap(order, nanosecond, linktype=101, origlen_extra=7))
    got = list(open_capture(path))
    assert [f.index for f in got] == [1, 2, 3]
    for f, (ts, data) in zip(got, FRAMES):
        assert f.data == data and f.caplen == len(data) and f.origlen == len(data) + 7
        assert f.ts_ns == (ts if nanosecond else ts // 1000 * 1000)
        assert f.linktype == 101 and f.interface_id == 0 and f.truncated


def test_pcap_writer_roundtrip(tmp_path):
    frame = roce(6, ((0x8100, 3),), 0x0A, reth_bytes(1, 2, 8), b"8 bytes!", dqpn=9)
    path = tmp_path / "w.pcap"
    assert write_pcap(path, [(ts, frame) for ts, _ in FRAMES]) == 3
    raw = path.read_bytes()
    assert raw[:4] == struct.pack("<I", 0xA1B23C4D) and struct.unpack("<I", raw[20:24])[0] == 1
    got = list(open_capture(path))
    assert [f.ts_ns for f in got] == [ts for ts, _ in FRAMES]
    assert all(f.data == frame and decode_frame(f.data, f.linktype, f.origlen).cls is FrameClass.ROCE_DATA
               for f in got)
    # an independent reader agrees
    dpkt = pytest.importorskip("dpkt")
    with open(path, "rb") as fh:
        r = dpkt.pcap.Reader(fh)
        assert r.datalink() == 1
        assert [bytes(b) for _, b in r] == [frame] * 3
    # snaplen cut: origlen kept, frame TRUNCATED
    buf = io.BytesIO()
    w = PcapWriter(buf, snaplen=64, byteorder=">")
    w.write(frame, 5)
    (f,) = iter_pcap(io.BytesIO(buf.getvalue()), "mem")
    assert (f.caplen, f.origlen, f.ts_ns) == (64, len(frame), 5)
    assert decode_frame(f.data, f.linktype, f.origlen).cls is FrameClass.TRUNCATED


def _block(order, btype, body):
    body += b"\0" * ((-len(body)) % 4)
    n = len(body) + 12
    return struct.pack(order + "II", btype, n) + body + struct.pack(order + "I", n)


def _opt(order, code, value):
    return struct.pack(order + "HH", code, len(value)) + value + b"\0" * ((-len(value)) % 4)


def hand_pcapng(order):
    shb = _block(order, 0x0A0D0D0A, struct.pack(order + "IHHq", 0x1A2B3C4D, 1, 0, -1))
    # interface 0: Ethernet, default microseconds; interface 1: raw IP, nanoseconds,
    # with if_name and an offset option to skip/apply
    idb0 = _block(order, 1, struct.pack(order + "HHI", 1, 0, 0)
                  + _opt(order, 2, b"eth0") + _opt(order, 0, b""))
    idb1 = _block(order, 1, struct.pack(order + "HHI", 101, 0, 65535)
                  + _opt(order, 9, b"\x09") + _opt(order, 14, struct.pack(order + "q", 10))
                  + _opt(order, 0, b""))
    idb2 = _block(order, 1, struct.pack(order + "HHI", 228, 0, 0)
                  + _opt(order, 9, b"\x8a") + _opt(order, 0, b""))   # 2**-10 s ticks

    def epb(iface, ticks, data, origlen=None):
        return _block(order, 6, struct.pack(order + "IIIII", iface, ticks >> 32, ticks & 0xFFFFFFFF,
                                            len(data), origlen or len(data)) + data)
    nrb = _block(order, 4, b"\0" * 8)                 # name resolution: skipped
    custom = _block(order, 0x0BAD, b"whatever")       # unknown type: skipped
    spb = _block(order, 3, struct.pack(order + "I", 5) + b"hello")
    return (shb + idb0 + idb1 + nrb + epb(0, 1_700_000_000_123_456, b"A" * 61)
            + epb(1, 1_700_000_000_123_456_789, b"B" * 3, origlen=100) + custom + idb2
            + epb(2, 3 * 1024 + 512, b"C") + spb)


@pytest.mark.parametrize("order", ["<", ">"])
def test_pcapng_hand_built(tmp_path, order):
    path = tmp_path / "x.pcapng"
    # two sections, the second in the other byte order: interface ids restart
    other = ">" if order == "<" else "<"
    path.write_bytes(hand_pcapng(order) + hand_pcapng(other))
    got = list(open_capture(path))
    assert [f.index for f in got] == list(range(1, 9))
    for section in (got[:4], got[4:]):
        a, b, c, s = section
        assert (a.interface_id, a.linktype, a.ts_ns, a.data, a.origlen) == \
            (0, 1, 1_700_000_000_123_456_000, b"A" * 61, 61)
        assert (b.interface_id, b.linktype, b.ts_ns, b.data, b.caplen, b.origlen) == \
            (1, 101, 1_700_000_010_123_456_789, b"B" * 3, 3, 100)
        assert (c.interface_id, c.linktype, c.ts_ns) == (2, 228, 3_500_000_000)
        assert (s.interface_id, s.linktype, s.ts_ns, s.data) == (0, 1, None, b"hello")
    assert all(isinstance(f, CapturedFrame) for f in got)
    # an independent reader agrees on the packets of interface 0
    dpkt = pytest.importorskip("dpkt")
    with open(path, "rb") as fh:
        first = next(iter(dpkt.pcapng.Reader(fh)))
    assert bytes(first[1]) == b"A" * 61


def test_capture_errors_name_file_and_frame(tmp_path):
    bad = tmp_path / "bad_magic.pcap"
    bad.write_bytes(b"\x00\x01\x02\x03" + b"\0" * 40)
    with pytest.raises(CaptureError, match="bad_magic.pcap"):
        list(open_capture(bad))
    empty = tmp_path / "empty.pcap"
    empty.write_bytes(b"")
    with pytest.raises(CaptureError, match="empty.pcap"):
        list(open_capture(empty))

    whole = hand_pcap("<", True)
    for cut, what in ((len(whole) - 1, "frame 3"),            # last record's header cut
                      (len(whole) - 16 - 700, "frame 2")):    # second record's data cut
        path = tmp_path / f"cut{cut}.pcap"
        path.write_bytes(whole[:cut])
        seen = []
        with pytest.raises(CaptureError) as ei:
            for f in open_capture(path):
                seen.append(f.index)
        assert path.name in str(ei.value) and what in str(ei.value) and "truncated" in str(ei.value)
        assert seen == list(range(1, int(what.split()[1])))   # the frames before are delivered

    ng = hand_pcapng("<")
    path = tmp_path / "cut.pcapng"
    path.write_bytes(ng[:-3])                # last block (block 10, the SPB, frame 4) cut short
    seen = []
    with pytest.raises(CaptureError) as ei:
        for f in open_capture(path):
            seen.append(f.index)
    msg = str(ei.value)
    assert "cut.pcapng" in msg and "block 10" in msg and "frame 4" in msg and "truncated" in msg
    assert seen == [1, 2, 3]
    path.write_bytes(b"\x0a\x0d\x0d\x0a" + struct.pack("<I", 28) + b"\x00\x00\x00\x00" + b"\0" * 16)
    with pytest.raises(CaptureError, match="byte-order magic"):
        list(open_capture(path))
    corrupt = bytearray(ng)
    struct.pack_into("<I", corrupt, len(ng) - 4, 999)   # trailing length disagrees
    path.write_bytes(bytes(corrupt))
    with pytest.raises(CaptureError, match="trailing block length"):
        list(open_capture(path))
    with pytest.raises(CaptureError, match="not a pcapng"):
        list(iter_pcapng(io.BytesIO(b"\x01\x00\x00\x00" + b"\0" * 20), "mem.pcapng"))


def test_ipv4_header_checksum_helper():
    raw = bytes(IP(src=V4_SRC, dst=V4_DST, ttl=7) / S_UDP() / Raw(b"q"))
    ip = IPv4.unpack(raw)
    assert ip.header_checksum() == ip.checksum and ip.src_addr == ipaddress.IPv4Address(V4_SRC)
    assert ip.pack() == raw[:20]
    eth = Ethernet.build(b"\x02" * 6, b"\x04" * 6, 0x86DD, tags=[(0x88A8, 10), (0x8100, 20, 5)])
    parsed = Ethernet.unpack(eth.pack() + b"\x60")
    assert parsed.vlan_ids == [10, 20] and parsed.ethertype == 0x86DD and parsed.tags[1].pcp == 5


def test_chunked_file_writes_whole_aligned_pieces_and_the_same_bytes(tmp_path):
    """parsers.pcap.ChunkedFile hands the file writes that end on multiples of
    WRITE_CHUNK, also after a flush (the next write completes the piece), and the file
    holds exactly what was written."""
    from parsers.pcap import ChunkedFile
    rng, data, ends = random.Random(3), [], []
    f = ChunkedFile(tmp_path / "c.pcap")
    f.WRITE_CHUNK = 1 << 16
    write = f.raw.write
    f.raw.write = lambda view: ends.append(f.written + len(view)) or write(view)
    for i in range(400):
        data.append(rng.randbytes(rng.randrange(1, 3000)))
        f.write(data[-1])
        if i == 150:
            f.flush()
            flushed_at = len(ends) - 1
    f.close()
    assert (tmp_path / "c.pcap").read_bytes() == b"".join(data)
    inner = [e for k, e in enumerate(ends[:-1]) if k != flushed_at]
    assert len(inner) > 3 and all(e % (1 << 16) == 0 for e in inner)
