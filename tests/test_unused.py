"""DDP's find_unused_parameters=True (docs/TRAINING.md): DDP never rebuilds its buckets,
allreduces its used-parameter map (one int32 a parameter) after every round's last bucket,
and leaves a parameter no rank used with grad None, so torch's step, clip_grad_norm_ and
the GradScaler skip it. Real 2-rank gloo DDP jobs (tests/_unused_job.py) with parameters
unused on every rank on some iterations, on one rank only, and never: the shadow, given
what DDP reduced, matches rank 0 bit for bit every iteration (parameters and optimizer
state), and a capture of such a job replays bit-exact through `ckptd replay`."""
from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptd.torch as ct
from ckptd.core.checkpoint import diff_checkpoints, load_checkpoint
from ckptd.core.plan import USED_MAP, PlanError, load_plan, plan_from_json
from ckptd.core.shadow import ShadowModel
import _unused_job as job
from helpers import job_runs, run_job

REPO = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("_unused_job.py")
LAYERS = ("fc1", "a", "b", "c", "dead", "head")


def _run(d: Path, kind: str, clip: float | None, zero_grad: str = "none"):
    return run_job(JOB.name, d, kind, "-" if clip is None else clip, zero_grad)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    get = job_runs(tmp_path_factory, JOB.name)
    return lambda kind, clip: get(kind, "-" if clip is None else clip)


def _buffers(plan, it: int, ref: dict, used=None) -> list[np.ndarray]:
    """The reduced buckets as the wire carries them (rank 0's param.grad after DDP; zeros
    where no rank used a parameter, as its bucket slot), then the used map where the
    iteration has one (every iteration with find_unused_parameters, iteration 0 with
    static_graph: the assembly lists it last)."""
    out = [np.concatenate([(ref["grads"][n] if n in ref["grads"] else torch.zeros(plan.param(n).shape))
                           .reshape(-1).numpy() for n in b.params]) for b in plan.layout(it)]
    if plan.has_map(it):
        out.append(np.asarray(ref["used"] if used is None else used, dtype="<i4"))
    return out


def _replay(d: Path, used=None, plan=None, iterations: int = job.ITERATIONS) -> list[tuple[int, list[str]]]:
    """Step the shadow with each iteration's reduced gradients and map; its differences
    from rank 0's state, per iteration. plan: in place of the run's own."""
    plan = plan or load_plan(d / "plan.json")
    shadow = ShadowModel(plan, load_checkpoint(d / "init.pt", plan.state_names))
    out = []
    for it in range(iterations):
        ref = torch.load(d / f"iter{it}.pt", weights_only=True)
        shadow.apply(it, _buffers(plan, it, ref, None if used is None else used(ref)))
        mine = {"iteration": it, "model": shadow.model_state(), "optimizer": shadow.optimizer_state()}
        out.append((it, diff_checkpoints(mine, {"iteration": it, **ref})))
    return out


@pytest.mark.parametrize("kind,clip", [("adamw", 0.5), ("adamw", None), ("sgd", 0.5), ("sgd", None)])
def test_parameters_unused_on_some_ranks_or_all_replay_bit_for_bit(runs, kind, clip):
    d = runs(kind, clip)
    plan = load_plan(d / "plan.json")
    assert plan.find_unused_parameters and not plan.rebuilt_learn
    assert plan.buckets_rebuilt == plan.buckets_first and len(plan.buckets_first) == 3  # DDP's caps, never rebuilt
    names = [p.name for p in plan.parameters]
    for it in range(job.ITERATIONS):
        ref = torch.load(d / f"iter{it}.pt", weights_only=True)
        # what DDP did: no rebuild, the same layout, the map reduced (counts of ranks),
        # a globally unused parameter's grad None, a locally unused one's the reduced value
        assert not ref["rebuilt"] and ref["layout"] == torch.load(d / "iter0.pt", weights_only=True)["layout"]
        want = job.used(it)
        assert ref["used"].dtype == torch.int32
        assert ref["used"].tolist() == [want[n.split(".")[0]] for n in names], it
        assert sorted(ref["grads"]) == sorted(n for n in names if want[n.split(".")[0]])
        state = ref["optimizer"]["state"]
        assert ("dead.weight" not in state) and (("b.weight" in state) == (it >= 1))
    assert _replay(d) == [(it, []) for it in range(job.ITERATIONS)]


def test_a_shadow_stepping_every_parameter_differs(runs):
    """The same replay with every parameter marked used (stepping globally unused ones,
    as ckptd would without the map) drifts from rank 0: the check above can fail."""
    d = runs("sgd", 0.5)
    bad = [(it, diffs) for it, diffs in _replay(d, used=lambda ref: np.maximum(ref["used"].numpy(), 1)) if diffs]
    assert bad and bad[0][0] == 0  # b and dead, unused on iteration 0, were stepped


def test_zero_grad_keeping_tensors_is_refused_in_one_line(tmp_path):
    """zero_grad(set_to_none=False): a parameter no rank used keeps a zero gradient, which
    torch's step does step and the wire cannot show: write_plan's step hook refuses it at
    the first such step (iteration 1: layer a, used on iteration 0, unused on 1)."""
    d = _run(tmp_path, "adamw", None, "zeros")
    msg = (d / "refused.txt").read_text()
    assert msg.startswith("1: parameter a.weight was used on no rank this iteration but has a gradient tensor")
    assert "set_to_none=True" in msg and "\n" not in msg


def test_the_plan_says_so_and_what_is_not_decoded_is_refused(runs):
    d = runs("adamw", 0.5)
    doc = json.loads((d / "plan.json").read_text())
    assert doc["find_unused_parameters"] is True and doc["buckets"]["rebuilt"] == doc["buckets"]["first"]
    plan = plan_from_json(doc)
    nb = len(plan.buckets_first)
    assert len(plan.buckets(0)) == nb + 1 and plan.buckets(3)[-1].count == len(plan.parameters)
    assert plan.buckets(0)[-1].dtype == np.dtype("<i4") and plan.is_used_map(0, nb) and not plan.is_used_map(0, 0)
    assert plan.param_ranges(2, nb) == [(USED_MAP, 0, len(plan.parameters))]
    for change, why in ((dict(allreduces_per_step=2), r"allreduces_per_step > 1 is not supported"),
                        (dict(buckets_rebuilt=plan.buckets_first[::-1]), r"never rebuilds its buckets"),
                        (dict(rebuilt_learn=True), r"never rebuilds its buckets")):
        with pytest.raises(PlanError, match=why) as e:
            dataclasses.replace(plan, **change)
        assert "\n" not in str(e.value)
    bad = {**doc, "find_unused_parameters": "yes"}
    with pytest.raises(PlanError, match=r"find_unused_parameters must be true or absent"):
        plan_from_json(bad)
    del doc["find_unused_parameters"]  # an older plan: no map on the wire
    assert not plan_from_json(doc).find_unused_parameters and len(plan_from_json(doc).buckets(0)) == nb
    # write_plan: an allreduce per micro-batch is refused in one line (tests/test_trainer.py)
    ct._check_find_unused(1)
    # a resumed shadow: a parameter never used has no optimizer state, and that is fine
    ckpt = load_checkpoint(d / "rank0" / "iter_000003.pt")
    assert "dead.weight" not in ckpt["optimizer"]["state"]
    plan.check_resume(ckpt, "ckpt")
    with pytest.raises(Exception, match=r"optimizer.state lacks 'dead.weight'"):
        dataclasses.replace(plan, find_unused_parameters=False, buckets_rebuilt=plan.buckets_first,
                            rebuilt_learn=False).check_resume(ckpt, "ckpt")


def test_a_map_no_reduction_gives_is_not_stepped(runs):
    d = runs("adamw", None)
    plan = load_plan(d / "plan.json")
    shadow = ShadowModel(plan, load_checkpoint(d / "init.pt", plan.state_names))
    ref = torch.load(d / "iter0.pt", weights_only=True)
    with pytest.raises(ValueError, match=r"used-parameter map says fc1.bias was used on 3 ranks of 2"):
        shadow.apply(0, _buffers(plan, 0, ref, used=[2, 3] + [0] * 10))


# -- a captured job ----------------------------------------------------------------------
def _captured(out: Path, kind: str, clip: float | None, script: Path = JOB, extra: tuple = ()) -> Path:
    from test_ddp_jobs import _q, _why_not
    why = _why_not()
    if why:
        pytest.skip(f"real DDP jobs skipped: {why}")
    out.mkdir(parents=True, exist_ok=True)
    pcap, err = out / "lo.pcap", out / "tcpdump.err"
    train = [sys.executable, str(script), str(out), kind, "-" if clip is None else str(clip), *extra]
    script = (f"ip link set lo up; tcpdump -i lo -s 0 -B 262144 -U --immediate-mode -w {pcap} tcp 2>{err} & T=$!; "
              f"sleep 1; PYTHONPATH={_q(str(REPO))} {' '.join(_q(a) for a in train)}; rc=$?; sleep 0.5; "
              "kill -INT $T; wait $T; exit $rc")
    r = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    dropped = [ln for ln in err.read_text().splitlines() if "dropped by kernel" in ln]
    if dropped and not dropped[0].startswith("0 "):
        pytest.skip(f"tcpdump lost packets ({dropped[0]}): the capture is not complete")
    return pcap


def _replay_cli(d: Path, pcaps: list[Path], out: Path):
    return subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(d / "plan.json"),
                           "--init", str(d / "init.pt"), "--out", str(out), "--reference", str(d / "rank0"),
                           *map(str, pcaps)], capture_output=True, text=True, timeout=300, cwd=REPO)


def assert_replay_exact(r, n: int):
    """`ckptd replay` exited 0 with all n iterations committed bit-exact."""
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"{n} iterations, {n} committed, 0 not recovered" in r.stdout
    assert r.stdout.count("bit-exact") == n and "NOT bit-exact" not in r.stdout


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    d = tmp_path_factory.mktemp("captured")
    return d, _captured(d, "sgd", 0.5)


def test_a_captured_job_replays_bit_exact(captured, tmp_path):
    d, pcap = captured
    r = _replay_cli(d, [pcap], tmp_path / "ckpts")
    assert_replay_exact(r, job.ITERATIONS)
    assert "rebuilt_not_seen" not in r.stdout  # no rebuild was waited for


def _without_map(pcap, tag: int, out):
    """pcap without the data segments of gloo tag `tag` (a used map) on any connection:
    every mirror copy of it lost. Returns out."""
    from parsers.capfile import open_capture
    from parsers.pcap import PcapWriter
    from parsers.tcp import decode_tcp_frame
    dropped = 0
    with open(out, "wb") as f:
        w = PcapWriter(f)
        for fr in open_capture(pcap):
            seg, _ = decode_tcp_frame(fr.data, fr.linktype, fr.origlen)
            payload = bytes(seg.payload) if seg is not None else b""
            at = payload.find(_map_slot(tag))
            if at >= 16 and struct.unpack_from("<Q", payload, at - 8)[0] == 1:  # SEND_UNBOUND_BUFFER: data
                dropped += 1
                continue
            w.write(fr.data, fr.ts_ns, fr.origlen)
    assert dropped
    return out


def _map_slot(tag: int) -> bytes:
    return struct.pack("<Q", (0x04 << 56) | (tag << 24))


def test_an_iteration_whose_map_was_lost_is_not_committed(captured, tmp_path):
    """Every segment carrying a data message of iteration 2's map allreduce dropped: that
    iteration is reported unrecoverable naming the map, never committed (nor any after it);
    the ones before commit bit-exact."""
    d, pcap = captured
    plan = load_plan(d / "plan.json")
    per = len(plan.buckets(0))  # allreduces a round, the map last
    tag = 3 + 3 * per - 1  # tags 0-2: DDP's start-up allgather and broadcasts; iteration 2's map
    lossy = _without_map(pcap, tag, tmp_path / "lossy.pcap")
    r = _replay_cli(d, [lossy], tmp_path / "ckpts")
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    lines = {int(ln.split()[1].rstrip(":")): ln for ln in r.stdout.splitlines() if ln.startswith("iteration ")}
    assert all("committed" in lines[i] and "bit-exact" in lines[i] for i in (0, 1)), r.stdout
    assert "unrecoverable" in lines[2] and USED_MAP in lines[2], lines[2]
    assert not any("committed" in lines[i] for i in lines if i > 2), r.stdout
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir() if p.name.startswith("iter")) == \
        ["iter_000000.pt", "iter_000001.pt"]


def _map_copies(pcap: Path, out: Path, tag: int, corrupt: int | None) -> list[Path]:
    """Two mirror copies of a capture; in copy `corrupt` (None: neither) one byte of the
    last data message of allreduce `tag` (an allgather send: final values) flipped."""
    from parsers.capfile import open_capture
    from parsers.pcap import PcapWriter
    from parsers.tcp import decode_tcp_frame
    frames = list(open_capture(pcap))
    last = None
    for k, fr in enumerate(frames):
        seg, _ = decode_tcp_frame(fr.data, fr.linktype, fr.origlen)
        payload = bytes(seg.payload) if seg is not None else b""
        at = payload.rfind(_map_slot(tag))
        if at >= 16 and struct.unpack_from("<Q", payload, at - 8)[0] == 1:
            last = (k, len(fr.data) - len(payload) + at - 16 + 48)  # the message's first payload byte
    assert last is not None
    paths = [out / "copy0.pcap", out / "copy1.pcap"]
    for c, p in enumerate(paths):
        with open(p, "wb") as f:
            w = PcapWriter(f)
            for k, fr in enumerate(frames):
                data = bytearray(fr.data)
                if c == corrupt and k == last[0]:
                    data[last[1]] ^= 0x01
                w.write(bytes(data), fr.ts_ns, fr.origlen)
    return paths


@pytest.mark.parametrize("what,corrupt", [("map", None), ("map", 0), ("map", 1), ("gradient", 0), ("gradient", 1)])
def test_mirror_copies_that_disagree_are_a_conflict(captured, tmp_path, what, corrupt):
    """Two mirror streams: identical copies commit every iteration bit-exact; where one
    copy of iteration 2's map, or of its first gradient bucket's final values, differs by
    a bit, whichever stream delivered first, that iteration is a conflict (exit 3), not
    committed with either copy. (With 2 ranks each final value crosses the wire once: the
    mirror copies are its only copies. The reassembler keeps the first copy of a byte;
    before, the first one delivered was committed.)"""
    d, pcap = captured
    per = len(load_plan(d / "plan.json").buckets(0))
    tag = 3 + 3 * per - 1 if what == "map" else 3 + 2 * per  # iteration 2's map; its first bucket
    copies = _map_copies(pcap, tmp_path, tag, corrupt)
    r = _replay_cli(d, copies, tmp_path / "ckpts")
    lines = {int(ln.split()[1].rstrip(":")): ln for ln in r.stdout.splitlines() if ln.startswith("iteration ")}
    n = job.ITERATIONS
    if corrupt is None:
        assert r.returncode == 0 and f"{n} iterations, {n} committed" in r.stdout, r.stdout[-2000:] + r.stderr
        assert r.stdout.count("bit-exact") == n and "NOT bit-exact" not in r.stdout
        return
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-2000:]
    assert all("committed" in lines[i] and "bit-exact" in lines[i] for i in (0, 1)), r.stdout
    assert "conflict" in lines[2] and "disagree" in lines[2], lines[2]
    assert (USED_MAP in lines[2]) == (what == "map"), lines[2]
    assert not any("committed" in lines[i] for i in lines if i > 2), r.stdout
