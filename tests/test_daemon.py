"""The daemon's loop, status and metrics, fed from files (the live network test is
tests/test_live.py)."""
import json
import threading
import urllib.request

import pytest

from ckptd.daemon import ConfigError, Daemon, load_config
from ckptd.pipeline import file_source

from helpers import pcaps, synth


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("daemon")
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=4, mirrors=2)
    return d


def _config(d, tmp_path, **extra):
    cfg = tmp_path / "ckptd.yaml"
    lines = [f"plan: {d / 'plan.json'}", f"init: {d / 'init.pt'}", f"out: {tmp_path / 'ck'}",
             "listen: 127.0.0.1:0", "interfaces:",
             "  - {name: mirror0, ifname: m0}", "  - {name: mirror1, ifname: m1}"]
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
