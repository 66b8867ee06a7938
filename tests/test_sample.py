"""The checked-in sample capture still replays bit-exact (a frozen artifact)."""
from pathlib import Path

from ckptd.core.checkpoint import diff_checkpoints, load_checkpoint
from ckptd.pipeline import ReplayOptions, replay
from ckptd.core.plan import load_plan

SAMPLE = Path(__file__).resolve().parents[1] / "pcaps" / "ll-2ranks-2ch"


def test_sample_replays_bit_exact(tmp_path):
    plan = load_plan(SAMPLE / "plan.json")
    pipe = replay(plan, [str(SAMPLE / "mirror0.pcap")], load_checkpoint(SAMPLE / "init.pt"),
                  ReplayOptions(out=str(tmp_path)))
    assert [r.status for r in pipe.reports] == ["committed"]
    mine = load_checkpoint(tmp_path / "iter_000000.pt")
    assert diff_checkpoints(mine, load_checkpoint(SAMPLE / "reference_iter_000000.pt")) == []
