"""The shadow model: the trainer's parameters and optimizer state, kept on the CPU.

Built from the plan and a starting checkpoint (the initial state, iteration -1, or
any committed checkpoint to resume from), it applies one committed iteration's
reduced gradients with the trainer's exact optimizer semantics (ckptd.core.optim).

The shadow takes the starting state's tensors over instead of copying them (at 330M
parameters a copy is 4 GB): a caller that needs its state unchanged passes a copy.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import torch

from ckptd.core.checkpoint import CheckpointError
from ckptd.core.finite import first_nonfinite
from ckptd.core.optim import (EAGER_STATE, GroupSchedule, NoLrForStep, OptimizerError, clip_grads, clips, full_groups, init_state,
                              scaler_state, scaler_unscale, scaler_update, step_groups,
                              writes_grads)
from ckptd.core.plan import COMM_HOOKS, USED_MAP, Plan, dtype_name


def bucket_step_threads() -> int:
    """torch intra-op threads for bucket steps: the cores the pipeline leaves over (the
    kernel's thread and the file reader take one each), at least one. On 2 cores
    torch's default of 2 OpenMP threads fought those two for them and a replay took
    5-25x longer (benchmarks/RESULTS.md, issue 16)."""
    return max(1, len(os.sched_getaffinity(0)) - 2)


def limit_step_threads(n: int):
    """Run this thread's torch ops on n intra-op threads. torch.set_num_threads sets the
    calling thread's OpenMP setting and also the default of threads that have not run a
    parallel op yet; that default is put back from a short-lived thread, so only this
    one changes. Only for elementwise steps (the bucket steps): a reduction (clipping's
    norm) can round differently with another thread count."""
    default = torch.get_num_threads()
    torch.set_num_threads(n)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,))
    restore.start()
    restore.join()


class MapNotSeen(ValueError):
    """static_graph: DDP's used map of iteration 0 was not seen by this shadow."""


class ShadowModel:
    def __init__(self, plan: Plan, start: dict):
        if plan.optimizer is None:
            raise CheckpointError("the plan has no optimizer: there is no model to shadow")
        self.plan = plan
        self.opt = plan.optimizer
        self.names = [p.name for p in plan.parameters]
        self.index = {n: i for i, n in enumerate(self.names)}
        model = start.get("model") or {}
        missing = [n for n in self.names if n not in model]
        if missing:
            raise CheckpointError(f"starting state lacks parameters {missing[:5]}")
        self.params = []
        for p in plan.parameters:
            t = p.laid_out(model[p.name].detach())  # (a channels_last weight stays one)
            if tuple(t.shape) != p.shape or dtype_name(t.dtype) != p.dtype:
                raise CheckpointError(f"starting state: {p.name} is {t.dtype}{list(t.shape)}, "
                                      f"plan says {p.dtype}{list(p.shape)}")
            self.params.append(t)
        # frozen parameters: never stepped (DDP reduces no gradient of theirs and torch's
        # step skips a parameter whose grad is None), carried into every checkpoint as
        # the starting state holds them
        self.frozen: dict[str, torch.Tensor] = {}
        for p in plan.frozen:
            t = model.get(p.name)
            if t is None:
                raise CheckpointError(f"starting state lacks frozen parameter {p.name}")
            if tuple(t.shape) != p.shape or dtype_name(t.dtype) != p.dtype:
                raise CheckpointError(f"starting state: frozen {p.name} is {t.dtype}{list(t.shape)}, "
                                      f"plan says {p.dtype}{list(p.shape)}")
            self.frozen[p.name] = t.detach()
        self.iteration = int(start.get("iteration", -1))
        try:
            self.groups = full_groups(self.opt, self.names)
        except OptimizerError as e:
            raise CheckpointError(f"plan optimizer: {e}") from e
        self.group_of = {n: gi for gi, g in enumerate(self.groups) for n in g["params"]}
        self.hyper = GroupSchedule(self.opt, self.groups)
        opt = start.get("optimizer") or {}
        # per parameter name, torch's optimizer.state[p] (created on its first step)
        self.state: dict[str, dict] = {n: dict(st) for n, st in (opt.get("state") or {}).items()}
        if self.opt.kind in EAGER_STATE and not self.state:
            # torch's constructor makes it for every parameter of its groups, frozen ones too
            first = self.hyper.at(self.iteration + 1)
            tensors = {**dict(zip(self.names, self.params)), **self.frozen}
            for n, gi in self.group_of.items():
                self.state[n] = init_state(self.opt.kind, tensors[n], first[gi])
        # prepare_state: per parameter, the state init_state makes for its first step, made
        # ahead for iteration _prepared_for
        self._prepared: dict[str, dict] = {}
        self._prepared_for: int | None = None
        self.scaler = None
        if self.opt.grad_scaler is not None:
            self.scaler = dict(opt.get("grad_scaler") or scaler_state(self.opt.grad_scaler))
        # module buffers as DDP last broadcast them (ckptd.core.buffers), set by the
        # pipeline before each commit; empty unless the plan captures them
        self.buffers: dict[str, torch.Tensor] = {}
        self.lr = None
        # static_graph: DDP's used map of iteration 0, per parameter (used_of)
        self.static_used: list[bool] | None = None if plan.static_used_map is None else \
            [bool(x) for x in plan.static_used_map]
        self._unalias()
        self.skipped = False  # the last step was skipped by the GradScaler (inf/nan gradients)
        # the job diverged: the first parameter found holding NaN or inf (ckptd.core.finite),
        # in the starting state or after a step
        self.nonfinite = first_nonfinite([*zip(self.names, self.params), *self.frozen.items()])

    def _unalias(self) -> None:
        """Every tensor the shadow steps in place its own memory: a starting state whose
        tensors share storage (torch.save keeps `s[b] = s[a]` as one tensor; a tied
        weight saved under two names) had the shared one stepped twice a step, and every
        checkpoint was wrong without a word. A later tensor whose bytes overlap an earlier
        one's is copied; tensors that only share a storage (views of one flat buffer,
        disjoint) stay as they are."""
        slots = [(self.params, i) for i in range(len(self.params))]
        slots += [(self.frozen, n) for n in self.frozen]
        slots += [(st, k) for n in sorted(self.state) for st in [self.state[n]] for k in st
                  if isinstance(st[k], torch.Tensor)]
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k)
                       for k, t in enumerate(holder[key] for holder, key in slots) if t.numel())
        reach = 0
        for lo, hi, k in spans:  # by address: one overlapping those before it is copied (fresh memory)
            if lo < reach:
                holder, key = slots[k]
                holder[key] = holder[key].clone()  # (its layout kept: a channels_last weight's too)
            else:
                reach = max(reach, hi)

    @property
    def bucketwise(self) -> bool:
        """Whether buckets can be stepped one by one as they complete: not when the step
        needs every gradient first (clipping's total norm, the scaler's inf check), nor
        with find_unused_parameters (which parameters step is known from DDP's used map,
        allreduced after the last bucket). clip_grad_value_ is a clamp, elementwise: its
        buckets step as they come."""
        return (self.opt.max_grad_norm is None and self.scaler is None and not self.plan.find_unused_parameters
                and not self.plan.static_graph)

    def prepare_state(self):
        """Makes now the optimizer state the next iteration's step would create (as
        init_state does then, with that iteration's hyperparameters), kept aside: the step
        takes it instead of allocating and zeroing ~2x the model's bytes in the middle of
        the live daemon's first iteration. The state only appears when that step runs, so
        checkpoints are as before; a parameter that first steps later makes its own."""
        self._prepared_for = self.iteration + 1
        try:
            hyper = self.hyper.at(self._prepared_for)
        except NoLrForStep:  # past the plan's lr_per_step: no step comes to take it
            self._prepared = {}
            return
        self._prepared = {n: init_state(self.opt.kind, self.params[i], hyper[self.group_of[n]])
                          for i, n in enumerate(self.names) if n not in self.state}

    def _step(self, iteration: int, idx: list[int], grads: list[torch.Tensor]):
        if self._prepared and self._prepared_for != iteration:
            self._prepared.clear()  # made for an iteration that did not step these parameters
        hyper = self.hyper.at(iteration)
        self.lr = hyper[0]["lr"]
        by_group: dict[int, list[int]] = {}
        for k, i in enumerate(idx):
            by_group.setdefault(self.group_of[self.names[i]], []).append(k)
        for gi in sorted(by_group):
            ks = by_group[gi]
            states = []
            for k in ks:
                n = self.names[idx[k]]
                if n not in self.state:
                    made = self._prepared.pop(n, None)
                    self.state[n] = made if made is not None else \
                        init_state(self.opt.kind, self.params[idx[k]], hyper[gi])
                states.append(self.state[n])
            gs = [grads[k] for k in ks]
            if writes_grads(self.opt.kind, hyper[gi]):
                gs = [g.clone() for g in gs]  # not into the assembly's buffers
            step_groups(self.opt.kind, [self.params[idx[k]] for k in ks], gs, states, hyper[gi])
            if self.nonfinite is None:  # once found, it stays: no step makes NaN or inf finite
                self.nonfinite = first_nonfinite((self.names[idx[k]], self.params[idx[k]]) for k in ks)

    def apply_buckets(self, iteration: int, buckets: list[tuple[int, np.ndarray]], layout_iteration: int):
        """Step only these reduced buckets' parameters ((bucket, buffer) pairs): as soon as
        DDP's buckets are reduced, while the next ones are still on the wire, several at
        once in one optimizer call where they are ready together. torch's optimizers are
        elementwise per tensor, so any grouping of the buckets is bit-identical to one
        step over all parameters. The iteration is done when `finish_iteration` is called
        after the last bucket; if it never completes, this in-memory state is abandoned
        (the last checkpoint is on disk)."""
        if iteration != self.iteration + 1:
            raise RuntimeError(f"shadow is at iteration {self.iteration}, cannot apply {iteration}")
        if not self.bucketwise:
            raise RuntimeError("gradient clipping by norm and AMP need every bucket: use apply()")
        idx, grads = [], []
        for b, buffer in buckets:
            flat = self._wire_to_param_dtype(buffer)
            for name, start, end in self.plan.param_ranges(layout_iteration, b):
                idx.append(self.index[name])
                grads.append(self.plan.param(name).grad_view(flat[start:end]))
        if clips(self.opt):  # clamps in place: not the assembly's buffers
            grads = [g.clone() for g in grads]
            clip_grads(self.opt, [self.params[i] for i in idx], grads)
        self._step(iteration, idx, grads)

    def finish_iteration(self, iteration: int):
        self.iteration = iteration

    def _wire_to_param_dtype(self, buf: np.ndarray) -> torch.Tensor:
        """A reduced bucket as the parameters' gradients: a compression hook's decompress
        is `bucket.buffer().copy_(reduced)`, a cast to the parameters' dtype."""
        t = torch.from_numpy(buf)
        wire = COMM_HOOKS[self.plan.comm_hook]
        if wire is None and self.plan.parameters[0].dtype == "bfloat16":
            return t.view(torch.bfloat16)  # bf16 parameters: the plain allreduce carries bf16
        if wire is None:
            return t
        if wire == "bfloat16":
            t = t.view(torch.bfloat16)  # carried as raw 16-bit words (numpy has no bfloat16)
        return t.to(getattr(torch, self.plan.parameters[0].dtype))

    def used_of(self, iteration: int, buffers: list[np.ndarray]) -> list[bool] | None:
        """find_unused_parameters: per parameter, whether some rank used it (DDP's reduced
        used map, the assembly's last buffer: a count of ranks, 0 = used on none); None
        without. ValueError for a map no reduction of 0/1 flags gives. static_graph: DDP
        reduces the map once, at iteration 0, and keeps it; later iterations take that one
        (ValueError if this shadow did not see it: then which parameters step is unknown)."""
        if not (self.plan.find_unused_parameters or self.plan.static_graph):
            return None
        if not self.plan.has_map(iteration):
            if self.static_used is None:
                raise MapNotSeen(f"{USED_MAP} of iteration 0 (static_graph: DDP keeps it for every later "
                                 "iteration) was not seen by this shadow: which parameters the trainer steps "
                                 "is not known")
            return self.static_used
        counts = np.asarray(buffers[len(self.plan.layout(iteration))], dtype=np.int64)
        bad = np.flatnonzero((counts < 0) | (counts > self.plan.nranks))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"DDP's used-parameter map says {self.names[i]} was used on {int(counts[i])} ranks "
                             f"of {self.plan.nranks}")
        used = [bool(c) for c in counts]
        if self.plan.static_graph:
            if self.plan.static_used_map is not None and used != self.static_used:
                i = next(k for k, (a, b) in enumerate(zip(used, self.static_used)) if a != b)
                raise ValueError(f"{USED_MAP} of iteration 0 says {self.names[i]} was "
                                 f"{'used' if used[i] else 'unused'}, the plan's static_used_map the opposite")
            self.static_used = used
        return used

    def grads_from_buckets(self, iteration: int, buffers: list[np.ndarray]) -> list[torch.Tensor]:
        """Per-parameter gradient views of the reduced bucket buffers (DDP's grad views)."""
        by_name = {}
        if self.plan.has_map(iteration):
            buffers = buffers[:len(self.plan.layout(iteration))]  # the used map is no gradient
        for b, buf in enumerate(buffers):
            t = self._wire_to_param_dtype(buf)
            for name, start, end in self.plan.param_ranges(iteration, b):
                by_name[name] = self.plan.param(name).grad_view(t[start:end])
        return [by_name[n] for n in self.names]

    def apply(self, iteration: int, buffers: list[np.ndarray], layout_iteration: int | None = None):
        """Step with one iteration's reduced buckets. `iteration` is the training
        iteration (it drives the lr schedule); `layout_iteration` says which bucket
        layout the buffers follow (0: DDP's first layout), default the same.
        The trainer's order: scaler.unscale_, clip_grad_norm_ (or clip_grad_value_), scaler.step (skipped on
        inf/nan), scaler.update. With find_unused_parameters only the parameters some rank
        used take part in any of them: DDP leaves a globally unused one's grad None, and
        unscale_, clip_grad_norm_ and the step all skip None grads."""
        if iteration != self.iteration + 1:
            raise RuntimeError(f"shadow is at iteration {self.iteration}, cannot apply {iteration}")
        lay = iteration if layout_iteration is None else layout_iteration
        used = self.used_of(lay, buffers)
        grads = self.grads_from_buckets(lay, buffers)
        idx = list(range(len(self.names)))
        params = self.params
        if used is not None:
            idx = [i for i in idx if used[i]]
            grads = [grads[i] for i in idx]
            params = [self.params[i] for i in idx]
        self.skipped = False
        if self.scaler is not None:
            grads = [g.clone() for g in grads]  # unscaled in place; the assembly keeps the wire's
            self.skipped = scaler_unscale(grads, self.scaler)
        if clips(self.opt):
            if self.scaler is None:  # clipping writes in place: not the assembly's buffers
                grads = [g.clone() for g in grads]
            clip_grads(self.opt, params, grads)
        if self.skipped:
            self.lr = self.hyper.at(iteration)[0]["lr"]
        else:
            self._step(iteration, idx, grads)
        if self.scaler is not None:
            scaler_update(self.scaler, self.opt.grad_scaler)
        self.iteration = iteration

    def model_state(self, copy: bool = True) -> dict:
        """Parameters and module buffers by name (a model.state_dict()); copy=False hands
        out the live tensors (to write or compare them while nothing steps the shadow)."""
        keep = (lambda t: t.clone()) if copy else (lambda t: t)
        out = {n: keep(p) for n, p in zip(self.names, self.params)}
        out.update((n, keep(t)) for n, t in self.frozen.items())
        out.update((n, keep(b)) for n, b in self.buffers.items())
        return out

    def state_template(self) -> tuple[dict, dict]:
        """(model_state, optimizer_state) as a commit hands them out once every parameter
        has stepped: the live tensors, and meta tensors (init_state's) for optimizer state
        not made yet. For laying out memory ahead (ckptd.live.memory_tier.reserve)."""
        model = self.model_state(copy=False)
        opt = self.optimizer_state(copy=False)
        try:
            hyper = self.hyper.at(self.iteration + 1)
        except NoLrForStep:  # no later step: the groups' own hyperparameters shape the state alike
            hyper = self.groups
        for i, n in enumerate(self.names):
            if n not in self.state:
                p = self.params[i].to("meta")
                g = hyper[self.group_of[n]]
                st = init_state(self.opt.kind, p, g)
                if self.opt.kind == "sgd" and g.get("momentum"):
                    st = {"momentum_buffer": p}  # the functional makes it on the first step
                opt["state"][n] = st
        opt["state"] = {n: opt["state"][n] for n in self.names + list(self.frozen) if n in opt["state"]}
        return model, opt

    def optimizer_state(self, copy: bool = True) -> dict:
        """{"lr": the first group's lr of the last step, "state": {name: torch's per-parameter
        state}}, plus "grad_scaler": {scale, growth_tracker} with AMP."""
        keep = (lambda t: t.clone()) if copy else (lambda t: t)
        # a frozen parameter has state only where torch made it at construction (Adagrad);
        # a step that keeps none (SGD without momentum) leaves no entry in torch's state_dict
        st = {n: {k: keep(v) for k, v in self.state[n].items()} for n in self.names + list(self.frozen)
              if self.state.get(n)}
        out = {"lr": self.lr, "state": st}
        if self.scaler is not None:
            out["grad_scaler"] = {k: keep(v) for k, v in self.scaler.items()}
        return out
