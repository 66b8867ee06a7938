"""The optimizer step, as one plain function: state in, state out.

The trainer steps torch.optim.Adam/AdamW; the shadow calls the functional
`torch.optim.adam.adam` that those classes call, with the same flags (for-loop,
foreach or fused) and the same float learning rate, so on CPU the result is bit for
bit the trainer's. The learning-rate schedule is computed the way LambdaLR does:
base_lr * factor(step), in Python floats.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.optim.adam import adam

from ckptd.core.plan import Optimizer


@dataclass
class AdamState:
    """Per-parameter optimizer state, in the plan's parameter order."""

    step: list[torch.Tensor] = field(default_factory=list)
    exp_avg: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sq: list[torch.Tensor] = field(default_factory=list)
    max_exp_avg_sq: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def zeros_like(cls, params: list[torch.Tensor], amsgrad: bool) -> "AdamState":
        # torch.optim.Adam._init_group: step is a float32 scalar tensor on CPU.
        return cls(step=[torch.tensor(0.0, dtype=torch.float32) for _ in params],
                   exp_avg=[torch.zeros_like(p, memory_format=torch.preserve_format) for p in params],
                   exp_avg_sq=[torch.zeros_like(p, memory_format=torch.preserve_format) for p in params],
                   max_exp_avg_sq=[torch.zeros_like(p) for p in params] if amsgrad else [])


def lr_factor(schedule: dict, step: int) -> float:
    """Multiplier of the base lr after `step` scheduler steps (LambdaLR semantics).

    kinds: constant; linear (warmup_steps, total_steps: linear warm-up then linear
    decay to 0); cosine (warmup_steps, total_steps, optional min_factor).
    """
    kind = schedule.get("kind", "constant")
    if kind == "constant":
        return 1.0
    warm = int(schedule.get("warmup_steps", 0))
    total = int(schedule["total_steps"])
    if step < warm:
        return float(step) / float(max(1, warm))
    progress = float(step - warm) / float(max(1, total - warm))
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        lo = float(schedule.get("min_factor", 0.0))
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    raise ValueError(f"unknown lr schedule kind {kind!r} (constant, linear, cosine)")


def lr_at(opt: Optimizer, step: int) -> float:
    return opt.lr * lr_factor(opt.lr_schedule, step)


def optimizer_step(params: list[torch.Tensor], grads: list[torch.Tensor], state: AdamState,
                   opt: Optimizer, lr: float) -> None:
    """One Adam/AdamW step in place on params and state, exactly as torch.optim does it."""
    if opt.max_grad_norm is not None:
        # torch.nn.utils.clip_grad_norm_ scales the grads in place, as the trainer's call does.
        torch.nn.utils.clip_grad_norm_(_as_leaves(params, grads), opt.max_grad_norm)
    with torch.no_grad():
        adam(params, grads, state.exp_avg, state.exp_avg_sq, state.max_exp_avg_sq, state.step,
             foreach=opt.implementation == "foreach", fused=opt.implementation == "fused" or None,
             decoupled_weight_decay=opt.kind == "adamw", amsgrad=opt.amsgrad,
             beta1=opt.betas[0], beta2=opt.betas[1], lr=lr, weight_decay=opt.weight_decay,
             eps=opt.eps, maximize=False)


def torch_optimizer(opt: Optimizer, params) -> torch.optim.Optimizer:
    """The trainer-side optimizer the plan describes (used by the synthesizer)."""
    cls = torch.optim.AdamW if opt.kind == "adamw" else torch.optim.Adam
    return cls(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
               amsgrad=opt.amsgrad, foreach=opt.implementation == "foreach",
               fused=opt.implementation == "fused" or None)


def _as_leaves(params, grads):
    """clip_grad_norm_ reads .grad: hand it views that carry the shadow's grads."""
    leaves = []
    for p, g in zip(params, grads):
        leaf = p.detach()
        leaf.grad = g
        leaves.append(leaf)
    return leaves
