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
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from parsers.pcap import PcapWriter

from ckptd.core.checkpoint import checkpoint_name, save_checkpoint
from ckptd.core.optim import lr_factor, torch_optimizer, torch_scheduler
from ckptd.core.plan import BucketLayout, Mirror, Optimizer, Parameter, Plan
from ckptd.core.psn import PSN_MOD
from ckptd.core.schedule import RingConfig
from ckptd.testing.synth.ddp import first_buckets, grad_ready_order, rebuilt_buckets
from ckptd.testing.synth.model import build_model, shard_batches
from ckptd.testing.synth.ring import reduce_iteration
from ckptd.testing.synth.wire import Host, QueuePair, imm_bytes, ip_udp_frame, ll_encode, roce_frame
from parsers.bth import BTH


@dataclass
class SynthOptions:
    out: str
    ranks: int = 4
    channels: int = 2
    protocol: str = "simple"
    mtu: int = 4096
    mirrors: int = 2
    iterations: int = 5
    seed: int = 0
    model: str = "small"
    nccl_version: str = "2.19"
    qps: int = 1
    bucket_cap_kb: int = 64
    optimizer: str = "foreach"  # for-loop | foreach | fused
    lr_schedule: str = "cosine"
    max_grad_norm: float | None = None
    # the trainer's torch.optim class (a plan optimizer kind) and its hyperparameters,
    # for jobs beyond the default AdamW: with any of these the plan has param groups
    opt_kind: str = "adamw"
    opt_hyper: dict = field(default_factory=dict)
    no_decay_group: bool = False  # biases and norms in a second group without weight decay
    lr_scheduler: dict | None = None  # {"class": "StepLR", "args": {...}}: the real torch class
    amp_init_scale: float | None = None  # a GradScaler: the wire carries scaled gradients
    amp_growth_interval: int = 2000
    comm_hook: str = "allreduce"  # fp16_compress | bf16_compress: the wire dtype
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
    stats: dict = field(default_factory=dict)


def _ring_orders(opts: SynthOptions, rng: random.Random):
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


def make_plan(opts: SynthOptions, model, rng: random.Random) -> Plan:
    named = list(model.named_parameters())
    params = [p for _, p in named]
    names = [n for n, _ in named]
    cap = opts.bucket_cap_kb * 1024
    first = first_buckets(params, cap, first_bytes=cap // 4)
    order = grad_ready_order(model, shard_batches(model, 0, 0, opts.seed))
    rebuilt = rebuilt_buckets(params, order, cap, first_bytes=cap // 4)
    major, minor = (int(x) for x in opts.nccl_version.split("."))
    ring = RingConfig(nranks=opts.ranks, rings=_ring_orders(opts, rng), protocol=opts.protocol,
                      nccl_version=(major, minor), qps_per_connection=opts.qps, mtu=opts.mtu)
    sched = {"constant": {"kind": "constant"},
             "cosine": {"kind": "cosine", "warmup_steps": 2, "total_steps": max(4, opts.iterations)},
             "linear": {"kind": "linear", "warmup_steps": 1, "total_steps": max(4, opts.iterations + 1)}}
    optimizer = Optimizer(kind="adamw", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                          implementation=opts.optimizer, lr_schedule=sched[opts.lr_schedule],
                          max_grad_norm=opts.max_grad_norm)
    if opts.opt_kind != "adamw" or opts.opt_hyper or opts.no_decay_group or opts.lr_scheduler \
            or opts.amp_init_scale:
        hyper = {"lr": 3e-3, "weight_decay": 0.1, "foreach": opts.optimizer == "foreach",
                 **({"fused": True} if opts.optimizer == "fused" else {}), **opts.opt_hyper}
        no_decay = [n for n in names if opts.no_decay_group and (n.endswith("bias") or "ln" in n or "norm" in n)]
        groups = [{"params": [n for n in names if n not in no_decay], **hyper}]
        if no_decay:
            groups.append({"params": no_decay, **hyper, "weight_decay": 0.0})
        scaler = None if opts.amp_init_scale is None else {
            "init_scale": opts.amp_init_scale, "growth_interval": opts.amp_growth_interval}
        optimizer = Optimizer(kind=opts.opt_kind, lr=hyper["lr"], groups=tuple(groups),
                              lr_schedule=sched[opts.lr_schedule] if not opts.lr_scheduler else {"kind": "constant"},
                              lr_scheduler=opts.lr_scheduler, grad_scaler=scaler,
                              max_grad_norm=opts.max_grad_norm)
    if opts.ipv6:
        addrs = tuple(f"fd00:77::{r + 1:x}" for r in range(opts.ranks))
    else:
        addrs = tuple(f"10.77.0.{r + 1}" for r in range(opts.ranks))
    mirrors = tuple(Mirror(f"mirror{k}", k % opts.ranks, opts.mirror_direction)
                    for k in range(opts.mirrors))
    return Plan(
        parameters=tuple(Parameter(n, tuple(p.shape), "float32") for n, p in named),
        buckets_first=tuple(BucketLayout(params=tuple(names[i] for i in b)) for b in first),
        buckets_rebuilt=tuple(BucketLayout(params=tuple(names[i] for i in b)) for b in rebuilt),
        ring=ring, optimizer=optimizer, addresses=addrs, mirrors=mirrors,
        iterations=opts.iterations, comm_hook=opts.comm_hook)


def trainer_checkpoint(model, optimizer, lr, scaler=None) -> tuple[dict, dict]:
    """The trainer's own state, keyed by parameter name (the checkpoint format)."""
    names = {p: n for n, p in model.named_parameters()}
    state = {}
    for p, st in optimizer.state.items():
        state[names[p]] = {k: v.detach().clone() for k, v in st.items()}
    opt = {"lr": lr, "state": state}
    if scaler is not None:
        opt["grad_scaler"] = {"scale": scaler._scale.clone(), "growth_tracker": scaler._growth_tracker.clone()}
    return ({n: p.detach().clone() for n, p in model.named_parameters()}, opt)


def _to_wire(flat: torch.Tensor, hook: str, nranks: int) -> np.ndarray:
    """One bucket as DDP's comm hook puts it on the wire: the default hook divides by the
    world size; the compression hooks cast first, then divide in the wire dtype."""
    if hook == "allreduce":
        return flat.div_(nranks).numpy()
    t = flat.to(torch.float16 if hook == "fp16_compress" else torch.bfloat16).div_(nranks)
    return t.numpy() if t.dtype == torch.float16 else t.view(torch.int16).numpy().view(np.uint16)


def _from_wire(buf: np.ndarray, hook: str) -> torch.Tensor:
    """The hook's decompress: the reduced bucket cast back into the float32 grads."""
    t = torch.from_numpy(buf)
    if hook == "bf16_compress":
        t = t.view(torch.bfloat16)
    return t.to(torch.float32)


class Wire:
    """Every QP of the job, and the frames one iteration puts on the wire."""

    def __init__(self, plan: Plan, opts: SynthOptions, rng: random.Random):
        self.plan, self.opts, self.rng = plan, opts, rng
        self.hosts = [Host(a, 0x0200_0000_0000 + r + 1) for r, a in enumerate(plan.addresses)]
        next_qpn = [rng.randrange(0x100, 0x8000) for _ in self.hosts]

        def alloc(rank):
            next_qpn[rank] += 1 + rng.randrange(0, 3)
            return next_qpn[rank]

        def start_psn():
            # NCCL connects every QP with sq_psn = rq_psn = 0 (net_ib.cc, ncclIbRtrQp and
            # ncclIbRtsQp); every flow of the FlowCheck captures starts at PSN 0 too.
            if opts.psn_wrap:
                return PSN_MOD - rng.randrange(1, 400)
            return 0

        sched = plan.schedule(0)
        self.data_qp, self.cts_qp, self.step_base, self.steps_done = {}, {}, {}, {}
        # NCCL connects channel by channel, so a receiver's QPNs grow with the channel.
        for (src, dst, c, q) in sorted(sched.flows, key=lambda k: (k[2], k[0], k[3])):
            self.data_qp[(src, dst, c, q)] = QueuePair(
                self.hosts[src], self.hosts[dst], dest_qp=alloc(dst), src_qp=alloc(src),
                psn=start_psn(), sport=rng.randrange(49152, 65536))
        for (src, dst, c) in sched.sends:
            self.cts_qp[(src, dst, c)] = QueuePair(
                self.hosts[dst], self.hosts[src], dest_qp=alloc(src), src_qp=alloc(dst),
                psn=start_psn(), sport=rng.randrange(49152, 65536))
            self.step_base[(src, dst, c)] = rng.randrange(0, 5)  # earlier collectives' steps
            self.steps_done[(src, dst, c)] = 0
        self.noise_qp = None
        if opts.noise and plan.nranks >= 2:
            # An unrelated RDMA flow between two ranks of the job (say, a p2p transfer).
            self.noise_qp = QueuePair(self.hosts[0], self.hosts[1], dest_qp=alloc(1),
                                      src_qp=alloc(0), psn=start_psn(), sport=rng.randrange(49152, 65536))

    def iteration_frames(self, sched, payloads) -> list[tuple[int, int, bytes]]:
        """(src rank, dst rank, frame) in wire order for one iteration."""
        cfg, opts, rng = self.plan.ring, self.opts, self.rng
        per_conn = []
        for conn, sends in sched.sends.items():
            src, dst, c = conn
            frames = []
            for s, data in zip(sends, payloads[conn]):
                raw = np.ascontiguousarray(data).tobytes()
                if cfg.protocol == "ll":
                    flag = (self.step_base[conn] + self.steps_done[conn] + s.step + 1) & 0xFFFFFFFF
                    wire = ll_encode(raw, flag)
                else:
                    wire = raw
                cts = self.cts_qp[conn]
                frames += [(dst, src, f) for f, _, _ in cts.write(
                    rng.randbytes(32), 4096, va=0x7f00_0000_0000 + 64 * (s.step % 8), rkey=0x1234, imm=None)]
                frames.append((src, dst, cts.ack(psn=(cts.psn - 1) % PSN_MOD)))
                for q in range(cfg.qps_per_connection):
                    msgs = [m for m in sched.flows[conn + (q,)].messages if m.send is s]
                    for m in msgs:
                        qp = self.data_qp[conn + (q,)]
                        part = wire[m.wire_offset:m.wire_offset + m.wire_len]
                        pkts = qp.write(part, cfg.mtu, va=0x7e00_0000_0000 + (s.step % 8) * cfg.step_bytes
                                        + m.wire_offset, rkey=0x5678,
                                        imm=imm_bytes(m.imm, cfg.imm_big_endian))
                        frames += [(src, dst, f) for f, _, _ in pkts]
                        if opts.retransmit and rng.random() < opts.retransmit:
                            k = rng.randrange(len(pkts))  # go-back-N from packet k
                            frames += [(src, dst, f) for f, _, _ in pkts[k:]]
                        frames.append((dst, src, qp.ack(pkts[-1][1])))
            self.steps_done[conn] += len(sends)
            per_conn.append(frames)
        # Channels and links run concurrently: interleave their frames on the wire.
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

    def noise_frames(self) -> list[tuple[int, int, bytes]]:
        rng, h = self.rng, self.hosts
        kind = rng.randrange(3)
        if kind == 0:  # an unrelated RDMA write between ranks 0 and 1
            pkts = self.noise_qp.write(rng.randbytes(rng.randrange(1, 3000)), self.plan.ring.mtu,
                                       va=0x1000, rkey=7, imm=b"\x01\x00\x00\x00")
            return [(0, 1, f) for f, _, _ in pkts]
        if kind == 1:  # the job's TCP store / bootstrap traffic: UDP stand-in on another port
            return [(1, 0, ip_udp_frame(h[1], h[0], 40000, 29500, rng.randbytes(64)))]
        other = Host("10.99.0.1" if h[0].ip.version == 4 else "fd00:99::1", 0x0200_0000_00ff)
        bth = BTH(opcode=4, pkey=0xFFFF, dest_qp=0x11, psn=rng.randrange(PSN_MOD))
        return [(0, -1, roce_frame(h[0], other, 50000, bth, b"", rng.randbytes(100)))]


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


def synthesize(opts: SynthOptions, progress=None) -> Plan:
    out = Path(opts.out)
    (out / "mirrors").mkdir(parents=True, exist_ok=True)
    (out / "reference").mkdir(exist_ok=True)
    rng = random.Random(opts.seed)
    torch.manual_seed(opts.seed)
    model = build_model(opts.model, opts.seed)
    plan = make_plan(opts, model, rng)
    plan.save(out / "plan.json")
    save_checkpoint(out / "init.pt", -1, {n: p.detach().clone() for n, p in model.named_parameters()}, None)
    optimizer = torch_optimizer(plan.optimizer, model.named_parameters())
    scheduler = torch_scheduler(plan.optimizer, optimizer)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    gs = plan.optimizer.grad_scaler
    scaler = None if gs is None else torch.amp.GradScaler("cpu", **gs)
    wire = Wire(plan, opts, rng)
    files = [open(out / "mirrors" / f"{m.name}.pcap", "wb") for m in plan.mirrors]
    writers = [PcapWriter(f) for f in files]
    hosts = []
    if opts.write_hosts:
        (out / "hosts").mkdir(exist_ok=True)
        hosts = [PcapWriter(open(out / "hosts" / f"rank{r}.pcap", "wb")) for r in range(plan.nranks)]
        files += [w.f for w in hosts]
    stats = {m.name: {"frames": 0, "lost": 0, "corrupted": 0, "duplicated": 0, "reordered": 0}
             for m in plan.mirrors}
    ts = 1_700_000_000 * 10**9
    params = dict(model.named_parameters())
    try:
        for t in range(opts.iterations):
            sched = plan.schedule(t)
            layout = plan.layout(t)
            local = []
            for r in range(plan.nranks):
                model.zero_grad(set_to_none=True)
                loss = model.loss(shard_batches(model, r, t, opts.seed))
                (scaler.scale(loss) if scaler else loss).backward()
                local.append([_to_wire(torch.cat([params[n].grad.reshape(-1) for n in b.params]),
                                       plan.comm_hook, plan.nranks) for b in layout])
            final, payloads = reduce_iteration(sched, local)
            for b, buf in enumerate(final):
                flat = _from_wire(buf, plan.comm_hook)
                for name, s, e in plan.param_ranges(t, b):
                    params[name].grad = flat[s:e].view(params[name].shape).clone()
            if scheduler is None:
                for g, base in zip(optimizer.param_groups, base_lrs):
                    g["lr"] = base * lr_factor(plan.optimizer.lr_schedule, t)  # LambdaLR's rule
            lr = optimizer.param_groups[0]["lr"]
            if scaler:
                scaler.unscale_(optimizer)
            if plan.optimizer.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), plan.optimizer.max_grad_norm)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
            m_state, o_state = trainer_checkpoint(model, optimizer, lr, scaler)
            save_checkpoint(out / "reference" / checkpoint_name(t), t, m_state, o_state)

            frames = wire.iteration_frames(sched, payloads)
            for i, (s, d, f) in enumerate(frames if hosts else ()):
                hosts[s].write(f, ts + 100 * i)
            for k, mirror in enumerate(plan.mirrors):
                seen = [(ts + 100 * i, f) for i, (s, d, f) in enumerate(frames) if mirror.sees(s, d)]
                for when, f in impair(seen, opts, rng, stats[mirror.name]):
                    writers[k].write(f, when)
                    stats[mirror.name]["frames"] += 1
            ts += 100 * len(frames) + 5_000_000  # then the next iteration's forward and backward
            if progress:
                progress(t, opts.iterations)
    finally:
        for f in files:
            f.close()
    opts.stats = stats
    (out / "synth.json").write_text(json.dumps(asdict(opts), indent=1) + "\n")
    return plan
