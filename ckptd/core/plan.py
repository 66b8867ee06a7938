"""The workload plan: the one description of the training job ckptd shadows.

A plan is a JSON file (format "ckptd-plan", version 1); docs/PLAN.md documents every
field. It says what the model's parameters are, how DDP buckets them for allreduce
(the first iteration's layout and the rebuilt one used from iteration 1 on), how NCCL
runs the ring, which optimizer the trainer steps, which NIC address each rank has and
what each mirror stream sees. QP numbers and initial PSNs are never in a plan: they
are learned from the traffic.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ckptd.core.schedule import Bucket, RingConfig, RingSchedule, ScheduleError
from ckptd.errors import CkptdError

PLAN_FORMAT = "ckptd-plan"
PLAN_VERSION = 1
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8")
# plan optimizer kind -> the torch.optim class the trainer steps (each has a functional form
# that its step() calls; ckptd.core.optim.STEPS calls the same)
OPTIMIZER_CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad",
                     "rmsprop": "RMSprop", "adamax": "Adamax", "nadam": "NAdam", "radam": "RAdam",
                     "asgd": "ASGD", "adadelta": "Adadelta", "rprop": "Rprop"}
# DDP communication hooks ckptd decodes: hook -> the dtype its allreduce puts on the wire
COMM_HOOKS = {"allreduce": None, "fp16_compress": "float16", "bf16_compress": "bfloat16"}
GRAD_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


class PlanError(CkptdError, ValueError):
    """A plan file that is malformed or inconsistent; the message names the field."""


@dataclass(frozen=True)
class Parameter:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class BucketLayout:
    """One allreduce: the parameters whose gradients it carries, in buffer order, or
    (for a bare collective with no model) an element count and dtype."""

    params: tuple[str, ...] = ()
    count: int = 0
    dtype: str = "float32"


@dataclass(frozen=True)
class Optimizer:
    kind: str = "adamw"  # a key of OPTIMIZER_CLASSES
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    amsgrad: bool = False
    implementation: str = "foreach"  # for-loop | foreach | fused
    lr_schedule: dict = field(default_factory=lambda: {"kind": "constant"})
    max_grad_norm: float | None = None
    # torch's param_groups: {"params": [names], hyperparameter: value, ...}; empty: one
    # group of every parameter with the fields above (adam/adamw plans before groups)
    groups: tuple = ()
    lr_scheduler: dict | None = None  # {"class": "StepLR", "args": {...}}: replayed by torch
    grad_scaler: dict | None = None  # GradScaler settings: the wire carries scaled gradients

    def legacy_hyperparameters(self) -> dict:
        """The one group a plan without `groups` describes, as torch's constructor takes it."""
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, "amsgrad": self.amsgrad,
                "foreach": self.implementation == "foreach",
                "fused": True if self.implementation == "fused" else None}

    def to_json(self) -> dict:
        doc = {"kind": self.kind, "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
               "weight_decay": self.weight_decay, "amsgrad": self.amsgrad,
               "implementation": self.implementation, "lr_schedule": dict(self.lr_schedule),
               "max_grad_norm": self.max_grad_norm}
        if self.groups:
            doc["groups"] = [dict(g) for g in self.groups]
        if self.lr_scheduler is not None:
            doc["lr_scheduler"] = dict(self.lr_scheduler)
        if self.grad_scaler is not None:
            doc["grad_scaler"] = dict(self.grad_scaler)
        return doc


@dataclass(frozen=True)
class Mirror:
    """A mirror stream: the switch port of `rank`, frames it sends (tx), receives (rx) or both."""

    name: str
    rank: int
    direction: str = "both"

    def sees(self, src: int, dst: int) -> bool:
        return ((self.direction in ("tx", "both") and src == self.rank)
                or (self.direction in ("rx", "both") and dst == self.rank))


@dataclass(frozen=True)
class Plan:
    parameters: tuple[Parameter, ...]
    buckets_first: tuple[BucketLayout, ...]
    buckets_rebuilt: tuple[BucketLayout, ...]
    ring: RingConfig
    optimizer: Optimizer | None
    addresses: tuple[str, ...]  # rank -> NIC address (canonical text)
    mirrors: tuple[Mirror, ...] = ()
    iterations: int | None = None
    transport: str = "roce"  # roce: NCCL over RoCEv2 | gloo: torch.distributed gloo over TCP
    rebuilt_learn: bool = False  # buckets.rebuilt is "learn": taken from the wire (gloo only)
    comm_hook: str = "allreduce"  # DDP's comm hook: a key of COMM_HOOKS

    # -- derived ------------------------------------------------------------------
    @property
    def nranks(self) -> int:
        return self.ring.nranks

    def param(self, name: str) -> Parameter:
        return self._params_by_name()[name]

    def _params_by_name(self) -> dict[str, Parameter]:
        return {p.name: p for p in self.parameters}

    def layout(self, iteration: int) -> tuple[BucketLayout, ...]:
        return self.buckets_first if iteration == 0 else self.buckets_rebuilt

    def learn_rebuilt(self, layout) -> None:
        """Set the rebuilt layout learned from the wire (a plan with "rebuilt": "learn";
        every stage reads it through layout()/buckets(), so it must be set before any
        iteration >= 1 is placed)."""
        if not self.rebuilt_learn:
            raise PlanError("the plan gives buckets.rebuilt; it is checked, not learned")
        object.__setattr__(self, "buckets_rebuilt", tuple(layout))

    def buckets(self, iteration: int) -> list[Bucket]:
        return [Bucket(self.bucket_count(b), np.dtype(_np_dtype(self.bucket_dtype(b))))
                for b in self.layout(iteration)]

    def bucket_count(self, b: BucketLayout) -> int:
        if b.params:
            return sum(self.param(n).numel for n in b.params)
        return b.count

    def bucket_dtype(self, b: BucketLayout) -> str:
        """The dtype on the wire: a compression hook's, else the parameters'."""
        if b.params:
            return COMM_HOOKS[self.comm_hook] or self.param(b.params[0]).dtype
        return b.dtype

    def schedule(self, iteration: int) -> RingSchedule:
        return RingSchedule(self.ring, self.buckets(iteration))

    def rank_of(self, addr: str) -> int | None:
        return self._rank_by_addr().get(addr)

    def _rank_by_addr(self) -> dict[str, int]:
        return {a: r for r, a in enumerate(self.addresses)}

    def param_ranges(self, iteration: int, b: int) -> list[tuple[str, int, int]]:
        """(name, start, end) element ranges of each parameter inside bucket b."""
        out, off = [], 0
        for name in self.layout(iteration)[b].params:
            n = self.param(name).numel
            out.append((name, off, off + n))
            off += n
        return out

    # -- (de)serialisation -------------------------------------------------------
    def to_json(self) -> dict:
        r = self.ring
        doc = {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "parameters": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype}
                           for p in self.parameters],
            "buckets": {"first": [_bucket_json(b) for b in self.buckets_first],
                        "rebuilt": "learn" if self.rebuilt_learn else
                        [_bucket_json(b) for b in self.buckets_rebuilt]},
            "ring": {
                "nranks": r.nranks, "rings": [list(x) for x in r.rings], "protocol": r.protocol,
                "nccl_version": f"{r.nccl_version[0]}.{r.nccl_version[1]}",
                "max_threads": r.max_threads, "buffsize": r.buffsize,
                "qps_per_connection": r.qps_per_connection,
                "split_data_on_qps": r.split_data_on_qps, "mtu": r.mtu,
            },
            "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
            "ranks": [{"rank": i, "addr": a} for i, a in enumerate(self.addresses)],
            "mirrors": [{"name": m.name, "rank": m.rank, "direction": m.direction}
                        for m in self.mirrors],
        }
        if self.iterations is not None:
            doc["iterations"] = self.iterations
        if self.transport != "roce":
            doc["transport"] = self.transport
        if self.comm_hook != "allreduce":
            doc["comm_hook"] = self.comm_hook
        return doc

    def save(self, path: str | Path):
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _bucket_json(b: BucketLayout) -> dict:
    return {"params": list(b.params)} if b.params else {"count": b.count, "dtype": b.dtype}


def _np_dtype(name: str) -> str:
    # numpy has no bfloat16: gradients of that type are carried as raw 16-bit words.
    return "uint16" if name == "bfloat16" else name


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{path}: cannot read plan: {e}") from e
    return plan_from_json(doc, str(path))


def plan_from_json(doc: dict, where: str = "plan") -> Plan:
    def need(d, key, ctx):
        if key not in d:
            raise PlanError(f"{where}: {ctx} is missing {key!r}")
        return d[key]

    if doc.get("format") != PLAN_FORMAT:
        raise PlanError(f"{where}: not a ckptd plan (format is {doc.get('format')!r}, "
                        f"expected {PLAN_FORMAT!r})")
    if doc.get("version") != PLAN_VERSION:
        raise PlanError(f"{where}: plan version {doc.get('version')!r} is not supported "
                        f"(this ckptd reads version {PLAN_VERSION})")
    params = []
    for i, p in enumerate(doc.get("parameters", [])):
        dt = p.get("dtype", "float32")
        if dt not in DTYPES:
            raise PlanError(f"{where}: parameters[{i}] ({p.get('name')}) has dtype {dt!r}; "
                            f"supported: {', '.join(DTYPES)}")
        params.append(Parameter(need(p, "name", f"parameters[{i}]"),
                                tuple(int(x) for x in need(p, "shape", f"parameters[{i}]")), dt))
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise PlanError(f"{where}: parameter names are not unique")

    def buckets(key):
        out = []
        for i, b in enumerate(need(need(doc, "buckets", "the plan"), key, "buckets") or []):
            if "params" in b:
                for n in b["params"]:
                    if n not in names:
                        raise PlanError(f"{where}: buckets.{key}[{i}] names unknown parameter {n!r}")
                dts = {next(p.dtype for p in params if p.name == n) for n in b["params"]}
                if len(dts) > 1:
                    raise PlanError(f"{where}: buckets.{key}[{i}] mixes dtypes {sorted(dts)}; "
                                    "DDP buckets hold one dtype")
                out.append(BucketLayout(params=tuple(b["params"])))
            else:
                dt = b.get("dtype", "float32")
                if dt not in DTYPES:
                    raise PlanError(f"{where}: buckets.{key}[{i}] has dtype {dt!r}")
                out.append(BucketLayout(count=int(need(b, "count", f"buckets.{key}[{i}]")), dtype=dt))
        return tuple(out)

    first = buckets("first")
    learn = doc["buckets"].get("rebuilt") == "learn"  # from the wire (gloo: DDP's broadcast)
    rebuilt = buckets("rebuilt") if doc["buckets"].get("rebuilt") and not learn else first
    for key, layout in (("first", first), ("rebuilt", rebuilt)):
        covered = [n for b in layout for n in b.params]
        if params and sorted(covered) != sorted(names):
            missing = sorted(set(names) - set(covered))
            dup = sorted({n for n in covered if covered.count(n) > 1})
            raise PlanError(f"{where}: buckets.{key} must hold every parameter exactly once "
                            f"(missing {missing[:5]}, repeated {dup[:5]})")

    r = need(doc, "ring", "the plan")
    try:
        major, minor = (int(x) for x in str(need(r, "nccl_version", "ring")).split(".")[:2])
        nranks = int(need(r, "nranks", "ring"))
        rings = r.get("rings") or [list(range(nranks))] * int(r.get("channels", 1))
        ring = RingConfig(
            nranks=nranks, rings=tuple(tuple(int(x) for x in ring) for ring in rings),
            protocol=str(r.get("protocol", "simple")).lower(), nccl_version=(major, minor),
            max_threads=int(r.get("max_threads", 512)), buffsize=r.get("buffsize"),
            qps_per_connection=int(r.get("qps_per_connection", 1)),
            split_data_on_qps=r.get("split_data_on_qps"), mtu=int(r.get("mtu", 4096)))
    except ScheduleError as e:
        raise PlanError(f"{where}: ring: {e}") from e
    except ValueError as e:
        raise PlanError(f"{where}: ring: {e}") from e

    opt = doc.get("optimizer")
    optimizer = None
    if opt is not None:
        optimizer = Optimizer(
            kind=opt.get("kind", "adamw"), lr=float(opt.get("lr", 1e-3)),
            betas=tuple(float(x) for x in opt.get("betas", (0.9, 0.999))),
            eps=float(opt.get("eps", 1e-8)), weight_decay=float(opt.get("weight_decay", 0.0)),
            amsgrad=bool(opt.get("amsgrad", False)),
            implementation=opt.get("implementation", "foreach"),
            lr_schedule=dict(opt.get("lr_schedule") or {"kind": "constant"}),
            max_grad_norm=opt.get("max_grad_norm"),
            groups=_optimizer_groups(opt.get("groups") or [], names, where),
            lr_scheduler=opt.get("lr_scheduler"), grad_scaler=opt.get("grad_scaler"))
        if optimizer.kind not in OPTIMIZER_CLASSES:
            raise PlanError(f"{where}: optimizer.kind {optimizer.kind!r} is not supported "
                            f"({', '.join(OPTIMIZER_CLASSES)})")
        if not optimizer.groups and optimizer.kind not in ("adam", "adamw"):
            raise PlanError(f"{where}: optimizer.kind {optimizer.kind!r} needs optimizer.groups")
        sch = optimizer.lr_scheduler
        if sch is not None and (not isinstance(sch, dict) or not isinstance(sch.get("class"), str)
                                or not isinstance(sch.get("args", {}), dict)):
            raise PlanError(f"{where}: optimizer.lr_scheduler must be {{\"class\": name, \"args\": {{...}}}}")
        gs = optimizer.grad_scaler
        if gs is not None and (not isinstance(gs, dict) or set(gs) - set(GRAD_SCALER_KEYS)):
            raise PlanError(f"{where}: optimizer.grad_scaler takes only {', '.join(GRAD_SCALER_KEYS)}")
        if optimizer.implementation not in ("for-loop", "foreach", "fused"):
            raise PlanError(f"{where}: optimizer.implementation must be for-loop, foreach or fused")
        if not params:
            raise PlanError(f"{where}: an optimizer needs parameters")

    ranks = sorted(need(doc, "ranks", "the plan"), key=lambda x: x["rank"])
    if [x["rank"] for x in ranks] != list(range(nranks)):
        raise PlanError(f"{where}: ranks must list ranks 0..{nranks - 1} once each")
    try:
        addrs = tuple(str(ipaddress.ip_address(x["addr"])) for x in ranks)
    except ValueError as e:
        raise PlanError(f"{where}: ranks: {e}") from e
    mirrors = []
    for i, m in enumerate(doc.get("mirrors", [])):
        mm = Mirror(m.get("name", f"mirror{i}"), int(need(m, "rank", f"mirrors[{i}]")),
                    m.get("direction", "both"))
        if mm.direction not in ("tx", "rx", "both") or not 0 <= mm.rank < nranks:
            raise PlanError(f"{where}: mirrors[{i}] needs rank in 0..{nranks - 1} and direction tx|rx|both")
        mirrors.append(mm)
    transport = doc.get("transport", "roce")
    if transport not in ("roce", "gloo"):
        raise PlanError(f"{where}: transport {transport!r} is not one of roce, gloo")
    if learn and (transport != "gloo" or not params):
        raise PlanError(f'{where}: buckets.rebuilt "learn" needs transport gloo and parameters')
    hook = doc.get("comm_hook", "allreduce")
    if hook not in COMM_HOOKS:
        raise PlanError(f"{where}: comm_hook {hook!r} is not one of {', '.join(COMM_HOOKS)}")
    return Plan(tuple(params), first, rebuilt, ring, optimizer, addrs, tuple(mirrors),
                doc.get("iterations"), transport, learn, hook)


def _optimizer_groups(groups: list, names: list[str], where: str) -> tuple:
    """optimizer.groups: every parameter in exactly one group; hyperparameters are
    checked by torch itself when the shadow builds them (ckptd.core.optim.full_groups)."""
    if not groups:
        return ()
    seen: list[str] = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise PlanError(f"{where}: optimizer.groups[{i}] needs a list of parameter names")
        unknown = [n for n in g["params"] if n not in names]
        if unknown:
            raise PlanError(f"{where}: optimizer.groups[{i}] names unknown parameters {unknown[:5]}")
        seen += g["params"]
    if sorted(seen) != sorted(names):
        raise PlanError(f"{where}: optimizer.groups must hold every parameter exactly once")
    return tuple(dict(g) for g in groups)
