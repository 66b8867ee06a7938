"""The shadow's functional optimizer step is bit-identical to torch.optim's classes."""
import pytest
import torch

from ckptd.core.optim import AdamState, lr_at, lr_factor, optimizer_step, torch_optimizer
from ckptd.core.plan import Optimizer


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (33,), (4, 4, 3), (1,)]
    return ([torch.randn(s, generator=g) for s in shapes],
            [[torch.randn(s, generator=g) * 1e-2 for s in shapes] for _ in range(6)])


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("extra", [{}, {"amsgrad": True}, {"max_grad_norm": 0.05},
                                   {"lr_schedule": {"kind": "cosine", "warmup_steps": 2, "total_steps": 6}}])
def test_functional_step_matches_torch_optim(impl, kind, extra):
    opt = Optimizer(kind=kind, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                    implementation=impl, **extra)
    init, grads = _tensors(0)
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = torch_optimizer(opt, ref)
    mine = [t.clone() for t in init]
    state = AdamState.zeros_like(mine, opt.amsgrad)
    for step, gs in enumerate(grads):
        lr = lr_at(opt, step)
        for p, g in zip(ref, gs):
            p.grad = g.clone()
        for group in ref_opt.param_groups:
            group["lr"] = lr
        if opt.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref, opt.max_grad_norm)
        ref_opt.step()
        optimizer_step(mine, [g.clone() for g in gs], state, opt, lr)
        for a, b, p in zip(mine, ref, ref):
            assert torch.equal(a, b.detach()), f"step {step}"
        for i, p in enumerate(ref):
            st = ref_opt.state[p]
            assert torch.equal(st["exp_avg"], state.exp_avg[i])
            assert torch.equal(st["exp_avg_sq"], state.exp_avg_sq[i])
            assert torch.equal(st["step"], state.step[i])


def test_lr_schedules():
    assert lr_factor({"kind": "constant"}, 100) == 1.0
    lin = {"kind": "linear", "warmup_steps": 2, "total_steps": 12}
    assert [lr_factor(lin, s) for s in (0, 1, 2, 7, 12)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    cos = {"kind": "cosine", "warmup_steps": 0, "total_steps": 10, "min_factor": 0.1}
    assert lr_factor(cos, 0) == 1.0 and abs(lr_factor(cos, 10) - 0.1) < 1e-12
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_factor({"kind": "step", "total_steps": 3}, 1)
