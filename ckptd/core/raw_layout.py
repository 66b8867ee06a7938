"""The raw layout the daemon streams a held state in, for `ckptd.restore` to read
straight into the model's own tensors (GET /checkpoint with `Accept: application/x-ckptd-raw`).

    one line: a JSON header, then "\n"
    each tensor's bytes (C order, native little-endian), in the header's order

Header: {"format": "ckptd-raw/1", "iteration", "lr", "plan_hash", "param_names",
"optimizer" (false: weights only), "tensors": [{"name", "dtype", "shape", "bytes", "blake2b"}]}. Names are the persistence
manifest's: "model.NAME" and "optimizer.NAME.KEY"; "blake2b" is the same BLAKE2b-128 the
manifest lists (ckptd.core.manifest.tensor_digest). Unlike a torch.save body, nothing needs
unpickling or a second buffer: a reader knows every tensor's place before its first byte.
"""
from __future__ import annotations

import hashlib
import json
import math
import os

import torch

from ckptd.core.plan import dtype_name

MEDIA_TYPE = "application/x-ckptd-raw"
FORMAT = "ckptd-raw/1"
MAX_HEADER = 64 << 20
# BLAKE2b runs at ~1.4 GB/s on one core here and releases the GIL: tensors are hashed on
# this many threads at once (the daemon's digests, the client's check)
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


def state_tensors(model: dict, optimizer: dict | None) -> list[tuple[str, torch.Tensor]]:
    """(manifest name, tensor) of a checkpoint's tensors, in the order they are sent."""
    out = [(f"model.{n}", t) for n, t in model.items()]
    for n, st in ((optimizer or {}).get("state") or {}).items():
        out += [(f"optimizer.{n}.{k}", v) for k, v in st.items() if isinstance(v, torch.Tensor)]
    return out


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory as bytes, shared (readinto writes the tensor)."""
    flat = t.detach().reshape(-1)  # a 0-d tensor (a step count) cannot be viewed as bytes
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def encode_header(iteration: int, lr, plan_hash: str | None, names: list[str], has_optimizer: bool,
                  tensors: list[tuple[str, torch.Tensor]], digests: dict[str, str]) -> bytes:
    entries = [{"name": n, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                "bytes": t.numel() * t.element_size(), "blake2b": digests[n]} for n, t in tensors]
    doc = {"format": FORMAT, "iteration": iteration, "lr": lr, "plan_hash": plan_hash,
           "param_names": list(names), "optimizer": has_optimizer, "tensors": entries}
    return json.dumps(doc).encode() + b"\n"


def decode_header(line: bytes, where: str) -> dict:
    """The header line, checked for what a reader relies on; CheckpointError otherwise."""
    from ckptd.core.checkpoint import CheckpointError
    from ckptd.core.plan import _is_int
    from ckptd.errors import show
    try:
        doc = json.loads(line)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
        it, lr = doc.get("iteration"), doc.get("lr")
        if not _is_int(it) or it < -1:
            raise ValueError(f"iteration {show(it)}, not an integer >= -1")
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))):
            raise ValueError(f"lr {show(lr)}, not a number")
        if lr is not None and not (0 <= lr < 1 << 1000 if isinstance(lr, int) else math.isfinite(lr) and lr >= 0):
            # JSON takes NaN and Infinity: it went into the optimizer's param_groups as the lr
            raise ValueError(f"lr {show(lr)}, not a finite lr >= 0")
        if not isinstance(doc.get("optimizer"), bool):
            raise ValueError(f"optimizer {show(doc.get('optimizer'))}, not true or false")
        if not isinstance(doc.get("tensors"), list):
            raise ValueError(f"tensors {show(doc.get('tensors'))}, not a list")
        seen = set()
        for e in doc["tensors"]:
            name = e["name"]
            if not isinstance(name, str):
                raise ValueError(f"tensor name {show(name)}, not a string")
            if name in seen:
                raise ValueError(f"{name} is listed twice")
            seen.add(name)
            e["dtype"] = dtype_named(e["dtype"])
            if not isinstance(e["shape"], list) or not all(_is_int(s) and s >= 0 for s in e["shape"]):
                raise ValueError(f"{name}: shape {show(e['shape'])}, not a list of sizes >= 0")
            if not _is_int(e["bytes"]) or e["bytes"] != e["dtype"].itemsize * math.prod(e["shape"]):
                raise ValueError(f"{name}: {show(e['bytes'])} bytes for {e['dtype']}{e['shape']}")
            if not isinstance(e.get("blake2b"), str):
                raise ValueError(f"{name}: blake2b {show(e.get('blake2b'))}, not a hex digest")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{where}: bad raw checkpoint header: {' '.join(str(err).split())[:300]}") from None
    return doc


def dtype_named(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def new_digest():
    return hashlib.blake2b(digest_size=16)

