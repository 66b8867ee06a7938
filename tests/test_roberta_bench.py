"""benchmarks/roberta.py and its traffic writer (ckptd/testing/synth/bulk.py) at a tiny size:
the bulk writer agrees with the per-frame synthesizer, and the benchmark runs end to end
and finds the replayed state bit-exact. No timing is asserted."""
from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest

from benchmarks import roberta
from ckptd.core.plan import BucketLayout, Mirror, Plan
from ckptd.core.schedule import RingConfig
from ckptd.testing.synth.bulk import BulkSynth, MessageFrames, rank_gradients, reduce_bucket
from ckptd.testing.synth.ring import reduce_iteration
from ckptd.testing.synth.wire import Host, QueuePair
from parsers.pcap import PcapWriter, iter_pcap


@pytest.mark.parametrize("addr", ["10.0.0.", "fd00:77::"])
def test_message_frames_match_queue_pair(addr):
    """Rows built as one array are byte for byte QueuePair.write's frames, PSN wrap included."""
    for size in (0, 100, 4096, 8193, 3 * 4096 + 17, 50 * 4096):
        ref_qp = QueuePair(Host(addr + "1", 1), Host(addr + "2", 2), 0x123, 0x456, 0xFFFFF0, 50000)
        qp = copy.copy(ref_qp)
        payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        ref = [f for f, _, _ in ref_qp.write(payload.tobytes(), 4096, va=77, rkey=5, imm=b"\1\2\3\4")]
        buf = io.BytesIO()
        n, nbytes = MessageFrames(4096).write(qp, payload, 77, 5, b"\1\2\3\4", [PcapWriter(buf)], 1000)
        buf.seek(0)
        assert [fr.data for fr in iter_pcap(buf)] == ref
        assert (n, nbytes, qp.psn) == (len(ref), sum(map(len, ref)), ref_qp.psn)


def test_reduce_bucket_matches_ring_reduction():
    """Final values and every reduce-scatter payload equal ckptd.testing.synth.ring's, bit for bit."""
    cfg = RingConfig(nranks=4, rings=((0, 1, 2, 3), (0, 2, 1, 3)), mtu=1024)
    layout = (BucketLayout(count=300_000), BucketLayout(count=12_345))
    plan = Plan((), layout, layout, cfg, None, tuple(f"10.0.0.{i + 1}" for i in range(4)),
                (Mirror("m0", 0, "tx"),))
    sched = plan.schedule(0)
    scratch = np.zeros((4, 300_000), np.float32)
    local = [rank_gradients(1, 0, b, 4, bk.count, scratch)[:, :bk.count].copy()
             for b, bk in enumerate(sched.buckets)]
    final, payloads = reduce_iteration(sched, [[local[b][r] for b in range(2)] for r in range(4)])
    by_bucket = BulkSynth._sends_by_bucket(sched)
    for b in range(2):
        red = reduce_bucket(sched, b, by_bucket[b], local[b], {0: set(range(4)), 1: set(range(4))})
        assert red.final.tobytes() == final[b].tobytes()
        for conn, sends in sched.sends.items():
            for s, want in zip(sends, payloads[conn]):
                if s.bucket == b:
                    got = red.payload(conn[2], s, cfg.ring_index(conn[2], conn[0]))
                    assert got.tobytes() == want.tobytes()


def test_mirrors_that_miss_allgather_elements_are_refused(tmp_path):
    params = roberta.roberta_parameters(0.2, layers=1)
    plan = roberta.build_plan(params, ranks=4, mirror_ranks=(0,), mirror_direction="rx")
    with pytest.raises(ValueError, match="miss allgather elements"):
        BulkSynth(plan, [tmp_path / "m0.pcap"])


def test_benchmark_runs_bit_exact(tmp_path):
    out = tmp_path / "result.json"
    work = tmp_path / "work"
    rc = roberta.main(["--params", "0.5", "--layers", "1", "--bucket-cap-mb", "0.5",
                       "--iterations", "3", "--optimizer-reps", "1", "--workdir", str(work),
                       "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["exact"] and s["committed"] == 3
    assert len(doc["replay"]["commits"]) == 3
    assert all(c["commit_lag"] is not None for c in doc["replay"]["commits"])
    assert sum(doc["generate"]["frames"]) > 0
    assert not list(work.glob("*.pcap"))  # the captures are deleted without --keep
