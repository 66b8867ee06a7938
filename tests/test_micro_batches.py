"""Gradient accumulation with an allreduce every micro-batch on NCCL (issue 15): the
plan's allreduces_per_step K makes every micro-batch a wire round; the shadow steps on
each step's last round (DDP's param.grad: the previous reduced value plus this
backward's gradient), the earlier rounds are matched and counted, and every round
advances QP rotation, PSNs and LL flags. Both paths against the synthesizer's trainer."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ckptd.cli import build_parser
from ckptd.core.checkpoint import checkpoint_name, load_checkpoint
from ckptd.core.plan import load_plan
from ckptd.pipeline import ReplayOptions, replay
from helpers import pcaps, synth
from test_fastpath import assert_same, synth_pair

K = 3


# Simple with a BatchNorm (DDP's buffer broadcast in every micro-batch's forward: the
# checkpoint holds those after the step's last one), LL with NCCL 2.29; both with 3 QPs
# whose rotation carries over rounds
@pytest.mark.parametrize("protocol,ranks,version,model,cap", [("simple", 3, "2.22", "tiny-bn", 64),
                                                              ("ll", 2, "2.29", "tiny", 32)])
def test_every_micro_batch_allreduced_bit_exact_on_both_paths(tmp_path, protocol, ranks, version, model, cap):
    n = 4
    ref, fast = synth_pair(tmp_path, ranks=ranks, channels=2, mtu=1024, mirrors=2, qps=3, protocol=protocol,
                           nccl_version=version, model=model, bucket_cap_kb=cap, iterations=n,
                           allreduces_per_step=K, seed=5)
    assert_same(ref, fast)
    plan = ref.plan
    assert plan.allreduces_per_step == K and plan.ring.qps_per_connection == 3
    assert plan.rotation_period() > 1  # rounds land on other QPs: every round is counted
    for pipe in (ref, fast):
        assert [r.iteration for r in pipe.reports] == list(range(n))
        # with module buffers the job's last step waits for a forward that never comes
        whole = list(pipe.reports)[:-1] if plan.buffers.captured else pipe.reports
        assert all(r.status == "committed" and r.exact for r in whole), \
            [(r.iteration, r.status, r.note) for r in pipe.reports]
        c = pipe.extract.counters
        # the earlier micro-batches' packets: matched, counted, never placed
        assert c["earlier_micro_batch_packets"] > 0
        assert c["schedule_mismatch"] == c["ll_flag_mismatch"] == c["before_start"] == 0
    # what the shadow committed is the trainer's state after each step
    final = load_checkpoint(tmp_path / "reference" / checkpoint_name(n - 1))
    assert final["iteration"] == n - 1


def test_micro_batches_read_as_steps_do_not_match(tmp_path):
    """The same capture read with K = 1 (one allreduce a step) is not the job."""
    synth(tmp_path, ranks=2, channels=1, mtu=1024, mirrors=1, iterations=2, allreduces_per_step=2)
    plan = dataclasses.replace(load_plan(tmp_path / "plan.json"), allreduces_per_step=1)
    reps = replay(plan, pcaps(tmp_path), load_checkpoint(tmp_path / "init.pt"),
                  ReplayOptions(reference=str(tmp_path / "reference"), agree_window_ms=0))
    assert not all(r.exact for r in reps.reports if r.status == "committed")


def test_synth_cli_option():
    a = build_parser().parse_args(["synth", "--out", "x", "--allreduces-per-step", "3"])
    assert a.allreduces_per_step == 3


def test_write_plan_on_nccl_accepts_allreduces_per_step(tmp_path, monkeypatch):
    import torch.distributed as dist

    import ckptd.torch as ct
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        monkeypatch.setattr(ct.dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(ct.dist, "get_world_size", lambda group=None: 2)
        plan = ct.write_plan(ddp, opt, tmp_path / "plan.json", addresses=["10.0.0.1", "10.0.0.2"],
                             allreduces_per_step=4)
        assert plan.transport == "roce" and plan.allreduces_per_step == 4
        assert load_plan(tmp_path / "plan.json").allreduces_per_step == 4
        with pytest.raises(ct.TrainerError, match="allreduces_per_step"):
            ct.build_plan(ddp, opt, addresses=["10.0.0.1", "10.0.0.2"], allreduces_per_step=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fast", [False, True])
def test_join_mid_step_starts_at_the_next_step(tmp_path, fast):
    """A capture that starts inside step 1 (at its second micro-batch's round) joins at
    step 2: the first step whose every round every flow was seen from."""
    from test_join import cut, iteration_starts, join_replay
    job = tmp_path / "job"
    synth(job, ranks=2, channels=1, mtu=1024, mirrors=2, qps=3, bucket_cap_kb=32, iterations=4,
          allreduces_per_step=K)
    starts = iteration_starts(pcaps(job))  # one per wire round
    assert len(starts) == 4 * K
    paths = cut(job, tmp_path / "cut", starts[K + 1] - 1_000_000)  # before step 1's second round
    pipe = join_replay(job, paths, tmp_path / "out", fast=fast)
    assert pipe.joined == 2
    assert [(r.iteration, r.status, r.exact) for r in pipe.reports] == [(2, "committed", True), (3, "committed", True)]
