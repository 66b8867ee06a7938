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
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ckptd.core.algorithms import check_allreduce_algorithm
from ckptd.core.schedule import Bucket, RingConfig, RingSchedule, ScheduleError, network_connections
from ckptd.errors import CkptdError

PLAN_FORMAT = "ckptd-plan"
PLAN_VERSION = 1
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8")


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
    kind: str = "adamw"  # adam | adamw
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    amsgrad: bool = False
    implementation: str = "foreach"  # for-loop | foreach | fused
    lr_schedule: dict = field(default_factory=lambda: {"kind": "constant"})
    max_grad_norm: float | None = None


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
    addresses: tuple[str, ...]  # rank -> its own NIC address (canonical text)
    mirrors: tuple[Mirror, ...] = ()
    iterations: int | None = None
    transport: str = "roce"  # roce: NCCL over RoCEv2 | gloo: torch.distributed gloo over TCP
    rebuilt_learn: bool = False  # buckets.rebuilt is "learn": taken from the wire (gloo only)
    # As given, empty for the defaults (read them through node_names and nic(), so that
    # dataclasses.replace(plan, addresses=...) keeps meaning "own NIC, own node"):
    nodes: tuple[str, ...] = ()  # rank -> node name; empty: every rank a node of its own
    channel_nics: tuple[tuple[str, ...], ...] = ()  # rank -> channel -> NIC address; empty: own NIC

    def __post_init__(self):
        if self.transport == "roce":  # gloo ranks are TCP endpoints: they may share an address
            _check_topology(self)

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
        return self.param(b.params[0]).dtype if b.params else b.dtype

    def schedule(self, iteration: int) -> RingSchedule:
        return RingSchedule(self.ring, self.buckets(iteration))

    def rank_of(self, addr: str) -> int | None:
        """The rank whose own NIC has this address: the lowest one where ranks of a node
        share a NIC. It names the NIC wherever traffic is keyed by address."""
        return self._rank_by_addr.get(addr)

    @cached_property
    def _rank_by_addr(self) -> dict[str, int]:
        owners: dict[str, int] = {}
        for r, a in enumerate(self.addresses):
            owners.setdefault(a, r)
        return owners

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
            "optimizer": None if self.optimizer is None else {
                "kind": self.optimizer.kind, "lr": self.optimizer.lr,
                "betas": list(self.optimizer.betas), "eps": self.optimizer.eps,
                "weight_decay": self.optimizer.weight_decay, "amsgrad": self.optimizer.amsgrad,
                "implementation": self.optimizer.implementation,
                "lr_schedule": dict(self.optimizer.lr_schedule),
                "max_grad_norm": self.optimizer.max_grad_norm,
            },
            "ranks": [self._rank_json(r) for r in range(self.nranks)],
            "mirrors": [{"name": m.name, "rank": m.rank, "direction": m.direction}
                        for m in self.mirrors],
        }
        if self.iterations is not None:
            doc["iterations"] = self.iterations
        if self.transport != "roce":
            doc["transport"] = self.transport
        return doc

    def _rank_json(self, r: int) -> dict:
        """A rank's entry; node and nics only where they differ from the defaults, so a
        one-GPU-per-host plan reads as it always did."""
        out = {"rank": r, "addr": self.addresses[r]}
        if self.node_names[r] != f"rank{r}":
            out["node"] = self.node_names[r]
        nics = [self.nic(r, c) for c in range(self.ring.channels)]
        if any(a != self.addresses[r] for a in nics):
            out["nics"] = nics
        return out

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
    # ring.algorithm: the job's NCCL_ALGO ("Ring" unless the plan says otherwise); a plan
    # that lets allreduce run as Tree/NVLS/CollNet is refused by name.
    nnodes = len({str(x.get("node", f"rank{x.get('rank')}")) for x in doc.get("ranks", [])}) or None
    check_allreduce_algorithm(r.get("algorithm", "Ring"), nnodes=nnodes, nvls_channels=r.get("nvls_channels"),
                              where=f"{where}: ring.algorithm: ")

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
            max_grad_norm=opt.get("max_grad_norm"))
        if optimizer.kind not in ("adam", "adamw"):
            raise PlanError(f"{where}: optimizer.kind {optimizer.kind!r} is not supported (adam, adamw)")
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
    nodes = tuple(str(x.get("node", f"rank{x['rank']}")) for x in ranks)
    nics = []
    for x, a in zip(ranks, addrs):
        per = x.get("nics")
        if per is None:
            nics.append((a,) * ring.channels)
            continue
        if not isinstance(per, list) or len(per) != ring.channels:
            raise PlanError(f"{where}: ranks[{x['rank']}].nics must list one NIC address per "
                            f"channel ({ring.channels})")
        try:
            nics.append(tuple(str(ipaddress.ip_address(n)) for n in per))
        except ValueError as e:
            raise PlanError(f"{where}: ranks[{x['rank']}].nics: {e}") from e
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
    try:
        return Plan(tuple(params), first, rebuilt, ring, optimizer, addrs, tuple(mirrors),
                    doc.get("iterations"), transport, learn,
                    nodes if any("node" in x for x in ranks) else (),
                    tuple(nics) if any("nics" in x for x in ranks) else ())
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from e


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
    for i, m in enumerate(plan.mirrors):
        if 0 <= m.rank < n and plan.rank_of(plan.addresses[m.rank]) != m.rank:
            raise PlanError(f"mirrors[{i}] names rank {m.rank}, whose NIC "
                            f"{plan.addresses[m.rank]} is rank {plan.rank_of(plan.addresses[m.rank])}'s "
                            "too: name the port by that rank")
