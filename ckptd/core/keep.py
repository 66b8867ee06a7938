"""Which checkpoints are on disk: writing each commit's file, surviving a disk that
fails, and pruning by a retention policy.

A long-running daemon meets full disks, read-only remounts and descriptor exhaustion.
None of them may stop capture: the shadow is exact in memory whatever the disk does. So
a failed write is logged and the iteration is reported committed but not persisted; the
next commits try again, spaced by an exponential back-off (a full disk is not hammered
every iteration), and the first write that works persists the newest state, which makes
the unpersisted ones before it moot. After every write that works, old checkpoints are
pruned: the newest `keep_last` stay, and with `keep_every` M also every iteration that
is a multiple of M (for good), and the newest checkpoint written whose parameters are
all finite: after a job diverges, its NaN checkpoints would otherwise push the last good
one out (ckptd.core.finite). A replay (retry=False) stops at the first failure
instead: there is no later moment at which the file could be written.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from ckptd.core.checkpoint import CheckpointWriteError, checkpoint_name, iteration_of_name, write_checkpoint
from ckptd.core.finite import first_nonfinite
from ckptd.core.store import Store, open_store

log = logging.getLogger("ckptd")
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0


class CheckpointKeeper:
    def __init__(self, out: str | Path | Store, keep_last: int | None = None, keep_every: int | None = None,
                 retry: bool = False, clock=time.monotonic):
        # a directory or an fsspec URL (ckptd.core.store); `out` is the local path, if any
        self.store = open_store(out)
        self.out = self.store.path
        try:
            self.store.makedirs()
        except CheckpointWriteError as e:  # an unreachable store: the writes retry it
            if self.store.local or not retry:
                raise
            log.warning("checkpoint store not reachable", extra={"fields": {"store": self.store.url,
                                                                             "error": str(e)}})
        self.keep_last, self.keep_every, self.retry = keep_last, keep_every, retry
        self.clock = clock
        self.last_persisted: int | None = None
        self.newest_unpersisted: int | None = None  # committed after last_persisted, not on disk
        self.not_persisted = 0  # commits whose own file was never written
        self.failures = 0  # write attempts that failed
        self.last_error: str | None = None
        self.last_size: int | None = None  # the last file written: bytes and SHA-256
        self.last_sha256: str | None = None
        self.pruned = 0
        # the newest checkpoint written whose parameters are finite (retention keeps it), and
        # whether the last one written was (ckptd.core.finite)
        self.newest_finite: int | None = None
        self.last_finite: bool | None = None
        self._backoff = 0.0
        self._next_try = 0.0

    @property
    def failing(self) -> bool:
        return self.newest_unpersisted is not None

    def write(self, iteration: int, model: dict, optimizer: dict | None, force: bool = False,
              prune: bool = True) -> bool:
        """Persist one committed iteration's state; True once its file is in place.
        While backing off after a failure, returns False without trying (unless force).
        prune=False leaves pruning to the caller (the persistence tier lists the new file
        in its manifest first, so the manifest never lists only pruned files)."""
        now = self.clock()
        if self.failing and not force and now < self._next_try:
            self._missed(iteration)
            return False
        try:
            self._put(iteration, model, optimizer)
        except CheckpointWriteError as e:
            if not self.retry:
                raise
            self.failed(iteration, e)
            return False
        if self.failing:
            log.warning("checkpoints written again", extra={"fields": {
                "iteration": iteration, "not_persisted": self.not_persisted}})
        self.last_persisted, self.newest_unpersisted = iteration, None
        self._backoff = 0.0
        if prune:
            self.prune()
        return True

    def write_older(self, iteration: int, model: dict, optimizer: dict | None) -> bool:
        """Persist a state older than the last written (the newest finite one, once the job
        diverged: ckptd.live.persist), once: what is said of the newest, written or not,
        and the back-off are left as they are; a failure is logged, not retried."""
        try:
            self._put(iteration, model, optimizer)
            return True
        except CheckpointWriteError as e:
            log.warning("checkpoint not written", extra={"fields": {"iteration": iteration, "error": str(e)}})
            return False

    def _put(self, iteration: int, model: dict, optimizer: dict | None):
        self.last_size, self.last_sha256 = self.store.write(
            checkpoint_name(iteration), lambda f: write_checkpoint(f, iteration, model, optimizer))
        # the model read once more, beside a write of it and its optimizer state (ckptd.core.finite)
        self.last_finite = first_nonfinite(model.items()) is None
        if self.last_finite and (self.newest_finite is None or iteration > self.newest_finite):
            self.newest_finite = iteration

    def failed(self, iteration: int, e: CheckpointWriteError):
        """A write for `iteration` failed (its file, or the manifest that lists it): one
        log line, and the next try waits out a growing back-off."""
        self.failures += 1
        self.last_error = str(e)
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2 * self._backoff))
        self._next_try = self.clock() + self._backoff
        self._missed(iteration)
        log.warning("checkpoint not written", extra={"fields": {
            "iteration": iteration, "error": self.last_error, "errno": e.errno,
            "retry_in_s": self._backoff}})

    def _missed(self, iteration: int):
        if self.newest_unpersisted != iteration:
            self.not_persisted += 1
        self.newest_unpersisted = iteration

    def prune(self) -> list[int]:
        """Remove checkpoints the retention policy does not keep; the iterations removed.
        Only files named iter_NNNNNN.pt in the directory are considered."""
        if self.keep_last is None:
            return []
        try:
            its = sorted(it for n in self.store.names() if (it := iteration_of_name(n)) is not None)
        except OSError as e:
            log.warning("cannot list checkpoints to prune", extra={"fields": {"error": str(e)}})
            return []
        keep = set(its[-self.keep_last:]) | {self.newest_finite}
        if self.keep_every:
            keep |= {i for i in its if i % self.keep_every == 0}
        gone = []
        for i in its:
            if i not in keep:
                try:
                    self.store.remove(checkpoint_name(i))
                    gone.append(i)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("cannot prune checkpoint", extra={"fields": {
                        "iteration": i, "error": e.strerror}})
        self.pruned += len(gone)
        return gone

    def status(self) -> dict:
        """For /status: whether writes work, what is on disk, what is not."""
        retry = max(0.0, self._next_try - self.clock()) if self.failing else None
        return {"state": "failing" if self.failing else "ok",
                "last_persisted": self.last_persisted,
                "newest_not_persisted": self.newest_unpersisted,
                "not_persisted": self.not_persisted, "write_failures": self.failures,
                "last_error": self.last_error, "retry_in_s": None if retry is None else round(retry, 3),
                "pruned": self.pruned, "keep_last": self.keep_last, "keep_every": self.keep_every,
                "newest_finite": self.newest_finite}
