"""ckptd.testing.netlab: a whole test network from a synthesized plan.

`ckptd synth --model tiny --ranks 3 --iterations 2 --mirrors 2` (mirrors on the ports
of ranks 0 and 1, both directions), every host sends its own frames from its own
namespace, RingCapture listens on each mirror's capture interface, and each mirror
must have captured exactly what the synthesizer says its port carries.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import struct
from collections import Counter
from pathlib import Path

import pytest

from ckptd.testing import netlab
from ckptd.testing.netlab import NetLab, NetLabError, host_frames, lab_namespaces
from ckptd.core.plan import Mirror, load_plan
from parsers.pcap import read_pcap, write_pcap

RING = dict(block_size=1 << 22, block_nr=8, retire_ms=10)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    reason = netlab.lab_unavailable()
    if reason:
        pytest.skip(f"netlab tests need network namespaces: {reason}")
    from ckptd.cli import main
    out = tmp_path_factory.mktemp("netlab_run")
    assert main(["synth", "--model", "tiny", "--ranks", "3", "--iterations", "2",
                 "--mirrors", "2", "--out", str(out)]) == 0
    return out


@pytest.fixture
def prefix():
    """A fresh lab name; whatever a test leaves behind under it is removed."""
    p = netlab.unique_prefix()
    yield p
    left = netlab.down(p, exact=True)
    assert not left, f"test left namespaces behind: {left}"


def roce_or_gre(f: bytes) -> bool:
    """What RingCapture's kernel filter passes, for these untagged IPv4 frames."""
    return f[12:14] == b"\x08\x00" and (f[23] == 47 or (f[23] == 17 and f[36:38] == b"\x12\xb7"))


def expected(run: Path, name: str) -> list[bytes]:
    return [f.data for f in read_pcap(run / "mirrors" / f"{name}.pcap")]


def test_host_frames_cover_the_wire(run):
    hf = host_frames(run)
    assert sorted(hf) == [0, 1, 2] and all(hf.values())
    mirrored = {(f.ts_ns, f.data) for m in ("mirror0", "mirror1")
                for f in read_pcap(run / "mirrors" / f"{m}.pcap")}
    assert sum(map(len, hf.values())) == len(mirrored)   # 3 ranks, 2 mirrors: all of it
    for r, frames in hf.items():
        assert all(f[26:30] == bytes([10, 77, 0, r + 1]) for _, f in frames)  # source = rank
        assert [t for t, _ in frames] == sorted(t for t, _ in frames)


def test_each_mirror_captures_exactly_its_ports_traffic(run, prefix):
    frames = host_frames(run)
    with NetLab(run / "plan.json", prefix=prefix) as lab:
        assert set(lab_namespaces(prefix, exact=True)) == set(lab.namespaces)
        assert [[(r.ifname, r.direction) for r in m.rules] for m in lab.mirrors] == \
            [[("h0", "ingress"), ("h0", "egress")], [("h1", "ingress"), ("h1", "egress")]]
        caps = lab.capture(**RING)
        raw = lab.capture(bpf=False, **RING)
        sent = lab.send(frames)
        got = [c.drain(0.1) for c in caps]
        got_raw = [c.drain(0.05) for c in raw]
        stats = [c.stats() for c in caps]
        assert lab.link_drops() == {"mirror0": 0, "mirror1": 0}
    assert not lab_namespaces(prefix)
    assert {r: s.sent for r, s in sent.items()} == {r: len(f) for r, f in frames.items()}
    assert all(s.failed == 0 for s in sent.values())
    for m, g, graw, st in zip(lab.mirrors, got, got_raw, stats):
        want = expected(run, m.name)
        # Everything the synthesizer put on that port, nothing else (no kernel chatter)...
        assert Counter(f.data for f in graw) == Counter(want), m.name
        # ...and through the kernel filter, exactly the RoCE part of it.
        assert Counter(f.data for f in g) == Counter(f for f in want if roce_or_gre(f)), m.name
        assert st["drops"] == 0 and st["packets"] == st["delivered"] == len(g)
        assert all(f.linktype == 1 and f.caplen == f.origlen for f in g)


def test_loss_on_one_mirror_link_and_replay_is_still_bit_exact(run, prefix, tmp_path):
    frames = host_frames(run)
    with NetLab(run / "plan.json", prefix=prefix, loss={"mirror1": 0.05}) as lab:
        caps = lab.capture(bpf=False, **RING)
        # Original timing (compressed 20x) keeps the ranks' frames in wire order.
        lab.send(frames, timing="original", speed=20)
        got = [c.drain(0.1) for c in caps]
        drops = lab.link_drops()
        kinds = [m.loss_kind for m in lab.mirrors]
    assert kinds[0] is None and kinds[1] in ("netem", "bpf")
    want = [Counter(expected(run, m)) for m in ("mirror0", "mirror1")]
    assert Counter(f.data for f in got[0]) == want[0] and drops["mirror0"] == 0
    lost = want[1] - Counter(f.data for f in got[1])
    assert not Counter(f.data for f in got[1]) - want[1]          # nothing but losses
    assert sum(lost.values()) == drops["mirror1"] > 0              # every loss accounted for

    # The captured streams go through the pipeline: mirror0 fills mirror1's gaps.
    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.pipeline import ReplayOptions, replay
    paths = []
    for m, g in zip(("mirror0", "mirror1"), got):
        paths.append(str(tmp_path / f"{m}.pcap"))
        write_pcap(paths[-1], g)
    pipe = replay(load_plan(run / "plan.json"), paths, load_checkpoint(run / "init.pt"),
                  ReplayOptions(out=str(tmp_path / "ckpt"), reference=str(run / "reference")))
    assert [(r.iteration, r.status, r.exact) for r in pipe.reports] == [(0, "committed", True),
                                                                        (1, "committed", True)]


def test_everything_is_removed_when_the_body_raises(run, prefix):
    with pytest.raises(RuntimeError, match="boom"):
        with NetLab(run / "plan.json", prefix=prefix) as lab:
            lab.capture(**RING)
            assert len(lab_namespaces(prefix, exact=True)) == 5
            raise RuntimeError("boom")
    assert lab_namespaces(prefix) == []


def test_a_failed_build_leaves_nothing(run, prefix):
    with pytest.raises(Exception):
        NetLab(run / "plan.json", prefix=prefix, mtu=70000).up()   # above veth's maximum
    assert lab_namespaces(prefix) == []
    with pytest.raises(NetLabError, match="not in the plan"):
        NetLab(run / "plan.json", prefix=prefix, loss={"mirror9": 0.1})


def test_same_name_twice_is_refused_and_down_by_prefix(run, prefix):
    lab = NetLab(run / "plan.json", prefix=prefix).up()
    try:
        with pytest.raises(NetLabError, match="already exist"):
            NetLab(run / "plan.json", prefix=prefix).up()
        assert lab.exists()                                  # the refusal did not touch it
        st = netlab.lab_status(prefix, exact=True)
        assert len(st[f"{prefix}-sw"]["mirrors"]) == 4
    finally:
        gone = netlab.down(prefix, exact=True)
    assert sorted(gone) == sorted(lab.namespaces) and not lab.exists()


def test_host_checksum_offload_is_off(run, prefix):
    with NetLab(run / "plan.json", prefix=prefix) as lab:
        h = lab.hosts[0]
        assert netlab.tx_checksum(h.ifname, h.netns) is False
        assert netlab.tx_checksum("m0", lab.switch_ns) is True   # veth default, untouched


def test_ipv6_hosts_and_one_way_mirrors(run, prefix):
    """A plan with IPv6 addresses and a tx-only and an rx-only mirror; every rank sends
    to every other (and to a MAC no host has): each mirror sees what Mirror.sees says."""
    addrs = ("fd00:77::1", "fd00:77::2", "fd00:77::3")
    plan = dataclasses.replace(load_plan(run / "plan.json"), addresses=addrs,
                               mirrors=(Mirror("txonly", 0, "tx"), Mirror("rxonly", 2, "rx")))

    def v6(src: int, dst: int, n: int) -> bytes:
        body = struct.pack("!hhI", src, dst, n) + b"\0" * 56
        udp = struct.pack("!HHHH", 50000, 4791, 8 + len(body), 0) + body
        dst_ip = addrs[dst] if dst >= 0 else "fd00:99::1"   # a host that is not there
        ip = struct.pack("!IHBB", 6 << 28, len(udp), 17, 64) + \
            ipaddress.IPv6Address(addrs[src]).packed + ipaddress.IPv6Address(dst_ip).packed
        mac = lambda r: bytes([2, 0, 0, 0, 0, (r + 1) & 0xFF])  # noqa: E731
        return mac(dst) + mac(src) + b"\x86\xdd" + ip + udp

    frames = {r: [v6(r, d, n) for d in (0, 1, 2, -1) if d != r for n in range(20)] for r in range(3)}
    with NetLab(plan, prefix=prefix) as lab:
        assert [[r.direction for r in m.rules] for m in lab.mirrors] == [["ingress"], ["egress"]]
        caps = lab.capture(**RING)
        lab.send(frames)
        got = [Counter(f.data for f in c.drain(0.1)) for c in caps]
    for m, g in zip(plan.mirrors, got):
        want = Counter(f for fs in frames.values() for f in fs
                       if m.sees(*struct.unpack_from("!hh", f, 14 + 40 + 8)))
        assert g == want, m.name
