"""A 2-rank gloo DDP job with find_unused_parameters=True that writes its plan
(tests/test_unused.py); run as a script: OUT KIND [CLIP] [ZERO_GRAD]. Some parameters are
unused on some iterations on every rank, some on one rank only, one never:

    a     used on every rank on even iterations (globally unused on odd ones, after it has
          optimizer state)
    b     used on rank 0 only, on iterations not divisible by 3 (globally unused on
          iteration 0, before it has state, and 3)
    c     used on rank 1 only, from iteration 2 on (rank 0 never uses it, yet steps it)
    dead  never used

Rank 0 records, per iteration, the reduced gradients DDP left in param.grad (None ones
left out), DDP's reduced used map and its state after the step (iter<N>.pt), and the same
state as ckptd checkpoints under rank0/ (a replay's reference). CLIP (a number, or -)
clips with clip_grad_norm_; ZERO_GRAD=zeros calls zero_grad(set_to_none=False)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import ckptd.torch as ct
from ckptd.core.checkpoint import checkpoint_name, save_checkpoint

ITERATIONS = 6


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 16)
        self.dead = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x, it, rank):
        h = F.relu(self.fc1(x))
        if it % 2 == 0:
            h = h + F.relu(self.a(h))
        if rank == 0 and it % 3 != 0:
            h = h + self.b(h)
        if rank == 1 and it >= 2:
            h = h + torch.tanh(self.c(h))
        return self.head(h)


def used(it: int) -> dict[str, int]:
    """On how many ranks each layer is used at iteration it (DDP's reduced map)."""
    return {"fc1": 2, "a": 2 * (it % 2 == 0), "b": int(it % 3 != 0), "c": int(it >= 2), "dead": 0, "head": 2}


def build():
    torch.manual_seed(0)
    return Net()


def optimizer(net, kind):
    if kind == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    if kind == "sgd":  # momentum and weight decay: a zero-gradient step would still move them
        return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    raise SystemExit(f"unknown optimizer {kind}")


def record(out, it, ddp, opt, grads, used_map, layout):
    """Rank 0, after iteration it's step: the reduced gradients, DDP's reduced used map,
    the state (iter<it>.pt), and the same state as ckptd's checkpoint under rank0/."""
    model, state = ct.initial_state(ddp, opt)
    torch.save({"grads": grads, "used": used_map, "model": model, "optimizer": state,
                "rebuilt": ddp._has_rebuilt_buckets, "layout": layout}, os.path.join(out, f"iter{it}.pt"))
    save_checkpoint(os.path.join(out, "rank0", checkpoint_name(it)), it, model, state)


def main(rank, out, kind, clip, zero_grad, store_path):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.set_num_threads(1)
    net = build()
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.002, find_unused_parameters=True)
    opt = optimizer(net, kind)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ct.write_plan(ddp, opt, os.path.join(out, "plan.json"), scheduler=sched, max_grad_norm=clip,
                  iterations=ITERATIONS, addresses=["127.0.0.1", "127.0.0.1"])
    os.makedirs(os.path.join(out, "rank0"), exist_ok=True)
    layouts = []
    for it in range(ITERATIONS):
        g = torch.Generator().manual_seed(100 * it + rank)
        opt.zero_grad(set_to_none=zero_grad != "zeros")
        x = torch.randn(8, 6, generator=g)
        ddp(x, it, rank).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        used_map = ddp.reducer._get_local_used_map().clone()
        layouts.append([[p.shape for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        try:
            opt.step()
        except ct.TrainerError as e:
            if rank == 0:
                with open(os.path.join(out, "refused.txt"), "w") as f:
                    f.write(f"{it}: {e}")
            break
        if rank == 0:  # with the lr this step used
            record(out, it, ddp, opt, grads, used_map, layouts[-1])
        sched.step()
    dist.barrier()
    # No teardown: torch 2.13's gloo teardown races between the ranks (see _frozen_job.py)
    os._exit(0)


if __name__ == "__main__":
    clip = float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    zero = sys.argv[4] if len(sys.argv) > 4 else "none"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(main, args=(sys.argv[1], sys.argv[2], clip, zero, os.path.join(sys.argv[1], "store")), nprocs=2)
