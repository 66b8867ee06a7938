"""Bad input from outside, through the command line: every case exits 2 with one
`error:` line on stderr naming the culprit, and never a traceback (issue 13, item 3).

Each case is (id, what to break, the text the error line must contain); the scenario
directory is a tiny synthesized job (plan.json, init.pt, mirrors/) and each case writes
its broken file next to it. Every case runs through `ckptd.cli.main` in this process
(what `python -m ckptd` calls; an escaping exception fails the test as a traceback
would), and a selection of them through a real `python -m ckptd` as well (a fresh
interpreter importing torch takes seconds on a loaded machine: the whole table that
way would take many minutes).
"""
from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import time
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import synth

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad-input")
    synth(d, iterations=1, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16)
    return d


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def ckptd_main(capsys, *argv):
    """`ckptd ARGV` in this process: exit status, stdout, stderr."""
    from ckptd.cli import main
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return _Result(rc, out, err)


def ckptd(*argv, timeout=120, stdin=subprocess.DEVNULL, pass_fds=()):
    """`python -m ckptd ARGV`; `stdin`: what it reads as `-` (a file, a pipe, a terminal)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CKPTD_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "ckptd", *map(str, argv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=stdin, pass_fds=pass_fds)


# -- plans ------------------------------------------------------------------------------
def _plan(d: Path, change, name: str) -> Path:
    doc = json.loads((d / "plan.json").read_text())
    if callable(change):
        doc = copy.deepcopy(doc)
        change(doc)
    else:
        doc = change
    p = d / f"plan-{name}.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def _set(path: str, value):
    """A change that sets doc[k1][k2]... = value (ints index lists); DELETE removes it."""
    def change(doc):
        keys = [int(k) if k.isdigit() else k for k in path.split(".")]
        node = doc
        for k in keys[:-1]:
            node = node[k]
        if value is DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return change


DELETE = object()


def _merge_rebuilt(doc):
    rb = doc["buckets"]["rebuilt"]
    rb[0]["params"] += rb.pop(1)["params"]


def _swap_rebuilt(doc):
    rb = doc["buckets"]["rebuilt"]
    rb[0]["params"].append(rb[1]["params"][0])  # one parameter twice


def _schedule(kind, **kw):
    return _set("optimizer.lr_schedule", {"kind": kind, **kw})


PLAN_CASES = [
    ("no-shape", _set("parameters.0.shape", DELETE), "parameters[0] is missing 'shape'"),
    ("huge-shape", _set("parameters.0.shape", [1 << 20, 1 << 20]), "parameters[0].shape"),
    ("shape-str", _set("parameters.0.shape", "64x64"), "parameters[0].shape must be a list"),
    ("shape-neg", _set("parameters.0.shape", [-1, 4]), "parameters[0].shape[0]"),
    ("shape-float", _set("parameters.0.shape", [2.5, 4]), "parameters[0].shape[0] must be an integer"),
    ("dims", _set("parameters.0.shape", [1] * 20), "dimensions"),
    ("name-int", _set("parameters.0.name", 7), "parameters[0].name must be a string"),
    ("iterations-float", _set("iterations", 1e12), "iterations must be an integer"),
    ("iterations-huge", _set("iterations", 10 ** 15), "iterations is 1000000000000000"),
    ("iterations-str", _set("iterations", "many"), "iterations must be an integer"),
    ("lr-negative", _set("optimizer.lr", -1), "optimizer.lr"),
    ("lr-str", _set("optimizer.lr", "fast"), "optimizer.lr must be a number"),
    ("beta-one", _set("optimizer.betas", [0.9, 1.0]), "optimizer.betas"),
    ("betas-three", _set("optimizer.betas", [0.9, 0.99, 0.5]), "optimizer.betas must be two"),
    ("eps-zero", _set("optimizer.eps", 0), "optimizer.eps"),
    ("wd-negative", _set("optimizer.weight_decay", -0.1), "optimizer.weight_decay"),
    ("total-steps-zero", _schedule("linear", warmup_steps=0, total_steps=0), "optimizer.lr_schedule.total_steps"),
    ("total-steps-missing", _schedule("cosine"), "optimizer.lr_schedule.total_steps"),
    ("warmup-over", _schedule("linear", warmup_steps=9, total_steps=3), "optimizer.lr_schedule.warmup_steps"),
    ("schedule-kind", _schedule("step"), "optimizer.lr_schedule.kind"),
    ("opt-kind", _set("optimizer.kind", "sgd"), "optimizer.kind"),
    ("max-grad-norm", _set("optimizer.max_grad_norm", -1), "optimizer.max_grad_norm"),
    ("grad-norm-type-str", _set("optimizer.grad_norm_type", "two"), "optimizer.grad_norm_type must be a number"),
    ("grad-norm-type-alone", _set("optimizer.grad_norm_type", 1), "optimizer.grad_norm_type is clip_grad_norm_'s"),
    ("clip-grad-value", _set("optimizer.clip_grad_value", [1]), "optimizer.clip_grad_value must be a number"),
    ("nranks-huge", _set("ring.nranks", 100000), "ring.nranks"),
    ("nranks-str", _set("ring.nranks", "2"), "ring.nranks must be an integer"),
    ("channels-huge", _set("ring.rings", [[0, 1]] * 1000), "ring.rings lists 1000 channels"),
    ("ring-bad-rank", _set("ring.rings", [[0, 7]]), "ring.rings[0]"),
    ("threads-huge", _set("ring.max_threads", 10 ** 9), "ring.max_threads"),
    ("buffsize-huge", _set("ring.buffsize", 1 << 40), "ring.buffsize"),
    ("mtu", _set("ring.mtu", 1500), "MTU 1500"),
    ("nccl-version", _set("ring.nccl_version", "two"), "ring.nccl_version"),
    ("rebuilt-merged", _merge_rebuilt, "bucket-cap rule"),
    ("rebuilt-twice", _swap_rebuilt, "exactly once"),
    ("bucket-unknown", _set("buckets.first.0.params", ["nope"]), "unknown parameter 'nope'"),
    ("buckets-str", _set("buckets", "all"), "buckets must be an object"),
    ("addr", _set("ranks.0.addr", "not-an-ip"), "not-an-ip"),
    ("rank-missing", _set("ranks", [{"rank": 0, "addr": "10.0.0.1"}]), "ranks must list ranks 0..1"),
    ("mirror-dir", _set("mirrors", [{"rank": 0, "direction": "up"}]), "mirrors[0].direction"),
    ("transport", _set("transport", "carrier-pigeon"), "transport"),
    ("format", _set("format", "other"), "not a ckptd plan"),
    ("start-iteration", _set("start_iteration", 5), "start_iteration 5 is not below iterations"),
    # a misspelt key took its default (no weight decay, no warmup, float32): every commit wrong, exit 0
    ("opt-key-typo", _set("optimizer.weight_decy", 0.1), "optimizer: unknown keys ['weight_decy']"),
    ("schedule-key-typo", _schedule("cosine", warmup_step=1, total_steps=4),
     "optimizer.lr_schedule: unknown keys ['warmup_step']"),
    ("param-key-typo", _set("parameters.0.dtpye", "bfloat16"), "parameters[0]: unknown keys ['dtpye']"),
    # the same in every other object of a plan: "spilt_data_on_qps" took NCCL's default QP
    # split, "portt" port 0, "direciton" both directions (flows that never bind, or bind to
    # the wrong stream), "limit" no check of DDP's layout
    ("ring-key-typo", _set("ring.spilt_data_on_qps", True), "ring: unknown keys ['spilt_data_on_qps']"),
    ("rank-key-typo", _set("ranks.1.nic", ["10.0.0.9"]), "ranks[1]: unknown keys ['nic']"),
    ("mirror-key-typo", _set("mirrors.0.direciton", "tx"), "mirrors[0]: unknown keys ['direciton']"),
    ("buckets-key-typo", _set("buckets.limit", {"first": [1]}), "buckets: unknown keys ['limit']"),
    ("bucket-key-typo", _set("buckets.first.0.parms", ["x"]), "buckets.first[0]: unknown keys ['parms']"),
    ("limits-key-typo", _set("buckets.limits", {"frist": [1]}), "buckets.limits: unknown keys ['frist']"),
    ("scheduler-key-typo", _set("optimizer.lr_scheduler", {"class": "StepLR", "args": {"step_size": 2},
                                                            "arg": {}}),
     "optimizer.lr_scheduler: unknown keys ['arg']"),
    ("allreduce-key-typo", _set("collectives", {"before": [{"count": 4, "dtype": "float32", "root": 0}]}),
     "collectives.before[0]: unknown keys ['root'] (known: op, count, dtype)"),
    # true == 1 in Python: read as version 1
    ("version-true", _set("version", True), "plan version True is not supported"),
    # a JSON number 2.20 is 2.2; "2.19.3" and "2.019" read 2.19 and a full-width "２.１９" too
    ("nccl-number", _set("ring.nccl_version", 2.2), "ring.nccl_version 2.2 is not MAJOR.MINOR as a string"),
    ("nccl-patch", _set("ring.nccl_version", "2.19.3"), "ring.nccl_version '2.19.3' is not MAJOR.MINOR"),
    ("nccl-leading-zero", _set("ring.nccl_version", "2.019"), "ring.nccl_version '2.019' is not MAJOR.MINOR"),
    ("nccl-full-width", _set("ring.nccl_version", "\uff12.\uff11\uff19"), "is not MAJOR.MINOR"),
    ("addr-not-ip", _set("ranks.1.addr", "x"), "ranks[1].addr 'x' is not an IPv4 or IPv6 address"),
    ("mirror-name-twice", _set("mirrors", [{"name": "m", "rank": 0}, {"name": "m", "rank": 1}]),
     "mirrors[1].name 'm' is given twice"),
    ("not-json", "{nope", "cannot read plan"),
    ("a-list", "[1, 2]", "must be an object"),
    ("deep", "[" * 100000 + "]" * 100000, "plan"),
]


def _prepare_plan(d, name, change):
    plan = _plan(d, change, name)
    return ["replay", "--plan", plan, "--init", d / "init.pt", *sorted((d / "mirrors").glob("*.pcap"))], str(plan)


@pytest.mark.parametrize("name,change,message", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_bad_plan(scenario, capsys, name, change, message):
    _run_case(scenario, capsys, "plan", name, message)


# -- init / checkpoints -------------------------------------------------------------------
def _init(d: Path, name: str, change) -> Path:
    p = d / f"init-{name}.pt"
    if isinstance(change, bytes):
        p.write_bytes(change)
        return p
    doc = torch.load(d / "init.pt", weights_only=True)
    change(doc)
    torch.save(doc, p)
    return p


def _first_param(doc):
    return next(iter(doc["model"]))


INIT_CASES = [
    ("missing", None, "cannot read checkpoint"),
    ("empty", b"", "cannot read checkpoint"),
    ("garbage", b"\x00garbage" * 100, "cannot read checkpoint"),
    # not ckptd's own format: read as a trainer's file, whose iteration counts steps done
    ("not-ckptd", lambda doc: doc.update(format="other"), "'iteration' must be a number of steps done"),
    ("iteration-str", lambda doc: doc.update(iteration="zero"), "iteration must be an integer"),
    ("iteration-past-end", lambda doc: doc.update(iteration=99), "holds iteration 99"),
    ("shape", lambda doc: doc["model"].update({_first_param(doc): torch.zeros(3)}), "the plan says"),
    ("param-missing", lambda doc: doc["model"].pop(_first_param(doc)), "is missing or not a tensor"),
    ("opt-state", lambda doc: doc.update(optimizer={"state": {"x": 1}}), "optimizer.state lacks"),
]


def _prepare_init(d, name, change):
    init = d / "init-missing.pt" if change is None else _init(d, name, change)
    return ["replay", "--plan", d / "plan.json", "--init", init, *sorted((d / "mirrors").glob("*.pcap"))], str(init)


@pytest.mark.parametrize("name,change,message", INIT_CASES, ids=[c[0] for c in INIT_CASES])
def test_bad_init(scenario, capsys, name, change, message):
    _run_case(scenario, capsys, "init", name, message)


def test_init_iteration_against_plan_start(scenario, capsys):
    """A plan that says where the job starts refuses an init of another iteration."""
    plan = _plan(scenario, _set("start_iteration", 0), "starts-at-0")
    init = _init(scenario, "iteration-3", lambda doc: doc.update(iteration=3))
    r = ckptd_main(capsys, "replay", "--plan", plan, "--init", init, *sorted((scenario / "mirrors").glob("*.pcap")))
    _one_line_error(r, str(init), "holds iteration 3, but the plan's start_iteration is 0")
    ok = ckptd_main(capsys, "replay", "--plan", plan, "--init", scenario / "init.pt",
                    *sorted((scenario / "mirrors").glob("*.pcap")))
    assert ok.returncode == 0, ok.stderr


# -- captures -----------------------------------------------------------------------------
def _pcap_header() -> bytes:
    return struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)


def _huge_records(n=3) -> bytes:
    """Records whose headers claim 256 MB each (the file holds a few bytes of each)."""
    return _pcap_header() + b"".join(struct.pack("<IIII", 0, 0, 1 << 28, 1 << 28) + b"\x00" * 64
                                     for _ in range(n))


def _record(data: bytes, origlen: int | None = None) -> bytes:
    return struct.pack("<IIII", 0, 0, len(data), len(data) if origlen is None else origlen) + data


def _pcapng_block(btype: int, body: bytes) -> bytes:
    return struct.pack("<II", btype, 12 + len(body)) + body + struct.pack("<I", 12 + len(body))


def _pcapng(major: int = 1, caplen: int = 64, origlen: int = 64) -> bytes:
    """A section header (version major.0), an Ethernet interface and one packet."""
    shb = _pcapng_block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, major, 0, -1))
    idb = _pcapng_block(1, struct.pack("<HHI", 1, 0, 65535))
    epb = _pcapng_block(6, struct.pack("<IIIII", 0, 0, 0, caplen, origlen) + b"\x00" * caplen)
    return shb + idb + epb


CAPTURES = {
    "missing": None,
    "empty": b"",
    "garbage": b"not a capture at all",
    "header-only-truncated": _pcap_header()[:10],
    "record-truncated": _pcap_header() + struct.pack("<IIII", 0, 0, 100, 100) + b"\x00" * 10,
    "huge-record": _huge_records(),
    "pcapng-bad-block": b"\x0a\x0d\x0d\x0a" + struct.pack("<I", 7) + b"\x4d\x3c\x2b\x1a",
    # each of these four was read as if it were sound
    "pcap-version": struct.pack("<IHHiIII", 0xA1B2C3D4, 1, 0, 0, 0, 65535, 1) + _record(b"\x00" * 64),
    "caplen-over-origlen": _pcap_header() + _record(b"\x00" * 64) + _record(b"\x00" * 64, origlen=60),
    "pcapng-version": _pcapng(major=2),
    "pcapng-caplen-over-origlen": _pcapng(caplen=64, origlen=60),
    # a big-endian magic over a little-endian header: it was "link type 0 is not one ckptd decodes"
    "pcap-magic-order": struct.pack(">I", 0xA1B2C3D4) + _pcap_header()[4:] + _record(b"\x00" * 64),
}
CAPTURE_MESSAGE = {
    "missing": "No such file", "empty": "neither pcap nor pcapng", "garbage": "neither pcap nor pcapng",
    "header-only-truncated": "header truncated", "record-truncated": "frame 1: record truncated",
    "huge-record": "frame 1: captured length 268435456 is more than the largest snaplen",
    "pcapng-bad-block": "bad block length 7",
    "pcap-version": "pcap version 1.0, not 2.x",
    "pcap-magic-order": "pcap version 512.1024, not 2.x",
    "caplen-over-origlen": "frame 2: captured length 64 is more than the length on the wire (60)",
    "pcapng-version": "block 1 (after frame 0): section version 2.0, not 1.x",
    "pcapng-caplen-over-origlen": "block 3 (frame 1): captured length 64 is more than the length on the wire (60)",
}


def _capture(d: Path, name: str) -> Path:
    p = d / f"cap-{name}.pcap"
    if CAPTURES[name] is not None:
        p.write_bytes(CAPTURES[name])
    return p


def _prepare_capture(d, name, _):
    cap = _capture(d, name)
    return ["inspect", cap], str(cap)


@pytest.mark.parametrize("name", sorted(CAPTURES))
def test_inspect_fails_on_unreadable_capture(scenario, capsys, name):
    _run_case(scenario, capsys, "capture", name, CAPTURE_MESSAGE[name])


def test_inspect_reports_every_file_and_fails_if_one_is_bad(scenario, capsys):
    good = sorted((scenario / "mirrors").glob("*.pcap"))[0]
    bad = _capture(scenario, "garbage")
    r = ckptd_main(capsys, "inspect", good, bad)
    _one_line_error(r, str(bad), "neither pcap nor pcapng")
    assert str(good) in r.stdout  # the good file's table is still printed


@pytest.mark.parametrize("fast", [False, True])
def test_replay_huge_records_are_a_capture_error(scenario, capsys, fast):
    """Records claiming 256 MB end the file with an error naming the frame; nothing
    sized from the claim is allocated (the run stays small and quick)."""
    cap = _capture(scenario, "huge-record")
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", *(["--fast"] if fast else []), cap)
    assert "Traceback" not in r.stderr
    assert "frame 1: captured length 268435456 is more than the largest snaplen" in r.stderr


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("name", ["pcap-version", "caplen-over-origlen", "pcapng-version",
                                  "pcapng-caplen-over-origlen"])
def test_replay_reads_a_broken_header_as_damage_on_either_path(scenario, capsys, name, path):
    """Both paths stop the file where the reader does, with the reader's words: the fast
    path's kernel indexed a pcap of another version, or a record of more bytes than the
    wire had, as sound."""
    cap = _capture(scenario, name)
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json",
                   *(["--reference-path"] if path == "reference" else []), _pcap0(scenario), cap)
    assert "Traceback" not in r.stderr
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {cap}: "), r.stderr
    assert CAPTURE_MESSAGE[name] in warned[0], warned[0]


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_replay_from_pipes_reads_them_whole(scenario, tmp_path, path):
    """Captures given as pipes (`<(zcat x.pcap.gz)`, FIFOs): their first bytes were read to
    tell pcap from pcapng and the file opened again, past them, so every stream read as
    "not a pcap file" and nothing was recovered. Now each pipe's replay equals the files'
    (the same committed checkpoints, bit-exact with the trainer's)."""
    import filecmp
    pcaps = sorted((scenario / "mirrors").glob("*.pcap"))
    flags = ["--reference-path"] if path == "reference" else []

    def replay(captures, out):
        # a process of its own with a deadline: a reader that opens a pipe twice waits for
        # a writer for ever
        return ckptd("replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                     "--reference", scenario / "reference", "--out", out, *flags, *captures, timeout=120)
    files = replay(pcaps, tmp_path / "files")
    fifos = []
    for p in pcaps:
        fifos.append(tmp_path / f"{p.stem}.fifo")   # the stream's name, as the file's
        os.mkfifo(fifos[-1])
    writers = [subprocess.Popen(["sh", "-c", f'exec cat "{p}" > "{f}"']) for p, f in zip(pcaps, fifos)]
    try:
        pipes = replay(fifos, tmp_path / "pipes")
    finally:
        for w in writers:
            w.kill()   # the shell; its cat goes with its pipe
            w.wait(30)
    assert files.returncode == 0 and "bit-exact" in files.stdout, files.stderr
    assert pipes.returncode == 0 and "warning" not in pipes.stderr, pipes.stderr
    def iterations(r):   # the reports, without the timings (how long a stage waited, the run took)
        return [line for line in r.stdout.splitlines() if line.startswith("iteration")]
    assert iterations(files) and iterations(pipes) == iterations(files)
    written = sorted(p.name for p in (tmp_path / "files").iterdir())
    assert written and written == sorted(p.name for p in (tmp_path / "pipes").iterdir())
    assert all(filecmp.cmp(tmp_path / "files" / n, tmp_path / "pipes" / n, shallow=False)
               for n in written if n.endswith(".pt"))


def _iterations(r):
    """A replay's iteration lines, without the timings."""
    return [line for line in r.stdout.splitlines() if line.startswith("iteration")]


def _streams(r):
    """A replay's `stream NAME:` lines' names."""
    return [line.split(":")[0][len("stream "):] for line in r.stdout.splitlines() if line.startswith("stream ")]


@pytest.mark.parametrize("path", ["reference", "fast"])
def test_replay_from_stdin_equals_the_file(scenario, tmp_path, path):
    """`-` is stdin (as tcpdump -r -): a capture redirected into it (< x.pcap) and one piped
    into it (cat x.pcap |) replay as the file does: the same iterations, the same
    checkpoints, the stream named `stdin`. It was "-: No such file or directory"."""
    import filecmp
    pcap = _pcap0(scenario)
    flags = ["--reference-path"] if path == "reference" else []

    def replay(capture, out, stdin=subprocess.DEVNULL):
        return ckptd("replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                     "--reference", scenario / "reference", "--out", out, *flags, capture, stdin=stdin)
    files = replay(pcap, tmp_path / "file")
    assert files.returncode == 0 and "bit-exact" in files.stdout, files.stderr
    with open(pcap, "rb") as f:
        redirected = replay("-", tmp_path / "redirected", stdin=f)
    cat = subprocess.Popen(["cat", str(pcap)], stdout=subprocess.PIPE)
    try:
        piped = replay("-", tmp_path / "piped", stdin=cat.stdout)
    finally:
        cat.stdout.close()
        cat.kill()
        cat.wait(30)
    expected = [line.replace(f"{pcap.stem}=", "stdin=") for line in _iterations(files)]
    written = sorted(p.name for p in (tmp_path / "file").iterdir())
    assert written
    for r, out in ((redirected, "redirected"), (piped, "piped")):
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
        assert _iterations(r) == expected and _streams(r) == ["stdin"], r.stdout
        assert written == sorted(p.name for p in (tmp_path / out).iterdir())
        assert all(filecmp.cmp(tmp_path / "file" / n, tmp_path / out / n, shallow=False)
                   for n in written if n.endswith(".pt"))


@pytest.mark.parametrize("argv, culprit, message", [
    (lambda d: ["replay", "--plan", _pcap0(d), _pcap0(d)], "mirror0.pcap",
     "cannot read plan: this is a packet capture, not a plan"),
    (lambda d: ["replay", "--plan", d / "init.pt", _pcap0(d)], "init.pt",
     "cannot read plan: this is a zip archive (a torch.save checkpoint?), not a plan"),
    (lambda d: ["replay", "--plan", d / "plan.json", "--init", d / "plan.json", _pcap0(d)], "plan.json",
     "cannot read checkpoint: this is JSON text (a plan?), not a checkpoint"),
    (lambda d: ["verify", _pcap0(d), d / "init.pt"], "mirror0.pcap",
     "cannot read checkpoint: this is a packet capture, not a checkpoint"),
    (lambda d: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", d / "plan.json"], "plan.json",
     "this is JSON text (a plan?), not a capture"),
    (lambda d: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", d / "init.pt"], "init.pt",
     "this is a zip archive (a torch.save checkpoint?), not a capture"),
], ids=["capture-as-plan", "checkpoint-as-plan", "plan-as-init", "capture-as-checkpoint", "plan-as-capture",
        "checkpoint-as-capture"])
def test_an_input_in_the_wrong_place_is_named_for_what_it_is(scenario, capsys, argv, culprit, message):
    """Swapped arguments said "'utf-8' codec can't decode byte 0xb2 in position 2" or
    "Unsupported operand 123": one line now says what the file is."""
    r = ckptd_main(capsys, *argv(scenario))
    _one_line_error(r, culprit, message)


def _pcap_of_linktype(linktype: int) -> bytes:
    """A classic pcap header of that link type and one 60-byte record."""
    import struct
    return (struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, linktype)
            + struct.pack("<IIII", 1, 0, 60, 60) + bytes(60))


@pytest.mark.parametrize("path", ["reference", "fast"])
@pytest.mark.parametrize("held, message", [
    (b"garbage, not a capture", "neither pcap nor pcapng (first bytes 67617262)"),
    (b"", "neither pcap nor pcapng (first bytes none)"),
    (_pcap_of_linktype(147), "link type 147 is not one ckptd decodes"),
], ids=["garbage", "empty", "linktype"])
def test_a_pipe_that_holds_no_capture_is_the_error_a_file_is(scenario, tmp_path, path, held, message):
    """A file that is no capture is refused up front, one line, exit 2. A pipe's first
    bytes are its reader's, so it could only be found once the run was under way, and it
    was a warning and every iteration "not recovered", exit 3 (`printf x | ckptd replay
    ... -`). Now it is the same line and exit 2: on stdin, and as a `<(...)` pipe beside a
    good capture."""
    flags = ["--reference-path"] if path == "reference" else []
    base = ["replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt", *flags]
    as_file = tmp_path / "held.pcap"
    as_file.write_bytes(held)
    _one_line_error(ckptd(*base, as_file), str(as_file), message)
    r = subprocess.run([sys.executable, "-m", "ckptd", *map(str, base), "-"], input=held, capture_output=True,
                       timeout=120)
    _one_line_error(subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode()),
                    "- (stdin)", message)  # as given, not the /dev/stdin it is read through
    rfd, wfd = os.pipe()
    os.write(wfd, held)
    os.close(wfd)
    try:
        r = ckptd(*base, _pcap0(scenario), f"/dev/fd/{rfd}", pass_fds=(rfd,))
    finally:
        os.close(rfd)
    _one_line_error(r, f"/dev/fd/{rfd}", message)
    assert "committed" in r.stdout  # the good capture was replayed


@pytest.mark.parametrize("command", ["replay", "inspect"])
def test_stdin_a_terminal_is_refused(scenario, command):
    """`-` with a terminal on stdin would wait for typed bytes: one line, exit 2, nothing read."""
    import pty
    master, slave = pty.openpty()
    try:
        args = ["--plan", scenario / "plan.json"] if command == "replay" else []
        r = ckptd(command, *args, "-", stdin=slave, timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: -: stdin is a terminal"), r.stderr


@pytest.mark.parametrize("command", ["replay", "inspect"])
def test_stdin_twice_is_refused(scenario, capsys, command):
    args = ["--plan", scenario / "plan.json"] if command == "replay" else []
    r = ckptd_main(capsys, command, *args, "-", _pcap0(scenario), "-")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: -: stdin given 2 times"), r.stderr


def _copies(d: Path, src: Path, *names) -> list[Path]:
    out = []
    for n in names:
        (d / n).parent.mkdir(parents=True, exist_ok=True)
        (d / n).write_bytes(src.read_bytes())
        out.append(d / n)
    return out


def test_stream_names_tell_the_streams_apart(scenario, tmp_path):
    """A process substitution's /dev/fd/N was named by its fd number (`stream 63:`), and two
    captures of one stem in two directories had one name between them: a /dev/fd path is
    named by its position (streamK, from 1), clashing stems take their directories."""
    pcap = _pcap0(scenario)
    m0, m1 = _copies(tmp_path, pcap, "m0/mirror.pcap", "m1/mirror.pcap")
    rd, wr = os.pipe()
    cat = subprocess.Popen(["cat", str(pcap)], stdout=wr)
    os.close(wr)
    try:
        r = ckptd("replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                  m0, f"/dev/fd/{rd}", m1, pass_fds=(rd,))
    finally:
        os.close(rd)
        cat.kill()
        cat.wait(30)
    assert r.returncode == 0, r.stderr
    assert _streams(r) == ["m0/mirror", "stream2", "m1/mirror"], r.stdout
    assert "coverage[m0/mirror=100.00% stream2=100.00% m1/mirror=100.00%]" in _iterations(r)[0], r.stdout


def test_stream_names_rules():
    from ckptd.cli import _stream_names
    from ckptd.core.streams import stream_names
    assert stream_names(["a.pcap", "-", "/dev/fd/63", "/proc/self/fd/12", "/proc/4242/fd/3"]) == \
        ["a", "stdin", "stream3", "stream4", "stream5"]
    assert stream_names(["x/m/mirror.pcap", "y/m/mirror.pcap", "mirror.pcapng"]) == \
        ["x/m/mirror", "y/m/mirror", "mirror"]
    # what no directory tells apart: the later ones get #K (their position, from 1)
    assert stream_names(["x.pcap", "./x.pcap", "stream3.pcap", "/dev/fd/9", "stdin.pcap", "-"]) == \
        ["x", "x#2", "stream3", "stream4", "stdin", "stdin#6"]
    assert _stream_names(["a.pcap", "b.pcap"], "left,right") == ["left", "right"]


@pytest.mark.parametrize("path", ["fast", "reference"])
def test_a_capture_name_that_is_not_utf8_replays(scenario, tmp_path, path):
    """A file name is bytes on Linux. The fast path's file map encoded its name strictly
    (for the message it leaves with the kernel, should the file shrink), and the report
    printed it to a stdout that is strict under a UTF-8 locale (PYTHONIOENCODING=utf-8
    here; Python relaxes it in the C locale only): a name that is not UTF-8 was a
    UnicodeEncodeError traceback. It is printed as the bytes it is, as ls does."""
    raw = b"bad\xff\xfename.pcap"
    (pcap,) = _copies(tmp_path, _pcap0(scenario), os.fsdecode(raw))
    flag = ["--reference-path"] if path == "reference" else []
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8"}
    r = subprocess.run([sys.executable, "-m", "ckptd", "replay", "--plan", str(scenario / "plan.json"),
                        "--init", str(scenario / "init.pt"), *flag, "--out", str(tmp_path / "out"), pcap],
                       cwd=REPO, env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert b"1 iterations, 1 committed" in r.stdout and b"coverage[bad\xff\xfename=100.00%]" in r.stdout, r.stdout


def test_names_override_the_stream_names(scenario, tmp_path, capsys):
    pcap = _pcap0(scenario)
    a, b = _copies(tmp_path, pcap, "a.pcap", "b.pcap")
    r = ckptd("replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
              "--names", "left,right", a, b)
    assert r.returncode == 0, r.stderr
    assert _streams(r) == ["left", "right"] and "coverage[left=100.00% right=100.00%]" in r.stdout, r.stdout
    r = ckptd_main(capsys, "inspect", "--json", "--names", "left,right", a, b)
    assert r.returncode == 0, r.stderr
    assert [fi["name"] for fi in json.loads(r.stdout)["files"]] == ["left", "right"]


@pytest.mark.parametrize("command", ["replay", "inspect"])
@pytest.mark.parametrize("names, message", [
    ("left", "--names 'left': 1 name(s) for 2 capture(s)"),
    ("left,right,more", "--names 'left,right,more': 3 name(s) for 2 capture(s)"),
    ("left,", "--names 'left,': name 2 is empty"),
    ("same,same", "--names 'same,same': 'same' is given twice"),
    ("le ft,right", "--names 'le ft,right': name 1 ('le ft') has a blank"),
])
def test_bad_names_are_refused(scenario, tmp_path, capsys, command, names, message):
    a, b = _copies(tmp_path, _pcap0(scenario), "a.pcap", "b.pcap")
    args = ["--plan", scenario / "plan.json", "--init", scenario / "init.pt"] if command == "replay" else []
    r = ckptd_main(capsys, command, *args, "--names", names, a, b)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: " + message), r.stderr


def test_inspect_from_stdin(scenario):
    """`ckptd inspect -` reads stdin as the file (the stream named stdin)."""
    pcap = _pcap0(scenario)
    with open(pcap, "rb") as f:
        r = ckptd("inspect", "--json", "-", stdin=f, timeout=60)
    assert r.returncode == 0, r.stderr
    (fi,) = json.loads(r.stdout)["files"]
    whole = ckptd("inspect", "--json", pcap, timeout=60)
    assert fi["name"] == "stdin" and fi["frames"] == json.loads(whole.stdout)["files"][0]["frames"] > 0


def test_inspect_reads_a_pipe_once_for_its_tcp_conversations(tmp_path):
    """inspect read the files a second time for the TCP conversations: a pipe's second read
    is empty (and a FIFO's waits for a writer), so stdin's TCP went unlisted. Its TCP
    frames are kept from the one read: the same conversations as the file's."""
    from parsers.pcap import write_pcap
    from tests.test_gloo import frame
    pcap = tmp_path / "tcp.pcap"
    write_pcap(pcap, [(1000 * k, frame(bytes([k]) * 100, 1 + 100 * k)) for k in range(5)])
    whole = ckptd("inspect", "--json", pcap, timeout=60)
    cat = subprocess.Popen(["cat", str(pcap)], stdout=subprocess.PIPE)
    try:
        piped = ckptd("inspect", "--json", "-", stdin=cat.stdout, timeout=60)
    finally:
        cat.stdout.close()
        cat.wait(30)
    assert whole.returncode == 0 and piped.returncode == 0, piped.stderr
    tcp = json.loads(whole.stdout)["tcp"]
    assert tcp and tcp[0]["segments"] == 5 and json.loads(piped.stdout)["tcp"] == tcp


def test_the_kernel_indexes_up_to_a_record_longer_than_the_wire():
    """The kernel's index_pcap stops before the broken record and says it is not clean
    (its callers then ask the reader for the error): it indexed both frames as sound."""
    import numpy as np
    from cython_ext import batch as kernel
    data = np.frombuffer(CAPTURES["caplen-over-origlen"], np.uint8)
    arrs = [np.empty(8, np.int64) for _ in range(5)]
    n, end, clean = kernel.index_pcap(data, 24, len(data), False, 0, *arrs)
    assert (n, end, clean) == (1, 24 + 16 + 64, False)


# -- command-line arguments ---------------------------------------------------------------
def _pcap0(d):
    return sorted((d / "mirrors").glob("*.pcap"))[0]


def _fifo(d):
    p = d / "stream.fifo"
    if not p.exists():
        os.mkfifo(p)
    return p


def _dangling(d):
    p = d / "dangling-link"
    if not p.is_symlink():
        p.symlink_to(d / "no-such-target")
    return p


def _bigger_first(doc):
    doc["parameters"][0]["shape"] = [n + 1 for n in doc["parameters"][0]["shape"]]


def _other_job(doc):
    """The plan of a job on other addresses, which does not say how many iterations ran
    (as `ckptd plan` writes it): no packet of the captures is its."""
    doc.pop("iterations", None)
    for r in doc["ranks"]:
        r["addr"] = "10.99.0." + r["addr"].rsplit(".", 1)[1]


_TWO_RANKS = ["--ranks", "2", "--addr", "10.0.0.1", "--addr", "10.0.0.2"]
ARG_CASES = [
    ("same-capture-twice", lambda d: ["replay", "--plan", d / "plan.json", _pcap0(d), _pcap0(d)], "the same capture as"),
    ("fifo-twice", lambda d: ["replay", "--plan", d / "plan.json", _fifo(d), _fifo(d)], "the same capture as"),
    ("capture-missing", lambda d: ["replay", "--plan", d / "plan.json", d / "nope.pcap"], "nope.pcap"),
    ("plan-missing", lambda d: ["replay", "--plan", d / "nope.json", _pcap0(d)], "nope.json"),
    ("resume-missing", lambda d: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", "--out", d / "o-resume",
                                  "--resume", d / "nope-ckpts", _pcap0(d)], "--resume"),
    ("reference-a-file", lambda d: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", "--reference",
                                    d / "plan.json", _pcap0(d)], "--reference"),
    ("reference-missing", lambda d: ["replay", "--plan", d / "plan.json", "--reference", d / "nope", _pcap0(d)],
     "no such directory"),
    ("capture-empty-beside-good", lambda d: ["replay", "--plan", d / "plan.json", _pcap0(d), _capture(d, "empty")],
     "cap-empty.pcap: neither pcap nor pcapng"),
    ("export-plan-of-another-model", lambda d: ["export", d / "init.pt", "--format", "torch", "--out", d / "x.torch",
                                                "--plan", _plan(d, _bigger_first, "bigger")], "the plan says"),
    ("export-over-itself", lambda d: ["export", _init(d, "copy", lambda doc: None), "--format", "torch", "--out",
                                      d / "init-copy.pt"], "is the checkpoint being exported"),  # it was replaced, exit 0
    # every format alike into an existing directory (DCP made the missing ones; the files
    # named a temporary "x.tmp" the user never gave)
    *[(f"export-{fmt}-{case}", lambda d, fmt=fmt, where=where: [
        "export", d / "init.pt", "--format", fmt, "--out", d / where / f"x.{fmt}"], f"{why} (the export is written")
      for fmt in ("torch", "safetensors", "dcp")
      for case, where, why in (("dir-missing", "no-dir", "no-dir does not exist"),
                               ("file-in-the-way", "plan.json", "plan.json is not a directory"))],
    ("out-empty", lambda d: ["replay", "--plan", d / "plan.json", "--out", "", _pcap0(d)], "--out: an empty path"),
    ("capture-a-directory", lambda d: ["replay", "--plan", d / "plan.json", d / "mirrors"], "a directory"),
    ("capture-a-device", lambda d: ["replay", "--plan", d / "plan.json", _pcap0(d), "/dev/null"],
     "/dev/null: a character device, not a capture file"),  # it was read as an empty stream: a warning, exit 0
    ("plan-of-another-job", lambda d: ["replay", "--plan", _plan(d, _other_job, "other-job"), "--init",
                                       d / "init.pt", "--out", d / "o-other", _pcap0(d)], "hold no iteration"),
    ("join-from-negative", lambda d: ["replay", "--plan", d / "plan.json", "--join-from", "-1", _pcap0(d)], "--join-from"),
    ("synth-iterations", lambda d: ["synth", "--out", d / "s", "--iterations", "1e12"], "--iterations"),
    ("synth-iterations-huge", lambda d: ["synth", "--out", d / "s", "--iterations", str(10 ** 12)], "--iterations"),
    ("synth-loss", lambda d: ["synth", "--out", d / "s", "--loss", "nan"], "--loss"),
    # a value beginning with '-' that argparse's own rule did not read as a number: it was
    # "expected one argument", not the option's check
    ("synth-norm-type-minus-inf", lambda d: ["synth", "--out", d / "s", "--max-grad-norm", "1",
                                             "--grad-norm-type", "-inf"], "--grad-norm-type: -inf is not > 0"),
    ("synth-loss-minus-exponent", lambda d: ["synth", "--out", d / "s", "--loss", "-1e-3"], "--loss: -1e-3 is not in 0..1"),
    ("synth-model", lambda d: ["synth", "--out", d / "s-model", "--model", "huge"], "not a synthetic model size"),
    ("demo-model", lambda d: ["demo", "--out", d / "d-model", "--model", "huge"], "not a synthetic model size"),
    ("synth-optim", lambda d: ["synth", "--out", d / "s-optim", "--optim", "lamb"], "--optim 'lamb'"),
    ("synth-ranks-and-nodes", lambda d: ["synth", "--out", d / "s-nodes", "--ranks", "4", "--nodes", "3"],
     "--ranks 4 with --nodes 3 x --gpus-per-node 1 (3 ranks)"),  # it made 3 ranks, exit 0
    ("synth-ranks", lambda d: ["synth", "--out", d / "s", "--ranks", "1"], "--ranks"),
    ("plan-model", lambda d: ["plan", "--model", "no_such_module:f", "--ranks", "2", "--out", d / "p.json"], "cannot import"),
    ("plan-model-attr", lambda d: ["plan", "--model", "json:no_such_fn", "--ranks", "2", "--out", d / "p.json"], "has no 'no_such_fn'"),
    ("plan-model-spec", lambda d: ["plan", "--model", "json", "--ranks", "2", "--out", d / "p.json"], "module:function"),
    ("plan-model-raises", lambda d: ["plan", "--model", "json:loads", *_TWO_RANKS, "--out", d / "p.json"],
     "--model 'json:loads' raised TypeError: loads() missing 1 required positional argument"),
    ("plan-model-not-module", lambda d: ["plan", "--model", "os:getcwd", *_TWO_RANKS, "--out", d / "p.json"],
     "returned str, not a torch.nn.Module"),
    ("plan-sample-fails", lambda d: ["plan", "--model", "test_cli:build_model", "--sample", "os:getcwd", *_TWO_RANKS,
                                     "--out", d / "p.json"], "--sample 'os:getcwd': a training step of --model"),
    ("plan-addr", lambda d: ["plan", "--model", "test_cli:build_model", "--ranks", "2", "--addr", "999.1.1.1",
                             "--addr", "10.0.0.2", "--out", d / "p.json"], "'999.1.1.1' is not an IPv4 or IPv6 address"),
    ("plan-gloo-channels", lambda d: ["plan", "--model", "test_cli:build_model", *_TWO_RANKS, "--transport", "gloo",
                                      "--channels", "4", "--out", d / "p-gloo.json"],
     "--transport gloo has no NCCL channels, protocol or version: leave out --channels"),  # a 1-channel plan, exit 0
    ("plan-betas-of-sgd", lambda d: ["plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                                     *_TWO_RANKS, "--optimizer", "nadam", "--beta1", "0.5", "--out", d / "p-nadam.json"],
     "--beta1 is for --optimizer adam or adamw, not nadam"),  # torch's default betas were written, exit 0
    ("plan-momentum-of-adamw", lambda d: ["plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                                          *_TWO_RANKS, "--momentum", "0.9", "--out", d / "p-adamw.json"],
     "--momentum is for --optimizer sgd or rmsprop, not adamw"),
    ("replay-out-a-file", lambda d: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", "--out",
                                     d / "plan.json", _pcap0(d)], "cannot create the checkpoint directory: a file is in the way"),
    ("replay-out-dangling-link", lambda d: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", "--out",
                                            _dangling(d), _pcap0(d)],
     "cannot create the checkpoint directory: a broken symbolic link is in the way"),  # it said "File exists"
    ("replay-out-proc", lambda d: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", "--out",
                                   "/proc/ckptd-out", _pcap0(d)], "/proc/ckptd-out: cannot keep checkpoints there: it lies on proc"),
    # it was the bare "[Errno 17] File exists", after --out had been made
    ("dump-gradients-a-file", lambda d: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", "--out",
                                         d / "o-dump", "--dump-gradients", d / "plan.json", _pcap0(d)],
     "plan.json: cannot create the gradient dump directory: a file is in the way"),
    ("verify-missing", lambda d: ["verify", d / "nope.pt", d / "init.pt"], "nope.pt"),
    ("verify-garbage", lambda d: ["verify", _capture(d, "garbage"), d / "init.pt"], "cannot read checkpoint"),
    ("unknown-command", lambda d: ["frobnicate"], "invalid choice"),
    ("unknown-option", lambda d: ["inspect", "--colour", _pcap0(d)], "--colour"),
    # as replay says them (inspect printed "[Errno 21] Is a directory: ...", and read a
    # device as an empty stream: "first bytes none")
    ("inspect-a-directory", lambda d: ["inspect", d / "mirrors"], "mirrors: a directory, not a capture file"),
    ("inspect-a-device", lambda d: ["inspect", _pcap0(d), "/dev/null"],
     "/dev/null: a character device, not a capture file"),
    # a FIFO given twice waited for a second writer for ever
    ("inspect-fifo-twice", lambda d: ["inspect", _fifo(d), _fifo(d)], "the same capture as"),
    ("run-config-missing", lambda d: ["run", "--config", d / "nope.yaml"], "nope.yaml"),
    ("risk-ring-huge", lambda d: ["mirror-risk", "--mirrors", "2", "--loss", "0.1", "--ring", "100000000",
                                  "--packets", "10"], "--ring N (2..65536)"),  # it ran out of memory
    ("risk-packets-nan", lambda d: ["mirror-risk", "--mirrors", "2", "--loss", "0.1", "--ring", "4",
                                    "--packets", "nan"], "--packets K"),  # it printed 'inf' iterations
    ("risk-trials", lambda d: ["mirror-risk", "--mirrors", "2", "--loss", "0.1", "--ring", "4", "--packets", "9",
                               "--simulate", "--trials", "100000000"], "--trials must be 1..1000000"),
    ("risk-seconds", lambda d: ["mirror-risk", "--mirrors", "2", "--loss", "0.1", "--ring", "4", "--packets", "9",
                                "--iteration-seconds", "-1"], "--iteration-seconds must be a number > 0"),
    ("risk-mirrors", lambda d: ["mirror-risk", "--mirrors", "two", "--loss", "0.1", "--ring", "4"], "--mirrors"),
]


def _prepare_args(d, name, argv):
    return argv(d), None


@pytest.mark.parametrize("name,argv,message", ARG_CASES, ids=[c[0] for c in ARG_CASES])
def test_bad_arguments(scenario, capsys, name, argv, message):
    _run_case(scenario, capsys, "args", name, message)


# -- daemon configs -------------------------------------------------------------------------
def _config(d: Path, name: str, text: str) -> Path:
    p = d / f"cfg-{name}.yaml"
    p.write_text(f"plan: plan.json\ninit: init.pt\nout: ckpt\n{text}")
    return p


IF = "interfaces:\n  - ifname: hdnone0\n"
CONFIG_CASES = [
    ("block-size-unit", IF + "    block_size: 4X\n", "interfaces[0].block_size"),
    ("block-size-page", IF + "    block_size: 5000\n", "interfaces[0].block_size"),
    ("block-size-list", IF + "    block_size: [1]\n", "interfaces[0].block_size"),
    ("block-nr-huge", IF + "    block_nr: 100000\n", "interfaces[0].block_nr"),
    ("ring-memory", IF + "    block_size: 64M\n    block_nr: 4096\n", "block_nr"),
    ("ring-memory-cap", "max_ring_memory: 16M\n" + IF + "    block_size: 4M\n    block_nr: 8\n", "max_ring_memory"),
    ("frame-size", IF + "    frame_size: 100\n", "interfaces[0].frame_size"),
    ("snaplen", IF + "    snaplen: 1000000000\n", "interfaces[0].snaplen"),
    ("retire", IF + "    retire_ms: -5\n", "interfaces[0].retire_ms"),
    ("fanout-mode", IF + "    fanout_mode: random\n", "interfaces[0].fanout_mode"),
    ("netns-path", IF + "    netns: ../../etc\n", "interfaces[0].netns"),
    ("netns-slash", IF + "    netns: /run/netns/x\n", "interfaces[0].netns"),
    ("ifname-long", "interfaces:\n  - ifname: averyveryverylongname\n", "interfaces[0].ifname"),
    ("ifname-slash", "interfaces:\n  - ifname: eth0/1\n", "interfaces[0].ifname"),
    ("ifname-int", "interfaces:\n  - ifname: 5\n", "interfaces[0].ifname"),
    ("same-interface", IF + "  - ifname: hdnone0\n", "again"),
    # checked once the file was read: named by the file too (they were not)
    ("listen-not-loopback", IF + "listen: '0.0.0.0:0'\n", "listen 0.0.0.0:0 is not a loopback address"),
    ("user-missing", IF + "user: ckptd-nosuchuser\n", "user: no user named 'ckptd-nosuchuser' on this host"),
    ("persist-url-under-a-file", IF + "persist_url: 'file:///proc/version/x'\n",
     "'persist_url': /proc/version/x: cannot keep checkpoints there: it lies on proc"),
    # an alias label is its device: a second stream of the same frames, each counted twice
    ("ifname-alias", IF + "  - {ifname: 'hdnone0:x', name: b}\n",
     "interfaces[1].ifname' 'hdnone0:x' is an address alias label, not a device: it captures 'hdnone0'"),
    ("erspan-session-range", IF + "    erspan_session: 1024\n", "interfaces[0].erspan_session"),
    ("same-erspan-session", IF + "    erspan_session: 5\n  - {ifname: hdnone0, name: b, erspan_session: 5}\n",
     "(erspan_session 5) again"),
    ("session-and-everything", IF + "    erspan_session: 5\n  - {ifname: hdnone0, name: b}\n", "again"),
    ("sessions-in-one-fanout", IF + "    erspan_session: 5\n    fanout_group: 3\n"
     "  - {ifname: hdnone0, name: b, erspan_session: 9, fanout_group: 3}\n", "share fanout_group 3"),
    ("unknown-if-key", IF + "    colour: red\n", "unknown keys"),
    ("no-interfaces", "interfaces: []\n", "interfaces"),
    ("listen-port", IF + "listen: 127.0.0.1:99999\n", "listen"),
    ("listen-v6-bare", IF + "listen: '::1:9187'\n", "brackets"),
    ("listen-v6-bad", IF + "listen: '[::zz]:0'\n", "not an IPv6 address"),
    ("listen-garbage", IF + "listen: 'a b:1'\n", "listen"),
    ("log-level", IF + "log_level: loud\n", "log_level"),
    ("fast-str", IF + "fast: 'yes'\n", "'fast' must be true or false"),
    ("join-from", IF + "join_from: soon\n", "join_from"),
    # replay --join-from refused it; the daemon's config passed --check (helper 78)
    ("join-from-past-the-job", IF + "join_from: 5\n", "plan.json has 1 iterations (0..0)"),
    ("keep-last", IF + "keep_last: 0\n", "keep_last"),
    ("keep-every", IF + "keep_every: x\n", "keep_every"),
    ("user", IF + "user: 'root;rm'\n", "user"),
    ("group-alone", IF + "group: nogroup\n", "group"),
    ("unknown-key", IF + "colour: red\n", "unknown keys"),
    ("plan-int", IF.replace("interfaces", "interfaces") + "plan: 5\n", "plan"),
    ("yaml-syntax", "interfaces: [\n  {ifname: x\n", "cannot read config"),
    ("nul-in-path", IF + "dump_gradients: \"a\\0b\"\n", "'dump_gradients' holds a NUL byte"),
    ("listen-superscript", IF + "listen: '127.0.0.1:\u00b3'\n", "listen"),
    ("listen-arabic-digits", IF + "listen: '127.0.0.1:\u0663'\n", "listen"),
    ("if-key-types", IF + "    1: x\n    colour: red\n", "unknown keys ['1', 'colour']"),
    ("token-not-utf8", IF + "token_file: tok-latin1\n", "printable ASCII"),
    ("not-mapping", None, "must be a mapping"),
    # session 28: each of these was accepted, or ended in a bare kernel error
    ("fanout-two-interfaces", IF + "    fanout_group: 3\n  - {ifname: hdnone1, name: b, fanout_group: 3}\n",
     "interfaces[1] (hdnone1) and interfaces[0] (hdnone0) share fanout_group 3"),
    ("fanout-two-modes", IF + "    fanout_group: 3\n  - {ifname: hdnone0, name: b, fanout_group: 3, fanout_mode: lb}\n",
     "share fanout_group 3 with fanout_mode lb and hash: a group has one mode"),
    ("resume-missing", IF + "resume: nowhere/ckpts\n", "'resume' "),
    ("yaml-octal", IF + "keep_last: 010\n", "010 is read by YAML as 8 (octal, hex or base 60)"),
    ("yaml-base-60", IF + "agree_window_ms: 1:30\n", "1:30 is read by YAML as 90"),
    ("persist-url-http", IF + "persist_url: 'https://example.invalid/ckpts'\n",
     "fsspec reads https:// but never writes there"),
    ("persist-url-zip", IF + "persist_url: 'zip://x'\n", "fsspec reads zip:// but never writes there"),
]


def _prepare_config(d, name, text):
    if text is None:
        cfg = d / "cfg-list.yaml"
        cfg.write_text("- 1\n- 2\n")
    elif name == "plan-int":
        cfg = d / "cfg-plan-int.yaml"
        cfg.write_text("plan: 5\ninit: init.pt\nout: ckpt\n" + IF)
    else:
        cfg = _config(d, name, text)
    if name == "token-not-utf8":
        (d / "tok-latin1").write_bytes(b"secret-token-\xe9\xe9\xe9-0123456789\n")
    return ["run", "--config", cfg], str(cfg)


@pytest.mark.parametrize("name,text,message", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_daemon_config(scenario, capsys, name, text, message):
    _run_case(scenario, capsys, "config", name, message)


def test_null_takes_the_default_and_an_upper_case_toml_is_toml(tmp_path):
    """capture_workers, busy_poll and huge_pages left empty were refused ("must be true or
    false, not None") where every other key takes its default; ckptd.TOML was read as YAML
    ("the config must be a mapping")."""
    from ckptd.live.daemon import load_config
    cfg = load_config(_config(tmp_path, "nulls", IF + "capture_workers:\nbusy_poll: ~\nhuge_pages:\n"))
    assert (cfg.capture_workers, cfg.busy_poll, cfg.huge_pages) == (False, False, "auto")
    toml = tmp_path / "ckptd.TOML"
    toml.write_text('plan = "plan.json"\ninit = "init.pt"\nout = "ckpt"\nkeep_last = 3\n'
                    '[[interfaces]]\nifname = "hdnone0"\n')
    cfg = load_config(toml)
    assert cfg.keep_last == 3 and [i.ifname for i in cfg.interfaces] == ["hdnone0"]


TABLES = {"plan": (PLAN_CASES, _prepare_plan), "init": (INIT_CASES, _prepare_init),
          "capture": ([(n, n, None) for n in sorted(CAPTURES)], _prepare_capture),
          "args": (ARG_CASES, _prepare_args), "config": (CONFIG_CASES, _prepare_config)}


def _case(table: str, name: str):
    cases, prepare = TABLES[table]
    _, arg, message = next(c for c in cases if c[0] == name)
    return prepare, arg, message


def _run_case(d, capsys, table, name, message):
    prepare, arg, _ = _case(table, name)
    argv, culprit = prepare(d, name, arg)
    _one_line_error(ckptd_main(capsys, *argv), culprit, message)


# the headline cases of issue 13, through a real `python -m ckptd`
THROUGH_PYTHON_M = [("plan", "no-shape"), ("plan", "iterations-float"), ("plan", "huge-shape"),
                    ("init", "garbage"), ("config", "block-size-unit"), ("config", "block-nr-huge"),
                    ("config", "listen-v6-bad"), ("args", "fifo-twice"), ("args", "synth-iterations-huge"),
                    ("capture", "huge-record"), ("capture", "missing")]


@pytest.mark.parametrize("table,name", THROUGH_PYTHON_M, ids=[f"{t}-{n}" for t, n in THROUGH_PYTHON_M])
def test_through_python_dash_m(scenario, table, name):
    prepare, arg, message = _case(table, name)
    if table == "capture":
        message = CAPTURE_MESSAGE[name]
    argv, culprit = prepare(scenario, name, arg)
    _one_line_error(ckptd(*argv), culprit, message)


@pytest.mark.parametrize("listen,message", [("[::1", "--listen"), ("localhost:x", "--listen"),
                                            ("1.2.3.4:70000", "--listen")])
def test_bad_listen_argument(scenario, capsys, listen, message):
    r = ckptd_main(capsys, "run", "--config", _config(scenario, "ok", IF), "--listen", listen)
    _one_line_error(r, None, message)


def test_daemon_refuses_bad_init_and_plan_before_capturing(scenario, capsys):
    bad_init = _init(scenario, "garbage", b"\x00garbage" * 100)
    cfg = scenario / "cfg-bad-init.yaml"
    cfg.write_text(f"plan: plan.json\ninit: {bad_init.name}\nout: ckpt\n{IF}")
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg), str(bad_init), "cannot read checkpoint")
    plan = _plan(scenario, _set("optimizer.lr", -1), "daemon-lr")
    cfg.write_text(f"plan: {plan.name}\ninit: init.pt\nout: ckpt\n{IF}")
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg), str(plan), "optimizer.lr")


def test_closed_stdout_is_not_a_traceback(scenario):
    """`ckptd inspect x | head -1`: the reader goes away; ckptd ends quietly."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "ckptd", "inspect", *sorted((scenario / "mirrors").glob("*.pcap"))],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert p.returncode == 0


def _one_line_error(r: subprocess.CompletedProcess, culprit: str | None = None, message: str = ""):
    lines = r.stderr.splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert message in lines[0], lines[0]
    if culprit is not None:
        assert culprit in lines[0], lines[0]


def test_an_interface_that_is_not_there_is_named_with_the_config(scenario, capsys):
    """`error: interfaces[0]: capture on hdnone0: no such interface` named the key but not
    the config file it was in (helper 71)."""
    cfg = _config(scenario, "no-if", IF)
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg, "--check"), f"{cfg}: interfaces[0]: capture on hdnone0",
                    "no such interface")


def test_an_interface_that_is_not_there_is_named_with_the_config_with_capture_workers(scenario, capsys):
    """With capture_workers the worker's message came alone: `error: capture on hdnone0:
    no such interface` (helper 78)."""
    cfg = _config(scenario, "no-if-workers", IF + "capture_workers: true\n")
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg, "--check"), f"{cfg}: interfaces[0]: capture on hdnone0",
                    "no such interface")


def test_init_entries_the_plan_does_not_have_are_warned_about(scenario, tmp_path, capsys):
    """An init whose model holds an entry the plan has no parameter, tied name or buffer
    for: the entry was dropped from every checkpoint without a word (helper 78); `export`
    already warned of the same in a checkpoint."""
    init = _init(scenario, "extra-entry", lambda doc: doc["model"].update(extra=torch.zeros(3)))
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", init, "--out", tmp_path / "ck",
                   *sorted((scenario / "mirrors").glob("*.pcap")))
    assert r.returncode == 0, r.stderr
    warned = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: ")]
    assert warned == [f"warning: {init}: model.extra is in the checkpoint but not in the plan {scenario / 'plan.json'} "
                      "(no parameter, tied name or buffer of it): no checkpoint will carry it"], r.stderr


def test_plan_refuses_a_fused_implementation_torch_does_not_have(tmp_path, capsys, monkeypatch):
    """`ckptd plan --optimizer asgd --implementation fused` wrote a plan of foreach=False,
    the request dropped without a word (helper 78); SGD has a fused step and keeps it."""
    (tmp_path / "onelayer.py").write_text("import torch\ndef build():\n    return torch.nn.Linear(4, 2)\n"
                                          "def leaves():\n    raise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path)
    common = ["plan", "--model", "onelayer:build", "--transport", "gloo", "--ranks", "2", "--addr", "10.0.0.1",
              "--addr", "10.0.0.2", "--implementation", "fused"]
    _one_line_error(ckptd_main(capsys, *common, "--optimizer", "asgd", "--out", tmp_path / "a.json"),
                    None, "--implementation fused: torch's ASGD has no fused step")
    assert ckptd_main(capsys, *common, "--optimizer", "sgd", "--out", tmp_path / "s.json").returncode == 0
    assert json.loads((tmp_path / "s.json").read_text())["optimizer"]["groups"][0]["fused"] is True
    # a --model that calls sys.exit: exit 7 without a word before
    common[2] = "onelayer:leaves"
    _one_line_error(ckptd_main(capsys, *common, "--out", tmp_path / "x.json"), None,
                    "--model 'onelayer:leaves' raised SystemExit: 7")


def test_a_missing_plan_or_init_is_named_by_its_key(scenario, tmp_path, capsys):
    """`init: nope.pt` said `nope.pt: cannot read checkpoint: No such file or directory`,
    naming neither the config nor the key (helper 71)."""
    for key in ("plan", "init"):
        p = scenario / f"cfg-missing-{key}.yaml"
        p.write_text((_config(scenario, key, IF).read_text()).replace(f"{key}: ", f"{key}: nope-", 1))
        r = ckptd_main(capsys, "run", "--config", p, "--check")
        _one_line_error(r, str(p), f"'{key}' ")
        assert "no such file" in r.stderr


def test_good_values_the_checks_accept(scenario):
    """The other side of the table: sizes with units, an IPv6 status address, a shared
    fanout group, names as `ip` takes them."""
    from ckptd.live.daemon import load_config
    cfg = load_config(_config(scenario, "good", "listen: '[::1]:0'\nkeep_last: 3\nkeep_every: 100\n"
                              "interfaces:\n  - {ifname: ens1f0.100, netns: ck-lab_1, block_size: 4M, "
                              "frame_size: 16K, fanout_group: 7}\n"
                              "  - {name: second, ifname: ens1f0.100, netns: ck-lab_1, fanout_group: 7}\n"))
    assert cfg.interfaces[0].block_size == 4 << 20 and cfg.interfaces[0].frame_size == 16 << 10
    assert cfg.listen == "[::1]:0" and cfg.keep_last == 3 and cfg.keep_every == 100
    assert [i.netns for i in cfg.interfaces] == ["ck-lab_1", "ck-lab_1"]


def test_null_takes_the_default(scenario):
    """`key:` left empty (YAML null) is the key's default, never a silent off switch."""
    from ckptd.live.daemon import DaemonConfig, load_config
    keys = ["read_timeout_s", "max_connections", "drop_capabilities", "memory_tier", "keep_last",
            "persist_every", "persist_interval_s", "http_workers", "agree_window_ms", "max_ring_memory"]
    cfg = load_config(_config(scenario, "nulls", "".join(f"{k}:\n" for k in keys) + IF + "    block_nr: null\n"))
    defaults = DaemonConfig(plan="", init="", out="", interfaces=[])
    assert [getattr(cfg, k) for k in keys if k != "drop_capabilities"] == \
        [getattr(defaults, k) for k in keys if k != "drop_capabilities"]
    assert cfg.drop_capabilities is True and cfg.interfaces[0].block_nr == 64  # a config file's defaults


def test_plan_command_writes_where_the_job_starts(tmp_path, capsys):
    from ckptd.core.plan import load_plan
    out = tmp_path / "plan.json"
    r = ckptd_main(capsys, "plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                   "--ranks", "2", "--addr", "10.0.0.1", "--addr", "10.0.0.2", "--bucket-cap-mb", "0.02",
                   "--start-iteration", "4", "--out", out)
    assert r.returncode == 0, r.stderr
    assert load_plan(out).start_iteration == 4
    r = ckptd_main(capsys, "plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                   "--ranks", "2", "--addr", "10.0.0.1", "--addr", "10.0.0.2", "--lr", "-1",
                   "--out", tmp_path / "bad.json")
    _one_line_error(r, None, "argument --lr: -1 is not in 0..1e+30")  # by its option (it named optimizer.lr)
    assert not (tmp_path / "bad.json").exists()


@pytest.mark.parametrize("cmd", ["synth", "demo"])
def test_an_unknown_synthetic_model_makes_no_directory(tmp_path, capsys, cmd):
    r = ckptd_main(capsys, cmd, "--out", tmp_path / "out", "--model", "huge")
    _one_line_error(r, None, "--model 'huge' is not a synthetic model size (tiny, small, default")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cmd", ["synth", "demo"])
@pytest.mark.parametrize("under", [False, True])
def test_out_a_file_is_refused_naming_the_option(tmp_path, capsys, cmd, under):
    """It was the bare "[Errno 20] Not a directory: '.../x.txt/mirrors'" (or "File exists")."""
    f = tmp_path / "x.txt"
    f.write_text("mine")
    out = f / "sub" if under else f
    r = ckptd_main(capsys, cmd, "--out", out, "--iterations", "1")
    _one_line_error(r, None, f"--out {out}: a file is in the way{f' ({f})' if under else ''}; give a directory")
    assert f.read_text() == "mine"


@pytest.mark.parametrize("arg", ["\u00b2", "\u0663", "9" * 5000, "-1", "1.0"])
def test_checkpoint_route_refuses_what_is_not_an_iteration_number(arg):
    """/checkpoint/<iteration>: ASCII digits only (int() takes other scripts' digits and
    fails on '²' or 5000 of them); anything else is a 404, not a 500."""
    from ckptd.live.memory_tier import MemoryTier
    from ckptd.live.status import checkpoint_routes
    one = checkpoint_routes(MemoryTier(), ["w"], lambda lr: None, None)["/checkpoint/"]
    r = one(arg, {})
    assert r.status == 404 and b"not an iteration number" in bytes(r.body), (r.status, arg)


def test_a_fifo_as_checkpoint_is_refused_not_waited_on(tmp_path):
    from ckptd.core.checkpoint import CheckpointError, load_checkpoint
    fifo = tmp_path / "init.pt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file or directory"):
        load_checkpoint(fifo)


def test_a_bad_pickle_is_one_error_without_torchs_warnings(tmp_path, recwarn):
    from ckptd.core.checkpoint import CheckpointError, load_checkpoint
    bad = tmp_path / "proto.pt"
    bad.write_bytes(b"\x80\xf4" + b"\x00" * 64)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(bad)
    assert not [w for w in recwarn.list if "torch" in str(w.filename)], [str(w.message) for w in recwarn.list]


def test_an_unreadable_file_in_the_resume_directory_is_waited_past(scenario, tmp_path, caplog):
    """A trainer's checkpoint half written when the shadow looks for it: not there yet, one
    warning, and the shadow goes on waiting (a daemon must not die of it)."""
    from ckptd.core.checkpoint import checkpoint_name, load_checkpoint
    from ckptd.core.plan import load_plan
    from ckptd.pipeline import Pipeline, ReplayOptions
    resume = tmp_path / "resume"
    resume.mkdir()
    (resume / checkpoint_name(2)).write_bytes(b"PK\x03\x04truncated-zip")
    pipe = Pipeline(load_plan(scenario / "plan.json"), load_checkpoint(scenario / "init.pt"), 1,
                    ReplayOptions(resume=str(resume)))
    with caplog.at_level("WARNING", logger="ckptd"):
        assert pipe._resume_state(2) is None and pipe._resume_state(2) is None
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: ")]
    assert len(warned) == 1 and checkpoint_name(2) in warned[0], warned


EMPTY_PATHS = [  # before: an empty --plan/--resume was taken as none given (exit 0), the others read '.'
    ("export-plan", lambda d: ["export", d / "init.pt", "--format", "torch", "--out", d / "x-empty.pt", "--plan", ""],
     "--plan"),
    ("verify-plan", lambda d: ["verify", d / "init.pt", d / "init.pt", "--plan", ""], "--plan"),
    ("replay-resume", lambda d: ["replay", "--plan", d / "plan.json", "--resume", "", _pcap0(d)], "--resume"),
    ("replay-capture", lambda d: ["replay", "--plan", d / "plan.json", _pcap0(d), ""], "pcap"),
    ("inspect", lambda d: ["inspect", ""], "pcap"),
    ("verify-a", lambda d: ["verify", "", d / "init.pt"], "a"),
    ("export-checkpoint", lambda d: ["export", "", "--format", "torch", "--out", d / "x-empty.pt"], "checkpoint"),
    ("run-config", lambda d: ["run", "--config", ""], "--config"),
    ("plan-nic-addrs", lambda d: ["plan", "--model", "x:y", "--nccl-log", d / "plan.json", "--nic-addrs", "",
                                  "--out", d / "p-empty.json"], "--nic-addrs"),
    ("risk-plan", lambda d: ["mirror-risk", "--mirrors", "2", "--loss", "0.1", "--plan", ""], "--plan"),
]


@pytest.mark.parametrize("name,argv,option", EMPTY_PATHS, ids=[c[0] for c in EMPTY_PATHS])
def test_an_empty_path_argument_is_refused(scenario, capsys, name, argv, option):
    r = ckptd_main(capsys, *argv(scenario))
    _one_line_error(r, None, f"argument {option}: an empty path")
    assert not (scenario / "x-empty.pt").exists()


def test_dump_gradients_in_the_way_leaves_no_checkpoint_directory(scenario, capsys):
    """--dump-gradients that cannot be made is refused before --out is made."""
    out = scenario / "o-dump-first"
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                   "--out", out, "--dump-gradients", scenario / "init.pt", _pcap0(scenario))
    _one_line_error(r, str(scenario / "init.pt"), "cannot create the gradient dump directory")
    assert not out.exists()


def test_dump_gradients_on_a_full_disk_is_one_line_and_leaves_whole_files(scenario, capsys, tmp_path):
    import numpy as np
    mnt = tmp_path / "full"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                       "--dump-gradients", mnt / "g", _pcap0(scenario))
        _one_line_error(r, str(mnt / "g"), "No space left on device")
        left = sorted((mnt / "g").iterdir())
        assert left and all(p.suffix == ".npy" for p in left), left  # no temporary, no partial file
        for p in left:
            np.load(p)  # each one whole
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_plan_from_a_pipe_is_read_and_one_nobody_writes_into_is_an_error(scenario, tmp_path, monkeypatch):
    """A pipe as the plan (`--plan <(...)`, a FIFO) is read once something is written into
    it; a FIFO nobody writes into is one error after the wait, not a hang; a device that
    never ends is too large, not a full memory."""
    import threading
    from ckptd.core import plan as plan_mod
    text = (scenario / "plan.json").read_bytes()
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)

    def write_later():
        time.sleep(0.3)   # the reader is already waiting for its first byte
        with open(fifo, "wb") as f:
            f.write(text)
    writer = threading.Thread(target=write_later)
    writer.start()
    try:
        got = plan_mod.load_plan(fifo, check_optimizer=False)
        assert got.to_json() == plan_mod.load_plan(scenario / "plan.json", check_optimizer=False).to_json()
    finally:
        writer.join(10)
        if writer.is_alive():   # the plan was never opened: let the writer's open return
            open(fifo, "rb").close()
            writer.join()
    from ckptd.core import readfile
    monkeypatch.setattr(readfile, "PIPE_WAIT_S", 0.2)
    t = time.monotonic()
    with pytest.raises(plan_mod.PlanError, match="^[^:]*plan.fifo: a pipe nothing was written into in 0.2 s"):
        plan_mod.load_plan(fifo)
    assert time.monotonic() - t < 5
    monkeypatch.setattr(plan_mod, "MAX_PLAN_BYTES", 1 << 20)
    with pytest.raises(plan_mod.PlanError, match="^/dev/zero: more than 1048576 bytes is too large for a plan"):
        plan_mod.load_plan("/dev/zero")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate((1 << 20) + 1)   # sparse: refused by its size, not read
    with pytest.raises(plan_mod.PlanError, match="big.json: 1048577 bytes is too large for a plan"):
        plan_mod.load_plan(big)


def test_a_config_or_token_fifo_nobody_writes_into_is_an_error_not_a_hang(scenario, tmp_path, capsys, monkeypatch):
    """`run --config FIFO` (and a FIFO as token_file) read it with read_text(): with no
    writer the daemon hung for ever before a line of log; /dev/zero filled the memory."""
    from ckptd.core import readfile
    monkeypatch.setattr(readfile, "PIPE_WAIT_S", 0.2)
    fifo = tmp_path / "cfg.fifo"
    os.mkfifo(fifo)
    t = time.monotonic()
    r = ckptd_main(capsys, "run", "--config", fifo)
    _one_line_error(r, str(fifo), "cannot read config: a pipe nothing was written into in 0.2 s")
    assert time.monotonic() - t < 10
    tok = tmp_path / "token.fifo"
    os.mkfifo(tok)
    cfg = _config(scenario, "token-fifo", IF + f"token_file: {tok}\n")
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg), f"token_file: cannot read {tok}",
                    "a pipe nothing was written into")
    _one_line_error(ckptd_main(capsys, "run", "--config", "/dev/zero"), "/dev/zero", "too large for a config")


def test_a_token_file_over_its_limit_is_refused_not_cut(scenario, tmp_path, capsys):
    """A token file of more than 64 KiB was read up to the limit and the rest dropped: the
    daemon started with a token no client holds (every request 401), or one that a
    shorter prefix of the real secret matches. It is refused by its size; one of the
    largest size accepted still loads whole."""
    from ckptd.live.daemon import MAX_TOKEN_BYTES, read_token
    big = tmp_path / "tok-big"
    big.write_bytes(b"t" * (MAX_TOKEN_BYTES + 10) + b"\n")
    cfg = _config(scenario, "token-big", IF + f"token_file: {big}\n")
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg), f"token_file: cannot read {big}",
                    f"{MAX_TOKEN_BYTES + 11} bytes is too large for a token file (at most {MAX_TOKEN_BYTES})")
    whole = tmp_path / "tok-whole"
    whole.write_bytes(b"t" * MAX_TOKEN_BYTES)
    assert read_token(str(whole), "token_file") == "t" * MAX_TOKEN_BYTES


def test_a_reference_directory_without_the_iterations_says_nothing_was_compared(scenario, tmp_path, capsys):
    """--reference of a directory that holds none of the committed iterations compared
    nothing, without a word: exit 0 as a bit-exact run (a wrong directory read as checked)."""
    empty = tmp_path / "ref-empty"
    empty.mkdir()
    argv = ["replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt", _pcap0(scenario)]
    r = ckptd_main(capsys, *argv[:1], "--reference", empty, *argv[1:])
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert f"warning: --reference {empty}: no checkpoint there is of a committed iteration (0)" in r.stderr
    r = ckptd_main(capsys, *argv[:1], "--reference", scenario / "reference", *argv[1:])
    assert r.returncode == 0 and "bit-exact" in r.stdout and "--reference" not in r.stderr, r.stderr


def test_an_init_of_a_later_iteration_than_the_captures_is_refused(tmp_path, capsys):
    """The captures' rounds are numbered from --init's iteration + 1: a trainer's checkpoint
    of iteration 0 as the init of captures from the job's start committed iterations 1..3
    of a 3-iteration job (each stepped from the wrong state), exit 0. The rounds past the
    plan's iterations show it."""
    d = tmp_path / "s"
    synth(d, iterations=3, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16)
    argv = ["replay", "--plan", d / "plan.json", "--out", tmp_path / "out", *sorted((d / "mirrors").glob("*.pcap"))]
    r = ckptd_main(capsys, *argv, "--init", d / "reference" / "iter_000000.pt")
    _one_line_error(r, str(d / "reference" / "iter_000000.pt"),
                    "the captures hold iterations up to 3 counted from --init")
    assert "past the 3 of the plan" in r.stderr
    # what it committed is not left as committed state (helper review, session 28): set aside
    assert "the 3 written are set aside in" in r.stderr
    # the summary above the error does not call them committed alone (gloo probe, session 37)
    assert "3 committed but suspect (see the error)" in r.stdout, r.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        f"iter_{i:06d}.pt.suspect" for i in (1, 2, 3)]
    # a join from an iteration the capture did not begin at: named as the cause, not the init
    joined = ["replay", "--plan", d / "plan.json", "--out", tmp_path / "out-join", "--join-from", "1",
              "--init", d / "reference" / "iter_000000.pt", *sorted((d / "mirrors").glob("*.pcap"))]
    r = ckptd_main(capsys, *joined)
    _one_line_error(r, None, "counted from --join-from 1 (iteration 1), past the 3 of the plan")
    assert "the join is not where the capture began" in r.stderr
    ok = ckptd_main(capsys, *argv, "--init", d / "init.pt")
    assert ok.returncode == 0, ok.stderr


def _plan_of_version(d: Path, version: str) -> Path:
    doc = json.loads((d / "plan.json").read_text())
    doc["ring"]["nccl_version"] = version
    out = d / f"plan-{version}.json"
    out.write_text(json.dumps(doc))
    return out


def test_a_plan_of_another_nccl_version_is_named_as_the_suspect(tmp_path, capsys):
    """A plan whose ring.nccl_version is not the job's: its messages have other lengths,
    so no flow fits the schedule. The replay blamed the init ("the init is not the state
    where the capture began") where the misfits made extra rounds, and said nothing where
    they did not, with the one fact that tells it (misfits) in counters only."""
    d = tmp_path / "ll"
    synth(d, iterations=3, ranks=4, channels=2, mirrors=2, protocol="ll", nccl_version="2.18", model="small")
    mirrors = sorted((d / "mirrors").glob("*.pcap"))
    r = ckptd_main(capsys, "replay", "--plan", _plan_of_version(d, "2.21"), "--init", d / "init.pt", *mirrors)
    _one_line_error(r, "plan-2.21.json", "matched no channel")
    assert "its ring (ring.nccl_version 2.21, ring.protocol ll, 2 channel(s)) may not be the job's" in r.stderr
    d = tmp_path / "simple"
    synth(d, iterations=2, ranks=4, channels=2, mirrors=2, nccl_version="2.28")
    mirrors = sorted((d / "mirrors").glob("*.pcap"))
    r = ckptd_main(capsys, "replay", "--plan", _plan_of_version(d, "2.19"), "--init", d / "init.pt", *mirrors)
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "iteration(s) not recovered: " in r.stderr and "ring.nccl_version 2.19" in r.stderr, r.stderr
    # the job's own plan: no such word
    r = ckptd_main(capsys, "replay", "--plan", d / "plan.json", "--init", d / "init.pt", *mirrors)
    assert r.returncode == 0 and "nccl_version" not in r.stderr, r.stderr
    # nor where one stream began mid-job (its first frames misfit; most packets fit): the
    # first version blamed the ring there (helper 73)
    from parsers.capfile import open_capture
    from parsers.pcap import write_pcap
    late = tmp_path / "late"
    synth(late, iterations=2, ranks=4, channels=2, mirrors=2)
    mirrors = sorted((late / "mirrors").glob("*.pcap"))
    frames = list(open_capture(mirrors[1]))
    write_pcap(str(late / "late.pcap"), frames[len(frames) * 15 // 28:])
    r = ckptd_main(capsys, "replay", "--plan", late / "plan.json", "--init", late / "init.pt", mirrors[0],
                   late / "late.pcap")
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "broke the schedule" not in r.stderr and "nccl_version" not in r.stderr, r.stderr


def test_a_plan_of_another_ring_order_names_the_off_ring_links(tmp_path, capsys):
    """A plan whose ring.rings (or ranks[].addr) is not the job's: links 0->1 and 1->2
    are no neighbours in [0, 2, 1, 3], so their data was only counted as unrelated while
    3->0 still bound, and the replay ended in exit 3 with no line naming the cause
    (helper 73). Both paths now name the links."""
    d = tmp_path / "s"
    synth(d, iterations=2, ranks=4, channels=2, mirrors=2)
    doc = json.loads((d / "plan.json").read_text())
    doc["ring"]["rings"] = [[0, 2, 1, 3]] * 2
    (d / "order.json").write_text(json.dumps(doc))
    mirrors = sorted((d / "mirrors").glob("*.pcap"))
    for path in ([], ["--reference-path"]):
        r = ckptd_main(capsys, "replay", *path, "--plan", d / "order.json", "--init", d / "init.pt", *mirrors)
        assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
        assert "off-ring data: RDMA writes between ports of the job that are neighbours in no channel of the plan's " \
               "ring (rank 0 -> 1, rank 1 -> 2)" in r.stdout, r.stdout
    r = ckptd_main(capsys, "replay", "--plan", d / "plan.json", "--init", d / "init.pt", *mirrors)
    assert r.returncode == 0 and "off-ring" not in r.stdout and "unknown address" not in r.stdout


def test_a_join_after_the_captures_last_iteration_is_no_success(tmp_path, capsys):
    """--join where one stream began so late that every flow was first seen whole only
    after the job's last iteration: "0 iterations, 0 committed", exit 0 (helper 73)."""
    from parsers.capfile import open_capture
    from parsers.pcap import write_pcap
    d = tmp_path / "s"
    synth(d, iterations=2, ranks=4, channels=2, mirrors=2)
    mirrors = sorted((d / "mirrors").glob("*.pcap"))
    frames = list(open_capture(mirrors[1]))
    write_pcap(str(d / "late.pcap"), frames[len(frames) * 15 // 28:])
    r = ckptd_main(capsys, "replay", "--join", "--plan", d / "plan.json", "--init", d / "init.pt", mirrors[0],
                   d / "late.pcap")
    assert "0 iterations, 0 committed" in r.stdout, r.stdout
    assert r.returncode == 3 and "after the last iteration the captures hold: nothing was replayed" in r.stderr


def test_a_rank_address_the_job_does_not_use_is_named(tmp_path, capsys):
    """ranks[3].addr wrong: link 3 -> 0's data was only counted as unrelated, with no word
    that a whole link of the job fitted no rank of the plan (helper 73). Named where
    iterations were lost (mirror 0 alone, which needs that link); with mirror 1 too every
    iteration commits, and such traffic alone (a job's p2p or storage) is no suspect."""
    d = tmp_path / "s"
    synth(d, iterations=2, ranks=4, channels=2, mirrors=2)
    doc = json.loads((d / "plan.json").read_text())
    job = doc["ranks"][3]["addr"]
    doc["ranks"][3]["addr"] = "10.77.0.9"
    (d / "addr.json").write_text(json.dumps(doc))
    mirrors = sorted((d / "mirrors").glob("*.pcap"))
    r = ckptd_main(capsys, "replay", "--plan", d / "addr.json", "--init", d / "init.pt", *mirrors)
    assert r.returncode == 0 and "unknown address" not in r.stdout, r.stdout
    for path in ([], ["--reference-path"]):
        r = ckptd_main(capsys, "replay", *path, "--plan", d / "addr.json", "--init", d / "init.pt", mirrors[0])
        assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
        assert (f"unknown address: RDMA data between the job's ports and addresses the plan does not list: {job} "
                "(with rank(s) 0); while rank(s) 3 of the plan were on no flow") in r.stdout, r.stdout
        # (rank 2, on no flow only because no mirror carries its links, was listed too)


def _other_version(scenario, tmp_path) -> Path:
    """The scenario's checkpoint of iteration 0 as a later ckptd format would write it."""
    doc = torch.load(scenario / "reference" / "iter_000000.pt", weights_only=True)
    assert doc["format"] == "ckptd-checkpoint/1"
    doc.update(format="ckptd-checkpoint/2", iteration=doc["iteration"] + 1)  # as steps done
    torch.save(doc, tmp_path / "v2.pt")
    return tmp_path / "v2.pt"


@pytest.mark.parametrize("cmd", ["verify", "torch", "dcp", "safetensors"])
def test_a_checkpoint_of_another_ckptd_format_is_refused(scenario, tmp_path, capsys, cmd):
    """A file whose format names another ckptd version was read as a trainer's torch.save:
    its iteration taken for steps done (one off: restored and exported as iteration 0,
    `verify` against iteration 0 'identical'), or refused with an unrelated complaint
    (which entries are parameters). Now one line naming the file and its format, and
    export leaves nothing."""
    v2 = _other_version(scenario, tmp_path)
    out = tmp_path / "out"
    argv = (["verify", v2, scenario / "reference" / "iter_000000.pt"] if cmd == "verify" else
            ["export", "--format", cmd, "--out", out, v2])
    r = ckptd_main(capsys, *argv)
    _one_line_error(r, str(v2), "format is 'ckptd-checkpoint/2'; this ckptd reads 'ckptd-checkpoint/1'")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["v2.pt"]


def test_restore_refuses_another_ckptd_format_and_a_source_of_the_wrong_type(scenario, tmp_path):
    """ckptd.restore of the file above restored iteration 0 as iteration 0 of a later
    numbering without a word; a source of None, 3 or bytes was str()'d into a path
    ('None: cannot read checkpoint: No such file or directory')."""
    import ckptd
    from ckptd.core.checkpoint import CheckpointError, load_checkpoint
    v2 = _other_version(scenario, tmp_path)
    with pytest.raises(CheckpointError, match=r"v2\.pt: format is 'ckptd-checkpoint/2'"):
        load_checkpoint(v2, ["w"])
    model = torch.nn.Linear(2, 2)
    for source in (None, 3, os.fsencode(str(v2))):
        with pytest.raises(TypeError, match=r"^ckptd\.restore: source must be a str or os\.PathLike .*, not "
                           + type(source).__name__ + "$"):
            ckptd.restore(model, None, source)


@pytest.mark.parametrize("only", [False, True], ids=["whole", "parameters-only"])
def test_verify_against_the_plan_of_another_model_is_refused(scenario, tmp_path, capsys, only):
    """verify --plan read the plan only to name a trainer's entries: two checkpoints of
    another model than the plan's (here the scenario's tiny one against a small model's
    plan) were 'identical', exit 0, as if checked against that job. export --plan refuses
    the same checkpoint; verify now checks each side as export does."""
    other = tmp_path / "small"
    synth(other, iterations=1, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16, model="small")
    ckpt = scenario / "reference" / "iter_000000.pt"
    r = ckptd_main(capsys, "verify", "--plan", other / "plan.json", *(["--parameters-only"] if only else []),
                   ckpt, ckpt)
    _one_line_error(r, str(ckpt), "the plan says float32")
    ok = ckptd_main(capsys, "verify", "--plan", scenario / "plan.json", ckpt, ckpt)
    assert ok.returncode == 0 and ok.stdout.startswith("identical"), ok.stderr


class _Mkdir:
    """Pickles as a call of os.mkdir(path): whoever unpickles it makes the directory."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("where", ["metadata", "entry", "torch-save"])
def test_a_checkpoint_runs_no_code_it_holds(scenario, tmp_path, capsys, where):
    """A DCP directory was code anyone who could write one ran in ckptd (verify, export,
    --init, ckptd.restore): DCP pickle.load-s its .metadata and torch.load-s each
    non-tensor entry with weights_only=False, where a torch.save file is read
    weights_only. Now .metadata may name only DCP's metadata classes and every entry must
    be plain data: one line naming the global, and nothing run. A torch.save file said
    only "Weights only load failed" (torch 2.13 words the reason apart): now the global."""
    import torch.distributed.checkpoint as dcp
    marker = tmp_path / "ran"
    ref = scenario / "reference" / "iter_000000.pt"
    if where == "torch-save":
        bad = tmp_path / "bad.pt"
        torch.save({"model": _Mkdir(marker)}, bad)
    else:
        good = tmp_path / "good"
        assert ckptd_main(capsys, "export", ref, "--format", "dcp", "--out", good).returncode == 0
        assert ckptd_main(capsys, "verify", good, ref).returncode == 0  # DCP itself still reads
        bad = tmp_path / "bad"
        if where == "metadata":
            shutil.copytree(good, bad)
            (bad / ".metadata").write_bytes(pickle.dumps(_Mkdir(marker)))
        else:
            doc = torch.load(ref, weights_only=True)
            doc["extra"] = _Mkdir(marker)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
                dcp.save(doc, checkpoint_id=str(bad))
    message = {"metadata": ".metadata: it names posix.mkdir, no part of DCP's metadata",
               "entry": "entry extra: not loadable as tensors and plain containers (weights_only): "
                        "Trying to load unsupported GLOBAL posix.mkdir",
               "torch-save": "not loadable as tensors and plain containers (weights_only): "
                             "Trying to load unsupported GLOBAL posix.mkdir"}[where]
    _one_line_error(ckptd_main(capsys, "verify", bad, ref), str(bad), message)
    assert not marker.exists()


def test_an_init_whose_tensors_share_memory_is_stepped_as_separate_tensors(capsys, tmp_path):
    """torch.save keeps `model[b] = model[a]` as one tensor: the shadow stepped it twice a
    step (as a and as b) and committed every checkpoint, wrong, as exact. The same state
    with the tensors apart gives the same checkpoints. (Three iterations: the default
    schedule's warm-up steps iteration 0 with lr 0.)"""
    scenario = tmp_path / "job"
    synth(scenario, iterations=3, ranks=2, channels=1, mirrors=1)
    doc = torch.load(scenario / "init.pt", weights_only=True)
    doc["model"]["head.weight"] = doc["model"]["tok.weight"]
    torch.save(doc, tmp_path / "tied.pt")
    apart = copy.deepcopy(doc)
    apart["model"]["head.weight"] = apart["model"]["head.weight"].clone()
    torch.save(apart, tmp_path / "apart.pt")
    for name in ("tied", "apart"):
        r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", tmp_path / f"{name}.pt",
                       "--out", tmp_path / name, _pcap0(scenario))
        assert r.returncode == 0, r.stderr
    assert ckptd_main(capsys, "verify", tmp_path / "tied", tmp_path / "apart").returncode == 0


def test_plan_out_that_is_a_capture_or_checkpoint_is_refused_not_overwritten(scenario, capsys, tmp_path):
    """`ckptd plan --out mirrors/mirror0.pcap` wrote the plan over the capture, exit 0."""
    for name, src in (("m.pcap", _pcap0(scenario)), ("init.pt", scenario / "init.pt")):
        out = tmp_path / name
        shutil.copy(src, out)
        before = out.read_bytes()
        r = ckptd_main(capsys, "plan", "--model", "test_cli:build_model", "--ranks", "2", "--addr", "10.0.0.1",
                       "--addr", "10.0.0.2", "--out", out)
        _one_line_error(r, str(out), "which the plan would overwrite; give --out a path of its own")
        assert out.read_bytes() == before


def test_checkpoints_left_in_out_from_before_are_named(scenario, capsys, tmp_path):
    """An --out holding another run's newer checkpoints: the replay wrote its own beside
    them without a word, and restore(out) then took the stale newest one."""
    out = tmp_path / "out"
    argv = ["replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt", "--out", out, _pcap0(scenario)]
    r = ckptd_main(capsys, *argv)
    assert r.returncode == 0 and "warning" not in r.stderr  # (a fresh --out)
    r = ckptd_main(capsys, *argv)
    assert r.returncode == 0 and "warning" not in r.stderr  # (its own files, rewritten)
    shutil.copy(out / "iter_000000.pt", out / "iter_000009.pt")
    r = ckptd_main(capsys, *argv)
    assert r.returncode == 0
    assert (f"warning: --out {out} still holds checkpoints of iterations 9 from before this replay, newer than "
            "its last commit (0)") in r.stderr


def test_a_state_of_another_optimizer_is_named_so(scenario, capsys, tmp_path):
    """An SGD job's checkpoint checked against an AdamW plan (--init, --resume, export
    --plan) said only "optimizer.state.X.step is not a tensor"."""
    doc = torch.load(scenario / "reference" / "iter_000000.pt", weights_only=True)
    doc["optimizer"]["state"] = {n: {"momentum_buffer": torch.zeros_like(t)} for n, t in doc["model"].items()}
    torch.save(doc, tmp_path / "sgd.pt")
    r = ckptd_main(capsys, "export", tmp_path / "sgd.pt", "--format", "torch", "--out", tmp_path / "x.pt",
                   "--plan", scenario / "plan.json")
    _one_line_error(r, str(tmp_path / "sgd.pt"), "holds ['momentum_buffer'], not torch's adamw state (step, exp_avg, "
                    "exp_avg_sq): the state of a job with another optimizer")


def test_a_capture_without_frames_prints_whole_lines(scenario, capsys, tmp_path):
    """A capture of a file header only printed `stream e: ` and `extraction: , late=0`."""
    empty = tmp_path / "e.pcap"
    empty.write_bytes(Path(_pcap0(scenario)).read_bytes()[:24])
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt", empty)
    lines = r.stdout.splitlines()
    assert "stream e: frames=0" in lines
    assert any(x.startswith("extraction: late=0") for x in lines), lines


_WITHOUT_KERNEL = """
import builtins, sys
real = builtins.__import__
def without_kernel(name, globals=None, locals=None, fromlist=(), level=0):
    # a source tree never built: the compiled batch kernel is not there
    if name == "cython_ext.batch" or (name == "cython_ext" and "batch" in (fromlist or ())):
        raise ModuleNotFoundError("No module named 'cython_ext.batch'", name="cython_ext.batch")
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = without_kernel
from ckptd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_replay_without_the_built_kernel_says_how_to_build_it_and_the_reference_path_still_replays(scenario):
    """A git clone run with PYTHONPATH (never `pip install`ed) has no compiled kernel:
    the default (fast) replay ended in an ImportError traceback."""
    args = ["replay", "--plan", str(scenario / "plan.json"), "--init", str(scenario / "init.pt"),
            *map(str, sorted((scenario / "mirrors").glob("*.pcap")))]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", _WITHOUT_KERNEL, *args], capture_output=True, text=True,
                       timeout=300, env=env, cwd=REPO)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line
    assert "compiled kernels are not built (cannot import cython_ext.batch)" in r.stderr
    assert "pip install ." in r.stderr and "--reference-path" in r.stderr
    r = subprocess.run([sys.executable, "-c", _WITHOUT_KERNEL, *args, "--reference-path"], capture_output=True,
                       text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0 and "1 iterations, 1 committed" in r.stdout, r.stdout[-1500:] + r.stderr[-1500:]


@pytest.mark.parametrize("fast", [False, True])
def test_a_plan_of_another_path_mtu_is_named_not_the_ring_version(scenario, tmp_path, capsys, fast):
    """The MTU cuts every message into packets (and PSNs): with the plan's ring.mtu not
    the captures', no flow fits. The replay blamed the ring's NCCL version and protocol,
    and every iteration said no packet of it was captured."""
    import json
    doc = json.loads((scenario / "plan.json").read_text())
    assert doc["ring"]["mtu"] == 4096  # (synth's default)
    doc["ring"]["mtu"] = 1024
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    r = ckptd_main(capsys, "replay", "--plan", tmp_path / "plan.json", "--init", scenario / "init.pt",
                   *([] if fast else ["--reference-path"]), *sorted((scenario / "mirrors").glob("*.pcap")))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "so the path MTU is 4096: the plan's ring.mtu is 1024" in r.stdout
    assert "the plan's ring.mtu is 1024" in r.stderr and "ring.nccl_version" not in r.stderr
    assert "no packet of it was placed: flows of the captures fit none of the plan's" in r.stdout
    assert "no packet of it was captured" not in r.stdout


@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz", "zstd"])
def test_a_compressed_capture_is_named_with_how_to_read_it(scenario, tmp_path, capsys, kind):
    """It said "neither pcap nor pcapng (first bytes 1f8b0808)"."""
    import bz2
    import gzip
    import lzma
    pcap = sorted((scenario / "mirrors").glob("*.pcap"))[0]
    data = pcap.read_bytes()
    packed = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress,
              "zstd": lambda d: b"\x28\xb5\x2f\xfd" + d[:64]}[kind](data)  # (zstd: its magic is enough)
    f = tmp_path / f"mirror0.pcap.{kind}"
    f.write_bytes(packed)
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt", f)
    _one_line_error(r, str(f), f"{kind}-compressed, not a capture: decompress it first")
    assert "ckptd replay ... -" in r.stderr


@pytest.mark.parametrize("fast", [False, True])
def test_captures_joined_with_cat_are_named_where_the_second_begins(scenario, tmp_path, capsys, fast):
    """`cat a.pcap b.pcap` reads on as one pcap whose 'record' at the second file header
    is absurd: it said "captured length 1700000000 is more than the largest snaplen: a
    broken record header", at a frame number one past the header. What the first file
    holds is still replayed."""
    from parsers.capfile import open_capture
    pcap = sorted((scenario / "mirrors").glob("*.pcap"))[0]
    frames = sum(1 for _ in open_capture(pcap))
    joined = tmp_path / "joined.pcap"
    joined.write_bytes(pcap.read_bytes() * 2)
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                   *([] if fast else ["--reference-path"]), joined)
    assert f"joined.pcap: frame {frames + 1}: another capture file's header starts here (files joined with cat?)" \
        in r.stderr, r.stderr
    assert "mergecap -a" in r.stderr and "1 iterations, 1 committed" in r.stdout, r.stdout


@pytest.mark.parametrize("cmd", ["synth", "demo"])
def test_out_where_no_directory_can_be_made_names_the_option(tmp_path, capsys, cmd):
    """/proc takes no new directory: it was the bare "[Errno 2] No such file or
    directory: '/proc/...'", naming no option; then "cannot make the directory: No such
    file or directory", which did not say why."""
    out = Path("/proc") / f"ckptd-test-{os.getpid()}"
    r = ckptd_main(capsys, cmd, "--out", out, "--iterations", "1", "--model", "tiny")
    _one_line_error(r, None, f"--out {out}: it lies on proc, a filesystem of the kernel's, not storage; give a "
                    "directory on a disk")
    assert not out.exists()


def test_a_reference_directory_with_two_different_files_of_an_iteration_is_refused(scenario, tmp_path, capsys):
    """Which of two files of one iteration --reference compared with depended on their
    names: a rename turned `NOT bit-exact`, exit 4, into `bit-exact`, exit 0. Two that
    differ are refused, naming both; identical copies are one reference."""
    ref = tmp_path / "ref"
    ref.mkdir()
    good = torch.load(scenario / "reference" / "iter_000000.pt", weights_only=True)
    torch.save(good, ref / "b.pt")
    torch.save(good, ref / "c.pt")
    argv = ["replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt", "--reference", ref,
            _pcap0(scenario)]
    r = ckptd_main(capsys, *argv)
    assert r.returncode == 0 and "bit-exact" in r.stdout and "NOT" not in r.stdout, r.stdout + r.stderr
    bad = copy.deepcopy(good)
    name = next(iter(bad["model"]))
    bad["model"][name].view(-1)[0] += 1
    for other in ("a.pt", "d.pt"):  # sorted before the good ones, and after them
        torch.save(bad, ref / other)
        r = ckptd_main(capsys, *argv)
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.startswith(f"error: {ref}: ") and r.stderr.count("\n") == 1, r.stderr
        first, second = sorted(["b.pt", other])
        assert f"{first} and {second} both hold iteration 0 and differ (model.{name}: 1 of" in r.stderr, r.stderr
        (ref / other).unlink()


def test_verify_compares_a_trainers_hyperparameters_and_scheduler(scenario, tmp_path, capsys):
    """verify ("exit 0 only if two checkpoints are bit-identical") read a trainer's file
    as model and optimizer state only: two files whose param_groups (lr, betas,
    weight_decay: what optimizer.load_state_dict takes back) or lr_scheduler state
    differed were `identical`, exit 0, and ckptd's scalar lr was compared with ==
    (-0.0 == 0.0). What only one file holds is named as not compared."""
    a = tmp_path / "a.pt"
    assert ckptd_main(capsys, "export", scenario / "reference" / "iter_000000.pt", "--format", "torch",
                      "--plan", scenario / "plan.json", "--out", a).returncode == 0
    doc = torch.load(a, weights_only=True)
    assert doc.get("lr_scheduler") is not None  # (the synthesized job has a scheduler)
    groups = copy.deepcopy(doc)
    groups["optimizer"]["param_groups"][0].update(lr=0.5, betas=(0.9, 0.5))
    torch.save(groups, tmp_path / "groups.pt")
    sched = copy.deepcopy(doc)
    sched["lr_scheduler"]["last_epoch"] += 7
    torch.save(sched, tmp_path / "sched.pt")
    r = ckptd_main(capsys, "verify", a, tmp_path / "groups.pt")
    assert r.returncode == 1 and "param_groups[0].lr: " in r.stdout and "!= 0.5" in r.stdout, r.stdout
    assert "param_groups[0].betas[1]: " in r.stdout, r.stdout
    r = ckptd_main(capsys, "verify", a, tmp_path / "sched.pt")
    assert r.returncode == 1 and "lr_scheduler.last_epoch: " in r.stdout, r.stdout
    r = ckptd_main(capsys, "verify", a, a)
    assert r.returncode == 0 and r.stdout == f"identical: {a} == {a}\n", r.stdout
    # ckptd's own file holds no hyperparameters (the plan does): compared on what both hold
    own = scenario / "reference" / "iter_000000.pt"
    r = ckptd_main(capsys, "verify", own, a)
    assert r.returncode == 0, r.stdout
    assert "(not compared: param_groups (only in second), lr_scheduler (only in second))" in r.stdout, r.stdout
    mine = torch.load(own, weights_only=True)
    zero = copy.deepcopy(mine)
    zero["optimizer"]["lr"], mine["optimizer"]["lr"] = 0.0, -0.0
    torch.save(zero, tmp_path / "zero.pt")
    torch.save(mine, tmp_path / "minus.pt")
    r = ckptd_main(capsys, "verify", tmp_path / "zero.pt", tmp_path / "minus.pt")
    assert r.returncode == 1 and "optimizer.lr: 0.0 != -0.0" in r.stdout, r.stdout


@pytest.mark.parametrize("command", ["export", "init"])
def test_a_directory_of_checkpoints_where_one_is_read_is_named_so(scenario, tmp_path, capsys, command):
    """export and --init read one checkpoint: given the trainer's directory they said "not a
    torch.distributed.checkpoint", though verify and restore take such a directory."""
    ref = scenario / "reference"
    argv = (["export", ref, "--format", "torch", "--out", tmp_path / "x.pt"] if command == "export" else
            ["replay", "--plan", scenario / "plan.json", "--init", ref, _pcap0(scenario)])
    r = ckptd_main(capsys, *argv)
    _one_line_error(r, str(ref), f"a directory of 1 checkpoint(s) (iter_000000.pt), not one checkpoint: give one "
                                 f"file (e.g. {ref / 'iter_000000.pt'}) or a torch.distributed.checkpoint directory")


@pytest.mark.parametrize("fmt,out,message", [
    ("torch", "new/", "new/: ends in / (a directory); --format torch writes a file"),
    ("dcp", "afile", "afile: a file is in the way; DCP writes a directory"),
], ids=["trailing-slash", "dcp-onto-a-file"])
def test_export_out_that_asks_for_the_other_kind_is_named(scenario, tmp_path, capsys, fmt, out, message):
    """`--out new/` (a directory, by its slash) was written as a file `new`; DCP onto a
    file said "exists and is not an empty directory"."""
    (tmp_path / "afile").write_text("x")
    target = f"{tmp_path}/{out}"
    r = ckptd_main(capsys, "export", scenario / "init.pt", "--format", fmt, "--out", target)
    _one_line_error(r, None, f"{tmp_path}/{message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "x"


def test_replay_out_too_long_names_the_option(scenario, capsys):
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                   "--out", "a" * 300, _pcap0(scenario))
    _one_line_error(r, None, f"--out {'a' * 300}: File name too long")


def test_restore_into_a_model_on_the_meta_device_is_named(scenario):
    """torch's "Tensor.item() cannot be called on meta tensors" came out of the load."""
    import ckptd
    from ckptd.testing.synth.model import build_model
    with torch.device("meta"):
        model = build_model("tiny", 0)
    with pytest.raises(TypeError, match=r"^ckptd\.restore: the model's \S+ is on the meta device \(no data to "
                                        r"restore into\): build the model on a real device"):
        ckptd.restore(model, None, scenario / "reference" / "iter_000000.pt")


def test_a_plan_with_swapped_rank_addresses_names_the_schedule_not_the_init(tmp_path, capsys):
    """The error blamed --init and the plan's iterations (the captures "hold iterations up
    to 3") and said nothing of the packets that broke the schedule: a few among many that
    fitted (2 channels: each rank pair is a ring hop either way), so the ring's own check
    stayed quiet."""
    synth(tmp_path, iterations=3, ranks=2, channels=2, mirrors=2)

    def swap(doc):
        a, b = doc["ranks"][0]["addr"], doc["ranks"][1]["addr"]
        doc["ranks"][0]["addr"], doc["ranks"][1]["addr"] = b, a
    plan = _plan(tmp_path, swap, "swapped")
    r = ckptd_main(capsys, "replay", "--plan", plan, "--init", tmp_path / "init.pt",
                   *sorted((tmp_path / "mirrors").glob("*.pcap")))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"packet(s) broke the schedule of the plan {plan} (its ranks[].addr or ring.rings may not be the job's), " \
           "or the init is not the state" in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["inspect", "replay"])
def test_an_os_error_on_a_path_reads_path_then_reason(scenario, tmp_path, capsys, command):
    """It was Python's "[Errno 40] Too many levels of symbolic links: 'loop1'"."""
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    argv = ["inspect"] if command == "inspect" else ["replay", "--plan", scenario / "plan.json"]
    r = ckptd_main(capsys, *argv, tmp_path / "loop1")
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == f"error: {tmp_path / 'loop1'}: Too many levels of symbolic links", r.stderr
