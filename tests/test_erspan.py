"""GRE and ERSPAN decapsulation in parsers/: frames built by scapy's GRE and ERSPAN layers
(scapy.layers.l2.GRE, scapy.contrib.erspan), so our decoder is checked against an
independent encoder, for every ERSPAN type, IPv4 and IPv6 outside and inside, and the
GRE checksum / key / sequence / routing variations.  Broken frames must classify
without raising.
"""
from __future__ import annotations

import ipaddress
import json
import random
import struct

import pytest

pytest.importorskip("scapy")
from scapy.contrib.erspan import ERSPAN_I, ERSPAN_II, ERSPAN_III, ERSPAN_PlatformSpecific  # noqa: E402
from scapy.contrib.roce import BTH as S_BTH  # noqa: E402
from scapy.layers.inet import IP, UDP  # noqa: E402
from scapy.layers.inet6 import IPv6  # noqa: E402
from scapy.layers.l2 import GRE as S_GRE, Dot1Q, Ether  # noqa: E402
from scapy.packet import Raw  # noqa: E402

from ckptd.testing.tunnel import erspan2, gre_tunnel, ip_fragments  # noqa: E402
from parsers import icrc  # noqa: E402
from parsers.erspan import ERSPAN2, ERSPAN3  # noqa: E402
from parsers.gre import GRE  # noqa: E402
from parsers.pcap import read_pcap, write_pcap  # noqa: E402
from parsers.roce import FrameClass, decode_frame  # noqa: E402

MAC_SW, MAC_COLL = "02:00:00:00:01:01", "02:00:00:00:01:02"
OUTER = {4: ("10.200.0.1", "10.200.0.9"), 6: ("fd00:200::1", "fd00:200::9")}
INNER = {4: ("192.168.1.10", "192.168.1.20"), 6: ("fe80::e42:a1ff:fe9f:58f8", "fe80::ac0:ebff:fe8c:282c")}
PAYLOAD = bytes(range(256)) * 4
RETH = struct.pack(">QII", 0x7F3D64028820, 0x1FDB9A, len(PAYLOAD))


def inner_ip(version):
    src, dst = INNER[version]
    return IP(src=src, dst=dst, flags="DF") if version == 4 else IPv6(src=src, dst=dst)


def roce_l3(version, payload=PAYLOAD):
    """IP/UDP/BTH/RETH/payload/ICRC of an RDMA WRITE ONLY (scapy computes the ICRC)."""
    return (inner_ip(version) / UDP(sport=52389, dport=4791)
            / S_BTH(opcode=0x0A, dqpn=0x1234, psn=0xABCDE, ackreq=1) / Raw(RETH + payload))


def roce_frame(version, tags=()):
    eth = Ether(src="02:00:00:00:00:0a", dst="02:00:00:00:00:0b")
    for vid in tags:
        eth = eth / Dot1Q(vlan=vid)
    return eth / roce_l3(version)


def outer(version, inner_pkt, gre: S_GRE):
    src, dst = OUTER[version]
    ip = IP(src=src, dst=dst, ttl=63, tos=8 << 2) if version == 4 else IPv6(src=src, dst=dst, hlim=63)
    return bytes(Ether(src=MAC_SW, dst=MAC_COLL) / ip / gre / inner_pkt)


GRE_VARIANTS = {
    "plain": {},
    "key": dict(key_present=1, key=0xCAFEF00D),
    "csum": dict(chksum_present=1),
    "csum_key": dict(chksum_present=1, key_present=1, key=7),
}


def erspan_frame(etype, outer_v, inner_v, gre_kw=None, session=0x2A5, tags=(), seq=77):
    """A whole captured frame: Ether/IP(v)/GRE/ERSPAN <etype>/Ether/IP(v)/UDP/BTH."""
    gre_kw = dict(gre_kw or {})
    inner = roce_frame(inner_v, tags)
    if etype == 1:
        gre_kw.pop("seqnum_present", None)
        return outer(outer_v, ERSPAN_I() / inner, S_GRE(proto=0x88BE, **gre_kw))
    if etype == 2:
        hdr = ERSPAN_II(session_id=session, vlan=tags[0] if tags else 0, cos=5, en=2 if tags else 0,
                        index=0x12345)
        return outer(outer_v, hdr / inner, S_GRE(proto=0x88BE, seqnum_present=1, sequence_number=seq, **gre_kw))
    hdr = ERSPAN_III(session_id=session, vlan=tags[0] if tags else 0, cos=3, timestamp=0xDEADBEEF,
                     sgt_other=0x4321, hw=9, d=1, gra=1, o=0)
    return outer(outer_v, hdr / inner, S_GRE(proto=0x22EB, seqnum_present=1, sequence_number=seq, **gre_kw))


def check_inner(frame: bytes, d, inner_v, tags=()):
    """The decode describes the inner RoCE packet, with offsets into the outer bytes."""
    assert d.cls is FrameClass.ROCE_DATA, d.reason
    assert d.icrc_ok is True
    assert d.src == ipaddress.ip_address(INNER[inner_v][0]) and d.dst == ipaddress.ip_address(INNER[inner_v][1])
    assert d.ip.version == inner_v and frame[d.ip_offset] >> 4 == inner_v
    assert d.bth.dest_qp == 0x1234 and d.bth.psn == 0xABCDE and d.sport == 52389
    assert (d.reth.va, d.reth.dma_len) == (0x7F3D64028820, len(PAYLOAD))
    assert d.payload == PAYLOAD
    assert bytes(frame[d.payload_offset:d.payload_offset + d.payload_len]) == PAYLOAD
    # the ICRC is the INNER packet's: recomputable from our offsets
    assert icrc.compute(frame, d.ip_offset, d.udp_offset, d.icrc_offset) == icrc.stored(frame, d.icrc_offset)
    # same header values as the unencapsulated frame, every offset shifted by the tunnel
    bare = bytes(roce_frame(inner_v, tags))
    b = decode_frame(bare)
    shift = d.encap.inner_offset
    assert bare == frame[shift:shift + len(bare)]
    assert (d.ip_offset, d.udp_offset, d.bth_offset, d.payload_offset, d.icrc_offset) == tuple(
        x + shift for x in (b.ip_offset, b.udp_offset, b.bth_offset, b.payload_offset, b.icrc_offset))
    assert d.bth == b.bth and d.eth == b.eth and [t.vid for t in d.vlan] == list(tags)
    # the tunnel is kept
    assert d.encap.outer_eth is not None and str(d.encap.outer_ip.src_addr) == OUTER[d.encap.outer_ip.version][0]


@pytest.mark.parametrize("etype", [1, 2, 3])
@pytest.mark.parametrize("outer_v", [4, 6])
@pytest.mark.parametrize("inner_v", [4, 6])
@pytest.mark.parametrize("gre", list(GRE_VARIANTS), ids=list(GRE_VARIANTS))
def test_erspan_decodes_inner_roce(etype, outer_v, inner_v, gre):
    frame = erspan_frame(etype, outer_v, inner_v, GRE_VARIANTS[gre])
    d = decode_frame(frame)
    check_inner(frame, d, inner_v)
    assert d.erspan_type == etype and d.encap.erspan_type == etype
    assert d.erspan_session == (None if etype == 1 else 0x2A5)
    s = Ether(frame)[S_GRE]      # scapy's dissection of the same bytes
    g = d.encap.gre
    assert (g.c, g.k, g.s, g.proto) == (s.chksum_present, s.key_present, s.seqnum_present, s.proto)
    assert g.key == (s.key if s.key_present else None)
    assert g.seq == (s.sequence_number if s.seqnum_present else None)
    assert d.encap.gre_checksum_ok is (True if s.chksum_present else None)
    if etype == 2:
        e = Ether(frame)[ERSPAN_II]
        h = d.encap.header
        assert isinstance(h, ERSPAN2)
        assert (h.ver, h.session_id, h.cos, h.index) == (1, e.session_id, e.cos, e.index) == (1, 0x2A5, 5, 0x12345)
    if etype == 3:
        e = Ether(frame)[ERSPAN_III]
        h = d.encap.header
        assert isinstance(h, ERSPAN3)
        assert (h.timestamp, h.sgt, h.hw_id, h.d, h.gra, h.o) == (e.timestamp, e.sgt_other, e.hw, 1, 1, 0)
        assert d.encap.direction == "egress"


@pytest.mark.parametrize("etype", [2, 3])
def test_vlan_tagged_mirrored_frame(etype):
    frame = erspan_frame(etype, 4, 4, tags=(100,))
    d = decode_frame(frame)
    check_inner(frame, d, 4, tags=(100,))
    assert d.encap.header.vlan == 100


def test_erspan3_platform_subheader():
    inner = roce_frame(6)
    hdr = ERSPAN_III(session_id=1023, o=1) / ERSPAN_PlatformSpecific(platf_id=3, info1=0x155, info2=0xAABBCCDD)
    frame = outer(4, hdr / inner, S_GRE(proto=0x22EB, seqnum_present=1, key_present=1, key=1))
    d = decode_frame(frame)
    check_inner(frame, d, 6)
    assert d.erspan_session == 1023
    assert d.encap.platform.platf_id == 3 and d.encap.platform.info == (0x155 << 32) | 0xAABBCCDD


@pytest.mark.parametrize("inner_v", [4, 6])
def test_erspan3_ip_frame_type(inner_v):
    """FT=2: the switch stripped the mirrored frame's Ethernet header."""
    l3 = bytes(roce_l3(inner_v))
    frame = outer(6, ERSPAN_III(session_id=9, ft=2) / Raw(l3), S_GRE(proto=0x22EB, seqnum_present=1))
    d = decode_frame(frame)
    assert d.cls is FrameClass.ROCE_DATA, d.reason
    assert d.eth is None and d.encap.inner_is_ip and d.erspan_session == 9
    assert d.ip_offset == d.encap.inner_offset and d.payload == PAYLOAD and d.icrc_ok


def test_transparent_ethernet_gre():
    frame = outer(4, roce_frame(4), S_GRE(proto=0x6558, key_present=1, key=5))
    d = decode_frame(frame)
    check_inner(frame, d, 4)
    assert d.encap is not None and d.erspan_type is None and d.erspan_session is None


def test_gre_routing_sres_are_skipped():
    """RFC 1701 routing present: checksum/offset words, then SREs up to a null SRE."""
    gre = struct.pack(">HH", 0x4000 | 0x1000, 0x88BE)          # R and S set
    gre += struct.pack(">HH", 0, 0)                              # checksum, offset
    gre += struct.pack(">I", 42)                                 # sequence number
    gre += struct.pack(">HBB", 0x0800, 0, 8) + bytes(8)          # one IPv4 SRE, 2 addresses
    gre += struct.pack(">HBB", 0, 0, 0)                          # null SRE
    body = gre + bytes(ERSPAN_II(session_id=3) / roce_frame(4))
    frame = bytes(Ether(src=MAC_SW, dst=MAC_COLL) / IP(src=OUTER[4][0], dst=OUTER[4][1], proto=47) / Raw(body))
    d = decode_frame(frame)
    check_inner(frame, d, 4)
    assert d.encap.gre.r and d.encap.gre.seq == 42 and d.encap.gre.routing == ((0x0800, 0, bytes(8)),)
    assert d.erspan_session == 3


def test_gre_header_unit():
    raw = bytes(S_GRE(chksum_present=1, key_present=1, key=9, seqnum_present=1, sequence_number=10,
                      proto=0x88BE) / Raw(b"x" * 9))
    g = GRE.unpack(raw)
    assert (g.hdr_len, g.key, g.seq, g.flag_text) == (16, 9, 10, "CKS")
    assert g.checksum_ok(raw, 0, len(raw)) is True
    bad = bytearray(raw)
    bad[-1] ^= 1
    assert g.checksum_ok(bad, 0, len(bad)) is False


def test_erspan_over_non_roce_is_other():
    inner = Ether() / IP(src="1.1.1.1", dst="2.2.2.2") / UDP(sport=1, dport=53) / Raw(b"q" * 20)
    d = decode_frame(outer(4, ERSPAN_II(session_id=4) / inner, S_GRE(proto=0x88BE, seqnum_present=1)))
    assert d.cls is FrameClass.OTHER and d.reason == "UDP port 53"
    assert d.erspan_session == 4 and str(d.src) == "1.1.1.1"


def test_ethernet_trailer_after_the_tunnel_is_ignored():
    frame = erspan_frame(2, 4, 4) + b"\xaa" * 4      # e.g. an FCS the capture kept
    d = decode_frame(frame)
    assert d.cls is FrameClass.ROCE_DATA and d.payload == PAYLOAD


def test_pcap_roundtrip(tmp_path):
    frames = [erspan_frame(t, 4, 4, session=t) for t in (1, 2, 3)]
    path = tmp_path / "erspan.pcap"
    write_pcap(path, frames)
    got = [decode_frame(fr.data, fr.linktype, fr.origlen) for fr in read_pcap(path)]
    assert [(d.cls, d.erspan_type, d.erspan_session) for d in got] == [
        (FrameClass.ROCE_DATA, 1, None), (FrameClass.ROCE_DATA, 2, 2), (FrameClass.ROCE_DATA, 3, 3)]


# --------------------------------------------------------------------------- broken frames

def _set_outer_ip_len(frame: bytearray, total: int):
    frame[14 + 2:14 + 4] = total.to_bytes(2, "big")


def test_malformed_and_truncated():
    good = erspan_frame(2, 4, 4, {"key_present": 1, "key": 1})
    gre_off = 14 + 20

    def cls(frame, **kw):
        d = decode_frame(bytes(frame), **kw)
        assert "decoder error" not in d.reason, d.reason
        return d

    # GRE version 2 does not exist
    f = bytearray(good)
    f[gre_off + 1] |= 0x02
    assert cls(f).cls is FrameClass.MALFORMED
    # ERSPAN type II header with version 2 in it
    f = bytearray(good)
    f[gre_off + 12] = (2 << 4) | (f[gre_off + 12] & 0x0F)
    d = cls(f)
    assert d.cls is FrameClass.MALFORMED and "version 2" in d.reason
    # outer IP packet ends inside the GRE optional words / inside the ERSPAN header
    for total in (20 + 2, 20 + 6, 20 + 14):
        f = bytearray(good)
        _set_outer_ip_len(f, total)
        assert cls(f).cls is FrameClass.MALFORMED, total
    # the capture stops inside the ERSPAN header / inside the inner frame
    assert cls(good[:gre_off + 14]).cls is FrameClass.TRUNCATED
    assert cls(good[:200]).cls is FrameClass.TRUNCATED
    assert cls(good[:200], origlen=len(good)).cls is FrameClass.TRUNCATED
    # a switch that truncated the mirrored frame says so with the T bit
    cut = bytes(outer(4, ERSPAN_II(session_id=1, t=1) / Raw(bytes(roce_frame(4))[:300]),
                      S_GRE(proto=0x88BE, seqnum_present=1)))
    d = cls(cut)
    assert d.cls is FrameClass.TRUNCATED and "T bit" in d.reason and d.erspan_session == 1
    # GRE carrying plain IP, enhanced GRE (version 1), ERSPAN III frame type 5: not mirrors
    assert cls(outer(4, inner_ip(4) / UDP(dport=4791), S_GRE(proto=0x0800))).cls is FrameClass.OTHER
    v1 = bytes(S_GRE(key_present=1, version=1, proto=0x880B, key=0x00040001)) + b"ppp!"
    d = cls(bytes(Ether() / IP(proto=47) / Raw(v1)))
    assert d.cls is FrameClass.OTHER and "version 1" in d.reason and d.tunnel_fault == "gre_unopened"
    d = cls(outer(4, ERSPAN_III(ft=5) / roce_frame(4), S_GRE(proto=0x22EB, seqnum_present=1)))
    assert d.cls is FrameClass.OTHER and "frame type 5" in d.reason
    # routing bit with SREs but no null SRE before the packet ends
    body = struct.pack(">HHHH", 0x4000, 0x88BE, 0, 0) + struct.pack(">HBB", 0x0800, 0, 4) + bytes(4)
    assert cls(bytes(Ether() / IP(proto=47) / Raw(body))).cls is FrameClass.MALFORMED
    # ERSPAN III says IP follows but the byte is no IP version
    d = cls(outer(4, ERSPAN_III(ft=2) / Raw(b"\x70" + bytes(60)), S_GRE(proto=0x22EB, seqnum_present=1)))
    assert d.cls is FrameClass.MALFORMED
    # fragmented tunnel packet
    src, dst = OUTER[4]
    frag = bytes(Ether() / IP(src=src, dst=dst, proto=47, flags="MF") / Raw(good[gre_off:gre_off + 64]))
    assert cls(frag).cls is FrameClass.OTHER and cls(frag).tunnel_fault == "gre_fragment"
    # IPv6 outer, raw-IP link type (a capture of the tunnel interface without Ethernet)
    raw6 = erspan_frame(3, 6, 4)[14:]
    assert cls(raw6, linktype=101).cls is FrameClass.ROCE_DATA


def test_random_corruption_never_raises():
    """Flip bytes all over the tunnel headers: every result is a class, never an exception."""
    rng = random.Random(6)
    bases = [erspan_frame(t, v, w, GRE_VARIANTS[g]) for t in (1, 2, 3) for v in (4, 6) for w in (4, 6)
             for g in ("plain", "csum_key")]
    seen = set()
    for i in range(3000):
        f = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(14, 14 + 40 + 16 + 12 + 14 + 40)   # outer IP .. inner IP
            f[pos] = rng.randrange(256)
        if i % 5 == 0:
            f = f[:rng.randrange(len(f))]
        d = decode_frame(bytes(f))
        assert isinstance(d.cls, FrameClass)
        assert "decoder error" not in d.reason, (d.reason, bytes(f).hex())
        seen.add(d.cls)
    assert {FrameClass.MALFORMED, FrameClass.TRUNCATED, FrameClass.OTHER} <= seen


# --------------------------------------------------------------------------- end to end

def _wrap(frame: bytes, etype: int, session: int, seq: int) -> bytes:
    """Ether/IPv4/GRE/ERSPAN around a captured frame, with struct (ckptd.testing.tunnel;
    scapy is checked against our decoder above, this only has to be fast)."""
    if etype == 1:
        return gre_tunnel(frame, 0x88BE, flags=0)
    if etype == 2:
        return erspan2(frame, session, seq)
    return gre_tunnel(frame, 0x22EB, struct.pack(">HHIHH", 2 << 12, session & 0x3FF, seq, 0, 0), seq=seq)


def test_replay_through_erspan_is_bit_exact(tmp_path):
    """A synthesized job whose mirror captures arrive wrapped in ERSPAN I, II and III
    (one type per stream) replays to the trainer's checkpoints, bit for bit."""
    from helpers import pcaps, run_replay, synth

    synth(tmp_path, ranks=3, channels=1, protocol="ll", mtu=1024, mirrors=3, loss=1e-3, iterations=3)
    for k, path in enumerate(pcaps(tmp_path)):
        frames = list(read_pcap(path))
        write_pcap(path, [(fr.ts_ns or 0, _wrap(bytes(fr.data), k + 1, 100 + k, i))
                          for i, fr in enumerate(frames)])
    first = next(iter(read_pcap(pcaps(tmp_path)[1])))
    assert decode_frame(first.data).erspan_session == 101
    reps = run_replay(tmp_path).reports
    assert [r.status for r in reps] == ["committed"] * 3 and all(r.exact for r in reps)


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_a_fragmented_mirror_tunnel_is_named_by_replay_and_inspect(tmp_path, capsys, path):
    """A remote mirror session whose path fragments its GRE packets loses the frames in
    them: replay warns (stream, count, why), inspect lists the reason, the other
    stream's copies still commit every iteration. Before, they were "other" frames and
    nothing said what had happened to the copies."""
    from ckptd.cli import main

    from helpers import pcaps, synth
    synth(tmp_path, ranks=2, channels=1, protocol="simple", mtu=2048, mirrors=2, iterations=3, seed=3)
    cut = 0
    for k, p in enumerate(pcaps(tmp_path)):
        out = []
        for i, fr in enumerate(read_pcap(p)):
            wrapped = erspan2(fr.data, 40 + k, i)
            if k == 1 and i % 7 == 3 and len(wrapped) > 1100:
                pieces = ip_fragments(wrapped)
                cut += 1
            else:
                pieces = [wrapped]
            out += [(fr.ts_ns, x) for x in pieces]
        write_pcap(p, out)
    assert cut > 20
    args = ["--plan", str(tmp_path / "plan.json"), "--init", str(tmp_path / "init.pt"), "--out",
            str(tmp_path / f"out-{path}"), "--reference", str(tmp_path / "reference")] + pcaps(tmp_path)
    assert main(["replay"] + (["--reference-path"] if path == "reference" else []) + args) == 0
    out, err = capsys.readouterr()
    assert "3 iterations, 3 committed, 0 not recovered" in out and out.count("bit-exact") == 3
    assert f"gre_fragment={2 * cut}" in out  # the stream's line counts them among its classes
    warned = [line for line in err.splitlines() if "fragments of GRE" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: stream mirror1: {2 * cut} frames were IP "
                                                      "fragments of GRE packets"), err
    assert "MTU" in warned[0]
    assert main(["inspect", "--json"] + pcaps(tmp_path)) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["other_reasons"]["IP fragment (GRE)"] == 2 * cut  # (beside the job's other UDP)
    assert [fi["other_reasons"].get("IP fragment (GRE)") for fi in res["files"]] == [None, 2 * cut]
    assert main(["inspect"] + pcaps(tmp_path)) == 0
    assert f"Other: IP fragment (GRE) {2 * cut}" in capsys.readouterr().out  # the most frequent first
