"""A real PyTorch DDP job on gloo, 3 ranks in 3 network namespaces on the test network's
bridge, its TCP traffic mirrored by tc rules (switch_config.linux) to the checkpoint
namespace, where the daemon captures it and must hold rank 0's state bit for bit after
every iteration, also with loss injected on one mirror link."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ckptd.testing import netlab
from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.live.daemon import Daemon, DaemonConfig, InterfaceConfig
from ckptd.testing.netlab import NetLab

from helpers import synth

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 3


@pytest.mark.parametrize("loss", [0.0, 0.02])
def test_ddp_gloo_on_a_mirrored_bridge_is_bit_exact(tmp_path, loss):
    reason = netlab.lab_unavailable()
    if reason:
        pytest.skip(f"needs network namespaces: {reason}")
    # The network's shape (3 hosts, mirrors on the ports of ranks 0 and 1) from a plan.
    shape = tmp_path / "shape"
    synth(shape, ranks=3, channels=1, mirrors=2, iterations=1)
    prefix = netlab.unique_prefix()
    run = tmp_path / "ddp"
    procs = []
    try:
        with NetLab(shape / "plan.json", prefix=prefix,
                    loss={"mirror1": loss} if loss else None) as lab:
            addrs = [str(h.addr) for h in lab.hosts]
            common = [sys.executable, str(REPO / "scripts" / "ddp_gloo_train.py"), "--world", "3",
                      "--iterations", str(ITERATIONS), "--out", str(run), "--port", "29517",
                      "--master", addrs[0], "--addrs", ",".join(addrs), "--size", "small",
                      "--hold", str(tmp_path / "go")]
            env = dict(os.environ, PYTHONPATH=str(REPO))
            # rank 0 writes plan.json and init.pt before its DDP starts; start it first
            for r, h in enumerate(lab.hosts):
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", h.netns] + common + ["--rank", str(r), "--ifname", h.ifname],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            deadline = time.time() + 60
            while not (run / "plan.json").exists() or not (run / "init.pt").exists():
                assert time.time() < deadline and procs[0].poll() is None, procs[0].stdout.read().decode()
                time.sleep(0.1)
            time.sleep(0.5)
            daemon = Daemon(DaemonConfig(
                plan=str(run / "plan.json"), init=str(run / "init.pt"), out=str(tmp_path / "ck"),
                listen="127.0.0.1:0", persist_sync=True,  # every commit checked on disk
                interfaces=[InterfaceConfig(m.name, m.capture_ifname, lab.ckpt_ns) for m in lab.mirrors]))
            t = threading.Thread(target=lambda: daemon.run(install_signals=False), name="daemon")
            t.start()
            try:
                # the plan is written inside the job (ckptd.torch.write_plan), after its
                # connections are up: the ranks wait until the daemon is capturing
                deadline = time.time() + 60
                while not (daemon.captures and getattr(daemon, "address", None)) and time.time() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)
                (tmp_path / "go").touch()
                for p in procs:
                    out, _ = p.communicate(timeout=240)
                    assert p.returncode == 0, out.decode()[-3000:]
                deadline = time.time() + 60
                while time.time() < deadline and sum(
                        r.status == "committed" for r in daemon.pipe.reports) < ITERATIONS:
                    time.sleep(0.2)
                time.sleep(0.5)
            finally:
                daemon.stop.set()
                t.join(60)
            drops = lab.link_drops()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        assert not netlab.down(prefix, exact=True)
    if loss:
        assert drops["mirror1"] > 0
    reps = {r.iteration: r for r in daemon.pipe.reports}
    for it in range(ITERATIONS):
        assert it in reps and reps[it].status == "committed", \
            [(r.iteration, r.status, r.note) for r in daemon.pipe.reports]
        mine = load_checkpoint(tmp_path / "ck" / checkpoint_name(it))
        assert diff_checkpoints(mine, load_checkpoint(run / "rank0" / checkpoint_name(it))) == []
