"""A 2-rank gloo DDP job with static_graph=True that writes its plan (tests/test_static.py);
run as a script: OUT KIND [CLIP] [FLAGS] (FLAGS: a comma list of find_unused, bn: a
BatchNorm1d after fc1, whose buffers DDP broadcasts every forward). The same parameters are used every
iteration (a static graph), layer a under activation checkpointing:

    a     used on every rank (torch.utils.checkpoint)
    b     used on rank 0 only (DDP's reduced map: 1)
    dead  never used (map 0: never stepped, grad None every iteration)

Rank 0 records, per iteration, the reduced gradients DDP left in param.grad (None ones
left out), DDP's reduced used map, its layout and state after the step (iter<N>.pt), and
the same state as ckptd checkpoints under rank0/ (a replay's reference)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ckptd.torch as ct
from _unused_job import optimizer, record  # the same AdamW and SGD, the same records

ITERATIONS = 5
USED = {"fc1": 2, "a": 2, "b": 1, "dead": 0, "head": 2}  # on how many ranks each layer is used


class Net(torch.nn.Module):
    def __init__(self, bn=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.bn = torch.nn.BatchNorm1d(16) if bn else None
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.dead = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, rank):
        h = self.fc1(x)
        h = F.relu(self.bn(h) if self.bn is not None else h)
        h = h + checkpoint(self.a, h, use_reentrant=False)
        if rank == 0:
            h = h + self.b(h)
        return self.head(h)


def build(bn=False):
    torch.manual_seed(0)
    return Net(bn)


def main(rank, out, kind, clip, flags, store_path):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.set_num_threads(1)
    net = build("bn" in flags)
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.002, static_graph=True,
                                                    find_unused_parameters="find_unused" in flags)
    opt = optimizer(net, kind)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ct.write_plan(ddp, opt, os.path.join(out, "plan.json"), scheduler=sched, max_grad_norm=clip,
                  iterations=ITERATIONS, addresses=["127.0.0.1", "127.0.0.1"])
    os.makedirs(os.path.join(out, "rank0"), exist_ok=True)
    for it in range(ITERATIONS):
        g = torch.Generator().manual_seed(100 * it + rank)
        opt.zero_grad()
        x = torch.randn(8, 6, generator=g)
        ddp(x, rank).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        used_map = ddp.reducer._get_local_used_map().clone()
        layout = [[p.shape for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        if rank == 0:  # with the lr this step used
            record(out, it, ddp, opt, grads, used_map, layout)
        sched.step()
    dist.barrier()
    # No teardown: torch 2.13's gloo teardown races between the ranks (see _frozen_job.py)
    os._exit(0)


if __name__ == "__main__":
    clip = float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    flags = sys.argv[4].split(",") if len(sys.argv) > 4 else []
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(main, args=(sys.argv[1], sys.argv[2], clip, flags, os.path.join(sys.argv[1], "store")), nprocs=2)
