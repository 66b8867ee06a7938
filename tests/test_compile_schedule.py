"""The fast path's kernel tables (compile_schedule) against the schedule they are compiled
from: every message of every timeline and layout, field by field, read the plain way off
Plan.timeline_schedules() (FlowSchedule.messages, Message.send), for a matrix of NCCL
versions, protocols, QPs per connection, merged NICs, split and adaptive-routing settings."""
from __future__ import annotations

import random

import numpy as np
import pytest

from ckptd.fast.pipeline import compile_schedule
from ckptd.testing.synth import SynthOptions, build_model, make_plan

CASES = [  # (version, protocol, qps, ndevs, split_data_on_qps, adaptive_routing)
    ((2, 19), "simple", 1, 1, None, None),
    ((2, 19), "ll", 3, 1, None, None),
    ((2, 17), "ll128", 2, 1, None, None),
    ((2, 14), "simple", 2, 1, None, None),  # every send over the AR threshold: WRITE + WRITE_WITH_IMM
    ((2, 20), "simple", 3, 1, None, True),
    ((2, 21), "ll", 2, 2, None, None),
    ((2, 22), "ll128", 1, 2, True, None),
    ((2, 24), "simple", 2, 2, False, True),
    ((2, 29), "simple", 3, 1, None, None),  # imm big-endian, 2.29's QP rotation
    ((2, 30), "ll", 1, 1, None, None),
]


def plain_tables(plan) -> dict:
    """The message columns, one message at a time: what compile_schedule must produce."""
    cols: dict[str, list] = {}
    for layout, sched in enumerate(plan.timeline_schedules()):
        kept = plan.buffer_others(min(layout, 1))
        for key in sorted(sched.flows):
            fs = sched.flows[key]
            for m, start in zip(fs.messages, fs.starts):
                s = m.send
                row = dict(m_start=start, m_npkts=m.npkts, m_wire_len=m.wire_len, m_wire_offset=m.wire_offset,
                           m_bucket=s.bucket, m_offset=s.offset, m_nelem=s.nelem, m_phase=s.phase,
                           m_step=s.step, m_ring_step=s.ring_step, m_imm=0 if m.imm is None else m.imm,
                           m_has_imm=m.imm is not None, m_keep=s.bucket < 0 and -1 - s.bucket in kept)
                for k, v in row.items():
                    cols.setdefault(k, []).append(v)
    return cols


@pytest.mark.parametrize("model", ["tiny", "tiny-bn"])  # tiny-bn: DDP's buffer broadcasts, kept (m_keep)
@pytest.mark.parametrize("version,protocol,qps,ndevs,split,ar", CASES)
def test_compiled_tables_are_the_schedules_messages(version, protocol, qps, ndevs, split, ar, model):
    opts = SynthOptions(out="unused", ranks=4, channels=2, mirrors=1, model=model, iterations=3,
                        protocol=protocol, nccl_version="%d.%d" % version, qps=qps, merged_nics=ndevs,
                        split_data_on_qps=split, adaptive_routing=ar)
    plan = make_plan(opts, build_model(model, 0), random.Random(0))
    ring = plan.ring
    assert (ring.protocol, ring.nccl_version, ring.data_qps) == (protocol, version, qps * ndevs)
    arrays = compile_schedule(plan).arrays
    want = plain_tables(plan)
    assert len(want["m_start"]) > 100
    assert any(want["m_keep"]) == (model == "tiny-bn")
    for name, values in want.items():
        got = arrays[name]
        expect = np.array(values, np.uint32 if name == "m_imm" else np.int64)
        if name == "m_imm" and ring.imm_big_endian:
            expect = expect.byteswap()
        assert got.dtype == expect.dtype, name
        assert np.array_equal(got, expect), name


def test_tables_are_compiled_without_making_a_send_and_each_send_is_one_object():
    """Where every send is one message, a schedule keeps its sends as rows
    (ConnectionSends) and its QPs' FlowSchedules are views of them: compiling the kernel's
    tables makes no Send or Message tuple. Those made afterwards, one at a time
    (FlowSchedule.message, what the reference places through) or all at once (sends,
    messages), are one object per send: Message.send is the connection's Send."""
    opts = SynthOptions(out="unused", ranks=4, channels=2, mirrors=1, model="tiny-bn", iterations=3,
                        protocol="simple", nccl_version="2.29", qps=2)
    plan = make_plan(opts, build_model("tiny-bn", 0), random.Random(0))
    compile_schedule(plan)
    scheds = plan.timeline_schedules()
    made = [s for sched in scheds for cs in sched._sends.values() for s in cs._made]
    # only the few sends the other collectives (DDP's broadcasts) were built from as tuples
    assert made.count(None) > 10 * (len(made) - made.count(None)) > 0
    sched = scheds[1]
    key = sorted(sched.flows)[1]
    fs = sched.flows[key]
    one = fs.message(7)
    assert fs.message(7) is one and sched._sends[key[:3]]._made.count(None) < sched.steps(key[:3])
    sends = sched.sends[key[:3]]
    assert fs.messages[7] is one and all(m.send is sends[m.send.step] for m in fs.messages)
    # send i goes on QP (sends before the iteration + i) mod 2
    assert [m.send for m in fs.messages] == sends[(key[3] - sched.send_base.get(key[:3], 0)) % 2::2]
    assert len(fs.messages) == len(fs) and fs.npkts == sum(m.npkts for m in fs.messages)
