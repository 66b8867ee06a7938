"""Replay captured frames out of an interface through an AF_PACKET raw socket.

    send_pcap("run/mirrors/mirror0.pcap", "eth0", netns="lab-h0", timing="original")

timing: "asap" sends back to back; "original" keeps the gaps between the capture
timestamps (scaled by `speed`); "rate" paces to `pps` packets per second.  Frames go
out unchanged (Ethernet header included), so the interface must be able to carry the
largest one: raise its MTU for 4 KiB RoCE MTUs.  The kernel's answer to each send is
counted: ENOBUFS (a full queue on the way) is retried after a short pause, which
slows the sender to what the path can carry instead of losing frames.
"""
from __future__ import annotations

import errno
import socket
import time
from dataclasses import dataclass, field
from typing import Iterable

from parsers.capfile import open_capture

from ckptd.live.ring import in_netns

TIMINGS = ("asap", "original", "rate")
_RETRY_PAUSE_S = 50e-6
_MAX_RETRIES = 2000            # ~0.1 s of back-pressure on one frame before giving up


@dataclass
class SendResult:
    sent: int = 0
    bytes: int = 0
    retries: int = 0           # ENOBUFS answers that were retried
    failed: int = 0            # frames given up on (errors below, by errno name)
    errors: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def pps(self) -> float:
        return self.sent / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"sent": self.sent, "bytes": self.bytes, "retries": self.retries,
                "failed": self.failed, "errors": dict(self.errors),
                "seconds": round(self.seconds, 6), "pps": round(self.pps, 1)}


def open_raw(ifname: str, netns: str | None = None) -> socket.socket:
    """A SOCK_RAW packet socket bound to ifname for sending (protocol 0: it receives
    nothing, so it never fills up with the traffic it is not reading)."""
    def make():
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            s.bind((ifname, 0))
        except OSError:
            s.close()
            raise
        return s
    try:
        return in_netns(netns, make)
    except OSError as e:
        where = ifname + (f" (netns {netns})" if netns else "")
        raise OSError(e.errno, f"send socket on {where}: {e.strerror or e}") from e


def send_frames(frames: Iterable, ifname: str, netns: str | None = None, *,
                timing: str = "asap", pps: float | None = None, speed: float = 1.0,
                sock: socket.socket | None = None) -> SendResult:
    """Send each frame; items are bytes, (ts_ns, bytes) or objects with .data/.ts_ns.

    Returns counts; raises only if the socket cannot be opened."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}")
    if timing == "rate" and not pps:
        raise ValueError("timing='rate' needs pps > 0")
    own = sock is None
    s = open_raw(ifname, netns) if own else sock
    res = SendResult()
    t0 = time.perf_counter()
    first_ts = None
    try:
        for i, item in enumerate(frames):
            ts, data = _unpack(item)
            if timing == "rate":
                _wait_until(t0 + i / pps)
            elif timing == "original" and ts is not None:
                if first_ts is None:
                    first_ts = ts
                _wait_until(t0 + (ts - first_ts) / 1e9 / speed)
            _send_one(s, data, res)
    finally:
        res.seconds = time.perf_counter() - t0
        if own:
            s.close()
    return res


def send_pcap(path: str, ifname: str, netns: str | None = None, **kw) -> SendResult:
    """send_frames over every frame of a pcap or pcapng file."""
    return send_frames(open_capture(path), ifname, netns, **kw)


def _unpack(item):
    if isinstance(item, (bytes, bytearray, memoryview)):
        return None, item
    if isinstance(item, tuple):
        return item[0], item[1]
    return getattr(item, "ts_ns", None), item.data


def _send_one(s: socket.socket, data, res: SendResult) -> None:
    for _attempt in range(_MAX_RETRIES):
        try:
            s.send(data)
        except OSError as e:
            if e.errno in (errno.ENOBUFS, errno.EAGAIN):
                res.retries += 1
                time.sleep(_RETRY_PAUSE_S)
                continue
            name = errno.errorcode.get(e.errno, str(e.errno))
            res.errors[name] = res.errors.get(name, 0) + 1
            res.failed += 1
            return
        res.sent += 1
        res.bytes += len(data)
        return
    res.errors["ENOBUFS"] = res.errors.get("ENOBUFS", 0) + 1
    res.failed += 1


def _wait_until(t: float) -> None:
    """Sleep most of the way, spin the last stretch: sleep alone overshoots by ~60 us."""
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        if left > 200e-6:
            time.sleep(left - 150e-6)
