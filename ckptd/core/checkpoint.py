"""Checkpoint files: the model and optimizer state after one iteration.

One format serves the shadow, the synthesizer's reference trainer and `ckptd verify`:
a torch.save'd dict {format, iteration, model: {name: tensor}, optimizer: {lr,
state: {name: {step, exp_avg, exp_avg_sq[, max_exp_avg_sq]}}}}. Tensors are keyed by
parameter name so two checkpoints compare without knowing either's object layout.
A checkpoint is written to a temporary name and renamed: a file that exists is whole.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from ckptd.errors import CkptdError

CHECKPOINT_FORMAT = "ckptd-checkpoint/1"


class CheckpointError(CkptdError, ValueError):
    """A file that is not a readable ckptd checkpoint, or one that does not fit the plan."""


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}.pt"


def save_checkpoint(path: str | Path, iteration: int, model: dict, optimizer: dict | None):
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": CHECKPOINT_FORMAT, "iteration": iteration,
                "model": model, "optimizer": optimizer}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict:
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        raise CheckpointError(f"{path}: cannot read checkpoint: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: not a ckptd checkpoint")
    return doc


def diff_checkpoints(a: dict, b: dict, limit: int = 10) -> list[str]:
    """Names of what differs between two checkpoints, bit for bit; empty if identical."""
    out: list[str] = []
    if a.get("iteration") != b.get("iteration"):
        out.append(f"iteration: {a.get('iteration')} != {b.get('iteration')}")
    _diff(a.get("model"), b.get("model"), "model", out)
    _diff(a.get("optimizer"), b.get("optimizer"), "optimizer", out)
    return out[:limit] if limit else out


def _diff(x, y, where: str, out: list[str]):
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y), key=str):
            if k not in x or k not in y:
                out.append(f"{where}.{k}: only in {'second' if k not in x else 'first'}")
            else:
                _diff(x[k], y[k], f"{where}.{k}", out)
    elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{where}: {x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}")
        elif not _bits_equal(x, y):
            ne = (_as_bits(x) != _as_bits(y)).flatten().nonzero()
            out.append(f"{where}: {ne.numel()} of {x.numel()} elements differ, first at flat index "
                       f"{int(ne[0])}")
    elif x != y and not (isinstance(x, float) and isinstance(y, float) and x != x and y != y):
        out.append(f"{where}: {x!r} != {y!r}")


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(view)


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return bool(torch.equal(_as_bits(x), _as_bits(y)))
