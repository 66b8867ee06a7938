"""NCCL's LL128 protocol (2.22-2.32): the line layout against the map taken from NCCL's
own prims_ll128.h (tests/data/nccl/ll128-permutation.json), synthesized jobs replayed
bit-exact, flags checked, and what is not decoded refused by name."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from ckptd.cli import main
from ckptd.core.schedule import RingConfig, ScheduleError, wire_bytes
from ckptd.testing.synth.wire import ll128_encode
from ckptd.transports.roce.extract import ll128_unpack
from parsers import icrc
from parsers.capfile import open_capture
from parsers.pcap import write_pcap
from parsers.roce import FrameClass, decode_frame

from helpers import pcaps, run_replay, synth

PERMUTATION = Path(__file__).parent / "data" / "nccl" / "ll128-permutation.json"


def test_line_layout_is_nccls():
    """Every wire u64 of a block holds the data u64 (or the flag) NCCL's map says."""
    table = json.loads(PERMUTATION.read_text())["wire_to_data_u64"]
    data = np.arange(1, 241, dtype="<u8")  # data word d holds d + 1: 0 is never data
    wire = np.frombuffer(ll128_encode(data.tobytes(), 0xF1A6, random.Random(0)), "<u8")
    assert len(wire) == 256
    for w, d in enumerate(table):
        assert wire[w] == (0xF1A6 if d == "flag" else d + 1), w
    back, flag, ok = ll128_unpack(wire.tobytes(), None)
    assert back == data.tobytes() and flag == 0xF1A6 and ok


def test_wire_size_is_whole_blocks():
    assert wire_bytes("ll128", 480, 4) == 2048  # 1920 data bytes: one block
    assert wire_bytes("ll128", 481, 4) == 4096  # a partial last block is sent whole
    assert wire_bytes("ll128", 1, 2) == 2048


@pytest.mark.parametrize("version,ranks,channels,mtu,loss,ipv6", [
    ("2.22", 2, 1, 4096, 0.0, False),
    ("2.26", 3, 2, 1024, 0.002, False),
    ("2.29", 4, 2, 4096, 0.002, True),
    ("2.32", 3, 1, 2048, 0.0, False),
])
def test_synthesized_ll128_replays_bit_exact(tmp_path, version, ranks, channels, mtu, loss, ipv6):
    synth(tmp_path, ranks=ranks, channels=channels, protocol="ll128", nccl_version=version,
          mtu=mtu, mirrors=2, loss=loss, iterations=3, seed=7, ipv6=ipv6)
    pipe = run_replay(tmp_path)
    assert [r.status for r in pipe.reports] == ["committed"] * 3, [(r.iteration, r.note) for r in pipe.reports]
    assert all(r.exact for r in pipe.reports)
    assert pipe.extract.counters["ag_packets"] > 0 and not pipe.extract.counters["ll_flag_mismatch"]


def test_several_loops_per_bucket_replay_bit_exact(tmp_path):
    """A 576 000-byte chunk per rank and step: buckets of the default model (2.6 M
    parameters, 8 MiB buckets) take several ring loops."""
    synth(tmp_path, model="default", ranks=2, channels=1, protocol="ll128", nccl_version="2.29",
          mtu=4096, mirrors=1, iterations=2, seed=3, bucket_cap_kb=8192)
    pipe = run_replay(tmp_path)
    assert [r.status for r in pipe.reports] == ["committed"] * 2 and all(r.exact for r in pipe.reports)
    sched = pipe.plan.schedule(1)
    conn = next(iter(sched.sends))
    loops = sum(1 for s in sched.sends[conn] if s.bucket == 0 and s.ring_step == 0)
    assert loops >= 2  # bucket 0's first send of each loop


def _flip_flag(frames, k):
    """frames with one flag word of frame k changed, its ICRC recomputed (a copy that
    checks intact but whose line NCCL had not finished writing)."""
    fr = frames[k]
    f = decode_frame(fr.data, fr.linktype, fr.origlen)
    buf = bytearray(fr.data)
    at = f.payload_offset + 15 * 8  # word 15 of the first line
    buf[at] ^= 1
    buf[f.icrc_offset:f.icrc_offset + 4] = icrc.pack(icrc.compute(buf, f.ip_offset, f.udp_offset, f.icrc_offset))
    out = list(frames)
    out[k] = type(fr)(fr.index, fr.ts_ns, fr.linktype, fr.caplen, fr.origlen, bytes(buf))
    return out


@pytest.fixture(scope="module")
def one_mirror(tmp_path_factory):
    d = tmp_path_factory.mktemp("ll128")
    synth(d, ranks=2, channels=1, protocol="ll128", nccl_version="2.29", mtu=4096, mirrors=1,
          iterations=3, seed=11)
    return d


def test_a_bad_flag_is_never_placed(one_mirror, tmp_path):
    frames = list(open_capture(pcaps(one_mirror)[0]))
    data = [k for k, fr in enumerate(frames)
            if (f := decode_frame(fr.data, fr.linktype, fr.origlen)).cls is FrameClass.ROCE_DATA
            and f.payload_len >= 1024]
    k = data[len(data) // 2]
    write_pcap(tmp_path / "bad.pcap", _flip_flag(frames, k))
    pipe = run_replay(one_mirror, [str(tmp_path / "bad.pcap")])
    assert pipe.extract.counters["ll_flag_mismatch"] == 1
    statuses = [r.status for r in pipe.reports]
    # the only copy of that packet is refused: its iteration is not committed (when the
    # packet was reduce-scatter data its loss costs nothing), and nothing wrong is
    assert all(r.exact for r in pipe.reports if r.status == "committed"), statuses
    assert statuses.count("committed") >= 1


@pytest.mark.parametrize("kw, message", [
    (dict(protocol="ll128", nccl_version=(2, 19)), "LL128 is decoded for NCCL 2.22-2.32"),
    (dict(protocol="ll128", nccl_version=(2, 29), mtu=512), "MTU of at least 1024"),
])
def test_what_is_not_decoded_is_refused_by_name(kw, message):
    with pytest.raises(ScheduleError, match=message):
        RingConfig(2, ((0, 1),), **kw)


def test_replay_takes_the_reference_path_and_says_so(one_mirror, tmp_path, capsys):
    rc = main(["replay", "--plan", str(one_mirror / "plan.json"), "--init", str(one_mirror / "init.pt"),
               "--reference", str(one_mirror / "reference"), *pcaps(one_mirror)])
    out = capsys.readouterr()
    assert rc == 0 and "LL128 is decoded on the reference path" in out.err
    assert out.out.count("bit-exact") == 3
    assert main(["replay", "--trust-icrc", "--plan", str(one_mirror / "plan.json"), "--init",
                 str(one_mirror / "init.pt"), *pcaps(one_mirror)]) == 2
