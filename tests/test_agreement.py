"""Copies must agree, late ones included: an iteration commits only after every mirror
stream's copies of it had their chance to be compared (the agreement window), so one
altered copy is a reported conflict, never a wrong checkpoint (issue 13, item 1)."""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from parsers import icrc
from parsers.capfile import open_capture
from parsers.pcap import write_pcap
from parsers.roce import FrameClass, decode_frame

from ckptd.core.checkpoint import load_checkpoint
from ckptd.core.plan import load_plan
from ckptd.core.schedule import AG
from ckptd.fast.pipeline import FastPipeline, fast_replay
from ckptd.pipeline import Pipeline, ReplayOptions, file_source, replay
from ckptd.transports.roce.transport import RoceTransport
from helpers import pcaps, synth


@pytest.fixture(scope="module")
def three_mirrors(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    synth(tmp, ranks=4, channels=1, mirrors=3, iterations=4, seed=3)
    return tmp


def _allgather_frame(plan, path, iteration: int) -> int:
    """Index (0-based, file order) of a frame of `path` that carries allgather elements of
    `iteration` and nothing else, as the reference transport places it."""
    tr = RoceTransport(plan)
    classes = Counter()
    for k, fr in enumerate(open_capture(path)):
        pls = tr.feed_frame(0, fr, classes)
        if len(pls) == 1 and pls[0].phase == AG and pls[0].iteration == iteration and k > 50:
            return k
    raise AssertionError(f"no allgather frame of iteration {iteration} in {path}")


def _alter(frames, k: int, flip_bit: bool = False) -> tuple[list, bytes]:
    """frames with frame k's payload changed: its ICRC recomputed (an altered copy that
    checks intact), or with flip_bit one bit flipped and the ICRC left (only --trust-icrc
    lets that through)."""
    fr = frames[k]
    f = decode_frame(fr.data, fr.linktype, fr.origlen)
    assert f.cls is FrameClass.ROCE_DATA and f.payload_len >= 8
    buf = bytearray(fr.data)
    buf[f.payload_offset + 5] ^= 0x10
    if not flip_bit:
        buf[f.icrc_offset:f.icrc_offset + 4] = icrc.pack(
            icrc.compute(buf, f.ip_offset, f.udp_offset, f.icrc_offset))
    out = list(frames)
    out[k] = type(fr)(fr.index, fr.ts_ns, fr.linktype, fr.caplen, fr.origlen, bytes(buf))
    return out, bytes(fr.data)


LATER_NS = 10_000_000  # the other mirror ports' copies reach the capture host 10 ms later


def _altered_scenario(tmp: Path, src: Path, flip_bit: bool = False, later_ns: int = LATER_NS,
                      lag_from_ns: int = 0) -> tuple[list[str], int]:
    """The three mirror captures with one allgather packet of iteration 1 altered in the
    first, whose port (both directions of rank 0: two links of the ring) sees every
    element first; the other two streams' copies, the intact ones, arrive 10 ms later,
    as on the real switch where this was found. Returns the paths and the training
    iteration the packet belongs to. lag_from_ns: the later copies are on time until
    that long into the capture (a mirror queue that builds up; a constant offset over
    the whole files is taken for two hosts' clocks and taken off: ckptd.core.clock)."""
    plan = load_plan(src / "plan.json")
    paths = pcaps(src)
    k = _allgather_frame(plan, paths[0], 1)
    frames = list(open_capture(paths[0]))
    altered, original = _alter(frames, k, flip_bit)
    t0 = frames[0].ts_ns
    later = [[type(fr)(fr.index, fr.ts_ns + (later_ns if fr.ts_ns - t0 >= lag_from_ns else 0), fr.linktype,
                       fr.caplen, fr.origlen, fr.data)
              for fr in open_capture(p)] for p in paths[1:]]
    assert original in {bytes(fr.data) for fs in later for fr in fs}, \
        "the altered packet must have an intact copy in another stream"
    out = [str(tmp / f"mirror{m}.pcap") for m in range(len(paths))]
    for path, fs in zip(out, [altered] + later):
        write_pcap(path, fs)
    return out, 1


def _run(src: Path, paths, fast: bool, out: Path, window_ms=None, trust_icrc=False):
    plan = load_plan(src / "plan.json")
    opts = ReplayOptions(out=str(out), reference=str(src / "reference"))
    if window_ms is not None:
        opts.agree_window_ms = window_ms
    start = load_checkpoint(src / "init.pt")
    if fast:
        return fast_replay(plan, paths, start, opts, trust_icrc=trust_icrc)
    return replay(plan, paths, start, opts)


def _statuses(pipe) -> dict[int, str]:
    return {r.iteration: r.status for r in pipe.reports}


@pytest.mark.parametrize("fast", [False, True])
def test_an_altered_copy_with_a_valid_icrc_is_a_conflict_not_a_commit(three_mirrors, tmp_path, fast):
    paths, bad = _altered_scenario(tmp_path, three_mirrors)
    pipe = _run(three_mirrors, paths, fast, tmp_path / "out")
    st = _statuses(pipe)
    assert st[0] == "committed"
    assert st[bad] == "conflict", st
    rep = next(r for r in pipe.reports if r.iteration == bad)
    assert "disagree with another intact copy of their elements" in rep.note and "bucket" in rep.note
    # no names given: the indices; the altered copy is stream 0's, whichever came first
    assert re.search(r"\(first: stream [0-2] against stream [0-2](, stream [0-2])?, bucket", rep.note), rep.note
    assert "stream 0" in rep.note
    # nothing wrong is ever written: no checkpoint from the conflicting iteration on
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["iter_000000.pt"]
    assert all(r.exact is not False for r in pipe.reports)


def test_without_the_window_the_altered_copy_commits_wrong_state(three_mirrors, tmp_path):
    """What the window prevents (and so what the test above can catch): committing at
    the first complete copy lets the altered one through."""
    paths, bad = _altered_scenario(tmp_path, three_mirrors)
    pipe = _run(three_mirrors, paths, False, tmp_path / "out", window_ms=0)
    rep = next(r for r in pipe.reports if r.iteration == bad)
    assert rep.status == "committed" and rep.exact is False


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("lag_ms", [150, 350])
def test_mirrors_lagging_past_the_window_are_waited_for_not_committed_over(three_mirrors, tmp_path, fast, lag_ms):
    """From iteration 1 on, the intact copies come 150 or 350 ms after the altered one:
    past the 50 ms window, and 1.5 or 3.5 iterations behind (the scenario's iterations
    are 100 ms apart). A capture clock says when those frames came, not which iteration
    they carry: the lagging streams' clocks passed the window while their copies of the
    iteration were still to come, and the altered copy was committed (the live probe's
    mirror lagged 150-300 ms). The commit now waits until each stream has carried a
    later iteration or all of this one."""
    paths, bad = _altered_scenario(tmp_path, three_mirrors, later_ns=lag_ms * 1_000_000,
                                   lag_from_ns=50_000_000)
    # one capture host's clock, as in the daemon: no offset between files to take off
    plan = load_plan(three_mirrors / "plan.json")
    opts = ReplayOptions(out=str(tmp_path / "out"), reference=str(three_mirrors / "reference"))
    start = load_checkpoint(three_mirrors / "init.pt")
    pipe = (FastPipeline if fast else Pipeline)(plan, start, len(paths), opts)
    errors = []
    pipe.run(file_source(paths, errors))
    assert not errors
    st = _statuses(pipe)
    assert st[0] == "committed" and st[bad] == "conflict", st
    assert all(r.exact is not False for r in pipe.reports)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["iter_000000.pt"]
    assert pipe.late == 0


def test_a_bit_flip_through_trust_icrc_is_caught_by_the_other_copies(three_mirrors, tmp_path):
    paths, bad = _altered_scenario(tmp_path, three_mirrors, flip_bit=True)
    pipe = _run(three_mirrors, paths, True, tmp_path / "out", trust_icrc=True)
    assert _statuses(pipe)[bad] == "conflict"
    assert all(r.exact is not False for r in pipe.reports)


@pytest.mark.parametrize("fast", [False, True])
def test_clean_streams_and_a_single_stream_commit_every_iteration_exactly(three_mirrors, tmp_path, fast):
    pipe = _run(three_mirrors, pcaps(three_mirrors), fast, tmp_path / "all")
    assert [r.status for r in pipe.reports] == ["committed"] * 4
    assert all(r.exact for r in pipe.reports)


def test_a_legitimately_lost_copy_still_commits(tmp_path):
    synth(tmp_path, ranks=4, channels=1, mirrors=3, iterations=4, seed=5, loss=0.01)
    ref = _run(tmp_path, pcaps(tmp_path), False, tmp_path / "ref")
    fast = _run(tmp_path, pcaps(tmp_path), True, tmp_path / "fast")
    assert [r.status for r in ref.reports] == [r.status for r in fast.reports]
    assert [r.status for r in ref.reports] == ["committed"] * 4
    assert all(r.exact for r in list(ref.reports) + list(fast.reports))


def test_the_cli_exits_3_and_names_the_conflict(three_mirrors, tmp_path):
    paths, bad = _altered_scenario(tmp_path, three_mirrors)
    r = subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(three_mirrors / "plan.json"),
                        "--init", str(three_mirrors / "init.pt"), "--out", str(tmp_path / "cli"), *paths],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"iteration {bad:>4}: conflict" in r.stdout
    assert "Traceback" not in r.stderr


def test_the_fast_path_reading_in_small_chunks_commits_through_the_window(three_mirrors):
    """The file reader pauses while an iteration's last optimizer step runs; with the
    window the commit waits for later traffic, so the reader must go on once the step
    is done (it once waited for the commit: a deadlock on any capture read in more than
    a few chunks)."""
    import threading
    done = {}

    def run():
        done["pipe"] = fast_replay(load_plan(three_mirrors / "plan.json"), pcaps(three_mirrors),
                                   load_checkpoint(three_mirrors / "init.pt"),
                                   ReplayOptions(agree_window_ms=50), chunk_bytes=16384)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "fast replay hung"
    reps = done["pipe"].reports
    assert reps and all(r.status == "committed" for r in reps), [(r.iteration, r.status) for r in reps]


def _last_iteration_altered(three_mirrors, tmp_path) -> tuple[list[str], int]:
    """The scenario's files, mirror 0 with one allgather packet of the last iteration
    altered (its ICRC kept right): (paths, that iteration)."""
    plan = load_plan(three_mirrors / "plan.json")
    paths = pcaps(three_mirrors)
    last = plan.iterations - 1 if plan.iterations else 3
    k = _allgather_frame(plan, paths[0], last)
    altered, _ = _alter(list(open_capture(paths[0])), k)
    out = [str(tmp_path / f"mirror{m}.pcap") for m in range(len(paths))]
    write_pcap(out[0], altered)
    for src, dst in zip(paths[1:], out[1:]):
        write_pcap(dst, list(open_capture(src)))
    return out, last


def test_a_daemon_stopped_on_a_conflict_says_so_not_only_missing(three_mirrors, tmp_path):
    """A daemon stopped while the last iteration holds copies that disagree: whole
    coverage, yet never committed. It was "abandoned" (the conflict only in its note) and
    the daemon's exit status 0: no copy still to come undoes a disagreement, so it is a
    conflict, as a replay reports it."""
    from ckptd.pipeline import Pipeline, file_source
    out, last = _last_iteration_altered(three_mirrors, tmp_path)
    plan = load_plan(three_mirrors / "plan.json")
    pipe = Pipeline(plan, load_checkpoint(three_mirrors / "init.pt"), len(out), ReplayOptions())
    pipe.run(file_source(out, pipe.errors), abandon=True)
    rep = pipe.reports[-1]
    assert rep.iteration == last and rep.status == "conflict", [(r.iteration, r.status) for r in pipe.reports]
    assert re.match(r"\d+ packets disagree with another intact copy of their elements \(first: stream \d against "
                    r"stream \d", rep.note), rep.note


def test_a_daemon_whose_capture_ends_on_a_conflict_exits_3_naming_it(three_mirrors, tmp_path):
    from ckptd.live.daemon import Daemon, load_config
    from ckptd.pipeline import file_source
    out, last = _last_iteration_altered(three_mirrors, tmp_path)
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text(f"plan: {three_mirrors / 'plan.json'}\ninit: {three_mirrors / 'init.pt'}\nout: {tmp_path / 'ck'}\n"
                   "listen: 127.0.0.1:0\ninterfaces:\n" + "".join(f"  - {{name: mirror{m}, ifname: m{m}}}\n"
                                                                 for m in range(len(out))))
    daemon = Daemon(load_config(cfg))
    assert daemon.run(source=file_source(out, []), install_signals=False) == 3
    assert [r.status for r in daemon.pipe.reports if r.iteration == last] == ["conflict"]
    assert last in [u["iteration"] for u in daemon.unrecovered]


def test_a_conflict_note_names_the_stream_by_its_file_and_the_shadow_after_a_semicolon(three_mirrors, tmp_path,
                                                                                       capsys):
    """The note said "first: stream 0" (an index the user never gave) and ran on into
    "plan or capture is wrong shadow stops at iteration 1" without a separator."""
    from ckptd.cli import main
    paths, bad = _altered_scenario(tmp_path, three_mirrors)
    main(["replay", "--plan", str(three_mirrors / "plan.json"), "--init", str(three_mirrors / "init.pt"),
          "--reference-path", *paths])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"iteration {bad:>4}: conflict"))
    assert re.search(r"\(first: stream mirror\d against stream mirror\d(, stream mirror\d)?, bucket", line), line
    assert "stream mirror0" in line, line  # the altered copy's file
    assert f"plan or capture is wrong; shadow stops at iteration {bad - 1})" in line, line


def _simple_block_pcapng(frames) -> bytes:
    """A pcapng of Simple Packet Blocks (no timestamp) on one Ethernet interface."""
    import struct

    def block(btype, body):
        body += b"\0" * ((-len(body)) % 4)
        return struct.pack("<II", btype, len(body) + 12) + body + struct.pack("<I", len(body) + 12)
    out = [block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1)),
           block(1, struct.pack("<HHI", 1, 0, 0))]
    out += [block(3, struct.pack("<I", fr.origlen) + fr.data) for fr in frames]
    return b"".join(out)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("form", ["pcap-zero", "pcapng-simple"])
def test_captures_without_timestamps_interleave_and_recover_what_each_lost(tmp_path_factory, tmp_path, fast, form):
    """Three mirror streams, each losing 1% of its frames, none with a timestamp (pcapng
    simple packet blocks; a pcap written with zeros). They were merged one whole file
    after the other: the copies in the second and third files came after their
    iterations had been given up, and every iteration the first had lost a packet of was
    lost (6 of 6 here). Without times the files now interleave frame by frame, and each
    iteration is recovered from the others' copies, as with times."""
    src = tmp_path_factory.mktemp("lossy")
    synth(src, ranks=4, channels=1, mirrors=3, iterations=6, seed=5, loss=0.01)
    paths = []
    for p in pcaps(src):
        frames = list(open_capture(p))
        q = tmp_path / (Path(p).stem + (".pcap" if form == "pcap-zero" else ".pcapng"))
        if form == "pcap-zero":
            write_pcap(str(q), [type(fr)(fr.index, 0, fr.linktype, fr.caplen, fr.origlen, fr.data) for fr in frames])
        else:
            q.write_bytes(_simple_block_pcapng(frames))
        paths.append(str(q))
    assert all(fr.merge_time == fr.index for fr in open_capture(paths[0]))
    timed = _run(src, pcaps(src), fast, tmp_path / "timed")
    untimed = _run(src, paths, fast, tmp_path / "untimed")
    assert [r.status for r in timed.reports] == ["committed"] * 6
    assert [(r.iteration, r.status, r.exact) for r in untimed.reports] == [(i, "committed", True) for i in range(6)], \
        [(r.iteration, r.status, r.note) for r in untimed.reports]


def _lagging_run(src: Path, paths, fast: bool, out: Path, window_ms=None, until_ns=None, abandon=False):
    """The pipeline fed as the daemon feeds it: one capture clock, no offset between the
    files taken off (replay's ckptd.core.clock would take a lag over a whole file for
    two hosts' clocks); until_ns: only the frames of the first that long, then a stop."""
    plan = load_plan(src / "plan.json")
    opts = ReplayOptions(out=str(out), reference=str(src / "reference"))
    if window_ms is not None:
        opts.agree_window_ms = window_ms
    pipe = (FastPipeline if fast else Pipeline)(plan, load_checkpoint(src / "init.pt"), len(paths), opts)
    errors = []
    frames = file_source(paths, errors)
    if until_ns is not None:
        t0 = next(iter(open_capture(paths[0]))).ts_ns
        frames = [(s, fr) for s, fr in frames if fr.ts_ns - t0 < until_ns]
    pipe.run(frames, abandon=abandon)
    assert not errors
    return pipe


@pytest.mark.parametrize("fast", [False, True])
def test_a_stop_before_a_lagging_streams_copies_came_abandons_the_iteration(three_mirrors, tmp_path, fast):
    """The daemon told to stop while the lagging streams still owe iteration 1's copies
    (it is complete in the altered stream alone): abandoned, with why; it was committed,
    with the altered copy in it."""
    paths, bad = _altered_scenario(tmp_path, three_mirrors, later_ns=350_000_000, lag_from_ns=50_000_000)
    pipe = _lagging_run(three_mirrors, paths, fast, tmp_path / "out", until_ns=250_000_000, abandon=True)
    rep = {r.iteration: r for r in pipe.reports}
    assert rep[0].status == "committed" and rep[bad].status == "abandoned", [(r.iteration, r.status) for r in pipe.reports]
    assert re.search(r"stopped while stream [12] had not delivered its copies of iteration 1 "
                     r"\(it carried packets of iteration 0 last\)", rep[bad].note), rep[bad].note
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["iter_000000.pt"]


@pytest.mark.parametrize("fast", [False, True])
def test_an_iteration_held_past_max_held_for_a_lagging_stream_is_refused_not_committed(tmp_path, fast):
    """A stream 750 ms (7.5 iterations) behind and still delivering, with a 100 ms
    window (a stream silent for 1 s stops holding): iteration 1 is held for its copies
    until the newest iteration is MAX_HELD (6) past it, then refused, naming the stream.
    It was committed on the first stream's copies alone."""
    from ckptd.pipeline import MAX_HELD
    src = tmp_path / "src"
    synth(src, ranks=4, channels=1, mirrors=2, iterations=9, seed=3)
    plain = pcaps(src)
    t0 = next(iter(open_capture(plain[0]))).ts_ns
    paths = [str(tmp_path / "mirror0.pcap"), str(tmp_path / "mirror1.pcap")]
    write_pcap(paths[0], list(open_capture(plain[0])))
    write_pcap(paths[1], [type(fr)(fr.index, fr.ts_ns + (750_000_000 if fr.ts_ns - t0 >= 50_000_000 else 0),
                                   fr.linktype, fr.caplen, fr.origlen, fr.data) for fr in open_capture(plain[1])])
    pipe = _lagging_run(src, paths, fast, tmp_path / "out", window_ms=100)
    rep = {r.iteration: r for r in pipe.reports}
    assert rep[0].status == "committed" and rep[1].status == "unrecoverable", [(r.iteration, r.status) for r in pipe.reports]
    assert re.search(rf"not committed: stream 1 had not delivered its copies of iteration 1 \(it carried packets "
                     rf"of iteration 0 last\) when iteration {1 + MAX_HELD} began \({MAX_HELD} held\)", rep[1].note), rep[1].note
    assert not any(r.status == "committed" for r in pipe.reports if r.iteration > 0)
    assert all(r.exact is not False for r in pipe.reports)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["iter_000000.pt"]



@pytest.mark.parametrize("fast", [False, True])
def test_copies_from_a_stream_written_off_mark_what_was_committed_without_them_unverified(
        three_mirrors, tmp_path, fast):
    """The other two streams stall for 700 ms after iteration 0, then deliver the rest:
    the capture quiet meanwhile (the daemon's idle clock) for ten windows, nothing seems
    on its way, so iterations 1-3 commit on the first stream's copies, the altered one
    among them. Their copies that then come were counted `late` and nothing else: the
    wrong checkpoint stood, exit 0 (the live probe). Those iterations are now
    `unverified`, by stream. (A stream silent while the others carry the job is written
    off: the daemon's test and the CLI's below.)"""
    from ckptd.fast.batches import batch_from_frames
    paths, bad = _altered_scenario(tmp_path, three_mirrors, later_ns=700_000_000, lag_from_ns=50_000_000)
    plan = load_plan(three_mirrors / "plan.json")
    opts = ReplayOptions(out=str(tmp_path / "out"), reference=str(three_mirrors / "reference"))
    pipe = (FastPipeline if fast else Pipeline)(plan, load_checkpoint(three_mirrors / "init.pt"), 3, opts)
    t0 = next(iter(open_capture(paths[0]))).ts_ns
    frames = list(file_source(paths, []))
    before = [(s, fr) for s, fr in frames if fr.ts_ns - t0 < 400_000_000]
    after = frames[len(before):]
    quiet = [t0 + 700_000_000] * 3
    if fast:
        pipe.run_batch(batch_from_frames(before))
        pipe.advance_clock(quiet)
        pipe.run_batch(batch_from_frames(after))
        pipe.finish()
    else:
        def source():
            yield from before
            pipe.advance_clock(quiet)
            yield from after
        pipe.run(source())
    st = _statuses(pipe)
    assert st == {0: "committed", 1: "committed", 2: "committed", 3: "committed"}, st
    assert {r.iteration: r.exact for r in pipe.reports}[bad] is False  # what the flag is for
    # (the capture was quiet meanwhile: no stream was written off, iterations went on
    # without what the two owed, which they then delivered)
    assert pipe.written_off == {} and pipe.late > 0
    assert pipe.unverified == {1: {1, 2}, 2: {1, 2}, 3: {1, 2}}, pipe.unverified


def test_replay_sets_aside_what_a_stream_written_off_then_contradicted_and_exits_3(tmp_path):
    """The CLI: iterations committed without two streams that stalled past ten windows
    (10 ms windows here) and then delivered their copies of them are unverified: named
    on stderr with the streams, their checkpoints and every later one set aside as
    iter_*.pt.suspect, exit 3 (it was 0, every checkpoint standing)."""
    src = tmp_path / "src"
    synth(src, ranks=4, channels=1, mirrors=3, iterations=10, seed=3)
    plain = pcaps(src)
    t0 = next(iter(open_capture(plain[0]))).ts_ns
    paths = [str(tmp_path / f"m{m}.pcap") for m in range(3)]
    write_pcap(paths[0], list(open_capture(plain[0])))
    for p, out in zip(plain[1:], paths[1:]):  # (most frames on time: no clock offset is taken off)
        write_pcap(out, [type(fr)(fr.index, fr.ts_ns + (700_000_000 if fr.ts_ns - t0 >= 550_000_000 else 0),
                                  fr.linktype, fr.caplen, fr.origlen, fr.data) for fr in open_capture(p)])
    out = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(src / "plan.json"),
                        "--init", str(src / "init.pt"), "--out", str(out), "--agree-window-ms", "10", *paths],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    warned = [ln for ln in r.stderr.splitlines() if "unverified" in ln]
    assert len(warned) == 1 and "stream(s) m1, m2" in warned[0] and "iter_*.pt.suspect" in warned[0], r.stderr
    first = int(warned[0].split("commits from iteration ")[1].split(" ")[0])
    assert 6 <= first <= 9
    kept = sorted(p.name for p in out.iterdir())
    assert kept == [f"iter_{k:06d}.pt" for k in range(first)] + [f"iter_{k:06d}.pt.suspect" for k in range(first, 10)]
