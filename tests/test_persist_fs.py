"""The persistence tier on an fsspec URL (persist_url, ckptd.core.store): entries that
verify, the manifest written last (a crash between an object and the manifest leaves the
previous newest entry), restore from the URL bit-identical, a failing store retried with
back-off and reported in one line, credentials never shown."""
from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid

import fsspec
import pytest
import torch

import ckptd
from ckptd.cli import main
from ckptd.core.checkpoint import CheckpointError, checkpoint_name, save_checkpoint
from ckptd.core.keep import BACKOFF_FIRST_S
from ckptd.core.store import Store, redact
from ckptd.live.daemon import ConfigError, JsonFormatter, load_config
from ckptd.live.memory_tier import HeldState, copy_state
from ckptd.live.persist import MANIFEST, PersistTier, newest_verified, read_manifest, verify_checkpoint
from ckptd.recovery import newest_at_url


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _trained(steps: int):
    """A model and Adam after `steps` steps, and each step's state as ckptd holds it."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    held = []
    for it in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6)).square().mean().backward()
        opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        state = {names[id(p)]: dict(st) for p, st in opt.state.items()}
        held.append(HeldState(it, copy_state(dict(model.state_dict())),
                              copy_state({"lr": 0.01, "state": state}), time.time(), 0.0))
    return model, opt, held


def _drain(tier):
    for _ in range(500):
        if tier.idle():
            return
        time.sleep(0.01)
    raise AssertionError("writer did not finish")


def _url(kind: str, tmp_path) -> str:
    return f"memory://ckpts-{uuid.uuid4().hex[:8]}" if kind == "memory" else f"file://{tmp_path / 'ck'}"


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_entries_verify_and_restore_from_the_url_is_bit_identical(kind, tmp_path):
    url = _url(kind, tmp_path)
    model, opt, held = _trained(5)
    tier = PersistTier(url, every=2, interval_s=None, keep_last=2, keep_every=None, plan_hash="p")
    for h in held:
        tier.offer(h)
        _drain(tier)
    tier.close(held[-1])
    store = Store(url)
    assert store.local == (kind == "file")
    man = read_manifest(url)
    assert [e["iteration"] for e in man["checkpoints"]] == [2, 4]  # 0 pruned (keep_last 2)
    assert sorted(n for n in store.names() if n.startswith("iter_")) == [checkpoint_name(2), checkpoint_name(4)]
    for e in man["checkpoints"]:
        # the SHA-256 taken while writing is the object's
        assert hashlib.sha256(store.read(e["file"])).hexdigest() == e["sha256"]
        verify_checkpoint(url, e)
    assert tier.status()["store"] == url.replace("file://", "") if kind == "file" else url
    # restore from the URL: the newest entry, bit-identical to the model and optimizer
    fresh = _Net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    r = ckptd.restore(fresh, fresh_opt, source=url)
    assert r.iteration == 4 and r.step == 5
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n
    for p, q in zip(model.parameters(), fresh.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, fresh_opt.state[q][k]), k
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    # ckptd verify takes the URL too (its newest entry that verifies)
    save_checkpoint(tmp_path / "x.pt", 4, held[4].model, held[4].optimizer)
    assert main(["verify", url, str(tmp_path / "x.pt")]) == 0


def test_a_crash_between_object_and_manifest_leaves_the_previous_entry(tmp_path):
    url = _url("memory", tmp_path)
    _, _, held = _trained(3)
    tier = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None)
    tier.offer(held[0])
    _drain(tier)
    # iteration 1's object is written, then the process dies before the manifest
    real = tier._write_manifest

    def crash():
        raise KeyboardInterrupt("killed")  # not an Exception: nothing after it runs
    tier._write_manifest = crash
    with pytest.raises(KeyboardInterrupt):
        tier._write(held[1])
    tier._write_manifest = real
    assert checkpoint_name(1) in Store(url).names()
    got = newest_verified(url)
    assert got[1]["iteration"] == 0  # the manifest never names what it does not hold whole
    # a crash in the middle of an object: a temporary at most, never the final name
    fs = fsspec.filesystem("memory")
    rm = fs.rm
    fs.rm = lambda *a, **k: None  # the crash leaves the temporary behind
    try:
        tier2 = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None)

        def half(f):
            f.write(b"PK\x03\x04 partial")
            raise KeyboardInterrupt("killed")
        with pytest.raises(KeyboardInterrupt):
            tier2.store.write(checkpoint_name(2), half)
    finally:
        fs.rm = rm
    names = Store(url).names()
    assert checkpoint_name(2) not in names and any(n.startswith(checkpoint_name(2) + ".tmp") for n in names)
    assert newest_at_url(url)[0]["iteration"] == 0
    # the next start lists only what is there whole; a later write lists 2 and keeps 0
    tier2.offer(held[2])
    _drain(tier2)
    tier2.close()
    assert [e["iteration"] for e in read_manifest(url)["checkpoints"]] == [0, 2]
    assert newest_verified(url)[1]["iteration"] == 2


def test_a_tampered_object_is_skipped_for_the_one_before(tmp_path):
    url = _url("memory", tmp_path)
    _, _, held = _trained(2)
    tier = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None)
    for h in held:
        tier.offer(h)
        _drain(tier)
    tier.close()
    store = Store(url)
    store.fs.pipe_file(store._key(checkpoint_name(1)), store.read(checkpoint_name(1))[:-10] + b"0" * 10)
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        verify_checkpoint(url, read_manifest(url)["checkpoints"][-1])
    assert newest_at_url(url)[0]["iteration"] == 0


class _Flaky:
    """The memory filesystem whose writes fail (PermissionError) while `failing`."""

    def __init__(self, fs):
        self.fs, self.failing, self.tries = fs, True, 0

    def __getattr__(self, k):
        return getattr(self.fs, k)

    def open(self, path, mode="rb", **kw):
        if "w" in mode:
            self.tries += 1
            if self.failing:
                raise PermissionError(13, "Access Denied for s3://alice:s3cret@bucket/x")
        return self.fs.open(path, mode, **kw)


def test_a_failing_store_is_retried_with_back_off_and_reported_in_one_line(tmp_path, caplog):
    url = _url("memory", tmp_path)
    now = [100.0]
    _, _, held = _trained(4)
    tier = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None)
    tier.keeper.clock = lambda: now[0]
    flaky = _Flaky(tier.store.fs)
    tier.store._fs = flaky
    caplog.set_level(logging.WARNING, logger="ckptd")
    tier.offer(held[0])
    _drain(tier)
    tier.offer(held[1])  # within the back-off: not tried
    _drain(tier)
    st = tier.status()
    assert flaky.tries == 1 and st["state"] == "failing" and st["write_failures"] == 1
    assert st["newest_not_persisted"] == 1 and st["retry_in_s"] == BACKOFF_FIRST_S
    assert "Access Denied" in st["last_error"] and "s3cret" not in st["last_error"]
    lines = [JsonFormatter().format(r) for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0] and "s3cret" not in lines[0]
    assert json.loads(lines[0])["msg"] == "checkpoint not written"
    flaky.failing = False
    now[0] += BACKOFF_FIRST_S
    tier.offer(held[2])
    _drain(tier)
    tier.close()
    assert tier.status()["state"] == "ok" and tier.status()["last_persisted"] == 2
    assert newest_verified(url)[1]["iteration"] == 2


def test_credentials_never_shown(tmp_path, caplog):
    assert redact("s3://AKIA:very/secret@bucket/p") == "s3://***@bucket/p"
    assert redact("error at ftp://u:p@h:21/x and s3://b/k") == "error at ftp://***@h:21/x and s3://b/k"
    # a store that cannot be reached: the daemon's tier logs and goes on, no password anywhere
    caplog.set_level(logging.WARNING, logger="ckptd")
    _, _, held = _trained(1)
    tier = PersistTier("ftp://alice:s3cret@127.0.0.1:1/ck", every=1, interval_s=None,
                       keep_last=None, keep_every=None)
    tier.offer(held[0])
    _drain(tier)
    tier.close()
    st = tier.status()
    assert st["state"] == "failing" and st["store"] == "ftp://***@127.0.0.1:1/ck"
    text = json.dumps(st) + "".join(JsonFormatter().format(r) for r in caplog.records)
    assert "s3cret" not in text and "alice" not in text
    with pytest.raises(CheckpointError) as e:
        newest_at_url("ftp://alice:s3cret@127.0.0.1:1/ck")
    assert "s3cret" not in str(e.value)


def test_persist_url_config_key(tmp_path):
    base = [f"plan: {tmp_path / 'plan.json'}", f"init: {tmp_path / 'init.pt'}", f"out: {tmp_path / 'ck'}",
            "interfaces:", "  - {name: m0, ifname: m0}"]

    def cfg(*extra):
        p = tmp_path / "c.yaml"
        p.write_text("\n".join(base + list(extra)) + "\n")
        return load_config(p)
    assert cfg().persist_url is None
    assert cfg("persist_url: memory://ckpts").persist_url == "memory://ckpts"
    with pytest.raises(ConfigError, match="persist_url") as e:
        cfg("persist_url: nosuchfs://alice:s3cret@x/y")
    assert "s3cret" not in str(e.value)
    with pytest.raises(ConfigError, match="persist_url"):
        cfg("persist_url: /just/a/path")
    with pytest.raises(ConfigError, match="persist_sync"):
        cfg("persist_url: memory://ckpts", "persist_sync: true")
    assert MANIFEST == "manifest.json"
