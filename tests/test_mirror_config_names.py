"""mirror-config refuses names that could leave --out or inject a line into a vendor's
configuration (issue 13, item 7): through the command line, one `error:` line, exit 2,
and nothing written anywhere."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from switch_config.cabling import CablingError, cabling_from_doc
from switch_config.common import RenderError
from switch_config.render import render_all
from switch_config.select import select_mirrors
from ckptd.core.plan import load_plan

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
INJECT = "Ethernet1\nusername evil privilege 15 secret x"


def _cabling(os_="eos") -> dict:
    doc = json.loads((GOLDEN / "cabling_span.json").read_text())
    doc["switches"][0]["os"] = os_
    if os_ != "linux":
        doc["switches"][0].pop("netns", None)
    return doc


def _with(path: str, value, os_="eos") -> dict:
    doc = copy.deepcopy(_cabling(os_))
    keys = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = doc
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    if path == "switches.0.name":  # keep the cabling consistent: ranks and collectors follow
        for entry in doc["ranks"] + doc["collectors"]:
            entry["switch"] = value
    return doc


CASES = [
    ("switch-dotdot", "switches.0.name", "../x", "switches[0]: name '../x' is not a safe name"),
    ("switch-abs", "switches.0.name", "/abs", "switches[0]: name '/abs' is not a safe name"),
    ("switch-dot", "switches.0.name", "..", "is not a safe name"),
    ("rank-port-newline", "ranks.0.port", INJECT, "ranks[0]: port 'Ethernet1\\nusername"),
    ("collector-port-space", "collectors.0.port", "Ethernet32 destination cpu", "collectors[0] (cap0): port"),
    ("collector-port-quote", "collectors.0.port", 'Ethernet32"', "collectors[0] (cap0): port"),
    ("collector-name-newline", "collectors.0.name", "cap\nshutdown", "collectors[0]: name"),
    ("netns", "switches.0.netns", "../../proc/1/ns/net", "netns"),
]


@pytest.mark.parametrize("name,path,value,message", CASES, ids=[c[0] for c in CASES])
def test_unsafe_names_are_refused_and_nothing_is_written(tmp_path, name, path, value, message):
    os_ = "linux" if name == "netns" else "eos"
    cab = tmp_path / "cabling.json"
    cab.write_text(json.dumps(_with(path, value, os_)))
    out = tmp_path / "deep" / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "ckptd", "mirror-config", "--plan", GOLDEN / "plan.json",
                        "--cabling", cab, "--out", out, "--vendor", "all"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert message in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["cabling.json"]  # not out, not ../x


@pytest.mark.parametrize("vendor,port", [
    ("eos", "Ethernet1@x"),            # a kernel name, not an EOS interface
    ("nxos", "Ethernet1@x"),
    ("comware", "Ethernet1@x"),
    ("sonic", "Ethernet1@x"),
    ("linux", "Ethernet1234567890"),   # longer than IFNAMSIZ
])
def test_each_vendor_refuses_what_its_syntax_cannot_say(vendor, port):
    doc = _with("ranks.0.port", port, "linux" if vendor == "linux" else "eos")
    cab = cabling_from_doc(doc)  # the generic name rule lets it through
    sel = select_mirrors(load_plan(GOLDEN / "plan.json").ring, cab)
    with pytest.raises(RenderError, match=f"source port '{port}' cannot be said safely in {vendor} syntax"):
        render_all(sel, [vendor])


def test_injection_never_reaches_a_rendering():
    """The newline case is stopped at the cabling file, before any vendor sees it."""
    with pytest.raises(CablingError, match=r"ranks\[0\]: port .* is not a safe name"):
        cabling_from_doc(_with("ranks.0.port", INJECT))


def test_safe_names_still_render_every_vendor():
    doc = _with("ranks.0.port", "Ethernet1/1", "eos")
    sel = select_mirrors(load_plan(GOLDEN / "plan.json").ring, cabling_from_doc(doc))
    files = render_all(sel, ["eos", "nxos", "comware", "sonic"])
    assert "monitor session ckptd_cap0_rx source Ethernet1/1 rx\n" in files["tor.eos.cfg"]
    assert "  source interface Ethernet1/1 rx\n" in files["tor.nxos.cfg"]
    assert "mirroring-port Ethernet1/1 inbound\n" in files["tor.comware.cfg"]


@pytest.mark.parametrize("names", [
    ("ck.a", "ckpt-b", "ck_a"),  # one name once '.' becomes '_'
    ("checkpoint-host-rack12-nic-a", "ckpt-b", "checkpoint-host-rack12-nic-b"),  # alike in the part kept
])
def test_collectors_whose_names_look_alike_get_sessions_of_their_own(names):
    """Two collectors' sessions on one switch got one name: SONiC's MIRROR_SESSION kept the
    last (a mirrored link gone), EOS merged both into one session, and mirror-config said
    every chunk reached 2 streams, exit 0. Each session of a switch has a name of its
    own, every SONiC session is in its table, and the direction stays at the end."""
    import yaml
    doc = yaml.safe_load((GOLDEN / "cabling_erspan.yaml").read_text())
    for col, name in zip(doc["collectors"], names):
        col["name"] = name
    sel = select_mirrors(load_plan(GOLDEN / "plan.json").ring, cabling_from_doc(doc))
    for sw in {s.switch.name for s in sel.sessions}:
        mine = sel.sessions_on(sw)
        assert len({s.name for s in mine}) == len(mine), [s.name for s in mine]
        assert all(len(s.name) <= 32 and s.name.endswith(f"_{s.direction}") for s in mine), [s.name for s in mine]
    files = render_all(sel, ["sonic", "eos"])
    for sw in {s.switch.name for s in sel.sessions if s.switch.os == "sonic"}:
        table = json.loads(files[f"{sw}.config_db.json"])["MIRROR_SESSION"]
        assert set(table) == {s.name for s in sel.sessions_on(sw)}
    assert {s.collector.name for s in sel.sessions} >= {names[0], names[2]}  # both alike ones are used
