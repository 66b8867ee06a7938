# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Capture files mapped read-only, side by side, into one address range: the files are
the batch.

A Batch has one buffer and its frames' offsets into it. The live path indexes the
TPACKET_V3 ring in place (ring.pyx); for capture files `MappedFiles` does the same: it
reserves one range of address space and maps each file into it (MAP_FIXED, a page
boundary apart), so the frames of every mirror stream lie in one buffer and merging the
streams by capture time is an order of offsets, not a copy of bytes. The pages are the
page cache's: no read() into a buffer of our own, no merge copy.

The first read of each page maps it (a minor fault, ~0.3 us a page here): the fast
pipeline's reader thread indexes the records and checks the ICRCs, so it, not the
thread that places, pays for that. Pages behind the reader's consumer are released
(`release_before`), so the resident size stays bounded.

Huge pages: each file is mapped at a 2 MiB-aligned address (its offset 0 is aligned too)
with MADV_HUGEPAGE. Where the page cache holds the file in PMD-sized folios, a fault maps
2 MiB with one PMD entry (Linux v6.18 mm/filemap.c filemap_map_pages -> filemap_map_pmd
-> mm/memory.c do_set_pmd, which asks for the folio to be PMD-order and the virtual
address and file offset to agree modulo 2 MiB: thp_vma_suitable_order), so 446 MB map in
~220 faults instead of ~109k PTEs set by ~7k faults (16 pages a fault-around), and
releasing them is a PMD clear each. VM_HUGEPAGE also makes a read fault on a page not in
the cache read ahead a whole PMD folio (mm/filemap.c do_sync_mmap_readahead ->
page_cache_ra_order), so a capture read from disk through this mapping lands in PMD
folios for the next replay too. A file
cached in smaller folios (written in small writes, e.g. tcpdump's) is mapped with PTEs
exactly as without the advice; the kernel does not regroup cached folios here
(MADV_COLLAPSE of a file needs CONFIG_READ_ONLY_THP_FOR_FS).

A file that shrinks while it is mapped (a capture rotated or truncated under the replay)
makes reads past its new end fault with SIGBUS. Nothing read from such a page can be
trusted, and a fault can come in the middle of the kernel placing a frame, so there is
no point to resume from: the guard below names the file in one line on stderr and ends
the process with status 2. Commits are atomic files (temp, fsync, rename), so every
checkpoint already committed stays whole and nothing half-placed is committed.
"""
import os
import stat

from cpython.buffer cimport PyBUF_WRITABLE
from libc.errno cimport errno
from libc.stdint cimport int64_t, uint8_t
from posix.mman cimport (MADV_DONTNEED, MAP_ANONYMOUS, MAP_FAILED, MAP_FIXED, MAP_NORESERVE,
                         MAP_PRIVATE, MAP_SHARED, MADV_HUGEPAGE, PROT_NONE, PROT_READ, madvise, mmap, munmap)

cdef extern from *:
    """
    #include <signal.h>
    #include <string.h>
    #include <unistd.h>

    /* The mapped files of every live MappedFiles: [lo, hi) and a message naming the
       file. Written with the GIL held, read by the SIGBUS handler (async-signal-safe:
       a scan, write(2) and _exit(2)). */
    #define CKPTD_GUARDS 256
    typedef struct { char *lo, *hi; const char *msg; size_t len; } ckptd_guard;
    static volatile ckptd_guard ckptd_guards[CKPTD_GUARDS];
    static struct sigaction ckptd_prev_bus;
    static int ckptd_installed = 0;

    static void ckptd_on_bus(int sig, siginfo_t *si, void *ctx) {
        char *a = (char *)si->si_addr;
        for (int i = 0; i < CKPTD_GUARDS; i++) {
            if (ckptd_guards[i].msg && a >= ckptd_guards[i].lo && a < ckptd_guards[i].hi) {
                ssize_t r = write(2, ckptd_guards[i].msg, ckptd_guards[i].len);
                (void)r;
                _exit(2);
            }
        }
        /* not ours: what was there before (the default: the process ends on SIGBUS) */
        sigaction(SIGBUS, &ckptd_prev_bus, NULL);
        if (ckptd_prev_bus.sa_flags & SA_SIGINFO && ckptd_prev_bus.sa_sigaction)
            ckptd_prev_bus.sa_sigaction(sig, si, ctx);
        else if (ckptd_prev_bus.sa_handler != SIG_DFL && ckptd_prev_bus.sa_handler != SIG_IGN)
            ckptd_prev_bus.sa_handler(sig);
    }

    static int ckptd_guard_add(char *lo, char *hi, const char *msg, size_t len) {
        if (!ckptd_installed) {
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_sigaction = ckptd_on_bus;
            sa.sa_flags = SA_SIGINFO;
            sigemptyset(&sa.sa_mask);
            if (sigaction(SIGBUS, &sa, &ckptd_prev_bus) != 0) return -1;
            ckptd_installed = 1;
        }
        for (int i = 0; i < CKPTD_GUARDS; i++) {
            if (!ckptd_guards[i].msg) {
                ckptd_guards[i].lo = lo; ckptd_guards[i].hi = hi; ckptd_guards[i].len = len;
                ckptd_guards[i].msg = msg;  /* last: the entry is whole when the handler sees it */
                return i;
            }
        }
        return -1;  /* full: a fault there ends the process the default way */
    }

    static void ckptd_guard_drop(int i) { if (i >= 0) ckptd_guards[i].msg = NULL; }
    """
    int ckptd_guard_add(char *lo, char *hi, const char *msg, size_t len)
    void ckptd_guard_drop(int i)


cdef size_t PAGE = os.sysconf("SC_PAGE_SIZE")
# where each file starts in the range and how releases are rounded: a PMD's span (x86-64,
# arm64 with 4 KiB pages), so the page cache's PMD-sized folios can be mapped whole
cdef size_t HUGE = 2 << 20
# release_before unmaps at least this much at a time: unmapping flushes the TLBs of every
# core running the process (an interrupt each), per call
cdef size_t RELEASE_GRAIN = 64 << 20


def mappable(path) -> bool:
    """A regular file with bytes in it (a pipe or an empty file is read the ordinary way)."""
    st = os.stat(path)
    return stat.S_ISREG(st.st_mode) and st.st_size > 0


cdef class MappedFiles:
    """Read-only buffer of files k = 0, 1, ...: file k's bytes are
    buf[starts[k]:starts[k] + sizes[k]]. Unmapped when the last view of it goes."""

    cdef uint8_t *base  # HUGE-aligned, inside the reservation
    cdef uint8_t *reservation
    cdef size_t reserved
    cdef Py_ssize_t length
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef readonly list starts, sizes
    cdef list released  # per file: its pages before this are released
    cdef list guards  # per file: its SIGBUS guard slot, and the message the slot points at

    def __cinit__(self, paths):
        self.base = self.reservation = NULL
        self.starts, self.sizes, self.guards = [], [], []
        fds = []
        try:
            for p in paths:
                fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
                fds.append(fd)
                self.sizes.append(os.fstat(fd).st_size)
            pos = 0
            for n in self.sizes:
                self.starts.append(pos)
                pos += -(-n // HUGE) * HUGE
            self.reserved = pos + HUGE  # never 0; room to align the base
            self.reservation = <uint8_t *>mmap(NULL, self.reserved, PROT_NONE,
                                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
            if self.reservation == <uint8_t *>MAP_FAILED:
                self.reservation = NULL
                raise OSError(errno, os.strerror(errno))
            self.base = <uint8_t *>((<size_t>self.reservation + HUGE - 1) & ~(HUGE - 1))
            for p, fd, at, n in zip(paths, fds, self.starts, self.sizes):
                if n and mmap(self.base + <size_t>at, n, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED:
                    raise OSError(errno, os.strerror(errno), str(p))
                # advice only: where THP is not built in (EINVAL) the mapping stays as it is
                madvise(self.base + <size_t>at, n, MADV_HUGEPAGE)
                self._guard(p, at, n)
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the files open
        self.length = self.starts[len(paths) - 1] + self.sizes[len(paths) - 1] if self.sizes else 0
        self.released = list(self.starts)
        self.shape[0], self.strides[0] = self.length, 1

    cdef _guard(self, path, size_t at, size_t n):
        msg = (f"ckptd: error: {os.fsdecode(path)}: the capture file shrank below {n} bytes while "
               "being replayed (rotated or truncated under it?); stopped, exit 2: checkpoints "
               "committed before stay whole, nothing after them was committed\n").encode("utf-8", "surrogateescape")
        # (a file name that is not UTF-8 goes to stderr as the bytes it is on disk)
        cdef const char *m = msg
        slot = ckptd_guard_add(<char *>self.base + at, <char *>self.base + at + n, m, len(msg))
        self.guards.append((slot, msg))

    def __dealloc__(self):
        for slot, _ in self.guards or ():
            ckptd_guard_drop(slot)
        if self.reservation != NULL:
            munmap(self.reservation, self.reserved)

    def __len__(self):
        return self.length

    def release_before(self, int64_t pos):
        """The pages wholly before byte pos of the buffer, in the file that holds pos,
        are read no more: unmap them (MADV_DONTNEED; the page cache keeps them, a later
        read maps them again), so the process's resident size stays at what is in
        flight, not the captures' size. Whole 2 MiB spans only: a part of one would
        clear a PMD mapping that the pages after pos still use."""
        cdef Py_ssize_t k = len(self.starts) - 1
        while k > 0 and self.starts[k] > pos:
            k -= 1
        if k < 0:
            return
        cdef size_t lo = self.released[k], hi = (<size_t>pos // HUGE) * HUGE
        if hi < lo + RELEASE_GRAIN:
            return  # in big steps: each call interrupts every core the process runs on
        with nogil:
            madvise(self.base + lo, hi - lo, MADV_DONTNEED)
        self.released[k] = hi

    def __getbuffer__(self, Py_buffer *view, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("mapped capture files are read-only")
        view.buf = self.base
        view.obj = self
        view.len = self.length
        view.readonly = 1
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = self.shape
        view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass
