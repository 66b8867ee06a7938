#!/usr/bin/env python3
"""Real DDP training over the gloo backend (TCP), for ckptd's TCP/gloo decode.

    python scripts/ddp_gloo_train.py --world 3 --iterations 4 --out run/ \
        [--optimizer sgd --momentum 0.9 --nesterov] [--no-decay-group] \
        [--scheduler StepLR:step_size=3,gamma=0.5] [--clip 1.0 [--norm-type inf] | --clip-value V] [--amp] \
        [--hook fp16|bf16] [--accumulate 2] [--batchnorm] [--freeze] [--tie]

starts `--world` processes on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo), trains a small MLP
with DistributedDataParallel (gloo, find_unused_parameters=False, bucket_cap_mb) and a
torch.optim optimizer, the way a user's script does: the plan is written by
`ckptd.torch.write_plan` inside the script. Under --out:

    plan.json                    the ckptd plan (ckptd.torch.write_plan; rewritten with
                                 DDP's rebuilt buckets in iteration 1)
    init.pt                      the initial state (iteration -1)
    rank<R>/iter_NNNNNN.pt       every rank's own state after each iteration
                                 (ckptd.torch.initial_state: parameters, optimizer
                                 state, GradScaler scale and growth tracker)
    ddp.json                     DDP's own bucket sizes per iteration (its logging data)

Options: --optimizer (any torch.optim class ckptd shadows) with --lr, --momentum,
--nesterov, --weight-decay; --no-decay-group puts biases and norm weights in a second
group without weight decay; --scheduler CLASS:arg=value,...; --clip MAX_NORM
(clip_grad_norm_, --norm-type P) or --clip-value V (clip_grad_value_); --amp (torch.autocast fp16 on CPU with a GradScaler, --init-scale,
--growth-interval); --hook fp16|bf16 (DDP's compression hooks); --accumulate K (K
micro-batches per step, the first K-1 under ddp.no_sync(), or with
--allreduce-every-micro-batch none: DDP allreduces each); --batchnorm (a BatchNorm1d:
module buffers, which the rank checkpoints hold too); --freeze (fc2 frozen, requires_grad=False,
before DDP: no bucket holds it, the optimizer still does, every checkpoint carries it);
--tie (fc2's weight used a second time as fc2t.weight: one parameter under two names).

A restarted job: --restore SOURCE (a checkpoint, a directory of them, or the daemon's
URL, with --token) puts ckptd's state back with `ckptd.restore` on every rank and trains
from the step after it to --iterations; --pace S sleeps S seconds after each step (a
test can then kill the job mid-run).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from ckptd.core.checkpoint import checkpoint_name, save_checkpoint  # noqa: E402

SIZES = {  # name: (in, hidden, wide, classes)
    "tiny": (32, 128, 256, 10),      # ~70 K parameters, 2 buckets
    "small": (64, 768, 1536, 10),    # ~1.8 M parameters: 7.3 MB first bucket, 9 gloo segments
}


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, wide: int, classes: int, batchnorm: bool = False,
                 tie: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        # BatchNorm: running statistics (float buffers) and num_batches_tracked (int64), which
        # DDP broadcasts from rank 0 at each forward, as two coalesced broadcasts
        self.bn = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
        self.fc2 = nn.Linear(hidden, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.fc3 = nn.Linear(hidden, wide)
        self.head = nn.Linear(wide, classes)
        # a tied weight: fc2's weight used a second time, under a second name in the
        # state_dict (as a language model's head and embedding)
        self.fc2t = None
        if tie:
            self.fc2t = nn.Linear(hidden, hidden, bias=False)
            self.fc2t.weight = self.fc2.weight

    def forward(self, x):
        x = F.gelu(self.bn(self.fc1(x)))
        x = self.ln(x + F.gelu(self.fc2(x)))
        if self.fc2t is not None:
            x = x + F.gelu(self.fc2t(x))
        return self.head(F.gelu(self.fc3(x)))


def build(size: str, seed: int, batchnorm: bool = False, tie: bool = False) -> MLP:
    torch.manual_seed(seed)
    return MLP(*SIZES[size], batchnorm=batchnorm, tie=tie)


def batch(model: MLP, rank: int, it: int, seed: int, n: int = 16):
    g = torch.Generator().manual_seed(seed * 7919 + it * 131 + rank)
    x = torch.randn(n, model.fc1.in_features, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return x, y


def _scheduler_arg(text: str):
    name, _, rest = text.partition(":")
    args = {}
    for k, v in re.findall(r"(\w+)=(\[[^\]]*\]|[^,]+)", rest):  # a list's commas stay in it
        args[k] = json.loads(v) if v[:1] == "[" else (int(v) if v.lstrip("-").isdigit() else float(v))
    return name, args


def make_optimizer(model: MLP, args):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if args.no_decay_group and (n.endswith("bias") or n.startswith("ln.")) else decay).append(p)
    hyper = {"lr": args.lr, "weight_decay": args.weight_decay}
    cls = {c.lower(): getattr(torch.optim, c) for c in dir(torch.optim)}[args.optimizer.lower()]
    if cls is torch.optim.SGD:
        hyper.update(momentum=args.momentum, nesterov=args.nesterov)
    groups = [{"params": decay}] + ([{"params": no_decay, "weight_decay": 0.0}] if no_decay else [])
    return cls(groups, **hyper)


T0 = time.time()  # the process's start: time to the first (resumed) iteration


def worker(rank: int, args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", args.ifname or "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                           rank=rank, world_size=args.world)
    import ckptd.torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out = Path(args.out)
    model = build(args.size, args.seed, args.batchnorm, args.tie).to(getattr(torch, args.dtype))
    if args.freeze:  # before DDP: its reducer takes the parameters that require grad then
        model.fc2.requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb,
                                              find_unused_parameters=False)
    if args.hook:
        ddp.register_comm_hook(None, {"fp16": default_hooks.fp16_compress_hook,
                                      "bf16": default_hooks.bf16_compress_hook}[args.hook])
    opt = make_optimizer(model, args)
    sched = None
    if args.scheduler:
        name, sargs = _scheduler_arg(args.scheduler)
        sched = getattr(torch.optim.lr_scheduler, name)(opt, **sargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=args.init_scale,
                                  growth_interval=args.growth_interval) if args.amp else None
    start = 0
    if args.restore:
        import ckptd
        r = ckptd.restore(model, opt, args.restore, scheduler=sched, token=args.token)
        start = r.step
        print(json.dumps({"rank": rank, "restored_iteration": r.iteration, "source": r.source,
                          "restore_s": round(r.seconds, 6)}), flush=True)
    # --lr-by-hand D: the loop writes lr * D**step into the groups (the second group half
    # of it), as trainers without a scheduler object do; the plan gets the values
    by_hand = None
    if args.lr_by_hand is not None:
        by_hand = [[args.lr * args.lr_by_hand ** s / (1 + gi) for gi in range(len(opt.param_groups))]
                   for s in range(args.iterations)]
    ckptd.torch.write_plan(ddp, opt, out / "plan.json", scheduler=sched, scaler=scaler,
                           max_grad_norm=args.clip, grad_norm_type=args.norm_type,
                           clip_grad_value=args.clip_value, iterations=args.iterations,
                           addresses=args.addrs, lr_per_step=by_hand,
                           allreduces_per_step=args.accumulate if args.allreduce_every_micro_batch else 1,
                           collectives={"after": [{"op": "allreduce", "count": 1, "dtype": "float32"}]}
                           if args.allreduce_loss == "listed" else None)
    (out / f"rank{rank}").mkdir(parents=True, exist_ok=True)
    while args.hold and not Path(args.hold).exists():  # a capture starting from the plan first
        time.sleep(0.05)
    sizes, clipped = [], 0  # clipped: the steps whose gradients the clipping changed
    for it in range(start, args.iterations):
        opt.zero_grad(set_to_none=True)
        for g, lr in zip(opt.param_groups, by_hand[it] if by_hand else []):
            g["lr"] = lr
        for micro in range(args.accumulate):
            x, y = batch(model, rank, it * args.accumulate + micro, args.seed)
            x = x.to(getattr(torch, args.dtype))
            sync = micro == args.accumulate - 1 or args.allreduce_every_micro_batch
            with (contextlib.nullcontext() if sync else ddp.no_sync()):
                with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
                    loss = F.cross_entropy(ddp(x).float(), y)
                (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if args.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip, norm_type=args.norm_type)
            clipped += bool(norm > args.clip)
        elif args.clip_value is not None:
            clipped += any(bool((p.grad.abs() > args.clip_value).any()) for p in model.parameters()
                           if p.grad is not None)
            torch.nn.utils.clip_grad_value_(model.parameters(), args.clip_value)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if args.allreduce_loss:  # a logging pattern: the mean loss, on DDP's own group
            dist.all_reduce(loss.detach().float())
        m, o = ckptd.torch.initial_state(ddp, opt, scaler)  # the lr this step used
        save_checkpoint(out / f"rank{rank}" / checkpoint_name(it), it, m, o)
        if sched:
            sched.step()
        sizes.append(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        if it == start:
            print(json.dumps({"rank": rank, "first_iteration": it,
                              "since_start_s": round(time.time() - T0, 3)}), flush=True)
        time.sleep(args.pace)
    if rank == 0:
        (out / "ddp.json").write_text(json.dumps({"bucket_sizes_per_iteration": sizes,
                                                  "clipped_steps": clipped}) + "\n")
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
    ap.add_argument("--optimizer", default="AdamW", help="a torch.optim class (AdamW, SGD, Adagrad, ...)")
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--nesterov", action="store_true")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--no-decay-group", action="store_true",
                    help="biases and LayerNorm weights in a second group without weight decay")
    ap.add_argument("--scheduler", help="CLASS:arg=value,... of torch.optim.lr_scheduler")
    ap.add_argument("--lr-by-hand", type=float, metavar="DECAY",
                    help="no scheduler: set each group's lr by hand, lr * DECAY**step")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the parameters' dtype (bfloat16: the allreduce carries bf16)")
    ap.add_argument("--clip", type=float, help="clip_grad_norm_ max_norm")
    ap.add_argument("--norm-type", default=2.0, type=float, help="clip_grad_norm_ norm_type with --clip (inf: max |g|)")
    ap.add_argument("--clip-value", type=float, help="clip_grad_value_ clip_value (instead of --clip)")
    ap.add_argument("--allreduce-loss", nargs="?", const="unlisted", choices=["unlisted", "listed"],
                    help="allreduce each step's loss on DDP's process group; `listed`: the plan lists it "
                         "(write_plan's collectives), else it does not")
    ap.add_argument("--amp", action="store_true", help="fp16 autocast with a GradScaler")
    ap.add_argument("--init-scale", type=float, default=2.0 ** 16)
    ap.add_argument("--growth-interval", type=int, default=2000)
    ap.add_argument("--hook", choices=["fp16", "bf16"], help="DDP gradient compression hook")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per step, all but the last under ddp.no_sync()")
    ap.add_argument("--allreduce-every-micro-batch", action="store_true",
                    help="with --accumulate: no no_sync(), DDP allreduces every micro-batch")
    ap.add_argument("--batchnorm", action="store_true",
                    help="a BatchNorm1d after fc1 (module buffers DDP broadcasts every forward)")
    ap.add_argument("--freeze", action="store_true",
                    help="fc2's weight and bias requires_grad=False (fine-tuning); still in the optimizer")
    ap.add_argument("--tie", action="store_true",
                    help="a tied weight: fc2's weight used again as fc2t.weight (one parameter, two names)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help="TCPStore port (0: pick a free one)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, help="run only this rank (one process per host, e.g. "
                    "in its own network namespace); default: spawn all ranks here")
    ap.add_argument("--master", default="127.0.0.1", help="rank 0's address (the TCPStore)")
    ap.add_argument("--addrs", type=lambda s: s.split(","), help="every rank's address, for the plan")
    ap.add_argument("--ifname", help="GLOO_SOCKET_IFNAME (default lo)")
    ap.add_argument("--hold", metavar="FILE", help="after writing the plan, every rank waits for FILE "
                    "to exist before training (a daemon started from the plan is capturing by then)")
    ap.add_argument("--restore", metavar="SOURCE", help="restart from ckptd's state (ckptd.restore): "
                    "a checkpoint, a directory of them, or the daemon's http:// URL")
    ap.add_argument("--token", help="the daemon's bearer token for --restore from a URL")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step")
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
