"""Wrapped models and prefixed state dicts (ckptd.core.wrappers): DDP names the model's
tensors `module.…`, torch.compile `_orig_mod.…`, both stacked `module._orig_mod.…`.
ckptd.restore takes the wrapper and loads into the plain model's very tensors; a
trainer's file saved from the wrapper (`torch.save({"model": ddp.state_dict(), ...})`)
reads as the plain names wherever a checkpoint is read (`ckptd replay --init`, restore,
verify); write_plan names a DDP(torch.compile(m)) job as m names its parameters; a file
whose keys mix a wrapper's prefix is refused in one line.

DDP is built on a one-rank gloo group in this process; torch.compile's wrapper is the
real one (building it compiles nothing: no forward runs here)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptd
import ckptd.torch as ct
from ckptd.core.checkpoint import CheckpointError, diff_checkpoints, load_checkpoint, save_checkpoint
from ckptd.core.optim import torch_optimizer
from ckptd.core.plan import load_plan
from ckptd.testing.synth.model import build_model
from helpers import pcaps, synth
from test_bad_input import ckptd_main

REPO = Path(__file__).resolve().parents[1]
DDP = torch.nn.parallel.DistributedDataParallel
WRAPS = {"ddp": DDP, "compile": torch.compile, "both": lambda m: DDP(torch.compile(m))}
PREFIX = {"ddp": "module.", "compile": "_orig_mod.", "both": "module._orig_mod."}


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def _trained(steps: int = 3):
    """A plain model and its Adam after `steps` steps (and BatchNorm's statistics)."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for s in range(steps):
        opt.zero_grad()
        net(torch.randn(5, 4, generator=torch.Generator().manual_seed(s))).pow(2).sum().backward()
        opt.step()
    return net, opt


def _same_state(net, opt, ref_net, ref_opt):
    for (n, a), (_, b) in zip(net.state_dict().items(), ref_net.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a.view(-1), b.view(-1)), n  # bit for bit (no NaN here)
    for p, q in zip(net.parameters(), ref_net.parameters()):
        assert sorted(opt.state[p]) == sorted(ref_opt.state[q])
        for k, v in opt.state[p].items():
            assert torch.equal(v, ref_opt.state[q][k]), k


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_restore_into_a_wrapped_model_loads_the_plain_models_tensors(group, wrap, tmp_path):
    """From ckptd's own checkpoint (plain names) and from a trainer's file saved from the
    wrapper's state_dict (every key prefixed), restore(wrapper, ...) fills the tensors the
    wrapper holds, in place, and the optimizer's state by its own parameter order."""
    ref, ref_opt = _trained()
    mine = tmp_path / "ckptd.pt"
    save_checkpoint(mine, 2, ref.state_dict(),
                    {"lr": 0.01, "state": {n: dict(ref_opt.state[p]) for n, p in ref.named_parameters()}})
    trainer = tmp_path / "trainer.pt"
    wrapped_ref = WRAPS[wrap](ref)
    assert next(iter(wrapped_ref.state_dict())).startswith(PREFIX[wrap])
    torch.save({"model": wrapped_ref.state_dict(), "optimizer": ref_opt.state_dict(), "step": 3}, trainer)
    for src in (mine, trainer):
        net = _net()
        wrapped = WRAPS[wrap](net)
        opt = torch.optim.Adam(wrapped.parameters(), lr=0.01)
        where = [p.data_ptr() for p in net.state_dict().values()]
        r = ckptd.restore(wrapped, opt, src)
        assert (r.step, r.buffers_not_restored) == (3, [])
        assert [p.data_ptr() for p in net.state_dict().values()] == where  # the model's own tensors
        _same_state(net, opt, ref, ref_opt)


def test_a_trainer_file_is_read_with_the_prefix_every_key_carries_taken_off(group, tmp_path):
    ref, ref_opt = _trained()
    plain = {n: t for n, t in ref.state_dict().items()}
    names = [n for n, _ in ref.named_parameters()]
    for wrap in WRAPS:
        torch.save({"model": WRAPS[wrap](ref).state_dict(), "optimizer": ref_opt.state_dict(), "step": 3},
                   tmp_path / f"{wrap}.pt")
        for given in (names, None):  # with the plan's names, and without (ckptd verify, export)
            doc = load_checkpoint(tmp_path / f"{wrap}.pt", given)
            assert list(doc["model"]) == list(plain) and set(doc["optimizer"]["state"]) == set(names)
    # an optimizer built over ddp.named_parameters() names its parameters with the prefix too
    ddp = DDP(_net())
    opt = torch.optim.Adam(ddp.named_parameters(), lr=0.01)
    assert opt.state_dict()["param_groups"][0]["param_names"][0] == "module.0.weight"
    torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "named.pt")
    assert load_checkpoint(tmp_path / "named.pt")["optimizer"] is not None
    # safetensors weights saved from the wrapper
    from safetensors.torch import save_file
    save_file(DDP(ref).state_dict(), str(tmp_path / "w.safetensors"))
    assert set(load_checkpoint(tmp_path / "w.safetensors", names)["model"]) == set(plain)
    # `ckptd verify` (no plan): the DDP trainer's file and ckptd's own of the same state are identical
    save_checkpoint(tmp_path / "mine.pt", 2, plain,
                    {"lr": 0.01, "state": {n: dict(ref_opt.state[p]) for n, p in ref.named_parameters()}})
    r = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(tmp_path / "mine.pt"), str(tmp_path / "ddp.pt")],
                       capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_model_whose_child_is_called_module_keeps_its_names(group, tmp_path):
    """The prefix is a wrapper's only where the model's own names do not carry it: a plain
    model whose one child is named `module` keeps `module.` (restore knows its names);
    its DDP's file loses one level, not both."""
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = _net()

    ref = Holder()
    torch.save({"model": ref.state_dict()}, tmp_path / "plain.pt")
    torch.save({"model": DDP(ref).state_dict()}, tmp_path / "ddp.pt")
    for f in ("plain.pt", "ddp.pt"):
        net = Holder()
        with torch.no_grad():
            for p in net.parameters():
                p.zero_()
        ckptd.restore(DDP(net), None, tmp_path / f)
        assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), ref.state_dict().values())), f


def test_keys_that_mix_a_wrappers_prefix_are_refused_in_one_line(group, tmp_path):
    ref, ref_opt = _trained()
    mixed = {("module." + n if k % 2 else n): t for k, (n, t) in enumerate(ref.state_dict().items())}
    torch.save({"model": mixed, "optimizer": ref_opt.state_dict(), "step": 3}, tmp_path / "mixed.pt")
    with pytest.raises(CheckpointError, match=r"mixed\.pt: model keys mix a wrapper's prefix: 4 of 9 start "
                                              r"with 'module\.' \('module\.0\.bias'\), '0\.weight' does not") as e:
        ddp = DDP(_net())
        ckptd.restore(ddp, torch.optim.Adam(ddp.parameters()), tmp_path / "mixed.pt")
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="mix a wrapper's prefix"):
        load_checkpoint(tmp_path / "mixed.pt")  # without names too: never decided per key
    # the optimizer's names are decided as one set as well
    ddp = DDP(_net())
    opt = torch.optim.Adam(ddp.named_parameters())
    sd = opt.state_dict()
    sd["param_groups"][0]["param_names"][0] = "0.weight"
    torch.save({"model": ddp.state_dict(), "optimizer": sd}, tmp_path / "opt-mixed.pt")
    with pytest.raises(CheckpointError, match=r"opt-mixed\.pt: the optimizer's parameter names mix a wrapper's "
                                              r"prefix: 5 of 6 start with 'module\.'"):
        load_checkpoint(tmp_path / "opt-mixed.pt")


def test_write_plan_names_a_compiled_ddp_job_as_the_plain_model(group, monkeypatch):
    """DDP(torch.compile(m)): DDP's names carry `_orig_mod.` (parameters, buffers), the
    plan and init.pt the plain model's, as DDP(m)'s do."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    plans = {}
    for wrap in ("plain", "compiled"):
        net = _net()
        net[0].requires_grad_(False)  # frozen ones are named apart
        ddp = DDP(torch.compile(net) if wrap == "compiled" else net)
        opt = torch.optim.AdamW(ddp.parameters())
        plans[wrap] = ct.build_plan(ddp, opt, addresses=["127.0.0.1", "127.0.0.2"])
        model, _ = ct.initial_state(ddp, opt)
        assert list(model) == ["1.weight", "1.bias", "2.weight", "2.bias", "0.weight", "0.bias",
                               "1.running_mean", "1.running_var", "1.num_batches_tracked"], wrap
    assert next(n for n, _ in DDP(torch.compile(_net())).named_parameters()).startswith("module._orig_mod.")
    assert plans["compiled"].to_json() == plans["plain"].to_json()


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    """A synthesized 2-rank job with Adagrad (state from construction on, so init.pt holds
    some) in two param groups (the optimizer's order is not the module's)."""
    d = tmp_path_factory.mktemp("wrapped")
    synth(d, iterations=3, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16, opt_kind="adagrad",
          opt_hyper={"lr": 0.05}, no_decay_group=True)
    return d


def _trainer_files(d: Path) -> dict[str, Path]:
    """init.pt as the trainer's torch.save of {"model", "optimizer", "step"}: from the plain
    model and from each wrapper's state_dict (the optimizer's state_dict, Adagrad's state
    from construction, keyed by index in the plan's group order)."""
    plan = load_plan(d / "plan.json")
    init = load_checkpoint(d / "init.pt")
    net = build_model("tiny", 0)
    net.load_state_dict(init["model"], strict=True)
    assert init["optimizer"] is None  # the synthesizer's: Adagrad's trainer made its state when built
    opt = torch_optimizer(plan.optimizer, net.named_parameters())
    assert len(opt.state) == len(plan.state_names)  # which the file keys by index
    out = {}
    for wrap, fn in {"plain": lambda m: m, **WRAPS}.items():
        out[wrap] = d / f"trainer-{wrap}.pt"
        torch.save({"model": fn(net).state_dict(), "optimizer": opt.state_dict(), "step": 0}, out[wrap])
    return out


def test_a_ddp_trainer_file_replays_as_init_bit_exact(group, scenario, capsys):
    """`ckptd replay --init` of the trainer's file saved from ddp.state_dict() (and the
    compiled wrappers') commits the same checkpoints, byte for byte, as the plain file,
    and those equal the trainer's own."""
    files = _trainer_files(scenario)
    outs = {}
    for wrap, init in files.items():
        out = scenario / f"out-{wrap}"
        r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", init, "--out", out,
                       *pcaps(scenario))
        assert r.returncode == 0, r.stderr
        outs[wrap] = out
    for t in range(3):
        name = f"iter_{t:06d}.pt"
        ref = load_checkpoint(scenario / "reference" / name)
        assert diff_checkpoints(load_checkpoint(outs["plain"] / name), ref) == []
        for wrap in WRAPS:
            assert (outs[wrap] / name).read_bytes() == (outs["plain"] / name).read_bytes(), (wrap, t)


def test_a_mixed_prefix_init_is_refused_in_one_line(scenario, capsys):
    doc = torch.load(_trainer_files(scenario)["ddp"], weights_only=True)
    first = next(iter(doc["model"]))
    doc["model"][first.removeprefix("module.")] = doc["model"].pop(first)
    torch.save(doc, scenario / "mixed.pt")
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "mixed.pt",
                   "--out", scenario / "out-mixed", *pcaps(scenario))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {scenario / 'mixed.pt'}: model keys mix a wrapper's prefix: ")
    assert not (scenario / "out-mixed").exists() or not any((scenario / "out-mixed").iterdir())
