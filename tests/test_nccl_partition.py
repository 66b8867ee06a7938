"""NCCL's channel partition and chunking against NCCL's own code: every row of the
tables in tests/data/nccl/ (docs/NCCL.md section 6 says how they were made: the
functions compiled from each tag's sources, run over a grid of inputs). Allreduce 2.22+;
broadcast and allgather 2.14+ (before 2.22 the tables list the device loop's sends)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptd.core.schedule import RingConfig, cbd_chunk_count, cbd_ranges

TABLES = sorted((Path(__file__).parent / "data" / "nccl").glob("partition-*.json"))
ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}


def _version(table: dict) -> tuple[int, int]:
    major, minor = table["nccl"].split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("path", TABLES, ids=[p.stem for p in TABLES])
def test_partition_and_chunks_equal_nccls_own(path):
    table = json.loads(path.read_text())
    version = _version(table)
    checked = 0
    for count, dtype, nranks, comm_ch, proto, forced, tuned, _nwarps, channels in table["rows"]:
        E = ITEMSIZE[dtype]
        cfg = RingConfig(nranks, tuple(tuple(range(nranks)) for _ in range(comm_ch)), proto, version)
        nc = forced or cfg.tune(count * E)[0]
        if not forced:
            assert nc == tuned, (count, dtype, nranks, comm_ch, proto)
        got = cbd_ranges(version, proto, count, E, comm_ch, nc)
        want = [(c, off, n) for c, off, n, *_ in channels]
        assert got == want, (count, dtype, nranks, comm_ch, proto, forced)
        chunk = cbd_chunk_count(proto, cfg.step_bytes, E)
        loop, align = nranks * chunk, 16 // E
        for c, off, n, chunk_count, loops, last in channels:
            assert chunk == chunk_count
            assert -(-n // loop) == loops
            rem = n % loop
            # the short last loop's chunks: alignUp(divUp(rem, nranks), 16/sizeof(T))
            assert (-(-(-(-rem // nranks)) // align) * align if rem else chunk) == last, (count, c)
        checked += 1
    assert checked > 1000


BROADCAST_TABLES = sorted((Path(__file__).parent / "data" / "nccl").glob("broadcast-*.json"))


@pytest.mark.parametrize("path", BROADCAST_TABLES, ids=[p.stem for p in BROADCAST_TABLES])
def test_broadcast_partition_and_chunks_equal_nccls_own(path):
    """A ring broadcast (int8 bytes, ncclFuncTrafficPerByte 1, BROADCAST_CHUNKSTEPS 1) against
    NCCL's own partition and chunking code compiled at each tag (docs/NCCL.md section 6), and
    RingSchedule's sends against the same parts: each hop out of the root carries every chunk
    of every channel's part, in order."""
    import numpy as np

    from ckptd.core.schedule import BROADCAST_CHUNKSTEPS, Broadcast, RingSchedule
    table = json.loads(path.read_text())
    version = _version(table)
    if version < (2, 22):
        _check_sends_before_2_22(table, allgather=False)
        return
    scheduled = 0
    for cfg, nbytes, nranks, comm_ch, channels in _rows_with_parts_checked(table, version, BROADCAST_CHUNKSTEPS,
                                                                           per_rank=False):
        sched = RingSchedule(cfg, [], before=[Broadcast(nbytes // 4, np.dtype("float32"), 0)])
        for c in range(comm_ch):
            want = [((off + e) // 4, min(ch, n - e) // 4) for cc, off, n, ch in channels if cc == c
                    for e in range(0, n, ch)]
            assert [(x.offset, x.nelem) for x in sched.sends[(0, 1, c)]] == want
            assert not sched.sends[(nranks - 1, 0, c)]
        scheduled += 1
    assert len(table["rows"]) > 1000 and scheduled > 50


ALLGATHER_TABLES = sorted((Path(__file__).parent / "data" / "nccl").glob("allgather-*.json"))


@pytest.mark.parametrize("path", ALLGATHER_TABLES, ids=[p.stem for p in ALLGATHER_TABLES])
def test_allgather_partition_and_chunks_equal_nccls_own(path):
    """A ring allgather (int8 bytes a rank, ncclFuncTrafficPerByte nRanks, tuned on nRanks
    times the bytes, ALLGATHER_CHUNKSTEPS 4) against NCCL's own partition and chunking code
    compiled at each tag (scripts/nccl-broadcast-harness), and RingSchedule's sends against
    the same parts: every hop carries, chunk after chunk of every channel's part, the
    chunk of the sender's own block, then of the rank before it, ..., nranks-1 blocks, each
    cut into slices that tile it."""
    import numpy as np

    from ckptd.core.schedule import ALLGATHER_CHUNKSTEPS, AllGather, RingSchedule
    table = json.loads(path.read_text())
    assert table["function"].startswith("allgather")
    version = _version(table)
    if version < (2, 22):
        _check_sends_before_2_22(table, allgather=True)
        return
    scheduled = 0
    for cfg, nbytes, nranks, comm_ch, channels in _rows_with_parts_checked(table, version, ALLGATHER_CHUNKSTEPS,
                                                                           per_rank=True):
        count = nbytes // 4
        sched = RingSchedule(cfg, [], before=[AllGather(count, np.dtype("float32"))])
        for c in range(comm_ch):
            want = [(k, j, (-j) % nranks * count + (off + e) // 4, min(ch, n - e) // 4)
                    for cc, off, n, ch in channels if cc == c
                    for k, e in enumerate(range(0, n, ch)) for j in range(nranks - 1)]
            got = {}
            for x in sched.sends[(0, 1, c)]:
                got.setdefault((x.chunk, x.ring_step), []).append((x.offset, x.nelem))
            assert len(got) == len(want)
            for k, j, first, n in want:
                parts = [p for p in got[(k, j)] if p[1]]
                assert parts[0][0] == first and sum(p[1] for p in parts) == n
                assert all(a[0] + a[1] == b[0] for a, b in zip(parts, parts[1:]))
        scheduled += 1
    assert len(table["rows"]) > 1000 and scheduled > 50


def _rows_with_parts_checked(table: dict, version, chunksteps: int, per_rank: bool):
    """Every row of a 2.22+ broadcast or allgather table with its channel parts and chunk
    size checked against ours (an allgather's count is per rank: tuned on nRanks times the
    bytes, ncclFuncTrafficPerByte nRanks); yields (cfg, nbytes, nranks, comm_ch, channels)
    of the rows small and unforced enough to schedule as well."""
    from ckptd.core.schedule import _ring_chunk_bytes
    for nbytes, nranks, comm_ch, proto, forced, channels in table["rows"]:
        cfg = RingConfig(nranks, tuple(tuple(range(nranks)) for _ in range(comm_ch)), proto, version)
        factor = nranks if per_rank else 1
        nc = forced or cfg.tune(nbytes * factor)[0]
        assert cbd_ranges(version, proto, nbytes, 1, comm_ch, nc, traffic_per_byte=factor) == \
            [(c, off, n) for c, off, n, _ in channels], (nbytes, nranks, comm_ch, proto, forced)
        chunk = _ring_chunk_bytes(proto, cfg.step_bytes, chunksteps)
        assert all(ch == chunk for *_, ch in channels)
        if not (forced or nbytes % 4 or nbytes > 1 << 22 or nranks > 3):
            yield cfg, nbytes, nranks, comm_ch, channels

def _check_sends_before_2_22(table: dict, allgather: bool, chunks=None):
    """NCCL 2.14-2.21: the tables list, per channel, rank 0's sends as NCCL's own runRing makes
    them from the work element NCCL's host rules give (scripts/nccl-broadcast-harness/genold.py)
    and every rank's number of sends. schedule.pipeline_chunks (or `chunks`, a stand-in rule)
    must give the same chunks, and RingSchedule the same sends on each hop: a broadcast's from
    the root (rank 0) on every hop but the one into it; an allgather's own block first, then the
    block of the rank j before, j = 1..nranks-2 (output offset owner * bytes + offset), each
    Simple chunk as slices that tile it. Returns how many rows disagree (0 for NCCL's rules)."""
    import numpy as np

    from ckptd.core.schedule import AllGather, Broadcast, RingSchedule, pipeline_chunks
    chunks = chunks or pipeline_chunks
    version = _version(table)
    wrong = scheduled = 0
    for nbytes, nranks, comm_ch, proto, forced, channels in table["rows"]:
        cfg = RingConfig(nranks, tuple(tuple(range(nranks)) for _ in range(comm_ch)), proto, version)
        nc, nt = cfg.tune(nbytes * (nranks if allgather else 1))
        got = {c: [(off, n) for off, n in parts] for c, parts in chunks(cfg, nbytes, forced or nc, nt, allgather)}
        want = {}
        for c, sends, counts in channels:
            # a chunk past the end has nelem < 0: prims post it empty (nelem < 0 ? 0 : nelem,
            # prims_ll.h:234, prims_ll128.h:304, prims_simple.h:196@v2.19.4-1)
            sends = [[off, max(0, n)] for off, n in sends]
            per = len(sends) // (nranks - 1) if allgather else len(sends)
            want[c] = [tuple(x) for x in sends[:per * (nranks - 1):nranks - 1]] if allgather else \
                [tuple(x) for x in sends]
            # the hop into the root carries nothing; every allgather hop carries nranks-1 copies
            assert counts == ([len(sends)] * nranks if allgather else [len(sends)] * (nranks - 1) + [0])
            if allgather:
                assert sends == [[(-j) % nranks * nbytes + off, n] for off, n in want[c] for j in range(nranks - 1)]
        if got != want:
            wrong += 1
            continue
        if forced or nbytes % 4 or nranks > 3 or chunks is not pipeline_chunks:
            continue
        other = AllGather(nbytes // 4, np.dtype("float32")) if allgather else Broadcast(nbytes // 4, np.dtype("float32"), 0)
        sched = RingSchedule(cfg, [], before=[other])
        for c in want:
            if allgather:
                merged = {}
                for x in sched.sends[(0, 1, c)]:
                    merged.setdefault((x.chunk, x.ring_step), []).append((x.offset * 4, x.nelem * 4))
                assert [(parts[0][0], sum(n for _, n in parts)) for parts in merged.values()] == \
                    [((-j) % nranks * nbytes + off, n) for off, n in want[c] for j in range(nranks - 1)]
            else:
                assert [(x.offset * 4, x.nelem * 4) for x in sched.sends[(0, 1, c)]] == want[c]
                assert not sched.sends[(nranks - 1, 0, c)]
        scheduled += 1
    if chunks is pipeline_chunks:
        assert wrong == 0 and len(table["rows"]) > 500 and scheduled > 50
    return wrong


@pytest.mark.parametrize("name", ["broadcast-2.14.3", "allgather-2.19.4", "broadcast-2.20.5", "allgather-2.21.5"])
def test_a_wrong_rule_before_2_22_fails_rows(name):
    """Negative controls: the 2.22+ rule (cells) for 2.14-2.21, and, for 2.14-2.19, the
    LL128 chunk grain of the other collective (broadcast.h has no /2, all_gather.h has)."""
    from ckptd.core import schedule
    table = json.loads((Path(__file__).parent / "data" / "nccl" / f"{name}.json").read_text())
    allgather = name.startswith("allgather")

    def cells(cfg, nbytes, nc, nt, ag):
        from dataclasses import replace
        return schedule.pipeline_chunks(replace(cfg, nccl_version=(2, 22)), nbytes, nc, nt, ag)

    def other_grain(cfg, nbytes, nc, nt, ag):
        return schedule.pipeline_chunks(cfg, nbytes, nc, nt, not ag)

    rows = len(table["rows"])
    assert _check_sends_before_2_22(table, allgather, cells) > rows // 10
    if _version(table) < (2, 20):
        assert _check_sends_before_2_22(table, allgather, other_grain) > 0


@pytest.mark.parametrize("version,protocol,ranks,channels,ipv6", [
    ("2.22", "simple", 3, 4, False),  # 2.22: small buckets may spill past the tuned channels
    ("2.23", "ll", 4, 2, True),
    ("2.26", "ll", 2, 3, False),
    ("2.29", "simple", 4, 2, True),  # big-endian immediates from 2.29
    ("2.32", "ll", 3, 1, False),
])
def test_todays_nccl_replays_bit_exact_on_both_paths(tmp_path, version, protocol, ranks, channels, ipv6):
    from helpers import pcaps, synth

    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.core.plan import load_plan
    from ckptd.fast.pipeline import fast_replay
    from ckptd.pipeline import ReplayOptions, replay
    synth(tmp_path, ranks=ranks, channels=channels, protocol=protocol, nccl_version=version,
          mirrors=2, iterations=3, ipv6=ipv6, loss=1e-3, seed=7)
    plan = load_plan(tmp_path / "plan.json")
    for run in (replay, fast_replay):
        pipe = run(plan, pcaps(tmp_path), load_checkpoint(tmp_path / "init.pt"),
                   ReplayOptions(reference=str(tmp_path / "reference")))
        assert [(r.status, r.exact) for r in pipe.reports] == [("committed", True)] * 3, \
            [(r.status, r.note) for r in pipe.reports]


def test_buckets_of_25_mb_and_more_replay_bit_exact_on_both_paths(tmp_path):
    """A 42 MB and a 17 MB bucket over 2 channels (NCCL 2.29): many 1 MiB sends per
    channel whose lengths tell the channels apart only in their last loop, with a
    foreign RoCE flow on the same link. Flows must still bind in QPN (= channel) order."""
    from helpers import pcaps, synth

    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.core.plan import load_plan
    from ckptd.fast.pipeline import fast_replay
    from ckptd.pipeline import ReplayOptions, replay
    synth(tmp_path, model="medium", ranks=2, channels=2, nccl_version="2.29", mirrors=1,
          iterations=2, bucket_cap_kb=32768, seed=2)
    plan = load_plan(tmp_path / "plan.json")
    assert max(b.nbytes for b in plan.schedule(1).buckets) >= 25 << 20
    opts = ReplayOptions(reference=str(tmp_path / "reference"))
    for run in (replay, fast_replay):
        pipe = run(load_plan(tmp_path / "plan.json"), pcaps(tmp_path), load_checkpoint(tmp_path / "init.pt"), opts)
        assert [(r.status, r.exact) for r in pipe.reports] == [("committed", True)] * 2, \
            [(r.iteration, r.status, r.note) for r in pipe.reports]


@pytest.mark.parametrize("version,ranks,channels", [("2.19", 3, 2), ("2.26", 4, 2), ("2.29", 2, 1)])
def test_four_qps_per_connection_replay_bit_exact_on_both_paths(tmp_path, version, ranks, channels):
    """NCCL_IB_QPS_PER_CONNECTION=4: split over the QPs (2.18-2.19 default) or whole sends
    rotating over them (2.20+), two mirrors with loss."""
    from helpers import pcaps, synth

    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.core.plan import load_plan
    from ckptd.fast.pipeline import fast_replay
    from ckptd.pipeline import ReplayOptions, replay
    synth(tmp_path, ranks=ranks, channels=channels, nccl_version=version, qps=4, mirrors=2,
          loss=0.002, iterations=3, seed=5)
    opts = ReplayOptions(reference=str(tmp_path / "reference"))
    for run in (replay, fast_replay):
        pipe = run(load_plan(tmp_path / "plan.json"), pcaps(tmp_path), load_checkpoint(tmp_path / "init.pt"), opts)
        assert [(r.status, r.exact) for r in pipe.reports] == [("committed", True)] * 3, \
            [(r.iteration, r.status, r.note) for r in pipe.reports]
