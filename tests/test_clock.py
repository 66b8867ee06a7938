"""Captures written on hosts whose clocks differ: the copies the streams share say by how
much (ckptd.core.clock), and the merge sets each stream right before it merges."""
import json

import pytest

from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.core.clock import MIN_SHIFT_NS, stream_shifts
from parsers.frame import CapturedFrame
from parsers.pcap import read_pcap, write_pcap

from helpers import pcaps, synth

SKEW_NS = 400_000_000  # a host whose clock runs 0.4 s ahead


def _skew(path: str, ns: int, dest: str | None = None):
    frames = [CapturedFrame(f.index, f.ts_ns + ns, f.linktype, f.caplen, f.origlen, f.data) for f in read_pcap(path)]
    write_pcap(dest or path, frames)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # two mirrors, each losing 2% of its frames: an iteration needs both streams' copies
    d = tmp_path_factory.mktemp("clock")
    synth(d, ranks=3, channels=1, protocol="simple", mtu=1024, mirrors=2, loss=0.02, iterations=6, seed=2)
    return d


def test_shifts_are_measured_from_the_copies_the_streams_share(run, tmp_path):
    paths = pcaps(run)
    assert stream_shifts(paths) == ([0, 0], [])  # one clock: nothing to set right
    assert stream_shifts([]) == ([], [])
    ahead, behind = str(tmp_path / "ahead.pcap"), str(tmp_path / "behind.pcap")
    _skew(paths[1], SKEW_NS, ahead)
    _skew(paths[1], -3 * MIN_SHIFT_NS, behind)
    shifts, notes = stream_shifts([paths[0], ahead, behind])
    assert shifts == [0, SKEW_NS, -3 * MIN_SHIFT_NS]  # the synthesized copies share their times exactly
    assert [(s, via) for s, _, via, _ in notes] == [(1, 0), (2, 0)] and all(n[3] >= 16 for n in notes)
    # under MIN_SHIFT_NS (path and queue delays) is left alone
    _skew(paths[1], MIN_SHIFT_NS // 2, behind)
    assert stream_shifts([paths[0], behind])[0] == [0, 0]
    # a stream that shares no copy with the others keeps its clock; so does a pipe (read once)
    _skew(paths[0], SKEW_NS, ahead)
    only_acks = str(tmp_path / "other.pcap")
    write_pcap(only_acks, [f for f in read_pcap(paths[1]) if f.caplen < 128])
    assert stream_shifts([paths[0], only_acks, ahead, "/dev/stdin"])[0] == [0, 0, SKEW_NS, 0]


@pytest.mark.parametrize("path,skew", [("fast", SKEW_NS), ("reference", SKEW_NS), ("fast", -SKEW_NS)])
def test_a_stream_captured_on_a_host_whose_clock_runs_ahead_still_fills_the_others_losses(run, tmp_path, capsys,
                                                                                      path, skew):
    """mirror1's capture host runs 0.4 s ahead: merged by their times, its copies came
    after their iterations had been given up, and every iteration that needed one of them
    was lost. Set right by the copies both streams carry, every iteration commits
    bit-exact, and replay says what it corrected."""
    from ckptd.cli import main
    paths = []
    for k, p in enumerate(pcaps(run)):
        paths.append(str(tmp_path / f"mirror{k}.pcap"))
        _skew(p, skew if k == 1 else 0, paths[-1])
    args = ["replay", "--plan", str(run / "plan.json"), "--init", str(run / "init.pt"), "--out",
            str(tmp_path / "out"), "--reference", str(run / "reference")]
    assert main(args + (["--reference-path"] if path == "reference" else []) + paths) == 0
    out, err = capsys.readouterr()
    assert "6 iterations, 6 committed, 0 not recovered" in out and out.count("bit-exact") == 6, out
    way = "ahead of" if skew > 0 else "behind"
    assert f"warning: stream mirror1: its capture clock runs 400.000 ms {way} mirror0's" in err, err
    for it in range(6):
        assert diff_checkpoints(load_checkpoint(tmp_path / "out" / checkpoint_name(it)),
                                load_checkpoint(run / "reference" / checkpoint_name(it))) == []


def test_inspect_says_how_far_the_clocks_are_apart(run, tmp_path, capsys):
    from ckptd.cli import main
    ahead = str(tmp_path / "mirror1.pcap")
    _skew(pcaps(run)[1], SKEW_NS, ahead)
    assert main(["inspect", "--json", pcaps(run)[0], ahead]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["clock_ahead_ns"] == [0, SKEW_NS] and len(res["clock_notes"]) == 1
    assert main(["inspect", pcaps(run)[0], ahead]) == 0
    assert "Clock: stream mirror1: its capture clock runs 400.000 ms ahead of mirror0's" in capsys.readouterr().out
    assert main(["inspect", "--json"] + pcaps(run)) == 0
    assert json.loads(capsys.readouterr().out)["clock_ahead_ns"] == [0, 0]
