"""A small input file (a plan, the daemon's config, a cabling file, a token file) read
whole, without hanging or filling the memory whatever the path names."""
from __future__ import annotations

import os
import select
import stat

PIPE_WAIT_S = 30.0  # a pipe as the file (`--config <(...)`, a FIFO): how long to wait for its first byte


def read_bounded(path, limit: int, wait_s: float | None = None) -> bytes:
    """At most `limit` + 1 bytes of the file at `path` (more than `limit` is the caller's
    "too large"): a device that never ends (/dev/zero) cannot fill the memory. A pipe
    (process substitution, a FIFO) is read once something is written into it; a FIFO
    nobody writes into is a TimeoutError (an OSError, as the callers' other read errors)
    after `wait_s` (PIPE_WAIT_S), not a command or a daemon that hangs without a word."""
    wait_s = PIPE_WAIT_S if wait_s is None else wait_s
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open waits for no writer
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            if not poll.poll(int(wait_s * 1000)):
                raise TimeoutError(f"a pipe nothing was written into in {wait_s:g} s; give the file itself")
        os.set_blocking(fd, True)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
