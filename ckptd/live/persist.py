"""The persistence tier: committed states written to disk in the background.

The commit path only hands the memory tier's copy (ckptd.live.memory_tier.HeldState,
never changed after the commit) to this tier when one is due: `persist_every` iterations
or `persist_interval_s` seconds after the last one handed over, whichever comes first. A
writer thread takes it and writes it with the CheckpointKeeper (ckptd.core.keep: atomic
write, back-off after failures, retention), then the manifest. So neither capture nor
commits ever wait for the disk. If the writer is still busy when the next one is due,
the newer state replaces the waiting one (the older would be stale anyway; counted as
`superseded`).

The manifest (`manifest.json` beside the checkpoints, written atomically after each
checkpoint) lists each checkpoint on disk: iteration, file, the file's SHA-256, every
tensor's BLAKE2b-128, and timings. A checkpoint is in the manifest only once its file is
in place, so after a crash at any moment the manifest's newest entry loads and verifies
(`verify_checkpoint`); a file newer than the manifest is a write that finished just before
the crash and is ignored.

The directory may be an fsspec URL (`persist_url`: memory://, s3://bucket/prefix, ...):
ckptd.core.store writes each object whole or not at all (an atomic commit on a bucket
store, a temporary name and a move elsewhere), and the order
above (checkpoint, then the manifest) is what keeps a reader from meeting a manifest entry
for a partial object. The SHA-256 is computed while the file is written.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ckptd.core.checkpoint import (CHECKPOINT_FORMAT, CheckpointError, CheckpointWriteError, check_checkpoint,
                                   checkpoint_name, load_checkpoint, torch_load)
from ckptd.core.keep import CheckpointKeeper
from ckptd.core.raw_layout import HASH_THREADS, as_bytes, new_digest, state_tensors
from ckptd.core.store import Store, open_store
from ckptd.errors import show
from ckptd.threads import Thread, name_os_thread

log = logging.getLogger("ckptd")
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "ckptd-manifest/1"


def tensor_digest(t: torch.Tensor) -> str:
    h = new_digest()
    h.update(as_bytes(t.contiguous()))
    return h.hexdigest()


def tensor_digests(model: dict, optimizer: dict | None) -> dict[str, str]:
    """'model.NAME' and 'optimizer.NAME.KEY' -> digest, for every tensor of a checkpoint,
    hashed on HASH_THREADS threads."""
    named = state_tensors(model, optimizer)
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="ckptd-digest",
                            initializer=name_os_thread) as pool:
        return dict(zip((n for n, _ in named), pool.map(tensor_digest, (t for _, t in named))))


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(directory: str | Path | Store) -> dict | None:
    store = open_store(directory)
    p = store.where(MANIFEST)
    try:
        doc = json.loads(store.read(MANIFEST))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: unreadable manifest: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or \
            not isinstance(doc.get("checkpoints"), list):
        raise CheckpointError(f"{p}: not a ckptd manifest")
    for i, entry in enumerate(doc["checkpoints"]):
        why = _bad_entry(entry)
        if why:
            raise CheckpointError(f"{p}: checkpoint entry {i}: {why}")
    return doc


def _bad_entry(entry) -> str | None:
    """Why a manifest entry is not one this tier wrote. Its file is a plain name in the
    tier's own directory: an entry naming ../x or /x would have a restore read (and a
    keeper delete) a file the tier never wrote."""
    if not isinstance(entry, dict):
        return f"{show(entry)} is no object"
    it, name, digest = entry.get("iteration"), entry.get("file"), entry.get("sha256")
    if not isinstance(it, int) or isinstance(it, bool) or it < 0:
        return f"iteration {show(it)} is no iteration number"
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        return f"file {show(name)} is not a file name in the tier's directory"
    if not isinstance(digest, str) or len(digest) != 64:
        return f"sha256 {show(digest)} is no SHA-256 digest"
    return None


def verify_checkpoint(directory: str | Path | Store, entry: dict) -> dict:
    """The checkpoint a manifest entry names, loaded and checked against it (file SHA-256,
    every tensor's digest); CheckpointError naming the file and what differs."""
    store = open_store(directory)
    path = store.where(entry["file"])
    if store.local:
        if not (store.path / entry["file"]).is_file():
            raise CheckpointError(f"{path}: listed in the manifest but missing")
        if file_digest(store.path / entry["file"]) != entry["sha256"]:
            raise CheckpointError(f"{path}: SHA-256 differs from the manifest's")
        # the SHA-256 covers every byte the zip CRCs do: no second pass for them
        doc = load_checkpoint(store.path / entry["file"], check_crc=False)
    else:
        try:
            data = store.read(entry["file"])
        except FileNotFoundError:
            raise CheckpointError(f"{path}: listed in the manifest but missing") from None
        except OSError as e:
            raise CheckpointError(str(e)) from None
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{path}: SHA-256 differs from the manifest's")
        try:
            doc = torch_load(io.BytesIO(data))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read checkpoint: {e}") from e
        if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path}: not a ckptd checkpoint")
        check_checkpoint(doc, path)  # as load_checkpoint does on the local branch
    if doc.get("iteration") != entry["iteration"]:
        raise CheckpointError(f"{path}: holds iteration {doc.get('iteration')}, the manifest says "
                              f"{entry['iteration']}")
    got = tensor_digests(doc["model"], doc.get("optimizer"))
    if got != entry["tensors"]:
        bad = sorted(k for k in set(got) | set(entry["tensors"]) if got.get(k) != entry["tensors"].get(k))
        raise CheckpointError(f"{path}: tensors differ from the manifest: {bad[:3]}")
    return doc


def newest_verified(directory: str | Path | Store) -> tuple[dict, dict] | None:
    """(checkpoint, manifest entry) of the newest checkpoint the manifest lists that
    verifies; None without a manifest or entries. `directory`: a path or an fsspec URL."""
    directory = open_store(directory)
    man = read_manifest(directory)
    if man is None:
        return None
    for entry in sorted(man["checkpoints"], key=lambda e: -e["iteration"]):
        try:
            return verify_checkpoint(directory, entry), entry
        except CheckpointError as e:
            log.warning("persisted checkpoint does not verify", extra={"fields": {"error": str(e)}})
    return None


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
        self.handed: int | None = None  # iteration last handed to the writer
        self._handed_at = clock()
        self.superseded = 0
        self.written = 0  # checkpoints written, and their bytes (manifests not counted)
        self.bytes_written = 0
        self.last_write_s: float | None = None
        self._cv = threading.Condition()
        self._pending = None
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
            return self._pending is None and not self._busy

    def _writer(self):
        while True:
            with self._cv:
                while self._pending is None and not self._closing:
                    self._cv.wait()
                held, self._pending = self._pending, None
                if held is None:
                    return
                self._busy = True
            try:
                self._write(held)
            except Exception as e:  # the writer must outlive any one bad write
                log.error("persistence failed", extra={"fields": {"iteration": held.iteration,
                                                                  "error": str(e)}})
            finally:
                held = None  # not kept while waiting: the memory tier reuses its memory
                with self._cv:
                    self._busy = False

    def _write(self, held):
        t0 = time.monotonic()
        # at the stop, one try even while backing off: there is no later moment
        if not self.keeper.write(held.iteration, held.model, held.optimizer, force=self._closing,
                                 prune=False):
            return  # failed or backing off (logged by the keeper); the next one due tries again
        name = checkpoint_name(held.iteration)
        self.written += 1
        self.bytes_written += self.keeper.last_size
        entry = {"iteration": held.iteration, "file": name,
                 "sha256": self.keeper.last_sha256,  # computed as the file was written
                 "tensors": held.digests(),
                 "committed_at": held.committed_at, "persisted_at": time.time(),
                 "write_s": round(time.monotonic() - t0, 6),
                 "lag_s": round(time.time() - held.committed_at, 6)}
        self.entries = [e for e in self.entries if e["iteration"] != held.iteration] + [entry]
        try:
            self._write_manifest()
        except CheckpointWriteError as e:  # the file is there, unlisted: the next write lists it
            self.keeper.failed(held.iteration, e)
            return
        if self.keeper.prune():  # only now: the manifest already lists the new file
            self._write_manifest()
        self.last_write_s = time.monotonic() - t0

    def _write_manifest(self):
        present = self.store.names()
        self.entries = sorted((e for e in self.entries if e["file"] in present), key=lambda e: e["iteration"])
        doc = {"format": MANIFEST_FORMAT, "plan_hash": self.plan_hash, "checkpoints": self.entries}
        self.store.write(MANIFEST, lambda f: f.write(json.dumps(doc, indent=1).encode()))

    def status(self) -> dict:
        st = self.keeper.status()
        st.update({"mode": "async", "store": self.store.url, "persist_every": self.every, "persist_interval_s": self.interval_s,
                   "superseded": self.superseded, "written": self.written,
                   "bytes_written": self.bytes_written,
                   "last_write_s": None if self.last_write_s is None else round(self.last_write_s, 6),
                   "manifest_newest": self.entries[-1]["iteration"] if self.entries else None})
        return st
