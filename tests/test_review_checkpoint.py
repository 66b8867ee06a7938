"""Review fixes around checkpoint files: every reader checks a checkpoint's structure
(a persistence tier's fsspec store, the daemon's /checkpoint body, as load_checkpoint
does), a persisted file whose SHA-256 the manifest verified is not CRC-checked a second
time, a write's OSError is found in the exception chain torch.save leaves, and values in
structure errors are shown bounded (ckptd.errors.show)."""
from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import uuid
import zlib

import pytest
import torch

import ckptd.core.checkpoint as checkpoint
from ckptd.core.checkpoint import (CHECKPOINT_FORMAT, CheckpointError, CheckpointWriteError, atomic_write,
                                   checkpoint_name, load_checkpoint, save_checkpoint)
from ckptd.core.store import Store
from ckptd.core.manifest import (MANIFEST, MANIFEST_FORMAT, file_digest, newest_verified, tensor_digests,
                                 verify_checkpoint)
from ckptd.live.serve import HttpServer, Response
from ckptd.recovery import fetch
from tests.test_checkpoint_files import flip_byte, main, member_data_offset, small_doc, tensor_member


def _manifest(entry: dict) -> bytes:
    return json.dumps({"format": MANIFEST_FORMAT, "plan_hash": None, "checkpoints": [entry]}).encode()


# -- 1. structure checked by the readers that do not go through load_checkpoint ----------------
def _remote_store_holding(doc) -> tuple[Store, dict]:
    """A memory:// store whose manifest lists a torch.save of `doc` with its true SHA-256."""
    store = Store(f"memory://review-{uuid.uuid4().hex[:8]}")
    name = checkpoint_name(0)
    store.write(name, lambda f: torch.save(doc, f))
    data = store.read(name)
    entry = {"iteration": 0, "file": name, "sha256": hashlib.sha256(data).hexdigest(), "tensors": {}}
    store.write(MANIFEST, lambda f: f.write(_manifest(entry)))
    return store, entry


def test_a_remote_persisted_checkpoint_of_the_wrong_structure_is_refused_naming_the_key(caplog, capsys):
    doc = {"format": CHECKPOINT_FORMAT, "iteration": 0, "model": [1], "optimizer": None}
    store, entry = _remote_store_holding(doc)
    where = store.where(entry["file"])
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(store, entry)
    assert str(e.value).startswith(f"{where}: ") and "model is a list" in str(e.value), str(e.value)
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        assert newest_verified(store) is None  # skipped with a warning, as a tampered file is
    assert any("model is a list" in r.fields["error"] for r in caplog.records if hasattr(r, "fields"))
    # the entry's own reason as a warning line (session 37: logged warnings print in commands), then the error
    rc, _, err = main(capsys, "verify", store.url, "unused.pt")
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 2 and "Traceback" not in err, err
    assert lines[0].startswith("warning: persisted checkpoint does not verify") and "model is a list" in lines[0]
    assert lines[1].startswith("error: ") and store.url in lines[1] and "no manifest entry there verifies" in lines[1]


def test_the_daemon_url_body_of_the_wrong_structure_is_refused_naming_the_key():
    # a trainer-format body (what /checkpoint serves) that from_torch_doc alone accepts
    body = {"model": {"w": torch.zeros(3)}, "step": 1,
            "optimizer": {"state": {0: {"exp_avg": "x"}}, "param_groups": [{"lr": 0.1, "params": [0]}]}}
    data = _saved(body)
    srv = HttpServer({"/checkpoint": lambda _, __: Response(200, data, "application/octet-stream")},
                     "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{srv.address[1]}/checkpoint"
        with pytest.raises(CheckpointError) as e:
            fetch(url, ["w"], None, 10)
        assert str(e.value).startswith(f"{url}: ") and "optimizer.state.w.exp_avg is a str" in str(e.value), \
            str(e.value)
        body["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)  # the same body, well formed
        data = _saved(body)
        got, _ = fetch(url, ["w"], None, 10)
        assert got["iteration"] == 0 and torch.equal(got["optimizer"]["state"]["w"]["exp_avg"], torch.zeros(3))
    finally:
        srv.stop()


def _saved(doc) -> bytes:
    buf = io.BytesIO()
    torch.save(doc, buf)
    return buf.getvalue()


# -- 2. the CRC pass: the default for every reader, skipped after the manifest's SHA-256 ------
@pytest.fixture
def crc_calls(monkeypatch):
    calls = []

    def counting():
        def crc(view):
            calls.append(len(view))
            return zlib.crc32(view)
        return crc
    monkeypatch.setattr(checkpoint, "_crc32", counting)
    return calls


def _persisted(tmp_path):
    d = small_doc()
    name = checkpoint_name(0)
    save_checkpoint(tmp_path / name, 0, d["model"], d["optimizer"])
    entry = {"iteration": 0, "file": name, "sha256": file_digest(tmp_path / name),
             "tensors": tensor_digests(d["model"], d["optimizer"])}
    (tmp_path / MANIFEST).write_bytes(_manifest(entry))
    return tmp_path / name, entry


def test_the_crc_check_is_the_default_and_catches_a_flipped_byte(tmp_path, crc_calls):
    p, _ = _persisted(tmp_path)
    load_checkpoint(p)
    assert crc_calls, "load_checkpoint ran no CRC"
    member = tensor_member(p)
    flip_byte(p, member_data_offset(p, member) + 5)
    with pytest.raises(CheckpointError, match=f"member {member}: CRC-32"):
        load_checkpoint(p)
    load_checkpoint(p, check_crc=False)  # what a caller that hashed the file itself asks for


def test_a_persisted_file_verified_by_its_sha256_is_not_crc_checked_again(tmp_path, crc_calls):
    p, entry = _persisted(tmp_path)
    got, got_entry = newest_verified(tmp_path)
    assert got_entry == entry and got["iteration"] == 0
    assert crc_calls == []  # the manifest's SHA-256 already covered every byte
    flip_byte(p, member_data_offset(p, tensor_member(p)) + 5)
    with pytest.raises(CheckpointError, match="SHA-256 differs from the manifest's"):
        verify_checkpoint(tmp_path, entry)  # and a damaged file is still refused


# -- 3. a write's OSError found in the chain torch.save leaves ----------------------------------
class _FullAfter:
    """A file whose writes fail with ENOSPC after `room` bytes (a disk filling up)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, b):
        n = memoryview(b).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= n
        return self.f.write(b)

    def flush(self):
        self.f.flush()


@pytest.mark.parametrize("room", [0, 100, 5000, 200_000])
def test_a_full_disk_under_torch_save_is_named_with_its_errno(tmp_path, room):
    # torch.save turns the write's OSError into "[enforce fail ...] unexpected pos"; the
    # OSError is that error's __context__, wherever in the file the write fails
    doc = {"model": {"w": torch.zeros(100_000)}}
    target = tmp_path / "c.pt"
    with pytest.raises(CheckpointWriteError) as e:
        atomic_write(target, lambda f: torch.save(doc, _FullAfter(f, room)))
    assert e.value.errno == errno.ENOSPC, e.value
    assert "No space left on device" in str(e.value) and "enforce fail" not in str(e.value), str(e.value)
    assert str(target) in str(e.value) and list(tmp_path.iterdir()) == []


# -- 4. bounded values in structure errors ----------------------------------------------------
def _refused(tmp_path, doc) -> str:
    p = tmp_path / "c.pt"
    torch.save(doc, p)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert str(e.value).startswith(f"{p}: ") and "\n" not in str(e.value) and len(str(e.value)) < 300
    return str(e.value)


def test_structure_errors_never_walk_or_repr_a_value_whole(tmp_path):
    shared = []
    for _ in range(18):  # a pickle keeps one object once: 2**18 lists when walked
        shared = [shared, shared]
    doc = small_doc()
    doc["optimizer"] = shared
    assert "optimizer is a list of 2 item(s), not None or a dict" in _refused(tmp_path, doc)
    doc = small_doc()
    doc["model"]["w"] = "x" * 100_000
    assert "model.w is a str 'xxx" in _refused(tmp_path, doc)
