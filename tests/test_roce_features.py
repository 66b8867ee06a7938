"""The shadow's training features through the RoCE/NCCL path (issue 15, "Every DDP job").

tests/test_ddp_jobs.py checks each feature on real gloo DDP jobs. Here the synthesizer's
trainer (a real tiny transformer on CPU) steps the torch optimizer, param groups, lr
scheduler or hand-set lrs, GradScaler, comm hook and parameter dtype the plan names, and
writes the RoCEv2 ring-allreduce traffic of its gradients (NCCL's per-hop summation, in
the wire dtype). Every scenario is replayed on the reference and the fast path; both must
agree frame for frame and commit every iteration bit-exact against the trainer's own
checkpoints.
"""
from __future__ import annotations

import pytest
import torch

from ckptd.cli import build_parser, _synth_training
from ckptd.core.checkpoint import checkpoint_name, load_checkpoint
from ckptd.testing.synth import parse_lr_per_step, parse_spec

from test_fastpath import assert_same, synth_pair

SGD = dict(opt_kind="sgd", opt_hyper={"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
           no_decay_group=True)
HAND_LRS = tuple([0.01 * 0.8 ** i, 0.02 * 0.8 ** i] if i % 2 else 0.01 * 0.8 ** i for i in range(10))
SCENARIOS = {
    # (a) an optimizer beyond AdamW, two param groups (no weight decay on biases and norms)
    "sgd-nesterov-2groups": dict(ranks=3, iterations=10, protocol="simple", **SGD),
    "adagrad-2groups-ll": dict(ranks=2, iterations=10, protocol="ll", opt_kind="adagrad",
                               opt_hyper={"lr": 0.01, "lr_decay": 1e-3, "initial_accumulator_value": 0.1},
                               no_decay_group=True),
    # (b) a torch lr scheduler by class and args
    "nadam-onecycle": dict(ranks=3, iterations=10, opt_kind="nadam", opt_hyper={"lr": 1e-3},
                           lr_scheduler={"class": "OneCycleLR", "args": {"max_lr": 0.01, "total_steps": 12}}),
    # (c) the lr written into the groups by hand before each step, some steps per group
    "adamw-lr-by-hand": dict(ranks=2, iterations=10, no_decay_group=True, lr_per_step=HAND_LRS,
                             max_grad_norm=0.5),
    # (c') clipping by another norm (the largest |g|) and by value (a clamp: the buckets
    # still step as they come)
    "sgd-clip-inf-norm": dict(ranks=3, iterations=6, max_grad_norm=1e-3, grad_norm_type=float("inf"), **SGD),
    "adamw-clip-value-ll": dict(ranks=2, iterations=6, protocol="ll", clip_grad_value=1e-4),
    # (d) a GradScaler: scaled gradients in fp16 on the wire, an overflow at iteration 4
    "amp-fp16hook-inf": dict(ranks=3, iterations=10, protocol="ll", comm_hook="fp16_compress",
                             amp_init_scale=2.0 ** 12, amp_growth_interval=3, inf_at=(4,), **SGD),
    # (e) the compression hooks: the ring adds fp16 / bf16 at every hop
    "fp16hook-radam": dict(ranks=3, iterations=10, comm_hook="fp16_compress", opt_kind="radam",
                           opt_hyper={"lr": 1e-3, "decoupled_weight_decay": True}),
    "bf16hook-rmsprop-ll128": dict(ranks=3, iterations=10, protocol="ll128", comm_hook="bf16_compress",
                                   opt_kind="rmsprop", opt_hyper={"lr": 1e-3, "momentum": 0.5}),
    # (f) bf16 parameters: the plain allreduce carries (and adds) bf16
    "bf16-params-adamw": dict(ranks=3, iterations=10, param_dtype="bfloat16", optimizer="for-loop"),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_feature_bit_exact_on_both_paths(tmp_path, name):
    kw = dict(channels=2, mtu=1024, mirrors=2, seed=list(SCENARIOS).index(name), **SCENARIOS[name])
    ref, fast = synth_pair(tmp_path, **kw)
    assert_same(ref, fast)
    n = kw["iterations"]
    for pipe in (ref, fast):
        reps = pipe.reports
        assert [r.iteration for r in reps] == list(range(n))
        assert all(r.status == "committed" and r.exact for r in reps), \
            [(r.iteration, r.status, r.note) for r in reps]
    refs = [load_checkpoint(tmp_path / "reference" / checkpoint_name(t)) for t in range(n)]
    plan = ref.plan
    wire = {"allreduce": kw.get("param_dtype", "float32"), "fp16_compress": "float16",
            "bf16_compress": "bfloat16"}[kw.get("comm_hook", "allreduce")]
    assert {plan.bucket_dtype(b) for b in plan.buckets_first + plan.buckets_rebuilt} == {wire}
    assert plan.optimizer.kind == kw.get("opt_kind", "adamw")
    assert len(plan.optimizer.groups) in ((2,) if kw.get("no_decay_group") else (0, 1))
    if "lr_scheduler" in kw:
        lrs = [c["optimizer"]["lr"] for c in refs]
        assert len(set(lrs)) == n  # OneCycleLR moves the lr every step
    if "lr_per_step" in kw:
        assert plan.optimizer.lr_per_step[3] == list(HAND_LRS[3])
        assert [c["optimizer"]["lr"] for c in refs] == [x[0] if isinstance(x, list) else x for x in HAND_LRS]
    if kw.get("inf_at"):
        (bad,) = kw["inf_at"]
        scales = [float(c["optimizer"]["grad_scaler"]["scale"]) for c in refs]
        assert scales[bad] == scales[bad - 1] / 2  # backoff on the overflow
        assert scales[bad - 1] == 2.0 ** 13  # growth after 3 clean steps
        # the skipped step: parameters and optimizer state unchanged
        before, after = refs[bad - 1], refs[bad]
        assert all(torch.equal(before["model"][k], after["model"][k]) for k in after["model"])
        assert not torch.equal(refs[bad + 1]["model"]["head.weight"], after["model"]["head.weight"])
    if kw.get("param_dtype") == "bfloat16":
        assert {p.dtype for p in plan.parameters} == {"bfloat16"}
        assert all(t.dtype == torch.bfloat16 for t in refs[-1]["model"].values())


ALL_KINDS = {"adam": {"lr": 1e-3, "amsgrad": True}, "adamw": {"lr": 1e-3, "betas": (0.8, 0.9)},
             "sgd": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1}, "adagrad": {"lr": 0.01},
             "rmsprop": {"lr": 1e-3, "centered": True}, "adamax": {"lr": 2e-3},
             "nadam": {"lr": 1e-3, "decoupled_weight_decay": True}, "radam": {"lr": 1e-3},
             "asgd": {"lr": 0.01, "t0": 2.0}, "adadelta": {"lr": 1.0}, "rprop": {"lr": 1e-3}}


@pytest.mark.parametrize("kind", list(ALL_KINDS))
def test_every_optimizer_kind_two_groups(tmp_path, kind):
    """(a) for every optimizer ckptd supports, with two param groups: a short job."""
    from ckptd.core.plan import OPTIMIZER_CLASSES
    assert set(ALL_KINDS) == set(OPTIMIZER_CLASSES)
    ref, fast = synth_pair(tmp_path, ranks=2, channels=1, mtu=1024, mirrors=2, iterations=4,
                           opt_kind=kind, opt_hyper=ALL_KINDS[kind], no_decay_group=True)
    assert_same(ref, fast)
    assert all(r.status == "committed" and r.exact for r in ref.reports + fast.reports)
    assert len(ref.reports) == 4 and ref.plan.optimizer.kind == kind


def test_spec_syntax():
    assert parse_spec("sgd:lr=0.1,momentum=0.9,nesterov=true,weight_decay=1e-4") == (
        "sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4})
    assert parse_spec("adam:betas=0.9/0.95,amsgrad=false") == ("adam", {"betas": [0.9, 0.95], "amsgrad": False})
    assert parse_spec("MultiStepLR:milestones=2/5,gamma=0.5") == ("MultiStepLR", {"milestones": [2, 5],
                                                                                  "gamma": 0.5})
    assert parse_spec("rprop") == ("rprop", {})
    with pytest.raises(ValueError):
        parse_spec("sgd:lr")
    assert parse_lr_per_step("0.1,0.05/0.01") == (0.1, [0.05, 0.01])
    a = build_parser().parse_args(
        ["synth", "--out", "x", "--optim", "SGD:lr=0.1,momentum=0.9", "--param-groups", "no-decay",
         "--lr-scheduler", "StepLR:step_size=3", "--amp", "4096", "--inf-at", "3", "--comm-hook",
         "bf16_compress", "--param-dtype", "bfloat16"])
    assert _synth_training(a) == dict(
        opt_kind="sgd", opt_hyper={"lr": 0.1, "momentum": 0.9}, no_decay_group=True,
        lr_scheduler={"class": "StepLR", "args": {"step_size": 3}}, amp_init_scale=4096.0,
        amp_growth_interval=2000, inf_at=(3,), comm_hook="bf16_compress", param_dtype="bfloat16")


def test_shadow_leaves_the_wire_buffers_alone(tmp_path):
    """SGD with Nesterov momentum and no weight decay adds the momentum into the grads in
    place: the shadow must hand it copies, not views of the reduced buckets, whose values
    later copies of the same elements are checked against (a false 'conflict' otherwise)."""
    import numpy as np

    from ckptd.core.plan import load_plan
    from ckptd.core.shadow import ShadowModel
    from helpers import synth

    synth(tmp_path, ranks=2, channels=1, iterations=1, opt_kind="sgd",
          opt_hyper={"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.0})
    plan = load_plan(tmp_path / "plan.json")
    shadow = ShadowModel(plan, load_checkpoint(tmp_path / "init.pt"))
    rng = np.random.default_rng(0)
    bufs = [rng.standard_normal(sum(e - s for _, s, e in plan.param_ranges(0, b))).astype(np.float32)
            for b in range(len(plan.buckets_first))]
    keep = [b.copy() for b in bufs]
    for b, buf in enumerate(bufs):
        shadow.apply_buckets(0, [(b, buf)], 0)
    assert all(np.array_equal(a, b) for a, b in zip(bufs, keep))


def test_ring_adds_in_the_wire_dtype_per_hop():
    """NCCL's FuncSum<half> / FuncSum<__nv_bfloat16> (src/device/reduce_kernel.h: __hadd, or
    float add then round to nearest on older GPUs) round every hop's sum to the 16-bit type;
    the synthesizer's ring does too, which differs from adding in float32 and casting once."""
    import numpy as np

    from ckptd.testing.synth.ring import _add

    x = np.float16([1.0, 2.0 ** -11, 2.0 ** -11])  # 1 + ulp/2 rounds back to 1, twice
    assert _add(_add(x[:1], x[1:2]), x[2:3])[0] == np.float16(1.0)
    assert np.float16(x.astype(np.float32).sum()) != np.float16(1.0)
    bf = torch.tensor([1.0, 2.0 ** -8, 2.0 ** -8], dtype=torch.bfloat16)
    words = bf.view(torch.int16).numpy().view(np.uint16)
    hop = _add(_add(words[:1], words[1:2]), words[2:3])
    assert torch.from_numpy(hop.view(np.int16)).view(torch.bfloat16).item() == 1.0
    assert bf.float().sum().bfloat16().item() != 1.0
