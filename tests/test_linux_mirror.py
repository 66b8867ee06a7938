"""switch_config.linux: tc mirror rules on a Linux port, really copying traffic.

Layout (three namespaces):  host: eth0 ──veth── p0 :switch: m0 ──veth── cap0 :ckpt
                                                          m1 ──veth── cap1
A frame the host sends enters p0 (ingress); a frame sent out of p0 from the switch
namespace leaves it (egress).
"""
from __future__ import annotations

import struct
from collections import Counter

import pytest

from ckptd.live.ring import RingCapture, in_netns
from ckptd.testing.netlab import lab_unavailable, remove_namespaces, unique_prefix
from ckptd.testing.sender import send_frames
from switch_config.linux import (MirrorError, add_loss, add_mirror, list_mirrors,
                                 remove_mirrors)


def frame(n: int, size: int = 100) -> bytes:
    body = struct.pack("!I", n) + b"\x5a" * (size - 4)
    udp = struct.pack("!HHHH", 50000, 4791, 8 + len(body), 0) + body
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                     bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]))
    return b"\x02\0\0\0\0\x02\x02\0\0\0\0\x01\x08\x00" + ip + udp


@pytest.fixture
def net():
    reason = lab_unavailable()
    if reason:
        pytest.skip(f"mirror tests need network namespaces: {reason}")
    from pyroute2 import IPRoute, netns
    p = unique_prefix()
    host, sw, ck = f"{p}-host", f"{p}-switch", f"{p}-ckpt"
    try:
        for n in (host, sw, ck):
            netns.create(n)
            in_netns(n, lambda: open("/proc/sys/net/ipv6/conf/default/disable_ipv6", "w").write("1"))
        with IPRoute(netns=sw, flags=0) as ipr:
            ipr.link("add", ifname="p0", kind="veth", peer={"ifname": "eth0", "net_ns_fd": host})
            for k in (0, 1):
                ipr.link("add", ifname=f"m{k}", kind="veth", peer={"ifname": f"cap{k}", "net_ns_fd": ck})
            for name in ("p0", "m0", "m1"):
                ipr.link("set", index=ipr.link_lookup(ifname=name)[0], state="up")
        for ns, names in ((host, ["eth0"]), (ck, ["cap0", "cap1"])):
            with IPRoute(netns=ns, flags=0) as ipr:
                for name in names:
                    ipr.link("set", index=ipr.link_lookup(ifname=name)[0], state="up")
        yield {"host": host, "sw": sw, "ck": ck}
    finally:
        remove_namespaces([host, sw, ck])


def traffic(net, n_in: int, n_out: int):
    """n_in frames into p0 from the host, n_out frames out of p0 from the switch;
    returns what cap0 and cap1 captured (sequence numbers)."""
    caps = [RingCapture(f"cap{k}", net["ck"], block_size=1 << 16, block_nr=8, retire_ms=5) for k in (0, 1)]
    try:
        assert send_frames([frame(i) for i in range(n_in)], "eth0", net["host"]).sent == n_in
        assert send_frames([frame(1000 + i) for i in range(n_out)], "p0", net["sw"]).sent == n_out
        return [sorted(struct.unpack_from("!I", f.data, 42)[0] for f in c.drain(0.08)) for c in caps]
    finally:
        for c in caps:
            c.close()


def test_add_list_mirror_remove(net):
    sw = net["sw"]
    rules = add_mirror("p0", "m0", "both", netns=sw)
    assert [(r.ifname, r.direction, r.dst_ifname) for r in rules] == [("p0", "ingress", "m0"), ("p0", "egress", "m0")]
    assert {r.classifier for r in rules} <= {"matchall", "u32"} and len({r.prio for r in rules}) == 2
    # A second session on the same port and hook: both must get every copy.
    rules += add_mirror("p0", "m1", "rx", netns=sw)
    assert sorted(list_mirrors("p0", netns=sw), key=lambda r: r.prio) == sorted(rules, key=lambda r: r.prio)
    assert sorted(list_mirrors(netns=sw), key=lambda r: r.prio) == sorted(rules, key=lambda r: r.prio)

    got0, got1 = traffic(net, 40, 25)
    assert got0 == list(range(40)) + list(range(1000, 1025))   # ingress and egress
    assert got1 == list(range(40))                              # ingress only

    removed = remove_mirrors("p0", netns=sw, dst_ifname="m1")
    assert [r.dst_ifname for r in removed] == ["m1"]
    assert {r.dst_ifname for r in list_mirrors(netns=sw)} == {"m0"}
    assert traffic(net, 5, 0) == [list(range(5)), []]

    assert len(remove_mirrors("p0", netns=sw)) == 2
    assert list_mirrors(netns=sw) == []
    assert traffic(net, 5, 5) == [[], []]
    from pyroute2 import IPRoute
    with IPRoute(netns=sw, flags=0) as ipr:  # the clsact qdisc went with the last rule
        p0 = ipr.link_lookup(ifname="p0")[0]
        assert not [q for q in ipr.get_qdiscs(index=p0) if q.get_attr("TCA_KIND") == "clsact"]


def test_tx_direction_is_the_ports_egress(net):
    (rule,) = add_mirror("p0", "m0", "tx", netns=net["sw"])
    assert rule.direction == "egress"
    assert traffic(net, 10, 10)[0] == list(range(1000, 1010))


def test_errors_name_the_interface(net):
    with pytest.raises(MirrorError, match=r"nosuch \(netns .*-switch\): no such interface"):
        add_mirror("nosuch", "m0", "rx", netns=net["sw"])
    with pytest.raises(MirrorError, match=r"nosuch .*no such interface"):
        add_mirror("p0", "nosuch", "rx", netns=net["sw"])
    with pytest.raises(MirrorError, match="direction"):
        add_mirror("p0", "m0", "sideways", netns=net["sw"])
    with pytest.raises(MirrorError, match="no-such-netns"):
        list_mirrors(netns="no-such-netns")
    assert list_mirrors(netns=net["sw"]) == []   # nothing half-made


def test_loss_on_a_link_is_random_and_counted(net):
    kind = add_loss("m0", 0.3, netns=net["sw"])
    add_mirror("p0", "m0", "rx", netns=net["sw"])
    got, _ = traffic(net, 2000, 0)
    assert kind in ("netem", "bpf")
    assert 0.22 < 1 - len(got) / 2000 < 0.38
    assert not (Counter(got) - Counter(range(2000)))       # only drops, nothing else
    from pyroute2 import IPRoute
    with IPRoute(netns=net["sw"], flags=0) as ipr:
        m0 = ipr.link_lookup(ifname="m0")[0]
        drops = sum((q.get_attr("TCA_STATS") or {}).get("drop", 0) for q in ipr.get_qdiscs(index=m0))
    assert drops == 2000 - len(got)                         # every drop shows in tc stats
    with pytest.raises(MirrorError, match="probability"):
        add_loss("m1", 1.5, netns=net["sw"])
