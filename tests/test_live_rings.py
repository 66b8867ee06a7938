"""The daemon on real capture rings, without the switch of tests/test_live.py: each
mirror stream's recorded frames are sent over a veth pair of their own into a namespace
where the daemon captures. Kernel ring drops must be reported as such (status
`dropped`, exit status 4), never as an iteration merely abandoned at the stop."""
from __future__ import annotations

import threading
import time

import pytest

from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.live.daemon import Daemon, DaemonConfig, InterfaceConfig
from ckptd.live.ring import in_netns
from ckptd.testing.netlab import lab_unavailable, remove_namespaces, unique_prefix
from ckptd.testing.sender import send_frames
from parsers.pcap import read_pcap

from helpers import pcaps, synth


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("rings")
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=6, mirrors=2)
    return d


@pytest.fixture
def links():
    """Namespaces a (senders) and b (the daemon), joined by veth pairs tx<k> -> rx<k>."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    from pyroute2 import IPRoute, netns
    p = unique_prefix()
    names = [f"{p}-a", f"{p}-b"]
    try:
        for n in names:
            netns.create(n)
        for k in range(2):
            with IPRoute(netns=names[0], flags=0) as ipr:
                ipr.link("add", ifname=f"tx{k}", kind="veth", peer={"ifname": f"rx{k}", "net_ns_fd": names[1]})
                ipr.link("set", index=ipr.link_lookup(ifname=f"tx{k}")[0], mtu=9000, state="up")
            with IPRoute(netns=names[1], flags=0) as ipr:
                ipr.link("set", index=ipr.link_lookup(ifname=f"rx{k}")[0], mtu=9000, state="up")
        for n in names:  # no IPv6 chatter on the links
            in_netns(n, lambda: open("/proc/sys/net/ipv6/conf/all/disable_ipv6", "w").write("1"))
        yield names
    finally:
        remove_namespaces(names)


def daemon_config(run, out, ns, **ring) -> DaemonConfig:
    return DaemonConfig(plan=str(run / "plan.json"), init=str(run / "init.pt"), out=str(out),
                        listen="127.0.0.1:0",
                        interfaces=[InterfaceConfig(f"mirror{k}", f"rx{k}", ns, **ring) for k in range(2)])


def send_streams(run, ns, pps):
    """Every mirror capture into its own link, concurrently, paced at pps each."""
    threads = []
    for k, p in enumerate(pcaps(run)):
        frames = [f.data for f in read_pcap(p)]
        threads.append(threading.Thread(target=send_frames, args=(frames, f"tx{k}", ns),
                                        kwargs=dict(timing="rate", pps=pps)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def assert_committed_are_exact(run, daemon, out):
    for r in daemon.pipe.reports:
        if r.status == "committed":
            mine = load_checkpoint(out / checkpoint_name(r.iteration))
            assert diff_checkpoints(mine, load_checkpoint(run / "reference" / checkpoint_name(r.iteration))) == []


def test_kernel_drops_are_reported_and_set_the_exit_status(run, links, tmp_path):
    """Rings of two 16 KiB blocks and a daemon that stalls 0.5 s on its first batch:
    the kernel drops frames, the iterations hit end `dropped` (not abandoned or merely
    unrecoverable), the exit status is 4, and whatever committed is exact."""
    daemon = Daemon(daemon_config(run, tmp_path / "ck", links[1], block_size=1 << 14, block_nr=2,
                                  frame_size=2048, retire_ms=5))
    real_run_batch, stalled = daemon.pipe.run_batch, []

    def stall_once(batch):
        if not stalled:
            stalled.append(True)
            time.sleep(0.5)
        real_run_batch(batch)

    daemon.pipe.run_batch = stall_once
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", daemon.run(install_signals=False)))
    t.start()
    try:
        time.sleep(0.5)  # the rings are open
        send_streams(run, links[0], pps=4000)
        time.sleep(0.5)
    finally:
        daemon.stop.set()
        t.join(60)
    drops = sum(c.stats()["drops"] for c in daemon.captures)
    assert stalled and drops > 0
    statuses = [r.status for r in daemon.pipe.reports]
    assert "dropped" in statuses and "abandoned" not in statuses, statuses
    assert all("kernel dropped frames" in r.note for r in daemon.pipe.reports if r.status == "dropped")
    assert result["rc"] == 4
    assert daemon.snapshot.get()["iterations_by_status"].get("dropped", 0) == statuses.count("dropped")
    assert_committed_are_exact(run, daemon, tmp_path / "ck")


def test_rings_without_drops_commit_every_iteration(run, links, tmp_path):
    """The same traffic into rings that hold it: no drops, every iteration committed
    bit-exact from the ring blocks indexed in place, exit status 0."""
    daemon = Daemon(daemon_config(run, tmp_path / "ck", links[1], block_size=1 << 16, block_nr=64,
                                  retire_ms=10))
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", daemon.run(install_signals=False)))
    t.start()
    try:
        time.sleep(0.5)
        send_streams(run, links[0], pps=4000)
        deadline = time.time() + 30
        while time.time() < deadline and not any(r.iteration == 5 for r in daemon.pipe.reports):
            time.sleep(0.1)
    finally:
        daemon.stop.set()
        t.join(60)
    assert sum(c.stats()["drops"] for c in daemon.captures) == 0
    assert [(r.iteration, r.status) for r in daemon.pipe.reports] == [(i, "committed") for i in range(6)]
    assert result["rc"] == 0
    assert_committed_are_exact(run, daemon, tmp_path / "ck")
