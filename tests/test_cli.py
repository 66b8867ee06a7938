"""The command line, as a user runs it."""
import json
import subprocess
from pathlib import Path
import sys

import pytest
import torch

from ckptd.core.checkpoint import checkpoint_name, load_checkpoint, save_checkpoint
from ckptd.cli import main

from helpers import pcaps, synth


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    synth(d, ranks=2, channels=2, protocol="ll", mtu=1024, iterations=3, mirrors=2)
    return d


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "ckptd", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("demo", "synth", "replay", "inspect", "verify", "plan"):
        assert cmd in out.stdout


def test_every_python_script_answers_help():
    """scripts/netlab, which README documents, died at its import (`from ckptd import
    netlab`: the module had moved to ckptd.testing), and build-checked-kernel took
    `--help` for its output directory and built into ./--help (helper 71)."""
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    checked = []
    for f in sorted(scripts.iterdir()):
        if f.is_file() and f.read_bytes()[:2] == b"#!" and b"python" in f.read_bytes().split(b"\n")[0]:
            r = subprocess.run([sys.executable, str(f), "--help"], capture_output=True, text=True, timeout=120,
                               cwd=scripts)
            assert r.returncode == 0 and "usage" in r.stdout.lower(), (f.name, r.stdout[-500:], r.stderr[-1000:])
            checked.append(f.name)
    assert {"netlab", "ddp_gloo_train.py", "build-checked-kernel"} <= set(checked), checked
    assert not (scripts / "--help").exists()


def test_version_is_the_installed_distributions():
    """`ckptd --version` said "the following arguments are required: cmd"."""
    from importlib.metadata import version
    out = subprocess.run([sys.executable, "-m", "ckptd", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"ckptd {version('ckptd')}", out


def test_replay_prints_a_line_per_iteration(run, tmp_path, capsys):
    rc = main(["replay", "--plan", str(run / "plan.json"), "--init", str(run / "init.pt"),
               "--out", str(tmp_path), "--reference", str(run / "reference")] + pcaps(run))
    out = capsys.readouterr().out
    assert rc == 0
    for t in range(3):
        assert f"iteration {t:>4}: committed" in out
        assert (tmp_path / checkpoint_name(t)).exists()
    assert out.count("bit-exact") == 3 and "NOT bit-exact" not in out
    assert "coverage[mirror0=" in out and "loss[mirror0=" in out
    assert "3 iterations, 3 committed, 0 not recovered" in out


def test_inspect_json(run, capsys):
    assert main(["inspect", "--json"] + pcaps(run)) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("frames", "roce_frames", "icrc_valid", "icrc_invalid", "flows"):
        assert key in res
    assert res["icrc_invalid"] == 0 and res["roce_frames"] > 0
    assert res["frames"] >= res["roce_frames"]


def test_inspect_real_captures_counts(flowcheck_dir, capsys):
    assert main(["inspect", "--json"] + sorted(str(p) for p in flowcheck_dir.glob("*.pcapng"))) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["roce_frames"], res["icrc_valid"], res["icrc_invalid"]) == (4681, 4674, 7)


def test_verify(run, tmp_path, capsys):
    a = run / "reference" / checkpoint_name(1)
    assert main(["verify", str(a), str(a)]) == 0
    doc = load_checkpoint(a)
    name = next(iter(doc["model"]))
    doc["model"][name] = doc["model"][name].clone()
    doc["model"][name].view(-1)[3] = torch.nextafter(doc["model"][name].view(-1)[3], torch.tensor(1e9))
    save_checkpoint(tmp_path / "b.pt", doc["iteration"], doc["model"], doc["optimizer"])
    capsys.readouterr()
    assert main(["verify", str(a), str(tmp_path / "b.pt")]) == 1
    out = capsys.readouterr().out
    assert f"model.{name}: 1 of" in out and "flat index 3" in out
    (tmp_path / "junk.pt").write_bytes(b"junk")
    assert main(["verify", str(a), str(tmp_path / "junk.pt")]) == 2


def test_verify_reads_what_restore_reads_the_daemons_url_bounded(run, tmp_path, capsys, monkeypatch):
    """verify takes the daemon's URL (its /checkpoint, $CKPTD_TOKEN sent) and a directory
    of checkpoints (its newest), as restore does; a body past what a checkpoint of the
    plan's model can take is one line, not a MemoryError after reading it."""
    import http.server
    import threading
    a = run / "reference" / checkpoint_name(2)
    body = a.read_bytes()
    seen = []

    class Daemon(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            endless = self.path.startswith("/endless")
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(10 ** 12 if endless else len(body)))
            self.end_headers()
            self.wfile.write(b"\0" * 65536 if endless else body)

        def log_message(self, *args):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Daemon)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        monkeypatch.setenv("CKPTD_TOKEN", "s3cret")
        assert main(["verify", url, str(a)]) == 0
        assert seen == [("/checkpoint", "Bearer s3cret")]
        assert main(["verify", str(run / "reference"), str(a)]) == 0  # the newest: iteration 2
        assert main(["verify", str(run / "reference"), str(run / "reference" / checkpoint_name(1))]) == 1
        capsys.readouterr()
        assert main(["verify", "--plan", str(run / "plan.json"), url + "/endless", str(a)]) == 2
        err = capsys.readouterr().err
        assert "Content-Length 1000000000000 is more than a checkpoint of this model" in err, err
        assert len(err.strip().splitlines()) == 1
    finally:
        srv.shutdown()


def test_replay_errors_are_clear(run, capsys):
    assert main(["replay", "--plan", str(run / "missing.json"), "x.pcap"]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert main(["replay", "--plan", str(run / "plan.json"), "--init", str(run / "init.pt"),
                 str(run / "nope.pcap")]) == 2
    assert "nope.pcap" in capsys.readouterr().err


def build_model():
    from ckptd.testing.synth.model import build_model as b
    return b("tiny", 0)


def sample_batch():
    from ckptd.testing.synth.model import shard_batches
    return shard_batches(build_model(), 0, 0, 0)


def test_plan_from_a_torch_model(tmp_path, capsys):
    from ckptd.core.plan import BucketLayout
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
               "--ranks", "2", "--addr", "10.0.0.1", "--addr", "10.0.0.2", "--bucket-cap-mb", "0.02",
               "--protocol", "ll", "--out", str(out)])
    assert rc == 0
    from ckptd.core.plan import load_plan
    plan = load_plan(out)
    model = build_model()
    assert [p.name for p in plan.parameters] == [n for n, _ in model.named_parameters()]
    assert plan.ring.protocol == "ll" and plan.transport == "roce"
    # torch 2.13 DDP (find_unused_parameters=False): iteration 0 is one bucket of every
    # parameter in registration order; the rebuilt buckets follow bucket_cap_mb in the
    # order backward made the gradients ready (the last layers first)
    assert plan.buckets_first == (BucketLayout(params=tuple(p.name for p in plan.parameters)),)
    assert len(plan.buckets_rebuilt) > 1
    assert plan.buckets_rebuilt[0].params[0] == plan.parameters[-1].name
    # the limits DDP used are recorded, and the layouts were checked against them
    import sys
    assert plan.bucket_limits == {"first": [sys.maxsize], "rebuilt": [int(0.02 * 2**20)] * 2}


def test_plan_for_gloo_with_a_model_module_in_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))\n")
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", "mymodel:build", "--ranks", "3", "--addr", "127.0.0.1", "--addr", "127.0.0.1",
            "--addr", "127.0.0.1", "--transport", "gloo", "--optimizer", "sgd", "--momentum", "0.9",
            "--lr", "0.1", "--out", "plan.json"]
    assert main(args) == 0, capsys.readouterr().err
    from ckptd.core.plan import load_plan
    plan = load_plan(tmp_path / "plan.json")
    assert plan.transport == "gloo" and plan.rebuilt_learn and len(plan.buckets_first) == 1
    assert plan.optimizer.kind == "sgd" and plan.optimizer.groups[0]["momentum"] == 0.9
    assert plan.collectives == {}
    # the job's own loss allreduce on DDP's group, listed (gloo's count skips it)
    assert main(args[:-1] + ["own.json", "--other-allreduce", "after:1", "--other-allreduce", "before:2:float16"]) == 0
    assert load_plan(tmp_path / "own.json").collectives == {"before": ((2, "float16"),), "after": ((1, "float32"),)}
    assert main(args[:-1] + ["bad.json", "--other-allreduce", "during:1"]) == 2
    assert "--other-allreduce 'during:1' is not WHEN:COUNT[:DTYPE]" in capsys.readouterr().err
    assert main(args[:-10] + ["--transport", "nccl", "--out", "p2.json"]) == 2
    assert "--sample" in capsys.readouterr().err
    # the loop's clipping: by another norm, by value; both at once is one line
    assert main(args[:-1] + ["inf.json", "--max-grad-norm", "0.5", "--grad-norm-type", "inf"]) == 0
    assert (load_plan(tmp_path / "inf.json").optimizer.max_grad_norm,
            load_plan(tmp_path / "inf.json").optimizer.grad_norm_type) == (0.5, float("inf"))
    assert main(args[:-1] + ["value.json", "--clip-grad-value", "0.1"]) == 0
    assert load_plan(tmp_path / "value.json").optimizer.clip_grad_value == 0.1
    capsys.readouterr()
    assert main(args[:-1] + ["both.json", "--clip-grad-value", "0.1", "--max-grad-norm", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --clip-grad-value and --max-grad-norm: the loop makes one clipping call (clip_grad_value_ or "
        "clip_grad_norm_) before the step; give one")
    assert not (tmp_path / "both.json").exists()
    assert main(args[:-1] + ["p.json", "--grad-norm-type", "inf"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: --grad-norm-type is clip_grad_norm_'s norm_type: it needs --max-grad-norm"
    assert main(["synth", "--clip-grad-value", "1", "--max-grad-norm", "1", "--out", str(tmp_path / "s")]) == 2
    assert "error: --clip-grad-value and --max-grad-norm" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
    assert main(["plan", "--model", "nosuch:build", "--ranks", "2", "--addr", "10.0.0.1",
                 "--addr", "10.0.0.2", "--out", "p3.json"]) == 2
    assert "error: --model 'nosuch:build'" in capsys.readouterr().err


def test_an_nccl_plan_from_a_model_lists_ddps_start_up_collectives_and_buffer_broadcasts(tmp_path, monkeypatch,
                                                                                         capsys):
    """DDP's constructor runs collectives on the NCCL communicator before iteration 0 (a
    shape check: an allgather of the parameter count and a broadcast of every
    parameter's sizes and strides; then rank 0's parameters and buffers), and each
    forward broadcasts the buffers: they move the ring's QP rotation, PSNs and LL steps.
    `ckptd plan` wrote none of them, so a capture from the job's start placed nothing
    (write_plan's plans had them)."""
    (tmp_path / "bnmodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))\n"
        "def sample():\n"
        "    return torch.randn(5, 4)\n")
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", "bnmodel:build", "--sample", "bnmodel:sample", "--ranks", "2",
            "--addr", "10.0.0.1", "--addr", "10.0.0.2", "--nccl-version", "2.21", "--out", "plan.json"]
    assert main(args) == 0, capsys.readouterr().err
    from ckptd.core.plan import load_plan
    plan = load_plan(tmp_path / "plan.json")
    # parameters 12+3, 3+3, 6+2 float32 (dims 2,1,1,1,2,1: 16 int64 of sizes and strides);
    # buffers running_mean, running_var (3+3 float32) and num_batches_tracked (1 int64)
    assert plan.collectives == {
        "start": ((1, "int64", "allgather"), (16, "int64", "broadcast", 0),
                  (29 + 6, "float32", "broadcast", 0), (1, "int64", "broadcast", 0)),
        "before": ((6, "float32", "broadcast", 0), (1, "int64", "broadcast", 0))}
    # and the buffers themselves, decoded from those broadcasts into every checkpoint
    # (before, the plan listed none: checkpoints without them, and no word of it)
    assert [b.name for b in plan.buffers.tensors] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert plan.buffers.broadcasts == (("1.running_mean", "1.running_var"), ("1.num_batches_tracked",))
    assert plan.buffers.captured
    # the job's own loss allreduce before backward follows DDP's per-forward buffer broadcasts
    assert main(args[:-1] + ["own.json", "--other-allreduce", "before:1"]) == 0
    assert load_plan(tmp_path / "own.json").collectives["before"] == plan.collectives["before"] + ((1, "float32"),)
    monkeypatch.setenv("NCCL_ALGO", "allgather:pat")  # 2.23+: a start-up allgather NCCL may run as PAT
    assert main(args[:-4] + ["--nccl-version", "2.23", "--out", "p2.json"]) == 2
    assert "PAT" in capsys.readouterr().err and not (tmp_path / "p2.json").exists()


def test_plan_of_a_model_with_a_tied_weight_records_its_other_name(tmp_path, monkeypatch, capsys):
    """named_parameters() gives a tied weight once; the plan records the other name so an
    export can write both (the trainer's strict load needs them)."""
    (tmp_path / "tiedmodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))\n"
        "    m.add_module('out', torch.nn.Linear(16, 8, bias=False))\n"
        "    m.out.weight = m[1].weight\n"
        "    return m\n")
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", "tiedmodel:build", "--ranks", "2", "--addr", "127.0.0.1", "--addr", "127.0.0.1",
            "--transport", "gloo", "--out", "plan.json"]
    assert main(args) == 0, capsys.readouterr().err
    from ckptd.core.plan import load_plan
    plan = load_plan(tmp_path / "plan.json")
    assert plan.tied == (("out.weight", "1.weight"),)
    assert "out.weight" not in [p.name for p in plan.parameters]


def test_demo_small(capsys):
    rc = main(["demo", "--model", "tiny", "--iterations", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("bit-exact") == 2


def test_replay_defaults_to_the_fast_path_with_the_reference_paths_output(run, tmp_path, capsys):
    """The batch kernel is replay's default; --reference-path gives the same lines
    (iterations, per-stream classes and loss, extraction counters) through the
    pure-Python path, and --fast is still accepted."""
    args = ["replay", "--plan", str(run / "plan.json"), "--init", str(run / "init.pt"),
            "--reference", str(run / "reference")] + pcaps(run)
    assert main(args + ["--out", str(tmp_path / "ref"), "--reference-path"]) == 0
    slow = capsys.readouterr().out
    assert main(args + ["--out", str(tmp_path / "fast")]) == 0
    fast = capsys.readouterr().out
    assert main(args + ["--out", str(tmp_path / "alias"), "--fast"]) == 0
    alias = capsys.readouterr().out

    def lines(text):  # all but the waits between threads (timing) and the wall time
        return [ln.split(", reader_waited")[0] for ln in text.splitlines()
                if ln.startswith(("iteration", "stream", "extraction"))]
    assert lines(fast) == lines(slow) == lines(alias) and fast.count("bit-exact") == 3
    assert "reader_waited" in fast and "reader_waited" not in slow  # which path ran
    assert main(args + ["--out", str(tmp_path / "x"), "--reference-path", "--trust-icrc"]) == 2
    assert "--trust-icrc needs the fast path" in capsys.readouterr().err


def test_every_command_and_option_says_what_it_is():
    """`ckptd demo --help` had no description and 27 options had no help (synth's
    --channels, replay's --plan, verify's two checkpoints, ...)."""
    import argparse

    from ckptd.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"{name} {a.option_strings or a.dest}" for name, sp in sub.choices.items() for a in sp._actions
            if not a.help and not isinstance(a, argparse._HelpAction)]
    assert bare == []
    assert [name for name, sp in sub.choices.items() if not sp.description] == []


def test_an_iteration_without_a_packet_says_so(tmp_path, capsys):
    """A capture gap that swallows a whole iteration (every mirror link down for a while):
    the iteration was reported unrecoverable with packets=0 and an empty note, the missing
    ranges alone saying what happened (helper 71)."""
    from parsers.capfile import open_capture
    from parsers.pcap import write_pcap
    d = tmp_path / "s"
    synth(d, ranks=2, channels=1, iterations=3, mirrors=1)
    frames = list(open_capture(pcaps(d)[0]))
    gaps = [k for k in range(1, len(frames)) if frames[k].ts_ns - frames[k - 1].ts_ns > 50_000_000]
    assert len(gaps) >= 2, "synth leaves ~100 ms between iterations"
    kept = frames[:gaps[0]] + frames[gaps[1]:]  # iteration 1's traffic is not in the capture
    write_pcap(str(tmp_path / "gap.pcap"), kept)
    rc = main(["replay", "--plan", str(d / "plan.json"), "--init", str(d / "init.pt"), str(tmp_path / "gap.pcap")])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("iteration    1:"))
    assert rc == 3 and "unrecoverable  packets=0" in line, out
    assert "(no packet of it was captured on any stream; shadow stops at iteration 0)" in line, line


def test_a_stream_captured_with_a_short_snap_length_is_named(run, tmp_path, capsys):
    """A capture cut by its snap length loses every copy it cut: the stream's coverage fell
    to 0 and nothing said why. Now replay warns, naming the stream, the count and the fix."""
    from parsers.frame import CapturedFrame
    from parsers.pcap import read_pcap, write_pcap
    cut = str(tmp_path / "short.pcap")
    frames = [CapturedFrame(f.index, f.ts_ns, f.linktype, min(f.caplen, 200), f.origlen, f.data[:200])
              for f in read_pcap(pcaps(run)[1])]
    write_pcap(cut, frames)
    short = sum(f.caplen < f.origlen for f in frames)
    assert short > 100
    for fast in ([], ["--reference-path"]):
        assert main(["replay", *fast, "--plan", str(run / "plan.json"), "--init", str(run / "init.pt"),
                     "--out", str(tmp_path / f"out{len(fast)}"), pcaps(run)[0], cut]) == 0
        out, err = capsys.readouterr()
        assert "3 iterations, 3 committed" in out  # mirror0 carried every copy
        assert f"warning: stream short: {short} frames were cut short" in err and "tcpdump -s 0" in err, err
        assert "warning: stream mirror0" not in err


def test_frames_that_fail_their_icrc_are_named_per_stream(run, tmp_path, capsys):
    from parsers.frame import CapturedFrame
    from parsers.pcap import read_pcap, write_pcap
    damaged = str(tmp_path / "damaged.pcap")
    frames, hit = [], 0
    for f in read_pcap(pcaps(run)[1]):
        data = f.data
        if f.caplen > 600 and hit < 5 and f.index % 3 == 0:  # a payload byte flipped on the way
            data, hit = data[:500] + bytes([data[500] ^ 0xFF]) + data[501:], hit + 1
        frames.append(CapturedFrame(f.index, f.ts_ns, f.linktype, f.caplen, f.origlen, data))
    write_pcap(damaged, frames)
    assert hit == 5
    for fast in ([], ["--reference-path"]):
        assert main(["replay", *fast, "--plan", str(run / "plan.json"), "--init", str(run / "init.pt"),
                     "--out", str(tmp_path / f"out{len(fast)}"), pcaps(run)[0], damaged]) == 0
        out, err = capsys.readouterr()
        assert "3 iterations, 3 committed" in out and "bad_icrc=5" in out
        assert "warning: stream damaged: 5 RoCE frames failed their ICRC" in err, err


def test_export_with_a_plan_names_entries_the_plan_does_not_have(run, tmp_path, capsys):
    """Exported as they are (a buffer an older plan does not list is the job's), but named:
    the trainer's strict load_state_dict would refuse them."""
    ck = load_checkpoint(run / "reference" / checkpoint_name(1))
    ck["model"]["junk.weight"] = torch.zeros(3)
    torch.save(ck, tmp_path / "extra.pt")
    args = ["export", "--format", "torch", "--plan", str(run / "plan.json")]
    assert main(args + [str(tmp_path / "extra.pt"), "--out", str(tmp_path / "a.pt")]) == 0
    err = capsys.readouterr().err
    assert "model.junk.weight is in the checkpoint but not in the plan" in err, err
    assert "junk.weight" in torch.load(tmp_path / "a.pt", weights_only=True)["model"]
    assert main(args + [str(run / "reference" / checkpoint_name(1)), "--out", str(tmp_path / "b.pt")]) == 0
    assert "warning" not in capsys.readouterr().err
