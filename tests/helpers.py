"""Shared by the tests: synthesize a scenario and replay it."""
from __future__ import annotations

import time
from pathlib import Path

from ckptd.core.checkpoint import load_checkpoint
from ckptd.pipeline import ReplayOptions, replay
from ckptd.core.plan import load_plan
from ckptd.testing.synth import SynthOptions, synthesize


def synth(tmp: Path, **kw) -> SynthOptions:
    kw.setdefault("model", "tiny")
    opts = SynthOptions(out=str(tmp), **kw)
    synthesize(opts)
    return opts


def pcaps(tmp: Path) -> list[str]:
    return sorted(str(p) for p in (Path(tmp) / "mirrors").glob("*.pcap"))


def run_replay(tmp: Path, paths=None, **kw):
    tmp = Path(tmp)
    plan = load_plan(tmp / "plan.json")
    opts = ReplayOptions(out=str(tmp / "out"), reference=str(tmp / "reference"), **kw)
    return replay(plan, paths or pcaps(tmp), load_checkpoint(tmp / "init.pt"), opts)


def busy(seconds: float):
    """Burn `seconds` of this thread's CPU time (a CPU hog, not a sleep)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
