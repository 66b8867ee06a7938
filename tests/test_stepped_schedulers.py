"""lr schedulers the shadow cannot rebuild by class and arguments but whose lr is a
function of the step count (LambdaLR, MultiplicativeLR, SequentialLR, ChainedScheduler,
a scheduler class of the trainer's own): write_plan steps the trainer's own scheduler
through the job's iterations and records the lrs as lr_per_step, leaving the scheduler
and the optimizer as they were. Real 2-rank gloo DDP jobs (tests/_sched_job.py) train
with Hugging-Face-style LambdaLRs and a SequentialLR; the shadow, given the gradients DDP
reduced, must match rank 0 bit for bit every iteration. And a step past the recorded
lrs stops the shadow with a report saying why, on both paths."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

import ckptd.torch as ct
from ckptd.core.checkpoint import diff_checkpoints, load_checkpoint
from ckptd.core.plan import load_plan
from ckptd.core.shadow import ShadowModel
import _sched_job as job
from helpers import job_runs
from test_trainer import _net, group  # noqa: F401 -- group is a fixture

S = torch.optim.lr_scheduler


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return job_runs(tmp_path_factory, "_sched_job.py")


def _bitwise(a, b) -> bool:
    """state_dicts equal bit for bit (floats by their bits, tensors by their bytes)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bitwise(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_bitwise(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()
    return a == b


@pytest.mark.parametrize("kind", ["hf_linear", "sequential", "two_groups"])
def test_the_shadow_matches_rank0_with_a_scheduler_recorded_as_lrs(runs, kind):
    d = runs(kind)
    plan = load_plan(d / "plan.json")
    opt = plan.optimizer
    assert opt.lr_scheduler is None and len(opt.lr_per_step) == job.ITERATIONS == plan.iterations
    around = torch.load(d / "around_write_plan.pt", weights_only=False)
    # write_plan left the trainer's scheduler and optimizer exactly as they were
    assert _bitwise(around["before"], around["after"])
    shadow = ShadowModel(plan, load_checkpoint(d / "init.pt", plan.state_names))
    used = []
    for it in range(job.ITERATIONS):
        ref = torch.load(d / f"iter{it}.pt", weights_only=True)
        used.append(ref["lrs"])
        buffers = [np.concatenate([ref["grads"][n].reshape(-1).numpy() for n in b.params])
                   for b in plan.layout(it)]
        shadow.apply(it, buffers)
        mine = {"iteration": it, "model": shadow.model_state(), "optimizer": shadow.optimizer_state()}
        assert diff_checkpoints(mine, {"iteration": it, "model": ref["model"], "optimizer": ref["optimizer"]}) == [], it
        # every group's lr of the step, as the trainer's scheduler set it
        assert [g["lr"] for g in shadow.hyper.at(it)] == ref["lrs"], it
    recorded = [x if isinstance(x, list) else [x] * len(used[0]) for x in opt.lr_per_step]
    assert recorded == used
    assert len({lrs[0] for lrs in used}) >= job.ITERATIONS - 1  # the schedule really moves
    if kind == "two_groups":
        assert len(opt.groups) == 2 and all(isinstance(x, list) for x in opt.lr_per_step[1:])
        assert used[0][0] == 0.0 and used[1][1] == 0.003 * 0.8  # each group its own lambda
    if kind == "sequential":  # the warmup's last lr, then the cosine from the base lr
        assert opt.lr_per_step[job.WARMUP] == 0.05


def _ddp():
    return torch.nn.parallel.DistributedDataParallel(_net())


def _plan(m, opt, sched, **kw):
    return ct.build_plan(m, opt, scheduler=sched, addresses=["127.0.0.1", "127.0.0.2"], **kw)


def _refused(m, opt, sched, match, **kw):
    with pytest.raises(ct.TrainerError, match=match) as e:
        _plan(m, opt, sched, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def _two_ranks(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)  # noqa: F811


def test_every_step_counted_scheduler_is_recorded_and_left_as_it_was(group, monkeypatch):  # noqa: F811
    """In process (one rank seen as two): each kind of scheduler's lrs are exactly those
    the trainer's own loop then sets, and its state and the optimizer's are bit for bit
    what they were; stepping it warned of nothing."""
    import warnings
    _two_ranks(monkeypatch)
    m = _ddp()

    class Mine(S.StepLR):  # a scheduler class of the trainer's own
        pass

    def build(kind, opt):
        if kind == "multiplicative":
            return S.MultiplicativeLR(opt, lambda s: 0.9)
        if kind == "chained":
            return S.ChainedScheduler([S.ConstantLR(opt, factor=0.5, total_iters=2), S.ExponentialLR(opt, 0.9)])
        if kind == "sequential":
            return S.SequentialLR(opt, [S.LinearLR(opt, 0.1, total_iters=2), S.CosineAnnealingLR(opt, 4)], [2])
        return Mine(opt, step_size=2)
    for kind in ("multiplicative", "chained", "sequential", "mine"):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        sched = build(kind, opt)
        before = copy.deepcopy({"s": sched.state_dict(), "o": opt.state_dict()})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plan = _plan(m, opt, sched, iterations=6)
        assert _bitwise(before, {"s": sched.state_dict(), "o": opt.state_dict()}), kind
        real = []
        for _ in range(6):
            real.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert list(plan.optimizer.lr_per_step) == real and len(set(real)) > 2, kind
        assert plan.optimizer.lr_scheduler is None
        plan.to_json()  # a plan like any other with lr_per_step


def test_what_cannot_be_recorded_is_refused_in_one_line(group, monkeypatch):  # noqa: F811
    _two_ranks(monkeypatch)
    m = _ddp()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    sched = S.LambdaLR(opt, lambda s: 0.9 ** s)
    # the lrs of which steps: iterations says
    assert "pass iterations=<the number of optimizer steps the job takes> to write_plan" in \
        _refused(m, opt, sched, "LambdaLR is recorded as the lr of every step")
    _refused(m, opt, sched, "scheduler_args given for lr scheduler LambdaLR", iterations=4,
             scheduler_args={"lr_lambda": None})
    _refused(m, opt, sched, "lr_per_step and a scheduler both set the lr", iterations=4, lr_per_step=[0.1] * 4)
    # ReduceLROnPlateau steps on the loss: refused, iterations or not, a subclass too
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    _refused(m, opt, S.ReduceLROnPlateau(opt), "ReduceLROnPlateau cannot be replayed: it steps on the training loss",
             iterations=4)

    class MyPlateau(S.ReduceLROnPlateau):
        pass
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    _refused(m, opt, MyPlateau(opt), "MyPlateau cannot be replayed: it steps on the training loss", iterations=4)
    # a scheduler that moves more than the lr (OneCycleLR cycles momentum) nested where
    # only its lrs would be recorded; and one that has stepped already
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    seq = S.SequentialLR(opt, [S.OneCycleLR(opt, 0.1, total_steps=10), S.ConstantLR(opt)], [5])
    before = copy.deepcopy(seq.state_dict())
    _refused(m, opt, seq, "SequentialLR moves group 0's momentum at step 1", iterations=4)
    assert _bitwise(before, seq.state_dict())  # put back all the same
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = S.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    opt.step()
    sched.step()
    _refused(m, opt, sched, "LambdaLR has stepped already", iterations=4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _refused(m, opt, S.LambdaLR(opt, lambda s: 1.0 / (3 - s)), r"LambdaLR fails at step 3 \(ZeroDivisionError",
             iterations=5)


def test_a_step_past_the_recorded_lrs_stops_the_shadow_saying_why(tmp_path):
    """The plan holds the lrs of the steps write_plan was told of; a job that runs on
    commits up to there, and the iteration past it is reported not applied, naming the
    missing lr, on the reference and the fast path (bucket by bucket: AdamW, no clipping)."""
    from helpers import pcaps, synth
    from test_fastpath import run_both
    synth(tmp_path, ranks=2, channels=1, mtu=1024, mirrors=1, iterations=4,
          lr_per_step=(0.01, 0.008, 0.006, 0.004))
    plan = load_plan(tmp_path / "plan.json")
    plan = dataclasses.replace(plan, iterations=None,
                               optimizer=dataclasses.replace(plan.optimizer, lr_per_step=(0.01, 0.008)))
    for pipe in run_both(plan, pcaps(tmp_path), tmp_path / "init.pt", reference=str(tmp_path / "reference")):
        reps = list(pipe.reports)
        assert [(r.iteration, r.status) for r in reps] == [(0, "committed"), (1, "committed"),
                                                           (2, "complete-not-applied"),
                                                           (3, "complete-not-applied")]
        assert all(r.exact for r in reps[:2])
        assert "lr_per_step has 2 entries: no lr for step 2" in reps[2].note
        assert "the shadow stops at iteration 1" in reps[2].note
