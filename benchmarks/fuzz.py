"""Fuzz run: mutated frames through the batch kernel and the reference decoder (their
classes must agree), and mutated captures through replay (no crash, no wrong commit).

    python -m benchmarks.fuzz [--frames 1000000] [--captures 300] [--seed 1]

Prints the counts; exits 1 on any disagreement, crash or wrong commit. A "wrong commit"
is a committed iteration whose checkpoint differs from the trainer's."""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from parsers.capfile import open_capture
from parsers.frame import CapturedFrame
from parsers.pcap import write_pcap
from parsers.roce import decode_frame

from ckptd.core.checkpoint import load_checkpoint
from ckptd.core.plan import load_plan
from ckptd.errors import CkptdError
from ckptd.fast.batches import batch_from_frames
from ckptd.fast.pipeline import FastExtractor, fast_replay
from ckptd.pipeline import ReplayOptions
from ckptd.testing.synth import SynthOptions, synthesize


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        kind = rng.randrange(4)
        if kind == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif kind == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == 2:
            del b[rng.randrange(len(b) + 1):]
        else:
            b += rng.randbytes(rng.randrange(1, 64))
    return bytes(b)


def frames_run(plan, frames: list[bytes], n: int, rng: random.Random) -> tuple[int, int]:
    ex = FastExtractor(plan, 1)
    done = disagree = 0
    while done < n:
        items = [mutate(rng.choice(frames), rng) for _ in range(min(20000, n - done))]
        batch = batch_from_frames([(0, CapturedFrame(k + 1, 0, 1, len(d), len(d), d)) for k, d in enumerate(items)])
        for d, cls in zip(items, ex.classify(batch)):
            want = decode_frame(d, 1, len(d))
            if cls == "encapsulated":
                ok = want.encap is not None or want.cls.value in ("truncated", "malformed", "other")
            else:
                ok = cls == want.cls.value
            disagree += not ok
        done += len(items)
    return done, disagree


def captures_run(d: Path, n: int, rng: random.Random) -> dict:
    plan = load_plan(d / "plan.json")
    paths = sorted((d / "mirrors").glob("*.pcap"))
    streams = [list(open_capture(p)) for p in paths]
    out = {"captures": 0, "crashes": 0, "wrong_commits": 0, "committed": 0, "refused": 0}
    with tempfile.TemporaryDirectory(prefix="ckptd-fuzz-") as tmp:
        for k in range(n):
            _one_capture(d, plan, streams, Path(tmp), k, rng, out)
    return out


def _one_capture(d: Path, plan, streams: list, work: Path, k: int, rng: random.Random, out: dict):
    """One replay of the scenario's captures with a few frames of each stream mutated,
    counted into `out`."""
    mine = []
    for s, frames in enumerate(streams):
        fs = list(frames)
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(len(fs))
            fr = fs[i]
            data = mutate(fr.data, rng)
            fs[i] = CapturedFrame(fr.index, fr.ts_ns, fr.linktype, len(data), len(data), data)
        p = work / f"m{s}.pcap"
        write_pcap(p, fs)
        mine.append(str(p))
    try:
        pipe = fast_replay(plan, mine, load_checkpoint(d / "init.pt"),
                           ReplayOptions(reference=str(d / "reference")))
        for r in pipe.reports:
            out["committed"] += r.ok
            out["wrong_commits"] += r.ok and r.exact is False
    except CkptdError:
        out["refused"] += 1
    except Exception as e:  # a crash: what the fuzz run looks for
        out["crashes"] += 1
        print(f"  crash on capture {k}: {type(e).__name__}: {e}", file=sys.stderr)
    out["captures"] += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--captures", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="ckptd-fuzz-scenario-") as tmp:
        return _run(Path(tmp), a, rng)


def _run(d: Path, a: argparse.Namespace, rng: random.Random) -> int:
    synthesize(SynthOptions(out=str(d), ranks=2, channels=1, protocol="ll", mtu=1024, mirrors=2,
                            iterations=2, model="tiny", seed=a.seed))
    plan = load_plan(d / "plan.json")
    frames = [fr.data for p in sorted((d / "mirrors").glob("*.pcap")) for fr in open_capture(p)]
    t0 = time.time()
    n, bad = frames_run(plan, frames, a.frames, rng)
    print(f"frames: {n} mutated, kernel/reference class disagreements {bad} ({time.time() - t0:.0f} s)")
    t0 = time.time()
    c = captures_run(d, a.captures, rng)
    print(f"captures: {c['captures']} mutated replays, crashes {c['crashes']}, refused (one-line errors) "
          f"{c['refused']}, iterations committed {c['committed']}, wrong commits {c['wrong_commits']} "
          f"({time.time() - t0:.0f} s)")
    return 1 if bad or c["crashes"] or c["wrong_commits"] else 0


if __name__ == "__main__":
    sys.exit(main())
