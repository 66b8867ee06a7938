"""NCCL connection state that lives across collectives (issue 12): the QP rotation index,
2.14-2.15's RDMA WRITE + 0-byte WRITE_WITH_IMM, 2.14-2.17's split over every QP, and the
clear-to-send write. The schedule is checked against a step-by-step simulation of
net_ib's posting loop; the replays against the trainer's own checkpoints, bit for bit,
on the reference and the fast path."""
from __future__ import annotations

import pytest

from ckptd.core.plan import PlanError, load_plan, plan_from_json
from ckptd.core.schedule import IB_AR_THRESHOLD, RingConfig
from parsers.capfile import open_capture
from parsers.roce import FrameClass, decode_frame

from helpers import pcaps, run_replay, synth
from test_fastpath import assert_same, synth_pair


def _plan(version: str, qps: int, counts=(3000, 70000, 5), ranks: int = 2, channels: int = 1,
          protocol: str = "ll", split=None, rebuilt=None):
    ring = {"nranks": ranks, "nccl_version": version, "channels": channels, "protocol": protocol,
            "qps_per_connection": qps, "mtu": 1024}
    if split is not None:
        ring["split_data_on_qps"] = split
    buckets = {"first": [{"count": c, "dtype": "float32"} for c in counts]}
    if rebuilt:
        buckets["rebuilt"] = [{"count": c, "dtype": "float32"} for c in rebuilt]
    return plan_from_json({"format": "ckptd-plan", "version": 1, "parameters": [], "buckets": buckets,
                           "ring": ring, "optimizer": None,
                           "ranks": [{"rank": r, "addr": f"10.9.0.{r + 1}"} for r in range(ranks)]})


def _simulated_qps(version: tuple[int, int], nq: int, split: bool, nsends: int) -> list[list[int]]:
    """For each send of a connection, the QP of each of its parts, by running net_ib's
    posting loop: <= 2.28 one qpIndex on the connection, advanced per post and never
    reset (net_ib.cc:1572-1613@v2.21.5-1; 2.14-2.17 post part q on QP q); 2.29+ part i on
    QP (fifoHead + i) % nqps, fifoHead counting the sends (net_ib/common.h:325-330@v2.29.7-1)."""
    qp_index, fifo_head, out = 0, 0, []
    nparts = nq if split else 1
    for _ in range(nsends):
        parts = []
        for i in range(nparts):
            if version >= (2, 29):
                parts.append((fifo_head + i) % nq)
            elif version < (2, 18):
                parts.append(i)
            else:
                parts.append(qp_index)
                qp_index = (qp_index + 1) % nq
        fifo_head += 1
        out.append(parts)
    return out


@pytest.mark.parametrize("version,qps,split", [
    ("2.14", 4, None), ("2.17", 2, None), ("2.19", 2, None), ("2.19", 3, False), ("2.22", 3, None),
    ("2.26", 4, None), ("2.29", 3, None), ("2.29", 4, True), ("2.32", 2, None)])
def test_qp_of_every_part_follows_net_ib_across_iterations(version, qps, split):
    """Iterations 0..6 concatenated on each connection put every part on the QP net_ib's
    loop picks, with the rotation carried over iterations and buckets; and
    timeline_schedules/layout_index repeat exactly those schedules."""
    plan = _plan(version, qps, split=split, rebuilt=(70000, 3000, 5))
    cfg = plan.ring
    iters = 7
    for conn in plan.schedule(0).sends:
        got = []  # per send in issue order: its parts' QPs (in wire-offset order)
        for t in range(iters):
            sched = plan.schedule(t)
            where = {}
            for q in range(qps):
                for m in sched.flows[conn + (q,)].messages:
                    if m.imm is not None:
                        where.setdefault(m.send.step, []).append((m.wire_offset, q))
            got += [[q for _, q in sorted(where[s.step])] for s in sched.sends[conn]]
        want = _simulated_qps(cfg.nccl_version, qps, cfg.split, len(got))
        assert got == want, conn
    layouts = plan.timeline_schedules()
    for t in range(iters):
        assert layouts[plan.layout_index(t)] is plan.schedule(t)
    carries = not cfg.split or cfg.nccl_version >= (2, 29)
    assert (plan.rotation_period() > 1) == (carries and any(
        len(v) % qps for v in plan.schedule(1).sends.values())), plan.rotation_period()


def test_flow_timeline_locates_rotated_iterations():
    from ckptd.transports.roce.flows import FlowBinder
    plan = _plan("2.22", 3, rebuilt=(70000, 3000, 5))
    assert plan.rotation_period() == 3
    binder = FlowBinder(plan)
    for key, tl in binder.timelines.items():
        for t in range(8):
            fs = plan.schedule(t).flows[key]
            assert tl.schedule_of(t) is fs
            start = tl.iteration_start(t)
            assert tl.iteration_start(t + 1) - start == fs.npkts
            for k, s in enumerate(fs.starts):
                it, sched, m, i = tl.locate(start + s)
                assert (it, m, i) == (t, k, 0) and sched is fs


@pytest.mark.parametrize("version,ar", [("2.14", True), ("2.15", True), ("2.16", False), ("2.20", False)])
def test_writes_then_zero_byte_immediate_above_8192_bytes_in_2_14_2_15(version, ar):
    """2.14-2.15 send anything over NCCL_IB_AR_THRESHOLD as RDMA WRITE(s) and a 0-byte
    WRITE_WITH_IMM on each QP (net_ib.cc:969@v2.14.3-1); from 2.16 only under adaptive
    routing, off on RoCE (net_ib.cc:979@v2.16.5-1)."""
    plan = _plan(version, 2, protocol="simple", counts=(1000, 200000))
    cfg = plan.ring
    assert cfg.ar_writes is ar
    sched = plan.schedule(0)
    conn = next(iter(sched.sends))
    big = small = 0
    for q in range(2):
        msgs = sched.flows[conn + (q,)].messages
        k = 0
        while k < len(msgs):
            m = msgs[k]
            if ar and m.send.wire_bytes > IB_AR_THRESHOLD:
                nxt = msgs[k + 1]
                assert m.imm is None and nxt.send is m.send and nxt.wire_len == 0 and nxt.npkts == 1
                assert nxt.imm == m.send.wire_bytes
                big, k = big + 1, k + 2
            else:
                assert m.imm == m.send.wire_bytes
                small, k = small + 1, k + 1
    assert small and (big > 0) == ar
    assert not any(m.imm is None for fs in sched.flows.values() for m in fs.messages) or ar


def test_split_data_on_qps_exists_only_from_2_18():
    assert _plan("2.17", 2).ring.split and not _plan("2.20", 2).ring.split
    assert not _plan("2.18", 2, split=False).ring.split
    with pytest.raises(PlanError, match="ring: split_data_on_qps false with NCCL 2.17"):
        _plan("2.17", 2, split=False)


@pytest.mark.parametrize("version,size", [("2.14", 32), ("2.19", 32), ("2.20", 64), ("2.29", 64),
                                          ("2.32", 64)])
def test_clear_to_send_size_and_qp_in_the_capture(tmp_path, version, size):
    """The receiver's CTS is a WRITE_ONLY of one ncclIbSendFifo entry on its first QP of
    the connection, toward the sender's first QP: the reverse direction of data QP 0."""
    assert RingConfig(2, ((0, 1),), nccl_version=tuple(map(int, version.split(".")))).cts_bytes == size
    if version not in ("2.14", "2.29"):
        return  # one capture per layout of the fifo entry is enough
    # 4 QPs at MTU 4096: 2.14's data parts of sends over 8192 B are WRITE_ONLY too
    synth(tmp_path, ranks=2, channels=1, protocol="simple", mtu=4096, mirrors=1, iterations=1,
          nccl_version=version, qps=4, noise=False)
    data_qps, only, acked = {}, [], {}
    for fr in open_capture(pcaps(tmp_path)[0]):
        f = decode_frame(fr.data, fr.linktype, fr.origlen)
        if f.cls is FrameClass.ROCE_DATA:
            flow = (str(f.src), str(f.dst), f.bth.dest_qp)
            if f.bth.opcode == 10:
                only.append((flow, f.reth.dma_len, f.payload_len))
            if f.immdt is not None:  # only data QPs get immediates
                data_qps.setdefault(flow[:2], set()).add(flow[2])
        elif f.cls is FrameClass.ROCE_ACK:  # receiver -> sender, to the sender's QPN
            acked.setdefault((str(f.src), str(f.dst)), set()).add(f.bth.dest_qp)
    cts = [(flow, n, p) for flow, n, p in only if flow[2] not in data_qps[flow[:2]]]
    data_only = [x for x in only if x not in cts]
    assert cts and all(n == size and p == size for _, n, p in cts)
    assert bool(data_only) == (version == "2.14") and all(n > size for _, n, _ in data_only)
    # every CTS goes to one QP per direction, the sender's first QP: never a data QP
    assert {flow[:2] for flow, *_ in cts} == {(d, s) for s, d in data_qps}
    assert len({flow for flow, *_ in cts}) == 2
    # ... a QPN that data QPs' ACKs are sent to: the reverse direction of a data QP's connection
    assert all(flow[2] in acked[flow[:2]] for flow, *_ in cts)
    # the extractor counts them and nothing else as other RoCE, binds no flow to them
    # (2.14: WRITE_ONLY also carries data there), and the replay is exact
    pipe = run_replay(tmp_path)
    assert pipe.classes[0]["other_roce"] == len(cts)
    assert not pipe.extract.binder.errors and pipe.extract.counters["schedule_mismatch"] == 0
    assert [(r.status, r.exact) for r in pipe.reports] == [("committed", True)]


# -- replay, bit for bit, reference and fast path ---------------------------------------------
MATRIX = [  # (version, qps, protocol, ranks, channels, rotation carried over iterations)
    # Simple sends 4 slices a loop per connection: 3 QPs rotate. LL with 2 ranks sends 2: 4 QPs rotate.
    ("2.14", 1, "simple", 2, 1, False), ("2.14", 2, "ll", 2, 2, False), ("2.14", 4, "simple", 3, 1, False),
    ("2.17", 2, "simple", 2, 2, False), ("2.17", 4, "ll", 2, 2, False),
    ("2.19", 1, "ll", 3, 1, False), ("2.19", 4, "simple", 2, 2, False),
    ("2.22", 2, "simple", 2, 2, False), ("2.22", 3, "simple", 2, 2, True), ("2.22", 4, "ll", 2, 2, True),
    ("2.26", 1, "simple", 3, 2, False), ("2.26", 4, "ll", 2, 2, True),
    ("2.29", 2, "ll", 3, 1, False), ("2.29", 3, "simple", 2, 2, True), ("2.29", 4, "ll", 2, 2, True),
    ("2.32", 2, "simple", 2, 2, False), ("2.32", 4, "ll", 2, 2, True),
    # with NCCL_IB_ADAPTIVE_ROUTING=1 (EXTRA): 2.16+ write + 0-byte immediate as 2.14-2.15 do
    ("2.16", 2, "simple", 2, 2, False), ("2.19", 2, "ll128", 3, 1, False), ("2.22", 3, "ll", 3, 1, False),
    ("2.29", 2, "simple", 3, 2, False), ("2.30", 3, "simple", 2, 2, True),
]
EXTRA = {  # once each: IPv6 addresses; a communicator with more channels than the tuner gives small buckets
    ("2.22", 3, "simple", 2, 2): dict(ipv6=True),
    ("2.32", 2, "simple", 2, 2): dict(channels=4),
    **{case: dict(adaptive_routing=True) for case in [("2.16", 2, "simple", 2, 2), ("2.19", 2, "ll128", 3, 1),
                                                      ("2.22", 3, "ll", 3, 1), ("2.29", 2, "simple", 3, 2),
                                                      ("2.30", 3, "simple", 2, 2)]},
}


@pytest.mark.parametrize("version,qps,protocol,ranks,channels,rotates", MATRIX,
                         ids=[f"{v}-{q}qp-{p}-{r}r{c}c" for v, q, p, r, c, _ in MATRIX])
def test_replay_bit_exact(tmp_path, version, qps, protocol, ranks, channels, rotates):
    case = (version, qps, protocol, ranks, channels)
    kw = dict(ranks=ranks, channels=channels, protocol=protocol, mtu=1024, mirrors=2, loss=1e-3,
              nccl_version=version, qps=qps, iterations=4, seed=[m[:5] for m in MATRIX].index(case))
    kw.update(EXTRA.get(case, {}))
    ref, fast = synth_pair(tmp_path, **kw)
    assert [(r.status, r.exact) for r in ref.reports] == [("committed", True)] * 4, \
        [(r.status, r.note) for r in ref.reports]
    assert ref.extract.counters["schedule_mismatch"] == 0
    assert_same(ref, fast)
    plan = load_plan(tmp_path / "plan.json")
    # the case exercises what it is listed for: QPs whose rotation carries over, and
    # 2.14-2.15's write + 0-byte immediate
    assert (plan.rotation_period() > 1) == rotates
    if kw.get("ipv6"):
        assert all(":" in a for a in plan.addresses)
    if kw["channels"] == 4:
        assert any(plan.ring.tune(b.nbytes)[0] < plan.ring.channels for b in plan.buckets(0))
    assert any(m.imm is None for fs in plan.schedule(1).flows.values() for m in fs.messages) == \
        plan.ring.ar_writes


def test_adaptive_routing_in_the_plan_is_checked_and_a_capture_with_it_does_not_replay_without(tmp_path):
    """ring.adaptive_routing / ar_threshold: bad values name the key; a capture made with
    NCCL_IB_ADAPTIVE_ROUTING=1 (every send over 8192 B a WRITE + 0-byte WRITE_WITH_IMM) read
    with a plan that says it is off commits nothing and places no byte."""
    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.pipeline import ReplayOptions, replay
    doc = _plan("2.22", 2).to_json()
    for ring, msg in [({"adaptive_routing": "yes"}, "ring.adaptive_routing must be true, false or null"),
                      ({"ar_threshold": 10}, "ring.ar_threshold"),
                      ({"adaptive_routing": False, "nccl_version": "2.15"}, "adaptive_routing false with NCCL 2.15")]:
        with pytest.raises(PlanError, match=msg) as e:
            plan_from_json({**doc, "ring": {**doc["ring"], **ring}}, "p.json")
        assert "\n" not in str(e.value)
    low = plan_from_json({**doc, "ring": {**doc["ring"], "adaptive_routing": True, "ar_threshold": 100000}}, "p.json")
    assert low.ring.ar_threshold == 100000 and plan_from_json(low.to_json(), "p.json").ring == low.ring
    synth(tmp_path, ranks=2, channels=2, protocol="simple", mtu=1024, mirrors=2, nccl_version="2.22", qps=2,
          iterations=2, seed=1, adaptive_routing=True)
    on = load_plan(tmp_path / "plan.json")
    assert on.ring.adaptive_routing is True
    off = plan_from_json({**on.to_json(), "ring": {**on.to_json()["ring"], "adaptive_routing": None}}, "p.json")
    pipe = replay(off, pcaps(tmp_path), load_checkpoint(tmp_path / "init.pt"),
                  ReplayOptions(out=str(tmp_path / "off")))
    assert not any(r.status == "committed" for r in pipe.reports)
    assert not list((tmp_path / "off").glob("iter_*.pt"))


def test_bucket_over_25_mb_with_rotating_qps(tmp_path):
    """A 28 MB bucket (over DDP's 25 MB cap, as a bucket holding one big parameter is),
    2 ranks, 3 QPs whose rotation carries over iterations: BulkSynth writes the traffic,
    the fast path's gradients are the allgather's final values, bit for bit."""
    import numpy as np

    from ckptd.fast.pipeline import fast_replay
    from ckptd.pipeline import ReplayOptions
    from ckptd.testing.synth.bulk import BulkSynth
    doc = {"format": "ckptd-plan", "version": 1, "parameters": [], "optimizer": None,
           "buckets": {"first": [{"count": 7_000_000, "dtype": "float32"}, {"count": 1000, "dtype": "float32"}]},
           "ring": {"nranks": 2, "channels": 2, "nccl_version": "2.22", "qps_per_connection": 3, "mtu": 4096},
           "ranks": [{"rank": 0, "addr": "10.9.0.1"}, {"rank": 1, "addr": "10.9.0.2"}],
           "mirrors": [{"name": "m0", "rank": 0, "direction": "both"}]}
    plan = plan_from_json(doc)
    assert plan.buckets(0)[0].nbytes >= 25 << 20 and plan.rotation_period() > 1
    finals = {}
    paths = [tmp_path / "m0.pcap"]
    BulkSynth(plan, paths).run(3, on_bucket=lambda t, b, final: finals.__setitem__((t, b), final))
    dump = tmp_path / "dump"
    pipe = fast_replay(plan, [str(p) for p in paths], None, ReplayOptions(dump_gradients=str(dump)))
    assert [r.status for r in pipe.reports] == ["complete"] * 3
    assert pipe.extract.counters["schedule_mismatch"] == 0
    for (t, b), final in finals.items():
        got = np.load(dump / f"iter_{t:06d}_bucket_{b:03d}.npy")
        assert got.tobytes() == final.tobytes(), (t, b)


# -- other collectives on the communicator (Plan.collectives) -----------------------------------
COLLECTIVES = {"start": [[1000, "float32"]], "before": [[3, "float32"]], "after": [[1, "float32"]]}


def test_collectives_in_the_plan_round_trip_and_bad_entries_name_the_key():
    base = _plan("2.22", 1).to_json()
    assert "collectives" not in base  # plans without them read and write as before
    doc = {**base, "collectives": {"start": [{"op": "allreduce", "count": 1000, "dtype": "float32"}],
                                   "before": [{"count": 3}], "after": [{"count": 1}]}}
    plan = plan_from_json(doc)
    assert plan.collectives == {"start": ((1000, "float32"),), "before": ((3, "float32"),),
                                "after": ((1, "float32"),)}
    assert plan_from_json(plan.to_json()) == plan
    s0, s1 = plan.schedule(0), plan.schedule(1)
    assert [b.count for b in s0.others] == [1000, 3, 1] and [b.count for b in s1.others] == [3, 1]
    conn = next(iter(s1.sends))
    order = [s.bucket for s in s1.sends[conn]]  # before (-1), the buckets (>= 0), after (-2)
    grads = [k for k, b in enumerate(order) if b >= 0]
    assert set(order[:grads[0]]) == {-1} and set(order[grads[-1] + 1:]) == {-2}
    assert all(order[k] >= 0 for k in range(grads[0], grads[-1] + 1))
    for bad, msg in [({"during": []}, "collectives: unknown keys \\['during'\\]"),
                     ({"after": [{"op": "gather", "count": 5}]}, r"collectives.after\[0\].op 'gather'"),
                     ({"start": [{"count": 0}]}, r"collectives.start\[0\].count"),
                     ({"before": [{"count": 4, "dtype": "complex64"}]}, r"collectives.before\[0\].dtype"),
                     ([1], "collectives must be an object")]:
        with pytest.raises(PlanError, match=msg):
            plan_from_json({**base, "collectives": bad}, "p.json")
    # gloo: the job's own allreduces (its count skips them); no other op (it counts allreduces alone)
    assert plan_from_json({**doc, "transport": "gloo"}, "p.json").collectives == plan.collectives
    bcast = {**doc["collectives"], "after": [{"op": "broadcast", "count": 4, "dtype": "float32", "root": 0}]}
    with pytest.raises(PlanError, match=r"collectives.after\[0\]: a gloo plan lists the job's own allreduces alone"):
        plan_from_json({**doc, "transport": "gloo", "collectives": bcast}, "p.json")


@pytest.mark.parametrize("version,qps,protocol", [("2.22", 3, "simple"), ("2.29", 4, "ll")])
def test_collectives_replay_bit_exact(tmp_path, version, qps, protocol):
    """A start-up allreduce and a loss allreduce before and after the buckets every
    iteration: they shift every QP's rotation, PSNs and LL steps; the gradients stay exact."""
    ref, fast = synth_pair(tmp_path, ranks=2, channels=2, protocol=protocol, mtu=1024, mirrors=2,
                           loss=1e-3, nccl_version=version, qps=qps, iterations=4, collectives=COLLECTIVES)
    assert [(r.status, r.exact) for r in ref.reports] == [("committed", True)] * 4
    assert ref.extract.counters["other_collective_packets"] > 0
    assert ref.extract.counters["schedule_mismatch"] == 0
    assert_same(ref, fast)
    assert load_plan(tmp_path / "plan.json").rotation_period() > 1


@pytest.mark.parametrize("fast,broadcast", [(False, False), (True, False), (True, True)])
def test_join_with_rotating_qps_and_collectives(tmp_path, fast, broadcast):
    """Joining places packets by PSN from the connect: the start-up allreduce (and DDP's
    start-up broadcast) and every iteration's loss allreduces are counted in, and so is
    the QP rotation."""
    from test_join import cut, iteration_starts, join_replay
    job = tmp_path / "job"
    synth(job, ranks=2, channels=2, protocol="simple", mtu=1024, mirrors=2, nccl_version="2.22", qps=3,
          iterations=5, seed=3, collectives=COLLECTIVES, startup_broadcast=broadcast)
    starts = iteration_starts(pcaps(job))
    assert len(starts) == 5
    paths = cut(job, tmp_path / "cut", starts[2] - 1_000_000)
    pipe = join_replay(job, paths, tmp_path / "out", fast=fast)
    assert pipe.joined == 2
    assert [(r.iteration, r.status, r.exact) for r in pipe.reports] == \
        [(t, "committed", True) for t in (2, 3, 4)], [(r.iteration, r.note) for r in pipe.reports]
    assert not pipe.extract.binder.errors


# -- ring broadcasts on the communicator (DDP's _sync_module_states, buffer broadcasts) --------
def test_broadcast_schedule_matches_a_hand_derivation():
    """One ncclBroadcast of 300000 float32 from rank 0, NCCL 2.22, Simple, 3 ranks, 2 channels
    with rings 0->1->2 and 0->2->1, default buffers (step 4 MiB/8 = 512 KiB). By NCCL's rules:
      taskAppend makes it int8: 1200000 bytes (enqueue.cc:2007-2008@v2.22.3-1);
      tuner: 1200000 >= 2 channels*512 threads*64, so both channels (topoGetAlgoInfo, which
        does not look at the function);
      partition (enqueue.cc:57-64,626,660-690@v2.22.3-1): trafficPerByte 1, trafficPerChannel
        = max(512, 1200000/2) = 600000, cells of 16 B: 75000; cellsLo = 600000/16 = 37500,
        cellsPerChannel 37500, one mid channel and no hi -> made the hi: channel 0 bytes
        [0, 600000), channel 1 [600000, 1200000);
      chunk (calcCollChunking, enqueue.cc:1757-1762,1813@v2.22.3-1): Simple with
        BROADCAST_CHUNKSTEPS 1 (include/collectives.h:21-22@v2.22.3-1): 524288 B, a multiple
        of the 512-B grain;
      device (device/broadcast.h:30-44,52@v2.22.3-1): each channel loops over its 600000 B in
        chunks of min(524288, rest): 524288 then 75712 B (131072 and 18928 floats); the root
        sends, the middle rank receives and forwards, the rank before the root only receives;
        ProtoSimple<1, 1> posts one slice per chunk. So each hop out of the root and out of
        the middle rank carries 2 sends, the hop into the root none."""
    import numpy as np

    from ckptd.core.schedule import Broadcast, RingSchedule
    cfg = RingConfig(3, ((0, 1, 2), (0, 2, 1)), "simple", (2, 22))
    sched = RingSchedule(cfg, [], before=[Broadcast(300000, np.dtype("float32"), 0)])
    got = {conn: [(s.offset, s.nelem, s.wire_bytes) for s in sends] for conn, sends in sched.sends.items()}
    ch0 = [(0, 131072, 524288), (131072, 18928, 75712)]
    ch1 = [(150000, 131072, 524288), (281072, 18928, 75712)]
    assert got == {(0, 1, 0): ch0, (1, 2, 0): ch0, (2, 0, 0): [],
                   (0, 2, 1): ch1, (2, 1, 1): ch1, (1, 0, 1): []}
    # from root 2 the hop into 2 is silent instead; every send advances its connection's index
    sched = RingSchedule(cfg, [], before=[Broadcast(300000, np.dtype("float32"), 2)])
    assert {c for c, v in sched.sends.items() if not v} == {(1, 2, 0), (0, 2, 1)}
    assert [s.step for s in sched.sends[(2, 0, 0)]] == [0, 1]


def test_broadcast_in_the_plan_round_trips_and_bad_entries_name_the_key():
    base = _plan("2.22", 3, ranks=2).to_json()
    doc = {**base, "collectives": {"start": [{"op": "broadcast", "count": 5000, "dtype": "float32", "root": 0},
                                             {"op": "broadcast", "count": 3, "dtype": "int64", "root": 0}],
                                   "before": [{"op": "broadcast", "count": 7, "root": 1}, {"count": 1}]}}
    plan = plan_from_json(doc)
    assert plan.collectives == {"start": ((5000, "float32", "broadcast", 0), (3, "int64", "broadcast", 0)),
                                "before": ((7, "float32", "broadcast", 1), (1, "float32"))}
    assert plan.to_json()["collectives"] == doc["collectives"] | {
        "before": [{"op": "broadcast", "count": 7, "dtype": "float32", "root": 1},
                   {"op": "allreduce", "count": 1, "dtype": "float32"}]}
    assert plan_from_json(plan.to_json()) == plan
    s0 = plan.schedule(0)
    assert [(type(b).__name__, b.count) for b in s0.others] == \
        [("Broadcast", 5000), ("Broadcast", 3), ("Broadcast", 7), ("Bucket", 1)]
    # the start-up broadcast moves the QP rotation of every later iteration
    bare = plan_from_json({**doc, "collectives": {"before": doc["collectives"]["before"]}})
    assert plan._send_base(1) != bare._send_base(1)
    for bad, msg in [({"start": [{"op": "broadcast", "count": 5}]}, r"collectives.start\[0\] is missing 'root'"),
                     ({"start": [{"op": "broadcast", "count": 5, "root": 2}]}, r"collectives.start\[0\].root 2"),
                     ({"start": [{"op": "broadcast", "count": 5, "root": -1}]}, r"collectives.start\[0\].root"),
                     ({"after": [{"op": "broadcast", "count": 5, "root": 0, "src": 1}]},
                      r"collectives.after\[0\]: unknown keys \['src'\]"),
                     ({"before": [{"op": "broadcast", "count": 0, "root": 0}]}, r"collectives.before\[0\].count"),
                     ({"before": [{"op": "bcast", "count": 1}]}, r"collectives.before\[0\].op 'bcast'")]:
        with pytest.raises(PlanError, match=msg) as e:
            plan_from_json({**base, "collectives": bad}, "p.json")
        assert "\n" not in str(e.value)
    old = _plan("2.20", 3, ranks=2).to_json()  # modelled from 2.14 (docs/NCCL.md section 4a)
    assert plan_from_json({**old, "collectives": {"start": doc["collectives"]["start"]}}, "p.json").collectives


@pytest.mark.parametrize("version,qps,protocol,ranks", [("2.22", 3, "simple", 3), ("2.29", 3, "ll", 2),
                                                        ("2.26", 2, "ll128", 3)] + [
    # before 2.22: 2.14-2.19's interleaved loops (2.14-2.17 split every send over the QPs),
    # 2.20-2.21's aligned channel ranges (docs/NCCL.md section 4a)
    (v, qps, p, 3) for v, qps in (("2.14", 2), ("2.17", 3), ("2.19", 3), ("2.21", 3))
    for p in ("simple", "ll", "ll128")])
def test_startup_broadcast_replays_bit_exact(tmp_path, version, qps, protocol, ranks):
    """DDP's start-up collectives: the verify allgather of the parameter count (1 int64 a
    rank) and broadcast of their shapes, then the broadcast of the parameters (and a
    per-iteration broadcast from rank 1 before the buckets, an allgather after them): every
    hop carries the allgathers, every hop but the one into the root the broadcasts, which
    shifts the QP rotation, PSNs and LL steps of everything after; the gradients stay exact."""
    ref, fast = synth_pair(tmp_path, ranks=ranks, channels=2, protocol=protocol, mtu=1024, mirrors=2,
                           loss=1e-3, nccl_version=version, qps=qps, iterations=3, startup_broadcast=True,
                           collectives={"before": [[40, "float32", "broadcast", 1]],
                                        "after": [[3000, "float32", "allgather"]]})
    plan = load_plan(tmp_path / "plan.json")
    start = plan.collectives["start"]
    assert start[0] == (1, "int64", "allgather")
    assert start[1] == (sum(2 * len(p.shape) for p in plan.parameters), "int64", "broadcast", 0)
    assert start[2][2:] == ("broadcast", 0) and start[2][0] == sum(p.numel for p in plan.parameters)
    assert [(r.status, r.exact) for r in ref.reports] == [("committed", True)] * 3
    assert ref.extract.counters["other_collective_packets"] > 0
    assert ref.extract.counters["schedule_mismatch"] == 0
    assert_same(ref, fast)


def test_allgather_schedule_matches_a_hand_derivation():
    """ncclAllGather of 300000 float32 a rank, NCCL 2.22, Simple, 3 ranks, 2 channels with
    rings 0->1->2 and 0->2->1, default buffers (step 4 MiB/8 = 512 KiB). By NCCL's rules:
      taskAppend makes it int8: 1200000 bytes a rank (enqueue.cc:2007-2008@v2.22.3-1);
      tuner: nBytes = 3*1200000 (ncclFuncMaxSendRecvCount, enqueue.cc:1669) >= 2 channels *
        512 threads * 64, so both channels;
      partition (enqueue.cc:57-64,626,657-700@v2.22.3-1): trafficPerByte 3, traffic 3600000,
        trafficPerChannel 1800000, cells of 16 B: 75000, trafficPerCell 48, cellsLo =
        1800000/48 = 37500: channel 0 bytes [0, 600000) of every block, channel 1
        [600000, 1200000);
      chunk (calcCollChunking, ALLGATHER_CHUNKSTEPS 4, include/collectives.h:17-18@v2.22.3-1):
        2 MiB, so one chunk a channel;
      device (device/all_gather.h:27-53,59@v2.22.3-1): a rank sends its own block's chunk,
        then forwards the chunk of the rank before it; ProtoSimple<2, 2> cuts each into 2
        slices of max(divUp(600000, 32)*16, 524288*2/32) = 300000 B (prims_simple.h
        genericOp on int8): 75000 floats.
    So on channel 0 rank 0 sends block 0 [0, 150000) then block 2 (from 600000); on channel
    1 (0->2->1) block 0 [150000, 300000) then block 1 (rank 1 is before 0 there)."""
    import numpy as np

    from ckptd.core.schedule import AllGather, RingSchedule
    cfg = RingConfig(3, ((0, 1, 2), (0, 2, 1)), "simple", (2, 22))
    sched = RingSchedule(cfg, [], before=[AllGather(300000, np.dtype("float32"))])
    got = {conn: [(s.offset, s.nelem, s.wire_bytes, s.ring_step) for s in sends] for conn, sends in sched.sends.items()}
    assert got[(0, 1, 0)] == [(0, 75000, 300000, 0), (75000, 75000, 300000, 0),
                              (600000, 75000, 300000, 1), (675000, 75000, 300000, 1)]
    assert got[(0, 2, 1)] == [(150000, 75000, 300000, 0), (225000, 75000, 300000, 0),
                              (450000, 75000, 300000, 1), (525000, 75000, 300000, 1)]
    assert [x[0] for x in got[(2, 1, 1)]] == [750000, 825000, 150000, 225000]
    assert all(len(v) == 4 for v in got.values())
    # DDP's verify allgather: 1 int64 a rank is 8 bytes, one channel, a 16-B... the second
    # Simple slice is empty and still posted: each hop [own 8 B, empty, previous 8 B, empty]
    sched = RingSchedule(cfg, [], before=[AllGather(1, np.dtype("int64"))])
    assert [(s.offset, s.nelem, s.wire_bytes) for s in sched.sends[(1, 2, 0)]] == \
        [(1, 1, 8), (2, 0, 0), (0, 1, 8), (1, 0, 0)]
    assert not sched.sends[(0, 2, 1)]


def test_allgather_in_the_plan_round_trips_and_bad_entries_name_the_key():
    base = _plan("2.22", 3, ranks=2).to_json()
    doc = {**base, "collectives": {"start": [{"op": "allgather", "count": 1, "dtype": "int64"},
                                             {"op": "broadcast", "count": 4, "dtype": "int64", "root": 0}],
                                   "after": [{"op": "allgather", "count": 700}]}}
    plan = plan_from_json(doc)
    assert plan.collectives == {"start": ((1, "int64", "allgather"), (4, "int64", "broadcast", 0)),
                                "after": ((700, "float32", "allgather"),)}
    assert plan.to_json()["collectives"]["after"] == [{"op": "allgather", "count": 700, "dtype": "float32"}]
    assert plan_from_json(plan.to_json()) == plan
    assert [type(b).__name__ for b in plan.schedule(0).others] == ["AllGather", "Broadcast", "AllGather"]
    assert [type(b).__name__ for b in plan.schedule(1).others] == ["AllGather"]
    # an allgather of the same count is not an allreduce of it: not one cached schedule
    as_allreduce = plan_from_json({**doc, "collectives": {"after": [{"count": 700}]}})
    assert as_allreduce.schedule(1).sends != plan.schedule(1).sends
    bare = plan_from_json({**doc, "collectives": {"after": doc["collectives"]["after"]}})
    assert plan._send_base(1) != bare._send_base(1)
    for bad, msg in [({"start": [{"op": "allgather", "count": 1, "root": 0}]},
                      r"collectives.start\[0\]: unknown keys \['root'\] \(known: op, count, dtype\)"),
                     ({"start": [{"op": "allgather", "count": 0}]}, r"collectives.start\[0\].count"),
                     ({"after": [{"op": "allgather"}]}, r"collectives.after\[0\] is missing 'count'"),
                     ({"before": [{"op": "allgather", "count": 2, "dtype": "int4"}]}, r"collectives.before\[0\].dtype"),
                     ({"before": [{"op": "all_gather", "count": 1}]}, r"collectives.before\[0\].op 'all_gather'")]:
        with pytest.raises(PlanError, match=msg) as e:
            plan_from_json({**base, "collectives": bad}, "p.json")
        assert "\n" not in str(e.value)
    old = _plan("2.21", 3, ranks=2).to_json()  # modelled from 2.14 (docs/NCCL.md section 4a)
    assert plan_from_json({**old, "collectives": {"start": doc["collectives"]["start"]}}, "p.json").collectives


def test_write_plan_records_adaptive_routing_from_the_environment(monkeypatch):
    """NCCL_IB_ADAPTIVE_ROUTING / NCCL_IB_AR_THRESHOLD of the trainer's environment go into the
    plan's ring (-2 is NCCL's "unset"); before 2.16 the variable does not exist and is ignored."""
    import ckptd.torch as ct
    for version, env, want in [((2, 22), {}, (None, 8192, False)),
                               ((2, 22), {"NCCL_IB_ADAPTIVE_ROUTING": "1"}, (True, 8192, True)),
                               ((2, 29), {"NCCL_IB_ADAPTIVE_ROUTING": "0", "NCCL_IB_AR_THRESHOLD": "0x8000"},
                                (False, 32768, False)),
                               ((2, 22), {"NCCL_IB_ADAPTIVE_ROUTING": "-2"}, (None, 8192, False)),
                               ((2, 15), {"NCCL_IB_ADAPTIVE_ROUTING": "0"}, (None, 8192, True))]:
        monkeypatch.setattr(ct, "_nccl_version", lambda v=version: v)
        for var in ("NCCL_IB_ADAPTIVE_ROUTING", "NCCL_IB_AR_THRESHOLD"):
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        ring = ct._ring("nccl", 2)
        assert (ring.adaptive_routing, ring.ar_threshold, ring.ar_writes) == want, (version, env)


def test_write_plan_takes_nccl_ib_split_data_on_qps_as_the_flag_the_plan_holds(monkeypatch, tmp_path):
    """NCCL_IB_SPLIT_DATA_ON_QPS=1 went into the ring as the int 1, which the saved plan
    then held and load_plan refused ("must be true, false or null")."""
    import ckptd.torch as ct
    monkeypatch.setattr(ct, "_nccl_version", lambda: (2, 22))
    for text, want in (("1", True), ("0", False)):
        monkeypatch.setenv("NCCL_IB_SPLIT_DATA_ON_QPS", text)
        ring = ct._ring("nccl", 2)
        assert ring.split_data_on_qps is want
        from ckptd.core.plan import BucketLayout, Parameter, Plan
        plan = Plan((Parameter("w", (4,), "float32"),), (BucketLayout(("w",)),), (BucketLayout(("w",)),), ring,
                    None, ("10.0.0.1", "10.0.0.2"), ())
        plan.save(tmp_path / "p.json")
        assert load_plan(tmp_path / "p.json").ring.split_data_on_qps is want


def test_write_plan_records_ddps_broadcasts(monkeypatch):
    """_ddp_collectives: the constructor's _sync_module_states (parameters, then buffers,
    bucketed by dtype) in "start", the per-forward buffer broadcast in "before"; and
    model_collectives (`ckptd plan --model`) gives the same from the plain model."""
    import torch
    import torch.distributed as dist

    import ckptd.torch as ct
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        ring = RingConfig(2, ((0, 1),), nccl_version=(2, 22))
        got = {"start": ((15 + 6 + 6, "float32", "broadcast", 0), (1, "int64", "broadcast", 0)),
               "before": ((6, "float32", "broadcast", 0), (1, "int64", "broadcast", 0))}
        # write_plan's: the constructor's verify_params_across_processes first, an allgather
        # of the parameter count (4) and a broadcast of sizes and strides (2 * dim each: 4+2+2+2)
        full = ct._ddp_collectives(ddp, ring, ["a", "b"])
        assert full == {**got, "start": ((1, "int64", "allgather"), (10, "int64", "broadcast", 0)) + got["start"]}
        assert ct.model_collectives(net, ring, True, {}) == full
        monkeypatch.setenv("NCCL_ALGO", "allreduce:ring")
        assert ct._ddp_collectives(ddp, ring, ["a", "b"]) == full  # 2.22 has no PAT
        with pytest.raises(ct.TrainerError, match="PAT"):
            ct._ddp_collectives(ddp, RingConfig(2, ((0, 1),), nccl_version=(2, 23)), ["a", "b"])
        assert ct._ddp_collectives(ddp, RingConfig(2, ((0, 1),), nccl_version=(2, 23)), ["a", "a"])["start"][0] \
            == (1, "int64", "allgather")  # two ranks on one node: no PAT
        monkeypatch.setenv("NCCL_ALGO", "Ring")
        assert ct._ddp_collectives(ddp, RingConfig(2, ((0, 1),), nccl_version=(2, 23)), ["a", "b"])["start"] \
            == full["start"]
        assert ct._ddp_collectives(ddp, RingConfig(2, ((0, 1),), nccl_version=(2, 14)), ["a", "b"]) == full
        assert ct._ddp_collectives(ddp, RingConfig(2, ((0, 1),), nccl_version=(2, 19)), ["a", "b"]) == full
        with pytest.warns(FutureWarning):
            ddp_nb = torch.nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)
        assert ct._ddp_collectives(ddp_nb, ring, ["a", "b"]) == \
            {"start": full["start"][:2] + ((21, "float32", "broadcast", 0),)}
        assert ct.coalesced_broadcasts([torch.zeros(5, dtype=torch.bool)]) == ((5, "uint8", "broadcast", 0),)
        # the reducer's parameters only: one that needs no grad is not verified
        net.frozen = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)
        assert ct.verify_collectives(ct._reducer_params(ddp)) == ((1, "int64", "allgather"), (10, "int64", "broadcast", 0))
        assert ct.verify_collectives([torch.zeros(())]) == ((1, "int64", "allgather"),)
    finally:
        dist.destroy_process_group()
