"""ckptd mirror-risk: the formula, its edge cases, and a Monte Carlo check of it through
the real merge code (ckptd.core.assemble.IterationAssembly)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ckptd.tools import risk

GOLDEN = Path(__file__).parent / "golden"


def closed_form(n, m, p, k):
    """The formula as written in docs/MIRRORS.md, independent of chunk_copies."""
    per_chunk = k / (n - 1)
    m = min(m, n)
    if m >= n:
        return 1 - (1 - p ** (n - 1)) ** (n * per_chunk)
    return 1 - (1 - p ** (m - 1)) ** (m * per_chunk) * (1 - p ** m) ** ((n - m) * per_chunk)


@pytest.mark.parametrize("n,m,p,k", [(8, 3, 1e-3, 20000), (4, 2, 0.05, 30), (5, 4, 0.2, 8),
                                     (3, 3, 0.3, 4), (6, 9, 0.1, 15), (2, 2, 0.01, 100)])
def test_formula_matches_closed_form(n, m, p, k):
    assert risk.failure_probability(n, m, p, k) == pytest.approx(closed_form(n, m, p, k), rel=1e-9)


def test_chunk_copies_from_the_schedule():
    # M < N: exactly M chunks (the receivers' of the mirrored links) have M-1 copies
    assert risk.chunk_copies(8, 3) == [3, 2, 2, 2, 3, 3, 3, 3]
    assert risk.chunk_copies(5, 5) == [4] * 5          # every link: N-1 copies each
    assert risk.chunk_copies(5, 7) == [4] * 5          # capped at the ring's N links
    assert risk.chunk_copies(4, 1) == [1, 0, 1, 1]     # rank 1's chunk never crosses 0>1
    assert risk.chunk_copies(2, 2) == [1, 1]


def test_edge_cases():
    assert risk.failure_probability(8, 1, 1e-6, 100) == 1.0     # M=1: a chunk is never seen
    assert risk.failure_probability(8, 1, 0.0, 100) == 1.0
    assert risk.failure_probability(8, 3, 0.0, 100) == 0.0      # p=0, M>=2: never fails
    assert risk.failure_probability(8, 3, 1.0, 100) == 1.0
    assert risk.failure_probability(4, 4, 0.1, 9) == risk.failure_probability(4, 10, 0.1, 9)  # M>=N
    assert risk.evaluate(8, 3, 0.0, 100)["iterations_between_failures"] is None   # never: JSON null
    # tiny probabilities keep their digits (log1p/expm1): p^2 * positions
    assert risk.failure_probability(8, 3, 1e-9, 7000) == pytest.approx(3 * 1000 * 1e-18, rel=1e-6)


@pytest.mark.parametrize("n,m,p,k", [(4, 3, 0.2, 6), (4, 2, 0.1, 6), (5, 2, 0.1, 8),
                                     (3, 3, 0.3, 4), (2, 2, 0.1, 3)])
def test_monte_carlo_agrees(n, m, p, k):
    """Failures are frequent enough here (20-60%) to measure: within 4 standard errors."""
    res = risk.check(n, m, p, k, trials=2000, seed=n * 100 + m)
    assert 0.1 < res["analytic"] < 0.9
    assert abs(res["z"]) < 4, res


def test_monte_carlo_edges():
    assert risk.check(4, 1, 0.0, 6, trials=30, seed=1)["failures"] == 30   # M=1: always incomplete
    assert risk.check(4, 3, 0.0, 6, trials=30, seed=1)["failures"] == 0    # p=0: never
    assert risk.check(3, 7, 0.0, 4, trials=30, seed=1)["failures"] == 0    # M>=N, p=0
    assert risk.check(3, 7, 1.0, 4, trials=10, seed=1)["failures"] == 10   # everything lost


def _cli(args):
    ap = argparse.ArgumentParser(prog="ckptd")
    sub = ap.add_subparsers()
    risk.add_subparser(sub)
    a = ap.parse_args(["mirror-risk"] + args)
    return a.func(a)


def test_cli(capsys):
    assert _cli(["--ring", "8", "--mirrors", "3", "--loss", "1e-3", "--packets", "20000"]) == 0
    out = capsys.readouterr().out
    assert "P(iteration cannot be completed) = 0.00854" in out and "iterations between failures" in out
    assert _cli(["--ring", "4", "--mirrors", "3", "--loss", "0.2", "--packets", "6", "--simulate",
                 "--trials", "300", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["simulation"]["trials"] == 300 and doc["p_fail"] == pytest.approx(closed_form(4, 3, 0.2, 6))
    assert _cli(["--ring", "1", "--mirrors", "3", "--loss", "2", "--packets", "6"]) == 2
    assert "--loss" in capsys.readouterr().err


def test_cli_from_plan(capsys):
    assert _cli(["--plan", str(GOLDEN / "plan.json"), "--mirrors", "3", "--loss", "1e-3"]) == 0
    assert "ring of 8 ranks" in capsys.readouterr().out


@pytest.mark.parametrize("args,text", [
    (["--loss", "0", "--packets", "100", "--iteration-seconds", "5"], ["between failures: never", "failures: never"]),
    (["--loss", "1e-300", "--packets", "100", "--iteration-seconds", "1e308"], ["more than 5e+304 h (never, in practice)"]),
    (["--loss", "5e-324", "--packets", "100"], ["iterations between failures: more than 1.8e+308 (never, in practice)"]),
])
def test_no_failure_is_null_in_json_and_never_in_text(capsys, args, text):
    """p=0, or 1/P_fail past the float range, printed Infinity: not JSON; the text said inf."""
    argv = ["--ring", "4", "--mirrors", "2", *args]
    assert _cli(argv + ["--json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert doc["iterations_between_failures"] is None or doc["seconds_between_failures"] is None, doc
    assert _cli(argv) == 0
    out = capsys.readouterr().out
    assert "inf" not in out and all(t in out for t in text), out


def test_finite_waits_are_still_numbers(capsys):
    assert _cli(["--ring", "4", "--mirrors", "2", "--loss", "0.1", "--packets", "30", "--iteration-seconds", "2",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["seconds_between_failures"] == pytest.approx(2 * doc["iterations_between_failures"])
    assert doc["iterations_between_failures"] == pytest.approx(1 / doc["p_fail"])
