"""Edge cases found in review: the HTTP server's head limit is exact and bare-LF heads
are answered at once; `ckptd replay` reports a damaged capture on stderr."""
from __future__ import annotations

import shutil
import socket
import struct
import time
from pathlib import Path

import pytest

from ckptd.cli import main
from ckptd.live.serve import MAX_HEAD, HttpServer, Response

from helpers import pcaps, synth


@pytest.fixture
def server():
    srv = HttpServer({"/hello": lambda _, __: Response(200, b"hello")}, "127.0.0.1", 0,
                     max_connections=8, read_timeout_s=2, workers=2).start()
    yield srv
    srv.stop()


def ask(server, *pieces: bytes) -> bytes:
    """Send the pieces (a pause between them, so the server mostly reads each on its own)
    and return the response's status line."""
    s = socket.create_connection(server.address)
    s.settimeout(5)
    try:
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(0.1)
            s.sendall(piece)
        got = b""
        while b"\r\n" not in got:
            more = s.recv(4096)
            if not more:
                break
            got += more
        return got.split(b"\r\n", 1)[0]
    finally:
        s.close()


def head_of(size: int, eol: bytes = b"\r\n") -> bytes:
    """A GET /hello head of exactly `size` bytes, its blank line included."""
    start = b"GET /hello HTTP/1.1" + eol + b"X-Pad: "
    pad = size - len(start) - 2 * len(eol)
    return start + b"a" * pad + eol + eol


@pytest.mark.parametrize("extra", [1, 100, 4000])
def test_a_head_over_the_limit_is_431_whatever_the_recv_boundaries(server, extra):
    head = head_of(MAX_HEAD + extra)
    assert ask(server, head) == b"HTTP/1.1 431 Request Header Fields Too Large"
    # the blank line alone arriving past the limit, in a recv of its own
    assert ask(server, head[:-4], head[-4:]).startswith(b"HTTP/1.1 431")


def test_a_head_of_exactly_the_limit_is_served(server):
    assert ask(server, head_of(MAX_HEAD)) == b"HTTP/1.1 200 OK"
    assert ask(server, head_of(MAX_HEAD, b"\n")) == b"HTTP/1.1 200 OK"


@pytest.mark.parametrize("pieces", [
    [b"GET /hello HTTP/1.1\n\n"],
    [b"GET /hello HTTP/1.1\nHost: x\n\n"],
    [b"GET /hello HTTP/1.1\r\nHost: x\n\r\n"],  # mixed
    [b"GET /hello HTTP/1.1\n", b"Host: x\n", b"\n"],  # typed line by line
    [b"GET /hello HTTP/1.1\r\nHost: x\r", b"\n\r", b"\n"],  # CRLFCRLF cut across recvs
])
def test_bare_lf_heads_are_answered_at_once(server, pieces):
    status = ask(server, *pieces)
    assert status == b"HTTP/1.1 200 OK"
    assert server.timed_out == 0  # answered, not left to the read timeout


def test_a_bare_cr_in_the_head_is_400_at_once(server):
    status = ask(server, b"GET /hello HTTP/1.1\r\nX-A: b\rc\r\n\r\n")
    assert status == b"HTTP/1.1 400 Bad Request" and server.timed_out == 0


# -- ckptd replay on damaged captures -------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("damaged")
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, iterations=4, mirrors=3, wrap_mirrors=True)
    return d


def record_offset(data: bytes, frame: int) -> int:
    """Where frame `frame` (from 1) of a little-endian pcap starts."""
    off = 24
    for _ in range(frame - 1):
        off += 16 + struct.unpack_from("<I", data, off + 8)[0]
    return off


def cut_inside(path: Path, frame: int):
    data = path.read_bytes()
    off = record_offset(data, frame)
    path.write_bytes(data[:off + 16 + struct.unpack_from("<I", data, off + 8)[0] // 2])


def break_length(path: Path, frame: int):
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, record_offset(data, frame) + 8, 0x7FFFFFFF)
    path.write_bytes(bytes(data))


def cut_every_mirror_after_iteration_1(run, tmp_path):
    """tmp_path/mirrors: every mirror cut inside the record header after iteration 1's
    last frame; tmp_path/plan.json: the plan without its iteration count."""
    import json
    from parsers.capfile import open_capture
    frames = list(open_capture(str(run / "mirrors" / "mirror0.pcap")))
    gaps = sorted((b.ts_ns - a.ts_ns, b.index) for a, b in zip(frames, frames[1:]))
    boundary = sorted(f for _, f in gaps[-3:])[1]  # the pause before iteration 2's first frame
    mirrors = tmp_path / "mirrors"
    shutil.copytree(run / "mirrors", mirrors)
    for p in mirrors.iterdir():
        data = p.read_bytes()
        p.write_bytes(data[:record_offset(data, boundary) + 8])  # a cut record header
    doc = json.loads((run / "plan.json").read_text())
    assert doc.pop("iterations") == 4
    (tmp_path / "plan.json").write_text(json.dumps(doc))


def replay(run, out: Path, paths: list[str], *extra: str) -> int:
    return main(["replay", "--plan", str(run / "plan.json"), "--init", str(run / "init.pt"),
                 "--out", str(out), "--reference", str(run / "reference"), *extra, *paths])


@pytest.mark.parametrize("path", [[], ["--reference-path"]])
def test_a_damaged_mirror_is_a_warning_on_stderr_when_the_others_recover_everything(
        run, tmp_path, capsys, path):
    mirrors = tmp_path / "mirrors"
    shutil.copytree(run / "mirrors", mirrors)
    cut_inside(mirrors / "mirror1.pcap", 801)
    break_length(mirrors / "mirror2.pcap", 1201)
    assert replay(run, tmp_path / "out", pcaps(tmp_path), *path) == 0
    out, err = capsys.readouterr()
    assert "4 iterations, 4 committed, 0 not recovered" in out and out.count("bit-exact") == 4
    assert "mirror1.pcap" not in out and "mirror2.pcap" not in out  # diagnostics are not results
    lines = sorted(err.splitlines())  # one line per damaged file, naming it and the frame
    assert len(lines) == 2
    assert lines[0].startswith(f"warning: {mirrors / 'mirror1.pcap'}: frame 801: record truncated")
    assert lines[1].startswith(f"warning: {mirrors / 'mirror2.pcap'}: frame 1201: captured length 2147483647")


def test_data_lost_in_every_mirror_is_exit_3_with_the_warnings_on_stderr(run, tmp_path, capsys):
    mirrors = tmp_path / "mirrors"
    shutil.copytree(run / "mirrors", mirrors)
    for p in mirrors.iterdir():
        cut_inside(p, 1001)
    assert replay(run, tmp_path / "out", pcaps(tmp_path)) == 3
    out, err = capsys.readouterr()
    assert "iteration    2: unrecoverable" in out and "2 not recovered (2, 3)" in out
    lines = sorted(err.splitlines())
    assert len(lines) == 3
    for k, line in enumerate(lines):
        assert line.startswith(f"warning: {mirrors / f'mirror{k}.pcap'}: frame 1001: record truncated")


def test_every_mirror_cut_at_an_iteration_boundary_is_exit_3_without_an_iteration_count(
        run, tmp_path, capsys):
    """Cut after iteration 1's last frame, every iteration seen is whole; with the plan's
    iteration count the lost ones are named, and without it the damage on every mirror
    says the job's end is unknown (exit 0 before)."""
    cut_every_mirror_after_iteration_1(run, tmp_path)
    assert replay(run, tmp_path / "out", pcaps(tmp_path)) == 3
    out = capsys.readouterr().out
    assert "4 iterations, 2 committed, 2 not recovered (2, 3)" in out
    assert main(["replay", "--plan", str(tmp_path / "plan.json"), "--init", str(run / "init.pt"),
                 *pcaps(tmp_path)]) == 3
    out, err = capsys.readouterr()
    assert "2 iterations, 2 committed, 0 not recovered" in out
    assert "every capture ends at damage (warnings on stderr): what the job did after iteration 1 " \
           "is not in them" in out
    assert len(err.splitlines()) == 3 and "record header truncated" in err


@pytest.mark.parametrize("path", [[], ["--reference-path"]])
def test_the_damage_verdict_does_not_depend_on_how_the_reader_words_it(run, tmp_path, capsys, monkeypatch, path):
    """The reader's messages reworded (here: no longer led by the file's path), replay's
    exit status and summary for captures that all end at damage are the same: it knew
    which files were damaged by matching "<path>: " at the start of each message."""
    import ckptd.fast.batches
    import ckptd.pipeline
    from parsers.capfile import CaptureError, open_capture

    def reworded(path, warn=None):
        try:
            yield from open_capture(path, warn)
        except CaptureError as e:
            raise CaptureError(f"damaged capture ({str(e).split(': ', 1)[1]}) in {path}") from None
    monkeypatch.setattr(ckptd.pipeline, "open_capture", reworded)
    monkeypatch.setattr(ckptd.fast.batches, "open_capture", reworded)
    cut_every_mirror_after_iteration_1(run, tmp_path)
    assert main(["replay", "--plan", str(tmp_path / "plan.json"), "--init", str(run / "init.pt"),
                 *path, *pcaps(tmp_path)]) == 3
    out, err = capsys.readouterr()
    assert "2 iterations, 2 committed, 0 not recovered" in out
    assert "every capture ends at damage (warnings on stderr): what the job did after iteration 1 " \
           "is not in them" in out
    assert len(err.splitlines()) == 3 and err.count("warning: damaged capture (frame ") == 3, err


def test_intact_captures_print_nothing_on_stderr(run, tmp_path, capsys):
    assert replay(run, tmp_path / "out", pcaps(run)) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.count("bit-exact") == 4
