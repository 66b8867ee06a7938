"""Resync: the training loop's side of the daemon's notice (ckptd.live.notice).

When ckptd cannot recover an iteration its shadow stops; it restarts from a checkpoint
the trainer saves. Three lines in the training script:

    from ckptd.resync import Resync
    resync = Resync(store, "/ckpt/resync", model, optimizer, scheduler=sched, scaler=scaler)
    for step in range(start, total):
        ...                                   # forward, backward, optimizer.step()
        resync.after_step(step + 1)           # steps done so far

`store` is the job's c10d store (torchrun's TCPStore; `dist.distributed_c10d._get_default_store()`
in a torchrun job, or any TCPStore the daemon's `notice.store` points at). Each call costs
one store round trip (`check`). When the daemon has announced a new unrecoverable
iteration, rank 0 saves `{"model", "optimizer", "step", "lr_scheduler", "scaler"}` with
torch.save, atomically, as `iter_NNNNNN.pt` (ckptd's numbering: iteration = steps - 1) in
`directory`, which is the daemon's `resume` directory. The file is in place before the
next step's traffic, so the daemon restarts its shadow at that next iteration.
Every rank calls it (the check is cheap); only `rank == 0` writes.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ckptd.core.checkpoint import atomic_write, checkpoint_name
from ckptd.live.notice import STORE_KEY


class Resync:
    def __init__(self, store, directory: str | os.PathLike, model, optimizer, scheduler=None,
                 scaler=None, rank: int | None = None):
        self.store, self.dir = store, Path(directory)
        self.model = getattr(model, "module", model)  # DDP's wrapped module: plain names
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.rank = rank
        self.handled = self._announced()  # what was announced before this run is old news
        self.saved: list[Path] = []

    def _announced(self) -> int:
        if not self.store.check([STORE_KEY]):
            return -1
        return int(self.store.get(STORE_KEY))

    def after_step(self, steps_done: int) -> Path | None:
        """Call after optimizer.step() (and scheduler.step()); returns the file written."""
        if not self.store.check([STORE_KEY]):
            return None
        announced = int(self.store.get(STORE_KEY))
        if announced <= self.handled:
            return None
        self.handled = announced
        if self.rank != 0:
            return None
        return self.save(steps_done)

    def save(self, steps_done: int) -> Path:
        doc = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
               "step": steps_done}
        if self.scheduler is not None:
            doc["lr_scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            doc["scaler"] = self.scaler.state_dict()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / checkpoint_name(steps_done - 1)
        # group-readable: the daemon (its own user, often) reads it from a shared directory
        atomic_write(path, lambda f: torch.save(doc, f), mode=0o640)
        self.saved.append(path)
        return path
