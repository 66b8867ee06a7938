"""The optimizer step, as plain functions: state in, state out.

The trainer steps a torch.optim optimizer; the shadow calls the functional form that
the optimizer's own `step()` calls (torch.optim.sgd.sgd, torch.optim.adam.adam, ...)
with the same group hyperparameters (foreach, fused, ... as torch filled them in), so
on CPU the result is bit for bit the trainer's. `STEPS` is the one place that maps a
plan's optimizer kind to its step function; `init_state` creates a parameter's state
lazily, on its first real step, with the names and dtypes `_init_group` uses, so the
shadow's per-parameter state is exactly `optimizer.state_dict()["state"]`.

Hyperparameters per step come from `GroupSchedule`: the trainer's
torch.optim.lr_scheduler class replayed on a dummy optimizer of the same class (never
re-implemented), or the legacy LambdaLR-style `lr_schedule` of a plan.

AMP: with a GradScaler the wire carries scaled gradients; `scaler_unscale` and
`scaler_update` are GradScaler's unscale_ / update (the same torch._amp_* kernels),
and a step whose gradients hold an inf or nan is skipped, as `scaler.step` does.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable

import torch
from torch.optim.adadelta import adadelta
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.adamax import adamax
from torch.optim.asgd import asgd
from torch.optim.nadam import nadam
from torch.optim.radam import radam
from torch.optim.rmsprop import rmsprop
from torch.optim.rprop import rprop
from torch.optim.sgd import sgd


def _eager(fn):
    """The function beneath torch's wrapper. torch wraps each functional optimizer so
    that torch.compile leaves it alone, and the wrapper imports torch._dynamo on its
    first call: 1.1 s here, more than a short replay's whole run. The shadow never runs
    under torch.compile, and then the wrapper calls this same function
    (torch/optim/optimizer.py _disable_dynamo_if_unsupported)."""
    return getattr(fn, "__wrapped__", fn)


adadelta, adagrad, adam, adamax, asgd, nadam, radam, rmsprop, rprop, sgd = map(
    _eager, (adadelta, adagrad, adam, adamax, asgd, nadam, radam, rmsprop, rprop, sgd))

from ckptd.core.plan import OPTIMIZER_CLASSES, Optimizer, PlanError, _all_finite, _short
from ckptd.errors import CkptdError


class OptimizerError(CkptdError, ValueError):
    """An optimizer, group or scheduler that the shadow cannot reproduce exactly."""


def _scalar(value: float = 0.0) -> torch.Tensor:
    # torch.optim's `step` (and ASGD's mu, NAdam's mu_product): a float32 scalar on CPU
    return torch.tensor(value, dtype=torch.float32)


def _zeros(p):
    return torch.zeros_like(p, memory_format=torch.preserve_format)


# Adagrad creates its state in __init__, from the constructor's initial_accumulator_value
# (a group's own value is ignored); every other class on the parameter's first step.
EAGER_STATE = ("adagrad",)


def init_state(kind: str, p: torch.Tensor, g: dict) -> dict:
    """A parameter's state on its first step (in __init__ for EAGER_STATE kinds), as the
    class creates it."""
    if kind == "sgd":
        return {}  # momentum_buffer appears after the first step (the functional creates it)
    if kind in ("adam", "adamw"):
        st = {"step": _scalar(), "exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)}
        if g["amsgrad"]:
            st["max_exp_avg_sq"] = _zeros(p)
        return st
    if kind == "adagrad":
        return {"step": _scalar(), "sum": torch.full_like(p, g["initial_accumulator_value"],
                                                         memory_format=torch.preserve_format)}
    if kind == "rmsprop":
        st = {"step": _scalar(), "square_avg": _zeros(p)}
        if g["momentum"] > 0:
            st["momentum_buffer"] = _zeros(p)
        if g["centered"]:
            st["grad_avg"] = _zeros(p)
        return st
    if kind == "adamax":
        return {"step": _scalar(), "exp_avg": _zeros(p), "exp_inf": _zeros(p)}
    if kind == "nadam":
        return {"step": _scalar(), "mu_product": _scalar(1.0), "exp_avg": _zeros(p),
                "exp_avg_sq": _zeros(p)}
    if kind == "radam":
        return {"step": _scalar(), "exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)}
    if kind == "asgd":
        return {"step": _scalar(), "eta": torch.as_tensor(float(g["lr"]), dtype=torch.float32).clone(),
                "mu": _scalar(1.0), "ax": _zeros(p)}
    if kind == "adadelta":
        return {"step": _scalar(), "square_avg": _zeros(p), "acc_delta": _zeros(p)}
    if kind == "rprop":
        return {"step": _scalar(), "prev": _zeros(p),
                "step_size": torch.full_like(p, float(g["lr"]))}
    raise OptimizerError(f"optimizer kind {kind!r} has no step function")


def _col(states, key):
    return [s[key] for s in states]


# One function per torch.optim class: the call its `step()` makes, flag for flag.
def _sgd(params, grads, states, g):
    bufs = [s.get("momentum_buffer") for s in states] if g["momentum"] != 0 else []
    sgd(params, grads, bufs, has_sparse_grad=False, foreach=g["foreach"], fused=g["fused"],
        weight_decay=g["weight_decay"], momentum=g["momentum"], lr=g["lr"],
        dampening=g["dampening"], nesterov=g["nesterov"], maximize=g["maximize"])
    if g["momentum"] != 0:
        for s, b in zip(states, bufs):
            s["momentum_buffer"] = b


def _adam(params, grads, states, g):
    b1, b2 = g["betas"]
    adam(params, grads, _col(states, "exp_avg"), _col(states, "exp_avg_sq"),
         _col(states, "max_exp_avg_sq") if g["amsgrad"] else [], _col(states, "step"),
         amsgrad=g["amsgrad"], has_complex=False, beta1=b1, beta2=b2, lr=g["lr"],
         weight_decay=g["weight_decay"], eps=g["eps"], maximize=g["maximize"],
         foreach=g["foreach"], capturable=g["capturable"], differentiable=g["differentiable"],
         fused=g["fused"], decoupled_weight_decay=g["decoupled_weight_decay"])


def _adagrad(params, grads, states, g):
    adagrad(params, grads, _col(states, "sum"), _col(states, "step"), lr=g["lr"],
            weight_decay=g["weight_decay"], lr_decay=g["lr_decay"], eps=g["eps"],
            has_sparse_grad=False, foreach=g["foreach"], maximize=g["maximize"],
            differentiable=g["differentiable"], has_complex=False, fused=g["fused"])


def _rmsprop(params, grads, states, g):
    rmsprop(params, grads, _col(states, "square_avg"),
            _col(states, "grad_avg") if g["centered"] else [],
            _col(states, "momentum_buffer") if g["momentum"] > 0 else [], _col(states, "step"),
            lr=g["lr"], alpha=g["alpha"], eps=g["eps"], weight_decay=g["weight_decay"],
            momentum=g["momentum"], centered=g["centered"], foreach=g["foreach"],
            maximize=g["maximize"], differentiable=g["differentiable"],
            capturable=g["capturable"], has_complex=False)


def _adamax(params, grads, states, g):
    b1, b2 = g["betas"]
    adamax(params, grads, _col(states, "exp_avg"), _col(states, "exp_inf"), _col(states, "step"),
           eps=g["eps"], beta1=b1, beta2=b2, lr=g["lr"], weight_decay=g["weight_decay"],
           foreach=g["foreach"], maximize=g["maximize"], differentiable=g["differentiable"],
           capturable=g["capturable"], has_complex=False)


def _nadam(params, grads, states, g):
    b1, b2 = g["betas"]
    nadam(params, grads, _col(states, "exp_avg"), _col(states, "exp_avg_sq"),
          _col(states, "mu_product"), _col(states, "step"), beta1=b1, beta2=b2, lr=g["lr"],
          weight_decay=g["weight_decay"], momentum_decay=g["momentum_decay"], eps=g["eps"],
          maximize=g["maximize"], decoupled_weight_decay=g["decoupled_weight_decay"],
          foreach=g["foreach"], capturable=g["capturable"], differentiable=g["differentiable"],
          has_complex=False)


def _radam(params, grads, states, g):
    b1, b2 = g["betas"]
    radam(params, grads, _col(states, "exp_avg"), _col(states, "exp_avg_sq"), _col(states, "step"),
          beta1=b1, beta2=b2, lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"],
          maximize=g["maximize"], foreach=g["foreach"], capturable=g["capturable"],
          differentiable=g["differentiable"], decoupled_weight_decay=g["decoupled_weight_decay"],
          has_complex=False)


def _asgd(params, grads, states, g):
    asgd(params, grads, _col(states, "ax"), _col(states, "mu"), _col(states, "eta"),
         _col(states, "step"), lambd=g["lambd"], lr=g["lr"], t0=g["t0"], alpha=g["alpha"],
         weight_decay=g["weight_decay"], foreach=g["foreach"], maximize=g["maximize"],
         differentiable=g["differentiable"], capturable=g["capturable"], has_complex=False)


def _adadelta(params, grads, states, g):
    adadelta(params, grads, _col(states, "square_avg"), _col(states, "acc_delta"),
             _col(states, "step"), lr=g["lr"], rho=g["rho"], eps=g["eps"],
             weight_decay=g["weight_decay"], foreach=g["foreach"], maximize=g["maximize"],
             differentiable=g["differentiable"], capturable=g["capturable"], has_complex=False)


def _rprop(params, grads, states, g):
    etaminus, etaplus = g["etas"]
    lo, hi = g["step_sizes"]
    rprop(params, grads, _col(states, "prev"), _col(states, "step_size"), _col(states, "step"),
          step_size_min=lo, step_size_max=hi, etaminus=etaminus, etaplus=etaplus,
          foreach=g["foreach"], maximize=g["maximize"], differentiable=g["differentiable"],
          capturable=g["capturable"], has_complex=False)


STEPS: dict[str, Callable] = {
    "sgd": _sgd, "adam": _adam, "adamw": _adam, "adagrad": _adagrad, "rmsprop": _rmsprop,
    "adamax": _adamax, "nadam": _nadam, "radam": _radam, "asgd": _asgd, "adadelta": _adadelta,
    "rprop": _rprop,
}
assert set(STEPS) == set(OPTIMIZER_CLASSES)


# -- groups and their hyperparameters over time ---------------------------------------
def optimizer_class(kind: str) -> type:
    return getattr(torch.optim, OPTIMIZER_CLASSES[kind])


def _hyper_for_torch(g: dict) -> dict:
    """A recorded group's hyperparameters as torch's constructor takes them (JSON lists back
    to the tuples torch stores)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in g.items() if k != "params"}


@functools.lru_cache(maxsize=None)
def _filling_class(cls: type) -> type:
    """`cls` for ckptd's own stand-in optimizers (hyperparameters filled in, a dummy for
    the LR scheduler): the same class but for add_param_group, which calls torch's
    function beneath its dynamo guard. The guard imports torch._dynamo on first use, 1.1 s
    that a replay would otherwise spend before its first packet; these stand-ins never run
    under torch.compile. The trainer's optimizer (torch_optimizer) is torch's own class."""
    base = torch.optim.Optimizer.add_param_group
    if cls.add_param_group is not base or not hasattr(base, "__wrapped__"):
        return cls
    return type(cls.__name__, (cls,), {"add_param_group": base.__wrapped__})


def construct(kind: str, groups: list[dict], stand_in: bool = False) -> torch.optim.Optimizer:
    """torch's optimizer over `groups` (hyperparameters as torch takes them, "params" the
    tensors), with the first group's values also as the constructor's defaults: what some
    classes read from the constructor alone (Adagrad's initial_accumulator_value, SGD's
    nesterov check) then agrees with the groups. `stand_in`: ckptd's own object, never
    stepped by a trainer (_filling_class)."""
    cls = optimizer_class(kind)
    if stand_in:
        cls = _filling_class(cls)
    takes = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in groups[0].items() if k in takes and k != "params"}
    return cls(groups, **defaults)


# Hyperparameters that are pairs (Adam's family's betas, Rprop's etas and step_sizes).
PAIRS = ("betas", "etas", "step_sizes")


def full_groups(opt: Optimizer, names: list[str]) -> list[dict]:
    """Every param group with every hyperparameter filled in as torch fills it: the plan's
    values over the class's defaults (resolved by constructing the class itself)."""
    groups = opt.groups or ({"params": list(names), **opt.legacy_hyperparameters()},)
    cls = optimizer_class(opt.kind)
    dummy = [torch.zeros(1) for _ in groups]
    # torch's constructor checks only its defaults (here the first group's values): a later
    # group's bad value ("momentum": "x") would pass and raise at the first step it is used
    if any(_construct_error(opt.kind, _hyper_for_torch(g)) for g in groups[1:]):
        raise OptimizerError(_refused_hyperparameter(opt, groups) or f"optimizer.groups: {cls.__name__} refuses them")
    try:
        filled = construct(opt.kind, [{**_hyper_for_torch(g), "params": [d]}
                                      for g, d in zip(groups, dummy)], stand_in=True).param_groups
    except Exception as e:  # noqa: BLE001 -- whatever torch's constructor refuses, said by key
        raise OptimizerError(_refused_hyperparameter(opt, groups) or f"optimizer.groups: {cls.__name__}: {e}") from e
    if opt.groups:
        _refuse_misspelt(cls, groups, filled)
    out = []
    for i, (g, f) in enumerate(zip(groups, filled)):
        h = {k: v for k, v in f.items() if k != "params"}
        for k in PAIRS:
            # torch's constructors check a pair's first two values and unpack it at the
            # first step: betas of three values failed there ("too many values to unpack")
            if k in h and not (isinstance(h[k], (list, tuple)) and len(h[k]) == 2):
                key = f"optimizer.groups[{i}].{k}" if opt.groups else f"optimizer.{k}"
                raise OptimizerError(f"{key} is {_short(g.get(k, h[k]))}: torch.optim.{cls.__name__} takes two values there")
        if isinstance(h.get("lr"), torch.Tensor):
            raise OptimizerError(f"optimizer {cls.__name__}: a tensor lr is not supported")
        if h.get("capturable"):  # torch asserts CUDA (or XLA, ...) tensors on its first step
            raise OptimizerError(f"optimizer.groups[{i}].capturable is true: the shadow steps {cls.__name__} "
                                 "on the CPU, where torch refuses a capturable step; use capturable=False")
        out.append({**h, "params": list(g["params"])})
    return out


def _refuse_misspelt(cls, groups, filled) -> None:
    """A group key the class takes no hyperparameter of is kept by torch as the trainer's own
    (a name, an lr multiplier), so the plan's groups keep such keys too. One a letter or two
    from a hyperparameter's name is a misspelling, though: the shadow would step with the
    class's own value of it, not the one given, and every checkpoint would be wrong. A key
    that holds a hyperparameter's name as a word (OneCycleLR's max_momentum, any
    scheduler's initial_lr) is the trainer's or a scheduler's own."""
    import difflib
    known = [k for k in inspect.signature(cls.__init__).parameters if k not in ("self", "params", "defaults")]
    for i, (g, f) in enumerate(zip(groups, filled)):
        for k in g:
            if k == "params" or not isinstance(k, str) or k in known:
                continue
            if any(w in known for w in k.split("_")) or any(f"_{w}" in k or f"{w}_" in k for w in known if "_" in w):
                continue  # a word of its own beside one (an lr scheduler's max_momentum, initial_lr, base_lr)
            meant = difflib.get_close_matches(k.lower(), known, n=1, cutoff=0.8)
            if meant:
                name = f"torch.optim.{cls.__name__}"
                raise OptimizerError(
                    f"optimizer.groups[{i}].{k}: {name} has no such hyperparameter; {meant[0]} misspelt? "
                    f"The shadow would step with {name}'s {meant[0]} of {_short(f[meant[0]])}, not "
                    f"{_short(g[k])} (a key of the trainer's own is kept as torch keeps it: name it unlike any "
                    "hyperparameter, or leave it out of the plan)")


# Plan keys of the legacy hyperparameters (plans without groups) that torch's do not name.
_LEGACY_KEYS = {"foreach": "implementation", "fused": "implementation"}


def _construct_error(kind: str, hyper: dict) -> Exception | None:
    try:
        construct(kind, [{**hyper, "params": [torch.zeros(1)]}], stand_in=True)
    except Exception as e:  # noqa: BLE001 -- a refusal of any kind is what is asked
        return e
    return None


def _refused_hyperparameter(opt: Optimizer, groups) -> str | None:
    """The message for the first group torch's constructor refuses on its own, naming the
    plan key: the hyperparameter without which it is taken (torch's default for it is
    valid), or the group."""
    cls = optimizer_class(opt.kind).__name__
    for i, g in enumerate(groups):
        h = _hyper_for_torch(g)
        err = _construct_error(opt.kind, h)
        if err is None:
            continue
        why = " ".join(str(err).split())[:200]
        for k in h:
            if _construct_error(opt.kind, {x: v for x, v in h.items() if x != k}) is None:
                key = f"optimizer.groups[{i}].{k}" if opt.groups else f"optimizer.{_LEGACY_KEYS.get(k, k)}"
                return f"{key} is {_short(g[k])}: torch.optim.{cls} refuses it ({why})"
        return f"{f'optimizer.groups[{i}]' if opt.groups else 'optimizer'}: torch.optim.{cls} refuses it ({why})"
    return None


def scheduler_class(name) -> type:
    if name in UNREPLAYABLE:
        how = "" if name in LOSS_DRIVEN else \
            " (ckptd.torch.write_plan records the lrs it sets as optimizer.lr_per_step)"
        raise OptimizerError(f"optimizer.lr_scheduler.class {name} cannot be replayed: {UNREPLAYABLE[name]}{how}")
    cls = getattr(torch.optim.lr_scheduler, name, None) if isinstance(name, str) and not name.startswith("_") else None
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.lr_scheduler.LRScheduler):
        raise OptimizerError(f"optimizer.lr_scheduler.class {_short(name)} is not a torch.optim.lr_scheduler class")
    return cls


def _split_top(text: str, sep: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()]


def _fits_annotation(v, ann: str) -> bool | None:
    """Whether a JSON value is of a scheduler argument's annotated type (torch's strings:
    "int", "float | list[float]", "Iterable[int]", "Literal['cos', 'linear']", ...);
    None where the annotation is not one of these."""
    verdicts = []
    for alt in _split_top(ann, "|"):
        if alt == "None":
            verdicts.append(v is None)
        elif alt == "int":
            verdicts.append(isinstance(v, int) and not isinstance(v, bool))
        elif alt == "float":
            verdicts.append(isinstance(v, (int, float)) and not isinstance(v, bool) and _all_finite(v))
        elif alt == "bool":
            verdicts.append(isinstance(v, bool))
        elif alt == "str":
            verdicts.append(isinstance(v, str))
        elif alt.startswith(("list[", "Iterable[", "Sequence[")) and alt.endswith("]"):
            inner = alt[alt.index("[") + 1:-1]
            each = [_fits_annotation(x, inner) for x in v] if isinstance(v, list) else [False]
            verdicts.append(None if None in each else all(each))
        elif alt.startswith("Literal[") and alt.endswith("]"):
            try:
                choices = ast.literal_eval(f"({alt[8:-1]},)")
            except (ValueError, SyntaxError):
                return None
            verdicts.append(v in choices and not isinstance(v, (list, dict)))
        elif alt.startswith("Callable"):
            verdicts.append(False)  # Python code: never in a plan
        else:
            return None
    return any(verdicts)


# Scheduler arguments torch takes as any int but divides by (StepLR: last_epoch %
# step_size; CosineAnnealingLR: % (2 * T_max)): 0 fails at the first step.
_POSITIVE_ARGS = {("StepLR", "step_size"), ("CosineAnnealingLR", "T_max"), ("CosineAnnealingWarmRestarts", "T_0"),
                  ("CyclicLR", "step_size_up")}


def _scheduler_failure(opt: Optimizer, groups: list[dict], args: dict, steps: int) -> Exception | None:
    """What building the scheduler over `groups` and stepping it `steps` times raises."""
    trial = dataclasses.replace(opt, lr_scheduler={**opt.lr_scheduler, "args": args})
    try:
        sched = GroupSchedule(trial, groups)
        for step in range(steps + 1):
            sched.at(step)
    except Exception as e:  # noqa: BLE001 -- ZeroDivisionError, TypeError, ...: any is the plan's
        return e.__cause__ if isinstance(e, OptimizerError) and e.__cause__ is not None else e
    return None


def check_replayable(opt: Optimizer, iterations: int | None = None) -> None:
    """What torch itself refuses in a plan's optimizer, found when the plan is loaded, not
    when a step needs it: every group through the class's constructor, and the lr
    scheduler built by class and stepped (up to twice, within the plan's iterations) as
    the shadow will. PlanError naming the plan key."""
    try:
        groups = full_groups(opt, [])
    except OptimizerError as e:
        raise PlanError(str(e)) from None
    s = opt.lr_scheduler
    if s is None:
        return
    key = "optimizer.lr_scheduler"
    try:
        cls = scheduler_class(s["class"])
    except OptimizerError as e:
        raise PlanError(str(e)) from None
    name, args = cls.__name__, dict(s.get("args") or {})
    takes = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k not in ("self", "optimizer")}
    for k, v in args.items():
        if k not in takes:
            raise PlanError(f"{key}.args.{k}: {name} takes no such argument (it takes {', '.join(takes)})")
        ann = takes[k].annotation
        if isinstance(ann, str) and _fits_annotation(v, ann) is False:
            raise PlanError(f"{key}.args.{k} is {_short(v)}; {name} takes {ann}")
        if (name, k) in _POSITIVE_ARGS and isinstance(v, int) and v < 1:
            raise PlanError(f"{key}.args.{k} is {v}; {name} needs it >= 1 (it divides by it)")
    missing = [k for k, p in takes.items() if p.default is inspect.Parameter.empty and k not in args]
    if missing:
        raise PlanError(f"{key}.args.{missing[0]} is missing: {name} needs it")
    steps = 2 if iterations is None else max(0, min(2, iterations - 1))
    err = _scheduler_failure(opt, groups, args, steps)
    if err is None:
        return
    text = err.args[0] if isinstance(err, KeyError) and err.args else err  # KeyError's str is a repr
    why = f"{type(err).__name__}: {' '.join(str(text).split())[:200]}"
    said = [k for k in args if k in str(text)]
    if len(said) == 1:  # torch's own check names it ("Expected positive integer total_steps")
        raise PlanError(f"{key}.args.{said[0]} is {_short(args[said[0]])}: {name} refuses it ({why})")
    for k in args:  # the argument without which (torch's default instead) it works
        if takes[k].default is not inspect.Parameter.empty and \
                _scheduler_failure(opt, groups, {x: v for x, v in args.items() if x != k}, steps) is None:
            raise PlanError(f"{key}.args.{k} is {_short(args[k])}: {name} fails with it ({why})")
    only = f".args.{next(iter(args))}" if len(args) == 1 else ""
    raise PlanError(f"{key}{only}: {name}({', '.join(f'{k}={v!r}' for k, v in args.items())[:120]}) "
                    f"fails when built and stepped ({why})")


# torch.optim.lr_scheduler classes the shadow cannot build from class and arguments.
# All but the loss-driven ones set an lr that is a function of the step count alone:
# ckptd.torch.write_plan steps the trainer's own scheduler object through the job's
# iterations and records the lrs it sets as `lr_per_step` (so does it for a scheduler
# class of the trainer's own); a plan naming one of these classes is refused.
UNREPLAYABLE = {
    "LambdaLR": "its lr_lambda is Python code",
    "MultiplicativeLR": "its lr_lambda is Python code",
    "ReduceLROnPlateau": "it steps on the training loss, which is not on the wire",
    "SequentialLR": "it nests other schedulers",
    "ChainedScheduler": "it nests other schedulers",
}
LOSS_DRIVEN = frozenset({"ReduceLROnPlateau"})


class GroupSchedule:
    """Each group's hyperparameters for training step i: the plan's values, moved by the
    trainer's lr scheduler replayed on a dummy optimizer of the same class (the real
    scheduler class, so any scheduler that only reads its step count is exact), or by
    the legacy `lr_schedule` (base lr x factor(step), LambdaLR semantics)."""

    def __init__(self, opt: Optimizer, groups: list[dict]):
        self.opt, self.groups = opt, groups
        self.pos = -1
        self.dummy = self.sched = None

    def _start(self):
        s = self.opt.lr_scheduler
        name = s["class"]
        cls = scheduler_class(name)
        groups = []
        for g in self.groups:
            h = _hyper_for_torch(g)
            h["lr"] = h.pop("initial_lr", h["lr"])  # the lr before the scheduler first set it
            groups.append({**h, "params": [torch.zeros(1)]})
        self.dummy = construct(self.opt.kind, groups, stand_in=True)
        args = {k: tuple(v) if isinstance(v, list) and k != "milestones" else v
                for k, v in (s.get("args") or {}).items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                self.sched = cls(self.dummy, **args)
            except (TypeError, ValueError, KeyError) as e:
                raise OptimizerError(f"optimizer.lr_scheduler: {name}{args}: {e}") from e
        self.pos = 0

    def at(self, step: int) -> list[dict]:
        if self.opt.lr_per_step:
            return lrs_set_by_hand(self.opt.lr_per_step, step, self.groups)
        if self.opt.lr_scheduler is None:
            f = lr_factor(self.opt.lr_schedule, step)
            return [{**g, "lr": g["lr"] * f} if f != 1.0 else g for g in self.groups]
        if self.sched is None or step < self.pos:
            self._start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scheduler.step() with no optimizer.step()
            while self.pos < step:
                self.sched.step()
                self.pos += 1
        return [{**g, **{k: v for k, v in d.items() if k not in ("params", "initial_lr")}}
                for g, d in zip(self.groups, self.dummy.param_groups)]


class NoLrForStep(OptimizerError):
    """A step past the plan's `lr_per_step`: its lr is not known, so the shadow stops
    there (the pipeline reports the iteration not applied, with this message)."""


def lrs_set_by_hand(lr_per_step: tuple, step: int, groups: list[dict]) -> list[dict]:
    """The groups with the lr the trainer wrote into them before step `step` (the plan's
    list: one lr for every group or one per group). A step past the list has no known lr,
    so it is refused rather than stepped with a guess."""
    if step >= len(lr_per_step):
        raise NoLrForStep(f"optimizer.lr_per_step has {len(lr_per_step)} entries: no lr for step {step} (the "
                          f"plan holds the lrs of steps 0-{len(lr_per_step) - 1}: write_plan's lr_per_step, or "
                          "its iterations for a scheduler it stepped through them)")
    x = lr_per_step[step]
    lrs = list(x) if isinstance(x, (list, tuple)) else [x] * len(groups)
    return [{**g, "lr": float(lr)} for g, lr in zip(groups, lrs)]


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
    """The legacy schedule's lr (one group): base lr x factor(step)."""
    return opt.lr * lr_factor(opt.lr_schedule, step)


# -- AMP -------------------------------------------------------------------------------
def scaler_state(cfg: dict) -> dict:
    """GradScaler's lazily created state (_lazy_init_scale_growth_tracker)."""
    return {"scale": torch.full((), float(cfg.get("init_scale", 65536.0)), dtype=torch.float32),
            "growth_tracker": torch.full((), 0, dtype=torch.int32)}


def scaler_unscale(grads: list[torch.Tensor], state: dict) -> bool:
    """GradScaler.unscale_: grads times 1/scale in place; True if any is inf or nan."""
    inv_scale = state["scale"].double().reciprocal().float()
    found_inf = torch.full((), 0.0, dtype=torch.float32)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)
    state["found_inf"] = found_inf
    return bool(found_inf.item())


def scaler_update(state: dict, cfg: dict) -> None:
    """GradScaler.update: grow the scale after growth_interval clean steps, back off on inf."""
    torch._amp_update_scale_(state["scale"], state["growth_tracker"], state.pop("found_inf"),
                             float(cfg.get("growth_factor", 2.0)), float(cfg.get("backoff_factor", 0.5)),
                             int(cfg.get("growth_interval", 2000)))


# -- one step ---------------------------------------------------------------------------
def step_groups(kind: str, params: list[torch.Tensor], grads: list[torch.Tensor],
                states: list[dict], hyper: dict) -> None:
    """The optimizer's update of one group (or any subset of it) in place."""
    with torch.no_grad():
        STEPS[kind](params, grads, states, hyper)


def writes_grads(kind: str, g: dict) -> bool:
    """Whether torch's step of this group may write into the gradients it is handed. The
    shadow hands it views of the reduced bucket buffers, which must keep the wire's values
    (later copies of the same elements are compared with them): such a group gets copies.
    SGD with Nesterov momentum adds the momentum into the grads in place
    (torch/optim/sgd.py _multi_tensor_sgd, `torch._foreach_add_(device_grads, bufs)`, when
    no weight decay made them fresh tensors first); every other step leaves them alone."""
    return kind == "sgd" and bool(g.get("nesterov")) and g.get("momentum", 0) != 0


def clips(opt: Optimizer) -> bool:
    return opt.max_grad_norm is not None or opt.clip_grad_value is not None


def clip_grads(opt: Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """The trainer's clipping call, on the grads in place, through torch's own function
    (so the same norm, in the same order, and the same rounding): clip_grad_norm_ with the
    plan's max_norm and norm_type, or clip_grad_value_ (a clamp, elementwise)."""
    if opt.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(_as_leaves(params, grads), opt.max_grad_norm, norm_type=opt.grad_norm_type)
    elif opt.clip_grad_value is not None:
        torch.nn.utils.clip_grad_value_(_as_leaves(params, grads), opt.clip_grad_value)


def torch_optimizer(opt: Optimizer, named_params) -> torch.optim.Optimizer:
    """The trainer-side optimizer the plan describes (the synthesizer's trainer):
    `named_params` is model.named_parameters()."""
    by_name = dict(named_params)
    return construct(opt.kind, [{**_hyper_for_torch(g), "params": [by_name[n] for n in g["params"]]}
                                 for g in full_groups(opt, list(by_name))])


def torch_scheduler(opt: Optimizer, optimizer: torch.optim.Optimizer):
    """The trainer-side lr scheduler the plan names, or None."""
    if opt.lr_scheduler is None:
        return None
    s = opt.lr_scheduler
    return getattr(torch.optim.lr_scheduler, s["class"])(optimizer, **(s.get("args") or {}))


def _as_leaves(params, grads):
    """torch's clipping reads .grad: hand it views that carry the shadow's grads."""
    leaves = []
    for p, g in zip(params, grads):
        leaf = p.detach()
        leaf.grad = g
        leaves.append(leaf)
    return leaves
