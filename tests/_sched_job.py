"""A 2-rank gloo DDP job whose lr scheduler is Python code or nests schedulers, so that
write_plan records its lrs as lr_per_step (tests/test_stepped_schedulers.py); run as a
script: OUT KIND. Rank 0 records, per iteration, the reduced gradients DDP left in
param.grad, every group's lr that step used and its state after the step; and, around
write_plan, the scheduler's and the optimizer's state_dicts (which write_plan must
leave as they were)."""
import copy
import functools
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptd.torch as ct

ITERATIONS = 8
WARMUP = 3


# Hugging Face transformers' get_linear_schedule_with_warmup and
# get_cosine_schedule_with_warmup, in plain torch: a LambdaLR over a functools.partial
def _linear_warmup_decay(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine_warmup(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))


def optimizer_and_scheduler(net, kind):
    S = torch.optim.lr_scheduler
    if kind == "hf_linear":  # AdamW, get_linear_schedule_with_warmup
        opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
        return opt, S.LambdaLR(opt, functools.partial(_linear_warmup_decay, num_warmup_steps=WARMUP,
                                                      num_training_steps=ITERATIONS))
    if kind == "sequential":  # the pure-torch warmup then cosine
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        warm = S.LinearLR(opt, start_factor=0.1, total_iters=WARMUP)
        cos = S.CosineAnnealingLR(opt, T_max=ITERATIONS - WARMUP, eta_min=1e-4)
        return opt, S.SequentialLR(opt, [warm, cos], milestones=[WARMUP])
    if kind == "two_groups":  # no weight decay on biases and norms, each group its own lambda
        decay = [p for n, p in net.named_parameters() if n.endswith("weight") and p.dim() > 1]
        rest = [p for n, p in net.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": rest, "weight_decay": 0.0, "lr": 0.003}], lr=0.01)
        return opt, S.LambdaLR(opt, [functools.partial(_cosine_warmup, num_warmup_steps=WARMUP,
                                                       num_training_steps=ITERATIONS),
                                     lambda step: 0.8 ** step])
    raise SystemExit(f"unknown kind {kind}")


def main(rank, out, kind, store_path):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.set_num_threads(1)
    net = build()
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0002)  # several buckets once rebuilt
    opt, sched = optimizer_and_scheduler(net, kind)
    before = copy.deepcopy({"scheduler": sched.state_dict(), "optimizer": opt.state_dict()})
    ct.write_plan(ddp, opt, os.path.join(out, "plan.json"), scheduler=sched, iterations=ITERATIONS,
                  addresses=["127.0.0.1", "127.0.0.1"])
    after = copy.deepcopy({"scheduler": sched.state_dict(), "optimizer": opt.state_dict()})
    if rank == 0:
        torch.save({"before": before, "after": after}, os.path.join(out, "around_write_plan.pt"))
    for it in range(ITERATIONS):
        g = torch.Generator().manual_seed(100 * it + rank)
        opt.zero_grad(set_to_none=True)
        x = torch.randn(8, 6, generator=g)
        ddp(x).pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        lrs = [grp["lr"] for grp in opt.param_groups]
        opt.step()
        if rank == 0:  # with the lr this step used
            model, state = ct.initial_state(ddp, opt)
            torch.save({"grads": grads, "lrs": lrs, "model": model, "optimizer": state},
                       os.path.join(out, f"iter{it}.pt"))
        sched.step()
    dist.barrier()
    # No teardown: torch 2.13's gloo teardown races between the ranks (tests/_frozen_job.py)
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], sys.argv[2], os.path.join(sys.argv[1], "store")), nprocs=2)
