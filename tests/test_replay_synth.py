"""Bit-exact checkpoints, every iteration, from synthesized mirror captures.

Each scenario trains a real (tiny) transformer over N ranks, writes what the mirror
ports would capture with the impairments named, replays the captures and compares the
shadow's checkpoint after every iteration with the trainer's own, bit for bit.
"""
import pytest

from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint

from helpers import run_replay, synth

SCENARIOS = {
    "simple-1ch-2ranks-2mirrors-loss": dict(ranks=2, channels=1, protocol="simple", mtu=1024,
                                             mirrors=2, loss=1e-3),
    "ll-3ch-8ranks-3mirrors-reorder-dup": dict(ranks=8, channels=3, protocol="ll", mtu=4096,
                                               mirrors=3, loss=1e-3, reorder=2e-3, duplicate=2e-3),
    "simple-3ch-8ranks-2mirrors-wrap-retx-corrupt": dict(
        ranks=8, channels=3, protocol="simple", mtu=1024, mirrors=2, loss=1e-3, psn_wrap=True,
        retransmit=0.02, corrupt=1e-3),
    "ll-1ch-2ranks-3mirrors-wrap": dict(ranks=2, channels=1, protocol="ll", mtu=1024, mirrors=3, wrap_mirrors=True,
                                        loss=1e-3, psn_wrap=True, reorder=1e-3),
    "nccl2.20-2qps-shuffled-rings-fused-ipv6": dict(
        ranks=4, channels=3, protocol="simple", mtu=4096, mirrors=3, loss=1e-3,
        nccl_version="2.20", qps=2, shuffle_rings=True, optimizer="fused", ipv6=True),
    "nccl2.19-split-qps-ll-forloop-clip": dict(
        ranks=3, channels=2, protocol="ll", mtu=2048, mirrors=2, loss=1e-3, qps=2,
        optimizer="for-loop", max_grad_norm=0.5, lr_schedule="linear"),
    # jobs beyond AdamW (issue 15): the synthesizer's trainer steps the same torch
    # optimizer, scheduler and GradScaler the plan names, through the same comm hook
    "sgd-nesterov-2groups-steplr-clip-bf16hook": dict(
        ranks=3, channels=2, protocol="simple", mtu=1024, mirrors=2, loss=1e-3, opt_kind="sgd",
        opt_hyper={"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        no_decay_group=True, lr_scheduler={"class": "StepLR", "args": {"step_size": 3, "gamma": 0.5}},
        max_grad_norm=0.5, comm_hook="bf16_compress"),
    "amp-fp16hook-rmsprop-2groups-onecycle": dict(
        ranks=4, channels=2, protocol="ll", mtu=2048, mirrors=2, loss=1e-3, opt_kind="rmsprop",
        opt_hyper={"lr": 1e-3, "momentum": 0.5, "centered": True}, no_decay_group=True,
        lr_scheduler={"class": "OneCycleLR", "args": {"max_lr": 0.01, "total_steps": 25}},
        amp_init_scale=2.0 ** 20, amp_growth_interval=3, comm_hook="fp16_compress"),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_bit_exact_every_iteration(tmp_path, name):
    iterations = 20
    opts = synth(tmp_path, iterations=iterations, seed=sorted(SCENARIOS).index(name), **SCENARIOS[name])
    injected = sum(s["lost"] for s in opts.stats.values())
    pipe = run_replay(tmp_path)
    reps = pipe.reports
    assert [r.iteration for r in reps] == list(range(iterations))
    assert all(r.status == "committed" for r in reps), [(r.iteration, r.status, r.note) for r in reps]
    assert all(r.exact for r in reps)
    # The checkpoint files themselves, not just the in-memory shadow, are the trainer's.
    for t in (0, iterations // 2, iterations - 1):
        mine = load_checkpoint(tmp_path / "out" / checkpoint_name(t))
        ref = load_checkpoint(tmp_path / "reference" / checkpoint_name(t))
        assert diff_checkpoints(mine, ref) == []
    assert pipe.extract.counters["schedule_mismatch"] == 0
    assert pipe.extract.counters["ll_flag_mismatch"] == 0
    if opts.loss:
        assert injected > 0, "the scenario should really have lost packets"
        assert any(x and x > 0 for r in reps for x in r.loss)
    if opts.psn_wrap:
        # Some QP's PSNs must really wrap past 2**24 in the middle of an iteration.
        def wraps(b, t):
            lo = b.base + b.timeline.iteration_start(t)
            hi = b.base + b.timeline.iteration_start(t + 1) - 1
            return lo >> 24 != hi >> 24
        assert any(wraps(b, t) for b in pipe.extract.binder.bound.values() for t in range(iterations))
    if opts.corrupt:
        assert sum(c["bad_icrc"] for c in pipe.classes) > 0
    if opts.amp_init_scale:  # the trainer skipped steps and moved its scale; the shadow followed
        scales = [float(load_checkpoint(tmp_path / "reference" / checkpoint_name(t))["optimizer"]
                        ["grad_scaler"]["scale"]) for t in range(iterations)]
        assert scales[0] < opts.amp_init_scale and len(set(scales)) > 2, scales
    if opts.comm_hook != "allreduce":
        wire = {"bf16_compress": "bfloat16", "fp16_compress": "float16"}[opts.comm_hook]
        assert pipe.plan.bucket_dtype(pipe.plan.buckets_first[0]) == wire


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fast"])
def test_replay_leaves_the_callers_starting_state_as_it_was(tmp_path, fast):
    """A library caller hands replay a state it keeps using (a model's state_dict, say):
    the shadow steps a copy of it, so the caller's tensors hold the starting values
    afterwards while the checkpoints move on; own_start hands it over (the CLI's way)."""
    import torch

    from ckptd.core.plan import load_plan
    from ckptd.fast.pipeline import fast_replay
    from ckptd.pipeline import ReplayOptions, replay

    from helpers import pcaps
    synth(tmp_path, ranks=2, channels=1, protocol="simple", mtu=1024, mirrors=2, iterations=3, seed=5,
          opt_kind="sgd", opt_hyper={"lr": 0.05, "momentum": 0.9})
    plan = load_plan(tmp_path / "plan.json")
    run = fast_replay if fast else replay

    def go(out, start, **kw):
        pipe = run(plan, pcaps(tmp_path), start, ReplayOptions(out=str(tmp_path / out)), **kw)
        assert [r.status for r in pipe.reports] == ["committed"] * 3, [(r.iteration, r.note) for r in pipe.reports]
        return load_checkpoint(tmp_path / out / checkpoint_name(2))["model"]

    start = load_checkpoint(tmp_path / "init.pt")
    kept = {n: t.clone() for n, t in start["model"].items()}
    last = go("a", start)
    assert all(torch.equal(start["model"][n], kept[n]) for n in kept)  # the caller's state as it was
    assert any(not torch.equal(last[n], kept[n]) for n in kept)  # while the shadow stepped on
    assert diff_checkpoints(load_checkpoint(tmp_path / "a" / checkpoint_name(2)),
                            load_checkpoint(tmp_path / "reference" / checkpoint_name(2))) == []
    # handed over: stepped in place, to the same end
    go("b", start, own_start=True)
    assert any(not torch.equal(start["model"][n], kept[n]) for n in kept)
    assert diff_checkpoints(load_checkpoint(tmp_path / "b" / checkpoint_name(2)),
                            load_checkpoint(tmp_path / "a" / checkpoint_name(2))) == []
