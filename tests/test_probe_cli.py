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
