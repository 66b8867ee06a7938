"""ckptd mirror-config: the selection (coverage reasoned from the ring schedule, checked
here against the schedule itself), the cabling file, the failure messages, the vendor
renderings (golden files under tests/golden/) and the SONiC YANG validator.

Regenerate the golden files after an intended change with
    CKPTD_REGEN_GOLDEN=1 python -m pytest -q tests/test_mirror_config.py
and review the diff.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

from ckptd.tools import mirror_config
from ckptd.core.schedule import AG, Bucket, RingConfig, RingSchedule
from switch_config import linux_render
from switch_config.cabling import CablingError, cabling_from_doc
from switch_config.common import RenderError
from switch_config.render import render_all
from switch_config.select import SelectionError, link_chunks, select_mirrors
from switch_config.sonic import validate_config_db

GOLDEN = Path(__file__).parent / "golden"


def run_cli(args) -> int:
    ap = argparse.ArgumentParser(prog="ckptd")
    mirror_config.add_subparser(ap.add_subparsers())
    a = ap.parse_args(["mirror-config"] + [str(x) for x in args])
    return a.func(a)


def cabling(n, collectors=3, mode="span", switches=1, max_sessions=8, ports=4, capacity=1, **sw):
    """A cabling doc: n ranks spread over `switches` switches, collectors on switch 0."""
    sws = []
    for i in range(switches):
        s = {"name": f"sw{i}", "os": "sonic", "mode": mode, "max_sessions": max_sessions,
             "max_source_ports": ports, **sw}
        if mode == "erspan":
            s["erspan"] = {"src_ip": f"10.1.0.{i + 1}", "dscp": 8, "ttl": 64}
        sws.append(s)
    cols = [{"name": f"c{j}", "switch": "sw0", "port": f"Ethernet{200 + 4 * j}", "ip": f"10.9.0.{j + 1}",
             "capacity": capacity} for j in range(collectors)]
    ranks = [{"rank": r, "switch": f"sw{r % switches}", "port": f"Ethernet{4 * r}"} for r in range(n)]
    return {"format": "ckptd-cabling", "version": 1, "switches": sws, "collectors": cols, "ranks": ranks}


def streams_from_schedule(ring: RingConfig, sel) -> dict:
    """{(channel, chunk ring index): set of collectors} from RingSchedule's own sends,
    independent of link_chunks: which allgather sends each mirrored link carries."""
    # big enough that NCCL's tuner keeps every channel (RingConfig.tune drops channels of small ones)
    sched = RingSchedule(ring, [Bucket(ring.nranks * 65536, np.dtype("float32"))])
    seen = {}
    for p, col in sel.chosen:
        for ch in range(ring.channels):
            src, dst = p.link(ring, ch)
            for s in sched.sends[(src, dst, ch)]:
                if s.phase == AG and s.nelem:
                    seen.setdefault((ch, s.chunk), set()).add(col.name)
    return seen


# --------------------------------------------------------------------------- ring facts

def test_link_chunks_match_the_schedule():
    """A link s>next(s) carries in allgather every chunk but next(s)'s (ckptd.core.schedule)."""
    ring = RingConfig(nranks=5, rings=((0, 1, 2, 3, 4), (0, 3, 1, 4, 2)))
    sched = RingSchedule(ring, [Bucket(5 * 8192, np.dtype("float32"))])
    for ch in range(2):
        for s in range(5):
            d = ring.next_rank(ch, s)
            chunks = {ring.rank_at(ch, x.chunk) for x in sched.sends[(s, d, ch)] if x.phase == AG}
            assert chunks == link_chunks(ring, ch, s) == set(range(5)) - {d}


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("seed", [0, 1])
def test_selection_meets_the_goal(n, seed):
    rng = random.Random(seed * 31 + n)
    rings = [tuple(range(n))] + [tuple(rng.sample(range(n), n)) for _ in range(2)]
    ring = RingConfig(nranks=n, rings=tuple(rings))
    cols = 4 if n == 2 else 3
    sel = select_mirrors(ring, cabling_from_doc(cabling(n, collectors=cols, switches=2, mode="erspan")))
    want = min(3, n)
    seen = streams_from_schedule(ring, sel)
    for ch in range(ring.channels):
        links = {p.link(ring, ch) for p, _ in sel.chosen}
        assert len(links) >= want
        for k in range(n):
            assert len(seen.get((ch, k), ())) >= 2, (ch, k, sel.chosen)


def test_two_ranks_need_both_ends_of_each_link():
    ring = RingConfig(nranks=2, rings=((0, 1),))
    sel = select_mirrors(ring, cabling_from_doc(cabling(2, collectors=4)))
    assert sorted((p.rank, p.direction) for p, _ in sel.chosen) == [(0, "rx"), (0, "tx"), (1, "rx"), (1, "tx")]
    assert any("other end" in n for n in sel.notes)
    with pytest.raises(SelectionError) as e:
        select_mirrors(ring, cabling_from_doc(cabling(2, collectors=3)))
    msg = str(e.value)
    assert "channel 0 (ring 0>1)" in msg and "chunk of rank" in msg and "capacity 1" in msg


def test_capacity_two_collectors_pack_links_and_both():
    ring = RingConfig(nranks=6, rings=((0, 1, 2, 3, 4, 5),))
    sel = select_mirrors(ring, cabling_from_doc(cabling(6, collectors=2, capacity=2)))
    assert len(sel.chosen) == 4                          # 2 streams x 2 links: each sees all
    assert "plan_mirrors" not in sel.to_json()           # a stream of 2 ports is not a plan Mirror
    sel2 = select_mirrors(RingConfig(nranks=2, rings=((0, 1),)), cabling_from_doc(cabling(2, collectors=2, capacity=2)))
    assert sorted(s.direction for s in sel2.sessions) == ["both", "both"]


# --------------------------------------------------------------------------- failures

def test_unmet_request_names_channel_and_reason(tmp_path):
    doc = cabling(8, collectors=3, max_sessions=2)
    (tmp_path / "cab.json").write_text(json.dumps(doc))
    out = tmp_path / "out"
    assert run_cli(["--plan", GOLDEN / "plan.json", "--cabling", tmp_path / "cab.json", "--out", out]) == 3
    assert not out.exists()                              # nothing written


def test_unmet_messages():
    ring = RingConfig(nranks=8, rings=((0, 1, 2, 3, 4, 5, 6, 7), (0, 2, 4, 6, 1, 3, 5, 7)))
    with pytest.raises(SelectionError) as e:
        select_mirrors(ring, cabling_from_doc(cabling(8, collectors=3, max_sessions=2)))
    msg = str(e.value)
    assert "sw0 would need 3 mirror sessions, it allows 2" in msg
    assert "channel 0 (ring 0>1>2>3>4>5>6>7)" in msg and "channel 1 (ring 0>2>4>6>1>3>5>7)" in msg
    assert "2 distinct mirrored link(s), 3 wanted" in msg
    # SPAN needs the collector on the rank's switch: ranks on sw1 cannot reach c0..c2
    doc = cabling(8, collectors=3, switches=2, max_sessions=1)
    with pytest.raises(SelectionError) as e:
        select_mirrors(ring, cabling_from_doc(doc))
    assert "sw1 mirrors locally (SPAN) and no collector port is on sw1" in str(e.value)
    # a switch that mirrors RX only still works; one that mirrors nothing usable fails
    assert select_mirrors(ring, cabling_from_doc(cabling(8, directions=["rx"])))
    with pytest.raises(SelectionError) as e:
        select_mirrors(ring, cabling_from_doc(cabling(8, directions=["both"])))
    assert "cannot mirror RX" in str(e.value)
    with pytest.raises(SelectionError, match="only 1 collector|1 stream"):
        select_mirrors(ring, cabling_from_doc(cabling(8, collectors=1)))


def test_cabling_errors(tmp_path):
    base = cabling(4)
    bad = []
    d = copy.deepcopy(base); del d["switches"][0]["max_sessions"]; bad.append((d, "max_sessions is required"))
    d = copy.deepcopy(base); d["ranks"][0]["switch"] = "nope"; bad.append((d, "not in switches"))
    d = cabling(4, mode="erspan"); d["switches"][0]["erspan"]["gre_type"] = "0x1234"; bad.append((d, "gre_type"))
    d = cabling(4, mode="erspan"); d["switches"][0]["erspan"]["dscp"] = 64; bad.append((d, "dscp"))
    d = copy.deepcopy(base); d["ranks"][1]["port"] = "Ethernet0"; bad.append((d, "unique"))
    d = cabling(4, switches=2); d["switches"][1]["name"] = d["switches"][0]["name"]  # quoted once (it was "'sw0'")
    bad.append((d, r"switch names must be unique; 'sw0' appears twice$"))
    d = copy.deepcopy(base); d["format"] = "x"; bad.append((d, "not a ckptd cabling"))
    d = copy.deepcopy(base); d["switches"][0].update(os="comware", mode="erspan",
                                                      erspan={"src_ip": "10.0.0.1"}); bad.append((d, "egress_port"))
    # an ERSPAN tunnel's ends: one IP version (a v6 source to v4 collectors was written out), two hosts
    d = cabling(4, mode="erspan"); d["switches"][0]["erspan"]["src_ip"] = "fd00::1"
    bad.append((d, r"erspan.src_ip fd00::1 is IPv6 but collectors\[0\] \(c0\) has the IPv4 ip 10.9.0.1"))
    d = cabling(4, mode="erspan"); d["switches"][0]["erspan"]["src_ip"] = "10.9.0.2"
    bad.append((d, r"erspan.src_ip 10.9.0.2 is collectors\[1\] \(c1\)'s own ip"))
    # no host's address: a tunnel into a multicast group or 0.0.0.0 was written out, exit 0
    for addr, why in (("239.1.1.1", "a multicast address"), ("0.0.0.0", "the unspecified address")):
        d = cabling(4, mode="erspan"); d["switches"][0]["erspan"]["src_ip"] = addr
        bad.append((d, rf"erspan: src_ip {addr} is {why}: an ERSPAN tunnel ends at one host's unicast address"))
    d = cabling(4, mode="erspan"); d["collectors"][0]["ip"] = "255.255.255.255"
    bad.append((d, r"collectors\[0\].*ip 255.255.255.255 is the broadcast address"))
    for doc, text in bad:
        with pytest.raises(CablingError, match=text):
            cabling_from_doc(doc)
    (tmp_path / "c.yaml").write_text("format: [unclosed\n")
    assert run_cli(["--plan", GOLDEN / "plan.json", "--cabling", tmp_path / "c.yaml", "--out", tmp_path / "o"]) == 2
    d = cabling(12)
    (tmp_path / "c.json").write_text(json.dumps(d))
    assert run_cli(["--plan", GOLDEN / "plan.json", "--cabling", tmp_path / "c.json", "--out", tmp_path / "o"]) == 2
    assert not (tmp_path / "o").exists()


def test_a_cabling_key_given_twice_is_refused_not_the_last_taken(tmp_path):
    """YAML and JSON parsers keep the last of two equal keys: a cabling file whose second
    `port:` (or `mode:`) overrode the first went out as switch rules without a word."""
    from switch_config.cabling import load_cabling
    (tmp_path / "twice.yaml").write_text("format: ckptd-cabling\nformat: ckptd-cabling\n")
    with pytest.raises(CablingError, match=r"twice.yaml.*key 'format' given twice \(line 2\)"):
        load_cabling(tmp_path / "twice.yaml")
    text = json.dumps(cabling(4))
    (tmp_path / "twice.json").write_text(text.replace('"format": ', '"format": "x", "format": ', 1))
    with pytest.raises(CablingError, match=r"twice.json.*key 'format' given twice"):
        load_cabling(tmp_path / "twice.json")
    (tmp_path / "once.json").write_text(text)
    assert load_cabling(tmp_path / "once.json")  # the same file, each key once


@pytest.mark.parametrize("args,message", [(["--min-streams", "0"], "--min-streams must be at least 1, not 0"),
                                          (["--links", "-1"], "--links must be at least 1, not -1"),
                                          (["--vendor", "cisco"], "unknown vendor 'cisco'"),
                                          # it said "unknown vendor 'all'", all being among those it listed
                                          (["--vendor", "all,sonic"], "--vendor: all stands alone, not in a list"),
                                          (["--vendor", " , "], "--vendor names no vendor")])
def test_bad_options_are_bad_input_not_an_unmet_request(tmp_path, capsys, args, message):
    """Exit 2 (the request is malformed), not 3 (a well-formed request the cabling
    cannot meet), and nothing written."""
    rc = run_cli(["--plan", GOLDEN / "plan.json", "--cabling", GOLDEN / "cabling_span.json",
                  "--out", tmp_path / "o", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_render_errors():
    ring = RingConfig(nranks=4, rings=((0, 1, 2, 3),))
    d = cabling(4, mode="erspan")
    d["switches"][0]["erspan"]["gre_type"] = 0x6558
    sel = select_mirrors(ring, cabling_from_doc(d))
    with pytest.raises(RenderError, match="NX-OS"):
        render_all(sel, ["nxos"])
    with pytest.raises(RenderError, match="Linux"):
        render_all(sel, ["linux"])
    assert "sw0.eos.cfg" in render_all(sel, ["eos"])


# --------------------------------------------------------------------------- golden files

@pytest.mark.parametrize("name,cab", [("erspan", "cabling_erspan.yaml"), ("span", "cabling_span.json")])
def test_golden(tmp_path, name, cab, capsys):
    out = tmp_path / name
    assert run_cli(["--plan", GOLDEN / "plan.json", "--cabling", GOLDEN / cab, "--vendor", "all",
                    "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "every chunk reaches >= 2 stream(s)" in printed
    want_dir = GOLDEN / name
    got = {p.name: p.read_text() for p in sorted(out.iterdir())}
    if os.environ.get("CKPTD_REGEN_GOLDEN"):
        want_dir.mkdir(exist_ok=True)
        for old in want_dir.iterdir():
            old.unlink()
        for fname, text in got.items():
            (want_dir / fname).write_text(text)
    want = {p.name: p.read_text() for p in sorted(want_dir.iterdir())}
    assert sorted(got) == sorted(want)
    for fname in want:
        assert got[fname] == want[fname], f"{fname} differs from tests/golden/{name}/{fname}"
    # every SONiC file passes the sonic-mirror-session.yang constraints
    for fname, text in want.items():
        if fname.endswith(".config_db.json"):
            sw = fname.split(".")[0]
            ports = cabling_ports(GOLDEN / cab, sw)
            assert validate_config_db(json.loads(text), ports=ports) == [], fname


def cabling_ports(path, switch):
    from switch_config.cabling import load_cabling
    return load_cabling(path).ports_of(switch)


def test_dry_run_writes_nothing(tmp_path, capsys):
    out = tmp_path / "o"
    assert run_cli(["--plan", GOLDEN / "plan.json", "--cabling", GOLDEN / "cabling_span.json",
                    "--out", out, "--dry-run"]) == 0
    assert not out.exists() and "dry run" in capsys.readouterr().out
    # --dry-run needs no --out (argparse required it); without either, one line says so
    assert run_cli(["--plan", GOLDEN / "plan.json", "--cabling", GOLDEN / "cabling_span.json", "--dry-run"]) == 0
    assert "dry run" in capsys.readouterr().out
    assert run_cli(["--plan", GOLDEN / "plan.json", "--cabling", GOLDEN / "cabling_span.json"]) == 2
    assert "--out is required" in capsys.readouterr().err


def test_linux_rules_and_backend_interface():
    from switch_config.cabling import load_cabling
    from ckptd.core.plan import load_plan
    cab = load_cabling(GOLDEN / "cabling_span.json")
    sel = select_mirrors(load_plan(GOLDEN / "plan.json").ring, cab)
    sw = cab.switch("tor")
    rl = linux_render.rules(sel, sw)
    assert rl == [("Ethernet0", "Ethernet32", "rx"), ("Ethernet4", "Ethernet36", "rx"),
                  ("Ethernet8", "Ethernet40", "rx")]
    calls = []
    linux_render.apply(rl, lambda s, d, direction, netns=None: calls.append((s, d, direction, netns)),
                       netns=sw.netns)
    assert calls == [r + ("lab-sw",) for r in rl]
    sh = linux_render.shell([("p0", "m0", "both")], None)
    assert sh.splitlines() == [
        "tc qdisc add dev p0 clsact",
        "tc filter add dev p0 ingress protocol all u32 match u32 0 0 action mirred egress mirror dev m0",
        "tc filter add dev p0 egress protocol all u32 match u32 0 0 action mirred egress mirror dev m0"]


# --------------------------------------------------------------------------- SONiC YANG

def test_sonic_validator_catches_model_violations():
    good = {"type": "ERSPAN", "src_ip": "10.1.0.1", "dst_ip": "10.9.0.1", "gre_type": "0x88be",
            "dscp": "8", "ttl": "64", "queue": "0", "src_port": "Ethernet0", "direction": "RX"}
    assert validate_config_db({"MIRROR_SESSION": {"s1": good}}, ports={"Ethernet0"}) == []
    span = {"type": "SPAN", "dst_port": "Ethernet4", "src_port": "Ethernet0,Ethernet8", "direction": "BOTH"}
    assert validate_config_db({"MIRROR_SESSION": {"s-2_x": span}}, ports={"Ethernet0", "Ethernet4", "Ethernet8"}) == []
    assert validate_config_db({"MIRROR_SESSION": {"cpu": dict(span, dst_port="CPU")}}) == []
    cases = [
        ({"_bad": good}, "name"), ({"x" * 33: good}, "name"),
        ({"s": dict(good, dscp="64")}, "dscp"), ({"s": dict(good, ttl="256")}, "ttl"),
        ({"s": dict(good, queue="-1")}, "queue"), ({"s": dict(good, gre_type="0x88be0")}, "gre_type"),
        ({"s": dict(good, gre_type="65536")}, "gre_type"), ({"s": dict(good, gre_type="zz")}, "gre_type"),
        ({"s": dict(good, direction="IN")}, "direction"), ({"s": dict(good, type="RSPAN")}, "type"),
        ({"s": dict(good, src_ip="10.1.0.300")}, "src_ip"), ({"s": dict(good, dst_port="Ethernet4")}, "dst_port"),
        ({"s": dict(span, dscp="8")}, "dscp is only allowed"), ({"s": dict(span, dst_port="Ethernet99")}, "leafref"),
        ({"s": dict(good, policer="p1")}, "POLICER"), ({"s": dict(good, vlan="5")}, "not a leaf"),
        ({"s": dict(good, src_port="")}, "src_port"), ({"s": {"type": "ERSPAN"}}, "needs src_ip"),
    ]
    for table, text in cases:
        errs = validate_config_db({"MIRROR_SESSION": table}, ports={"Ethernet0", "Ethernet4", "Ethernet8"})
        assert any(text in e for e in errs), (table, errs)
    assert validate_config_db({"MIRROR_SESSION": {"s": dict(good, policer="p1")},
                               "POLICER": {"p1": {}}}, ports={"Ethernet0"}) == []
    assert validate_config_db({"MIRROR_SESSION": {"s": dict(good, gre_type="35006")}}) == []


# --------------------------------------------------------------------------- the daemon's interfaces

def _nxos_erspan_ids(text: str) -> dict:
    """{session name: erspan-id} as an NX-OS rendering says them."""
    ids, name = {}, None
    for line in text.splitlines():
        if line.startswith("  description "):
            name = line.split()[-1]
        elif line.startswith("  erspan-id "):
            ids[name] = int(line.split()[-1])
    return ids


def _daemon_config(tmp_path, fragment: str):
    """The written fragment as the daemon reads it, inside a config of its own."""
    from ckptd.live.daemon import load_config
    cfg = tmp_path / "ckptd.yaml"
    cfg.write_text("plan: plan.json\ninit: init.pt\nout: out\n" + fragment)
    return load_config(cfg)


def test_daemon_interfaces_split_sessions_only_where_the_switch_sets_their_id(tmp_path, capsys):
    """Several ERSPAN sessions reaching one collector from NX-OS switches (which take the
    erspan-id we give) are one daemon stream each, filtered by the id the switch config
    sends, unique over both switches; from EOS (which picks its own id) they stay one
    stream, and the note says why. A collector without ifname gets a note, no entry."""
    plan, opts = GOLDEN / "plan.json", ["--links", "4", "--min-streams", "1"]
    # one source port per session, and c0 taking most links: c0 gets sessions of both switches
    d = cabling(8, collectors=2, mode="erspan", switches=2, capacity=8, ports=1)
    d["collectors"][1]["capacity"] = 1
    for s in d["switches"]:
        s["os"] = "nxos"
    d["collectors"][0].update(ifname="ens1f0", netns="capture")
    d["collectors"][1].update(ifname="ens1f1")
    (tmp_path / "c.json").write_text(json.dumps(d))
    out = tmp_path / "nxos"
    assert run_cli(["--plan", plan, "--cabling", tmp_path / "c.json", "--out", out, *opts]) == 0
    printed = capsys.readouterr().out
    ids = {}
    for sw in ("sw0", "sw1"):
        for name, i in _nxos_erspan_ids((out / f"{sw}.nxos.cfg").read_text()).items():
            ids[(sw, name)] = i
    assert len(ids) >= 3 and sorted(ids.values()) == list(range(1, len(ids) + 1)), ids
    sessions = json.loads((out / "selection.json").read_text())["sessions"]
    per_collector, switches = {}, {}
    for s in sessions:
        per_collector.setdefault(s["collector"], []).append(ids[(s["switch"], s["name"])])
        switches.setdefault(s["collector"], set()).add(s["switch"])
    assert switches["c0"] == {"sw0", "sw1"}, sessions   # the case under test
    config = _daemon_config(tmp_path, (out / "daemon-interfaces.yaml").read_text())
    got = {}
    for i in config.interfaces:
        got.setdefault((i.ifname, i.netns), []).append(i.erspan_session)
    ifnames = {"c0": ("ens1f0", "capture"), "c1": ("ens1f1", None)}
    want = {ifnames[c]: sorted(v) if len(v) > 1 else [None] for c, v in per_collector.items()}
    assert {k: sorted(v, key=str) for k, v in got.items()} == want
    assert len({i.name for i in config.interfaces}) == len(config.interfaces)
    assert "note:" not in printed

    # the same cabling on EOS: the ids are the switch's, so one stream per collector
    for s in d["switches"]:
        s["os"] = "eos"
    del d["collectors"][1]["ifname"]
    (tmp_path / "c.json").write_text(json.dumps(d))
    out = tmp_path / "eos"
    assert run_cli(["--plan", plan, "--cabling", tmp_path / "c.json", "--out", out, *opts]) == 0
    printed = capsys.readouterr().out
    config = _daemon_config(tmp_path, (out / "daemon-interfaces.yaml").read_text())
    assert [(i.name, i.ifname, i.netns, i.erspan_session) for i in config.interfaces] == [
        ("c0", "ens1f0", "capture", None)]
    assert "note: collector c1 has no ifname" in printed
    assert "note: collector c0 receives 3 mirror sessions" in printed
    assert "eos choose the ERSPAN session ID themselves" in printed

    # no collector with an ifname: no file, and a note for each
    for c in d["collectors"]:
        c.pop("ifname", None), c.pop("netns", None)
    (tmp_path / "c.json").write_text(json.dumps(d))
    out = tmp_path / "none"
    assert run_cli(["--plan", plan, "--cabling", tmp_path / "c.json", "--out", out, *opts]) == 0
    assert not (out / "daemon-interfaces.yaml").exists()
    assert capsys.readouterr().out.count("has no ifname") == 2


@pytest.mark.parametrize("where,change,message", [
    ("top", {"collector": []}, "unknown keys ['collector']"),
    ("switch", {"max_source_port": 4}, "switches[0] (sw0): unknown keys ['max_source_port']"),
    ("erspan", {"tll": 64}, "switches[0] (sw0): erspan: unknown keys ['tll']"),
    ("collector", {"ifnmae": "eth1"}, "collectors[0] (c0): unknown keys ['ifnmae']"),
    ("rank", {"prot": "x"}, "ranks[0]: unknown keys ['prot']"),
    ("collector", {"ifname": "a very long name"}, "collectors[0] (c0): ifname 'a very long name' is not a safe name"),
    ("collector", {"netns": "lab"}, "collectors[0] (c0): netns without ifname"),
    ("collectors", {"ifname": "eth1"}, "collectors' (ifname, netns) pairs (one interface of the checkpoint host "
                                       "is one collector) must be unique; ('eth1', None) appears twice"),
])
def test_cabling_keys_are_checked(tmp_path, capsys, where, change, message):
    """A key the cabling format does not have is refused in one line naming the entry, as
    the daemon's config is: a misspelt optional key must not silently be its default."""
    d = cabling(4, mode="erspan")
    for entry in {"top": [d], "switch": d["switches"][:1], "erspan": [d["switches"][0]["erspan"]],
                  "collector": d["collectors"][:1], "rank": d["ranks"][:1], "collectors": d["collectors"]}[where]:
        entry.update(change)
    (tmp_path / "c.json").write_text(json.dumps(d))
    assert run_cli(["--plan", GOLDEN / "plan.json", "--cabling", tmp_path / "c.json", "--out", tmp_path / "o"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_a_second_run_into_the_same_out_removes_the_first_runs_stale_configs(tmp_path, capsys):
    """A run with --vendor all, then one with the default vendors, into one --out: the first
    run's eos/nxos/comware files stayed beside the second's, two configurations of one
    switch with nothing saying which was current. The files an earlier run wrote
    (its selection.json lists them) and this one does not are removed; others stay."""
    out = tmp_path / "out"
    base = ["--plan", GOLDEN / "plan.json", "--cabling", GOLDEN / "cabling_erspan.yaml", "--out", out]
    assert run_cli([*base, "--vendor", "all"]) == 0
    first = {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("mine")  # not ckptd's: stays
    capsys.readouterr()
    assert run_cli(base) == 0
    printed = capsys.readouterr().out
    now = {p.name for p in out.iterdir()}
    listed = set(json.loads((out / "selection.json").read_text())["files"])
    assert now == listed | {"notes.txt"}, now
    assert {"leaf1.eos.cfg", "leaf2.config_db.json"} <= first - now  # sonic leaf1, eos leaf2 by default
    for gone in sorted(first - now):
        assert f"removed {out / gone} (an earlier run's: not in this selection)" in printed
