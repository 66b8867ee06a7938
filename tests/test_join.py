"""Joining a running job: captures that start in the middle of the job (issue 4).

The synthesizer connects every QP at PSN 0, as NCCL does; cutting its mirror captures at
some instant gives what a daemon started at that instant would have seen.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from ckptd.core.checkpoint import checkpoint_name, load_checkpoint
from ckptd.fast.pipeline import fast_replay
from ckptd.transports.roce.flows import FlowBinder
from ckptd.pipeline import ReplayOptions, replay
from ckptd.transports.roce.transport import decode_roce
from ckptd.core.plan import load_plan
from ckptd.core.psn import PSN_MOD
from parsers.capfile import open_capture
from parsers.pcap import PcapWriter

from helpers import pcaps, synth

SCENARIO = dict(ranks=4, channels=2, protocol="simple", mtu=4096, mirrors=3, loss=1e-3,
                iterations=6, seed=11)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("join")
    synth(tmp, **SCENARIO)
    return tmp


def iteration_spans(paths) -> list[tuple[int, int]]:
    """Capture times of each iteration's first and last frame: the synthesizer leaves
    5 ms between iterations (forward and backward) and 100 ns between frames."""
    ts = np.unique(np.concatenate([[fr.ts_ns for fr in open_capture(p)] for p in paths]))
    gaps = np.flatnonzero(np.diff(ts) > 1_000_000)
    firsts = [int(ts[0])] + [int(ts[g + 1]) for g in gaps]
    lasts = [int(ts[g]) for g in gaps] + [int(ts[-1])]
    return list(zip(firsts, lasts))


def iteration_starts(paths) -> list[int]:
    return [a for a, _ in iteration_spans(paths)]


def cut(job: Path, dest: Path, at_ns: int) -> list[str]:
    """The mirror captures from time at_ns on: what a capture started then records."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for p in pcaps(job):
        q = dest / Path(p).name
        with open(q, "wb") as f:
            w = PcapWriter(f)
            for fr in open_capture(p):
                if fr.ts_ns >= at_ns:
                    w.write(fr.data, fr.ts_ns, origlen=fr.origlen)
        out.append(str(q))
    return out


def join_replay(job: Path, paths, out: Path, fast=False, resume=None, **kw):
    plan = load_plan(job / "plan.json")
    opts = ReplayOptions(out=str(out), reference=str(job / "reference"), join=True,
                         resume=str(resume or job / "reference"), **kw)
    run = fast_replay if fast else replay
    return run(plan, paths, load_checkpoint(job / "init.pt"), opts)


@pytest.mark.parametrize("fast", [False, True])
def test_join_at_an_iteration_boundary(job, tmp_path, fast):
    starts = iteration_starts(pcaps(job))
    assert len(starts) == SCENARIO["iterations"]
    paths = cut(job, tmp_path / "cut", starts[2] - 1_000_000)  # in the gap before iteration 2
    pipe = join_replay(job, paths, tmp_path / "out", fast=fast)
    assert pipe.joined == 2
    assert [r.iteration for r in pipe.reports] == [2, 3, 4, 5]
    assert all(r.status == "committed" and r.exact for r in pipe.reports), \
        [(r.iteration, r.status, r.note) for r in pipe.reports]
    assert "resumed from" in pipe.reports[0].note
    assert pipe.before_join == 0 and not pipe.extract.binder.errors


@pytest.mark.parametrize("fast", [False, True])
def test_join_mid_iteration_skips_the_partial_one(job, tmp_path, fast):
    first, last = iteration_spans(pcaps(job))[2]
    paths = cut(job, tmp_path / "cut", (first + last) // 2)  # inside iteration 2
    pipe = join_replay(job, paths, tmp_path / "out", fast=fast)
    assert pipe.joined == 3
    assert [(r.iteration, r.status, r.exact) for r in pipe.reports] == \
        [(3, "committed", True), (4, "committed", True), (5, "committed", True)]
    assert pipe.before_join > 0  # iteration 2's second half was seen and dropped
    # the checkpoints written are the trainer's
    for it in (3, 4, 5):
        assert (tmp_path / "out" / checkpoint_name(it)).exists()


def test_fast_and_reference_join_the_same_way(job, tmp_path):
    first, last = iteration_spans(pcaps(job))[1]
    paths = cut(job, tmp_path / "cut", first + (last - first) // 3)
    ref = join_replay(job, paths, tmp_path / "a")
    fast = join_replay(job, paths, tmp_path / "b", fast=True)
    rows = [[(r.iteration, r.status, r.packets, r.coverage, r.loss, r.note, r.exact) for r in p.reports]
            for p in (ref, fast)]
    assert rows[0] == rows[1] and ref.joined == fast.joined == 2
    assert ref.before_join == fast.before_join and ref.extract.counters == fast.extract.counters


def test_join_waits_for_the_trainers_checkpoint(job, tmp_path):
    """No checkpoint of the iteration before the one joined: complete iterations are
    reported not applied, with the reason, until one is there."""
    starts = iteration_starts(pcaps(job))
    paths = cut(job, tmp_path / "cut", starts[2] - 1_000_000)
    ckpts = tmp_path / "trainer"
    ckpts.mkdir()
    shutil.copy(job / "reference" / checkpoint_name(3), ckpts)  # only iteration 3's
    pipe = join_replay(job, paths, tmp_path / "out", resume=ckpts)
    got = [(r.iteration, r.status) for r in pipe.reports]
    # first, the gap between the starting state (iteration -1) and the join, said once
    assert got == [(0, "not-captured"), (2, "complete-not-applied"), (3, "complete-not-applied"),
                   (4, "committed"), (5, "committed")]
    assert pipe.reports[0].through == 1 and pipe.reports[0].note.startswith(
        "iterations 0-1 ran before the capture saw the job (joined at 2); the newest state held is iteration -1")
    assert f"no checkpoint of iteration 1 in {ckpts}" in pipe.reports[1].note
    assert all(r.exact for r in list(pipe.reports)[3:])
    assert not (tmp_path / "out" / checkpoint_name(2)).exists()


def test_join_refuses_qps_that_did_not_start_at_psn_zero(tmp_path):
    """A flow whose PSNs are not its positions since a PSN-0 connect cannot be placed by
    PSN arithmetic: it is named, and nothing is committed from a wrong alignment."""
    synth(tmp_path, ranks=2, channels=1, protocol="simple", mtu=4096, mirrors=1, iterations=3,
          psn_wrap=True, seed=3)
    pipe = join_replay(tmp_path, pcaps(tmp_path), tmp_path / "out")
    assert not any(r.status == "committed" for r in pipe.reports)
    assert pipe.extract.binder.errors
    assert "connected it at PSN 0" in pipe.extract.binder.errors[0]


def _packets(paths, cfg):
    from collections import Counter
    classes = Counter()
    for k, p in enumerate(paths):
        for fr in open_capture(p):
            pkt = decode_roce(cfg, k, fr, classes)
            if pkt is not None and pkt.opcode != 17:
                yield pkt


def test_join_from_picks_the_wrap_of_the_psns(job):
    """PSNs wrap every 2**24 packets per QP: iteration 1's packets moved K iterations on
    (PSN + K * packets per iteration, per QP) are iteration 1 + K only for a reader that
    knows the job is past some iteration near there (join_from)."""
    plan = load_plan(job / "plan.json")
    rebuilt = plan.schedule(1)
    paths = pcaps(job)
    probe = FlowBinder(plan)  # learn each flow's QP from the whole capture
    for pkt in _packets(paths, plan.ring):
        if pkt.flow not in probe.bound:
            hop = probe.hop_of(pkt)
            if hop is not None:
                probe.offer(hop, pkt)
    probe.flush()
    period = {key: rebuilt.flows[b.conn + (b.qp,)].npkts for key, b in probe.bound.items()}
    assert period
    k = 3 * PSN_MOD // min(period.values())  # far past the first wrap of every QP
    starts = {key: probe.bound[key].timeline.iteration_start(1) for key in period}
    ends = {key: probe.bound[key].timeline.iteration_start(2) for key in period}

    def moved():
        for pkt in _packets(paths, plan.ring):
            if pkt.flow in period:
                # this copy's own position: the capture's PSNs start at 0
                if starts[pkt.flow] <= pkt.psn < ends[pkt.flow]:
                    pkt.psn = (pkt.psn + k * period[pkt.flow]) % PSN_MOD
                    yield pkt

    for join_from, want in [(k - 5, k + 1), (0, None)]:
        binder = FlowBinder(plan, join_from=join_from)
        placed = set()
        for pkt in moved():
            if pkt.flow in binder.bound:
                released = [(binder.bound[pkt.flow], pkt)]
            else:
                released = binder.offer(binder.hop_of(pkt), pkt)
            for b, p in released:
                placed.add(binder.locate(b, p.psn).iteration)
        for b, p in binder.flush():
            placed.add(binder.locate(b, p.psn).iteration)
        if want is not None:
            assert placed == {want} and not binder.errors
        else:  # read from the first wrap on: the lengths rule those positions out, or they
            # name smaller iterations; never the true one
            assert k + 1 not in placed and (binder.errors or all(i < k for i in placed))


@pytest.mark.parametrize("fast", [False, True])
def test_replay_join_on_the_command_line(job, tmp_path, capsys, fast):
    from ckptd.cli import main
    first, last = iteration_spans(pcaps(job))[3]
    paths = cut(job, tmp_path / "cut", first + (last - first) // 2)
    rc = main(["replay", "--plan", str(job / "plan.json"), "--init", str(job / "init.pt"),
               "--out", str(tmp_path / "out"), "--reference", str(job / "reference"),
               "--resume", str(job / "reference"), "--join"] + ([] if fast else ["--reference-path"]) + paths)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "joined at iteration 4" in out and "2 iterations, 2 committed" in out


def test_replay_resumes_from_a_persistence_tier_url(job, tmp_path, capsys):
    """--resume takes a persist_url: the newest manifest entry that verifies (here the
    trainer's state of iteration 3 on memory://) is where the joined shadow starts."""
    import time
    import uuid

    from ckptd.cli import main
    from ckptd.live.memory_tier import HeldState
    from ckptd.live.persist import PersistTier
    url = f"memory://ckptd-join-{uuid.uuid4().hex}"
    tier = PersistTier(url, every=1, interval_s=None, keep_last=None, keep_every=None)
    ref = load_checkpoint(job / "reference" / checkpoint_name(3))
    tier.offer(HeldState(3, ref["model"], ref["optimizer"], time.time(), 0.0))
    tier.close()
    first, last = iteration_spans(pcaps(job))[3]
    paths = cut(job, tmp_path / "cut", first + (last - first) // 2)
    rc = main(["replay", "--plan", str(job / "plan.json"), "--init", str(job / "init.pt"),
               "--out", str(tmp_path / "out"), "--reference", str(job / "reference"),
               "--resume", url, "--join"] + paths)
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    assert f"resume: iteration 3 from {url}/" in cap.err
    assert "joined at iteration 4" in cap.out and "2 iterations, 2 committed" in cap.out


def test_replay_resume_from_a_url_with_nothing_there_is_one_line(job, tmp_path, capsys):
    from ckptd.cli import main
    rc = main(["replay", "--plan", str(job / "plan.json"), "--init", str(job / "init.pt"),
               "--resume", "memory://ckptd-join-empty", "--join"] + pcaps(job))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "memory://ckptd-join-empty" in err[0], err


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("where", [(1, 0.3), (3, 0.5)])
def test_a_capture_begun_mid_job_without_join_commits_nothing_and_says_join(job, tmp_path, capsys, fast, where):
    """Without --join the flows of a capture that began mid-job are placed by their
    message lengths alone, as if the job began there: their later heads break the
    schedule. That was refused as an FSDP/ZeRO reduce-scatter, or blamed on the ring's
    NCCL version and protocol; now the replay commits nothing (the misplaced copies
    disagree) and says the capture began mid-job: replay with --join."""
    from ckptd.cli import main
    k, frac = where
    first, last = iteration_spans(pcaps(job))[k]
    paths = cut(job, tmp_path / "cut", first + int((last - first) * frac))
    rc = main(["replay", "--plan", str(job / "plan.json"), "--init", str(job / "init.pt"),
               "--out", str(tmp_path / "out"), "--reference", str(job / "reference")]
              + ([] if fast else ["--reference-path"]) + paths)
    out, err = capsys.readouterr()
    assert rc == 3, out + err
    assert " 0 committed" in out and not list((tmp_path / "out").glob("iter_*.pt"))
    assert "mid-job: packets broke the schedule" in out and "replay with --join" in out
    assert "the capture began mid-job; replay with --join" in err and "FSDP" not in out + err
    assert "ring.nccl_version" not in err


@pytest.mark.parametrize("fast", [False, True])
def test_a_join_taken_before_every_flow_was_seen_says_which(job, tmp_path, fast):
    """Two of the three streams begin three iterations after the third, as a daemon whose
    rings opened far apart would see them (mirror1 alone from iteration 1). The join is
    taken without the links only the late streams carry (rank 2 -> 3 and 3 -> 0) once
    mirror1's flows are FINALIZE_LAG iterations on. mirror1's losses in iteration 1 (every
    5th frame) then have no other copy, so the joined iteration is unrecoverable: its report now also says the join was
    taken without those links (and the daemon's /status `join.unbound` and log), where it
    gave only the missing ranges. Nothing is committed wrong, and once every link is seen
    the shadow resumes from the trainer's checkpoints."""
    starts = iteration_starts(pcaps(job))
    early = cut(job, tmp_path / "early", starts[1] - 1_000_000)
    late = cut(job, tmp_path / "late", starts[4] - 1_000_000)
    paths = [p if Path(p).name == "mirror1.pcap" else q for p, q in zip(early, late)]
    lossy = tmp_path / "lossy.pcap"  # mirror1 loses every 5th frame of iteration 1
    with open(lossy, "wb") as f:
        w = PcapWriter(f)
        for k, fr in enumerate(open_capture(paths[[Path(p).name for p in paths].index("mirror1.pcap")])):
            if not (starts[1] <= fr.ts_ns < starts[2] and k % 5 == 0):
                w.write(fr.data, fr.ts_ns, origlen=fr.origlen)
    paths = [str(lossy) if Path(p).name == "mirror1.pcap" else p for p in paths]
    pipe = join_replay(job, paths, tmp_path / "out", fast=fast)
    assert pipe.joined == 1 and pipe.join_unbound == ["rank 2 -> rank 3", "rank 3 -> rank 0"], pipe.join_unbound
    got = [(r.iteration, r.status) for r in pipe.reports]
    assert got[0] == (1, "unrecoverable") and got[-2:] == [(4, "committed"), (5, "committed")], got
    assert pipe.reports[0].missing and pipe.reports[0].note.endswith(
        "joined here before every flow of rank 2 -> rank 3, rank 3 -> rank 0 was bound (taken 2 iterations on "
        "without them): their packets of it may have passed before the capture saw them")
    assert all(r.exact for r in pipe.reports if r.status == "committed")


def test_join_from_on_a_capture_from_the_jobs_start_stays_within_the_job(job, capsys):
    """A capture from the job's start (PSN 0) with --join-from 1: its packets were placed a
    PSN wrap later, at iterations ~10^5-10^6 of a job of a few, and the error read as if
    the captures held them. A position past the plan's iterations is no fit: nothing
    joins, and the line says the join may be wrong."""
    from ckptd.cli import main
    rc = main(["replay", "--plan", str(job / "plan.json"), "--init", str(job / "init.pt"), "--join-from", "1"]
              + pcaps(job))
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert "--join-from 1: no flow of the job" in err and "1 is not an iteration the job had reached when the " \
        "capture began" in err, err
    assert not re.search(r"iteration +\d{4,}", out), out
