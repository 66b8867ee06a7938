import logging
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOWCHECK = REPO.parent / "shared" / "pcaps" / "flowcheck"


@pytest.fixture(scope="session")
def flowcheck_dir() -> Path:
    if not FLOWCHECK.is_dir():
        pytest.skip(f"real FlowCheck captures not found at {FLOWCHECK} "
                    "(they live in ../shared/pcaps/flowcheck beside the repo)")
    return FLOWCHECK


@pytest.fixture(autouse=True)
def _ckptd_logger_restored():
    """A daemon run in-process (setup_logging) points the "ckptd" logger at the stderr of
    its test and stops propagation; left so, a later test's log calls write to a closed
    capture and caplog sees nothing. Each test starts from the logger as it was."""
    log = logging.getLogger("ckptd")
    saved = (log.handlers[:], log.propagate, log.level)
    yield
    log.handlers[:], log.propagate, log.level = saved[0], saved[1], saved[2]
