"""Shared by the tests: synthesize a scenario and replay it; run a real DDP job script."""
from __future__ import annotations

import os
import subprocess
import sys
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


def run_job(script: str, out: Path, *args) -> Path:
    """tests/<script> OUT ARGS...: a real DDP job (the script spawns its ranks) with the
    repository importable. Returns OUT; a failed job fails the test with its stderr."""
    r = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), str(out), *map(str, args)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def job_runs(tmp_path_factory, script: str):
    """For a module-scoped fixture: get(*args) runs the job script once per distinct
    arguments, each in a fresh folder, and returns that folder."""
    made = {}

    def get(*args):
        if args not in made:
            made[args] = run_job(script, tmp_path_factory.mktemp(Path(script).stem.strip("_")), *args)
        return made[args]
    return get


def busy(seconds: float):
    """Burn `seconds` of this thread's CPU time (a CPU hog, not a sleep)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def drain_writer(tier):
    """Wait until a persistence tier's writer has nothing in hand (at most 5 s)."""
    for _ in range(500):
        if tier.idle():
            return
        time.sleep(0.01)
    raise AssertionError("writer did not finish")


def patch_tcp_bytes(pcap, out: Path, key: tuple, offset: int, new: bytes) -> str:
    """A copy of capture `pcap` in which TCP direction `key` (src, sport, dst, dport)
    carries `new` at stream offset `offset` (counted from the byte after its SYN), in
    every frame that carries those bytes (a resent one too): one receiver's copy of a
    message, changed."""
    from parsers.capfile import open_capture
    from parsers.pcap import PcapWriter
    from parsers.tcp import SYN, decode_tcp_frame
    base, written = None, 0
    with open(out, "wb") as f, PcapWriter(f) as w:
        for fr in open_capture(pcap):
            data = bytearray(fr.data)
            seg, _ = decode_tcp_frame(data, fr.linktype, fr.origlen)  # its payload is a view of data
            if seg is not None and seg.key == key:
                if seg.tcp.flags & SYN:
                    base = (seg.seq + 1) % (1 << 32)
                elif base is not None:
                    start = (seg.seq - base) % (1 << 32)
                    for i, b in enumerate(new):
                        if 0 <= offset + i - start < len(seg.payload):
                            seg.payload[offset + i - start] = b
                            written += 1
            w.write(bytes(data), fr.ts_ns, fr.origlen)
    assert written >= len(new), f"{key} carries no byte [{offset}, {offset + len(new)})"
    return str(out)
