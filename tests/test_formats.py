"""Standard formats in and out, and ckptd.restore from files and directories: a trainer's
own torch.save / DCP checkpoints are read with the right iteration, exports load with
plain torch, and a job restored from any of them continues bit for bit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import ckptd
from ckptd.core.checkpoint import (CheckpointError, diff_checkpoints, load_checkpoint,
                                   save_checkpoint)
from ckptd.core.plan import Optimizer, Parameter, Plan
from ckptd.core.schedule import RingConfig
from ckptd.testing.synth import trainer_checkpoint


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def train(model, opt, sched, steps: range):
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()


def fresh():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def plan_of(model) -> Plan:
    from ckptd.core.plan import BucketLayout
    names = tuple(n for n, _ in model.named_parameters())
    layout = (BucketLayout(params=names),)
    return Plan(parameters=tuple(Parameter(n, tuple(p.shape), "float32")
                                 for n, p in model.named_parameters()),
                buckets_first=layout, buckets_rebuilt=layout, ring=RingConfig(2, ((0, 1),)),
                optimizer=Optimizer(kind="adamw", lr=1e-2, weight_decay=0.01,
                                    implementation="foreach"),
                addresses=("10.0.0.1", "10.0.0.2"), transport="gloo")


def trainer_doc(model, opt, sched, steps):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps,
            "lr_scheduler": sched.state_dict()}


def same_training_state(a, b):
    ma, oa, sa = a
    mb, ob, sb = b
    for (n, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(x, y), n
    for p, q in zip(ma.parameters(), mb.parameters()):
        for k in oa.state[p]:
            assert torch.equal(oa.state[p][k], ob.state[q][k]), k
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"]
    assert sa.last_epoch == sb.last_epoch


def _parameters_only(model, m, o):
    """A ckptd checkpoint without module buffers (a job whose buffers are not on the wire)."""
    params = dict(model.named_parameters())
    return {n: t for n, t in m.items() if n in params}, o


def test_trainer_torch_save_is_read_with_steps_done_as_the_iteration(tmp_path):
    model, opt, sched = fresh()
    train(model, opt, sched, range(5))
    torch.save(trainer_doc(model, opt, sched, 5), tmp_path / "trainer.pt")
    doc = load_checkpoint(tmp_path / "trainer.pt")
    assert doc["iteration"] == 4  # 5 steps done: ckptd's iteration 4
    assert set(doc["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}
    assert torch.equal(doc["optimizer"]["state"]["fc2.weight"]["exp_avg"],
                       opt.state[model.fc2.weight]["exp_avg"])
    assert "bn.running_mean" in doc["model"]  # buffers kept from a trainer's file
    # and the same state in ckptd's own format compares identical to it (parameters only)
    m, o = _parameters_only(model, *trainer_checkpoint(model, opt, opt.param_groups[0]["lr"]))
    save_checkpoint(tmp_path / "mine.pt", 4, m, o)
    out = subprocess.run([sys.executable, "-m", "ckptd", "verify", "--parameters-only",
                          str(tmp_path / "mine.pt"), str(tmp_path / "trainer.pt")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "ckptd", "verify",
                          str(tmp_path / "mine.pt"), str(tmp_path / "trainer.pt")],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "model.bn.running_mean: only in second" in out.stdout


def test_step_that_disagrees_with_the_optimizer_is_refused(tmp_path):
    model, opt, sched = fresh()
    train(model, opt, sched, range(3))
    torch.save({**trainer_doc(model, opt, sched, 3), "step": 2}, tmp_path / "off.pt")
    with pytest.raises(CheckpointError, match=r"off\.pt: says 2 steps done but its optimizer state has taken 3"):
        load_checkpoint(tmp_path / "off.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    out = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(tmp_path / "junk.pt"),
                          str(tmp_path / "off.pt")], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "junk.pt" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_restore_from_trainer_files_continues_bit_for_bit(tmp_path, fmt):
    ref = fresh()
    train(*ref, range(6))
    model, opt, sched = fresh()
    train(model, opt, sched, range(3))
    doc = trainer_doc(model, opt, sched, 3)
    if fmt == "torch":
        torch.save(doc, tmp_path / "ckpt.pt")
        src = tmp_path / "ckpt.pt"
    else:
        dcp.save(doc, checkpoint_id=str(tmp_path / "dcp"))
        src = tmp_path / "dcp"
    back = fresh()
    r = ckptd.restore(back[0], back[1], src, scheduler=back[2])
    assert (r.iteration, r.step, r.buffers_not_restored) == (2, 3, [])
    train(*back, range(r.step, 6))
    same_training_state(ref, back)


@pytest.mark.parametrize("fmt", ["torch", "dcp", "safetensors"])
def test_export_loads_with_plain_torch_and_verifies_against_the_source(tmp_path, fmt):
    model, opt, sched = fresh()
    train(model, opt, sched, range(4))
    m, o = _parameters_only(model, *trainer_checkpoint(model, opt, opt.param_groups[0]["lr"]))
    save_checkpoint(tmp_path / "iter_000003.pt", 3, m, o)
    out = tmp_path / {"torch": "x.pt", "dcp": "x.dcp", "safetensors": "x.safetensors"}[fmt]
    plan_of(model).save(tmp_path / "plan.json")
    rc = subprocess.run([sys.executable, "-m", "ckptd", "export", str(tmp_path / "iter_000003.pt"),
                         "--format", fmt, "--out", str(out), "--plan", str(tmp_path / "plan.json")],
                        capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    verify = [sys.executable, "-m", "ckptd", "verify", str(tmp_path / "iter_000003.pt"), str(out)]
    if fmt == "safetensors":  # weights only
        weights = load_checkpoint(out)
        assert weights["iteration"] == 3 and diff_checkpoints(
            {**load_checkpoint(tmp_path / "iter_000003.pt"), "optimizer": None}, weights) == []
        return
    assert subprocess.run(verify, capture_output=True).returncode == 0
    if fmt == "torch":  # plain torch: load_state_dict on a model with buffers, strict=False
        doc = torch.load(out, weights_only=True)
        assert doc["step"] == 4 and doc["iteration"] == 4
        back, bopt, bsched = fresh()
        missing, unexpected = back.load_state_dict(doc["model"], strict=False)
        # (BatchNorm fills a missing num_batches_tracked in itself)
        assert unexpected == [] and set(missing) == {"bn.running_mean", "bn.running_var"}
        bopt.load_state_dict(doc["optimizer"])  # torch's own param_groups: loads as is
        for p, q in zip(model.parameters(), back.parameters()):
            assert torch.equal(opt.state[p]["exp_avg_sq"], bopt.state[q]["exp_avg_sq"])
        r = ckptd.restore(back, bopt, out, scheduler=bsched)
        assert r.buffers_not_restored == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]


@pytest.mark.parametrize("fmt", ["torch", "dcp", "safetensors"])
def test_export_where_it_cannot_write_is_one_line_and_leaves_nothing(tmp_path, fmt):
    """An --out in a missing directory, a file's place taken by a directory (or a DCP
    directory's by a file): exit 2, one line naming --out, no traceback, no temporary left;
    a file written is readable as the umask allows (a trainer loads it, often as another
    user), not owner-only like ckptd's own checkpoints."""
    model, opt, sched = fresh()
    m, o = _parameters_only(model, *trainer_checkpoint(model, opt, opt.param_groups[0]["lr"]))
    src = tmp_path / "iter_000000.pt"
    save_checkpoint(src, 0, m, o)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")  # a DCP --out must be empty
    (tmp_path / "afile").write_text("x")
    blocked = [tmp_path / "missing" / "sub" / "x" if fmt != "dcp" else Path("/proc/ckptd-x"),
               tmp_path / "taken", *([tmp_path / "afile"] if fmt == "dcp" else [])]
    for out in blocked:
        rc = subprocess.run([sys.executable, "-m", "ckptd", "export", str(src), "--format", fmt,
                             "--out", str(out)], capture_output=True, text=True)
        assert rc.returncode == 2 and "Traceback" not in rc.stderr, rc.stderr
        assert rc.stderr.startswith(f"error: {out}:") and rc.stderr.count("\n") == 1, rc.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["afile", "iter_000000.pt", "taken"]
    if fmt != "dcp":
        out = tmp_path / "ok"
        rc = subprocess.run(["sh", "-c", 'umask 022 && exec "$@"', "sh", sys.executable, "-m", "ckptd",
                             "export", str(src), "--format", fmt, "--out", str(out)],
                            capture_output=True, text=True)
        assert rc.returncode == 0, rc.stderr
        assert out.stat().st_mode & 0o777 == 0o644 and src.stat().st_mode & 0o777 == 0o600


def test_restore_from_a_directory_takes_the_newest_whole_checkpoint(tmp_path):
    model, opt, sched = fresh()
    for steps in (1, 2, 3):
        train(model, opt, sched, range(steps - 1, steps))
        m, o = trainer_checkpoint(model, opt, opt.param_groups[0]["lr"])
        save_checkpoint(tmp_path / f"iter_{steps - 1:06d}.pt", steps - 1, m, o)
    good = (tmp_path / "iter_000002.pt").read_bytes()
    (tmp_path / "iter_000003.pt").write_bytes(good[: len(good) // 2])  # torn: never committed
    back = fresh()
    r = ckptd.restore(back[0], back[1], tmp_path)
    assert r.iteration == 2 and r.source.endswith("iter_000002.pt")
    for p, q in zip(model.parameters(), back[0].parameters()):
        assert torch.equal(p, q)


def test_a_trainers_file_reads_a_tied_weights_other_name_as_the_one_parameter(tmp_path):
    """torch.save keeps a tied weight's names as one tensor: read with the parameters
    named, the name that is no parameter goes; two parameters of the plan that share a
    tensor, and a buffer, stay. An export's ckptd.tied drops its names only where their
    values are the parameter's."""
    from ckptd.core.checkpoint import load_checkpoint
    w, mean = torch.randn(3, 2), torch.zeros(2)
    torch.save({"model": {"a.weight": w, "b.weight": w, "head.weight": w, "bn.running_mean": mean}, "step": 1},
               tmp_path / "shared.pt")
    got = load_checkpoint(tmp_path / "shared.pt", ["a.weight", "b.weight"])
    assert sorted(got["model"]) == ["a.weight", "b.weight", "bn.running_mean"]
    for alias, kept in ((w.clone(), False), (w + 1, True)):
        torch.save({"model": {"a.weight": w, "head.weight": alias}, "step": 1,
                    "ckptd": {"tied": {"head.weight": "a.weight"}}}, tmp_path / "export.pt")
        assert ("head.weight" in load_checkpoint(tmp_path / "export.pt")["model"]) == kept


def test_a_trainers_own_dcp_or_copied_state_dict_of_a_tied_model_verifies_against_the_plan(tmp_path):
    """The trainer's own save of a tied model (no ckptd export): DCP loads each name of
    the tied weight apart, and a copy of model.state_dict() ({k: v.clone()}) holds
    them as two tensors, so nothing in the file says head.weight is emb.weight. Read
    with the plan's names (its `tied`), the other name goes where its values are the
    parameter's; `verify --plan` of such a file against ckptd's said "differ:
    model.head.weight: only in second"."""
    import dataclasses

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)
            self.head.weight = self.emb.weight

    model = Tied()
    plan = dataclasses.replace(plan_of(model), tied=(("head.weight", "emb.weight"),))
    sd = model.state_dict()
    assert sorted(sd) == ["emb.weight", "head.bias", "head.weight"]
    torch.save({"model": {k: v.clone() for k, v in sd.items()}, "step": 3}, tmp_path / "copied.pt")
    dcp.save({"model": sd, "step": 3}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    ours = tmp_path / "ours.pt"
    torch.save({"model": {"emb.weight": sd["emb.weight"].clone(), "head.bias": sd["head.bias"].clone()},
                "step": 3}, ours)
    for f in ("copied.pt", "dcp"):
        got = load_checkpoint(tmp_path / f, plan.state_names)
        assert sorted(got["model"]) == ["emb.weight", "head.bias"], f
        assert load_checkpoint(tmp_path / f, [p.name for p in plan.parameters])["model"].keys() == sd.keys(), f
        plan.save(tmp_path / "plan.json")
        r = subprocess.run([sys.executable, "-m", "ckptd", "verify", "--plan", str(tmp_path / "plan.json"),
                            str(ours), str(tmp_path / f)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("identical"), (f, r.stdout, r.stderr[-800:])
    bent = {k: v.clone() for k, v in sd.items()}
    bent["head.weight"] += 1  # not the parameter's values: kept, and verify says so
    torch.save({"model": bent, "step": 3}, tmp_path / "bent.pt")
    assert "head.weight" in load_checkpoint(tmp_path / "bent.pt", plan.state_names)["model"]


def test_a_tied_weight_is_restored_under_both_names_not_reported_as_a_buffer(tmp_path):
    """A plan lists a tied weight once (named_parameters() drops the second name): restore
    loaded it but warned "buffers not restored: head.weight" and listed it in
    buffers_not_restored, although the model's head.weight is that very tensor."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

    saved = {"emb.weight": torch.randn(10, 8)}
    torch.save({"model": saved, "step": 1}, tmp_path / "tied.pt")
    model = Tied()
    r = ckptd.restore(model, None, tmp_path / "tied.pt")
    assert r.buffers_not_restored == []
    assert torch.equal(model.head.weight, saved["emb.weight"]) and model.head.weight is model.emb.weight
