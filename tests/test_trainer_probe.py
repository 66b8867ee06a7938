"""ckptd.torch.write_plan / build_plan on what a training script may hand it: each case is
refused at write time in one line naming what is wrong, or (world_of_two) written as a
plan that ckptd loads. Never a raw traceback, never a plan that replays wrongly."""
import warnings

import pytest
import torch
import torch.distributed as dist

import ckptd.torch as ct
from ckptd.core.plan import Optimizer, PlanError, load_plan
from test_trainer import _ddp, _net, _refused, group  # noqa: F401 -- group is a fixture

L = torch.optim.lr_scheduler


@pytest.fixture
def world_of_two(group, monkeypatch):  # noqa: F811
    """The one-rank group seen as two ranks by write_plan (no forward runs), so a plan
    gets past the ring and is written."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return ["127.0.0.1", "127.0.0.2"]


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def test_capturable_is_refused_when_written_and_when_loaded(group):  # noqa: F811
    """capturable=True: torch asserts CUDA tensors on its first step, so the CPU shadow
    crashed with a raw AssertionError at the first replayed iteration."""
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.NAdam):
        m = _ddp()
        _refused(m, cls(m.parameters(), capturable=True), r"groups\[0\]\.capturable is true")
    from ckptd.core.optim import check_replayable
    opt = Optimizer(kind="adam", groups=({"params": ["w"], "lr": 1e-3, "capturable": True},))
    with pytest.raises(PlanError, match="capturable"):
        check_replayable(opt)


def test_scheduler_with_a_python_function_is_refused(group):  # noqa: F811
    """CyclicLR(scale_fn=...): its state matches the replay at step 0, its lrs from step 1
    on do not (the plan was written and replayed other lrs)."""
    m = _ddp()
    opt = _sgd(m)
    sched = L.CyclicLR(opt, 0.01, 0.1, scale_fn=lambda x: 0.5, scale_mode="cycle")
    names = [n for n, _ in m.module.named_parameters()]
    kind, groups = ct._optimizer(opt, {id(p): n for n, p in m.module.named_parameters()}, names)
    rec = Optimizer(kind=kind, groups=tuple(groups), lr_scheduler=ct._scheduler(sched, opt, None))
    with pytest.raises(ct.TrainerError, match="at step 1 the replayed group 0 lr"):
        ct._check_replay(rec, names, opt, sched)
    _refused(m, opt, "at step 1", scheduler=sched)


def test_schedulers_that_replay_are_still_accepted_over_their_steps(world_of_two):
    for mk in (lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=10),
               lambda o: L.CyclicLR(o, 0.01, 0.1, mode="exp_range", gamma=0.9),
               lambda o: L.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2)):
        m = _ddp()
        opt = _sgd(m)
        assert ct.build_plan(m, opt, scheduler=mk(opt), addresses=world_of_two).optimizer.lr_scheduler


def test_scheduler_of_another_optimizer_and_bad_scheduler_args_are_refused(group):  # noqa: F811
    m = _ddp()
    opt, other = _sgd(m), _sgd(m)
    _refused(m, opt, "drives another optimizer", scheduler=L.StepLR(other, 1, 0.1))
    _refused(m, opt, "scheduler_args must be a dict", scheduler=L.StepLR(opt, 2), scheduler_args=[2])


def test_scaler_that_is_not_a_grad_scaler_is_refused(group):  # noqa: F811
    m = _ddp()
    _refused(m, _sgd(m), "scaler must be a torch.amp.GradScaler", scaler=object())


def test_parameter_in_two_groups_is_refused(group):  # noqa: F811
    m = _ddp()
    ps = list(m.parameters())
    opt = torch.optim.SGD(ps, lr=0.1)
    opt.param_groups.append({**opt.param_groups[0], "params": [ps[0]]})
    _refused(m, opt, "parameter 0.weight is in optimizer group 0 and group 1")


def test_complex_parameters_are_refused_by_dtype(group):  # noqa: F811
    class Cx(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    m = torch.nn.parallel.DistributedDataParallel(Cx())
    _refused(m, torch.optim.Adam(m.parameters()), "parameters of dtype complex64")


def test_a_world_of_one_is_said(group):  # noqa: F811
    m = _ddp()
    _refused(m, _sgd(m), "the process group has 1 rank: ckptd needs at least 2 ranks")


def test_bad_iterations_and_addresses_are_refused_not_written(world_of_two):
    m = _ddp()
    for it in (0, -1, "5", True):
        with pytest.raises(ct.TrainerError, match="iterations must be an integer >= 1"):
            ct.build_plan(m, _sgd(m), addresses=world_of_two, iterations=it)
    for addrs, match in (("127.0.0.1", "addresses must be a list"), (["127.0.0.1"], "1 addresses for a world of 2"),
                         (["nohost", "127.0.0.2"], r"addresses\[0\] is 'nohost'")):
        with pytest.raises(ct.TrainerError, match=match):
            ct.build_plan(m, _sgd(m), addresses=addrs)


def test_write_plan_paths(world_of_two, tmp_path):
    m = _ddp()

    def refused(path, match, **kw):
        with pytest.raises(ct.TrainerError, match=match) as e:
            ct.write_plan(m, _sgd(m), path, addresses=world_of_two, **kw)
        assert "\n" not in str(e.value)
    refused(None, "path must be a file path, not None")
    refused("", "path must be a file path")
    (tmp_path / "d").mkdir()
    refused(tmp_path / "d", "is a directory")
    assert not (tmp_path / "init.pt").exists()  # nothing written beside it first
    refused(tmp_path / "p.json", "is a directory", init=tmp_path / "d")
    (tmp_path / "f").write_text("x")
    refused(tmp_path / "f" / "plan.json", "f is not a directory")
    refused(tmp_path / "s.json", "init and path are the same file", init=tmp_path / "s.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct.write_plan(m, _sgd(m), tmp_path / "ok" / "plan.json", addresses=world_of_two, iterations=3)
    assert load_plan(tmp_path / "ok" / "plan.json").iterations == 3 and (tmp_path / "ok" / "init.pt").exists()
