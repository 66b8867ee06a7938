"""A daemon persisting to a URL (persist_url) killed with SIGKILL mid-capture, started
again with the same config: it loads the newest persisted state that verifies and joins
the running job at the iteration after it; every later checkpoint is bit-exact against
the trainer's. The job's traffic is synthesized RoCE (ckptd.testing.synth), fed from the
captures: the first daemon sees iterations from 0 and then waits mid-job (killed there),
the second sees the job from the iteration after its newest persisted one."""
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
from ckptd.live.persist import newest_verified, read_manifest, verify_checkpoint

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
    first = _start(cfg, run, 0, 4)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            man = read_manifest(store) if (store / "manifest.json").exists() else None
            if man and man["checkpoints"] and man["checkpoints"][-1]["iteration"] >= 1:
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


def test_restart_from_a_memory_url_joins_after_its_newest_entry(run, tmp_path):
    """The same in one process on memory:// (an object store: no local file to resume
    from, so the daemon writes the verified state to out/restart-iter_NNNNNN.pt first)."""
    import uuid

    from ckptd.live.daemon import Daemon, load_config
    from ckptd.pipeline import file_source
    from helpers import pcaps
    url = f"memory://restart-{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {tmp_path / 'out'}\n"
                   f"persist_url: {url}\npersist_every: 1\njoin: true\n"
                   "listen: 127.0.0.1:0\ninterfaces:\n"
                   "  - {name: mirror0, ifname: m0}\n  - {name: mirror1, ifname: m1}\n")
    frames = list(file_source(pcaps(run), []))
    ts = sorted({fr.ts_ns for _, fr in frames})
    starts = [ts[0]] + [ts[i] for i in range(1, len(ts)) if ts[i] - ts[i - 1] > 1_000_000]
    first = Daemon(load_config(cfg))
    assert first.restarted_from is None
    assert first.run(source=iter([x for x in frames if x[1].ts_ns < starts[3]]), install_signals=False) == 0
    k = newest_verified(url)[1]["iteration"]
    assert k == 2  # the clean stop persists the newest committed state
    second = Daemon(load_config(cfg))
    assert second.restarted_from == (k, str(tmp_path / "out" / f"restart-{checkpoint_name(k)}"))
    assert second.run(source=iter([x for x in frames if x[1].ts_ns >= starts[k + 1]]), install_signals=False) == 0
    assert second.pipe.joined == k + 1
    assert [(r.iteration, r.status) for r in second.pipe.reports] == [(i, "committed") for i in range(k + 1, ITERATIONS)]
    assert second.snapshot.get()["join"]["restarted_from"] == k
    assert second.snapshot.get()["checkpoints"]["store"] == url
    doc, entry = newest_verified(url)
    assert entry["iteration"] == ITERATIONS - 1
    assert diff_checkpoints(doc, load_checkpoint(run / "reference" / entry["file"])) == []
