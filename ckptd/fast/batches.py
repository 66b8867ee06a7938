"""Source stage for capture files: frames as Batches (many frames in one buffer).

    load_capture, load_captures   whole files in memory (benchmarks that measure
                                  extraction alone read from memory)
    stream_batches                bounded chunks of every file, merged in capture-time
                                  order exactly as ckptd.pipeline.file_source merges them
    ReaderStage                   any iterator of Batches run on its own thread behind a
                                  bounded queue: the fast path's read stage
    BufferPool                    byte buffers stream_batches writes into and a ReaderStage
                                  hands back once the consumer is done with a Batch

A clean pcap is indexed in place by the kernel (no per-frame Python); pcapng, and a pcap
with a broken record, go through the reference readers in parsers/, which also word the
error that ends a file early.
"""
from __future__ import annotations

import os
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from cython_ext import batch as _kernel
from parsers.capfile import CaptureError, CapturedFrame, capture_format, open_capture
from parsers.frame import MAX_SNAPLEN
from parsers.pcap import MAGIC_NS, MAGIC_US

# Bytes read from a file at a time by stream_batches. Small enough that the pool's
# buffers, reused chunk after chunk, stay few and cache-warm: with 32 MiB chunks a
# replay of 446 MB touched ~400 MB of fresh pages (a fault per page) and the reader,
# not the kernel, set the pace (0.82-0.92 s against 0.36-0.40 s with 4 MiB, same run,
# benchmarks/RESULTS.md).
CHUNK_BYTES = 4 << 20
CHUNK_FRAMES = 1 << 15  # frames per Batch from the reference readers
READ_DEPTH = 3  # Batches a ReaderStage may hold ready
READER_NICE = 10  # the reader thread's nice value (in Linux each thread has its own)


# -- buffers -------------------------------------------------------------------------------
class BufferPool:
    """Byte buffers reused across chunks and Batches. Memory written for the first time
    costs a page fault per page, in this VM 2.5-8x the cost of copying into mapped
    memory (benchmarks/RESULTS.md), and a replay writes every byte twice (read into a
    chunk, merged into a Batch): so both go into buffers handed back when done with.
    Thread-safe: the reader thread takes, the consumer gives back."""

    GRAIN = 1 << 20  # capacities are rounded up to this, so near sizes share buffers

    def __init__(self):
        self.free: list[np.ndarray] = []
        self.made = 0  # buffers allocated (the rest of the takes reused one)
        self._mine: dict[int, weakref.ref] = {}  # buffers this pool made: only those come back
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        """n bytes (uninitialized), in the smallest free buffer that holds them."""
        with self._lock:
            fits = [k for k, a in enumerate(self.free) if len(a) >= n]
            if fits:
                k = min(fits, key=lambda k: len(self.free[k]))
                return self.free.pop(k)[:n]
        a = np.empty(-(-max(n, 1) // self.GRAIN) * self.GRAIN, np.uint8)
        self.made += 1
        key = id(a)
        self._mine[key] = weakref.ref(a, lambda _: self._mine.pop(key, None))
        return a[:n]

    def give_back(self, buf: np.ndarray):
        """Whoever held buf (or any view of it) is done with it; buffers the pool did
        not make are left alone."""
        base = buf if buf.base is None else buf.base
        ref = self._mine.get(id(base))
        if ref is not None and ref() is base:
            with self._lock:
                if all(a is not base for a in self.free):
                    self.free.append(base)


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
    ts: np.ndarray  # int64, ns (0 where the capture has none)

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
                 np.array([fr.ts_ns or 0 for _, fr in frames], np.int64))


_PCAP_MAGICS = {MAGIC_US.to_bytes(4, "little"): (False, 1000), MAGIC_US.to_bytes(4, "big"): (True, 1000),
                MAGIC_NS.to_bytes(4, "little"): (False, 1), MAGIC_NS.to_bytes(4, "big"): (True, 1)}


def _pcap_header(head: bytes) -> tuple[bool, int, int] | None:
    """(big-endian, ns per timestamp tick, linktype) of a classic pcap file header."""
    if len(head) != 24 or head[:4] not in _PCAP_MAGICS:
        return None
    big, tick = _PCAP_MAGICS[head[:4]]
    return big, tick, int.from_bytes(head[20:24], "big" if big else "little") & 0xFFFF


def load_capture(path, stream: int = 0) -> tuple[Batch, str | None]:
    """One capture file in memory as a Batch, and the CaptureError/OSError message that
    ended it early (None when it read to the end), as file_source would report it.

    A clean pcap is indexed in place by the kernel (no per-frame Python); pcapng, and a
    pcap with a broken record, go through the reference readers in parsers/."""
    try:
        fmt = capture_format(path)
        if fmt == "pcap":
            data = np.fromfile(path, np.uint8)
            head = data[:24].tobytes()
            if (hdr := _pcap_header(head)) is not None:
                big, tick, linktype = hdr
                cap = max(0, (len(data) - 24) // 16)
                arrs = [np.empty(cap, np.int64) for _ in range(5)]
                n, clean = _kernel.index_pcap(data, 24, big, 0, *arrs)
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


# -- streaming: bounded chunks, merged ----------------------------------------------------
def _reference_error(path) -> str | None:
    """The error parsers' reader raises for a file, worded as file_source reports it."""
    try:
        for _ in open_capture(path):
            pass
    except (CaptureError, OSError) as e:
        return str(e)
    return None


def _file_chunks(path, stream: int, chunk_bytes: int, errors: list[str],
                 pool: BufferPool | None = None) -> Iterator[Batch]:
    """One file as Batches of at most about chunk_bytes each (a record longer than that
    makes its chunk longer); a problem that ends the file early goes to errors."""
    try:
        fmt = capture_format(path)
        f = open(path, "rb")
    except (CaptureError, OSError) as e:
        errors.append(str(e))
        return
    with f:
        head = f.read(24) if fmt == "pcap" else b""
        if (hdr := _pcap_header(head)) is not None:
            big, tick, linktype = hdr
            yield from _pcap_chunks(path, f, stream, big, tick, linktype, chunk_bytes, errors, pool)
            return
    frames = []
    try:
        for fr in open_capture(path):
            frames.append((stream, fr))
            if len(frames) == CHUNK_FRAMES:
                yield batch_from_frames(frames)
                frames = []
    except (CaptureError, OSError) as e:
        errors.append(str(e))
    if frames:
        yield batch_from_frames(frames)


def _pcap_chunks(path, f, stream, big, tick, linktype, chunk_bytes, errors, pool) -> Iterator[Batch]:
    carry = np.zeros(0, np.uint8)  # the start of a record the last chunk cut off
    numbered = 0  # frames yielded so far
    while True:
        n = len(carry) + chunk_bytes
        data = pool.take(n) if pool is not None else np.empty(n, np.uint8)
        data[:len(carry)] = carry
        got = f.readinto(memoryview(data)[len(carry):])
        eof = got < chunk_bytes
        data = data[:len(carry) + got]
        cap = len(data) // 16
        arrs = [np.empty(cap, np.int64) for _ in range(5)]
        n, _ = _kernel.index_pcap(data, 0, big, 0, *arrs)
        # copies: the arrays are sized for a frame every 16 bytes, and a Batch lives on
        offsets, caplen, origlen, sec, frac = (a[:n].copy() for a in arrs)
        del arrs
        if n:
            yield Batch(data, offsets, caplen, origlen, np.full(n, stream, np.int32),
                        np.full(n, linktype, np.int32),
                        np.arange(numbered + 1, numbered + n + 1, dtype=np.int64),
                        sec * 1_000_000_000 + frac * tick)
            numbered += n
        end = int(offsets[-1] + caplen[-1]) if n else 0
        rest = data[end:]
        if len(rest) >= 16:
            incl = int.from_bytes(rest[8:12].tobytes(), "big" if big else "little")
            if incl > MAX_SNAPLEN:
                eof = True  # an implausible record: the reference reader words the error
        if eof:
            if len(rest):
                errors.append(_reference_error(path) or f"{path}: capture ends inside a record")
            return
        carry = rest.copy()
        if not n and pool is not None:  # no whole record in it: nobody holds the buffer
            pool.give_back(data)


def _gather(sources: list[Batch], first: list[int], which: np.ndarray, idx: np.ndarray,
            pool: BufferPool | None = None) -> Batch:
    """A Batch of frames taken from several sources: frame t is sources[which[t]]'s frame
    first[which[t]] + idx[t]. Each source gives a contiguous run of frames, so its bytes
    are copied in one span (into a buffer from the pool, when given)."""
    if len(which) == 0:
        return batch_from_frames([])
    counts = np.bincount(which, minlength=len(sources))
    spans, runs = [], []  # runs: (source, first frame, end, offset shift) per source used
    base = 0
    for b, lo, c in zip(sources, first, counts.tolist()):
        if c == 0:
            continue
        hi = lo + c
        start = int(b.offsets[lo])
        stop = int(b.offsets[hi - 1] + b.caplen[hi - 1])
        spans.append(b.buf[start:stop])
        runs.append((b, lo, hi, base - start))
        base += stop - start
    pos = np.concatenate(([0], np.cumsum(counts)[:-1]))[which] + idx

    def take(name, shift=False):
        return np.concatenate([getattr(b, name)[lo:hi] + (d if shift else 0) for b, lo, hi, d in runs])[pos]

    if pool is not None:
        buf = pool.take(base)
        np.concatenate(spans, out=buf)
    else:
        buf = np.concatenate(spans)
    return Batch(buf, take("offsets", True), take("caplen"), take("origlen"),
                 take("stream"), take("linktype"), take("frame_no"), take("ts"))


def stream_batches(paths: list[str], errors: list[str], chunk_bytes: int = CHUNK_BYTES,
                   pool: BufferPool | None = None) -> Iterator[Batch]:
    """Every file (one per stream) in chunks, merged into Batches in the order
    file_source yields the frames: repeatedly the smallest (time, stream, frame number)
    head. That choice needs every stream's next frame in memory, so a merged Batch ends
    where some stream's chunk runs out; that stream's next chunk is read and the merge
    goes on. Memory: about one chunk per stream, plus the Batches handed out.

    With a pool, chunks and merged Batches are written into its buffers; a chunk's goes
    back once merged out, a Batch's is the consumer's to give back (ReaderStage's
    release)."""
    chunks = [_file_chunks(p, k, chunk_bytes, errors, pool) for k, p in enumerate(paths)]

    def refill(s):
        for b in chunks[s]:
            if len(b):
                return b
        return None

    pend = [refill(s) for s in range(len(paths))]
    pos = [0] * len(paths)
    while True:
        live = [s for s in range(len(paths)) if pend[s] is not None]
        if not live:
            return
        if len(live) == 1:
            (s,) = live
            b, lo = pend[s], pos[s]
            if lo == 0:
                yield b  # the chunk itself: its buffer is the consumer's now
            else:
                yield _gather([b], [lo], np.zeros(len(b) - lo, np.int64),
                              np.arange(len(b) - lo, dtype=np.int64), pool)
                if pool is not None:
                    pool.give_back(b.buf)
            pend[s], pos[s] = refill(s), 0
            continue
        which, idx = _kernel.merge_order([pend[s].ts[pos[s]:] for s in live])
        # the merge is exact up to where a stream's last pending frame goes out
        left = np.array([len(pend[s]) - pos[s] for s in live])
        last = which * (1 << 40) + idx  # (stream, index) as one key
        at = np.flatnonzero(np.isin(last, np.arange(len(live)) * (1 << 40) + left - 1))
        cut = int(at.min()) + 1
        yield _gather([pend[s] for s in live], [pos[s] for s in live], which[:cut], idx[:cut], pool)
        taken = np.bincount(which[:cut], minlength=len(live))
        for j, s in enumerate(live):
            pos[s] += int(taken[j])
            if pos[s] == len(pend[s]):
                if pool is not None:  # every frame of it was copied out
                    pool.give_back(pend[s].buf)
                pend[s], pos[s] = refill(s), 0


class ReaderStage:
    """Runs an iterator of Batches (reading files, merging) on its own thread and hands
    them over through a bounded queue, so reading overlaps extraction. A full queue
    makes the reader wait (`full_waits`: extraction is the slower stage); an empty one
    makes the consumer wait (`empty_waits`: reading is). An error in the reader is
    raised in the consumer after the Batches before it. With `release`, each Batch is
    handed to it when the consumer asks for the next one (a Batch is the consumer's
    only until then: the fast pipeline copies what it keeps)."""

    _END = object()

    def __init__(self, batches: Iterable[Batch], depth: int = READ_DEPTH,
                 release: Callable[[Batch], None] | None = None):
        self.release = release
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.full_waits = self.empty_waits = 0
        self._stop = threading.Event()
        self._go = threading.Event()  # cleared by pause(True)
        self._go.set()
        self.thread = threading.Thread(target=self._work, args=(iter(batches),),
                                       name="ckptd-read", daemon=True)
        self.thread.start()

    def _work(self, batches):
        # Reading ahead is the least urgent work: with fewer cores than stages, the
        # optimizer's step (the commit waits for it) goes first.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READER_NICE)
        except OSError:
            pass  # not permitted here: the reader keeps the process's priority
        try:
            while True:
                self._go.wait()
                b = next(batches, None)
                if b is None:
                    break
                if self.queue.full():
                    self.full_waits += 1
                while not self._stop.is_set():
                    try:
                        self.queue.put(b, timeout=0.2)
                        break
                    except queue.Full:
                        continue
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
                self.release(b)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def pause(self, on: bool):
        """Hold the reader before its next read (on=True) or let it go on."""
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
