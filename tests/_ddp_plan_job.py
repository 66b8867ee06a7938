"""A 2-rank gloo DDP job that writes its plan (tests/test_plan.py); run as a script."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckptd.torch import write_plan


def main(rank, out, store_path):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 200),
                                torch.nn.ReLU(), torch.nn.Linear(200, 100), torch.nn.ReLU(), torch.nn.Linear(100, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    write_plan(ddp, opt, os.path.join(out, "plan.json"), iterations=3)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 64)).sum().backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(sys.argv[1], os.path.join(sys.argv[1], "store")), nprocs=2)
