"""Shared memory for the capture workers' slots, in huge pages where the machine has them.

    area = SharedArea(nbytes, huge_pages="auto")   # the coordinator
    area.buf      # a writable memoryview of nbytes
    area.pages    # what backs it: "hugetlb", "thp" or "4k"
    # pickled into a spawned worker (a Process argument): the worker maps the same memory
    area.close()

Where the memory comes from, in this order under `auto`:
- "hugetlb": memfd_create(MFD_HUGETLB), 2 MiB pages out of the pool the administrator
  reserved (vm.nr_hugepages). mmap reserves every page of the area up front
  (mm/hugetlb.c hugetlb_reserve_pages), so a short pool fails here, not with SIGBUS later.
- "thp": a plain memfd with madvise(MADV_HUGEPAGE), where the kernel's policy for
  shared memory (/sys/kernel/mm/transparent_hugepage/shmem_enabled) honours the advice.
- "4k": a plain memfd.
`on` refuses to start with neither, `off` takes "4k".

Why huge pages: one area is 8 slots per interface, up to ~6.6 MiB each (a 4 MiB turn of
ring blocks and its frame arrays); the worker writes every ring block into it and the
coordinator reads it back, so in 4 KiB pages each pass walks up to ~13,400 pages (first
touch: that many page faults) and their TLB misses; in 2 MiB pages, 27.
A memfd rather than a file in /dev/shm: nothing is left behind by a daemon that is
killed (the memory goes with its last mapping), MFD_HUGETLB needs no hugetlbfs mount,
and /dev/shm's tmpfs ignores shmem_enabled (its own mount option `huge=` decides).

The TPACKET ring itself is the kernel's memory: net/packet/af_packet.c alloc_pg_vec
takes each block as one physically contiguous allocation (__get_free_pages of the
block's order, vzalloc when fragmented) and maps it to user space page by page, so
no setting of ours puts the ring in huge pages.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

from ckptd.errors import CkptdError

HUGE_PAGES = ("auto", "on", "off")
HUGE_PAGE = 2 << 20  # the x86-64 / arm64 default huge page size; areas are rounded up to it
THP_SHMEM_POLICY = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
_THP_ADVICE_HONOURED = {"always", "within_size", "advise", "force"}


class HugePagesUnavailable(CkptdError, OSError):
    """huge_pages: on, and the machine has none to give."""


def thp_policy() -> str | None:
    """The selected word of shmem_enabled ("never", "advise", ...), or None without THP."""
    try:
        words = THP_SHMEM_POLICY.read_text().split()
    except OSError:
        return None
    return next((w[1:-1] for w in words if w.startswith("[")), None)


def _memfd(nbytes: int, flags: int = 0) -> int:
    """A memfd for the slots, sized; OSError (and nothing left open) when it cannot be."""
    fd = os.memfd_create("ckptd-slots", os.MFD_CLOEXEC | flags)
    try:
        os.ftruncate(fd, nbytes)
        return fd
    except OSError:
        os.close(fd)
        raise


def _hugetlb_fd(nbytes: int) -> int:
    """A memfd of 2 MiB hugetlb pages; OSError when the pool cannot back it."""
    return _memfd(nbytes, os.MFD_HUGETLB)


class SharedArea:
    def __init__(self, nbytes: int, huge_pages: str = "auto", *, _fd: int | None = None, _pages: str = ""):
        if _fd is not None:  # a worker's end (see __reduce__)
            self.pages, self.size, self._fd = _pages, nbytes, None
            self._map = mmap.mmap(_fd, nbytes)
            os.close(_fd)
        else:
            self.size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
            self._fd, self._map, self.pages = self._create(huge_pages)
        self.buf = memoryview(self._map)

    def _create(self, mode: str):
        if mode not in HUGE_PAGES:
            raise ValueError(f"huge_pages must be one of {', '.join(HUGE_PAGES)}, not {mode!r}")
        if mode != "off":
            try:
                fd = _hugetlb_fd(self.size)
            except OSError:
                fd = None  # no hugetlb support at all
            if fd is not None:
                try:
                    return fd, mmap.mmap(fd, self.size), "hugetlb"  # takes the pages from the pool
                except OSError:
                    os.close(fd)  # the pool is short
            if thp_policy() in _THP_ADVICE_HONOURED:
                fd = _memfd(self.size)
                m = mmap.mmap(fd, self.size)
                m.madvise(mmap.MADV_HUGEPAGE)
                return fd, m, "thp"
            if mode == "on":
                raise HugePagesUnavailable(
                    f"huge_pages: on, but no huge pages for the capture workers' shared memory "
                    f"({self.size >> 20} MiB): reserve 2 MiB pages (vm.nr_hugepages) or let shared memory use "
                    f"transparent huge pages ({THP_SHMEM_POLICY}: advise), or set huge_pages: auto")
        fd = _memfd(self.size)
        return fd, mmap.mmap(fd, self.size), "4k"

    def __reduce__(self):
        """Into a spawned process: the memfd itself goes along (multiprocessing passes it
        as an inherited descriptor while spawning), and the worker maps it."""
        from multiprocessing.reduction import DupFd
        return _attach, (DupFd(self._fd), self.size, self.pages)

    def close(self):
        """Unmap (and, on the creating side, close the memfd); the memory is freed with
        the last mapping. A view still held elsewhere keeps it mapped (BufferError)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.buf.release()
        self._map.close()


def _attach(dupfd, size: int, pages: str) -> SharedArea:
    return SharedArea(size, _fd=dupfd.detach(), _pages=pages)


__all__ = ["SharedArea", "HugePagesUnavailable", "HUGE_PAGES", "thp_policy"]
