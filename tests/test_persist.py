"""The persistence tier (ckptd.live.persist): which commits are written, the manifest and
retention, and that a writer killed with SIGKILL at any moment leaves a newest persisted
checkpoint that loads and verifies against its manifest."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from ckptd.core.checkpoint import CheckpointError
from ckptd.core.manifest import newest_verified, read_manifest, verify_checkpoint
from ckptd.live.memory_tier import HeldState
from ckptd.live.persist import PersistTier

from helpers import drain_writer


def held(it: int, n: int = 1000) -> HeldState:
    model = {"w": torch.full((n,), float(it)), "b": torch.arange(7, dtype=torch.float32) + it}
    opt = {"lr": 0.1, "state": {"w": {"step": torch.tensor(float(it + 1)), "exp_avg": torch.full((n,), it / 2)}}}
    return HeldState(it, model, opt, time.time(), 0.0)


def test_every_n_iterations_manifest_and_retention(tmp_path):
    tier = PersistTier(tmp_path, every=3, interval_s=None, keep_last=2, keep_every=6, plan_hash="abc")
    handed = []
    for it in range(11):
        if tier.offer(held(it)):
            handed.append(it)
        drain_writer(tier)
    tier.close(held(10))
    assert handed == [0, 3, 6, 9]
    man = read_manifest(tmp_path)
    assert man["plan_hash"] == "abc"
    # kept: the newest two (9, 10: the stop writes the newest) and every 6th (0, 6)
    assert [e["iteration"] for e in man["checkpoints"]] == [0, 6, 9, 10]
    assert sorted(p.name for p in tmp_path.glob("iter_*.pt")) == [f"iter_{i:06d}.pt" for i in (0, 6, 9, 10)]
    for e in man["checkpoints"]:
        doc = verify_checkpoint(tmp_path, e)
        assert torch.equal(doc["model"]["w"], held(e["iteration"]).model["w"])
        assert set(e["tensors"]) == {"model.w", "model.b", "optimizer.w.step", "optimizer.w.exp_avg"}
        assert e["write_s"] >= 0 and e["persisted_at"] >= e["committed_at"]
    assert newest_verified(tmp_path)[1]["iteration"] == 10


def test_offline_recovery_reads_a_tiers_manifest_without_the_live_package(tmp_path):
    """`ckptd resume` on a machine that only recovers: the manifest is read through
    ckptd.core.manifest, never by importing the daemon's package."""
    tier = PersistTier(tmp_path, every=1, interval_s=None, keep_last=None, keep_every=None)
    for it in range(3):
        tier.offer(held(it))
        drain_writer(tier)
    tier.close(held(2))
    code = ("import sys, pathlib\n"
            "from ckptd.recovery import newest_at_url, newest_in\n"
            "d = pathlib.Path(sys.argv[1])\n"
            "ckpt, where = newest_in(d, None)\n"
            "assert ckpt['iteration'] == 2 and where.endswith('iter_000002.pt'), where\n"
            "assert newest_at_url(d.as_uri())[0]['iteration'] == 2\n"
            "print(sorted(m for m in sys.modules if m.startswith('ckptd.live')))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_interval_and_a_tampered_file_is_named(tmp_path):
    now = [0.0]
    tier = PersistTier(tmp_path, every=None, interval_s=10, keep_last=None, keep_every=None,
                       clock=lambda: now[0])
    assert tier.offer(held(0))
    drain_writer(tier)
    assert not tier.offer(held(1))
    now[0] = 10.5
    assert tier.offer(held(2))
    tier.close()
    assert tier.superseded == 0
    entries = read_manifest(tmp_path)["checkpoints"]
    assert [e["iteration"] for e in entries] == [0, 2]
    path = tmp_path / "iter_000002.pt"
    data = bytearray(path.read_bytes())
    data[-30] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"iter_000002\.pt: SHA-256 differs"):
        verify_checkpoint(tmp_path, entries[1])
    # the newest that verifies is the one before
    assert newest_verified(tmp_path)[1]["iteration"] == 0
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"manifest\.json: unreadable manifest"):
        read_manifest(tmp_path)


def test_a_manifest_entry_naming_a_file_outside_the_tier_is_refused(tmp_path):
    """A tier's manifest lists only the files it wrote, by plain name: an entry naming
    ../x, /x or no file at all makes the manifest unreadable as such (one line naming
    the entry), so no restore loads, and no keeper deletes, a file outside the tier."""
    tier = PersistTier(tmp_path / "tier", every=1, interval_s=None, keep_last=None, keep_every=None)
    assert tier.offer(held(0))
    tier.close()
    man = read_manifest(tmp_path / "tier")
    good = man["checkpoints"][0]
    (tmp_path / "outside.pt").write_bytes((tmp_path / "tier" / good["file"]).read_bytes())
    cases = {"../outside.pt": "file '../outside.pt' is not a file name",
             str(tmp_path / "outside.pt"): "file .* is not a file name", "": "file '' is not",
             None: "file None is not"}
    for name, why in cases.items():
        man["checkpoints"] = [good, dict(good, file=name, iteration=7)]
        (tmp_path / "tier" / "manifest.json").write_text(json.dumps(man))
        with pytest.raises(CheckpointError, match=r"manifest\.json: checkpoint entry 1: " + why):
            newest_verified(tmp_path / "tier")
    for entry, why in (({}, "iteration None"), (dict(good, iteration=True), "iteration True"),
                       (dict(good, sha256=5), "sha256 5"), ([1], r"a list of 1")):
        man["checkpoints"] = [entry]
        (tmp_path / "tier" / "manifest.json").write_text(json.dumps(man))
        with pytest.raises(CheckpointError, match=r"checkpoint entry 0: " + why):
            read_manifest(tmp_path / "tier")


# The writers are forked by a helper process that never runs a torch op itself: a child
# forked from a process whose OpenMP pool has run (pytest's, after other tests) can hang.
SUPERVISOR = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from ckptd.live.persist import PersistTier
from helpers import drain_writer
from test_persist import held
out = sys.argv[1]
for line in sys.stdin:
    start = int(line)
    pid = os.fork()
    if pid == 0:
        try:
            tier = PersistTier(out, every=1, interval_s=None, keep_last=3, keep_every=None)
            it = start
            while True:  # persist every iteration, for ever (until killed)
                tier.offer(held(it, 200_000))
                drain_writer(tier)
                it += 1
        finally:
            os._exit(1)
    print(pid, flush=True)
    os.waitpid(pid, 0)
"""


def test_sigkill_at_20_random_moments_leaves_a_verified_newest(tmp_path):
    rng = random.Random(14)
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path / "ck"), os.path.dirname(__file__)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    newest = -1
    kills_mid_write = 0
    try:
        for _ in range(20):
            sup.stdin.write(f"{newest + 1}\n")
            sup.stdin.flush()
            pid = int(sup.stdout.readline())
            time.sleep(rng.uniform(0.05, 0.4))
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
            out = tmp_path / "ck"
            kills_mid_write += out.is_dir() and any(p.name.endswith(".tmp") for p in out.iterdir())
            got = newest_verified(out) if out.is_dir() else None
            if got is None:
                assert not out.is_dir() or read_manifest(out) is None  # before the first manifest
                continue
            doc, entry = got
            assert entry["iteration"] >= newest
            assert entry["iteration"] == max(e["iteration"] for e in read_manifest(out)["checkpoints"])
            assert torch.equal(doc["model"]["w"], torch.full((200_000,), float(entry["iteration"])))
            newest = entry["iteration"]
    finally:
        sup.stdin.close()
        sup.wait(10)
    assert newest > 5
    print(json.dumps({"newest": newest, "kills_with_a_temporary_left": kills_mid_write}))


def test_restarted_daemon_joins_from_its_own_persisted_state(tmp_path):
    """A daemon captures iterations 0-2 and stops; started again (join: true, no resume)
    on a capture that begins just before iteration 3, it takes its newest persisted state
    (iteration 2, verified against the manifest) and commits 3-5 exactly."""
    from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
    from ckptd.live.daemon import Daemon, load_config
    from ckptd.pipeline import file_source
    from helpers import pcaps, synth

    job = tmp_path / "job"
    synth(job, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=6, mirrors=1, seed=5)
    frames = list(file_source(pcaps(job), []))
    ts = sorted({fr.ts_ns for _, fr in frames})
    starts = [ts[0]] + [b for a, b in zip(ts, ts[1:]) if b - a > 1_000_000]  # 5 ms between iterations
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text(f"plan: {job / 'plan.json'}\ninit: {job / 'init.pt'}\nout: {tmp_path / 'ck'}\n"
                   "listen: 127.0.0.1:0\npersist_every: 1\njoin: true\n"
                   "interfaces:\n  - {name: mirror0, ifname: m0}\n")
    first = Daemon(load_config(cfg))
    assert first.restarted_from is None
    assert first.run(source=iter([f for f in frames if f[1].ts_ns < starts[3]]), install_signals=False) == 0
    assert read_manifest(tmp_path / "ck")["checkpoints"][-1]["iteration"] == 2

    again = Daemon(load_config(cfg))
    assert again.restarted_from == (2, str(tmp_path / "ck" / checkpoint_name(2)))
    assert again.run(source=iter([f for f in frames if f[1].ts_ns >= starts[3] - 1_000_000]),
                     install_signals=False) == 0
    assert [(r.iteration, r.status) for r in again.pipe.reports] == [(3, "committed"), (4, "committed"),
                                                                    (5, "committed")]
    assert again.snapshot.get()["join"]["restarted_from"] == 2
    persisted = [e["iteration"] for e in read_manifest(tmp_path / "ck")["checkpoints"]]
    assert persisted[-1] == 5  # those due while the writer was busy may be superseded
    for it in [i for i in persisted if i >= 3]:
        assert diff_checkpoints(load_checkpoint(tmp_path / "ck" / checkpoint_name(it)),
                                load_checkpoint(job / "reference" / checkpoint_name(it))) == []


def test_a_busy_writer_takes_the_newest_state_due(tmp_path):
    """Due while the writer is still busy: the newer state replaces the one waiting. One
    handed over by write_older (the last finite state of a diverged job) is written all
    the same, and the newer ones' schedule goes on."""
    tier = PersistTier(tmp_path, every=1, interval_s=None, keep_last=None, keep_every=None)
    gate = __import__("threading").Event()
    write = tier._write
    tier._write = lambda h, older=False: (gate.wait(5), write(h, older))
    for it in range(4):  # 0 is taken by the writer (blocked), 1 and 2 wait in turn, 3 stays
        tier.offer(held(it))
        if it == 2:
            tier.write_older(held(1))
        time.sleep(0.05)
    gate.set()
    tier.close()
    assert tier.superseded == 2
    assert [e["iteration"] for e in read_manifest(tmp_path)["checkpoints"]] == [0, 1, 3]
    assert tier.keeper.last_persisted == 3 and not tier.keeper.failing


def test_the_writer_and_its_hashing_threads_yield_the_cpu_to_capture(tmp_path, monkeypatch):
    """The writer thread, and the threads it starts to hash the tensors, run at nice
    PERSIST_NICE: on a host whose cores are busy, a late frame loses its iteration and a
    late checkpoint file only is older. The thread that commits keeps its priority."""
    import threading

    from ckptd.core import manifest
    from ckptd.live.persist import PERSIST_NICE

    def nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = nice()
    if before > PERSIST_NICE:
        pytest.skip(f"this test runs at nice {before}, above the writer's {PERSIST_NICE}")
    seen = {}
    digest = manifest.tensor_digest
    monkeypatch.setattr(manifest, "tensor_digest",
                        lambda t: (seen.setdefault(threading.current_thread().name, nice()), digest(t))[1])
    tier = PersistTier(tmp_path, every=1, interval_s=None, keep_last=None, keep_every=None)
    write = tier._write
    tier._write = lambda h, older=False: (seen.setdefault("writer", nice()), write(h, older))[1]
    tier.offer(held(0))
    tier.close()
    assert read_manifest(tmp_path)["checkpoints"][0]["iteration"] == 0
    hashing = {k: v for k, v in seen.items() if k.startswith("ckptd-digest")}
    assert seen["writer"] == PERSIST_NICE and hashing and set(hashing.values()) == {PERSIST_NICE}, seen
    assert nice() == before


def test_a_thread_already_nicer_keeps_its_priority():
    """lower_priority never raises a thread's priority: under `nice -n 15` the writer
    would otherwise have run ahead of the capture loop (root may lower a nice value)."""
    import threading

    from ckptd.threads import lower_priority

    base = os.getpriority(os.PRIO_PROCESS, 0)  # raising a nice value needs no privilege
    if base > 15:
        pytest.skip(f"this test runs at nice {base}")
    got = {}

    def body(start):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, start)
        got[start] = (lower_priority(10), os.getpriority(os.PRIO_PROCESS, tid))

    for start in (15, base):
        t = threading.Thread(target=body, args=(start,))
        t.start()
        t.join()
    assert got == {15: (True, 15), base: (True, max(10, base))}
