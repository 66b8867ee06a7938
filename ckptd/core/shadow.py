"""The shadow model: the trainer's parameters and optimizer state, kept on the CPU.

Built from the plan and a starting checkpoint (the initial state, iteration -1, or
any committed checkpoint to resume from), it applies one committed iteration's
reduced gradients with the trainer's exact optimizer semantics (ckptd.core.optim).

The shadow takes the starting state's tensors over instead of copying them (at 330M
parameters a copy is 4 GB): a caller that needs its state unchanged passes a copy.
"""
from __future__ import annotations

import numpy as np
import torch

from ckptd.core.checkpoint import CheckpointError
from ckptd.core.optim import AdamState, lr_at, optimizer_step
from ckptd.core.plan import Plan


class ShadowModel:
    def __init__(self, plan: Plan, start: dict):
        if plan.optimizer is None:
            raise CheckpointError("the plan has no optimizer: there is no model to shadow")
        self.plan = plan
        self.names = [p.name for p in plan.parameters]
        self.index = {n: i for i, n in enumerate(self.names)}
        model = start.get("model") or {}
        missing = [n for n in self.names if n not in model]
        if missing:
            raise CheckpointError(f"starting state lacks parameters {missing[:5]}")
        self.params = []
        for p in plan.parameters:
            t = model[p.name].detach().contiguous()
            if tuple(t.shape) != p.shape or str(t.dtype).removeprefix("torch.") != p.dtype:
                raise CheckpointError(f"starting state: {p.name} is {t.dtype}{list(t.shape)}, "
                                      f"plan says {p.dtype}{list(p.shape)}")
            self.params.append(t)
        self.iteration = int(start.get("iteration", -1))
        opt = start.get("optimizer")
        if opt and opt.get("state"):
            st = opt["state"]
            self.state = AdamState(
                step=[st[n]["step"] for n in self.names],
                exp_avg=[st[n]["exp_avg"] for n in self.names],
                exp_avg_sq=[st[n]["exp_avg_sq"] for n in self.names],
                max_exp_avg_sq=[st[n]["max_exp_avg_sq"] for n in self.names]
                if plan.optimizer.amsgrad else [])
        else:
            self.state = AdamState.zeros_like(self.params, plan.optimizer.amsgrad)
        self.lr = None

    def apply_bucket(self, iteration: int, b: int, buffer: np.ndarray, layout_iteration: int):
        """Step only bucket b's parameters: as soon as DDP's bucket is reduced, while the
        next buckets are still on the wire. Adam is elementwise per tensor, so stepping
        bucket by bucket is bit-identical to one step over all parameters. The iteration
        is done when `finish_iteration` is called after the last bucket; if it never
        completes, this in-memory state is abandoned (the last checkpoint is on disk)."""
        if iteration != self.iteration + 1:
            raise RuntimeError(f"shadow is at iteration {self.iteration}, cannot apply {iteration}")
        if self.plan.optimizer.max_grad_norm is not None:
            raise RuntimeError("gradient clipping needs every bucket: use apply()")
        flat = torch.from_numpy(buffer)
        idx, grads = [], []
        for name, start, end in self.plan.param_ranges(layout_iteration, b):
            idx.append(self.index[name])
            grads.append(flat[start:end].view(self.plan.param(name).shape))
        st = self.state
        sub = AdamState([st.step[i] for i in idx], [st.exp_avg[i] for i in idx],
                        [st.exp_avg_sq[i] for i in idx],
                        [st.max_exp_avg_sq[i] for i in idx] if st.max_exp_avg_sq else [])
        self.lr = lr_at(self.plan.optimizer, iteration)
        optimizer_step([self.params[i] for i in idx], grads, sub, self.plan.optimizer, self.lr)

    def finish_iteration(self, iteration: int):
        self.iteration = iteration

    def grads_from_buckets(self, iteration: int, buffers: list[np.ndarray]) -> list[torch.Tensor]:
        """Per-parameter gradient views of the reduced bucket buffers (DDP's grad views)."""
        by_name = {}
        for b, buf in enumerate(buffers):
            t = torch.from_numpy(buf)
            for name, start, end in self.plan.param_ranges(iteration, b):
                by_name[name] = t[start:end].view(self.plan.param(name).shape)
        return [by_name[n] for n in self.names]

    def apply(self, iteration: int, buffers: list[np.ndarray], layout_iteration: int | None = None):
        """Step with one iteration's reduced buckets. `iteration` is the training
        iteration (it drives the lr schedule); `layout_iteration` says which bucket
        layout the buffers follow (0: DDP's first layout), default the same."""
        if iteration != self.iteration + 1:
            raise RuntimeError(f"shadow is at iteration {self.iteration}, cannot apply {iteration}")
        grads = self.grads_from_buckets(iteration if layout_iteration is None else layout_iteration,
                                        buffers)
        self.lr = lr_at(self.plan.optimizer, iteration)
        optimizer_step(self.params, grads, self.state, self.plan.optimizer, self.lr)
        self.iteration = iteration

    def model_state(self, copy: bool = True) -> dict:
        """Parameters by name; copy=False hands out the live tensors (to write or
        compare them while nothing steps the shadow)."""
        keep = (lambda t: t.clone()) if copy else (lambda t: t)
        return {n: keep(p) for n, p in zip(self.names, self.params)}

    def optimizer_state(self, copy: bool = True) -> dict:
        keep = (lambda t: t.clone()) if copy else (lambda t: t)
        st = {}
        for i, n in enumerate(self.names):
            st[n] = {"step": keep(self.state.step[i]), "exp_avg": keep(self.state.exp_avg[i]),
                     "exp_avg_sq": keep(self.state.exp_avg_sq[i])}
            if self.state.max_exp_avg_sq:
                st[n]["max_exp_avg_sq"] = keep(self.state.max_exp_avg_sq[i])
        return {"lr": self.lr, "state": st}
