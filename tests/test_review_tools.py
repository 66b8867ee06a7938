"""Review fixes: mirror-config and mirror-risk read a plan without building its optimizer
in torch (replay still refuses a bad lr scheduler at load); nccl_log's errors say what
was wrong with a line; synth's --model and --optim are checked in one place."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ckptd.tools.nccl_log as nccl_log
from ckptd.core.plan import PlanError, load_plan
from ckptd.tools.nccl_log import NcclLogError, parse_nccl_log

from helpers import synth

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scheduler_plans(tmp_path_factory):
    """(a plan whose optimizer has a good lr scheduler, the same with a bad one)."""
    d = tmp_path_factory.mktemp("sched")
    synth(d, ranks=2, channels=1, mirrors=2, iterations=2, bucket_cap_kb=16)
    doc = json.loads((d / "plan.json").read_text())
    paths = []
    for name, args in (("good", {"step_size": 2}), ("bad", {"step_size": 0})):
        doc["optimizer"].update(lr_schedule=None, lr_scheduler={"class": "StepLR", "args": args})
        paths.append(d / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    cabling = {"format": "ckptd-cabling", "version": 1,
               "switches": [{"name": "sw0", "os": "sonic", "mode": "span", "max_sessions": 8, "max_source_ports": 4}],
               "collectors": [{"name": f"c{j}", "switch": "sw0", "port": f"Ethernet{200 + 4 * j}",
                               "ip": f"10.9.0.{j + 1}", "capacity": 1} for j in range(4)],
               "ranks": [{"rank": r, "switch": "sw0", "port": f"Ethernet{4 * r}"} for r in range(2)]}
    (d / "cabling.json").write_text(json.dumps(cabling))
    return paths[0], paths[1], d / "cabling.json"


def test_mirror_tools_read_a_plan_with_a_scheduler_without_torch(scheduler_plans, tmp_path):
    good, _, cabling = scheduler_plans
    script = textwrap.dedent(f"""
        import argparse, sys
        from ckptd.tools import mirror_config, risk
        ap = argparse.ArgumentParser()
        sub = ap.add_subparsers()
        mirror_config.add_subparser(sub)
        risk.add_subparser(sub)
        for argv in (["mirror-config", "--plan", {str(good)!r}, "--cabling", {str(cabling)!r},
                      "--out", {str(tmp_path / "cfg")!r}],
                     ["mirror-risk", "--plan", {str(good)!r}, "--mirrors", "2", "--loss", "1e-3"]):
            a = ap.parse_args(argv)
            assert a.func(a) == 0, argv
        print("torch imported:", "torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "torch imported: False" in r.stdout, r.stdout


def test_load_plan_still_refuses_a_bad_scheduler(scheduler_plans):
    """What replays (replay, run, export, verify --plan) loads with the check."""
    good, bad, _ = scheduler_plans
    assert load_plan(good).optimizer.lr_scheduler["class"] == "StepLR"
    with pytest.raises(PlanError, match="optimizer.lr_scheduler.args.step_size is 0"):
        load_plan(bad)
    assert load_plan(bad, check_optimizer=False).optimizer.lr_scheduler["args"] == {"step_size": 0}


PFX = "dgx-a01:100:100 [0] NCCL INFO "


def test_nccl_log_long_number_is_named():
    with pytest.raises(NcclLogError) as e:
        parse_nccl_log("NCCL version 2.27.5\n" + PFX + "Channel 00/04 : 0 1" + "2" * 40 + "\n", "job.log")
    msg = str(e.value)
    assert msg.startswith("job.log:2: a number of more than 12 digits: 12222222222222222222... (41 digits)"), msg
    assert "\n" not in msg


def test_nccl_log_other_value_error_is_not_called_a_long_number(monkeypatch):
    """No log line reaches another ValueError today; if one does, its own cause is told
    (at the file and line), not 'more than 12 digits'."""
    def agree(*_):
        raise ValueError("nranks is not a count")
    monkeypatch.setattr(nccl_log, "_agree", agree)
    with pytest.raises(NcclLogError) as e:
        parse_nccl_log(PFX + "4 coll channels, 0 nvls channels\n", "job.log")
    assert str(e.value) == "job.log:1: nranks is not a count"


@pytest.mark.parametrize("argv, message", [
    (["--optim", "lamb"], "--optim 'lamb': one of"),
    (["--model", "huge"], "--model 'huge' is not a synthetic model size (tiny, small, default"),
    # torch checks a pair's first two values and unpacks it at the first step: three betas
    # ended in "too many values to unpack", after --out was made
    (["--optim", "adam:betas=0.9/0.9/0.9"],
     "--optim adam: optimizer.groups[0].betas is [0.9, 0.9, 0.9]: torch.optim.Adam takes two values there"),
    (["--optim", "rprop:step_sizes=1"], "optimizer.groups[0].step_sizes is 1: torch.optim.Rprop takes two"),
])
def test_synth_model_and_optim_are_refused_before_out(tmp_path, capsys, argv, message):
    from ckptd.cli import main
    out = tmp_path / "out"
    assert main(["synth", "--out", str(out), "--ranks", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()
