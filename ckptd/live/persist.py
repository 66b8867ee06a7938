"""The persistence tier: committed states written to disk in the background.

The commit path only hands the memory tier's copy (ckptd.live.memory_tier.HeldState,
never changed after the commit) to this tier when one is due: `persist_every` iterations
or `persist_interval_s` seconds after the last one handed over, whichever comes first. A
writer thread takes it and writes it with the CheckpointKeeper (ckptd.core.keep: atomic
write, back-off after failures, retention), then the manifest. So neither capture nor
commits ever wait for the disk. If the writer is still busy when the next one is due,
the newer state replaces the waiting one (the older would be stale anyway; counted as
`superseded`). Nor do they wait for the writer's CPU: the writer thread, and the
hashing threads it starts, run at nice PERSIST_NICE. On a host whose cores are all busy
(a burst at line rate), a frame the capture loop is late for is lost with its iteration,
while a checkpoint written late is only older on disk (the memory tier holds the newest);
so the writer takes the CPU the capture and the optimizer leave.

The manifest (`manifest.json` beside the checkpoints, written atomically after each
checkpoint; its format is ckptd.core.manifest's) lists each checkpoint on disk: iteration, file, the file's SHA-256, every
tensor's BLAKE2b-128, and timings. A checkpoint is in the manifest only once its file is
in place, so after a crash at any moment the manifest's newest entry loads and verifies
(ckptd.core.manifest.verify_checkpoint); a file newer than the manifest is a write that finished just before
the crash and is ignored.

The directory may be an fsspec URL (`persist_url`: memory://, s3://bucket/prefix, ...):
ckptd.core.store writes each object whole or not at all (an atomic commit on a bucket
store, a temporary name and a move elsewhere), and the order
above (checkpoint, then the manifest) is what keeps a reader from meeting a manifest entry
for a partial object. The SHA-256 is computed while the file is written.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from ckptd.core.checkpoint import CheckpointError, CheckpointWriteError, checkpoint_name
from ckptd.core.keep import CheckpointKeeper
from ckptd.core.manifest import read_manifest, write_manifest
from ckptd.core.store import open_store
from ckptd.threads import Thread, lower_priority

log = logging.getLogger("ckptd")

PERSIST_NICE = 10  # the writer thread's nice value (and its hashing threads', inherited)


class PersistTier:
    def __init__(self, out: str | Path, every: int | None, interval_s: float | None,
                 keep_last: int | None, keep_every: int | None, plan_hash: str | None = None,
                 clock=time.monotonic, options: dict | None = None):
        # a directory or an fsspec URL (ckptd.core.store), `options` its storage options
        self.store = open_store(out, options)
        self.out = self.store.path
        self.keeper = CheckpointKeeper(self.store, keep_last, keep_every, retry=True)
        self.every, self.interval_s, self.plan_hash, self.clock = every, interval_s, plan_hash, clock
        try:
            man = read_manifest(self.store)
        except CheckpointError as e:
            if self.store.local:
                raise
            log.warning("cannot read the manifest", extra={"fields": {"error": str(e)}})
            man = None
        self.entries: list[dict] = list(man["checkpoints"]) if man else []
        # retention keeps the newest finite checkpoint of earlier runs too (an entry written
        # before ckptd said whether it was finite counts as finite: a newer write replaces it)
        self.keeper.newest_finite = max((e["iteration"] for e in self.entries if e.get("finite", True) is not False),
                                        default=None)
        self.handed: int | None = None  # iteration last handed to the writer
        self._handed_at = clock()
        self.superseded = 0
        self.written = 0  # checkpoints written, and their bytes (manifests not counted)
        self.bytes_written = 0
        self.last_write_s: float | None = None
        self._cv = threading.Condition()
        self._pending = None
        self._older = None  # an older state to write besides (write_older), never superseded
        self._busy = False
        self._closing = False
        self.thread = Thread(target=self._writer, name="ckptd-persist", daemon=True)
        self.thread.start()

    def due(self, iteration: int) -> bool:
        if self.handed is None:
            return True
        if self.every is not None and iteration - self.handed >= self.every:
            return True
        return self.interval_s is not None and self.clock() - self._handed_at >= self.interval_s

    def offer(self, held) -> bool:
        """At a commit (the commit path: cheap). Hands `held` to the writer if due."""
        if not self.due(held.iteration):
            return False
        self.handed, self._handed_at = held.iteration, self.clock()
        with self._cv:
            if self._pending is not None:
                self.superseded += 1
            self._pending = held
            self._cv.notify()
        return True

    def write_older(self, held) -> None:
        """Have `held` written too, though older than what was handed over and whether a
        write is due or not: the newest finite state once the job diverged (the daemon
        hands it from the memory tier), which `persist_every` would otherwise have skipped.
        It is not superseded by newer states, and leaves their schedule as it was."""
        with self._cv:
            self._older = held
            self._cv.notify()

    def close(self, newest=None, timeout: float | None = None):
        """Stop: `newest` (the last committed state) is written first if it is not yet
        (handed over and failed, or skipped while backing off, included); then waits for
        the writer."""
        if newest is not None and newest.iteration != self.keeper.last_persisted and \
                (newest.iteration != self.handed or newest.iteration == self.keeper.newest_unpersisted):
            self.handed = newest.iteration
            with self._cv:
                self._pending = newest
        with self._cv:
            self._closing = True
            self._cv.notify()
        self.thread.join(timeout)

    def idle(self) -> bool:
        with self._cv:
            return self._pending is None and self._older is None and not self._busy

    def _writer(self):
        lower_priority(PERSIST_NICE)
        while True:
            with self._cv:
                while self._pending is None and self._older is None and not self._closing:
                    self._cv.wait()
                older = self._older is not None
                if older:
                    held, self._older = self._older, None
                else:
                    held, self._pending = self._pending, None
                if held is None:
                    return
                self._busy = True
            try:
                self._write(held, older)
            except Exception as e:  # the writer must outlive any one bad write
                log.error("persistence failed", extra={"fields": {"iteration": held.iteration,
                                                                  "error": str(e)}})
            finally:
                held = None  # not kept while waiting: the memory tier reuses its memory
                with self._cv:
                    self._busy = False

    def _write(self, held, older: bool = False):
        t0 = time.monotonic()
        if older:
            if not self.keeper.write_older(held.iteration, held.model, held.optimizer):
                return  # logged by the keeper; the newer states' writes go on as they were
        # at the stop, one try even while backing off: there is no later moment
        elif not self.keeper.write(held.iteration, held.model, held.optimizer, force=self._closing,
                                   prune=False):
            return  # failed or backing off (logged by the keeper); the next one due tries again
        name = checkpoint_name(held.iteration)
        self.written += 1
        self.bytes_written += self.keeper.last_size
        entry = {"iteration": held.iteration, "file": name,
                 "sha256": self.keeper.last_sha256,  # computed as the file was written
                 "tensors": held.digests(),
                 "committed_at": held.committed_at, "persisted_at": time.time(),
                 "write_s": round(time.monotonic() - t0, 6), "finite": self.keeper.last_finite,
                 "lag_s": round(time.time() - held.committed_at, 6)}
        self.entries = [e for e in self.entries if e["iteration"] != held.iteration] + [entry]
        try:
            self._write_manifest()
        except CheckpointWriteError as e:  # the file is there, unlisted: the next write lists it
            if older:
                log.warning("manifest not written", extra={"fields": {"iteration": held.iteration, "error": str(e)}})
            else:
                self.keeper.failed(held.iteration, e)
            return
        if self.keeper.prune():  # only now: the manifest already lists the new file
            self._write_manifest()
        self.last_write_s = time.monotonic() - t0

    def _write_manifest(self):
        present = self.store.names()
        self.entries = sorted((e for e in self.entries if e["file"] in present), key=lambda e: e["iteration"])
        write_manifest(self.store, self.plan_hash, self.entries)

    def status(self) -> dict:
        st = self.keeper.status()
        st.update({"mode": "async", "store": self.store.url, "persist_every": self.every, "persist_interval_s": self.interval_s,
                   "superseded": self.superseded, "written": self.written,
                   "bytes_written": self.bytes_written,
                   "last_write_s": None if self.last_write_s is None else round(self.last_write_s, 6),
                   "manifest_newest": self.entries[-1]["iteration"] if self.entries else None})
        return st
