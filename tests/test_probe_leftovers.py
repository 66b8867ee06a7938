"""Leftovers of the command-line probe (tests/test_probe_cli.py): each exits 2 with one
`error:` line naming the culprit (option, file, interface), or warns once, never a
traceback, two lines for one cause, or a silently wrong result."""
from __future__ import annotations

import json
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
