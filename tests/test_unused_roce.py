"""find_unused_parameters on the RoCE/NCCL path: `ckptd synth --unused PREFIX` trains the
synthetic job with those parameters left unused by the forward on every rank at
iterations 0 and 3 and on rank 0 only at 1, as DDP with find_unused_parameters=True
sees it: the rank's bucket slots zeros, its local used map 0 there, the map allreduced
after the last bucket on the same ring (on the wire, in the PSNs and QP rotation), a
globally unused parameter's grad None (torch's step, clip_grad_norm_ and the GradScaler
skip it). Replay through the fast path and the reference path must rebuild every
iteration bit for bit. (tests/test_unused.py covers gloo, with real 2-process jobs.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptd.cli import main
from ckptd.core.checkpoint import checkpoint_name, load_checkpoint
from ckptd.core.plan import load_plan
from ckptd.core.shadow import ShadowModel
from ckptd.fast.pipeline import fast_replay
from ckptd.pipeline import ReplayOptions, replay
from ckptd.testing.synth.model import build_model

from helpers import pcaps

ITERATIONS = 4
SCENARIOS = {
    # the second block, AdamW, clipping, Simple on 3 ranks (the unused rank-0-only case:
    # the other ranks' gradients reduced)
    "block1-adamw-clip-3ranks": (["--ranks", "3", "--unused", "blocks.1.", "--max-grad-norm", "0.5"]),
    # the head, SGD with momentum and weight decay, LL on 2 ranks
    "head-sgd-ll": (["--ranks", "2", "--protocol", "ll", "--unused", "head",
                     "--optim", "sgd:lr=0.05,momentum=0.9,weight_decay=0.01"]),
    # the embeddings under AMP (the scaler's inf check over the used ones only), LL128, 4 ranks
    "embeddings-amp-ll128": (["--ranks", "4", "--protocol", "ll128", "--unused", "tok", "--unused", "pos",
                              "--amp", "1024"]),
}


def scenario_runs(tmp_path_factory, scenarios: dict, *extra: str, iterations: int = ITERATIONS):
    """For a module fixture: get(name) synthesizes scenario `name` (its `ckptd synth`
    arguments, then `extra`) once, on the tiny model, and returns its folder."""
    made = {}

    def get(name):
        if name not in made:
            d = tmp_path_factory.mktemp(name)
            assert main(["synth", "--out", str(d), "--model", "tiny", "--iterations", str(iterations),
                         "--channels", "2", "--mirrors", "2", "--bucket-cap-kb", "16", "--seed", "3",
                         *extra, *scenarios[name]]) == 0
            made[name] = d
        return made[name]
    return get


def unused_in(args: list[str]) -> set[str]:
    """The tiny model's parameters the --unused prefixes in `args` name."""
    prefixes = tuple(args[i + 1] for i, a in enumerate(args) if a == "--unused")
    return {n for n, _ in build_model("tiny", 3).named_parameters() if n.startswith(prefixes)}


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    return scenario_runs(tmp_path_factory, SCENARIOS)


def _unused(name):
    return unused_in(SCENARIOS[name])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_plan_and_the_trainer(synthesized, name):
    d = synthesized(name)
    plan = load_plan(d / "plan.json")
    assert plan.find_unused_parameters and plan.buckets_rebuilt == plan.buckets_first
    assert plan.buckets(1)[-1].count == len(plan.parameters) and plan.buckets(1)[-1].dtype == np.dtype("<i4")
    unused = _unused(name)
    refs = [load_checkpoint(d / "reference" / checkpoint_name(t)) for t in range(ITERATIONS)]
    # torch's step skipped them at 0 (no state) and 3 (unchanged), stepped them at 1 (rank 0
    # only unused) and 2
    assert not unused & set(refs[0]["optimizer"]["state"]) and unused <= set(refs[1]["optimizer"]["state"])
    for n in unused:
        assert torch.equal(refs[3]["model"][n], refs[2]["model"][n])
        assert not torch.equal(refs[2]["model"][n], refs[1]["model"][n])


@pytest.mark.parametrize("path", ["fast", "reference"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_replay_is_bit_exact_with_unused_parameters(synthesized, tmp_path, name, path):
    d = synthesized(name)
    plan = load_plan(d / "plan.json")
    opts = ReplayOptions(out=str(tmp_path / "out"), reference=str(d / "reference"))
    pipe = (fast_replay if path == "fast" else replay)(plan, pcaps(d), load_checkpoint(d / "init.pt"), opts)
    reps = pipe.reports
    assert [r.iteration for r in reps] == list(range(ITERATIONS))
    assert all(r.status == "committed" and r.exact for r in reps), [(r.iteration, r.status, r.note) for r in reps]


def test_a_shadow_stepping_every_parameter_is_caught(synthesized, tmp_path, monkeypatch):
    """Every parameter taken as used (the map ignored): iteration 0 differs from the
    trainer's (the unused block stepped), so the exact replay above can fail."""
    d = synthesized("block1-adamw-clip-3ranks")
    plan = load_plan(d / "plan.json")
    monkeypatch.setattr(ShadowModel, "used_of", lambda self, it, bufs: [True] * len(self.names))
    pipe = replay(plan, pcaps(d), load_checkpoint(d / "init.pt"), ReplayOptions(reference=str(d / "reference")))
    assert pipe.reports[0].status == "committed" and pipe.reports[0].exact is False


def test_unused_with_micro_batches_is_refused(tmp_path, capsys):
    assert main(["synth", "--out", str(tmp_path / "x"), "--model", "tiny", "--ranks", "2", "--iterations", "1",
                 "--unused", "head", "--allreduces-per-step", "2"]) == 2
    err = capsys.readouterr().err
    assert "--unused with --allreduces-per-step > 1" in err and "Traceback" not in err
    assert main(["synth", "--out", str(tmp_path / "y"), "--model", "tiny", "--ranks", "2", "--iterations", "1",
                 "--unused", "nothing."]) == 2
    assert "--unused 'nothing.' matches no trainable parameter" in capsys.readouterr().err
