"""write_plan watches the job's own collectives on DDP's process group (ckptd.own_collectives):
one the plan does not list, of exactly a gradient bucket's size, is refused at the call
(the replay would take it for that bucket: wrong checkpoints that look good); any other
unlisted one, and a listed one the loop did not make, is warned about once. DDP's own
calls through the Python API (its compression hooks) and calls on other groups are not
the job's."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ckptd.torch as ct
from test_trainer import _ddp, _refused, group  # noqa: F401 -- group is a fixture
from test_trainer_probe import world_of_two  # noqa: F401 -- a fixture

LOSS = {"op": "allreduce", "count": 1, "dtype": "float32"}


def _train(model, opt, steps: int, before=(), after=()):
    """`steps` steps of one synchronising backward, with the job's own allreduces made
    before the forward and after the step (`(count, dtype)` each)."""
    for _ in range(steps):
        for n, d in before:
            dist.all_reduce(torch.zeros(n, dtype=d))
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        for n, d in after:
            dist.all_reduce(torch.zeros(n, dtype=d))


def _planned(tmp_path, addresses, name="a", **kw):
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = ct.write_plan(model, opt, tmp_path / name / "plan.json", addresses=addresses, **kw)
    return model, opt, plan


def _bucket(plan) -> int:
    """The elements (float32) of the plan's one gradient bucket."""
    (bucket,) = plan.layout_buckets(plan.buckets_first)
    return bucket.count


def test_an_unlisted_allreduce_of_a_buckets_size_is_refused_at_the_call(world_of_two, tmp_path):  # noqa: F811
    """The test model's gradients are one bucket of 74 float32: an allreduce of 74 float32
    on DDP's group each step went through and every replayed round was two (helper
    finding, docs/TRAINING.md before this change); now it is refused before it reaches the
    wire. Listed, it passes without a word."""
    model, opt, plan = _planned(tmp_path, world_of_two)
    n = _bucket(plan)
    assert n == 74
    _train(model, opt, 1)
    with pytest.raises(ct.TrainerError, match=rf"^an allreduce of {n} float32 on DDP's process group \(after 2 rounds "
                                              rf"of gradient allreduces\) is not in write_plan's collectives, and it is exactly a gradient "
                                              rf"bucket's size \({4 * n} bytes\).*dist.new_group") as e:
        _train(model, opt, 1, after=[(n, torch.float32)])
    assert "\n" not in str(e.value)
    listed, opt, _ = _planned(tmp_path, world_of_two, "b",
                              collectives={"after": [{"op": "allreduce", "count": n, "dtype": "float32"}]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(listed, opt, 4, after=[(n, torch.float32)])
    # of another dtype, the same bytes: the wire cannot tell it apart either
    with pytest.raises(ct.TrainerError, match=rf"an allreduce of {2 * n} float16 .*\({4 * n} bytes\)"):
        _train(listed, opt, 1, after=[(n, torch.float32), (2 * n, torch.float16)])


def test_listed_collectives_in_their_places_pass_and_others_are_warned_once(world_of_two, tmp_path):  # noqa: F811
    """A loss allreduced after each step and a metric before each forward, listed: no
    warning over 5 steps, on the default group named or not. Unlisted (a logging
    allreduce the plan does not know): one warning, naming it, however often it recurs.
    A listed one the loop stops making: one warning. A group of the job's own: nothing."""
    model, opt, _ = _planned(tmp_path, world_of_two,
                             collectives={"before": [{"op": "allreduce", "count": 3, "dtype": "int64"}],
                                          "after": [LOSS]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, opt, 3, before=[(3, torch.int64)], after=[(1, torch.float32)])
        for _ in range(2):
            dist.all_reduce(torch.zeros(3, dtype=torch.int64), group=dist.group.WORLD)
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.SUM)
        own = dist.new_group([0], backend="gloo")
        dist.all_reduce(torch.zeros(5), group=own)  # not DDP's group
        dist.barrier()  # gloo's barrier is no allreduce
        dist.broadcast(torch.zeros(2), 0)  # gloo counts allreduces alone
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _train(model, opt, 3, before=[(3, torch.int64)], after=[(1, torch.float32), (2, torch.float32)])
    texts = [str(x.message) for x in w]
    assert texts == ["ckptd: an allreduce of 2 float32 on DDP's process group (after 6 rounds of gradient "
                     "allreduces) is not in write_plan's collectives: the iteration it falls in will not be committed; list it where the loop makes it "
                     "({'op': 'allreduce', 'count': 2, 'dtype': 'float32'}) or make it on a group of its own "
                     "(dist.new_group)"], texts
    assert w[0].filename == __file__  # at the job's own call
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _train(model, opt, 3, after=[(1, torch.float32)])  # the "before" metric is no longer made
    assert [str(x.message) for x in w] == [
        "ckptd: write_plan's collectives list an allreduce of 3 int64 on DDP's process group before round 9's "
        "gradient allreduces, and the loop did not make it: the iterations around it will not be committed; "
        "list the collectives as the loop makes them"]


def test_start_collectives_may_run_before_or_after_write_plan(world_of_two, tmp_path):  # noqa: F811
    """`start` ones come once before the first round: made after write_plan, or before it
    (then not seen), both pass; made again later, they are unlisted."""
    start = {"start": [{"op": "allreduce", "count": 4, "dtype": "float64"}], "after": [LOSS]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, made_after in (("a", True), ("b", False)):
            model, opt, _ = _planned(tmp_path, world_of_two, name, collectives=start)
            if made_after:
                dist.all_reduce(torch.zeros(4, dtype=torch.float64))
            _train(model, opt, 3, after=[(1, torch.float32)])
    with pytest.warns(RuntimeWarning, match=r"an allreduce of 4 float64 on DDP's process group \(after 3 rounds of gradient allreduces\)"):
        _train(model, opt, 1, before=[(4, torch.float64)], after=[(1, torch.float32)])


def test_ddp_compression_hooks_are_not_the_jobs_own(world_of_two, tmp_path):  # noqa: F811
    """fp16_compress_hook allreduces each bucket through dist.all_reduce: DDP's buckets,
    never the job's (the bucket is exactly a bucket's size on the wire)."""
    model = _ddp()
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ct.write_plan(model, opt, tmp_path / "plan.json", addresses=world_of_two)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, opt, 3)


def _with_sync_bn(**kw):
    """DDP refuses to wrap a SyncBatchNorm on the CPU (it runs on GPUs only), so this DDP
    model gets its SyncBatchNorm after DDP was built, as a GPU job's would have it."""
    m = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)))
    sync = torch.nn.SyncBatchNorm(8, **kw)
    sync.weight, sync.bias = m.module[1].weight, m.module[1].bias  # the parameters DDP's reducer holds
    m.module[1] = sync
    return m


def test_sync_batchnorm_on_ddps_group_is_refused(group):  # noqa: F811
    """SyncBatchNorm allreduces its statistics in the forward and the backward, among the
    buckets; refused unless it has a group of its own."""
    m = _with_sync_bn()
    _refused(m, torch.optim.SGD(m.parameters(), lr=0.1), r"^1 is a SyncBatchNorm on DDP's process group")
    m = _with_sync_bn(process_group=dist.group.WORLD)
    _refused(m, torch.optim.SGD(m.parameters(), lr=0.1), r"^1 is a SyncBatchNorm on DDP's process group")
    m = _with_sync_bn(process_group=dist.new_group([0], backend="gloo"))
    _refused(m, torch.optim.SGD(m.parameters(), lr=0.1), "2 ranks")  # past the check: a one-rank group has no ring


_BUCKET_SIZED_JOB = r'''
import warnings
model = ddp()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ct.write_plan(model, opt, os.path.join(tmp, "plan.json"), addresses=["127.0.0.1"] * world,
              collectives={"after": [{"op": "allreduce", "count": 1, "dtype": "float32"}]})
n = sum(p.numel() for p in model.parameters())  # one bucket: every gradient
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for step in range(4):
        try:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            dist.all_reduce(torch.zeros(1))  # the listed loss
            if step == 2:
                dist.all_reduce(torch.zeros(n))  # a parameter-sized sum of its own, unlisted
            got = ["stepped", step]
        except Exception as e:
            got = ["raised", type(e).__name__, str(e)]
        print(json.dumps({f"step{step}": got + [0]}), flush=True)
        if got[0] == "raised":
            break
print(json.dumps({"warnings": [str(w.message) for w in seen] + [0]}), flush=True)
dist.barrier()
os._exit(0)
'''


def test_in_a_real_job_every_rank_refuses_the_same_call(tmp_path):
    """Two gloo ranks: the listed loss allreduce passes for three steps without a warning,
    and the unlisted allreduce of the gradients' size (the model is one bucket) is refused
    on both ranks at the same call, before it reaches the wire: no rank hangs in it."""
    from test_trainer_probe import _run_job
    got = _run_job(tmp_path, _BUCKET_SIZED_JOB, 2)
    for r in range(2):
        assert [got[r][f"step{s}"][:2] for s in range(2)] == [["stepped", 0], ["stepped", 1]], got[r]
        assert got[r]["step2"][:2] == ["raised", "TrainerError"], got[r]
        assert got[r]["step2"][2].startswith("an allreduce of 58 float32 on DDP's process group (after 3 rounds of "
                                             "gradient allreduces) is not in write_plan's collectives, and it is "
                                             "exactly a gradient bucket's size (232 bytes)"), got[r]
        assert got[r]["warnings"] == [0], got[r]


class _Group:  # a stand-in process group: OwnCollectives holds it by weak reference
    pass


def test_on_nccl_broadcasts_allgathers_and_barriers_are_matched_too():
    """NCCL runs every collective on the communicator's rings, so broadcasts (with their
    root), allgathers and barriers (ProcessGroupNCCL::barrier: an allreduce of one float32)
    are matched like allreduces; on gloo, whose count takes allreduces alone, they are not
    the plan's business."""
    from ckptd.core.plan import collectives_from_json
    from ckptd.own_collectives import OwnCollectives
    own = collectives_from_json({"before": [{"op": "broadcast", "count": 6, "dtype": "int64", "root": 0},
                                            {"op": "allreduce", "count": 1, "dtype": "float32"}],
                                 "after": [{"op": "allgather", "count": 2, "dtype": "int64"}]})
    g = _Group()
    nccl = OwnCollectives(g, own, "roce", lambda: {400}, ct.TrainerError)
    gloo = OwnCollectives(g, own, "gloo", lambda: {400}, ct.TrainerError)
    bcast, barrier, gather = ("broadcast", 6, "int64", 0), ("barrier", 0, "", None), ("allgather", 2, "int64", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            nccl.called(bcast, None)
            nccl.called(barrier, None)  # the listed allreduce of 1 float32
            nccl.round_begins()
            nccl.called(gather, None)
        gloo.called(bcast, None)
        gloo.called(barrier, None)
        gloo.called(("allreduce", 1, "float32", None), None)
        gloo.round_begins()
    with pytest.warns(RuntimeWarning, match=r"^ckptd: a broadcast of 6 int64 from rank 1 on DDP's process group "
                                            r"\(after 3 rounds of gradient allreduces\) is not in write_plan's"):
        nccl.called(("broadcast", 6, "int64", 1), None)  # another root
    with pytest.warns(RuntimeWarning, match=r"^ckptd: a barrier \(on NCCL an allreduce of 1 float32\) on DDP's"):
        nccl.called(barrier, None)  # the broadcast was not made: the barrier does not fit there
    with pytest.raises(ct.TrainerError, match=r"^an allreduce of 100 float32 .*exactly a gradient bucket's size"):
        nccl.called(("allreduce", 100, "float32", None), None)
    with pytest.raises(ct.TrainerError, match=r"^an allreduce of 100 float32 .*exactly a gradient bucket's size"):
        gloo.called(("allreduce", 100, "float32", None), None)
