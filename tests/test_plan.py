import json

import pytest

from ckptd.core.plan import PlanError, load_plan, plan_from_json

from helpers import synth


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    synth(d, ranks=3, channels=2, iterations=1)
    return json.loads((d / "plan.json").read_text())


def test_round_trip(plan_doc, tmp_path):
    plan = plan_from_json(plan_doc)
    plan.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == plan_doc
    assert plan.nranks == 3 and plan.ring.channels == 2
    assert sum(plan.bucket_count(b) for b in plan.buckets_first) == sum(p.numel for p in plan.parameters)
    assert plan.layout(0) != plan.layout(1)  # DDP rebuilt its buckets after iteration 0


def _broken(doc, change):
    doc = json.loads(json.dumps(doc))
    change(doc)
    return doc


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="other"), "not a ckptd plan"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["buckets"]["first"][0]["params"].append("nope"), "unknown parameter 'nope'"),
    (lambda d: d["buckets"]["first"].pop(), "exactly once"),
    (lambda d: d["ring"].update(protocol="ll64"), "ll64"),
    (lambda d: d["ring"].update(nccl_version="2.33"), "2.33 is not supported"),
    (lambda d: d["ranks"].pop(), "ranks 0..2"),
    (lambda d: d["ranks"][0].update(addr="not-an-ip"), "not-an-ip"),
    (lambda d: d["optimizer"].update(kind="sgd"), "optimizer.kind"),
    (lambda d: d["parameters"][0].update(dtype="complex64"), "complex64"),
    (lambda d: d.update(tied={d["parameters"][1]["name"]: d["parameters"][0]["name"]}),
     "must be a new non-empty name"),
    (lambda d: d.update(tied={"head.alias": "nope"}), "tied.head.alias is 'nope', not a parameter"),
    (lambda d: d.update(tied=[["head.alias", "tok.weight"]]), "tied must map"),
])
def test_bad_plans_name_the_field(plan_doc, change, message):
    with pytest.raises(PlanError, match=message):
        plan_from_json(_broken(plan_doc, change), "p.json")


def test_unreadable_file(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(PlanError, match="x.json"):
        load_plan(tmp_path / "x.json")


def _with_buffers(doc, captured=False, transport=None):
    doc = json.loads(json.dumps(doc))
    doc["buffers"] = {"tensors": [{"name": "bn.running_mean", "shape": [8], "dtype": "float32"},
                                  {"name": "bn.num_batches_tracked", "shape": [], "dtype": "int64"}],
                      "broadcasts": [["bn.running_mean"], ["bn.num_batches_tracked"]], "captured": captured}
    if transport:
        doc["transport"] = transport
    return doc


def test_module_buffers_round_trip_and_are_checked(plan_doc, tmp_path):
    doc = _with_buffers(plan_doc)
    plan = plan_from_json(doc)
    plan.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == doc
    assert plan.buffer_broadcast_bytes() == [32, 8] and not plan.buffers.captured
    # NCCL: captured only where the plan lists DDP's per-forward buffer broadcasts
    with pytest.raises(PlanError, match="buffers.captured on NCCL needs DDP's buffer broadcasts"):
        plan_from_json(_with_buffers(plan_doc, captured=True))
    doc = _with_buffers(plan_doc, captured=True)
    doc["ring"]["nccl_version"] = "2.22"
    doc["collectives"] = {"before": [{"op": "allreduce", "count": 1, "dtype": "float32"},
                                     {"op": "broadcast", "count": 8, "dtype": "float32", "root": 0},
                                     {"op": "broadcast", "count": 1, "dtype": "int64", "root": 0}],
                          "start": [{"op": "broadcast", "count": 3, "dtype": "float32", "root": 0}]}
    plan = plan_from_json(doc)
    assert plan.buffer_broadcast_at() == 1
    assert plan.buffer_others(0) == {2: 0, 3: 1} and plan.buffer_others(1) == {1: 0, 2: 1}
    doc["collectives"]["before"][2]["root"] = 1
    with pytest.raises(PlanError, match="buffers.captured on NCCL needs"):
        plan_from_json(doc)
    bad = _with_buffers(plan_doc)
    bad["buffers"]["broadcasts"] = [["bn.running_mean", "bn.num_batches_tracked"]]
    with pytest.raises(PlanError, match=r"broadcasts\[0\] must be a non-empty list of buffers of one dtype"):
        plan_from_json(bad)
    bad["buffers"]["broadcasts"] = [["bn.running_mean"]]
    with pytest.raises(PlanError, match="every buffer of buffers.tensors exactly once"):
        plan_from_json(bad)


def test_allreduces_per_step_round_trips_on_both_transports(plan_doc):
    doc = json.loads(json.dumps(plan_doc))
    doc["allreduces_per_step"] = 3
    nccl = plan_from_json(doc)  # NCCL decodes it too (issue 15)
    assert nccl.transport == "roce" and plan_from_json(nccl.to_json()).allreduces_per_step == 3
    # wire rounds: round 0 alone has DDP's first layout; round w is step w // 3's
    # last micro-batch when w % 3 == 2; buffers broadcast in round w follow round w - 1
    assert nccl.wire_layout(0) == nccl.buckets_first and nccl.wire_layout(1) == nccl.buckets_rebuilt
    assert [nccl.step_of_round(w) for w in range(7)] == [None, None, 0, None, None, 1, None]
    assert [nccl.buffers_step_of_round(w) for w in range(7)] == [None, None, None, 0, None, None, 1]
    doc["allreduces_per_step"] = 0
    with pytest.raises(PlanError, match="allreduces_per_step"):
        plan_from_json(doc)
    plan = plan_from_json(plan_doc)
    import dataclasses
    gloo = dataclasses.replace(plan, transport="gloo", allreduces_per_step=3)
    assert plan_from_json(gloo.to_json()).allreduces_per_step == 3
    # a step's gradients come from its last micro-batch: DDP's first layout is only in
    # the job's first round, which is no step's last when K > 1
    assert gloo.last_wire_iteration(0) == 2 and gloo.layout(0) == gloo.buckets_rebuilt
    assert plan.layout(0) == plan.buckets_first


def test_every_key_to_json_writes_is_read_back_equal(plan_doc):
    """Plans that together set every optional field (no one plan can: static_graph is gloo's
    and excludes find_unused_parameters and allreduces_per_step > 1; lr_per_step excludes
    lr_scheduler): each is read, written, and read again unchanged, and between them they
    write every key the plan format declares, so none is written and then refused."""
    from ckptd.core.plan import OPTIMIZER_KEYS, PLAN_FIELDS, PLAN_KEYS
    names = [p["name"] for p in plan_doc["parameters"]]
    nccl = json.loads(json.dumps(plan_doc))
    nccl["buckets"]["rebuilt"] = nccl["buckets"]["first"]  # find_unused_parameters: DDP never rebuilds
    hyper = {k: nccl["optimizer"][k] for k in ("betas", "eps", "weight_decay", "amsgrad")}
    nccl["optimizer"].update(
        groups=[{"params": names[:3], "lr": 0.01, **hyper}, {"params": names[3:], "lr": 0.003, **hyper}],
        lr_per_step=[0.01, [0.02, 0.03]], max_grad_norm=1.0, grad_norm_type="inf",
        grad_scaler={"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100})
    nccl.update(start_iteration=0, comm_hook="fp16_compress", find_unused_parameters=True,
                collectives={"before": [{"op": "allreduce", "count": 1, "dtype": "float32"}]},
                frozen=[{"name": "head.frozen", "shape": [4], "dtype": "float32"}],
                tied={"head.tied": names[0], "head.frozen_too": "head.frozen"})
    nccl = _with_buffers(nccl)
    gloo = json.loads(json.dumps(plan_doc))
    gloo.update(transport="gloo", static_graph=True, static_used_map=[1] * (len(names) - 1) + [0])
    gloo["optimizer"].update(max_grad_norm=None, clip_grad_value=0.25)
    micro = json.loads(json.dumps(plan_doc))
    micro["allreduces_per_step"] = 2
    micro["optimizer"]["lr_scheduler"] = {"class": "StepLR", "args": {"step_size": 2}}
    written = []
    for doc in (nccl, gloo, micro):
        out = plan_from_json(doc).to_json()
        assert out == doc
        assert plan_from_json(json.loads(json.dumps(out))).to_json() == out
        written.append(set(out))
    assert set().union(*written) == set(PLAN_FIELDS)
    assert set(PLAN_KEYS) == set(PLAN_FIELDS) | {"written_by"}  # the reader's, and write_plan's note
    assert set(nccl["optimizer"]) >= {"groups", "lr_per_step", "max_grad_norm", "grad_scaler"}
    assert set().union(*(d["optimizer"] for d in (nccl, gloo, micro))) == set(OPTIMIZER_KEYS)
    assert plan_from_json(nccl).optimizer.grad_norm_type == float("inf")


# -- DDP's bucketing rule (buckets.limits, ckptd.core.ddp_buckets) -------------------
import copy  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from ckptd.core.ddp_buckets import assign, rebuilt_problem  # noqa: E402


def test_rule_agrees_with_torch_on_200_random_parameter_lists():
    import torch
    import torch.distributed as dist
    rng = random.Random(13)
    kinds = [(torch.float32, "float32"), (torch.float16, "float16"), (torch.float64, "float64")]
    for _ in range(200):
        n = rng.randint(1, 30)
        ts = [(torch.empty(rng.choice([1, 7, 100, 1000, 5000, 30000]), dtype=k[0]), k[1])
              for k in (rng.choice(kinds[:rng.randint(1, 3)]) for _ in range(n))]
        limits = rng.choice([[4096], [1 << 20, 25 << 20], [1000, 20000], [64, 8192, 100000], [1]])
        tensors = [t for t, _ in ts]
        sizes = [t.numel() * t.element_size() for t in tensors]
        dtypes = [d for _, d in ts]
        want, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
        assert assign(sizes, dtypes, limits) == [list(b) for b in want]
        order = list(range(n))
        rng.shuffle(order)  # a gradient-ready order: torch's tensor_indices
        ready, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits, [False] * n, order)
        ours = assign([sizes[i] for i in order], [dtypes[i] for i in order], limits, order)
        closed = [b for b in ours if sum(sizes[i] for i in b) >= 0]
        # the buckets left open at the end follow in hash-map order in torch: compare as sets there
        assert sorted(map(tuple, ours)) == sorted(tuple(b) for b in ready) and len(closed) == len(ready)
        assert rebuilt_problem([list(b) for b in ready], sizes, dtypes, limits) is None


@pytest.fixture(scope="module")
def ddp_plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("_ddp_plan_job.py")), str(d)],
                       capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((d / "plan.json").read_text())


def test_real_ddp_plan_records_limits_and_passes(ddp_plan, tmp_path):
    lim = ddp_plan["buckets"]["limits"]
    assert lim == {"first": [sys.maxsize], "rebuilt": [209715, 209715]}, lim  # bucket_cap_mb=0.2
    assert len(ddp_plan["buckets"]["rebuilt"]) > 1 and ddp_plan["buckets"]["rebuilt"] != ddp_plan["buckets"]["first"]
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(ddp_plan))
    plan = load_plan(p)
    assert plan.bucket_limits == lim
    assert load_plan(_write(tmp_path, plan.to_json())).bucket_limits == lim  # round trip


def _write(tmp_path, doc, name="plan.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def _names(b):
    return b["params"]


def _split_early(doc):  # the rebuilt bucket 0's last parameter moved to bucket 1
    rb = doc["buckets"]["rebuilt"]
    rb[1]["params"].insert(0, rb[0]["params"].pop())


def _split_late(doc):  # bucket 1's first parameter joins bucket 0
    rb = doc["buckets"]["rebuilt"]
    rb[0]["params"].append(rb[1]["params"].pop(0))


def _mix_dtypes(doc):
    doc["parameters"][0]["dtype"] = "float64"


def _reorder_first(doc):
    fb = doc["buckets"]["first"]
    fb[0]["params"].reverse()


def _missing(doc):
    doc["buckets"]["rebuilt"][-1]["params"].pop()


def _tiny_limits(doc):
    doc["buckets"]["limits"]["rebuilt"] = [64]


_RULE = "no gradient-ready order gives this layout with buckets.limits.rebuilt"


@pytest.mark.parametrize("change, message", [
    (_split_early, "buckets.rebuilt[0] is split too early: 82816 bytes, below the limit 209715, and not its "
                   f"dtype's last bucket: {_RULE} [209715, 209715] (DDP's bucketing rule)"),
    (_split_late, "buckets.rebuilt[0] is split too late: 322816 bytes before its last parameter already reach "
                  f"the limit 209715: {_RULE} [209715, 209715] (DDP's bucketing rule)"),
    (_mix_dtypes, "buckets.first[0] mixes dtypes ['float32', 'float64']; DDP buckets hold one dtype"),
    (_reorder_first, "buckets.first[0] is not DDP's first layout for buckets.limits.first "
                     "[9223372036854775807]: DDP puts ['0.weight', '0.bias', '2.weight', '2.bias']... there"),
    (_missing, "buckets.rebuilt must hold every parameter exactly once (missing ['0.weight'], repeated [])"),
    (_tiny_limits, "buckets.rebuilt[0] is split too late: 82816 bytes before its last parameter already reach "
                   f"the limit 64: {_RULE} [64] (DDP's bucketing rule)"),
], ids=["split-early", "split-late", "dtype-mix", "first-reordered", "missing", "limits"])
def test_layouts_ddp_cannot_produce_are_refused(ddp_plan, tmp_path, change, message):
    doc = copy.deepcopy(ddp_plan)
    change(doc)
    p = _write(tmp_path, doc)
    with pytest.raises(PlanError) as e:
        load_plan(p)
    msg = str(e.value)
    assert msg == f"{p}: {message}"


def test_plans_without_limits_load_and_say_so_once(ddp_plan, tmp_path, caplog, monkeypatch):
    import logging

    import ckptd.core.plan as plan_mod
    monkeypatch.setattr(logging.getLogger("ckptd"), "propagate", True)  # the daemon's setup_logging clears it
    doc = copy.deepcopy(ddp_plan)
    del doc["buckets"]["limits"]
    plan_mod._NO_LIMITS_SAID.clear()
    with caplog.at_level("INFO", logger="ckptd"):
        load_plan(_write(tmp_path, doc))
        load_plan(_write(tmp_path, doc, "again.json"))
    said = [r for r in caplog.records if "buckets.limits" in r.getMessage()]
    assert len(said) == 1
