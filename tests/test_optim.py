"""The shadow's functional optimizer step is bit-identical to torch.optim's classes:
every optimizer with a functional form, several param groups, lr schedulers replayed
by class, clipping (by any norm, by value), and GradScaler (skipped steps, scale growth and backoff)."""
import dataclasses

import numpy as np
import pytest
import torch

from ckptd.core.checkpoint import CheckpointError
from ckptd.core.optim import GroupSchedule, OptimizerError, full_groups, lr_factor, torch_optimizer
from ckptd.core.plan import BucketLayout, Optimizer, Parameter, Plan
from ckptd.core.schedule import RingConfig
from ckptd.core.shadow import ShadowModel

SHAPES = {"w1": (7, 5), "b1": (7,), "w2": (4, 4, 3), "b2": (1,)}


def _plan(opt: Optimizer) -> Plan:
    names = tuple(SHAPES)
    return Plan(tuple(Parameter(n, s) for n, s in SHAPES.items()), (BucketLayout(params=names),),
                (BucketLayout(params=names),), RingConfig(2, ((0, 1),)), opt,
                ("10.0.0.1", "10.0.0.2"))


def _run(opt: Optimizer, steps=8, inf_at=(), grad_scale=1.0, sched_args=None, prepare=False):
    """Step torch's optimizer (and scheduler, scaler) and the shadow on the same gradients;
    assert both hold the same bits after every step. prepare: the shadow's first step's
    optimizer state is made ahead (ShadowModel.prepare_state, as the daemon does)."""
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    groups = full_groups(opt, list(SHAPES))
    ref_opt = torch_optimizer(opt, ref.items())
    assert len(ref_opt.param_groups) == len(groups)
    sched = None
    if opt.lr_scheduler:
        sched = getattr(torch.optim.lr_scheduler, opt.lr_scheduler["class"])(ref_opt, **opt.lr_scheduler["args"])
    scaler = None
    if opt.grad_scaler:
        scaler = torch.amp.GradScaler("cpu", **opt.grad_scaler)
    shadow = ShadowModel(_plan(opt), {"model": {n: t.clone() for n, t in init.items()}})
    made = {}
    if prepare:
        eager = {n: dict(st) for n, st in shadow.state.items()}
        shadow.prepare_state()
        assert shadow.state == eager  # nothing shows before the step that makes it
        made = {(n, k): t.data_ptr() for n, st in shadow._prepared.items() for k, t in st.items()
                if t.numel() == t.new_empty(SHAPES[n]).numel()}
    skipped = 0
    for step in range(steps):
        grads = {n: torch.randn(s, generator=g) * 1e-2 * grad_scale for n, s in SHAPES.items()}
        if step in inf_at:
            grads["w2"][1, 2, 0] = float("inf")
        for n, p in ref.items():
            p.grad = grads[n].clone()
        if opt.lr_per_step:  # the trainer's `g["lr"] = f(step)`, no scheduler
            x = opt.lr_per_step[step]
            for grp, lr in zip(ref_opt.param_groups, x if isinstance(x, list) else [x] * len(groups)):
                grp["lr"] = lr
        lr = ref_opt.param_groups[0]["lr"]
        if scaler is not None:
            scaler.scale(torch.ones(()))  # creates the scale, as scaler.scale(loss) does
            scaler.unscale_(ref_opt)
        if opt.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(ref.values()), opt.max_grad_norm, norm_type=opt.grad_norm_type)
        elif opt.clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(list(ref.values()), opt.clip_grad_value)
        if scaler is not None:
            scaler.step(ref_opt)
            scaler.update()
        else:
            ref_opt.step()
        if sched is not None:
            sched.step()
        flat = torch.cat([grads[n].reshape(-1) for n in SHAPES]).numpy().copy()
        shadow.apply(step, [flat])
        if step == 0 and not shadow.skipped:  # the first step stepped the state made ahead
            assert {key: shadow.state[key[0]][key[1]].data_ptr() for key in made} == made
            assert not shadow._prepared
        skipped += shadow.skipped
        assert shadow.lr == lr, f"step {step}: lr {shadow.lr} != {lr}"
        for n, p in ref.items():
            assert torch.equal(shadow.params[list(SHAPES).index(n)], p.detach()), f"step {step} {n}"
            want = ref_opt.state.get(p, {})
            have = shadow.state.get(n, {})
            assert sorted(want) == sorted(have), f"step {step} {n}: {sorted(want)} != {sorted(have)}"
            for k in want:
                assert torch.equal(want[k], have[k]), f"step {step} {n}.{k}"
        if scaler is not None:
            assert torch.equal(shadow.scaler["scale"], scaler._scale)
            assert torch.equal(shadow.scaler["growth_tracker"], scaler._growth_tracker)
    assert not shadow._prepared  # used, or let go once its iteration passed
    return shadow, skipped


NO_DECAY = ["b1", "b2"]


def _two_groups(base: dict, **second) -> tuple:
    return ({"params": ["w1", "w2"], **base}, {"params": NO_DECAY, **base, "weight_decay": 0.0, **second})


KINDS = {
    "sgd": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2},
    "adam": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1, "amsgrad": True},
    "adamw": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
    "adagrad": {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 1e-2, "initial_accumulator_value": 0.1},
    "rmsprop": {"lr": 1e-2, "momentum": 0.5, "centered": True, "weight_decay": 1e-2},
    "adamax": {"lr": 2e-2, "weight_decay": 1e-2},
    "nadam": {"lr": 1e-2, "weight_decay": 1e-2, "decoupled_weight_decay": True},
    "radam": {"lr": 1e-2, "weight_decay": 1e-2},
    "asgd": {"lr": 1e-2, "t0": 3, "weight_decay": 1e-2},
    "adadelta": {"lr": 1.0, "weight_decay": 1e-2},
    "rprop": {"lr": 1e-2, "etas": [0.4, 1.3]},
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_torch_optimizer_with_two_groups_and_a_scheduler(kind, foreach):
    opt = Optimizer(kind=kind, groups=_two_groups({**KINDS[kind], "foreach": foreach}, lr=KINDS[kind]["lr"] / 2),
                    lr_scheduler={"class": "StepLR", "args": {"step_size": 3, "gamma": 0.5}})
    _run(opt)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_optimizer_state_made_ahead_steps_as_torchs(kind):
    """The daemon makes the first step's optimizer state before capturing (its zeroing
    otherwise faults in ~2x the model's bytes in the first iteration): it appears only with
    that step, the step uses that memory, and every step still equals torch's, also where
    the state's initial values follow the step's lr (asgd, rprop) under a schedule."""
    opt = Optimizer(kind=kind, groups=_two_groups(KINDS[kind], lr=KINDS[kind]["lr"] / 2),
                    lr_scheduler={"class": "LinearLR", "args": {"start_factor": 0.25, "total_iters": 4}})
    _run(opt, steps=4, prepare=True)
    skipped = Optimizer(kind=kind, groups=_two_groups(KINDS[kind]), grad_scaler={"init_scale": 2.0 ** 10})
    _run(skipped, steps=3, inf_at=(0,), prepare=True)  # the first step skipped: made again later


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw", "adagrad"])
def test_fused_implementations(kind):
    _run(Optimizer(kind=kind, groups=_two_groups({**KINDS[kind], "fused": True})))


@pytest.mark.parametrize("sched", [
    {"class": "CosineAnnealingLR", "args": {"T_max": 5, "eta_min": 1e-4}},
    {"class": "MultiStepLR", "args": {"milestones": [2, 5], "gamma": 0.3}},
    {"class": "LinearLR", "args": {"start_factor": 0.25, "total_iters": 4}},
    {"class": "OneCycleLR", "args": {"max_lr": [0.2, 0.1], "total_steps": 10}},
    {"class": "CyclicLR", "args": {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 2}},
    {"class": "PolynomialLR", "args": {"total_iters": 6, "power": 2.0}},
])
def test_schedulers_replayed_by_class(sched):
    # OneCycleLR and CyclicLR also cycle SGD's momentum: the replay reads every
    # hyperparameter the scheduler moves, not only the lr
    opt = Optimizer(kind="sgd", groups=_two_groups({"lr": 0.05, "momentum": 0.9}), lr_scheduler=sched)
    _run(opt, steps=10)


def test_clipping_and_grad_scaler_skip_and_rescale():
    opt = Optimizer(kind="adamw", groups=_two_groups({"lr": 1e-2, "weight_decay": 0.1}), max_grad_norm=0.5,
                    grad_scaler={"init_scale": 1024.0, "growth_interval": 2})
    shadow, skipped = _run(opt, steps=10, inf_at=(0, 4, 5), grad_scale=1024.0)
    assert skipped == 3
    # three backoffs (x0.5: steps 0, 4, 5) and three growths (after steps 2, 7, 9: two
    # clean steps each, x2) from 1024
    assert float(shadow.scaler["scale"]) == 1024.0 * 0.5 ** 3 * 2 ** 3


@pytest.mark.parametrize("clip", [{"max_grad_norm": 0.01, "grad_norm_type": float("inf")},
                                  {"max_grad_norm": 0.2, "grad_norm_type": 1.0},
                                  {"clip_grad_value": 4e-3}])
def test_clipping_by_other_norms_and_by_value(clip):
    """clip_grad_norm_ with another norm_type, and clip_grad_value_: the shadow clips as
    the trainer's call does, and the bound is tight enough that every step clips (so the
    step without clipping would differ)."""
    hyper = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}  # SGD: Adam's step hides a gradient's scale
    shadow, _ = _run(Optimizer(kind="sgd", groups=_two_groups(hyper), **clip), steps=6)
    plain, _ = _run(Optimizer(kind="sgd", groups=_two_groups(hyper)), steps=6)
    assert not all(torch.equal(a, b) for a, b in zip(shadow.params, plain.params))


def test_clipping_by_value_steps_bucket_by_bucket():
    """clip_grad_value_ is a clamp, elementwise: the buckets step as they come (as
    without clipping), clamped copies, the assembly's buffers left as the wire had them."""
    opt = Optimizer(kind="sgd", groups=_two_groups({"lr": 0.1, "momentum": 0.9}), clip_grad_value=4e-3)
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    ref_opt = torch_optimizer(opt, ref.items())
    shadow = ShadowModel(_plan(opt), {"model": {n: t.clone() for n, t in init.items()}})
    assert shadow.bucketwise
    for step in range(4):
        grads = {n: torch.randn(s, generator=g) * 1e-2 for n, s in SHAPES.items()}
        for n, p in ref.items():
            p.grad = grads[n].clone()
        torch.nn.utils.clip_grad_value_(ref.values(), 4e-3)
        ref_opt.step()
        flat = torch.cat([grads[n].reshape(-1) for n in SHAPES]).numpy().copy()
        wire = flat.copy()
        shadow.apply_buckets(step, [(0, flat)], step)
        shadow.finish_iteration(step)
        assert np.array_equal(flat, wire) and np.abs(flat).max() > 4e-3
        for n, p in ref.items():
            assert torch.equal(shadow.params[list(SHAPES).index(n)], p.detach()), f"step {step} {n}"
    assert not ShadowModel(_plan(dataclasses.replace(opt, clip_grad_value=None, max_grad_norm=1.0)),
                           {"model": init}).bucketwise


def test_clipping_fields_are_checked():
    from ckptd.core.plan import PlanError, check_optimizer
    for kw, why in [({"grad_norm_type": 1.0}, "grad_norm_type is clip_grad_norm_'s norm_type: it needs max_grad_norm"),
                    ({"max_grad_norm": 1.0, "grad_norm_type": -2.0}, 'grad_norm_type must be a number > 0 or "inf"'),
                    ({"clip_grad_value": float("nan")}, "clip_grad_value must be a finite number > 0"),
                    ({"clip_grad_value": 1.0, "max_grad_norm": 1.0}, "clip_grad_value and max_grad_norm are both set")]:
        with pytest.raises(PlanError, match=f"^optimizer.{why}"):
            check_optimizer(Optimizer(kind="adamw", **kw))


def test_lr_set_by_hand_each_step_is_recorded_as_data():
    f = [1e-2 * 0.7 ** i for i in range(6)]
    _run(Optimizer(kind="adamw", groups=_two_groups(KINDS["adamw"]), lr_per_step=tuple(f)), steps=6)
    per_group = tuple([v, v / 10] for v in f)
    shadow, _ = _run(Optimizer(kind="sgd", groups=_two_groups(KINDS["sgd"]), lr_per_step=per_group), steps=6)
    with pytest.raises(OptimizerError, match="lr_per_step has 6 entries: no lr for step 6"):
        shadow.apply(6, [np.zeros(sum(int(np.prod(s)) for s in SHAPES.values()), np.float32)])
    from ckptd.core.plan import PlanError, check_optimizer
    for bad, why in [((0.1, [0.1]), r"lr_per_step\[1\] has 1 lrs for 2"), ((-1.0,), r"lr_per_step\[0\] must be")]:
        with pytest.raises(PlanError, match=why):
            check_optimizer(Optimizer(kind="sgd", groups=_two_groups(KINDS["sgd"]), lr_per_step=bad))


def test_legacy_plan_schedule_is_lambdalr():
    opt = Optimizer(kind="adamw", lr=1e-2, weight_decay=0.1,
                    lr_schedule={"kind": "cosine", "warmup_steps": 2, "total_steps": 6})
    groups = full_groups(opt, list(SHAPES))
    sched = GroupSchedule(opt, groups)
    assert [sched.at(s)[0]["lr"] for s in range(3)] == [0.0, 0.005, 0.01]
    assert groups[0]["decoupled_weight_decay"] and groups[0]["foreach"]


def test_lr_schedules():
    assert lr_factor({"kind": "constant"}, 100) == 1.0
    lin = {"kind": "linear", "warmup_steps": 2, "total_steps": 12}
    assert [lr_factor(lin, s) for s in (0, 1, 2, 7, 12)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    cos = {"kind": "cosine", "warmup_steps": 0, "total_steps": 10, "min_factor": 0.1}
    assert lr_factor(cos, 0) == 1.0 and abs(lr_factor(cos, 10) - 0.1) < 1e-12
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_factor({"kind": "step", "total_steps": 3}, 1)


@pytest.mark.parametrize("sched,why", [
    ({"class": "LambdaLR", "args": {}}, "Python code"),
    ({"class": "ReduceLROnPlateau", "args": {}}, "loss"),
    ({"class": "NoSuchLR", "args": {}}, "not a torch.optim.lr_scheduler"),
    ({"class": "StepLR", "args": {}}, "step_size"),
])
def test_schedulers_that_cannot_be_replayed_are_refused(sched, why):
    opt = Optimizer(kind="sgd", groups=({"params": list(SHAPES), "lr": 0.1},), lr_scheduler=sched)
    shadow = ShadowModel(_plan(opt), {"model": {n: torch.zeros(s) for n, s in SHAPES.items()}})
    with pytest.raises(Exception, match=why) as e:
        shadow.apply(0, [np.zeros(sum(int(np.prod(s)) for s in SHAPES.values()), np.float32)])
    assert e.type.__name__ == "OptimizerError"


def test_bad_hyperparameters_are_one_line_errors():
    opt = Optimizer(kind="sgd", groups=({"params": list(SHAPES), "lr": 0.1, "nesterov": True},))
    with pytest.raises(CheckpointError, match="Nesterov"):
        ShadowModel(_plan(opt), {"model": {n: torch.zeros(s) for n, s in SHAPES.items()}})
