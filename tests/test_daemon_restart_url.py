"""A daemon persisting to a URL (persist_url) killed with SIGKILL mid-capture, started
again with the same config: it loads the newest persisted state that verifies and joins
the running job at the iteration after it; every later checkpoint is bit-exact against
the trainer's. The job's traffic is synthesized RoCE (ckptd.testing.synth), fed from the
captures: the first daemon sees iterations from 0 and then waits mid-job (killed there),
the second sees the job from the iteration after its newest persisted one. After an
outage longer than the persisted state covers, the second daemon says which iterations
it missed, the notice reaches the trainer, whose Resync saves into `resume`, and the
shadow goes on from there bit-exact."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.core.manifest import newest_verified, read_manifest, verify_checkpoint

from helpers import synth

ITERATIONS = 7
ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time
from pathlib import Path
from ckptd.live.daemon import Daemon, load_config, setup_logging
from ckptd.pipeline import file_source
cfg, run, start, stop = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
paths = sorted(str(p) for p in (run / "mirrors").glob("*.pcap"))
frames = list(file_source(paths, []))
ts = sorted({fr.ts_ns for _, fr in frames})
# the synthesizer leaves 5 ms between iterations: iteration t starts at starts[t]
starts = [ts[0]] + [ts[i] for i in range(1, len(ts)) if ts[i] - ts[i - 1] > 1_000_000]

def source():
    for k, fr in frames:
        if fr.ts_ns < starts[start]:
            continue
        if stop >= 0 and fr.ts_ns >= starts[stop]:
            print("waiting", flush=True)
            time.sleep(3600)  # the job goes on; this daemon is killed here
        yield k, fr

setup_logging("info")
d = Daemon(load_config(cfg))
rc = d.run(source=source(), install_signals=False)
print("REPORTS", [(r.iteration, r.status) for r in d.pipe.reports], "JOINED", d.pipe.joined,
      "RESTARTED", d.restarted_from and d.restarted_from[0], flush=True)
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("restart")
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=ITERATIONS, mirrors=2)
    return d


def _iteration_starts(frames) -> list[int]:
    """Capture time of each iteration's first frame (the synthesizer leaves a pause between)."""
    ts = sorted({fr.ts_ns for _, fr in frames})
    return [ts[0]] + [ts[i] for i in range(1, len(ts)) if ts[i] - ts[i - 1] > 1_000_000]


def _kill_once_persisted(first: subprocess.Popen, store: Path, iteration: int):
    """SIGKILL the first daemon at some moment after its manifest lists `iteration`."""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            man = read_manifest(store) if (store / "manifest.json").exists() else None
            if man and man["checkpoints"] and man["checkpoints"][-1]["iteration"] >= iteration:
                break
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        else:
            raise AssertionError("nothing persisted")
        time.sleep(0.3)  # the writer may be mid-write: SIGKILL at whatever moment
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL


def _start(cfg, run, start: int, stop: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + str(ROOT / "tests")}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(cfg), str(run), str(start), str(stop)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_sigkilled_daemon_restarts_from_its_persisted_url_and_stays_bit_exact(run, tmp_path):
    store = tmp_path / "remote"
    url = f"file://{store}"
    cfg = tmp_path / "ckptd.yaml"
    # the same config both times: join (the job may be running), persisted to the URL
    cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {tmp_path / 'out'}\n"
                   f"persist_url: {url}\npersist_every: 1\njoin: true\nkeep_last: 20\n"
                   "listen: 127.0.0.1:0\ninterfaces:\n"
                   "  - {name: mirror0, ifname: m0}\n  - {name: mirror1, ifname: m1}\n")
    _kill_once_persisted(_start(cfg, run, 0, 4), store, 1)
    doc, entry = newest_verified(url)
    k = entry["iteration"]
    assert 1 <= k < ITERATIONS - 2
    assert diff_checkpoints(doc, load_checkpoint(run / "reference" / checkpoint_name(k))) == []

    second = _start(cfg, run, k + 1, -1)  # the job is now at iteration k+1
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("REPORTS"))
    assert f"JOINED {k + 1}" in line and f"RESTARTED {k}" in line, line
    logs = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert any(x["msg"] == "restarting from the persisted state" and x["iteration"] == k for x in logs), err
    reports = eval(line.split("REPORTS ")[1].split(" JOINED")[0])
    assert reports == [(i, "committed") for i in range(k + 1, ITERATIONS)]
    man = read_manifest(url)
    listed = [e["iteration"] for e in man["checkpoints"]]
    # persist_every 1, but fed from files faster than the writer: some are superseded
    assert listed[-1] == ITERATIONS - 1 and k in listed
    for e in man["checkpoints"]:
        if e["iteration"] >= k:
            doc = verify_checkpoint(url, e)
            assert diff_checkpoints(doc, load_checkpoint(run / "reference" / e["file"])) == [], e["file"]


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_restart_from_an_object_store_url_joins_after_its_newest_entry(run, tmp_path, kind, request):
    """The same in one process on memory:// and on s3:// (a local S3 server, credentials
    and endpoint in persist_options): no local file to resume from, so the daemon writes
    the verified state to out/restart-iter_NNNNNN.pt first."""
    import uuid

    from ckptd.core.store import Store
    from ckptd.live.daemon import Daemon, load_config
    from ckptd.pipeline import file_source
    from helpers import pcaps
    options = None
    if kind == "s3":
        s3 = request.getfixturevalue("s3")
        url, options = s3.bucket(), s3.options
    else:
        url = f"memory://restart-{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {tmp_path / 'out'}\n"
                   f"persist_url: {url}\npersist_every: 1\njoin: true\n"
                   + (f"persist_options: {json.dumps(options)}\n" if options else "") +
                   "listen: 127.0.0.1:0\ninterfaces:\n"
                   "  - {name: mirror0, ifname: m0}\n  - {name: mirror1, ifname: m1}\n")
    store = Store(url, options)  # what the test reads it through
    frames = list(file_source(pcaps(run), []))
    starts = _iteration_starts(frames)
    first = Daemon(load_config(cfg))
    assert first.restarted_from is None
    assert first.run(source=iter([x for x in frames if x[1].ts_ns < starts[3]]), install_signals=False) == 0
    k = newest_verified(store)[1]["iteration"]
    assert k == 2  # the clean stop persists the newest committed state
    second = Daemon(load_config(cfg))
    assert second.restarted_from == (k, str(tmp_path / "out" / f"restart-{checkpoint_name(k)}"))
    assert second.run(source=iter([x for x in frames if x[1].ts_ns >= starts[k + 1]]), install_signals=False) == 0
    assert second.pipe.joined == k + 1
    assert [(r.iteration, r.status) for r in second.pipe.reports] == [(i, "committed") for i in range(k + 1, ITERATIONS)]
    assert second.snapshot.get()["join"]["restarted_from"] == k
    assert second.snapshot.get()["checkpoints"]["store"] == url
    if options:  # the credentials are nowhere in /status
        status = json.dumps(second.snapshot.get())
        assert options["secret"] not in status and options["key"] not in status
    doc, entry = newest_verified(store)
    assert entry["iteration"] == ITERATIONS - 1
    assert diff_checkpoints(doc, load_checkpoint(run / "reference" / entry["file"])) == []


OUTAGE_ITERATIONS = 11


def test_a_daemon_restarted_after_a_long_outage_resyncs_through_the_notice(tmp_path_factory, tmp_path, caplog):
    """SIGKILLed; the job runs on for longer than persist_every; restarted, the daemon
    reports the iterations it missed and why, announces them in the job's TCPStore, the
    trainer's Resync saves a checkpoint into `resume` at its next step boundary, and the
    shadow restarts there: every later commit bit-exact against the trainer."""
    import logging
    from datetime import timedelta

    from torch.distributed import TCPStore

    import ckptd
    from ckptd.core.optim import torch_optimizer
    from ckptd.core.plan import load_plan
    from ckptd.live.daemon import Daemon, load_config
    from ckptd.live.memory_tier import copy_state
    from ckptd.live.notice import STORE_KEY
    from ckptd.pipeline import file_source
    from ckptd.resync import Resync
    from ckptd.testing.synth.model import build_model
    from helpers import pcaps
    run = tmp_path_factory.mktemp("outage")
    synth(run, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=OUTAGE_ITERATIONS, mirrors=2)
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))  # the job's store (torchrun's, in a real job)
    resync_dir = tmp_path / "resync"
    resync_dir.mkdir()  # shared by the trainer and the daemon
    store = tmp_path / "remote"
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {tmp_path / 'out'}\n"
                   f"persist_url: file://{store}\npersist_every: 2\njoin: true\nkeep_last: 20\n"
                   f"resume: {resync_dir}\nfast: false\nnotice: {{store: '127.0.0.1:{master.port}'}}\n"
                   "listen: 127.0.0.1:0\ninterfaces:\n"
                   "  - {name: mirror0, ifname: m0}\n  - {name: mirror1, ifname: m1}\n")
    _kill_once_persisted(_start(cfg, run, 0, 4), store, 2)
    k = newest_verified(f"file://{store}")[1]["iteration"]
    assert k == 2  # persist_every 2: 0, then 2
    # The job runs on while no daemon captures: iterations k+1 and k+2, longer than
    # persist_every. The trainer has been running all along: its Resync is older news.
    plan = load_plan(run / "plan.json")
    model = build_model("tiny", 0)
    optimizer = torch_optimizer(plan.optimizer, model.named_parameters())
    client = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    resync = Resync(client, resync_dir, model, optimizer, rank=0)
    caplog.set_level(logging.INFO, logger="ckptd")
    second = Daemon(load_config(cfg))
    assert second.restarted_from == (k, str(store / checkpoint_name(k)))
    commits = {}
    second.pipe.on_commit.append(lambda it, m, o: commits.__setitem__(it, {
        "iteration": it, "model": copy_state(m), "optimizer": copy_state(o)}))
    frames = list(file_source(pcaps(run), []))
    starts = _iteration_starts(frames)
    back = k + 3

    def wire_with_trainer():
        step = back  # the iteration whose traffic is on the wire
        for x in frames:
            if x[1].ts_ns < starts[back]:
                continue
            while step + 1 < len(starts) and x[1].ts_ns >= starts[step + 1]:
                # the job finished iteration `step` (fast: false places frame by frame, so
                # the daemon has seen all of it); its notice, if any, is delivered
                deadline = time.monotonic() + 10
                while not second.notifier.idle() and time.monotonic() < deadline:
                    time.sleep(0.01)
                ckptd.restore(model, optimizer, run / "reference" / checkpoint_name(step))
                resync.after_step(step + 1)
                step += 1
            yield x

    rc = second.run(source=wire_with_trainer(), install_signals=False)
    joined = second.pipe.joined
    assert joined == back
    reports = list(second.pipe.reports)
    # the gap: said once, first, with which iterations and why
    gap = reports[0]
    assert (gap.iteration, gap.status, gap.through) == (k + 1, "not-captured", joined - 1)
    assert gap.note.startswith(f"iterations {k + 1}-{joined - 1} ran before the capture saw the job "
                               f"(joined at {joined}); the newest state held is iteration {k} "
                               f"({store / checkpoint_name(k)}): the shadow waits for a checkpoint")
    # the notice reached the job's store: the gap's last iteration, and the event
    assert client.get(STORE_KEY) == str(joined - 1).encode()
    ev = json.loads(client.get(f"{STORE_KEY}/{joined - 1}"))
    assert (ev["iteration"], ev["through"], ev["status"]) == (k + 1, joined - 1, "not-captured")
    assert second.notifier.stats() == {"sent": 1, "failed": 0, "dropped": 0}
    # the trainer saved once into `resume`, at the first step boundary after the notice
    assert len(resync.saved) == 1 and resync.saved[0].parent == resync_dir
    saved = int(load_checkpoint(resync.saved[0], [p.name for p in plan.parameters])["iteration"])
    assert joined <= saved < OUTAGE_ITERATIONS - 2
    logged = [r for r in caplog.records if r.getMessage() == "iteration not recovered"]
    assert [(r.fields["iteration"], r.fields["status"], r.fields.get("through")) for r in logged] == \
        [(k + 1, "not-captured", joined - 1)] + [(i, "complete-not-applied", None) for i in range(joined, saved + 1)]
    assert f"shadow stopped at iteration {k}; no checkpoint of iteration {joined - 1} in {resync_dir}" in \
        logged[1].fields["note"]
    got = [(r.iteration, r.status) for r in reports[1:]]
    assert got == [(i, "complete-not-applied") for i in range(joined, saved + 1)] + \
        [(i, "committed") for i in range(saved + 1, OUTAGE_ITERATIONS)]
    assert reports[saved + 2 - joined].note == f"resumed from {resync_dir}"
    # every commit after it is the trainer's state, bit for bit; and so is what is persisted
    assert sorted(commits) == list(range(saved + 1, OUTAGE_ITERATIONS))
    for it, doc in commits.items():
        assert diff_checkpoints(doc, load_checkpoint(run / "reference" / checkpoint_name(it))) == [], it
    entries = [e for e in read_manifest(store)["checkpoints"] if e["iteration"] > k]
    assert entries and entries[-1]["iteration"] == OUTAGE_ITERATIONS - 1
    for e in entries:
        doc = verify_checkpoint(store, e)
        assert diff_checkpoints(doc, load_checkpoint(run / "reference" / e["file"])) == [], e["file"]
    st = second.snapshot.get()
    assert st["join"]["restarted_from"] == k and st["last_committed"] == OUTAGE_ITERATIONS - 1
    # exit 3: iterations joined..saved were seen whole but not committed
    assert rc == 3
