"""What write_plan's step check costs a training step (ckptd.torch._check_grads_as_planned).

    python -m benchmarks.step_check [--params 8e6] [--reps 3] [--threads 1]

For its first 8 optimizer steps write_plan takes one norm of the gradients at the end of
each backward pass and one at the step, and matches them (docs/TRAINING.md). This times
those 8 steps of a plain training loop (an MLP of about --params parameters, SGD with
momentum, clip_grad_norm_) with the check's hooks on and off, alternated --reps times in
one run, and prints the milliseconds per step of each and their ratio. The hooks come off
after the 8th checked step, so later steps cost what they cost without write_plan.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ckptd.core.plan import Optimizer
from ckptd.torch import CHECKED_STEPS, _check_grads_as_planned


def _model(params: float, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    width = max(16, int((params / 3) ** 0.5))
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, width))


def _steps(model, checked: bool, batch: torch.Tensor) -> float:
    """Seconds per step over CHECKED_STEPS steps, the check on or off."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    params = list(model.parameters())
    if checked:
        _check_grads_as_planned(opt, params, Optimizer(kind="sgd", max_grad_norm=1.0))
    t0 = time.perf_counter()
    for _ in range(CHECKED_STEPS):
        model(batch).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - t0) / CHECKED_STEPS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=8e6, help="parameters of the MLP (default 8e6)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = _model(a.params)
    n = sum(p.numel() for p in model.parameters())
    batch = torch.randn(a.batch, model[0].in_features)
    _steps(model, False, batch)  # warm-up: allocator, kernels
    times = {False: [], True: []}
    for _ in range(a.reps):
        for checked in (False, True):
            times[checked].append(_steps(model, checked, batch))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"{n / 1e6:.1f} M parameters, batch {a.batch}, {a.threads} thread(s), {a.reps} alternations of "
          f"{CHECKED_STEPS} steps")
    print(f"  without the check: {off * 1e3:8.2f} ms/step (median; all: "
          f"{', '.join(f'{t * 1e3:.2f}' for t in times[False])})")
    print(f"  with the check:    {on * 1e3:8.2f} ms/step (median; all: "
          f"{', '.join(f'{t * 1e3:.2f}' for t in times[True])})")
    print(f"  ratio: {on / off:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
