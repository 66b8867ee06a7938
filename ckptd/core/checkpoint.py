"""Checkpoint files: the model and optimizer state after one iteration.

One format serves the shadow, the synthesizer's reference trainer and `ckptd verify`:
a torch.save'd dict {format, iteration, model: {name: tensor}, optimizer: {lr,
state: {name: {step, exp_avg, exp_avg_sq[, max_exp_avg_sq]}}}}. Tensors are keyed by
parameter name so two checkpoints compare without knowing either's object layout.
A checkpoint is written to a temporary name and renamed: a file that exists is whole.

`load_checkpoint` also reads the standard formats a trainer writes (ckptd.core.formats:
a torch.save of {"model", "optimizer", "step"/"iteration", ...}, a torch.distributed.checkpoint
directory, safetensors weights) and returns them in this format. Optimizer state moves
between the two layouts through one pair of functions, `torch_optimizer_state` and
`named_optimizer_state`: torch keys state by parameter index, ckptd by name; each
parameter's state is a dict of tensors whatever the optimizer, so new optimizers fit.
"""
from __future__ import annotations

import errno
import os
import stat
import warnings
from pathlib import Path

import torch
from ckptd.errors import CkptdError

CHECKPOINT_FORMAT = "ckptd-checkpoint/1"


class CheckpointError(CkptdError, ValueError):
    """A file that is not a readable ckptd checkpoint, or one that does not fit the plan."""


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}.pt"


class CheckpointWriteError(CkptdError, OSError):
    """A checkpoint could not be written (disk full, read-only, out of descriptors, a
    planted link); nothing was left under the final name, nor a partial temporary."""

    def __str__(self):
        return str(self.strerror)


def save_checkpoint(path: str | Path, iteration: int, model: dict, optimizer: dict | None):
    atomic_write(path, lambda f: write_checkpoint(f, iteration, model, optimizer))


def write_checkpoint(f, iteration: int, model: dict, optimizer: dict | None):
    """A ckptd checkpoint into an open binary file (anything with write())."""
    doc = {"format": CHECKPOINT_FORMAT, "iteration": iteration, "model": model, "optimizer": optimizer}
    torch.save(doc, f)


def atomic_write(path: str | Path, write, mode: int = 0o600) -> None:
    """Write a file so that it exists whole or not at all, and stays after a crash:
    `write(f)` fills a new temporary (`NAME.tmp` beside it, created with O_EXCL and
    O_NOFOLLOW, so a symlink planted there is refused instead of followed, and with
    `mode`), which is fsynced, renamed over `path`, and the directory fsynced so the
    rename itself is durable. Any failure removes the temporary and raises
    CheckpointWriteError naming the file and the cause (errno kept)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(tmp, flags, mode)
        except FileExistsError:
            _remove_stale(tmp)  # a temporary a crash left behind: ours to remove
            fd = os.open(tmp, flags, mode)
    except OSError as e:
        raise CheckpointWriteError(e.errno, f"{path}: cannot create {tmp.name}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except Exception as e:  # torch reports a full disk as RuntimeError, not OSError
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError:
            pass  # the directory itself is unusable: the error below says why
        err = e.errno if isinstance(e, OSError) else _errno_in(e)
        raise CheckpointWriteError(err, f"{path}: cannot write checkpoint: "
                                   + " ".join(str(getattr(e, "strerror", None) or e).split())[:300]) from None


def _remove_stale(tmp: Path) -> None:
    """Remove a leftover temporary; a symlink (or anything not a regular file) there was
    put by someone else: refuse it rather than write through it or delete it."""
    st = os.lstat(tmp)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointWriteError(errno.EEXIST, "it exists and is not a regular file "
                                   "(a planted link?): refusing to write through it")
    os.unlink(tmp)


def _errno_in(e: Exception) -> int | None:
    """The errno behind torch's RuntimeError for a failed write, where it says one."""
    cause = e.__cause__ or e.__context__
    if isinstance(cause, OSError):
        return cause.errno
    text = str(e)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
        if os.strerror(code) in text:
            return code
    return None


def load_checkpoint(path: str | Path, names: list[str] | None = None) -> dict:
    """Any supported checkpoint, as a ckptd checkpoint dict. `names`: the model's parameter
    names in optimizer order (the plan's), needed for a trainer's file that does not say
    which model entries are parameters."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e.strerror or e}") from e
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a FIFO would block the read forever
        raise CheckpointError(f"{path}: cannot read checkpoint: not a regular file or directory")
    if path.is_dir() or not _is_torch_zip(path):
        from ckptd.core.formats import load_standard
        return load_standard(path, names)
    try:
        doc = torch_load(path)
    except Exception as e:  # torch raises many types for a bad file
        raise CheckpointError(f"{path}: cannot read checkpoint: {e}") from e
    if isinstance(doc, dict) and doc.get("format") == CHECKPOINT_FORMAT:
        return doc
    from ckptd.core.formats import from_torch_doc
    return from_torch_doc(doc, path, names)


def torch_load(src):
    """torch.load of tensors and plain containers only (weights_only), on the CPU. A bad
    file is the caller's one-line error: torch's own warnings about it (a legacy header,
    an unknown pickle protocol) are not printed beside that line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(src, map_location="cpu", weights_only=True)


def _is_torch_zip(path: Path) -> bool:
    """torch.save's zip container (what ckptd and most trainers write)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e.strerror or e}") from e


def torch_optimizer_state(named: dict | None, names: list[str],
                          param_groups: list[dict] | None = None) -> dict:
    """ckptd's {lr, state: {name: {key: tensor}}} as torch's optimizer.state_dict():
    {state: {index: {key: tensor}}, param_groups}. Index i is names[i], the order the
    trainer's optimizer holds its parameters in. `param_groups` (torch's, with every
    hyperparameter) make the result loadable by optimizer.load_state_dict; without them
    one group carries the lr and the indices."""
    named = named or {"lr": None, "state": {}}
    state = {i: dict(named["state"][n]) for i, n in enumerate(names) if n in named["state"]}
    if param_groups is None:
        param_groups = [{"lr": named.get("lr"), "params": list(range(len(names)))}]
    return {"state": state, "param_groups": param_groups}


def named_optimizer_state(sd: dict, names: list[str] | None, where: str) -> dict:
    """torch's optimizer.state_dict() (state keyed by index, or by name as
    torch.distributed.checkpoint.state_dict writes it) as ckptd's {lr, state: {name: ...}}."""
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict):
        raise CheckpointError(f"{where}: 'optimizer' is not an optimizer.state_dict() (no 'state')")
    groups = sd.get("param_groups") or []
    order: list = [i for g in groups for i in g.get("params", [])]
    given = [n for g in groups for n in g.get("param_names", [])]
    if len(given) == len(order) and given:
        names = given
    position = {str(i): k for k, i in enumerate(order)}
    state = {}
    for key, st in sd["state"].items():
        if not isinstance(st, dict):
            raise CheckpointError(f"{where}: optimizer state of {key!r} is not a dict")
        k = position.get(str(key))
        if k is None and isinstance(key, str) and not key.isdigit():
            state[key] = dict(st)  # keyed by name already
            continue
        if k is None:
            raise CheckpointError(f"{where}: optimizer state for parameter index {key} that no "
                                  f"param_group lists")
        if names is None or k >= len(names):
            raise CheckpointError(f"{where}: cannot tell which parameter optimizer index {key} is "
                                  f"(the file does not name its parameters): pass the plan")
        state[names[k]] = dict(st)
    lr = groups[0].get("lr") if groups else None
    return {"lr": float(lr) if isinstance(lr, (int, float)) else lr, "state": state}


def check_optimizer_fits(optimizer, model, saved_keys: dict[str, set[str]], where: str) -> None:
    """Refuse optimizer state that `optimizer` would not keep: Adam's exp_avg/exp_avg_sq
    loaded into an SGD, or a state without max_exp_avg_sq into an amsgrad Adam, loads
    without a word (load_state_dict copies whatever keys it is given) and the job goes on
    with an optimizer state that is not the checkpoint's. `saved_keys`: parameter name
    -> the state keys the checkpoint holds for it. What a group keeps is found by one step
    of its class, with its settings, on a 1-element probe; a class that cannot be probed
    so (a custom optimizer with a required argument) is not checked."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    for g, group in enumerate(optimizer.param_groups):
        names = [name_of.get(id(q)) for q in group["params"]]
        saved = {n: saved_keys[n] for n in names if saved_keys.get(n)}
        if not saved:
            continue
        keeps = _state_keys_kept(optimizer, group)
        if keeps is None:
            continue
        for n, keys in saved.items():
            if keys != keeps:
                settings = {k: v for k, v in group.items() if k in ("momentum", "amsgrad", "centered", "nesterov")}
                raise CheckpointError(
                    f"{where}: the optimizer state of {n} holds {sorted(keys)}, but this "
                    f"{type(optimizer).__name__}{' ' + str(settings) if settings else ''} (param group {g}) "
                    f"keeps {sorted(keeps)}: the checkpoint is of another optimizer or setting")


def _state_keys_kept(optimizer, group: dict) -> set[str] | None:
    import inspect
    try:
        accepted = inspect.signature(type(optimizer)).parameters
        args = {k: v for k, v in group.items() if k != "params" and k in accepted}
        probe_param = torch.zeros(1, requires_grad=True)
        probe = type(optimizer)([probe_param], **args)
        probe_param.grad = torch.ones(1)
        probe.step()
    except Exception:  # noqa: BLE001 -- an optimizer the probe cannot build or step: unchecked
        return None
    return {k for k, v in probe.state[probe_param].items() if v is not None}


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
