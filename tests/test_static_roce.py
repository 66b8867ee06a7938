"""DDP's static_graph=True on the RoCE/NCCL path (docs/TRAINING.md), synthesized: `ckptd
synth --static-graph` trains the synthetic job as DDP with a static graph does (the first
layout one bucket; iteration 0 allreduces DDP's used map FIRST, then the bucket; iteration
1 the first layout again, no map; the rebuilt layout from iteration 2 on), with the
parameters named by --unused PREFIX unused on every rank at every iteration (the graph is
static): zeros in their bucket slots, grad None, never stepped, as iteration 0's map,
which DDP keeps, says. Replay through the fast path and the reference path must rebuild
every iteration bit for bit. (tests/test_static.py covers gloo, with real 2-process jobs;
no real NCCL job was run: the wire is the synthesizer's.)"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ckptd.cli import main
from ckptd.core.checkpoint import checkpoint_name, load_checkpoint
from ckptd.core.plan import USED_MAP, Plan, load_plan
from ckptd.core.psn import PSN_MOD
from ckptd.core.schedule import AG
from ckptd.core.shadow import ShadowModel
from ckptd.fast.batches import load_captures
from ckptd.fast.pipeline import FastPipeline, fast_replay
from ckptd.pipeline import ReplayOptions, replay
from parsers.capfile import open_capture
from parsers.pcap import write_pcap
from parsers.roce import FrameClass, decode_frame

from helpers import pcaps
from test_unused_roce import scenario_runs, unused_in

ITERATIONS = 5  # rounds 0 (map + first layout), 1 (first layout), 2.. (rebuilt, QP rotation)
SCENARIOS = {
    # the second block unused, AdamW (weight decay: a stepped unused parameter would move),
    # clipping over the used ones, Simple on 3 ranks
    "block1-adamw-clip-3ranks": ["--ranks", "3", "--unused", "blocks.1.", "--max-grad-norm", "0.5"],
    # the head, SGD with momentum and weight decay, LL on 2 ranks
    "head-sgd-ll": ["--ranks", "2", "--protocol", "ll", "--unused", "head",
                    "--optim", "sgd:lr=0.05,momentum=0.9,weight_decay=0.01"],
    # the embeddings under AMP (the scaler's inf check over the used ones), LL128, 4 ranks,
    # 2 QPs a connection (the QP rotation counted over both opening rounds)
    "embeddings-amp-ll128-2qps": ["--ranks", "4", "--protocol", "ll128", "--unused", "tok", "--unused", "pos",
                                  "--amp", "1024", "--qps", "2"],
}


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    return scenario_runs(tmp_path_factory, SCENARIOS, "--static-graph", iterations=ITERATIONS)


def _unused(name):
    return unused_in(SCENARIOS[name])


def _replay(plan, d, paths=None, path="reference", **kw):
    opts = ReplayOptions(reference=str(d / "reference"), **kw)
    return (fast_replay if path == "fast" else replay)(plan, paths or pcaps(d), load_checkpoint(d / "init.pt"), opts)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_plan_the_wire_order_and_the_trainer(synthesized, name):
    d = synthesized(name)
    plan = load_plan(d / "plan.json")
    assert plan.transport == "roce" and plan.static_graph and not plan.find_unused_parameters
    assert len(plan.buckets_first) == 1 and len(plan.buckets_rebuilt) > 1 and plan.rebuild_round == 2
    n = len(plan.parameters)
    assert plan.buckets(0)[-1].count == n and plan.buckets(0)[-1].dtype == np.dtype("<i4")
    assert plan.has_map(0) and not plan.has_map(1) and len(plan.buckets(1)) == 1
    assert plan.wire_order(0) == (1, 0) and plan.wire_order(1) == (0,)
    # iteration 0: on every connection the map's sends (bucket 1 of the assembly) before the
    # bucket's; some connections carry the map (a channel may carry none of its few bytes)
    s0 = plan.schedule(0)
    order = {c: [x.bucket for x in sends if x.bucket >= 0] for c, sends in s0.sends.items()}
    assert all(bs == sorted(bs, reverse=True) for bs in order.values())
    assert any(bs and bs[0] == 1 for bs in order.values()) and all(0 in bs for bs in order.values())
    assert [len(s.buckets) for s in plan.timeline_schedules()[:3]] == [2, 1, len(plan.buckets_rebuilt)]
    unused = _unused(name)
    init = load_checkpoint(d / "init.pt")["model"]
    refs = [load_checkpoint(d / "reference" / checkpoint_name(t)) for t in range(ITERATIONS)]
    # never stepped (no state, the init value) in any iteration; the rest stepped
    for ref in refs:
        assert not unused & set(ref["optimizer"]["state"])
        assert all(torch.equal(ref["model"][k], init[k]) for k in unused)
    used = [p.name for p in plan.parameters if p.name not in unused]
    assert used and all(k in refs[0]["optimizer"]["state"] for k in used)
    assert all(not torch.equal(refs[-1]["model"][k], init[k]) for k in used)


@pytest.mark.parametrize("path", ["fast", "reference"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_replay_is_bit_exact_with_a_static_graph(synthesized, tmp_path, name, path):
    d = synthesized(name)
    pipe = _replay(load_plan(d / "plan.json"), d, path=path, out=str(tmp_path / "out"))
    reps = pipe.reports
    assert [r.iteration for r in reps] == list(range(ITERATIONS))
    assert all(r.status == "committed" and r.exact for r in reps), [(r.iteration, r.status, r.note) for r in reps]
    assert pipe.extract.counters["schedule_mismatch"] == 0
    if path == "fast":  # the kernel placed the frames itself (its opening layouts), not the reference
        assert pipe.kernel_frames > 5 * sum(pipe.stops.values()), (pipe.kernel_frames, pipe.stops)


def test_the_fast_path_reserves_the_opening_layouts_and_lets_them_go(synthesized):
    """The kernel's tables open with two layouts (rounds 0 and 1: Plan.timeline_prefix):
    reserve_iterations makes what the run takes, and each opening layout's buffers are
    let go once its one iteration is done, as iteration 0's are without static_graph."""
    d = synthesized("head-sgd-ll")
    plan = load_plan(d / "plan.json")
    fast = FastPipeline(plan, load_checkpoint(d / "init.pt"), 2, ReplayOptions(reference=str(d / "reference")))
    assert fast.kernel.nprefix == 2 == plan.timeline_prefix
    assert fast.kernel.nlayouts == len(plan.timeline_schedules())
    assert [fast.kernel.layout_of(i) for i in range(4)] == [plan.layout_index(i) for i in range(4)] == [0, 1, 2, 2]
    reserved = fast.reserve_iterations()
    batch, errors = load_captures(pcaps(d))
    assert not errors
    fast.run_batch(batch)
    fast.finish()
    assert [r.status for r in fast.reports] == ["committed"] * ITERATIONS and all(r.exact for r in fast.reports)
    opening = FastPipeline(plan, None, 2, ReplayOptions()).kernel
    opening.reserve(0, 1)
    opening.reserve(1, 1)
    assert 0 < opening.buffer_bytes()["kept"] < reserved
    assert fast.kernel.buffer_bytes() == {"lent": 0, "kept": reserved - opening.buffer_bytes()["kept"],
                                          "received_maps": 0}


def test_a_decoder_expecting_the_map_last_does_not_fit_the_wire(synthesized, monkeypatch):
    """Negative control of the wire order: the same capture, decoded as if iteration 0
    allreduced the bucket first and the map last (find_unused_parameters' order), does
    not replay: the map really is first on the synthesized wire."""
    d = synthesized("block1-adamw-clip-3ranks")
    monkeypatch.setattr(Plan, "wire_order", lambda self, r: tuple(range(len(
        self.layout_buckets(self.wire_layout(r), self.has_map(r))))))
    pipe = _replay(load_plan(d / "plan.json"), d)
    assert pipe.extract.counters["schedule_mismatch"] > 0
    assert not any(r.status == "committed" for r in pipe.reports), [(r.iteration, r.status) for r in pipe.reports]


def test_a_shadow_stepping_every_parameter_is_caught(synthesized, monkeypatch):
    """Every parameter taken as used (the map ignored): iteration 0 differs from the
    trainer's (the unused block stepped: AdamW's weight decay moves it), so the exact
    replay above can fail."""
    d = synthesized("block1-adamw-clip-3ranks")
    monkeypatch.setattr(ShadowModel, "used_of", lambda self, it, bufs: [True] * len(self.names))
    pipe = _replay(load_plan(d / "plan.json"), d)
    assert pipe.reports[0].status == "committed" and pipe.reports[0].exact is False


def _without_the_map(d, plan, tmp_path) -> list[str]:
    """The mirror captures less every packet of iteration 0's map allgather (the reduced
    values) on every mirror: where the packets are comes from a clean replay's bindings."""
    pipe = _replay(plan, d)
    mapb = len(plan.layout(0))
    drop = set()
    for key, b in pipe.extract.binder.bound.items():
        tl = b.timeline
        for pos in range(tl.first.npkts):
            _, fs, m, _ = tl.locate(pos)
            send = fs.message(m).send
            if send.bucket == mapb and send.phase == AG:
                drop.add((key, (b.base + pos) % PSN_MOD))
    assert drop
    out, dropped = [], 0
    for i, p in enumerate(pcaps(d)):
        keep = []
        for fr in open_capture(p):
            f = decode_frame(fr.data)
            if f.cls is FrameClass.ROCE_DATA and ((str(f.src), str(f.dst), f.bth.dest_qp), f.bth.psn) in drop:
                dropped += 1
                continue
            keep.append(fr)
        out.append(str(tmp_path / f"lossy{i}.pcap"))
        write_pcap(out[-1], keep)
    assert dropped >= len(drop)
    return out


@pytest.mark.parametrize("recorded", [True, False])
def test_a_lost_map_of_iteration_0_commits_nothing(synthesized, tmp_path, recorded):
    """Iteration 0's map lost on every mirror: iteration 0 is unrecoverable naming the
    map and nothing later is committed (the shadow stopped there; with a plan that does
    not record static_used_map every later iteration is unrecoverable too). Resumed from
    the trainer's checkpoint of iteration 0, a plan recording DDP's kept map
    (write_plan's rewrite) replays the rest bit-exact; one without it steps nothing."""
    d = synthesized("head-sgd-ll")
    plan = load_plan(d / "plan.json")
    lossy = _without_the_map(d, plan, tmp_path)
    if recorded:
        kept = tuple(int(k not in _unused("head-sgd-ll")) for k in (p.name for p in plan.parameters))
        plan = dataclasses.replace(plan, static_used_map=kept)
    reps = list(_replay(plan, d, lossy, out=str(tmp_path / "out")).reports)
    assert reps[0].status == "unrecoverable" and USED_MAP in reps[0].note, (reps[0].status, reps[0].note)
    assert not any(r.status == "committed" for r in reps), [(r.iteration, r.status) for r in reps]
    if not recorded:
        assert all(r.status == "unrecoverable" and "static_graph" in r.note for r in reps[1:]), \
            [(r.iteration, r.status, r.note) for r in reps]
    resumed = _replay(plan, d, lossy, resume=str(d / "reference" / checkpoint_name(0))).reports
    later = [r for r in resumed if r.iteration > 0]
    if recorded:
        assert later and all(r.status == "committed" and r.exact for r in later), \
            [(r.iteration, r.status, r.note) for r in resumed]
    else:
        assert not any(r.status == "committed" for r in later), [(r.iteration, r.status) for r in resumed]


def test_static_graph_with_micro_batches_is_refused(tmp_path, capsys):
    assert main(["synth", "--out", str(tmp_path / "x"), "--model", "tiny", "--ranks", "2", "--iterations", "1",
                 "--static-graph", "--allreduces-per-step", "2"]) == 2
    err = capsys.readouterr().err
    assert "--static-graph with --allreduces-per-step > 1" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
