"""The raw layout the daemon streams a held state in, for `ckptd.restore` to read
straight into the model's own tensors (GET /checkpoint with `Accept: application/x-ckptd-raw`).

    one line: a JSON header, then "\n"
    each tensor's bytes (C order, native little-endian), in the header's order

Header: {"format": "ckptd-raw/1", "iteration", "lr", "plan_hash", "param_names",
"optimizer" (false: weights only), "tensors": [{"name", "dtype", "shape", "bytes", "blake2b"}]}. Names are the persistence
manifest's: "model.NAME" and "optimizer.NAME.KEY"; "blake2b" is the same BLAKE2b-128 the
manifest lists (ckptd.live.persist.tensor_digest). Unlike a torch.save body, nothing needs
unpickling or a second buffer: a reader knows every tensor's place before its first byte.
"""
from __future__ import annotations

import hashlib
import json
import math
import os

import torch

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
    entries = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "bytes": t.numel() * t.element_size(), "blake2b": digests[n]} for n, t in tensors]
    doc = {"format": FORMAT, "iteration": iteration, "lr": lr, "plan_hash": plan_hash,
           "param_names": list(names), "optimizer": has_optimizer, "tensors": entries}
    return json.dumps(doc).encode() + b"\n"


def decode_header(line: bytes, where: str) -> dict:
    """The header line, checked for what a reader relies on; CheckpointError otherwise."""
    from ckptd.core.checkpoint import CheckpointError
    try:
        doc = json.loads(line)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
        for e in doc["tensors"]:
            e["dtype"] = dtype_named(e["dtype"])
            e["shape"] = [int(s) for s in e["shape"]]
            if e["bytes"] != e["dtype"].itemsize * math.prod(e["shape"]):
                raise ValueError(f"{e['name']}: {e['bytes']} bytes for {e['dtype']}{e['shape']}")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{where}: bad raw checkpoint header: {err}") from None
    return doc


def dtype_named(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def new_digest():
    return hashlib.blake2b(digest_size=16)

