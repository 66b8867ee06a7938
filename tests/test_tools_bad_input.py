"""Bad input to mirror-config (the cabling file), mirror-risk and plan --nic-addrs /
--nccl-log: one short line naming what and where, exit 2; never a traceback, a hang,
unbounded memory or silently wrong output.

The YAML alias bombs here are small files that expand to 9**6 (in-process) or 9**9
(the subprocess, which hung at 13 GB before) nodes when anything walks them whole.
"""
from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ckptd.cli import main
from ckptd.tools import nccl_log, risk
from ckptd.tools.nccl_log import NcclJob, NcclLogError, load_nic_addrs, parse_nccl_log, ring_topology
from switch_config.cabling import CablingError, cabling_from_doc

GOLDEN = Path(__file__).parent / "golden"
MAX_MESSAGE = 300


def bomb(levels: int = 6, width: int = 9):
    """A list nested `levels` deep, every level `width` references to the one below."""
    x = ["lol"] * width
    for _ in range(levels - 1):
        x = [x] * width
    return x


def golden_cabling() -> dict:
    return yaml.safe_load((GOLDEN / "cabling_erspan.yaml").read_text())


def _error(capsys, argv) -> str:
    rc = main([str(x) for x in argv])
    err = capsys.readouterr().err
    assert rc == 2, err[:2000]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[:2000]
    assert "Traceback" not in err
    # the file names are pytest's long temporary paths: not counted (a user's path is theirs)
    assert len(re.sub(r"/tmp/\S*/", "/", lines[0])) < MAX_MESSAGE, lines[0][:400]
    return lines[0]


def _mirror_config_error(tmp_path, capsys, doc, name="c.yaml") -> str:
    f = tmp_path / name
    # safe_dump writes shared objects once, with anchors and aliases: a bomb stays small
    f.write_text(json.dumps(doc) if name.endswith(".json") else yaml.safe_dump(doc))
    assert f.stat().st_size < 100_000
    return _error(capsys, ["mirror-config", "--plan", GOLDEN / "plan.json", "--cabling", f,
                           "--out", tmp_path / "out"])


# -- 1. alias bombs: every message short, nothing walks the bomb ---------------------------------
def test_alias_bomb_in_format_fails_at_once_in_bounded_memory(tmp_path):
    """It hung > 60 s and reached 13 GB (the message repr'd the expanded `format`)."""
    f = tmp_path / "bomb.yaml"
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    f.write_text("\n".join(lines + ["format: *i", ""]))

    def limit():  # 4 GiB of address space, or less where the caller's limit is lower
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = 4 << 30 if hard == resource.RLIM_INFINITY else min(4 << 30, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))

    code = "import sys; from ckptd.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, "mirror-config", "--plan", str(GOLDEN / "plan.json"),
                        "--cabling", str(f), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=40, preexec_fn=limit)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.startswith("error: ") and len(p.stderr) < MAX_MESSAGE and "format is a list" in p.stderr
    assert not (tmp_path / "out").exists()


def _put(doc, path, value):
    *head, last = path
    for k in head:
        doc = doc[k]
    doc[last] = value


BOMB_PLACES = [
    (("format",), "format"),
    (("version",), "version"),
    (("switches", 0, "name"), "name"),
    (("switches", 0, "os"), "os"),
    (("switches", 0, "mode"), "mode"),
    (("switches", 0, "max_sessions"), "max_sessions"),
    (("switches", 0, "directions"), "directions"),
    (("switches", 0, "erspan", "src_ip"), "src_ip"),
    (("switches", 0, "erspan", "gre_type"), "gre_type"),
    (("switches", 0, "erspan", "dscp"), "dscp"),
    (("switches", 0, "erspan", "vrf"), "vrf"),
    (("switches", 0, "erspan", "egress_port"), "egress_port"),
    (("collectors", 0, "name"), "name"),
    (("collectors", 0, "switch"), "switch"),
    (("collectors", 0, "ip"), "ip"),
    (("collectors", 0, "capacity"), "capacity"),
    (("ranks", 0, "rank"), "rank"),
    (("ranks", 0, "switch"), "switch"),
    (("ranks", 0, "port"), "port"),
]


@pytest.mark.parametrize("path,key", BOMB_PLACES, ids=[".".join(map(str, p)) for p, _ in BOMB_PLACES])
def test_alias_bomb_anywhere_gives_a_short_line_naming_the_key(tmp_path, capsys, path, key):
    doc = golden_cabling()
    _put(doc, path, bomb())
    t = time.monotonic()
    msg = _mirror_config_error(tmp_path, capsys, doc)
    assert key in msg
    assert time.monotonic() - t < 5


def test_long_and_huge_scalars_are_shown_short():
    from ckptd.errors import show
    doc = golden_cabling()
    doc["switches"][0]["os"] = "x" * 1_000_000
    with pytest.raises(CablingError) as e:
        cabling_from_doc(doc)
    assert len(str(e.value)) < MAX_MESSAGE and "os is 'xxx" in str(e.value)
    doc = golden_cabling()
    doc["ranks"][0]["rank"] = 1 << 20000   # YAML reads 0x<5000 hex digits> as this; repr() of it raises
    with pytest.raises(CablingError) as e:
        cabling_from_doc(doc)
    assert len(str(e.value)) < MAX_MESSAGE and "rank is an integer of 20001 bits" in str(e.value)
    doc = golden_cabling()
    doc["ranks"][0]["switch"] = 1 << 20000  # str() of it raises
    with pytest.raises(CablingError, match="switch is an integer of"):
        cabling_from_doc(doc)
    assert show(bomb(9)) == "a list of 9 item(s)" and show({"a": bomb(9)}) == "a mapping of 1 key(s)"


# -- 2. erspan fields type-checked ----------------------------------------------------------------
GRE_BAD = ["null", "[1, 2]", "{a: 1}", ".inf", "-.inf", ".nan", "35006.5", "true", "''", "0x" + "f" * 5000,
           "'0x" + "f" * 5000 + "'", "'1" + "0" * 5000 + "'", "!!binary aGVsbG8=", "2024-01-01"]


@pytest.mark.parametrize("value", GRE_BAD, ids=[v[:12] for v in GRE_BAD])
def test_gre_type_of_any_type_is_one_line_naming_it(tmp_path, capsys, value):
    text = (GOLDEN / "cabling_erspan.yaml").read_text().replace("gre_type: 0x88be", f"gre_type: {value}", 1)
    (tmp_path / "c.yaml").write_text(text)
    msg = _error(capsys, ["mirror-config", "--plan", GOLDEN / "plan.json", "--cabling", tmp_path / "c.yaml",
                          "--out", tmp_path / "out"])
    assert "switches[0] (leaf1): erspan: gre_type" in msg


def test_gre_type_list_in_json(tmp_path, capsys):
    doc = golden_cabling()
    doc["switches"][0]["erspan"]["gre_type"] = [35006]
    msg = _mirror_config_error(tmp_path, capsys, doc, "c.json")
    assert "gre_type is a list of 1 item(s)" in msg


def test_gre_type_good_spellings_still_load():
    for v, want in ((0x22EB, 0x22EB), ("0x6558", 0x6558), ("35006", 0x88BE)):
        doc = golden_cabling()
        doc["switches"][0]["erspan"]["gre_type"] = v
        assert cabling_from_doc(doc).switches[0].erspan.gre_type == want


@pytest.mark.parametrize("key,value", [("dscp", 8.5), ("ttl", None), ("queue", "0"), ("src_ip", 167772161),
                                       ("vrf", ["a"]), ("egress_port", {"a": 1})])
def test_other_erspan_fields_of_a_wrong_type(key, value):
    doc = golden_cabling()
    doc["switches"][0]["erspan"][key] = value
    with pytest.raises(CablingError, match=f"erspan: {key}"):
        cabling_from_doc(doc, "c.yaml")


def test_binary_cabling_file(tmp_path, capsys):
    (tmp_path / "c.yaml").write_bytes(b"\xff\xfe\x00garbage")
    msg = _error(capsys, ["mirror-config", "--plan", GOLDEN / "plan.json", "--cabling", tmp_path / "c.yaml",
                          "--out", tmp_path / "out"])
    assert "cannot read cabling file" in msg


# -- 3. collectors sharing an IP are one stream -------------------------------------------------
@pytest.mark.parametrize("ip", ["10.9.0.10", "::ffff:10.9.0.10"])
def test_collectors_with_one_ip_are_refused(tmp_path, capsys, ip):
    """Before: every chunk 'reached 2 streams', configs written, exit 0, all to one host."""
    doc = golden_cabling()
    doc["collectors"][1]["ip"] = ip
    msg = _mirror_config_error(tmp_path, capsys, doc)
    assert "c.yaml: collectors[0] (ckpt-a) and collectors[1] (ckpt-b) have the same ip 10.9.0.10" in msg
    assert not (tmp_path / "out").exists()


def test_distinct_collector_ips_still_load():
    assert len(cabling_from_doc(golden_cabling()).collectors) == 3


# -- 3b. values YAML 1.1 reads otherwise than they look; names of the wrong type -------------
YAML11 = [  # (golden text, replacement, key path, what YAML read)
    ("port: Ethernet0}", "port: 1.10}", "ranks[0].port is written 1.10 (line 34)", "the number 1.1: quote it"),
    ("port: Ethernet0}", "port: 010}", "ranks[0].port is written 010 (line 34)", "the number 8: quote it"),
    ("port: Ethernet0}", "port: 0x10}", "ranks[0].port is written 0x10 (line 34)", "the number 16"),
    ("port: Ethernet0}", "port: 1:30}", "ranks[0].port is written 1:30 (line 34)", "the number 90"),
    ("port: Ethernet0}", "port: 1_0}", "ranks[0].port is written 1_0 (line 34)", 'the number 10: quote it ("1_0")'),
    ("name: ckpt-a,", "name: no,", "collectors[0].name is written no (line 30)", "the boolean False"),
    ("ifname: ens1f0}", "ifname: on}", "collectors[0].ifname is written on (line 30)", "the boolean True"),
    ("dscp: 8", "dscp: 010", "switches[0].erspan.dscp is written 010 (line 14)", "the number 8: write the number in decimal"),
]


@pytest.mark.parametrize("old,new,where,what", YAML11, ids=[c[1] for c in YAML11])
def test_yaml11_scalars_are_refused_naming_key_and_line(tmp_path, capsys, old, new, where, what):
    """`port: 1.10` wrote `source 1.1` into the EOS config, 010 port 8, 1:30 port 90, and
    a collector `{name: no, ifname: on}` became "False"/"True" in daemon-interfaces.yaml."""
    text = (GOLDEN / "cabling_erspan.yaml").read_text()
    assert old in text
    (tmp_path / "c.yaml").write_text(text.replace(old, new, 1))
    msg = _error(capsys, ["mirror-config", "--plan", GOLDEN / "plan.json", "--cabling", tmp_path / "c.yaml",
                          "--out", tmp_path / "out"])
    assert f"c.yaml: {where}, which YAML 1.1 reads as {what}" in msg, msg
    assert not (tmp_path / "out").exists()


def test_yaml_numbers_that_mean_what_they_say_still_load(tmp_path, capsys):
    """An int port (port: 10) is common; gre_type in hex is the format's own; a quoted 1.10 is
    text; a number key may group its digits (1_0 is 10 there, as Python reads it)."""
    text = (GOLDEN / "cabling_erspan.yaml").read_text()
    text = text.replace("port: Ethernet0}", "port: 10}", 1).replace("port: Ethernet4}", "port: '1.10'}", 1)
    assert "dscp: 8" in text and "ttl: 64" in text
    text = text.replace("ttl: 64", "ttl: 6_4", 1)
    (tmp_path / "c.yaml").write_text(text.replace("dscp: 8", "dscp: 0x8", 1))
    assert main(["mirror-config", "--plan", str(GOLDEN / "plan.json"), "--cabling", str(tmp_path / "c.yaml"),
                 "--out", str(tmp_path / "out"), "--vendor", "eos"]) == 0, capsys.readouterr().err
    eos = (tmp_path / "out" / "leaf1.eos.cfg").read_text()
    assert " source 10 " in eos and " source 1.10 " in eos and " source 1.1 " not in eos


JSON_TYPES = [
    ("collectors", "name", True, "collectors[0]: name is True; expected a name (text)"),
    ("collectors", "port", 1.5, "collectors[0] (cap0): port is 1.5; expected a port name (text) or a whole number"),
    ("collectors", "port", False, "collectors[0] (cap0): port is False"),
    ("collectors", "ifname", float("nan"), "collectors[0] (cap0): ifname is nan; expected a name (text)"),
    ("ranks", "port", True, "ranks[0]: port is True"),
    ("ranks", "port", 1.5, "ranks[0]: port is 1.5"),
    ("ranks", "port", -1, "ranks[0]: port is -1"),
    ("switches", "netns", True, "switches[0] (tor): netns is True; expected a name (text)"),
]


@pytest.mark.parametrize("entry,key,value,want", JSON_TYPES, ids=[f"{c[0]}.{c[1]}={c[2]}" for c in JSON_TYPES])
def test_json_names_must_be_text_and_ports_text_or_whole(tmp_path, capsys, entry, key, value, want):
    """"netns": true wrote `ip netns exec True ...`; 1.5, NaN, true were taken as names."""
    doc = json.loads((GOLDEN / "cabling_span.json").read_text())
    doc[entry][0][key] = value
    assert want in _mirror_config_error(tmp_path, capsys, doc, "c.json")
    assert not (tmp_path / "out").exists()


# -- plan --nic-addrs and --nccl-log ------------------------------------------------------------
def _plan_error(tmp_path, capsys, nics: Path) -> str:
    log = tmp_path / "nccl.log"
    log.write_text("")
    return _error(capsys, ["plan", "--model", "no_such_module:f", "--nccl-log", log, "--nic-addrs", nics,
                           "--out", tmp_path / "p.json"])


@pytest.mark.parametrize("doc,want", [
    ({"h1": [bomb()]}, "host 'h1': NIC address [0] a list of 9 item(s)"),
    ({"h1": bomb()}, "host 'h1': NIC address [0] a list of 9 item(s)"),
    ({"h1": {"a": bomb()}}, "host 'h1': expected a list"),
    ({"h1": ["10.0.0.1", "x" * 100_000]}, "NIC address [1] 'xxx"),
    ({"h1": [167772161]}, "NIC address [0] 167772161 is not"),
    (bomb(), "not a list of 9 item(s)"),
])
def test_nic_addrs_bad_values_are_short(tmp_path, capsys, doc, want):
    f = tmp_path / "nics.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert want in _plan_error(tmp_path, capsys, f)


def test_nic_addrs_unreadable_or_huge_numbers(tmp_path, capsys):
    f = tmp_path / "nics.yaml"
    f.write_bytes(b"\xff\xfe\x00")
    assert "cannot read NIC addresses" in _plan_error(tmp_path, capsys, f)
    f = tmp_path / "nics.json"
    f.write_text('{"h1": [1' + "0" * 5000 + "]}")   # json.loads: ValueError, not a JSONDecodeError
    assert "cannot read NIC addresses" in _plan_error(tmp_path, capsys, f)
    assert load_nic_addrs(str(_write(tmp_path / "ok.json", {"h1": ["10.0.0.1"]}))) == {"h1": ["10.0.0.1"]}


def _write(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


PFX = "h1:1:1 [0] NCCL INFO "


def test_nccl_log_huge_nranks_is_refused_without_the_memory():
    """set(range(nranks)) of a line saying 10**11 ranks took all the memory."""
    job = parse_nccl_log("NCCL version 2.27.5+cuda12.9\n" + PFX
                         + "comm 0x1 rank 0 nranks 100000000000 cudaDev 0 nvmlDev 0 busId 1000 commId 0x1 "
                         "- Init COMPLETE\n")
    with pytest.raises(NcclLogError, match="nranks 100000000000 is not 1..65536"):
        ring_topology(job, {"h1": ["10.0.0.1"]})


def test_nccl_log_numbers_past_the_int_limit_and_long_hosts():
    with pytest.raises(NcclLogError, match="log:2: a number of more than 12 digits") as e:
        parse_nccl_log("NCCL version 2.27.5\n" + PFX + "comm 0x1 rank 0 nranks 1" + "0" * 5000
                       + " cudaDev 0 nvmlDev 0 busId 1000 commId 0x1 - Init COMPLETE\n")
    assert len(str(e.value)) < MAX_MESSAGE
    with pytest.raises(NcclLogError, match="host name of 100000 characters") as e:
        parse_nccl_log("x" * 100_000 + ":1:1 [0] NCCL INFO 4 coll channels, 0 nvls channels\n")
    assert len(str(e.value)) < MAX_MESSAGE
    with pytest.raises(NcclLogError, match="NCCL_ALGO set to a value of") as e:
        parse_nccl_log(PFX + "NCCL_ALGO set by environment to " + "R" * 100_000 + "\n")
    assert len(str(e.value)) < MAX_MESSAGE


def test_nccl_log_ring_lines_naming_unknown_ranks():
    """`Ring 00 : x -> 0 -> 5` with no line for rank 5 was a KeyError traceback."""
    job = NcclJob(nranks=2, coll_channels=1, graph_next={0: {0: 5, 1: 7}})
    with pytest.raises(NcclLogError, match=r"ring of channel 0 \[0 5\] does not hold ranks 0..1"):
        nccl_log._rings(job, "log")
    job = NcclJob(nranks=2, coll_channels=1, graph_next={0: {3: 1, 1: 0}})
    with pytest.raises(NcclLogError, match="ring of channel 0"):
        nccl_log._rings(job, "log")


# -- 4. mirror-risk --simulate in bounded memory; --seed -----------------------------------------
RISK = ["mirror-risk", "--ring", "4", "--mirrors", "2", "--loss", "0.1"]


def test_risk_simulate_huge_packets_is_refused_naming_packets(capsys):
    """It allocated in proportion to --packets (24 GB for 1e9)."""
    msg = _error(capsys, RISK + ["--packets", "1e9", "--simulate", "--trials", "10"])
    assert "--simulate with --packets 1e+09" in msg and "262144" in msg


def test_risk_simulate_total_work_is_capped(capsys):
    msg = _error(capsys, RISK + ["--packets", "30000", "--simulate"])
    assert "--trials 2000" in msg and "lower --trials or --packets" in msg


def test_risk_negative_seed(capsys):
    assert "--seed must be >= 0" in _error(capsys, RISK + ["--packets", "9", "--simulate", "--seed", "-1"])


@pytest.mark.parametrize("packets", ["2", "1", "1.5", "0.25e1"])
def test_risk_packets_fewer_than_chunks_or_fractional(capsys, packets):
    """--packets 2 on a ring of 4 is 0.67 packets a chunk: the formula took that, the
    simulation one packet, and they disagreed (0.0134 against 0.0201)."""
    msg = _error(capsys, RISK + ["--packets", packets, "--simulate", "--trials", "20"])
    assert msg == (f"error: --packets K must be a whole number of packets, 3..1e+15 (a link of a ring of 4 carries "
                   f"3 chunks, each at least one packet), not {float(packets):g}")


def test_risk_packets_whole_and_at_least_the_chunks_still_run(capsys):
    for packets in ("3", "1e9", "20000"):
        assert main(RISK + ["--packets", packets, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["packets_per_chunk"] >= 1


def test_risk_formula_still_any_size_and_simulation_small(capsys):
    assert main(RISK + ["--packets", "1e9"]) == 0
    capsys.readouterr()
    assert main(RISK + ["--packets", "9", "--simulate", "--trials", "20", "--seed", "3", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["simulation"]["trials"] == 20


def test_risk_full_ring_of_max_ranks_is_fast(capsys):
    """--ring 65536 --mirrors 65536 read 65536 links off the schedule: O(N^2), MemoryError."""
    t = time.monotonic()
    assert main(["mirror-risk", "--ring", "65536", "--mirrors", "65536", "--loss", "0.1", "--packets", "1e6",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["chunks_by_copies"] == {"65535": 65536} and res["p_fail"] == 0.0
    assert time.monotonic() - t < 10


@pytest.mark.parametrize("n,m,nodes", [(8, 3, None), (8, 8, None), (9, 4, 3), (12, 20, 4)])
def test_risk_closed_form_copies_match_the_schedule(monkeypatch, n, m, nodes):
    read = risk.chunk_copies(n, m, nodes), risk.carried_chunks(n, risk.mirrored_links(n, m, nodes))
    monkeypatch.setattr(risk, "MAX_SCHEDULE_READ", 0)
    assert (risk.chunk_copies(n, m, nodes), risk.carried_chunks(n, risk.mirrored_links(n, m, nodes))) == read


# -- 5. empty paths ------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--out", "--plan", "--cabling"])
def test_mirror_config_empty_path_is_refused_and_writes_nothing(tmp_path, capsys, monkeypatch, option):
    """An empty --out wrote every file into the current directory (exit 0); an empty
    --plan or --cabling was read as '.' ("Is a directory")."""
    monkeypatch.chdir(tmp_path)
    argv = {"--plan": str(GOLDEN / "plan.json"), "--cabling": str(GOLDEN / "cabling_erspan.yaml"),
            "--out": str(tmp_path / "out")}
    argv[option] = ""
    with pytest.raises(SystemExit) as e:   # argparse's own exit
        main(["mirror-config", *[x for kv in argv.items() for x in kv]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert f"argument {option}: an empty path" in err
    assert list(tmp_path.iterdir()) == []


def test_mirror_config_out_a_file_is_refused_naming_the_option(tmp_path, capsys):
    """It was "cannot write into x.txt: [Errno 17] File exists", after the selection was
    printed as if it would be written."""
    f = tmp_path / "x.txt"
    f.write_text("mine")
    msg = _error(capsys, ["mirror-config", "--plan", GOLDEN / "plan.json", "--cabling", GOLDEN / "cabling_erspan.yaml",
                          "--out", f])
    assert msg == f"error: --out {f}: a file is in the way; give a directory"
    assert f.read_text() == "mine"


def test_cabling_fifo_nobody_writes_into_is_an_error_not_a_hang(tmp_path, capsys, monkeypatch):
    """--cabling FIFO was read with read_text(): with no writer mirror-config hung for ever."""
    import os
    from ckptd.core import readfile
    monkeypatch.setattr(readfile, "PIPE_WAIT_S", 0.2)
    fifo = tmp_path / "cabling.fifo"
    os.mkfifo(fifo)
    t = time.monotonic()
    msg = _error(capsys, ["mirror-config", "--plan", GOLDEN / "plan.json", "--cabling", fifo, "--out", tmp_path / "out"])
    assert "cannot read cabling file: a pipe nothing was written into in 0.2 s" in msg
    assert time.monotonic() - t < 10 and not (tmp_path / "out").exists()


def test_nccl_log_and_nic_addrs_fifo_or_endless_are_errors_not_hangs(tmp_path, capsys, monkeypatch):
    """--nccl-log and --nic-addrs were read with read_text(): a FIFO nobody writes into hung
    `ckptd plan` for ever, /dev/zero as --nccl-log filled the memory until the kernel
    killed it."""
    import os
    from ckptd.core import readfile
    monkeypatch.setattr(readfile, "PIPE_WAIT_S", 0.2)
    monkeypatch.setattr(nccl_log, "MAX_NCCL_LOG_BYTES", 1 << 20)
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    log = tmp_path / "nccl.log"
    log.write_text("")
    t = time.monotonic()
    assert "cannot read NIC addresses: a pipe nothing was written into in 0.2 s" in _plan_error(tmp_path, capsys, fifo)
    msg = _error(capsys, ["plan", "--model", "no_such_module:f", "--nccl-log", fifo, "--nic-addrs", log,
                          "--out", tmp_path / "p.json"])
    assert f"--nccl-log {fifo}: a pipe nothing was written into" in msg
    msg = _error(capsys, ["plan", "--model", "no_such_module:f", "--nccl-log", "/dev/zero", "--nic-addrs", log,
                          "--out", tmp_path / "p.json"])
    assert "--nccl-log /dev/zero: more than 1048576 bytes is too large" in msg
    assert ("/dev/zero: cannot read NIC addresses: more than 16777216 bytes is too large for NIC addresses"
            in _plan_error(tmp_path, capsys, Path("/dev/zero")))
    assert time.monotonic() - t < 20
