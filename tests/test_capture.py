"""ckptd.live.ring (TPACKET_V3 ring, BPF filter, fanout, statistics) and ckptd.testing.sender.

The BPF program is checked twice: by a small classic-BPF interpreter here (no root
needed) and in the kernel between two network namespaces (root only; skipped with a
message otherwise).
"""
from __future__ import annotations

import socket
import struct
import threading
import time
import types

import pytest

from ckptd.live.ring import (CaptureSetupError, RingCapture, in_netns, ring_batches, ring_source,
                             roce_filter)
from ckptd.testing.netlab import lab_unavailable, remove_namespaces, unique_prefix
from ckptd.testing.sender import send_frames
from ckptd.testing.tunnel import erspan2, gre_tunnel

ROCE = 4791


# -- frames ----------------------------------------------------------------------------
def eth(payload: bytes, ethertype: int, vlan: int | None = None) -> bytes:
    head = b"\x02\x00\x00\x00\x00\x02" + b"\x02\x00\x00\x00\x00\x01"
    if vlan is not None:
        head += struct.pack("!HH", 0x8100, vlan)
    return head + struct.pack("!H", ethertype) + payload


def ipv4(proto: int, body: bytes, frag: int = 0, options: bytes = b"") -> bytes:
    ihl = 5 + len(options) // 4
    return struct.pack("!BBHHHBBH4s4s", 0x40 | ihl, 0, 4 * ihl + len(body), 1, frag, 64, proto, 0,
                       bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2])) + options + body


def ipv6(nxt: int, body: bytes) -> bytes:
    return struct.pack("!IHBB16s16s", 6 << 28, len(body), nxt, 64,
                       b"\xfd" + b"\0" * 14 + b"\x01", b"\xfd" + b"\0" * 14 + b"\x02") + body


def udp(dport: int, payload: bytes = b"\0" * 32) -> bytes:
    return struct.pack("!HHHH", 50000, dport, 8 + len(payload), 0) + payload


def roce_v4(n: int = 0, size: int = 64, vlan=None) -> bytes:
    """A UDP/4791 frame whose payload carries its sequence number n."""
    return eth(ipv4(17, udp(ROCE, struct.pack("!I", n) + b"\xab" * (size - 4))), 0x0800, vlan)


# -- the filter, interpreted -----------------------------------------------------------
def run_bpf(prog, pkt: bytes) -> int:
    """Just the classic-BPF subset roce_filter uses; an out-of-packet load rejects, as in
    the kernel."""
    a = x = pc = 0
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        try:
            if code == 0x28:
                a = struct.unpack_from("!H", pkt, k)[0]
            elif code == 0x30:
                a = pkt[k]
            elif code == 0x48:
                a = struct.unpack_from("!H", pkt, x + k)[0]
            elif code == 0xB1:
                x = 4 * (pkt[k] & 0x0F)
            elif code == 0x15:
                pc += jt if a == k else jf
            elif code == 0x45:
                pc += jt if a & k else jf
            elif code == 0x06:
                return k
            else:
                raise AssertionError(f"opcode {code:#x} not interpreted")
        except (IndexError, struct.error):
            return 0


CASES = [
    ("ipv4 udp 4791", roce_v4(), True),
    ("ipv4 udp 4790", eth(ipv4(17, udp(4790)), 0x0800), False),
    ("ipv4 udp src port 4791 only", eth(ipv4(17, struct.pack("!HHHH", 4791, 9, 8, 0)), 0x0800), False),
    ("ipv4 gre (erspan)", eth(ipv4(47, b"\x10\x00\x88\xbe" + b"\0" * 40), 0x0800), True),
    ("ipv4 tcp to 4791", eth(ipv4(6, struct.pack("!HH", 1, ROCE) + b"\0" * 16), 0x0800), False),
    ("ipv4 options then udp 4791", eth(ipv4(17, udp(ROCE), options=b"\x01\x01\x01\x00"), 0x0800), True),
    ("ipv4 later fragment", eth(ipv4(17, udp(ROCE), frag=0x0010), 0x0800), False),
    ("ipv4 first fragment, MF set", eth(ipv4(17, udp(ROCE), frag=0x2000), 0x0800), True),
    ("ipv6 udp 4791", eth(ipv6(17, udp(ROCE)), 0x86DD), True),
    ("ipv6 udp 53", eth(ipv6(17, udp(53)), 0x86DD), False),
    ("ipv6 gre", eth(ipv6(47, b"\0" * 40), 0x86DD), True),
    ("ipv6 hop-by-hop first", eth(ipv6(0, b"\x11\0" + b"\0" * 6 + udp(ROCE)), 0x86DD), False),
    ("vlan ipv4 udp 4791", roce_v4(vlan=7), True),
    ("vlan ipv4 udp 80", eth(ipv4(17, udp(80)), 0x0800, vlan=7), False),
    ("vlan ipv6 udp 4791", eth(ipv6(17, udp(ROCE)), 0x86DD, vlan=7), True),
    ("vlan ipv4 gre", eth(ipv4(47, b"\0" * 40), 0x0800, vlan=7), True),
    ("arp", eth(b"\0" * 28, 0x0806), False),
    ("truncated ipv4", eth(ipv4(17, b"")[:12], 0x0800), False),
]


@pytest.mark.parametrize("name,frame,accept", CASES, ids=[c[0] for c in CASES])
def test_filter_program(name, frame, accept):
    assert (run_bpf(roce_filter(), frame) != 0) == accept


def test_filter_program_is_well_formed():
    prog = roce_filter()
    assert len(prog) < 64
    for i, (code, jt, jf, _) in enumerate(prog):
        if code in (0x15, 0x45):
            assert i + 1 + max(jt, jf) < len(prog)
    assert prog[-1][0] == 0x06 and prog[-1][3] == 0   # falls off into "drop"


def test_ring_parameters_are_checked():
    with pytest.raises(ValueError, match="block_size"):
        RingCapture("lo", block_size=5000)
    with pytest.raises(ValueError, match="fanout"):
        RingCapture("lo", fanout=(1, "random"))


# -- in the kernel ---------------------------------------------------------------------
@pytest.fixture
def link():
    """Two namespaces joined by a veth: frames sent on tx (in ns[0]) arrive on rx (ns[1])."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(f"capture tests need network namespaces: {reason}")
    from pyroute2 import IPRoute, netns
    p = unique_prefix()
    names = [f"{p}-a", f"{p}-b"]
    try:
        for n in names:
            netns.create(n)
        with IPRoute(netns=names[0], flags=0) as ipr:
            ipr.link("add", ifname="tx", kind="veth", peer={"ifname": "rx", "net_ns_fd": names[1]})
            ipr.link("set", index=ipr.link_lookup(ifname="tx")[0], mtu=9000, state="up")
        with IPRoute(netns=names[1], flags=0) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="rx")[0], mtu=9000, state="up")
        for n in names:  # no IPv6 chatter on the link
            in_netns(n, lambda: open("/proc/sys/net/ipv6/conf/all/disable_ipv6", "w").write("1"))
        yield names
    finally:
        remove_namespaces(names)


def test_capture_receives_what_the_sender_sends(link):
    frames = [roce_v4(i, size=64 + 37 * i) for i in range(200)]
    before = time.time_ns()
    with RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=16, retire_ms=10) as cap:
        res = send_frames(frames, "tx", link[0])
        got = cap.drain(0.1)
        st = cap.stats()
    assert (res.sent, res.failed, res.bytes) == (200, 0, sum(map(len, frames)))
    assert [f.data for f in got] == frames
    assert [f.index for f in got] == list(range(1, 201))
    assert all(f.linktype == 1 and f.caplen == f.origlen == len(f.data) for f in got)
    assert all(before <= f.ts_ns <= time.time_ns() for f in got)
    assert all(a.ts_ns <= b.ts_ns for a, b in zip(got, got[1:]))
    assert st["packets"] == st["delivered"] == 200 and st["drops"] == 0 and st["blocks"] >= 1


def test_kernel_filter_passes_only_roce_and_gre(link):
    frames = [c[1] for c in CASES if not c[0].startswith("truncated")]
    wanted = [c[1] for c in CASES if c[2]]
    with RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=4, retire_ms=10) as cap, \
            RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=4, retire_ms=10, bpf=False) as raw:
        send_frames(frames * 3, "tx", link[0])
        got, all_ = cap.drain(0.1), raw.drain(0.05)
        st = cap.stats()
    # The veth takes 802.1Q tags off into metadata; RingCapture puts them back.
    assert [f.data for f in got] == wanted * 3
    assert len(all_) == len(frames) * 3
    assert st["packets"] == len(wanted) * 3   # the kernel counts only what the filter passed
    assert st["vlan_restored"] == 3 * sum(1 for c in CASES if c[2] and c[0].startswith("vlan"))


def both_readers(cap: RingCapture, idle_s: float = 0.1, stream: int = 0) -> tuple[list, list]:
    """Everything that arrives until the link has been quiet for idle_s, read twice from
    the same ring bytes: by read_batch (the Cython indexer, in place) and by the
    reference frame reader (_take_block) run on a copy of the ring taken just before.
    Both as CapturedFrames."""
    got, want, quiet = [], [], time.monotonic() + idle_s
    while time.monotonic() < quiet:
        if not cap.ready():
            time.sleep(0.005)
            continue
        ref = types.SimpleNamespace(
            _mv=memoryview(bytearray(cap._ring)), block_size=cap.block_size, block_nr=cap.block_nr,
            _block=cap._block, snaplen=cap.snaplen, _index=cap._index, _vlan_restored=0, _blocks_read=0)
        b = cap.read_batch(stream)
        assert (b.stream == stream).all() and (b.linktype == 1).all()
        got += [b.frame(i) for i in range(len(b))]
        blocks = cap._held
        cap.release()
        for _ in range(blocks):
            want += RingCapture._take_block(ref)
        quiet = time.monotonic() + idle_s
    return got, want


def as_tuples(frames) -> list:
    return [(f.index, f.ts_ns, f.linktype, f.caplen, f.origlen, f.data) for f in frames]


def test_batch_indexer_gives_what_the_frame_reader_gives(link):
    """The same ring blocks read by the reference frame reader and indexed in place by
    the Cython indexer: the same frames, numbers, timestamps and lengths; VLAN tags put
    back; sizes from 64 B to 7.8 KB; several blocks per batch."""
    frames = [roce_v4(i, size=64 + 97 * (i % 80), vlan=(i % 4000) + 1 if i % 3 == 0 else None)
              for i in range(600)]
    before = time.time_ns()
    with RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=64, retire_ms=10) as cap:
        send_frames(frames, "tx", link[0])
        time.sleep(0.1)  # several blocks retire before the first read
        got, want = both_readers(cap)
        st = cap.stats()
    assert [f.data for f in got] == frames
    assert as_tuples(got) == as_tuples(want)
    assert [f.index for f in got] == list(range(1, 601))
    assert all(before <= f.ts_ns <= time.time_ns() for f in got)
    assert st["vlan_restored"] == 200 and st["delivered"] == 600 and st["errors"] == {}
    assert st["blocks"] >= 2


def test_batch_indexer_snaplen_and_blocks_go_back(link):
    """snaplen cuts after the tag is restored, as the reference does; released blocks
    are refilled: 40 rounds through a 4-block ring lose nothing."""
    with RingCapture("rx", netns=link[1], block_size=1 << 14, block_nr=4, retire_ms=5, snaplen=60) as cap:
        got, want = [], []
        for r in range(40):
            batch = [roce_v4(r * 8 + i, size=900, vlan=5 if i % 2 else None) for i in range(8)]
            send_frames(batch, "tx", link[0])
            g, w = both_readers(cap, 0.02)
            got, want = got + g, want + w
        st = cap.stats()
    assert len(want) == 320 and as_tuples(got) == as_tuples(want)
    assert all(f.caplen == 60 and f.origlen in (14 + 20 + 8 + 900, 18 + 20 + 8 + 900) for f in got)
    assert st["drops"] == 0 and st["blocks"] >= 40


def test_read_batch_needs_release_first(link):
    with RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=4, retire_ms=5) as cap:
        assert cap.read_batch() is None
        send_frames([roce_v4(i) for i in range(3)], "tx", link[0])
        time.sleep(0.05)
        b = cap.read_batch()
        assert b is not None and len(b) == 3
        with pytest.raises(RuntimeError, match="released"):
            cap.read_batch()
        cap.release()
        assert cap.read_batch() is None


def test_ring_batches_streams_and_hands_blocks_back(link):
    from pyroute2 import IPRoute
    with IPRoute(netns=link[0], flags=0) as ipr:  # a second link between the namespaces
        ipr.link("add", ifname="tx2", kind="veth", peer={"ifname": "rx2", "net_ns_fd": link[1]})
        ipr.link("set", index=ipr.link_lookup(ifname="tx2")[0], state="up")
    with IPRoute(netns=link[1], flags=0) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="rx2")[0], state="up")
    caps = [RingCapture(i, netns=link[1], block_size=1 << 14, block_nr=4, retire_ms=5) for i in ("rx", "rx2")]
    stop, errors, got = threading.Event(), [], []

    def consume():
        for k, b in ring_batches(caps, stop, errors, poll_s=0.01):
            got.extend((k, b.frame(i)) for i in range(len(b)))

    try:
        reader = threading.Thread(target=consume)
        reader.start()
        for r in range(20):  # each round fits the 4 blocks, all of them ten times over
            send_frames([roce_v4(r * 25 + i, size=1000) for i in range(25)], "tx", link[0])
            send_frames([roce_v4(i) for i in range(5)], "tx2", link[0])
            deadline = time.monotonic() + 5  # the reader catches up before the next round
            while len(got) < (r + 1) * 30 and time.monotonic() < deadline:
                time.sleep(0.01)
        stop.set()
        reader.join(5)
        assert not reader.is_alive()
    finally:
        stop.set()
        for c in caps:
            c.close()
    assert errors == []
    assert [struct.unpack_from("!I", f.data, 42)[0] for k, f in got if k == 0] == list(range(500))
    assert sum(1 for k, _ in got if k == 1) == 100
    assert all(c.stats()["drops"] == 0 for c in caps)


@pytest.mark.parametrize("turn_blocks", [1, 3])
def test_a_turn_takes_at_most_its_bytes_of_a_backed_up_ring(link, turn_blocks):
    """Eight retired blocks waiting: each Batch takes `turn` bytes' worth of them (at
    least one block, however small the turn), in order, nothing lost. One frame a block:
    the block timer retires a block at whichever tick finds it unchanged, so frames sent
    together can still land in two blocks (CI saw [6, 3, 6, 6, 3] for three a block)."""
    block = 1 << 14
    with RingCapture("rx", netns=link[1], block_size=block, block_nr=16, retire_ms=5) as cap:
        for r in range(8):  # one retired block each: the reader is not running yet
            send_frames([roce_v4(r, size=1000)], "tx", link[0])
            deadline = time.monotonic() + 5  # retired after retire_ms: wait for it, not a guess
            while cap.handed_over() < r + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        stop, errors, sizes, seqs = threading.Event(), [], [], []
        for k, b in ring_batches([cap], stop, errors, poll_s=0.01, idle=True, turn=turn_blocks * block - 1):
            if b is None:
                break
            sizes.append(len(b))
            seqs.extend(struct.unpack_from("!I", b.frame(i).data, 42)[0] for i in range(len(b)))
        stop.set()
    want_blocks = max(1, turn_blocks - 1)  # turn // block_size, at least one
    assert errors == [] and seqs == list(range(8))
    assert sizes == [want_blocks] * (8 // want_blocks) + ([8 % want_blocks] if 8 % want_blocks else [])


def test_the_daemon_turn_is_under_half_an_iteration_of_the_quietest_link(tmp_path):
    """Plan.least_link_bytes: a ring allreduce moves 2(n-1)/n of the gradients over each
    link (reduce-scatter and allgather), so a link of a 4-rank tiny plan carries ~1.5x its
    gradient bytes; the turn is half that (a block at least), TURN_BYTES at most."""
    from ckptd.core.plan import load_plan
    from ckptd.live.ring import TURN_BYTES, turn_bytes
    from tests.helpers import synth
    synth(tmp_path, model="tiny", ranks=4, channels=2, protocol="simple", mtu=4096, mirrors=2, iterations=1)
    plan = load_plan(tmp_path / "plan.json")
    grads = sum(p.numel for p in plan.parameters) * 4
    least = plan.least_link_bytes()
    assert 1.3 * grads < least <= 1.5 * grads, (least, grads)
    assert turn_bytes(least) == least // 2 < TURN_BYTES
    assert turn_bytes(10 * TURN_BYTES) == TURN_BYTES and turn_bytes(0) == 1


def test_snaplen_keeps_the_wire_length(link):
    with RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=4, retire_ms=10, snaplen=60) as cap:
        send_frames([roce_v4(1, size=1000)], "tx", link[0])
        (f,) = cap.drain(0.1)
    assert f.caplen == len(f.data) == 60 and f.origlen == 14 + 20 + 8 + 1000 and f.truncated


def test_overrun_ring_reports_drops(link):
    # Two 4 KiB blocks hold a few frames; nobody reads while 300 arrive.
    with RingCapture("rx", netns=link[1], block_size=4096, block_nr=2, frame_size=2048,
                     retire_ms=1000) as cap:
        res = send_frames([roce_v4(i, size=1000) for i in range(300)], "tx", link[0])
        got = cap.drain(0.05)
        time.sleep(0.05)
        got += cap.drain(0.05)
        st = cap.stats()
    assert res.sent == 300
    assert st["drops"] > 250 and st["freeze_q_cnt"] >= 1
    assert st["packets"] == 300 == st["delivered"] + st["drops"] and len(got) == st["delivered"]


def test_ring_high_water_mark(link):
    """stats()["ready_peak"]: the most blocks found handed over and waiting at a read,
    counted past what the read takes (max_blocks); a ring that overran peaks at block_nr."""
    with RingCapture("rx", netns=link[1], block_size=1 << 14, block_nr=16, retire_ms=5) as cap:
        assert cap.stats()["ready_peak"] == 0 and cap.stats()["block_nr"] == 16
        send_frames([roce_v4(i, size=1000) for i in range(60)], "tx", link[0])  # ~4-5 blocks
        time.sleep(0.1)  # every block retired before the first look
        reads = 0
        while cap.read_batch(0, max_blocks=1) is not None:
            reads += 1
            cap.release()
            if reads == 1:
                first_peak = cap.stats()["ready_peak"]
        st = cap.stats()
    assert st["delivered"] == 60 and st["drops"] == 0
    assert 3 <= reads < 16 and first_peak == reads == st["ready_peak"]
    # the same through the frame-by-frame reader (the reference path's)
    with RingCapture("rx", netns=link[1], block_size=1 << 14, block_nr=16, retire_ms=5) as cap:
        send_frames([roce_v4(i, size=1000) for i in range(60)], "tx", link[0])
        time.sleep(0.1)
        blocks = 0
        while cap.read_block(0):
            blocks += 1
        st = cap.stats()
    assert st["delivered"] == 60 and 3 <= blocks < 16 and st["ready_peak"] == blocks
    send = [roce_v4(i, size=1000) for i in range(300)]
    with RingCapture("rx", netns=link[1], block_size=4096, block_nr=2, frame_size=2048, retire_ms=5) as cap:
        send_frames(send, "tx", link[0])
        time.sleep(0.05)
        cap.read_batch(0)
        cap.release()
        st = cap.stats()
    assert st["drops"] > 0 and st["ready_peak"] == st["block_nr"] == 2


def test_stats_accumulate_across_reads(link):
    with RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=4, retire_ms=10) as cap:
        for k in range(3):
            send_frames([roce_v4(i) for i in range(10)], "tx", link[0])
            cap.drain(0.05)
            assert cap.stats()["packets"] == 10 * (k + 1)
    assert cap.stats()["delivered"] == 30   # still readable after close


def test_outgoing_frames_are_not_captured(link):
    with RingCapture("tx", netns=link[0], block_size=1 << 16, block_nr=4, retire_ms=10) as cap, \
            RingCapture("tx", netns=link[0], block_size=1 << 16, block_nr=4, retire_ms=10,
                        outgoing=True) as both:
        send_frames([roce_v4(i) for i in range(5)], "tx", link[0])
        assert cap.drain(0.05) == [] and len(both.drain(0.05)) == 5


def test_fanout_shares_one_interface(link):
    kw = dict(netns=link[1], block_size=1 << 16, block_nr=8, retire_ms=10, fanout=(0x4791, "lb"))
    with RingCapture("rx", **kw) as a, RingCapture("rx", **kw) as b:
        send_frames([roce_v4(i) for i in range(400)], "tx", link[0])
        ga, gb = a.drain(0.1), b.drain(0.05)
    seq = sorted(struct.unpack_from("!I", f.data, 42)[0] for f in ga + gb)
    assert seq == list(range(400))
    assert 150 < len(ga) < 250   # round robin


def test_a_fanout_group_held_in_another_mode_is_named(link):
    """The kernel refuses a second member of a group in another mode (or on another
    device) with EINVAL: it said "capture on rx: Invalid argument"."""
    kw = dict(netns=link[1], block_size=1 << 16, block_nr=2, retire_ms=10)
    with RingCapture("rx", fanout=(0x4792, "hash"), **kw):
        with pytest.raises(OSError, match=r"capture on rx \(netns .*\): cannot join fanout group 18322 \(lb\): "
                                          "another socket in this network namespace holds that group"):
            RingCapture("rx", fanout=(0x4792, "lb"), **kw)


def _roce_flow_frame(src: int, dst: int, sport: int, n: int, v6: bool) -> bytes:
    """A RoCEv2 frame from host src to host dst (UDP source port sport) carrying n."""
    body = struct.pack("!HHHH", sport, ROCE, 8 + 36, 0) + struct.pack("!I", n) + b"\xab" * 32
    if v6:
        a, b = (b"\xfd" + b"\0" * 14 + bytes([h]) for h in (src, dst))
        return eth(struct.pack("!IHBB16s16s", 6 << 28, len(body), 17, 64, a, b) + body, 0x86DD)
    return eth(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(body), 1, 0, 64, 17, 0,
                           bytes([10, 0, 0, src]), bytes([10, 0, 0, dst])) + body, 0x0800)


def _wrapped(frame: bytes, how: str, i: int) -> bytes:
    """frame as a remote mirror delivers it: bare, ERSPAN II, ERSPAN III with the platform
    sub-header and frame type 2 (the IP packet alone), or gretap with C and K around the
    frame given an 802.1ad and an 802.1Q tag."""
    if how == "bare":
        return frame
    if how == "erspan2":
        return erspan2(frame, 7, i)
    if how == "erspan3":
        hdr = struct.pack("!HHIHH", 2 << 12, 7, i, 0, 2 << 10 | 1) + b"\x11" * 8
        return gre_tunnel(frame[14:], 0x22EB, hdr, seq=i)
    tags = struct.pack("!HHHH", 0x88A8, 5, 0x8100, 9)
    return gre_tunnel(frame[:12] + tags + frame[12:], 0x6558, flags=0xA000)


def test_flow_fanout_keeps_a_flow_on_one_member_index_on_every_port_and_in_every_tunnel(link):
    """fanout_mode "flow" (roce_flow_program): three ports, each a fanout group of three
    members joined in the same order; 16 flows (IPv4 and IPv6), each in both directions,
    bare on port 0, in ERSPAN II on port 1, in ERSPAN III or gretap on port 2. Every copy
    of a flow, either way, reaches the same member index, and the flows spread over the
    members. (The kernel's own "hash" hashes a tunnel's outer header: every ERSPAN frame
    of a port to one member.)"""
    from pyroute2 import IPRoute
    for k in (1, 2):  # two more links beside the fixture's
        with IPRoute(netns=link[0], flags=0) as ipr:
            ipr.link("add", ifname=f"tx{k}", kind="veth", peer={"ifname": f"rx{k}", "net_ns_fd": link[1]})
            ipr.link("set", index=ipr.link_lookup(ifname=f"tx{k}")[0], mtu=9000, state="up")
        with IPRoute(netns=link[1], flags=0) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname=f"rx{k}")[0], mtu=9000, state="up")
    ports = [("rx", "tx", ["bare"]), ("rx1", "tx1", ["erspan2"]), ("rx2", "tx2", ["erspan3", "gretap"])]
    flows, frames = _flow_frames()
    kw = dict(netns=link[1], block_size=1 << 16, block_nr=8, retire_ms=10)
    members = [[RingCapture(rx, fanout=(0x4700 + k, "flow"), **kw) for k, (rx, _, _) in enumerate(ports)]
               for _ in range(3)]
    try:
        for rx, tx, ways in ports:
            send_frames([_wrapped(fr, ways[i % len(ways)], i) for i, (_, fr) in enumerate(frames)], tx, link[0])
        got, where = _members_of_flows(members)
    finally:
        for caps in members:
            for cap in caps:
                cap.close()
    assert len(got) == 3 * len(frames)
    assert len(where) == len(flows) and all(len(m) == 1 for m in where.values()), where
    assert len({m for ms in where.values() for m in ms}) >= 2  # spread, not all on one member


def _flow_frames():
    """16 RoCE flows (IPv4 and IPv6), and 6 frames of each both ways: data one way, its
    ACKs the other, the same UDP source port."""
    flows = [(1 + f % 4, 5 + f // 4, 49152 + 97 * f, f % 2 == 1) for f in range(16)]
    frames = []
    for f, (a, b, sport, v6) in enumerate(flows):
        for i in range(6):
            frames.append(((a, b, sport, v6), _roce_flow_frame(a, b, sport, 100 * f + i, v6)))
            frames.append(((a, b, sport, v6), _roce_flow_frame(b, a, sport, 100 * f + i, v6)))
    return flows, frames


def _members_of_flows(members) -> tuple[list, dict]:
    """Drain members[m][port]: (the frames received, {flow: the member indices it reached})."""
    from parsers.roce import decode_frame
    where: dict[tuple, set] = {}
    got = []
    for m, caps in enumerate(members):
        for cap in caps:
            for fr in cap.drain(0.1):
                d = decode_frame(fr.data)  # (the ICRCs are not made: decoded for the addresses)
                where.setdefault((min(d.src, d.dst), max(d.src, d.dst), d.sport), set()).add(m)
                got.append(fr.data)
    return got, where


def test_flow_fanout_spreads_one_erspan_session(link):
    """Several workers for one session: three members of one `flow` fanout group, each
    filtering on ERSPAN session 5. The group picks a member by the RoCE flow inside the
    tunnel, then that member's filter runs: every frame of session 5 reaches exactly one
    member, every flow stays on one, the flows spread; session 9's frames and bare ones
    reach none."""
    flows, frames = _flow_frames()
    kw = dict(netns=link[1], block_size=1 << 16, block_nr=8, retire_ms=10)
    members = [[RingCapture("rx", fanout=(0x4710, "flow"), erspan_session=5, **kw)] for _ in range(3)]
    try:
        mine = [erspan2(fr, 5, i) for i, (_, fr) in enumerate(frames)]
        others = [w for i, (_, fr) in enumerate(frames) for w in (erspan2(fr, 9, i), fr)]
        send_frames([f for pair in zip(mine, others[::2], others[1::2]) for f in pair], "tx", link[0])
        got, where = _members_of_flows(members)
    finally:
        for caps in members:
            for cap in caps:
                cap.close()
    assert sorted(got) == sorted(mine)
    assert len(where) == len(flows) and all(len(m) == 1 for m in where.values()), where
    assert len({m for ms in where.values() for m in ms}) >= 2


def test_erspan_session_filters_split_one_interface_into_its_sessions(link):
    """Two rings on one interface, one per ERSPAN session (erspan_session_filter): each
    gets exactly its session's frames, type II and III, over IPv4 and IPv6, with GRE
    keys and checksums; bare RoCE, ERSPAN type I (no session) and other sessions reach
    neither."""
    def erspan3_v6(frame: bytes, session: int, seq: int) -> bytes:
        hdr = struct.pack("!HHIHH", 2 << 12, session, seq, 0, 0)
        return gre_tunnel(frame, 0x22EB, hdr, flags=0xB000, seq=seq, outer_v=6)

    def erspan1(frame: bytes, seq: int) -> bytes:
        return gre_tunnel(frame, 0x88BE, flags=0)
    mine = {5: [], 9: []}
    frames = []
    for i in range(60):
        inner = roce_v4(i)
        session = (5, 9, 17)[i % 3]
        wrapped = erspan2(inner, session, i) if i % 2 else erspan3_v6(inner, session, i)
        frames.append(wrapped)
        if session in mine:
            mine[session].append(wrapped)
        frames += [inner, erspan1(inner, i)]
    kw = dict(netns=link[1], block_size=1 << 16, block_nr=8, retire_ms=10)
    with RingCapture("rx", erspan_session=5, **kw) as a, RingCapture("rx", erspan_session=9, **kw) as b:
        send_frames(frames, "tx", link[0])
        got = {5: [f.data for f in a.drain(0.1)], 9: [f.data for f in b.drain(0.05)]}
    assert got == mine and len(mine[5]) == len(mine[9]) == 20
    with pytest.raises(ValueError, match="1024"):
        RingCapture("rx", erspan_session=1024, **kw)


def test_read_block_times_out_and_blocks_stop(link):
    with RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=4, retire_ms=10) as cap:
        t = time.monotonic()
        assert cap.read_block(0.05) == [] and cap.read_block(0) == []
        assert time.monotonic() - t < 0.5
        stop = threading.Event()
        threading.Timer(0.1, stop.set).start()
        t = time.monotonic()
        assert list(cap.blocks(stop, poll_s=0.02)) == []
        assert time.monotonic() - t < 1.0


def test_ring_source_streams_in_list_order(link):
    from pyroute2 import IPRoute
    with IPRoute(netns=link[0], flags=0) as ipr:  # a second link between the namespaces
        ipr.link("add", ifname="tx2", kind="veth", peer={"ifname": "rx2", "net_ns_fd": link[1]})
        ipr.link("set", index=ipr.link_lookup(ifname="tx2")[0], state="up")
    with IPRoute(netns=link[1], flags=0) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="rx2")[0], state="up")
    caps = [RingCapture(i, netns=link[1], block_size=1 << 16, block_nr=4, retire_ms=5) for i in ("rx", "rx2")]
    stop, errors, got = threading.Event(), [], []
    try:
        reader = threading.Thread(target=lambda: got.extend(ring_source(caps, stop, errors, poll_s=0.01)))
        reader.start()
        send_frames([roce_v4(i) for i in range(70)], "tx", link[0])
        send_frames([roce_v4(i) for i in range(30)], "tx2", link[0])
        time.sleep(0.1)
        stop.set()
        reader.join(5)
        assert not reader.is_alive()
    finally:
        stop.set()
        for c in caps:
            c.close()
    assert errors == []
    assert [sum(1 for k, _ in got if k == s) for s in (0, 1)] == [70, 30]
    for s in (0, 1):
        idx = [f.index for k, f in got if k == s]
        assert idx == sorted(idx)


def test_errors_name_the_interface(link):
    with pytest.raises(CaptureSetupError, match=r"nosuch0 \(netns .*\): no such interface"):
        RingCapture("nosuch0", netns=link[1])
    with pytest.raises(CaptureSetupError, match="no-such-ns"):
        RingCapture("rx", netns="no-such-ns")
    with pytest.raises(OSError, match="nosuch0"):
        send_frames([roce_v4()], "nosuch0", link[0])


# -- sender timing ---------------------------------------------------------------------
def test_sender_paces_to_a_rate_and_to_timestamps(link):
    res = send_frames([roce_v4(i) for i in range(100)], "tx", link[0], timing="rate", pps=1000)
    assert res.sent == 100 and 0.095 <= res.seconds < 0.3
    stamped = [(i * 2_000_000, roce_v4(i)) for i in range(26)]   # 2 ms apart: 50 ms in all
    res = send_frames(stamped, "tx", link[0], timing="original")
    assert res.sent == 26 and 0.049 <= res.seconds < 0.25
    res = send_frames(stamped, "tx", link[0], timing="original", speed=10)
    assert res.seconds < 0.05
    with pytest.raises(ValueError):
        send_frames([], "tx", link[0], timing="rate")


def test_frames_larger_than_the_mtu_are_counted_not_raised(link):
    s = in_netns(link[0], lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
    s.bind(("tx", 0))
    try:
        res = send_frames([roce_v4(0, size=9500), roce_v4(1)], "tx", sock=s)
    finally:
        s.close()
    assert res.sent == 1 and res.failed == 1 and res.errors == {"EMSGSIZE": 1}


def test_link_down_is_reported_and_capture_resumes(link):
    from pyroute2 import IPRoute
    cap = RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=4, retire_ms=5)
    stop, errors, got = threading.Event(), [], []
    reader = threading.Thread(target=lambda: got.extend(ring_source([cap], stop, errors, poll_s=0.01)))
    reader.start()
    try:
        send_frames([roce_v4(i) for i in range(10)], "tx", link[0])
        with IPRoute(netns=link[1], flags=0) as ipr:
            rx = ipr.link_lookup(ifname="rx")[0]
            ipr.link("set", index=rx, state="down")
            time.sleep(0.1)
            ipr.link("set", index=rx, state="up")
        time.sleep(0.05)
        send_frames([roce_v4(i) for i in range(10, 20)], "tx", link[0])
        time.sleep(0.05)
    finally:
        stop.set()
        reader.join(5)
        cap.close()
    assert [struct.unpack_from("!I", f.data, 42)[0] for _, f in got] == list(range(20))
    assert len(errors) == 1 and "ENETDOWN" in errors[0] and "rx" in errors[0]
    assert cap.stats()["errors"] == {"ENETDOWN": 1}


def test_interface_counters_see_what_the_interface_dropped_before_the_ring(link):
    """Frames over the receiving veth's MTU are dropped by the interface itself
    (rx_dropped), before any capture ring: the ring counts none of them, the interface's
    counters (read through /proc/net/dev in its namespace, after the opening thread is
    gone) count them, and the frames it passed."""
    from pyroute2 import IPRoute
    from ckptd.live.nic import InterfaceCounters, parse_proc_net_dev
    with IPRoute(netns=link[1], flags=0) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="rx")[0], mtu=1500)
    nic = InterfaceCounters("rx", link[1])
    try:
        with RingCapture("rx", netns=link[1], block_size=1 << 16, block_nr=8, retire_ms=10) as cap:
            s = in_netns(link[0], lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
            s.bind(("tx", 0))
            try:
                for i in range(3):   # one try each (send_frames would retry the ENOBUFS)
                    try:
                        s.send(roce_v4(i, size=3000))
                    except OSError:
                        pass
            finally:
                s.close()
            res = send_frames([roce_v4(i) for i in range(20)], "tx", link[0])
            got = cap.drain(0.1)
            ring = cap.stats()
        st = nic.stats()
    finally:
        nic.close()
    assert res.sent == 20 and len(got) == 20 and ring["drops"] == 0
    assert st["dropped"] >= 3, st
    assert st["packets"] >= 20 and st["fifo"] == 0
    assert nic.stats() is None  # closed
    text = ("Inter-|   Receive\n face |bytes packets errs drop fifo frame compressed multicast|bytes\n"
            "    lo:  0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
            "eth1.100: 9000 7 1 2 3 0 0 0 0 0 0 0 0 0 0 0\n")
    assert parse_proc_net_dev(text, "eth1.100") == {"bytes": 9000, "packets": 7, "errors": 1, "dropped": 2,
                                                      "fifo": 3, "frame": 0, "compressed": 0, "multicast": 0}
    assert parse_proc_net_dev(text, "eth1") is None
