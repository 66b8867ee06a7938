"""Optimizer update throughput: ckptd.core.optim.step_groups against torch's fused AdamW.

    python -m benchmarks.optimizer [--params 25] [--reps 7] [--threads 1]

The same parameter, gradient and state tensors (a transformer-like list of --params
million float32 parameters: 12 blocks of 4 matrices plus biases and norms) go through
torch.optim.AdamW(fused=True).step() and through ckptd.core.optim.step_groups with the
plan's three implementations (fused, foreach, for-loop). Each step is timed alone, the
variants interleaved, best of --reps. Reported as million parameters per second and as
a ratio to torch's fused AdamW (the target for the shadow's fused step is >= 0.9x).
Below the table: what the shadow's check for NaN and inf after each step costs
(ckptd.core.finite, over the same parameters), against torch.isfinite(t).all(), as a
share of the fused step.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.machine import machine
from ckptd.core.finite import first_nonfinite
from ckptd.core.optim import full_groups, init_state, step_groups
from ckptd.core.plan import Optimizer


def shapes(million: float) -> list[tuple[int, ...]]:
    """A RoBERTa-like layer list scaled to about `million` M parameters."""
    d = 64
    while 12 * 12 * d * d < million * 1e6:
        d += 64
    out = []
    for _ in range(12):
        out += [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=25, help="million parameters")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    sh = shapes(a.params)
    n = sum(torch.Size(s).numel() for s in sh)
    print(f"machine: {machine()}; torch {torch.__version__}, {a.threads} thread(s); {n / 1e6:.1f} M parameters")
    grads = [torch.randn(s) * 1e-3 for s in sh]
    opt = Optimizer(kind="adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    # torch's own optimizer, fused
    t_params = [torch.randn(s, requires_grad=True) for s in sh]
    for p, g in zip(t_params, grads):
        p.grad = g.clone()
    torch_opt = torch.optim.AdamW(t_params, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                  weight_decay=opt.weight_decay, fused=True)
    runs = {"torch AdamW fused": lambda: torch_opt.step()}
    for impl in ("fused", "foreach", "for-loop"):
        params = [p.detach().clone() for p in t_params]
        o = Optimizer(kind="adamw", lr=opt.lr, betas=opt.betas, eps=opt.eps,
                      weight_decay=opt.weight_decay, implementation=impl)
        hyper = full_groups(o, [str(i) for i in range(len(params))])[0]
        state = [init_state(o.kind, p, hyper) for p in params]
        runs[f"step_groups {impl}"] = (lambda params=params, state=state, hyper=hyper:
                                       step_groups("adamw", params, grads, state, hyper))
    named = [(str(i), p.detach()) for i, p in enumerate(t_params)]
    runs["finite check (ckptd.core.finite)"] = lambda: first_nonfinite(named)
    runs["torch.isfinite(t).all()"] = lambda: all(bool(torch.isfinite(t).all()) for _, t in named)
    for fn in runs.values():  # warm up: lazy state, first-touch pages
        fn()
    best = {k: float("inf") for k in runs}
    for _ in range(a.reps):
        for k, fn in runs.items():
            t = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t)
    ref = best["torch AdamW fused"]
    print("| optimizer | ms / step | M params/s | x torch fused AdamW |")
    print("|---|---|---|---|")
    checks = [k for k in best if not k.startswith(("torch AdamW", "step_groups"))]
    for k, t in best.items():
        if k not in checks:
            print(f"| {k} | {t * 1e3:.1f} | {n / t / 1e6:.0f} | {ref / t:.2f} |")
    step = best["step_groups fused"]
    for k in checks:
        print(f"{k}: {best[k] * 1e3:.1f} ms, {100 * best[k] / step:.1f}% of a step_groups fused step")


if __name__ == "__main__":
    main()
