"""The workload plan: the one description of the training job ckptd shadows.

A plan is a JSON file (format "ckptd-plan", version 1); docs/PLAN.md documents every
field. It says what the model's parameters are, how DDP buckets them for allreduce
(the first iteration's layout and the rebuilt one used from iteration 1 on), how NCCL
runs the ring, which optimizer the trainer steps, which NIC address each rank has and
what each mirror stream sees. QP numbers and initial PSNs are never in a plan: they
are learned from the traffic.

Ranks, nodes and NICs: each rank has its own NIC address (`addr`), the node it runs on
(default: a node of its own, so a plan without nodes is one GPU per host) and, per
channel, the address of the NIC its network hops of that channel use (`nics`; default
its own NIC on every channel). Ranks of one node may share a NIC, and with PXN a rank
may send through a NIC of another GPU of its node; every NIC a channel uses must be
some rank's own NIC on that node, and the lowest such rank names it (`rank_of`). Only
hops between ranks of different nodes reach a NIC (`network_connections`).

Merged NICs (NCCL_IB_MERGE_NICS): a NIC may be several physical ports that NCCL's
net_ib drives as one device; `ports` lists their addresses in NCCL's device order
(default: `addr` alone). Each QP of a connection runs between one port of each end
(`qp_link`, RingConfig.port_of_qp), so a link on the wire is a pair of ports.
"""
from __future__ import annotations

import ipaddress
import json
import math
import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ckptd.core.algorithms import check_allreduce_algorithm
from ckptd.core.docload import strict_json
from ckptd.core.readfile import TooLarge, read_bounded
from ckptd.core.schedule import (IB_AR_THRESHOLD, MIN_AR_THRESHOLD, AllGather, Broadcast, Bucket, RingConfig, RingSchedule,
                                 ScheduleError, min_buffsize, network_connections, parse_nccl_version)
from ckptd.errors import CkptdError, unknown_keys

PLAN_FORMAT = "ckptd-plan"
PLAN_VERSION = 1
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8")


def dtype_name(dtype) -> str:
    """torch.float32 -> 'float32': how plans, messages and the raw layout's header name dtypes."""
    return str(dtype).removeprefix("torch.")
# plan optimizer kind -> the torch.optim class the trainer steps (each has a functional form
# that its step() calls; ckptd.core.optim.STEPS calls the same)
OPTIMIZER_CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad",
                     "rmsprop": "RMSprop", "adamax": "Adamax", "nadam": "NAdam", "radam": "RAdam",
                     "asgd": "ASGD", "adadelta": "Adadelta", "rprop": "Rprop"}
# DDP communication hooks ckptd decodes: hook -> the dtype its allreduce puts on the wire
COMM_HOOKS = {"allreduce": None, "fp16_compress": "float16", "bf16_compress": "bfloat16"}
# DDP with find_unused_parameters=True: after each round's last bucket the reducer allreduces
# its local_used_map, one int32 per reducer parameter (1 where this rank used it), so the
# reduced map says on how many ranks each parameter was used; 0: globally unused, its grad
# left untouched (None after zero_grad(), so torch's step skips it). The plan's wire layouts
# carry it as one more allreduce (Plan.layout_buckets), named so in reports.
# DDP with static_graph=True allreduces that map once, at iteration 0 FIRST (before its buckets,
# Reducer::delay_all_reduce), and keeps it: a parameter no rank used then is never stepped.
USED_MAP = "(DDP's used-parameter map)"
GRAD_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


class PlanError(CkptdError, ValueError):
    """A plan file that is malformed or inconsistent; the message names the field."""


# Bounds checked before anything is allocated: a plan is input, and a shape or count
# from it sizes the shadow, the bucket buffers and the per-iteration bookkeeping.
MAX_PARAM_ELEMENTS = 1 << 36  # 64 Gi elements over all parameters (a 250 GB fp32 model)
MAX_BUCKET_ELEMENTS = 1 << 34  # one allreduce
MAX_DIMS = 8
MAX_ITERATIONS = 1 << 31
MAX_RANKS = 1 << 16
MAX_PORTS = 4  # NCCL_IB_MAX_DEVS_PER_NIC from 2.24 (net_ib.cc:45@v2.24.3-1); 2 before, RingConfig checks
MAX_CHANNELS = 64  # NCCL's MAXCHANNELS
MAX_THREADS = 1024
MAX_BUFFSIZE = 1 << 30
MAX_QPS = 128
MAX_PLAN_BYTES = 256 << 20  # a plan file larger than this is not a plan


@dataclass(frozen=True)
class Parameter:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    # the order of its dimensions in memory, outermost first, where it is not the shape's
    # own (a channels_last conv weight: (0, 2, 3, 1)); None: contiguous. DDP lays each
    # gradient into its bucket in the parameter's memory order (reducer.cpp
    # initialize_bucket_views: as_strided with the parameter's strides)
    memory_order: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # not np.prod: 10x faster on a short tuple, asked per parameter per layout

    def grad_view(self, flat):
        """The parameter's gradient as a tensor of its shape over its bucket slice `flat`
        (strided as the parameter is, where it has a memory_order)."""
        if self.memory_order is None:
            return flat.view(self.shape)
        return flat.view([self.shape[d] for d in self.memory_order]).permute(self._to_shape_order)

    def laid_out(self, t):
        """`t` (of this shape) dense in this parameter's memory order: the shadow's copy,
        so that its step runs over the same layout as the trainer's."""
        if self.memory_order is None:
            return t.contiguous()
        return t.permute(self.memory_order).contiguous().permute(self._to_shape_order)

    @property
    def _to_shape_order(self) -> list[int]:
        """The permutation from memory order back to the shape's (memory_order's inverse)."""
        return [self.memory_order.index(d) for d in range(len(self.memory_order))]

    @classmethod
    def each_of(cls, named) -> tuple["Parameter", ...]:
        """The entries of (name, tensor) pairs (a module's parameters or buffers)."""
        return tuple(cls(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in named)


@dataclass(frozen=True)
class BucketLayout:
    """One allreduce: the parameters whose gradients it carries, in buffer order, or
    (for a bare collective with no model) an element count and dtype."""

    params: tuple[str, ...] = ()
    count: int = 0
    dtype: str = "float32"


@dataclass(frozen=True)
class ModuleBuffers:
    """DDP's module buffers (BatchNorm running statistics, ...). With broadcast_buffers
    (DDP's default) rank 0 broadcasts them at the start of a forward that follows a
    synced backward (and the first): `tensors` in DDP's order (module.named_buffers()),
    `broadcasts` the names of each coalesced broadcast in order, each flattened in that
    order (torch's broadcast_coalesced: one per dtype, at most 250 MB each).
    `captured`: the broadcasts are decoded (gloo; NCCL, where they are also
    collectives.before broadcasts: Plan.buffer_others) and checkpoints hold the buffers;
    False: not on the wire (broadcast_buffers=False) ,
    checkpoints lack them and say so."""

    tensors: tuple[Parameter, ...] = ()
    broadcasts: tuple[tuple[str, ...], ...] = ()
    captured: bool = False

    def to_json(self) -> dict:
        return {"tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.tensors],
                "broadcasts": [list(b) for b in self.broadcasts], "captured": self.captured}


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
    # clip_grad_norm_'s norm_type (inf: the largest |g|); only with max_grad_norm
    grad_norm_type: float = 2.0
    # torch.nn.utils.clip_grad_value_'s clip_value: every gradient element clamped to +-it
    clip_grad_value: float | None = None
    # torch's param_groups: {"params": [names], hyperparameter: value, ...}; empty: one
    # group of every parameter with the fields above (adam/adamw plans before groups)
    groups: tuple = ()
    lr_scheduler: dict | None = None  # {"class": "StepLR", "args": {...}}: replayed by torch
    grad_scaler: dict | None = None  # GradScaler settings: the wire carries scaled gradients
    # the lr the trainer sets by hand before step i (`g["lr"] = f(i)`, no scheduler):
    # entry i is one number for every group or one per group; no entry: no checkpoint
    lr_per_step: tuple = ()

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
        if self.grad_norm_type != 2.0:  # written only where set: plans before it read alike
            doc["grad_norm_type"] = "inf" if self.grad_norm_type == math.inf else self.grad_norm_type
        if self.clip_grad_value is not None:
            doc["clip_grad_value"] = self.clip_grad_value
        if self.groups:
            doc["groups"] = [dict(g) for g in self.groups]
        if self.lr_scheduler is not None:
            doc["lr_scheduler"] = dict(self.lr_scheduler)
        if self.grad_scaler is not None:
            doc["grad_scaler"] = dict(self.grad_scaler)
        if self.lr_per_step:
            doc["lr_per_step"] = [list(x) if isinstance(x, (list, tuple)) else x for x in self.lr_per_step]
        return doc


LR_SCHEDULES = ("constant", "linear", "cosine")
LR_SCHEDULE_KEYS = ("kind", "warmup_steps", "total_steps", "min_factor")  # what lr_factor reads
# an optimizer section's keys: Optimizer's fields, as to_json writes them
OPTIMIZER_KEYS = ("kind", "lr", "betas", "eps", "weight_decay", "amsgrad", "implementation", "lr_schedule",
                  "max_grad_norm", "grad_norm_type", "clip_grad_value", "groups", "lr_scheduler", "grad_scaler",
                  "lr_per_step")
TENSOR_KEYS = ("name", "shape", "dtype", "memory_order")  # an entry of parameters, frozen, buffers.tensors
# the other objects' keys, each as its writer below writes it (_ring_json, _rank_json,
# PLAN_FIELDS["mirrors"], _buckets_json, _bucket_json, ModuleBuffers.to_json), plus the
# ones a plan written by hand may give: ring.channels (one ring of ranks 0..n-1 per
# channel), ring.algorithm and ring.nvls_channels (docs/PLAN.md)
RING_KEYS = ("nranks", "rings", "protocol", "nccl_version", "max_threads", "buffsize", "qps_per_connection",
             "split_data_on_qps", "mtu", "adaptive_routing", "ar_threshold", "channels", "algorithm",
             "nvls_channels")
RANK_KEYS = ("rank", "addr", "node", "nics", "ports")
MIRROR_KEYS = ("name", "rank", "direction", "port")
BUCKETS_KEYS = ("first", "rebuilt", "limits")
BUCKET_LIMIT_KEYS = ("first", "rebuilt")
BUFFERS_KEYS = ("tensors", "broadcasts", "captured")
LR_SCHEDULER_KEYS = ("class", "args")


def check_optimizer(opt: Optimizer) -> None:
    """Every hyperparameter in the range the trainer's torch.optim accepts (and a schedule
    that can be evaluated), so a wrong plan is refused instead of committing wrong state.
    One place for every optimizer kind: a new kind adds its fields here."""
    def bad(key, why):
        raise PlanError(f"optimizer.{key} {why}")

    if opt.kind not in OPTIMIZER_CLASSES:
        bad("kind", f"{opt.kind!r} is not supported ({', '.join(OPTIMIZER_CLASSES)})")
    if not opt.groups and opt.kind not in ("adam", "adamw"):
        bad("kind", f"{opt.kind!r} needs optimizer.groups (its hyperparameters, as torch's param_groups)")
    sch, gs = opt.lr_scheduler, opt.grad_scaler
    if sch is not None and (not isinstance(sch, dict) or not isinstance(sch.get("class"), str)
                            or not isinstance(sch.get("args", {}), dict)):
        bad("lr_scheduler", 'must be {"class": name, "args": {...}}')
    if sch is not None and (why := unknown_keys("optimizer.lr_scheduler", sch, LR_SCHEDULER_KEYS)):
        raise PlanError(why)
    if opt.lr_per_step and sch is not None:
        bad("lr_per_step", "and lr_scheduler both set the lr: give one")
    for i, x in enumerate(opt.lr_per_step):
        lrs = x if isinstance(x, (list, tuple)) else [x]
        if not lrs or not all(_finite(v) and v >= 0 for v in lrs):
            bad(f"lr_per_step[{i}]", f"must be a finite lr >= 0 or a list of them, not {x!r}")
        if isinstance(x, (list, tuple)) and len(x) != max(1, len(opt.groups)):
            bad(f"lr_per_step[{i}]", f"has {len(x)} lrs for {max(1, len(opt.groups))} param groups")
    if gs is not None and (not isinstance(gs, dict) or set(gs) - set(GRAD_SCALER_KEYS)):
        bad("grad_scaler", f"takes only {', '.join(GRAD_SCALER_KEYS)}")
    for k, v in (gs or {}).items():
        ok, why = GRAD_SCALER_RULES[k]
        if not ok(v):
            bad(f"grad_scaler.{k}", f"is {_short(v)}; it must be {why}")
    for i, g in enumerate(opt.groups):
        for k, v in g.items() if isinstance(g, dict) else ():
            if k != "params" and not _all_finite(v):
                bad(f"groups[{i}].{k}", f"is {_short(v)}; it must be finite")
    if opt.implementation not in ("for-loop", "foreach", "fused"):
        bad("implementation", f"{opt.implementation!r} must be for-loop, foreach or fused")
    if not _finite(opt.lr) or opt.lr < 0:
        bad("lr", f"must be a finite number >= 0, not {opt.lr!r}")
    if (not isinstance(opt.betas, tuple) or len(opt.betas) != 2
            or not all(_finite(b) and 0 <= b < 1 for b in opt.betas)):
        bad("betas", f"must be two numbers in [0, 1), not {opt.betas!r}")
    if not _finite(opt.eps) or opt.eps <= 0:
        bad("eps", f"must be a finite number > 0, not {opt.eps!r}")
    if not _finite(opt.weight_decay) or opt.weight_decay < 0:
        bad("weight_decay", f"must be a finite number >= 0, not {opt.weight_decay!r}")
    if not isinstance(opt.amsgrad, bool):
        bad("amsgrad", f"must be true or false, not {opt.amsgrad!r}")
    if opt.max_grad_norm is not None and (not _finite(opt.max_grad_norm) or opt.max_grad_norm <= 0):
        bad("max_grad_norm", f"must be a finite number > 0 or null, not {opt.max_grad_norm!r}")
    p = opt.grad_norm_type
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (p == math.inf or _finite(p) and p > 0):
        bad("grad_norm_type", f"must be a number > 0 or \"inf\", not {_short(p)}")
    if p != 2.0 and opt.max_grad_norm is None:
        bad("grad_norm_type", "is clip_grad_norm_'s norm_type: it needs max_grad_norm")
    if opt.clip_grad_value is not None and (not _finite(opt.clip_grad_value) or opt.clip_grad_value <= 0):
        bad("clip_grad_value", f"must be a finite number > 0 or null, not {opt.clip_grad_value!r}")
    if opt.clip_grad_value is not None and opt.max_grad_norm is not None:
        # which of the two the loop calls first changes the result: the plan would have to say
        bad("clip_grad_value", "and max_grad_norm are both set: ckptd reproduces one clipping call "
            "(clip_grad_value_ or clip_grad_norm_) before the step")
    sched = opt.lr_schedule
    kind = sched.get("kind", "constant")
    if kind not in LR_SCHEDULES:
        bad("lr_schedule.kind", f"{kind!r} is not one of {', '.join(LR_SCHEDULES)}")
    if kind == "constant":
        return
    total, warm = sched.get("total_steps"), sched.get("warmup_steps", 0)
    if not _is_int(total) or not 0 < total <= MAX_ITERATIONS:
        bad("lr_schedule.total_steps", f"must be an integer in 1..{MAX_ITERATIONS} for a {kind} "
            f"schedule, not {total!r}")
    if not _is_int(warm) or not 0 <= warm <= total:
        bad("lr_schedule.warmup_steps", f"must be an integer in 0..total_steps, not {warm!r}")
    lo = sched.get("min_factor", 0.0)
    if not _finite(lo) or not 0 <= lo <= 1:
        bad("lr_schedule.min_factor", f"must be a number in [0, 1], not {lo!r}")


def _finite(x) -> bool:
    """A number a float holds and that is neither inf nor nan (a JSON integer too large
    for a float is not: torch would overflow on it)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _norm_type(o: "_Doc") -> float:
    """optimizer.grad_norm_type as JSON holds it: a number, or "inf" (JSON has no
    infinity) for the largest |g|, as torch's norm_type=float('inf') or 'inf'. Absent or
    null: 2.0, clip_grad_norm_'s default. A value out of range is refused by
    check_optimizer, naming the key."""
    v = o.get("grad_norm_type")
    if v is None:
        return 2.0
    if isinstance(v, str):
        if v.strip().lower() in ("inf", "infinity"):
            return math.inf
        raise PlanError(f'optimizer.grad_norm_type must be a number or "inf", not {_short(v)}')
    return o.num("grad_norm_type", None)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _all_finite(v) -> bool:
    """No inf, nan or float-overflowing number anywhere in a JSON value."""
    if isinstance(v, (list, tuple)):
        return all(_all_finite(x) for x in v)
    if isinstance(v, dict):
        return all(_all_finite(x) for x in v.values())
    return _finite(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else True


FLOAT32_MAX = 3.4028234663852886e38
# GradScaler's settings: torch itself asks growth_factor > 1 and backoff_factor < 1
# (torch/amp/grad_scaler.py GradScaler.__init__) and nothing else, but its scale is a
# float32 (_lazy_init_scale_growth_tracker) and _amp_update_scale_ takes growth_interval
# as an int64 matched against an int32 tracker: a scale <= 0 or inf, a backoff <= 0 or
# an interval < 1 gives garbage (or never-growing) scales, never an error.
GRAD_SCALER_RULES = {
    "init_scale": (lambda v: _finite(v) and 0 < v <= FLOAT32_MAX, "a finite number > 0 (a float32)"),
    "growth_factor": (lambda v: _finite(v) and 1 < v <= FLOAT32_MAX, "a finite number > 1"),
    "backoff_factor": (lambda v: _finite(v) and 0 < v < 1, "a number in (0, 1)"),
    "growth_interval": (lambda v: _is_int(v) and 1 <= v < 1 << 63, "an integer >= 1"),
}


@dataclass(frozen=True)
class Mirror:
    """A mirror stream: the switch port of `rank`'s NIC (of its port `port` where the NIC
    is merged from several), frames it sends (tx), receives (rx) or both."""

    name: str
    rank: int
    direction: str = "both"
    port: int = 0

    def sees(self, src: int, dst: int, src_port: int = 0, dst_port: int = 0) -> bool:
        """Whether a frame from NIC src's port src_port to NIC dst's port dst_port is
        in this stream (NICs named by their owner rank)."""
        return ((self.direction in ("tx", "both") and (src, src_port) == (self.rank, self.port))
                or (self.direction in ("rx", "both") and (dst, dst_port) == (self.rank, self.port)))


class StateNames(list):
    """Plan.state_names: the parameter names, with the plan's `tied` ({other name:
    parameter}) along, so that every reader of a trainer's file given the names
    (ckptd.core.formats.from_torch_doc) also knows a tied weight's other names."""

    def __init__(self, names, tied: dict[str, str] | None = None):
        super().__init__(names)
        self.tied = tied or {}


@dataclass(frozen=True)
class Plan:
    parameters: tuple[Parameter, ...]
    buckets_first: tuple[BucketLayout, ...]
    buckets_rebuilt: tuple[BucketLayout, ...]
    ring: RingConfig
    optimizer: Optimizer | None
    addresses: tuple[str, ...]  # rank -> its own NIC address (canonical text)
    mirrors: tuple[Mirror, ...] = ()
    iterations: int | None = None
    transport: str = "roce"  # roce: NCCL over RoCEv2 | gloo: torch.distributed gloo over TCP
    rebuilt_learn: bool = False  # buckets.rebuilt is "learn": taken from the wire (gloo only)
    # As given, empty for the defaults (read them through node_names and nic(), so that
    # dataclasses.replace(plan, addresses=...) keeps meaning "own NIC, own node"):
    nodes: tuple[str, ...] = ()  # rank -> node name; empty: every rank a node of its own
    channel_nics: tuple[tuple[str, ...], ...] = ()  # rank -> channel -> NIC address; empty: own NIC
    # rank -> its own NIC's port addresses, NCCL's device order, the first = addr; empty:
    # one port each (read them through nic_ports()); ring.ndevs ports on every NIC
    ports: tuple[tuple[str, ...], ...] = ()
    start_iteration: int | None = None  # the job's first iteration: init must be the one before
    comm_hook: str = "allreduce"  # DDP's comm hook: a key of COMM_HOOKS
    # DDP's bucket size limits in bytes, {"first": [...], "rebuilt": [...]}: the layouts are
    # checked against DDP's rule with them (ckptd.core.ddp_buckets); None: an older plan
    bucket_limits: dict | None = None
    # Other collectives on the job's communicator (a loss or metric allreduce, DDP's
    # broadcasts), which advance its QP rotation, PSNs and LL steps:
    # {"start" | "before" | "after": (entry, ...)} (once before iteration 0; every wire
    # round before / after the gradient buckets: with allreduces_per_step > 1 every
    # micro-batch, as DDP's per-forward buffer broadcasts are), an entry (count, dtype) for an allreduce,
    # (count, dtype, "broadcast", root) for a broadcast or (count, dtype, "allgather") for an
    # allgather of count elements a rank (collective_entry reads them all)
    collectives: dict = field(default_factory=dict, hash=False)
    buffers: ModuleBuffers = ModuleBuffers()
    # micro-batches per optimizer step, each allreduced (accumulation without no_sync):
    # the step uses the last one's gradients (docs/TRAINING.md); 1: one allreduce per step
    allreduces_per_step: int = 1
    # Frozen parameters (requires_grad=False): not DDP's (its reducer leaves them out, so
    # they are in no bucket, no index and no gradient on the wire) and never stepped; the
    # checkpoints carry their init values unchanged, so each is a whole state_dict. The
    # optimizer's groups may name them (torch skips a parameter whose grad is None).
    frozen: tuple[Parameter, ...] = ()
    # DDP's find_unused_parameters=True: every wire round ends with the allreduce of its
    # used-parameter map (USED_MAP, one int32 per parameter), DDP never rebuilds its
    # buckets, and the shadow steps only the parameters some rank used (docs/TRAINING.md)
    find_unused_parameters: bool = False
    # DDP's static_graph=True (docs/TRAINING.md): iteration 0's round opens with the
    # used-map allreduce, later rounds carry none; the first layout serves wire rounds 0
    # and 1 (DDP rebuilds after iteration 1); the shadow steps only the parameters some
    # rank used at iteration 0, in every iteration
    static_graph: bool = False
    # static_graph: per parameter, whether some rank used it at iteration 0 (1/0), as
    # write_plan's rewrite after DDP's rebuild reads the reducer's kept map; so a shadow
    # resumed past iteration 0 knows which parameters step. None: not recorded (it must
    # then see iteration 0's map on the wire)
    static_used_map: tuple[int, ...] | None = None
    # A tied weight's other names (`head.weight = emb.weight`): (name, the parameter's
    # name), the parameter a plain or frozen one of this plan. DDP and the plan hold the
    # tensor once; model.state_dict() holds it under every name, so an export writes each
    # (docs/RECOVERY.md) and a file that has them reads as the one parameter.
    tied: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        check_plan(self)
        if self.transport == "roce":  # gloo ranks are TCP endpoints: they may share an address
            _check_topology(self)

    # -- derived ------------------------------------------------------------------
    @property
    def nranks(self) -> int:
        return self.ring.nranks

    def param(self, name: str) -> Parameter:
        return self._params_by_name[name]

    @cached_property
    def _params_by_name(self) -> dict[str, Parameter]:
        # built once: bucket sizes and every bucket step look parameters up by name
        return {p.name: p for p in self.parameters}

    @cached_property
    def state_names(self) -> "StateNames":
        """The model's parameter names in the trainer's optimizer order, the indices of its
        optimizer.state_dict() (its groups' parameters in turn, frozen ones where a group
        holds them; without groups the plan's order), then the frozen parameters no group
        holds: how a trainer's file that does not name its parameters is read, and how an
        exported one is written. Its `tied` names a tied weight's other names, which a
        trainer's model.state_dict() holds too."""
        groups = self.optimizer.groups if self.optimizer is not None else ()
        order = [n for g in groups for n in g["params"]] or [p.name for p in self.parameters]
        return StateNames(order + [p.name for p in self.frozen if p.name not in set(order)], dict(self.tied))

    def layout(self, iteration: int) -> tuple[BucketLayout, ...]:
        """The layout of the allreduce a training iteration steps with: its last
        micro-batch's, which is DDP's first layout only for the job's very first allreduce."""
        return self.buckets_first if self.last_wire_iteration(iteration) < self.rebuild_round else self.buckets_rebuilt

    def last_wire_iteration(self, iteration: int) -> int:
        """The wire iteration (the n-th round of bucket allreduces of the communicator)
        of a training iteration's last micro-batch."""
        return (iteration + 1) * self.allreduces_per_step - 1

    def wire_layout(self, round_: int) -> tuple[BucketLayout, ...]:
        """The layout of wire round `round_` (the n-th round of bucket allreduces of the
        communicator): DDP's first for round 0 only (it rebuilds after the first
        backward's allreduce; with static_graph after the second's), the rebuilt one for
        every later round."""
        return self.buckets_first if round_ < self.rebuild_round else self.buckets_rebuilt

    @property
    def rebuild_round(self) -> int:
        """The first wire round on DDP's rebuilt layout: 1, or 2 with static_graph (its
        first backward only counts hook calls, so the order is recorded in the second)."""
        return 2 if self.static_graph else 1

    @property
    def timeline_prefix(self) -> int:
        """How many wire rounds open the job with a schedule of their own before the
        rebuilt rounds cycle (timeline_schedules): rebuild_round (round 0; with
        static_graph rounds 0, with the map, and 1, the first layout again)."""
        return self.rebuild_round

    def wire_order(self, round_: int) -> tuple[int, ...]:
        """The assembly's bucket indices (buckets(), the used map last) in the order wire
        round `round_` allreduces them: the assembly's own, but for static_graph's round 0,
        which allreduces the used map FIRST (Reducer::delay_all_reduce). Every transport
        numbers its allreduces by this (RingSchedule's order, the gloo extractor's)."""
        buckets = self.layout_buckets(self.wire_layout(round_), self.has_map(round_))
        n = len(buckets)
        if self.static_graph and round_ == 0:
            return (n - 1,) + tuple(range(n - 1))
        return tuple(range(n))

    def has_map(self, iteration: int) -> bool:
        """Whether an iteration's allreduces include DDP's used-parameter map: every one
        with find_unused_parameters, iteration 0's with static_graph (where it is the
        first allreduce on the wire; the assembly lists it last all the same)."""
        return self.find_unused_parameters or (self.static_graph and iteration == 0)

    def step_of_round(self, round_: int) -> int | None:
        """The training iteration wire round `round_` is the last micro-batch of, whose
        reduced values the step uses; None for a step's earlier micro-batches."""
        k = self.allreduces_per_step
        return round_ // k if round_ % k == k - 1 else None

    def buffers_step_of_round(self, round_: int) -> int | None:
        """The training iteration whose module buffers DDP's broadcasts in wire round
        `round_`'s forward carry (rank 0's buffers after the forward of the step's last
        micro-batch), or None (a broadcast after an earlier micro-batch)."""
        return None if round_ < 1 else self.step_of_round(round_ - 1)

    def layout_buckets(self, layout: tuple[BucketLayout, ...], used_map: bool | None = None) -> list[Bucket]:
        # made once per layout (a bucket's count sums its parameters' sizes): asked per
        # iteration opened, finalized and scheduled; keyed by the layout tuple itself,
        # which the cache keeps alive, so its id is never another's
        # (used_map: whether the map follows the buckets, by default find_unused_parameters)
        used_map = self.find_unused_parameters if used_map is None else used_map
        cache = self.__dict__.setdefault("_layout_buckets", {})
        hit = cache.get((id(layout), used_map))
        if hit is None or hit[0] is not layout:
            hit = cache[(id(layout), used_map)] = (layout, tuple(
                Bucket(self.bucket_count(b), np.dtype(_np_dtype(self.bucket_dtype(b)))) for b in layout)
                + ((self.used_map_bucket,) if used_map else ()))
        return list(hit[1])

    @cached_property
    def used_map_bucket(self) -> Bucket:
        """DDP's used-parameter map allreduce (find_unused_parameters): one int32 per
        parameter, the plan's order (the reducer's variable index); the last allreduce of
        every wire round, after the gradient buckets (Reducer::mark_variable_ready ->
        all_reduce_local_used_map once the last bucket is launched)."""
        return Bucket(len(self.parameters), np.dtype("<i4"))

    def is_used_map(self, iteration: int, b: int) -> bool:
        """Whether bucket b of an iteration's assembly is DDP's used-parameter map."""
        return self.has_map(iteration) and b == len(self.layout(iteration))

    def learn_rebuilt(self, layout) -> None:
        """Set the rebuilt layout learned from the wire (a plan with "rebuilt": "learn";
        every stage reads it through layout()/buckets(), so it must be set before any
        iteration >= 1 is placed)."""
        if not self.rebuilt_learn:
            raise PlanError("the plan gives buckets.rebuilt; it is checked, not learned")
        layout = tuple(layout)
        _check_layout(self, "rebuilt (learned)", layout)
        object.__setattr__(self, "buckets_rebuilt", layout)

    def buckets(self, iteration: int) -> list[Bucket]:
        return self.layout_buckets(self.layout(iteration), self.has_map(iteration))

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
        """The ring schedule of wire round `iteration`'s allreduces (with
        allreduces_per_step K > 1 every micro-batch is a round: training iteration i is
        rounds i*K .. i*K+K-1; with K = 1 rounds and training iterations are the same), built once per (ring, buckets,
        QP rotation): every stage that asks (binder, extractor, fast path, synthesizer)
        shares it, and a layout learned later (learn_rebuilt) gets a schedule of its own.
        Treat it as read-only.

        NCCL's QP rotation lives on the connection across collectives
        (RingConfig.qp_of_part), so with several QPs an iteration's messages sit on QPs
        that depend on how many sends came before it: iteration i >= 1 looks like
        iteration 1 + (i-1) % rotation_period()."""
        return self._ring_schedule(iteration, self._send_base(iteration))

    def other_collectives(self, iteration: int) -> tuple[list[Bucket], list[Bucket]]:
        """The non-gradient collectives before and after the iteration's buckets: Bucket
        for an allreduce, Broadcast for a broadcast, AllGather for an allgather."""
        def buckets(key):
            out = []
            for e in self.collectives.get(key, ()):
                op, n, d, root = collective_entry(e)
                dt = np.dtype(_np_dtype(d))
                out.append(Broadcast(n, dt, root) if op == "broadcast" else AllGather(n, dt) if op == "allgather"
                           else Bucket(n, dt))
            return out
        before = (buckets("start") if iteration == 0 else []) + buckets("before")
        return before, buckets("after")

    def _ring_schedule(self, iteration: int, send_base: tuple) -> RingSchedule:
        buckets = self.layout_buckets(self.wire_layout(iteration), self.has_map(iteration))
        order = self.wire_order(iteration)
        before, after = self.other_collectives(iteration)

        def sig(bs):
            return tuple((type(b).__name__, b.count, b.dtype.str, getattr(b, "root", None)) for b in bs)
        key = (self.ring, sig(buckets), order, sig(before), sig(after), send_base)
        cache = self.__dict__.setdefault("_schedules", {})
        sched = cache.get(key)
        if sched is None:
            # the layouts share their allreduces' cut: most bucket sizes are in both
            cells = self.__dict__.setdefault("_allreduce_cells", {}).setdefault(self.ring, {})
            sched = cache[key] = RingSchedule(self.ring, buckets, dict(send_base), before, after, cells, order)
        return sched

    def _sends_per_iteration(self, iteration: int) -> dict:
        """Sends each connection makes in an iteration (they do not depend on the QPs)."""
        sched = self._ring_schedule(min(iteration, self.timeline_prefix), ())
        return {c: sched.steps(c) for c in sched.conns}

    def opening_sends(self) -> dict:
        """{connection: (sends of each opening round 0 .. P-1, P = timeline_prefix, then of
        a rebuilt round)}: what sends_before counts with."""
        # keyed by the rebuilt layout itself (a learned one makes new counts), kept alive
        # by the cache so its id is never another's
        hit = self.__dict__.get("_opening_sends")
        if hit is None or hit[0] is not self.buckets_rebuilt:
            per = [self._sends_per_iteration(k) for k in range(self.timeline_prefix + 1)]
            hit = self.__dict__["_opening_sends"] = (self.buckets_rebuilt, {c: tuple(x[c] for x in per)
                                                                            for c in per[0]})
        return hit[1]

    def sends_before(self, iteration: int, conn=None):
        """Sends each connection made before wire round `iteration` (one connection's, with
        conn): the opening rounds' (timeline_prefix), then the rebuilt rounds'."""
        p = self.timeline_prefix
        per = self.opening_sends()

        def before(n):
            return sum(n[:iteration]) if iteration < p else sum(n[:p]) + (iteration - p) * n[p]
        if conn is not None:
            return before(per[conn])
        return {c: before(n) for c, n in per.items()}

    def _send_base(self, iteration: int) -> tuple:
        """(connection, sends before this iteration modulo RingConfig.rotation_modulus),
        sorted; empty where rotation changes nothing (one QP, or every send split over
        all QPs from QP 0) and for iteration 0 (no sends before it)."""
        nq = self.ring.rotation_modulus
        if nq == 1 or iteration == 0:
            return ()  # a missing connection starts at 0: iteration 0 shares the counting schedule
        return tuple((c, n % nq) for c, n in sorted(self.sends_before(iteration).items()))

    def rotation_period(self) -> int:
        """The smallest p >= 1 with schedule(i + p) == schedule(i) for every i >=
        timeline_prefix: the rebuilt iterations cycle through p QP rotations (1 with one QP)."""
        nq = self.ring.rotation_modulus
        rebuilt = self._sends_per_iteration(self.timeline_prefix)
        p = 1
        while any(p * n % nq for n in rebuilt.values()):
            p += 1
        return p

    def timeline_schedules(self) -> list[RingSchedule]:
        """The opening rounds' schedules (schedule(0 .. P-1), P = timeline_prefix: 1, or 2
        with static_graph), then one period of rebuilt iterations: schedule(P .. P +
        rotation_period() - 1)."""
        return [self.schedule(i) for i in range(self.timeline_prefix + self.rotation_period())]

    def layout_index(self, iteration: int) -> int:
        """Which of timeline_schedules() an iteration uses."""
        p = self.timeline_prefix
        return iteration if iteration < p else p + (iteration - p) % self.rotation_period()

    def rank_of(self, addr: str) -> int | None:
        """The rank whose own NIC has this address (any of its ports): the lowest one
        where ranks of a node share a NIC. It names the NIC wherever traffic is keyed by
        address."""
        port = self.port_of(addr)
        return None if port is None else port[0]

    def port_of(self, addr: str) -> tuple[int, int] | None:
        """(the NIC, named by its owner rank; which of its ports) that has this address."""
        return self._port_by_addr.get(addr)

    @cached_property
    def _port_by_addr(self) -> dict[str, tuple[int, int]]:
        owners: dict[str, tuple[int, int]] = {}
        for r in range(len(self.addresses)):
            for k, a in enumerate(self.nic_ports(r)):
                owners.setdefault(a, (r, k))
        return owners

    def nic_ports(self, rank: int) -> tuple[str, ...]:
        """The port addresses of `rank`'s own NIC, in NCCL's device order."""
        return self.ports[rank] if self.ports else (self.addresses[rank],)

    def port_address(self, port: tuple[int, int]) -> str:
        return self.nic_ports(port[0])[port[1]]

    def qp_link(self, conn: tuple[int, int, int], qp: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The pair of ports QP `qp` of a network connection runs between: (sender NIC,
        port), (receiver NIC, port), the port by RingConfig.port_of_qp."""
        s, d = self.link_of(conn)
        k = self.ring.port_of_qp(qp)
        return (s, k), (d, k)

    def nic(self, rank: int, channel: int) -> str:
        """The address of the NIC `rank`'s network hops of `channel` use."""
        return self.channel_nics[rank][channel] if self.channel_nics else self.addresses[rank]

    @property
    def node_names(self) -> tuple[str, ...]:
        """rank -> the node it runs on ("rank<r>" where the plan gives none)."""
        return self.nodes or tuple(f"rank{r}" for r in range(len(self.addresses)))

    @cached_property
    def network_connections(self) -> frozenset[tuple[int, int, int]]:
        """The ring connections (src, dst, channel) that cross the network: the only
        ones a mirror can see (ckptd.core.schedule.network_connections)."""
        return network_connections(self.ring, self.node_names)

    def least_link_bytes(self) -> int:
        """The fewest payload bytes one directed NIC-to-NIC link carries in an iteration
        (every channel and QP of it, from iteration 1's schedule), shared among a merged
        NIC's ports: the least a mirror stream can carry, since it sees at least one such
        link, or one port of it (0 where nothing crosses the network)."""
        per_link: dict[tuple[int, int], int] = {}
        wire = self.network_connections
        for (s, d, c, _q), flow in self.schedule(1).flows.items():
            if (s, d, c) in wire:
                link = self.link_of((s, d, c))
                per_link[link] = per_link.get(link, 0) + int(flow.columns()["m_wire_len"].sum())
        return min(per_link.values(), default=0) // self.ring.ndevs

    def link_of(self, conn: tuple[int, int, int]) -> tuple[int, int]:
        """The NIC pair a network connection's frames travel between, each NIC named by
        its owner rank (rank_of): (sender NIC, receiver NIC)."""
        src, dst, c = conn
        return self.rank_of(self.nic(src, c)), self.rank_of(self.nic(dst, c))

    @property
    def one_host_per_rank(self) -> bool:
        """Every rank a host of its own with one NIC: every ring hop is on the wire,
        between the ranks' own NICs (every plan written before nodes existed)."""
        return len(set(self.node_names)) == self.nranks and all(
            self.nic(r, c) == a for r, a in enumerate(self.addresses) for c in range(self.ring.channels))

    def param_ranges(self, iteration: int, b: int) -> list[tuple[str, int, int]]:
        """(name, start, end) element ranges of each parameter inside bucket b (the
        used-parameter map: one range named USED_MAP)."""
        if self.is_used_map(iteration, b):
            return [(USED_MAP, 0, len(self.parameters))]
        out, off = [], 0
        for name in self.layout(iteration)[b].params:
            n = self.param(name).numel
            out.append((name, off, off + n))
            off += n
        return out

    def state_bytes(self) -> int:
        """About one copy of the shadow's state: the parameters and Adam's two (three
        with amsgrad) moments."""
        params = sum(p.numel * _itemsize(p.dtype) for p in self.parameters)
        moments = 0 if self.optimizer is None else (3 if self.optimizer.amsgrad else 2)
        return params * (1 + moments) + sum(p.numel * _itemsize(p.dtype) for p in self.frozen)

    def shadow_bytes(self) -> int:
        """About what shadowing this plan holds in memory: the state, and gradient
        buffers for two iterations in flight."""
        grads = max(sum(self.bucket_count(b) * _itemsize(self.bucket_dtype(b)) for b in layout)
                    for layout in (self.buckets_first, self.buckets_rebuilt))
        return self.state_bytes() + 2 * grads

    def check_start(self, state: dict, where: str) -> None:
        """The state the shadow starts from (`--init`, the daemon's `init`) fits this plan:
        its iteration is the one before the plan's start_iteration (when the plan says it)
        and before its last iteration, and every parameter and optimizer tensor is there
        with the plan's shape and dtype. CheckpointError naming `where` and the key."""
        from ckptd.core.checkpoint import CheckpointError
        it = state.get("iteration")
        if not _is_int(it) or it < -1:
            raise CheckpointError(f"{where}: iteration must be an integer >= -1, not {_short(it)}")
        if self.start_iteration is not None and it != self.start_iteration - 1:
            raise CheckpointError(
                f"{where}: holds iteration {it}, but the plan's start_iteration is "
                f"{self.start_iteration}: the job starts from the state of iteration "
                f"{self.start_iteration - 1}")
        if self.iterations is not None and it >= self.iterations - 1:
            raise CheckpointError(f"{where}: holds iteration {it}; the plan's job has only "
                                  f"{self.iterations} iterations (0..{self.iterations - 1})")
        self.check_resume(state, where)

    def past_the_job(self, join_from: int | None, plan_name) -> str | None:
        """Where joining from `join_from` is past the job's last iteration, the reason
        (the caller puts the option or key in front), else None."""
        its = self.iterations
        if join_from is None or its is None or join_from < its:
            return None
        return (f"the job of the plan {plan_name} has {its} iterations (0..{its - 1}); give an iteration it had "
                "reached when the capture began")

    def not_in_plan(self, state: dict, where: str, plan_name) -> str | None:
        """Where a state's model holds entries this plan has no parameter, tied name or
        buffer for, the sentence that says so (the caller adds what follows), else None."""
        known = set(self.state_names) | set(self.tied) | {b.name for b in self.buffers.tensors}
        extra = [k for k in state.get("model") or {} if k not in known]
        if not extra:
            return None
        return (f"{where}: model.{extra[0]}" + (f" and {len(extra) - 1} more are" if len(extra) > 1 else " is")
                + f" in the checkpoint but not in the plan {plan_name} (no parameter, tied name or buffer of it)")

    def check_resume(self, state: dict, where: str) -> None:
        """A state the shadow (re)starts from fits this plan: check_state, and after a step
        (iteration >= 0) the optimizer state an optimizer that keeps one has by then. A
        checkpoint without it was stepped on with zeroed moments: every commit after it
        wrong, without a word (a resume from a trainer's model-only save)."""
        from ckptd.core.checkpoint import CheckpointError
        if self.optimizer is None:
            return
        self.check_state(state, where)
        it = state.get("iteration")
        if _is_int(it) and it >= 0 and state.get("optimizer") is None and self._optimizer_keeps_state():
            raise CheckpointError(f"{where}: holds iteration {it} without optimizer state, which the plan's "
                                  f"{self.optimizer.kind} keeps from its first step: give a checkpoint with it")

    def _optimizer_keeps_state(self) -> bool:
        """Whether the optimizer holds per-parameter state after a step: all of torch's but
        SGD without momentum."""
        opt = self.optimizer
        if opt.kind != "sgd":
            return True
        return any(g.get("momentum", 0) for g in opt.groups) if opt.groups else False

    def check_state(self, state: dict, where: str) -> None:
        """Every parameter of this plan is in the state with the plan's shape and dtype,
        and so is its optimizer state (when the state has one). CheckpointError naming
        `where` and the key."""
        from ckptd.core.checkpoint import CheckpointError
        model = state.get("model")
        if not isinstance(model, dict):
            raise CheckpointError(f"{where}: has no model state")
        opt = state.get("optimizer")
        per_param = opt.get("state") if isinstance(opt, dict) else None
        if opt is not None and per_param is not None and not isinstance(per_param, dict):
            raise CheckpointError(f"{where}: optimizer.state must map parameter names to state")
        adam = self.optimizer is not None and self.optimizer.kind in ("adam", "adamw")
        keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if adam and self.optimizer.amsgrad else ())
        for p in self.frozen:  # never stepped: torch makes no state for them after construction
            _check_tensor(model.get(p.name), p, f"{where}: model.{p.name}")
            for k, v in ((per_param or {}).get(p.name) or {}).items():
                if getattr(v, "ndim", 0):  # Adagrad's sum, made when the trainer built its optimizer
                    _check_tensor(v, p, f"{where}: optimizer.state.{p.name}.{k}")
        for p in self.parameters:
            _check_tensor(model.get(p.name), p, f"{where}: model.{p.name}")
            if per_param:
                st = per_param.get(p.name)
                if st is None and (self.find_unused_parameters or self.static_graph):
                    continue  # unused on every rank so far: torch made no state for it yet
                if not isinstance(st, dict):
                    raise CheckpointError(f"{where}: optimizer.state lacks {p.name!r}")
                if adam and st and not {"exp_avg", "exp_avg_sq"} & set(st):
                    # (SGD's momentum_buffer: "step is not a tensor" named a symptom)
                    raise CheckpointError(f"{where}: optimizer.state.{p.name} holds {sorted(map(str, st))[:5]}, not "
                                          f"torch's {self.optimizer.kind} state ({', '.join(keys)}): the state of a "
                                          "job with another optimizer")
                # other optimizers: every per-element buffer (not a scalar like step) has
                # the parameter's shape and dtype
                for k in keys if adam else [k for k, v in st.items() if getattr(v, "ndim", 0)]:
                    if k == "step":
                        step = st.get(k)
                        if not hasattr(step, "dtype"):
                            raise CheckpointError(f"{where}: optimizer.state.{p.name}.step is not a tensor")
                        # torch's Adam keeps one float step: two elements raised "cannot be
                        # converted to Scalar", an int64 one the foreach step's dtype check
                        if step.numel() != 1 or not step.dtype.is_floating_point:
                            raise CheckpointError(
                                f"{where}: optimizer.state.{p.name}.step is {dtype_name(step.dtype)}"
                                f"{list(step.shape)}; torch's {self.optimizer.kind} keeps one float step")
                    else:
                        _check_tensor(st.get(k), p, f"{where}: optimizer.state.{p.name}.{k}")

    # -- (de)serialisation -------------------------------------------------------
    def to_json(self) -> dict:
        # every key from PLAN_FIELDS, the one list the reader also takes its keys from
        doc = {key: write(self) for key, write in PLAN_FIELDS.items()}
        return {key: v for key, v in doc.items() if v is not UNSET}

    def buffer(self, name: str) -> Parameter:
        return {t.name: t for t in self.buffers.tensors}[name]

    def buffer_broadcast_bytes(self) -> list[int]:
        """The payload size of each of DDP's buffer broadcasts, in order."""
        return [sum(self.buffer(n).numel * _itemsize(self.buffer(n).dtype) for n in b)
                for b in self.buffers.broadcasts]

    def buffer_broadcast_entries(self) -> list[tuple[int, str]]:
        """(count, dtype) of each of DDP's buffer broadcasts as Plan.collectives lists them
        (torch.coalesced_broadcasts: a group of no elements is never issued)."""
        return [(sum(self.buffer(n).numel for n in b), self.buffer(b[0]).dtype) for b in self.buffers.broadcasts]

    def buffer_broadcast_at(self) -> int | None:
        """Where DDP's per-forward buffer broadcasts sit in collectives["before"] (NCCL):
        the index of the first of the last run of root-0 broadcasts matching
        buffer_broadcast_entries() in order; None if there is none."""
        want = [(n, d) for n, d in self.buffer_broadcast_entries() if n]
        before = [collective_entry(e) for e in self.collectives.get("before", ())]
        if not want:
            return None
        for at in range(len(before) - len(want), -1, -1):
            if all(op == "broadcast" and root == 0 and (n, d) == w
                   for (op, n, d, root), w in zip(before[at:at + len(want)], want)):
                return at
        return None

    def buffer_others(self, iteration: int) -> dict[int, int]:
        """{index in RingSchedule.others: buffer broadcast group} of DDP's buffer
        broadcasts in an iteration's schedule (NCCL plans with buffers.captured); the
        broadcast in iteration i carries rank 0's buffers after forward i-1."""
        at = self.buffer_broadcast_at() if self.buffers.captured and self.transport == "roce" else None
        if at is None:
            return {}
        at += len(self.collectives.get("start", ())) if iteration == 0 else 0
        groups = [g for g, (n, _) in enumerate(self.buffer_broadcast_entries()) if n]
        return {at + k: g for k, g in enumerate(groups)}

    def _rank_json(self, r: int) -> dict:
        """A rank's entry; node and nics only where they differ from the defaults, so a
        one-GPU-per-host plan reads as it always did."""
        out = {"rank": r, "addr": self.addresses[r]}
        if self.node_names[r] != f"rank{r}":
            out["node"] = self.node_names[r]
        nics = [self.nic(r, c) for c in range(self.ring.channels)]
        if any(a != self.addresses[r] for a in nics):
            out["nics"] = nics
        if len(self.nic_ports(r)) > 1:
            out["ports"] = list(self.nic_ports(r))
        return out

    def save(self, path: str | Path):
        """Write the plan as JSON, whole or not at all (a temporary beside it, fsynced, then
        renamed over it). PlanError naming the key of a number JSON cannot hold (inf, nan);
        PlanWriteError naming the file where it cannot be written."""
        doc = self.to_json()
        try:
            text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
        except ValueError:
            raise PlanError(f"{path}: {_nonfinite_key(doc) or 'a number'} is not finite: "
                            "a plan holds no inf or nan") from None
        _write_atomic(Path(path), text)


class PlanWriteError(CkptdError, OSError):
    """A plan file could not be written; nothing was left under its name (errno kept)."""

    def __str__(self):
        return str(self.strerror)


def _write_atomic(path: Path, text: str) -> None:
    """checkpoint.atomic_write's whole-or-nothing write, as a plain write leaves a plan
    (0644 less the umask), its failure named as the plan's."""
    import os
    from ckptd.core.checkpoint import CheckpointWriteError, atomic_write
    try:
        atomic_write(path, lambda f: f.write(text.encode()), mode=0o644)
    except CheckpointWriteError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        if str(e).startswith(f"{path}: is a "):  # not a regular file: say what it is
            why = str(e).removeprefix(f"{path}: ")
        raise PlanWriteError(e.errno, f"{path}: cannot write plan: {why}") from None


def _nonfinite_key(v, key: str = "") -> str | None:
    """The key path of the first inf or nan in a JSON document."""
    if isinstance(v, float) and not math.isfinite(v):
        return key or "the plan"
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, (list, tuple)) else ()
    for k, x in items:
        found = _nonfinite_key(x, f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}" if key else str(k))
        if found:
            return found
    return None


# -- checks --------------------------------------------------------------------------
def _check_tensor(t, p: Parameter, key: str) -> None:
    from ckptd.core.checkpoint import CheckpointError
    if not hasattr(t, "shape") or not hasattr(t, "dtype"):
        raise CheckpointError(f"{key} is missing or not a tensor")
    dtype = dtype_name(t.dtype)
    if tuple(t.shape) != p.shape or dtype != p.dtype:
        raise CheckpointError(f"{key} is {dtype}{list(t.shape)}; the plan says {p.dtype}{list(p.shape)}")


def check_plan(plan: Plan) -> None:
    """Everything a Plan must be before anything is sized from it; PlanError naming the
    key. Runs in the constructor, so a plan built in code is checked as a loaded one is."""
    if plan.transport != "roce":  # gloo numbers allreduces alone: the job's own broadcasts need no entry
        for when, entries in plan.collectives.items():
            for i, e in enumerate(entries):
                if collective_entry(e)[0] != "allreduce":
                    raise PlanError(f"collectives.{when}[{i}]: a {plan.transport} plan lists the job's own allreduces "
                                    "alone (gloo numbers allreduces by one counter with DDP's buckets; its other "
                                    "collectives need no entry)")
    for when, entries in plan.collectives.items():
        for i, e in enumerate(entries):
            op, _, _, root = collective_entry(e)
            if op == "allreduce":
                continue
            if op == "broadcast" and root >= plan.ring.nranks:
                raise PlanError(f"collectives.{when}[{i}].root {root}: the ring has ranks "
                                f"0..{plan.ring.nranks - 1}")
    names: set[str] = set()
    total = _check_tensors(plan.parameters, "parameters", names) + _check_tensors(plan.frozen, "frozen", names)
    if total > MAX_PARAM_ELEMENTS:
        raise PlanError(f"parameters hold {total} elements in all (at most {MAX_PARAM_ELEMENTS})")
    if not plan.buckets_first:
        raise PlanError("buckets.first lists no allreduce")
    _check_tied(plan, names)
    if plan.find_unused_parameters:
        _check_find_unused(plan)
    if plan.static_graph:
        _check_static_graph(plan)
    elif plan.static_used_map is not None:
        raise PlanError("static_used_map without static_graph")
    _check_layout(plan, "first", plan.buckets_first)
    if not plan.rebuilt_learn:
        _check_layout(plan, "rebuilt", plan.buckets_rebuilt)
        if plan.parameters:
            check_cap_rule(plan)
    if plan.parameters and plan.bucket_limits is not None:
        check_ddp_limits(plan)
    r = plan.ring
    if not r.nranks <= MAX_RANKS:
        raise PlanError(f"ring.nranks {r.nranks} is more than {MAX_RANKS}")
    if not 1 <= r.channels <= MAX_CHANNELS:
        raise PlanError(f"ring.rings lists {r.channels} channels (1..{MAX_CHANNELS})")
    if not 1 <= r.max_threads <= MAX_THREADS:
        raise PlanError(f"ring.max_threads {r.max_threads} is not in 1..{MAX_THREADS}")
    if r.buffsize is not None and not 1 <= r.buffsize <= MAX_BUFFSIZE:
        raise PlanError(f"ring.buffsize {r.buffsize} is not in 1..{MAX_BUFFSIZE}")
    if r.buffsize is not None:
        broadcast = any(collective_entry(e)[0] == "broadcast" for es in plan.collectives.values() for e in es)
        least = min_buffsize(r.nccl_version, r.protocol, broadcast)
        if r.buffsize < least:
            raise PlanError(f"ring.buffsize is {r.buffsize}; with NCCL {r.nccl_version[0]}.{r.nccl_version[1]} "
                            f"{r.protocol}{' and broadcasts' if broadcast else ''} it must be at least {least} "
                            f"bytes (NCCL_BUFFSIZE; a smaller one leaves a ring chunk empty)")
    if r.qps_per_connection > MAX_QPS:
        raise PlanError(f"ring.qps_per_connection {r.qps_per_connection} is more than {MAX_QPS}")
    if plan.optimizer is not None:
        if not plan.parameters:
            raise PlanError("an optimizer needs parameters")
        check_optimizer(plan.optimizer)
        if plan.frozen:  # write_plan's groups may name them (a loaded plan's are checked as read)
            _optimizer_groups(list(plan.optimizer.groups), [p.name for p in plan.parameters],
                              [p.name for p in plan.frozen])
        steps = plan.optimizer.lr_per_step
        if steps and plan.iterations is not None and len(steps) < plan.iterations:
            raise PlanError(f"optimizer.lr_per_step has {len(steps)} entries for the plan's {plan.iterations} "
                            f"iterations: no lr for step {len(steps)}")
    if len(plan.addresses) != r.nranks:
        raise PlanError(f"ranks lists {len(plan.addresses)} addresses for {r.nranks} ranks")
    for i, m in enumerate(plan.mirrors):
        if m.direction not in ("tx", "rx", "both") or not 0 <= m.rank < r.nranks:
            raise PlanError(f"mirrors[{i}] needs rank in 0..{r.nranks - 1} and direction tx|rx|both")
    for key in ("iterations", "start_iteration"):
        v = getattr(plan, key)
        if v is not None and (not _is_int(v) or not 0 <= v <= MAX_ITERATIONS):
            raise PlanError(f"{key} must be an integer in 0..{MAX_ITERATIONS}, not {v!r}")
    if plan.iterations is not None and plan.start_iteration is not None \
            and plan.start_iteration >= plan.iterations:
        raise PlanError(f"start_iteration {plan.start_iteration} is not below iterations "
                        f"{plan.iterations}")
    if plan.transport not in ("roce", "gloo"):
        raise PlanError(f"transport {plan.transport!r} is not one of roce, gloo")
    if plan.rebuilt_learn and (plan.transport != "gloo" or not plan.parameters):
        raise PlanError('buckets.rebuilt "learn" needs transport gloo and parameters')
    _check_buffers(plan)
    k = plan.allreduces_per_step
    if not _is_int(k) or not 1 <= k <= MAX_ITERATIONS:
        raise PlanError(f"allreduces_per_step must be an integer >= 1, not {k!r}")


def _check_find_unused(plan: Plan) -> None:
    """find_unused_parameters: what ckptd decodes of it (docs/TRAINING.md)."""
    if plan.find_unused_parameters is not True:
        raise PlanError(f"find_unused_parameters must be true or absent, not {_short(plan.find_unused_parameters)}")
    if not plan.parameters:
        raise PlanError("find_unused_parameters needs parameters (it is DDP's map of them)")
    if plan.rebuilt_learn or plan.buckets_rebuilt != plan.buckets_first:
        raise PlanError("find_unused_parameters: DDP never rebuilds its buckets then, so buckets.rebuilt "
                        "must be absent or equal buckets.first")
    if plan.allreduces_per_step != 1:
        raise PlanError("find_unused_parameters with allreduces_per_step > 1 is not supported (a parameter "
                        "unused in the last micro-batch keeps an earlier one's reduced gradient)")


def _check_static_graph(plan: Plan) -> None:
    """static_graph: what ckptd decodes of it (docs/TRAINING.md)."""
    if plan.static_graph is not True:
        raise PlanError(f"static_graph must be true or absent, not {_short(plan.static_graph)}")
    if not plan.parameters:
        raise PlanError("static_graph needs parameters (DDP's used map is of them)")
    if plan.find_unused_parameters:
        raise PlanError("static_graph with find_unused_parameters: DDP's wire is static_graph's then; "
                        "the plan says static_graph only")
    if plan.allreduces_per_step != 1:
        raise PlanError("static_graph with allreduces_per_step > 1 is not supported")
    m = plan.static_used_map
    if m is not None and (not isinstance(m, tuple) or len(m) != len(plan.parameters)
                          or any(x not in (0, 1) or isinstance(x, bool) for x in m)):
        raise PlanError(f"static_used_map must be one 0 or 1 per parameter ({len(plan.parameters)}), "
                        f"not {_short(m)}")


def _check_tensors(tensors: tuple[Parameter, ...], key: str, names: set[str]) -> int:
    """parameters or frozen: unique names (across both: `names` collects them), a dtype
    ckptd names, a shape it sizes; their element count."""
    total = 0
    for i, p in enumerate(tensors):
        if not isinstance(p.name, str) or not p.name:
            raise PlanError(f"{key}[{i}].name must be a non-empty string")
        if p.name in names:
            raise PlanError(f"{key}[{i}].name {p.name!r} is not unique")
        names.add(p.name)
        if p.dtype not in DTYPES:
            raise PlanError(f"{key}[{i}] ({p.name}) has dtype {p.dtype!r}; supported: "
                            f"{', '.join(DTYPES)}")
        if len(p.shape) > MAX_DIMS or not all(_is_int(x) and x >= 0 for x in p.shape):
            raise PlanError(f"{key}[{i}].shape {list(p.shape)[:10]} must be at most {MAX_DIMS} "
                            "non-negative integers")
        n = math.prod(p.shape)  # Python ints: no overflow before the bound is checked
        if n > MAX_PARAM_ELEMENTS:
            raise PlanError(f"{key}[{i}].shape {list(p.shape)} has {n} elements "
                            f"(at most {MAX_PARAM_ELEMENTS})")
        if p.memory_order is not None and sorted(p.memory_order) != list(range(len(p.shape))):
            raise PlanError(f"{key}[{i}].memory_order {list(p.memory_order)[:10]} is not an order of the "
                            f"{len(p.shape)} dimensions of shape {list(p.shape)} (outermost first)")
        if p.memory_order is not None and key != "parameters":
            raise PlanError(f"{key}[{i}].memory_order: only a parameter DDP reduces has one")
        total += n
    return total


def _check_tied(plan: Plan, names: set[str]) -> None:
    """tied: each other name new (no parameter's, no buffer's, once), each target a
    parameter or frozen one of the plan."""
    seen = {t.name for t in plan.buffers.tensors}
    for alias, target in plan.tied:
        if not isinstance(alias, str) or not alias or alias in names or alias in seen:
            raise PlanError(f"tied: {_short(alias)} must be a new non-empty name (not a parameter's, not twice)")
        if target not in names:
            raise PlanError(f"tied.{alias} is {_short(target)}, not a parameter of the plan")
        seen.add(alias)


def _check_buffers(plan: Plan) -> None:
    bufs = plan.buffers
    seen: dict[str, str] = {}
    for i, t in enumerate(bufs.tensors):
        if not isinstance(t.name, str) or not t.name or t.name in seen or t.name in plan._params_by_name \
                or t.name in {f.name for f in plan.frozen}:
            raise PlanError(f"buffers.tensors[{i}].name {t.name!r} must be a new non-empty name")
        if t.dtype not in DTYPES:
            raise PlanError(f"buffers.tensors[{i}] ({t.name}) has dtype {t.dtype!r}; supported: {', '.join(DTYPES)}")
        if len(t.shape) > MAX_DIMS or not all(_is_int(x) and 0 <= x <= MAX_PARAM_ELEMENTS for x in t.shape) \
                or math.prod(t.shape) > MAX_PARAM_ELEMENTS:
            raise PlanError(f"buffers.tensors[{i}].shape {list(t.shape)[:10]} is not a shape ckptd takes")
        seen[t.name] = t.dtype
    listed = [n for b in bufs.broadcasts for n in b]
    if sorted(listed) != sorted(seen):
        raise PlanError("buffers.broadcasts must list every buffer of buffers.tensors exactly once")
    for i, b in enumerate(bufs.broadcasts):
        if not b or len({seen[n] for n in b}) != 1:
            raise PlanError(f"buffers.broadcasts[{i}] must be a non-empty list of buffers of one dtype")
    if bufs.captured and plan.transport == "roce" and any(n for n, _ in plan.buffer_broadcast_entries()) \
            and plan.buffer_broadcast_at() is None:
        raise PlanError("buffers.captured on NCCL needs DDP's buffer broadcasts in collectives.before: one "
                        "broadcast from root 0 per buffers.broadcasts group, with its element count and dtype, "
                        "in order (ckptd.torch.write_plan records them)")


def _check_layout(plan: Plan, key: str, layout: tuple[BucketLayout, ...]) -> None:
    by_name = plan._params_by_name
    for i, b in enumerate(layout):
        if b.params:
            unknown = [n for n in b.params if n not in by_name]
            if unknown:
                raise PlanError(f"buckets.{key}[{i}] names unknown parameter {unknown[0]!r}")
            dts = {by_name[n].dtype for n in b.params}
            if len(dts) > 1:
                raise PlanError(f"buckets.{key}[{i}] mixes dtypes {sorted(dts)}; DDP buckets hold one dtype")
            n = sum(math.prod(by_name[p].shape) for p in b.params)
        else:
            if plan.parameters:
                raise PlanError(f"buckets.{key}[{i}] lists no parameters (a plan with parameters "
                                "buckets parameters, not counts)")
            if b.dtype not in DTYPES:
                raise PlanError(f"buckets.{key}[{i}] has dtype {b.dtype!r}")
            n = b.count
            if not _is_int(n) or n < 1:
                raise PlanError(f"buckets.{key}[{i}].count must be a positive integer, not {n!r}")
        if n > MAX_BUCKET_ELEMENTS:
            raise PlanError(f"buckets.{key}[{i}] holds {n} elements (at most {MAX_BUCKET_ELEMENTS})")
    if plan.parameters:
        covered = [n for b in layout for n in b.params]
        if len(covered) != len(by_name) or set(covered) != set(by_name):
            seen, dup = set(), []
            for n in covered:
                if n in seen:
                    dup.append(n)
                seen.add(n)
            raise PlanError(f"buckets.{key} must hold every parameter exactly once (missing "
                            f"{sorted(set(by_name) - seen)[:5]}, repeated {dup[:5]})")


def check_ddp_limits(plan: Plan) -> None:
    """With `buckets.limits`: buckets.first must be exactly DDP's assignment of the
    parameters (registration order) with the first limits, reversed; buckets.rebuilt
    one that DDP's rule gives with the rebuilt limits for SOME gradient-ready order
    (ckptd.core.ddp_buckets). PlanError naming the bucket."""
    from ckptd.core.ddp_buckets import first_layout, rebuilt_problem
    lim = plan.bucket_limits
    for key in ("first", "rebuilt"):
        v = lim.get(key) if isinstance(lim, dict) else None
        if not isinstance(v, (list, tuple)) or not v or not all(_is_int(x) and x >= 1 for x in v):
            raise PlanError(f"buckets.limits.{key} must be a non-empty list of byte counts >= 1, not {v!r}")
    index = {p.name: i for i, p in enumerate(plan.parameters)}
    sizes = [p.numel * _itemsize(p.dtype) for p in plan.parameters]
    dtypes = [p.dtype for p in plan.parameters]
    want = first_layout(sizes, dtypes, lim["first"])
    got = [[index[n] for n in b.params] for b in plan.buckets_first]
    if got != want:
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        names = [plan.parameters[j].name for j in want[i]] if i < len(want) else []
        raise PlanError(f"buckets.first[{i}] is not DDP's first layout for buckets.limits.first "
                        f"{list(lim['first'])}: DDP puts {names[:4]}{'...' if len(names) > 4 else ''} there")
    if plan.rebuilt_learn or plan.buckets_rebuilt == plan.buckets_first:
        return  # not rebuilt yet (write_plan rewrites the plan when DDP rebuilds)
    bad = rebuilt_problem([[index[n] for n in b.params] for b in plan.buckets_rebuilt], sizes, dtypes,
                          lim["rebuilt"])
    if bad is not None:
        raise PlanError(f"buckets.rebuilt[{bad[0]}] {bad[1]}: no gradient-ready order gives this layout "
                        f"with buckets.limits.rebuilt {list(lim['rebuilt'])} (DDP's bucketing rule)")


def check_cap_rule(plan: Plan) -> None:
    """Each layout must be what DDP's bucket assignment could produce for some bucket cap
    (torch's compute_bucket_assignment_by_size): per dtype, in assignment order, a bucket
    is closed as soon as it reaches its limit -- the first bucket's limit (a small first
    bucket; any value up to the cap is allowed here), then the cap. So every closed bucket
    minus its last parameter is below its limit and the whole bucket reaches it, and the
    bucket left open at the end is below the cap before its last parameter. The cap is
    not in the plan, and the two layouts may use different ones (DDP without
    find_unused_parameters puts iteration 0 in one bucket): a layout no cap can explain is
    refused. Iteration 0 assigns in registration order and allreduces the buckets
    reversed; the rebuilt layout is listed in assignment order. A gloo plan's rebuilt
    layout is left to the stronger check on the wire (DDP broadcasts the layout it
    rebuilt; docs/GLOO.md)."""
    why = []
    layouts = [("first", plan.buckets_first, True)]
    if plan.transport != "gloo":  # gloo checks its rebuilt layout against DDP's broadcast
        layouts.append(("rebuilt", plan.buckets_rebuilt, False))
    for key, layout, reverse in layouts:
        lo, hi = 0, math.inf  # this layout's cap lies in (lo, hi]
        order = list(enumerate(layout))
        if reverse:
            order.reverse()
        by_dtype: dict[str, list] = {}
        for i, b in order:
            by_dtype.setdefault(plan.param(b.params[0]).dtype, []).append((i, b))
        for buckets in by_dtype.values():
            for k, (i, b) in enumerate(buckets):
                sizes = [plan.param(n).numel * _itemsize(plan.param(n).dtype) for n in b.params]
                lo = max(lo, sum(sizes) - sizes[-1])  # it had not reached its limit (<= cap)
                if k and k < len(buckets) - 1:
                    hi = min(hi, sum(sizes))  # closed on reaching the cap
                if lo >= hi:
                    why.append(f"buckets.{key}[{i}]")
                    break
            if why:
                break
        if why:
            break
    if why:
        raise PlanError(f"{why[0]} does not follow DDP's bucket-cap rule: no bucket cap "
                        "gives this layout (every parameter once, each bucket closed as soon as "
                        "it reaches the cap); rebuild the plan with `ckptd plan --sample`")


def _itemsize(dtype: str) -> int:
    return np.dtype(_np_dtype(dtype)).itemsize


def _bucket_json(b: BucketLayout) -> dict:
    return {"params": list(b.params)} if b.params else {"count": b.count, "dtype": b.dtype}


def _np_dtype(name: str) -> str:
    # numpy has no bfloat16: gradients of that type are carried as raw 16-bit words.
    return "uint16" if name == "bfloat16" else name


def load_plan(path: str | Path, *, check_optimizer: bool = True) -> Plan:
    """The plan in the file at `path`; check_optimizer as in plan_from_json."""
    from ckptd.core.readfile import misplaced
    path = Path(path)
    data = b""
    try:
        data = _read_plan_bytes(path)
        doc = strict_json(data.decode())
    except PlanError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError: JSONDecodeError, and an integer past Python's 4300-digit limit
        if what := misplaced(data[:16], "plan"):  # an argument in the wrong place, said so
            raise PlanError(f"{path}: cannot read plan: this is {what}, not a plan (the JSON file "
                            "`ckptd plan` or ckptd.torch.write_plan writes)") from None
        raise PlanError(f"{path}: cannot read plan: {e}") from None
    return plan_from_json(doc, str(path), check_optimizer=check_optimizer)


def _read_plan_bytes(path: Path) -> bytes:
    """The plan's bytes (ckptd.core.readfile.read_bounded: a device that never ends cannot
    fill the memory; a FIFO nobody writes into is an error after its wait, not a daemon
    or a replay that hangs without a word)."""
    try:
        return read_bounded(path, MAX_PLAN_BYTES, "a plan")
    except (TimeoutError, TooLarge) as e:
        raise PlanError(f"{path}: {e}") from None


class _Doc:
    """Typed access to one JSON object of a plan: every wrong type or missing key is a
    PlanError naming its key path (parameters[3].shape), never a TypeError later."""

    def __init__(self, d, key: str):
        if not isinstance(d, dict):
            raise PlanError(f"{key or 'the plan'} must be an object, not {_kind(d)}")
        self.d, self.key = d, key

    def path(self, k) -> str:
        return f"{self.key}.{k}" if self.key else str(k)

    def only(self, known) -> None:
        """Refuse keys this object does not have: a misspelt one is not there at all and
        its default is taken without a word ("weight_decy": the moments stepped with no
        weight decay; "warmup_step": no warmup; "dtpye": float32), every commit wrong."""
        if why := unknown_keys(self.key, self.d, known):
            raise PlanError(why)

    def has(self, k) -> bool:
        return self.d.get(k) is not None

    def get(self, k, default=None):
        return self.d.get(k, default)

    def need(self, k):
        if k not in self.d:
            raise PlanError(f"{self.key or 'the plan'} is missing {k!r}")
        return self.d[k]

    def int(self, k, lo: int, hi: int, default=None, required=False):
        v = self.need(k) if required else self.d.get(k)
        if v is None and not required:
            # `"key": null` takes the default like a missing key (as has() reads it), not
            # None into a field that is compared as an int later (ring.max_threads)
            return default
        return _int(v, self.path(k), lo, hi)

    def num(self, k, default):
        v = self.d.get(k, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise PlanError(f"{self.path(k)} must be a number, not {_kind(v)}")
        try:
            return float(v)
        except OverflowError:
            raise PlanError(f"{self.path(k)} is {_short(v)}...: too large for a float") from None

    def str(self, k, default=None, choices=None):
        v = self.d.get(k, default)
        if not isinstance(v, str):
            raise PlanError(f"{self.path(k)} must be a string, not {_kind(v)}")
        if choices is not None and v not in choices:
            raise PlanError(f"{self.path(k)} is {v!r}; expected one of {', '.join(choices)}")
        return v

    def list(self, k, default=None, required=False):
        v = self.need(k) if required else self.d.get(k, default)
        if not isinstance(v, list):
            raise PlanError(f"{self.path(k)} must be a list, not {_kind(v)}")
        return v

    def obj(self, k):
        return _Doc(self.need(k), self.path(k))


def _int(v, key: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlanError(f"{key} must be an integer, not {_kind(v)}")
    if not lo <= v <= hi:
        raise PlanError(f"{key} is {_short(v)}; it must be in {lo}..{hi}")
    return v


def _short(v) -> str:
    return repr(v)[:40]


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), f"{type(v).__name__} {v!r}"[:60])


def plan_from_json(doc, where: str = "plan", *, check_optimizer: bool = True) -> Plan:
    """The plan a parsed JSON document describes; PlanError "<where>: <key>: <why>".
    check_optimizer=False is for tools that read only the ring and parameters and never
    step the optimizer (mirror-config, mirror-risk): its groups and lr scheduler are then
    not built in torch, which is not even imported; whatever replays keeps the check."""
    try:
        plan = _plan_from_json(doc)
        opt = plan.optimizer
        if check_optimizer and opt is not None and (opt.groups or opt.lr_scheduler is not None):
            # torch's constructors and scheduler: what they refuse (or fail on at their
            # first step) is refused now, before any checkpoint is written
            from ckptd.core.optim import check_replayable
            check_replayable(opt, plan.iterations)
        if plan.bucket_limits is None and plan.parameters:
            _say_no_limits()  # once it loaded: an error stays one line
        return plan
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None
    except RecursionError:
        raise PlanError(f"{where}: nested too deeply to be a plan") from None


def _buckets_json(p: Plan) -> dict:
    doc = {"first": [_bucket_json(b) for b in p.buckets_first],
           "rebuilt": "learn" if p.rebuilt_learn else [_bucket_json(b) for b in p.buckets_rebuilt]}
    if p.bucket_limits is not None:
        doc["limits"] = {k: list(v) for k, v in p.bucket_limits.items()}
    return doc


def _ring_json(p: Plan) -> dict:
    r = p.ring
    return {"nranks": r.nranks, "rings": [list(x) for x in r.rings], "protocol": r.protocol,
            "nccl_version": f"{r.nccl_version[0]}.{r.nccl_version[1]}",
            "max_threads": r.max_threads, "buffsize": r.buffsize,
            "qps_per_connection": r.qps_per_connection,
            "split_data_on_qps": r.split_data_on_qps, "mtu": r.mtu,
            "adaptive_routing": r.adaptive_routing, "ar_threshold": r.ar_threshold}


def _tensors_json(tensors) -> list[dict]:
    return [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
             **({"memory_order": list(t.memory_order)} if t.memory_order is not None else {})} for t in tensors]


UNSET = object()  # a PLAN_FIELDS writer's answer for a key the plan leaves out (its default)

# Every top-level key of a plan document and how Plan.to_json writes it, in its order.
# The reader accepts exactly these keys (PLAN_KEYS), so a key added here is both written
# and read: two hand-kept lists let a new field be written and then refused as unknown.
PLAN_FIELDS = {
    "format": lambda p: PLAN_FORMAT,
    "version": lambda p: PLAN_VERSION,
    "parameters": lambda p: _tensors_json(p.parameters),
    "buckets": _buckets_json,
    "ring": _ring_json,
    "optimizer": lambda p: None if p.optimizer is None else p.optimizer.to_json(),
    "ranks": lambda p: [p._rank_json(r) for r in range(p.nranks)],
    "mirrors": lambda p: [{"name": m.name, "rank": m.rank, "direction": m.direction,
                           **({"port": m.port} if m.port else {})} for m in p.mirrors],
    "iterations": lambda p: UNSET if p.iterations is None else p.iterations,
    "start_iteration": lambda p: UNSET if p.start_iteration is None else p.start_iteration,
    "transport": lambda p: UNSET if p.transport == "roce" else p.transport,
    "comm_hook": lambda p: UNSET if p.comm_hook == "allreduce" else p.comm_hook,
    "collectives": lambda p: {k: [collective_json(*collective_entry(e)) for e in v] for k, v in p.collectives.items()}
    if p.collectives else UNSET,
    "buffers": lambda p: p.buffers.to_json() if p.buffers.tensors else UNSET,
    "allreduces_per_step": lambda p: UNSET if p.allreduces_per_step == 1 else p.allreduces_per_step,
    "frozen": lambda p: _tensors_json(p.frozen) if p.frozen else UNSET,
    "find_unused_parameters": lambda p: True if p.find_unused_parameters else UNSET,
    "static_graph": lambda p: True if p.static_graph else UNSET,
    "static_used_map": lambda p: UNSET if p.static_used_map is None else list(p.static_used_map),
    "tied": lambda p: dict(p.tied) if p.tied else UNSET,
}
# and the note ckptd.torch.write_plan adds (which ckptd wrote it), kept by no Plan
PLAN_KEYS = (*PLAN_FIELDS, "written_by")


def _plan_from_json(raw) -> Plan:
    doc = _Doc(raw, "")
    if doc.get("format") != PLAN_FORMAT:
        raise PlanError(f"not a ckptd plan (format is {_short(doc.get('format'))}, "
                        f"expected {PLAN_FORMAT!r})")
    if doc.get("version") != PLAN_VERSION or isinstance(doc.get("version"), bool):  # true == 1 in Python
        raise PlanError(f"plan version {_short(doc.get('version'))} is not supported "
                        f"(this ckptd reads version {PLAN_VERSION})")
    # a misspelt section is not there at all: "optimiser" replayed as a plan without an
    # optimizer (exit 0, no checkpoint written), "colectives" as a job without them
    if why := unknown_keys("", raw, PLAN_KEYS):
        raise PlanError(why)
    params = _tensors_from_json(doc.list("parameters", []), "parameters")
    frozen = _tensors_from_json(doc.list("frozen", []), "frozen")  # absent in older plans: none

    bk = doc.obj("buckets")
    bk.only(BUCKETS_KEYS)

    def layout(key):
        out = []
        for i, raw_b in enumerate(bk.list(key, required=key == "first") or []):
            b = _Doc(raw_b, f"buckets.{key}[{i}]")
            b.only(("params",) if b.has("params") else ("count", "dtype"))  # _bucket_json writes one or the other
            if b.has("params"):
                names = b.list("params")
                for j, n in enumerate(names):
                    if not isinstance(n, str):
                        raise PlanError(f"{b.path('params')}[{j}] must be a parameter name, not {_kind(n)}")
                out.append(BucketLayout(params=tuple(names)))
            else:
                out.append(BucketLayout(count=b.int("count", 1, MAX_BUCKET_ELEMENTS, required=True),
                                        dtype=b.str("dtype", "float32", DTYPES)))
        return tuple(out)

    first = layout("first")
    named = [n for b in first for n in b.params]
    if named and "parameters" not in raw:  # (it said the optimizer's groups name unknown parameters)
        raise PlanError(f"parameters: missing, and the buckets name {len(named)} (first: {_short(named[0])}): "
                        "the plan lists each parameter's name, shape and dtype there")
    limits = bk.get("limits")
    if limits is not None and not isinstance(limits, dict):
        raise PlanError(f"buckets.limits must be an object, not {_kind(limits)}")
    if limits is not None:
        _Doc(limits, "buckets.limits").only(BUCKET_LIMIT_KEYS)
        limits = {k: [v] if _is_int(v) else v for k, v in limits.items()}
    learn = bk.get("rebuilt") == "learn"  # from the wire (gloo: DDP's broadcast)
    rebuilt = layout("rebuilt") if bk.get("rebuilt") and not learn else first

    r = doc.obj("ring")
    r.only(RING_KEYS)
    nccl = r.need("nccl_version")
    try:
        if not isinstance(nccl, str):  # a JSON number 2.20 reads 2.2
            raise ValueError
        major, minor = parse_nccl_version(nccl)
    except ValueError:
        raise PlanError(f"ring.nccl_version {_short(nccl)} is not MAJOR.MINOR as a string, e.g. \"2.21\"") from None
    nranks = r.int("nranks", 2, MAX_RANKS, required=True)
    channels = r.int("channels", 1, MAX_CHANNELS, 1)
    rings = r.list("rings") if r.has("rings") else [list(range(nranks))] * channels
    if not 1 <= len(rings) <= MAX_CHANNELS:
        raise PlanError(f"ring.rings lists {len(rings)} channels (1..{MAX_CHANNELS})")
    for c, ring in enumerate(rings):
        if not isinstance(ring, list) or len(ring) != nranks:
            raise PlanError(f"ring.rings[{c}] must list the {nranks} ranks")
    split = r.get("split_data_on_qps")
    if split is not None and not isinstance(split, bool):
        raise PlanError(f"ring.split_data_on_qps must be true, false or null, not {_kind(split)}")
    ar = r.get("adaptive_routing")
    if ar is not None and not isinstance(ar, bool):
        raise PlanError(f"ring.adaptive_routing must be true, false or null, not {_kind(ar)}")
    try:
        ring_cfg = RingConfig(
            nranks=nranks, rings=tuple(tuple(_int(x, f"ring.rings[{c}]", 0, nranks - 1) for x in ring)
                                       for c, ring in enumerate(rings)),
            protocol=r.str("protocol", "simple").lower(), nccl_version=(major, minor),
            max_threads=r.int("max_threads", 1, MAX_THREADS, 512),
            buffsize=r.int("buffsize", 1, MAX_BUFFSIZE),
            qps_per_connection=r.int("qps_per_connection", 1, MAX_QPS, 1),
            split_data_on_qps=split, mtu=r.int("mtu", 256, 4096, 4096), adaptive_routing=ar,
            ar_threshold=r.int("ar_threshold", MIN_AR_THRESHOLD, (1 << 31) - 1, IB_AR_THRESHOLD))
    except ScheduleError as e:
        raise PlanError(f"ring: {e}") from e
    # ring.algorithm: the job's NCCL_ALGO ("Ring" unless the plan says otherwise); a plan
    # that lets allreduce run as Tree/NVLS/CollNet is refused by name.
    nnodes = len({str(x.get("node", f"rank{x.get('rank')}")) for x in doc.list("ranks", [])
                  if isinstance(x, dict)}) or None
    check_allreduce_algorithm(r.str("algorithm", "Ring"), nnodes=nnodes, nvls_channels=r.get("nvls_channels"),
                              where="ring.algorithm: ")

    optimizer = None
    if doc.get("optimizer") is not None:
        o = doc.obj("optimizer")
        o.only(OPTIMIZER_KEYS)
        betas = o.list("betas", [0.9, 0.999])
        if len(betas) != 2:
            raise PlanError(f"optimizer.betas must be two numbers, not {len(betas)}")
        sched = o.get("lr_schedule") or {"kind": "constant"}
        if not isinstance(sched, dict):
            raise PlanError(f"optimizer.lr_schedule must be an object, not {_kind(sched)}")
        _Doc(sched, "optimizer.lr_schedule").only(LR_SCHEDULE_KEYS)
        mgn = o.get("max_grad_norm")
        kind = o.str("kind", "adamw")
        optimizer = Optimizer(
            kind=kind, lr=o.num("lr", 1e-3),
            betas=tuple(_Doc({"b": x}, "optimizer.betas").num("b", 0) for x in betas),
            # a hyperparameter left out is the torch class's default, as in `groups`: AdamW's
            # weight_decay is 0.01 (0.0 here stepped every iteration of such a job wrong)
            eps=o.num("eps", 1e-8), weight_decay=o.num("weight_decay", 0.01 if kind == "adamw" else 0.0),
            amsgrad=o.get("amsgrad", False), implementation=o.str("implementation", "foreach"),
            lr_schedule=dict(sched),
            max_grad_norm=None if mgn is None else o.num("max_grad_norm", None),
            grad_norm_type=_norm_type(o),
            clip_grad_value=None if o.get("clip_grad_value") is None else o.num("clip_grad_value", None),
            groups=_optimizer_groups(o.list("groups", []), [p.name for p in params], [p.name for p in frozen]),
            lr_scheduler=o.get("lr_scheduler"), grad_scaler=o.get("grad_scaler"),
            lr_per_step=tuple(o.list("lr_per_step", [])))

    ranks = []
    for i, raw_r in enumerate(doc.list("ranks", required=True)):
        rk = _Doc(raw_r, f"ranks[{i}]")
        rk.only(RANK_KEYS)
        rank, addr = rk.int("rank", 0, MAX_RANKS, required=True), rk.str("addr")
        try:
            ranks.append((rank, str(ipaddress.ip_address(addr))))
        except ValueError:
            raise PlanError(f"ranks[{i}].addr {_short(addr)} is not an IPv4 or IPv6 address") from None
    ranks.sort()
    if [x for x, _ in ranks] != list(range(nranks)):
        raise PlanError(f"ranks must list ranks 0..{nranks - 1} once each")
    addrs = tuple(a for _, a in ranks)
    nodes, nics = [], []
    for i, raw_r in enumerate(sorted(doc.list("ranks", required=True), key=lambda x: x.get("rank", 0))):
        rk = _Doc(raw_r, f"ranks[{i}]")
        nodes.append(rk.str("node", f"rank{i}"))
        if not rk.has("nics"):
            nics.append((addrs[i],) * ring_cfg.channels)
            continue
        per = rk.list("nics")
        if len(per) != ring_cfg.channels:
            raise PlanError(f"ranks[{i}].nics must list one NIC address per channel ({ring_cfg.channels})")
        try:
            nics.append(tuple(str(ipaddress.ip_address(n)) for n in per))
        except (TypeError, ValueError) as e:
            raise PlanError(f"ranks[{i}].nics: {e}") from e
    ports = _ports_from_json(doc, addrs)
    if ports:
        try:
            ring_cfg = dataclasses.replace(ring_cfg, ndevs=len(ports[0]))
        except ScheduleError as e:
            raise PlanError(f"ranks[0].ports: {e}") from None
    mirrors = []
    for i, raw_m in enumerate(doc.list("mirrors", [])):
        m = _Doc(raw_m, f"mirrors[{i}]")
        m.only(MIRROR_KEYS)
        mirrors.append(Mirror(m.str("name", f"mirror{i}"), m.int("rank", 0, nranks - 1, required=True),
                              m.str("direction", "both", ("tx", "rx", "both")),
                              m.int("port", 0, MAX_PORTS - 1, 0)))
        if mirrors[-1].name in [x.name for x in mirrors[:-1]]:  # the streams are told apart by name
            raise PlanError(f"mirrors[{i}].name {mirrors[-1].name!r} is given twice")
    return Plan(tuple(params), first, rebuilt, ring_cfg, optimizer, addrs, tuple(mirrors),
                doc.int("iterations", 1, MAX_ITERATIONS), doc.str("transport", "roce"), learn,
                nodes=tuple(nodes) if any(isinstance(x, dict) and "node" in x for x in doc.list("ranks")) else (),
                channel_nics=tuple(nics) if any(isinstance(x, dict) and "nics" in x for x in doc.list("ranks")) else (),
                ports=ports,
                start_iteration=doc.int("start_iteration", 0, MAX_ITERATIONS),
                comm_hook=doc.str("comm_hook", "allreduce", tuple(COMM_HOOKS)),
                collectives=_collectives(doc),
                buffers=_buffers_from_json(doc),
                allreduces_per_step=doc.int("allreduces_per_step", 1, MAX_ITERATIONS, 1),
                bucket_limits=limits, frozen=tuple(frozen),
                find_unused_parameters=doc.get("find_unused_parameters", False),
                static_graph=doc.get("static_graph", False),
                static_used_map=_tuple_if_list(doc.get("static_used_map")),
                tied=_tied_from_json(doc))


def _tied_from_json(doc) -> tuple[tuple[str, str], ...]:
    raw = doc.get("tied", {})  # absent in older plans: no tied weights
    if not isinstance(raw, dict):
        raise PlanError(f"tied must map a tied weight's other name to its parameter, not {_short(raw)}")
    return tuple(raw.items())


def _tuple_if_list(raw):
    # a list as JSON has it, as the frozen Plan holds it; its checks say what else is wrong
    return tuple(raw) if isinstance(raw, list) else raw


def _tensors_from_json(entries: list, key: str) -> list[Parameter]:
    """A list of {name, shape, dtype} (parameters, frozen, buffers.tensors)."""
    out = []
    for i, raw in enumerate(entries):
        t = _Doc(raw, f"{key}[{i}]")
        t.only(TENSOR_KEYS)
        shape = t.list("shape", required=True)
        if len(shape) > MAX_DIMS:
            raise PlanError(f"{t.path('shape')} has {len(shape)} dimensions (at most {MAX_DIMS})")
        order = None if t.d.get("memory_order") is None else t.list("memory_order")
        out.append(Parameter(t.str("name"), tuple(_int(x, f"{t.path('shape')}[{j}]", 0, MAX_PARAM_ELEMENTS)
                                                 for j, x in enumerate(shape)),
                             t.str("dtype", "float32", DTYPES),
                             None if order is None else tuple(_int(x, f"{t.path('memory_order')}[{j}]", 0, MAX_DIMS)
                                                               for j, x in enumerate(order))))
    return out


def _ports_from_json(doc, addrs: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """ranks[].ports: every rank's merged-NIC ports, or () where no rank lists any."""
    raw = sorted(doc.list("ranks", required=True), key=lambda x: x.get("rank", 0) if isinstance(x, dict) else 0)
    if not any(isinstance(x, dict) and "ports" in x for x in raw):
        return ()
    out = []
    for i, raw_r in enumerate(raw):
        rk = _Doc(raw_r, f"ranks[{i}]")
        per = rk.list("ports", [addrs[i]])
        if not 1 <= len(per) <= MAX_PORTS:
            raise PlanError(f"ranks[{i}].ports must list 1 to {MAX_PORTS} port addresses (NCCL_IB_MAX_DEVS_PER_NIC)")
        try:
            out.append(tuple(str(ipaddress.ip_address(a)) for a in per))
        except (TypeError, ValueError) as e:
            raise PlanError(f"ranks[{i}].ports: {e}") from e
    return tuple(out)


_NO_LIMITS_SAID = []


def _say_no_limits() -> None:
    """An older plan without buckets.limits loads, its layouts checked by the weaker
    bucket-cap rule only; said once per process."""
    if not _NO_LIMITS_SAID:
        _NO_LIMITS_SAID.append(True)
        import logging
        logging.getLogger("ckptd").info(  # info: a CLI error stays one line on stderr
            "the plan has no buckets.limits: its bucket layouts are checked by the bucket-cap rule only, "
            "not against DDP's limits; rewrite it with write_plan or `ckptd plan` to check them")


COLLECTIVE_WHEN = ("start", "before", "after")
COLLECTIVE_OPS = ("allreduce", "broadcast", "allgather")


def collective_entry(e) -> tuple[str, int, str, int | None]:
    """(op, count, dtype, root) of a Plan.collectives entry: (count, dtype) is an
    allreduce (root None), (count, dtype, "broadcast", root) a broadcast, (count, dtype,
    "allgather") an allgather of count elements a rank (root None)."""
    if len(e) == 2:
        return "allreduce", int(e[0]), str(e[1]), None
    if len(e) == 3:
        return str(e[2]), int(e[0]), str(e[1]), None
    return str(e[2]), int(e[0]), str(e[1]), int(e[3])


def collective_json(op: str, n: int, d: str, root: int | None) -> dict:
    """A collective (collective_entry's fields) in the plan's JSON form."""
    out = {"op": op, "count": n, "dtype": d}
    if op == "broadcast":
        out["root"] = root
    return out


def collectives_from_json(obj, key: str = "collectives") -> dict:
    """Plan.collectives from their JSON form (docs/PLAN.md `collectives`), checked as a
    plan's are: write_plan's `collectives` argument."""
    return _collectives(_Doc({key: obj}, ""))


def _collectives(doc: "_Doc") -> dict:
    """plan["collectives"]: the communicator's other allreduces (docs/PLAN.md)."""
    if doc.get("collectives") is None:
        return {}
    c = doc.obj("collectives")
    c.only(COLLECTIVE_WHEN)
    out = {}
    for when in COLLECTIVE_WHEN:
        entries = []
        for i, raw in enumerate(c.list(when, [])):
            e = _Doc(raw, f"collectives.{when}[{i}]")
            op = e.str("op", "allreduce")
            if op not in COLLECTIVE_OPS:
                raise PlanError(f"collectives.{when}[{i}].op {op!r}: one of {', '.join(COLLECTIVE_OPS)} "
                                "(docs/NCCL.md section 4a)")
            e.only(("op", "count", "dtype", "root") if op == "broadcast" else ("op", "count", "dtype"))
            count, dtype = e.int("count", 1, MAX_BUCKET_ELEMENTS, required=True), e.str("dtype", "float32", DTYPES)
            if op == "broadcast":
                entries.append((count, dtype, op, e.int("root", 0, MAX_RANKS - 1, required=True)))
            elif op == "allgather":
                entries.append((count, dtype, op))
            else:
                entries.append((count, dtype))
        if entries:
            out[when] = tuple(entries)
    return out



def _buffers_from_json(doc) -> ModuleBuffers:
    if doc.get("buffers") is None:
        return ModuleBuffers()
    b = doc.obj("buffers")
    b.only(BUFFERS_KEYS)
    tensors = _tensors_from_json(b.list("tensors", required=True), "buffers.tensors")
    groups = []
    for i, g in enumerate(b.list("broadcasts", required=True)):
        if not isinstance(g, list) or not all(isinstance(n, str) for n in g):
            raise PlanError(f"buffers.broadcasts[{i}] must be a list of buffer names")
        groups.append(tuple(g))
    captured = b.get("captured", False)
    if not isinstance(captured, bool):
        raise PlanError(f"buffers.captured must be true or false, not {_kind(captured)}")
    return ModuleBuffers(tuple(tensors), tuple(groups), captured)


def _check_topology(plan: Plan):
    """Nodes and NICs that describe real hosts: a NIC belongs to one node, and every NIC
    a channel uses is some rank's own NIC on the rank's node (the rank NCCL's proxy for
    it runs on, with PXN), so that a NIC address always names one rank (rank_of)."""
    n = len(plan.addresses)
    if plan.nodes and len(plan.nodes) != n or plan.channel_nics and len(plan.channel_nics) != n:
        raise PlanError(f"ranks: {n} addresses, {len(plan.nodes)} nodes, "
                        f"{len(plan.channel_nics)} NIC lists")
    nodes = plan.node_names
    node_of_addr: dict[str, tuple[str, int]] = {}
    for r, (a, node) in enumerate(zip(plan.addresses, nodes)):
        other = node_of_addr.setdefault(a, (node, r))
        if other[0] != node:
            raise PlanError(f"ranks {other[1]} and {r} share NIC {a} but are on nodes "
                            f"{other[0]!r} and {node!r}: a NIC belongs to one node")
    for r, per in enumerate(plan.channel_nics):
        if len(per) != plan.ring.channels:
            raise PlanError(f"ranks[{r}].nics must list one NIC address per channel "
                            f"({plan.ring.channels})")
        for c, a in enumerate(per):
            if node_of_addr.get(a, (None,))[0] != nodes[r]:
                raise PlanError(f"ranks[{r}].nics[{c}] is {a}, which is no rank's own NIC "
                                f"(addr) on node {nodes[r]!r}: list the NIC's owner rank with it as addr")
    _check_ports(plan)
    for i, m in enumerate(plan.mirrors):
        if 0 <= m.rank < n and m.port >= plan.ring.ndevs:
            raise PlanError(f"mirrors[{i}].port is {m.port}, but rank {m.rank}'s NIC has "
                            f"{plan.ring.ndevs} port(s)")
        if 0 <= m.rank < n and plan.rank_of(plan.addresses[m.rank]) != m.rank:
            raise PlanError(f"mirrors[{i}] names rank {m.rank}, whose NIC "
                            f"{plan.addresses[m.rank]} is rank {plan.rank_of(plan.addresses[m.rank])}'s "
                            "too: name the port by that rank")


def _check_ports(plan: Plan):
    """Merged NICs: each NIC's ports start with its addr, belong to that NIC alone, and
    every NIC has ring.ndevs of them. Different port counts at the two ends of a
    connection are not modelled: 2.20-2.23 connect QPS·local ndevs QPs on each side and
    only warn when they differ (net_ib.cc:1098-1102@v2.21.5-1), and 2.24+'s max(local,
    remote) rule (net_ib.cc:1232-1234,1390@v2.24.3-1) is not implemented here."""
    n, k = len(plan.addresses), plan.ring.ndevs
    if plan.ports and len(plan.ports) != n:
        raise PlanError(f"ranks: {n} addresses, {len(plan.ports)} port lists")
    seen: dict[str, int] = {}
    for r in range(n):
        ports = plan.nic_ports(r)
        if len(ports) != k:
            raise PlanError(f"ranks[{r}].ports lists {len(ports)} port(s) where the job's NICs have {k}: "
                            "merged NICs with different port counts are not modelled")
        if ports[0] != plan.addresses[r]:
            raise PlanError(f"ranks[{r}].ports[0] is {ports[0]}, not the rank's addr {plan.addresses[r]}: "
                            "list the NIC's ports in NCCL's device order, addr first")
        if len(set(ports)) != len(ports):
            raise PlanError(f"ranks[{r}].ports lists an address twice")
        owner = plan.rank_of(plan.addresses[r])
        if owner != r and plan.nic_ports(owner) != ports:
            raise PlanError(f"ranks[{r}].ports differ from ranks[{owner}].ports, whose NIC it shares")
        for a in ports:
            if seen.setdefault(a, owner) != owner:
                raise PlanError(f"ranks[{r}].ports: {a} is a port of rank {seen[a]}'s NIC too")


def _optimizer_groups(groups: list, names: list[str], frozen: list[str] = ()) -> tuple:
    """optimizer.groups: every parameter in exactly one group, a frozen one in at most one
    (torch never steps it: its grad stays None); hyperparameters are checked by torch
    itself when the shadow builds them (ckptd.core.optim.full_groups)."""
    if not groups:
        return ()
    seen: list[str] = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise PlanError(f"optimizer.groups[{i}] needs a list of parameter names")
        unknown = [n for n in g["params"] if n not in names and n not in frozen]
        if unknown:
            raise PlanError(f"optimizer.groups[{i}] names unknown parameters {unknown[:5]}")
        seen += g["params"]
    if sorted(n for n in seen if n not in frozen) != sorted(names) or len(set(seen)) != len(seen):
        raise PlanError("optimizer.groups must hold every parameter exactly once (a frozen one at most once)")
    return tuple(dict(g) for g in groups)
