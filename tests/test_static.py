"""DDP's static_graph=True on gloo (docs/TRAINING.md): the first backward only counts hook
calls, then the reducer allreduces its used-parameter map FIRST (one int32 a parameter)
and every bucket of the first layout (one bucket); iteration 1 allreduces the first
layout again with no map; DDP rebuilds after iteration 1 (the rebuilt-indices broadcast)
and later rounds carry no map either. The map of iteration 0 is kept: a parameter no rank
used then is never stepped. Real 2-rank gloo DDP jobs (tests/_static_job.py; a parameter
unused on every rank, one used on one rank, one under activation checkpointing): the
shadow, given what DDP reduced, matches rank 0 bit for bit every iteration, and a capture
replays bit-exact through `ckptd replay`."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptd.core.checkpoint import diff_checkpoints, load_checkpoint
from ckptd.core.plan import USED_MAP, PlanError, load_plan, plan_from_json
from ckptd.core.shadow import ShadowModel
import _static_job as job
from helpers import job_runs
from test_unused import assert_replay_exact, _buffers, _without_map, _captured, _replay_cli, _replay as _replay_unused

REPO = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("_static_job.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    get = job_runs(tmp_path_factory, JOB.name)
    return lambda kind, clip, find_unused=False: get(kind, "-" if clip is None else clip,
                                                     *(["find_unused"] if find_unused else []))


def _replay(d: Path, used=None, recorded: bool = True) -> list[tuple[int, list[str]]]:
    plan = load_plan(d / "plan.json")
    if not recorded:  # as a plan write_plan did not rewrite: the map only from the wire
        plan = dataclasses.replace(plan, static_used_map=None)
    return _replay_unused(d, used, plan, job.ITERATIONS)


@pytest.mark.parametrize("kind,clip,find_unused", [("adamw", 0.5, False), ("adamw", None, False),
                                                   ("sgd", 0.5, False), ("sgd", None, True)])
def test_parameters_unused_at_iteration_0_replay_bit_for_bit(runs, kind, clip, find_unused):
    d = runs(kind, clip, find_unused)
    plan = load_plan(d / "plan.json")
    assert plan.static_graph and not plan.find_unused_parameters and not plan.rebuilt_learn
    assert len(plan.buckets_first) == 1 and len(plan.buckets_rebuilt) == 2  # DDP's caps: one first bucket
    assert plan.buckets_rebuilt[1].params == ("fc1.bias", "fc1.weight", "dead.weight", "dead.bias")
    names = [p.name for p in plan.parameters]
    for it in range(job.ITERATIONS):
        ref = torch.load(d / f"iter{it}.pt", weights_only=True)
        # what DDP did: rebuilt before iteration 2's backward (after iteration 1), its
        # map of iteration 0 kept, dead's grad None every iteration, b's the reduced one
        assert ref["rebuilt"] == (it >= 2) and len(ref["layout"]) == (1 if it < 2 else 2)
        assert ref["used"].tolist() == [job.USED[n.split(".")[0]] for n in names], it
        assert sorted(ref["grads"]) == sorted(n for n in names if not n.startswith("dead"))
        assert not any(n.startswith("dead") for n in ref["optimizer"]["state"])
    assert _replay(d) == [(it, []) for it in range(job.ITERATIONS)]


def test_a_shadow_ignoring_the_map_differs(runs):
    """Every parameter marked used at iteration 0 (dead stepped with its zero slot, as a
    shadow ignoring the map would): rank 0 differs from iteration 0 on."""
    d = runs("sgd", 0.5)
    bad = [(it, diffs) for it, diffs in _replay(d, used=lambda ref: np.maximum(ref["used"].numpy(), 1), recorded=False)
           if diffs]
    assert bad and bad[0][0] == 0 and any("dead" in x for x in bad[0][1])


def test_the_plan_says_so_and_what_is_not_decoded_is_refused(runs):
    d = runs("adamw", 0.5)
    doc = json.loads((d / "plan.json").read_text())
    assert doc["static_graph"] is True and "find_unused_parameters" not in doc
    plan = plan_from_json(doc)
    assert plan_from_json(plan.to_json()) == plan
    nb, n = len(plan.buckets_first), len(plan.parameters)
    assert [b.count for b in plan.buckets(0)][-1] == n and plan.buckets(0)[-1].dtype == np.dtype("<i4")
    assert plan.is_used_map(0, nb) and not plan.is_used_map(1, nb) and not plan.has_map(2)
    assert len(plan.buckets(1)) == nb and len(plan.buckets(2)) == len(plan.buckets_rebuilt)
    assert plan.layout(1) == plan.buckets_first and plan.wire_layout(1) == plan.buckets_first
    assert plan.layout(2) == plan.buckets_rebuilt and plan.rebuild_round == 2
    for change, why in ((dict(allreduces_per_step=2), r"allreduces_per_step > 1 is not supported"),
                        (dict(find_unused_parameters=True, buckets_rebuilt=plan.buckets_first),
                         r"static_graph with find_unused_parameters"),
                        (dict(static_graph="yes"), r"static_graph must be true or absent")):
        with pytest.raises(PlanError, match=why) as e:
            dataclasses.replace(plan, **change)
        assert "\n" not in str(e.value)
    import ckptd.torch as ct
    ct._check_static_graph("nccl", 1)  # NCCL/RoCE too (tests/test_static_roce.py, synthesized)
    with pytest.raises(ct.TrainerError, match=r"static_graph=True with allreduces_per_step > 1") as e:
        ct._check_static_graph("nccl", 2)
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError, match=r"static_used_map must be one 0 or 1 per parameter"):
        plan_from_json({**doc, "static_used_map": [1, 0]})
    with pytest.raises(PlanError, match=r"static_used_map without static_graph"):
        plan_from_json({k: v for k, v in doc.items() if k != "static_graph"})
    # a resumed shadow: never-used parameters have no optimizer state, and that is fine;
    # write_plan's rewrite after DDP's rebuild recorded the map DDP keeps from iteration
    # 0, so the shadow steps every later iteration bit for bit without seeing it
    names = [p.name for p in plan.parameters]
    assert plan.static_used_map == tuple(int(job.USED[n.split(".")[0]] > 0) for n in names)
    ckpt = load_checkpoint(d / "rank0" / "iter_000001.pt", plan.state_names)
    plan.check_resume(ckpt, "ckpt")
    shadow = ShadowModel(plan, ckpt)
    for it in range(2, job.ITERATIONS):
        ref = torch.load(d / f"iter{it}.pt", weights_only=True)
        shadow.apply(it, _buffers(plan, it, ref))
        assert diff_checkpoints({"iteration": it, "model": shadow.model_state(),
                                 "optimizer": shadow.optimizer_state()}, {"iteration": it, **ref}) == [], it
    # a plan without it (not rewritten): the shadow did not see iteration 0's map, so it cannot step
    shadow = ShadowModel(dataclasses.replace(plan, static_used_map=None), ckpt)
    with pytest.raises(ValueError, match=r"of iteration 0 \(static_graph"):
        shadow.apply(2, _buffers(plan, 2, torch.load(d / "iter2.pt", weights_only=True)))
    # a plan's map the wire contradicts at iteration 0 is refused, never stepped
    flipped = dataclasses.replace(plan, static_used_map=tuple(1 - x for x in plan.static_used_map))
    shadow = ShadowModel(flipped, load_checkpoint(d / "init.pt", plan.state_names))
    with pytest.raises(ValueError, match=r"the plan's static_used_map the opposite"):
        shadow.apply(0, _buffers(plan, 0, torch.load(d / "iter0.pt", weights_only=True)))


# -- a captured job ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    d = tmp_path_factory.mktemp("captured")
    return d, _captured(d, "sgd", 0.5, JOB)


def test_a_captured_job_replays_bit_exact(captured, tmp_path):
    d, pcap = captured
    r = _replay_cli(d, [pcap], tmp_path / "ckpts")
    assert_replay_exact(r, job.ITERATIONS)


def test_a_captured_job_replays_bit_exact_learning_the_rebuilt_layout(captured, tmp_path):
    """The plan's rebuilt layout "learn" (write_plan's before DDP rebuilt, iteration 2's
    forward): the extractor takes it from the broadcast after iteration 1."""
    d, pcap = captured
    doc = json.loads((d / "plan.json").read_text())
    doc["buckets"]["rebuilt"] = "learn"
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(tmp_path / "plan.json"),
                        "--init", str(d / "init.pt"), "--out", str(tmp_path / "ckpts"), "--reference",
                        str(d / "rank0"), str(pcap)], capture_output=True, text=True, timeout=300, cwd=REPO)
    n = job.ITERATIONS
    assert r.returncode == 0 and f"{n} iterations, {n} committed" in r.stdout, r.stdout[-2000:] + r.stderr
    assert r.stdout.count("bit-exact") == n and "NOT bit-exact" not in r.stdout and "rebuilt_learned" in r.stdout


def test_a_captured_job_with_buffers_replays_bit_exact(tmp_path_factory, tmp_path):
    """A BatchNorm's buffers, broadcast by DDP at every forward: after iteration 1 they
    follow DDP's rebuilt-layout broadcasts (a static graph rebuilds there, not after 0)."""
    d = tmp_path_factory.mktemp("captured_bn")
    pcap = _captured(d, "adamw", None, JOB, ("bn",))
    assert load_plan(d / "plan.json").buffers.captured
    r = _replay_cli(d, [pcap], tmp_path / "ckpts")
    n = job.ITERATIONS  # the last one's buffers are never broadcast (no forward follows)
    assert f"{n} iterations, {n - 1} committed, 1 not recovered ({n - 1})" in r.stdout, r.stdout[-2000:] + r.stderr
    assert r.stdout.count("bit-exact") == n - 1 and "NOT bit-exact" not in r.stdout
    assert "module buffers after iteration 4 not seen whole" in r.stdout


@pytest.mark.parametrize("recorded", [True, False])
def test_a_lost_map_of_iteration_0_commits_nothing(captured, tmp_path, recorded):
    """Every segment carrying a data message of the map allreduce (tag 3, the first after
    DDP's start-up allgather and broadcasts) dropped: iteration 0 is unrecoverable naming
    the map, and nothing later is committed: the shadow stopped there (with the map the
    plan recorded), or every later iteration is unrecoverable too (a plan without it:
    DDP keeps that map, and this shadow never saw it)."""
    d, pcap = captured
    lossy = _without_map(pcap, 3, tmp_path / "lossy.pcap")
    if not recorded:  # the plan as write_plan wrote it before DDP's rebuild
        doc = json.loads((d / "plan.json").read_text())
        assert doc.pop("static_used_map")
        d2 = tmp_path / "unrecorded"
        d2.mkdir()
        (d2 / "plan.json").write_text(json.dumps(doc))
        for name in ("init.pt", "rank0"):
            (d2 / name).symlink_to(d / name)
        d = d2
    r = _replay_cli(d, [lossy], tmp_path / "ckpts")
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    lines = {int(ln.split()[1].rstrip(":")): ln for ln in r.stdout.splitlines() if ln.startswith("iteration ")}
    assert "unrecoverable" in lines[0] and USED_MAP in lines[0], lines[0]
    later = [lines[i] for i in range(1, job.ITERATIONS)]
    if recorded:
        assert all("complete-not-applied" in ln and "shadow stopped at iteration -1" in ln for ln in later), r.stdout
    else:
        assert all("unrecoverable" in ln and "static_graph" in ln for ln in later), r.stdout
    assert not any("committed" in ln for ln in lines.values()), r.stdout
    assert not any(p.name.startswith("iter") for p in (tmp_path / "ckpts").iterdir())
