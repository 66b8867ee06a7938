"""LL128: the wire layout (ckptd.core.ll128) against the map derived from NCCL's
prims_ll128.h, the kernel's half-block decode against it, and a flag word that is not the
step's: its packet is never placed."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import pcaps, synth

from ckptd.core import ll128
from ckptd.core.checkpoint import load_checkpoint
from ckptd.core.plan import load_plan
from ckptd.core.schedule import Bucket, RingConfig, RingSchedule
from ckptd.pipeline import ReplayOptions, replay
from parsers import icrc
from parsers.pcap import read_pcap, write_pcap
from parsers.roce import decode_frame

kernel = pytest.importorskip("cython_ext.batch", reason="Cython extensions not built")
DATA = Path(__file__).parent / "data" / "nccl"


def test_permutation_is_the_one_derived_from_prims_ll128():
    want = json.loads((DATA / "ll128-permutation.json").read_text())["wire_to_data_u64"]
    assert [None if d < 0 else int(d) for d in ll128.WIRE_TO_DATA] == [None if w == "flag" else w for w in want]


@pytest.mark.parametrize("nbytes", [8, 1920, 1928, 1920 * 5 + 968])
def test_any_line_aligned_piece_decodes_to_its_data(nbytes):
    """Packets of any MTU, or a QP's 128-aligned share, decode to the data words they hold."""
    rng = np.random.default_rng(nbytes)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    wire = ll128.encode(data, 1 << 40, pad=0xA5)
    assert len(wire) == -(-nbytes // 1920) * 2048
    got = bytearray(len(wire))
    for piece in (256, 512, 1024, 4096, 384):
        for off in range(0, len(wire), piece):
            runs, flag, ok = ll128.decode(wire[off:off + piece], off, 1 << 40)
            assert ok and flag == 1 << 40
            for doff, b in runs:
                got[doff:doff + len(b)] = b
        assert bytes(got[:nbytes]) == data
    bad = bytearray(wire)
    bad[128 * 5 + 120] ^= 0x80  # the flag word of line 5
    assert not ll128.decode(bytes(bad), 0, 1 << 40)[2]
    assert not ll128.decode(wire, 0, (1 << 40) + 1)[2]


@pytest.mark.parametrize("halves", [1, 2, 4, 7])
def test_kernel_half_blocks_equal_reference(halves):
    rng = np.random.default_rng(halves)
    flag = (1 << 63) + 5  # u64: no 32-bit wrap
    wire = ll128.encode(rng.integers(0, 256, halves * 960, dtype=np.uint8).tobytes(), flag)[:halves * 1024]
    runs, _, ok = ll128.decode(wire, 0, flag)
    out = bytearray(halves * 960)
    assert ok and len(runs) == 1 and kernel.ll128_unpack_into(wire, out, flag) is True
    assert bytes(out) == runs[0][1]
    for line in range(0, halves * 8, 3):
        bad = bytearray(wire)
        bad[128 * line + 120] ^= 1
        assert kernel.ll128_unpack_into(bytes(bad), out, flag) is False


def test_multi_loop_buckets_send_every_element_once_per_allgather_hop():
    for version in ((2, 19), (2, 21), (2, 22), (2, 29)):
        cfg = RingConfig(3, ((0, 1, 2), (2, 1, 0)), "ll128", version, buffsize=65536)
        sched = RingSchedule(cfg, [Bucket(100_003, np.dtype("float32")), Bucket(77, np.dtype("float16"))])
        for b in range(2):
            assert (sched.ag_elements(b) == cfg.nranks - 1).all(), version
        sends = sched.sends[(0, 1, 0)]
        assert sum(s.bucket == 0 for s in sends) > 2 * (cfg.nranks - 1) * 4, version  # many loops
        assert all(s.wire_bytes == -(-s.nelem * 4 // 1920) * 2048 for s in sends if s.bucket == 0)


def _corrupt_last_allgather_flag(path: Path) -> None:
    """Flip a bit of the flag word of the last big data packet (with 2 ranks and one
    iteration that is an allgather send), with the ICRC made valid again."""
    frames = list(read_pcap(path))
    k = max(i for i, fr in enumerate(frames)
            if (f := decode_frame(fr.data)).payload_len and f.payload_len >= 1024)
    f = decode_frame(frames[k].data)
    buf = bytearray(f.data)
    buf[f.payload_offset + 120] ^= 0x10
    buf[f.icrc_offset:f.icrc_offset + 4] = icrc.pack(icrc.compute(buf, f.ip_offset, f.udp_offset, f.icrc_offset))
    assert decode_frame(bytes(buf)).icrc_ok
    write_pcap(path, [(fr.ts_ns or 0, bytes(buf) if i == k else fr.data) for i, fr in enumerate(frames)])


@pytest.mark.parametrize("mirrors", [1, 2])
def test_a_wrong_flag_is_never_placed(tmp_path, mirrors):
    """One mirror: the iteration misses that data and is not committed. Two mirrors (the
    packet seen on both ports): the other copy is placed and the checkpoint is exact."""
    from ckptd.fast.pipeline import fast_replay
    synth(tmp_path, ranks=2, channels=1, protocol="ll128", nccl_version="2.29", mirrors=mirrors,
          iterations=1, noise=False, seed=1)
    _corrupt_last_allgather_flag(Path(pcaps(tmp_path)[0]))
    plan = load_plan(tmp_path / "plan.json")
    for run in (replay, fast_replay):
        pipe = run(plan, pcaps(tmp_path), load_checkpoint(tmp_path / "init.pt"),
                   ReplayOptions(reference=str(tmp_path / "reference")))
        assert pipe.extract.counters["ll_flag_mismatch"] == 1, run.__name__
        (rep,) = pipe.reports
        if mirrors == 1:
            assert rep.status != "committed", (run.__name__, rep.status)
        else:
            assert (rep.status, rep.exact) == ("committed", True), (run.__name__, rep.note)


def test_cli_synth_and_replay_ll128_on_both_paths(tmp_path, capsys):
    """`ckptd synth --protocol ll128`, then `ckptd replay` (fast path) and --reference-path:
    every iteration bit-exact, the same lines from both."""
    from ckptd.cli import main
    assert main(["synth", "--out", str(tmp_path), "--protocol", "ll128", "--ranks", "3", "--channels", "2",
                 "--mtu", "2048", "--iterations", "2", "--loss", "1e-3", "--model", "tiny",
                 "--nccl-version", "2.19"]) == 0
    args = ["replay", "--plan", str(tmp_path / "plan.json"), "--init", str(tmp_path / "init.pt"),
            "--reference", str(tmp_path / "reference")] + pcaps(tmp_path)
    capsys.readouterr()
    outs = []
    for extra in ([], ["--reference-path"]):
        assert main(args + ["--out", str(tmp_path / f"out{len(outs)}")] + extra) == 0
        out = capsys.readouterr().out
        assert out.count("bit-exact") == 2 and "NOT bit-exact" not in out, out
        outs.append([ln for ln in out.splitlines() if ln.startswith("iteration")])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("version,ranks,channels,mtu,loss,ipv6", [
    ("2.22", 2, 1, 4096, 0.0, False),
    ("2.26", 3, 2, 1024, 0.002, False),
    ("2.29", 4, 2, 4096, 0.002, True),
    ("2.32", 3, 1, 2048, 0.0, False),
    ("2.19", 3, 2, 1024, 0.002, False),
])
def test_todays_nccl_ll128_replays_bit_exact_on_both_paths(tmp_path, version, ranks, channels, mtu, loss, ipv6):
    """The NCCL versions current PyTorch ships, with loss on two mirror links, IPv6 and
    MTU 1024-4096: every iteration committed bit-exact by the reference path and the kernel."""
    from ckptd.fast.pipeline import fast_replay
    synth(tmp_path, ranks=ranks, channels=channels, protocol="ll128", nccl_version=version,
          mtu=mtu, mirrors=2, loss=loss, iterations=3, seed=7, ipv6=ipv6)
    plan, start = load_plan(tmp_path / "plan.json"), load_checkpoint(tmp_path / "init.pt")
    opts = ReplayOptions(reference=str(tmp_path / "reference"))
    for pipe in (replay(plan, pcaps(tmp_path), start, opts),
                 fast_replay(load_plan(tmp_path / "plan.json"), pcaps(tmp_path),
                             load_checkpoint(tmp_path / "init.pt"), opts)):
        assert [r.status for r in pipe.reports] == ["committed"] * 3, [(r.iteration, r.note) for r in pipe.reports]
        assert all(r.exact for r in pipe.reports)
        assert pipe.extract.counters["ag_packets"] > 0 and not pipe.extract.counters["ll_flag_mismatch"]
