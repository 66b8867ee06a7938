"""What a capture interface lost before any capture ring saw it.

A capture ring's own counters (PACKET_STATISTICS: `drops` in /status `capture`) count
only the frames the ring had no room for. A frame the NIC could not take (its receive
ring overrun: rx_missed_errors; its FIFO: rx_fifo_errors) or the driver or stack
dropped (rx_dropped) never reaches a ring, and shows only as data missing from an
iteration. tcpdump reports these as "dropped by interface" (libpcap's ps_ifdrop); the
daemon reports them per interface as `capture.<if>.interface` in /status, and at stop.

They come from the interface's line in /proc/net/dev, read in the interface's network
namespace: the file is opened there once (ckptd.live.ring.in_netns) and re-read through
that descriptor, which keeps its namespace after the thread that opened it is gone and
after the daemon has dropped its privileges.
"""
from __future__ import annotations

import os

from ckptd.live.ring import in_netns

PROC_NET_DEV = "/proc/thread-self/net/dev"
# the receive columns of /proc/net/dev (net/core/net-procfs.c dev_seq_printf_stats):
# bytes packets errs drop fifo frame compressed multicast, where drop is rx_dropped +
# rx_missed_errors and fifo is rx_fifo_errors
RX_COLUMNS = ("bytes", "packets", "errors", "dropped", "fifo", "frame", "compressed", "multicast")
REPORTED = ("packets", "dropped", "fifo", "errors")


def parse_proc_net_dev(text: str, ifname: str) -> dict[str, int] | None:
    """The receive counters of `ifname` in /proc/net/dev's text; None if it is not there
    (the interface is gone)."""
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        if sep and name.strip() == ifname:
            values = rest.split()
            if len(values) < len(RX_COLUMNS):
                return None
            return {k: int(v) for k, v in zip(RX_COLUMNS, values)}
    return None


class InterfaceCounters:
    """The receive counters of one interface since this object was made."""

    def __init__(self, ifname: str, netns: str | None = None):
        self.ifname, self.netns = ifname, netns
        self._fd = in_netns(netns, os.open, PROC_NET_DEV, os.O_RDONLY | os.O_CLOEXEC)
        self._start = self._read()

    def _read(self) -> dict[str, int] | None:
        chunks, off = [], 0
        while True:  # a seq file: read it whole from the start, each time
            chunk = os.pread(self._fd, 65536, off)
            if not chunk:
                break
            chunks.append(chunk)
            off += len(chunk)
        return parse_proc_net_dev(b"".join(chunks).decode("ascii", "replace"), self.ifname)

    def stats(self) -> dict[str, int] | None:
        """{packets, dropped, fifo, errors} received since the start; None if the
        interface (or its counters) cannot be read now."""
        if self._fd is None:
            return None
        now = self._read()
        if now is None or self._start is None:
            return None
        # a counter that went backwards (the interface was re-created): from zero again
        return {k: now[k] - self._start[k] if now[k] >= self._start[k] else now[k] for k in REPORTED}

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_counters(ifname: str, netns: str | None) -> InterfaceCounters | None:
    """InterfaceCounters, or None where /proc/net/dev cannot be opened there (reported as
    unknown, never a reason not to capture)."""
    try:
        return InterfaceCounters(ifname, netns)
    except OSError:
        return None
