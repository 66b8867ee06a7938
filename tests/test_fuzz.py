"""Property tests (hypothesis): the parsers never fail but in their documented way, and
the batch kernel classifies every mutated frame as the reference decoder does. The long
run (10^6 frames, 10^4 captures) is benchmarks/fuzz.py."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parsers.capfile import CaptureError, open_capture
from parsers.frame import CapturedFrame
from parsers.roce import decode_frame

from ckptd.core.plan import load_plan
from ckptd.fast.batches import batch_from_frames
from ckptd.fast.pipeline import FastExtractor
from helpers import pcaps, synth

LINKTYPES = [1, 101, 113, 228, 229, 276, 0, 12345]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def real_frames(tmp_path_factory):
    """Frames of a small synthesized job (data, ACKs, clear-to-sends, noise) and its plan."""
    d = tmp_path_factory.mktemp("fuzz")
    synth(d, ranks=2, channels=1, protocol="ll", mtu=1024, mirrors=1, iterations=1)
    frames = [fr.data for fr in open_capture(pcaps(d)[0])]
    return frames, load_plan(d / "plan.json"), Path(pcaps(d)[0]).read_bytes()


def _mutate(data: bytes, edits, cut: int | None) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        if b:
            b[pos % len(b)] = val
    return bytes(b[:cut] if cut is not None else b)


edits = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6)


@SETTINGS
@given(data=st.binary(max_size=300), linktype=st.sampled_from(LINKTYPES))
def test_decode_frame_classifies_any_bytes(data, linktype):
    f = decode_frame(data, linktype, len(data))
    assert f.cls is not None


@SETTINGS
@given(picks=st.lists(st.tuples(st.integers(0, 10**6), edits, st.one_of(st.none(), st.integers(0, 5000))),
                      min_size=1, max_size=40),
       linktype=st.sampled_from([1, 1, 1, 101, 113]))
def test_kernel_classifies_mutated_frames_as_the_reference(real_frames, picks, linktype):
    frames, plan, _ = real_frames
    items = [_mutate(frames[i % len(frames)], e, cut) for i, e, cut in picks]
    batch = batch_from_frames([(0, CapturedFrame(k + 1, 0, linktype, len(d), len(d), d))
                               for k, d in enumerate(items)])
    got = FastExtractor(plan, 1).classify(batch)
    for data, cls in zip(items, got):
        want = decode_frame(data, linktype, len(data))
        if cls == "encapsulated":  # GRE: unwrapped by the reference, whatever it holds
            assert want.encap is not None or want.cls.value in ("truncated", "malformed", "other")
        else:
            assert cls == want.cls.value, (data.hex(), want.reason)


@SETTINGS
@given(e=edits, cut=st.one_of(st.none(), st.integers(0, 4000)))
def test_a_mutated_capture_file_reads_or_fails_with_a_capture_error(real_frames, tmp_path, e, cut):
    _, _, raw = real_frames
    path = tmp_path / "m.pcap"
    path.write_bytes(_mutate(raw[:6000], e, cut))
    try:
        for fr in open_capture(path):
            assert fr.caplen == len(fr.data) <= 1 << 18
    except CaptureError as err:
        assert str(path) in str(err)

