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


def test_allreduces_per_step_is_gloo_only_and_round_trips(plan_doc):
    doc = json.loads(json.dumps(plan_doc))
    doc["allreduces_per_step"] = 3
    with pytest.raises(PlanError, match="allreduces_per_step > 1 .* needs transport gloo"):
        plan_from_json(doc)
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
