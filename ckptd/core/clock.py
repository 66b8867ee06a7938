"""The capture clocks of several streams, told apart by the copies they share.

Streams are merged by capture time (ckptd.pipeline.file_source, ckptd.fast.batches).
Captures written on different hosts carry different clocks: a stream whose clock runs
400 ms ahead of the others had every copy merged after its iteration committed ("late"),
so what only it carried was lost. Mirror copies of one packet are the same bytes, seen
at (nearly) the same moment: the median of their time differences is how far two
clocks are apart. `stream_shifts` measures it over each file's first frames and says
how much to take off each stream's times; streams no copy ties to stream 0 (nor to a
stream tied to it) keep their own clocks.
"""
from __future__ import annotations

import os
import stat
import struct
from statistics import median

from parsers.capfile import CaptureError, open_capture
from parsers.pcap import byte_order

from ckptd.core.assemble import AGREE_WINDOW_MS

SAMPLE_FRAMES = 4096  # read of each file's start: copies of the same packets within it
SAMPLE_BYTES = 2 << 20  # (a pcap's first frames: at most this much of it, ~3 ms for three files)
MIN_BYTES = 128       # frames shorter than this are not matched (ACKs, padding: alike too often)
TAIL_BYTES = 20       # a frame's last bytes (RoCE: payload and ICRC, which covers the PSN) are its key
MIN_COPIES = 16       # copies two streams must share for a difference to count
# Differences within the agreement window are left alone: copies on other mirror ports
# come up to ~10 ms later through their queues (docs/ARCHITECTURE.md "Copies must
# agree"), the live daemon sees them so too, and the window waits for them. Beyond it,
# the capture hosts' clocks differ.
MIN_SHIFT_NS = int(AGREE_WINDOW_MS * 1_000_000)


def _first_times(path: str, sample: int) -> dict[bytes, int]:
    """{a frame's key: its capture time} over the file's first `sample` frames (at most
    SAMPLE_BYTES of a pcap); keys seen twice (retransmissions, duplicates) are dropped.
    Empty for a pipe (it is read once, by the merge), a file without timestamps or one
    that cannot be read."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return {}
        seen: dict[bytes, int] = {}
        twice: set[bytes] = set()
        for ts, caplen, origlen, key in _records(path, sample):
            if not ts or caplen != origlen or caplen < MIN_BYTES:
                continue
            if key in seen:
                twice.add(key)
            seen[key] = ts
        for key in twice:
            del seen[key]
        return seen
    except (CaptureError, OSError, struct.error):
        return {}  # (the merge reports it)


def _records(path: str, sample: int):
    """(time, caplen, origlen, last TAIL_BYTES) of the file's first frames: a classic
    pcap's read from its first SAMPLE_BYTES by their record headers (~1 ms a file, for a
    replay that takes 0.1 s; parsers' reader, a CapturedFrame each, took ~25 ms for three
    files), any other capture's through parsers."""
    with open(path, "rb") as f:
        head = f.read(SAMPLE_BYTES)
    form = byte_order(head)
    if form is None:
        for n, fr in enumerate(open_capture(path, lambda msg: None)):
            if n >= sample:
                return
            yield fr.ts_ns, fr.caplen, fr.origlen, bytes(fr.data[-TAIL_BYTES:])
        return
    order, tick = form
    record = struct.Struct(order + "IIII")
    pos = 24
    for _ in range(sample):
        if pos + 16 > len(head):
            return
        sec, frac, caplen, origlen = record.unpack_from(head, pos)
        end = pos + 16 + caplen
        if end > len(head):
            return
        yield sec * 1_000_000_000 + frac * tick, caplen, origlen, head[end - TAIL_BYTES:end]
        pos = end


def stream_shifts(paths: list[str], sample: int = SAMPLE_FRAMES) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """(ns to take off each stream's capture times, and one (stream, ns, via, copies) per
    stream shifted: `via` the stream whose copies, `copies` of them, tied it in). Stream
    0's clock is the one the others are set to, through the streams they share copies
    with; a difference under MIN_SHIFT_NS is left alone."""
    if not paths:
        return [], []
    times = [_first_times(p, sample) for p in paths]
    ahead = [None] * len(paths)  # ns each stream's clock runs ahead of stream 0's
    via: dict[int, tuple[int, int]] = {}
    ahead[0] = 0
    todo = [0]
    while todo:  # breadth first from stream 0 over the streams that share copies
        s = todo.pop(0)
        for t in range(len(paths)):
            if ahead[t] is not None:
                continue
            common = times[s].keys() & times[t].keys()
            if len(common) < MIN_COPIES:
                continue
            diff = int(median(times[t][k] - times[s][k] for k in common))
            ahead[t] = ahead[s] + diff
            via[t] = (s, len(common))
            todo.append(t)
    shifts = [a if a is not None and abs(a) >= MIN_SHIFT_NS else 0 for a in ahead]
    notes = [(t, shifts[t], *via[t]) for t in range(len(paths)) if shifts[t]]
    return shifts, notes


def shift_note(names: list[str], stream: int, ns: int, via: int, copies: int) -> str:
    """The line replay prints for a stream it shifted."""
    way = "ahead of" if ns > 0 else "behind"
    return (f"stream {names[stream]}: its capture clock runs {abs(ns) / 1e6:.3f} ms {way} {names[0]}'s (the "
            f"median over {copies} copies of the same packets it shares with {names[via]}): its frames are "
            "merged at their times corrected by that (captures written on hosts whose clocks differ)")


__all__ = ["MIN_SHIFT_NS", "shift_note", "stream_shifts"]
