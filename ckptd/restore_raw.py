"""Restore from the daemon's memory with the bytes written once, where they end.

The daemon streams the raw layout (ckptd.core.raw_layout): a header naming every tensor,
then their bytes. The socket is read (`readinto`) straight into the model's own
parameters and buffers (they exist and their pages are already faulted in) and into the
optimizer's state tensors, allocated once with the header's dtype and shape and adopted
by `optimizer.load_state_dict` as they are (torch's `.to()` returns the same tensor when
dtype and device match). The torch.save path made three passes over fresh memory instead
(the body, torch.load's storages, the copy into the model), each slow in a VM where
first-touch writes run at 0.2-1.3 GB/s.

Every tensor's BLAKE2b-128 is checked as its bytes arrive (while they are in cache, on a
second thread): the daemon computed the digests once per held state, the same the
persistence manifest lists.

Failures:
- the header against the model and optimizer (a tensor the model lacks, another dtype or
  shape, a missing parameter, no optimizer state for an optimizer) is checked whole
  before the first byte is read into the model: refused, nothing changed;
- a connection torn mid-body, or a digest that differs, is a CheckpointError saying so;
  by default the model's tensors then hold a partial state (some tensors new, the rest
  old) and the optimizer and scheduler are untouched. That is the default because the
  alternative costs a second pass over fresh memory and the error is never silent: a
  caller that would train on after a failed restore must restore again (or rebuild the
  model) first. `all_or_nothing=True` reads into fresh memory and copies into the model
  only when every tensor arrived and verified.
"""
from __future__ import annotations

import http.client
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ckptd.core.checkpoint import CheckpointError, check_optimizer_fits, check_state_tensors, optimizer_params_in
from ckptd.core.finite import first_nonfinite, refused_state
from ckptd.core.plan import dtype_name
from ckptd.core.raw_layout import HASH_THREADS, MAX_HEADER, as_bytes, decode_header, new_digest

CHUNK = 1 << 22  # read and hash 4 MiB at a time: the bytes just written are still in cache


def read_into_model(resp, model: torch.nn.Module, optimizer, where: str,
                    all_or_nothing: bool = False, finite: bool = False) -> tuple[dict, list[str], int]:
    """Read a raw-layout response into model and optimizer state tensors: (the checkpoint
    less the model's tensors, {iteration, optimizer: {lr, state} to load or None}; buffers
    the state lacks; bytes read). `finite` (with all_or_nothing): a state whose model
    holds NaN or inf is refused before it is copied in."""
    line = resp.readline(MAX_HEADER)
    if not line.endswith(b"\n"):
        raise CheckpointError(f"{where}: the raw checkpoint header is cut or over {MAX_HEADER} bytes")
    head = decode_header(line, where)
    plan = _destinations(head, model, optimizer, where, all_or_nothing)
    total = len(line) + sum(e["bytes"] for e in head["tensors"])
    length = resp.headers.get("Content-Length") if hasattr(resp, "headers") else None
    if length is not None and length.strip() != str(total):  # before a byte reaches the model
        raise CheckpointError(f"{where}: Content-Length {' '.join(length.split())[:40]}, but the raw "
                              f"checkpoint header describes {total} bytes; nothing in the model changed")
    after = "nothing in the model changed" if all_or_nothing else \
        "the model's tensors now hold a partial state: restore again before training"
    # hashing threads check each chunk just read (a tensor's chunks in order, on one
    # thread; tensors spread over them) while the next arrives: hashlib and the socket
    # both run without the GIL, so the check costs little beside the read on a client
    # with cores to spare (one BLAKE2b-128 thread runs at ~1.4 GB/s here, the read at ~5)
    hashers = [ThreadPoolExecutor(1, thread_name_prefix="ckptd-verify") for _ in range(HASH_THREADS)]
    try:
        digests = [_read_tensor(resp, e, dest, where, after, hashers[i % len(hashers)])
                   for i, (e, dest) in enumerate(plan)]
        for (e, _), digest in zip(plan, digests):
            if digest.result() != e["blake2b"]:
                raise CheckpointError(f"{where}: {e['name']}: BLAKE2b differs from the header's; {after}")
    finally:
        for h in hashers:
            h.shutdown(wait=True, cancel_futures=True)
    if finite and (bad := first_nonfinite((e["name"][6:], dest) for e, dest in plan
                                          if e["name"].startswith("model."))):
        raise CheckpointError(f"{refused_state(where, bad, head['iteration'])}; {after}")
    own = model.state_dict()
    with torch.no_grad():
        for e, dest in plan:
            name = e["name"]
            if name.startswith("model.") and dest.data_ptr() != own[name[6:]].data_ptr():
                own[name[6:]].copy_(dest)  # staged: not contiguous, not on the CPU, or all-or-nothing
    state: dict = {}
    for e, dest in plan:
        if dest is not None and e["name"].startswith("optimizer."):
            pname, key = e["param"], e["key"]
            state.setdefault(pname, {})[key] = dest
    sent = {e["name"][6:] for e in head["tensors"] if e["name"].startswith("model.")}
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied weight's second name too
    missing = [n for n in own if n not in sent and n not in params]
    named = {"lr": head.get("lr"), "state": state} if head.get("optimizer") else None
    return {"iteration": int(head["iteration"]), "optimizer": named}, missing, total


def _destinations(head: dict, model, optimizer, where: str, staged: bool) -> list[tuple[dict, torch.Tensor]]:
    """Each header entry with the tensor its bytes go into, after checking them all."""
    own = model.state_dict()
    params = dict(model.named_parameters())
    if optimizer is not None:
        optimizer_params_in(optimizer, model, where)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
    out, sent = [], set()
    for e in head["tensors"]:
        name, dtype, shape = e["name"], e["dtype"], e["shape"]
        kind, _, rest = name.partition(".")
        if kind == "model":
            mine = own.get(rest)
            if mine is None:
                raise CheckpointError(f"{where}: {rest} is in the checkpoint, not in the model")
            if list(mine.shape) != shape or mine.dtype != dtype:
                raise CheckpointError(f"{where}: {rest} is {dtype_name(dtype)}{shape}, the model's is "
                                      f"{dtype_name(mine.dtype)}{list(mine.shape)}")
            sent.add(rest)
            in_place = not staged and mine.is_contiguous() and mine.device.type == "cpu"
            out.append((e, mine if in_place else torch.empty(shape, dtype=dtype)))
        elif kind == "optimizer":
            pname, _, key = rest.rpartition(".")
            if optimizer is None:
                out.append((e, None))  # read past it
                continue
            p = params.get(pname)
            if p is None or id(p) not in held:
                raise CheckpointError(f"{where}: optimizer state {rest} is for a parameter the "
                                      f"{'optimizer' if p is not None else 'model'} does not have")
            # shape, dtype and size against the parameter before anything is allocated
            check_state_tensors(optimizer, model, {pname: {key: (dtype, shape)}}, where)
            e["param"], e["key"] = pname, key
            out.append((e, torch.empty(shape, dtype=dtype)))
        else:
            raise CheckpointError(f"{where}: raw checkpoint entry {name!r} is neither model. nor optimizer.")
    lacking = [n for n in params if n not in sent]
    if lacking:
        raise CheckpointError(f"{where}: lacks parameters {lacking[:5]}")
    if optimizer is not None and not head.get("optimizer"):
        raise CheckpointError(f"{where}: holds no optimizer state (weights only)")
    if optimizer is not None:  # before a byte is read into the model
        saved: dict[str, set[str]] = {}
        for e, _ in out:
            if "param" in e:
                saved.setdefault(e["param"], set()).add(e["key"])
        check_optimizer_fits(optimizer, model, saved, where)
    return out


def _read_tensor(resp, e: dict, dest: torch.Tensor | None, where: str, after: str, hasher) -> Future:
    """Read one tensor's bytes into `dest` (None: past them, unchecked); the future of
    their BLAKE2b hex digest. `after`: what a failure leaves, for its message."""
    view, got, h = as_bytes(dest) if dest is not None else None, 0, new_digest()
    size = e["bytes"]
    scratch = memoryview(bytearray(min(CHUNK, size))) if view is None else None
    while got < size:
        try:
            n = resp.readinto(view[got:got + CHUNK] if view is not None else scratch[:size - got])
        except (OSError, http.client.HTTPException) as err:
            raise CheckpointError(f"{where}: reading {e['name']}: {' '.join(str(err).split())}; {after}") from err
        if not n:
            raise CheckpointError(f"{where}: connection closed {size - got} bytes short in "
                                  f"{e['name']}; {after}")
        if view is not None:
            hasher.submit(h.update, view[got:got + n])
        got += n
    if view is None:
        skipped: Future = Future()
        skipped.set_result(e["blake2b"])
        return skipped
    return hasher.submit(h.hexdigest)
