"""The NCCL ring schedule: rules checked on their own (the real captures judge them too)."""
import numpy as np
import pytest

from ckptd.core.schedule import (AG, RS, Bucket, RingConfig, RingSchedule, ScheduleError, ring_steps,
                            wire_bytes)

F32, I32 = np.dtype("float32"), np.dtype("int32")


def sizes(sched, src, dst, ch, q=0):
    return [m.wire_len for m in sched.flows[(src, dst, ch, q)].messages]


def test_flowcheck_layout_2_19_ll():
    # 5,000 int32, 2 ranks, 2 channels, LL, NCCL 2.19: the sizes the real NICs sent.
    cfg = RingConfig(2, ((0, 1), (0, 1)), "ll", (2, 19), mtu=1024)
    s = RingSchedule(cfg, [Bucket(5000, I32)])
    assert sizes(s, 0, 1, 0) == [7232, 16384]
    assert sizes(s, 0, 1, 1) == [0, 16384]
    assert sizes(s, 1, 0, 0) == [16384, 7232]
    assert sizes(s, 1, 0, 1) == [16384, 0]


def test_ring_steps_phases():
    # rank at ring index r: n-1 reduce-scatter sends, then n-1 allgather sends, ending on
    # every chunk but r+1
    for n in (2, 3, 8):
        for r in range(n):
            steps = ring_steps(n, r)
            assert [p for p, _ in steps] == [RS] * (n - 1) + [AG] * (n - 1)
            ag = {c for p, c in steps if p == AG}
            assert ag == set(range(n)) - {(r + 1) % n}


@pytest.mark.parametrize("version", [(2, 19), (2, 20)])
@pytest.mark.parametrize("protocol", ["simple", "ll"])
@pytest.mark.parametrize("count", [1, 1000, 12345, 3_000_000])
def test_every_element_reaches_every_rank(version, protocol, count):
    n = 4
    cfg = RingConfig(n, ((0, 1, 2, 3), (0, 2, 1, 3), (0, 3, 2, 1)), protocol, version)
    s = RingSchedule(cfg, [Bucket(count, F32)])
    # each element's final value crosses n-1 links in allgather, exactly once per loop
    np.testing.assert_array_equal(s.ag_elements(0), n - 1)
    for conn, sends in s.sends.items():
        for snd in sends:
            assert snd.wire_bytes == wire_bytes(protocol, snd.nelem, 4)
            assert snd.nelem == 0 or 0 <= snd.offset and snd.offset + snd.nelem <= count


def test_simple_sends_two_slices_even_when_one_is_empty():
    cfg = RingConfig(2, ((0, 1),), "simple", (2, 19))
    s = RingSchedule(cfg, [Bucket(1000, F32)])
    msgs = s.flows[(0, 1, 0, 0)].messages
    assert len(msgs) == 4  # RS chunk and AG chunk, 2 slices each
    assert any(m.wire_len == 0 for m in msgs)
    assert all(m.npkts >= 1 for m in msgs)


def test_2_20_channels_take_contiguous_ranges():
    cfg = RingConfig(2, ((0, 1), (0, 1)), "simple", (2, 20))
    s = RingSchedule(cfg, [Bucket(1 << 20, F32)])
    ch0 = [x for x in s.sends[(0, 1, 0)] if x.nelem]
    ch1 = [x for x in s.sends[(0, 1, 1)] if x.nelem]
    assert max(x.offset + x.nelem for x in ch0) <= min(x.offset for x in ch1)


def test_split_data_on_qps_parts():
    cfg = RingConfig(2, ((0, 1),), "simple", (2, 19), qps_per_connection=2, mtu=4096)
    s = RingSchedule(cfg, [Bucket(100_000, F32)])
    p0, p1 = s.flows[(0, 1, 0, 0)].messages, s.flows[(0, 1, 0, 1)].messages
    assert len(p0) == len(p1)
    for a, b in zip(p0, p1):
        assert a.send is b.send
        assert a.wire_len % 128 == 0 or b.wire_len == 0 or a.wire_len + b.wire_len == a.send.wire_bytes
        assert a.wire_len + b.wire_len == a.send.wire_bytes
        assert a.imm == b.imm == a.send.wire_bytes  # every part carries the whole size


def test_no_split_rotates_whole_sends_over_qps():
    cfg = RingConfig(2, ((0, 1),), "simple", (2, 20), qps_per_connection=2)
    s = RingSchedule(cfg, [Bucket(100_000, F32)])
    sends = s.sends[(0, 1, 0)]
    assert [m.send for m in s.flows[(0, 1, 0, 0)].messages] == sends[0::2]
    assert [m.send for m in s.flows[(0, 1, 0, 1)].messages] == sends[1::2]


def test_tuning_shrinks_channels_for_small_collectives():
    cfg = RingConfig(4, ((0, 1, 2, 3),) * 4, "simple", (2, 19))
    assert cfg.tune(1 << 30) == (4, 512 + 32)
    nc, _ = cfg.tune(4096)
    assert nc == 1


def test_imm_byte_order_by_version():
    assert not RingConfig(2, ((0, 1),), nccl_version=(2, 19)).imm_big_endian


@pytest.mark.parametrize("kw, msg", [
    (dict(protocol="ll64"), "unknown NCCL protocol 'll64'"),
    (dict(nccl_version=(2, 13)), "2.13 is not supported"),
    (dict(nccl_version=(2, 33)), "2.33 is not supported"),
    (dict(rings=((0, 0),)), "exactly once"),
    (dict(mtu=1500), "MTU"),
])
def test_refused_with_clear_error(kw, msg):
    args = dict(nranks=2, rings=((0, 1),))
    args.update(kw)
    with pytest.raises(ScheduleError, match=msg):
        RingConfig(**args)
