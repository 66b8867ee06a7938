"""The daemon survives its checkpoint disk (issue 13, item 4): a small tmpfs as `out`
fills mid-run; capture and commits go on (reported committed, not persisted), /status
says the writes fail, and when space returns the newest state is written, old ones are
pruned to keep_last, and every file written is bit-identical to the trainer's. Also:
SIGHUP does not stop the daemon."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
import uuid

import pytest

from ckptd.core import keep
from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.live.daemon import Daemon, load_config
from ckptd.pipeline import file_source

from helpers import pcaps, synth

ITERATIONS = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("disk")
    synth(d, ranks=2, channels=1, mtu=1024, iterations=ITERATIONS, mirrors=2)
    return d


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / f"hd-ck-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _fill(path):
    """Write until the file system is full; the filler's path."""
    filler = path / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_full_disk_mid_run_capture_goes_on_and_writes_resume(run, tmpfs, tmp_path, monkeypatch):
    monkeypatch.setattr(keep, "BACKOFF_FIRST_S", 0.0)  # retry at every commit (back-off: test_keep.py)
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {tmpfs}\n"
                   "listen: 127.0.0.1:0\npersist_sync: true\nkeep_last: 3\ninterfaces:\n"
                   "  - {name: mirror0, ifname: m0}\n  - {name: mirror1, ifname: m1}\n")
    daemon = Daemon(load_config(cfg))
    seen = {}

    def committed():
        return [r.iteration for r in daemon.pipe.reports if r.status == "committed"]

    def source():
        filler = None
        for item in file_source(pcaps(run), []):
            done = committed()
            if filler is None and done and done[-1] >= 1 and "full" not in seen:
                filler = _fill(tmpfs)
                seen["full"] = done[-1]
            if filler is not None and done and done[-1] >= seen["full"] + 3:
                seen["status"] = json.loads(urllib.request.urlopen(
                    f"http://127.0.0.1:{daemon.address[1]}/status").read())
                seen["metrics"] = urllib.request.urlopen(f"http://127.0.0.1:{daemon.address[1]}/metrics").read()
                os.unlink(filler)  # space returns
                filler = None
            yield item

    rc = daemon.run(source=source(), install_signals=False)
    reps = {r.iteration: r for r in daemon.pipe.reports}
    assert rc == 0 and committed() == list(range(ITERATIONS))
    full = seen["full"]
    unpersisted = [i for i, r in reps.items() if r.persisted is False]
    assert unpersisted == list(range(full + 1, full + 4)), [(i, r.persisted) for i, r in reps.items()]
    assert all(reps[i].persisted for i in range(ITERATIONS) if i not in unpersisted)
    st = seen["status"]["checkpoints"]
    assert st["state"] == "failing" and st["last_persisted"] == full
    assert "No space left on device" in st["last_error"], st
    # and in Prometheus, for an alert: failing now, the newest written, how many not
    metrics = dict(re.findall(r"^(ckptd_(?:checkpoint|last_persisted|checkpoints)\w*) (\S+)$",
                              seen["metrics"].decode(), re.M))
    assert metrics == {"ckptd_checkpoint_writes_failing": "1.0", "ckptd_last_persisted_iteration": f"{full}.0",
                       "ckptd_checkpoint_write_failures_total": f"{st['write_failures']}.0",
                       "ckptd_checkpoints_not_persisted_total": f"{st['not_persisted']}.0"}, metrics
    assert st["write_failures"] >= 1 and st["not_persisted"] >= 1
    # keep_last 3: only the newest three remain, each exactly the trainer's
    names = sorted(p.name for p in tmpfs.iterdir())
    assert names == [checkpoint_name(i) for i in range(ITERATIONS - 3, ITERATIONS)], names
    for name in names:
        assert (os.stat(tmpfs / name).st_mode & 0o777) == 0o600
        assert diff_checkpoints(load_checkpoint(tmpfs / name), load_checkpoint(run / "reference" / name)) == []


def test_sighup_is_ignored(run, tmp_path):
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {tmp_path / 'ck'}\n"
                   "listen: 127.0.0.1:0\npersist_sync: true\ninterfaces:\n  - {name: mirror0, ifname: m0}\n")
    daemon = Daemon(load_config(cfg))
    daemon.install_signals()
    try:
        os.kill(os.getpid(), signal.SIGHUP)  # would end the process with the default action
        time.sleep(0.1)
        assert not daemon.stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert daemon.stop.is_set()
    finally:
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)


@pytest.mark.parametrize("sync", [True, False], ids=["persist_sync", "persistence_tier"])
def test_a_disk_full_to_the_end_is_exit_5_naming_the_newest_iteration(run, tmpfs, tmp_path, monkeypatch, caplog,
                                                                       sync):
    """Commits go on while no checkpoint can be written; at the stop the last try fails
    too: the exit status says the newest committed state is not on disk (not 0)."""
    monkeypatch.setattr(keep, "BACKOFF_FIRST_S", 0.0)
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {tmpfs}\n"
                   f"listen: 127.0.0.1:0\npersist_sync: {str(sync).lower()}\npersist_every: 1\ninterfaces:\n"
                   "  - {name: mirror0, ifname: m0}\n  - {name: mirror1, ifname: m1}\n")
    daemon = Daemon(load_config(cfg))

    def top_up():
        """Whatever space a failed write gave back is taken again (the persistence tier
        writes from its own thread, so the disk may be full before the filler exists)."""
        try:
            with open(tmpfs / "filler", "ab") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC

    def source():
        full = False
        for item in file_source(pcaps(run), []):
            full = full or any(r.status == "committed" for r in daemon.pipe.reports)
            if full:
                top_up()
            yield item

    with caplog.at_level("ERROR", logger="ckptd"):
        rc = daemon.run(source=source(), install_signals=False)
    committed = [r.iteration for r in daemon.pipe.reports if r.status == "committed"]
    assert committed == list(range(ITERATIONS))
    assert rc == 5 and daemon._unpersisted() == ITERATIONS - 1
    assert any(r.getMessage() == "the newest committed checkpoint was not written" for r in caplog.records)
    assert checkpoint_name(ITERATIONS - 1) not in {p.name for p in tmpfs.iterdir()}


def test_an_out_the_daemon_cannot_write_stops_it_at_the_start(run, tmp_path):
    mnt = tmp_path / f"ro-ck-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.strip()}")
    try:
        cfg = tmp_path / "ckptd.yaml"
        cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {mnt}\n"
                       "listen: 127.0.0.1:0\ninterfaces:\n  - {name: mirror0, ifname: lo}\n")
        r = subprocess.run(["ckptd", "run", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
        err = r.stderr.strip().splitlines()
        assert r.returncode == 2 and err[-1].startswith(f"error: {cfg}: out {mnt}: the daemon cannot write there"), r.stderr
        assert "Read-only file system" in err[-1] and "Traceback" not in r.stderr
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_sigterm_while_the_daemon_starts_ends_it_with_a_line(tmp_path):
    """Before Daemon.run takes SIGTERM as a stop (imports, the config, the shadow), the
    default action killed the process without a word, exit 143 (SIGINT said a line and
    exited 130). Here the config is a FIFO nobody writes into: the start waits on it."""
    import subprocess
    import sys
    fifo = tmp_path / "ckptd.yaml"
    os.mkfifo(fifo)
    p = subprocess.Popen([sys.executable, "-m", "ckptd", "run", "--config", str(fifo)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not _holds(p.pid, fifo):  # the start waits on the FIFO
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and err.count("\n") == 1 and "interrupted" in err, (p.returncode, err)


def _holds(pid: int, path) -> bool:
    """Whether process pid has `path` open."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    return True
            except OSError:
                continue  # closed meanwhile
    except OSError:
        return False  # the process has ended
    return False


def test_a_process_forked_during_the_start_ends_on_sigterm():
    """The start-up handler raised KeyboardInterrupt in a process forked meanwhile (a
    capture worker, or a test's helper): the child ran its parent's exit path instead of
    ending (CI stopped at 16%). A forked child gets the default action."""
    import ckptd.cli as cli
    pid = os.fork()
    if pid == 0:  # the child: the parent's start is the one the handler was set for
        try:
            cli._STARTING_PID[:] = [os.getppid()]
            signal.signal(signal.SIGTERM, cli._interrupted)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except BaseException:
            os._exit(7)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
