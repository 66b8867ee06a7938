"""Least privilege (issue 13, item 6): the daemon, configured with `user: nobody`, opens
its capture rings inside the lab's checkpoint namespace as root, then runs as uid 65534
with CAP_NET_RAW alone (bounding set included), and still writes bit-exact checkpoints
of traffic sent over the netlab network."""
from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.testing import netlab
from ckptd.testing.netlab import NetLab
from parsers.pcap import read_pcap

from helpers import synth

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 3
CAP_NET_RAW = 1 << 13


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    reason = netlab.lab_unavailable()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' here")
    d = tmp_path_factory.mktemp("priv")
    synth(d, ranks=2, channels=1, mtu=1024, mirrors=2, iterations=ITERATIONS, write_hosts=True, seed=5)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int) -> dict:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.split()
    return out


def _status(port: int) -> dict | None:
    try:
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2).read())
    except OSError:
        return None


def _start_daemon(run: Path, lab, top: Path, out: Path, port: int, extra: str) -> subprocess.Popen:
    """`ckptd run` from a config file (written in top) on the lab's mirror ports; `extra`:
    more config lines."""
    cfg = top / "ckptd.yaml"
    ifs = "".join(f"  - {{name: {m.name}, ifname: {m.capture_ifname}, netns: {lab.ckpt_ns}, "
                  "block_size: 1M, block_nr: 64, retire_ms: 50}\n" for m in lab.mirrors)
    cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {out}\n"
                   f"listen: 127.0.0.1:{port}\npersist_sync: true\n{extra}interfaces:\n{ifs}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "ckptd", "run", "--config", cfg, "--log-level", "info"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_capturing(proc: subprocess.Popen, port: int) -> float:
    """Until the daemon's /status says it captures; the test's deadline."""
    deadline = time.time() + 120
    while time.time() < deadline and not (_status(port) or {}).get("capture"):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.3)
    return deadline


@pytest.mark.parametrize("drop", [False, True], ids=["keep-net-raw", "drop-capabilities"])
def test_daemon_as_nobody_with_only_cap_net_raw_is_bit_exact(run, drop):
    """drop_capabilities false: uid 65534 keeping CAP_NET_RAW alone; true (a config
    file's default): uid 65534 with no capability at all, in every thread."""
    keep = 0 if drop else CAP_NET_RAW
    frames = {r: [(f.ts_ns, f.data) for f in read_pcap(run / "hosts" / f"rank{r}.pcap")] for r in range(2)}
    # the checkpoint directory's parent must be reachable by uid 65534 (pytest's is 0700)
    top = Path(tempfile.mkdtemp(prefix="hd-priv-"))
    os.chmod(top, 0o755)
    out = top / "ck"
    port = _free_port()
    prefix = f"hd{secrets.token_hex(3)}"
    proc = None
    try:
        with NetLab(run / "plan.json", prefix=prefix) as lab:
            proc = _start_daemon(run, lab, top, out, port,
                                 f"user: nobody\ndrop_capabilities: {str(drop).lower()}\n")
            deadline = _wait_capturing(proc, port)
            ids = _proc_status(proc.pid)
            while ids["Uid"][0] != "65534" and time.time() < deadline:  # the drop follows the rings
                time.sleep(0.1)
                ids = _proc_status(proc.pid)
            assert ids["Uid"] == ["65534"] * 4 and ids["Gid"][0] == str(pwd.getpwnam("nobody").pw_gid)
            for tid, row in _threads(proc.pid).items():  # every thread
                assert row["Uid"] == ["65534"] * 4, tid
                assert int(row["CapEff"][0], 16) in (keep, 0) and int(row["CapPrm"][0], 16) in (keep, 0)
                assert int(row["CapBnd"][0], 16) == keep, (tid, row["CapBnd"])
                assert int(row["CapInh"][0], 16) == 0 and row["NoNewPrivs"] == ["1"], tid
            assert int(ids["CapEff"][0], 16) == keep
            assert int(ids["CapPrm"][0], 16) == keep
            assert int(ids["CapBnd"][0], 16) == keep
            assert int(ids["CapInh"][0], 16) == 0 and ids["NoNewPrivs"] == ["1"]
            time.sleep(1.0)  # as tests/test_live.py: the lab settles before the job starts
            sent = lab.send(frames, timing="rate", pps=4000)
            assert all(x.failed == 0 for x in sent.values())
            while time.time() < deadline and (_status(port) or {}).get("last_committed", -1) < ITERATIONS - 1:
                time.sleep(0.3)
            st = _status(port)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            assert st["last_committed"] == ITERATIONS - 1, (st, err[-3000:])
            assert st["checkpoints"]["state"] == "ok"
        for it in range(ITERATIONS):
            path = out / checkpoint_name(it)
            assert path.stat().st_uid == 65534 and (path.stat().st_mode & 0o777) == 0o600
            assert diff_checkpoints(load_checkpoint(path),
                                    load_checkpoint(run / "reference" / checkpoint_name(it))) == []
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        shutil.rmtree(top, ignore_errors=True)
        assert not netlab.down(prefix, exact=True)


def _threads(pid: int) -> dict[int, dict]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        out[int(tid)] = {k: v.split() for k, _, v in (line.partition(":") for line in text.splitlines())}
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            kids += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return kids


@pytest.mark.parametrize("workers", [False, True], ids=["in-process", "capture-workers"])
def test_drop_capabilities_every_thread_no_capability_bit_exact(run, workers):
    """No `user`: drop_capabilities (a config file's default) leaves the daemon root with
    no capability in ANY thread (the status server, the persistence writer, torch's
    pools were running before the drop) nor in its capture worker processes, the
    bounding sets empty and no_new_privs set; the open rings still capture, and the
    checkpoints are bit-exact."""
    frames = {r: [(f.ts_ns, f.data) for f in read_pcap(run / "hosts" / f"rank{r}.pcap")] for r in range(2)}
    top = Path(tempfile.mkdtemp(prefix="hd-caps-"))
    out = top / "ck"
    port = _free_port()
    prefix = f"hc{secrets.token_hex(3)}"
    proc = None
    try:
        with NetLab(run / "plan.json", prefix=prefix) as lab:
            # drop_capabilities: the default
            proc = _start_daemon(run, lab, top, out, port, f"capture_workers: {str(workers).lower()}\n")
            deadline = _wait_capturing(proc, port)
            while int(_proc_status(proc.pid)["CapEff"][0], 16) and time.time() < deadline:
                time.sleep(0.1)  # the drop follows the rings
            time.sleep(0.5)
            pids = [proc.pid] + (_children(proc.pid) if workers else [])
            if workers:
                assert len(pids) >= 1 + len(lab.mirrors), pids
            threads = {(pid, tid): row for pid in pids for tid, row in _threads(pid).items()}
            assert len(_threads(proc.pid)) > 1  # the drop had other threads to reach
            for (pid, tid), row in threads.items():
                assert row["Uid"][0] == "0"
                caps = {k: int(row[k][0], 16) for k in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb")}
                assert caps == dict.fromkeys(caps, 0), (pid, tid, row["Name"], caps)
                assert row["NoNewPrivs"] == ["1"], (pid, tid)
            time.sleep(1.0)
            sent = lab.send(frames, timing="rate", pps=4000)
            assert all(x.failed == 0 for x in sent.values())
            # capture workers hand the last iteration over at the stop (the same without
            # drop_capabilities): wait for the one before it there
            want = ITERATIONS - 2 if workers else ITERATIONS - 1
            while time.time() < deadline and (_status(port) or {}).get("last_committed", -1) < want:
                time.sleep(0.3)
            st = _status(port)
            for pid in pids:  # threads started since (HTTP workers, ...) inherited nothing
                for tid, row in _threads(pid).items():
                    assert int(row["CapEff"][0], 16) == 0 and int(row["CapBnd"][0], 16) == 0, (pid, tid)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            assert st["last_committed"] >= want, st
            stopped = [json.loads(line) for line in err.splitlines() if '"msg": "stopped"' in line]
            assert stopped and stopped[-1]["last_committed"] == ITERATIONS - 1, err[-2000:]
        drops = [line for line in err.splitlines() if "capabilities dropped in all" in line]
        assert len(drops) == 1, err  # one line, the daemon's (a worker's own drop is read from /proc above)
        assert "CAP_NET_RAW" in drops[0] and "CAP_SYS_ADMIN" in drops[0]
        for it in range(ITERATIONS):
            assert diff_checkpoints(load_checkpoint(out / checkpoint_name(it)),
                                    load_checkpoint(run / "reference" / checkpoint_name(it))) == []
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        shutil.rmtree(top, ignore_errors=True)
        assert not netlab.down(prefix, exact=True)


def test_drop_capabilities_config_key(tmp_path):
    """The key: a bool, true unless a config file says otherwise; DaemonConfig's own
    default stays False (programmatic and test daemons)."""
    from ckptd.live.daemon import ConfigError, DaemonConfig, load_config
    assert DaemonConfig(plan="p", init="i", out="o", interfaces=[]).drop_capabilities is False
    base = "plan: p.json\ninit: i.pt\nout: ck\ninterfaces:\n  - {name: m0, ifname: lo}\n"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(base)
    assert load_config(cfg).drop_capabilities is True
    cfg.write_text(base + "drop_capabilities: false\n")
    assert load_config(cfg).drop_capabilities is False
    cfg.write_text(base + "drop_capabilities: maybe\n")
    with pytest.raises(ConfigError, match="drop_capabilities"):
        load_config(cfg)


def test_drop_capabilities_error_is_one_line_naming_the_key(monkeypatch):
    """A drop the kernel refuses stops the start with one line naming the config key
    (the helper stubbed: this test process keeps its capabilities)."""
    import cython_ext.caps as caps
    from ckptd.live.privilege import PrivilegeError, drop_capabilities
    monkeypatch.setattr(caps, "drop_all_threads", lambda *a: (-1, 3, 1234, "capset"))
    with pytest.raises(PrivilegeError) as e:
        drop_capabilities()
    assert str(e.value) == "drop_capabilities: cannot capset in thread 1234: Operation not permitted"
