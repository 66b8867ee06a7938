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
