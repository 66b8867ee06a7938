"""Frozen parameters (requires_grad=False, as in fine-tuning): DDP's reducer leaves them
out (no bucket, no index, no gradient on the wire), so the plan records them apart
(`frozen`) and the shadow carries their init.pt values into every checkpoint unchanged.
Real 2-rank gloo DDP jobs (tests/_frozen_job.py) train with a frozen layer; the shadow,
given the gradients DDP reduced, must match rank 0 bit for bit (parameters, frozen ones
too, and optimizer state: none for a frozen parameter but Adagrad's, made at
construction), and a checkpoint must load into the trainer's model strictly, through
ckptd.restore and as an exported torch file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptd
import ckptd.torch as ct
from ckptd.core.checkpoint import CheckpointError, diff_checkpoints, load_checkpoint, save_checkpoint
from ckptd.core.formats import export_checkpoint
from ckptd.core.plan import PlanError, load_plan
from ckptd.core.shadow import ShadowModel
import _frozen_job as job
from helpers import job_runs
from test_trainer import _net, group  # noqa: F401 -- group is a fixture



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return job_runs(tmp_path_factory, "_frozen_job.py")


def _replay(d: Path):
    """The shadow stepped with each iteration's reduced gradients (DDP's param.grad on rank
    0, laid out in the plan's buckets as the wire carries them); per iteration its state
    against rank 0's."""
    plan = load_plan(d / "plan.json")
    shadow = ShadowModel(plan, load_checkpoint(d / "init.pt", plan.state_names))
    for it in range(job.ITERATIONS):
        ref = torch.load(d / f"iter{it}.pt", weights_only=True)
        assert set(ref["grads"]) == {p.name for p in plan.parameters}  # DDP reduces the trainable ones only
        buffers = [np.concatenate([ref["grads"][n].reshape(-1).numpy() for n in b.params])
                   for b in plan.layout(it)]
        shadow.apply(it, buffers)
        mine = {"iteration": it, "model": shadow.model_state(), "optimizer": shadow.optimizer_state()}
        assert diff_checkpoints(mine, {"iteration": it, **ref}) == [], it
    return plan, shadow


@pytest.mark.parametrize("kind", ["adamw", "sgd", "frozen_group", "adagrad", "adam_trainable"])
def test_a_frozen_layer_replays_bit_for_bit_and_restores(runs, kind, tmp_path):
    d = runs(kind)
    plan, shadow = _replay(d)
    frozen = {"2.weight", "2.bias"}
    assert {p.name for p in plan.frozen} == frozen and not frozen & {p.name for p in plan.parameters}
    assert len(plan.buckets_rebuilt) > 1  # the layout DDP rebuilt, of the trainable parameters only
    init = load_checkpoint(d / "init.pt")
    for n in frozen:  # carried unchanged, and never given optimizer state the trainer lacks
        assert torch.equal(shadow.model_state()[n], init["model"][n])
        assert (n in shadow.optimizer_state()["state"]) == (kind == "adagrad")
    final = torch.load(d / "final.pt", weights_only=True)
    ckpt = tmp_path / "ckpt.pt"
    save_checkpoint(ckpt, job.ITERATIONS - 1, shadow.model_state(), shadow.optimizer_state())
    # the checkpoint is a whole state_dict of the trainer's model
    net = job.build()
    net.load_state_dict(load_checkpoint(ckpt)["model"], strict=True)
    assert all(torch.equal(v, final["model"][k]) for k, v in net.state_dict().items())
    # ckptd.restore puts model and optimizer back as the trainer had them
    net = job.build()
    opt = job.optimizer(net, kind)
    r = ckptd.restore(net, opt, str(ckpt))
    assert r.step == job.ITERATIONS and not r.buffers_not_restored
    _same_optimizer(opt.state_dict(), final["optimizer"])
    assert all(torch.equal(v, final["model"][k]) for k, v in net.state_dict().items())
    # and an exported torch file loads into a plain optimizer (its indices in the trainer's order)
    out = export_checkpoint(load_checkpoint(ckpt), tmp_path / "export.pt", "torch", plan)
    doc = torch.load(out, weights_only=True)
    net = job.build()
    net.load_state_dict(doc["model"], strict=True)
    opt = job.optimizer(net, kind)
    opt.load_state_dict(doc["optimizer"])
    _same_optimizer(opt.state_dict(), final["optimizer"])


def _same_optimizer(a: dict, b: dict):
    """optimizer.state_dict()s with the same state bit for bit, by torch's index (the lr is
    the checkpoint's, the last step's: restoring the scheduler is tested elsewhere)."""
    assert sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        assert sorted(a["state"][i]) == sorted(b["state"][i]), i
        for k, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][k]), (i, k)
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]


def test_the_plan_records_frozen_parameters_apart(group, monkeypatch):  # noqa: F811
    """One rank seen as two (nothing runs): DDP's parameters and layout are the reducer's,
    the frozen ones a section of their own, and the optimizer's groups name them as torch
    holds them; a plan without the section (older files) has none."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    net = _net()
    net[0].requires_grad_(False)
    m = torch.nn.parallel.DistributedDataParallel(net)
    plan = ct.build_plan(m, torch.optim.AdamW(m.parameters()), addresses=["127.0.0.1", "127.0.0.2"])
    assert [p.name for p in plan.parameters] == ["1.weight", "1.bias", "2.weight", "2.bias"]
    assert [(p.name, p.shape) for p in plan.frozen] == [("0.weight", (8, 4)), ("0.bias", (8,))]
    assert sorted(n for b in plan.buckets_first for n in b.params) == sorted(p.name for p in plan.parameters)
    assert plan.optimizer.groups[0]["params"][:2] == ["0.weight", "0.bias"]
    assert plan.state_names == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    doc = plan.to_json()
    assert doc["frozen"] == [{"name": "0.weight", "shape": [8, 4], "dtype": "float32"},
                             {"name": "0.bias", "shape": [8], "dtype": "float32"}]
    from ckptd.core.plan import plan_from_json
    assert plan_from_json(json.loads(json.dumps(doc))).frozen == plan.frozen
    del doc["frozen"]  # an older plan: no frozen parameters, so its groups may not name them
    with pytest.raises(PlanError, match=r"names unknown parameters \['0.weight', '0.bias'\]"):
        plan_from_json(doc)
    doc["optimizer"]["groups"][0]["params"] = doc["optimizer"]["groups"][0]["params"][2:]
    assert plan_from_json(doc).frozen == ()
    # on NCCL the start-up collectives: DDP's shape check over the reducer's parameters
    # (2·dim int64 each: 10), its _sync_module_states broadcast over every one (74 floats)
    from ckptd.core.schedule import RingConfig
    assert ct._ddp_collectives(m, RingConfig(2, ((0, 1),), nccl_version=(2, 19)), ["a", "b"]) == \
        {"start": ((1, "int64", "allgather"), (10, "int64", "broadcast", 0), (74, "float32", "broadcast", 0))}
    # the trainable-only optimizer of fine-tuning scripts
    plan = ct.build_plan(m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]),
                         addresses=["127.0.0.1", "127.0.0.2"])
    assert plan.optimizer.groups[0]["params"] == ["1.weight", "1.bias", "2.weight", "2.bias"]
    assert plan.state_names[-2:] == ["0.weight", "0.bias"]


def test_what_does_not_fit_is_refused_in_one_line(group, monkeypatch, tmp_path):  # noqa: F811
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    addrs = ["127.0.0.1", "127.0.0.2"]
    # requires_grad changed after DDP took its parameters: the plan would not be DDP's
    net = _net()
    m = torch.nn.parallel.DistributedDataParallel(net)
    net[2].requires_grad_(False)
    with pytest.raises(ct.TrainerError, match=r"^parameter 2.bias changed requires_grad after DDP was built "
                                              r"\(DDP reduces it\)") as e:
        ct.build_plan(m, torch.optim.AdamW(m.parameters()), addresses=addrs)
    assert "\n" not in str(e.value)
    net = _net()
    net[0].requires_grad_(False)
    m = torch.nn.parallel.DistributedDataParallel(net)
    net[0].requires_grad_(True)
    with pytest.raises(ct.TrainerError, match=r"parameter 0.bias changed requires_grad .*does not reduce it"):
        ct.build_plan(m, torch.optim.AdamW(m.parameters()), addresses=addrs)
    net = _net()
    net[0].requires_grad_(False)
    m = torch.nn.parallel.DistributedDataParallel(net)
    plan = ct.build_plan(m, torch.optim.AdamW(m.parameters()), addresses=addrs)
    import dataclasses
    from ckptd.core.plan import Parameter
    with pytest.raises(PlanError, match=r"frozen\[1\].name '1.weight' is not unique"):
        dataclasses.replace(plan, frozen=(plan.frozen[0], Parameter("1.weight", (8,))))
    with pytest.raises(PlanError, match=r"frozen\[0\] \(0.weight\) has dtype 'complex64'"):
        dataclasses.replace(plan, frozen=(Parameter("0.weight", (8, 4), "complex64"), plan.frozen[1]))
    # a starting state without the frozen values, or with other ones, is refused naming them
    model, opt = ct.initial_state(m, torch.optim.AdamW(m.parameters()))
    del model["0.bias"]
    with pytest.raises(CheckpointError, match=r"init: model.0.bias is missing"):
        plan.check_start({"iteration": -1, "model": model, "optimizer": opt}, "init")
    model["0.bias"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"model.0.bias is float32\[3\]; the plan says float32\[8\]"):
        plan.check_start({"iteration": -1, "model": model, "optimizer": opt}, "init")
    with pytest.raises(CheckpointError, match="frozen 0.bias is torch.float32"):
        ShadowModel(plan, {"iteration": -1, "model": model, "optimizer": opt})


def test_a_captured_gloo_job_with_a_frozen_layer_replays_bit_exact(tmp_path):
    """End to end: scripts/ddp_gloo_train.py --freeze (3 ranks, fc2 frozen but in the
    optimizer, two groups, clipping, a scheduler) captured on lo with tcpdump and replayed:
    every iteration committed and equal to rank 0 bit for bit, fc2 included."""
    from test_ddp_jobs import ITERATIONS, _replay_exact, _why_not, run_captured_job
    why = _why_not()
    if why:
        pytest.skip(f"real DDP jobs skipped: {why}")
    run, pcap = run_captured_job(tmp_path / "frozen", ["--optimizer", "AdamW", "--lr", "0.003", "--freeze",
                                                       "--no-decay-group", "--clip", "0.5",
                                                       "--scheduler", "StepLR:step_size=3,gamma=0.5"])
    plan, pipe = _replay_exact(run, pcap)  # the shadow's whole model against rank 0's, every iteration
    assert [p.name for p in plan.frozen] == ["fc2.weight", "fc2.bias"]
    assert {"fc2.weight", "fc2.bias"} <= {n for g in plan.optimizer.groups for n in g["params"]}  # as torch holds them
    init = load_checkpoint(run / "init.pt")
    mine = pipe.shadow.model_state()
    assert pipe.shadow.iteration == ITERATIONS - 1
    assert all(torch.equal(mine[n], init["model"][n]) for n in ("fc2.weight", "fc2.bias"))
    assert not {"fc2.weight", "fc2.bias"} & set(pipe.shadow.optimizer_state()["state"])


def test_ckptd_plan_offline_records_a_models_frozen_parameters(tmp_path, monkeypatch, capsys):
    """`ckptd plan --model` (DDP's layouts from a one-rank DDP in process): the frozen
    parameters are in no bucket and in the plan's `frozen`, not its parameters."""
    from ckptd.cli import main
    (tmp_path / "frozenmodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))\n"
        "    net[0].requires_grad_(False)\n"
        "    return net\n")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "frozenmodel:build", "--ranks", "2", "--addr", "127.0.0.1", "--addr",
                 "127.0.0.1", "--transport", "gloo", "--optimizer", "sgd", "--lr", "0.1", "--out", "plan.json"]) == 0, \
        capsys.readouterr().err
    plan = load_plan(tmp_path / "plan.json")
    assert [p.name for p in plan.frozen] == ["0.weight", "0.bias"]
    assert [p.name for p in plan.parameters] == ["1.weight", "1.bias", "2.weight", "2.bias"]
    assert [b.params for b in plan.buckets_first] == [("1.weight", "1.bias", "2.weight", "2.bias")]
