"""ckptd.live.hugemem: the capture workers' shared memory, in huge pages where the
machine has them, refused under huge_pages: on where it has none."""
from __future__ import annotations

import errno
import multiprocessing as mp

import pytest

from ckptd.live import hugemem
from ckptd.live.hugemem import HUGE_PAGE, HugePagesUnavailable, SharedArea


@pytest.fixture
def no_hugetlb(monkeypatch, tmp_path):
    """A machine whose hugetlb pool is empty; `policy` sets its shmem THP policy."""
    def empty_pool(nbytes):
        raise OSError(errno.ENOMEM, "no huge pages")
    monkeypatch.setattr(hugemem, "_hugetlb_fd", empty_pool)
    path = tmp_path / "shmem_enabled"
    monkeypatch.setattr(hugemem, "THP_SHMEM_POLICY", path)

    def policy(selected: str):
        path.write_text(" ".join(f"[{w}]" if w == selected else w
                                 for w in ("always", "within_size", "advise", "never", "deny", "force")) + "\n")
    return policy


def _write_in_child(area: SharedArea, at: int, value: int):
    area.buf[at] = value
    area.close()


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_a_spawned_worker_writes_the_memory_the_coordinator_reads(mode):
    area = SharedArea(3 * HUGE_PAGE + 5, mode)
    assert area.size == 4 * HUGE_PAGE and len(area.buf) == area.size  # whole huge pages
    assert area.pages == "4k" if mode == "off" else area.pages in ("hugetlb", "thp", "4k")
    area.buf[0] = 7
    p = mp.get_context("spawn").Process(target=_write_in_child, args=(area, area.size - 1, 9))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert (area.buf[0], area.buf[area.size - 1]) == (7, 9)
    area.close()


def test_on_refuses_in_one_line_naming_the_key_without_huge_pages(no_hugetlb):
    no_hugetlb("never")
    with pytest.raises(HugePagesUnavailable) as e:
        SharedArea(HUGE_PAGE, "on")
    assert str(e.value).startswith("huge_pages: on, but no huge pages") and "\n" not in str(e.value)
    auto = SharedArea(HUGE_PAGE, "auto")  # the same machine under auto: 4 KiB pages, silently
    assert auto.pages == "4k"
    auto.close()


@pytest.mark.parametrize("policy,pages", [("advise", "thp"), ("always", "thp"), ("never", "4k"), ("deny", "4k")])
def test_transparent_huge_pages_where_the_shmem_policy_honours_the_advice(no_hugetlb, policy, pages):
    no_hugetlb(policy)
    area = SharedArea(HUGE_PAGE, "auto")
    assert area.pages == pages
    area.close()


def test_off_never_asks_for_huge_pages(no_hugetlb):
    no_hugetlb("always")
    area = SharedArea(HUGE_PAGE, "off")
    assert area.pages == "4k"
    area.close()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="huge_pages must be one of auto, on, off, not 'maybe'"):
        SharedArea(HUGE_PAGE, "maybe")
