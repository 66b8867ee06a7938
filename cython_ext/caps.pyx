# cython: language_level=3
"""Capabilities dropped in every thread of the process (capdrop.c; ckptd.live.privilege)."""
from libc.stdint cimport uint64_t

cdef extern from "capdrop.h":
    int ckptd_drop_all_threads(uint64_t keep, uint64_t keep_bounding, int set_caps, int last_cap, int *threads,
                               int *tid, const char **what) nogil


def drop_all_threads(uint64_t keep, uint64_t keep_bounding, bint set_caps, int last_cap):
    """Keep only `keep_bounding` (capability bits) in every thread's bounding set (and,
    with set_caps, `keep` in the permitted and effective sets; inheritable and ambient emptied), and set
    no_new_privs in every thread. Returns (0, threads, tid, "") or (-errno, threads,
    tid, what failed)."""
    cdef int threads = 0, tid = 0, r
    cdef const char *what = NULL
    with nogil:
        r = ckptd_drop_all_threads(keep, keep_bounding, set_caps, last_cap, &threads, &tid, &what)
    return r, threads, tid, (what or b"").decode()
