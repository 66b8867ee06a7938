"""NCCL's tree allreduce (ckptd.core.tree): the shape and chunks `synth --collective tree`
writes and the binder refuses by name, checked against NCCL's own pictures and by hand."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ckptd.core.schedule import Bucket, RingConfig
from ckptd.core.tree import TreeSchedule, _channel_chunks, tree_edges

from helpers import pcaps, synth

REPO = Path(__file__).resolve().parents[1]

F32 = np.dtype(np.float32)


def _pairs(children: dict) -> set:
    return {(c, p) for p, kids in children.items() for c in kids}


# The pictures in src/graph/trees.cc:22-29,70-86@v2.19.4-1, read as parent -> children.
@pytest.mark.parametrize("nnodes, which, picture", [
    (14, 0, {0: [8], 8: [4, 12], 4: [2, 6], 12: [10, 13], 2: [1, 3], 6: [5, 7], 10: [9, 11]}),
    (12, 1, {11: [3], 3: [1, 7], 7: [5, 9], 1: [0, 2], 5: [4, 6], 9: [8, 10]}),  # mirrored
    (13, 1, {1: [9], 9: [5, 0], 5: [3, 7], 0: [11], 3: [2, 4], 7: [6, 8], 11: [10, 12]}),  # shifted
])
def test_tree_shape_is_nccls(nnodes, which, picture):
    assert set(tree_edges(nnodes, which)) == _pairs(picture)


def test_tree_chunks_by_hand():
    # 2.19 Simple, 2 one-GPU nodes, 1e6 fp32 on 2 channels: depth 1, the 512 KiB step halves
    # while 4e6 // (2 * chunk) < 8 (enqueue.cc:1352@v2.19.4-1): 256 KiB -> 7, 128 KiB (floor);
    # channel bid takes chunk bid of every 2-chunk loop (all_reduce.h:120-122@v2.19.4-1)
    cfg = RingConfig(2, ((0, 1), (0, 1)), "simple", (2, 19))
    parts = dict(_channel_chunks(cfg, 1_000_000, 4, 2))
    assert parts[0][:2] == [(0, 32768), (65536, 32768)] and parts[0][-1] == (983040, 1_000_000 - 983040)
    assert parts[1][0] == (32768, 32768) and parts[1][-1] == (950272, 32768) and len(parts[1]) == 15
    # 2.27 LL128: 15/16 of the 614400-B step (576000) halved while 4e6 // (2 * chunk) < 2.1*64
    # (> 131072) then < 2.1*16 (> 32768): 36000, to the 1920-B grain: 34560 B = 8640 elements
    cfg = RingConfig(2, ((0, 1), (0, 1)), "ll128", (2, 27))
    parts = dict(_channel_chunks(cfg, 1_000_000, 4, 2))
    spans = sorted(c for chunks in parts.values() for c in chunks)
    assert all(n == 8640 for chunks in parts.values() for _, n in chunks[:-1])
    assert sum(n for _, n in spans) == 1_000_000
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))  # contiguous, no gap or overlap


def test_every_chunk_goes_up_and_down_each_edge():
    cfg = RingConfig(2, ((0, 1), (0, 1)), "ll", (2, 27))
    t = TreeSchedule(cfg, [Bucket(300_000, F32), Bucket(5_000, F32)], ["a", "b"])
    # channel 0 runs tree 0 (node 1's parent is node 0), channel 1 tree 1 (the mirror)
    assert t.edges == {0: [(1, 0)], 1: [(0, 1)]}
    for c in (0, 1):
        up, down = t.sends[t.edges[c][0] + (c,)], t.sends[t.edges[c][0][::-1] + (c,)]
        assert [(s.bucket, s.offset, s.nelem) for s in up] == [(s.bucket, s.offset, s.nelem) for s in down]
        assert [s.wire_bytes for s in up] == [m.wire_len for m in t.flows[t.edges[c][0] + (c, 0)].messages]
    for b, bucket in enumerate(t.buckets):
        got = np.zeros(bucket.count, np.int32)
        for c in (0, 1):
            for s in t.sends[t.edges[c][0] + (c,)]:
                if s.bucket == b:
                    got[s.offset:s.offset + s.nelem] += 1
        assert (got == 1).all()  # every element up each edge once, on one channel


def test_ring_traffic_that_fits_no_plan_is_not_called_tree(tmp_path):
    """Ring traffic whose plan says another path MTU binds nothing (every message sits at
    other PSNs), so the binder looks for reduce-scatter, Tree and another protocol in it,
    and must find none: it stays unmatched (exit 3)."""
    synth(tmp_path / "a", ranks=2, channels=2, iterations=2, mirrors=2)
    synth(tmp_path / "b", ranks=2, channels=2, iterations=2, mirrors=2, mtu=1024)
    res = subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(tmp_path / "b" / "plan.json"),
                          "--init", str(tmp_path / "a" / "init.pt"), *pcaps(tmp_path / "a")],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 3 and "unmatched flow" in out and "error:" not in out, out


@pytest.mark.parametrize("wire, plan, words", [
    ("simple", "ll128", ("NCCL's Simple", "protocol ll128", "NCCL_PROTO=LL128")),  # lengths bind, lines do not
    ("ll128", "simple", ("NCCL's LL128", "protocol simple", "NCCL_PROTO=Simple")),  # nothing binds
    ("ll", "ll128", ("NCCL's LL (16-byte lines", "protocol ll128", "NCCL_PROTO=LL128")),
])
@pytest.mark.parametrize("fast", [False, True])
def test_traffic_of_another_protocol_is_refused_by_name(tmp_path_factory, wire, plan, words, fast):
    base = tmp_path_factory.getbasetemp()
    for proto in (wire, plan):
        if not (base / f"proto-{proto}" / "plan.json").exists():
            synth(base / f"proto-{proto}", ranks=2, channels=2, iterations=2, mirrors=2, protocol=proto)
    res = subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(base / f"proto-{plan}" / "plan.json"),
                          "--init", str(base / f"proto-{wire}" / "init.pt"), *pcaps(base / f"proto-{wire}"),
                          *([] if fast else ["--reference-path"])],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and all(w in err for w in words), err
