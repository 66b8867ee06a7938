"""Threads the operating system can tell apart.

Python names its threads for itself only: `top -H`, `ps -L`, `perf` and /proc show
every thread of a ckptd process under the process's name. ckptd's own threads carry
their Python name into the kernel's (/proc/thread-self/comm, at most 15 bytes), so an
operator sees which stage takes the CPU (the optimizer's `ckptd-apply`, the writer's
`ckptd-persist`, ...) and benchmarks/capture_rate.py tells the capture path's CPU from
the shadow model's. A thread a named thread starts (torch's intra-op pool, say)
inherits its name.
"""
from __future__ import annotations

import ctypes
import os
import threading

COMM_BYTES = 15  # TASK_COMM_LEN 16, less the terminating NUL
PR_SET_NAME = 15  # include/uapi/linux/prctl.h

try:  # libc called with the GIL held (PyDLL): see name_os_thread
    _prctl = ctypes.PyDLL(None).prctl
    _prctl.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _prctl.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux
    _prctl = None


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its name (default: its Python name) in the kernel too,
    with prctl(PR_SET_NAME) and without letting go of the GIL. Writing
    /proc/thread-self/comm instead let go of it at the open, the write and the close, and
    a new thread waits up to the switch interval (5 ms) to get it back each time while
    another runs Python: the replay's reader lost 5 ms so before its first line of work,
    behind the pipeline's construction (benchmarks/RESULTS.md, session 14). Without
    prctl (not Linux) the name stays Python's."""
    if _prctl is not None:
        _prctl(PR_SET_NAME, (name or threading.current_thread().name).encode("utf-8", "replace")[:COMM_BYTES],
               0, 0, 0)


def lower_priority(nice: int) -> bool:
    """Give the calling thread the nice value `nice` (Linux keeps one per thread, and a
    thread it starts inherits it), or leave it where it is already nicer (a daemon
    started under `nice -n 15` keeps its writer below its capture loop, never above):
    for a stage that may fall behind without losing anything, so that on a busy host the
    stages that can lose data run first. False where that is not permitted (the thread
    keeps the priority it had)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except (OSError, AttributeError):
        return False
    return True


class Thread(threading.Thread):
    """threading.Thread whose name the kernel knows too (name_os_thread)."""

    def run(self):
        name_os_thread(self.name)
        super().run()
