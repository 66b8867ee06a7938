"""What replay does when it cannot be exact: it says so, and never commits a wrong state."""
import json
import shutil
from pathlib import Path

import pytest

from ckptd.core.algorithms import CollectiveRefused
from ckptd.core.checkpoint import checkpoint_name
from ckptd.cli import main
from parsers.capfile import open_capture
from parsers.pcap import write_pcap
from parsers.roce import FrameClass, decode_frame

from helpers import pcaps, run_replay, synth

MIDDLE = 7


@pytest.fixture(scope="module")
def one_mirror(tmp_path_factory):
    """2 ranks, one mirror port seeing both directions: every element has exactly one copy."""
    d = tmp_path_factory.mktemp("one_mirror")
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, mirrors=1, iterations=6, seed=3)
    return d


def _drop(src: str, dst: str, drop: set[int]):
    write_pcap(dst, [fr for fr in open_capture(src) if fr.index not in drop])


def _data_frames(path, opcode):
    return [fr.index for fr in open_capture(path)
            if (f := decode_frame(fr.data)).cls is FrameClass.ROCE_DATA and f.bth.opcode == opcode]


def test_a_lost_allgather_packet_is_reported_exactly_and_the_shadow_stops(one_mirror, tmp_path, capsys):
    src = pcaps(one_mirror)[0]
    middles = _data_frames(src, MIDDLE)
    # Find a middle packet of iteration 3 carrying allgather data: drop candidates until
    # an iteration becomes unrecoverable (reduce-scatter losses cost nothing).
    for idx in middles[len(middles) // 2:]:
        lossy = str(tmp_path / "lossy.pcap")
        _drop(src, lossy, {idx})
        shutil.rmtree(one_mirror / "out", ignore_errors=True)
        pipe = run_replay(one_mirror, [lossy])
        bad = [r for r in pipe.reports if r.status == "unrecoverable"]
        if bad:
            break
    else:
        pytest.fail("no allgather packet found to drop")
    assert len(bad) == 1
    t = bad[0].iteration
    missing = bad[0].missing
    # exactly one packet's worth: 1024 bytes of float32, named by parameter
    assert len(missing) == 1 and missing[0].end - missing[0].start == 256
    assert sum(e - s for _, s, e in missing[0].params) == 256
    for r in pipe.reports:
        if r.iteration < t:
            assert r.status == "committed" and r.exact
        elif r.iteration > t:
            assert r.status == "complete-not-applied"
    out = one_mirror / "out"
    assert (out / checkpoint_name(t - 1)).exists() if t > 0 else True
    assert not (out / checkpoint_name(t)).exists()
    shutil.rmtree(out)

    # The CLI says which iteration and exits non-zero.
    rc = main(["replay", "--plan", str(one_mirror / "plan.json"), "--init", str(one_mirror / "init.pt"),
               "--out", str(tmp_path / "ck"), lossy])
    text = capsys.readouterr().out
    assert rc == 3
    assert f"iteration {t:>4}: unrecoverable" in text
    assert f"missing: bucket {missing[0].bucket} elements [{missing[0].start}, {missing[0].end})" in text

    # Resuming from a checkpoint of the lost iteration continues, bit-exact.
    pipe = run_replay(one_mirror, [lossy], resume=str(one_mirror / "reference" / checkpoint_name(t)))
    after = [r for r in pipe.reports if r.iteration > t]
    assert after and all(r.status == "committed" and r.exact for r in after)


@pytest.mark.parametrize("field, value", [("mtu", 4096), ("protocol", "ll")])
def test_a_wrong_plan_commits_nothing(one_mirror, tmp_path, field, value):
    doc = json.loads((one_mirror / "plan.json").read_text())
    doc["ring"][field] = value
    for name in ("plan.json", "init.pt"):
        if name == "plan.json":
            (tmp_path / name).write_text(json.dumps(doc))
        else:
            shutil.copy(one_mirror / name, tmp_path / name)
    shutil.copytree(one_mirror / "reference", tmp_path / "reference")
    if field == "protocol":  # Simple on the wire: no LL flag words, refused by name
        with pytest.raises(CollectiveRefused, match="NCCL's Simple .* plan says protocol ll"):
            run_replay(tmp_path, pcaps(one_mirror))
    else:
        pipe = run_replay(tmp_path, pcaps(one_mirror))
        assert not any(r.status == "committed" for r in pipe.reports)
    assert not list((tmp_path / "out").glob("iter_*.pt"))


def test_flow_binds_even_when_its_first_message_is_lost_everywhere(tmp_path):
    synth(tmp_path, ranks=2, channels=2, protocol="ll", mtu=1024, mirrors=2, iterations=4, seed=5)
    paths = pcaps(tmp_path)
    # the first message of every data flow: its packets up to the first LAST/ONLY
    first = {}
    for fr in open_capture(paths[0]):
        f = decode_frame(fr.data)
        if f.cls is not FrameClass.ROCE_DATA or f.bth.opcode not in (6, 7, 9, 11):
            continue
        key = (str(f.src), str(f.dst), f.bth.dest_qp)
        st = first.setdefault(key, {"psns": set(), "done": False})
        if not st["done"]:
            st["psns"].add(f.bth.psn)
            st["done"] = f.bth.opcode in (9, 11)
    victim = next(k for k, st in first.items() if k[0].endswith(".1"))
    lossy = []
    for i, p in enumerate(paths):
        keep = []
        for fr in open_capture(p):
            f = decode_frame(fr.data)
            if (f.cls is FrameClass.ROCE_DATA and (str(f.src), str(f.dst), f.bth.dest_qp) == victim
                    and f.bth.psn in first[victim]["psns"]):
                continue
            keep.append(fr)
        out = str(tmp_path / f"lossy{i}.pcap")
        write_pcap(out, keep)
        lossy.append(out)
    pipe = run_replay(tmp_path, lossy)
    assert pipe.extract.counters["schedule_mismatch"] == 0
    assert victim in pipe.extract.binder.bound
    later = [r for r in pipe.reports if r.iteration > 0]
    assert later and all(r.status == "committed" and r.exact for r in later)


def test_a_capture_cut_mid_record_still_replays_what_is_there(one_mirror, tmp_path):
    src = Path(pcaps(one_mirror)[0])
    cut = tmp_path / "cut.pcap"
    data = src.read_bytes()
    cut.write_bytes(data[:len(data) - 500])
    pipe = run_replay(one_mirror, [str(cut)])
    assert pipe.errors and "cut.pcap" in pipe.errors[0]
    assert all(r.status == "committed" and r.exact for r in list(pipe.reports)[:-1])
    assert pipe.reports[-1].status == "unrecoverable"
