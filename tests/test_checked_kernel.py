"""The batch kernel built once with every check on (Cython bounds/wraparound/initialized
checks and AddressSanitizer over all of its C), then fuzzed: mutated frames against the
reference decoder and mutated captures through replay. An out-of-bounds index raises
IndexError (a crash in the fuzz count); a stray read or write in the C aborts under ASan."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _libasan() -> str | None:
    try:
        p = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return p if os.path.isabs(p) and os.path.exists(p) else None


def test_fuzz_through_a_bounds_checked_asan_kernel(tmp_path):
    asan = _libasan()
    if asan is None:
        pytest.skip("needs gcc with libasan (Debian: gcc) to build the checked kernel")
    build = subprocess.run([sys.executable, str(REPO / "scripts" / "build-checked-kernel"), str(tmp_path)],
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    so = next((tmp_path / "cython_ext").glob("batch*.so"))
    assert "libasan" in subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
    scratch = tmp_path / "fuzz-tmp"  # the fuzz run's own temporary files, which it must remove
    scratch.mkdir()
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1", LD_PRELOAD=asan,
               PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", TMPDIR=str(scratch))
    code = ("import sys, cython_ext.batch as b; assert b.__file__.startswith(sys.argv[1]), b.__file__; "
            "from benchmarks.fuzz import main; sys.exit(main(sys.argv[2:]))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path), "--frames", "30000", "--captures", "6",
                          "--seed", "7"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert "AddressSanitizer" not in out, out[-4000:]
    assert run.returncode == 0, out[-4000:]
    assert "kernel/reference class disagreements 0" in out
    assert "crashes 0" in out and "wrong commits 0" in out
    assert not list(scratch.glob("ckptd-*")), "benchmarks/fuzz.py left its scenario or captures behind"
