"""The checkpoint write path (issue 13, item 4): atomic, private files that refuse a
planted link; a full disk reported and retried with back-off, never raised in a
daemon; retention (keep_last, keep_every)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ckptd.core.checkpoint import CheckpointWriteError, checkpoint_name, load_checkpoint, save_checkpoint, write_checkpoint
from ckptd.core.keep import BACKOFF_FIRST_S, CheckpointKeeper


def _state(n=1000, value=1.0):
    return {"w": torch.full((n,), value)}, None


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_checkpoint_file_is_private_and_whole(tmp_path):
    save_checkpoint(tmp_path / "a.pt", 3, *_state())
    assert (os.stat(tmp_path / "a.pt").st_mode & 0o777) == 0o600
    assert load_checkpoint(tmp_path / "a.pt")["iteration"] == 3
    assert _names(tmp_path) == ["a.pt"]


def test_planted_symlink_at_the_temporary_is_refused_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "a.pt.tmp")
    with pytest.raises(CheckpointWriteError, match="not a regular file"):
        save_checkpoint(tmp_path / "a.pt", 3, *_state())
    assert victim.read_text() == "precious"
    assert not (tmp_path / "a.pt").exists()
    assert (tmp_path / "a.pt.tmp").is_symlink()  # left for the operator to look at


def test_stale_temporary_from_a_crash_is_replaced(tmp_path):
    (tmp_path / "a.pt.tmp").write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path / "a.pt", 1, *_state())
    assert _names(tmp_path) == ["a.pt"]


def test_retention_keeps_the_newest_and_every_mth(tmp_path):
    out = tmp_path / "ck"
    k = CheckpointKeeper(out, keep_last=3, keep_every=10)
    assert (os.stat(out).st_mode & 0o777) == 0o700  # the directory it creates is private
    for it in range(25):
        assert k.write(it, *_state(10))
    assert _names(out) == [checkpoint_name(i) for i in (0, 10, 20, 22, 23, 24)]
    assert k.pruned == 19
    (out / "notes.txt").write_text("not a checkpoint")
    k.write(25, *_state(10))
    assert "notes.txt" in _names(out)


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_failed_writes_back_off_and_the_newest_state_is_persisted_when_writing_works(tmp_path, monkeypatch):
    clock = _Clock()
    k = CheckpointKeeper(tmp_path, keep_last=10, retry=True, clock=clock)
    calls = []
    real = write_checkpoint

    def full_disk(f, iteration, *a):
        calls.append(checkpoint_name(iteration))
        raise CheckpointWriteError(errno.ENOSPC, f"{checkpoint_name(iteration)}: cannot write checkpoint: "
                                   "No space left on device")

    monkeypatch.setattr("ckptd.core.keep.write_checkpoint", full_disk)
    assert k.write(0, *_state()) is False
    assert k.write(1, *_state()) is False  # within the back-off: not even tried
    assert calls == [checkpoint_name(0)]
    clock.t += BACKOFF_FIRST_S
    assert k.write(2, *_state()) is False  # tried again, failed: the back-off doubles
    assert calls == [checkpoint_name(0), checkpoint_name(2)]
    st = k.status()
    assert st["state"] == "failing" and st["newest_not_persisted"] == 2 and st["not_persisted"] == 3
    assert st["retry_in_s"] == 2 * BACKOFF_FIRST_S and "No space left" in st["last_error"]
    monkeypatch.setattr("ckptd.core.keep.write_checkpoint", real)
    clock.t += 1.0
    assert k.write(3, *_state()) is False  # still backing off
    clock.t += 1.0
    assert k.write(4, *_state(value=4.0)) is True
    assert k.status()["state"] == "ok" and k.last_persisted == 4
    assert _names(tmp_path) == [checkpoint_name(4)]
    assert torch.equal(load_checkpoint(tmp_path / checkpoint_name(4))["model"]["w"], torch.full((1000,), 4.0))


def test_replay_keeper_raises_instead(tmp_path, monkeypatch):
    def fail(f, iteration, *a):
        raise CheckpointWriteError(errno.EROFS, "cannot write checkpoint: Read-only file system")
    monkeypatch.setattr("ckptd.core.keep.write_checkpoint", fail)
    with pytest.raises(CheckpointWriteError, match="Read-only"):
        CheckpointKeeper(tmp_path).write(0, *_state())


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs root and mount): a disk that really fills."""
    mnt = tmp_path / f"hd-tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_real_full_disk_leaves_nothing_behind_and_names_enospc(small_tmpfs):
    model = {"w": torch.zeros(400_000)}  # 1.6 MB: more than the disk
    with pytest.raises(CheckpointWriteError) as e:
        save_checkpoint(small_tmpfs / "a.pt", 0, model, None)
    assert e.value.errno == errno.ENOSPC, e.value
    assert _names(small_tmpfs) == []
    save_checkpoint(small_tmpfs / "b.pt", 0, {"w": torch.zeros(1000)}, None)  # space is still usable
    assert _names(small_tmpfs) == ["b.pt"]


def test_read_only_file_system_is_a_write_error(small_tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(CheckpointWriteError) as e:
        save_checkpoint(small_tmpfs / "a.pt", 0, *_state())
    assert e.value.errno == errno.EROFS and "a.pt" in str(e.value)
    k = CheckpointKeeper(small_tmpfs, keep_last=2, retry=True)  # the directory exists already
    assert k.write(0, *_state()) is False and k.status()["state"] == "failing"


def test_out_of_file_descriptors_is_a_write_error(tmp_path):
    """EMFILE, in a child process whose descriptor limit is used up."""
    code = f"""
import errno, resource, torch
from ckptd.core.checkpoint import CheckpointWriteError, save_checkpoint
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    while True:
        held.append(open("/dev/null"))
except OSError:
    pass
try:
    save_checkpoint({str(tmp_path / "a.pt")!r}, 0, {{"w": torch.ones(3)}}, None)
except CheckpointWriteError as e:
    print("errno", e.errno)
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.strip() == f"errno {errno.EMFILE}", r.stderr
    assert _names(tmp_path) == []
