"""TCP/gloo: TCP decode, reassembly, gloo framing, ring schedule, and a real DDP run.

The end-to-end test trains a real 3-rank DDP job on gloo over 127.0.0.1 while tcpdump
captures lo, decodes the capture with parsers.tcp / ckptd.transports.gloo.tcpstream / ckptd.transports.gloo.framing /
ckptd.transports.gloo.extract, applies AdamW with the shadow, and compares every iteration with
rank 0's own checkpoint bit for bit; then the same capture split into two lossy
mirror streams (each dropping different segments) must still give exact checkpoints,
and one lossy stream alone must report its missing ranges, never a wrong checkpoint.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ckptd.transports.gloo.framing import (HEADER_LEN, NOTIFY_RECV_READY, NOTIFY_SEND_READY, SEND_UNBOUND_BUFFER,
                        GlooFramer, GlooRingSchedule, Header, decode_rebuilt_buckets, message,
                        ring_segments, slot_of)
from ckptd.core.schedule import AG, RS, Bucket
from ckptd.transports.gloo.tcpstream import Direction, Piece, TcpReassembler
from parsers.ethernet import Ethernet
from parsers.ipv4 import PROTO_TCP, IPv4
from parsers.tcp import ACK, PSH, SYN, TCP, decode_tcp_frame

REPO = Path(__file__).resolve().parents[1]


# -- helpers -----------------------------------------------------------------------
def frame(payload: bytes, seq: int, flags: int = ACK | PSH, sport=40000, dport=50000,
          src="10.0.0.2", dst="10.0.0.1", options: bytes = b"", ack: int = 1) -> bytes:
    import ipaddress
    tcp = TCP(options=options, sport=sport, dport=dport, seq=seq % (1 << 32), ack=ack % (1 << 32), flags=flags,
              window=512, checksum=0xBEEF)  # a partial checksum, as veth captures carry
    ip = IPv4(proto=PROTO_TCP, total_len=20 + tcp.hdr_len + len(payload),
              src=int(ipaddress.IPv4Address(src)), dst=int(ipaddress.IPv4Address(dst)))
    eth = Ethernet(dst=2, src=1, type=0x0800)
    return eth.pack() + ip.pack() + tcp.pack() + payload


def seg(payload: bytes, seq: int, **kw):
    s, why = decode_tcp_frame(frame(payload, seq, **kw))
    assert s is not None, why
    return s


def collect(pieces) -> tuple[bytes, list[tuple[int, int]]]:
    out, holes = bytearray(), []
    for p in pieces:
        if p.data is None:
            holes.append((p.offset, p.end))
            out += b"\0" * p.length
        else:
            out += p.data
    return bytes(out), holes


# -- parsers/tcp.py ------------------------------------------------------------------
def test_tcp_header_decode():
    opts = b"\x02\x04\x05\xb4\x01\x01\x08\x0a" + b"\0" * 8  # MSS, NOP, NOP, timestamps
    s = seg(b"hello", 0xFFFFFFF0, flags=SYN | ACK, options=opts)
    assert (s.tcp.sport, s.tcp.dport, s.seq, s.tcp.ack) == (40000, 50000, 0xFFFFFFF0, 1)
    assert s.tcp.hdr_len == 20 + len(opts) and s.tcp.options == opts
    assert s.tcp.flag_names() == "SYN|ACK" and bytes(s.payload) == b"hello"
    assert s.key == ("10.0.0.2", 40000, "10.0.0.1", 50000)
    assert s.tcp.checksum == 0xBEEF  # kept, never checked
    none, why = decode_tcp_frame(frame(b"x", 1)[:14 + 20 + 10])
    assert none is None and "TCP" in why


# -- ckptd/transports/gloo/tcpstream.py --------------------------------------------------------------
def test_reassembly_reorder_duplicates_retransmits_and_wrap():
    data = bytes(random.Random(1).randrange(256) for _ in range(5000))
    isn = (1 << 32) - 1000  # the sequence numbers wrap inside the stream
    segs = [seg(b"", isn, flags=SYN)]
    cuts = [0, 700, 1400, 2100, 3000, 4200, 5000]
    for a, b in zip(cuts, cuts[1:]):
        segs.append(seg(data[a:b], isn + 1 + a))
    segs.append(seg(data[500:2500], isn + 1 + 500))  # a retransmission, new boundaries
    segs.append(segs[3])  # a duplicate
    rng = random.Random(2)
    body = segs[1:]
    rng.shuffle(body)
    d = Direction(("k",))
    got = []
    for s in [segs[0]] + body:
        got += d.add(s, 0)
    got += d.flush()
    out, holes = collect(got)
    assert out == data and holes == [] and not d.conflicts
    assert d.counts["duplicate_bytes"] > 0


def test_reassembly_hole_is_exact_and_never_filled_by_invention():
    data = bytes(range(256)) * 8
    d = Direction(("k",))
    d.add(seg(b"", 99, flags=SYN), 0)
    got = d.add(seg(data[:100], 100), 0)
    got += d.add(seg(data[300:], 400), 0)  # bytes 100..300 never arrive
    assert collect(got)[0] == data[:100]  # held back behind the hole
    assert d.missing() == [(100, 300)]
    got += d.flush()
    out, holes = collect(got)
    assert holes == [(100, 300)] and out[:100] == data[:100] and out[300:] == data[300:]
    d.add(seg(data[100:300], 200), 0)  # too late: counted, not spliced in
    assert d.counts["late_bytes"] == 200 and d.holes == [(100, 300)]


def test_reassembly_merges_mirror_streams_and_flags_conflicts():
    data = bytes(random.Random(3).randrange(256) for _ in range(3000))
    r = TcpReassembler()
    got = [p for _, p in r.feed(seg(b"", 0, flags=SYN), 0)]
    got += [p for _, p in r.feed(seg(data[:1000], 1), 0)]
    got += [p for _, p in r.feed(seg(data[2000:], 2001), 0)]  # stream 0 lost 1000..2000
    got += [p for _, p in r.feed(seg(data[1000:2000], 1001), 1)]  # stream 1 has it
    got += [p for _, p in r.feed(seg(data[:1500], 1), 1)]  # stream 1's duplicate copy
    got += [p for _, p in r.flush()]
    out, holes = collect(got)
    assert out == data and holes == []
    assert {p.stream for p in got} == {0, 1}
    d = r.dirs[seg(b"", 0).key]
    bad = bytearray(data[2500:2600])
    bad[10] ^= 1
    d.add(seg(data[2600:2700], 2601), 2)
    d.add(seg(bytes(bad), 2501), 2)  # already delivered: a late copy, compared all the same
    assert d.conflicts == [(2500, 2600, 2)]
    r2 = Direction(("k2",))
    r2.add(seg(b"", 0, flags=SYN), 0)
    r2.add(seg(data[100:200], 101), 0)
    bad2 = bytearray(data[150:250])
    bad2[0] ^= 1
    r2.add(seg(bytes(bad2), 151), 1)
    assert r2.conflicts == [(150, 200, 1)]


def test_a_late_copy_over_a_hole_and_delivered_bytes_is_compared_where_delivered():
    """A retransmission covering a given-up hole and the bytes after it: its copy of the
    delivered bytes was never compared (the whole segment skipped for touching the hole),
    so a delivered copy that differed from it was committed without a word."""
    data = bytes(range(256)) * 8
    d = Direction(("k",))
    d.add(seg(b"", 99, flags=SYN), 0)
    d.add(seg(data[:100], 100), 0)
    bad = bytearray(data[300:600])
    bad[50] ^= 1  # byte 350 as the first copy delivered it
    d.add(seg(bytes(bad), 400), 0)
    d.flush()  # 100..300 given up
    assert d.holes == [(100, 300)]
    d.add(seg(data[50:500], 150), 1)  # bytes 50..500 again: delivered, the hole, delivered
    assert d.conflicts == [(300, 500, 1)] and d.holes == [(100, 300)]
    assert d._outside_holes(0, 400) == [(0, 100), (300, 400)] and d._outside_holes(120, 200) == []


def test_a_mirror_copy_lagging_past_what_is_retained_is_counted_unchecked():
    """A copy of bytes delivered more than RETAIN ago cannot be compared any more: the
    first copy stands, and the bytes are counted (a diagnostic), never silently passed."""
    from ckptd.transports.gloo.tcpstream import RETAIN
    d = Direction(("k",))
    d.add(seg(b"", 0, flags=SYN), 0)
    chunk = bytes(range(256)) * 128  # 32 KiB
    n = RETAIN // len(chunk) + 2
    for k in range(n):
        d.add(seg(chunk, 1 + k * len(chunk)), 0)
    d.add(seg(b"x" * 100, 1), 1)  # the first bytes again, on another mirror, differing
    assert d.counts["unchecked_copy_bytes"] == 100 and not d.conflicts
    d.add(seg(b"x" * 100, 1 + (n - 1) * len(chunk)), 1)  # recent ones are still compared
    assert d.conflicts == [((n - 1) * len(chunk), (n - 1) * len(chunk) + 100, 1)]


def test_reassembly_sees_a_lost_tail_in_the_other_directions_acknowledgments():
    """A loss in a direction's last bytes leaves no hole (nothing follows it); the
    receiver's acknowledgments, or the FIN's place, show whether the bytes seen end
    where the sender's did."""
    back = {"sport": 50000, "dport": 40000, "src": "10.0.0.1", "dst": "10.0.0.2"}
    isn = (1 << 32) - 300  # the acknowledgment numbers wrap too

    def run(acks: list[int], fin_at: int | None = None, sent: int = 1000) -> Direction:
        r = TcpReassembler()
        r.feed(seg(b"", isn, flags=SYN), 0)
        for a in range(0, sent, 250):
            r.feed(seg(b"x" * 250, isn + 1 + a), 0)
        if fin_at is not None:
            r.feed(seg(b"", isn + 1 + fin_at, flags=ACK | 0x01), 0)
        for a in acks:  # offsets acknowledged, as sequence numbers of the sender
            r.feed(seg(b"", 7, ack=isn + 1 + a, **back), 0)
        return r.dirs[seg(b"", 0).key]

    assert run([500, 1000]).tail_seen() and run([500, 1000]).acked == 1000
    assert not run([500, 1250], sent=1000).tail_seen()  # bytes 1000..1250 were lost
    assert not run([500]).tail_seen()  # the last acknowledgment was not captured: unknown
    assert not run([]).tail_seen()
    assert run([1250, 500], sent=1250).tail_seen()  # a reordered, older ack does not count
    assert run([], fin_at=1000).tail_seen() and run([1001], fin_at=1000).tail_seen()
    assert not run([1001], fin_at=1000, sent=750).tail_seen()  # lost just before the FIN


# -- ckptd/transports/gloo/framing.py ---------------------------------------------------------------------
def test_ring_segments_match_the_wire():
    # seen on the wire (scripts/ddp_gloo_train.py, 3 ranks): a 7354408-byte bucket went
    # as 817160-byte segments, the last 817128
    assert ring_segments(7354408, 3, 4) == (9, 3, 817160)
    assert 7354408 - 8 * 817160 == 817128
    assert ring_segments(100, 3, 4) == (6, 2, 20)
    assert ring_segments(3 << 20, 2, 4) == (4, 2, 786432)


@pytest.mark.parametrize("nranks,count", [(2, 10), (3, 1838602), (3, 7), (4, 300001), (5, 12)])
def test_ring_schedule_covers_every_element(nranks, count):
    sched = GlooRingSchedule(nranks, [Bucket(count, np.dtype("float32"))])
    assert (sched.ag_copies(0) == nranks - 1).all()
    n, k, _ = ring_segments(count * 4, nranks, 4)
    for r in range(nranks):
        sends = sched.connection_sends(r, 0)
        rs = [s for s in sends if s.phase == RS]
        ag = [s for s in sends if s.phase == AG]
        assert [s.index for s in sends] == list(range(len(sends)))
        own = [s for s in ag if s.segment // k == r]
        assert ag[:len(own)] == own  # its own (reduced) chunk goes first
        assert len(rs) <= n - k and len(ag) <= n - k


def _stream(msgs: list[bytes], preamble: int | None = None) -> bytes:
    return (b"" if preamble is None else struct.pack("<q", preamble)) + b"".join(msgs)


def test_framer_messages_split_anywhere():
    slot = slot_of(4, 7)
    body = [np.arange(i, i + 25, dtype="<f4").tobytes() for i in range(3)]
    msgs = [message(NOTIFY_SEND_READY, slot, length=100), message(SEND_UNBOUND_BUFFER, slot, body[0]),
            message(NOTIFY_RECV_READY, slot, length=100), message(SEND_UNBOUND_BUFFER, slot, body[1]),
            message(SEND_UNBOUND_BUFFER, slot_of(6, 8), b"x" * 13)]
    raw = _stream(msgs, preamble=2)
    for step in (1, 7, 48, 1000):
        fr = GlooFramer(True, lambda h: True)
        out = []
        for off in range(0, len(raw), step):
            out += fr.feed(Piece(off, raw[off:off + step], 0))
        assert fr.sequence == 2
        assert [m.header.opcode for m in out] == [2, 1, 3, 1, 1]
        assert bytes(out[1].payload) == body[0] and out[1].complete
        assert out[2].header.length == 100 and out[2].header.nbytes == HEADER_LEN


def test_framer_hole_inside_payload_keeps_framing_and_resyncs_after_lost_header():
    slot = slot_of(4, 9)
    body = [np.full(64, i, "<f4").tobytes() for i in range(6)]
    msgs = [message(SEND_UNBOUND_BUFFER, slot, b) for b in body]
    raw = _stream(msgs)
    size = len(msgs[0])
    fr = GlooFramer(False, lambda h: h.length == 256)
    out = fr.feed(Piece(0, raw[:60], 0))
    out += fr.feed(Piece(60, None, -1, 100))  # inside message 0's payload
    out += fr.feed(Piece(160, raw[160:size + 10], 0))
    out += fr.feed(Piece(size + 10, None, -1, size))  # cuts message 1's preamble, and 2's
    out += fr.feed(Piece(2 * size + 10, raw[2 * size + 10:], 0))
    out += fr.flush()
    assert out[0].have == [(0, 12, 0), (112, 256, 0)] and not out[0].complete
    # messages 1 and 2 cannot be framed; the next provable preamble is message 3's
    assert [m.offset for m in out[1:]] == [3 * size, 4 * size, 5 * size]
    assert out[1].resync and all(m.complete for m in out[1:])
    assert [bytes(m.payload) for m in out[1:]] == body[3:]
    assert fr.lost == [(size + 10, 2 * size + 10)]
    assert fr.counts["framing_lost"] == 1 and fr.counts["resync"] == 1


def test_framer_refuses_a_connection_that_is_not_gloo():
    fr = GlooFramer(False, lambda h: True)
    assert fr.feed(Piece(0, b"\x01" * 200, 0)) == [] and fr.not_gloo


def test_header_fields():
    h = Header.unpack(message(SEND_UNBOUND_BUFFER, slot_of(4, 0x1234), b"abcd"))
    assert (h.nbytes, h.opcode, h.prefix, h.tag, h.length, h.offset, h.roffset) == \
        (52, 1, 4, 0x1234, 4, 0, 0)
    assert h.is_allreduce and h.is_data and h.well_formed()


def test_decode_rebuilt_buckets():
    # reducer.cpp sync_bucket_indices: indices then the bucket count, then the sizes
    idx = struct.pack("<6i", 4, 3, 2, 0, 1, 2)
    assert decode_rebuilt_buckets(idx, struct.pack("<2i", 3, 2), 5) == [[4, 3, 2], [0, 1]]
    assert isinstance(decode_rebuilt_buckets(idx, struct.pack("<2i", 3, 1), 5), str)
    assert isinstance(decode_rebuilt_buckets(idx, struct.pack("<3i", 1, 2, 2), 5), str)
    assert isinstance(decode_rebuilt_buckets(struct.pack("<6i", 4, 4, 2, 0, 1, 2),
                                             struct.pack("<2i", 3, 2), 5), str)
    assert isinstance(decode_rebuilt_buckets(idx, struct.pack("<2i", 3, 2), 6), str)


def test_plan_rebuilt_learn_round_trip():
    from ckptd.core.plan import PlanError, plan_from_json
    doc = {"format": "ckptd-plan", "version": 1, "transport": "gloo",
           "parameters": [{"name": "a", "shape": [2]}, {"name": "b", "shape": [3]}],
           "buckets": {"first": [{"params": ["a", "b"]}], "rebuilt": "learn"},
           "ring": {"nranks": 2, "nccl_version": "2.19"}, "optimizer": None,
           "ranks": [{"rank": 0, "addr": "127.0.0.1"}, {"rank": 1, "addr": "127.0.0.1"}]}
    plan = plan_from_json(doc)
    assert plan.rebuilt_learn and plan.buckets_rebuilt == plan.buckets_first
    assert plan.to_json()["buckets"]["rebuilt"] == "learn"
    assert plan_from_json(plan.to_json()) == plan
    with pytest.raises(PlanError, match="learn"):
        plan_from_json({**doc, "transport": "roce"})
    from ckptd.core.plan import BucketLayout
    plan.learn_rebuilt([BucketLayout(params=("b",)), BucketLayout(params=("a",))])
    assert [b.count for b in plan.buckets(1)] == [3, 2]


# -- a real DDP job on gloo, captured on lo ---------------------------------------------
def _can_capture() -> str | None:
    if os.geteuid() != 0:
        return "needs root to capture on lo"
    if shutil.which("tcpdump") is None:
        return "tcpdump is not installed (apt-get install -y tcpdump)"
    return None


@pytest.fixture(scope="module")
def ddp_capture(tmp_path_factory):
    why = _can_capture()
    if why:
        pytest.skip(f"end-to-end gloo capture skipped: {why}")
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.getbasetemp()
    tmp = Path(tmp_path_factory.mktemp("gloo", numbered=True)) if base != Path("/dev/shm") else \
        Path(subprocess.check_output(["mktemp", "-d", "/dev/shm/ckptd-gloo.XXXXXX"], text=True).strip())
    pcap = tmp / "lo.pcap"
    # a large kernel buffer and a RAM-backed file: lo moves 64 KiB segments quickly
    # --immediate-mode: each packet handed over as it comes; without it, a ring block
    # waits up to its timeout (1 s) to be handed over, and the SIGINT below lost the
    # job's last packets with it (test_unused's capture, once in a full CI)
    cap = subprocess.Popen(["tcpdump", "-i", "lo", "-s", "0", "-B", "262144", "-U", "--immediate-mode", "-w",
                            str(pcap), "tcp"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        run = subprocess.run([sys.executable, str(REPO / "scripts" / "ddp_gloo_train.py"),
                              "--world", "3", "--iterations", "3", "--size", "small",
                              "--out", str(tmp / "run")], capture_output=True, text=True, timeout=120)
        time.sleep(0.5)
    finally:
        cap.send_signal(signal.SIGINT)
        err = cap.communicate(timeout=20)[1]
    if run.returncode != 0:
        pytest.fail(f"training failed:\n{run.stderr[-3000:]}")
    dropped = [ln for ln in err.splitlines() if "dropped by kernel" in ln]
    yield tmp, pcap, dropped
    shutil.rmtree(tmp, ignore_errors=True)


def _replay(tmp: Path, paths: list[str], plan=None):
    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.pipeline import ReplayOptions, replay
    from ckptd.core.plan import load_plan
    plan = plan or load_plan(tmp / "run" / "plan.json")
    return replay(plan, paths, load_checkpoint(tmp / "run" / "init.pt"),
                       ReplayOptions(reference=str(tmp / "run" / "rank0")))


def test_real_ddp_gloo_capture_is_bit_exact(ddp_capture):
    tmp, pcap, dropped = ddp_capture
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    pipe = _replay(tmp, [str(pcap)])
    reps = list(pipe.reports)
    assert [r.iteration for r in reps] == [0, 1, 2], [r.note for r in reps]
    assert all(r.status == "committed" and r.exact for r in reps), \
        [(r.status, r.note, pipe.extract.examples) for r in reps]
    ex = pipe.extract
    assert ex.counters["schedule_mismatch"] == 0 and ex.counters["ag_messages"] > 0
    assert ex.other_slots["broadcast"] > 0  # DDP's own collectives share the tag counter


def test_cli_replay_of_a_gloo_plan_exits_0_with_its_summary(ddp_capture):
    """The command line on a gloo plan: every iteration committed, bit-exact against
    rank 0's checkpoints, the summary line printed, exit 0."""
    tmp, pcap, dropped = ddp_capture
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    run = tmp / "run"
    r = subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(run / "plan.json"),
                        "--init", str(run / "init.pt"), "--out", str(tmp / "cli-ckpts"),
                        "--reference", str(run / "rank0"), str(pcap)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "3 iterations, 3 committed, 0 not recovered" in r.stdout
    assert r.stdout.count("bit-exact") == 3 and "NOT bit-exact" not in r.stdout
    assert sorted(p.name for p in (tmp / "cli-ckpts").iterdir()) == \
        [f"iter_{i:06d}.pt" for i in range(3)]


def _split(pcap: Path, out: Path, keep) -> str:
    from parsers.capfile import open_capture
    from parsers.pcap import PcapWriter
    with open(out, "wb") as f, PcapWriter(f) as w:
        for fr in open_capture(pcap):
            if keep(fr.index):
                w.write(fr.data, fr.ts_ns, fr.origlen)
    return str(out)


def test_two_lossy_mirrors_merge_and_one_alone_reports_its_holes(ddp_capture):
    tmp, pcap, dropped = ddp_capture
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    from parsers.capfile import open_capture
    n = sum(1 for _ in open_capture(pcap))
    rng = random.Random(5)
    lost = rng.sample(range(200, n + 1), 12)  # data segments well after connection setup
    a = set(lost[:6])
    b = set(lost[6:])
    m0 = _split(pcap, tmp / "m0.pcap", lambda i: i not in a)
    m1 = _split(pcap, tmp / "m1.pcap", lambda i: i not in b)
    merged = _replay(tmp, [m0, m1])
    assert all(r.status == "committed" and r.exact for r in merged.reports), \
        [(r.iteration, r.status, r.note) for r in merged.reports]
    alone = _replay(tmp, [m0])
    assert all(r.exact in (True, None) for r in alone.reports)  # never a wrong checkpoint
    holes = alone.extract.holes()
    assert holes, "six lost segments must leave holes"
    bad = [r for r in alone.reports if r.status != "committed"]
    for r in bad:
        assert r.status in ("unrecoverable", "complete-not-applied", "conflict") or r.missing


def _plan_doc(tmp: Path) -> dict:
    import json
    return json.loads((tmp / "run" / "plan.json").read_text())


def test_rebuilt_layout_learned_from_the_wire(ddp_capture):
    """DDP's rebuilt-bucket broadcast decodes to the layout the trainer's plan states,
    and a plan that says "learn" replays bit-exact with it."""
    tmp, pcap, dropped = ddp_capture
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    from ckptd.core.plan import plan_from_json
    doc = _plan_doc(tmp)
    given = plan_from_json(doc)
    doc["buckets"]["rebuilt"] = "learn"
    plan = plan_from_json(doc)
    assert plan.rebuilt_learn
    pipe = _replay(tmp, [str(pcap)], plan)
    ex = pipe.extract
    assert ex.rebuilt == "ok" and ex.counters["rebuilt_learned"] == 1
    assert ex.wire_rebuilt == given.buckets_rebuilt == plan.buckets_rebuilt
    # tags 4, 5: after DDP's 0-2 (docs/GLOO.md) iteration 0's allreduce takes 3; write_plan
    # exchanges the rank addresses through the c10d store, no tag of the group's
    assert len(plan.buckets_rebuilt) == 3 and ex.rebuilt_tag == 4
    reps = list(pipe.reports)
    assert [r.iteration for r in reps] == [0, 1, 2]
    assert all(r.status == "committed" and r.exact for r in reps), \
        [(r.status, r.note, ex.examples) for r in reps]
    # the trainer's own plan is checked against the wire and agrees
    checked = _replay(tmp, [str(pcap)])
    assert checked.extract.counters["rebuilt_checked"] == 1
    assert checked.extract.counters["rebuilt_mismatch"] == 0


def test_a_layout_learned_from_copies_that_disagree_commits_nothing_placed_in_it(ddp_capture):
    """One receiver's copy of DDP's rebuilt-bucket broadcast with its first two indices
    swapped (still a layout): a "learn" plan took whichever copy came first and committed
    iterations 1 and 2 NOT bit-exact; as a mirror copy beside the true capture it was
    never compared. Which copy is rank 0's is not known: nothing in that layout commits."""
    tmp, pcap, dropped = ddp_capture
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    from ckptd.core.plan import plan_from_json
    from tests.helpers import patch_tcp_bytes
    doc = _plan_doc(tmp)
    doc["buckets"]["rebuilt"] = "learn"
    ex = _replay(tmp, [str(pcap)], plan_from_json(doc)).extract
    t = ex.rebuilt_tag
    assert len(ex.bcast_spans[t]) == 2  # rank 0 sends it to ranks 1 and 2
    key, lo, _ = min(ex.bcast_spans[t])
    head = ex.rebuilt_payloads[t][:8]
    assert head[:4] != head[4:]
    bad = patch_tcp_bytes(pcap, tmp / "layout-swapped.pcap", key, lo + 48, head[4:] + head[:4])
    for paths in ([bad], [str(pcap), bad], [bad, str(pcap)]):
        reps = list(_replay(tmp, paths, plan_from_json(doc)).reports)  # (learning changes the plan)
        assert reps[0].status == "committed" and reps[0].exact, (paths, reps[0].note)
        assert [r.status for r in reps[1:]] == ["conflict", "conflict"], (paths, [r.note for r in reps])
        assert all("rebuilt-bucket broadcast, which the plan's layout was learned from, disagree" in r.note
                   for r in reps[1:]), reps[1].note


def test_wrong_rebuilt_layout_is_reported_and_nothing_after_iteration_0_commits(ddp_capture):
    tmp, pcap, dropped = ddp_capture
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    from ckptd.core.plan import PlanError, plan_from_json
    doc = _plan_doc(tmp)
    # the same bucket sizes, parameters reversed in each bucket: the ring schedule
    # cannot tell, only the broadcast layout can
    doc["buckets"]["rebuilt"] = [{"params": b["params"][::-1]} for b in doc["buckets"]["rebuilt"]]
    with pytest.raises(PlanError, match=r"buckets.rebuilt\[\d+\] is split too"):
        plan_from_json(doc)  # with buckets.limits DDP's rule refuses it at load already
    del doc["buckets"]["limits"]  # an older plan: the wire check is what catches it
    pipe = _replay(tmp, [str(pcap)], plan_from_json(doc))
    ex = pipe.extract
    assert ex.rebuilt == "mismatch" and ex.counters["rebuilt_mismatch"] == 1
    assert ex.counters["rebuilt_mismatch_dropped"] > 0
    assert any("rebuilt buckets" in e and "the plan says" in e for e in ex.examples)
    reps = {r.iteration: r for r in pipe.reports}
    assert reps[0].status == "committed" and reps[0].exact
    assert [r.iteration for r in pipe.reports if r.status == "committed"] == [0]
    assert all(r.exact is not False for r in pipe.reports)
    # each says why (it was "no packet of it was captured on any stream")
    assert all("DDP's rebuilt buckets, broadcast after iteration 0, are not the plan's" in reps[i].note
               for i in (1, 2)), reps[1].note


def test_connections_whose_ranks_are_not_known_are_named(ddp_capture):
    """Without the connection setup (the SYNs and the connector's rank) and with every
    rank at one address, no message can be placed: each iteration said "no packet of it
    was captured on any stream" of a capture full of them. The connections are listed."""
    tmp, pcap, dropped = ddp_capture
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    from parsers.capfile import open_capture
    syns = {fr.index for fr in open_capture(pcap)
            if (s := decode_tcp_frame(fr.data, fr.linktype, fr.origlen)[0]) is not None and s.tcp.flags & SYN}
    pipe = _replay(tmp, [_split(pcap, tmp / "no-syn.pcap", lambda i: i not in syns)])
    reps = list(pipe.reports)
    assert reps and all(r.status == "unrecoverable" and "flows of the captures fit none of the plan's (listed "
                        "below)" in r.note for r in reps), [r.note for r in reps]
    named = [d for d in pipe.extract.diagnostics() if d.startswith("unmatched connection: 127.0.0.1:")]
    assert len(named) >= 2 and all("the ranks at its ends are not known" in d for d in named), named


def test_segments_cut_by_the_snapshot_length_are_named(ddp_capture, tmp_path):
    """A capture taken with a snapshot length under the frames: the loss showed (96% of
    the bytes) with no cause; the connections say their segments were cut short."""
    tmp, pcap, dropped = ddp_capture
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    from parsers.capfile import open_capture
    from parsers.pcap import PcapWriter
    with open(tmp_path / "snap.pcap", "wb") as f, PcapWriter(f) as w:
        for fr in open_capture(pcap):
            w.write(fr.data[:1500], fr.ts_ns, fr.origlen)
    pipe = _replay(tmp, [str(tmp_path / "snap.pcap")])
    assert not [r for r in pipe.reports if r.status == "committed"]
    cut = [d for d in pipe.extract.diagnostics() if "cut short by the capture's snapshot length" in d]
    assert cut and all(d.startswith("connection 127.0.0.1:") for d in cut), pipe.extract.diagnostics()


def _extract(plan, frames, drop: set, quiet_ms: float, cls=None):
    """GlooExtractor (or cls) fed frame by frame as the daemon feeds it, told the
    capture is quiet (idle) wherever the next frame comes more than quiet_ms later."""
    from collections import Counter

    from ckptd.transports.gloo.extract import GlooExtractor
    ex, out, classes = (cls or GlooExtractor)(plan), [], Counter()
    for i, fr in enumerate(frames):
        if fr.index in drop:
            continue
        out += ex.feed_frame(0, fr, classes)
        if i + 1 < len(frames) and frames[i + 1].ts_ns - fr.ts_ns > quiet_ms * 1e6:
            out += ex.idle()
    return ex, out + ex.flush()


class _Truth:
    """What the complete capture places: the allgather bytes of every (iteration, bucket)."""

    def __init__(self, ddp_capture):
        tmp, pcap, dropped = ddp_capture
        if dropped and not dropped[0].startswith("0 "):
            pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
        from ckptd.core.plan import load_plan
        from parsers.capfile import open_capture
        self.plan = load_plan(tmp / "run" / "plan.json")
        self.frames = list(open_capture(pcap))
        ex, whole = _extract(self.plan, self.frames, set(), float("inf"))
        self.e = ex.sched[0].buckets[0].dtype.itemsize
        self.bytes: dict[tuple[int, int], bytearray] = {}
        for p in whole:
            buf = self.bytes.setdefault((p.iteration, p.bucket), bytearray())
            lo = p.start * self.e
            buf.extend(b"\0" * max(0, lo + len(p.raw) - len(buf)))
            buf[lo:lo + len(p.raw)] = p.raw

    def check(self, out, *context):
        for p in out:
            lo = p.start * self.e
            assert bytes(self.bytes[(p.iteration, p.bucket)][lo:lo + len(p.raw)]) == p.raw, \
                (*context, p.iteration, p.bucket, p.start, p.sender, p.ring_step)


@pytest.fixture(scope="module")
def truth(ddp_capture) -> _Truth:
    return _Truth(ddp_capture)


def test_one_lossy_stream_places_only_true_bytes_however_quiet(truth):
    """One mirror stream that lost 12 segments, its capture going quiet at every pause
    longer than 1 ms, 20 ms, 0.6 s, or never: every allgather byte placed is the byte
    the complete capture places there. (Messages after a lost gloo header are indexed
    from their tag's end; that index was wrong while the tag could still grow on its
    direction, numbered at a quiet spell, or while that direction waited for its
    ranks, and the shifted payload then conflicted with another rank's copy, so its
    iteration was never committed.)"""
    from_end = placed = 0
    for seed in range(8):
        drop = set(random.Random(seed).sample(range(200, len(truth.frames)), 12))
        for quiet_ms in (1, 20, 600, float("inf")):
            ex, out = _extract(truth.plan, truth.frames, drop, quiet_ms)
            truth.check(out, seed, quiet_ms)
            from_end += ex.counters["indexed_from_end"]
            placed += len(out)
    assert from_end > 0 and placed > 0  # the lost headers did send messages down that path


def test_a_loss_in_a_directions_last_bytes_leaves_no_group_indexed_one_off(truth):
    """The busiest direction loses its last data segment and one a few messages before:
    the messages framed after that first loss are indexed from their tag's end only if
    the direction's last bytes were seen. They were not, and a group one message short
    would put every payload one message off (the old code placed wrong bytes here for
    most k). With the last segment kept, the same groups are still placed from the end."""
    from collections import Counter
    sizes, data_frames = Counter(), {}
    for fr in truth.frames:
        s, _ = decode_tcp_frame(fr.data, fr.linktype, fr.origlen)
        if s is not None and len(s.payload):
            sizes[s.key] += len(s.payload)
            data_frames.setdefault(s.key, []).append(fr.index)
    busiest = data_frames[sizes.most_common(1)[0][0]]
    from_end = unseen = 0
    for k in range(2, 15):
        for drop in ({busiest[-1], busiest[-k]}, {busiest[-k]}):
            ex, out = _extract(truth.plan, truth.frames, drop, float("inf"))
            truth.check(out, k, sorted(drop))
            if busiest[-1] in drop:
                unseen += ex.counters["tail_unseen"]
            else:
                from_end += ex.counters["indexed_from_end"]
    assert unseen > 0 and from_end > 0


def test_a_gap_that_hides_whole_allreduces_stops_the_count_instead_of_shifting_it(truth):
    """Every direction loses the same run of frames, as in a capture pause: where that
    hides every message of some collectives, nobody can tell whether they were
    allreduces, and gloo numbers an allreduce (its iteration and bucket) by its place in
    the group's count. Nothing after the gap is placed (the old code numbered the next
    allreduce seen as the first one lost: a later iteration's gradients placed, and
    committed, as an earlier one's), and the iterations from there are unplaced with
    the reason; what comes before is placed as the whole capture places it."""
    n = len(truth.frames)
    stopped = 0
    for lo in range(n // 8, 3 * n // 4, n // 32):
        drop = set(range(lo, lo + n // 4))
        ex, out = _extract(truth.plan, truth.frames, drop, float("inf"))
        truth.check(out, lo)
        if getattr(ex, "count_lost", None) is not None:
            stopped += 1
            first = ex.unplaced_from()
            assert not [p for p in out if p.iteration > first], lo
            assert "capture gap hid whole collectives" in ex.why_unplaced(first)
            assert ex.why_unplaced(first - 1) is None
            assert any("were never seen where bytes were lost" in d for d in ex.diagnostics())
    assert stopped > 0  # some gap did hide whole collectives


def test_a_broadcast_lost_on_the_roots_links_alone_does_not_stop_the_count(truth):
    """Rank 0's links lose the frames around DDP's rebuilt-bucket broadcasts (the root
    and each rank talk directly; ranks 1 and 2 do not): those tags are never seen. They
    were no allreduces: exactly the rebuilt layout's two broadcasts are missing between
    iteration 0's round and iteration 1's, and, where that count is not known (a job
    with buffers: here made so), the ring directions between ranks 1 and 2 framed past
    them with no loss. Numbering goes on either way, every byte placed true."""
    from collections import Counter

    from ckptd.transports.gloo.extract import GlooExtractor

    class Spy(GlooExtractor):  # the frames that complete the rebuilt layout's broadcasts
        def _broadcast(self, key, m):
            if m.header.length == 4 * (self.nparams + 1) or self.bcast:
                at.append(index)
            super()._broadcast(key, m)
    at: list[int] = []
    ex0, classes = Spy(truth.plan), Counter()
    for fr in truth.frames:
        index = fr.index
        ex0.feed_frame(0, fr, classes)
    ex0.flush()
    assert at and ex0.rebuilt == "ok"
    root = {ep for ep, r in ex0.ranks.endpoint.items() if r == 0}
    drop = {fr.index for fr in truth.frames if min(at) - 8 <= fr.index <= max(at) + 8
            and (s := decode_tcp_frame(fr.data, fr.linktype, fr.origlen)[0]) is not None
            and ((s.key[0], s.key[1]) in root or (s.key[2], s.key[3]) in root)}

    class CountUnknown(GlooExtractor):
        def _others_before(self, kind):
            return None
    last = max(p.iteration for p in _extract(truth.plan, truth.frames, set(), float("inf"))[1])
    for cls in (GlooExtractor, CountUnknown):
        ex, out = _extract(truth.plan, truth.frames, drop, float("inf"), cls)
        truth.check(out, cls)
        assert ex.rebuilt == "not_seen" and ex.counters["unseen_tags_not_allreduce"] >= 2, cls
        assert ex.count_lost is None and not any("never seen" in d for d in ex.diagnostics()), cls
        assert any(p.iteration == last for p in out), cls
