"""The manifest of a directory (or fsspec URL) of persisted checkpoints: its format, how it
is written and read, and how a checkpoint it lists is verified.

The persistence tier (ckptd.live.persist) writes it; offline recovery (ckptd.recovery)
and the daemon's restart read it. It lives here, beside the checkpoint format and the
store, so reading a checkpoint directory never needs the live daemon's package.

`manifest.json` lists each checkpoint on disk: iteration, file, the file's SHA-256, every
tensor's BLAKE2b-128, and timings. A writer lists a checkpoint only once its file is in
place (write the file, then `write_manifest`), so the newest entry always names a whole
file; `verify_checkpoint` checks a file against its entry.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ckptd.core.checkpoint import (CHECKPOINT_FORMAT, CheckpointError, check_checkpoint, iteration_of_name, load_checkpoint,
                                   torch_load)
from ckptd.core.raw_layout import HASH_THREADS, as_bytes, new_digest, state_tensors
from ckptd.core.store import Store, open_store
from ckptd.errors import show
from ckptd.threads import name_os_thread

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


def unlisted_checkpoints(directory: str | Path | Store) -> list[str]:
    """The checkpoint files (iter_NNNNNN.pt) in a local directory that its manifest does
    not list and that are not newer than the manifest's newest entry: files some other
    writer put there (a trainer, a replay, another daemon). A file newer than the newest
    entry is the daemon's own write that a crash caught before its manifest line (the
    tier writes the file, then the manifest). Retention would prune such files as its
    own and a commit of the same iteration overwrite one, so the daemon refuses them."""
    store = open_store(directory)
    names = store.names()
    man = read_manifest(store)
    entries = man["checkpoints"] if man else []
    listed = {e["file"] for e in entries}
    newest = max((e["iteration"] for e in entries), default=-1)
    return sorted(n for n in names if (it := iteration_of_name(n)) is not None
                  and n not in listed and (not entries or it <= newest))


def write_manifest(store: Store, plan_hash: str | None, entries: list[dict]) -> None:
    """The manifest listing `entries` (written whole or not at all: ckptd.core.store);
    CheckpointWriteError when it cannot be written."""
    doc = {"format": MANIFEST_FORMAT, "plan_hash": plan_hash, "checkpoints": entries}
    store.write(MANIFEST, lambda f: f.write(json.dumps(doc, indent=1).encode()))


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


def newest_verified(directory: str | Path | Store, finite: bool = False) -> tuple[dict, dict] | None:
    """(checkpoint, manifest entry) of the newest checkpoint the manifest lists that
    verifies; None without a manifest or entries. `directory`: a path or an fsspec URL.
    `finite`: the newest whose model is all finite (ckptd.core.finite): an entry that
    says `finite: false` is passed over unread, any other is checked once loaded."""
    from ckptd.core.finite import diverged_state, nonfinite_in
    directory = open_store(directory)
    man = read_manifest(directory)
    if man is None:
        return None
    for entry in sorted(man["checkpoints"], key=lambda e: -e["iteration"]):
        if finite and entry.get("finite") is False:
            continue
        try:
            doc = verify_checkpoint(directory, entry)
        except CheckpointError as e:
            log.warning("persisted checkpoint does not verify", extra={"fields": {"error": str(e)}})
            continue
        if finite and (bad := nonfinite_in(doc)):
            log.warning("skipping %s", diverged_state(directory.where(entry["file"]), bad, entry["iteration"]))
            continue
        return doc, entry
    return None
