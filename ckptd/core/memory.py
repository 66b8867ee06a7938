"""What this host can hold: sizes from input are checked against it before allocating.

A plan's shapes size the shadow (parameters and optimizer state) and the gradient
buffers; a daemon config's ring geometry sizes kernel memory. Either can ask for more
than the host has, and the allocation would then end in the OOM killer (or, for rings,
the kernel allocating until it fires) instead of a one-line error.
"""
from __future__ import annotations

from ckptd.errors import CkptdError


class MemoryLimitError(CkptdError):
    """The input asks for more memory than this host has available."""


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def require_memory(nbytes: int, what: str) -> None:
    """MemoryLimitError naming `what` when nbytes is more than the memory available."""
    avail = available_memory()
    if avail is not None and nbytes > avail:
        raise MemoryLimitError(f"{what} needs about {nbytes / 2**30:.1f} GiB; this host has "
                               f"{avail / 2**30:.1f} GiB available")
