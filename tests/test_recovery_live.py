"""A killed job resumes from ckptd's state: a 3-rank DDP job on gloo, in 3 network
namespaces, mirrored to the daemon; every rank SIGKILLed mid-run; the job restarted with
`ckptd.restore` from the daemon; it trains on to the end, and every parameter and
optimizer state of every rank is bit-identical to the same job restarted from the
trainer's own checkpoint of that iteration.

Why not "identical to an uninterrupted run": any restarted DDP job runs its first
iteration with DDP's initial bucket layout (parameters in definition order, the first
bucket capped at 1 MB), not the rebuilt one (gradient-ready order) the uninterrupted job
uses there. A ring allreduce adds each element's contributions in an order set by where
the element falls in its bucket, so that iteration's sums differ in rounding whatever
checkpoint the job restarts from (measured: 56 of 768 elements of fc1.bias differ after
5 more steps). Restarting from ckptd equals restarting from the trainer's own file."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.live.daemon import Daemon, DaemonConfig, InterfaceConfig
from ckptd.recovery import fetch
from ckptd.testing import netlab
from ckptd.testing.netlab import NetLab

from helpers import synth

REPO = Path(__file__).resolve().parents[1]
TOTAL = 8  # the job's length: k + m
KILL_AFTER = 2  # the ranks are killed once rank 0 has finished this iteration


def _train(args, env, netns=None):
    cmd = [sys.executable, str(REPO / "scripts" / "ddp_gloo_train.py"), "--size", "small", *args]
    return subprocess.Popen((["ip", "netns", "exec", netns] if netns else []) + cmd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _records(outs: list[str], key: str) -> list[dict]:
    """The JSON records naming `key` the ranks printed (three processes share one pipe, so
    records may run together on a line)."""
    return [json.loads(m) for o in outs for m in re.findall(r'\{[^{}]*"%s"[^{}]*\}' % key, o)]


def _reports(daemon):
    return ([(r.iteration, r.status, r.note[:200]) for r in daemon.pipe.reports], daemon.pipe.errors[:3],
            dict(daemon.pipe.extract.counters), daemon.pipe.classes)


def _wait(cond, what, timeout=90):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what() if callable(what) else what
        time.sleep(0.05)


def test_killed_ddp_job_restores_from_the_daemon_and_ends_bit_identical(tmp_path):
    reason = netlab.lab_unavailable()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    shape = tmp_path / "shape"
    synth(shape, ranks=3, channels=1, mirrors=2, iterations=1)
    prefix = netlab.unique_prefix()
    first, second = tmp_path / "first", tmp_path / "second"
    procs: list[subprocess.Popen] = []
    try:
        with NetLab(shape / "plan.json", prefix=prefix) as lab:
            addrs = [str(h.addr) for h in lab.hosts]

            def job(out, port, extra):
                return [_train(["--world", "3", "--iterations", str(TOTAL), "--out", str(out),
                                "--port", str(port), "--master", addrs[0], "--addrs", ",".join(addrs),
                                "--rank", str(r), "--ifname", h.ifname, *extra], env, h.netns)
                        for r, h in enumerate(lab.hosts)]

            procs += job(first, 29531, ["--hold", str(tmp_path / "go"), "--pace", "1.0"])
            _wait(lambda: (first / "plan.json").exists() and (first / "init.pt").exists(),
                  "the job wrote no plan")
            time.sleep(0.5)
            daemon = Daemon(DaemonConfig(
                plan=str(first / "plan.json"), init=str(first / "init.pt"), out=str(tmp_path / "ck"),
                listen="127.0.0.1:0",
                interfaces=[InterfaceConfig(m.name, m.capture_ifname, lab.ckpt_ns) for m in lab.mirrors]))
            t = threading.Thread(target=lambda: daemon.run(install_signals=False), name="daemon")
            t.start()
            try:
                _wait(lambda: daemon.captures and getattr(daemon, "address", None), "daemon not capturing")
                time.sleep(0.5)
                (tmp_path / "go").touch()
                # killed on the job's own clock: once rank 0 has finished iteration KILL_AFTER
                _wait(lambda: (first / "rank0" / checkpoint_name(KILL_AFTER)).exists(),
                      "the job did not get going", 120)
                for p in procs:  # the whole job dies at once, mid-run
                    p.send_signal(signal.SIGKILL)
                for p in procs:
                    p.wait(30)
                done = {int(p.name[5:11]) for p in (first / "rank0").glob("iter_*.pt")}
                assert max(done) < TOTAL - 1, "the job finished before it was killed"
                # the job is dead, the daemon runs on: the capture goes quiet and the
                # daemon commits the iterations it has whole (gloo's last collectives
                # are numbered without the later traffic that will never come)
                _wait(lambda: any(r.status == "committed" and r.iteration >= KILL_AFTER
                                  for r in daemon.pipe.reports),
                      lambda: f"the daemon did not commit the last iterations: {_reports(daemon)}", 60)
                time.sleep(1.0)
                assert daemon.pipe.reports[-1].status == "committed", _reports(daemon)
                # restarted from the daemon's memory, over HTTP, while it runs on (the
                # new job on this host's loopback, where the daemon listens)
                host, port = daemon.address[:2]
                url = f"http://{host}:{port}"
                served, _ = fetch(url, None, None, 60)
                restarted = [_train(["--world", "3", "--iterations", str(TOTAL), "--out", str(second),
                                     "--restore", url], env)]
                outs = []
                for p in restarted:
                    out, _ = p.communicate(timeout=240)
                    assert p.returncode == 0, out.decode()[-3000:]
                    outs.append(out.decode())
            finally:
                daemon.stop.set()
                t.join(60)
            procs += restarted
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        assert not netlab.down(prefix, exact=True)
    committed = max(r.iteration for r in daemon.pipe.reports if r.status == "committed")
    restored = _records(outs, "restored_iteration")
    assert sorted(x["rank"] for x in restored) == [0, 1, 2]
    assert {x["restored_iteration"] for x in restored} == {committed}
    assert {x["source"] for x in restored} == {url}
    first_step = _records(outs, "first_iteration")
    print(f"restore from the daemon's memory: {max(x['restore_s'] for x in restored):.3f} s; "
          f"restart to the first resumed iteration: {max(x['since_start_s'] for x in first_step):.2f} s")
    assert KILL_AFTER <= committed < TOTAL - 1
    # the daemon's state is the job's own at that iteration
    mine = load_checkpoint(first / "rank0" / checkpoint_name(committed))
    assert served["iteration"] == committed
    assert diff_checkpoints(served, mine) == []
    # the same restart from the trainer's own checkpoint (all ranks on loopback)
    own = _train(["--world", "3", "--iterations", str(TOTAL), "--out", str(tmp_path / "own"),
                  "--restore", str(first / "rank0" / checkpoint_name(committed))], env)
    out, _ = own.communicate(timeout=240)
    assert own.returncode == 0, out.decode()[-3000:]
    # the restarted job ran only the iterations after the restored one, and ends equal
    assert not (second / "rank0" / checkpoint_name(committed)).exists()
    for it in range(committed + 1, TOTAL):
        for r in range(3):
            assert diff_checkpoints(load_checkpoint(second / f"rank{r}" / checkpoint_name(it)),
                                    load_checkpoint(tmp_path / "own" / f"rank{r}" / checkpoint_name(it))) == [], (it, r)
