"""A trainer resumed from a ckptd checkpoint takes its next step with the hyperparameters
the uninterrupted job would have used: every group's lr (chainable schedulers multiply
the lr they find, LambdaLR takes a lambda per group) and OneCycleLR's momentum.

ckptd's checkpoint records the lr its step USED; the trainer's optimizer holds the next
step's once its scheduler has stepped. restore(scheduler=fresh) replays the fresh
scheduler to the checkpoint's step, and `export --plan` writes the plan's scheduler as
the trainer holds it. Before, both set the step's own lr with the scheduler one step on:
StepLR's lrs stayed 2x too high for good, OneCycleLR's first momentum was off."""
import subprocess
import sys

import pytest
import torch

import ckptd
from ckptd.core.checkpoint import CheckpointError
from ckptd.core.optim import torch_optimizer, torch_scheduler
from ckptd.core.plan import load_plan
from ckptd.testing.synth.model import build_model
from helpers import run_replay, synth

SCHEDULERS = {
    "steplr": {"class": "StepLR", "args": {"step_size": 1, "gamma": 0.5}},
    "onecycle": {"class": "OneCycleLR", "args": {"max_lr": 0.02, "total_steps": 8}},
}


@pytest.fixture(scope="module", params=sorted(SCHEDULERS))
def job(request, tmp_path_factory):
    """(scenario directory, plan): 2 param groups, 4 iterations, replayed into out/."""
    d = tmp_path_factory.mktemp(request.param)
    synth(d, ranks=2, channels=1, mirrors=1, iterations=4, opt_kind="adamw", opt_hyper={"lr": 0.01},
          no_decay_group=True, lr_scheduler=SCHEDULERS[request.param], noise=False)
    reports = run_replay(d).reports
    assert [(r.status, r.exact) for r in reports] == [("committed", True)] * 4
    return d, load_plan(d / "plan.json")


def _trainer(plan):
    model = build_model("tiny", 0)
    opt = torch_optimizer(plan.optimizer, model.named_parameters())
    return model, opt, torch_scheduler(plan.optimizer, opt)


def _uninterrupted(plan, steps: int):
    """The optimizer and scheduler as the job holds them after `steps` steps."""
    _, opt, sched = _trainer(plan)
    for _ in range(steps):  # no grads: the parameters stay, the schedule moves as in the job
        opt.step()
        sched.step()
    return opt, sched


def _hyper(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize("it", [0, 2])
def test_restore_steps_a_fresh_scheduler_to_the_checkpoint(job, it):
    d, plan = job
    model, opt, sched = _trainer(plan)
    r = ckptd.restore(model, opt, d / "out" / f"iter_{it:06d}.pt", scheduler=sched)
    assert r.step == it + 1
    want_opt, want_sched = _uninterrupted(plan, it + 1)
    assert _hyper(opt) == _hyper(want_opt)
    assert sched.state_dict() == want_sched.state_dict()
    opt.step(), sched.step(), want_opt.step(), want_sched.step()  # and on from there
    assert _hyper(opt) == _hyper(want_opt)


def test_export_with_the_plan_loads_as_the_trainer_holds_it(job, tmp_path):
    d, plan = job
    out = tmp_path / "x.pt"
    rc = subprocess.run([sys.executable, "-m", "ckptd", "export", str(d / "out" / "iter_000002.pt"), "--format",
                         "torch", "--out", str(out), "--plan", str(d / "plan.json")], capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    doc = torch.load(out, weights_only=True)
    _, opt, sched = _trainer(plan)
    opt.load_state_dict(doc["optimizer"])
    sched.load_state_dict(doc["lr_scheduler"])
    want_opt, want_sched = _uninterrupted(plan, 3)
    assert _hyper(opt) == _hyper(want_opt)
    assert sched.state_dict() == want_sched.state_dict()
    model, opt2, sched2 = _trainer(plan)  # restore() reads the export's scheduler state as it is
    ckptd.restore(model, opt2, out, scheduler=sched2)
    assert _hyper(opt2) == _hyper(want_opt) and sched2.state_dict() == want_sched.state_dict()
    model, opt3, sched3 = _trainer(plan)  # one that has stepped takes the saved state, every group's lr
    opt3.step(), sched3.step()
    ckptd.restore(model, opt3, out, scheduler=sched3)
    assert [g["lr"] for g in opt3.param_groups] == [g["lr"] for g in want_opt.param_groups]
    assert sched3.state_dict() == want_sched.state_dict()
    # the export is the same checkpoint: its step's lr read back, not the next one
    rc = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(d / "out" / "iter_000002.pt"), str(out)],
                        capture_output=True, text=True)
    assert rc.returncode == 0, rc.stdout + rc.stderr


def test_a_scheduler_that_is_not_the_jobs_or_has_stepped_is_refused_unchanged(job):
    d, plan = job
    model, opt, _ = _trainer(plan)
    other = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    before = (_hyper(opt), other.state_dict(), [p.clone() for p in model.parameters()])
    with pytest.raises(CheckpointError, match=r"iter_000002\.pt: its step 2 used lr .* but the ExponentialLR "
                                              r"given, stepped once per optimizer step, gives"):
        ckptd.restore(model, opt, d / "out" / "iter_000002.pt", scheduler=other)
    assert _hyper(opt) == before[0] and other.state_dict() == before[1]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before[2]))
    model, opt, sched = _trainer(plan)
    opt.step(), sched.step()
    with pytest.raises(CheckpointError, match=r"has stepped 1 times: give a freshly built one"):
        ckptd.restore(model, opt, d / "out" / "iter_000002.pt", scheduler=sched)
