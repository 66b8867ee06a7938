"""The trainer's side of recovery: put a checkpoint back into a live model and optimizer.

    import ckptd
    r = ckptd.restore(model, optimizer, "http://ckpt-host:9187", scheduler=sched, token=...)
    for step in range(r.step, total_steps): ...

`source` is a checkpoint file or DCP directory (any format ckptd.core.checkpoint reads), a
directory of checkpoints (the newest one that loads whole: a persisted tier's manifest
first, else by iteration), the daemon's URL (its in-memory latest state, streamed), or
the fsspec URL a persistence tier writes to (`persist_url`: memory://, s3://bucket/prefix,
...; the manifest's newest entry that verifies against its digests).
Call it on every rank, before or after wrapping the model in DDP or torch.compile (a
wrapper is unwrapped: the state goes into the plain model's tensors, which the wrapper
holds), before the first step.
"""
from __future__ import annotations

import contextlib
import hashlib
import http.client
import io
import logging
import os
import re
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ckptd.core.checkpoint import (CheckpointError, as_checkpoint, check_optimizer_fits, check_state_tensors,
                                   load_checkpoint, load_failure, optimizer_params_in, set_group_lrs, torch_load)
from ckptd.core.finite import diverged_state, first_nonfinite, nonfinite_in, refused_state
from ckptd.core.store import redact
from ckptd.core.wrappers import unwrap
from ckptd.errors import show

log = logging.getLogger("ckptd.recovery")
URL = re.compile(r"^https?://", re.I)


@dataclass
class Restored:
    iteration: int  # ckptd's number of the last iteration in the state (-1: initial)
    source: str
    buffers_not_restored: list[str] = field(default_factory=list)  # the checkpoint lacks them (not captured)
    seconds: float = 0.0
    bytes: int = 0
    # the first parameter holding NaN or inf: the job had diverged by this state
    # (ckptd.core.finite; docs/DAEMON.md "A job that diverges")
    nonfinite: str | None = None

    @property
    def step(self) -> int:
        """Optimizer steps done: the loop resumes at this step index."""
        return self.iteration + 1


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, source: str | os.PathLike,
            scheduler=None, token: str | None = None, timeout: float = 120.0,
            all_or_nothing: bool = False, finite: bool = False) -> Restored:
    """From the daemon's URL the state is read straight into the model's tensors
    (ckptd.restore_raw: if the connection breaks mid-body, the CheckpointError says the
    model now holds a partial state, unless `all_or_nothing`, which stages it in fresh
    memory first at the cost of one more pass). Other sources are loaded whole first.
    `timeout` bounds an HTTP source's connect and each read, not the whole transfer: a
    large body on a slow link is not cut off while its bytes flow.
    `finite`: only a state whose parameters are all finite, as a job that diverged needs
    (docs/DAEMON.md "A job that diverges"): a directory or persisted URL gives its newest
    such checkpoint; a file, or the daemon's latest state, that holds NaN or inf is
    refused (CheckpointError) with the model unchanged (the daemon's state is read into
    fresh memory first, as with all_or_nothing)."""
    import time
    t0 = time.perf_counter()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ckptd.restore: model must be a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ckptd.restore: optimizer must be a torch.optim.Optimizer or None, "
                        f"not {type(optimizer).__name__}")
    # a checkpoint names tensors as the plain model does; DDP's and torch.compile's
    # wrappers hold that model's very tensors under prefixed names
    if not isinstance(source, (str, os.PathLike)):  # str() of None, 3 or b"..." named no file it was
        raise TypeError(f"ckptd.restore: source must be a str or os.PathLike (a checkpoint file, directory "
                        f"or URL), not {type(source).__name__}")
    model, _ = unwrap(model)
    meta = next((n for n, t in model.state_dict().items() if isinstance(t, torch.Tensor) and t.is_meta), None)
    if meta is not None:  # (torch's "Tensor.item() cannot be called on meta tensors" came out of the load)
        raise TypeError(f"ckptd.restore: the model's {meta} is on the meta device (no data to restore into): "
                        "build the model on a real device (model.to_empty(device=...)) first")
    names = [n for n, _ in model.named_parameters()]
    limit = body_limit(model)
    src = str(source)
    if not src.strip():
        raise CheckpointError("ckptd.restore: source is empty (a checkpoint file, directory or URL)")
    if optimizer is not None:
        optimizer_params_in(optimizer, model, src)
    from_daemon = URL.match(src) is not None
    if scheduler is not None and from_daemon:  # (a file's is checked before anything changes)
        _check_fresh(scheduler)
    if from_daemon:  # the raw layout is checked whole before a byte reaches the model
        ckpt, missing_buffers, nbytes = _from_daemon(model, optimizer, scheduler, src, names, token, timeout,
                                                     all_or_nothing, limit, finite)
        replayed = scheduler is not None and _replay_scheduler(scheduler, ckpt, src)
    else:
        ckpt, src, nbytes = load_source(src, names, token, timeout, limit, finite)
        _check_fits(model, optimizer, scheduler, ckpt, src)  # before anything changes
        replayed = scheduler is not None and _replay_scheduler(scheduler, ckpt, src)  # (or refused, unchanged)
        missing_buffers = _load_model(model, ckpt)
    if optimizer is not None:  # (a replayed scheduler has set the next step's hyperparameters)
        _load_optimizer(model, optimizer, ckpt, src, adopt=from_daemon, keep_hyper=replayed)
    if scheduler is not None and not replayed:
        scheduler.load_state_dict(ckpt["lr_scheduler"])  # the trainer's own, checked by _check_fits
        last = ckpt["lr_scheduler"].get("_last_lr")  # every group's lr for the next step, as the trainer's
        if isinstance(last, list) and len(last) == len(scheduler.optimizer.param_groups) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in last):
            for g, v in zip(scheduler.optimizer.param_groups, last):
                g["lr"] = v
    if missing_buffers:
        log.warning("buffers not restored (not captured in this checkpoint): %s", ", ".join(missing_buffers[:10]))
    nonfinite = first_nonfinite(model.named_parameters())
    if nonfinite:
        log.warning("%s; a checkpoint from before is the one to resume from (restore(..., finite=True) from a "
                    "checkpoint directory takes the newest finite one, which the daemon's retention keeps)",
                    diverged_state(src, nonfinite, ckpt["iteration"]))
    return Restored(int(ckpt["iteration"]), src, missing_buffers, time.perf_counter() - t0, nbytes, nonfinite)


def body_limit(model: torch.nn.Module) -> int:
    """The most bytes a checkpoint of `model` fetched over HTTP may take (body_limit_of)."""
    return body_limit_of(sum(t.numel() * t.element_size() for t in model.state_dict().values()))


def body_limit_of(state_bytes: int) -> int:
    """The most bytes a checkpoint of a model whose state takes `state_bytes` may take
    over HTTP: that eight times over (Adam's two moments, amsgrad's third, room to
    spare) and 256 MiB. A body past it (a lying Content-Length, an endless body) is
    refused before it fills the reader's memory."""
    return 8 * state_bytes + (256 << 20)


def _from_daemon(model, optimizer, scheduler, url: str, names: list[str], token: str | None, timeout: float,
                 all_or_nothing: bool, limit: int | None = None, finite: bool = False) -> tuple[dict, list[str], int]:
    """(the checkpoint less the model's tensors, which are read in place; buffers not
    restored; bytes read). A daemon that answers in torch.save format (an older one) is
    loaded whole, as fetch() does."""
    from ckptd.core.raw_layout import MEDIA_TYPE
    from ckptd.restore_raw import read_into_model
    with _request(url, token or os.environ.get("CKPTD_TOKEN"), timeout, MEDIA_TYPE) as (resp, url):
        if resp.headers.get_content_type() != MEDIA_TYPE:
            ckpt, n = _torch_body(resp, url, names, limit)
            if finite:
                _refuse_nonfinite(ckpt, url)
            _check_fits(model, optimizer, scheduler, ckpt, url)
            return ckpt, _load_model(model, ckpt), n
        return read_into_model(resp, model, optimizer, url, all_or_nothing or finite, finite)


def _check_fits(model, optimizer, scheduler, ckpt: dict, where: str) -> None:
    """Everything restore() will load checked against the model, optimizer and scheduler
    first, so that a refusal leaves all three as they were: the model's entries (as
    _load_model checks them), the optimizer's state (its kind, each tensor's shape and
    dtype), the scheduler's saved state."""
    _check_model(model, ckpt, where)
    named = ckpt.get("optimizer")
    if optimizer is not None:
        if named is None:
            raise CheckpointError(f"{where}: holds no optimizer state (weights only)")
        check_optimizer_fits(optimizer, model, {n: {k for k, v in st.items() if v is not None}
                                                for n, st in named["state"].items()}, where)
        check_state_tensors(optimizer, model, {n: {k: (v.dtype, list(v.shape)) for k, v in st.items()
                                                   if isinstance(v, torch.Tensor)}
                                               for n, st in named["state"].items()}, where)
    if scheduler is not None:
        _check_scheduler(scheduler, optimizer, ckpt.get("lr_scheduler"), where)


def _check_scheduler(scheduler, optimizer, saved, where: str) -> None:
    """A scheduler's saved state_dict (one with base_lrs, which _load_scheduler loads
    whole) must be this scheduler's kind: LRScheduler.load_state_dict sets every key as
    an attribute, so a StepLR's state loaded into a CosineAnnealingLR leaves a hybrid of
    the two without a word."""
    if saved is not None and not isinstance(saved, dict):  # not silently rebuilt from the step count
        raise CheckpointError(f"{where}: lr_scheduler is {show(saved)}, not a scheduler's state_dict")
    if not (isinstance(saved, dict) and "base_lrs" in saved):
        return
    own = scheduler.state_dict()
    # its public settings name the kind (StepLR's step_size, gamma; CosineAnnealingLR's
    # T_max, eta_min); private keys come and go between torch versions, and the daemon's
    # torch need not be the trainer's
    foreign = sorted(str(k) for k in saved if k not in own and not str(k).startswith("_"))
    if foreign:
        raise CheckpointError(f"{where}: lr_scheduler holds {foreign[:5]}, which this "
                              f"{type(scheduler).__name__} does not have: the checkpoint is of another scheduler")
    base = saved["base_lrs"]
    groups = len(optimizer.param_groups) if optimizer is not None else len(own.get("base_lrs") or [])
    if not isinstance(base, list) or len(base) != groups or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in base):
        raise CheckpointError(f"{where}: lr_scheduler.base_lrs is {show(base)}, not one number per "
                              f"param group ({groups})")
    for key in ("last_epoch", "_step_count"):
        v = saved.get(key)
        if key in saved and (isinstance(v, bool) or not isinstance(v, int)):
            raise CheckpointError(f"{where}: lr_scheduler.{key} is {show(v)}, not an integer")


def load_source(src: str, names: list[str] | None, token: str | None = None,
                timeout: float = 120.0, limit: int | None = None, finite: bool = False) -> tuple[dict, str, int]:
    """Any source restore() takes, as (checkpoint, where it came from, bytes fetched);
    limit: the most bytes an HTTP body may take (body_limit), or None. `finite`: as
    restore() takes it."""
    src = str(src)
    if URL.match(src):
        ckpt, n = fetch(src, names, token or os.environ.get("CKPTD_TOKEN"), timeout, limit)
    elif "://" in src:
        return (*newest_at_url(src, finite), 0)
    elif Path(src).is_dir() and not (Path(src) / ".metadata").is_file():
        return (*newest_in(Path(src), names, finite), 0)
    else:
        ckpt, n = load_checkpoint(src, names), 0
    if finite:
        _refuse_nonfinite(ckpt, src)
    return ckpt, src, n


def _refuse_nonfinite(ckpt: dict, where: str) -> None:
    if bad := nonfinite_in(ckpt):
        raise CheckpointError(refused_state(where, bad, ckpt.get("iteration")))


def newest_at_url(url: str, finite: bool = False) -> tuple[dict, str]:
    """The newest checkpoint a persistence tier's manifest at an fsspec URL lists that
    verifies (file SHA-256, every tensor's digest), with `finite` the newest finite one;
    messages never show credentials."""
    from ckptd.core.store import READ_ONLY_PROTOCOLS, open_store, redact
    from ckptd.core.manifest import newest_verified, read_manifest
    protocol = url.split("://", 1)[0].lower()
    if protocol in READ_ONLY_PROTOCOLS:  # ("not enough values to unpack", the working directory's name)
        raise CheckpointError(f"{redact(url)}: fsspec only reads {protocol}://, where no persistence tier writes: "
                              "give the tier's persist_url, or the daemon's http:// URL")
    try:
        store = open_store(url)
        store.check_bucket()  # a missing bucket named as such, not as "no manifest"
        got = newest_verified(store, finite)
        if got is None and read_manifest(store) is None:  # why, read only then (it said "no manifest entry there verifies")
            why = "no such directory" if store.local and not store.path.is_dir() else \
                "holds no manifest.json: no persistence tier writes there"
            raise CheckpointError(f"{redact(url)}: {why}")
    except (OSError, ValueError) as e:
        raise CheckpointError(redact(" ".join(str(e).split()))) from None
    if got is None:
        raise CheckpointError(f"{redact(url)}: no manifest entry there verifies"
                              + " and holds a finite state" * finite)
    return got[0], store.where(got[1]["file"])


def fetch(url: str, names: list[str] | None, token: str | None, timeout: float,
          limit: int | None = None) -> tuple[dict, int]:
    """The daemon's latest state: GET <url>/checkpoint (a URL naming a path is used as is)."""
    with _request(url, token, timeout, "application/octet-stream") as (resp, url):
        return _torch_body(resp, url, names, limit)


class _TokenStaysHome(urllib.request.HTTPRedirectHandler):
    """Redirects are followed within the daemon's origin only while a token is sent:
    urllib hands every request header, Authorization included, to whatever host a
    redirect names, and the daemon itself never redirects elsewhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if req.has_header("Authorization") and (old.scheme, old.hostname, old.port) != \
                (new.scheme, new.hostname, new.port):
            raise CheckpointError(f"{req.full_url}: redirected ({code}) to {new.scheme}://{new.netloc}, another "
                                  "origin: not followed, the token would go with it")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


@contextlib.contextmanager
def _request(url: str, token: str | None, timeout: float, accept: str):
    """(the open response, the URL asked) of GET <url>/checkpoint; HTTP and socket errors,
    here or while the body is read, as one-line CheckpointErrors naming the URL."""
    try:
        parts = urllib.parse.urlsplit(url)
        path = parts.path
        parts.port  # noqa: B018 -- "Port out of range": 99999 was tried as another port, "Connection refused"
    except ValueError as e:  # "http://[::1": Invalid IPv6 URL
        raise CheckpointError(f"{redact(url)}: cannot fetch checkpoint: {e}") from None
    if parts.username is not None or parts.password is not None:
        # urllib takes user:password@ for part of the host name ("Name or service not
        # known"), and the message showed the password
        raise CheckpointError(f"{redact(url)}: user:password@ in a daemon's URL is not used: give the daemon's "
                              "token in $CKPTD_TOKEN (or token=)")
    if path in ("", "/"):
        url = url.rstrip("/") + "/checkpoint"
    headers = {"Accept": accept}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    opener = urllib.request.build_opener(_TokenStaysHome)
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            yield resp, url
    except urllib.error.HTTPError as e:
        try:
            detail = e.read(300).decode(errors="replace")
        except (OSError, http.client.HTTPException):
            detail = ""
        line = " ".join(f"HTTP {e.code} {e.reason}: {detail}".split()).rstrip(":")
        raise CheckpointError(f"{url}: {line}") from e
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
        # ValueError: a URL urllib cannot use (a host label over 63 characters is
        # UnicodeError from the idna codec, "Invalid IPv6 URL")
        reason = " ".join(str(getattr(e, "reason", e)).split())
        raise CheckpointError(f"{url}: cannot fetch checkpoint: {reason}") from e


def _torch_body(resp, url: str, names: list[str] | None, limit: int | None = None) -> tuple[dict, int]:
    want = resp.headers.get("X-Ckptd-SHA256")
    buf = _read_body(resp, url, limit)
    n = buf.getbuffer().nbytes
    if want is not None and hashlib.sha256(buf.getbuffer()).hexdigest() != want:
        raise CheckpointError(f"{url}: the body's SHA-256 differs from X-Ckptd-SHA256 ({n} bytes)")
    try:
        doc = torch_load(buf)
    except Exception as e:  # a cut stream, or not a checkpoint at all (a proxy's page)
        ctype = resp.headers.get_content_type()
        said = "" if ctype == "application/octet-stream" else f", Content-Type {ctype}"
        raise CheckpointError(f"{url}: not a whole checkpoint ({n} bytes{said}): {load_failure(e)}") from e
    return as_checkpoint(doc, url, names), n


def _read_body(resp, url: str, limit: int | None = None) -> io.RawIOBase:
    """The whole body as a seekable file over one buffer, read in place. With a
    Content-Length the buffer is allocated once, uninitialized (zero-filling 4 GB first
    cost 0.2-0.7 s here), and never copied: io.BytesIO copies a bytearray it is given,
    1.4-1.7 s for 600 MB in this VM, five times the transfer itself. Past `limit` bytes
    (said or sent) the body is refused."""
    length = resp.headers.get("Content-Length")
    if length is None or not re.fullmatch(r"[0-9]{1,15}", length):
        return io.BytesIO(_read_capped(resp, url, limit))
    if limit is not None and int(length) > limit:
        raise CheckpointError(f"{url}: Content-Length {length} is more than a checkpoint of this model "
                              f"takes ({limit} bytes at most)")
    try:
        data = np.empty(int(length), np.uint8)
    except MemoryError:
        raise CheckpointError(f"{url}: Content-Length {length}: cannot allocate a buffer that large") from None
    view, got = memoryview(data), 0
    while got < len(data):
        n = resp.readinto(view[got:got + (1 << 24)])
        if not n:
            break
        got += n
    return _BufferFile(view[:got])


def _read_capped(resp, url: str, limit: int | None) -> bytes:
    """A body without a usable Content-Length, read to its end, refused past `limit`."""
    parts, got = [], 0
    while chunk := resp.read(1 << 24):
        got += len(chunk)
        if limit is not None and got > limit:
            raise CheckpointError(f"{url}: the body (no Content-Length) goes on past {limit} bytes, more than "
                                  "a checkpoint of this model takes")
        parts.append(chunk)
    return b"".join(parts)


class _BufferFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (what torch.load needs), sharing it."""

    def __init__(self, view: memoryview):
        self._view, self._pos = view, 0

    def getbuffer(self) -> memoryview:
        return self._view

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def newest_in(directory: Path, names: list[str] | None, finite: bool = False) -> tuple[dict, str]:
    """The newest checkpoint of a directory that loads whole: the manifest's order when
    a persisted tier wrote one, else every checkpoint by its iteration, newest first.
    `finite`: the newest whose model is all finite (an entry the manifest says is not
    is passed over unread)."""
    from ckptd.core.formats import checkpoints_in
    from ckptd.core.manifest import MANIFEST, read_manifest
    manifest = directory / MANIFEST
    candidates: list[Path] = []
    if manifest.is_file():
        try:
            entries = read_manifest(directory)["checkpoints"]
            candidates = [directory / e["file"] for e in sorted(entries, key=lambda e: -e["iteration"])
                          if not (finite and e.get("finite") is False)]
        except CheckpointError as e:
            log.warning("%s, scanning the directory", e)
    tried = set()

    def usable(p: Path) -> dict | None:
        try:
            ckpt = load_checkpoint(p, names)
            if finite:
                _refuse_nonfinite(ckpt, str(p))
            return ckpt
        except CheckpointError as e:
            log.warning("skipping %s", e)
            return None
    for p in candidates:
        tried.add(p)
        if (ckpt := usable(p)) is not None:
            return ckpt, str(p)
    if candidates:
        log.warning("%s: none of the checkpoints its manifest lists loads, scanning the directory", manifest)
    found = []
    try:
        listed = checkpoints_in(directory)
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot list the directory: {e.strerror or e}") from None
    for p in listed:
        if p in tried:
            continue
        try:
            found.append((int(load_checkpoint(p, names)["iteration"]), p))
        except CheckpointError as e:
            log.warning("skipping %s", e)
    for _, p in sorted(found, key=lambda x: (-x[0], str(x[1]))):
        if (ckpt := usable(p)) is not None:
            return ckpt, str(p)
    raise CheckpointError(f"{directory}: no checkpoint here loads" + " and holds a finite state" * finite)


def _check_model(model: torch.nn.Module, ckpt: dict, where: str) -> None:
    state = ckpt["model"]
    own = model.state_dict()
    params = dict(model.named_parameters())
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise CheckpointError(f"{where}: entries the model does not have: {unknown[:5]}")
    lacking = [n for n in params if n not in state]
    if lacking:
        raise CheckpointError(f"{where}: lacks parameters {lacking[:5]}")
    for n, t in state.items():
        if tuple(t.shape) != tuple(own[n].shape) or t.dtype != own[n].dtype:
            raise CheckpointError(f"{where}: {n} is {t.dtype}{list(t.shape)}, the model's is "
                                  f"{own[n].dtype}{list(own[n].shape)}")


def _load_model(model: torch.nn.Module, ckpt: dict) -> list[str]:
    """ckpt's model entries into the model (checked already: _check_fits); the names of
    the model's buffers it did not hold."""
    state = ckpt["model"]
    own = model.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied weight's second name too
    with torch.no_grad():
        for n, t in state.items():
            own[n].copy_(t)  # state_dict tensors share storage with the module's
    return [n for n in own if n not in state and n not in params]


def _load_optimizer(model, optimizer, ckpt: dict, where: str, adopt: bool = False, keep_hyper: bool = False):
    """`adopt`: the state's tensors are the caller's to give away (read for this restore
    only); load_state_dict then keeps them as they are, else each is cloned first.
    `keep_hyper`: the groups' hyperparameters stay as they are (a scheduler replayed to
    the checkpoint's step set them), else the checkpoint's lr is set."""
    named = ckpt.get("optimizer")
    if named is None:
        raise CheckpointError(f"{where}: holds no optimizer state (weights only)")
    name_of = {id(p): n for n, p in model.named_parameters()}
    sd = optimizer.state_dict()
    index = 0
    state = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            n = name_of.get(id(p))
            if n is None:
                raise CheckpointError("the optimizer holds a parameter that is not the model's")
            st = named["state"].get(n)
            if st is not None:
                state[index] = {k: (v.clone() if isinstance(v, torch.Tensor) and not adopt else v)
                                for k, v in st.items()}
            index += 1
    sd["state"] = state
    if not keep_hyper:
        set_group_lrs(sd["param_groups"], named.get("lr"))  # the others in proportion, not all the first's
    optimizer.load_state_dict(sd)


def _nested(scheduler) -> list:
    """The scheduler and those it drives (SequentialLR's, ChainedScheduler's)."""
    return [scheduler] + list(getattr(scheduler, "_schedulers", None) or [])


def _stepped(scheduler) -> int:
    """How often the scheduler (or one it drives) has stepped; 0 for a fresh one."""
    return max((getattr(s, "last_epoch", 0) for s in _nested(scheduler)), default=0)


def _check_fresh(scheduler) -> None:
    """restore() replays a scheduler from step 0 where the checkpoint holds no state of
    one, so it must not have stepped yet."""
    if _stepped(scheduler) > 0:
        raise CheckpointError(f"ckptd.restore: the {type(scheduler).__name__} given has stepped "
                              f"{_stepped(scheduler)} times: give a freshly built one (as the trainer builds it "
                              "before step 0); restore steps it to the checkpoint's step")


def _replay_scheduler(scheduler, ckpt: dict, where: str) -> bool:
    """Step the fresh scheduler once per optimizer step done, as the trainer did, so every
    group's hyperparameters are what the trainer's next step uses: its exact lr (chainable
    schedulers multiply the lr they find; LambdaLR takes a lambda per group), OneCycleLR's
    momentum too. True: replayed (the groups keep what it set).

    A checkpoint without the trainer's scheduler state (ckptd's own, or a trainer's file
    that saved none) must come from this scheduler: the lr the checkpoint's last step used
    (ckptd's; a trainer's file holds the next one) must be what it gives there, else it is
    another scheduler or one the job steps otherwise (per epoch, say), refused with the
    scheduler and its optimizer as they were. With the trainer's saved state: replayed only
    where a fresh scheduler arrives at that very state (the saved one alone does not hold
    the groups' momentum), else False and the saved state is loaded as it is."""
    saved = ckpt.get("lr_scheduler")
    has_saved = isinstance(saved, dict) and "base_lrs" in saved
    if has_saved and _stepped(scheduler) > 0:
        return False
    _check_fresh(scheduler)
    steps = int(ckpt["iteration"]) + 1
    groups = scheduler.optimizer.param_groups
    before = [(s, dict(s.__dict__)) for s in _nested(scheduler)], [dict(g) for g in groups]

    def undo():
        for s, d in before[0]:
            s.__dict__.clear()
            s.__dict__.update(d)
        for g, d in zip(groups, before[1]):
            g.clear()
            g.update(d)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scheduler.step() before optimizer.step()
        for _ in range(steps):
            seen.append(groups[0]["lr"])
            scheduler.step()
    seen.append(groups[0]["lr"])
    if has_saved:
        own = scheduler.state_dict()
        if any(own.get(k) != saved.get(k) for k in ("last_epoch", "_last_lr")):
            undo()
            return False
        return True
    want = (ckpt.get("optimizer") or {}).get("lr")
    if want is not None and float(want) not in (float(seen[-2]), float(seen[-1])):
        undo()
        raise CheckpointError(f"{where}: its step {steps - 1} used lr {float(want)!r}, but the "
                              f"{type(scheduler).__name__} given, stepped once per optimizer step, gives "
                              f"{float(seen[-2])!r} there: not the job's scheduler, or one it steps otherwise "
                              "(restore without scheduler= and set the scheduler's state yourself)")
    return True
