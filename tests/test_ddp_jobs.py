"""Real DDP jobs people run, on gloo over TCP, each captured and replayed bit-exact.

Each job is scripts/ddp_gloo_train.py (3 ranks, a ~70 K-parameter MLP, 10 iterations)
run in a network namespace of its own (so tcpdump on its lo sees only this job), with
the plan written by ckptd.torch.write_plan inside the training script. Every iteration
the shadow commits must equal rank 0's own state bit for bit: parameters, optimizer
state, and the GradScaler's scale and growth tracker. Features are combined into a few
jobs to keep the suite short:

    sgd:   SGD momentum + nesterov + weight decay, two param groups (no decay on biases
           and norms), StepLR, clip_grad_norm_
    amp:   AdamW, fp16 autocast with a GradScaler (skipped steps, backoff and growth),
           the fp16 compression hook, gradient accumulation under no_sync, CosineAnnealingLR
    rmsprop: RMSprop with momentum, two groups, OneCycleLR (it also cycles momentum)
    adagrad: Adagrad (state created at construction), two groups, MultiStepLR,
             clip_grad_norm_ with norm_type=inf
    nadam:   NAdam (its mu_product state), LinearLR, clip_grad_value_
    handlr:  SGD momentum, two groups, each group's lr set by hand every step (no
             scheduler object; write_plan(lr_per_step=...))
    batchnorm: SGD with a BatchNorm1d: DDP's buffer broadcasts decoded into the checkpoints
    every_micro: AdamW, 3 micro-batches per step each allreduced (no no_sync), BatchNorm, StepLR
    lossy: AdamW on a larger model, captured once and split into two mirror copies that
           each lose 2% of frames independently

    bf16:    AdamW with bf16 parameters (no hook): the plain allreduce carries bf16
DDP refuses the bf16 compression hook without CUDA and NCCL, so the bf16 hook is
tested through the RoCE path with synthesized traffic (tests/test_replay_synth.py).
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptd.core.checkpoint import checkpoint_name, load_checkpoint

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 10

JOBS = {
    "sgd": ["--optimizer", "SGD", "--lr", "0.05", "--momentum", "0.9", "--nesterov",
            "--weight-decay", "0.01", "--no-decay-group", "--scheduler", "StepLR:step_size=3,gamma=0.5",
            "--clip", "0.5"],
    "amp": ["--optimizer", "AdamW", "--lr", "0.003", "--amp", "--init-scale", "1048576",
            "--growth-interval", "3", "--hook", "fp16", "--accumulate", "2",
            "--scheduler", "CosineAnnealingLR:T_max=10,eta_min=0.0001"],
    # a 1.8 M-parameter MLP: 7.3 MB allreduces, many segments per gloo message
    "lossy": ["--size", "small", "--optimizer", "AdamW"],
    # clip_grad_norm_ by the largest |g| (norm_type=inf)
    "adagrad": ["--optimizer", "Adagrad", "--lr", "0.01", "--no-decay-group",
                "--scheduler", "MultiStepLR:milestones=[3,6],gamma=0.5", "--clip", "0.02", "--norm-type", "inf"],
    # clip_grad_value_
    "nadam": ["--optimizer", "NAdam", "--lr", "0.002", "--scheduler", "LinearLR:start_factor=0.5,total_iters=5",
              "--clip-value", "0.002"],
    # plain SGD (momentum 0): torch keeps no per-parameter state at all
    "sgdplain": ["--optimizer", "SGD", "--lr", "0.05"],
    # the trainer's own allreduce of the loss on DDP's group, every step
    "lossreduce": ["--optimizer", "SGD", "--lr", "0.05", "--momentum", "0.9", "--allreduce-loss"],
    # the same, the plan listing it (write_plan's collectives)
    "lossreduce_listed": ["--optimizer", "SGD", "--lr", "0.05", "--momentum", "0.9", "--allreduce-loss", "listed"],
    # no scheduler: the loop writes each group's lr by hand, the plan holds the values
    "handlr": ["--optimizer", "SGD", "--lr", "0.05", "--momentum", "0.9", "--no-decay-group",
               "--lr-by-hand", "0.8"],
    # bf16 parameters (not a hook): the plain allreduce carries bf16
    "bf16": ["--optimizer", "AdamW", "--lr", "0.01", "--dtype", "bfloat16"],
    "rmsprop": ["--optimizer", "RMSprop", "--lr", "0.001", "--momentum", "0.5", "--no-decay-group",
                "--scheduler", "OneCycleLR:max_lr=0.01,total_steps=12"],
    "batchnorm": ["--optimizer", "SGD", "--lr", "0.05", "--momentum", "0.9", "--batchnorm"],
    # a tied weight (fc2.weight also fc2t.weight): one parameter, two state_dict names
    "tied": ["--optimizer", "AdamW", "--lr", "0.003", "--no-decay-group", "--tie"],
    "every_micro": ["--optimizer", "AdamW", "--lr", "0.003", "--accumulate", "3",
                    "--allreduce-every-micro-batch", "--batchnorm", "--scheduler", "StepLR:step_size=4,gamma=0.5"],
}


def _why_not() -> str | None:
    import os
    if os.geteuid() != 0:
        return "needs root for a network namespace and tcpdump"
    for tool in ("tcpdump", "unshare", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def run_captured_job(out: Path, args: list[str], iterations: int = ITERATIONS) -> tuple[Path, Path]:
    """Run scripts/ddp_gloo_train.py in a new network namespace while tcpdump writes
    its lo to out/lo.pcap. Returns (run directory, capture)."""
    out.mkdir(parents=True, exist_ok=True)
    pcap, err = out / "lo.pcap", out / "tcpdump.err"
    train = [sys.executable, str(REPO / "scripts" / "ddp_gloo_train.py"), "--world", "3",
             "--iterations", str(iterations), "--size", "tiny", "--port", "31577",
             "--out", str(out / "run"), *args]
    script = (f"ip link set lo up; tcpdump -i lo -s 0 -B 262144 -U --immediate-mode -w {pcap} tcp 2>{err} & T=$!; "
              f"sleep 1; {' '.join(_q(a) for a in train)}; rc=$?; sleep 0.5; "
              "kill -INT $T; wait $T; exit $rc")
    # a network namespace per job: its lo carries this job's traffic and nothing else.
    # --immediate-mode: each packet is handed over as it comes; without it a ring block
    # waits up to its timeout (1 s), and the SIGINT 0.5 s after the job lost the job's
    # last packets with it (test_unused's capture, iterations 4-5, once in a full CI)
    r = subprocess.run(["unshare", "--net", "sh", "-c", script],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"training failed ({r.returncode}):\n{r.stderr[-3000:]}")
    (out / "train.err").write_text(r.stderr)  # the ranks' warnings
    dropped = [ln for ln in err.read_text().splitlines() if "dropped by kernel" in ln]
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    return out / "run", pcap


def _q(a: str) -> str:
    import shlex
    return shlex.quote(a)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    why = _why_not()
    if why:
        pytest.skip(f"real DDP jobs skipped: {why}")
    base = Path(subprocess.check_output(["mktemp", "-d", "/dev/shm/ckptd-ddpjobs.XXXXXX"], text=True).strip())
    made = {}

    def get(name):
        if name not in made:
            made[name] = run_captured_job(base / name, JOBS[name])
        return made[name]
    yield get
    shutil.rmtree(base, ignore_errors=True)


def _replay_exact(run: Path, pcap: Path):
    from ckptd.core.plan import load_plan
    from ckptd.pipeline import ReplayOptions, replay
    plan = load_plan(run / "plan.json")
    pipe = replay(plan, [str(pcap)], load_checkpoint(run / "init.pt"),
                  ReplayOptions(reference=str(run / "rank0")))
    reps = list(pipe.reports)
    assert [r.iteration for r in reps] == list(range(ITERATIONS)), [(r.iteration, r.note) for r in reps]
    bad = [(r.iteration, r.status, r.exact, r.note) for r in reps if not (r.status == "committed" and r.exact)]
    assert not bad, (bad, pipe.extract.examples)
    return plan, pipe


def test_sgd_nesterov_two_groups_steplr_clipping(jobs):
    run, pcap = jobs("sgd")
    plan, pipe = _replay_exact(run, pcap)
    opt = plan.optimizer
    assert opt.kind == "sgd" and len(opt.groups) == 2 and opt.max_grad_norm == 0.5
    assert opt.groups[0]["nesterov"] and opt.groups[1]["weight_decay"] == 0.0
    assert opt.lr_scheduler == {"class": "StepLR", "args": {"step_size": 3, "gamma": 0.5}}
    assert plan.transport == "gloo" and plan.buckets_rebuilt != plan.buckets_first  # rewritten in iteration 1
    lrs = [load_checkpoint(run / "rank0" / checkpoint_name(i))["optimizer"]["lr"] for i in range(ITERATIONS)]
    assert lrs[0] == 0.05 and lrs[3] == 0.025 and lrs[9] == 0.05 / 8  # the schedule did move


def test_amp_fp16_hook_accumulation_cosine(jobs):
    run, pcap = jobs("amp")
    plan, pipe = _replay_exact(run, pcap)
    assert plan.comm_hook == "fp16_compress" and plan.bucket_dtype(plan.buckets_first[0]) == "float16"
    assert plan.optimizer.grad_scaler["growth_interval"] == 3
    scales = [float(load_checkpoint(run / "rank0" / checkpoint_name(i))["optimizer"]["grad_scaler"]["scale"])
              for i in range(ITERATIONS)]
    # the job really skipped steps and backed off, and grew the scale again
    assert any(b < a for a, b in zip(scales, scales[1:])) and scales[0] < 1048576
    assert any(b > a for a, b in zip(scales, scales[1:])), scales


def test_rmsprop_two_groups_onecycle(jobs):
    run, pcap = jobs("rmsprop")
    plan, pipe = _replay_exact(run, pcap)
    assert plan.optimizer.kind == "rmsprop" and len(plan.optimizer.groups) == 2
    assert plan.optimizer.lr_scheduler["class"] == "OneCycleLR"


@pytest.mark.parametrize("name", ["adagrad", "nadam", "sgdplain"])
def test_more_torch_optimizers_on_real_jobs(jobs, name):
    """adagrad clips by the largest |g| (clip_grad_norm_'s norm_type=inf), nadam by value
    (clip_grad_value_): before, write_plan and the plan knew the 2-norm only.
    sgdplain: the shadow's state held an empty entry per parameter where torch's holds
    none, so every iteration of a plain SGD job was reported NOT bit-exact (helper 72)."""
    run, pcap = jobs(name)
    plan, pipe = _replay_exact(run, pcap)
    assert plan.optimizer.kind == name.removesuffix("plain")
    clip = {"adagrad": (0.02, math.inf, None), "nadam": (None, 2.0, 0.002), "sgdplain": (None, 2.0, None)}[name]
    opt = plan.optimizer
    assert (opt.max_grad_norm, opt.grad_norm_type, opt.clip_grad_value) == clip
    if name != "sgdplain":  # the clipping changed every step's gradients, so it had to be replayed
        assert json.loads((run / "ddp.json").read_text())["clipped_steps"] == ITERATIONS
    state = load_checkpoint(run / "rank0" / checkpoint_name(ITERATIONS - 1))["optimizer"]["state"]
    if name == "sgdplain":
        assert state == {}
        return
    assert {"adagrad": {"step", "sum"}, "nadam": {"step", "mu_product", "exp_avg", "exp_avg_sq"}}[name] \
        == set(next(iter(state.values())))


def test_a_tied_weights_export_loads_strictly_into_the_trainers_model(jobs, tmp_path):
    """A tied weight is one parameter to DDP and the plan; the export held it under its
    first name only, so the trainer's model.load_state_dict(strict=True) failed on the
    second ("Missing key(s): fc2t.weight"). The plan now records the other name and the
    torch and DCP exports write both, as one tensor; reading an export back (verify) takes
    them as the one parameter."""
    import argparse

    import torch
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(REPO / "scripts"))
    from ddp_gloo_train import build, make_optimizer
    run, pcap = jobs("tied")
    plan, _ = _replay_exact(run, pcap)
    assert plan.tied == (("fc2t.weight", "fc2.weight"),)
    assert "fc2t.weight" not in [p.name for p in plan.parameters]
    last = run / "rank0" / checkpoint_name(ITERATIONS - 1)
    for fmt in ("torch", "dcp"):
        out = tmp_path / f"export.{fmt}"
        r = subprocess.run([sys.executable, "-m", "ckptd", "export", str(last), "--format", fmt,
                            "--out", str(out), "--plan", str(run / "plan.json")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        model = build("tiny", 1, tie=True)  # another seed: every value must come from the file
        opt = make_optimizer(model, argparse.Namespace(no_decay_group=True, lr=0.003, weight_decay=0.01,
                                                       optimizer="AdamW", momentum=0.0, nesterov=False))
        if fmt == "torch":
            doc = torch.load(out, weights_only=True)
        else:
            doc = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            dcp.load(doc, checkpoint_id=str(out))
        model.load_state_dict(doc["model"], strict=True)
        assert model.fc2t.weight is model.fc2.weight
        opt.load_state_dict(doc["optimizer"])
        ref = load_checkpoint(last)
        for n, t in model.state_dict().items():
            assert torch.equal(t, ref["model"]["fc2.weight" if n == "fc2t.weight" else n]), n
        r = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(out), str(last)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_batchnorm_buffers_from_ddps_broadcast_equal_rank0s(jobs, tmp_path):
    """Checkpoint k holds rank 0's buffers after forward k, which DDP broadcasts at the
    start of forward k+1: every iteration but the last commits with parameters,
    optimizer state and buffers bit-exact; the last (no later forward) is not committed."""
    import torch

    import ckptd
    from ckptd.core.plan import load_plan
    from ckptd.pipeline import ReplayOptions, replay
    sys.path.insert(0, str(REPO / "scripts"))
    from ddp_gloo_train import build
    run, pcap = jobs("batchnorm")
    plan = load_plan(run / "plan.json")
    assert plan.buffers.captured and [list(b) for b in plan.buffers.broadcasts] == \
        [["bn.running_mean", "bn.running_var"], ["bn.num_batches_tracked"]]
    pipe = replay(plan, [str(pcap)], load_checkpoint(run / "init.pt"),
                  ReplayOptions(reference=str(run / "rank0"), out=str(tmp_path / "ckpts")))
    reps = {r.iteration: r for r in pipe.reports}
    assert sorted(reps) == list(range(ITERATIONS))
    bad = [(i, r.status, r.exact, r.note) for i, r in reps.items()
           if i < ITERATIONS - 1 and not (r.status == "committed" and r.exact)]
    assert not bad, (bad, pipe.extract.examples)
    last = reps[ITERATIONS - 1]
    assert last.status == "unrecoverable" and "module buffers" in last.note
    mine = load_checkpoint(tmp_path / "ckpts" / checkpoint_name(ITERATIONS - 2))
    ref = load_checkpoint(run / "rank0" / checkpoint_name(ITERATIONS - 2))
    assert int(mine["model"]["bn.num_batches_tracked"]) == ITERATIONS - 1  # one per forward
    assert torch.equal(mine["model"]["bn.running_var"], ref["model"]["bn.running_var"])
    # a trainer's strict load takes the checkpoint whole: nothing is left unrestored
    model = build("tiny", 0, batchnorm=True)
    r = ckptd.restore(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                      tmp_path / "ckpts" / checkpoint_name(ITERATIONS - 2))
    assert r.buffers_not_restored == [] and r.iteration == ITERATIONS - 2
    model.load_state_dict(mine["model"], strict=True)
    # `ckptd plan --model` of the plain model lists the buffers as write_plan did from DDP
    from ckptd.torch import model_buffers
    assert model_buffers(build("tiny", 0, batchnorm=True)) == plan.buffers


def test_buffer_broadcast_copies_that_disagree_commit_no_buffers(jobs, tmp_path, monkeypatch):
    """One receiver's copy of DDP's broadcast of the buffers after iteration 0, changed:
    the first copy to arrive was committed (the other only named among the examples), and
    as a mirror copy beside the true capture it was never compared, so the order of the
    files decided which buffers the checkpoint held."""
    from ckptd.core.plan import load_plan
    from ckptd.pipeline import ReplayOptions, replay
    from ckptd.transports.gloo.extract import GlooExtractor
    from tests.helpers import patch_tcp_bytes
    run, pcap = jobs("batchnorm")
    seen = []  # (tag, direction, first byte) of every buffer broadcast copy
    keep = GlooExtractor._keep_copy

    def spy(self, key, m, payloads, spans, clash, what):
        if what == "buffer broadcast":
            seen.append((m.header.tag, key, m.offset))
        return keep(self, key, m, payloads, spans, clash, what)
    monkeypatch.setattr(GlooExtractor, "_keep_copy", spy)

    def go(paths):
        return replay(load_plan(run / "plan.json"), [str(p) for p in paths], load_checkpoint(run / "init.pt"),
                      ReplayOptions(reference=str(run / "rank0")))
    tags = go([pcap]).extract._buffer_tags(0)
    _, key, lo = min(s for s in seen if s[0] == tags[0])
    bad = patch_tcp_bytes(pcap, tmp_path / "buffers.pcap", key, lo + 48, b"\x7f\x7f\x7f\x7f")
    for paths in ([bad], [pcap, bad], [bad, pcap]):
        reps = {r.iteration: r for r in go(paths).reports}
        assert reps[0].status == "conflict" and "module buffers after iteration 0: copies of DDP's broadcast" \
            in reps[0].note, (paths, reps[0].note)
        assert all(reps[i].status == "committed" and reps[i].exact for i in range(1, ITERATIONS - 1)), \
            [(i, r.status, r.note) for i, r in reps.items()]


def test_accumulation_with_an_allreduce_every_micro_batch(jobs):
    """DDP allreduces param.grad (the last reduced value plus this micro-batch's) every
    micro-batch; the step uses the third round of each step, and the buffers broadcast
    after it (every forward broadcasts here)."""
    from ckptd.core.plan import load_plan
    from ckptd.pipeline import ReplayOptions, replay
    run, pcap = jobs("every_micro")
    plan = load_plan(run / "plan.json")
    assert plan.allreduces_per_step == 3 and plan.buffers.captured
    pipe = replay(plan, [str(pcap)], load_checkpoint(run / "init.pt"), ReplayOptions(reference=str(run / "rank0")))
    reps = {r.iteration: r for r in pipe.reports}
    assert sorted(reps) == list(range(ITERATIONS))
    bad = [(i, r.status, r.exact, r.note) for i, r in reps.items()
           if i < ITERATIONS - 1 and not (r.status == "committed" and r.exact)]
    assert not bad, (bad, pipe.extract.examples)
    # every step's last round (the rebuilt layout, even in step 0) was placed; the
    # other two rounds were checked against the ring schedule, not placed
    from ckptd.core.schedule import AG
    ex = pipe.extract
    per_round = sum(1 for per in ex.sched[1].sends.values() for sends in per for snd in sends if snd.phase == AG)
    assert ex.counters["earlier_micro_batch_messages"] > 0
    assert ex.counters["ag_messages"] - ex.counters["earlier_micro_batch_messages"] == ITERATIONS * per_round
    ref = load_checkpoint(run / "rank0" / checkpoint_name(ITERATIONS - 2))
    assert int(ref["model"]["bn.num_batches_tracked"]) == 3 * (ITERATIONS - 1)  # a forward per micro-batch
    # the same capture read as one step per allreduce round does not match rank 0
    import dataclasses
    wrong = replay(dataclasses.replace(load_plan(run / "plan.json"), allreduces_per_step=1), [str(pcap)],
                   load_checkpoint(run / "init.pt"), ReplayOptions(reference=str(run / "rank0")))
    assert any(r.exact is False for r in wrong.reports)


def test_cli_replays_a_plan_written_by_the_training_script(jobs, tmp_path):
    run, pcap = jobs("sgd")
    _every_iteration_exact(_cli_replay(run / "plan.json", run, pcap, tmp_path / "ckpts"))


def _cli_replay(plan: Path, run: Path, pcap: Path, out: Path) -> subprocess.CompletedProcess:
    """`ckptd replay` of a job's capture, rank 0's checkpoints as the reference."""
    return subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(plan), "--init",
                           str(run / "init.pt"), "--out", str(out), "--reference", str(run / "rank0"), str(pcap)],
                          capture_output=True, text=True, timeout=300)


def _every_iteration_exact(r: subprocess.CompletedProcess):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"{ITERATIONS} iterations, {ITERATIONS} committed, 0 not recovered" in r.stdout
    assert r.stdout.count("bit-exact") == ITERATIONS and "NOT bit-exact" not in r.stdout


def test_a_collective_of_the_job_on_ddps_group_is_named(jobs, tmp_path):
    """The loss allreduced each step on DDP's group (a common logging pattern) takes a
    bucket's place in gloo's count: every other iteration was unrecoverable, with "4 bytes,
    the schedule says N" among the rejects, and the error blamed the init (helper 72).
    Never a wrong commit; now the warning names the job's own collectives. (It was an error,
    the loss rounds counted as iterations past the plan's 10, and iteration 0's commit set
    aside as suspect: the count now stops at the first allreduce that breaks the schedule,
    the loss's, and iteration 0 is before it.)"""
    run, pcap = jobs("lossreduce")
    # write_plan told the job itself, once on each rank, at its own call
    warned = [ln for ln in (run.parent / "train.err").read_text().splitlines() if "RuntimeWarning: ckptd:" in ln]
    assert len(warned) == 3 and all("ddp_gloo_train.py" in ln and "an allreduce of 1 float32 on DDP's process group "
                                    "(after 1 round of gradient allreduces) is not in write_plan's collectives"
                                    in ln for ln in warned), warned
    r = _cli_replay(run / "plan.json", run, pcap, tmp_path / "ckpts")
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert "NOT bit-exact" not in r.stdout and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("warning: 9 iteration(s) not recovered") and \
        "the job's collectives on DDP's process group are not the ones the plan lists" in r.stderr, r.stderr
    assert "10 iterations, 1 committed" in r.stdout and r.stdout.count(" bit-exact") == 1
    assert "does not fit the plan's schedule (4 bytes where it says" in r.stdout
    assert [p.name for p in (tmp_path / "ckpts").glob("*.pt")] == ["iter_000000.pt"]


def test_a_collective_of_the_job_listed_in_the_plan_is_skipped_on_gloo(jobs, tmp_path):
    """The same job, its loss allreduce listed by write_plan(collectives=...) as an NCCL
    plan lists one: gloo's count skips it every round, its messages are checked against
    its size and never placed, and every iteration commits bit-exact. Listed twice where
    the job runs one, the sizes say so at once: no wrong commit."""
    from ckptd.core.plan import load_plan
    from ckptd.pipeline import ReplayOptions, replay
    run, pcap = jobs("lossreduce_listed")
    assert "RuntimeWarning: ckptd:" not in (run.parent / "train.err").read_text()
    doc = json.loads((run / "plan.json").read_text())
    assert doc["collectives"] == {"after": [{"op": "allreduce", "count": 1, "dtype": "float32"}]}
    r = _cli_replay(run / "plan.json", run, pcap, tmp_path / "ckpts")
    _every_iteration_exact(r)
    assert "schedule_mismatch" not in r.stdout and f"own_allreduce_messages={4 * ITERATIONS}" in r.stdout
    doc["collectives"]["after"] *= 2
    (tmp_path / "twice.json").write_text(json.dumps(doc))
    pipe = replay(load_plan(tmp_path / "twice.json"), [str(pcap)], load_checkpoint(run / "init.pt"),
                  ReplayOptions(reference=str(run / "rank0")))
    assert all(r.exact is not False for r in pipe.reports)
    assert sum(r.ok for r in pipe.reports) <= 1 and pipe.extract.counters["schedule_mismatch"] > 0


def test_a_plan_listing_an_allreduce_the_job_does_not_run_commits_nothing_after_it(jobs):
    """The plan lists an allreduce of the job's own after the bucket, which the job does
    not run: iteration 1's bucket was numbered as that one (refused on its size), and
    iteration 2's then placed and committed as iteration 1, NOT bit-exact (one bucket a
    round: every later one fits). A message framed from its direction's start that breaks
    the schedule shows the count is off: nothing from there on is placed or committed."""
    from ckptd.core.plan import plan_from_json
    from ckptd.pipeline import ReplayOptions, replay
    run, pcap = jobs("sgd")
    doc = json.loads((run / "plan.json").read_text())
    assert len(doc["buckets"]["first"]) == 1 and not doc.get("collectives")
    doc["collectives"] = {"after": [{"count": 4, "dtype": "float32"}]}
    pipe = replay(plan_from_json(doc), [str(pcap)], load_checkpoint(run / "init.pt"),
                  ReplayOptions(reference=str(run / "rank0")))
    reps = list(pipe.reports)
    assert reps[0].status == "committed" and reps[0].exact, reps[0].note
    assert all(r.status == "unrecoverable" and "does not fit the plan's schedule" in r.note for r in reps[1:]), \
        [(r.iteration, r.status, r.exact, r.note) for r in reps]
    assert pipe.extract.counters["after_misfit"] > 0


def _copies(pcap: Path, out: Path, loss: float, seeds=(1, 2)) -> tuple[list[str], str, int]:
    """Two mirror copies of a capture, each losing `loss` of the frames independently
    (connection setup kept), and their union: every frame at least one copy has."""
    import random

    from parsers.capfile import open_capture
    from parsers.pcap import PcapWriter
    rngs = [random.Random(s) for s in seeds]
    paths = [out / "copy0.pcap", out / "copy1.pcap", out / "union.pcap"]
    files = [open(p, "wb") for p in paths]
    writers = [PcapWriter(f) for f in files]
    both = 0
    try:
        for fr in open_capture(pcap):
            drop = [fr.index > 60 and r.random() < loss for r in rngs]
            both += all(drop)
            for k in range(2):
                if not drop[k]:
                    writers[k].write(fr.data, fr.ts_ns, fr.origlen)
            if not all(drop):
                writers[2].write(fr.data, fr.ts_ns, fr.origlen)
    finally:
        for f in files:
            f.close()
    return [str(p) for p in paths[:2]], str(paths[2]), both


def test_two_copies_each_losing_2pct_commit_every_iteration_their_union_covers(jobs, tmp_path):
    """One lost gloo preamble costs only the messages it touched: two mirror copies that
    each lose 2% of frames commit every iteration that the union of the two copies
    commits as one stream, and with no frame lost in both, every iteration."""
    from ckptd.core.plan import load_plan
    from ckptd.pipeline import ReplayOptions, replay
    run, pcap = jobs("lossy")
    copies, union, both = _copies(pcap, tmp_path, 0.02)

    def go(paths):
        return replay(load_plan(run / "plan.json"), paths, load_checkpoint(run / "init.pt"),
                      ReplayOptions(reference=str(run / "rank0")))
    merged = go(copies)
    whole = go([union])
    done = [r.iteration for r in merged.reports if r.status == "committed"]
    assert all(r.exact for r in merged.reports if r.status == "committed")
    assert all(r.exact is not False for r in merged.reports)  # never a wrong checkpoint
    assert done == [r.iteration for r in whole.reports if r.status == "committed"]
    # each frame lost in both copies can cost at most the iteration it carried
    assert len(done) >= ITERATIONS - both, ([(r.iteration, r.status, r.note) for r in merged.reports], both)
    # each copy alone did lose gloo framing (a preamble in a lost frame), and each alone
    # cannot commit every iteration: the merge is what recovers them
    for path in copies:
        alone = go([path])
        assert sum(fr.counts["framing_lost"] for fr in alone.extract.framers.values()) > 0
        assert all(r.exact is not False for r in alone.reports)


def test_inspect_shows_the_gloo_conversations(jobs):
    from ckptd.tools.inspect import format_inspect, inspect_captures
    run, pcap = jobs("sgd")
    res = inspect_captures([pcap])
    gloo = [c for c in res["tcp"] if c["gloo"]]
    data = [c for c in gloo if c["gloo"]["collectives"].get("allreduce")]
    # 3 ranks: 3 connections, each carrying allreduce data one way (r -> r-1)
    assert len(data) == 3 and all(c["missing_bytes"] == 0 for c in res["tcp"])
    # the connecting side of each of the 3 connections presents its rank
    seqs = [c["gloo"]["sequence"] for c in gloo if c["gloo"]["sequence"] is not None]
    assert len(seqs) == 3 and all(0 <= q < 3 for q in seqs)
    text = format_inspect(res)
    assert "TCP conversations" in text and "gloo" in text and "allreduce:" in text
    # the sequence number is shown as what it is: inspect has no plan to tell a rank by
    assert all(f"gloo seq {q} " in text for q in seqs) and "gloo rank" not in text


def test_lr_set_by_hand_each_step(jobs):
    run, pcap = jobs("handlr")
    plan, pipe = _replay_exact(run, pcap)
    lrs = plan.optimizer.lr_per_step
    assert plan.optimizer.lr_scheduler is None and len(lrs) == ITERATIONS
    assert lrs[3] == [0.05 * 0.8 ** 3, 0.05 * 0.8 ** 3 / 2]
    last = load_checkpoint(run / "rank0" / checkpoint_name(ITERATIONS - 1))
    assert last["optimizer"]["lr"] == lrs[-1][0]  # rank 0's own lr in its last step


def test_bf16_parameters(jobs):
    run, pcap = jobs("bf16")
    plan, pipe = _replay_exact(run, pcap)
    assert {p.dtype for p in plan.parameters} == {"bfloat16"} and plan.comm_hook == "allreduce"
    last = load_checkpoint(run / "rank0" / checkpoint_name(ITERATIONS - 1))
    assert all(t.dtype == torch.bfloat16 for t in last["model"].values())


def test_a_capture_gap_that_hides_whole_iterations_commits_nothing_after_it(jobs, tmp_path):
    """A run of frames lost on the one stream, as in a capture pause, long enough to hide
    every message of some allreduces. This job's rounds are one bucket each, alike in
    size, so an allreduce counted one place off fits the schedule: the old code
    numbered the first allreduce after the gap as the first one lost, and committed
    later iterations' gradients as earlier ones' (wrong checkpoints, reported good;
    with --resume from the trainer's files, marked committed). Now the count stops at
    the gap: every commit is bit-exact, and the iterations from there on are
    unrecoverable with the reason."""
    from ckptd.core.plan import load_plan
    from ckptd.pipeline import ReplayOptions, replay
    from parsers.capfile import open_capture
    from parsers.pcap import PcapWriter
    run, pcap = jobs("tied")
    frames = list(open_capture(pcap))
    plan = load_plan(run / "plan.json")
    n, stopped = len(frames), 0
    for lo in range(n // 4, 3 * n // 4, n // 16):
        cut = tmp_path / f"gap{lo}.pcap"
        with open(cut, "wb") as f, PcapWriter(f) as w:
            for fr in frames:
                if not lo <= fr.index < lo + n // 6:
                    w.write(fr.data, fr.ts_ns, fr.origlen)
        pipe = replay(plan, [str(cut)], load_checkpoint(run / "init.pt"),
                      ReplayOptions(reference=str(run / "rank0"), resume=str(run / "rank0")))
        reps = list(pipe.reports)
        assert [r.iteration for r in reps] == list(range(ITERATIONS)), lo
        wrong = [r.iteration for r in reps if r.status == "committed" and not r.exact]
        assert not wrong, (lo, wrong)
        first = pipe.extract.unplaced_from()
        if first is not None:
            stopped += 1
            assert all(r.status == "unrecoverable" and "capture gap hid whole collectives" in r.note
                       for r in reps[first:]), (lo, [(r.iteration, r.status, r.note) for r in reps])
    assert stopped > 0  # some gap did hide whole allreduces
