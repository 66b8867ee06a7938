"""Source stage for capture files: frames as Batches (many frames in one buffer).

    load_capture, load_captures   whole files in memory (benchmarks that measure
                                  extraction alone read from memory)
    stream_batches                every file a chunk at a time, merged in capture-time
                                  order exactly as ckptd.pipeline.file_source merges them
    ReaderStage                   any iterator of Batches run on its own thread behind a
                                  bounded queue: the fast path's read stage

A clean pcap is indexed in place by the kernel (no per-frame Python); stream_batches
maps the pcap files (cython_ext/filemap.pyx), so its Batches point into the page cache
and streams merge by offsets, without a byte copied. pcapng, and a pcap with a broken
record, go through the reference readers in parsers/, which also word the error that
ends a file early.
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from cython_ext import batch as _kernel
from cython_ext.filemap import MappedFiles, mappable
from parsers.capfile import CaptureError, CapturedFrame, capture_format, open_capture
from parsers.pcap import MAGIC_NS, MAGIC_US

from ckptd.errors import CaptureDamage
from ckptd.threads import Thread, lower_priority

# Bytes of a file stream_batches indexes at a time: the grain of a merged Batch, so of
# how often the fast pipeline moves the streams' clocks (agreement windows), and of the
# pages the reader faults in ahead of the kernel. Each Batch costs the consumer a round
# of Python (merge, stops, clocks): issue 16's replay took 0.108 s at 4 MiB, 0.100 s at
# 16 MiB, 0.15 s at 1 MiB (benchmarks/RESULTS.md).
CHUNK_BYTES = 16 << 20
CHUNK_FRAMES = 1 << 11  # frames per Batch from the reference readers
# Batches a ReaderStage may hold ready: enough for the reader to index ahead while the
# pipeline is built (a mapped file's Batch holds only its index: 8 x 16 MiB per stream
# mapped ahead at most); the reference readers' Batches (their own bytes) stay at
# 16k frames.
READ_DEPTH = 8
READER_NICE = 10  # the reader thread's nice value (in Linux each thread has its own)


# -- a Batch ------------------------------------------------------------------------------
@dataclass
class Batch:
    """Many frames in one buffer: the unit the kernel works on. A capture file read into
    memory and a capture-ring block are both one of these."""

    buf: np.ndarray  # uint8
    offsets: np.ndarray  # int64, where each frame starts in buf
    caplen: np.ndarray  # int64, bytes captured
    origlen: np.ndarray  # int64, bytes on the wire
    stream: np.ndarray  # int32, mirror stream
    linktype: np.ndarray  # int32, LINKTYPE_* of the frame's interface
    frame_no: np.ndarray  # int64, frame number in its file (1-based, as Wireshark)
    ts: np.ndarray  # int64, ns (where the capture has none, the frame number: CapturedFrame.merge_time)
    # uint8, 1 where the frame's ICRC was found good ahead (BatchKernel.check_icrc), or None
    icrc_checked: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def nbytes(self) -> int:
        return int(self.caplen.sum())

    def frame(self, i: int) -> CapturedFrame:
        off, n = int(self.offsets[i]), int(self.caplen[i])
        return CapturedFrame(int(self.frame_no[i]), int(self.ts[i]), int(self.linktype[i]), n,
                             int(self.origlen[i]), self.buf[off:off + n].tobytes())


def batch_from_frames(frames: Iterable[tuple[int, CapturedFrame]]) -> Batch:
    """A Batch of (stream, frame) pairs, in the order given."""
    frames = list(frames)
    sizes = np.array([len(fr.data) for _, fr in frames], np.int64)
    offsets = np.zeros(len(frames), np.int64)
    if len(frames):
        offsets[1:] = np.cumsum(sizes)[:-1]
    buf = np.frombuffer(b"".join(fr.data for _, fr in frames), np.uint8) if frames \
        else np.zeros(0, np.uint8)
    return Batch(buf, offsets, sizes, np.array([fr.origlen for _, fr in frames], np.int64),
                 np.array([s for s, _ in frames], np.int32),
                 np.array([fr.linktype for _, fr in frames], np.int32),
                 np.array([fr.index for _, fr in frames], np.int64),
                 np.array([fr.merge_time for _, fr in frames], np.int64))


_PCAP_MAGICS = {MAGIC_US.to_bytes(4, "little"): (False, 1000), MAGIC_US.to_bytes(4, "big"): (True, 1000),
                MAGIC_NS.to_bytes(4, "little"): (False, 1), MAGIC_NS.to_bytes(4, "big"): (True, 1)}


def _pcap_header(head: bytes) -> tuple[bool, int, int] | None:
    """(big-endian, ns per timestamp tick, linktype) of a classic pcap file header."""
    if len(head) != 24 or head[:4] not in _PCAP_MAGICS:
        return None
    big, tick = _PCAP_MAGICS[head[:4]]
    if int.from_bytes(head[4:6], "big" if big else "little") != 2:
        return None  # not version 2: parsers' reader words what is wrong
    return big, tick, int.from_bytes(head[20:24], "big" if big else "little") & 0xFFFF


def load_capture(path, stream: int = 0) -> tuple[Batch, str | None]:
    """One capture file in memory as a Batch, and the CaptureError/OSError message that
    ended it early (None when it read to the end), as file_source would report it.

    A clean pcap is indexed in place by the kernel (no per-frame Python); pcapng, and a
    pcap with a broken record, go through the reference readers in parsers/."""
    try:
        fmt = capture_format(path)  # a pipe ("stream"): parsers' reader below reads it once
        if fmt == "pcap":
            data = np.fromfile(path, np.uint8)
            head = data[:24].tobytes()
            if (hdr := _pcap_header(head)) is not None:
                big, tick, linktype = hdr
                cap = max(0, (len(data) - 24) // 16)
                arrs = [np.empty(cap, np.int64) for _ in range(5)]
                n, _, clean = _kernel.index_pcap(data, 24, len(data), big, 0, *arrs)
                if clean:
                    offsets, caplen, origlen, sec, frac = (a[:n] for a in arrs)
                    return Batch(data, offsets, caplen, origlen, np.full(n, stream, np.int32),
                                 np.full(n, linktype, np.int32), np.arange(1, n + 1, dtype=np.int64),
                                 sec * 1_000_000_000 + frac * tick), None
    except (CaptureError, OSError) as e:
        return batch_from_frames([]), str(e)
    frames, error = [], None
    try:
        for fr in open_capture(path):
            frames.append((stream, fr))
    except (CaptureError, OSError) as e:
        error = str(e)
    return batch_from_frames(frames), error


def merge_batches(batches: list[Batch]) -> Batch:
    """Frames of several streams in the order ckptd.pipeline.file_source yields them
    (heapq.merge by (time, stream, frame number))."""
    if len(batches) == 1:
        return batches[0]
    which, idx = _kernel.merge_order([b.ts for b in batches])
    return _gather(batches, [0] * len(batches), which, idx)


def load_captures(paths: list[str]) -> tuple[Batch, list[str]]:
    """Every file (one per stream), merged; and the errors that cut files short."""
    loaded = [load_capture(p, k) for k, p in enumerate(paths)]
    return merge_batches([b for b, _ in loaded]), [e for _, e in loaded if e]


# -- streaming: mapped files a chunk at a time, merged by index -----------------------------
def _reference_error(path) -> str | None:
    """The error parsers' reader raises for a file, worded as file_source reports it."""
    try:
        for _ in open_capture(path):
            pass
    except (CaptureError, OSError) as e:
        return str(e)
    return None


def _reference_chunks(path, stream: int, errors: list[str]) -> Iterator[Batch]:
    """A file through parsers' reader (pcapng; a pcap that is no regular file), as
    Batches of CHUNK_FRAMES frames; the error that ends it early goes to errors."""
    frames = []
    try:
        for fr in open_capture(path):
            frames.append((stream, fr))
            if len(frames) == CHUNK_FRAMES:
                yield batch_from_frames(frames)
                frames = []
    except (CaptureError, OSError) as e:
        errors.append(CaptureDamage(path, e))
    if frames:
        yield batch_from_frames(frames)


def _pcap_chunks(path, stream: int, files: MappedFiles, buf: np.ndarray, k: int, chunk_bytes: int,
                 errors: list[str], checker=None) -> Iterator[Batch]:
    """Mapped file k as Batches of the records that start in each `chunk_bytes`: offsets
    into buf (every mapped file's bytes), nothing copied. Indexing faults in the pages
    that hold record headers; with a checker (ckptd.fast.icrc.icrc_checker) it also
    checks each frame's ICRC as it goes (Batch.icrc_checked), on the same thread."""
    start, size = files.starts[k], files.sizes[k]
    data = buf[start:start + size]
    if (hdr := _pcap_header(data[:24].tobytes())) is None:
        yield from _reference_chunks(path, stream, errors)  # the reader words what is wrong
        return
    big, tick, linktype = hdr
    cap = chunk_bytes // 16 + 1
    scratch = [np.empty(cap, np.int64) for _ in range(5)]
    checked = np.empty(cap, np.uint8) if checker is not None else None
    pos, numbered = 24, 0
    while pos < size:
        n, end, clean = _kernel.index_pcap(data, pos, pos + chunk_bytes, big, start, *scratch,
                                           checker, linktype, checked)
        if n:
            offsets, caplen, origlen, sec, frac = (a[:n].copy() for a in scratch)
            yield Batch(buf, offsets, caplen, origlen, np.full(n, stream, np.int32),
                        np.full(n, linktype, np.int32),
                        np.arange(numbered + 1, numbered + n + 1, dtype=np.int64),
                        sec * 1_000_000_000 + frac * tick,
                        None if checked is None else checked[:n].copy())
            numbered += n
        if not clean:
            errors.append(CaptureDamage(path, _reference_error(path) or f"{path}: capture ends inside a record"))
            return
        pos = end


def _mapped_merge(paths: list[str], buf: np.ndarray | None, specs: list, chunk_bytes: int,
                  errors: list[str], checker) -> Iterator[Batch]:
    """stream_batches where every file is a mapped pcap (or could not be opened):
    cython_ext's PcapMerge indexes and merges, one call without the GIL per Batch.
    specs: per stream, (where its file starts in buf, its size, big-endian, ns per tick,
    linktype, ns taken off its times), or None."""
    merge = _kernel.PcapMerge(buf if buf is not None else np.zeros(0, np.uint8), specs, chunk_bytes, checker)
    while True:
        arrays = merge.next_batch()
        for s in merge.cut_short():
            errors.append(CaptureDamage(paths[s], _reference_error(paths[s])
                                        or f"{paths[s]}: capture ends inside a record"))
        if arrays is None:
            return
        yield Batch(buf, *arrays)


def _gather(sources: list[Batch], first: list[int], which: np.ndarray, idx: np.ndarray) -> Batch:
    """A Batch of frames taken from several sources: frame t is sources[which[t]]'s frame
    first[which[t]] + idx[t]. Sources over one buffer (mapped files) are merged by their
    offsets alone; otherwise each source's contiguous run of frames is copied in one span."""
    if len(which) == 0:
        return batch_from_frames([])
    counts = np.bincount(which, minlength=len(sources))
    shared = all(b.buf is sources[0].buf for b in sources)
    spans, runs = [], []  # runs: (source, first frame, end, offset shift) per source used
    base = 0
    for b, lo, c in zip(sources, first, counts.tolist()):
        if c == 0:
            continue
        hi = lo + c
        start = int(b.offsets[lo])
        stop = int(b.offsets[hi - 1] + b.caplen[hi - 1])
        spans.append(b.buf[start:stop])
        runs.append((b, lo, hi, 0 if shared else base - start))
        base += stop - start
    pos = np.concatenate(([0], np.cumsum(counts)[:-1]))[which] + idx

    def take(name, shift=False):
        return np.concatenate([getattr(b, name)[lo:hi] + (d if shift else 0) for b, lo, hi, d in runs])[pos]

    buf = sources[0].buf if shared else np.concatenate(spans)
    checked = None
    if any(b.icrc_checked is not None for b, *_ in runs):  # unchecked sources: 0, the kernel checks
        checked = np.concatenate([np.zeros(hi - lo, np.uint8) if b.icrc_checked is None
                                  else b.icrc_checked[lo:hi] for b, lo, hi, _ in runs])[pos]
    return Batch(buf, take("offsets", True), take("caplen"), take("origlen"),
                 take("stream"), take("linktype"), take("frame_no"), take("ts"), checked)


def stream_batches(paths: list[str], errors: list[str], chunk_bytes: int = CHUNK_BYTES,
                   checker=None, shifts: list[int] | None = None) -> Iterator[Batch]:
    """Every file (one per stream), merged into Batches in the order file_source yields
    the frames: repeatedly the smallest (time, stream, frame number) head. Each file is
    indexed a chunk at a time; that choice needs every stream's next frame indexed, so
    a merged Batch ends where some stream's chunk runs out; that stream's next chunk
    is indexed and the merge goes on. Pcap files are mapped (cython_ext/filemap.pyx) and
    every Batch points into the mapping: no bytes are read or copied. With a checker
    (ckptd.fast.icrc.icrc_checker) every frame's ICRC is checked on the way
    (Batch.icrc_checked): mapped files as they are indexed, the others as read.

    The files are opened, recognized and mapped here, on the caller's thread (well under
    a millisecond), and the Batches come from the returned iterator: run on a
    ReaderStage's thread, its first step is then indexing, which runs without the GIL.
    Opened on that thread, while the caller built the pipeline (pure Python), they took
    ~16 ms of GIL hand-overs on issue 16's replay before the first chunk was indexed.

    Where every file is a pcap, cython_ext's PcapMerge indexes and merges them in one call
    without the GIL per Batch: with numpy calls in between, the reader waited for the GIL
    at each one, up to the switch interval, whenever the pipeline ran Python
    (benchmarks/RESULTS.md, session 17). A pcapng stream (parsers' reader, its own
    buffer) is merged with the others by _merged, which copies the frames into one buffer.
    Files that cannot be opened or recognized are reported in errors, in stream order.
    `shifts`: ns taken off each stream's capture times (ckptd.core.clock.stream_shifts;
    frames without a time keep their frame numbers), as file_source takes them off."""
    shifts = shifts or [0] * len(paths)
    formats: list[str | None] = []
    for p in paths:
        try:
            fmt = capture_format(p)  # a pipe ("stream") goes to parsers' reader, which sniffs it
            formats.append("mapped" if fmt == "pcap" and mappable(p) else fmt)
        except (CaptureError, OSError) as e:
            errors.append(CaptureDamage(p, e))
            formats.append(None)
    mapped = [p for p, f in zip(paths, formats) if f == "mapped"]
    files = MappedFiles(mapped) if mapped else None
    buf = np.frombuffer(files, np.uint8) if mapped else None
    specs, k, all_pcap = [], 0, True  # PcapMerge's per stream
    for fmt in formats:
        spec = None
        if fmt == "mapped":
            start, size = files.starts[k], files.sizes[k]
            k += 1
            hdr = _pcap_header(buf[start:start + min(24, size)].tobytes())
            all_pcap &= hdr is not None  # else parsers' reader words what is wrong
            spec = None if hdr is None else (start, size, *hdr, shifts[len(specs)])
        elif fmt is not None:
            all_pcap = False
        specs.append(spec)
    if all_pcap:
        return _mapped_merge(paths, buf, specs, chunk_bytes, errors, checker)
    sources, nmapped = [], 0
    for k, (p, fmt) in enumerate(zip(paths, formats)):
        if fmt == "mapped":
            sources.append(_shifted(_pcap_chunks(p, k, files, buf, nmapped, chunk_bytes, errors, checker),
                                    shifts[k]))
            nmapped += 1
        elif fmt is not None:
            sources.append(_shifted(_reference_chunks(p, k, errors), shifts[k]))
        else:
            sources.append(iter(()))
    return _merged(sources, len(paths), checker)


def _shifted(batches: Iterator[Batch], shift: int) -> Iterator[Batch]:
    """A stream's Batches with `shift` ns taken off their capture times, and a frame
    without one merged at its frame number (CapturedFrame.merge_time)."""
    for b in batches:
        untimed = b.ts == 0
        if untimed.any():
            b.ts = np.where(untimed, b.frame_no, b.ts - shift)
        elif shift:
            b.ts = b.ts - shift
        yield b


def _merged(sources: list[Iterator[Batch]], nstreams: int, checker) -> Iterator[Batch]:
    """stream_batches' merge of its sources' Batches."""
    def refill(s):
        for b in sources[s]:
            if len(b):
                if checker is not None and b.icrc_checked is None:
                    b.icrc_checked = checker.check_icrc(b.buf, b.offsets, b.caplen, b.origlen, b.linktype)
                return b
        return None

    pend = [refill(s) for s in range(nstreams)]
    pos = [0] * nstreams
    while True:
        live = [s for s in range(nstreams) if pend[s] is not None]
        if not live:
            return
        if len(live) == 1:
            (s,) = live
            b, lo = pend[s], pos[s]
            yield b if lo == 0 else _gather([b], [lo], np.zeros(len(b) - lo, np.int64),
                                           np.arange(len(b) - lo, dtype=np.int64))
            pend[s], pos[s] = refill(s), 0
            continue
        which, idx = _kernel.merge_order([pend[s].ts[pos[s]:] for s in live])
        # The merge is exact up to where a stream's last pending frame goes out: the
        # last place its number appears in `which`.
        backwards = which[::-1]
        cut = len(which) - max(int(np.argmax(backwards == j)) for j in range(len(live)))
        yield _gather([pend[s] for s in live], [pos[s] for s in live], which[:cut], idx[:cut])
        taken = np.bincount(which[:cut], minlength=len(live))
        for j, s in enumerate(live):
            pos[s] += int(taken[j])
            if pos[s] == len(pend[s]):
                pend[s], pos[s] = refill(s), 0


def reader_cpu() -> int | None:
    """A CPU for the reader alone where the process may use 2 or more (the highest), else
    None. The reader keeps to it; extraction and the optimizer's thread may use every CPU,
    the reader's too, since indexing and the ICRC check fill about half of one
    (benchmarks/RESULTS.md: 0.091-0.097 s on issue 16's replay, against 0.099-0.101 with
    the rest kept off the reader's CPU)."""
    try:
        mask = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    return max(mask) if len(mask) >= 2 else None


def release_mapped(batch: Batch):
    """The consumer is done with a Batch: the mapped pages before each stream's last
    frame in it are released (MappedFiles.release_before; each stream's frames lie in
    file order), so a replay's resident size stays at the Batches in flight."""
    files = getattr(batch.buf.base, "obj", None)
    if not isinstance(files, MappedFiles) or not len(batch):
        return
    streams, from_end = np.unique(batch.stream[::-1], return_index=True)
    for pos in batch.offsets[len(batch) - 1 - from_end].tolist():
        files.release_before(pos)


class ReaderStage:
    """Runs an iterator of Batches (reading files, merging) on its own thread and hands
    them over through a bounded queue, so reading overlaps extraction. A full queue
    makes the reader wait (`full_waits`: extraction is the slower stage); an empty one
    makes the consumer wait (`empty_waits`: reading is). An error in the reader is
    raised in the consumer after the Batches before it. With `release`, each Batch the
    consumer is done with (it asked for the next) is handed to it on the reader's
    thread, before the reader's next read or while it waits for room (release_mapped:
    0.02 s of page-table work per 446 MB that stays off the consumer's core)."""

    _END = object()

    def __init__(self, batches: Iterable[Batch], depth: int = READ_DEPTH,
                 release: Callable[[Batch], None] | None = None, cpu: int | None = None):
        self.release = release
        self.cpu = cpu  # the CPU the reader keeps to itself (reader_cpu), or None
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # Batches for release
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.full_waits = self.empty_waits = 0
        self._stop = threading.Event()
        self._go = threading.Event()  # cleared by pause(True)
        self._go.set()
        self.thread = Thread(target=self._work, args=(iter(batches),),
                                       name="ckptd-read", daemon=True)
        self.thread.start()

    def _work(self, batches):
        if self.cpu is not None:
            try:
                os.sched_setaffinity(0, {self.cpu})  # this thread only (Linux: per thread)
            except OSError:
                self.cpu = None
        if self.cpu is None:
            # Sharing cores with the other stages, reading ahead is the least urgent
            # work: the optimizer's step (the commit waits for it) goes first.
            lower_priority(READER_NICE)
        try:
            while True:
                self._go.wait()
                self._release_done()
                b = next(batches, None)
                if b is None:
                    break
                if self.queue.full():
                    self.full_waits += 1
                while not self._stop.is_set():
                    try:
                        self.queue.put(b, timeout=0.05)
                        break
                    except queue.Full:
                        self._release_done()
                if self._stop.is_set():
                    return
        except BaseException as e:  # raised in the consumer
            self.error = e
        finally:
            if not self._stop.is_set():
                self.queue.put(self._END)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            if self.queue.empty():
                self.empty_waits += 1
                # Nothing left to extract: a reader paused for the commit (pause) must go
                # on, since the commit may wait for later frames (the agreement window)
                # and would then wait forever.
                self._go.set()
            b = self.queue.get()
            if b is self._END:
                break
            yield b
            if self.release is not None:
                self._done.put(b)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def _release_done(self):
        while self.release is not None:
            try:
                b = self._done.get_nowait()
            except queue.Empty:
                return
            self.release(b)

    def pause(self, on: bool):
        """Hold the reader before its next read (on=True) or let it go on. A reader
        on a CPU of its own is never held: the optimizer's thread may share that CPU now,
        but holding the reader for it measured slower (issue 16's replay: 0.104 s best
        against 0.097)."""
        if self.cpu is not None:
            return
        if on:
            self._go.clear()
        else:
            self._go.set()

    def close(self):
        """Stop reading early (the consumer gives up)."""
        self._stop.set()
        self._go.set()
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.thread.join()
