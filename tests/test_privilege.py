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


def test_daemon_as_nobody_with_only_cap_net_raw_is_bit_exact(run):
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
            cfg = top / "ckptd.yaml"
            ifs = "".join(f"  - {{name: {m.name}, ifname: {m.capture_ifname}, netns: {lab.ckpt_ns}, "
                          "block_size: 1M, block_nr: 64, retire_ms: 50}\n" for m in lab.mirrors)
            cfg.write_text(f"plan: {run / 'plan.json'}\ninit: {run / 'init.pt'}\nout: {out}\n"
                           f"listen: 127.0.0.1:{port}\npersist_sync: true\nuser: nobody\ndrop_capabilities: false\ninterfaces:\n{ifs}")
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            proc = subprocess.Popen([sys.executable, "-m", "ckptd", "run", "--config", cfg, "--log-level", "info"],
                                    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.time() + 120
            while time.time() < deadline and not (_status(port) or {}).get("capture"):
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.3)
            ids = _proc_status(proc.pid)
            while ids["Uid"][0] != "65534" and time.time() < deadline:  # the drop follows the rings
                time.sleep(0.1)
                ids = _proc_status(proc.pid)
            assert ids["Uid"] == ["65534"] * 4 and ids["Gid"][0] == str(pwd.getpwnam("nobody").pw_gid)
            assert int(ids["CapEff"][0], 16) == CAP_NET_RAW
            assert int(ids["CapPrm"][0], 16) == CAP_NET_RAW
            assert int(ids["CapBnd"][0], 16) == CAP_NET_RAW
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
            assert st["last_committed"] == ITERATIONS - 1, st
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
