"""Leftovers of the command-line probe (tests/test_probe_cli.py): each exits 2 with one
`error:` line naming the culprit (option, file, interface), or warns once, never a
traceback, two lines for one cause, or a silently wrong result."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.helpers import synth
from tests.test_bad_input import _one_line_error, ckptd_main


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("leftovers")
    synth(d, iterations=2, ranks=2, channels=1, mirrors=1, bucket_cap_kb=16)
    return d


def _pcaps(d: Path) -> list[Path]:
    return sorted((d / "mirrors").glob("*.pcap"))


# -- synth --mirrors past the switch ports ------------------------------------------------------
_SYNTH = ["synth", "--model", "tiny", "--iterations", "1", "--channels", "1"]


@pytest.mark.parametrize("extra,message", [
    (["--ranks", "2", "--mirrors", "3"], "--mirrors 3: the job has 2 switch port(s) to mirror (--ranks 2); "
                                         "give at most 2"),
    (["--ranks", "2", "--merged-nics", "2", "--nccl-version", "2.24", "--mirrors", "5"],
     "--mirrors 5: the job has 4 switch port(s) to mirror (--ranks 2 x --merged-nics 2)"),
    (["--nodes", "2", "--gpus-per-node", "2", "--mirrors", "5"],
     "--mirrors 5: the job has 4 switch port(s) to mirror (--nodes 2 x 2 NIC(s) a node)"),
    (["--nodes", "2", "--gpus-per-node", "2", "--nics-per-node", "1", "--mirrors", "3"],
     "--mirrors 3: the job has 2 switch port(s)"),
    (["--nodes", "2", "--gpus-per-node", "1", "--nics-per-node", "2", "--mirrors", "1"],
     "--nics-per-node 2 is more than --gpus-per-node 1"),
], ids=["ranks", "merged-nics", "nodes", "nics-per-node", "more-nics-than-gpus"])
def test_synth_mirrors_past_the_switch_ports_are_refused(capsys, tmp_path, extra, message):
    """Mirror k past the ports wrapped to the port of mirror k - ports: --mirrors 3 over
    2 ranks wrote mirror2.pcap, a second copy of rank 0's port, exit 0. More NICs than
    GPUs was refused by the plan check naming ranks[0].nics[1], no option."""
    out = tmp_path / "out"
    _one_line_error(ckptd_main(capsys, *_SYNTH, *extra, "--out", out), None, message)
    assert not out.exists()


def test_the_python_api_refuses_mirrors_past_the_ports_as_the_command_does(tmp_path):
    """synthesize(SynthOptions(...)) wrapped mirror 2 of 2 ranks onto rank 0's port (only
    `ckptd synth` refused it); now the one check is check_options', and wrap_mirrors asks
    for the second copy on purpose."""
    from ckptd.testing.synth import SynthOptionError, SynthOptions, synthesize
    out = tmp_path / "out"
    opts = dict(model="tiny", iterations=1, channels=1, ranks=2, mirrors=3)
    with pytest.raises(SynthOptionError) as e:
        synthesize(SynthOptions(out=str(out), **opts))
    assert str(e.value) == "--mirrors 3: the job has 2 switch port(s) to mirror (--ranks 2); give at most 2"
    assert not out.exists()
    synthesize(SynthOptions(out=str(out), wrap_mirrors=True, **opts))
    doc = json.loads((out / "plan.json").read_text())
    assert [(m["name"], m["rank"]) for m in doc["mirrors"]] == [("mirror0", 0), ("mirror1", 1), ("mirror2", 0)]


@pytest.mark.parametrize("extra,mirrors", [
    (["--ranks", "2", "--mirrors", "2"], [(0, 0), (1, 0)]),
    (["--nodes", "2", "--gpus-per-node", "2", "--mirrors", "4"], [(0, 0), (1, 0), (2, 0), (3, 0)]),
    (["--ranks", "2", "--merged-nics", "2", "--nccl-version", "2.24", "--mirrors", "4"],
     [(0, 0), (0, 1), (1, 0), (1, 1)]),
], ids=["ranks", "nodes", "merged-nics"])
def test_synth_mirrors_up_to_the_ports_are_each_a_port_of_their_own(capsys, tmp_path, extra, mirrors):
    out = tmp_path / "out"
    r = ckptd_main(capsys, *_SYNTH, *extra, "--out", out)
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "plan.json").read_text())
    assert [(m["rank"], m.get("port", 0)) for m in doc["mirrors"]] == mirrors


# -- pcapng interfaces of a link type ckptd does not decode ---------------------------------------
def _pcap_frames(path: Path) -> list[tuple[int, bytes]]:
    """(time in us, data) of every record of a little-endian microsecond pcap."""
    raw = path.read_bytes()
    out, off = [], 24
    while off < len(raw):
        sec, usec, caplen, _ = struct.unpack("<IIII", raw[off:off + 16])
        out.append((sec * 1_000_000 + usec, raw[off + 16:off + 16 + caplen]))
        off += 16 + caplen
    return out


def _block(btype: int, body: bytes) -> bytes:
    body += b"\0" * (-len(body) % 4)
    return struct.pack("<II", btype, len(body) + 12) + body + struct.pack("<I", len(body) + 12)


def _pcapng(frames, linktypes: list[int], on=lambda k: 0, extra=()) -> bytes:
    """A pcapng file: one section, an interface per link type (microseconds), frame k
    on interface on(k); `extra` (interface, time, data) frames after them."""
    blocks = [_block(0x0A0D0D0A, struct.pack("<IHHq", 0x1A2B3C4D, 1, 0, -1))]
    blocks += [_block(1, struct.pack("<HHI", lt, 0, 0)) for lt in linktypes]
    for k, (t, data) in enumerate(frames):
        blocks.append(_block(6, struct.pack("<IIIII", on(k), t >> 32, t & 0xFFFFFFFF, len(data), len(data)) + data))
    for iface, t, data in extra:
        blocks.append(_block(6, struct.pack("<IIIII", iface, t >> 32, t & 0xFFFFFFFF, len(data), len(data)) + data))
    return b"".join(blocks)


REPLAY_PATHS = [[], ["--reference-path"]]


@pytest.mark.parametrize("argv", [
    lambda d, f: ["inspect", f],
    lambda d, f: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", f],
    lambda d, f: ["replay", "--plan", d / "plan.json", "--init", d / "init.pt", "--reference-path", f],
], ids=["inspect", "replay", "replay-reference-path"])
@pytest.mark.parametrize("linktypes", [[147], [147, 148]], ids=["one-interface", "two-interfaces"])
def test_a_pcapng_of_interfaces_ckptd_does_not_decode_is_named(scenario, capsys, tmp_path, argv, linktypes):
    """Every frame on an interface of link type 147 (USER0) was "other": inspect exited 0
    and replay 2 with "hold no iteration of the job" (fast path and reference path
    alike), naming neither the interface nor its link type, as a classic pcap of link
    type 147 is (tests/test_probe_cli.py)."""
    f = tmp_path / "user0.pcapng"
    f.write_bytes(_pcapng(_pcap_frames(_pcaps(scenario)[0]), linktypes, on=lambda k: k % len(linktypes)))
    _one_line_error(ckptd_main(capsys, *argv(scenario, f)), str(f),
                    "interface 0 (block 2): link type 147 is not one ckptd decodes (1 Ethernet")


def test_a_pcapng_of_only_undecoded_interfaces_and_no_packet_is_refused(scenario, capsys, tmp_path):
    f = tmp_path / "empty.pcapng"
    f.write_bytes(_pcapng([], [147]))
    _one_line_error(ckptd_main(capsys, "inspect", f), str(f), "no interface in the file is of one")


@pytest.mark.parametrize("path", REPLAY_PATHS, ids=["fast", "reference-path"])
def test_a_pcapng_mixing_interfaces_replays_with_one_warning_per_other_one(scenario, capsys, caplog, tmp_path,
                                                                         path):
    """One file may hold interfaces of several link types (dumpcap -i eth0 -i nflog):
    the Ethernet one's frames replay, and each other one is named once in a warning
    (its frames were "other" without a word)."""
    frames = _pcap_frames(_pcaps(scenario)[0])
    t = frames[-1][0]
    f = tmp_path / "mixed.pcapng"
    f.write_bytes(_pcapng(frames, [1, 147, 1, 148], extra=[(1, t, b"x" * 60), (1, t, b"y" * 60),
                                                          (3, t, b"z" * 60)]))
    with caplog.at_level("WARNING", logger="ckptd"):
        r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt", *path, f)
    assert r.returncode == 0 and "2 committed" in r.stdout, (r.returncode, r.stdout, r.stderr)
    warned = [m.getMessage() for m in caplog.records]
    assert warned == [f"{f}: interface 1 (block 3): link type 147 is not one ckptd decodes (1 Ethernet, 101 raw IP, "
                      "113 Linux SLL, 228 IPv4, 229 IPv6, 276 Linux SLL2): its frames are read as other traffic",
                      f"{f}: interface 3 (block 5): link type 148 is not one ckptd decodes (1 Ethernet, 101 raw IP, "
                      "113 Linux SLL, 228 IPv4, 229 IPv6, 276 Linux SLL2): its frames are read as other traffic"]
    # on the terminal as the command's own warnings are (it was the bare message)
    assert [line for line in r.stderr.splitlines() if "link type" in line] == [f"warning: {m}" for m in warned]


def test_inspect_of_a_mixed_pcapng_warns_once(scenario, capsys, caplog, tmp_path):
    """inspect reads the files twice where they hold frames other than RoCE (its TCP
    pass): the interface was warned of twice."""
    frames = _pcap_frames(_pcaps(scenario)[0])
    f = tmp_path / "mixed.pcapng"
    f.write_bytes(_pcapng(frames, [1, 147], extra=[(1, frames[-1][0], b"x" * 60)]))
    with caplog.at_level("WARNING", logger="ckptd"):
        r = ckptd_main(capsys, "inspect", f)
    assert r.returncode == 0, r.stderr
    warned = [m.getMessage() for m in caplog.records]
    assert len(warned) == 1 and warned[0].startswith(f"{f}: interface 1 (block 3): link type 147"), warned


def test_the_pcapng_reader_warns_once_per_interface_of_each_section(tmp_path):
    from parsers.capfile import open_capture
    from parsers.pcapng import iter_pcapng
    one = _pcapng([(1, b"a" * 60), (2, b"b" * 60), (3, b"c" * 60)], [1, 147], on=lambda k: min(k, 1))
    f = tmp_path / "two-sections.pcapng"
    f.write_bytes(one + one)
    said: list[str] = []
    with open(f, "rb") as fh:
        frames = list(iter_pcapng(fh, str(f), warn=said.append))
    assert [(fr.interface_id, fr.linktype) for fr in frames] == [(0, 1), (1, 147), (1, 147)] * 2
    assert len(said) == 2 and "interface 1 (block 3)" in said[0] and "interface 1 (block 9, section 2)" in said[1]
    assert len(list(open_capture(f))) == 6


# -- replay --join-from where nothing joins -------------------------------------------------------
@pytest.mark.parametrize("path", REPLAY_PATHS, ids=["fast", "reference-path"])
def test_a_join_that_joins_nothing_is_one_error_line(scenario, capsys, path):
    """stderr had two lines for one cause: "warning: joining: no flow of the job was
    recognised, no iteration joined", then "error: the captures ... hold no iteration
    of the job"."""
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                   "--join-from", "1", *path, *_pcaps(scenario))
    _one_line_error(r, str(scenario / "plan.json"),
                    "--join-from 1: no flow of the job in ")
    assert "so no iteration was joined" in r.stderr and "1 is not an iteration the job had reached" in r.stderr
    assert "the flows left unmatched are listed above" in r.stderr and "unmatched flow: " in r.stdout
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                   "--join-from", "0", *path, *_pcaps(scenario))
    assert r.returncode == 0 and r.stderr == "" and "joined at iteration 0" in r.stdout, r.stderr
    # past the plan's job: refused before a frame is read (it printed "joined at iteration
    # 524290" and the iterations past the job's end, then refused them)
    r = ckptd_main(capsys, "replay", "--plan", scenario / "plan.json", "--init", scenario / "init.pt",
                   "--join-from", "524288", *path, *_pcaps(scenario))
    _one_line_error(r, str(scenario / "plan.json"), "--join-from 524288: the job of the plan ")
    assert "has 2 iterations (0..1)" in r.stderr and r.stdout == ""


# -- checkpoints whose lr is not a finite number >= 0 -------------------------------------------------
@pytest.mark.parametrize("lr,shown", [
    (float("nan"), "nan"), (float("inf"), "inf"), (-1.0, "-1.0"), (10 ** 400, "an integer of 1329 bits"),
    ("tensor-nan", "nan"),
], ids=["nan", "inf", "negative", "huge-int", "nan-tensor"])
@pytest.mark.parametrize("argv", [
    lambda d, f: ["export", f, "--format", "torch", "--plan", d / "plan.json", "--out", d / "x.pt"],
    lambda d, f: ["export", f, "--format", "torch", "--out", d / "x.pt"],
    lambda d, f: ["export", f, "--format", "safetensors", "--out", d / "x.safetensors"],
    lambda d, f: ["verify", f, d / "init.pt"],
    lambda d, f: ["replay", "--plan", d / "plan.json", "--init", f, *_pcaps(d)],
], ids=["export-torch-plan", "export-torch", "export-safetensors", "verify", "replay-init"])
def test_a_checkpoint_whose_lr_is_not_finite_is_refused_naming_the_file(scenario, capsys, tmp_path, lr, shown, argv):
    """export wrote the NaN (or inf, or -1) into torch's param_groups and exited 0; the
    plan checks its own lr (finite, >= 0), a checkpoint's was taken as it was."""
    import torch
    doc = torch.load(scenario / "reference" / "iter_000000.pt", weights_only=True)
    doc["optimizer"]["lr"] = torch.tensor(float("nan")) if lr == "tensor-nan" else lr
    f = tmp_path / "lr.pt"
    torch.save(doc, f)
    _one_line_error(ckptd_main(capsys, *argv(scenario, f)), str(f),
                    f"optimizer.lr is {shown}, not a finite lr >= 0: a damaged checkpoint")
    assert not (scenario / "x.pt").exists() and not (scenario / "x.safetensors").exists()


@pytest.mark.parametrize("lr", ["NaN", "Infinity", "-1"])
def test_a_raw_checkpoint_header_whose_lr_is_not_finite_is_refused(lr):
    """JSON takes NaN and Infinity: restore from the daemon put them in param_groups."""
    from ckptd.core.checkpoint import CheckpointError
    from ckptd.core.raw_layout import decode_header
    line = ('{"format": "ckptd-raw/1", "iteration": 0, "lr": %s, "optimizer": true, "tensors": []}' % lr).encode()
    with pytest.raises(CheckpointError, match="not a finite lr >= 0"):
        decode_header(line, "http://x/checkpoint")
    assert decode_header(line.replace(lr.encode(), b"0.001"), "u")["lr"] == 0.001


# -- mirror-risk with uneven nodes ------------------------------------------------------------------
@pytest.fixture(scope="module")
def five(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("risk5")
    synth(d, iterations=1, ranks=5, channels=2, mirrors=1)
    return d


def _with_nodes(d: Path, nodes: str, name: str, rings=None) -> Path:
    doc = json.loads((d / "plan.json").read_text())
    for r, n in zip(doc["ranks"], nodes):
        r["node"] = n
    assert doc["ring"]["rings"] == [list(range(5))] * 2
    if rings:
        doc["ring"]["rings"] = rings
    p = d / f"plan-{name}.json"
    p.write_text(json.dumps(doc))
    return p


def _risk(capsys, *argv):
    r = ckptd_main(capsys, "mirror-risk", "--mirrors", "8", "--loss", "0.01", "--json", *argv)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_mirror_risk_of_uneven_nodes_is_that_of_any_split(five, capsys):
    """5 ranks on 2 nodes: the copies of each chunk depend only on the mirrored links
    being distinct, so the nodes of 3+2 (--ring 5 --nodes 2), of 1+4 and of 3+2 in a
    plan give one P_fail."""
    by_hand = _risk(capsys, "--ring", "5", "--nodes", "2", "--packets", "56")
    assert by_hand["nodes"] == 2 and by_hand["mirrored_links"] == 2
    for nodes in ("aaabb", "abbbb"):
        res = _risk(capsys, "--plan", _with_nodes(five, nodes, nodes), "--packets", "56")
        assert res["nodes"] == 2 and res["mirrorable_links"] == 2
        assert res["chunks_by_copies"] == by_hand["chunks_by_copies"] == {"1": 2, "2": 3}
        assert res["p_fail"] == by_hand["p_fail"]


def test_mirror_risk_names_a_plans_nodes_not_its_hops(five, capsys):
    """Nodes a, b, a, b, a: the ring crosses between them 4 times. It said "ring of 5
    ranks on 4 nodes" (JSON nodes 4), the hops taken for the nodes."""
    plan = _with_nodes(five, "ababa", "interleaved")
    r = ckptd_main(capsys, "mirror-risk", "--plan", plan, "--mirrors", "8", "--loss", "0.01")
    assert r.returncode == 0 and "ring of 5 ranks on 2 nodes (4 hops between nodes can be mirrored)" in r.stdout, \
        r.stdout
    res = _risk(capsys, "--plan", plan)
    assert (res["nodes"], res["mirrorable_links"]) == (2, 4)


def test_mirror_risk_nodes_against_the_plans_are_refused(five, capsys):
    """--nodes replaced the plan's hops without a word: nodes a,b,a,b,a (4 hops) with
    --nodes 3 was taken as 3 hops, and --nodes 2 (the plan's own count) as 2, not 4."""
    plan = _with_nodes(five, "ababa", "interleaved-nodes")
    r = ckptd_main(capsys, "mirror-risk", "--plan", plan, "--nodes", "3", "--mirrors", "8", "--loss", "0.01")
    _one_line_error(r, str(plan), "--nodes 3 disagrees with the plan")
    assert r.stderr.rstrip().endswith("(2 nodes): give one of them"), r.stderr
    res = _risk(capsys, "--plan", plan, "--nodes", "2")  # agreeing: the plan's hops stand
    assert (res["nodes"], res["mirrorable_links"]) == (2, 4) and res == _risk(capsys, "--plan", plan)
    # one-GPU hosts: the plan's 5 ranks are 5 nodes
    r = ckptd_main(capsys, "mirror-risk", "--plan", five / "plan.json", "--nodes", "2", "--mirrors", "8",
                   "--loss", "0.01")
    _one_line_error(r, str(five / "plan.json"), "--nodes 2 disagrees with the plan")
    assert r.stderr.rstrip().endswith("(5 ranks, each its own host): give one of them"), r.stderr
    assert _risk(capsys, "--plan", five / "plan.json", "--nodes", "5")["mirrorable_links"] == 5


def test_mirror_risk_refuses_rings_of_different_hops_and_a_plan_on_one_node(five, capsys):
    """Channel 0's ring 0>1>2>3>4 crosses nodes aabbb twice, channel 1's 0>2>1>3>4 four
    times: the mean was taken (a model of neither); one node: ZeroDivisionError."""
    plan = _with_nodes(five, "aabbb", "two-rings", rings=[[0, 1, 2, 3, 4], [0, 2, 1, 3, 4]])
    _one_line_error(ckptd_main(capsys, "mirror-risk", "--plan", plan, "--mirrors", "2", "--loss", "0.01"),
                    str(plan), "the rings cross between nodes different numbers of times, 2 (channel 0), "
                               "4 (channel 1)")
    plan = _with_nodes(five, "aaaaa", "one")
    _one_line_error(ckptd_main(capsys, "mirror-risk", "--plan", plan, "--mirrors", "2", "--loss", "0.01"),
                    str(plan), "every rank is on node 'a': no hop of the ring crosses the network")


def test_a_logged_warning_in_a_command_keeps_its_fields(capsys):
    """Python's last-resort handler printed a record's message alone: "checkpoint not
    written", without the error it carries in its fields."""
    import logging
    from ckptd.cli import _CommandLog
    log = logging.getLogger("ckptd.test-command-log")
    keep = log.handlers[:], log.propagate
    log.handlers[:], log.propagate = [_CommandLog()], False
    try:
        log.info("not shown")
        log.warning("checkpoint not written", extra={"fields": {"iteration": 3, "error": "disk full\x1b[2J"}})
    finally:
        log.handlers[:], log.propagate = keep
    assert capsys.readouterr().err == \
        "warning: checkpoint not written (iteration: 3, error: disk full\\x1b[2J)\n"
