"""`ckptd synth` with bad arguments: one `error:` line naming the option, exit 2, no
traceback, no huge allocation or long run, and nothing new under --out (checked before
the output directory is made; a failure found while writing removes what the run made)."""
from __future__ import annotations

import re

import pytest

import ckptd.testing.synth as synth_mod
from ckptd.cli import main

BASE = ["--ranks", "2", "--channels", "1", "--mirrors", "2", "--iterations", "2", "--model", "tiny",
        "--bucket-cap-kb", "16"]

CASES = [
    ("nodes-huge", ["--nodes", "100000", "--gpus-per-node", "100000"],
     ["--nodes"]),  # synth's message below; argparse's if cli.py ranges --nodes
    ("nodes-64x64", ["--nodes", "64", "--gpus-per-node", "64"], ["--nodes 64 x --gpus-per-node 64", "at most 64"]),
    ("nodes-one-rank", ["--nodes", "1", "--gpus-per-node", "1"], ["--nodes 1 x --gpus-per-node 1", "at least 2"]),
    ("gpus-per-node-0", ["--nodes", "2", "--gpus-per-node", "0"], ["--gpus-per-node"]),
    ("other-allreduce-count", ["--other-allreduce", "before:999999999"], ["--other-allreduce", "COUNT"]),
    ("other-allreduce-total", ["--other-allreduce", "before:4000000", "--other-allreduce", "after:4000000"],
     ["--other-allreduce", "in all"]),
    ("other-broadcast-root", ["--other-broadcast", "before:10:float32:5"], ["--other-broadcast", "ROOT 5"]),
    # (without --amp an --inf-at is a job that diverges: tests/test_diverge.py)
    ("inf-at-past-the-end", ["--inf-at", "2"], ["--inf-at 2: the job runs iterations 0..1"]),
    ("optim-betas", ["--optim", "adam:betas=2/3"], ["--optim adam"]),
    ("nccl-version-2", ["--nccl-version", "2"], ["--nccl-version '2'"]),
    ("nccl-version-2.99", ["--nccl-version", "2.99"], ["--nccl-version", "NCCL 2.99 is not supported"]),
    ("nics-per-node-neg", ["--nodes", "2", "--gpus-per-node", "2", "--nics-per-node", "-1"], ["--nics-per-node"]),
    ("bn-bfloat16", ["--model", "tiny-bn", "--param-dtype", "bfloat16"], ["--param-dtype bfloat16", "--model tiny-bn"]),
    ("scheduler-unknown", ["--lr-scheduler", "NoSuch"], ["--lr-scheduler 'NoSuch'"]),
    ("scheduler-step-0", ["--lr-scheduler", "StepLR:step_size=0"], ["--lr-scheduler StepLR"]),
    ("scheduler-lambda", ["--lr-scheduler", "LambdaLR"], ["--lr-scheduler LambdaLR"]),
    ("seed-huge", ["--seed", str(10 ** 26)], ["--seed"]),
    ("seed-negative", ["--seed", "-3"], ["--seed"]),
    ("lr-per-step-short", ["--lr-per-step", "0.1"], ["--lr-per-step"]),
    ("gpus-per-node-no-nodes", ["--gpus-per-node", "4"], ["--gpus-per-node needs --nodes"]),  # did nothing
    ("nics-per-node-no-nodes", ["--nics-per-node", "2"], ["--nics-per-node needs --nodes"]),
    # a typo would have trained the whole model; freezing all of it, DDP refuses
    ("freeze-no-match", ["--freeze", "block.0."], ["--freeze 'block.0.' matches no parameter", "blocks.0"]),
    ("freeze-empty", ["--freeze", ""], ["--freeze ''"]),
    ("freeze-everything", ["--freeze", "tok", "--freeze", "pos", "--freeze", "blocks", "--freeze", "ln",
                           "--freeze", "head"], ["freezes every parameter"]),
]


def _refused(capsys, argv, needles):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals (one line too, exit 2)
        rc = e.code
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert rc == 2, cap.err
    assert len(lines) == 1 and lines[0].startswith("error:"), cap.err
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in cap.err


@pytest.mark.parametrize("argv, needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_synth_argument_is_one_line_and_makes_nothing(tmp_path, capsys, argv, needles):
    out = tmp_path / "out" / "s"
    _refused(capsys, ["synth", "--out", str(out), *BASE, *argv], needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kw, message", [
    (dict(nodes=100000, gpus_per_node=100000), "--nodes 100000 x --gpus-per-node 100000 is 10000000000 ranks; "
                                               "at most 64"),
    (dict(nodes=2, gpus_per_node=2, nics_per_node=-1), "--nics-per-node -1 is not in 0..64"),
    (dict(collectives={"before": [[10 ** 14, "float32"]]}), "--other-allreduce before:100000000000000:float32: COUNT"),
    (dict(nccl_version="2"), "--nccl-version '2' is not MAJOR.MINOR"),
    (dict(seed=10 ** 26), "--seed 100000000000000000000000000 is not in 0..4294967295"),
])
def test_synthesize_refuses_before_making_out(tmp_path, kw, message):
    from ckptd.errors import CkptdError
    out = tmp_path / "s"
    with pytest.raises(synth_mod.SynthOptionError, match=re.escape(message)) as e:
        synth_mod.synthesize(synth_mod.SynthOptions(out=str(out), ranks=2, channels=1, model="tiny", **kw))
    assert isinstance(e.value, CkptdError) and isinstance(e.value, ValueError)
    assert not out.exists()


def test_refused_arguments_leave_an_existing_out_as_it_was(tmp_path, capsys):
    out = tmp_path / "s"
    (out / "mirrors").mkdir(parents=True)
    (out / "keep.txt").write_text("mine")
    (out / "mirrors" / "old.pcap").write_bytes(b"x")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    _refused(capsys, ["synth", "--out", str(out), *BASE, "--lr-scheduler", "StepLR:step_size=0"], ["--lr-scheduler"])
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert (out / "keep.txt").read_text() == "mine"


def test_a_failure_while_writing_removes_what_the_run_made(tmp_path, capsys, monkeypatch):
    """A failure found only while training (here: the first reference checkpoint cannot
    be written) removes the run's files, never those that were there before."""
    real = synth_mod.save_checkpoint

    def failing(path, iteration, *a, **k):
        if iteration >= 0:
            raise OSError(f"{path}: disk full")
        return real(path, iteration, *a, **k)

    monkeypatch.setattr(synth_mod, "save_checkpoint", failing)
    fresh = tmp_path / "new" / "s"
    rc = main(["synth", "--out", str(fresh), *BASE, "--iterations", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "disk full" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "new").exists()

    old = tmp_path / "old"
    (old / "reference").mkdir(parents=True)
    (old / "keep.txt").write_text("mine")
    (old / "reference" / "note.txt").write_text("mine too")
    rc = main(["synth", "--out", str(old), *BASE, "--iterations", "1"])
    assert rc == 2
    capsys.readouterr()
    assert sorted(str(p.relative_to(old)) for p in old.rglob("*")) == ["keep.txt", "reference", "reference/note.txt"]
