"""The persistence tier on an fsspec URL (persist_url, ckptd.core.store): entries that
verify, the manifest written last (a crash between an object and the manifest leaves the
previous newest entry), restore from the URL bit-identical, a failing store retried with
back-off and reported in one line, credentials never shown. On memory://, file:// and
s3:// (a local S3 server speaking the real REST protocol: tests/conftest.py `s3`)."""
from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid

import pytest
import torch

import ckptd
from ckptd.cli import main
from ckptd.core.checkpoint import CheckpointError, checkpoint_name, save_checkpoint
from ckptd.core.keep import BACKOFF_FIRST_S
from ckptd.core.store import Store, redact
from ckptd.live.daemon import ConfigError, JsonFormatter, load_config
from ckptd.live.memory_tier import HeldState, copy_state
from ckptd.core.manifest import MANIFEST, newest_verified, read_manifest, verify_checkpoint
from ckptd.live.persist import PersistTier
from ckptd.recovery import newest_at_url

from helpers import drain_writer


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


def _target(kind: str, tmp_path, request) -> tuple[str, dict | None]:
    """A fresh store of that kind: its URL and storage options."""
    if kind == "s3":
        s3 = request.getfixturevalue("s3")
        return s3.bucket(), s3.options
    return (f"memory://ckpts-{uuid.uuid4().hex[:8]}" if kind == "memory" else f"file://{tmp_path / 'ck'}"), None


@pytest.mark.parametrize("kind", ["memory", "file", "s3"])
def test_entries_verify_and_restore_from_the_url_is_bit_identical(kind, tmp_path, request, monkeypatch):
    url, options = _target(kind, tmp_path, request)
    model, opt, held = _trained(5)
    tier = PersistTier(url, every=2, interval_s=None, keep_last=2, keep_every=None, plan_hash="p",
                       options=options)
    for h in held:
        tier.offer(h)
        drain_writer(tier)
    tier.close(held[-1])
    store = Store(url, options)
    assert store.local == (kind == "file")
    man = read_manifest(store)
    assert [e["iteration"] for e in man["checkpoints"]] == [2, 4]  # 0 pruned (keep_last 2)
    # nothing else there: no temporary left (s3: none made, the commit publishes the name)
    assert sorted(store.names()) == [checkpoint_name(2), checkpoint_name(4), MANIFEST]
    for e in man["checkpoints"]:
        # the SHA-256 taken while writing is the object's
        assert hashlib.sha256(store.read(e["file"])).hexdigest() == e["sha256"]
        verify_checkpoint(store, e)
    assert tier.status()["store"] == url.replace("file://", "") if kind == "file" else url
    if kind == "s3":  # restore and verify get no options: s3fs reads the AWS_* environment
        for k, v in request.getfixturevalue("s3").env.items():
            monkeypatch.setenv(k, v)
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


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_a_crash_between_object_and_manifest_leaves_the_previous_entry(kind, tmp_path, request):
    url, options = _target(kind, tmp_path, request)
    store = Store(url, options)
    _, _, held = _trained(3)
    tier = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None, options=options)
    tier.offer(held[0])
    drain_writer(tier)
    # iteration 1's object is written, then the process dies before the manifest
    real = tier._write_manifest

    def crash():
        raise KeyboardInterrupt("killed")  # not an Exception: nothing after it runs
    tier._write_manifest = crash
    with pytest.raises(KeyboardInterrupt):
        tier._write(held[1])
    tier._write_manifest = real
    assert checkpoint_name(1) in store.names()
    got = newest_verified(store)
    assert got[1]["iteration"] == 0  # the manifest never names what it does not hold whole
    # a crash in the middle of an object: nothing stored (the write is discarded)
    tier2 = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None, options=options)
    before = store.names()
    assert before == {checkpoint_name(0), checkpoint_name(1), MANIFEST}

    def half(f):
        f.write(b"PK\x03\x04 partial" * (6 << 16))  # > 5 MiB: on S3 one part is uploaded
        raise KeyboardInterrupt("killed")
    with pytest.raises(KeyboardInterrupt):
        tier2.store.write(checkpoint_name(2), half)
    assert store.names() == before
    # a crash once every byte is written, before the commit that stores them (S3: an
    # upload never completed): nothing under any name
    fs = tier2.store.fs
    real_open = fs.open

    def killed(*a, **k):
        raise KeyboardInterrupt("killed")

    def dies_at_commit(*a, **k):
        f = real_open(*a, **k)
        f.commit = killed
        return f
    fs.open = dies_at_commit
    try:
        with pytest.raises(KeyboardInterrupt):
            tier2.store.write(checkpoint_name(2), lambda f: f.write(b"whole" * (1 << 16)))
    finally:
        del fs.open
    assert store.names() == before
    if kind == "s3":  # behind s3fs: the first upload was aborted, the second left incomplete
        bucket, prefix = url[len("s3://"):].split("/", 1)
        uploads = request.getfixturevalue("s3").client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        assert [u["Key"] for u in uploads] == [f"{prefix}/{checkpoint_name(2)}"]
    if kind == "memory":
        # a store with a rename: a crash after the commit, before the move, leaves the
        # temporary (whole), never listed
        fs.mv, fs.rm = killed, lambda *a, **k: None
        try:
            with pytest.raises(KeyboardInterrupt):
                tier2.store.write(checkpoint_name(2), lambda f: f.write(b"whole"))
        finally:
            del fs.mv, fs.rm
        left = store.names() - before
        assert len(left) == 1 and left.pop().startswith(checkpoint_name(2) + ".tmp-")
    assert newest_verified(store)[1]["iteration"] == 0
    # the next start lists only what is there whole; a later write lists 2 and keeps 0
    tier2.offer(held[2])
    drain_writer(tier2)
    tier2.close()
    assert [e["iteration"] for e in read_manifest(store)["checkpoints"]] == [0, 2]
    assert newest_verified(store)[1]["iteration"] == 2


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_a_tampered_object_is_skipped_for_the_one_before(kind, tmp_path, request):
    url, options = _target(kind, tmp_path, request)
    _, _, held = _trained(2)
    tier = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None, options=options)
    for h in held:
        tier.offer(h)
        drain_writer(tier)
    tier.close()
    store = Store(url, options)
    store.fs.pipe_file(store._key(checkpoint_name(1)), store.read(checkpoint_name(1))[:-10] + b"0" * 10)
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        verify_checkpoint(store, read_manifest(store)["checkpoints"][-1])
    assert newest_verified(store)[1]["iteration"] == 0


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
    url = f"memory://ckpts-{uuid.uuid4().hex[:8]}"
    now = [100.0]
    _, _, held = _trained(4)
    tier = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None)
    tier.keeper.clock = lambda: now[0]
    flaky = _Flaky(tier.store.fs)
    tier.store._fs = flaky
    caplog.set_level(logging.WARNING, logger="ckptd")
    tier.offer(held[0])
    drain_writer(tier)
    tier.offer(held[1])  # within the back-off: not tried
    drain_writer(tier)
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
    drain_writer(tier)
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
    drain_writer(tier)
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
    with pytest.raises(ConfigError, match="file:// URL takes an absolute path") as e:
        cfg("persist_url: file://alice:s3cret@host/x")
    assert "s3cret" not in str(e.value) and "***@host" in str(e.value)
    with pytest.raises(ConfigError, match="persist_sync"):
        cfg("persist_url: memory://ckpts", "persist_sync: true")
    assert MANIFEST == "manifest.json"
    # storage options: a mapping given to the filesystem as it is; messages name keys only
    opts = cfg("persist_url: s3://b/p", "persist_options: {key: AKIAX, secret: 'w/s3cret',",
               "  client_kwargs: {endpoint_url: 'http://127.0.0.1:9000'}, config_kwargs: {retries: {max_attempts: 2}}}")
    assert opts.persist_options == {"key": "AKIAX", "secret": "w/s3cret",
                                    "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
                                    "config_kwargs": {"retries": {"max_attempts": 2}}}
    for extra, message in [(["persist_options: {key: a}"], "'persist_options' needs persist_url"),
                           (["persist_url: s3://b/p", "persist_options: [s3cret]"], "'persist_options' must be a mapping"),
                           (["persist_url: s3://b/p", "persist_options: {secret: s3cret, 3: x}"],
                            "'persist_options' has a key that is not"),
                           (["persist_url: s3://b/p", "persist_options: {client_kwargs: {t: 2026-01-01}}"],
                            "'persist_options.client_kwargs.t' must be a string, number")]:
        with pytest.raises(ConfigError, match=message) as e:
            cfg(*extra)
        assert "s3cret" not in str(e.value)


def test_storage_option_credentials_never_shown(tmp_path):
    """The values of credential keys in the storage options are not in any message."""
    from ckptd.core.store import credentials_in
    opts = {"key": "AKIAXYZ", "secret": "s3cret/long", "client_kwargs": {"endpoint_url": "http://h:1",
            "aws_session_token": "tok3n"}, "anon": False}
    assert credentials_in(opts) == ["s3cret/long", "AKIAXYZ", "tok3n"]
    assert redact("denied for AKIAXYZ with s3cret/long at http://h:1", credentials_in(opts)) == \
        "denied for *** with *** at http://h:1"
    # an fsspec filesystem that fails with the credential in its message (memory:// takes any option)
    store = Store(f"memory://ckpts-{uuid.uuid4().hex[:8]}", {"token": "tok3n-123"})

    class Leaky:
        def open(self, *a, **k):
            raise PermissionError(13, "token tok3n-123 refused")
    store._fs, store._root = Leaky(), "/x"
    with pytest.raises(OSError) as e:
        store.write("iter_000001.pt", lambda f: f.write(b"x"))
    assert "tok3n" not in str(e.value) and "token *** refused" in str(e.value)


def test_a_missing_bucket_is_one_line_naming_the_url(s3, caplog, monkeypatch):
    url = f"s3://nosuch-{uuid.uuid4().hex[:10]}/job1"  # a bucket nobody made
    caplog.set_level(logging.WARNING, logger="ckptd")
    _, _, held = _trained(1)
    # the daemon's tier: reported at start and at each write, never created, never a traceback
    tier = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None, options=s3.options)
    tier.offer(held[0])
    drain_writer(tier)
    tier.close()
    st = tier.status()
    assert st["state"] == "failing" and st["write_failures"] == 1
    bucket = url.split("/")[2]
    assert st["last_error"] == f"{url}/{checkpoint_name(0)}: cannot write: bucket {bucket!r} does not exist"
    lines = [JsonFormatter().format(r) for r in caplog.records]
    assert [json.loads(x)["msg"] for x in lines] == ["checkpoint store not reachable", "checkpoint not written"]
    assert all("\n" not in x and s3.SECRET not in x for x in lines)
    # restore and verify: one line naming the URL and the bucket
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(CheckpointError, match=f"^{url}: bucket '{bucket}' does not exist$"):
        ckptd.restore(_Net(), None, source=url)
    assert main(["verify", url, url]) == 2


def test_a_server_that_is_down_is_retried_and_reported_in_one_line(s3, tmp_path, caplog):
    """The tier's store stops answering (connection refused): each write due after the
    back-off tries once, fails in one line, and the first write after it is back lists
    the newest state."""
    from moto.server import ThreadedMotoServer
    url = s3.bucket()  # moto's buckets live in the process: a second server sees them
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = dict(s3.options, client_kwargs={"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"})
    now = [100.0]
    _, _, held = _trained(4)
    tier = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None, options=options)
    tier.keeper.clock = lambda: now[0]
    tier.offer(held[0])
    drain_writer(tier)
    assert tier.status()["state"] == "ok" and tier.status()["last_persisted"] == 0
    server.stop()  # the server goes away
    caplog.set_level(logging.WARNING, logger="ckptd")
    tier.offer(held[1])
    drain_writer(tier)
    tier.offer(held[2])  # within the back-off: not tried
    drain_writer(tier)
    now[0] += BACKOFF_FIRST_S
    tier.offer(held[3])  # tried again: still down
    drain_writer(tier)
    st = tier.status()
    assert st["state"] == "failing" and st["write_failures"] == 2 and st["newest_not_persisted"] == 3
    assert st["last_error"].startswith(f"{url}/{checkpoint_name(3)}: cannot write: ")
    assert f"{host}:{port}" in st["last_error"]  # says where it could not connect to
    lines = [JsonFormatter().format(r) for r in caplog.records]
    assert [json.loads(x)["msg"] for x in lines] == ["checkpoint not written"] * 2
    assert all("\n" not in x and s3.SECRET not in x and s3.KEY not in x for x in lines)
    # back on the same port: the clean stop's forced write persists the newest state
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        tier.close(held[3])
        assert tier.status()["state"] == "ok" and tier.status()["last_persisted"] == 3
        store = Store(url, options)
        assert [e["iteration"] for e in read_manifest(store)["checkpoints"]] == [0, 3]
        assert newest_verified(store)[1]["iteration"] == 3
    finally:
        server.stop()


def test_status_without_details_keeps_a_url_and_drops_local_directories():
    """/status (status_details off) shows a store URL and its object names whole, and of a
    local path only the file name, in the write error and in the unrecovered notes."""
    from ckptd.live.status import redact as redact_status
    doc = redact_status({
        "checkpoints": {"store": "s3://bkt/job1",
                        "last_error": "s3://bkt/job1/iter_000003.pt: cannot write: bucket 'bkt' does not exist"},
        "unrecoverable": [{"iteration": 3, "status": "not-captured", "missing": [],
                           "note": "the newest state held is iteration 2 (/var/lib/ckptd/iter_000002.pt): "
                                   "the shadow waits for a checkpoint of the job's own state in /shared/resync"}]})
    assert doc["checkpoints"] == {"store": "s3://bkt/job1", "last_error":
                                  "s3://bkt/job1/iter_000003.pt: cannot write: bucket 'bkt' does not exist"}
    assert doc["unrecoverable"][0]["note"] == ("the newest state held is iteration 2 (iter_000002.pt): "
                                               "the shadow waits for a checkpoint of the job's own state in resync")
