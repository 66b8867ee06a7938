"""The in-memory tier: the latest committed state and the one before, for serving.

At each commit the shadow's tensors are copied once (the shadow steps them in place
for the next iteration); the copy is never changed after, so the HTTP workers and the
persistence tier read it without a lock while the pipeline goes on. Two are kept: a
client that asked for the latest may still be reading it when the next commit lands.
The memory of a copy nothing refers to any more (torch counts what shares it) takes a
later commit's copy: after start-up, commits touch no fresh pages.

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

    def encoded(self, names: list[str], hyper, plan_hash: str | None) -> tuple[memoryview, str]:
        """(torch.save bytes of the trainer-format doc, their sha256 hex); `hyper()` gives
        its formats.TrainerHyper (or None), asked only when the doc is first encoded."""
        with self._lock:
            if self._encoded is None:
                from ckptd.core.formats import torch_doc
                buf = io.BytesIO()
                torch.save(torch_doc(self.checkpoint(), names, hyper(), plan_hash), buf)
                data = buf.getbuffer()  # not getvalue(): a second copy, 4 GB at 330 M parameters
                self._encoded = (data, hashlib.sha256(data).hexdigest())
            return self._encoded

    def digests(self) -> dict[str, str]:
        """'model.NAME' / 'optimizer.NAME.KEY' -> BLAKE2b-128, computed once."""
        with self._lock:
            if self._digests is None:
                from ckptd.core.manifest import tensor_digests
                self._digests = tensor_digests(self.model, self.optimizer)
            return self._digests

    def raw(self, names: list[str], lr, plan_hash: str | None) -> tuple[bytes, list[memoryview]]:
        """(header, each tensor's bytes) of the raw layout; the bytes are the held tensors'."""
        from ckptd.core.raw_layout import as_bytes, encode_header, state_tensors
        tensors = [(n, t.contiguous()) for n, t in state_tensors(self.model, self.optimizer)]
        head = encode_header(self.iteration, lr, plan_hash, names, self.optimizer is not None, tensors,
                             self.digests())
        return head, [as_bytes(t) for _, t in tensors]


def copy_state(tree, copy=lambda t: t.detach().clone()):
    """A deep copy of a state (dicts of tensors and plain values): each tensor through
    `copy`, in the tree's order."""
    if isinstance(tree, torch.Tensor):
        return copy(tree)
    if isinstance(tree, dict):
        return {k: copy_state(v, copy) for k, v in tree.items()}
    return tree


def _tensors(tree, path=()):
    """(path, tensor) of every tensor in a state tree, in its order."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, path + (k,))


def _layout(tree) -> tuple:
    return tuple((path, tuple(t.shape), t.dtype) for path, t in _tensors(tree))


def _sharers(t: torch.Tensor) -> int:
    """How many tensors (views, and what numpy arrays or memoryviews made of them keep
    alive) share t's memory: torch's own count on the storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Slot:
    """Memory for one copy of a state of a given layout, reused from commit to commit. A
    HeldState gets views of these tensors, and anything a reader makes of them (numpy
    arrays, memoryviews, torch.save's references) is a view too, so the slot is free
    exactly when torch counts no sharer but its own tensors."""

    def __init__(self, layout: tuple):
        self.layout = layout
        self.tensors = [torch.empty(shape, dtype=dtype) for _, shape, dtype in layout]
        for t in self.tensors:
            t.zero_()  # every page touched now, not in a commit
        self.idle = [_sharers(t) for t in self.tensors]

    def free(self) -> bool:
        return all(_sharers(t) == n for t, n in zip(self.tensors, self.idle))

    def fill(self, tree):
        """tree's values copied in; returns the same tree with views of them. One torch
        call copies them all: each torch call lets go of the GIL, which the capture
        loop then takes, and this thread waits to have it back (a copy per tensor was
        ~160 calls for issue 16's state)."""
        if self.tensors:
            torch._foreach_copy_(self.tensors, [t for _, t in _tensors(tree)])
        it = iter(self.tensors)
        return copy_state(tree, lambda _: next(it)[...])


class MemoryTier:
    """The latest KEEP committed states. Each commit copies into memory of an earlier copy
    that nothing refers to any more (_Slot), so after start-up a commit touches no fresh
    page: on a virtual machine whose freed memory goes back to the host, fresh pages cost
    the copy of issue 16's 31 MB state 80-180 ms instead of ~13, the bucket steps queued
    behind it stalled the capture loop, and the rings overflowed (benchmarks/RESULTS.md).
    reserve() makes the slots before capturing starts."""

    KEEP = 2

    @classmethod
    def copies(cls, writer: bool) -> int:
        """Copies of the state the tier holds at most: the KEEP held, the one being
        copied, and with a persistence `writer` one it may still be writing (its first
        write took 300-370 ms, three commits at issue 16's rates)."""
        return cls.KEEP + 1 + writer

    def __init__(self):
        self._lock = threading.Lock()
        self._held: list[HeldState] = []  # oldest first
        self._slots: list[_Slot] = []

    def reserve(self, model: dict, optimizer: dict | None, writer: bool = False):
        """Make the slots for states laid out as model and optimizer (their tensors may be
        on the meta device): copies(writer) of them."""
        layout = _layout({"model": model, "optimizer": optimizer})
        have = sum(s.layout == layout for s in self._slots)
        self._slots += [_Slot(layout) for _ in range(self.copies(writer) - have)]

    def _copy(self, model: dict, optimizer: dict | None) -> dict:
        tree = {"model": model, "optimizer": optimizer}
        layout = _layout(tree)
        slot = next((s for s in self._slots if s.layout == layout and s.free()), None)
        if slot is None:  # the state's layout changed, or a reader still holds every copy
            slot = _Slot(layout)
            self._slots.append(slot)
        copied = slot.fill(tree)
        # Slots kept: the held states, the next copy and one the persistence tier may be
        # writing (what taking a fresh copy each commit held at most too); spare ones
        # beyond that, and those of an old layout, are let go.
        spare = [s for s in self._slots if s is not slot and s.free()]
        busy = len(self._slots) - len(spare)
        for s in spare:
            if s.layout != layout or busy >= self.copies(writer=True):
                self._slots.remove(s)
            else:
                busy += 1
        return copied

    def commit(self, iteration: int, model: dict, optimizer: dict | None) -> HeldState:
        """Take a copy of a state just committed (its tensors are the shadow's live ones)."""
        t0 = time.perf_counter()
        copied = self._copy(model, optimizer)
        held = HeldState(iteration, copied["model"], copied["optimizer"], time.time(), 0.0)
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
