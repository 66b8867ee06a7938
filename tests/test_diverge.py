"""A job that diverges (docs/DAEMON.md "A job that diverges"): a gradient with an inf and
no GradScaler steps NaN into the weights and the job trains on. The shadow follows it
bit for bit and says so; retention never prunes the newest finite checkpoint and the
state just before is written; restore warns about a NaN state, and with finite=True
takes the newest finite one."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time

import pytest
import torch

from ckptd.core.checkpoint import CheckpointError, checkpoint_name, diff_checkpoints, load_checkpoint, save_checkpoint
from ckptd.core.finite import first_nonfinite, is_finite
from ckptd.core.keep import CheckpointKeeper
from ckptd.core.manifest import read_manifest
from ckptd.core.optim import torch_optimizer
from ckptd.core.plan import load_plan
from ckptd.fast.pipeline import fast_replay
from ckptd.live.daemon import Daemon, load_config
from ckptd.live.memory_tier import HeldState, MemoryTier
from ckptd.live.persist import PersistTier
from ckptd.live.serve import HttpServer
from ckptd.live.status import _Collector, checkpoint_routes
from ckptd.pipeline import ReplayOptions, file_source
from ckptd.recovery import load_source, restore
from ckptd.testing.synth.model import build_model

from helpers import drain_writer, pcaps, run_replay, synth

DIVERGES_AT = 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """8 iterations of AdamW; rank 0's gradient holds an inf at iteration 3, stepped as is:
    one element of the first parameter NaN from then on, the rest finite."""
    d = tmp_path_factory.mktemp("diverge")
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=8, mirrors=2, inf_at=(DIVERGES_AT,))
    return d


def _reference_nonfinite(job) -> dict[int, bool]:
    """Per iteration, whether the trainer's own checkpoint holds NaN or inf (looked at
    element by element, not by ckptd.core.finite)."""
    out = {}
    for it in range(8):
        model = load_checkpoint(job / "reference" / checkpoint_name(it))["model"]
        out[it] = any(not bool(torch.isfinite(t).all()) for t in model.values() if t.is_floating_point())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_is_finite_finds_one_nan_or_inf_anywhere(dtype):
    t = torch.randn(10_001).to(dtype)
    assert is_finite(t)
    for where in (0, 5_000, 10_000):
        for bad in (float("nan"), float("inf"), float("-inf")):
            u = t.clone()
            u[where] = bad
            assert not is_finite(u), (where, bad)
    both = t.clone()
    both[1], both[2] = float("inf"), float("-inf")  # their sum is NaN: still not finite
    assert not is_finite(both)


def test_finite_values_whose_sum_overflows_are_finite():
    assert is_finite(torch.full((100,), 3e38))
    assert is_finite(torch.full((100_000,), 60_000.0, dtype=torch.float16))
    assert is_finite(torch.arange(10)) and is_finite(torch.zeros(0))
    assert is_finite(torch.tensor([1 + 2j, 3j])) and not is_finite(torch.tensor([1 + 2j, complex(0, float("inf"))]))
    strided = torch.randn(6, 4).t()  # not contiguous
    assert is_finite(strided)
    strided[1, 1] = float("nan")
    assert not is_finite(strided)
    assert first_nonfinite([("a", torch.ones(3)), ("b", torch.tensor([1.0, float("nan")])),
                            ("c", torch.tensor([float("inf")]))]) == "b"
    assert first_nonfinite([("a", torch.ones(3))]) is None


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_replay_of_a_diverging_job_is_exact_and_says_from_where(job, tmp_path, path):
    shutil.copytree(job, tmp_path / "job")
    d = tmp_path / "job"
    if path == "fast":
        opts = ReplayOptions(out=str(d / "out"), reference=str(d / "reference"))
        reps = fast_replay(load_plan(d / "plan.json"), pcaps(d), load_checkpoint(d / "init.pt"), opts).reports
    else:
        reps = run_replay(d).reports
    truth = _reference_nonfinite(job)
    assert truth == {it: it >= DIVERGES_AT for it in range(8)}  # the scenario diverges where asked
    first = load_plan(d / "plan.json").parameters[0].name
    assert [(r.iteration, r.status, r.exact) for r in reps] == [(it, "committed", True) for it in range(8)]
    assert [r.nonfinite for r in reps] == [first if truth[r.iteration] else None for r in reps]


def test_replay_cli_marks_each_diverged_iteration_and_names_the_newest_finite(job, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(job / "plan.json"), *pcaps(job),
                        "--init", str(job / "init.pt"), "--reference", str(job / "reference")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("iteration")]
    assert len(lines) == 8
    name = lines[-1].split("NaN/inf in ")[1]
    for it, line in enumerate(lines):
        assert "bit-exact" in line
        assert ("NaN/inf in " in line) == (it >= DIVERGES_AT), line
    warning = [x for x in r.stderr.splitlines() if "diverged" in x]
    assert warning == [f"warning: the job diverged: its parameters hold NaN or inf from iteration {DIVERGES_AT} on "
                       f"(first: {name}); the newest finite state committed is "
                       f"iteration {DIVERGES_AT - 1}"]
    # an export of a diverged checkpoint is written, and says what it holds
    for it, said in ((DIVERGES_AT - 1, False), (DIVERGES_AT, True)):
        src = job / "reference" / checkpoint_name(it)
        r = subprocess.run([sys.executable, "-m", "ckptd", "export", str(src), "--format", "safetensors",
                            "--out", str(tmp_path / f"{it}.safetensors")], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and (tmp_path / f"{it}.safetensors").exists(), r.stderr
        assert (r.stderr.strip() == f"warning: {src}: {name} holds NaN or inf (iteration {it}: the job had diverged "
                "by then)") == said, r.stderr


def test_daemon_reports_the_divergence_and_retention_keeps_the_newest_finite(job, tmp_path, webhook):
    url, posts = webhook
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text("\n".join([
        f"plan: {job / 'plan.json'}", f"init: {job / 'init.pt'}", f"out: {tmp_path / 'ck'}",
        "listen: 127.0.0.1:0", "persist_sync: true", "keep_last: 2", f"notice: {{webhook: '{url}'}}", "interfaces:",
        "  - {name: mirror0, ifname: m0}", "  - {name: mirror1, ifname: m1}"]) + "\n")
    daemon = Daemon(load_config(cfg))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ckptd").addHandler(handler)
    try:
        assert daemon.run(source=iter(list(file_source(pcaps(job), []))), install_signals=False) == 0
    finally:
        logging.getLogger("ckptd").removeHandler(handler)
    first = load_checkpoint(job / "reference" / checkpoint_name(DIVERGES_AT))
    name = next(n for n, t in first["model"].items() if not bool(torch.isfinite(t).all()))
    want = {"since": DIVERGES_AT, "parameter": name, "newest_finite_committed": DIVERGES_AT - 1}
    assert daemon.snapshot.get()["diverged"] == want
    metrics = {(s.name, *s.labels.values()): s.value for m in _Collector(daemon.snapshot).collect() for s in m.samples}
    assert metrics[("ckptd_diverged_since_iteration",)] == DIVERGES_AT
    assert metrics[("ckptd_last_persisted_iteration",)] == 7 and metrics[("ckptd_checkpoint_writes_failing",)] == 0
    assert {k[1]: v for k, v in metrics.items() if k[0] == "ckptd_notice_events_total"} == \
        {"sent": 1, "failed": 0, "dropped": 0}
    said = [r for r in records if r.getMessage() == "the job diverged: its parameters hold NaN or inf"]
    assert len(said) == 1 and said[0].fields == want  # once, not at every later iteration
    stopped = [r for r in records if r.getMessage() == "stopped"]
    assert len(stopped) == 1 and stopped[0].fields["diverged_since"] == DIVERGES_AT
    assert [ev for _, ev in posts] == [{"event": "ckptd.job_diverged", "iteration": DIVERGES_AT, "parameter": name,
                                        "newest_finite_committed": DIVERGES_AT - 1, "note": posts[0][1]["note"]}]
    # the newest two, and the newest finite one, which keep_last alone would have pruned
    assert sorted(p.name for p in (tmp_path / "ck").glob("iter_*.pt")) == \
        [checkpoint_name(i) for i in (DIVERGES_AT - 1, 6, 7)]
    assert daemon.snapshot.get()["checkpoints"]["newest_finite"] == DIVERGES_AT - 1
    kept = load_checkpoint(tmp_path / "ck" / checkpoint_name(DIVERGES_AT - 1))
    ref = load_checkpoint(job / "reference" / checkpoint_name(DIVERGES_AT - 1))
    assert all(torch.equal(kept["model"][n], ref["model"][n]) for n in ref["model"])


def test_the_persistence_tier_writes_the_last_finite_state_it_would_have_skipped(job, tmp_path):
    """persist_every 10 writes iteration 0 and, at the stop, 7: the state just before the
    divergence (2) would be on no disk, and the memory tier lets it go at the next commit.
    The daemon hands it to the tier when the divergence shows; retention keeps it."""
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text("\n".join([
        f"plan: {job / 'plan.json'}", f"init: {job / 'init.pt'}", f"out: {tmp_path / 'ck'}",
        "listen: 127.0.0.1:0", "persist_every: 10", "keep_last: 2", "interfaces:",
        "  - {name: mirror0, ifname: m0}", "  - {name: mirror1, ifname: m1}"]) + "\n")
    daemon = Daemon(load_config(cfg))
    assert daemon.run(source=iter(list(file_source(pcaps(job), []))), install_signals=False) == 0
    entries = read_manifest(tmp_path / "ck")["checkpoints"]
    assert [(e["iteration"], e["finite"]) for e in entries] == [(DIVERGES_AT - 1, True), (7, False)]
    assert sorted(p.name for p in (tmp_path / "ck").glob("iter_*.pt")) == \
        [checkpoint_name(DIVERGES_AT - 1), checkpoint_name(7)]
    st = daemon.snapshot.get()["checkpoints"]
    assert st["last_persisted"] == 7 and st["newest_finite"] == DIVERGES_AT - 1 and st["state"] == "ok"
    kept = load_checkpoint(tmp_path / "ck" / checkpoint_name(DIVERGES_AT - 1))
    ref = load_checkpoint(job / "reference" / checkpoint_name(DIVERGES_AT - 1))
    assert diff_checkpoints(_parameters(kept, ref), ref) == []


def _parameters(ckpt: dict, ref: dict) -> dict:
    """ckpt with only the model entries the reference (the trainer's) holds."""
    return {**ckpt, "model": {n: t for n, t in ckpt["model"].items() if n in ref["model"]}}


def _state(value: float, n: int = 100):
    w = torch.full((n,), 1.0)
    w[n // 2] = value
    return {"w": w, "b": torch.zeros(3)}, None


def test_retention_keeps_the_newest_finite_checkpoint_until_a_newer_one(tmp_path):
    k = CheckpointKeeper(tmp_path, keep_last=3)
    for it in range(5):
        k.write(it, *_state(1.0))
    for it in range(5, 13):
        k.write(it, *_state(float("nan") if it % 2 else float("inf")))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [checkpoint_name(i) for i in (4, 10, 11, 12)]
    assert k.status()["newest_finite"] == 4 and k.last_finite is False
    k.write(13, *_state(2.0))  # finite again (a resync onto the trainer's state): 4 may go
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(i) for i in (11, 12, 13)]
    assert k.newest_finite == 13


def _held(it: int, value: float) -> HeldState:
    model, _ = _state(value)
    return HeldState(it, model, {"lr": 0.1, "state": {}}, time.time(), 0.0)


def test_the_manifest_says_which_are_finite_and_a_restart_keeps_the_newest_finite(tmp_path):
    tier = PersistTier(tmp_path, every=1, interval_s=None, keep_last=2, keep_every=None)
    for it in range(3):
        assert tier.offer(_held(it, 1.0))
        drain_writer(tier)
    tier.close()
    entries = read_manifest(tmp_path)["checkpoints"]
    assert [(e["iteration"], e["finite"]) for e in entries] == [(1, True), (2, True)]
    # a restarted daemon whose job has diverged meanwhile
    tier = PersistTier(tmp_path, every=1, interval_s=None, keep_last=2, keep_every=None)
    for it in range(3, 7):
        assert tier.offer(_held(it, float("nan")))
        drain_writer(tier)
    tier.close()
    entries = read_manifest(tmp_path)["checkpoints"]
    assert [(e["iteration"], e["finite"]) for e in entries] == [(2, True), (5, False), (6, False)]
    assert sorted(p.name for p in tmp_path.glob("iter_*.pt")) == [checkpoint_name(i) for i in (2, 5, 6)]
    assert json.loads((tmp_path / "manifest.json").read_text())["checkpoints"][0]["finite"] is True


def test_restore_of_a_nan_state_says_so(tmp_path, caplog):
    model = torch.nn.Linear(4, 3)
    good = {n: t.detach().clone() for n, t in model.state_dict().items()}
    bad = {**good, "bias": torch.tensor([0.0, float("nan"), 1.0])}
    save_checkpoint(tmp_path / "good.pt", 4, good, None)
    save_checkpoint(tmp_path / "bad.pt", 5, bad, None)
    with caplog.at_level(logging.WARNING, logger="ckptd.recovery"):
        r = restore(model, None, tmp_path / "good.pt")
    assert r.nonfinite is None and not [x for x in caplog.records if "NaN" in x.getMessage()]
    with caplog.at_level(logging.WARNING, logger="ckptd.recovery"):
        r = restore(model, None, tmp_path / "bad.pt")
    assert r.nonfinite == "bias" and r.iteration == 5
    said = [x.getMessage() for x in caplog.records if "NaN" in x.getMessage()]
    assert said == [f"{tmp_path / 'bad.pt'}: bias holds NaN or inf (iteration 5: the job had diverged by then); "
                    "a checkpoint from before is the one to resume from (restore(..., finite=True) from a "
                    "checkpoint directory takes the newest finite one, which the daemon's retention keeps)"]
    assert torch.isnan(model.bias[1])  # restored as asked: the warning does not refuse it


def _trainer(plan):
    model = build_model("tiny", 0)
    return model, torch_optimizer(plan.optimizer, model.named_parameters())


def test_restore_finite_takes_the_newest_finite_checkpoint_of_a_directory(job, tmp_path, caplog):
    """restore(finite=True) of a replay's output: the iteration before the divergence,
    bit-equal to the trainer's; without it, the newest (NaN) one, with the warning."""
    plan = load_plan(job / "plan.json")
    shutil.copytree(job, tmp_path / "job")
    run_replay(tmp_path / "job")
    out = tmp_path / "job" / "out"
    model, opt = _trainer(plan)
    r = restore(model, opt, out, finite=True)
    assert r.iteration == DIVERGES_AT - 1 and r.nonfinite is None
    ref = load_checkpoint(job / "reference" / checkpoint_name(DIVERGES_AT - 1))
    assert all(torch.equal(t, ref["model"][n]) for n, t in model.state_dict().items() if n in ref["model"])
    with caplog.at_level(logging.WARNING, logger="ckptd.recovery"):
        r = restore(*_trainer(plan), out)
    assert r.iteration == 7 and r.nonfinite
    assert any("holds NaN or inf" in x.getMessage() for x in caplog.records)


@pytest.mark.parametrize("url", [False, True], ids=["directory", "file-url"])
def test_finite_passes_over_what_the_manifest_says_is_not_finite_unread(tmp_path, caplog, url):
    tier = PersistTier(tmp_path, every=1, interval_s=None, keep_last=3, keep_every=None)
    for it, value in ((0, 1.0), (1, 2.0), (2, float("nan")), (3, float("inf"))):
        assert tier.offer(_held(it, value))
        drain_writer(tier)
    tier.close()
    for it in (2, 3):  # unreadable: finite=True must not even open them
        (tmp_path / checkpoint_name(it)).write_bytes(b"not read")
    src = f"file://{tmp_path}" if url else str(tmp_path)
    with caplog.at_level(logging.WARNING):
        ckpt, where, _ = load_source(src, None, finite=True)
    assert ckpt["iteration"] == 1 and where.endswith(checkpoint_name(1))
    assert torch.equal(ckpt["model"]["w"], _held(1, 2.0).model["w"])
    assert not caplog.records, [(x.getMessage(), getattr(x, "fields", None)) for x in caplog.records]


def test_restore_finite_of_a_nan_file_is_refused_with_the_model_unchanged(tmp_path):
    model = torch.nn.Linear(4, 3)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    bad = {n: torch.full_like(t, 7.0) for n, t in before.items()}
    bad["weight"][2, 1] = float("inf")
    save_checkpoint(tmp_path / "bad.pt", 5, bad, None)
    with pytest.raises(CheckpointError) as e:
        restore(model, None, tmp_path / "bad.pt", finite=True)
    assert str(e.value) == (f"{tmp_path / 'bad.pt'}: weight holds NaN or inf (iteration 5: the job had diverged "
                            "by then); with finite=True only a finite state is restored: a checkpoint directory "
                            "gives its newest finite one")
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_restore_finite_from_the_daemon_refuses_its_nan_state_with_the_model_unchanged(tmp_path):
    model = torch.nn.Linear(4, 3)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    tier = MemoryTier()
    routes = checkpoint_routes(tier, ["weight", "bias"], lambda lr: None, None)
    srv = HttpServer(routes, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{srv.address[1]}"
        state = {"weight": torch.full((3, 4), 0.5), "bias": torch.tensor([1.0, float("nan"), 2.0])}
        tier.commit(4, state, None)
        with pytest.raises(CheckpointError, match=r"bias holds NaN or inf \(iteration 4: .*nothing in the model "
                                                  r"changed"):
            restore(model, None, url, finite=True)
        assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
        state = {"weight": torch.full((3, 4), 0.5), "bias": torch.tensor([1.0, 3.0, 2.0])}
        tier.commit(5, state, None)
        r = restore(model, None, url, finite=True)
        assert r.iteration == 5 and torch.equal(model.bias.detach(), state["bias"])
    finally:
        srv.stop()
