"""The daemon's loop, status and metrics, fed from files (the live network test is
tests/test_live.py)."""
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from ckptd.live.daemon import ConfigError, Daemon, load_config
from ckptd.live.status import run_delay
from ckptd.pipeline import ReplayOptions, file_source

from helpers import busy, pcaps, synth


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("daemon")
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=4, mirrors=2)
    return d


def _config(d, tmp_path, **extra):
    cfg = tmp_path / "ckptd.yaml"
    ns = extra.pop("interfaces_netns", None)
    where = f", netns: {ns}" if ns else ""
    lines = [f"plan: {d / 'plan.json'}", f"init: {extra.pop('init', d / 'init.pt')}", f"out: {tmp_path / 'ck'}",
             f"listen: {extra.pop('listen', '127.0.0.1:0')}", "interfaces:",
             f"  - {{name: mirror0, ifname: m0{where}}}",
             f"  - {{name: mirror1, ifname: {extra.pop('second', 'm1')}{where}}}"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def test_daemon_commits_and_serves_status_and_metrics(run, tmp_path):
    daemon = Daemon(load_config(_config(run, tmp_path)))
    gate = threading.Event()
    seen = {}

    def source():
        frames = list(file_source(pcaps(run), []))
        yield from frames[: len(frames) * 3 // 5]  # the daemon sits mid-capture here
        gate.set()
        seen["status"] = json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{daemon.address[1]}/status").read())
        seen["metrics"] = urllib.request.urlopen(
            f"http://127.0.0.1:{daemon.address[1]}/metrics").read().decode()
        yield from frames[len(frames) * 3 // 5:]

    rc = daemon.run(source=source(), install_signals=False)
    assert rc == 0 and gate.is_set()
    st = seen["status"]
    assert st["state"] == "running" and st["last_committed"] >= 1
    assert [s["name"] for s in st["streams"]] == ["mirror0", "mirror1"]
    assert st["streams"][0]["frames"] > 0 and st["commit_lag_s"] is not None
    assert "ckptd_last_committed_iteration" in seen["metrics"]
    assert 'ckptd_stream_frames_total{stream="mirror0"}' in seen["metrics"]
    loop = {m[1]: float(m[2]) for m in re.finditer(r'^ckptd_loop_seconds_total\{part="(\w+)"\} (\S+)$',
                                                   seen["metrics"], re.M)}
    assert loop["cpu"] > 0 and loop["idle"] == 0, loop  # from a file: the loop never waits for traffic
    assert set(loop) >= {"cpu", "idle", "waiting"}
    assert (tmp_path / "ck" / "iter_000003.pt").exists()


def test_stop_mid_iteration_abandons_it_and_keeps_the_last_exact_checkpoint(run, tmp_path):
    daemon = Daemon(load_config(_config(run, tmp_path)))
    frames = list(file_source(pcaps(run), []))

    def source():
        for i, f in enumerate(frames):
            if i == len(frames) * 7 // 10:
                daemon.stop.set()  # what SIGTERM does
            if daemon.stop.is_set():
                return
            yield f

    daemon.run(source=source(), install_signals=False)
    reps = daemon.pipe.reports
    assert reps[-1].status == "abandoned"
    committed = [r.iteration for r in reps if r.status == "committed"]
    assert committed == list(range(len(committed))) and committed
    assert (tmp_path / "ck" / f"iter_{committed[-1]:06d}.pt").exists()
    assert daemon.snapshot.get()["state"] == "stopped"


def test_config_errors_name_the_problem(run, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("plan: p.json\ninit: i.pt\nout: o\ninterfaces: []\n")
    with pytest.raises(ConfigError, match="no mirror port"):
        load_config(bad)
    with pytest.raises(ConfigError, match="unknown keys"):
        load_config(_config(run, tmp_path, colour="blue"))


def test_fast_daemon_matches_the_reference_daemon(run, tmp_path):
    """The same frames through the fast daemon (FastPipeline, batches) and the reference
    daemon (Pipeline): the same reports, counters and checkpoints; both abandon the
    iteration in flight when stopped."""
    from ckptd.core.checkpoint import diff_checkpoints, load_checkpoint
    from ckptd.fast.pipeline import FastPipeline
    from ckptd.pipeline import Pipeline

    frames = list(file_source(pcaps(run), []))
    cut = len(frames) * 7 // 10  # stop mid-iteration

    def go(fast):
        d = tmp_path / ("fast" if fast else "ref")
        d.mkdir()
        daemon = Daemon(load_config(_config(run, d, fast="true" if fast else "false")))
        seen = []
        daemon.pipe.on_iteration = lambda rep: (seen.append(rep.iteration), daemon._on_iteration(rep))
        assert daemon.fast is fast
        assert type(daemon.pipe) is (FastPipeline if fast else Pipeline)
        rc = daemon.run(source=iter(frames[:cut]), install_signals=False)
        return daemon, rc, seen, d / "ck"

    ref, ref_rc, ref_seen, ref_ck = go(False)
    fast, fast_rc, fast_seen, fast_ck = go(True)
    assert fast_rc == ref_rc == 0
    assert fast_seen == ref_seen and fast_seen

    def key(r):
        return (r.iteration, r.status, r.packets, r.grad_bytes, r.coverage, r.loss, r.note,
                [(m.bucket, m.start, m.end) for m in r.missing])
    assert [key(r) for r in fast.pipe.reports] == [key(r) for r in ref.pipe.reports]
    assert fast.pipe.reports[-1].status == "abandoned"
    assert fast.frames == ref.frames == cut
    assert fast.pipe.classes == ref.pipe.classes
    assert dict(fast.pipe.extract.counters) == dict(ref.pipe.extract.counters)
    assert fast.by_status == ref.by_status
    a, b = fast.snapshot.get(), ref.snapshot.get()
    for k in ("state", "last_committed", "iterations_by_status", "extraction", "shadow_stopped_after"):
        assert a[k] == b[k], k
    assert [(s["name"], s["frames"], s["classes"], s["coverage"]) for s in a["streams"]] == \
        [(s["name"], s["frames"], s["classes"], s["coverage"]) for s in b["streams"]]
    assert a["pipeline"]["fast"] and a["pipeline"]["kernel_frames"] > 0 and not b["pipeline"]["fast"]
    names = sorted(p.name for p in ref_ck.glob("iter_*.pt"))  # and a manifest each
    assert names and sorted(p.name for p in fast_ck.glob("iter_*.pt")) == names
    for n in names:
        assert diff_checkpoints(load_checkpoint(fast_ck / n), load_checkpoint(ref_ck / n)) == []


def test_fast_key_defaults_to_the_transport_and_is_checked(run, tmp_path):
    assert load_config(_config(run, tmp_path)).fast is None
    assert Daemon(load_config(_config(run, tmp_path))).fast  # a RoCE plan
    assert load_config(_config(run, tmp_path, fast="false")).fast is False
    with pytest.raises(ConfigError, match="'fast' must be true or false"):
        load_config(_config(run, tmp_path, fast="sometimes"))


def test_join_keys(run, tmp_path):
    cfg = load_config(_config(run, tmp_path))
    assert cfg.join is False and cfg.join_from is None
    cfg = load_config(_config(run, tmp_path, join_from=120))
    assert cfg.join is True and cfg.join_from == 120  # join_from implies join
    with pytest.raises(ConfigError, match="'join' must be true or false"):
        load_config(_config(run, tmp_path, join="maybe"))
    with pytest.raises(ConfigError, match="'join_from' must be an iteration number"):
        load_config(_config(run, tmp_path, join_from="soon"))


def test_joining_daemon_reports_where_it_joined(run, tmp_path):
    """Fed the captures from iteration 1 on (the first frames cut away): the daemon joins
    at 1 and, its init being iteration -1, takes the shadow from the trainer's checkpoint
    of iteration 0 in the resume directory."""
    paths = pcaps(run)
    frames = list(file_source(paths, []))
    ts = sorted({fr.ts_ns for _, fr in frames})
    # the synthesizer leaves 5 ms between iterations: the first such gap starts iteration 1
    first = [i for i in range(1, len(ts)) if ts[i] - ts[i - 1] > 1_000_000][0]
    later = [(k, fr) for k, fr in frames if fr.ts_ns >= ts[first]]
    d = Daemon(load_config(_config(run, tmp_path, join="true", resume=run / "reference")))
    assert d.run(source=iter(later), install_signals=False) == 0
    assert d.pipe.joined == 1
    reps = list(d.pipe.reports)
    assert [(r.iteration, r.status) for r in reps] == [(1, "committed"), (2, "committed"), (3, "committed")]
    doc = json.loads(json.dumps(d.snapshot.get()))
    assert doc["join"] == {"joining": False, "joined_at": 1, "packets_before": 0, "unbound": [],
                           "restarted_from": None}


def test_startup_objects_are_out_of_the_collectors_walks_while_capturing(run, tmp_path):
    """While the loop runs, what the daemon made before it (torch, plan, schedules, shadow)
    is frozen (gc.freeze): a full collection over it held the GIL for 60-160 ms and the
    rings overflowed. Garbage the loop makes is still collected, and at the stop the
    objects go back to the collector."""
    import gc
    import weakref
    daemon = Daemon(load_config(_config(run, tmp_path)))
    seen = {}

    class Holder:
        pass

    def source():
        frames = list(file_source(pcaps(run), []))
        yield from frames[:len(frames) // 2]
        seen["frozen"] = gc.get_freeze_count()
        seen["pipe_walked"] = any(o is daemon.pipe for o in gc.get_objects())
        holder = Holder()
        holder.me = holder  # a cycle made during the loop: only the collector frees it
        gone = weakref.ref(holder)
        del holder
        gc.collect()
        seen["cycle_collected"] = gone() is None
        yield from frames[len(frames) // 2:]

    assert gc.get_freeze_count() == 0
    assert daemon.run(source=source(), install_signals=False) == 0
    assert seen["frozen"] > 10_000 and not seen["pipe_walked"] and seen["cycle_collected"]
    assert gc.get_freeze_count() == 0 and any(o is daemon.pipe for o in gc.get_objects())


def test_commits_copy_into_the_memory_reserved_at_start(run, tmp_path):
    """The memory tier's slots are made (and their pages touched) before capturing, laid
    out as every commit's state is (ShadowModel.state_template), and the commits copy
    into them. (Checkpoints are written in the commit path here: the persistence tier's
    writer holds a state while it writes it, and a commit meanwhile takes fresh memory.)"""
    from ckptd.live.memory_tier import _layout
    daemon = Daemon(load_config(_config(run, tmp_path, persist_sync="true")))
    reserved = list(daemon.memory._slots)
    assert len(reserved) == daemon.memory.KEEP + 1 and len({s.layout for s in reserved}) == 1
    assert daemon.run(source=file_source(pcaps(run), []), install_signals=False) == 0
    assert daemon.memory.iterations() == [2, 3]
    homes = {t.data_ptr() for s in reserved for t in s.tensors}
    for it in (2, 3):
        held = daemon.memory.get(it)
        assert _layout({"model": held.model, "optimizer": held.optimizer}) == reserved[0].layout
        assert all(t.data_ptr() in homes for t in held.model.values())


def test_the_first_iterations_memory_is_made_before_capturing(run, tmp_path):
    """Fresh pages cost a fault each (10-30 us where the VM hands freed memory back to its
    host): the kernel's iteration buffers and the first step's optimizer state are made
    at start, and the run takes no other buffers and steps that state."""
    daemon = Daemon(load_config(_config(run, tmp_path)))
    assert daemon.fast
    reserved = daemon.pipe.kernel.buffer_bytes()
    prepared = {(n, k): t for n, st in daemon.pipe.shadow._prepared.items() for k, t in st.items()}
    assert reserved["kept"] > 0 and {k for _, k in prepared} == {"step", "exp_avg", "exp_avg_sq"}
    assert not daemon.pipe.shadow.state  # Adam's state appears with its first step, as torch's
    assert daemon.run(source=file_source(pcaps(run), []), install_signals=False) == 0
    assert [r.status for r in daemon.pipe.reports] == ["committed"] * 4
    from ckptd.fast.pipeline import FastPipeline
    first = FastPipeline(daemon.plan, None, 2, ReplayOptions()).kernel
    first.reserve(0, 1)  # iteration 0's layout: let go once it is done, never used again
    iteration0 = first.buffer_bytes()["kept"]
    assert daemon.pipe.kernel.buffer_bytes() == {"lent": 0, "kept": reserved["kept"] - iteration0,
                                                 "received_maps": 0}
    assert all(daemon.pipe.shadow.state[n][k] is t for (n, k), t in prepared.items())


def test_a_host_without_memory_for_the_memory_tier_is_refused_at_start(run, tmp_path, monkeypatch):
    """The memory tier's copies are made at start, so they count in the memory the daemon
    asks for: too little is one line naming the way out, not an OOM kill at a commit."""
    from ckptd.core import memory
    from ckptd.core.plan import load_plan
    from ckptd.live.memory_tier import MemoryTier
    plan = load_plan(run / "plan.json")
    monkeypatch.setattr(memory, "available_memory",
                        lambda: plan.shadow_bytes() + MemoryTier.KEEP * plan.state_bytes())
    with pytest.raises(memory.MemoryLimitError, match="memory tier's 4 copies.*memory_tier: false"):
        Daemon(load_config(_config(run, tmp_path)))
    daemon = Daemon(load_config(_config(run, tmp_path, memory_tier="false")))
    assert daemon.memory is None


def test_status_names_the_last_commit_however_many_reports_came_after_it(run, tmp_path):
    """A shadow that stopped (a lost iteration) reports complete-not-applied from then on;
    the pipeline keeps only the newest KEEP_REPORTS reports, and /status must still name
    the last iteration committed, not -1."""
    from ckptd.live.daemon import KEEP_REPORTS
    from ckptd.pipeline import IterationReport
    daemon = Daemon(load_config(_config(run, tmp_path)))
    assert daemon.run(source=file_source(pcaps(run), []), install_signals=False) == 0
    assert daemon.snapshot.get()["last_committed"] == 3
    for it in range(4, 4 + KEEP_REPORTS + 1):
        rep = IterationReport(it, "complete-not-applied", note="shadow stopped at iteration 3")
        daemon.pipe.reports.append(rep)  # as Pipeline._finalize does, then the hook
        daemon._on_iteration(rep)
    assert all(r.status != "committed" for r in daemon.pipe.reports)
    assert daemon.snapshot.get()["last_committed"] == 3
    assert daemon.snapshot.get()["iterations_by_status"]["complete-not-applied"] == KEEP_REPORTS + 1


def test_status_says_how_long_the_loop_waited_for_the_gil(run, tmp_path):
    """/status `loop`: the capture loop's wall time split into its CPU time, its sleep in
    poll(2) (none from a file) and the rest, waiting. Another thread running Python the
    whole time makes the loop wait for the GIL at every hand-over (here 2.88 s of a
    2.89 s run, against 0.02 s alone: mostly its commits waiting for the optimizer)."""
    stop = threading.Event()

    def hog():  # pure Python: holds the GIL until the interpreter makes it switch
        n = 0
        while not stop.is_set():
            n += 1
    frames = list(file_source(pcaps(run), []))
    runs = iter(range(100))

    def measured(with_hog: bool) -> dict:
        d = tmp_path / str(next(runs))  # a fresh out: a daemon restarts from its own newest
        d.mkdir()
        daemon = Daemon(load_config(_config(run, d)))
        t = threading.Thread(target=hog)
        if with_hog:
            stop.clear()
            t.start()
        try:
            assert daemon.run(source=iter(frames), install_signals=False) == 0
        finally:
            stop.set()
            if with_hog:
                t.join()
        return daemon.snapshot.get()["loop"]

    def gil(loop):  # waiting less the run queue (where the kernel keeps it): a loaded machine
        return loop["waiting_s"] - (loop["runqueue_s"] or 0)  # adds run-queue time to both runs

    # The runs are short (~0.1 s alone), and on a loaded machine the quiet run's waits
    # (disk, its commits waiting for the optimizer thread) vary by as much as the hog's
    # effect: the contrast must show in one of three pairs; every pair's accounting holds.
    pairs = []
    for _ in range(3):
        alone, hogged = measured(False), measured(True)
        for loop in (alone, hogged):
            assert loop["idle_s"] == 0 and loop["cpu_s"] > 0, loop
            assert loop["cpu_s"] + loop["waiting_s"] == pytest.approx(loop["wall_s"], abs=2e-6), loop
        assert hogged["waiting_s"] > 0.3 * hogged["wall_s"], hogged
        pairs.append((alone, hogged))
        if gil(hogged) > 3 * gil(alone) and (hogged["runqueue_s"] is None  # the GIL is no CPU: not in the run queue
                                             or gil(hogged) > 0.2 * hogged["wall_s"]):
            return
    pytest.fail(f"the hog's GIL waits did not stand out in three tries: {pairs}")


@pytest.mark.skipif(run_delay() is None, reason="this kernel keeps no run delay (/proc/thread-self/schedstat)")
def test_status_says_how_long_the_loop_waited_for_a_cpu(run, tmp_path):
    """/status `loop` `runqueue_s`: the loop runnable with no CPU to run on. The daemon's
    threads kept to one CPU with a busy process on it (nice 0 both: about half the CPU
    each) wait there a large share of the run; a GIL wait (above) is not counted."""
    cpu = max(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    box = {}
    try:
        time.sleep(0.2)  # the hog is on its CPU
        daemon = Daemon(load_config(_config(run, tmp_path)))
        frames = list(file_source(pcaps(run), []))

        def source():  # work on the loop's thread between frames: ~0.4 s of CPU in all
            for i, f in enumerate(frames):
                if i % (len(frames) // 40) == 0:
                    busy(0.01)
                yield f

        def pinned():
            os.sched_setaffinity(0, {cpu})  # this thread, and the daemon's threads it starts
            box["rc"] = daemon.run(source=source(), install_signals=False)
        t = threading.Thread(target=pinned)
        t.start()
        t.join(120)
    finally:
        hog.kill()
        hog.wait()
    assert box["rc"] == 0
    loop = daemon.snapshot.get()["loop"]
    assert loop["runqueue_s"] > 0.25 * loop["wall_s"], loop
    assert loop["runqueue_s"] <= loop["waiting_s"] + 0.05, loop  # no poll(2) here: all of it mid-work


def test_status_has_every_frame_once_the_capture_goes_quiet(run, tmp_path):
    """Snapshots are taken at most every SNAPSHOT_S while frames flow; when the rings go
    quiet (an idle tick) the status catches up with every frame placed, not only with
    those before the last snapshot or report."""
    daemon = Daemon(load_config(_config(run, tmp_path, fast="false")))
    # captured from a minute on: the quiet tick's wall clock says every frame before it
    # (less the ring's retire time) was delivered, and these come after it, as on a ring
    # (with the synthesized 2023 times, the frames after the tick were copies that came
    # after it, and what committed meanwhile was unverified: exit 3)
    ahead = time.time_ns() + 60_000_000_000
    frames = [(s, type(fr)(fr.index, fr.ts_ns - fr0.ts_ns + ahead, fr.linktype, fr.caplen, fr.origlen, fr.data))
              for fr0 in [next(iter(file_source(pcaps(run), [])))[1]] for s, fr in file_source(pcaps(run), [])]
    cut = len(frames) * 3 // 5  # mid-iteration: frames after the last report
    seen = {}

    def source():
        yield from frames[:cut]
        yield -1, None  # the rings are quiet
        seen["doc"] = daemon.snapshot.get()  # what /status serves, after the quiet tick
        yield from frames[cut:]

    assert daemon.run(source=source(), install_signals=False) == 0
    doc = seen["doc"]
    assert sum(s["frames"] for s in doc["streams"]) == cut, (cut, doc["streams"])
    assert doc["last_committed"] < 3  # the cut left iterations to come


def test_a_trainers_init_file_is_read_in_the_plans_optimizer_order(tmp_path):
    """A trainer's file that does not name its parameters has its optimizer state
    indexed in param-group order (here weights, then biases: a no-decay group), not the
    model's: the daemon reads its `init` with the plan's state_names, as replay does."""
    import torch

    from ckptd.core.checkpoint import checkpoint_name, load_checkpoint
    from ckptd.core.plan import load_plan
    d = tmp_path / "job"
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=3, mirrors=2, no_decay_group=True)
    plan = load_plan(d / "plan.json")
    order = plan.state_names
    assert order != [p.name for p in plan.parameters]  # the groups reorder them
    ref = load_checkpoint(d / "reference" / checkpoint_name(0))
    state = {k: ref["optimizer"]["state"][n] for k, n in enumerate(order)}
    groups, k = [], 0
    for g in plan.optimizer.groups:
        groups.append({**{h: v for h, v in g.items() if h != "params"}, "params": list(range(k, k + len(g["params"])))})
        k += len(g["params"])
    trainer = tmp_path / "trainer.pt"
    torch.save({"model": ref["model"], "optimizer": {"state": state, "param_groups": groups}, "step": 1}, trainer)
    daemon = Daemon(load_config(_config(d, tmp_path, init=trainer)))
    got = daemon.start_state["optimizer"]["state"]
    assert sorted(got) == sorted(order)
    for n in order:
        for key, t in ref["optimizer"]["state"][n].items():
            assert torch.equal(got[n][key], t), (n, key)


def test_check_opens_what_a_start_opens_and_captures_nothing(run, tmp_path):
    """`ckptd run --check` (as users run it): a config whose interfaces exist is one line,
    exit 0, no checkpoint written and nothing left listening; a missing interface, an
    address in use and an `out` that is a file are each one line naming it, exit 2."""
    import socket
    from ckptd.testing.netlab import lab_unavailable, remove_namespaces, unique_prefix
    reason = lab_unavailable()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    from pyroute2 import IPRoute, netns
    ns = f"{unique_prefix()}-chk"
    netns.create(ns)
    try:
        with IPRoute(netns=ns, flags=0) as ipr:
            for name in ("m0", "m1"):
                ipr.link("add", ifname=name, kind="veth", peer={"ifname": f"{name}p"})
                ipr.link("set", index=ipr.link_lookup(ifname=name)[0], state="up")

        def check(cfg):
            r = subprocess.run([sys.executable, "-m", "ckptd", "run", "--config", str(cfg), "--check"],
                               capture_output=True, text=True, timeout=300)
            return r.returncode, r.stdout + r.stderr

        rc, out = check(_config(run, tmp_path, interfaces_netns=ns))
        assert rc == 0 and out.count("\n") == 1, out
        assert "ckptd.yaml: ok: 2 interface(s) opened (mirror0=m0, mirror1=m1)" in out and "2 ranks" in out
        assert not list((tmp_path / "ck").glob("iter_*"))
        (tmp_path / "w").mkdir()   # the capture workers start, open their rings and stop
        rc, out = check(_config(run, tmp_path / "w", interfaces_netns=ns, capture_workers="true"))
        assert rc == 0 and out.count("\n") == 1 and "path, capture workers;" in out, out
        (tmp_path / "p").mkdir()  # where it writes, less the URL's password (docs/DAEMON.md persist_url)
        rc, out = check(_config(run, tmp_path / "p", interfaces_netns=ns, persist_url="memory://alice:s3cret@x/ck"))
        assert rc == 0 and "checkpoints to memory://***@x/ck" in out and "s3cret" not in out, out
        (tmp_path / "b").mkdir()
        bad = _config(run, tmp_path / "b", interfaces_netns=ns, second="nosuch")
        rc, out = check(bad)
        assert rc == 2 and out.count("\n") == 1 and out.startswith(f"error: {bad}: interfaces[1]:") and "nosuch" in out, out
        assert not (tmp_path / "b" / "ck").exists()  # the `out` it made is not left behind (it was, empty)
        (tmp_path / "b" / "ck").mkdir()  # one that was there stays
        rc, out = check(_config(run, tmp_path / "b", interfaces_netns=ns, second="nosuch"))
        assert rc == 2 and "nosuch" in out and (tmp_path / "b" / "ck").is_dir(), out
        with socket.socket() as busy_port:
            busy_port.bind(("127.0.0.1", 0))
            busy_port.listen()
            port = busy_port.getsockname()[1]
            (tmp_path / "c").mkdir()
            rc, out = check(_config(run, tmp_path / "c", interfaces_netns=ns, listen=f"127.0.0.1:{port}"))
        assert rc == 2 and out.count("\n") == 1 and f"127.0.0.1:{port}" in out, out
        assert not (tmp_path / "c" / "ck").exists()
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "ck").write_text("a file")
        rc, out = check(_config(run, tmp_path / "d", interfaces_netns=ns))
        assert rc == 2 and out.count("\n") == 1 and "d/ck: cannot create the checkpoint directory" in out, out
        _check_as_a_user(run, ns, check)
    finally:
        remove_namespaces([ns])


def _check_as_a_user(run, ns, check):
    """With `user:` the check drops to that user as a start does, but hands it nothing:
    root's `out` stays root's (a start chowns it; the check did too). It still says where
    the user could not write once handed it: a directory it cannot reach."""
    import pwd
    import shutil
    import tempfile
    from pathlib import Path
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return
    top = Path(tempfile.mkdtemp(prefix="hd-chk-"))  # reachable by nobody (pytest's tmp is 0700)
    try:
        os.chmod(top, 0o755)
        (top / "ck").mkdir()
        rc, out = check(_config(run, top, interfaces_netns=ns, user="nobody"))
        assert rc == 0 and out.count("\n") == 1 and "ok:" in out, out
        assert (top / "ck").stat().st_uid == 0  # as it was
        os.chmod(top, 0o700)  # now nobody cannot reach top/ck
        rc, out = check(_config(run, top, interfaces_netns=ns, user="nobody"))
        assert rc == 2 and out.count("\n") == 1 and "out " in out and "(as user nobody)" in out, out
        assert (top / "ck").stat().st_uid == 0
    finally:
        shutil.rmtree(top)


def test_a_fragmented_mirror_tunnel_is_logged_once_and_counted_in_status(run, tmp_path, caplog):
    """Copies lost to a remote mirror session's fragmented tunnel: one warning names the
    stream and why (tests/test_erspan.py has replay's), /status's classes keep counting."""
    from ckptd.testing.tunnel import erspan2, ip_fragments

    frames, cut = [], 0
    for s, fr in file_source(pcaps(run), []):
        wrapped = erspan2(fr.data, 40 + s, fr.index)
        pieces = ip_fragments(wrapped) if s == 1 and fr.index % 5 == 2 and len(wrapped) > 1100 else [wrapped]
        cut += len(pieces) > 1
        frames += [(s, fr.__class__(fr.index, fr.ts_ns, fr.linktype, len(x), len(x), x)) for x in pieces]
    assert cut > 5
    daemon = Daemon(load_config(_config(run, tmp_path)))
    with caplog.at_level("WARNING", logger="ckptd"):
        assert daemon.run(source=iter(frames), install_signals=False) == 0
    warned = [r.getMessage() for r in caplog.records if "fragments of GRE" in r.getMessage()]
    assert daemon.pipe.classes[1]["gre_fragment"] == 2 * cut and "gre_fragment" not in daemon.pipe.classes[0]
    # once when first seen, with the count of that moment, and the total at the stop (the
    # first one's count alone read as the whole: 1 where /status said 51)
    assert len(warned) == 2 and all(w.startswith("stream mirror1: ") and "MTU" in w for w in warned), warned
    assert warned[0].endswith("(so far: /status counts on, the stop logs the total)")
    assert warned[1].startswith(f"stream mirror1: {2 * cut} frames were IP fragments") and warned[1].endswith("(in all)")
    # mirror0 had every copy. The last iteration is abandoned: the stop came right after
    # its last frame, and mirror1, short of the copies the tunnel lost, had carried no
    # later iteration: copies on their way from a lagging mirror look the same
    # (Pipeline._copies_due); a live daemon's quiet rings tell it after ten windows
    assert [r.status for r in daemon.pipe.reports] == ["committed"] * 3 + ["abandoned"]
    assert "stopped while stream mirror1 had not delivered its copies of iteration 3" in daemon.pipe.reports[-1].note


def test_an_out_holding_checkpoints_the_daemon_did_not_write_is_refused(run, tmp_path):
    """A trainer's directory as `out` (and `resume`, as docs/DAEMON.md suggests for
    resume): retention pruned the trainer's files as the daemon's own and commits replaced
    those of the same iterations, without a word, and restore(out) then took the newest
    foreign one. Refused at start, naming the key and the files. The daemon's own
    directory (every file listed in its manifest, or newer than it: a write a crash caught
    before its manifest line) is taken as before."""
    import shutil
    from ckptd.core.checkpoint import checkpoint_name
    out = tmp_path / "ck"
    out.mkdir()
    for it in range(4):  # the trainer's files
        shutil.copy(run / "reference" / checkpoint_name(it % 2), out / checkpoint_name(it))
    for extra in ({}, {"resume": out}, {"persist_sync": "true"}):
        with pytest.raises(ConfigError, match=r"ckptd.yaml: 'out' .*ck holds checkpoints this daemon did not write "
                                              r"\(iter_000000.pt, iter_000001.pt, iter_000002.pt and 1 more: no "
                                              r"manifest.json there lists them\)"):
            Daemon(load_config(_config(run, tmp_path, **extra)))
    assert sorted(p.name for p in out.iterdir()) == [checkpoint_name(i) for i in range(4)]  # untouched
    shutil.rmtree(out)
    daemon = Daemon(load_config(_config(run, tmp_path, keep_last=2, persist_every=1)))
    assert daemon.run(source=file_source(pcaps(run), []), install_signals=False) == 0
    own = sorted(p.name for p in out.iterdir())  # (a busy writer skips to the newest commit due)
    assert checkpoint_name(3) in own and "manifest.json" in own and checkpoint_name(1) not in own, own
    shutil.copy(out / checkpoint_name(3), out / checkpoint_name(9))  # the crash's newest write
    Daemon(load_config(_config(run, tmp_path)))  # a restart over its own directory
    shutil.copy(out / checkpoint_name(3), out / checkpoint_name(1))  # older than the manifest, not in it
    with pytest.raises(ConfigError, match=r"\(iter_000001.pt: no manifest.json there lists them\)"):
        Daemon(load_config(_config(run, tmp_path)))


def test_a_snaplen_that_cuts_the_plans_data_frames_is_refused_at_start(run, tmp_path):
    """`--check` said ok and the daemon started, then lost every iteration to frames cut
    short (exit 3). The plan's MTU says it at start."""
    cfg = _config(run, tmp_path)
    text = cfg.read_text().replace("ifname: m1}", "ifname: m1, snaplen: 1097}")
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=r"ckptd.yaml: 'interfaces\[1\].snaplen' 1097 cuts the plan's data frames "
                                          r"\(ring.mtu 1024: at least 1098 bytes each"):
        Daemon(load_config(cfg))
    cfg.write_text(text.replace("snaplen: 1097", "snaplen: 1098"))
    Daemon(load_config(cfg))


def test_status_clock_goes_on_while_no_frame_comes(run, tmp_path):
    """/status is the last snapshot, published while frames flow: on a quiet link its
    uptime_s stood still (0.391 over seconds of requests), so a monitor could not tell a
    quiet daemon from a hung one. uptime_s and snapshot_age_s are read at the request."""
    daemon = Daemon(load_config(_config(run, tmp_path)))
    seen = []

    def source():
        frames = list(file_source(pcaps(run), []))
        yield from frames[:len(frames) // 2]
        for _ in range(2):  # the link goes quiet: the loop waits here for the next frame
            seen.append(json.loads(urllib.request.urlopen(f"http://127.0.0.1:{daemon.address[1]}/status").read()))
            time.sleep(0.4)
        yield from frames[len(frames) // 2:]

    assert daemon.run(source=source(), install_signals=False) == 0
    first, second = seen
    assert second["uptime_s"] - first["uptime_s"] >= 0.35, (first["uptime_s"], second["uptime_s"])
    assert second["snapshot_age_s"] - first["snapshot_age_s"] >= 0.35
    assert first["last_committed"] == second["last_committed"]  # the same snapshot under both


def test_a_daemon_that_lost_iterations_logs_the_diagnosis_replay_prints(run, tmp_path, caplog):
    """A capture begun mid-job (the first 40% of each mirror's frames missing) without
    `join`: replay says the capture began mid-job and to replay with --join; the daemon
    only called the iterations' copies in conflict ("plan or capture is wrong"). At the
    stop it now logs the extractor's diagnosis, as replay prints it under its table."""
    from parsers.capfile import open_capture
    from parsers.pcap import PcapWriter
    late = []
    for p in pcaps(run):
        frames = list(open_capture(p))
        late.append(str(tmp_path / os.path.basename(p)))
        with open(late[-1], "wb") as f, PcapWriter(f) as w:
            for fr in frames[len(frames) * 2 // 5:]:
                w.write(fr.data, fr.ts_ns, fr.origlen)
    daemon = Daemon(load_config(_config(run, tmp_path)))
    with caplog.at_level("WARNING", logger="ckptd"):
        rc = daemon.run(source=file_source(late, []), install_signals=False)
    assert rc == 3
    said = [r.fields["detail"] for r in caplog.records if r.getMessage() == "diagnosis"]
    # in the daemon's words: its config's join, not replay's option
    assert any("mid-job" in d and "set join: true" in d and "--join" not in d for d in said), said


def test_two_daemons_with_one_out_are_refused(run, tmp_path):
    """Two daemons writing one `out` deleted each other's temporary files as a crash's
    leftovers, and each manifest listed only its own commits (the next start called the
    other's files foreign). The second is refused while the first runs; once the first has
    stopped, the directory is free again."""
    first = Daemon(load_config(_config(run, tmp_path)))
    running, release = threading.Event(), threading.Event()

    def source():
        running.set()
        release.wait(30)
        yield from ()

    t = threading.Thread(target=lambda: first.run(source=source(), install_signals=False))
    t.start()
    try:
        assert running.wait(30)
        second = Daemon(load_config(_config(run, tmp_path)))
        with pytest.raises(ConfigError, match=r"'out' .* is in use by another ckptd daemon"):
            second.run(source=iter(()), install_signals=False)
    finally:
        release.set()
        t.join(60)
    third = Daemon(load_config(_config(run, tmp_path)))
    assert third.run(source=iter(()), install_signals=False) in (0, 3)


def test_late_copies_are_counted_in_status_and_named_at_the_stop(run, tmp_path, caplog):
    """A mirror stream 1 s behind the other, with a 10 ms window: it has carried nothing
    for ten windows (100 ms) while the other carried the job, so it is taken for stopped
    (Pipeline._copies_due), and its copies come after their iterations were committed on
    the first stream's alone, never compared. They were counted in no status, metric or
    log line (the probe's lagging mirror hid a disagreement so), and the daemon exited 0."""
    from parsers.capfile import open_capture
    from parsers.pcap import PcapWriter
    paths = pcaps(run)
    behind = str(tmp_path / "behind.pcap")
    with open(behind, "wb") as f, PcapWriter(f) as w:
        for fr in open_capture(paths[1]):
            w.write(fr.data, fr.ts_ns + 1_000_000_000, fr.origlen)
    daemon = Daemon(load_config(_config(run, tmp_path, agree_window_ms=10)))
    with caplog.at_level("WARNING", logger="ckptd"):
        rc = daemon.run(source=file_source([paths[0], behind], []), install_signals=False)
    # the stream taken for stopped is said when it happens, and the iterations committed
    # without it are unverified once its copies come after all: exit 3, not 0
    off = [r for r in caplog.records if r.getMessage().startswith("stream mirror1 carried no packet of the job")]
    assert len(off) == 1 and "taken for stopped" in off[0].getMessage()
    unverified = daemon.snapshot.get()["unverified"]
    assert unverified and unverified == sorted(daemon.pipe.unverified) and rc == 3
    # every later state stems from the first: /status says from where, and the memory
    # tier's states from there on are refused, not served as good (a probe's trainer got
    # the newest with a plain 200)
    first = daemon.snapshot.get()["unverified_from"]
    assert first == unverified[0]
    metrics = daemon.routes()["/metrics"]("", {}).body.decode()
    assert f"ckptd_unverified_from_iteration {float(first)}" in metrics
    assert daemon.memory is not None and daemon.memory.latest().iteration >= first
    r = daemon.routes()["/checkpoint"]("", {})
    assert r.status == 409 and f"iteration {first} was committed without" in r.body.decode(), r.status
    said = [r.getMessage() for r in caplog.records if "are unverified" in r.getMessage()]
    assert said and all("stream(s) mirror1" in m for m in said)
    assert {int(x) for m in said for x in m.split(" were committed")[0].split("iteration(s) ")[1].split(", ")} \
        == set(unverified)
    late = daemon.snapshot.get()["late_copies"]
    assert late > 0 and late == daemon.pipe.late
    said = [r for r in caplog.records if r.getMessage().startswith("copies arrived after their iteration")]
    assert len(said) == 1 and said[0].fields["late_copies"] == late
