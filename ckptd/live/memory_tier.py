"""The in-memory tier: the latest committed state and the one before, for serving.

At each commit the shadow's tensors are copied once (the shadow steps them in place
for the next iteration); the copy is never changed after, so the HTTP workers and the
persistence tier read it without a lock while the pipeline goes on. Two are kept: a
client that asked for the latest may still be reading it when the next commit lands.

A held state is encoded for the wire on first request only (torch.save of the standard
trainer format, ckptd.core.formats.torch_doc, the one `ckptd.restore` reads), with its
SHA-256, and the encoding is kept with it: many clients restoring at once cost one
encoding. The raw layout (ckptd.core.raw_layout, what `ckptd.restore` asks for) needs no
encoding: only its header, with every tensor's BLAKE2b-128 (one pass over the state, on
first request; the persistence tier's manifest reuses them), is computed and kept.
"""
from __future__ import annotations

import hashlib
import io
import threading
import time
from dataclasses import dataclass, field

import torch

from ckptd.core.checkpoint import CHECKPOINT_FORMAT


@dataclass
class HeldState:
    iteration: int
    model: dict
    optimizer: dict | None
    committed_at: float  # time.time() of the commit
    copy_seconds: float
    _encoded: tuple[memoryview, str] | None = field(default=None, repr=False)
    _digests: dict[str, str] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def checkpoint(self) -> dict:
        return {"format": CHECKPOINT_FORMAT, "iteration": self.iteration, "model": self.model,
                "optimizer": self.optimizer}

    def encoded(self, names: list[str], param_groups: list[dict] | None,
                plan_hash: str | None) -> tuple[memoryview, str]:
        """(torch.save bytes of the trainer-format doc, their sha256 hex)."""
        with self._lock:
            if self._encoded is None:
                from ckptd.core.formats import torch_doc
                buf = io.BytesIO()
                torch.save(torch_doc(self.checkpoint(), names, param_groups, plan_hash), buf)
                data = buf.getbuffer()  # not getvalue(): a second copy, 4 GB at 330 M parameters
                self._encoded = (data, hashlib.sha256(data).hexdigest())
            return self._encoded

    def digests(self) -> dict[str, str]:
        """'model.NAME' / 'optimizer.NAME.KEY' -> BLAKE2b-128, computed once."""
        with self._lock:
            if self._digests is None:
                from ckptd.live.persist import tensor_digests
                self._digests = tensor_digests(self.model, self.optimizer)
            return self._digests

    def raw(self, names: list[str], lr, plan_hash: str | None) -> tuple[bytes, list[memoryview]]:
        """(header, each tensor's bytes) of the raw layout; the bytes are the held tensors'."""
        from ckptd.core.raw_layout import as_bytes, encode_header, state_tensors
        tensors = [(n, t.contiguous()) for n, t in state_tensors(self.model, self.optimizer)]
        head = encode_header(self.iteration, lr, plan_hash, names, self.optimizer is not None, tensors,
                             self.digests())
        return head, [as_bytes(t) for _, t in tensors]


def copy_state(tree):
    """A deep copy of a state's tensors (dicts of tensors and plain values)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: copy_state(v) for k, v in tree.items()}
    return tree


class MemoryTier:
    KEEP = 2

    def __init__(self):
        self._lock = threading.Lock()
        self._held: list[HeldState] = []  # oldest first

    def commit(self, iteration: int, model: dict, optimizer: dict | None) -> HeldState:
        """Take a copy of a state just committed (its tensors are the shadow's live ones)."""
        t0 = time.perf_counter()
        held = HeldState(iteration, copy_state(model), copy_state(optimizer), time.time(), 0.0)
        held.copy_seconds = time.perf_counter() - t0
        with self._lock:
            self._held = (self._held + [held])[-self.KEEP:]
        return held

    def latest(self) -> HeldState | None:
        with self._lock:
            return self._held[-1] if self._held else None

    def get(self, iteration: int) -> HeldState | None:
        with self._lock:
            return next((h for h in self._held if h.iteration == iteration), None)

    def iterations(self) -> list[int]:
        with self._lock:
            return [h.iteration for h in self._held]
