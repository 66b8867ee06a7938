"""Frozen parameters on the RoCE/NCCL path: `ckptd synth --freeze PREFIX` trains the
synthetic job with those parameters requires_grad=False, as a DDP job would (its reducer
leaves them out: no bucket, no gradient on the wire; the optimizer, built over
model.parameters(), holds them and skips them). Replay, through the fast path and the
reference path, must rebuild every iteration bit for bit, the frozen parameters carried
unchanged from init.pt, and its checkpoint must be a whole state_dict of the model.
(tests/test_frozen.py covers gloo, with real 2-process jobs.)"""
from __future__ import annotations

import json

import pytest
import torch

from ckptd.cli import main
from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.core.plan import load_plan
from ckptd.fast.pipeline import fast_replay
from ckptd.pipeline import ReplayOptions, replay
from ckptd.testing.synth.model import build_model
from ckptd.torch import verify_collectives

from helpers import pcaps

ITERATIONS = 3
SCENARIOS = {
    # the first block frozen, default AdamW, several buckets (a 16 KiB cap) on 3 ranks
    "block0-adamw-3ranks": (["--ranks", "3", "--freeze", "blocks.0."], "tiny"),
    # the embeddings frozen (the last gradients to become ready: the rebuilt layout changes),
    # Adagrad (torch makes state for them at construction), two groups, clipping, LL,
    # DDP's start-up collectives (the shape check covers the trainable parameters only)
    "embeddings-adagrad-ll-startup": (["--ranks", "2", "--protocol", "ll", "--freeze", "tok", "--freeze", "pos",
                                       "--optim", "adagrad:lr=0.01", "--param-groups", "no-decay",
                                       "--max-grad-norm", "0.5", "--startup-broadcast"], "tiny"),
    # the head frozen under AMP with a skipped step, LL128, 2 micro-batches a step
    "head-amp-ll128-accumulate": (["--ranks", "4", "--protocol", "ll128", "--freeze", "head", "--amp", "1024",
                                   "--inf-at", "1", "--allreduces-per-step", "2"], "tiny"),
}


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            args, model = SCENARIOS[name]
            d = tmp_path_factory.mktemp(name)
            assert main(["synth", "--out", str(d), "--model", model, "--iterations", str(ITERATIONS),
                         "--channels", "2", "--mirrors", "2", "--bucket-cap-kb", "16", "--seed", "3", *args]) == 0
            made[name] = d
        return made[name]
    return get


def _frozen_names(args):
    prefixes = [args[i + 1] for i, a in enumerate(args) if a == "--freeze"]
    return {n for n, _ in build_model("tiny", 3).named_parameters() if n.startswith(tuple(prefixes))}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_plan_leaves_frozen_parameters_out_of_the_buckets(synthesized, name):
    d = synthesized(name)
    plan = load_plan(d / "plan.json")
    frozen = _frozen_names(SCENARIOS[name][0])
    model = build_model("tiny", 3)
    assert {p.name for p in plan.frozen} == frozen and not frozen & {p.name for p in plan.parameters}
    assert [p.name for p in plan.frozen] == [n for n, _ in model.named_parameters() if n in frozen]  # model order
    trainable = sorted(p.name for p in plan.parameters)
    assert trainable == sorted(n for n, _ in model.named_parameters() if n not in frozen)
    for layout in (plan.buckets_first, plan.buckets_rebuilt):  # DDP's layouts: the trainable ones, once each
        assert sorted(n for b in layout for n in b.params) == trainable
    assert len(plan.buckets_first) > 1
    # the optimizer was built over model.parameters(): its groups hold the frozen ones too
    assert sorted(n for g in plan.optimizer.groups for n in g["params"]) == sorted(n for n, _ in model.named_parameters())
    if "--startup-broadcast" in SCENARIOS[name][0]:
        trainable_tensors = [p for n, p in model.named_parameters() if n not in frozen]
        assert plan.collectives["start"][:2] == verify_collectives(trainable_tensors)


@pytest.mark.parametrize("path", ["fast", "reference"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_replay_is_bit_exact_with_frozen_parameters(synthesized, tmp_path, name, path):
    d = synthesized(name)
    plan = load_plan(d / "plan.json")
    init = load_checkpoint(d / "init.pt")
    frozen = [p.name for p in plan.frozen]
    opts = ReplayOptions(out=str(tmp_path / "out"), reference=str(d / "reference"))
    pipe = (fast_replay if path == "fast" else replay)(plan, pcaps(d), load_checkpoint(d / "init.pt"), opts)
    reps = pipe.reports
    assert [r.iteration for r in reps] == list(range(ITERATIONS))
    assert all(r.status == "committed" for r in reps), [(r.iteration, r.status, r.note) for r in reps]
    assert all(r.exact for r in reps)
    for t in range(ITERATIONS):
        mine = load_checkpoint(tmp_path / "out" / checkpoint_name(t))
        ref = load_checkpoint(d / "reference" / checkpoint_name(t))
        assert diff_checkpoints(mine, ref) == [], t  # the whole state, frozen parameters and optimizer too
        assert sorted(mine["model"]) == sorted(init["model"])
        for n in frozen:  # carried unchanged from init.pt, as the trainer kept them
            assert torch.equal(mine["model"][n], init["model"][n]) and torch.equal(ref["model"][n], init["model"][n])
        # optimizer state for a frozen parameter only where torch makes it at construction
        assert bool(set(frozen) & set(mine["optimizer"]["state"])) == (plan.optimizer.kind == "adagrad")
    last = load_checkpoint(tmp_path / "out" / checkpoint_name(ITERATIONS - 1))
    moved = [n for n in last["model"] if n not in frozen and not torch.equal(last["model"][n], init["model"][n])]
    assert moved  # the trainable ones did train
    # the checkpoint is a whole state_dict of the synthetic model: it loads strictly
    net = build_model("tiny", 0)
    net.load_state_dict(last["model"], strict=True)
    assert all(torch.equal(v, last["model"][k]) for k, v in net.state_dict().items())


def test_the_cli_replays_a_frozen_job_on_both_paths(synthesized, tmp_path, capsys):
    """`ckptd replay` (fast by default, --reference-path) against the trainer's checkpoints:
    exit 0 only when every iteration committed and matched (4 when one differs)."""
    d = synthesized("block0-adamw-3ranks")
    for extra in ([], ["--reference-path"]):
        rc = main(["replay", "--plan", str(d / "plan.json"), "--init", str(d / "init.pt"), "--out",
                   str(tmp_path / f"out{len(extra)}"), "--reference", str(d / "reference"), *extra, *pcaps(d)])
        out = capsys.readouterr().out
        assert rc == 0, out
        lines = [x for x in out.splitlines() if x.startswith("iteration ")]
        assert len(lines) == ITERATIONS and all("committed" in x and x.endswith("bit-exact") for x in lines), out
        assert f"{ITERATIONS} iterations, {ITERATIONS} committed, 0 not recovered" in out


def test_without_freeze_the_plan_has_no_frozen_section(tmp_path):
    """No --freeze: every parameter is in the buckets and the plan (its file too) has no
    frozen section, as before --freeze existed."""
    assert main(["synth", "--out", str(tmp_path), "--model", "tiny", "--ranks", "2", "--iterations", "1",
                 "--channels", "1", "--mirrors", "1"]) == 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert "frozen" not in doc and "groups" not in doc["optimizer"]
    plan = load_plan(tmp_path / "plan.json")
    assert sorted(p.name for p in plan.parameters) == sorted(n for n, _ in build_model("tiny", 0).named_parameters())
