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
import io
import math
import os
import re
import stat
import struct
import warnings
from pathlib import Path

import torch
from ckptd.core.plan import dtype_name
from ckptd.errors import CkptdError, show

CHECKPOINT_FORMAT = "ckptd-checkpoint/1"


class CheckpointError(CkptdError, ValueError):
    """A file that is not a readable ckptd checkpoint, or one that does not fit the plan."""


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:06d}.pt"


_CHECKPOINT_NAME = re.compile(r"iter_(\d{6,})\.pt")


def iteration_of_name(name: str) -> int | None:
    """The iteration a checkpoint file's name (checkpoint_name) says; None for another name."""
    m = _CHECKPOINT_NAME.fullmatch(name)
    return None if m is None else int(m.group(1))


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
    try:
        st = os.stat(path)
    except OSError:
        st = None  # not there (or unreadable): the open or rename below says why if it matters
    if st is not None and not stat.S_ISREG(st.st_mode):
        # the rename would replace the node itself: `--out /dev/full` (or /dev/stdout, a
        # FIFO) turned the device into a regular file, as root, and exited 0
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "device, FIFO or socket"
        raise CheckpointWriteError(errno.EEXIST, f"{path}: is a {kind}, not a regular file: "
                                   "give the path of a file to write")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(tmp, flags, mode)
        except FileExistsError:
            _remove_stale(tmp)  # a temporary a crash left behind: ours to remove
            fd = os.open(tmp, flags, mode)
    except OSError as e:
        raise CheckpointWriteError(e.errno, f"{path}: cannot create {tmp.name}: {e.strerror or e}") from None
    raw = None
    try:
        raw = io.FileIO(fd, "wb")
        with io.BufferedWriter(raw) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:  # torch reports a full disk as RuntimeError, not OSError
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError:
            pass  # the directory itself is unusable: the error below says why
        if raw is None:
            _close_quietly(fd)
        if not isinstance(e, Exception):  # Ctrl-C mid-write: no NAME.tmp left behind, the interrupt goes on
            raise
        cause = _oserror_in(e)
        if cause is not None:  # the real errno, not torch's "enforce fail ... unexpected pos"
            err, why = cause.errno, cause.strerror or cause
        else:
            err, why = _errno_in(e), e
        raise CheckpointWriteError(err, f"{path}: cannot write checkpoint: "
                                   + " ".join(str(why).split())[:300]) from None


def _oserror_in(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: e itself, or one in its chain. torch.save reports
    a full disk as its own RuntimeError ("[enforce fail at inline_container.cc] unexpected
    pos ..."), which names neither the cause nor its errno; but that error is raised by
    its zip writer's __exit__ while the file's OSError propagates, so Python chains the
    OSError as its __context__."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def fsync_dir(d: Path) -> None:
    """A rename into `d` made durable (OSError if the directory cannot be synced)."""
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _remove_stale(tmp: Path) -> None:
    """Remove a leftover temporary; a symlink (or anything not a regular file) there was
    put by someone else: refuse it rather than write through it or delete it."""
    st = os.lstat(tmp)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointWriteError(errno.EEXIST, "it exists and is not a regular file "
                                   "(a planted link?): refusing to write through it")
    os.unlink(tmp)


def _errno_in(e: Exception) -> int | None:
    """The errno a failed write's message names, where no OSError is chained to it."""
    text = str(e)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
        if os.strerror(code) in text:
            return code
    return None


def load_checkpoint(path: str | Path, names: list[str] | None = None, *, check_crc: bool = True) -> dict:
    """Any supported checkpoint, as a ckptd checkpoint dict. `names`: the model's parameter
    names in optimizer order (the plan's), needed for a trainer's file that does not say
    which model entries are parameters. `check_crc=False` skips verify_zip's pass over the
    file, for a caller that has just checked the whole file's hash itself (a persisted
    checkpoint against its manifest's SHA-256): a second pass would find nothing new."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e.strerror or e}") from e
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a FIFO would block the read forever
        raise CheckpointError(f"{path}: cannot read checkpoint: not a regular file or directory")
    if stat.S_ISDIR(mode) or not _is_torch_zip(path):
        from ckptd.core.formats import load_standard
        return check_checkpoint(load_standard(path, names), path)
    if check_crc:
        verify_zip(path)  # torch.load reads a damaged tensor without a word
    try:
        doc = torch_load(path)
    except Exception as e:  # torch raises many types for a bad file
        raise CheckpointError(f"{path}: cannot read checkpoint: {load_failure(e)}") from e
    return as_checkpoint(doc, path, names)


def load_failure(e: BaseException) -> str:
    """Why torch.load refused something, in one short line: its weights_only message is
    a dozen lines of advice around the reason ("Unsupported operand 60", "Unsupported
    global: GLOBAL numpy...")."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation of torch.load")[0]
        text = "not loadable as tensors and plain containers (weights_only): " + text.strip().split(". ")[0]
    elif text.startswith("Weights only load failed"):
        # torch 2.13: the advice, then the reason as a paragraph of its own ("Trying to load
        # unsupported GLOBAL posix.mkdir ..."), then where the documentation is
        reason = next((p for p in text.split("\n\n")[1:] if p.strip() and "documentation" not in p), "")
        text = "not loadable as tensors and plain containers (weights_only): " + reason.strip().split(". ")[0]
    else:
        text = text.split(". ")[0]
    text = " ".join(text.split())[:200].rstrip(".")
    return text or f"the data ends early or is not a torch.save ({type(e).__name__})"


def as_checkpoint(doc, where, names: list[str] | None = None) -> dict:
    """What torch_load read (a file, an HTTP body) as a checked ckptd checkpoint: ckptd's
    own format as it is, a trainer's through ckptd.core.formats.from_torch_doc, then
    check_checkpoint either way, so every reader gets the one-line error naming the key."""
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if isinstance(fmt, str) and fmt.startswith("ckptd-") and fmt != CHECKPOINT_FORMAT:
        # another version (or kind) of ckptd's own file: read as a trainer's, its
        # iteration was taken for steps done (one off) or a confusing complaint followed
        raise CheckpointError(f"{where}: format is {show(fmt)}; this ckptd reads {CHECKPOINT_FORMAT!r}")
    if fmt != CHECKPOINT_FORMAT:
        from ckptd.core.formats import from_torch_doc
        doc = from_torch_doc(doc, where, names)
    return check_checkpoint(doc, where)


def check_checkpoint(doc: dict, where) -> dict:
    """`doc` if it has the structure of a ckptd checkpoint (module docstring): iteration an
    integer >= -1, model a dict of name -> tensor, optimizer None or {lr, state: {name:
    {key: tensor}}[, grad_scaler]}; else CheckpointError naming `where` and the key. What
    reads one (the shadow, export, verify) can then rely on it."""
    it = doc.get("iteration")
    if isinstance(it, bool) or not isinstance(it, int) or it < -1:
        raise CheckpointError(f"{where}: iteration must be an integer >= -1, not {_short(it)}")
    model = doc.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{where}: model is {_short(model)}, not a dict of parameter name -> tensor")
    for k, t in model.items():
        if not isinstance(k, str):
            raise CheckpointError(f"{where}: model key {_short(k)} is not a parameter name (a str)")
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{where}: model.{k} is {_short(t)}, not a tensor")
        _check_dense(t, f"model.{k}", where)
    opt = doc.get("optimizer")
    if opt is None:
        return doc
    if not isinstance(opt, dict):
        raise CheckpointError(f"{where}: optimizer is {_short(opt)}, not None or a dict {{lr, state}}")
    state = opt.get("state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: optimizer.state is {_short(state)}, not a dict of parameter "
                              f"name -> its state")
    _check_lr(opt.get("lr"), where)
    for n, st in state.items():
        if not isinstance(n, str):
            raise CheckpointError(f"{where}: optimizer.state key {_short(n)} is not a parameter name (a str)")
        if not isinstance(st, dict):
            raise CheckpointError(f"{where}: optimizer.state lacks a dict of tensors for {n!r} "
                                  f"(it holds {_short(st)})")
        _check_values(st, f"optimizer.state.{n}", where)
        _check_step(st.get("step"), f"optimizer.state.{n}.step", it, where)
    scaler = opt.get("grad_scaler")
    if scaler is not None:
        if not isinstance(scaler, dict):
            raise CheckpointError(f"{where}: optimizer.grad_scaler is {_short(scaler)}, not a dict")
        _check_values(scaler, "optimizer.grad_scaler", where)
    return doc


def _check_lr(lr, where) -> None:
    """A checkpoint's lr (None, or what goes into torch's param_groups on export and
    restore): one finite number >= 0. NaN, an infinity or a negative lr is a damaged
    checkpoint (no torch optimizer is built with one; the plan's lr is held to the same)
    and was exported and restored as it was."""
    if lr is None:
        return
    if isinstance(lr, bool) or not isinstance(lr, (int, float, torch.Tensor)):
        raise CheckpointError(f"{where}: optimizer.lr is {_short(lr)}, not a number")
    if isinstance(lr, torch.Tensor):
        _check_dense(lr, "optimizer.lr", where)
        if lr.numel() != 1:  # verify compares it as it is; export (with a plan) refuses it
            return
        if lr.is_complex() or lr.dtype == torch.bool:
            raise CheckpointError(f"{where}: optimizer.lr is {_short(lr)}, not a number")
    try:
        value, shown = float(lr), None
    except OverflowError:  # an int past float's range
        value, shown = math.inf, _short(lr)
    if not math.isfinite(value) or value < 0:
        raise CheckpointError(f"{where}: optimizer.lr is {shown or repr(value)}, not a finite lr >= 0: "
                              "a damaged checkpoint")


def _check_step(step, key: str, iteration: int, where) -> None:
    """A parameter's optimizer step count: a whole number from 0 to the steps the
    checkpoint's iteration has done (iteration + 1; fewer where steps were skipped: AMP's
    inf steps, a parameter unused so far). A trainer's file was held to this
    (ckptd.core.formats._steps) and ckptd's own was not: a NaN step was restored and the
    job's next step made every weight NaN, a step of 100 at iteration 1 bias-corrected
    Adam wrongly from then on."""
    if step is None:
        return
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_complex() or step.dtype == torch.bool:
            raise CheckpointError(f"{where}: {key} is {_short(step)}, not a count of steps")
        step = step.item()
    value = float(step)
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise CheckpointError(f"{where}: {key} is {value!r}, not a count of steps")
    if value > iteration + 1:
        raise CheckpointError(f"{where}: {key} is {int(value)}, more steps than iteration {iteration} has done "
                              f"({iteration + 1}): a damaged checkpoint")


def _check_values(d: dict, key: str, where) -> None:
    """Every value of d a tensor (or a plain number, as older torch keeps a step)."""
    for k, v in d.items():
        if not isinstance(k, str):
            raise CheckpointError(f"{where}: {key} key {_short(k)} is not a str")
        if v is not None and not isinstance(v, (torch.Tensor, int, float)):
            raise CheckpointError(f"{where}: {key}.{k} is {_short(v)}, not a tensor")
        if isinstance(v, torch.Tensor):
            _check_dense(v, f"{key}.{k}", where)


def _check_dense(t: torch.Tensor, key: str, where) -> None:
    """A tensor with its elements on the CPU, as the shadow, verify and export read them: a
    meta tensor (saved from a model built on device="meta") has no data and a sparse or
    quantized one no plain layout; each raised from torch deep inside a replay, verify or
    export (or was exported as it was, without its data)."""
    if t.is_meta or t.layout != torch.strided or t.is_quantized or t.device.type != "cpu":
        kind = "meta" if t.is_meta else "quantized" if t.is_quantized else \
            str(t.layout).removeprefix("torch.") if t.layout != torch.strided else t.device.type
        raise CheckpointError(f"{where}: {key} is a {kind} tensor {dtype_name(t.dtype)}"
                              f"{list(t.shape)}, not a dense tensor with its data")


def _short(v, width: int = 60) -> str:
    """A value from a checkpoint for a structure error: ckptd.errors.show (never walks a
    container: a pickle can share one list many times over), a tensor by dtype and shape
    (never its elements; errors.py does not import torch), and a number or string with
    its type, as what is wrong in a structure is the type ("model.w is an int 1")."""
    if isinstance(v, torch.Tensor):
        return f"a tensor {dtype_name(v.dtype)}{list(v.shape)}"
    text = show(v, width)
    if isinstance(v, (bool, float, str)) or isinstance(v, int) and v.bit_length() <= 64:
        kind = type(v).__name__
        return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} {text}"
    return text  # None, or show names the type (a list of 3 item(s), an integer of 90 bits)


def verify_zip(path: Path) -> None:
    """Every member of a zip checkpoint has the CRC-32 its central directory records, else
    CheckpointError naming the file and the member: torch.load checks none, so a flipped
    bit in a tensor loads as a wrong checkpoint. torch.save stores its members
    uncompressed: those are checked in place (the file mapped, no copy) by the project's
    fast CRC (the same polynomial: 0.04-0.08 s for a 504 MB file in the page cache, against
    0.16-0.27 s for its torch.load and 0.20-0.30 s for zipfile's testzip); a compressed member
    (another writer's zip) is read through zipfile, which checks it."""
    import mmap
    import struct
    import zipfile
    import zlib
    member = None
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:
                    member = info.filename
                    with z.open(info) as m:  # checks the CRC-32 at its end
                        while m.read(1 << 24):
                            pass
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, ValueError) as e:
        where = f"member {member}: " if member else ""
        raise CheckpointError(f"{path}: {where}cannot read checkpoint: damaged zip archive "
                              f"({_zip_why(e)})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e.strerror or e}") from None
    stored = [i for i in infos if i.compress_type == zipfile.ZIP_STORED and i.file_size]
    if not stored:
        return
    crc = _crc32()
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if hasattr(mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            data = memoryview(mm)
            try:
                size = len(data)
                for info in stored:
                    at = info.header_offset
                    if at + 30 > size or data[at:at + 4] != b"PK\x03\x04":
                        raise CheckpointError(f"{path}: member {info.filename}: no local header at "
                                              f"offset {at}: damaged zip archive")
                    name_len, extra_len = struct.unpack_from("<HH", data, at + 26)
                    start = at + 30 + name_len + extra_len
                    if info.compress_size != info.file_size or start + info.file_size > size:
                        raise CheckpointError(f"{path}: member {info.filename}: its {info.file_size} bytes "
                                              f"run past the end of the file (truncated?)")
                    got = crc(data[start:start + info.file_size])
                    if got != info.CRC:
                        raise CheckpointError(f"{path}: member {info.filename}: CRC-32 {got:08x}, the zip "
                                              f"directory says {info.CRC:08x}: the file is damaged")
            finally:
                data.release()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e.strerror or e}") from None


def _zip_why(e: Exception) -> str:
    return " ".join(str(e).split())[:120] or type(e).__name__


def _crc32():
    """zlib.crc32 of a buffer, by the fastest CRC this CPU has (cython_ext's kernel)."""
    try:
        from cython_ext import batch as kernel
        from ckptd.fast.icrc import crc_setting
        impl, external = crc_setting("auto")
    except (ImportError, ValueError):  # no kernel built: zlib's own
        import zlib
        return zlib.crc32

    def crc(view: memoryview) -> int:
        return kernel.crc32(view, 0, impl, external)
    return crc


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
    groups = param_groups_of(sd, where)
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


def set_group_lrs(groups: list[dict], lr: float | None) -> None:
    """Each param group's lr from a checkpoint's one lr, the first group's: torch's lr
    schedulers scale every group's base lr (`initial_lr` once a scheduler is attached,
    else its lr) by the same factor, so the others follow from the first's."""
    if lr is None or not groups:
        return
    base = groups[0].get("initial_lr", groups[0]["lr"])
    for g in groups[1:] if base else []:  # (a first group of lr 0 gives no factor)
        g["lr"] = g.get("initial_lr", g["lr"]) * (lr / base)
    groups[0]["lr"] = lr


# optimizer state with the parameter's shape and dtype (Adam's moments, SGD's momentum, ...)
PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "sum",
                "acc_delta", "grad_avg", "ax", "prev", "step_size", "exp_inf")


def param_groups_of(sd: dict, where) -> list[dict]:
    """An optimizer.state_dict()'s param_groups, checked: a list of dicts whose "params"
    (and "param_names", where given) are lists."""
    groups = sd.get("param_groups")
    if groups is None:
        return []
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{where}: optimizer.param_groups is {_short(groups)}, not a list of dicts")
    for k, g in enumerate(groups):
        for key in ("params", "param_names"):
            if key in g and not isinstance(g[key], list):
                raise CheckpointError(f"{where}: optimizer.param_groups[{k}].{key} is {_short(g[key])}, not a list")
    return groups


def check_state_tensors(optimizer, model, saved: dict[str, dict[str, tuple]], where: str) -> None:
    """Refuse per-parameter optimizer state that load_state_dict would take without a
    word and the next step would trip over or silently convert: `saved` is parameter
    name -> {key: (dtype, shape)} of the checkpoint's tensors. A moment (PARAM_SHAPED)
    must have its parameter's shape and dtype (torch would cast another dtype on load);
    a step count one element; another key the shape the optimizer already holds, else
    no more elements than its parameter (which bounds what a reader allocates)."""
    params = dict(model.named_parameters())
    for n, keys in saved.items():
        p = params.get(n)
        if p is None:
            raise CheckpointError(f"{where}: optimizer state for {n}, a parameter the model does not have")
        have = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, (dtype, shape) in keys.items():
            shape, numel = list(shape), 1
            for s in shape:
                numel *= s
            held = have.get(key)
            if key in PARAM_SHAPED:
                want, want_dtype = list(p.shape), p.dtype
            elif isinstance(held, torch.Tensor):
                want, want_dtype = list(held.shape), None
            elif key == "step":
                want, want_dtype = (shape if numel == 1 else []), None
            else:
                want, want_dtype = (shape if numel <= max(1, p.numel()) else list(p.shape)), None
            if shape != want or want_dtype is not None and dtype != want_dtype:
                shown = dtype_name(want_dtype or dtype)
                raise CheckpointError(f"{where}: optimizer state {n}.{key} is {dtype_name(dtype)}{shape}, "
                                      f"the parameter's is {shown}{want}")


def optimizer_params_in(optimizer, model, where: str) -> None:
    """Refuse an optimizer holding a tensor that is not one of the model's parameters (its
    state could not be named, so it would not be restored)."""
    mine = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for q in group["params"]:
            if id(q) not in mine:
                raise CheckpointError(f"{where}: the optimizer's param group {g} holds a "
                                      f"{dtype_name(q.dtype)}{list(q.shape)} tensor that is not a parameter "
                                      f"of the model: its state cannot be named")


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

        def closure():  # for a class whose step needs one (LBFGS): the loss, its gradient set
            probe_param.grad = torch.ones(1)
            return torch.ones(())
        try:
            probe.step()
        except Exception:  # noqa: BLE001 -- then with a closure (an LBFGS "restored" AdamW state unchecked)
            probe.step(closure)
    except Exception:  # noqa: BLE001 -- an optimizer the probe cannot build or step: unchecked
        return None
    return {k for k, v in probe.state[probe_param].items() if v is not None}


# What a trainer's file holds beside model and optimizer state (ckptd.core.formats
# from_torch_doc), compared where both checkpoints hold it: ckptd's own format holds none
# of them (the plan has the hyperparameters), and a trainer's file against ckptd's differs
# in that by design.
TRAINER_ENTRIES = ("param_groups", "lr_scheduler", "scaler")


def diff_checkpoints(a: dict, b: dict, limit: int = 10) -> list[str]:
    """Names of what differs between two checkpoints, bit for bit; empty if identical.
    The TRAINER_ENTRIES are compared where both hold them (`one_sided` names the others)."""
    out: list[str] = []
    if a.get("iteration") != b.get("iteration"):
        out.append(f"iteration: {a.get('iteration')} != {b.get('iteration')}")
    _diff(a.get("model"), b.get("model"), "model", out)
    _diff(a.get("optimizer"), b.get("optimizer"), "optimizer", out)
    for key in TRAINER_ENTRIES:
        if a.get(key) is not None and b.get(key) is not None:
            _diff(a[key], b[key], key, out)
    return out[:limit] if limit else out


def one_sided(a: dict, b: dict) -> list[str]:
    """The TRAINER_ENTRIES only one of two checkpoints holds, each as `key (only in
    first|second)`: not compared by diff_checkpoints."""
    return [f"{k} (only in {'first' if a.get(k) is not None else 'second'})" for k in TRAINER_ENTRIES
            if (a.get(k) is None) != (b.get(k) is None)]


def _diff(x, y, where: str, out: list[str]):
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(set(x) | set(y), key=str):
            if k not in x or k not in y:
                out.append(f"{where}.{k}: only in {'second' if k not in x else 'first'}")
            else:
                _diff(x[k], y[k], f"{where}.{k}", out)
    elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):  # (param_groups[0].betas[1]: where, not "a tuple")
            _diff(u, v, f"{where}[{i}]", out)
    elif isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{where}: {x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}")
        elif not _bits_equal(x, y):
            ne = (_as_bits(x) != _as_bits(y)).flatten().nonzero()
            out.append(f"{where}: {ne.numel()} of {x.numel()} elements differ, first at flat index "
                       f"{int(ne[0])}")
    elif not _same(x, y):
        out.append(f"{where}: {_brief(x)} != {_brief(y)}")


def _same(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):  # bit for bit, as tensors: -0.0 is not 0.0
        return struct.pack("<d", x) == struct.pack("<d", y) or (x != x and y != y)
    try:
        return bool(x == y)  # a 1-element tensor against its number: equal
    except Exception:  # noqa: BLE001 -- a tensor against a number, lists of tensors: no truth value
        return False


def _brief(v) -> str:
    """A value in a difference line: the value itself (no type, as _short gives), short,
    and never a tensor's elements."""
    return _short(v, 40) if isinstance(v, torch.Tensor) else show(v, 40)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(view)


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return bool(torch.equal(_as_bits(x), _as_bits(y)))
