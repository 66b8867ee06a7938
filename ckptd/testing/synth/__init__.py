"""`ckptd synth`: real PyTorch training of a small LM over N data-parallel ranks, and the
RoCEv2 frames its NCCL ring allreduce would put on every mirrored switch port.

It writes, under --out:
  plan.json                 the workload plan (buckets, ring, optimizer, addresses, mirrors)
  init.pt                   the initial model state (checkpoint of iteration -1)
  mirrors/<name>.pcap       what each mirror stream captured (with its impairments)
  reference/iter_NNNNNN.pt  the trainer's own state after each iteration
  synth.json                what was generated and injected, per stream
"""
from __future__ import annotations

import json
import math
import random
import shutil
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from parsers.pcap import ChunkedFile, PcapWriter

from ckptd.core.checkpoint import checkpoint_name, save_checkpoint
from ckptd.core.optim import UNREPLAYABLE, lr_factor, scheduler_class, torch_optimizer, torch_scheduler
from ckptd.core.plan import (COLLECTIVE_WHEN, DTYPES, MAX_BUCKET_ELEMENTS, OPTIMIZER_CLASSES, BucketLayout,
                             Mirror, ModuleBuffers, Optimizer, Parameter, Plan, _is_int)
from ckptd.errors import CkptdError
from ckptd.core.psn import PSN_MOD
from ckptd.core.schedule import AG, NCCL_VERSIONS, RingConfig, parse_nccl_version
from ckptd.core.tree import TreeSchedule
from ckptd.testing.synth.ddp import first_buckets, grad_ready_order, rebuilt_buckets
from ckptd.testing.synth.model import MODEL_SIZES, build_model, shard_batches
from ckptd.testing.synth.ring import reduce_iteration
from ckptd.core import ll128
from ckptd.testing.synth.wire import Host, QueuePair, imm_bytes, ip_udp_frame, ll_encode, roce_frame
from parsers.bth import BTH


# Between one iteration's last allreduce and the next one's first: the optimizer step,
# the forward pass and the first part of the backward pass. Tens to hundreds of ms in real
# jobs; longer than the agreement window (ckptd.core.assemble.AGREE_WINDOW_MS), as there.
ITERATION_GAP_NS = 100_000_000

# What the synthesizer takes (the command line's ranges): every rank's gradients and every
# other collective's values are real tensors, reduced on this machine for every iteration.
SYNTH_RANKS = (2, 64)
SYNTH_CHANNELS = (1, 32)
SYNTH_MIRRORS = (1, 64)
MAX_ITERATIONS_SYNTH = 10_000
SYNTH_NICS_PER_NODE = (0, 64)
# The other collectives' elements (--other-allreduce/--other-broadcast), each and in all: a
# loss or metric is a few elements; this is more than the default model's 2.6 M parameters,
# and far below the plan's MAX_BUCKET_ELEMENTS (which the command line's 9-digit COUNT
# never reaches), as synth holds count x ranks values of each in memory every iteration.
SYNTH_MAX_OTHER_ELEMENTS = min(1 << 22, MAX_BUCKET_ELEMENTS)
# shard_batches seeds a torch.Generator with seed * 1_000_003 + ...: a 64-bit seed overflows it
SYNTH_MAX_SEED = (1 << 32) - 1


class SynthOptionError(CkptdError, ValueError):
    """SynthOptions that do not make a job, named as the `ckptd synth` option that sets them."""


@dataclass
class SynthOptions:
    out: str
    ranks: int = 4
    channels: int = 2
    protocol: str = "simple"
    mtu: int = 4096
    mirrors: int = 2
    iterations: int = 5
    # micro-batches per step, each allreduced (accumulation without no_sync): DDP's
    # param.grad holds the previous reduced value plus this backward's gradient
    allreduces_per_step: int = 1
    seed: int = 0
    model: str = "small"
    nccl_version: str = "2.19"
    qps: int = 1
    # ports of every rank's merged NIC (NCCL_IB_MERGE_NICS, 2.20+): port k's address is
    # port_address(addr, k); mirror m is port m % K of the NIC _mirror_nics gives it
    merged_nics: int = 1
    # mirrors past the job's switch ports (mirror_ports): mirror k a second session of the
    # port of mirror k - ports, an independent lossy copy of it, which tests ask for on
    # purpose; otherwise refused (a user asking for more mirrors expects more ports)
    wrap_mirrors: bool = False
    split_data_on_qps: bool | None = None  # NCCL_IB_SPLIT_DATA_ON_QPS (None: the version's default)
    adaptive_routing: bool | None = None  # NCCL_IB_ADAPTIVE_ROUTING (RingConfig.ar_writes)
    buffsize: int | None = None  # NCCL_<PROTO>_BUFFSIZE: a small one makes many ring loops
    bucket_cap_kb: int = 64
    optimizer: str = "foreach"  # for-loop | foreach | fused
    lr_schedule: str = "cosine"
    max_grad_norm: float | None = None
    grad_norm_type: float = 2.0  # clip_grad_norm_'s norm_type (with max_grad_norm)
    clip_grad_value: float | None = None  # clip_grad_value_ instead
    # the trainer's torch.optim class (a plan optimizer kind) and its hyperparameters,
    # for jobs beyond the default AdamW: with any of these the plan has param groups
    opt_kind: str = "adamw"
    opt_hyper: dict = field(default_factory=dict)
    no_decay_group: bool = False  # biases and norms in a second group without weight decay
    lr_scheduler: dict | None = None  # {"class": "StepLR", "args": {...}}: the real torch class
    amp_init_scale: float | None = None  # a GradScaler: the wire carries scaled gradients
    amp_growth_interval: int = 2000
    comm_hook: str = "allreduce"  # fp16_compress | bf16_compress: the wire dtype
    # the lr the trainer writes into its groups before step i (no scheduler): entry i one
    # number for every group or a list of one per group (Optimizer.lr_per_step)
    lr_per_step: tuple = ()
    # iterations whose gradient holds an inf (rank 0, one element, after the backward), as a
    # real fp16 overflow would: with a GradScaler the step is skipped and the scale backs off;
    # without one the trainer steps it and diverges (NaN weights from then on)
    inf_at: tuple = ()
    param_dtype: str = "float32"  # float32 | bfloat16: the model's parameters (and gradients)
    loss: float = 0.0  # per mirror link, independently
    duplicate: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    retransmit: float = 0.0  # per message, on the wire (every mirror sees it)
    psn_wrap: bool = False  # start PSNs just below 2**24 so they wrap inside iteration 0/1
    ipv6: bool = False
    shuffle_rings: bool = False  # a different ring order per channel
    noise: bool = True  # unrelated traffic on the same ports
    mirror_direction: str = "both"
    write_hosts: bool = False  # also hosts/rank<r>.pcap: what each rank's NIC sends (no mirror loss)
    nodes: int = 0  # >0: ranks = nodes x gpus_per_node, NCCL-style rings through NVLink inside a node
    gpus_per_node: int = 1
    nics_per_node: int = 0  # 0: one NIC per GPU (rails); channel c uses NIC c % nics_per_node
    collective: str = "allreduce"  # what the wire carries: allreduce | reduce_scatter | tree (refusal tests)
    # other collectives on the communicator (Plan.collectives): {"start"|"before"|"after":
    # [[count, dtype] (an allreduce), [count, dtype, "broadcast", root] or [count, dtype,
    # "allgather"] (count a rank), ...]}
    collectives: dict = field(default_factory=dict)
    # DDP's constructor collectives on the wire before iteration 0, first of the plan's
    # "start" collectives: verify_params_across_processes' allgather of the parameter count
    # (1 int64) and broadcast of the shapes and strides (int64), then _sync_module_states'
    # broadcast of the parameters and buffers from rank 0 (250 MiB buckets)
    startup_broadcast: bool = False
    # name prefixes of parameters the trainer freezes (requires_grad=False, as fine-tuning
    # does) before wrapping the model in DDP: the reducer leaves them out (no bucket, no
    # gradient on the wire), the plan records them in `frozen`, and the optimizer, built over
    # model.parameters(), holds them in its group and skips them (their grad stays None)
    freeze: tuple = ()
    # name prefixes of parameters the forward leaves unused (DDP's find_unused_parameters=True,
    # unused_on): on every rank at iterations 0, 3, 6, ..., on rank 0 only at 1, 4, 7, ...
    # The plan says find_unused_parameters; every round ends with DDP's used-map allreduce
    unused: tuple = ()
    # DDP's static_graph=True (docs/TRAINING.md): the first layout one bucket, iteration 0's
    # round opens with DDP's used-map allreduce (Reducer::delay_all_reduce), iteration 1
    # allreduces the first layout again, the rebuilt layout from iteration 2 on. With
    # --unused its parameters are unused on every rank at every iteration (the graph is
    # static): zeros in their bucket slots, never stepped (the map of iteration 0 is kept)
    static_graph: bool = False
    stats: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.nodes:
            self.ranks = self.nodes * self.gpus_per_node


def parse_spec(text: str) -> tuple[str, dict]:
    """`NAME[:key=value,...]` (the CLI's --optim and --lr-scheduler) -> (NAME, {key: value}).
    A value is true/false, none, an int, a float, a list of numbers joined by "/"
    (betas=0.9/0.95, milestones=2/5) or else a string."""
    name, _, rest = text.partition(":")
    if not name:
        raise ValueError(f"{text!r}: NAME[:key=value,...]")
    args = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{text!r}: {item!r} is not key=value")
        if key.strip() in args:  # the last one silently winning hides a typo
            raise ValueError(f"{text!r}: {key.strip()!r} given twice")
        args[key.strip()] = _spec_value(value.strip())
    return name.strip(), args


def _spec_value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if "/" in v:
        return [_spec_value(x) for x in v.split("/")]
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def parse_lr_per_step(text: str) -> tuple:
    """The CLI's --lr-per-step: `LR,LR,...` one per step; `A/B` sets each group's own."""
    out = []
    for i, item in enumerate(text.split(","), 1):
        try:
            vals = [float(x) for x in item.split("/")]
        except ValueError:  # (it said "could not convert string to float: ''")
            raise ValueError(f"{text!r}: entry {i} ({item!r}) is not LR or LR/LR/...: give LR,LR,..., "
                             "one per step") from None
        out.append(vals if "/" in item else vals[0])
    return tuple(out)


def _ring_orders(opts: SynthOptions, rng: random.Random):
    if opts.nodes:
        return _node_rings(opts.nodes, opts.gpus_per_node, opts.channels)
    base = list(range(opts.ranks))
    rings = []
    for c in range(opts.channels):
        if opts.shuffle_rings and c > 0:
            order = base[1:]
            rng.shuffle(order)
            rings.append(tuple([0] + order))
        else:
            rings.append(tuple(base))
    return tuple(rings)


def _node_rings(nodes: int, gpus: int, channels: int) -> tuple[tuple[int, ...], ...]:
    """NCCL-style rings over nodes whose ranks are consecutive: each node's GPUs in
    turn, entered at local GPU c on channel c and left from the one before it, so
    every channel enters each node at a different GPU (and NIC, on a rail-optimised
    node), as NCCL's graph search lays rings out (src/graph/search.cc)."""
    return tuple(tuple(n * gpus + (c + j) % gpus for n in range(nodes) for j in range(gpus))
                 for c in range(channels))


def _node_nics(opts: SynthOptions, rings) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """(rank -> own NIC address, rank -> node, rank -> per-channel NIC address).

    NIC k of node n serves the GPUs k*g/K .. (k+1)*g/K - 1 (g GPUs, K NICs), so each
    GPU owns the NIC nearest to it. Channel c's network hops use NIC c % K on every
    node (rails): the GPU entering the node receives on it and the GPU leaving sends
    through it (via PXN when it is another GPU's NIC). Hops inside a node use none."""
    g = opts.gpus_per_node
    k = opts.nics_per_node or g
    if opts.ipv6:
        addr = [[f"fd00:77::{n + 1:x}:{i + 1:x}" for i in range(k)] for n in range(opts.nodes)]
    else:
        addr = [[f"10.77.{n}.{i + 1}" for i in range(k)] for n in range(opts.nodes)]
    own = tuple(addr[r // g][(r % g) * k // g] for r in range(opts.ranks))
    nodes = tuple(f"node{r // g}" for r in range(opts.ranks))
    nics = [list((a,) * opts.channels) for a in own]
    for c, ring in enumerate(rings):
        for i, src in enumerate(ring):
            dst = ring[(i + 1) % len(ring)]
            if src // g != dst // g:
                nics[src][c] = addr[src // g][c % k]
                nics[dst][c] = addr[dst // g][c % k]
    return own, nodes, tuple(tuple(x) for x in nics)


def _node_mirrors(opts: SynthOptions, own: tuple[str, ...]) -> tuple[Mirror, ...]:
    """Mirror k on the switch port of NIC k % K of node k // K: with one channel per
    rail, the first K mirrors see two links of every ring (both directions). With merged
    NICs of P ports, mirrors k*P .. k*P+P-1 are the P ports of that NIC."""
    g = opts.gpus_per_node
    k = opts.nics_per_node or g
    out = []
    for m in range(opts.mirrors):
        m_nic, port = divmod(m, opts.merged_nics)
        node, nic = (m_nic // k) % opts.nodes, m_nic % k
        owner = next(r for r in range(node * g, node * g + g) if own[r] == own[node * g + nic * g // k])
        out.append(Mirror(f"mirror{m}", owner, opts.mirror_direction, port))
    return tuple(out)


def mirror_ports(opts: SynthOptions) -> int:
    """How many distinct switch ports the job's mirrors can be on: every rank's NIC (with
    --nodes, every NIC of every node), each of its --merged-nics ports. Mirror k past
    them wraps to the port of mirror k - mirror_ports: a second session of the same
    port (make_plan, _node_mirrors), refused by check_options unless wrap_mirrors."""
    if opts.nodes:
        return opts.nodes * (opts.nics_per_node or opts.gpus_per_node) * opts.merged_nics
    return opts.ranks * opts.merged_nics


def port_address(addr: str, k: int) -> str:
    """Port k of the merged NIC whose first port is addr (10.77.x.y -> 10.(77+k).x.y,
    fd00:77:: -> fd00:(77+k)::)."""
    if k == 0:
        return addr
    if ":" in addr:
        return addr.replace("fd00:77:", f"fd00:{0x77 + k:x}:", 1)
    a, b, rest = addr.split(".", 2)
    return f"{a}.{int(b) + k}.{rest}"


def make_plan(opts: SynthOptions, model, rng: random.Random) -> Plan:
    every = list(model.named_parameters())
    # DDP's reducer takes only the parameters that require grad: its buckets (first and
    # rebuilt) and the plan's parameters are those; the frozen ones go to Plan.frozen
    named = [(n, p) for n, p in every if p.requires_grad]
    frozen = [(n, p) for n, p in every if not p.requires_grad]
    params = [p for _, p in named]
    names = [n for n, _ in named]
    cap = opts.bucket_cap_kb * 1024
    # find_unused_parameters: DDP's first layout uses the cap (compute_bucket_size_limits)
    # and is never rebuilt; static_graph: the first layout is one bucket (sys.maxsize), rebuilt
    # as a plain job's
    find_unused = bool(opts.unused) and not opts.static_graph
    if opts.static_graph:
        first = first_buckets(params, sys.maxsize, first_bytes=sys.maxsize)
    else:
        first = first_buckets(params, cap, first_bytes=cap if find_unused else cap // 4)
    order = grad_ready_order(model, shard_batches(model, 0, 0, opts.seed))
    rebuilt = first if find_unused else rebuilt_buckets(params, order, cap, first_bytes=cap // 4)
    major, minor = _nccl_version(opts.nccl_version)
    if opts.nodes and opts.shuffle_rings:
        raise SynthOptionError("--shuffle-rings makes one-GPU-per-host rings; with --nodes the rings are NCCL's")
    ring = RingConfig(nranks=opts.ranks, rings=_ring_orders(opts, rng), protocol=opts.protocol,
                      nccl_version=(major, minor), qps_per_connection=opts.qps, mtu=opts.mtu,
                      buffsize=opts.buffsize, ndevs=opts.merged_nics,
                      split_data_on_qps=opts.split_data_on_qps, adaptive_routing=opts.adaptive_routing)
    sched = {"constant": {"kind": "constant"},
             "cosine": {"kind": "cosine", "warmup_steps": 2, "total_steps": max(4, opts.iterations)},
             "linear": {"kind": "linear", "warmup_steps": 1, "total_steps": max(4, opts.iterations + 1)}}
    optimizer = Optimizer(kind="adamw", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                          implementation=opts.optimizer, lr_schedule=sched[opts.lr_schedule],
                          max_grad_norm=opts.max_grad_norm, grad_norm_type=opts.grad_norm_type,
                          clip_grad_value=opts.clip_grad_value)
    if opts.lr_per_step and opts.lr_scheduler:
        raise SynthOptionError("--lr-per-step and --lr-scheduler (lr_per_step and lr_scheduler) both set "
                               "the lr: give one")
    if opts.lr_per_step and len(opts.lr_per_step) < opts.iterations:
        raise SynthOptionError(f"--lr-per-step (lr_per_step) has {len(opts.lr_per_step)} lrs for "
                               f"{opts.iterations} iterations")
    late = [i for i in opts.inf_at if i >= opts.iterations]
    if late:  # never reached: the run had no overflow at all, silently
        raise SynthOptionError(f"--inf-at {late[0]}: the job runs iterations 0..{opts.iterations - 1}")
    # with frozen parameters the plan names the groups as torch holds them (build_plan's
    # record of an optimizer over model.parameters()): the frozen ones in them, in the
    # model's order; without groups the shadow's one group would be the trainable ones only
    if opts.opt_kind != "adamw" or opts.opt_hyper or opts.no_decay_group or opts.lr_scheduler \
            or opts.amp_init_scale or opts.lr_per_step or frozen:
        hyper = {"lr": 3e-3, "weight_decay": 0.1, "foreach": opts.optimizer == "foreach",
                 **({"fused": True} if opts.optimizer == "fused" else {}), **opts.opt_hyper}
        held = [n for n, _ in every]  # the optimizer's: model.parameters(), frozen ones included
        no_decay = [n for n in held if opts.no_decay_group and (n.endswith("bias") or "ln" in n or "norm" in n)]
        groups = [{"params": [n for n in held if n not in no_decay], **hyper}]
        if no_decay:
            groups.append({"params": no_decay, **hyper, "weight_decay": 0.0})
        scaler = None if opts.amp_init_scale is None else {
            "init_scale": opts.amp_init_scale, "growth_interval": opts.amp_growth_interval}
        by_hand = tuple([float(v) for v in x] if isinstance(x, (list, tuple)) else float(x)
                        for x in opts.lr_per_step)
        optimizer = Optimizer(kind=opts.opt_kind, lr=hyper["lr"], groups=tuple(groups),
                              lr_schedule=sched[opts.lr_schedule] if not (opts.lr_scheduler or by_hand)
                              else {"kind": "constant"},
                              lr_scheduler=opts.lr_scheduler, grad_scaler=scaler,
                              max_grad_norm=opts.max_grad_norm, grad_norm_type=opts.grad_norm_type,
                          clip_grad_value=opts.clip_grad_value, lr_per_step=by_hand)
    nodes, nics = (), ()
    if opts.nodes:
        addrs, nodes, nics = _node_nics(opts, ring.rings)
        mirrors = _node_mirrors(opts, addrs)
    else:
        if opts.ipv6:
            addrs = tuple(f"fd00:77::{r + 1:x}" for r in range(opts.ranks))
        else:
            addrs = tuple(f"10.77.0.{r + 1}" for r in range(opts.ranks))
        mirrors = tuple(Mirror(f"mirror{k}", (k // opts.merged_nics) % opts.ranks, opts.mirror_direction,
                               k % opts.merged_nics) for k in range(opts.mirrors))
    ports = () if opts.merged_nics == 1 else tuple(
        tuple(port_address(a, k) for k in range(opts.merged_nics)) for a in addrs)
    return Plan(
        parameters=Parameter.each_of(named),
        buckets_first=tuple(BucketLayout(params=tuple(names[i] for i in b)) for b in first),
        buckets_rebuilt=tuple(BucketLayout(params=tuple(names[i] for i in b)) for b in rebuilt),
        ring=ring, optimizer=optimizer, addresses=addrs, mirrors=mirrors,
        iterations=opts.iterations, nodes=nodes, channel_nics=nics, ports=ports, comm_hook=opts.comm_hook,
        collectives=_plan_collectives(opts, model), buffers=_module_buffers(opts, model),
        allreduces_per_step=opts.allreduces_per_step,
        frozen=Parameter.each_of(frozen), find_unused_parameters=find_unused, static_graph=opts.static_graph)


def unused_on(iteration: int, rank: int, static_graph: bool = False) -> bool:
    """--unused: whether the forward leaves the parameters named by the prefixes unused on
    `rank` at `iteration`: on every rank (globally unused) at iterations divisible by 3,
    on rank 0 only at the next ones; with static_graph always (the graph is static)."""
    return static_graph or iteration % 3 == 0 or (iteration % 3 == 1 and rank == 0)


def _unused_names(model, prefixes) -> set[str]:
    """The trainable parameters --unused PREFIX names; a PREFIX matching none is refused."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out = set()
    for prefix in prefixes:
        hit = [n for n in names if prefix and n.startswith(prefix)]
        if not hit:
            raise SynthOptionError(f"--unused {prefix!r} matches no trainable parameter of the model")
        out.update(hit)
    return out


def freeze_parameters(model, prefixes) -> list[str]:
    """--freeze: requires_grad_(False) on every parameter whose name starts with one of
    `prefixes` (a plain string prefix: "blocks.0." freezes the first block, "tok" the token
    embedding), before DDP would wrap the model. Returns their names. A prefix that
    matches nothing (a typo would train the whole model) and a freeze of every parameter
    (DDP refuses a model with none that requires grad) are refused."""
    names = [n for n, _ in model.named_parameters()]
    for prefix in prefixes:
        if not isinstance(prefix, str) or not prefix:
            raise SynthOptionError(f"--freeze {prefix!r}: give a parameter name prefix, e.g. blocks.0.")
        if not any(n.startswith(prefix) for n in names):
            tops = dict.fromkeys(_top_module(n) for n in names)
            raise SynthOptionError(f"--freeze {prefix!r} matches no parameter of the model (its parameters' "
                                   f"names start with {', '.join(tops)})")
    frozen = [n for n in names if any(n.startswith(x) for x in prefixes)]
    if len(frozen) == len(names):
        raise SynthOptionError(f"--freeze {' '.join(prefixes)} freezes every parameter of the model: nothing "
                               "would train (DDP refuses a model with no parameter that requires grad)")
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    return frozen


def _top_module(name: str) -> str:
    """The model's top module of a parameter, with a ModuleList's index: blocks.0.ln1.weight
    -> blocks.0, tok.weight -> tok (what --freeze's refusal lists)."""
    parts = name.split(".")
    return ".".join(parts[:2] if len(parts) > 2 and parts[1].isdigit() else parts[:1])


def _module_buffers(opts: SynthOptions, model) -> ModuleBuffers:
    """The model's buffers as write_plan records them for DDP with broadcast_buffers on
    NCCL: captured, in torch's broadcast_coalesced groups."""
    named = list(model.named_buffers())
    if not named:
        return ModuleBuffers()
    from ckptd.torch import DDP_BROADCAST_BUCKET_BYTES
    groups, _ = torch.distributed._compute_bucket_assignment_by_size([b for _, b in named],
                                                                      [DDP_BROADCAST_BUCKET_BYTES])
    return ModuleBuffers(Parameter.each_of(named),
                         tuple(tuple(named[i][0] for i in g) for g in groups), True)


def _plan_collectives(opts: SynthOptions, model) -> dict:
    out = {k: tuple(_collective(e) for e in v) for k, v in opts.collectives.items() if v}
    from ckptd.torch import coalesced_broadcasts
    if opts.startup_broadcast:
        from ckptd.torch import verify_collectives
        params = [p.detach() for p in model.parameters()]
        tensors = params + [b.detach() for b in model.buffers()]
        # the shape check is over the reducer's parameters (trainable), the broadcast over
        # every parameter and buffer (_sync_module_states), as ckptd.torch records them
        reducer = [p.detach() for p in model.parameters() if p.requires_grad]
        out["start"] = verify_collectives(reducer) + coalesced_broadcasts(tensors) + out.get("start", ())
    bufs = [b.detach() for b in model.buffers()]
    if bufs:  # DDP's buffer broadcast at the start of every forward (broadcast_buffers)
        out["before"] = coalesced_broadcasts(bufs) + out.get("before", ())
    return {k: out[k] for k in ("start", "before", "after") if k in out}


def _buffer_values(plan: Plan, buffers: dict, iteration: int, others: list) -> None:
    """Put rank 0's buffers (what DDP broadcasts at this forward) into the schedule's
    buffer broadcasts: each group flattened in order, as broadcast_coalesced does."""
    for k, g in plan.buffer_others(iteration).items():
        flat = torch.cat([buffers[n].reshape(-1) for n in plan.buffers.broadcasts[g]]).numpy().copy()
        for per_rank in others:
            per_rank[k] = flat


def _collective(e) -> tuple:
    """A SynthOptions.collectives entry, [count, dtype] (an allreduce), [count, dtype,
    "broadcast", root] or [count, dtype, "allgather"], as a Plan.collectives entry."""
    if len(e) == 2:
        return int(e[0]), str(e[1])
    if len(e) == 3:
        return int(e[0]), str(e[1]), str(e[2])
    return int(e[0]), str(e[1]), str(e[2]), int(e[3])


def trainer_checkpoint(model, optimizer, lr, scaler=None) -> tuple[dict, dict]:
    """The trainer's own state, keyed by parameter name (the checkpoint format)."""
    names = {p: n for n, p in model.named_parameters()}
    state = {}
    for p, st in optimizer.state.items():
        state[names[p]] = {k: v.detach().clone() for k, v in st.items()}
    opt = {"lr": lr, "state": state}
    if scaler is not None:
        opt["grad_scaler"] = {"scale": scaler._scale.clone(), "growth_tracker": scaler._growth_tracker.clone()}
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out.update((n, b.detach().clone()) for n, b in model.named_buffers())  # rank 0's module buffers
    return out, opt


def _to_wire(flat: torch.Tensor, hook: str, nranks: int) -> np.ndarray:
    """One bucket as DDP's comm hook puts it on the wire: the default hook divides by the
    world size (in the parameters' dtype); the compression hooks cast first, then divide
    in the wire dtype. bfloat16 travels as raw 16-bit words (numpy has no bfloat16)."""
    if hook == "allreduce":
        t = flat.div_(nranks)
    else:
        t = flat.to(torch.float16 if hook == "fp16_compress" else torch.bfloat16).div_(nranks)
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _from_wire(buf: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The hook's decompress (`bucket.buffer().copy_(reduced)`): the reduced bucket cast
    back into the parameters' dtype."""
    t = torch.from_numpy(buf)
    if buf.dtype == np.uint16:
        t = t.view(torch.bfloat16)
    return t.to(dtype)


class Wire:
    """Every QP of the job's network hops, and the frames one iteration puts on the wire.

    Frames travel between NICs, each named by its owner rank (Plan.rank_of): on
    one-GPU hosts that is the sending and receiving rank; ring hops inside a node
    (NVLink/PCIe) put nothing on the wire and get no QPs."""

    def __init__(self, plan: Plan, opts: SynthOptions, rng: random.Random):
        self.plan, self.opts, self.rng = plan, opts, rng
        self.hosts = [Host(a, 0x0200_0000_0000 + r + 1) for r, a in enumerate(plan.addresses)]
        # (NIC, port) -> the port's host; port 0 is the NIC's addr
        self.ports = {(r, k): Host(a, 0x0200_0000_0000 + (k << 16) + r + 1) if k else self.hosts[r]
                      for r in range(plan.nranks) for k, a in enumerate(plan.nic_ports(r))}
        next_qpn = [rng.randrange(0x100, 0x8000) for _ in self.hosts]

        def alloc(nic):
            next_qpn[nic] += 1 + rng.randrange(0, 3)
            return next_qpn[nic]

        def start_psn():
            # NCCL connects every QP with sq_psn = rq_psn = 0 (net_ib.cc, ncclIbRtrQp and
            # ncclIbRtsQp); every flow of the FlowCheck captures starts at PSN 0 too.
            if opts.psn_wrap:
                return PSN_MOD - rng.randrange(1, 400)
            return 0

        self.alloc, self.start_psn = alloc, start_psn
        sched = plan.schedule(0)
        wire = plan.network_connections
        self.link = {conn: plan.link_of(conn) for conn in sched.sends if conn in wire}
        self.data_qp, self.cts_qps, self.step_base, self.steps_done = {}, {}, {}, {}
        # NCCL connects channel by channel, so a receiver's QPNs grow with the channel.
        for (src, dst, c, q) in sorted(sched.flows, key=lambda k: (k[2], k[0], k[3])):
            if (src, dst, c) not in wire:
                continue
            a, b = plan.qp_link((src, dst, c), q)
            self.data_qp[(src, dst, c, q)] = QueuePair(
                self.ports[a], self.ports[b], dest_qp=alloc(b[0]), src_qp=alloc(a[0]),
                psn=start_psn(), sport=rng.randrange(49152, 65536))
        for (src, dst, c) in sched.sends:
            if (src, dst, c) not in wire:
                continue
            # The receiver writes the clear-to-send on its QP RingConfig.cts_qp(send) of
            # the connection, toward the sender's QP of that index: the other direction of
            # that data QP's RC connection, with its own PSNs from 0 (docs/NCCL.md section 4)
            self.cts_qps[(src, dst, c)] = [self.reverse_qp(self.data_qp[(src, dst, c, k)])
                                           for k in range(plan.ring.ndevs)]
            self.step_base[(src, dst, c)] = rng.randrange(0, 5)  # earlier collectives' steps
            self.steps_done[(src, dst, c)] = 0
        # Tree connections (collective tree) have QPs of their own, also where a tree edge
        # joins two ring neighbours
        self.tree_qp: dict[tuple[int, int, int, int], QueuePair] = {}
        self.tree_cts: dict[tuple[int, int, int], list[QueuePair]] = {}
        self.noise_qp = None
        if opts.noise and plan.nranks >= 2:
            # An unrelated RDMA flow between two NICs of the job (say, a p2p transfer).
            n0, n1 = 0, plan.rank_of(next(a for a in plan.addresses if a != plan.addresses[0]))
            self.noise_pair = (n0, n1)
            self.noise_qp = QueuePair(self.hosts[n0], self.hosts[n1], dest_qp=alloc(n1),
                                      src_qp=alloc(n0), psn=start_psn(), sport=rng.randrange(49152, 65536))

    def iteration_frames(self, sched, payloads) -> list[tuple[tuple[int, int], tuple[int, int], bytes]]:
        """(sender port, receiver port, frame) in wire order for one iteration, each port
        (its NIC named by the owner rank, port index; 0 but on merged NICs)."""
        opts = self.opts
        if opts.collective == "tree":
            return self.tree_frames(sched)
        per_conn = []
        for conn, sends in sched.sends.items():
            if conn not in self.link:
                continue  # NVLink/PCIe inside a node: nothing reaches a NIC
            frames = []
            for s, data in zip(sends, payloads[conn]):
                if opts.collective == "reduce_scatter" and s.phase == AG:
                    continue  # FSDP/ZeRO: the reduced shard stays on its owner
                frames += self.send_frames(sched, conn, s, np.ascontiguousarray(data).tobytes(), self.data_qp,
                                           self.cts_qps[conn])
            self.steps_done[conn] += len(sends)
            per_conn.append(frames)
        return self.interleave(per_conn)

    def send_frames(self, sched, conn, s, raw: bytes, data_qp, cts_qps) -> list[tuple[tuple, tuple, bytes]]:
        """One send on the wire: the receiver's clear-to-send (on the QP RingConfig.cts_qp
        names for the connection's send number, reversed), then the send's RDMA writes on
        the QPs the schedule puts them on, each between its ports (Plan.qp_link) and
        acknowledged."""
        cfg, opts, rng = self.plan.ring, self.opts, self.rng
        index = self.steps_done[conn] + s.step  # the connection's send number: one step a send
        if cfg.protocol == "ll":
            flag = (self.step_base[conn] + self.steps_done[conn] + s.step + 1) & 0xFFFFFFFF
            wire = ll_encode(raw, flag)
        elif cfg.protocol == "ll128":  # u64 flags: no 32-bit wrap (prims_ll128.h)
            wire = ll128.encode(raw, self.step_base[conn] + self.steps_done[conn] + s.step + 1, pad=0xA5)
        else:
            wire = raw
        cts = cts_qps[cfg.cts_qp(index)]
        src, dst = self.plan.qp_link(conn, cfg.cts_qp(index))
        frames = [(dst, src, f) for f, _, _ in cts.write(
            rng.randbytes(cfg.cts_bytes), 4096, va=0x7f00_0000_0000 + 64 * (s.step % 8), rkey=0x1234,
            imm=None)]
        frames.append((src, dst, cts.ack(psn=(cts.psn - 1) % PSN_MOD)))
        for q in range(cfg.data_qps):
            msgs = [m for m in sched.flows[conn + (q,)].messages if m.send is s]
            src, dst = self.plan.qp_link(conn, q)
            for m in msgs:
                qp = data_qp[conn + (q,)]
                part = wire[m.wire_offset:m.wire_offset + m.wire_len]
                if m.imm is None or m.wire_len:
                    va, rkey = 0x7e00_0000_0000 + (s.step % 8) * cfg.step_bytes + m.wire_offset, 0x5678
                else:  # the 0-byte WRITE_WITH_IMM after an RDMA WRITE: a zeroed work request
                    va, rkey = 0, 0
                pkts = qp.write(part, cfg.mtu, va=va, rkey=rkey,
                                imm=None if m.imm is None else imm_bytes(m.imm, cfg.imm_big_endian))
                frames += [(src, dst, f) for f, _, _ in pkts]
                if opts.retransmit and rng.random() < opts.retransmit:
                    k = rng.randrange(len(pkts))  # go-back-N from packet k
                    frames += [(src, dst, f) for f, _, _ in pkts[k:]]
                frames.append((dst, src, qp.ack(pkts[-1][1])))
        return frames

    def reverse_qp(self, qp: QueuePair) -> QueuePair:
        """The other direction of a data QP's RC connection (the receiver's clear-to-sends),
        with its own PSNs from the connect."""
        return QueuePair(qp.dst, qp.src, dest_qp=qp.src_qp, src_qp=qp.dest_qp, psn=self.start_psn(), sport=qp.sport)

    def interleave(self, per_conn: list[list]) -> list[tuple[int, int, bytes]]:
        """Channels and links run concurrently: interleave their frames on the wire."""
        rng = self.rng
        out, idx = [], [0] * len(per_conn)
        live = list(range(len(per_conn)))
        while live:
            nxt = []
            for i in live:
                burst = rng.randrange(1, 4)
                out += per_conn[i][idx[i]:idx[i] + burst]
                idx[i] += burst
                if idx[i] < len(per_conn[i]):
                    nxt.append(i)
            live = nxt
            if self.noise_qp is not None and rng.random() < 0.05:
                out += self.noise_frames()
        return out

    def tree_frames(self, sched) -> list[tuple[int, int, bytes]]:
        """What NCCL's tree allreduce of the iteration's buckets puts on the wire
        (ckptd.core.tree: every chunk up and down every tree edge between nodes, each
        connection with its own QPs, clear-to-sends and LL flags), for the refusal tests.
        The values are zeros: nothing may ever be placed from them."""
        plan = self.plan
        tree = TreeSchedule(plan.ring, sched.buckets, plan.node_names,
                            send_base={conn: n for conn, n in self.steps_done.items() if conn in self.tree_cts})
        per_conn = []
        for conn, sends in tree.sends.items():
            if conn not in self.tree_cts:  # connected in channel order, like the ring's
                for q in range(plan.ring.data_qps):
                    a, b = plan.qp_link(conn, q)
                    self.tree_qp[conn + (q,)] = QueuePair(
                        self.ports[a], self.ports[b], dest_qp=self.alloc(b[0]), src_qp=self.alloc(a[0]),
                        psn=self.start_psn(), sport=self.rng.randrange(49152, 65536))
                self.tree_cts[conn] = [self.reverse_qp(self.tree_qp[conn + (k,)]) for k in range(plan.ring.ndevs)]
                self.step_base[conn], self.steps_done[conn] = self.rng.randrange(0, 5), 0
            frames = []
            for s in sends:
                raw = bytes(s.nelem * tree.buckets[s.bucket].dtype.itemsize)
                frames += self.send_frames(tree, conn, s, raw, self.tree_qp, self.tree_cts[conn])
            self.steps_done[conn] += len(sends)
            per_conn.append(frames)
        return self.interleave(per_conn)

    def noise_frames(self) -> list[tuple[int, int, bytes]]:
        rng, h = self.rng, self.hosts
        n0, n1 = self.noise_pair
        kind = rng.randrange(3)
        if kind == 0:  # an unrelated RDMA write between two NICs of the job
            pkts = self.noise_qp.write(rng.randbytes(rng.randrange(1, 3000)), self.plan.ring.mtu,
                                       va=0x1000, rkey=7, imm=b"\x01\x00\x00\x00")
            return [((n0, 0), (n1, 0), f) for f, _, _ in pkts]
        if kind == 1:  # the job's TCP store / bootstrap traffic: UDP stand-in on another port
            return [((n1, 0), (n0, 0), ip_udp_frame(h[n1], h[n0], 40000, 29500, rng.randbytes(64)))]
        other = Host("10.99.0.1" if h[0].ip.version == 4 else "fd00:99::1", 0x0200_0000_00ff)
        bth = BTH(opcode=4, pkey=0xFFFF, dest_qp=0x11, psn=rng.randrange(PSN_MOD))
        return [((0, 0), (-1, 0), roce_frame(h[0], other, 50000, bth, b"", rng.randbytes(100)))]


def impair(frames: list[tuple[int, bytes]], opts: SynthOptions, rng: random.Random,
           stats: dict) -> list[tuple[int, bytes]]:
    """What one mirror link does to its copy of (timestamp, frame): loss, corruption,
    duplication, reordering. Timestamps stay those of arrival, so they never go back."""
    out = []
    for ts, f in frames:
        if opts.loss and rng.random() < opts.loss:
            stats["lost"] += 1
            continue
        if opts.corrupt and rng.random() < opts.corrupt:
            b = bytearray(f)
            b[rng.randrange(42, len(b) - 4)] ^= 1 << rng.randrange(8)
            f = bytes(b)
            stats["corrupted"] += 1
        out.append((ts, f))
        if opts.duplicate and rng.random() < opts.duplicate:
            out.append((ts, f))
            stats["duplicated"] += 1
    if opts.reorder:
        for i in range(len(out) - 1):
            if rng.random() < opts.reorder:
                (t0, f0), (t1, f1) = out[i], out[i + 1]
                out[i], out[i + 1] = (t0, f1), (t1, f0)
                stats["reordered"] += 1
    return out


def _write_round(wire, sched, payloads, hosts, writers, plan, opts, rng, stats, ts) -> int:
    """One round of allreduces on the wire, to the host and mirror captures; returns the
    capture time of the next round."""
    frames = wire.iteration_frames(sched, payloads)
    for i, (s, d, f) in enumerate(frames if hosts else ()):
        hosts[s[0]].write(f, ts + 100 * i)
    for k, mirror in enumerate(plan.mirrors):
        seen = [(ts + 100 * i, f) for i, (s, d, f) in enumerate(frames) if mirror.sees(s[0], d[0], s[1], d[1])]
        for when, f in impair(seen, opts, rng, stats[mirror.name]):
            writers[k].write(f, when)
            stats[mirror.name]["frames"] += 1
    return ts + 100 * len(frames) + ITERATION_GAP_NS  # then the next round's forward and backward


def _nccl_version(text) -> tuple[int, int]:
    try:
        version = parse_nccl_version(text)
    except ValueError as e:
        raise SynthOptionError(f"--nccl-version {e}") from None
    if not NCCL_VERSIONS[0] <= version <= NCCL_VERSIONS[1]:
        (lo_major, lo_minor), (hi_major, hi_minor) = NCCL_VERSIONS
        raise SynthOptionError(f"--nccl-version: NCCL {version[0]}.{version[1]} is not supported (the schedule "
                               f"models {lo_major}.{lo_minor}..{hi_major}.{hi_minor})")
    return version


def _in_range(option: str, value, lo: int, hi: int, note: str = "") -> None:
    if not _is_int(value) or not lo <= value <= hi:
        raise SynthOptionError(f"{option} {value!r} is not in {lo}..{hi}{note}")


def check_options(opts: SynthOptions) -> None:
    """Everything about `opts` that needs no model: refused (SynthOptionError, naming the
    `ckptd synth` option) before anything is allocated or written."""
    if opts.collective not in ("allreduce", "reduce_scatter", "tree"):
        raise SynthOptionError(f"--collective {opts.collective!r}: allreduce, reduce_scatter or tree")
    if opts.param_dtype not in ("float32", "bfloat16"):
        raise SynthOptionError(f"--param-dtype {opts.param_dtype!r}: float32 or bfloat16")
    if opts.model not in MODEL_SIZES:
        raise SynthOptionError(f"--model {opts.model!r} is not a synthetic model size ({', '.join(MODEL_SIZES)})")
    if opts.param_dtype == "bfloat16" and opts.model.endswith("-bn"):
        raise SynthOptionError(f"--param-dtype bfloat16 with --model {opts.model}: the BatchNorm's running "
                               "statistics would be bfloat16 module buffers, which synth does not broadcast; "
                               "use --param-dtype float32 or a model without -bn")
    _in_range("--seed", opts.seed, 0, SYNTH_MAX_SEED)
    _nccl_version(opts.nccl_version)
    lo, hi = SYNTH_RANKS
    if opts.nodes or opts.gpus_per_node != 1:
        if not _is_int(opts.nodes) or opts.nodes < 0:
            raise SynthOptionError(f"--nodes {opts.nodes!r} is not a number of nodes (0: one GPU per host)")
        if not _is_int(opts.gpus_per_node) or opts.gpus_per_node < 1:
            raise SynthOptionError(f"--gpus-per-node {opts.gpus_per_node!r} must be at least 1")
    if not opts.nodes and (opts.gpus_per_node != 1 or opts.nics_per_node):
        # without nodes every rank is a host of its own: the option changed nothing
        raise SynthOptionError(f"--{'gpus' if opts.gpus_per_node != 1 else 'nics'}-per-node needs --nodes "
                               "(without it every rank is a host of its own)")
    if opts.nodes:
        n = opts.nodes * opts.gpus_per_node
        if not lo <= n <= hi:
            raise SynthOptionError(f"--nodes {opts.nodes} x --gpus-per-node {opts.gpus_per_node} is {n} ranks; "
                                   + (f"at most {hi}" if n > hi else f"at least {lo}"))
    else:
        _in_range("--ranks", opts.ranks, lo, hi)
    _in_range("--nics-per-node", opts.nics_per_node, *SYNTH_NICS_PER_NODE, " (0: one NIC per GPU)")
    if opts.nodes and opts.nics_per_node > opts.gpus_per_node:
        # NIC k serves GPUs k*g/K ..: past g NICs some serve no GPU, which no plan can name
        # (the plan check refused it naming ranks[0].nics[1], no option)
        raise SynthOptionError(f"--nics-per-node {opts.nics_per_node} is more than --gpus-per-node "
                               f"{opts.gpus_per_node}: every NIC serves at least one GPU of its node")
    _in_range("--channels", opts.channels, *SYNTH_CHANNELS)
    _in_range("--mirrors", opts.mirrors, *SYNTH_MIRRORS)
    _in_range("--iterations", opts.iterations, 1, MAX_ITERATIONS_SYNTH)
    _in_range("--allreduces-per-step", opts.allreduces_per_step, 1, 64)
    if opts.static_graph and opts.allreduces_per_step != 1:
        raise SynthOptionError("--static-graph with --allreduces-per-step > 1: not supported (ckptd decodes "
                               "DDP's static_graph with one allreduce per step)")
    _in_range("--bucket-cap-kb", opts.bucket_cap_kb, 1, 1 << 20)
    if opts.opt_kind not in OPTIMIZER_CLASSES:
        raise SynthOptionError(f"--optim {opts.opt_kind!r}: one of {', '.join(OPTIMIZER_CLASSES)}")
    if "params" in opts.opt_hyper:
        raise SynthOptionError("--optim: params is not a hyperparameter")
    # torch keeps any key in a param group: a misspelt one (momentun=0.9) trained without it
    import inspect
    cls = getattr(torch.optim, OPTIMIZER_CLASSES[opts.opt_kind])
    takes = [k for k in inspect.signature(cls.__init__).parameters if k not in ("self", "params")]
    unknown = [k for k in opts.opt_hyper if k not in takes]
    if unknown:
        raise SynthOptionError(f"--optim {opts.opt_kind}: {cls.__name__} takes no {unknown[0]!r} "
                               f"(it takes {', '.join(takes)})")
    _check_collectives(opts)
    if opts.mirrors > mirror_ports(opts) and not opts.wrap_mirrors:
        where = (f"--nodes {opts.nodes} x {opts.nics_per_node or opts.gpus_per_node} NIC(s) a node" if opts.nodes
                 else f"--ranks {opts.ranks}")
        merged = f" x --merged-nics {opts.merged_nics}" if opts.merged_nics > 1 else ""
        raise SynthOptionError(f"--mirrors {opts.mirrors}: the job has {mirror_ports(opts)} switch port(s) to "
                               f"mirror ({where}{merged}); give at most {mirror_ports(opts)}")


def _check_collectives(opts: SynthOptions) -> None:
    """--other-allreduce / --other-broadcast (SynthOptions.collectives): every count at most
    SYNTH_MAX_OTHER_ELEMENTS, and all of them together too; a broadcast's root a rank."""
    if not isinstance(opts.collectives, dict):
        raise SynthOptionError("--other-allreduce/--other-broadcast: collectives must be a dict")
    total = 0
    for when, entries in opts.collectives.items():
        for e in entries or ():
            option = "--other-broadcast" if len(e) > 2 and e[2] == "broadcast" else "--other-allreduce"
            spec = ":".join(str(x) for x in [when, *e] if x != "broadcast")
            if when not in COLLECTIVE_WHEN or not 2 <= len(e) <= 4 or str(e[1]) not in DTYPES:
                raise SynthOptionError(f"{option} {spec}: not WHEN:COUNT:DTYPE with WHEN one of "
                                       f"{', '.join(COLLECTIVE_WHEN)}")
            count = e[0]
            if not _is_int(count) or not 1 <= count <= SYNTH_MAX_OTHER_ELEMENTS:
                raise SynthOptionError(f"{option} {spec}: COUNT {count} is not in 1..{SYNTH_MAX_OTHER_ELEMENTS} "
                                       "(synth materializes every rank's values of it each iteration)")
            total += count
            if total > SYNTH_MAX_OTHER_ELEMENTS:
                raise SynthOptionError(f"--other-allreduce/--other-broadcast: {total} or more elements in all; "
                                       f"at most {SYNTH_MAX_OTHER_ELEMENTS} together")
            if len(e) == 4 and (not _is_int(e[3]) or not 0 <= e[3] < opts.ranks):
                raise SynthOptionError(f"{option} {spec}: ROOT {e[3]!r} is not a rank (0..{opts.ranks - 1})")


def _check_training(opts: SynthOptions, plan: Plan, model) -> None:
    """The trainer's optimizer and lr scheduler, built and stepped for every iteration on
    stand-in parameters (one element each): what torch refuses only when constructing or
    stepping them is refused here, before --out is touched."""
    dtype = getattr(torch, opts.param_dtype)
    dummy = [(n, torch.zeros(1, dtype=dtype, requires_grad=p.requires_grad)) for n, p in model.named_parameters()]
    which = (f"--optim {opts.opt_kind}" if opts.opt_kind != "adamw" or opts.opt_hyper
             else f"--optimizer {opts.optimizer}")
    try:
        optimizer = torch_optimizer(plan.optimizer, dummy)
        for _, p in dummy:
            if p.requires_grad:  # a frozen one's grad stays None: the step skips it
                p.grad = torch.zeros_like(p)
        optimizer.step()
    except (CkptdError, ValueError, TypeError, RuntimeError, KeyError) as e:
        raise SynthOptionError(f"{which}: {e}") from None
    sch = plan.optimizer.lr_scheduler
    if sch is None:
        return
    name = sch.get("class")
    if name in UNREPLAYABLE:  # the shadow's own list of what it cannot replay
        raise SynthOptionError(f"--lr-scheduler {name}: {UNREPLAYABLE[name]}, which the shadow cannot replay")
    try:
        scheduler_class(name)
    except CkptdError:
        raise SynthOptionError(f"--lr-scheduler {name!r} is not a torch.optim.lr_scheduler class") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scheduler = torch_scheduler(plan.optimizer, optimizer)
            for _ in range(opts.iterations):  # as the training loop steps it, after every step
                scheduler.step()
            lrs = [g["lr"] for g in optimizer.param_groups]
    except (CkptdError, ValueError, TypeError, RuntimeError, KeyError, ZeroDivisionError, ArithmeticError,
            AttributeError, IndexError) as e:
        raise SynthOptionError(f"--lr-scheduler {name}: {type(e).__name__}: {e}") from None
    if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in lrs):
        raise SynthOptionError(f"--lr-scheduler {name}: the lr becomes {lrs[0]!r} within {opts.iterations} "
                               "iterations (not a finite lr >= 0)")


class _Created:
    """The paths this run creates under --out, removed again if it fails: never a file
    or directory that was there before it started."""

    def __init__(self):
        self.paths: list[Path] = []

    def mkdir(self, d: Path) -> Path:
        missing = []
        p = d
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        d.mkdir(parents=True, exist_ok=True)
        self.paths += reversed(missing)  # the outermost first: removing it removes the rest
        return d

    def file(self, f: Path) -> Path:
        if not f.exists() and not f.is_symlink():
            self.paths.append(f)
        return f

    def remove(self) -> None:
        for p in reversed(self.paths):
            try:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            except OSError:
                pass  # gone already, or best effort: the error being raised is the one to report


def synthesize(opts: SynthOptions, progress=None) -> Plan:
    check_options(opts)
    out = Path(opts.out)
    rng = random.Random(opts.seed)
    torch.manual_seed(opts.seed)
    model = build_model(opts.model, opts.seed).to(getattr(torch, opts.param_dtype))
    if opts.freeze:
        freeze_parameters(model, (opts.freeze,) if isinstance(opts.freeze, str) else tuple(opts.freeze))
    if opts.unused:
        if opts.allreduces_per_step != 1 and not opts.static_graph:
            raise SynthOptionError("--unused with --allreduces-per-step > 1: not supported (find_unused_parameters)")
        opts.unused_names = _unused_names(model, (opts.unused,) if isinstance(opts.unused, str) else opts.unused)
    plan = make_plan(opts, model, rng)
    _check_training(opts, plan, model)
    buffers = dict(model.named_buffers())  # the model's own (rank 0's after each forward)
    optimizer = torch_optimizer(plan.optimizer, model.named_parameters())
    scheduler = torch_scheduler(plan.optimizer, optimizer)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    gs = plan.optimizer.grad_scaler
    scaler = None if gs is None else torch.amp.GradScaler("cpu", **gs)
    wire = Wire(plan, opts, rng)
    created = _Created()
    try:
        return _write(opts, plan, model, buffers, optimizer, scheduler, base_lrs, scaler, wire, rng,
                      out, created, progress)
    except BaseException:
        created.remove()
        raise


def _write(opts, plan, model, buffers, optimizer, scheduler, base_lrs, scaler, wire, rng, out: Path,
           created: _Created, progress) -> Plan:
    """Train and write everything under --out (every path it creates told to `created`)."""
    try:
        created.mkdir(out / "mirrors")
        created.mkdir(out / "reference")
    except OSError as e:  # named as the option it came from, not as a bare errno line
        raise SynthOptionError(f"--out {out}: cannot make the directory: {e.strerror or e}") from None
    plan.save(created.file(out / "plan.json"))
    save_checkpoint(created.file(out / "init.pt"), -1,
                    {**{n: p.detach().clone() for n, p in model.named_parameters()},
                     **{n: b.detach().clone() for n, b in model.named_buffers()}}, None)
    files, writers, hosts = [], [], []
    stats = {m.name: {"frames": 0, "lost": 0, "corrupted": 0, "duplicated": 0, "reordered": 0}
             for m in plan.mirrors}
    ts = 1_700_000_000 * 10**9
    params = dict(model.named_parameters())
    kept_map = None  # static_graph: iteration 0's reduced used map, which DDP keeps for good
    try:
        for m in plan.mirrors:
            files.append(ChunkedFile(created.file(out / "mirrors" / f"{m.name}.pcap")))
            writers.append(PcapWriter(files[-1]))
        if opts.write_hosts:
            created.mkdir(out / "hosts")
            for r in range(plan.nranks):
                files.append(ChunkedFile(created.file(out / "hosts" / f"rank{r}.pcap")))
                hosts.append(PcapWriter(files[-1]))
        K = plan.allreduces_per_step
        for t in range(opts.iterations):
            for j in range(K):  # micro-batch j of step t: wire round w
                w = t * K + j
                sched = plan.schedule(w)
                layout = plan.wire_layout(w)
                reduced = {n: p.grad for n, p in params.items()} if j else {}
                local = []
                # DDP's forward w starts with rank 0's buffers (the broadcast); each rank's
                # forward then updates its own; rank 0's are what the next forward broadcasts
                synced = {n: b.detach().clone() for n, b in buffers.items()}
                after0 = synced
                for r in range(plan.nranks):
                    for n, b in buffers.items():
                        b.copy_(synced[n])
                    model.zero_grad(set_to_none=True)
                    for n, g in reduced.items():  # param.grad: the previous round's reduced value
                        params[n].grad = None if g is None else g.clone()
                    loss = model.loss(shard_batches(model, r, w, opts.seed))
                    if r == 0:
                        after0 = {n: b.detach().clone() for n, b in buffers.items()}
                    (scaler.scale(loss) if scaler else loss).backward()
                    if opts.unused and unused_on(t, r, plan.static_graph):
                        for n in opts.unused_names:  # autograd never reached them on this rank
                            params[n].grad = None
                    if r == 0 and t in opts.inf_at and j == K - 1:  # an overflow in one element
                        first = next(p for p in params.values() if p.requires_grad)  # a frozen one has no grad
                        first.grad.view(-1)[0] = float("inf")
                    # a parameter this rank did not use: zeros in its bucket (mark_variable_ready)
                    local.append([_to_wire(torch.cat([(params[n].grad if params[n].grad is not None else
                                                       torch.zeros_like(params[n])).reshape(-1) for n in b.params]),
                                           plan.comm_hook, plan.nranks) for b in layout])
                    if plan.has_map(w):  # DDP's local_used_map (static_graph: allreduced first on the wire)
                        local[-1].append(np.array([params[p.name].grad is not None for p in plan.parameters],
                                                  dtype="<i4"))
                # each rank's values for the other allreduces (a loss, a metric): not gradients
                others = [[np.random.default_rng((opts.seed, w, r, k)).standard_normal(b.count).astype(b.dtype)
                           for k, b in enumerate(sched.others)] for r in range(plan.nranks)]
                _buffer_values(plan, synced, w, others)
                for n, b in buffers.items():
                    b.copy_(after0[n])
                final, payloads = reduce_iteration(sched, local, others)
                for b, buf in enumerate(final[:len(layout)]):  # finalize_bucket_dense: param.grad = the reduced bucket
                    flat = _from_wire(buf, getattr(torch, opts.param_dtype))
                    off = 0
                    for name in layout[b].params:
                        n = params[name].numel()
                        params[name].grad = flat[off:off + n].view(params[name].shape).clone()
                        off += n
                if plan.static_graph and w == 0:
                    kept_map = final[len(layout)].copy()
                if plan.find_unused_parameters or plan.static_graph:  # used on no rank: grad left None
                    for p, count in zip(plan.parameters, final[len(layout)] if plan.has_map(w) else kept_map):
                        if not count:
                            params[p.name].grad = None
                if j < K - 1:
                    ts = _write_round(wire, sched, payloads, hosts, writers, plan, opts, rng, stats, ts)
            if plan.optimizer.lr_per_step:  # the loop writes each step's lr by hand
                x = plan.optimizer.lr_per_step[t]
                for g, lr_g in zip(optimizer.param_groups, x if isinstance(x, list) else [x] * len(base_lrs)):
                    g["lr"] = lr_g
            elif scheduler is None:
                for g, base in zip(optimizer.param_groups, base_lrs):
                    g["lr"] = base * lr_factor(plan.optimizer.lr_schedule, t)  # LambdaLR's rule
            lr = optimizer.param_groups[0]["lr"]
            if scaler:
                scaler.unscale_(optimizer)
            if opts.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), opts.max_grad_norm, norm_type=opts.grad_norm_type)
            elif opts.clip_grad_value is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), opts.clip_grad_value)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
            m_state, o_state = trainer_checkpoint(model, optimizer, lr, scaler)
            save_checkpoint(created.file(out / "reference" / checkpoint_name(t)), t, m_state, o_state)

            ts = _write_round(wire, sched, payloads, hosts, writers, plan, opts, rng, stats, ts)
            if progress:
                progress(t, opts.iterations)
    finally:
        for f in files:
            f.close()
    opts.stats = stats
    created.file(out / "synth.json").write_text(json.dumps(asdict(opts), indent=1) + "\n")
    return plan
