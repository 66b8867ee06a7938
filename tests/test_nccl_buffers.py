"""Module buffers over NCCL (issue 15): DDP's per-forward buffer broadcast decoded into
the checkpoints. The synthesizer trains a real BatchNorm model (tiny-bn): checkpoint k
holds rank 0's running statistics after forward k, taken from iteration k+1's "before"
broadcast; copies of it must agree, and any mirror's copy fills another's gap."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from parsers import icrc
from parsers.capfile import open_capture
from parsers.pcap import write_pcap
from parsers.roce import FrameClass, decode_frame

from ckptd.core.checkpoint import load_checkpoint
from ckptd.core.plan import load_plan
from ckptd.fast.pipeline import fast_replay
from ckptd.pipeline import ReplayOptions, replay
from ckptd.transports.roce.transport import RoceTransport
from helpers import pcaps, synth

ITERATIONS = 4
BUFFERS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")
LAST_NOTE = "not seen whole: DDP broadcasts them at the next forward"


def _synth(tmp: Path, protocol: str, nccl_version: str = "2.27", **kw):
    kw = {"ranks": 3, "channels": 2, "mirrors": 2, "iterations": ITERATIONS, "seed": 1, **kw}
    synth(tmp, model="tiny-bn", protocol=protocol, nccl_version=nccl_version, **kw)


@pytest.fixture(scope="module", params=["simple", "ll", "ll128"])
def bn_job(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"bn-{request.param}")
    _synth(tmp, request.param)
    return tmp


def _run(src: Path, paths, fast: bool, out: Path):
    plan = load_plan(src / "plan.json")
    opts = ReplayOptions(out=str(out), reference=str(src / "reference"))
    start = load_checkpoint(src / "init.pt")
    if fast:
        return fast_replay(plan, paths, start, opts)
    return replay(plan, paths, start, opts)


def _statuses(pipe) -> list[str]:
    return [r.status for r in pipe.reports]


@pytest.mark.parametrize("fast", [False, True])
def test_buffers_replay_bit_exact_on_both_paths(bn_job, tmp_path, fast):
    _check_buffers_replay(bn_job, tmp_path, fast)


@pytest.mark.parametrize("version,protocol", [("2.14", "ll128"), ("2.19", "ll"), ("2.21", "simple")])
def test_buffers_replay_bit_exact_before_2_22(tmp_path, version, protocol):
    """2.14-2.19's interleaved broadcast loops and 2.20-2.21's aligned channel ranges."""
    _synth(tmp_path / "job", protocol, version)
    for fast in (False, True):
        _check_buffers_replay(tmp_path / "job", tmp_path / f"out-{fast}", fast)


def _check_buffers_replay(bn_job: Path, tmp_path: Path, fast: bool):
    plan = load_plan(bn_job / "plan.json")
    assert plan.transport == "roce" and plan.buffers.captured
    assert [t.name for t in plan.buffers.tensors] == list(BUFFERS)
    assert plan.collectives["before"] == ((64, "float32", "broadcast", 0), (1, "int64", "broadcast", 0))
    pipe = _run(bn_job, pcaps(bn_job), fast, tmp_path / "out")
    # the last iteration's buffers are never broadcast (no later forward): as on gloo
    assert _statuses(pipe) == ["committed"] * (ITERATIONS - 1) + ["unrecoverable"]
    assert LAST_NOTE in pipe.reports[-1].note
    assert all(r.exact for r in list(pipe.reports)[:-1])
    assert pipe.extract.counters["buffer_broadcast_packets"] > 0
    assert pipe.extract.counters["buffer_broadcast_conflict"] == 0
    init = load_checkpoint(bn_job / "init.pt")["model"]
    for k in range(ITERATIONS - 1):
        mine = load_checkpoint(tmp_path / "out" / f"iter_{k:06d}.pt")["model"]
        ref = load_checkpoint(bn_job / "reference" / f"iter_{k:06d}.pt")["model"]
        for n in BUFFERS:
            assert torch.equal(mine[n], ref[n]), (k, n)
        assert int(mine["bn.num_batches_tracked"]) == int(init["bn.num_batches_tracked"]) + k + 1
        assert not torch.equal(mine["bn.running_mean"], init["bn.running_mean"])  # real statistics


def _buffer_frames(plan, path) -> list[tuple[int, int]]:
    """(index in file order, iteration whose buffers it carries) of each frame of `path`
    that the reference keeps as a buffer-broadcast copy of group 0 (running stats)."""
    frames = list(open_capture(path))
    index = {fr.index: i for i, fr in enumerate(frames)}
    tr = RoceTransport(plan)
    hits = []
    keep = tr._keep_buffer

    def spy(k, g, send, runs, pkt):
        if g == 0:
            hits.append((index[pkt.frame_no], k))
        return keep(k, g, send, runs, pkt)
    tr._keep_buffer = spy
    classes = Counter()
    for fr in frames:
        tr.feed_frame(0, fr, classes)
    tr.flush()
    return hits


def _alter(frames, k: int):
    """Frame k with a data byte of its payload changed and its ICRC recomputed (an
    altered copy that checks intact). Byte 1 is data in Simple and in LL (a line's first
    word; the second is its flag)."""
    fr = frames[k]
    f = decode_frame(fr.data, fr.linktype, fr.origlen)
    assert f.cls is FrameClass.ROCE_DATA and f.payload_len >= 8
    buf = bytearray(fr.data)
    buf[f.payload_offset + 1] ^= 0x10
    buf[f.icrc_offset:f.icrc_offset + 4] = icrc.pack(icrc.compute(buf, f.ip_offset, f.udp_offset, f.icrc_offset))
    out = list(frames)
    out[k] = type(fr)(fr.index, fr.ts_ns, fr.linktype, fr.caplen, fr.origlen, bytes(buf))
    return out


LATER_NS = 10_000_000


def _rewrite(tmp: Path, src: Path, change, later: bool = False) -> tuple[list[str], int]:
    """Mirror 0's capture changed at one buffer-broadcast frame carrying the buffers
    after iteration 1 (change(frames, k) -> frames); the other mirrors as they are.
    later: mirror 0's frames reach the capture host 10 ms after the others'."""
    plan = load_plan(src / "plan.json")
    paths = pcaps(src)
    k, it = next((k, it) for k, it in _buffer_frames(plan, paths[0]) if it == 1)
    frames = change(list(open_capture(paths[0])), k)
    if later:
        frames = [type(fr)(fr.index, fr.ts_ns + LATER_NS, fr.linktype, fr.caplen, fr.origlen, fr.data)
                  for fr in frames]
    out = [str(tmp / Path(p).name) for p in paths]
    write_pcap(out[0], frames)
    for p, o in zip(paths[1:], out[1:]):
        write_pcap(o, list(open_capture(p)))
    return out, it


@pytest.mark.parametrize("fast,later", [(False, False), (True, False), (False, True), (True, True)])
def test_an_altered_buffer_copy_is_a_conflict_not_a_commit(bn_job, tmp_path, fast, later):
    """Whether the altered copy comes first or 10 ms after the intact ones (within the
    agreement window), the disagreement is found: never resolved by arrival order."""
    paths, bad = _rewrite(tmp_path, bn_job, _alter, later)
    pipe = _run(bn_job, paths, fast, tmp_path / "out")
    st = _statuses(pipe)
    assert st[bad] == "conflict", st
    assert "module buffers after iteration 1" in pipe.reports[bad].note and "disagree" in pipe.reports[bad].note
    assert pipe.extract.counters["buffer_broadcast_conflict"] >= 1
    # the gradients were right: the shadow goes on, and the next iteration's buffers
    # (a whole new broadcast) commit again
    assert st[:bad] == ["committed"] * bad and st[bad + 1] == "committed"
    assert all(r.exact is not False for r in pipe.reports)
    assert not (tmp_path / "out" / f"iter_{bad:06d}.pt").exists()


def test_the_cli_exits_3_on_a_buffer_conflict(bn_job, tmp_path):
    paths, bad = _rewrite(tmp_path, bn_job, _alter)
    r = subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(bn_job / "plan.json"),
                        "--init", str(bn_job / "init.pt"), "--out", str(tmp_path / "cli"), *paths],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"iteration {bad:>4}: conflict" in r.stdout
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("fast", [False, True])
def test_a_lost_buffer_packet_is_recovered_from_another_mirror(bn_job, tmp_path, fast):
    paths, _ = _rewrite(tmp_path, bn_job, lambda frames, k: frames[:k] + frames[k + 1:])
    pipe = _run(bn_job, paths, fast, tmp_path / "out")
    assert _statuses(pipe) == ["committed"] * (ITERATIONS - 1) + ["unrecoverable"]
    assert all(r.exact for r in list(pipe.reports)[:-1])


def test_a_buffer_packet_lost_on_every_mirror_leaves_its_iteration_uncommitted(tmp_path):
    """Without any copy the buffers after that iteration are not known: not committed
    (the checkpoint would lack them), and the next iteration commits again."""
    _synth(tmp_path / "job", "simple", mirrors=1)
    paths, bad = _rewrite(tmp_path, tmp_path / "job", lambda frames, k: frames[:k] + frames[k + 1:])
    # the one mirror (rank 0's port) sees each byte of the broadcast once, on hop 0 -> 1
    pipe = _run(tmp_path / "job", paths, True, tmp_path / "out")
    st = _statuses(pipe)
    assert st[bad] == "unrecoverable" and st[bad + 1] == "committed", st


def test_synth_refuses_an_nccl_version_outside_the_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ckptd", "synth", "--out", str(tmp_path / "cli"), "--model", "tiny-bn",
                        "--iterations", "1", "--nccl-version", "2.13"], capture_output=True, text=True, timeout=300)
    # ckptd synth exits 2 with one line for what it cannot synthesize, like any bad input
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "NCCL 2.13 is not supported" in r.stderr and "Traceback" not in r.stderr
