"""The 12 FlowCheck captures from real ConnectX-6 NICs (see their README.md): ground
truth for the packet layer.  Counts below are the README's, which were made with
dpkt + zlib, independently of this project's code; this file also recounts with dpkt
and rechecks ICRCs with scapy, so a disagreement points at the decoder, not the data.
"""
from __future__ import annotations

import struct
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from parsers.capfile import open_capture
from parsers.roce import FrameClass, decode_frame

FLOWCHECK = Path(__file__).resolve().parents[1].parent / "shared" / "pcaps" / "flowcheck"
if not FLOWCHECK.is_dir():
    pytest.skip(f"real captures not found at {FLOWCHECK} (the shared/ checkout beside the repo)",
                allow_module_level=True)

# file: (frames, UDP/4791 frames, {BTH opcode: count})  -- README table
EXPECTED = {
    "allreduce+p2p.pcapng": (837, 150, {6: 8, 7: 84, 9: 8, 10: 10, 11: 2, 17: 26, 100: 12}),
    "allreduce+partial_p2p.pcapng": (867, 120, {6: 7, 7: 70, 9: 7, 10: 9, 11: 2, 17: 25}),
    "allreduce+partial_p2p_new.pcapng": (823, 118, {6: 7, 7: 70, 9: 7, 10: 9, 11: 2, 17: 23}),
    "allreduce_addstep.pcapng": (404, 156, {6: 9, 7: 94, 9: 8, 10: 12, 11: 3, 17: 30}),
    "iter_40000_p2p.pcapng": (102, 102, {6: 4, 7: 80, 9: 4, 10: 3, 11: 2, 17: 9}),
    "iter_40000_p2p_iter10.pcapng": (1417, 1417, {6: 61, 7: 878, 9: 61, 10: 41, 11: 4, 17: 106, 100: 266}),
    "iter_40000_p2p_iter10_2.pcapng": (1634, 1223, {6: 101, 7: 248, 9: 101, 10: 106, 11: 5, 17: 302, 100: 360}),
    "iter_40000_p2p_iter10_3.pcapng": (665, 665, {6: 61, 7: 128, 9: 61, 10: 41, 11: 4, 17: 106, 100: 264}),
    "iter_40000_p2p_iter2.pcapng": (171, 171, {6: 7, 7: 122, 9: 7, 10: 5, 11: 4, 17: 16, 100: 10}),
    "iter_80000.pcapng": (483, 244, {6: 6, 7: 198, 9: 4, 10: 9, 11: 3, 17: 24}),
    "iter_80000_p2p.pcapng": (192, 192, {6: 5, 7: 168, 9: 5, 10: 3, 11: 2, 17: 9}),
    "rdma32.pcapng": (175, 123, {6: 4, 7: 40, 8: 2, 9: 2, 10: 40, 11: 6, 17: 22, 170: 7}),
}
ALLREDUCE = ["allreduce_addstep.pcapng", "allreduce+p2p.pcapng",
             "allreduce+partial_p2p.pcapng", "allreduce+partial_p2p_new.pcapng"]


def decoded(name):
    """[(CapturedFrame, RoceFrame)] for one capture, decoded once per test session."""
    if name not in _cache:
        _cache[name] = [(f, decode_frame(f.data, f.linktype, f.origlen))
                        for f in open_capture(FLOWCHECK / name)]
    return _cache[name]


_cache: dict = {}


def test_all_twelve_present():
    assert sorted(p.name for p in FLOWCHECK.glob("*.pcapng")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_per_file_counts(name):
    frames, roce, opcodes = EXPECTED[name]
    got = decoded(name)
    assert len(got) == frames
    assert [f.index for f, _ in got] == list(range(1, frames + 1))
    assert all(f.linktype == 1 and f.caplen == f.origlen == len(f.data) for f, _ in got)
    ts = [f.ts_ns for f, _ in got]
    assert all(1_700_000_000 * 10**9 < t < 1_800_000_000 * 10**9 for t in ts)   # Nov/Dec 2023, us resolution
    assert all(t % 1000 == 0 for t in ts)
    rf = [d for _, d in got if d.is_roce]
    assert len(rf) == roce
    assert dict(Counter(d.bth.opcode for d in rf)) == opcodes
    # nothing is truncated or malformed; everything that is not UDP/4791 is OTHER
    classes = Counter(d.cls for _, d in got)
    assert classes[FrameClass.TRUNCATED] == classes[FrameClass.MALFORMED] == 0
    assert classes[FrameClass.OTHER] == frames - roce
    assert classes[FrameClass.ROCE_ACK] == opcodes.get(17, 0)
    assert classes[FrameClass.UNKNOWN_OPCODE] == opcodes.get(170, 0)
    assert classes[FrameClass.ROCE_DATA] == roce - opcodes.get(17, 0) - opcodes.get(170, 0)
    for d in rf:
        assert d.ip.version == 6 and d.src.is_link_local and d.dst.is_link_local


def test_totals_and_icrc():
    total = valid = 0
    invalid = []
    for name in EXPECTED:
        for f, d in decoded(name):
            if d.is_roce:
                total += 1
                if d.icrc_ok:
                    valid += 1
                else:
                    invalid.append((name, f.index, d.bth.opcode, d.cls))
    assert total == 4681 and valid == 4674
    assert len(invalid) == 7
    assert all(n == "rdma32.pcapng" and op == 170 and c is FrameClass.UNKNOWN_OPCODE
               for n, _, op, c in invalid)


def test_payload_lengths_follow_the_mtu():
    """MIDDLE packets carry exactly one path MTU; messages add up to their RETH length."""
    for name in EXPECTED:
        mtu = 4096 if name in ("iter_40000_p2p_iter10_2.pcapng", "iter_40000_p2p_iter10_3.pcapng") else 1024
        for _, d in decoded(name):
            if d.cls is FrameClass.ROCE_DATA:
                assert d.bth.padcnt == (-d.payload_len) % 4     # NICs pad to 4 bytes
                if d.bth.opcode == 7:
                    assert d.payload_len == mtu, name
                if d.bth.opcode == 6:
                    assert d.payload_len == mtu and d.reth.dma_len > mtu
                if d.bth.opcode in (10, 11):
                    assert d.payload_len == d.reth.dma_len
                if d.bth.opcode == 100:
                    assert d.bth.dest_qp == 1 and d.deth is not None


def messages(name):
    """{(src, dst, dest QP): [message dict]} for RDMA writes, in capture order."""
    out = defaultdict(list)
    for f, d in decoded(name):
        if d.cls is not FrameClass.ROCE_DATA or not d.opcode.is_write:
            continue
        key = (str(d.src), str(d.dst), d.bth.dest_qp)
        if d.opcode.starts_message:
            out[key].append({"dma_len": d.reth.dma_len, "payload": b"", "imm": None,
                             "psns": [], "complete": False})
        elif not out[key]:
            continue      # tail of a message begun before the capture started
        m = out[key][-1]
        m["payload"] += d.payload
        m["psns"].append(d.bth.psn)
        if d.immdt is not None:
            m["imm"] = d.immdt
        m["complete"] = d.opcode.ends_message
    return out


def test_write_messages_are_consistent():
    """Within a message PSNs are consecutive and the payload adds up to the RETH length,
    except for one gap: iter_80000.pcapng lost 15 packets of QP 3225 (PSN 62..76) from
    the capture, although the receiver's next ACK covers PSN 79 - the mirror dropped
    them, not the network.  A decoder downstream must expect that."""
    gaps = []
    for name in EXPECTED:
        for key, ms in messages(name).items():
            for m in ms:
                psns = m["psns"]
                for a, b in zip(psns, psns[1:]):
                    if b != a + 1:
                        gaps.append((name, key[2], a, b))
                if m["complete"] and psns == list(range(psns[0], psns[0] + len(psns))):
                    assert len(m["payload"]) == m["dma_len"], (name, key)
                    if m["imm"] is not None and name != "rdma32.pcapng":
                        # NCCL 2.19 puts the size in the immediate, host (little-endian) order
                        assert m["imm"].le == m["dma_len"], (name, key)
    assert gaps == [("iter_80000.pcapng", 3225, 61, 77)]
    acks = [d for _, d in decoded("iter_80000.pcapng")
            if d.cls is FrameClass.ROCE_ACK and d.bth.dest_qp == 1299]
    assert acks[-1].bth.psn == 79 and acks[-1].aeth.kind == "ACK"


def test_rdma32_zero_length_imm_carries_size():
    """rdma32.pcapng writes data without immediate and then signals with a zero-length
    WRITE_ONLY_WITH_IMMEDIATE whose immediate (little-endian) is the size written."""
    seen = []
    for key, ms in messages("rdma32.pcapng").items():
        for m in ms:
            if m["dma_len"] == 0 and m["imm"] is not None:
                seen.append(m["imm"].le)
    assert 16384 in seen and 0 in seen


def _ll_lines(payload):
    return [struct.unpack_from("<IIII", payload, i) for i in range(0, len(payload), 16)]


@pytest.mark.parametrize("name", ALLREDUCE)
def test_allreduce_ll_flags(name):
    """README: 2 ranks x 2 channels, protocol LL.  Per direction channel 0 sends 7232 then
    16384 bytes, channel 1 sends 0 then 16384 (the other direction the mirror image);
    LL lines are {data, flag, data, flag}, the flag the same on every line of a message
    and one more per message on its QP, zero-length messages included."""
    ends = ("58f8", "282c")
    msgs = messages(name)
    allreduce_qps = {k: ms for k, ms in msgs.items()
                     if k[0].endswith(ends) and k[1].endswith(ends)
                     and ms[0]["dma_len"] in (0, 7232, 16384) and len(ms) >= 2}
    sizes = sorted((k[0][-4:], ms[0]["dma_len"], ms[1]["dma_len"]) for k, ms in allreduce_qps.items())
    assert sizes == [("282c", 16384, 0), ("282c", 16384, 7232),
                     ("58f8", 0, 16384), ("58f8", 7232, 16384)]
    lines_checked = 0
    for key, ms in allreduce_qps.items():
        for k, m in enumerate(ms):
            payload = m["payload"]
            assert len(payload) % 16 == 0
            for d0, f0, d1, f1 in _ll_lines(payload):
                assert f0 == f1 == k + 1, (name, key, k)
                # int32 gradient values: i % 10 (reduce-scatter) or 2 * (i % 10) (allgather)
                assert d0 <= 18 and d1 <= 18
                lines_checked += 1
    assert lines_checked >= (7232 + 16384 + 16384) // 16 * 2    # both directions, 2 messages each
    # the 32-byte clear-to-send writes ride on other QPs, never LL-formatted
    cts = [k for k, ms in msgs.items() if all(m["dma_len"] == 32 for m in ms)]
    assert len(cts) >= 4 and not set(cts) & set(allreduce_qps)


def test_cross_check_with_dpkt():
    """An independent parse (dpkt) finds the same UDP/4791 frames and opcodes."""
    dpkt = pytest.importorskip("dpkt")
    for name, (frames, roce, opcodes) in EXPECTED.items():
        n, ours = 0, [f.index for f, d in decoded(name) if d.is_roce]
        theirs, ops = [], Counter()
        with open(FLOWCHECK / name, "rb") as fh:
            for ts, buf in dpkt.pcapng.Reader(fh):
                n += 1
                eth = dpkt.ethernet.Ethernet(buf)
                ip = eth.data
                if isinstance(ip, (dpkt.ip.IP, dpkt.ip6.IP6)) and isinstance(ip.data, dpkt.udp.UDP) \
                        and ip.data.dport == 4791:
                    theirs.append(n)
                    ops[bytes(ip.data.data)[0]] += 1
        assert n == frames and ours == theirs and dict(ops) == opcodes, name


@pytest.mark.parametrize("name", ["rdma32.pcapng", "allreduce_addstep.pcapng"])
def test_cross_check_icrc_with_scapy(name):
    """scapy.contrib.roce recomputes the ICRC independently; it agrees frame by frame."""
    pytest.importorskip("scapy")
    from scapy.contrib.roce import BTH
    from scapy.layers.l2 import Ether
    for f, d in decoded(name):
        if not d.is_roce:
            continue
        pkt = Ether(f.data)
        theirs = pkt[BTH].compute_icrc(None)
        assert (theirs == f.data[-4:]) == d.icrc_ok, f.index


@pytest.mark.parametrize("name", ALLREDUCE)
def test_connection_pairs_share_udp_source_port(name):
    """Both directions of one RC connection use one UDP source port: each LL data flow
    pairs with exactly one reverse flow of 32-byte clear-to-send writes."""
    sports = defaultdict(set)
    for _, d in decoded(name):
        if d.cls is FrameClass.ROCE_DATA and d.opcode.is_write:
            sports[(str(d.src), str(d.dst), d.bth.dest_qp)].add(d.sport)
    assert all(len(s) == 1 for s in sports.values())
    msgs = messages(name)
    for key, ms in msgs.items():
        if ms[0]["dma_len"] == 32:
            continue
        (sport,) = sports[key]
        partners = [k for k in sports if sports[k] == {sport} and k != key]
        assert len(partners) == 1, (name, key)
        src, dst, _ = partners[0]
        assert (src, dst) == (key[1], key[0])                     # the opposite direction
        assert {m["dma_len"] for m in msgs[partners[0]]} == {32}  # carrying the CTS writes
