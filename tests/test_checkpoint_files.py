"""Bad checkpoint and capture files: a damaged zip member, a checkpoint of the wrong
structure, a corrupt DCP directory, a full disk, pcapng timestamps past int64 ns. Each is
one CheckpointError / CaptureError naming the file and what in it is wrong (through the
command line: exit 2 and one `error:` line), never a traceback, a wrong checkpoint or a
partial output left behind."""
from __future__ import annotations

import logging
import os
import struct
import subprocess
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptd.core.checkpoint import (CHECKPOINT_FORMAT, CheckpointError, _crc32, diff_checkpoints,
                                   load_checkpoint, save_checkpoint, verify_zip)
from ckptd.core.formats import export_checkpoint
from parsers.frame import CaptureError
from parsers.pcapng import iter_pcapng
from tests.helpers import synth


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ckpt-files")
    synth(d, iterations=1, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16)
    return d


def main(capsys, *argv):
    """`ckptd ARGV` in this process: (exit status, stdout, stderr)."""
    from ckptd.cli import main as cli_main
    capsys.readouterr()
    try:
        rc = cli_main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(result, *parts):
    rc, out, err = result
    assert "Traceback" not in err and rc == 2, (rc, err[-2000:])
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    for p in parts:
        assert str(p) in lines[0], lines[0]
    assert len(out) < 500, out[:500]
    return lines[0]


def small_doc(iteration=0):
    g = torch.Generator().manual_seed(1)
    model = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}
    opt = {"lr": 0.1, "state": {n: {"step": torch.tensor(1.0), "exp_avg": torch.randn(t.shape, generator=g),
                                    "exp_avg_sq": torch.rand(t.shape, generator=g)} for n, t in model.items()}}
    return {"format": CHECKPOINT_FORMAT, "iteration": iteration, "model": model, "optimizer": opt}


def member_data_offset(path: Path, name: str) -> int:
    info = zipfile.ZipFile(path).getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    n, m = struct.unpack_from("<HH", head, 26)
    return info.header_offset + 30 + n + m


def flip_byte(path: Path, offset: int):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def tensor_member(path: Path) -> str:
    return max(zipfile.ZipFile(path).infolist(), key=lambda i: i.file_size).filename


# -- 1. zip members' CRC-32 ----------------------------------------------------------------
def test_the_kernel_crc_is_zips_crc32():
    crc = _crc32()
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    view = memoryview(data)
    for n in (1, 3, 15, 16, 17, 63, 64, 65, 255, 4096, 65537, len(data)):
        for start in (0, 1, 7):
            part = view[start:start + n]
            assert crc(part) == zlib.crc32(part), (start, n)


def test_a_flipped_byte_in_a_tensor_is_refused_naming_file_and_member(tmp_path):
    good = tmp_path / "good.pt"
    torch.save(small_doc(), good)
    verify_zip(good)  # a whole file passes
    assert load_checkpoint(good)["iteration"] == 0
    bad = tmp_path / "bad.pt"
    bad.write_bytes(good.read_bytes())
    member = tensor_member(bad)
    flip_byte(bad, member_data_offset(bad, member) + 100)
    # torch.load alone takes it: a silently wrong checkpoint
    doc = torch.load(bad, weights_only=True)
    assert any(not torch.equal(doc["model"][n], small_doc()["model"][n]) for n in doc["model"]) or \
        any(not torch.equal(doc["optimizer"]["state"][n]["exp_avg"], small_doc()["optimizer"]["state"][n]["exp_avg"])
            for n in doc["model"])
    with pytest.raises(CheckpointError, match="CRC-32") as e:
        load_checkpoint(bad)
    assert str(bad) in str(e.value) and member in str(e.value) and "\n" not in str(e.value)


def test_a_compressed_member_is_checked_through_zipfile(tmp_path):
    src = tmp_path / "src.pt"
    torch.save(small_doc(), src)
    deflated = tmp_path / "deflated.zip"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    verify_zip(deflated)
    member = tensor_member(deflated)
    info = zipfile.ZipFile(deflated).getinfo(member)
    flip_byte(deflated, member_data_offset(deflated, member) + info.compress_size // 2)
    with pytest.raises(CheckpointError) as e:
        verify_zip(deflated)
    assert str(deflated) in str(e.value) and member in str(e.value)


def test_a_member_cut_short_is_refused(tmp_path):
    src = tmp_path / "src.pt"
    torch.save(small_doc(), src)
    data = src.read_bytes()
    torn = tmp_path / "torn.pt"
    torn.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(torn)


def test_replay_with_a_damaged_init_is_one_line(scenario, tmp_path, capsys):
    bad = tmp_path / "init.pt"
    bad.write_bytes((scenario / "init.pt").read_bytes())
    member = tensor_member(bad)
    flip_byte(bad, member_data_offset(bad, member) + 7)
    r = main(capsys, "replay", "--plan", scenario / "plan.json", "--init", bad, "--out", tmp_path / "out",
             *sorted((scenario / "mirrors").glob("*.pcap")))
    one_line_error(r, bad, member, "CRC-32")
    assert not list((tmp_path / "out").glob("*.pt")) if (tmp_path / "out").exists() else True


# -- 2. structure ----------------------------------------------------------------------------
STRUCTURE_CASES = [
    ("optimizer-str", lambda d: d.update(optimizer="x"), "optimizer is a str"),
    ("optimizer-list", lambda d: d.update(optimizer=[1]), "optimizer is a list"),
    ("model-list", lambda d: d.update(model=[1]), "model is a list"),
    ("model-none", lambda d: d.update(model=None), "model is None"),
    ("model-value-int", lambda d: d["model"].update(w=1), "model.w is an int"),
    ("model-key-int", lambda d: d["model"].update({3: torch.zeros(1)}), "model key an int 3"),
    ("state-str", lambda d: d["optimizer"].update(state="x"), "optimizer.state is a str"),
    ("state-missing", lambda d: d["optimizer"].pop("state"), "optimizer.state is None"),
    ("state-entry-int", lambda d: d["optimizer"]["state"].update(w=1), "optimizer.state lacks a dict"),
    ("state-value-str", lambda d: d["optimizer"]["state"]["w"].update(exp_avg="x"),
     "optimizer.state.w.exp_avg is a str"),
    ("lr-str", lambda d: d["optimizer"].update(lr="fast"), "optimizer.lr is a str"),
    ("scaler-str", lambda d: d["optimizer"].update(grad_scaler="x"), "optimizer.grad_scaler is a str"),
    ("iteration-str", lambda d: d.update(iteration="zero"), "iteration must be an integer"),
    ("iteration-float", lambda d: d.update(iteration=1.5), "iteration must be an integer"),
    # a parameter's step count, as a trainer's file is held to (restored, a NaN step made the
    # job's weights NaN at its next step; 100 at iteration 0 bias-corrected Adam wrongly)
    ("step-nan", lambda d: d["optimizer"]["state"]["w"].update(step=torch.tensor(float("nan"))),
     "optimizer.state.w.step is nan, not a count of steps"),
    ("step-negative", lambda d: d["optimizer"]["state"]["b"].update(step=torch.tensor(-3.0)),
     "optimizer.state.b.step is -3.0, not a count of steps"),
    ("step-fraction", lambda d: d["optimizer"]["state"]["w"].update(step=1.5), "optimizer.state.w.step is 1.5"),
    ("step-two-elements", lambda d: d["optimizer"]["state"]["w"].update(step=torch.ones(2)),
     "optimizer.state.w.step is a tensor float32[2], not a count of steps"),
    ("step-past-iteration", lambda d: d["optimizer"]["state"]["w"].update(step=torch.tensor(100.0)),
     "optimizer.state.w.step is 100, more steps than iteration 0 has done (1)"),
]


@pytest.mark.parametrize("name,change,message", STRUCTURE_CASES, ids=[c[0] for c in STRUCTURE_CASES])
def test_a_checkpoint_of_the_wrong_structure_is_refused_naming_the_key(tmp_path, name, change, message):
    doc = small_doc()
    change(doc)
    p = tmp_path / f"{name}.pt"
    torch.save(doc, p)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert str(e.value).startswith(f"{p}: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_the_structure_ckptd_writes_is_accepted(tmp_path, scenario):
    for p in (scenario / "init.pt", *sorted((scenario / "reference").glob("*.pt"))):
        load_checkpoint(p)
    d = small_doc()
    save_checkpoint(tmp_path / "a.pt", 0, d["model"], None)
    save_checkpoint(tmp_path / "b.pt", 0, d["model"], {**d["optimizer"], "grad_scaler": {
        "scale": torch.tensor(2.0 ** 16), "growth_tracker": torch.tensor(0)}})
    assert load_checkpoint(tmp_path / "a.pt")["optimizer"] is None
    assert diff_checkpoints(load_checkpoint(tmp_path / "b.pt"), {**d, "optimizer": {
        **d["optimizer"], "grad_scaler": {"scale": torch.tensor(2.0 ** 16), "growth_tracker": torch.tensor(0)}}}) == []


@pytest.mark.parametrize("name,change,message", [
    ("opt-str", lambda d: d.update(optimizer="x"), "optimizer is a str"),
    ("model-list", lambda d: d.update(model=[1]), "model is a list"),
])
def test_the_commands_refuse_a_wrong_structure_in_one_line(scenario, tmp_path, capsys, name, change, message):
    doc = torch.load(scenario / "init.pt", weights_only=True)
    change(doc)
    p = tmp_path / f"{name}.pt"
    torch.save(doc, p)
    for fmt in ("torch", "safetensors", "dcp"):
        one_line_error(main(capsys, "export", p, "--format", fmt, "--out", tmp_path / f"x-{fmt}"), p, message)
    one_line_error(main(capsys, "verify", p, scenario / "init.pt"), p, message)
    one_line_error(main(capsys, "verify", scenario / "init.pt", p), p, message)
    one_line_error(main(capsys, "replay", "--plan", scenario / "plan.json", "--init", p, "--out", tmp_path / "o",
                        *sorted((scenario / "mirrors").glob("*.pcap"))), p, message)
    assert sorted(q.name for q in tmp_path.iterdir()) == [p.name]


def test_verify_differences_are_short_lines(tmp_path, capsys):
    a, b = small_doc(), small_doc()
    a["optimizer"]["lr"] = torch.full((100, 100), 0.5)  # a tensor against a float
    a["optimizer"]["state"]["w"]["step"] = torch.ones(1)  # against a 0-d tensor: shapes
    b["optimizer"]["state"]["b"]["step"] = 0  # a number against a tensor (1.0)
    b["optimizer"]["state"]["w"]["exp_avg"] = 1.0  # a number against a tensor of many
    b["optimizer"]["extra"] = [torch.zeros(1000)] * 3  # only in one
    a["optimizer"]["extra"] = [torch.ones(1000)] * 3  # lists of tensors: no truth value
    diffs = diff_checkpoints(a, b, limit=0)
    assert len(diffs) == 7, diffs  # (the lists element by element: extra[0] .. extra[2])
    assert all(len(d) < 160 and "\n" not in d for d in diffs), diffs
    assert not any("0.5000" in d or "1., 1." in d for d in diffs), diffs
    for name, doc in (("a.pt", a), ("b.pt", b)):
        torch.save(doc, tmp_path / name)
    rc, out, err = main(capsys, "verify", tmp_path / "a.pt", tmp_path / "b.pt")
    assert rc == 1 and err == "" and len(out) < 1000, out


# -- 3. corrupt DCP directory ---------------------------------------------------------------
def test_a_dcp_directory_with_garbage_metadata_is_one_line(scenario, tmp_path, capsys, caplog):
    bad = tmp_path / "bad.dcp"
    bad.mkdir()
    (bad / ".metadata").write_bytes(os.urandom(16) + b"garbage" * 20)
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(CheckpointError, match="cannot read DCP checkpoint") as e:
            load_checkpoint(bad)
    assert str(bad) in str(e.value) and ".metadata" in str(e.value) and "\n" not in str(e.value)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    one_line_error(main(capsys, "verify", bad, scenario / "init.pt"), bad, "cannot read DCP checkpoint")
    one_line_error(main(capsys, "export", bad, "--format", "torch", "--out", tmp_path / "x.pt"), bad)
    one_line_error(main(capsys, "replay", "--plan", scenario / "plan.json", "--init", bad, "--out", tmp_path / "o",
                        *sorted((scenario / "mirrors").glob("*.pcap"))), bad)
    # other code's records still pass the root logger
    with caplog.at_level(logging.WARNING):
        logging.getLogger().warning("still logged")
    assert [r.getMessage() for r in caplog.records] == ["still logged"]


def test_a_dcp_export_goes_whole_into_place(tmp_path):
    src = small_doc()
    empty = tmp_path / "empty.dcp"
    empty.mkdir()
    for out in (tmp_path / "new.dcp", empty):
        export_checkpoint(src, out, "dcp")
        assert diff_checkpoints(load_checkpoint(out), src) == []
    assert sorted(q.name for q in tmp_path.iterdir()) == ["empty.dcp", "new.dcp"]


# -- 4. full disk ---------------------------------------------------------------------------
@pytest.fixture
def full_disk(tmp_path):
    d = tmp_path / "full"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


def big_doc():
    d = small_doc()
    d["model"]["big"] = torch.randn(256, 256)  # 256 KiB: more than the disk
    return d


def test_a_full_disk_says_so_and_leaves_nothing(full_disk, tmp_path, capsys):
    d = big_doc()
    src = tmp_path / "src.pt"
    save_checkpoint(src, 0, d["model"], d["optimizer"])
    with pytest.raises(OSError) as e:
        save_checkpoint(full_disk / "iter_000000.pt", 0, d["model"], d["optimizer"])
    assert "No space left on device" in str(e.value) and str(full_disk / "iter_000000.pt") in str(e.value)
    assert e.value.errno == 28 and "enforce fail" not in str(e.value)
    for fmt, out in (("torch", full_disk / "x.pt"), ("safetensors", full_disk / "x.st"),
                     ("dcp", full_disk / "x.dcp"), ("dcp", full_disk / "x.dcp")):  # a retry: the same
        line = one_line_error(main(capsys, "export", src, "--format", fmt, "--out", out), out,
                              "No space left on device")
        assert "enforce fail" not in line and "not an empty directory" not in line
        assert list(full_disk.iterdir()) == []


def test_replay_to_a_full_disk_says_no_space(full_disk, scenario, capsys):
    r = main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
             "--out", full_disk / "ck", *sorted((scenario / "mirrors").glob("*.pcap")))
    rc, out, err = r
    assert "Traceback" not in err and rc != 0, err
    assert "No space left on device" in err and "enforce fail" not in err, err
    assert str(full_disk / "ck" / "iter_000000.pt") in err, err
    assert [q.name for q in (full_disk / "ck").iterdir()] == []


# -- 5. pcapng timestamps past int64 ns -------------------------------------------------------
def _block(btype, body):
    body += b"\0" * (-len(body) % 4)
    return struct.pack("<II", btype, len(body) + 12) + body + struct.pack("<I", len(body) + 12)


def _opt(code, value):
    return struct.pack("<HH", code, len(value)) + value + b"\0" * (-len(value) % 4)


def pcapng(ticks: list[int], tsresol: int = 6, tsoffset: int | None = None) -> bytes:
    opts = _opt(9, bytes([tsresol])) + (_opt(14, struct.pack("<q", tsoffset)) if tsoffset is not None else b"")
    blocks = [_block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1)),
              _block(1, struct.pack("<HHI", 1, 0, 0) + opts + _opt(0, b""))]
    for t in ticks:
        data = b"\x02" * 60
        blocks.append(_block(6, struct.pack("<IIIII", 0, t >> 32, t & 0xFFFFFFFF, len(data), len(data)) + data))
    return b"".join(blocks)


TS_CASES = [
    ("huge-offset", dict(tsoffset=1 << 62), [1, 2]),
    ("negative-offset", dict(tsoffset=-(1 << 40)), [1_700_000_000_000_000, 1_700_000_000_000_001]),
    ("seconds-ticks", dict(tsresol=0), [5, (1 << 64) - 1]),
    ("nanoseconds-past-int64", dict(tsresol=9), [5, 1 << 63]),
]


@pytest.mark.parametrize("name,iface,ticks", TS_CASES, ids=[c[0] for c in TS_CASES])
def test_a_pcapng_timestamp_past_int64_ns_is_a_capture_error(tmp_path, name, iface, ticks):
    from ckptd.fast.batches import load_capture, stream_batches
    p = tmp_path / f"{name}.pcapng"
    p.write_bytes(pcapng(ticks, **iface))
    bad_frame = 1 if iface.get("tsoffset") else 2
    with pytest.raises(CaptureError) as e, open(p, "rb") as f:
        list(iter_pcapng(f, str(p)))
    msg = str(e.value)
    assert msg.startswith(f"{p}: block {2 + bad_frame} (frame {bad_frame}): timestamp"), msg
    assert "2**63-1" in msg and "\n" not in msg
    # the fast path's batches (int64 ns) get the error, not an OverflowError
    batch, error = load_capture(str(p))
    assert error == msg and len(batch) == bad_frame - 1
    errors: list[str] = []
    frames = sum(len(b) for b in stream_batches([str(p)], errors=errors))
    assert errors == [msg] and frames == bad_frame - 1


def test_pcapng_timestamps_up_to_int64_max_are_kept(tmp_path):
    p = tmp_path / "edge.pcapng"
    p.write_bytes(pcapng([0, (1 << 63) - 1], tsresol=9))
    with open(p, "rb") as f:
        assert [fr.ts_ns for fr in iter_pcapng(f, str(p))] == [0, (1 << 63) - 1]
    p.write_bytes(pcapng([10], tsresol=6, tsoffset=-1))  # 1970 less a second plus 10 us: negative
    with pytest.raises(CaptureError, match="outside 0..2"), open(p, "rb") as f:
        list(iter_pcapng(f, str(p)))


def test_ctrl_c_mid_write_leaves_no_temporary_and_says_so(tmp_path, monkeypatch, capsys):
    """SIGINT during a checkpoint's write left NAME.tmp behind and ckptd ended without a word."""
    from ckptd.cli import main
    from ckptd.core.checkpoint import atomic_write

    def half(f):
        f.write(b"x" * 1000)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "iter_000003.pt", half)
    assert list(tmp_path.iterdir()) == []

    def interrupted(a):
        raise KeyboardInterrupt
    monkeypatch.setattr("ckptd.cli.cmd_verify", interrupted)
    assert main(["verify", str(tmp_path / "a"), str(tmp_path / "b")]) == 130
    assert capsys.readouterr().err.strip() == ("ckptd: interrupted; the files written before are whole, "
                                                "none is left half-written")
