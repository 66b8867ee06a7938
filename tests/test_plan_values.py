"""Bad values in a plan are refused when it is loaded (before anything is written), as
one-line PlanErrors naming the file and the plan key: GradScaler settings, numbers too
large for a float, ring.buffsize below what the schedule can cut, lr scheduler
arguments, lr_per_step too short, inf/nan; and Plan.save writes atomically."""
import errno
import json
import os

import pytest

from ckptd.core.plan import PlanError, PlanWriteError, load_plan, plan_from_json
from ckptd.core.schedule import RingConfig, RingSchedule, Bucket, min_buffsize, NCCL_STEPS

from helpers import synth


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory):
    d = tmp_path_factory.mktemp("values")
    synth(d, ranks=2, channels=1, mirrors=2, iterations=2, bucket_cap_kb=16)
    return json.loads((d / "plan.json").read_text())


def _load(tmp_path, doc=None, text=None):
    p = tmp_path / "plan.json"
    p.write_text(text if text is not None else json.dumps(doc))
    return load_plan(p)


def _refused(tmp_path, message, doc=None, text=None):
    with pytest.raises(PlanError) as e:
        _load(tmp_path, doc, text)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / "plan.json") + ": "), msg
    assert message in msg, msg
    return msg


def _opt(doc, **kw):
    doc = json.loads(json.dumps(doc))
    doc["optimizer"].update(kw)
    return doc


def _names(doc):
    return [p["name"] for p in doc["parameters"]]


# 1. optimizer.grad_scaler values
@pytest.mark.parametrize("scaler, message", [
    ({"init_scale": -1}, "optimizer.grad_scaler.init_scale is -1; it must be a finite number > 0"),
    ({"init_scale": 0}, "optimizer.grad_scaler.init_scale is 0;"),
    ({"init_scale": "big"}, "optimizer.grad_scaler.init_scale is 'big';"),
    ({"init_scale": 1e39}, "optimizer.grad_scaler.init_scale is 1e+39;"),  # inf as torch's float32 scale
    ({"growth_factor": 1.0}, "optimizer.grad_scaler.growth_factor is 1.0; it must be a finite number > 1"),
    ({"backoff_factor": 0}, "optimizer.grad_scaler.backoff_factor is 0; it must be a number in (0, 1)"),
    ({"backoff_factor": 1}, "optimizer.grad_scaler.backoff_factor is 1;"),
    ({"growth_interval": 0}, "optimizer.grad_scaler.growth_interval is 0; it must be an integer >= 1"),
    ({"growth_interval": "x"}, "optimizer.grad_scaler.growth_interval is 'x';"),
    ({"growth_interval": 2.5}, "optimizer.grad_scaler.growth_interval is 2.5;"),
])
def test_grad_scaler_values(plan_doc, tmp_path, scaler, message):
    _refused(tmp_path, message, _opt(plan_doc, grad_scaler=scaler))


def test_grad_scaler_good_and_partial_values_load(plan_doc, tmp_path):
    plan = _load(tmp_path, _opt(plan_doc, grad_scaler={"init_scale": 1024.0, "growth_interval": 3}))
    assert plan.optimizer.grad_scaler == {"init_scale": 1024.0, "growth_interval": 3}
    _load(tmp_path, _opt(plan_doc, grad_scaler={}))  # every key keeps torch's default


# 2. numbers too large
def test_huge_lr_names_the_key(plan_doc, tmp_path):
    text = json.dumps(plan_doc).replace('"lr": 0.003', '"lr": 1' + "0" * 400)
    assert text != json.dumps(plan_doc)
    _refused(tmp_path, "optimizer.lr is 1000", text=text)


def test_integer_past_the_digit_limit_names_the_file(plan_doc, tmp_path):
    text = json.dumps(plan_doc).replace('"shape": [', '"shape": [1' + "0" * 5000 + ", ", 1)
    msg = _refused(tmp_path, "cannot read plan", text=text)
    assert "4300 digits" in msg and len(msg) < 400
    text = json.dumps(plan_doc).replace('"shape": [', '"shape": [1' + "0" * 4000 + ", ", 1)
    msg = _refused(tmp_path, "parameters[0].shape[0] is 1000", text=text)
    assert len(msg) < 300  # the number is not spelled out


def test_huge_integer_in_a_float_setting(plan_doc, tmp_path):
    doc = _opt(plan_doc, lr_schedule={"kind": "cosine", "warmup_steps": 0, "total_steps": 4, "min_factor": 10 ** 400})
    _refused(tmp_path, "optimizer.lr_schedule.min_factor", doc)


# 3. ring.buffsize
def test_buffsize_below_the_smallest_chunk_is_refused(plan_doc, tmp_path):
    doc = json.loads(json.dumps(plan_doc))
    doc["ring"]["buffsize"] = 8
    _refused(tmp_path, "ring.buffsize is 8; with NCCL 2.19 simple it must be at least 64 bytes", doc)
    doc["ring"]["buffsize"] = 64
    _load(tmp_path, doc).schedule(1)  # the smallest works
    doc["ring"].update(buffsize=16383, protocol="ll128", nccl_version="2.22")
    _refused(tmp_path, "ring.buffsize is 16383; with NCCL 2.22 ll128 it must be at least 16384", doc)


@pytest.mark.parametrize("version", [(2, 19), (2, 21), (2, 22)])
@pytest.mark.parametrize("protocol", ["simple", "ll", "ll128"])
def test_min_buffsize_is_the_real_lower_bound(version, protocol):
    import numpy as np
    buckets = [Bucket(n, np.dtype(d)) for d in ("float64", "float16") for n in (1, 1000, 20011)]
    least = min_buffsize(version, protocol)
    RingSchedule(RingConfig(3, ((0, 1, 2),), protocol, version, buffsize=least), buckets, {})
    with pytest.raises((ValueError, ZeroDivisionError)):  # one step less: some chunk is empty
        RingSchedule(RingConfig(3, ((0, 1, 2),), protocol, version, buffsize=least - NCCL_STEPS), buckets, {})


# 4. lr schedulers and lr_per_step, at load time
@pytest.mark.parametrize("sched, message", [
    ({"class": "StepLR", "args": {"step_size": 0}}, "optimizer.lr_scheduler.args.step_size is 0"),
    ({"class": "StepLR", "args": {"step_size": "x"}}, "optimizer.lr_scheduler.args.step_size is 'x'"),
    ({"class": "StepLR", "args": {}}, "optimizer.lr_scheduler.args.step_size is missing"),
    ({"class": "StepLR", "args": {"step_size": 2, "nope": 1}}, "optimizer.lr_scheduler.args.nope"),
    ({"class": "CosineAnnealingLR", "args": {"T_max": "x"}}, "optimizer.lr_scheduler.args.T_max is 'x'"),
    ({"class": "CosineAnnealingLR", "args": {"T_max": 0}}, "optimizer.lr_scheduler.args.T_max is 0"),
    ({"class": "OneCycleLR", "args": {"max_lr": 0.01, "total_steps": 0}},
     "optimizer.lr_scheduler.args.total_steps is 0"),
    ({"class": "StepLR", "args": {"step_size": 2, "last_epoch": 5}}, "optimizer.lr_scheduler.args.last_epoch is 5"),
    ({"class": "NoSuchLR", "args": {}}, "optimizer.lr_scheduler.class 'NoSuchLR' is not a torch.optim.lr_scheduler"),
    ({"class": "LambdaLR", "args": {}}, "optimizer.lr_scheduler.class LambdaLR cannot be replayed"),
])
def test_bad_scheduler_arguments_are_refused_at_load(plan_doc, tmp_path, sched, message):
    _refused(tmp_path, message, _opt(plan_doc, lr_schedule=None, lr_scheduler=sched))


def test_good_scheduler_loads(plan_doc, tmp_path):
    plan = _load(tmp_path, _opt(plan_doc, lr_schedule=None,
                                lr_scheduler={"class": "StepLR", "args": {"step_size": 1, "gamma": 0.5}}))
    assert plan.optimizer.lr_scheduler["class"] == "StepLR"


def test_lr_per_step_shorter_than_the_job_is_refused_at_load(plan_doc, tmp_path):
    _refused(tmp_path, "optimizer.lr_per_step has 1 entries for the plan's 2 iterations",
             _opt(plan_doc, lr_schedule=None, lr_per_step=[0.1]))
    _load(tmp_path, _opt(plan_doc, lr_schedule=None, lr_per_step=[0.1, 0.05]))


# 5. inf / nan
def test_nan_in_group_hyperparameters_is_refused(plan_doc, tmp_path):
    text = json.dumps(_opt(plan_doc, kind="sgd", groups=[{"params": _names(plan_doc), "lr": 0.1,
                                                          "weight_decay": float("nan")}]))
    assert "NaN" in text
    _refused(tmp_path, "optimizer.groups[0].weight_decay is nan; it must be finite", text=text)
    text = json.dumps(_opt(plan_doc, kind="sgd", groups=[{"params": _names(plan_doc), "lr": float("inf")}]))
    _refused(tmp_path, "optimizer.groups[0].lr is inf", text=text)


def test_save_refuses_nan(plan_doc, tmp_path):
    import dataclasses
    plan = plan_from_json(plan_doc)
    # past the constructor's checks (an Optimizer changed in place): save still refuses
    object.__setattr__(plan.optimizer, "lr_schedule", {"kind": "constant", "x": float("nan")})
    with pytest.raises(PlanError, match=r"out\.json: optimizer\.lr_schedule\.x is not finite"):
        plan.save(tmp_path / "out.json")
    assert not (tmp_path / "out.json").exists()
    assert dataclasses.is_dataclass(plan)


def small_model():
    import torch
    return torch.nn.Linear(4, 2)


def small_batch():
    import torch
    return torch.ones(3, 4)


def test_cli_plan_with_nan_weight_decay_is_one_line(tmp_path, capsys):
    from ckptd.cli import main
    out = tmp_path / "p.json"
    try:
        rc = main(["plan", "--model", "test_plan_values:small_model", "--sample", "test_plan_values:small_batch",
                   "--ranks", "2", "--addr", "10.0.0.1", "--addr", "10.0.0.2", "--optimizer", "sgd",
                   "--weight-decay", "nan", "--out", str(out)])
    except SystemExit as e:  # refused by its option's own check (argparse)
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc != 0 and not out.exists()
    assert "argument --weight-decay: nan is not in 0..1e+30" in err and len(err.splitlines()) == 1, err


# 6. atomic save
def test_save_on_a_full_disk_leaves_the_old_plan_and_no_temporary(plan_doc, tmp_path, monkeypatch):
    plan = plan_from_json(plan_doc)
    target = tmp_path / "plan.json"
    target.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(PlanWriteError) as e:
        plan.save(target)
    assert str(target) in str(e.value) and "No space left on device" in str(e.value)
    assert e.value.errno == errno.ENOSPC and "\n" not in str(e.value)
    assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["plan.json"]
    monkeypatch.undo()
    plan.save(target)
    assert json.loads(target.read_text()) == plan.to_json()
    assert sorted(os.listdir(tmp_path)) == ["plan.json"] and (target.stat().st_mode & 0o777) == 0o644


def test_save_into_a_missing_directory_names_the_file(plan_doc, tmp_path):
    with pytest.raises(PlanWriteError, match=r"nodir/plan\.json: cannot write plan: No such file"):
        plan_from_json(plan_doc).save(tmp_path / "nodir" / "plan.json")


# 7. torch's refusals name the plan key
def test_torch_refusal_names_the_group_key(plan_doc, tmp_path):
    doc = _opt(plan_doc, groups=[{"params": _names(plan_doc), "lr": -1.0}])
    _refused(tmp_path, "optimizer.groups[0].lr is -1.0: torch.optim.AdamW refuses it (Invalid learning rate: -1.0)",
             doc)
    doc = _opt(plan_doc, kind="sgd", groups=[{"params": _names(plan_doc), "lr": 0.1, "nesterov": True}])
    _refused(tmp_path, "optimizer.groups[0].nesterov is True: torch.optim.SGD refuses it", doc)


def test_a_plan_without_parameters_whose_buckets_name_some_says_so(plan_doc, tmp_path):
    """It said the optimizer's groups name unknown parameters (the gloo probe)."""
    doc = json.loads(json.dumps(plan_doc))
    first = doc["buckets"]["first"][0]["params"][0]
    del doc["parameters"]
    _refused(tmp_path, f"parameters: missing, and the buckets name {sum(len(b['params']) for b in doc['buckets']['first'])}"
             f" (first: '{first}')", doc)


def test_a_pair_of_three_values_is_refused_naming_the_key(plan_doc, tmp_path):
    """torch's Adam checks betas[0] and betas[1] and unpacks the pair at its first step."""
    doc = _opt(plan_doc, groups=[{"params": _names(plan_doc), "lr": 0.001, "betas": [0.9, 0.99, 0.5]}])
    _refused(tmp_path, "optimizer.groups[0].betas is [0.9, 0.99, 0.5]: torch.optim.AdamW takes two values there", doc)


def test_a_misspelt_hyperparameter_in_a_group_is_refused_a_trainers_own_key_kept(plan_doc, tmp_path):
    """torch keeps any key in a param group (the trainer's own: a name, an lr scale), so
    the plan does too; but `weight_decy` would have the shadow step with AdamW's own
    weight_decay (0.01), not the 0.1 meant, and every checkpoint be wrong."""
    names = _names(plan_doc)
    for key, value, meant, default in (("weight_decy", 0.1, "weight_decay", "0.01"), ("beta", [0.8, 0.9], "betas",
                                                                                       "(0.9, 0.999)"),
                                       ("Lr", 0.5, "lr", "0.001")):
        doc = _opt(plan_doc, groups=[{"params": names, "lr": 0.001, key: value}])
        _refused(tmp_path, f"optimizer.groups[0].{key}: torch.optim.AdamW has no such hyperparameter; {meant} "
                 f"misspelt? The shadow would step with torch.optim.AdamW's {meant} of {default}, not", doc)
    for own in ("name", "lr_scale", "initial_lr", "layer_id", "max_momentum", "base_momentum", "max_lr", "base_lr",
                "min_lr", "my_weight_decay_scale"):
        kept = _load(tmp_path, _opt(plan_doc, groups=[{"params": names, "lr": 0.001, own: 1}]))
        assert kept.optimizer.groups[0][own] == 1


def test_runtime_messages_name_the_key_too():
    from ckptd.core.optim import OptimizerError, full_groups
    from ckptd.core.plan import Optimizer
    with pytest.raises(OptimizerError, match=r"optimizer\.groups\[0\]\.lr is -1\.0"):
        full_groups(Optimizer(kind="adamw", groups=({"params": ["w"], "lr": -1.0},)), ["w"])


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_a_hyperparameter_left_out_is_the_torch_class_default(plan_doc, tmp_path, kind):
    """docs/PLAN.md: a hyperparameter the plan leaves out takes the optimizer class's
    default. AdamW's weight_decay was read as 0.0, not torch's 0.01: a hand-written plan
    without it stepped every iteration wrong, with exit 0."""
    import torch
    doc = json.loads(json.dumps(plan_doc))
    doc["optimizer"] = {"kind": kind, "lr_schedule": {"kind": "constant"}}
    opt = _load(tmp_path, doc).optimizer
    default = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]([torch.zeros(1)]).defaults
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.amsgrad) == \
        (default["lr"], default["betas"], default["eps"], default["weight_decay"], default["amsgrad"])
