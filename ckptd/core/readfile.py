"""A small input file (a plan, the daemon's config, a cabling file, a token file) read
whole, without hanging or filling the memory whatever the path names."""
from __future__ import annotations

import os
import select
import stat

PIPE_WAIT_S = 30.0  # a pipe as the file (`--config <(...)`, a FIFO): how long to wait for its first byte


class TooLarge(OSError):
    """The file holds more than its kind ever does: not that kind of file (a log given as
    a plan, /dev/zero), or cut short silently had it been read up to the limit."""


def read_bounded(path, limit: int, what: str, wait_s: float | None = None) -> bytes:
    """The whole file at `path`, or TooLarge ("more than `limit` bytes is too large for
    `what`", e.g. "a plan") where it holds more: a device that never ends (/dev/zero)
    cannot fill the memory, and a regular file over the limit is refused by its size,
    unread. A pipe (process substitution, a FIFO) is read once something is written into
    it; a FIFO nobody writes into is a TimeoutError after `wait_s` (PIPE_WAIT_S), not a
    command or a daemon that hangs without a word. Both are OSErrors, as the callers'
    other read errors are."""
    wait_s = PIPE_WAIT_S if wait_s is None else wait_s
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open waits for no writer
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            raise TooLarge(f"{st.st_size} bytes is too large for {what} (at most {limit})")
        if stat.S_ISFIFO(st.st_mode):
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
        if left <= 0:
            raise TooLarge(f"more than {limit} bytes is too large for {what}")
        return b"".join(chunks)
    finally:
        os.close(fd)



def _kinds():
    """(kind, words for it, test of a file's first bytes) of each input ckptd takes."""
    from parsers.pcap import is_pcap
    from parsers.pcapng import is_pcapng
    return (("capture", "a packet capture", lambda h: is_pcap(h) or is_pcapng(h)),
            ("checkpoint", "a zip archive (a torch.save checkpoint?)", lambda h: h.startswith(b"PK\x03\x04")),
            ("plan", "JSON text (a plan?)", lambda h: h.lstrip()[:1] in (b"{", b"[")))


def misplaced(head: bytes, expected: str) -> str | None:
    """What a file refused as the `expected` kind ("capture", "checkpoint", "plan")
    evidently is instead, by its first bytes: another input ckptd takes, given in the
    wrong place (a capture as the plan, the plan as the init). None when it is none of
    the others."""
    return next((words for kind, words, test in _kinds() if kind != expected and test(head)), None)


def misplaced_file(path, expected: str) -> str | None:
    """misplaced() of the file at `path` (None where it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return misplaced(f.read(16), expected)
    except OSError:
        return None
