"""The daemon on real capture rings, without the switch of tests/test_live.py: each
mirror stream's recorded frames are sent over a veth pair of their own into a namespace
where the daemon captures. Kernel ring drops must be reported as such (status
`dropped`, exit status 4), never as an iteration merely abandoned at the stop."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.live.daemon import Daemon, DaemonConfig, InterfaceConfig
from ckptd.live.ring import in_netns, turn_bytes
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


def daemon_config(run, out, ns, workers=False, **ring) -> DaemonConfig:
    return DaemonConfig(plan=str(run / "plan.json"), init=str(run / "init.pt"), out=str(out),
                        listen="127.0.0.1:0", capture_workers=workers, persist_sync=True,
                        interfaces=[InterfaceConfig(f"mirror{k}", f"rx{k}", ns, **ring) for k in range(2)])


def send_streams(run, ns, pps, midway=None, wrap=None, link_of=lambda k: k):
    """Every mirror capture into its own link (stream k into tx<link_of(k)>),
    concurrently, paced at pps each; midway() is called when a third of the frames are
    out; wrap(frame, k, i) replaces frame i of stream k."""
    threads = []
    streams = [[f.data for f in read_pcap(p)] for p in pcaps(run)]
    if wrap is not None:
        streams = [[wrap(bytes(d), k, i) for i, d in enumerate(fr)] for k, fr in enumerate(streams)]
    third = len(streams[0]) // 3
    for part in ((0, third), (third, None)):
        for k, frames in enumerate(streams):
            threads.append(threading.Thread(target=send_frames, args=(frames[slice(*part)], f"tx{link_of(k)}", ns),
                                            kwargs=dict(timing="rate", pps=pps)))
            threads[-1].start()
        for t in threads:
            t.join(60)
        if midway is not None and part[1] is not None:
            midway()


def started(daemon) -> tuple[threading.Thread, dict]:
    """The daemon running on its own thread (its capture open): the thread, and the dict
    its exit status lands in ("rc")."""
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", daemon.run(install_signals=False)))
    t.start()
    deadline = time.time() + 30
    while daemon.snapshot.get().get("state") != "running" and time.time() < deadline:
        time.sleep(0.05)
    return t, result


def run_until_done(daemon, run, ns, pps=4000, midway=None, wrap=None, link_of=lambda k: k) -> int:
    """The daemon on its own thread while the streams are sent; stopped once iteration 5
    is reported (or 30 s after the last frame). Returns its exit status."""
    t, result = started(daemon)
    try:
        send_streams(run, ns, pps, midway, wrap, link_of)
        deadline = time.time() + 30
        while time.time() < deadline and not any(r.iteration == 5 for r in daemon.pipe.reports):
            time.sleep(0.1)
    finally:
        daemon.stop.set()
        t.join(60)
    return result["rc"]


def assert_every_iteration_exact(run, daemon, out, rc):
    """No kernel drop, iterations 0-5 committed, exit status 0, no error, and every
    checkpoint the trainer's bit for bit."""
    assert sum(c.stats()["drops"] for c in daemon.captures) == 0
    assert [(r.iteration, r.status) for r in daemon.pipe.reports] == [(i, "committed") for i in range(6)], \
        [(r.iteration, r.status, r.note) for r in daemon.pipe.reports]
    assert rc == 0 and daemon.pipe.errors == []
    assert_committed_are_exact(run, daemon, out)


def assert_committed_are_exact(run, daemon, out):
    for r in daemon.pipe.reports:
        if r.status == "committed":
            mine = load_checkpoint(out / checkpoint_name(r.iteration))
            assert diff_checkpoints(mine, load_checkpoint(run / "reference" / checkpoint_name(r.iteration))) == []


def test_a_drop_gap_covers_iterations_first_seen_after_it(caplog):
    """A ring that drops during a stall loses frames of iterations no frame of has been
    read yet: every iteration seen until the stream has placed frames captured after
    the gap counts as in flight during the drops; later ones do not. A ring found 3/4
    full is logged once, before it drops."""
    from types import SimpleNamespace

    class Ring:
        ifname, drops, ready_peak = "rx0", 0, 2

        def stats(self):
            return {"ifname": "rx0", "drops": self.drops, "block_nr": 8, "ready_peak": self.ready_peak}
    ring = Ring()
    d = Daemon.__new__(Daemon)
    d.captures, d.drop_iterations = [ring], set()
    d._drops_seen, d._drop_gaps, d._drops_done, d._drops_looked = [], {}, -1, 0.0
    d._ring_warned, d.nic_counters, d._nic_drops = set(), {}, {}  # no interface counters: the ring's drops alone
    d.pipe = SimpleNamespace(offset=0, highest=0, done=-1, stream_time=[time.time_ns()])

    def warned():
        return [r.fields for r in caplog.records if r.getMessage() == "capture ring nearly full"]
    d._watch_drops(force=True)
    assert d.drop_iterations == set() and warned() == []
    ring.ready_peak = 6  # 3/4 of the ring waiting: said once, with no drop yet
    d._watch_drops(force=True)
    d._watch_drops(force=True)
    assert [(w["interface"], w["ready_peak"], w["blocks"], w["drops"]) for w in warned()] == [("rx0", 6, 8, 0)]
    assert d.drop_iterations == set()
    ring.drops, ring.ready_peak = 100, 8  # the stall: iteration 0 open, the ring full
    d._watch_drops(force=True)
    assert d.drop_iterations == {0, 1}
    d.pipe.highest = 3  # frames from the ring's backlog, captured before the look
    d._watch_drops(force=True)
    assert d.drop_iterations == {0, 1, 2, 3, 4}
    d.pipe.highest, d.pipe.stream_time = 5, [time.time_ns()]  # placed frames from after the gap
    d._watch_drops(force=True)
    assert d.drop_iterations == set(range(7))
    d.pipe.highest, d.pipe.done = 9, 6
    d._watch_drops(force=True)
    assert d.drop_iterations == set(range(7))  # the gap is behind: later iterations are not in it
    assert len(warned()) == 1


def test_kernel_drops_are_reported_and_set_the_exit_status(run, links, tmp_path, caplog):
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
    # the ring that dropped was found full, and said so once
    full = [r.fields for r in caplog.records if r.getMessage() == "capture ring nearly full"]
    assert full and all(f["ready_peak"] == f["blocks"] == 2 for f in full), full
    assert len({f["interface"] for f in full}) == len(full)
    statuses = [r.status for r in daemon.pipe.reports]
    assert "dropped" in statuses and "abandoned" not in statuses, statuses
    assert all("kernel dropped frames" in r.note for r in daemon.pipe.reports if r.status == "dropped")
    assert result["rc"] == 4
    assert daemon.snapshot.get()["iterations_by_status"].get("dropped", 0) == statuses.count("dropped")
    assert_committed_are_exact(run, daemon, tmp_path / "ck")


def test_frames_the_interfaces_drop_are_reported_as_dropped(run, links, tmp_path, monkeypatch):
    """A third of the way in, both receiving veths' MTU falls below the data frames' size:
    from then on the interfaces drop every data frame themselves, before any ring. The
    rings drop nothing; the iteration in flight ends `dropped`, its note naming the
    interfaces' drops (before, it was abandoned, exit 0); the exit status is 4; /status
    has the interfaces' counts; what committed is exact."""
    from pyroute2 import IPRoute
    from ckptd.testing import sender
    monkeypatch.setattr(sender, "_MAX_RETRIES", 1)  # a frame the veth drops answers ENOBUFS: no retries
    daemon = Daemon(daemon_config(run, tmp_path / "ck", links[1], block_size=1 << 16, block_nr=64, retire_ms=10))

    def shrink():
        with IPRoute(netns=links[1], flags=0) as ipr:
            for k in range(2):
                ipr.link("set", index=ipr.link_lookup(ifname=f"rx{k}")[0], mtu=600)
    rc = run_until_done(daemon, run, links[0], midway=shrink)
    assert sum(c.stats()["drops"] for c in daemon.captures) == 0
    reports = [(r.iteration, r.status, r.note) for r in daemon.pipe.reports]
    dropped = [note for _, status, note in reports if status == "dropped"]
    assert dropped and all(status in ("committed", "dropped") for _, status, _ in reports), reports
    assert all("dropped by the interface before any ring" in note for note in dropped), dropped
    assert rc == 4
    nic = {k: v["interface"] for k, v in daemon.snapshot.get()["capture"].items()}
    assert set(nic) == {"rx0", "rx1"} and all(v["dropped"] > 0 for v in nic.values()), nic
    assert_committed_are_exact(run, daemon, tmp_path / "ck")


@pytest.fixture
def huge_page_pool():
    """16 more 2 MiB pages in the hugetlb pool while the test runs."""
    pool = Path("/proc/sys/vm/nr_hugepages")
    before = int(pool.read_text())
    try:
        pool.write_text(str(before + 16))
    except OSError as e:
        pytest.skip(f"cannot reserve huge pages: {e}")
    if int(pool.read_text()) < before + 16:
        pool.write_text(str(before))
        pytest.skip("the kernel found no memory for 16 huge pages")
    yield
    pool.write_text(str(before))


@pytest.mark.parametrize("workers,busy,huge", [(False, False, "auto"), (True, False, "off"), (True, True, "off"),
                                               (True, False, "on"), (True, False, "auto")],
                         ids=["in-process", "capture-workers", "capture-workers-busy-poll",
                              "capture-workers-huge-pages-on", "capture-workers-huge-pages-auto"])
def test_rings_without_drops_commit_every_iteration(run, links, tmp_path, request, workers, busy, huge):
    """The same traffic into rings that hold it: no drops, every iteration committed
    bit-exact, exit status 0; read in the daemon's process (ring blocks indexed in
    place) or by a capture worker process per interface (blocks through shared memory
    in 4 KiB pages, hugetlb pages with huge_pages: on, whatever the machine has with
    auto), sleeping in poll(2) or spinning on the ring."""
    if huge == "on":
        request.getfixturevalue("huge_page_pool")
    cfg = daemon_config(run, tmp_path / "ck", links[1], workers, block_size=1 << 16, block_nr=64, retire_ms=10)
    cfg.busy_poll, cfg.huge_pages = busy, huge
    daemon = Daemon(cfg)
    rc = run_until_done(daemon, run, links[0])
    caps = [c.stats() for c in daemon.captures]
    assert_every_iteration_exact(run, daemon, tmp_path / "ck", rc)
    sent = [sum(1 for _ in read_pcap(p)) for p in pcaps(run)]
    assert [c["delivered"] for c in caps] == [cls["frames"] for cls in daemon.pipe.classes]
    assert all(0 < c["packets"] <= n for c, n in zip(caps, sent))  # the filter passes RoCE only
    if workers:
        assert all(c["worker"]["alive"] is False and c["worker"]["lost"] == 0 for c in caps)
        assert len({c["worker"]["pid"] for c in caps}) == 2
        # a slot holds what the in-process path takes of a ring per turn, sized from the plan
        turn = turn_bytes(daemon.plan.least_link_bytes())
        assert all(c["worker"]["slot_bytes"] == max(1, turn >> 16) << 16 for c in caps), (turn, caps)
        pages = {c["worker"]["pages"] for c in caps}
        if huge == "auto":  # whatever the machine has: the same for both workers
            assert len(pages) == 1 and pages <= {"hugetlb", "thp", "4k"}
        else:
            assert pages == {"on": {"hugetlb"}, "off": {"4k"}}[huge]


@pytest.mark.parametrize("workers", [False, True], ids=["in-process", "capture-workers"])
def test_a_remote_mirror_session_is_unwrapped_by_the_kernel(run, links, tmp_path, workers):
    """The streams as remote mirror sessions deliver them (IPv4/GRE/ERSPAN II around
    every frame) into the rings: every iteration committed bit-exact, and the batch
    kernel unwrapped every frame itself: none went to the reference's decapsulation."""
    from ckptd.testing.tunnel import erspan2
    cfg = daemon_config(run, tmp_path / "ck", links[1], workers, block_size=1 << 16, block_nr=64, retire_ms=10)
    daemon = Daemon(cfg)
    rc = run_until_done(daemon, run, links[0], wrap=lambda d, k, i: erspan2(d, 100 + k, i))
    caps = [c.stats() for c in daemon.captures]
    assert_every_iteration_exact(run, daemon, tmp_path / "ck", rc)
    frames = sum(cls["frames"] for cls in daemon.pipe.classes)
    assert frames == sum(c["delivered"] for c in caps) > 0
    # (the reference still sees what it always does: a new flow's first packets, ...)
    assert daemon.pipe.stops["encapsulated"] == 0, daemon.pipe.stops
    assert daemon.pipe.kernel_frames > 0.9 * frames


@pytest.mark.parametrize("workers", [False, True], ids=["in-process", "capture-workers"])
def test_two_erspan_sessions_on_one_interface_are_two_streams(run, links, tmp_path, workers):
    """Both mirror streams arrive at one collector interface as ERSPAN sessions 100 and
    101; the config lists the interface once per session (erspan_session). Each ring gets
    its own session's frames only, and every iteration commits bit-exact."""
    from ckptd.testing.tunnel import erspan2
    cfg = daemon_config(run, tmp_path / "ck", links[1], workers, block_size=1 << 16, block_nr=64, retire_ms=10)
    for k, i in enumerate(cfg.interfaces):
        i.ifname, i.erspan_session = "rx0", 100 + k
    daemon = Daemon(cfg)
    rc = run_until_done(daemon, run, links[0], wrap=lambda d, k, i: erspan2(d, 100 + k, i), link_of=lambda k: 0)
    caps = [c.stats() for c in daemon.captures]
    assert_every_iteration_exact(run, daemon, tmp_path / "ck", rc)
    sent = [sum(1 for _ in read_pcap(p)) for p in pcaps(run)]
    assert [cls["frames"] for cls in daemon.pipe.classes] == [c["delivered"] for c in caps] == sent
    # /status keeps both rings of the one interface apart, each named by its stream
    status = daemon.snapshot.get()["capture"]
    assert {k: v["delivered"] for k, v in status.items()} == {"rx0:mirror0": sent[0], "rx0:mirror1": sent[1]}


@pytest.fixture(scope="module")
def static_run(tmp_path_factory):
    """DDP with static_graph=True on NCCL (synthesized): iteration 0 allreduces the used map
    first, iteration 1 the first layout again, the rebuilt layout from 2 on; the head is
    never used, so never stepped."""
    d = tmp_path_factory.mktemp("static")
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=6, mirrors=2,
          static_graph=True, unused=("head",), bucket_cap_kb=16)
    return d


@pytest.mark.parametrize("workers", [False, True], ids=["in-process", "capture-workers"])
def test_a_static_graph_job_commits_every_iteration_live(static_run, links, tmp_path, workers):
    """The daemon on static_graph's wire: its two opening layouts (the map-first round and
    the first layout again) and then the rebuilt one, through the rings, every iteration
    committed bit-exact."""
    cfg = daemon_config(static_run, tmp_path / "ck", links[1], workers, block_size=1 << 16, block_nr=64,
                        retire_ms=10)
    daemon = Daemon(cfg)
    assert daemon.plan.static_graph and daemon.plan.timeline_prefix == 2
    rc = run_until_done(daemon, static_run, links[0])
    assert_every_iteration_exact(static_run, daemon, tmp_path / "ck", rc)


def test_a_killed_capture_worker_is_reported_and_the_other_stream_goes_on(run, links, tmp_path):
    """Stream 1's worker is killed a third of the way in. The daemon names it, stream 0
    keeps being captured, and since stream 0 alone carries every element here (2 ranks,
    a mirror on each one's port) every iteration still commits, bit-exact."""
    daemon = Daemon(daemon_config(run, tmp_path / "ck", links[1], True, block_size=1 << 16,
                                  block_nr=64, retire_ms=10))
    seen = {}

    def kill_worker_1():
        time.sleep(0.3)  # what was sent so far is through
        seen["frames0"] = daemon.pipe.classes[0]["frames"]
        # each worker carries its stream in its kernel name (top, ps, capture_rate's CPU split)
        seen["comm"] = [Path(f"/proc/{c.pid}/comm").read_text().strip() for c in daemon.captures]
        os.kill(daemon.captures[1].pid, signal.SIGKILL)
        deadline = time.time() + 10
        while not daemon.pipe.errors and time.time() < deadline:
            time.sleep(0.05)

    rc = run_until_done(daemon, run, links[0], midway=kill_worker_1)
    assert seen["comm"] == ["ckptd-capture0", "ckptd-capture1"]
    assert len(daemon.pipe.errors) == 1, daemon.pipe.errors
    assert "capture worker for stream 1 on rx1" in daemon.pipe.errors[0] and "died" in daemon.pipe.errors[0]
    st = daemon.snapshot.get()
    assert st["capture"]["rx1"]["worker"]["alive"] is False
    assert st["capture"]["rx1"]["worker"]["exitcode"] == -signal.SIGKILL
    assert st["capture"]["rx0"]["drops"] == 0
    # the worker's ring high-water mark reaches the coordinator with its other counters
    assert 1 <= st["capture"]["rx0"]["ring"]["ready_peak"] < st["capture"]["rx0"]["ring"]["blocks"]
    frames0 = daemon.pipe.classes[0]["frames"]
    assert seen["frames0"] > 0 and frames0 > 2 * seen["frames0"]  # stream 0 went on
    assert daemon.pipe.classes[1]["frames"] < frames0
    assert [(r.iteration, r.status) for r in daemon.pipe.reports] == [(i, "committed") for i in range(6)]
    assert rc == 0
    assert_committed_are_exact(run, daemon, tmp_path / "ck")


def test_every_capture_worker_killed_ends_the_daemon_with_exit_6(run, links, tmp_path, caplog):
    """Both workers killed a third of the way in: the daemon's loop ran out of streams and
    stopped by itself, exit 0, the iteration in flight "abandoned" as at an operator's
    stop, each error saying "the other streams go on" (helper 71). systemd's
    Restart=on-failure then left a blind daemon down. Now: exit 6, and one error saying
    capture ended without a stop."""
    daemon = Daemon(daemon_config(run, tmp_path / "ck", links[1], True, block_size=1 << 16,
                                  block_nr=64, retire_ms=10))

    def kill_both():
        time.sleep(0.3)
        for c in daemon.captures:
            os.kill(c.pid, signal.SIGKILL)
        deadline = time.time() + 10
        while len(daemon.pipe.errors) < 2 and time.time() < deadline:
            time.sleep(0.05)

    with caplog.at_level("ERROR", logger="ckptd"):
        rc = run_until_done(daemon, run, links[0], midway=kill_both)
    assert rc == 6
    assert len(daemon.pipe.errors) == 2 and "no stream is left" in daemon.pipe.errors[-1], daemon.pipe.errors
    assert daemon.capture_ended and any("capture ended without a stop" in r.getMessage() for r in caplog.records)
    # what was committed before stays exact
    assert_committed_are_exact(run, daemon, tmp_path / "ck")


def test_capture_workers_commit_the_last_iteration_while_the_ports_are_quiet(run, links, tmp_path):
    """With capture workers, no batch came while the ports were quiet, so the capture
    clock stood still: the job's last iteration, complete, waited in its agreement window
    for the next traffic or the stop (1.5 s after the job, /status said 4 where the
    in-process loop said 5). The workers' quiet waits now move the clock as the rings'."""
    daemon = Daemon(daemon_config(run, tmp_path / "ck", links[1], True, block_size=1 << 16,
                                  block_nr=64, retire_ms=10))
    t, result = started(daemon)
    try:
        send_streams(run, links[0], 4000)
        deadline = time.time() + 5
        while time.time() < deadline and daemon.snapshot.get().get("last_committed") != 5:
            time.sleep(0.05)
        assert daemon.snapshot.get()["last_committed"] == 5, daemon.snapshot.get()["last_committed"]
        assert not daemon.stop.is_set()
    finally:
        daemon.stop.set()
        t.join(60)
    assert_every_iteration_exact(run, daemon, tmp_path / "ck", result["rc"])


@pytest.mark.parametrize("workers", [False, True, "busy", "reference"],
                         ids=["in-process", "capture-workers", "busy-poll", "reference-path"])
def test_every_interface_deleted_ends_the_daemon_with_exit_6(run, links, tmp_path, workers, caplog):
    """Both capture interfaces deleted mid-run: the daemon logged ENETDOWN (in-process;
    the workers said nothing) and went on capturing nothing, /status "running", exit 0.
    The kernel unbinds a packet socket from a device it unregisters, and one made again
    under the name is another device: a deleted interface's capture ends, and with none
    left the daemon ends by itself, exit 6, as when every capture worker dies. Busy-polling
    workers never called poll(2), where the socket's error shows: they spun on."""
    from pyroute2 import IPRoute
    cfg = daemon_config(run, tmp_path / "ck", links[1], workers in (True, "busy"), block_size=1 << 16,
                        block_nr=64, retire_ms=10)
    cfg.busy_poll = workers == "busy"
    cfg.fast = workers != "reference"
    daemon = Daemon(cfg)
    caplog.set_level("WARNING", logger="ckptd")
    t, result = started(daemon)
    try:
        streams = [[f.data for f in read_pcap(p)] for p in pcaps(run)]
        for k, frames in enumerate(streams):
            send_frames(frames[:len(frames) // 3], f"tx{k}", links[0], timing="rate", pps=4000)
        with IPRoute(netns=links[1], flags=0) as ipr:
            for k in range(2):
                ipr.link("del", index=ipr.link_lookup(ifname=f"rx{k}")[0])
                time.sleep(0.5)  # the first one's error is logged while the other ring goes on
        t.join(15)  # it ends by itself: nothing asked it to stop
        assert not t.is_alive(), "the daemon went on with no interface left"
    finally:
        daemon.stop.set()
        t.join(60)
    assert result["rc"] == 6 and daemon.capture_ended
    gone = [e for e in daemon.pipe.errors if "the interface is gone (deleted): its capture ends" in e]
    assert len(gone) == 2 and all(f"rx{k}" in " ".join(gone) for k in range(2)), daemon.pipe.errors
    # each error once: as it came, not again at the stop
    logged = [r.fields["error"] for r in caplog.records if r.getMessage() == "capture error"]
    assert sorted(logged) == sorted(daemon.pipe.errors), logged
    # as it came: the first before the stop (the reference path's loop said both at the
    # stop; the last one ends the capture, so it is said with the stop)
    said = [r.getMessage() for r in caplog.records if r.getMessage() in ("capture error", "stopped")]
    assert said.index("capture error") < said.index("stopped"), said
    assert_committed_are_exact(run, daemon, tmp_path / "ck")


def test_capture_worker_config_is_checked(run, tmp_path):
    from ckptd.live.daemon import ConfigError, load_config

    def cfg(extra: str, iface: str = ""):
        p = tmp_path / "c.yaml"
        p.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {tmp_path / 'ck'}\n"
                     f"interfaces:\n  - {{ifname: m0{iface}}}\n{extra}")
        return load_config(p)

    ok = cfg("capture_workers: true\nbusy_poll: true\ncpus: [0]\n", ", cpu: 0")
    assert ok.capture_workers and ok.busy_poll and ok.cpus == [0] and ok.interfaces[0].cpu == 0
    assert ok.huge_pages == "auto"
    for text, want in [("on", "on"), ("off", "off"), ("auto", "auto"), ("true", "on"), ("'off'", "off")]:
        assert cfg(f"capture_workers: true\nhuge_pages: {text}\n").huge_pages == want
    assert cfg("huge_pages: off\n").huge_pages == "off"  # no workers: nothing to put in huge pages anyway
    for extra, iface, msg in [
        ("capture_workers: yes please\n", "", "'capture_workers' must be true or false"),
        ("busy_poll: true\n", "", "busy_poll applies to capture workers"),
        ("", ", cpu: 0", r"interfaces\[0\].cpu pins a capture worker"),
        ("capture_workers: true\n", ", cpu: 4096", r"interfaces\[0\].cpu must be a CPU number"),
        ("cpus: [0, -1]\n", "", "'cpus' must be a list of CPU numbers"),
        ("cpus: 0\n", "", "'cpus' must be a list"),
        ("capture_workers: true\nfast: false\n", "", "cannot be used with fast: false"),
        ("capture_workers: true\nhuge_pages: always\n", "", "'huge_pages' must be one of auto, on, off, not 'always'"),
        ("huge_pages: on\n", "", "huge_pages applies to capture workers' shared memory"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            cfg(extra, iface)


def test_worker_slot_copy_rebases_blocks_that_wrap_the_ring():
    """A worker's batch of consecutive ring blocks that wraps (blocks 3, then 0 of 4)
    lands in its slot block after block, each frame's bytes and fields unchanged."""
    import numpy as np
    from ckptd.fast.batches import Batch
    from ckptd.live.workers import _copy_blocks
    bs, nr = 1024, 4
    ring = np.random.default_rng(1).integers(0, 256, bs * nr, dtype=np.uint8)
    offsets = np.array([3 * bs + 100, 3 * bs + 400, 0 * bs + 60, 0 * bs + 700], np.int64)
    caplen = np.array([200, 300, 500, 90], np.int64)
    batch = Batch(ring, offsets, caplen, caplen + 4, np.zeros(4, np.int32), np.ones(4, np.int32),
                  np.arange(1, 5, dtype=np.int64), np.arange(4, dtype=np.int64) * 7)
    data, meta = np.zeros(2 * bs, np.uint8), np.zeros((5, 64), np.int64)
    assert _copy_blocks(batch, bs, nr, data, meta) == 4
    assert meta[0, :4].tolist() == [100, 400, bs + 60, bs + 700]
    for i in range(4):
        o, n = int(meta[0, i]), int(caplen[i])
        assert data[o:o + n].tobytes() == ring[offsets[i]:offsets[i] + n].tobytes()
    assert meta[1:, :4].tolist() == [caplen.tolist(), (caplen + 4).tolist(), [0, 7, 14, 21], [1, 2, 3, 4]]


def test_capture_workers_check_the_icrc(run, links):
    """A worker checks each frame's ICRC as it hands a slot over: the coordinator's
    Batches say which frames are RoCE with a good ICRC (the kernel then computes no CRC
    for them), and a frame with one byte changed on the way is not one of them."""
    import numpy as np
    from ckptd.live.workers import CaptureWorkers
    # RoCEv2 only (the synthesized capture has other UDP too, which the ring's filter drops)
    frames = [fr.data for fr in read_pcap(pcaps(run)[0]) if fr.data[36:38] == b"\x12\xb7"][:300]
    bad = set(range(7, 300, 50))
    sent = [f[:60] + bytes([f[60] ^ 0xFF]) + f[61:] if i in bad else f for i, f in enumerate(frames)]
    iface = InterfaceConfig("mirror0", "rx0", links[1], block_size=1 << 16, block_nr=16, retire_ms=5)
    workers = CaptureWorkers([iface], bpf=True, icrc=True)
    stop, errors, got = threading.Event(), [], []
    try:
        threading.Timer(0.2, lambda: send_frames(sent, "tx0", links[0])).start()
        threading.Timer(3.0, stop.set).start()
        for _, b in workers.batches(stop, errors):
            got += [(b.frame(i).data, int(b.icrc_checked[i])) for i in range(len(b))]
    finally:
        stop.set()
        workers.close()
    assert errors == [] and [d for d, _ in got] == sent
    assert [i for i, (_, ok) in enumerate(got) if not ok] == sorted(bad)
    assert np.mean([ok for _, ok in got]) > 0.9


class _FakeWorker:
    """A capture worker's process as CaptureWorkers.batches sees it: a sentinel fd that
    turns readable when the process ends (end()), a pid and an exit code."""

    def __init__(self):
        self.sentinel, self._w = os.pipe()
        self.pid, self.exitcode = 0, None
        self.pipe_end = None  # its end of the pipe, closed as a killed process's would be

    def end(self, exitcode=0):
        self.exitcode = exitcode
        os.write(self._w, b"x")

    def kill(self):
        self.pipe_end.close()
        self.end(-9)

    def join(self, timeout=None):
        pass

    def close(self):
        os.close(self.sentinel)
        os.close(self._w)


def _fake_pool(n: int):
    """CaptureWorkers with n fake workers: (pool, the workers' ends of their pipes)."""
    import multiprocessing as mp
    import numpy as np
    from ckptd.live.workers import SLOTS, CaptureWorkers, WorkerCapture
    pool = CaptureWorkers.__new__(CaptureWorkers)
    pipes = [mp.Pipe() for _ in range(n)]
    pool.conns, pool.procs = [p[0] for p in pipes], [_FakeWorker() for _ in range(n)]
    pool.captures = [WorkerCapture(pool, k, f"rx{k}", None) for k in range(n)]
    for proc, p in zip(pool.procs, pipes):
        proc.pipe_end = p[1]
    pool.icrc = False
    views = [(np.zeros(64, np.uint8), np.zeros((5, 4), np.int64), np.zeros(4, np.uint8)) for _ in range(SLOTS)]
    pool._views = [views] * n
    pool._busy = [np.ones(SLOTS, np.uint8) for _ in range(n)]
    pool._stream = [np.full(4, k, np.int32) for k in range(n)]
    pool._linktype = np.ones(4, np.int32)
    return pool, [p[1] for p in pipes]


def _take(pool, errors=None, on_poll=None, stop=None):
    got = [k for k, b in pool.batches(stop or threading.Event(), [] if errors is None else errors, on_poll)
           if int(b.stream[0]) == k]
    for p in pool.procs:
        p.close()
    return got


def test_the_coordinator_takes_the_workers_slots_in_turn():
    """Slots waiting from several workers are taken one per worker in turn, as
    ring_batches takes the rings, however many one worker has queued: no stream gets
    ahead of the others by more than a slot (the pipeline closes an iteration once a
    stream is two past it, and the others' copies of it would come too late)."""
    pool, ends = _fake_pool(2)
    for slot in range(3):  # worker 0 has three slots waiting before worker 1 has one
        ends[0].send(("batch", slot, 1, {}))
    ends[1].send(("batch", 0, 1, {}))
    for e in ends:
        e.send(("done", {}))
    assert _take(pool) == [0, 1, 0, 0]
    assert all(c.done for c in pool.captures) and pool._busy[0][:3].tolist() == [0, 0, 0]


def test_a_worker_that_ended_with_slots_queued_still_takes_its_turn():
    """At stop a worker hands over what its ring held and ends: its process may be gone
    while its slots still wait in the pipe. They are taken in turn with the other
    workers' (not all at once), and a worker that ends without saying done has died: it
    is reported once everything it sent has been taken."""
    pool, ends = _fake_pool(3)
    for slot in range(3):
        ends[0].send(("batch", slot, 1, {}))
        ends[2].send(("batch", slot, 1, {}))
    ends[0].send(("done", {}))
    ends[0].close()
    pool.procs[0].end(0)  # ended normally, after its last slots
    ends[1].send(("batch", 0, 1, {}))
    ends[1].close()
    pool.procs[1].end(-9)  # killed: no "done"
    ends[2].send(("done", {}))
    errors = []
    assert _take(pool, errors) == [0, 1, 2, 0, 2, 0, 2]
    assert [c.done for c in pool.captures] == [True, False, True]
    assert len(errors) == 1 and "stream 1 on rx1" in errors[0] and "exit code -9" in errors[0], errors
    assert pool.captures[1].exitcode == -9


def test_a_worker_whose_pipe_closed_before_its_process_ended_is_waited_for_not_spun_on():
    """A worker that dies of an exception closes its pipe while its interpreter shuts
    down, before the process ends: the coordinator waits for the process's sentinel in
    poll(2) (a hung-up pipe polls ready for ever), then reports it."""
    pool, ends = _fake_pool(2)
    ends[0].close()  # EOF now, the process ends 0.3 s later
    threading.Timer(0.3, pool.procs[0].end, (1,)).start()
    ends[1].send(("done", {}))
    waits, errors = [], []
    assert _take(pool, errors, on_poll=waits.append) == []
    assert len(errors) == 1 and "exit code 1" in errors[0], errors
    assert len(waits) < 100, f"{len(waits)} waits in ~0.3 s: spinning on the hung-up pipe"


def test_a_worker_hung_at_the_stop_is_killed_and_what_it_handed_over_is_kept(monkeypatch):
    """A healthy worker ends within STOP_DRAIN_S of the stop; one still running after
    STOP_GRACE_S is hung: it is killed (so the daemon stops in bounded time) and said so,
    and the slots it handed over before are still taken."""
    import ckptd.live.workers as workers
    monkeypatch.setattr(workers, "STOP_GRACE_S", 0.2)
    pool, ends = _fake_pool(2)
    ends[0].send(("batch", 0, 1, {}))  # then nothing: no "done", the process never ends
    ends[1].send(("done", {}))
    stop, errors = threading.Event(), []
    stop.set()
    assert _take(pool, errors, stop=stop) == [0]
    assert len(errors) == 1 and "stream 0 on rx0" in errors[0] and \
        "did not stop within 0.2 s of the stop and was killed" in errors[0], errors
    assert pool.captures[1].done and not pool.captures[0].done
