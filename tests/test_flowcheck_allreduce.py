"""Real NCCL traffic is the judge of our schedule (issue 7).

Four FlowCheck captures hold an NCCL 2.19 LL ring allreduce of 5,000 int32 over 2
ranks and 2 channels, taken on real ConnectX-6 NICs; the reduced values are known:
2 * (i % 10), and each rank's reduce-scatter payload is its own i % 10.
"""
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from ckptd.cli import main
from ckptd.pipeline import ReplayOptions, replay
from ckptd.core.plan import load_plan
from ckptd.testing.synth import SynthOptions
from ckptd.testing.synth.ring import reduce_iteration
from ckptd.testing.synth import Wire
from parsers.capfile import open_capture
from parsers.roce import FrameClass, decode_frame

PLAN = Path(__file__).parent / "data" / "flowcheck_allreduce_plan.json"
CAPTURES = ["allreduce_addstep", "allreduce+p2p", "allreduce+partial_p2p", "allreduce+partial_p2p_new"]
ELEMENTS = np.arange(5000)


@pytest.mark.parametrize("name", CAPTURES)
def test_real_allreduce_gives_every_reduced_element(flowcheck_dir, tmp_path, name):
    plan = load_plan(PLAN)
    pipe = replay(plan, [str(flowcheck_dir / f"{name}.pcapng")], None,
                  ReplayOptions(dump_gradients=str(tmp_path)))
    first = pipe.reports[0]
    assert first.iteration == 0 and first.status == "complete" and not first.missing
    grad = np.load(tmp_path / "iter_000000_bucket_000.npy")
    assert grad.dtype == np.int32
    np.testing.assert_array_equal(grad, 2 * (ELEMENTS % 10))
    assert np.load(tmp_path / "iter_000000_bucket_000_coverage.npy").all()
    # Reduce-scatter bookkeeping: each rank's first send is its own i % 10. With 2 ranks
    # and 2 channels, rank 0 (ring index 0) sends chunk 1: channel 0's [4096, 5000) and
    # channel 1's empty tail; rank 1 sends chunk 0: [0, 2048) and [2048, 4096).
    for rank, (lo, hi) in ((0, (4096, 5000)), (1, (0, 4096))):
        vals = np.load(tmp_path / f"iter_000000_bucket_000_rs_rank{rank}.npy")
        cov = np.load(tmp_path / f"iter_000000_bucket_000_rs_rank{rank}_coverage.npy")
        assert cov[lo:hi].all() and cov.sum() == hi - lo
        np.testing.assert_array_equal(vals[lo:hi], ELEMENTS[lo:hi] % 10)
    # LL flags: every line carried its connection's step flag, growing by one per step.
    assert pipe.extract.counters["ll_flag_mismatch"] == 0
    assert pipe.extract.counters["schedule_mismatch"] == 0
    assert len(pipe.extract.flag_base) == 4  # 2 hops x 2 channels
    # these connections had carried nothing before: the first step's flag is 1, then 2, 3
    assert set(pipe.extract.flag_base.values()) == {0}
    if name == "allreduce_addstep":
        # The next allreduce starts and is cut off: incomplete, every element missing.
        second = pipe.reports[1]
        assert second.status == "unrecoverable"
        assert [(m.bucket, m.start, m.end) for m in second.missing] == [(0, 0, 5000)]
    else:
        assert len(pipe.reports) == 1


def test_cli_dump_gradients_and_exit_status(flowcheck_dir, tmp_path, capsys):
    rc = main(["replay", "--plan", str(PLAN), "--dump-gradients", str(tmp_path),
               str(flowcheck_dir / "allreduce_addstep.pcapng")])
    out = capsys.readouterr().out
    assert rc == 3  # the cut-off second allreduce could not be recovered
    assert "iteration    1: unrecoverable" in out
    assert "missing: bucket 0 elements [0, 5000)" in out
    assert (tmp_path / "iter_000000_bucket_000.npy").exists()


def _messages(frames):
    """Per data QP, in PSN order: (opcodes, DMA length, immediate bytes, LL flags relative
    to the QP's first) of every RDMA write message."""
    by_flow = defaultdict(list)
    for data in frames:
        f = decode_frame(data)
        if f.cls is FrameClass.ROCE_DATA and f.bth.opcode in (6, 7, 9, 11):
            by_flow[(str(f.src), str(f.dst), f.bth.dest_qp)].append(f)
    out = {}
    for key, pkts in by_flow.items():
        pkts.sort(key=lambda f: f.bth.psn)
        msgs, cur = [], None
        for f in pkts:
            if f.bth.opcode in (6, 11):
                cur = {"ops": [], "dma": f.reth.dma_len, "imm": None, "flags": set()}
                msgs.append(cur)
            cur["ops"].append(f.bth.opcode)
            if f.immdt is not None:
                cur["imm"] = f.immdt.raw
            words = np.frombuffer(f.payload, "<u4").reshape(-1, 4)
            cur["flags"] |= set(words[:, 1].tolist()) | set(words[:, 3].tolist())
        base = min(min(m["flags"]) for m in msgs if m["flags"])
        for m in msgs:
            m["flags"] = sorted(x - base for x in m["flags"])
            m["ops"] = tuple(m["ops"])
        out[key] = msgs
    # name each data QP by (sender, receiver, channel): QPNs grow with the channel
    named = {}
    for (src, dst, qp), msgs in sorted(out.items(), key=lambda kv: kv[0][2]):
        ch = sum(1 for k in named if k[:2] == (src, dst))
        named[(src, dst, ch)] = msgs
    return named


def test_synthesizer_sends_what_nccl_sent(flowcheck_dir):
    plan = load_plan(PLAN)
    sched = plan.schedule(0)
    local = [[(ELEMENTS % 10).astype(np.int32)] for _ in range(2)]
    final, payloads = reduce_iteration(sched, local)
    np.testing.assert_array_equal(final[0], 2 * (ELEMENTS % 10))
    wire = Wire(plan, SynthOptions(out="", noise=False), random.Random(1))
    synthesized = _messages([f for _, _, f in wire.iteration_frames(sched, payloads)])
    real = _messages([fr.data for fr in open_capture(flowcheck_dir / "allreduce+partial_p2p_new.pcapng")])
    real = {k: v for k, v in real.items() if k in synthesized}
    assert sorted(real) == sorted(synthesized)
    for key in synthesized:
        assert synthesized[key] == real[key][:len(synthesized[key])], key
    # the facts the comparison covered, spelled out
    r0_ch1 = synthesized[("fe80::e42:a1ff:fe9f:58f8", "fe80::ac0:ebff:fe8c:282c", 1)]
    assert r0_ch1[0]["ops"] == (11,) and r0_ch1[0]["dma"] == 0  # zero-length WRITE_ONLY_WITH_IMM
    assert r0_ch1[1]["imm"] == (16384).to_bytes(4, "little")  # immediate: size, little-endian
