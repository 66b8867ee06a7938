#!/usr/bin/env python3
"""Real DDP training over the gloo backend (TCP), for ckptd's TCP/gloo decode.

    python scripts/ddp_gloo_train.py --world 3 --iterations 4 --out run/

starts `--world` processes on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo), trains a small MLP
with DistributedDataParallel (gloo, find_unused_parameters=False, bucket_cap_mb) and
torch.optim.AdamW (foreach), and writes under --out:

    plan.json                    the ckptd plan: parameters, DDP's first and rebuilt
                                 bucket layouts, AdamW, rank addresses
    init.pt                      the initial state (iteration -1)
    rank<R>/iter_NNNNNN.pt       every rank's own state after each iteration
                                 (ckptd.core.checkpoint format, ckptd.testing.synth.trainer_checkpoint)
    ddp.json                     DDP's own bucket sizes (its logging data), to check the plan

The bucket layouts in the plan are computed the way DDP computes them
(ckptd.testing.synth.ddp: iteration 0 one bucket of every parameter, since
find_unused_parameters=False; from iteration 1 the rebuild in gradient-ready order)
and checked against DDP's logging data after the run.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from ckptd.core.checkpoint import checkpoint_name, save_checkpoint  # noqa: E402
from ckptd.core.plan import BucketLayout, Optimizer, Parameter, Plan  # noqa: E402
from ckptd.core.schedule import RingConfig  # noqa: E402
from ckptd.testing.synth import trainer_checkpoint  # noqa: E402

SIZES = {  # name: (in, hidden, wide, classes)
    "tiny": (32, 128, 256, 10),      # ~70 K parameters, 2 buckets
    "small": (64, 768, 1536, 10),    # ~1.8 M parameters: 7.3 MB first bucket, 9 gloo segments
}


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, wide: int, classes: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.fc3 = nn.Linear(hidden, wide)
        self.head = nn.Linear(wide, classes)

    def forward(self, x):
        x = F.gelu(self.fc1(x))
        x = self.ln(x + F.gelu(self.fc2(x)))
        return self.head(F.gelu(self.fc3(x)))


def build(size: str, seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP(*SIZES[size])


def batch(model: MLP, rank: int, it: int, seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed * 7919 + it * 131 + rank)
    x = torch.randn(n, model.fc1.in_features, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return x, y


def plan_for(model: MLP, args, ready_order: list[int]) -> Plan:
    from ckptd.testing.synth.ddp import rebuilt_buckets

    named = list(model.named_parameters())
    params = [p for _, p in named]
    cap = int(args.bucket_cap_mb * 1024 * 1024)
    first = [BucketLayout(params=tuple(n for n, _ in named))]  # find_unused_parameters=False
    rebuilt = [BucketLayout(params=tuple(named[i][0] for i in idx))
               for idx in rebuilt_buckets(params, ready_order, cap, first_bytes=cap)]
    opt = Optimizer(kind="adamw", lr=args.lr, weight_decay=0.01, implementation="foreach")
    return Plan(tuple(Parameter(n, tuple(p.shape), "float32") for n, p in named), tuple(first),
                tuple(rebuilt), RingConfig(args.world, (tuple(range(args.world)),)), opt,
                tuple(args.addrs or ["127.0.0.1"] * args.world), (), args.iterations, "gloo")


def ready_order(model: MLP, args) -> list[int]:
    """Parameter indices in the order backward makes their gradients ready (DDP's rebuild)."""
    params = list(model.parameters())
    order: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
             for i, p in enumerate(params)]
    x, y = batch(model, 0, 0, args.seed)
    F.cross_entropy(model(x), y).backward()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return order


def worker(rank: int, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", args.ifname or "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                           rank=rank, world_size=args.world)
    out = Path(args.out)
    model = build(args.size, args.seed)
    if rank == 0:
        save_checkpoint(out / "init.pt", -1, {n: p.detach().clone() for n, p in model.named_parameters()},
                        None)
        plan_for(model, args, ready_order(build(args.size, args.seed), args)).save(out / "plan.json")
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb,
                                              find_unused_parameters=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=True)
    (out / f"rank{rank}").mkdir(parents=True, exist_ok=True)
    sizes = []
    for it in range(args.iterations):
        x, y = batch(model, rank, it, args.seed)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        lr = opt.param_groups[0]["lr"]
        m, o = trainer_checkpoint(model, opt, lr)
        save_checkpoint(out / f"rank{rank}" / checkpoint_name(it), it, m, o)
        sizes.append(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
    if rank == 0:
        (out / "ddp.json").write_text(json.dumps({"bucket_sizes_per_iteration": sizes}) + "\n")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--bucket-cap-mb", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help="TCPStore port (0: pick a free one)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, help="run only this rank (one process per host, e.g. "
                    "in its own network namespace); default: spawn all ranks here")
    ap.add_argument("--master", default="127.0.0.1", help="rank 0's address (the TCPStore)")
    ap.add_argument("--addrs", type=lambda s: s.split(","), help="every rank's address, for the plan")
    ap.add_argument("--ifname", help="GLOO_SOCKET_IFNAME (default lo)")
    args = ap.parse_args(argv)
    if args.rank is not None:
        if not args.port:
            ap.error("--rank needs --port (all ranks must agree on it)")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        worker(args.rank, args)
        return
    args.port = args.port or free_port()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(args,), nprocs=args.world, join=True)
    print(json.dumps({"out": args.out, "port": args.port, "world": args.world,
                      "iterations": args.iterations}))


if __name__ == "__main__":
    main()
