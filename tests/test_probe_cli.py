"""Bad input found by probing the command line after the earlier rounds: each case exits 2
with one `error:` line naming the culprit (file, key, option), never a traceback, a hang or
a silently wrong result."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import synth
from tests.test_bad_input import _one_line_error, ckptd_main


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("probe")
    synth(d, iterations=1, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16)
    return d


@pytest.fixture(scope="module")
def groups_scenario(tmp_path_factory) -> Path:
    """SGD with two param groups (no-decay)."""
    d = tmp_path_factory.mktemp("probe-groups")
    synth(d, iterations=1, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16, opt_kind="sgd",
          opt_hyper={"lr": 0.1, "momentum": 0.9}, no_decay_group=True)
    return d


def _pcaps(d: Path) -> list[Path]:
    return sorted((d / "mirrors").glob("*.pcap"))


def _changed_plan(d: Path, name: str, change) -> Path:
    doc = json.loads((d / "plan.json").read_text())
    change(doc)
    p = d / f"plan-{name}.json"
    p.write_text(json.dumps(doc))
    return p


def _replay(capsys, d: Path, plan: Path, *extra):
    return ckptd_main(capsys, "replay", "--plan", plan, "--init", d / "init.pt", *extra, *_pcaps(d))


@pytest.mark.parametrize("key", ["max_threads", "qps_per_connection", "ar_threshold", "mtu"])
def test_a_null_ring_integer_takes_its_default(scenario, capsys, key):
    """`"max_threads": null` raised TypeError ('<=' not supported between int and NoneType)
    in check_plan or RingConfig: null now takes the default, like a missing key."""
    plan = _changed_plan(scenario, f"null-{key}", lambda doc: doc["ring"].update({key: None}))
    r = _replay(capsys, scenario, plan)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("key,value", [("momentum", "x"), ("weight_decay", "x"), ("momentum", -1), ("lr", -1)])
def test_a_bad_hyperparameter_of_a_later_group_is_refused_at_load(groups_scenario, capsys, key, value):
    """torch's constructor checks only its defaults (the first group): groups[1].momentum
    "x" was taken and raised TypeError in _foreach_mul_ at the first step (after iteration
    0's checkpoint was written); -1 replayed silently with a momentum no trainer can set
    by the constructor."""
    d = groups_scenario

    def change(doc):
        doc["optimizer"]["groups"][1][key] = value
    plan = _changed_plan(d, f"g1-{key}-{value}", change)
    r = _replay(capsys, d, plan, "--out", d / f"out-{key}-{value}")
    _one_line_error(r, str(plan), f"optimizer.groups[1].{key} is {value!r}: torch.optim.SGD refuses it")
    assert not (d / f"out-{key}-{value}").exists()


# -- daemon config: YAML alias bombs ------------------------------------------------------------
def _bomb(levels: int = 6, width: int = 9):
    """A list nested `levels` deep, every level `width` references to the one below:
    yaml.safe_dump writes it in a few lines with anchors and aliases."""
    x = ["lol"] * width
    for _ in range(levels - 1):
        x = [x] * width
    return x


BASE_CONFIG = {"plan": "plan.json", "init": "init.pt", "out": "ckpt", "interfaces": [{"ifname": "hdnone0"}]}
CONFIG_BOMBS = [
    ("log_level", {}, "'log_level'"),
    ("keep_last", {}, "'keep_last'"),
    ("fast", {}, "'fast'"),
    ("listen", {}, "'listen'"),
    ("capture_workers", {}, "'capture_workers'"),
    ("cpus", {}, "'cpus'"),
    ("huge_pages", {}, "'huge_pages'"),
    ("notice.webhook", {}, "'notice.webhook'"),
    ("notice.timeout_s", {"webhook": "http://127.0.0.1:1/x"}, "'notice.timeout_s'"),
    ("notice.store", {}, "notice.store"),
    ("interfaces.block_size", {}, "'interfaces[0].block_size'"),
    ("interfaces.fanout_mode", {}, "'interfaces[0].fanout_mode'"),
    ("interfaces.cpu", {}, "interfaces[0].cpu"),
    ("persist_options.a", {}, "'persist_options' holds more than 10000 values"),
]


@pytest.mark.parametrize("key,extra,message", CONFIG_BOMBS, ids=[c[0] for c in CONFIG_BOMBS])
def test_alias_bomb_in_the_daemon_config_is_a_short_line_at_once(scenario, capsys, key, extra, message):
    """The checks repr'd the value whole (then cut it to 200 characters, or not at all):
    9**9 nodes hung `ckptd run` past 60 s at 3 GB; persist_options was walked node by node
    (and taken). 9**6 nodes here: the old code made multi-megabyte lines or took it."""
    import time

    import yaml
    doc = json.loads(json.dumps(BASE_CONFIG))
    head, _, rest = key.partition(".")
    if head == "interfaces":
        doc["interfaces"][0][rest] = _bomb()
    elif head == "notice":
        doc["notice"] = {**extra, rest: _bomb()}
    elif head == "persist_options":
        doc.update(persist_url="memory://probe", persist_options={rest: _bomb()})
    else:
        doc[key] = _bomb()
    cfg = scenario / f"cfg-bomb-{key}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    assert cfg.stat().st_size < 10_000
    t = time.monotonic()
    r = ckptd_main(capsys, "run", "--config", cfg)
    _one_line_error(r, str(cfg), message)
    assert len(r.stderr) < 300 + len(str(cfg)), r.stderr[:400]
    assert time.monotonic() - t < 5


@pytest.mark.parametrize("key", ["resume", "init", "out"])
def test_a_url_where_the_daemon_config_takes_a_path_is_named(scenario, capsys, key):
    """`resume: http://host:9187` was read as the relative path <config dir>/http:/host:9187."""
    cfg = scenario / f"cfg-url-{key}.yaml"
    keys = {"plan": "plan.json", "init": "init.pt", "out": "ckpt", key: "http://127.0.0.1:9187"}
    cfg.write_text("".join(f"{k}: {v}\n" for k, v in keys.items()) + "interfaces:\n  - ifname: hdnone0\n")
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg), str(cfg),
                    f"'{key}' 'http://127.0.0.1:9187' is a URL: {key} takes a local file or directory")


def test_a_bad_cpu_in_the_list_is_named(scenario, capsys):
    cfg = scenario / "cfg-cpus.yaml"
    cfg.write_text("plan: plan.json\ninit: init.pt\nout: ckpt\ncapture_workers: true\ncpus: [0, -1]\n"
                   "interfaces:\n  - ifname: hdnone0\n")
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg), str(cfg), "(-1 is not one)")


@pytest.mark.parametrize("key", ["log_level", "listen"])
def test_a_megabyte_string_in_the_daemon_config_is_shown_short(scenario, capsys, key):
    cfg = scenario / f"cfg-long-{key}.yaml"
    cfg.write_text(f"plan: plan.json\ninit: init.pt\nout: ckpt\n{key}: {'a' * 100_000}\n"
                   "interfaces:\n  - ifname: hdnone0\n")
    r = ckptd_main(capsys, "run", "--config", cfg)
    _one_line_error(r, str(cfg), f"'{key}'" if key == "log_level" else "listen")
    assert "(100000 characters)" in r.stderr and len(r.stderr) < 400 + len(str(cfg))


# -- checkpoints ----------------------------------------------------------------------------------
def _init_with_first_param(d: Path, name: str, make) -> Path:
    import torch
    doc = torch.load(d / "init.pt", weights_only=True)
    k = next(iter(doc["model"]))
    doc["model"][k] = make(doc["model"][k])
    p = d / f"init-{name}.pt"
    torch.save(doc, p)
    return p


def _meta(t):
    import torch
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


TENSOR_KINDS = [("meta", _meta, "is a meta tensor"),
                ("sparse", lambda t: t.to_sparse(), "is a sparse_coo tensor")]


@pytest.mark.parametrize("kind,make,message", TENSOR_KINDS, ids=[k[0] for k in TENSOR_KINDS])
@pytest.mark.parametrize("argv", [
    lambda d, f: ["replay", "--plan", d / "plan.json", "--init", f, *_pcaps(d)],
    lambda d, f: ["verify", f, d / "init.pt"],
    lambda d, f: ["export", f, "--format", "safetensors", "--out", d / "x.safetensors"],
    lambda d, f: ["export", f, "--format", "torch", "--out", d / "x.torch"],
], ids=["replay-init", "verify", "export-safetensors", "export-torch"])
def test_a_tensor_without_plain_data_is_refused_where_the_checkpoint_is_read(scenario, capsys, kind, make,
                                                                             message, argv):
    """A model saved from device="meta" (no data) or with a sparse weight: replay raised
    RuntimeError in torch (Tensor on device cpu is not on the expected device meta;
    unsupported memory format option Contiguous), verify NotImplementedError in
    aten::equal, export to safetensors NotImplementedError, and export to torch wrote the
    meta tensor as it was (exit 0, a checkpoint without weights)."""
    f = _init_with_first_param(scenario, kind, make)
    r = ckptd_main(capsys, *argv(scenario, f))
    _one_line_error(r, str(f), message)
    assert not (scenario / "x.safetensors").exists() and not (scenario / "x.torch").exists()


def test_parameters_only_of_two_different_models_is_not_identical(scenario, capsys, tmp_path):
    """--parameters-only kept the names both files hold: two models with none in common
    (every entry dropped) were "identical", exit 0."""
    import torch
    other = tmp_path / "other.pt"
    torch.save({"model": {"a": torch.zeros(2)}, "iteration": 0}, other)
    r = ckptd_main(capsys, "verify", other, scenario / "init.pt", "--parameters-only")
    assert r.returncode == 1 and "model.a: only in first" in r.stdout, (r.returncode, r.stdout, r.stderr)
    empty = tmp_path / "empty.pt"
    torch.save({"model": {}, "iteration": 0}, empty)
    _one_line_error(ckptd_main(capsys, "verify", empty, scenario / "init.pt", "--parameters-only"), None,
                    "--parameters-only: a checkpoint holds no model entry")
    _one_line_error(ckptd_main(capsys, "verify", other, other, "--parameters-only", "--plan", scenario / "plan.json"),
                    str(other), "model.tok.weight is missing or not a tensor")  # not the plan's job's
    # a parameter missing from the file with more entries is a difference, not dropped
    doc = torch.load(scenario / "init.pt", weights_only=True)
    doc["model"]["bn.running_mean"] = torch.zeros(3)  # a buffer, as a trainer's file has
    doc["model"].pop(next(iter(doc["model"])))
    trainer = tmp_path / "trainer.pt"
    torch.save(doc, trainer)
    r = ckptd_main(capsys, "verify", scenario / "init.pt", trainer, "--parameters-only")
    assert r.returncode == 1 and "only in first" in r.stdout, r.stdout
    r = ckptd_main(capsys, "verify", scenario / "init.pt", scenario / "init.pt", "--parameters-only")
    assert r.returncode == 0, r.stderr


# -- captures ---------------------------------------------------------------------------------------
def _with_linktype(src: Path, dst: Path, linktype: int, big: bool = False) -> Path:
    """The capture `src` (a little-endian pcap) with another link type in its header, or
    rewritten big-endian."""
    import struct
    raw = src.read_bytes()
    magic, vmaj, vmin, tz, sig, snap, _ = struct.unpack("<IHHiIII", raw[:24])
    order = ">" if big else "<"
    out = bytearray(struct.pack(order + "IHHiIII", magic, vmaj, vmin, tz, sig, snap, linktype))
    off = 24
    while off < len(raw):
        rec = struct.unpack("<IIII", raw[off:off + 16])
        out += struct.pack(order + "IIII", *rec) + raw[off + 16:off + 16 + rec[2]]
        off += 16 + rec[2]
    dst.write_bytes(bytes(out))
    return dst


@pytest.mark.parametrize("big", [False, True], ids=["little-endian", "big-endian"])
@pytest.mark.parametrize("argv", [
    lambda d, f: ["inspect", f],
    lambda d, f: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", f],
    lambda d, f: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", "--reference-path", f],
], ids=["inspect", "replay", "replay-reference-path"])
def test_a_pcap_of_a_link_type_ckptd_does_not_decode_is_named(scenario, capsys, tmp_path, big, argv):
    """Link type 147 (USER0): every frame was "other"; inspect exited 0 and replay 3
    ("not recovered") without saying why."""
    f = _with_linktype(_pcaps(scenario)[0], tmp_path / "user0.pcap", 147, big)
    _one_line_error(ckptd_main(capsys, *argv(scenario, f)), str(f), "link type 147 is not one ckptd decodes (1 Ethernet")


def test_a_big_endian_pcap_of_ethernet_still_replays(scenario, capsys, tmp_path):
    f = _with_linktype(_pcaps(scenario)[0], tmp_path / "big.pcap", 1, big=True)
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt", f)
    assert r.returncode == 0 and "1 committed" in r.stdout, r.stderr


# -- output paths -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_onto_a_fifo_or_device_leaves_it_as_it_was(scenario, capsys, tmp_path, fmt):
    """The temporary was renamed over whatever --out named: `--out /dev/full` as root made
    the device a regular file (exit 0); a FIFO was replaced the same way."""
    import os
    import stat
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    r = ckptd_main(capsys, "export", scenario / "init.pt", "--format", fmt, "--out", fifo)
    _one_line_error(r, str(fifo), "is a device, FIFO or socket, not a regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and not (tmp_path / "out.fifo.tmp").exists()


def test_plan_onto_a_fifo_is_refused_naming_what_it_is(capsys, tmp_path):
    import os
    import stat
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    r = ckptd_main(capsys, "plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                   "--ranks", "2", "--addr", "10.0.0.1", "--addr", "10.0.0.2", "--out", fifo)
    _one_line_error(r, str(fifo), "cannot write plan: is a device, FIFO or socket")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("via_link", [False, True])
def test_replay_out_the_reference_directory_is_refused(scenario, capsys, tmp_path, via_link):
    """--out = --reference overwrote the trainer's checkpoints with ckptd's, each compared
    with the file it had just written: "bit-exact" always, and the reference lost."""
    import shutil
    ref = tmp_path / "reference"
    shutil.copytree(scenario / "reference", ref)
    before = {p.name: p.read_bytes() for p in ref.iterdir()}
    out = ref
    if via_link:
        out = tmp_path / "link"
        out.symlink_to(ref)
    r = _replay(capsys, scenario, scenario / "plan.json", "--out", out, "--reference", ref)
    _one_line_error(r, str(out), "is the --reference directory")
    assert {p.name: p.read_bytes() for p in ref.iterdir()} == before


# -- plan files --------------------------------------------------------------------------------------
def test_a_misspelt_plan_section_is_refused_by_name(scenario, capsys):
    """"optimiser" for "optimizer": read as a plan without an optimizer, replay --out
    wrote no checkpoint and exited 0 ("0 committed, 0 not recovered")."""
    def change(doc):
        doc["optimiser"] = doc.pop("optimizer")
    plan = _changed_plan(scenario, "optimiser", change)
    r = _replay(capsys, scenario, plan, "--out", scenario / "out-optimiser")
    _one_line_error(r, str(plan), "unknown keys ['optimiser']")
    assert not (scenario / "out-optimiser").exists()


@pytest.mark.parametrize("how", ["absent", "null"])
def test_replay_out_with_a_plan_that_names_no_optimizer_is_refused(scenario, capsys, how):
    """The same ending with the section removed or null: every iteration complete, then
    "0 committed", exit 0, nothing written."""
    def change(doc):
        if how == "absent":
            del doc["optimizer"]
        else:
            doc["optimizer"] = None
    plan = _changed_plan(scenario, f"no-optimizer-{how}", change)
    r = _replay(capsys, scenario, plan, "--out", scenario / f"out-no-optimizer-{how}")
    _one_line_error(r, None, "names no optimizer, so there is no model state to step and no checkpoint to write")
    assert not (scenario / f"out-no-optimizer-{how}").exists()
    assert _replay(capsys, scenario, plan).returncode == 0  # without --out: the gradients are checked


def test_a_key_given_twice_in_a_plan_is_refused(scenario, capsys):
    """JSON's last value silently won: a hand edit of the first one did nothing."""
    text = (scenario / "plan.json").read_text()
    assert '"iterations": 1' in text
    plan = scenario / "plan-twice.json"
    plan.write_text(text.replace('"iterations": 1', '"iterations": 1, "iterations": 5'))
    _one_line_error(_replay(capsys, scenario, plan), str(plan), "key 'iterations' given twice")


def test_a_plan_written_by_write_plan_keeps_its_note(scenario, capsys):
    plan = _changed_plan(scenario, "note", lambda doc: doc.update(written_by="ckptd.torch.write_plan"))
    assert _replay(capsys, scenario, plan).returncode == 0


# -- URLs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url,message", [
    ("http://[::1", "cannot fetch checkpoint: Invalid IPv6 URL"),  # ValueError from urlsplit
    ("http://" + "a" * 70, "cannot fetch checkpoint: encoding with 'idna' codec failed"),  # UnicodeError
    # a port out of range was tried as another one and read "Connection refused"
    ("http://127.0.0.1:99999", "cannot fetch checkpoint: Port out of range 0-65535"),
])
def test_resume_from_a_url_urllib_cannot_use_is_one_line(scenario, capsys, url, message):
    r = _replay(capsys, scenario, scenario / "plan.json", "--resume", url)
    _one_line_error(r, None, message)


def test_a_password_in_a_daemon_url_is_refused_and_never_shown(scenario, capsys):
    """urllib took user:password@ for part of the host: "Name or service not known", with
    the password in the line. The daemon takes a token ($CKPTD_TOKEN)."""
    r = ckptd_main(capsys, "verify", "http://alice:s3cret@127.0.0.1:1/x", scenario / "init.pt")
    _one_line_error(r, "http://***@127.0.0.1:1/x", "user:password@ in a daemon's URL is not used")
    assert "s3cret" not in r.stderr + r.stdout


def test_verify_of_a_daemon_url_nothing_answers_is_one_line_naming_it(scenario, capsys):
    """It was read as the path "http:/127.0.0.1:1" (No such file or directory); verify
    now reads the daemon's URL as restore does (tests/test_cli.py), and one that nothing
    answers is named as such."""
    r = ckptd_main(capsys, "verify", "http://127.0.0.1:1", scenario / "init.pt")
    _one_line_error(r, "http://127.0.0.1:1/checkpoint", "refused")


# -- synth options -------------------------------------------------------------------------------------
_SYNTH = ["synth", "--model", "tiny", "--iterations", "2", "--ranks", "2", "--channels", "1", "--mirrors", "1"]


@pytest.mark.parametrize("extra,message", [
    (["--optim", "sgd:lr=0.1,momentun=0.9"], "--optim sgd: SGD takes no 'momentun'"),
    (["--optim", "sgd:lr=0.1,lr=0.2"], "'lr' given twice"),
    (["--amp", "1024", "--inf-at", "5"], "--inf-at 5: the job runs iterations 0..1"),
    # each of these was taken as not given: the scenario trained without it, exit 0
    (["--amp-growth-interval", "5"], "--amp-growth-interval is the GradScaler's growth_interval: it needs --amp"),
    (["--optim", ""], "--optim '': NAME[:key=value,...]"),
    (["--lr-per-step", ""], "--lr-per-step '': entry 1 ('') is not LR or LR/LR/..."),
    (["--lr-per-step", "0.1,,0.2"], "--lr-per-step '0.1,,0.2': entry 2 ('') is not LR"),
], ids=["misspelt-hyperparameter", "key-twice", "inf-at-past-the-end", "growth-without-amp", "optim-empty",
        "lr-per-step-empty", "lr-per-step-hole"])
def test_synth_options_that_would_do_nothing_are_refused_before_out(capsys, tmp_path, extra, message):
    """Each was taken and had no effect: torch keeps any key in a param group (SGD trained
    without momentum), the last of two values won, an --inf-at past the last iteration
    injected nothing."""
    out = tmp_path / "out"
    _one_line_error(ckptd_main(capsys, *_SYNTH, *extra, "--out", out), None, message)
    assert not out.exists()


@pytest.mark.parametrize("key,line", [
    ("keep_last", "keep_last: 0x{hex}\ninterfaces:\n  - ifname: hdnone0\n"),
    ("interfaces[0].block_size", "interfaces:\n  - {{ifname: hdnone0, block_size: 0x{hex}}}\n"),
])
def test_a_yaml_integer_past_4300_digits_is_named_not_a_traceback(scenario, capsys, key, line):
    """YAML's hex integers are not held to Python's 4300-digit limit when parsed, but the
    message's str() of one is: ValueError (Exceeds the limit ...). (Session 28: a hex
    number is refused as YAML 1.1 reads it, on its line, before any key takes it.)"""
    cfg = scenario / f"cfg-hex-{key[:4]}.yaml"
    cfg.write_text("plan: plan.json\ninit: init.pt\nout: ckpt\n" + line.format(hex="f" * 4000))
    r = ckptd_main(capsys, "run", "--config", cfg)
    _one_line_error(r, str(cfg), "is read by YAML as an integer of 16000 bits (octal, hex or base 60)")


def test_a_decimal_yaml_integer_of_5000_digits_is_named_by_its_line(scenario, capsys):
    """It was Python's "Exceeds the limit (4300 digits) ... use sys.set_int_max_str_digits()"."""
    cfg = scenario / "cfg-decimal-digits.yaml"
    cfg.write_text("plan: plan.json\ninit: init.pt\nout: ckpt\ninterfaces:\n  - {ifname: hdnone0}\nkeep_last: "
                   + "9" * 5000 + "\n")
    r = ckptd_main(capsys, "run", "--config", cfg)
    _one_line_error(r, str(cfg), "line 6: an integer of 5000 digits: no setting takes one that long")
    assert "set_int_max_str_digits" not in r.stderr


def test_a_size_string_of_5000_digits_is_named_not_a_traceback(scenario, capsys):
    """'999...9M': int() of the digits raised ValueError (Exceeds the limit ...)."""
    cfg = scenario / "cfg-size-digits.yaml"
    cfg.write_text("plan: plan.json\ninit: init.pt\nout: ckpt\ninterfaces:\n"
                   f"  - {{ifname: hdnone0, block_size: '{'9' * 5000}M'}}\n")
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg), str(cfg), "'interfaces[0].block_size' must be a size")


def test_a_long_safetensors_step_is_shown_short(scenario, capsys, tmp_path):
    """The metadata's 'step' was repr'd whole into the line (5000 characters)."""
    import struct
    good = tmp_path / "ok.safetensors"
    assert ckptd_main(capsys, "export", scenario / "init.pt", "--format", "safetensors", "--out", good).returncode == 0
    raw = good.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    head["__metadata__"] = {"step": "9" * 5000}
    hb = json.dumps(head).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    r = ckptd_main(capsys, "verify", bad, scenario / "init.pt")
    _one_line_error(r, str(bad), "(5000 characters), not a number")
    assert len(r.stderr) < 300 + len(str(bad))


# -- resume states -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gap_scenario(tmp_path_factory) -> Path:
    """Iteration 0 lost on the only mirror, 1 complete: the shadow resumes from a
    checkpoint of iteration 0 (this seed's losses; asserted below)."""
    d = tmp_path_factory.mktemp("probe-gap")
    synth(d, iterations=3, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16, loss=0.02, seed=3)
    return d


@pytest.mark.parametrize("kind", ["other-model", "wrong-shape", "no-optimizer-state"])
def test_a_resume_checkpoint_that_does_not_fit_is_waited_past_not_fatal(gap_scenario, capsys, caplog, tmp_path,
                                                                       kind):
    """A checkpoint of another model in the --resume directory ended the replay (and a
    daemon) with "starting state lacks parameters [...]", naming no file; one without
    the optimizer state (a model-only save) was stepped on with zeroed Adam moments and
    committed NOT bit-exact. Now each is one warning naming the file, and the shadow
    waits for a checkpoint that fits."""
    import torch
    d = gap_scenario
    ref = torch.load(d / "reference" / "iter_000000.pt", weights_only=True)
    if kind == "other-model":
        ref = {**ref, "model": {"a": torch.zeros(2)}, "optimizer": None}
    elif kind == "wrong-shape":
        k = next(iter(ref["model"]))
        ref = {**ref, "model": {**ref["model"], k: torch.zeros(3)}}
    else:
        ref = {**ref, "optimizer": None}
    resume = tmp_path / "resume"
    resume.mkdir()
    torch.save(ref, resume / "iter_000000.pt")
    with caplog.at_level("WARNING", logger="ckptd"):
        r = ckptd_main(capsys, "replay", "--plan", d / "plan.json", "--init", d / "init.pt", "--resume", resume,
                       "--reference", d / "reference", *_pcaps(d))
    assert "Traceback" not in r.stderr and r.returncode == 3, (r.returncode, r.stderr)
    assert "iteration    0: unrecoverable" in r.stdout  # the gap this test needs
    assert "iteration    1: complete-not-applied" in r.stdout and "NOT bit-exact" not in r.stdout, r.stdout
    warned = [m.getMessage() for m in caplog.records if m.getMessage().startswith("resume: ")]
    assert len(warned) == 1 and str(resume) in warned[0], warned


def test_a_resume_from_the_trainers_own_checkpoint_still_commits(gap_scenario, capsys, tmp_path):
    import shutil
    resume = tmp_path / "resume"
    resume.mkdir()
    shutil.copy(gap_scenario / "reference" / "iter_000000.pt", resume)
    r = ckptd_main(capsys, "replay", "--plan", gap_scenario / "plan.json", "--init", gap_scenario / "init.pt",
                   "--resume", resume, "--reference", gap_scenario / "reference", *_pcaps(gap_scenario))
    assert "iteration    1: committed" in r.stdout and "bit-exact" in r.stdout, r.stdout


def test_an_init_after_a_step_without_optimizer_state_is_refused(gap_scenario, capsys, tmp_path):
    import torch
    doc = torch.load(gap_scenario / "reference" / "iter_000000.pt", weights_only=True)
    init = tmp_path / "model-only.pt"
    torch.save({**doc, "optimizer": None}, init)
    r = ckptd_main(capsys, "replay", "--plan", gap_scenario / "plan.json", "--init", init, *_pcaps(gap_scenario))
    _one_line_error(r, str(init), "holds iteration 0 without optimizer state, which the plan's adamw keeps")


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("probe-two")
    synth(d, iterations=2, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16)
    return d


@pytest.mark.parametrize("step,message", [
    ("vector", "step is a tensor float32[2], not a count of steps"),  # (the checkpoint's own check, session 36)
    ("int64", "step is int64[]; torch's adamw keeps one float step"),
])
def test_an_init_whose_adam_step_is_not_one_float_is_refused(two_iterations, capsys, tmp_path, step, message):
    """A step of two elements raised RuntimeError (a Tensor with 2 elements cannot be
    converted to Scalar), an int64 one RuntimeError from the foreach step's dtype check,
    both at the first iteration applied."""
    import torch
    d = two_iterations
    doc = torch.load(d / "reference" / "iter_000000.pt", weights_only=True)
    k = next(iter(doc["optimizer"]["state"]))
    doc["optimizer"]["state"][k]["step"] = torch.tensor([1.0, 2.0]) if step == "vector" else torch.tensor(1)
    init = tmp_path / f"init-{step}.pt"
    torch.save(doc, init)
    r = ckptd_main(capsys, "replay", "--plan", d / "plan.json", "--init", init, *_pcaps(d))
    _one_line_error(r, str(init), f"optimizer.state.{k}.{message}")


@pytest.mark.parametrize("plan", [True, False], ids=["plan", "no-plan"])
def test_an_lr_tensor_of_several_elements_is_not_exported_as_the_lr(two_iterations, capsys, tmp_path, plan):
    """It went into torch's param_groups as the lr (exit 0): with --plan into every group's,
    without it into the one group's, and into the scheduler's _last_lr either way."""
    import torch
    doc = torch.load(two_iterations / "reference" / "iter_000000.pt", weights_only=True)
    doc["optimizer"]["lr"] = torch.zeros(5)
    f = tmp_path / "lr.pt"
    torch.save(doc, f)
    r = ckptd_main(capsys, "export", f, "--format", "torch", "--out", tmp_path / "x.pt",
                   *(["--plan", two_iterations / "plan.json"] if plan else []))
    _one_line_error(r, str(f), "optimizer.lr is a tensor of 5 elements, not one lr (param group 0's lr in the export)")
    assert not (tmp_path / "x.pt").exists()


def test_mirror_risk_ring_against_the_plans_is_refused(scenario, capsys):
    """--ring was dropped for the plan's rank count without a word; --ports, which
    replaced the plan's without a word, is refused where it disagrees; --packets with a
    plan is a what-if, taken and said (it replaced the schedule's K without a word)."""
    r = ckptd_main(capsys, "mirror-risk", "--plan", scenario / "plan.json", "--ring", "4", "--mirrors", "2",
                   "--loss", "0.1")
    _one_line_error(r, str(scenario / "plan.json"), "--ring 4 disagrees with the plan")
    base = ["mirror-risk", "--plan", scenario / "plan.json", "--mirrors", "2", "--loss", "0.1"]
    r = ckptd_main(capsys, *base, "--ring", "2")
    assert r.returncode == 0 and "--packets" not in r.stdout
    _one_line_error(ckptd_main(capsys, *base, "--ports", "2"), str(scenario / "plan.json"),
                    "--ports 2 disagrees with the plan")
    assert ckptd_main(capsys, *base, "--ports", "1").returncode == 0
    r = ckptd_main(capsys, *base, "--packets", "7")
    assert r.returncode == 0 and "7 allgather packets per link per iteration" in r.stdout
    assert "(--packets; the plan's schedule gives " in r.stdout
    doc = json.loads(ckptd_main(capsys, *base, "--packets", "7", "--json").stdout)
    assert doc["packets_per_link"] == 7 and doc["packets_of_plan"] > 0


def test_a_sample_that_returns_none_is_named(capsys, tmp_path):
    """It said "--transport nccl needs --sample", which had been given (gc.enable returns None)."""
    r = ckptd_main(capsys, "plan", "--model", "test_cli:build_model", "--sample", "gc:enable", "--ranks", "2",
                   "--addr", "10.0.0.1", "--addr", "10.0.0.2", "--out", tmp_path / "p.json")
    _one_line_error(r, None, "--sample 'gc:enable' returned None, not an input batch")
    assert not (tmp_path / "p.json").exists()


def test_demo_names_its_own_seed_option(capsys):
    """demo --seed -1 was refused by the synth parser it hands the seed to ("ckptd synth:
    argument --seed"), naming a command the user did not run."""
    r = ckptd_main(capsys, "demo", "--seed", "-1")
    assert r.returncode == 2 and "ckptd demo: argument --seed: -1 is not in 0..4294967295" in r.stderr \
        and "synth" not in r.stderr


def sparse_embedding():
    import torch
    return torch.nn.Embedding(10, 3, sparse=True)


@pytest.mark.parametrize("sample", [[], ["--sample", "test_probe_cli:sparse_index"]])
def test_plan_of_a_sparse_embedding_is_refused_as_write_plan_refuses_it(capsys, tmp_path, sample):
    """write_plan named the sparse gradients; `ckptd plan` read the buckets of such a model
    and failed inside ("Expected a proper Tensor but got None"), blamed on --sample."""
    r = ckptd_main(capsys, "plan", "--model", "test_probe_cli:sparse_embedding", *sample, "--transport", "gloo",
                   "--ranks", "2", "--addr", "10.0.0.1", "--addr", "10.0.0.2", "--out", tmp_path / "p.json")
    _one_line_error(r, None, "parameter weight has sparse gradients (an Embedding with sparse=True)")
    assert not (tmp_path / "p.json").exists()


def sparse_index():
    import torch
    return torch.tensor([1, 2, 3])


def test_a_servers_control_bytes_never_reach_the_terminal(scenario, capsys):
    """The error line quotes an HTTP server's reason and body: ESC, BEL, NUL and
    backspace in them went to the terminal as they were (a server set its title,
    cleared the screen, hid the real error behind backspaces). They are written as
    escapes."""
    import http.server
    import threading

    class Junk(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(500, "Oops\x1b]0;PWNED\x07")
            self.send_header("Content-Length", "16")
            self.end_headers()
            self.wfile.write(b"\x1b[2Jcleared\x00\x08\x08\x08zz")

        def log_message(self, *args):
            pass
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Junk)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = ckptd_main(capsys, "verify", f"http://127.0.0.1:{srv.server_port}", scenario / "init.pt")
    finally:
        srv.shutdown()
    _one_line_error(r, None, "HTTP 500")
    assert not any(ord(ch) < 32 and ch != "\n" for ch in r.stderr), repr(r.stderr)
    assert "\\x1b]0;PWNED\\x07" in r.stderr and "\\x1b[2Jcleared\\x00\\x08" in r.stderr, r.stderr


@pytest.mark.parametrize("url,message", [
    ("file:///nonexistent-ckptd-dir", "file:///nonexistent-ckptd-dir: no such directory"),
    ("file:///proc/self", "file:///proc/self: holds no manifest.json: no persistence tier writes there"),
    ("zip://x", "zip://x: fsspec only reads zip://, where no persistence tier writes"),
    ("data://x", "data://x: fsspec only reads data://"),
], ids=["missing", "no-manifest", "zip", "data"])
def test_a_tier_url_that_holds_no_tier_says_why(scenario, capsys, url, message):
    """They said "no manifest entry there verifies" (a directory that is not there, one no
    tier wrote), the working directory's name (zip://) or "not enough values to unpack"
    (data://)."""
    r = ckptd_main(capsys, "verify", url, scenario / "init.pt")
    _one_line_error(r, None, message)


@pytest.mark.parametrize("addr,why", [("224.0.0.1", "a multicast address"), ("0.0.0.0", "the unspecified address"),
                                      ("ff02::1", "a multicast address")])
def test_plan_addr_that_is_no_nics_is_refused(capsys, tmp_path, addr, why):
    """A multicast, unspecified or broadcast --addr was written into the plan as a NIC."""
    r = ckptd_main(capsys, "plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                   "--ranks", "2", "--addr", "10.0.0.1", "--addr", addr, "--out", tmp_path / "p.json")
    _one_line_error(r, None, f"argument --addr: {addr} is {why}, not a NIC's")
    assert not (tmp_path / "p.json").exists()


def frozen_linear():
    import torch
    m = torch.nn.Linear(4, 3)
    m.requires_grad_(False)
    return m


def test_plan_without_sample_never_blames_the_sample(capsys, tmp_path):
    """A model DDP refuses (nothing trainable) said "--sample None: a training step of
    --model ... on it raised": no --sample was given and no step ran."""
    r = ckptd_main(capsys, "plan", "--model", "test_probe_cli:frozen_linear", "--transport", "gloo",
                   "--ranks", "2", "--addr", "10.0.0.1", "--addr", "10.0.0.2", "--out", tmp_path / "p.json")
    _one_line_error(r, None, "--model 'test_probe_cli:frozen_linear': DistributedDataParallel around it raised "
                             "RuntimeError: DistributedDataParallel is not needed")
    assert "--sample" not in r.stderr


def test_plan_addr_ipv4_mapped_is_the_ipv4_address(capsys, tmp_path):
    """--addr ::ffff:10.0.0.1 (how a RoCE GID shows an IPv4 address) was a NIC other than
    10.0.0.1: the plan then expected IPv6 frames the wire never carries."""
    r = ckptd_main(capsys, "plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                   "--ranks", "2", "--addr", "10.0.0.1", "--addr", "::ffff:10.0.0.1", "--out", tmp_path / "p.json")
    _one_line_error(r, None, "ranks 0 and 1 share NIC 10.0.0.1")
    r = ckptd_main(capsys, "plan", "--model", "test_cli:build_model", "--sample", "test_cli:sample_batch",
                   "--ranks", "2", "--addr", "::ffff:10.0.0.1", "--addr", "10.0.0.2", "--out", tmp_path / "p.json")
    assert r.returncode == 0, r.stderr
    assert [x["addr"] for x in json.loads((tmp_path / "p.json").read_text())["ranks"]] == ["10.0.0.1", "10.0.0.2"]


def linear_with_float8_buffer():
    import torch
    model = torch.nn.Linear(4, 4)
    model.register_buffer("amax", torch.zeros(3, dtype=torch.float8_e4m3fn))
    return model


def linear_sample():
    import torch
    return torch.randn(2, 4)


@pytest.mark.parametrize("sample", [[], ["--sample", "test_probe_cli:linear_sample"]])
def test_plan_of_a_float8_buffer_names_the_buffer_and_dtype(capsys, tmp_path, sample):
    """DDP's constructor broadcast the float8 buffer and raised torch's "Invalid scalar
    type", which named neither the buffer nor its dtype (a bool buffer got past DDP and was
    named by the plan's own check)."""
    r = ckptd_main(capsys, "plan", "--model", "test_probe_cli:linear_with_float8_buffer", *sample,
                   "--transport", "gloo", "--ranks", "2", "--addr", "10.0.0.1", "--addr", "10.0.0.2",
                   "--out", tmp_path / "p.json")
    _one_line_error(r, None, "buffer amax has dtype float8_e4m3fn: ckptd records float32, float64")
    assert not (tmp_path / "p.json").exists()


def test_kernel_filesystem_reads_the_mount_table(tmp_path):
    """The longest mount point over the path wins, a later mount on the same point is on
    top, a space in a mount point is written \\040, and a path not yet made counts by
    the ancestor that is."""
    from ckptd.core.kernelfs import kernel_filesystem
    d = tmp_path / "my disk"
    (d / "proc").mkdir(parents=True)
    mounts = tmp_path / "mountinfo"
    point = str(d).replace(" ", "\\040")
    mounts.write_text(f"1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
                      f"2 1 0:5 / {point} rw shared:1 - devtmpfs udev rw\n"
                      f"3 2 0:6 / {point} rw - tmpfs tmpfs rw\n"
                      f"4 3 0:7 / {point}/proc rw - proc proc rw\n")
    assert kernel_filesystem(d, str(mounts)) is None  # tmpfs on top of devtmpfs
    assert kernel_filesystem(d / "proc" / "not" / "made", str(mounts)) == "proc"
    assert kernel_filesystem(tmp_path / "my diskette", str(mounts)) is None  # a prefix, not a parent
    assert kernel_filesystem(d, str(tmp_path / "no-mountinfo")) is None


@pytest.mark.parametrize("argv, message", [
    (["replay", "--plan", "{s}/plan.json", "--init", "{s}/init.pt", "--out", "/proc/self", "{s}/mirrors/mirror0.pcap"],
     "/proc/self: cannot keep checkpoints there: it lies on proc, a filesystem of the kernel's, not storage"),
    (["replay", "--plan", "{s}/plan.json", "--init", "{s}/init.pt", "--out", "{t}/ckpt", "--dump-gradients",
      "/proc/self/grads", "{s}/mirrors/mirror0.pcap"], "/proc/self/grads: cannot keep gradient dumps there: it lies on proc"),
])
def test_a_directory_on_a_kernel_filesystem_is_refused_up_front(scenario, tmp_path, capsys, argv, message):
    """replay --out /proc/self said "cannot create iter_000000.pt.tmp: No such file or
    directory" of a directory that exists; under /dev it wrote checkpoints among the device
    nodes, in memory, without a word."""
    from ckptd.core.kernelfs import kernel_filesystem
    if kernel_filesystem("/proc/self") != "proc":
        pytest.skip("this machine's /proc is not the kernel's own filesystem")
    r = ckptd_main(capsys, *[a.format(s=scenario, t=tmp_path) for a in argv])
    _one_line_error(r, None, message)
    assert not (tmp_path / "ckpt").exists()


def test_the_daemons_out_on_a_kernel_filesystem_is_refused_naming_the_key(scenario, tmp_path, capsys):
    from ckptd.core.kernelfs import kernel_filesystem
    if kernel_filesystem("/proc/self") != "proc":
        pytest.skip("this machine's /proc is not the kernel's own filesystem")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"plan: {scenario}/plan.json\ninit: {scenario}/init.pt\nout: /proc/self\n"
                   "interfaces: [{ifname: lo}]\n")
    _one_line_error(ckptd_main(capsys, "run", "--config", cfg, "--check"), f"{cfg}: 'out': /proc/self",
                    "cannot keep checkpoints there: it lies on proc")
