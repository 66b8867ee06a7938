"""ckptd.torch.write_plan / build_plan on what a training script may hand it: each case is
refused at write time in one line naming what is wrong, or (world_of_two) written as a
plan that ckptd loads. Never a raw traceback, never a plan that replays wrongly."""
import warnings

import pytest
import torch
import torch.distributed as dist

import ckptd.torch as ct
from ckptd.core.plan import Optimizer, PlanError, load_plan
from test_trainer import _ddp, _net, _refused, group  # noqa: F401 -- group is a fixture

L = torch.optim.lr_scheduler


@pytest.fixture
def world_of_two(group, monkeypatch):  # noqa: F811
    """The one-rank group seen as two ranks by write_plan (no forward runs), so a plan
    gets past the ring and is written."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return ["127.0.0.1", "127.0.0.2"]


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def test_capturable_is_refused_when_written_and_when_loaded(group):  # noqa: F811
    """capturable=True: torch asserts CUDA tensors on its first step, so the CPU shadow
    crashed with a raw AssertionError at the first replayed iteration."""
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.NAdam):
        m = _ddp()
        _refused(m, cls(m.parameters(), capturable=True), r"groups\[0\]\.capturable is true")
    from ckptd.core.optim import check_replayable
    opt = Optimizer(kind="adam", groups=({"params": ["w"], "lr": 1e-3, "capturable": True},))
    with pytest.raises(PlanError, match="capturable"):
        check_replayable(opt)


def test_scheduler_with_a_python_function_is_refused(group):  # noqa: F811
    """CyclicLR(scale_fn=...): its state matches the replay at step 0, its lrs from step 1
    on do not (the plan was written and replayed other lrs)."""
    m = _ddp()
    opt = _sgd(m)
    sched = L.CyclicLR(opt, 0.01, 0.1, scale_fn=lambda x: 0.5, scale_mode="cycle")
    names = [n for n, _ in m.module.named_parameters()]
    kind, groups = ct._optimizer(opt, {id(p): n for n, p in m.module.named_parameters()}, names)
    rec = Optimizer(kind=kind, groups=tuple(groups), lr_scheduler=ct._scheduler(sched, opt, None))
    with pytest.raises(ct.TrainerError, match="at step 1 the replayed group 0 lr"):
        ct._check_replay(rec, names, opt, sched)
    _refused(m, opt, "at step 1", scheduler=sched)


def test_schedulers_that_replay_are_still_accepted_over_their_steps(world_of_two):
    for mk in (lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=10),
               lambda o: L.CyclicLR(o, 0.01, 0.1, mode="exp_range", gamma=0.9),
               lambda o: L.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2)):
        m = _ddp()
        opt = _sgd(m)
        assert ct.build_plan(m, opt, scheduler=mk(opt), addresses=world_of_two).optimizer.lr_scheduler


def test_scheduler_of_another_optimizer_and_bad_scheduler_args_are_refused(group):  # noqa: F811
    m = _ddp()
    opt, other = _sgd(m), _sgd(m)
    _refused(m, opt, "drives another optimizer", scheduler=L.StepLR(other, 1, 0.1))
    _refused(m, opt, "scheduler_args must be a dict", scheduler=L.StepLR(opt, 2), scheduler_args=[2])


def test_scaler_that_is_not_a_grad_scaler_is_refused(group):  # noqa: F811
    m = _ddp()
    _refused(m, _sgd(m), "scaler must be a torch.amp.GradScaler", scaler=object())


def test_parameter_in_two_groups_is_refused(group):  # noqa: F811
    m = _ddp()
    ps = list(m.parameters())
    opt = torch.optim.SGD(ps, lr=0.1)
    opt.param_groups.append({**opt.param_groups[0], "params": [ps[0]]})
    _refused(m, opt, "parameter 0.weight is in optimizer group 0 and group 1")


def test_complex_parameters_are_refused_by_dtype(group):  # noqa: F811
    class Cx(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    m = torch.nn.parallel.DistributedDataParallel(Cx())
    _refused(m, torch.optim.Adam(m.parameters()), "parameters of dtype complex64")


def test_a_world_of_one_is_said(group):  # noqa: F811
    m = _ddp()
    _refused(m, _sgd(m), "the process group has 1 rank: ckptd needs at least 2 ranks")


def test_bad_iterations_and_addresses_are_refused_not_written(world_of_two):
    m = _ddp()
    for it in (0, -1, "5", True):
        with pytest.raises(ct.TrainerError, match="iterations must be an integer >= 1"):
            ct.build_plan(m, _sgd(m), addresses=world_of_two, iterations=it)
    for addrs, match in (("127.0.0.1", "addresses must be a list"), (["127.0.0.1"], "1 addresses for a world of 2"),
                         (["nohost", "127.0.0.2"], r"addresses\[0\] is 'nohost'")):
        with pytest.raises(ct.TrainerError, match=match):
            ct.build_plan(m, _sgd(m), addresses=addrs)


def test_write_plan_paths(world_of_two, tmp_path):
    m = _ddp()

    def refused(path, match, **kw):
        with pytest.raises(ct.TrainerError, match=match) as e:
            ct.write_plan(m, _sgd(m), path, addresses=world_of_two, **kw)
        assert "\n" not in str(e.value)
    refused(None, "path must be a file path, not None")
    refused("", "path must be a file path")
    (tmp_path / "d").mkdir()
    refused(tmp_path / "d", "is a directory")
    assert not (tmp_path / "init.pt").exists()  # nothing written beside it first
    refused(tmp_path / "p.json", "is a directory", init=tmp_path / "d")
    (tmp_path / "f").write_text("x")
    refused(tmp_path / "f" / "plan.json", "f is not a directory")
    refused(tmp_path / "s.json", "init and path are the same file", init=tmp_path / "s.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ct.write_plan(m, _sgd(m), tmp_path / "ok" / "plan.json", addresses=world_of_two, iterations=3)
    assert load_plan(tmp_path / "ok" / "plan.json").iterations == 3 and (tmp_path / "ok" / "init.pt").exists()


_RANK0_FAILS_JOB = r'''
import datetime, json, os, sys, time
import torch, torch.distributed as dist
import ckptd.torch as ct
rank, tmp = int(sys.argv[1]), sys.argv[2]
# rank 0 hosts the store (as with tcp:// or env:// outside torchrun): its exit takes it along
timeout = datetime.timedelta(seconds=20)  # the old code's other ranks waited in an allreduce for it
port_file = os.path.join(tmp, "port")
if rank == 0:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(store.port))
    os.rename(port_file + ".tmp", port_file)
else:
    for _ in range(400):
        if os.path.exists(port_file):
            break
        time.sleep(0.05)
    store = dist.TCPStore("127.0.0.1", int(open(port_file).read()), 2, False, timeout=timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
torch.manual_seed(0)
ddps = [torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
        for _ in range(5)]  # every constructor broadcasts: built up front, on both ranks
got = {}


def call(name, ddp, path, iterations=0, before=None):
    t = time.monotonic()
    try:
        plan = ct.write_plan(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), path,
                             addresses=["127.0.0.1", "127.0.0.1"], iterations=5)
        if before:
            before()
        for _ in range(iterations):  # DDP rebuilds its buckets in the second forward
            ddp(torch.randn(3, 4)).sum().backward()
        got[name] = ["returned", type(plan).__name__]
    except Exception as e:
        got[name] = ["raised", type(e).__name__, str(e)]
    got[name].append(time.monotonic() - t)
    print(json.dumps({name: got[name]}), flush=True)  # as it goes: a rank may die later


def tmp_dir_in_the_way():  # the rewrite's temporary (plan.json.tmp) cannot be written
    if rank == 0:
        os.mkdir(os.path.join(tmp, "bad", "plan.json.tmp"))


open(os.path.join(tmp, "f"), "w").close()
os.makedirs(os.path.join(tmp, "d"), exist_ok=True)
call("under_a_file", ddps[0], os.path.join(tmp, "f", "plan.json"))
call("a_directory", ddps[0], os.path.join(tmp, "d"))
call("written", ddps[1], os.path.join(tmp, "ok", "plan.json"), iterations=2)
call("rewrite_fails", ddps[2], os.path.join(tmp, "bad", "plan.json"), iterations=2, before=tmp_dir_in_the_way)
# rank 0 slower than the store's timeout: the others give up at it
default_store = dist.distributed_c10d._get_default_store()
if rank == 0:
    initial_state = ct.initial_state
    ct.initial_state = lambda *a: (time.sleep(4), initial_state(*a))[1]
else:
    default_store.set_timeout(datetime.timedelta(seconds=2))
call("rank0_slow", ddps[3], os.path.join(tmp, "slow", "plan.json"))
if rank == 0:
    ct.initial_state = initial_state
    store.set("job/slow_done", b"")
else:
    default_store.set_timeout(timeout)
    store.wait(["job/slow_done"])
    time.sleep(1)  # rank 0 fails and exits before rank 1 comes to read: it waits for the read
call("rank0_exits", ddps[4], os.path.join(tmp, "f", "plan.json"))
os._exit(0)  # no teardown: see test_trainer.py's _EXCHANGE_JOB
'''


def test_rank0s_failure_to_write_the_plan_is_raised_on_every_rank(tmp_path):
    """Rank 0 alone writes the plan: when it could not (its path under a regular file, a
    directory as the path, the rewrite after DDP rebuilt its buckets), every rank raises
    TrainerError at once, the others naming rank 0's error; they used to return (or go
    on from the rebuilding forward) and hang in the first allreduce until the process
    group's timeout. A rank 0 that never answers is waited for up to the store's timeout."""
    import json
    import os
    import subprocess
    import sys
    script = tmp_path / "job.py"
    script.write_text(_RANK0_FAILS_JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(__import__("pathlib").Path(ct.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]),
           "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("a rank hung: " + " | ".join(p.communicate()[1][-1000:] for p in procs))
    got = [{k: v for line in out.splitlines() if line.startswith("{") for k, v in json.loads(line).items()}
           for out, _ in outs]
    for r in range(2):
        for name in got[r]:
            assert got[r][name][-1] < 15, (r, name, got[r][name])  # not at the 20 s timeout
            assert "\n" not in str(got[r][name]), (r, name)
    f = tmp_path / "f"
    zero = {"under_a_file": f"cannot write the initial state to {f / 'init.pt'}: {f} is not a directory",
            "a_directory": f"{tmp_path / 'd'} is a directory: write_plan writes a file there",
            "rewrite_fails": f"cannot rewrite the plan at {tmp_path / 'bad' / 'plan.json'} with DDP's rebuilt "
                             "buckets: Is a directory"}
    for name, msg in zero.items():
        assert got[0][name][:3] == ["raised", "TrainerError", msg], got[0][name]
        step = "rewrite" if name == "rewrite_fails" else "write"
        assert got[1][name][:3] == ["raised", "TrainerError", f"rank 0 could not {step} the plan: {msg}"], got[1][name]
    assert got[0]["written"][:2] == got[1]["written"][:2] == ["returned", "Plan"]
    written = load_plan(tmp_path / "ok" / "plan.json")
    assert not written.rebuilt_learn and written.buckets_rebuilt  # rewritten after the rebuild
    slow = got[1]["rank0_slow"]
    assert slow[:2] == ["raised", "TrainerError"], slow  # gave up at its 2 s: rank 0 took 4
    assert slow[2].startswith("rank 1 had no word from rank 0 on whether it could write the plan (c10d store key "
                              "'ckptd/write_plan/0,1/4/write_the_plan', waited up to 2 s): "), slow
    assert got[0]["rank0_slow"][:2] == ["returned", "Plan"]
    exits = f"cannot write the initial state to {f / 'init.pt'}: {f} is not a directory"
    assert got[0]["rank0_exits"][:3] == ["raised", "TrainerError", exits]
    assert got[1]["rank0_exits"][:3] == ["raised", "TrainerError", f"rank 0 could not write the plan: {exits}"]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]


@pytest.mark.parametrize("kw, match", [
    ({"max_grad_norm": -1.0}, r"^max_grad_norm must be a finite number > 0 or null, not -1.0$"),
    ({"max_grad_norm": float("nan")}, r"^max_grad_norm must be a finite number > 0"),
    ({"max_grad_norm": 1.0, "grad_norm_type": 0}, r'^grad_norm_type must be a number > 0 or "inf", not 0.0$'),
    ({"max_grad_norm": 1.0, "grad_norm_type": "two"}, r"^grad_norm_type 'two' is not a number or 'inf'"),
    ({"grad_norm_type": "inf"}, r"^grad_norm_type is clip_grad_norm_'s norm_type: it needs max_grad_norm$"),
    ({"clip_grad_value": -0.5}, r"^clip_grad_value must be a finite number > 0 or null, not -0.5$"),
    ({"clip_grad_value": 0.5, "max_grad_norm": 1.0}, r"^clip_grad_value and max_grad_norm are both set"),
    ({"scaler": {"init_scale": -1.0}}, r"^scaler's init_scale is -1.0; it must be a finite number > 0"),
    ({"scaler": {"growth_interval": 0}}, r"^scaler's growth_interval is 0; it must be an integer >= 1$"),
])
def test_a_bad_argument_is_named_as_write_plan_takes_it(world_of_two, tmp_path, kw, match):
    """A value the plan's check refuses is named by write_plan's argument (a TrainerError),
    not by the plan field it would have gone to (a PlanError, 'optimizer.max_grad_norm')."""
    m = _ddp()
    if "scaler" in kw:
        kw = {"scaler": torch.amp.GradScaler("cpu", **kw["scaler"])}
    with pytest.raises(ct.TrainerError, match=match):
        ct.write_plan(m, _sgd(m), tmp_path / "plan.json", addresses=world_of_two, **kw)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("key", ["momentum", "dampening"])
def test_a_nan_group_value_torch_takes_is_named(world_of_two, tmp_path, key):
    """torch's SGD checks momentum < 0, which nan passes; the replay's comparison then
    built a scheduler's message with no scheduler: TypeError from inside ckptd."""
    m = _ddp()
    opt = _sgd(m)
    opt.param_groups[0][key] = float("nan")
    with pytest.raises(ct.TrainerError, match=rf"^optimizer.param_groups\[0\] {key} is nan: it must be a finite number$"):
        ct.write_plan(m, opt, tmp_path / "plan.json", addresses=world_of_two)
    assert not (tmp_path / "plan.json").exists()


def test_bucket_cap_mb_zero_is_named_by_ddps_argument(world_of_two, tmp_path):
    """torch builds DDP(bucket_cap_mb=0); the refusal named the plan's buckets.limits.rebuilt,
    a field the user never passed."""
    torch.manual_seed(0)
    m = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
                                                  bucket_cap_mb=0)
    with pytest.raises(ct.TrainerError, match=r"^DDP was built with bucket_cap_mb=0: "):
        ct.write_plan(m, _sgd(m), tmp_path / "plan.json", addresses=world_of_two)
    assert not (tmp_path / "plan.json").exists()


def test_scheduler_args_without_a_scheduler_is_refused(world_of_two, tmp_path):
    """scheduler_args with no scheduler was ignored: the plan replayed a constant lr."""
    m = _ddp()
    with pytest.raises(ct.TrainerError, match="^scheduler_args given without a scheduler"):
        ct.write_plan(m, _sgd(m), tmp_path / "plan.json", addresses=world_of_two, scheduler_args={"step_size": 2})


_JOB_HEAD = r'''
import datetime, json, os, sys, time
import torch, torch.distributed as dist
import ckptd.torch as ct
rank, world, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
timeout = datetime.timedelta(seconds=60)  # what the old code's ranks waited out (in an allreduce, or the store)
port_file = os.path.join(tmp, "port")
if rank == 0:  # rank 0 hosts the store (tcp://, env:// outside torchrun): its exit takes it along
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(store.port))
    os.rename(port_file + ".tmp", port_file)
else:
    for _ in range(400):
        if os.path.exists(port_file):
            break
        time.sleep(0.05)
    store = dist.TCPStore("127.0.0.1", int(open(port_file).read()), world, False, timeout=timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def ddp():
    torch.manual_seed(0)
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))


def call(name, model, path, lr=0.1, train=0, **kw):
    t = time.monotonic()
    try:
        plan = ct.write_plan(model, torch.optim.SGD(model.parameters(), lr=lr), path,
                             addresses=kw.pop("addresses", ["127.0.0.1"] * world), **kw)
        got = ["returned", type(plan).__name__]
    except Exception as e:
        got = ["raised", type(e).__name__, str(e)]
    got.append(time.monotonic() - t)
    print(json.dumps({name: got}), flush=True)  # as it goes: a rank may hang later
    for _ in range(train):  # DDP rebuilds its buckets in the second forward
        model(torch.randn(3, 4)).sum().backward()
'''


def _run_job(tmp_path, script: str, world: int) -> list[dict]:
    """A real `world`-rank gloo job on this host: each rank's {case: outcome} lines."""
    import json
    import os
    import subprocess
    import sys
    (tmp_path / "job.py").write_text(_JOB_HEAD + script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(__import__("pathlib").Path(ct.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]),
           "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "job.py"), str(r), str(world), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate() for p in procs]
        pytest.fail("a rank hung: " + " | ".join(o[:1500] + e[-1500:] for o, e in outs))
    assert all(p.returncode == 0 for p in procs), [o[-1000:] + e[-2000:] for o, e in outs]
    got = [{k: v for line in out.splitlines() if line.startswith("{") for k, v in json.loads(line).items()}
           for out, _ in outs]
    for r in range(world):
        for name, outcome in got[r].items():
            assert outcome[-1] < 30, (r, name, outcome)  # seconds (a loaded machine), not the 60 s timeout
    return got


_ANY_RANK_FAILS_JOB = r'''
models = [ddp() for _ in range(5)]  # every constructor broadcasts: built up front, on every rank
call("rank1_bad_argument", models[0], os.path.join(tmp, "a", "plan.json"),
     max_grad_norm=-1.0 if rank == 1 else None)
call("ranks12_fail", models[1], os.path.join(tmp, "b", "plan.json"), iterations=0 if rank else 5)
call("rank2_no_path", models[2], "" if rank == 2 else os.path.join(tmp, "c", "plan.json"))
call("rank1_other_lr", models[3], os.path.join(tmp, "d", "plan.json"), lr=0.2 if rank == 1 else 0.1)
call("all_ok", models[4], os.path.join(tmp, "ok", "plan.json"), train=2)
dist.barrier()
os._exit(0)  # no teardown: see test_trainer.py's _EXCHANGE_JOB
'''


def test_any_ranks_failure_in_write_plan_is_raised_on_every_rank_and_no_plan_is_written(tmp_path):
    """Every rank's outcome counts: where a rank other than 0 fails alone in write_plan
    (its own arguments, its own checks) or the ranks describe different jobs (rank 1's
    optimizer has another lr), every rank raises TrainerError in seconds naming the
    rank(s) and the first error, and rank 0 writes no plan. The old code's rank 0 wrote
    the plan and went on (into the first allreduce, until the process group's timeout),
    the job then training with a plan that did not describe every rank."""
    got = _run_job(tmp_path, _ANY_RANK_FAILS_JOB, 3)
    bad_norm = "max_grad_norm must be a finite number > 0 or null, not -1.0"
    assert got[1]["rank1_bad_argument"][:3] == ["raised", "TrainerError", bad_norm]
    for r in (0, 2):
        assert got[r]["rank1_bad_argument"][:3] == ["raised", "TrainerError", f"write_plan failed on rank 1: {bad_norm}"]
    bad_it = "iterations must be an integer >= 1 (or None), not 0"
    assert got[1]["ranks12_fail"][:3] == got[2]["ranks12_fail"][:3] == ["raised", "TrainerError", bad_it]
    assert got[0]["ranks12_fail"][:3] == ["raised", "TrainerError", f"write_plan failed on ranks 1, 2 (rank 1: {bad_it})"]
    no_path = "path must be a file path, not ''"
    assert got[2]["rank2_no_path"][:3] == ["raised", "TrainerError", no_path]
    for r in (0, 1):
        assert got[r]["rank2_no_path"][:3] == ["raised", "TrainerError", f"write_plan failed on rank 2: {no_path}"]
    differ = ("the ranks describe different jobs: rank 1 differs from rank 0 in its optimizer (the plan would be "
              "rank 0's: every rank builds the same model, optimizer and scheduler and passes write_plan the same "
              "arguments)")
    for r in range(3):
        assert got[r]["rank1_other_lr"][:3] == ["raised", "TrainerError", differ], (r, got[r]["rank1_other_lr"])
        assert got[r]["all_ok"][:2] == ["returned", "Plan"], (r, got[r]["all_ok"])
    for d in "abcd":
        assert not (tmp_path / d).exists(), d  # neither the plan nor the initial state: nothing agreed on
    written = load_plan(tmp_path / "ok" / "plan.json")
    assert (tmp_path / "ok" / "init.pt").exists() and not written.rebuilt_learn and written.buckets_rebuilt
    assert written.optimizer.groups[0]["lr"] == 0.1


_CALL_COUNTS_JOB = r'''
a, b = ddp(), ddp()
call("together", a, os.path.join(tmp, "a", "plan.json"))
if rank == 0:  # a second call the other rank does not make: it goes on to train
    call("rank0_again", b, os.path.join(tmp, "b", "plan.json"))
a(torch.randn(3, 4)).sum().backward()  # rank 1 waited for rank 0 here: in step again
if rank == 0:  # now rank 0 alone calls: rank 1 never comes (told from a slow rank only by the timeout)
    dist.distributed_c10d._get_default_store().set_timeout(datetime.timedelta(seconds=2))
    call("rank0_alone", b, os.path.join(tmp, "c", "plan.json"))
dist.barrier()
os._exit(0)  # no teardown: see test_trainer.py's _EXCHANGE_JOB
'''


def test_unequal_write_plan_call_counts_fail_with_a_clear_error(tmp_path):
    """Keys are per call, so every rank calls write_plan equally often. A rank that makes
    a call the others do not, after they went on to train, raises at once saying so
    (the old code's rank 0 wrote the plan and returned); a rank whose call the others
    never make waits up to the store's timeout and names whom it waited for and the key
    (the old code raised the store's bare DistStoreError)."""
    got = _run_job(tmp_path, _CALL_COUNTS_JOB, 2)
    assert got[0]["together"][:2] == got[1]["together"][:2] == ["returned", "Plan"]
    assert got[0]["rank0_again"][:3] == [
        "raised", "TrainerError", "rank 1 went on to train after 1 write_plan call, while rank 0 made call 2 without "
        "training in between: every rank calls write_plan equally often, at the same points (as with a collective)"]
    alone = got[0]["rank0_alone"]
    assert alone[:2] == ["raised", "TrainerError"], alone
    assert alone[2].startswith("rank 0 had no word from rank 1 on whether they could exchange addresses (c10d store "
                               "key 'ckptd/write_plan/0,1/2/exchange_addresses/1', waited up to 2 s; every rank calls "
                               "write_plan, equally often): "), alone
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert "rank0_again" not in got[1] and "rank0_alone" not in got[1]


def _step(model, opt, micro: int, sync_all: bool):
    for j in range(micro):
        if sync_all or j == micro - 1:
            model(torch.randn(3, 4)).sum().backward()
        else:
            with model.no_sync():
                model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_an_accumulation_the_plan_does_not_declare_is_refused_at_its_step(world_of_two, tmp_path):
    """A loop that accumulates 3 micro-batches without no_sync() allreduces 3 times a step:
    with the default allreduces_per_step=1 every replay stepped each round, 15 iterations
    committed for 5 steps, all wrong (helper 72). Now the first such step is refused on
    the trainer; no_sync() accumulation, a declared K and an evaluation forward under grad
    (no backward) pass."""
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ct.write_plan(model, opt, tmp_path / "a" / "plan.json", addresses=world_of_two)
    _step(model, opt, 3, sync_all=False)  # no_sync for all but the last: one round
    model(torch.randn(3, 4))  # evaluation with grad on, no backward: not a round
    _step(model, opt, 1, sync_all=True)
    with pytest.raises(ct.TrainerError, match="follows 3 synchronising backward passes .* allreduces_per_step=3"):
        _step(model, opt, 3, sync_all=True)
    declared = _ddp()
    opt = torch.optim.SGD(declared.parameters(), lr=0.1)
    ct.write_plan(declared, opt, tmp_path / "b" / "plan.json", allreduces_per_step=3, addresses=world_of_two)
    _step(declared, opt, 3, sync_all=True)
    with pytest.raises(ct.TrainerError, match="follows 1 synchronising"):
        _step(declared, opt, 1, sync_all=True)


def test_with_a_grad_scaler_the_rounds_are_counted_at_its_update(world_of_two, tmp_path):
    """With a GradScaler a skipped step (inf) calls no optimizer.step(), so the count was
    not checked at all, and an undeclared accumulation under AMP committed wrong
    checkpoints. It now ends at scaler.update(), which runs once a step, skipped or not."""
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    ct.write_plan(model, opt, tmp_path / "a" / "plan.json", scaler=scaler, addresses=world_of_two)

    def amp_step(micro: int, inf: bool = False):
        for _ in range(micro):
            loss = model(torch.randn(3, 4)).sum() * (float("inf") if inf else 1.0)
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    amp_step(1, inf=True)  # skipped: no optimizer.step(), one round, counted at the update
    assert scaler.get_scale() == 8.0  # (it was skipped: the scale backed off)
    amp_step(1)
    with pytest.raises(ct.TrainerError, match="follows 2 synchronising backward passes .* allreduces_per_step=2"):
        amp_step(2)


def _clip_norm(max_norm, norm_type=2.0):
    return lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type=norm_type)


def _clip_value(v):
    return lambda ps: torch.nn.utils.clip_grad_value_(ps, v)


def _halve(ps):
    for p in ps:
        p.grad.mul_(0.5)


_GRADS = r"the gradients at this optimizer step are not the reduced ones as the plan transforms them: "


@pytest.mark.parametrize("declared, loop, match", [
    # declared, and the loop does not clip (or with a larger bound): the shadow clipped what the trainer did not
    ({"max_grad_norm": 0.05}, None,
     _GRADS + r"their 2-norm is \S+ where the plan's clip_grad_norm_\(model\.parameters\(\), 0\.05\) "
              r"leaves 0\.05; the loop clips otherwise than write_plan was told"),
    ({"max_grad_norm": 0.05}, _clip_norm(1.0), r"their 2-norm is 1 where the plan's clip_grad_norm_"),
    # a smaller bound than declared: within the declared bound, and still not what the shadow does
    ({"max_grad_norm": 0.05}, _clip_norm(0.01), r"their 2-norm is 0\.01 where .* leaves 0\.05"),
    # another norm than declared
    ({"max_grad_norm": 0.05, "grad_norm_type": "inf"}, _clip_norm(0.05),
     r"their inf-norm is \S+ where the plan's clip_grad_norm_\(model\.parameters\(\), 0\.05, norm_type=inf\) "
     r"leaves 0\.05"),
    ({"clip_grad_value": 0.01}, None,
     r"their 2-norm is \S+ where the plan's clip_grad_value_\(model\.parameters\(\), 0\.01\) leaves"),
    # clipping write_plan was not told of, and an edit of .grad: the shadow would step the reduced gradients
    ({}, _clip_norm(0.05), r"their 2-norm is 0\.05 where the plan's no clipping leaves \S+; the loop clips otherwise"),
    ({}, _clip_value(0.01), r"where the plan's no clipping leaves"),
    ({}, _halve, r"where the plan's no clipping leaves .* or changes \.grad itself"),
    # AMP with a GradScaler write_plan was not given: the wire carries scaled gradients
    ({}, "amp", r"where the plan's no clipping leaves .*, unscales them with a GradScaler write_plan was not "
                r"given \(scaler=\)"),
])
def test_gradients_changed_otherwise_than_the_plan_says_are_refused_at_the_step(world_of_two, tmp_path, declared,
                                                                                loop, match):
    """The gradients a step takes must be the reduced ones as the plan transforms them.
    Before, a declared max_grad_norm was checked as an upper bound only, and nothing at all
    was checked without one: a loop that clipped (by norm or by value) without telling
    write_plan, clipped with a smaller bound than declared, scaled .grad, or stepped
    through a GradScaler write_plan was not given had every checkpoint wrong and reported
    good. Two steps done as declared pass first."""
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ct.write_plan(model, opt, tmp_path / "a" / "plan.json", addresses=world_of_two, **declared)
    as_declared = (_clip_norm(declared["max_grad_norm"], declared.get("grad_norm_type", 2.0))
                   if "max_grad_norm" in declared else
                   _clip_value(declared["clip_grad_value"]) if "clip_grad_value" in declared else None)
    for _ in range(2):  # clipped as declared: no word
        (model(torch.randn(3, 4)) * 100).sum().backward()
        if as_declared is not None:
            as_declared(model.parameters())
        opt.step()
        opt.zero_grad()
    if loop == "amp":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scaler.scale((model(torch.randn(3, 4)) * 100).sum()).backward()
        with pytest.raises(ct.TrainerError, match=match):
            scaler.step(opt)
        return
    (model(torch.randn(3, 4)) * 100).sum().backward()
    if loop is not None:
        loop(model.parameters())
    with pytest.raises(ct.TrainerError, match=match):
        opt.step()


@pytest.mark.parametrize("declared, clip", [
    ({}, None), ({"max_grad_norm": 0.05}, _clip_norm(0.05)), ({"max_grad_norm": 1e6}, _clip_norm(1e6)),
    ({"max_grad_norm": 0.05, "grad_norm_type": 1}, _clip_norm(0.05, 1)),
    ({"clip_grad_value": 0.01}, _clip_value(0.01)),
])
@pytest.mark.parametrize("amp", [False, True])
def test_loops_that_do_what_the_plan_says_step_without_a_word(world_of_two, tmp_path, declared, clip, amp):
    """The check at the step on loops that do as declared, with a GradScaler too (its
    unscale_ before the clipping, an overflow that skips a step), micro-batches under
    no_sync(), and a step without a backward before it: never a false refusal."""
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1) if amp else None
    ct.write_plan(model, opt, tmp_path / "a" / "plan.json", scaler=scaler, addresses=world_of_two, **declared)
    hooks = len(opt._optimizer_step_pre_hooks)
    for step in range(10):
        with model.no_sync():
            (model(torch.randn(3, 4)) * 100).sum().backward()
        loss = (model(torch.randn(3, 4)) * (float("inf") if amp and step == 3 else 100)).sum()
        (scaler.scale(loss) if amp else loss).backward()
        if amp:
            scaler.unscale_(opt)
        if clip is not None:
            clip(model.parameters())
        if amp:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    opt.step()  # no gradients, no backward: nothing to check
    assert len(opt._optimizer_step_pre_hooks) == hooks - 1  # 8 steps checked (one skipped): the check is gone


def test_two_models_trained_on_one_process_group_are_refused(world_of_two, tmp_path):
    """Two DDP models on the default group, each with its plan, trained by turns: their
    bucket allreduces interleave on one wire, and the replay of either plan committed 8
    iterations for a 4-step job, all but the first wrong, exit 0 (helper 72). Now the first
    forward that goes back to a model after the other trained is refused. One model
    trained after another, and a model on a group of its own, are let be."""
    a, b = _ddp(), _ddp()
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    ct.write_plan(a, opt_a, tmp_path / "a" / "plan.json", addresses=world_of_two)
    ct.write_plan(a, opt_a, tmp_path / "a2" / "plan.json", addresses=world_of_two)  # the same model again
    ct.write_plan(b, opt_b, tmp_path / "b" / "plan.json", addresses=world_of_two)
    _step(a, opt_a, 1, sync_all=True)
    with torch.no_grad():
        b(torch.randn(3, 4))  # an evaluation: no allreduce
    _step(b, opt_b, 1, sync_all=True)  # b after a: one phase after another, let be
    with pytest.raises(ct.TrainerError, match=r"another DDP model \(its plan: .*b.plan.json\) trains on the "
                                              "same process group by turns with this one"):
        _step(a, opt_a, 1, sync_all=True)  # a again: by turns
    own = dist.new_group([0], backend="gloo")
    c = torch.nn.parallel.DistributedDataParallel(_net(), process_group=own)
    opt_c = torch.optim.SGD(c.parameters(), lr=0.1)
    ct.write_plan(c, opt_c, tmp_path / "c" / "plan.json", addresses=world_of_two)
    _step(c, opt_c, 1, sync_all=True)
    _step(b, opt_b, 1, sync_all=True)
