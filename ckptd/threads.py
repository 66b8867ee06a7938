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

import threading

COMM_BYTES = 15  # TASK_COMM_LEN 16, less the terminating NUL


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its name (default: its Python name) in the kernel too.
    Where /proc cannot take it (not Linux, a read-only /proc) the name stays Python's."""
    raw = (name or threading.current_thread().name).encode("utf-8", "replace")[:COMM_BYTES]
    try:
        with open("/proc/thread-self/comm", "wb") as f:
            f.write(raw)
    except OSError:
        pass


class Thread(threading.Thread):
    """threading.Thread whose name the kernel knows too (name_os_thread)."""

    def run(self):
        name_os_thread(self.name)
        super().run()
