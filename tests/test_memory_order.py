"""Parameters in another memory order than their shape's (a channels_last conv weight, a
transposed view). DDP lays each gradient into its bucket in its parameter's memory order
(NHWC for channels_last), and the plan gave shapes only: the shadow read such a gradient
in the wrong element order and committed every checkpoint wrong, as exact. write_plan now
records each parameter's `memory_order`, and the shadow reads the gradient by it."""
import json
from pathlib import Path

import pytest
import torch

import _channels_last_job as job
import ckptd.torch as ct
from ckptd.core.plan import PlanError, load_plan, plan_from_json
from test_trainer import group  # noqa: F401 -- a fixture
from test_trainer_probe import world_of_two  # noqa: F401 -- a fixture
from test_unused import _captured, _replay_cli, assert_replay_exact

JOB = Path(__file__).with_name("_channels_last_job.py")


def test_the_plan_reads_each_gradient_as_ddp_lays_it_out(world_of_two):  # noqa: F811
    """A comm hook sees every parameter's slice of the bucket: the plan's grad_view of it
    is DDP's gradient, with the parameter's strides."""
    class T(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.w = torch.nn.Parameter(torch.randn(5, 3).t())  # a transposed view: dense, order (1, 0)

        def forward(self, x):
            return self.conv(x).sum() + (self.w @ torch.arange(5.0)).sum()
    net = T().to(memory_format=torch.channels_last)
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1e-6)
    slices = {}

    def hook(state, bucket):
        at = 0
        for q in bucket.parameters():
            slices[id(q)] = bucket.buffer()[at:at + q.numel()].clone()
            at += q.numel()
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    plan = ct.build_plan(ddp, torch.optim.SGD(net.parameters(), lr=0.1), addresses=world_of_two)
    ddp.register_comm_hook(None, hook)
    ddp(torch.randn(2, 3, 6, 6)).backward()
    orders = {p.name: p.memory_order for p in plan.parameters}
    assert orders == {"conv.weight": (0, 2, 3, 1), "conv.bias": None, "w": (1, 0)}
    for name, q in net.named_parameters():
        got = plan.param(name).grad_view(slices[id(q)])
        assert torch.equal(got, q.grad) and got.stride() == q.grad.stride() == q.stride(), name
    assert not torch.equal(slices[id(net.conv.weight)].view(4, 3, 3, 3), net.conv.weight.grad)  # the old reading
    assert plan_from_json(json.loads(json.dumps(plan.to_json()))) == plan


@pytest.mark.parametrize("order", [[0, 1, 2], [0, 0, 2, 3], [0, 2, 3, 4], "0231"])
def test_a_memory_order_that_is_no_order_of_the_dimensions_is_refused(order):
    doc = {"format": "ckptd-plan", "version": 1, "transport": "gloo",
           "parameters": [{"name": "w", "shape": [4, 3, 3, 3], "memory_order": order}],
           "buckets": {"first": [{"params": ["w"]}], "rebuilt": "learn"},
           "ring": {"nranks": 2, "nccl_version": "2.19"}, "optimizer": None,
           "ranks": [{"rank": 0, "addr": "127.0.0.1"}, {"rank": 1, "addr": "127.0.0.1"}]}
    with pytest.raises(PlanError, match=r"parameters\[0\]\.memory_order"):
        plan_from_json(doc)


@pytest.mark.parametrize("kind,clip", [("sgd", None), ("adamw", 0.5)])
def test_a_channels_last_job_replays_bit_exact(tmp_path, kind, clip):
    """A real 2-rank gloo job, captured on lo: every iteration bit-exact against rank 0's
    own checkpoints, and not without the plan's memory_order."""
    d = tmp_path / "job"
    pcap = _captured(d, kind, clip, JOB)
    plan = load_plan(d / "plan.json")
    assert plan.param("0.weight").memory_order == (0, 2, 3, 1)
    assert_replay_exact(_replay_cli(d, [pcap], tmp_path / "ckpts"), job.ITERATIONS)
    doc = json.loads((d / "plan.json").read_text())
    for p in doc["parameters"]:
        p.pop("memory_order", None)
    (d / "plan.json").write_text(json.dumps(doc))
    r = _replay_cli(d, [pcap], tmp_path / "ckpts-shapes-only")
    assert "NOT bit-exact" in r.stdout
