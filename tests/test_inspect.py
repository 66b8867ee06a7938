"""ckptd.tools.inspect: counts and flows over captures, synthetic and real."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ckptd.tools.inspect import format_inspect, inspect_captures
from parsers import icrc
from parsers.pcap import write_pcap
from parsers.roce import FrameClass

FLOWCHECK = Path(__file__).resolve().parents[1].parent / "shared" / "pcaps" / "flowcheck"
CLASSES = {c.value for c in FrameClass}


def _roce_v4(opcode, dest_qp, psn, ext=b"", payload=b"", good=True):
    """Ethernet/IPv4/UDP/BTH frame built by hand, ICRC from parsers.icrc (checked
    against scapy in test_parsers)."""
    pad = (-len(payload)) % 4
    bth = struct.pack(">BBHII", opcode, pad << 4, 0xFFFF, dest_qp, psn)
    udp_payload = bth + ext + payload + b"\0" * pad + b"\0\0\0\0"
    udp = struct.pack(">HHHH", 50000, 4791, 8 + len(udp_payload), 0) + udp_payload
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0,
                     bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2])) + udp
    frame = bytearray(b"\x02" * 6 + b"\x04" * 6 + b"\x08\x00" + ip)
    frame[-4:] = icrc.pack(icrc.compute(frame, 14, 34, len(frame) - 4) ^ (0 if good else 1))
    return bytes(frame)


def _synthetic(tmp_path):
    reth = lambda n: struct.pack(">QII", 0x1000, 7, n)
    frames = [
        _roce_v4(0x06, 5, 100, reth(2048 + 10), b"a" * 1024),
        _roce_v4(0x07, 5, 101, b"", b"b" * 1024),
        _roce_v4(0x09, 5, 102, struct.pack("<I", 2058), b"c" * 10),
        _roce_v4(0x0B, 5, 103, reth(0) + struct.pack("<I", 0), b""),
        _roce_v4(0x11, 9, 103, bytes.fromhex("1f000002")),
        _roce_v4(0x0A, 6, 0, reth(32), b"d" * 32, good=False),
        _roce_v4(0xAA, 6, 1, b"", b"zz"),
        b"\x02" * 12 + b"\x08\x06" + b"\0" * 28,                     # ARP: other
    ]
    path = tmp_path / "syn.pcap"
    write_pcap(path, [(1000 * i, f) for i, f in enumerate(frames)])
    path2 = tmp_path / "cut.pcap"
    path2.write_bytes(path.read_bytes()[:-5])                          # last record cut
    return path, path2


def test_inspect_synthetic(tmp_path):
    path, cut = _synthetic(tmp_path)
    r = inspect_captures([path])
    assert json.loads(json.dumps(r)) == r
    # the unknown opcode carries a good ICRC (the check does not need the opcode)
    assert (r["frames"], r["roce_frames"], r["icrc_valid"], r["icrc_invalid"]) == (8, 7, 6, 1)
    assert set(r["classes"]) == CLASSES
    assert r["classes"] == {"roce_data": 4, "roce_ack": 1, "other": 1, "truncated": 0,
                            "bad_icrc": 1, "unknown_opcode": 1, "malformed": 0}
    flows = {(f["src"], f["dst"], f["dest_qp"]): f for f in r["flows"]}
    assert set(flows) == {("10.0.0.1", "10.0.0.2", 5), ("10.0.0.1", "10.0.0.2", 9),
                          ("10.0.0.1", "10.0.0.2", 6)}    # the unknown opcode makes no flow
    f5 = flows[("10.0.0.1", "10.0.0.2", 5)]
    assert f5["packets"] == 4 and f5["messages"] == 2
    assert f5["payload_bytes"] == 2058 and f5["dma_lengths"] == [2058, 0]
    assert (f5["first_psn"], f5["last_psn"]) == (100, 103)
    assert f5["opcodes"] == {"RC_RDMA_WRITE_FIRST": 1, "RC_RDMA_WRITE_MIDDLE": 1,
                             "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE": 1,
                             "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE": 1}
    assert f5["imm"] == ["0a080000", "00000000"] and f5["files"] == {str(path): 4}
    f9 = flows[("10.0.0.1", "10.0.0.2", 9)]
    assert f9["first_psn"] is None and f9["last_ack_psn"] == 103 and f9["last_msn"] == 2
    assert flows[("10.0.0.1", "10.0.0.2", 6)]["icrc_invalid"] == 1
    text = format_inspect(r)
    assert "8 frames" in text and "ICRC valid 6, invalid 1" in text and "WRITE_FIRST:1" in text

    # a broken file: its good frames are counted and the error is reported, named
    r2 = inspect_captures([path, cut])
    assert r2["frames"] == 8 + 7 and len(r2["errors"]) == 1
    assert "cut.pcap" in r2["errors"][0] and "frame 8" in r2["errors"][0]
    assert r2["files"][1]["error"] == r2["errors"][0]
    assert "frame 8" in format_inspect(r2)
    f5 = {(f["src"], f["dst"], f["dest_qp"]): f for f in r2["flows"]}[("10.0.0.1", "10.0.0.2", 5)]
    assert f5["packets"] == 8 and f5["files"] == {str(path): 4, str(cut): 4}
    # the same PSNs in a second file are a second view, not retransmissions
    assert (f5["psn_gaps"], f5["psn_missing"], f5["psn_repeats"]) == (0, 0, 0)


needs_real = pytest.mark.skipif(not FLOWCHECK.is_dir(), reason=f"real captures not at {FLOWCHECK}")


@needs_real
def test_inspect_rdma32():
    r = inspect_captures(FLOWCHECK / "rdma32.pcapng")
    assert json.loads(json.dumps(r)) == r
    assert (r["frames"], r["roce_frames"], r["icrc_valid"], r["icrc_invalid"]) == (175, 123, 116, 7)
    assert r["classes"]["unknown_opcode"] == 7 and r["classes"]["other"] == 52
    assert r["classes"]["roce_ack"] == 22 and r["classes"]["roce_data"] == 94
    assert r["opcodes"]["UNKNOWN_0xaa(XRC)"] == 7
    assert sum(f["packets"] for f in r["flows"]) == 123 - 7
    assert all(f["icrc_invalid"] == 0 for f in r["flows"])


@needs_real
def test_inspect_all_real_captures():
    paths = sorted(FLOWCHECK.glob("*.pcapng"))
    r = inspect_captures(paths)
    json.dumps(r)
    assert len(r["files"]) == 12 and not r["errors"]
    assert (r["roce_frames"], r["icrc_valid"], r["icrc_invalid"]) == (4681, 4674, 7)
    assert r["frames"] == sum(fi["frames"] for fi in r["files"]) == 7770
    assert sum(r["classes"].values()) == r["frames"]
    assert r["opcodes"]["RC_ACKNOWLEDGE"] == 26 + 25 + 23 + 30 + 9 + 106 + 302 + 106 + 16 + 24 + 9 + 22
    # same answer one file at a time
    assert sum(inspect_captures(p)["roce_frames"] for p in paths) == 4681
    # allreduce_addstep: the 4 LL data QPs of the ring, each with 3 messages (the third
    # is the next allreduce, cut off), and 4 clear-to-send QPs of 32-byte writes
    (addstep,) = [fi for fi in r["files"] if fi["path"].endswith("allreduce_addstep.pcapng")]
    flows = [f for f in r["flows"] if addstep["path"] in f["files"]]
    data = sorted((f["src"][-4:], f["dest_qp"], tuple(f["dma_lengths"])) for f in flows
                  if f["dma_lengths"] and f["dma_lengths"][0] != 32)
    assert data == [("282c", 2082, (16384, 7232, 16384)), ("282c", 2085, (16384, 0, 16384)),
                    ("58f8", 2325, (7232, 16384, 7232)), ("58f8", 2327, (0, 16384, 0))]
    cts = [f for f in flows if f["dma_lengths"] and set(f["dma_lengths"]) == {32}]
    assert len(cts) == 4 and all(f["messages"] == 3 and f["payload_bytes"] == 96 for f in cts)
    # the one place a capture lost packets: iter_80000.pcapng, QP 3225, PSN 62..76
    lossy = [(f["dest_qp"], f["psn_gaps"], f["psn_missing"]) for f in r["flows"]
             if f["psn_gaps"] or f["psn_repeats"]]
    assert lossy == [(3225, 1, 15)]
    text = format_inspect(r)
    assert "4681 RoCEv2" in text and "fe80::e42:a1ff:fe9f:58f8" in text


def test_reordered_packets_are_late_not_lost(tmp_path):
    """A mirror that swaps neighbouring frames (no loss): inspect counted each swap within
    a flow as a lost PSN and a retransmission, and showed the last PSN seen as the end of
    the range, not the highest."""
    from ckptd.testing.synth import SynthOptions, synthesize
    synthesize(SynthOptions(out=str(tmp_path), ranks=2, channels=1, mirrors=1, iterations=2, model="tiny",
                            reorder=0.05, psn_wrap=True, noise=False))
    r = inspect_captures([tmp_path / "mirrors" / "mirror0.pcap"])
    data = [f for f in r["flows"] if f["first_psn"] is not None]
    assert [f["psn_missing"] for f in data] == [0] * len(data)
    assert [f["psn_repeats"] for f in data] == [0] * len(data)
    assert sum(f["psn_late"] for f in data) > 0
    assert all(f["psn_late"] <= f["psn_gaps"] for f in data)
