"""A 2-rank gloo DDP job of a conv net in channels_last (tests/test_memory_order.py); run
as a script: OUT OPTIMIZER CLIP (sgd: SGD with momentum; adamw: AdamW (foreach); CLIP a
max_grad_norm for clip_grad_norm_, whose per-tensor norms read the gradients in memory
order, or -). The conv weight is
channels_last (strides NHWC), so DDP lays its gradient into the bucket in NHWC order.
Rank 0 writes the plan and, per iteration, its state as ckptd checkpoints under rank0/."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptd.torch as ct
from ckptd.core.checkpoint import checkpoint_name, save_checkpoint

ITERATIONS = 3


def build():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
    return net.to(memory_format=torch.channels_last)


def main(rank, out, kind, clip, store):
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    torch.set_num_threads(1)
    net = build()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    if kind == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=0.01, foreach=True)
    ct.write_plan(ddp, opt, os.path.join(out, "plan.json"), max_grad_norm=clip, iterations=ITERATIONS,
                  addresses=["127.0.0.1", "127.0.0.1"])
    os.makedirs(os.path.join(out, "rank0"), exist_ok=True)
    for it in range(ITERATIONS):
        x = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(100 * it + rank))
        opt.zero_grad()
        ddp(x.to(memory_format=torch.channels_last)).pow(2).sum().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        if rank == 0:
            m, o = ct.initial_state(ddp, opt)
            save_checkpoint(os.path.join(out, "rank0", checkpoint_name(it)), it, m, o)
    dist.barrier()
    os._exit(0)  # no teardown: torch 2.13's gloo teardown races between the ranks (see _frozen_job.py)


if __name__ == "__main__":
    out, kind, clip = sys.argv[1], sys.argv[2], None if sys.argv[3] == "-" else float(sys.argv[3])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(main, args=(out, kind, clip, os.path.join(out, "store")), nprocs=2)
