"""Standard checkpoint formats in and out: what a trainer writes and loads with plain torch.

    torch        torch.save of {"model": state_dict, "optimizer": optimizer.state_dict(),
                 "step": n, "iteration": n, "lr_scheduler": ..., "ckptd": {...}}
    dcp          a torch.distributed.checkpoint directory of the same dict
    safetensors  the model's weights only (metadata: "step")

Iteration numbering. ckptd numbers iterations from 0: the checkpoint of iteration t
holds the state after t+1 optimizer steps. A trainer's "step" or "iteration" is the
number of steps done (the loop resumes with `for step in range(ckpt["step"], ...)`),
so a trainer's file with step n is ckptd's iteration n-1, and an exported file of
iteration t says step = iteration = t+1. Where the file has an Adam-style per-parameter
"step" the two must agree; a file with neither is the initial state (iteration -1).

Wrapped models: a trainer's file saved from DDP's or torch.compile's wrapper has every key
prefixed (`module.`, `_orig_mod.`); it is read as the plain model's names, which ckptd
uses everywhere (ckptd.core.wrappers.wrapper_prefix: only a prefix every key carries).

Buffers (BatchNorm running statistics, ...): the shadow holds parameters, plus the module
buffers a gloo plan captures from DDP's broadcasts (exported files list them under
"ckptd"; else say they have none); a trainer's file that has buffers keeps them when
read, and `ckptd verify` compares them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pickle
import stat
import re
import shutil
import struct
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptd.core.checkpoint import (CHECKPOINT_FORMAT, CheckpointError, CheckpointWriteError, as_checkpoint, atomic_write,
                                   fsync_dir, iteration_of_name, load_failure, named_optimizer_state, param_groups_of,
                                   set_group_lrs, torch_load, torch_optimizer_state)
from ckptd.core.readfile import misplaced_file
from ckptd.core.wrappers import wrapper_prefix
from ckptd.errors import show

EXPORT_FORMATS = ("torch", "dcp", "safetensors")
STANDARD_TAG = "ckptd-torch/1"
EXPORT_MODE = 0o644  # less the umask (os.open applies it)
BUFFERS_NOTE = "parameters only: no module buffers captured (none, or not on a wire ckptd decodes)"


# -- reading -------------------------------------------------------------------------------
def load_standard(path: Path, names: list[str] | None) -> dict:
    """A DCP directory or a safetensors file (a torch.save goes through from_torch_doc)."""
    if path.is_dir():
        if not (path / ".metadata").is_file():
            held = sorted(p.name for p in checkpoints_in(path))
            if held:  # (verify and restore take a directory's newest; one checkpoint is read here)
                newest = max(held, key=lambda n: (iteration_of_name(n) is not None, iteration_of_name(n) or 0, n))
                raise CheckpointError(f"{path}: a directory of {len(held)} checkpoint(s) ({held[0]}"
                                      f"{' ... ' + held[-1] if len(held) > 1 else ''}), not one checkpoint: give one "
                                      f"file (e.g. {path / newest}) or a torch.distributed.checkpoint directory")
            raise CheckpointError(f"{path}: a directory without .metadata is not a "
                                  f"torch.distributed.checkpoint checkpoint")
        for p in path.iterdir():  # DCP opens its shards blind: a FIFO would block it forever
            try:
                mode = p.stat().st_mode
            except OSError as e:
                raise CheckpointError(f"{p}: cannot read checkpoint: {e.strerror or e}") from None
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise CheckpointError(f"{p}: cannot read checkpoint: not a regular file or directory")
        return from_torch_doc(_load_dcp(path), path, names)
    if _is_safetensors(path):
        return _load_safetensors(path, names)
    try:  # torch.save's legacy (non-zip) serialization
        doc = torch_load(path)
    except Exception as e:  # torch raises many types for a bad file
        if what := misplaced_file(path, "checkpoint"):  # an argument in the wrong place, said so
            raise CheckpointError(f"{path}: cannot read checkpoint: this is {what}, not a checkpoint") from e
        raise CheckpointError(f"{path}: cannot read checkpoint: not a torch.save file, DCP "
                              f"directory or safetensors file ({load_failure(e)[:120]})") from e
    return as_checkpoint(doc, path, names)


def from_torch_doc(doc, path: Path, names: list[str] | None) -> dict:
    """A trainer's checkpoint dict (or a bare model state_dict) as a ckptd checkpoint."""
    where = str(path)
    if not isinstance(doc, dict):
        raise CheckpointError(f"{where}: holds a {type(doc).__name__}, not a checkpoint dict")
    if "model" not in doc:
        if doc and all(isinstance(v, torch.Tensor) for v in doc.values()):
            doc = {"model": doc}  # a bare model.state_dict()
        else:
            raise CheckpointError(f"{where}: no 'model' entry (keys: {sorted(map(str, doc))[:8]})")
    model = doc["model"]
    if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise CheckpointError(f"{where}: 'model' is not a state_dict of tensors")
    meta = doc.get("ckptd") if isinstance(doc.get("ckptd"), dict) else {}
    given = meta.get("param_names")
    if given is not None and not (isinstance(given, list) and all(isinstance(n, str) for n in given)):
        raise CheckpointError(f"{where}: ckptd.param_names is {show(given)}, not a list of parameter names")
    names = given or names
    prefix = wrapper_prefix(model, names, where)  # saved from ddp.state_dict(): read as the plain model's
    model = _untied({k[len(prefix):]: t for k, t in model.items()}, names, meta.get("tied"))
    opt = doc.get("optimizer")
    optimizer = None
    if opt is not None:
        opt = _unprefixed_optimizer(opt, names or list(model), where)
        if names is None:
            names = _parameter_names(model, opt, where)
        optimizer = named_optimizer_state(opt, names, where)
        step_lr = meta.get("step_lr")  # ckptd's export: the lr its step used (param_groups hold the next one)
        if isinstance(step_lr, (int, float)) and not isinstance(step_lr, bool):
            optimizer["lr"] = float(step_lr)
    steps = _steps(doc, optimizer, where)
    out = {"format": CHECKPOINT_FORMAT, "iteration": steps - 1, "model": model,
           "optimizer": optimizer}
    for key in ("lr_scheduler", "scaler"):
        if doc.get(key) is not None:
            out[key] = doc[key]
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        # the hyperparameters a trainer's optimizer.load_state_dict takes back (verify
        # compares them; ckptd's own format holds none: the plan has them)
        out["param_groups"] = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in groups]
    return out


def _untied(model: dict, names: list[str] | None, tied) -> dict:
    """A tied weight's other names left out (the plan holds the tensor once, under its
    first name): those `tied` (an export's ckptd.tied, or the plan's: Plan.state_names
    carries it) lists with the very values of their parameter, and, where the parameters
    are named, an entry that is no parameter but the very tensor of one (torch.save keeps
    a tied weight's names as one tensor; a module buffer never is a parameter's tensor).
    A trainer's own DCP save, or a copy of its state_dict, holds the other name as a
    tensor of its own: only the plan's `tied` tells it."""
    tied = {**getattr(names, "tied", {}), **(tied if isinstance(tied, dict) else {})}
    if not names and not tied:
        return model
    def place(t):  # where a tensor's values lie: two names of one tensor share it
        return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()
    named = set(names or ())
    params_at = {place(t) for n, t in model.items() if n in named and t.numel()}
    out = {}
    for n, t in model.items():
        target = tied.get(n)
        if isinstance(target, str) and isinstance(model.get(target), torch.Tensor) \
                and model[target].shape == t.shape and model[target].dtype == t.dtype and torch.equal(model[target], t):
            continue
        if n not in named and t.numel() and place(t) in params_at:
            continue
        out[n] = t
    return out


def _unprefixed_optimizer(opt, names: list[str], where: str):
    """torch's optimizer.state_dict() with a wrapper's prefix taken off the parameter names
    it holds (param_groups' param_names, state keyed by name as DCP's get_state_dict
    writes it), decided apart from the model's keys: an optimizer built over
    ddp.named_parameters() names them so even where the plain model's state_dict was saved."""
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict):
        return opt  # named_optimizer_state says what is wrong
    groups = param_groups_of(opt, where)
    keyed = [k for k in opt["state"] if isinstance(k, str) and not k.isdigit()]
    given = [n for g in groups for n in g.get("param_names", [])]
    prefix = wrapper_prefix(keyed + given, names, where, "the optimizer's parameter names")
    if not prefix:
        return opt
    cut, keyed = len(prefix), set(keyed)
    return {**opt, "state": {(k[cut:] if k in keyed else k): v for k, v in opt["state"].items()},
            "param_groups": [{**g, "param_names": [n[cut:] for n in g["param_names"]]} if "param_names" in g else g
                             for g in groups]}


NORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")  # torch's _NormBase


def _parameter_names(model: dict, opt: dict, where: str) -> list[str]:
    """Which model entries the optimizer's indices are, for a file that does not name
    them: the floating-point entries in order, less the buffers torch's norm layers
    name (running_mean, running_var), when their number is the optimizer's and every
    per-parameter state tensor has its entry's shape."""
    floats = [n for n, t in model.items() if t.is_floating_point()
              and n.rsplit(".", 1)[-1] not in NORM_BUFFERS]
    order = [i for g in param_groups_of(opt, where) for i in g.get("params", [])] if isinstance(opt, dict) else []
    fits = len(order) == len(floats)
    state = opt.get("state") or {}
    for k, i in enumerate(order if fits else []):
        for v in (state.get(i) or state.get(str(i)) or {}).values():
            if isinstance(v, torch.Tensor) and v.dim() and v.shape != model[floats[k]].shape:
                fits = False
    if fits:
        return floats
    raise CheckpointError(f"{where}: cannot tell which of the {len(floats)} floating-point model "
                          f"entries are the optimizer's {len(order)} parameters (buffers?): pass the plan")


def _steps(doc: dict, optimizer: dict | None, where: str) -> int:
    """Optimizer steps done, from "step"/"iteration" and the per-parameter step counts."""
    said = None
    for key in ("step", "iteration"):
        v = doc.get(key)
        if v is not None:
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = int(v.item())
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CheckpointError(f"{where}: '{key}' must be a number of steps done, not {v!r}")
            said = v
            break
    taken = None
    if optimizer and optimizer["state"]:
        name, first = next(iter(optimizer["state"].items()))
        step = first.get("step")
        if isinstance(step, torch.Tensor) and step.numel() != 1:
            raise CheckpointError(f"{where}: the optimizer step of {name} is a tensor of {step.numel()} "
                                  f"elements, not a count")
        if isinstance(step, (torch.Tensor, int, float)) and not isinstance(step, bool):
            value = float(step)
            if not math.isfinite(value) or value < 0:
                raise CheckpointError(f"{where}: the optimizer step of {name} is {value}, not a count")
            taken = int(value)
    if said is not None and taken is not None and said != taken:
        raise CheckpointError(f"{where}: says {said} steps done but its optimizer state has taken "
                              f"{taken} (step/iteration must count steps done)")
    return said if said is not None else (taken if taken is not None else 0)


# What a DCP directory's .metadata is made of (torch.distributed.checkpoint.metadata and
# filesystem, torch 2.13): the classes its unpickling may name, and nothing else.
_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "StorageMeta", "MetadataIndex", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _DCP_METADATA_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, no part of DCP's metadata (not run)")


class _WeightsOnlyBytes:
    """A load planner whose non-tensor entries pass torch's weights_only unpickler before
    the planner's own load_bytes (torch.load(weights_only=False)) reads the same bytes."""

    def __init__(self, planner):
        self._planner = planner

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value):
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            raise pickle.UnpicklingError(f"entry {read_item.dest_index.fqn}: {load_failure(e)}") from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


def _checked_reader(path: Path):
    """DCP's file-system reader, with what it unpickles checked. Unchecked, a DCP
    directory is code anyone who can write one runs in ckptd (`.metadata` is pickle.load-ed,
    each non-tensor entry torch.load-ed with weights_only=False), where a torch.save file
    is read weights_only: so .metadata may name only the classes DCP metadata is made of,
    and every non-tensor entry must be plain data."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _DcpMetadataUnpickler(f).load()
            # as FileSystemReader.read_metadata leaves it: the storage meta carries this load's id
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            return super().read_data(plan, _WeightsOnlyBytes(planner))

    return CheckedReader(str(path))


def _load_dcp(path: Path) -> dict:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    try:
        with warnings.catch_warnings(), _quiet_dcp():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            return _load_state_dict_from_keys(storage_reader=_checked_reader(path))
    except (Exception, CheckpointException) as e:  # the latter a BaseException, per rank
        raise CheckpointError(f"{path}: cannot read DCP checkpoint: {_dcp_why(e)}") from None


def _dcp_why(e: BaseException) -> str:
    """DCP's reason in one line: for a bad .metadata it says "metadata is None; global
    metadata read failed: <why>; rank local metadata read failed: <no __0.metadata>",
    of which the first is the one that matters."""
    why = _root_cause(e)
    m = re.search(r"global metadata read failed: (.*?);? rank local metadata read failed", why)
    if m:
        why = f".metadata: {m.group(1).rstrip('.; ')}"
    return why[:300]


class _DcpLogFilter(logging.Filter):
    """Drops what torch.distributed.checkpoint logs (on the root logger, tracebacks
    included: "Global metadata is not found. Falling back ..."): ckptd says in one line
    what was wrong. Other code's records pass."""
    def filter(self, record: logging.LogRecord) -> bool:
        return _DCP_DIR not in record.pathname


_DCP_DIR = os.path.join("torch", "distributed", "checkpoint", "")


@contextlib.contextmanager
def _quiet_dcp():
    """While DCP loads or saves here, its log records are dropped. torch logs through the
    root logger itself, so a filter there (not a level: other threads log through it too)
    catches its records and no one else's; its own named loggers, if any, propagate to
    the root's handlers, so the handlers get the filter as well (lastResort when none)."""
    flt = _DcpLogFilter()
    root = logging.getLogger()
    handlers = list(root.handlers) + ([logging.lastResort] if logging.lastResort else [])
    root.addFilter(flt)
    for h in handlers:
        h.addFilter(flt)
    try:
        yield
    finally:
        root.removeFilter(flt)
        for h in handlers:
            h.removeFilter(flt)


def _is_safetensors(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e.strerror or e}") from e
    return len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < (1 << 27)


def _load_safetensors(path: Path, names: list[str] | None) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        model = load_file(str(path), device="cpu")
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            meta = json.loads(f.read(n)).get("__metadata__") or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors: {e}") from e
    step = meta.get("step", "0")
    if not isinstance(step, str) or not re.fullmatch(r"[0-9]{1,18}", step):
        raise CheckpointError(f"{path}: safetensors metadata 'step' is {show(step)}, not a number")
    prefix = wrapper_prefix(model, names, path)  # saved from a wrapper's state_dict, as from_torch_doc reads it
    return {"format": CHECKPOINT_FORMAT, "iteration": int(step) - 1,
            "model": {k[len(prefix):]: t for k, t in model.items()}, "optimizer": None}


# -- writing -------------------------------------------------------------------------------
def torch_doc(ckpt: dict, names: list[str], hyper: "TrainerHyper | None" = None,
              plan_hash: str | None = None) -> dict:
    """A ckptd checkpoint as the dict a trainer torch.loads: the model's parameters, the
    optimizer's state_dict (loadable by optimizer.load_state_dict when `hyper` gives torch's
    own param_groups, see trainer_hyper), the lr scheduler's state where the plan names the
    scheduler, steps done, and what ckptd knows under "ckptd"."""
    steps = int(ckpt["iteration"]) + 1
    param_groups = hyper.param_groups if hyper is not None else None
    doc = {"model": dict(ckpt["model"]), "step": steps, "iteration": steps,
           "ckptd": {"format": STANDARD_TAG, "last_iteration": steps - 1, "param_names": list(names)}}
    buffers = [n for n in ckpt["model"] if n not in set(names)]  # names: every parameter, frozen ones too
    doc["ckptd"]["buffers"] = buffers or BUFFERS_NOTE  # the captured ones (gloo), by name
    if plan_hash:
        doc["ckptd"]["plan_hash"] = plan_hash
    if ckpt.get("optimizer") is not None:
        doc["optimizer"] = torch_optimizer_state(ckpt["optimizer"], names, param_groups)
        lr = ckpt["optimizer"].get("lr")
        if isinstance(lr, (int, float)):  # read back as the checkpoint's own lr (from_torch_doc)
            doc["ckptd"]["step_lr"] = float(lr)
        if hyper is not None and hyper.lr_scheduler is not None:
            doc["lr_scheduler"] = hyper.lr_scheduler
    return doc


_SCHEDULED = ("lr", "initial_lr", "betas", "momentum")  # the group keys torch's schedulers set


@dataclass(frozen=True)
class TrainerHyper:
    """What a trainer's optimizer and lr scheduler hold after a checkpoint's step and the
    scheduler's step that follows it: torch's param_groups, with the hyperparameters of
    the NEXT step where the plan names a schedule (a ckptd checkpoint's lr is the one its
    step used), and the scheduler's state_dict (None: the plan names no scheduler)."""
    param_groups: list[dict]
    lr_scheduler: dict | None


def trainer_hyper(plan, ckpt: dict) -> TrainerHyper | None:
    """The plan's optimizer as the trainer holds it after `ckpt`'s step (TrainerHyper;
    None without an optimizer in the plan). The schedule is replayed as the shadow
    replays it (ckptd.core.optim.GroupSchedule, the trainer's own scheduler class), so
    every group's lr and OneCycleLR's momentum are the trainer's values to the bit. lrs
    set by hand (lr_per_step) or none: the lr the step used, the others in proportion."""
    from ckptd.core.optim import GroupSchedule, full_groups, torch_optimizer
    opt = plan.optimizer
    if opt is None:
        return None
    held = {n for g in opt.groups for n in g["params"]}  # frozen ones the trainer's groups hold
    dummies = [(p.name, torch.zeros(0, requires_grad=True))
               for p in plan.parameters + tuple(f for f in plan.frozen if f.name in held)]
    groups = torch_optimizer(opt, dummies).state_dict()["param_groups"]
    lr = (ckpt.get("optimizer") or {}).get("lr")
    scheduled = not opt.lr_per_step and (opt.lr_scheduler is not None
                                         or (opt.lr_schedule or {}).get("kind", "constant") != "constant")
    if not scheduled:
        set_group_lrs(groups, lr)
        return TrainerHyper(groups, None)
    steps = int(ckpt["iteration"]) + 1
    schedule = GroupSchedule(opt, full_groups(opt, [n for n, _ in dummies]))
    nxt = schedule.at(steps)  # (steps the scheduler on its dummy optimizer there too)
    if opt.lr_scheduler is not None:  # the scheduler's own dummy optimizer: the keys it keeps there too
        for g, d in zip(groups, schedule.dummy.param_groups):  # (initial_lr; OneCycleLR's max_lr, ...)
            g.update({k: v for k, v in d.items() if k != "params" and (k in _SCHEDULED or k not in g)})
        state = schedule.sched.state_dict()
    else:  # the legacy lr_schedule: LambdaLR's state after `steps` steps (its lambda is not saved)
        for g, d in zip(groups, nxt):
            g["lr"] = d["lr"]
        state = {"last_epoch": steps, "_step_count": steps + 1, "_last_lr": [g["lr"] for g in groups],
                 "_get_lr_called_within_step": False}
    return TrainerHyper(groups, state)


def export_checkpoint(ckpt: dict, out: str | Path, fmt: str, plan=None) -> Path:
    """Write a ckptd checkpoint as `fmt` at `out` (a file; a directory for dcp). A file
    is written whole or not at all (atomic_write) and, unlike ckptd's own checkpoints
    (owner only), readable as the umask allows: it is made for a trainer to load, often
    as another user. Any failure is one CheckpointError naming `out`."""
    if fmt not in EXPORT_FORMATS:
        raise CheckpointError(f"unknown export format {fmt!r} (one of {', '.join(EXPORT_FORMATS)})")
    if fmt != "dcp" and str(out).endswith("/"):  # Path() drops the slash: `new/` was written as a file `new`
        raise CheckpointError(f"{out}: ends in / (a directory); --format {fmt} writes a file")
    out = Path(out)
    if fmt != "dcp" and out.is_dir():
        raise CheckpointError(f"{out}: is a directory; --format {fmt} writes a file")
    # into a directory that is there, for every format alike (DCP made the missing ones,
    # the files said "cannot create x.tmp": a name the user never gave)
    parent = out.parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() or parent.is_symlink() else "does not exist"
        raise CheckpointError(f"{out}: {parent} {why} (the export is written into an existing directory)")
    names = plan.state_names if plan is not None else list(ckpt["model"])
    if fmt == "safetensors":
        from safetensors.torch import save
        data = save({n: t.contiguous() for n, t in ckpt["model"].items()},
                    metadata={"step": str(int(ckpt["iteration"]) + 1), "format": STANDARD_TAG})
        atomic_write(out, lambda f: f.write(data), mode=EXPORT_MODE)
        return out
    hyper = trainer_hyper(plan, ckpt) if plan is not None and ckpt.get("optimizer") is not None else None
    doc = torch_doc(ckpt, names, hyper)
    tied = {a: t for a, t in plan.tied if t in doc["model"]} if plan is not None else {}
    if tied:  # every name model.state_dict() has, for load_state_dict(strict=True): one tensor
        doc["model"].update({a: doc["model"][t] for a, t in tied.items()})
        doc["ckptd"]["tied"] = tied
    if fmt == "torch":
        atomic_write(out, lambda f: torch.save(doc, f), mode=EXPORT_MODE)
        return out
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: a file is in the way; DCP writes a directory")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not an empty directory; DCP writes a directory")
    # Written whole or not at all, as a file is: into a new sibling directory, renamed into
    # place (over an empty directory too); a failure removes it, so a retry finds out as
    # it was and not a partial directory ("not an empty directory").
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with warnings.catch_warnings(), _quiet_dcp():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save(doc, checkpoint_id=str(tmp))
        os.rename(tmp, out)
    except (Exception, CheckpointException) as e:  # the latter a BaseException, per rank
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{out}: cannot write the DCP directory: {_root_cause(e)}") from None
    try:
        fsync_dir(out.parent)
    except OSError as e:  # in place, but not known to be durable: as atomic_write says of a file
        raise CheckpointWriteError(e.errno, f"{out}: cannot sync its directory: {e.strerror or e}") from None
    return out


def _root_cause(e: BaseException) -> str:
    """The innermost error's one-line message (DCP's exception lists every rank's
    traceback; an OSError from a rank is what the user can act on)."""
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    while e.__cause__ is not None:
        e = e.__cause__
    if not isinstance(e, OSError) and isinstance(e.__context__, OSError):
        # torch's writer reports a failed write (a full disk) as "[enforce fail at
        # inline_container.cc] unexpected pos ..." raised while the OSError was handled
        e = e.__context__
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}{f': {e.filename}' if e.filename else ''}"
    return " ".join(str(e).split()) or type(e).__name__


# -- finding -------------------------------------------------------------------------------
def checkpoints_in(directory: str | Path) -> list[Path]:
    """Every checkpoint-like entry of a directory: files (*.pt, *.pth, *.bin, *.safetensors)
    and DCP subdirectories, unsorted."""
    d = Path(directory)
    out = []
    for p in d.iterdir():
        if p.is_dir() and (p / ".metadata").is_file():
            out.append(p)
        elif p.is_file() and p.suffix in (".pt", ".pth", ".bin", ".safetensors"):
            out.append(p)
    return out


def find_checkpoint(directory: str | Path, iteration: int, names: list[str] | None = None) -> dict | None:
    """The checkpoint of `iteration` in a directory: ckptd's iter_NNNNNN.pt, or any of the
    trainer's files whose steps done say so (each read once per call). Two files of the
    iteration that differ are refused, naming both: which one was taken depended on their
    names (a --reference verdict flipped with a rename)."""
    from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
    d = Path(directory)
    own = d / checkpoint_name(iteration)
    found = [(own, load_checkpoint(own, names))] if own.exists() else []
    for p in sorted(checkpoints_in(d)):
        if p.name.startswith("iter_") and p.suffix == ".pt":
            continue  # ckptd's own: named by iteration, checked above
        try:
            doc = load_checkpoint(p, names)
        except CheckpointError:
            continue
        if int(doc.get("iteration", -2)) == iteration:
            found.append((p, doc))
    if not found:
        return None
    (first, doc), *others = found
    for p, other in others:
        if diffs := diff_checkpoints(doc, other, limit=1):
            raise CheckpointError(f"{d}: {first.name} and {p.name} both hold iteration {iteration} and differ "
                                  f"({diffs[0]}): keep one checkpoint of each iteration there")
    return doc
