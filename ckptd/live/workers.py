"""Capture workers: one process per configured interface reads its TPACKET_V3 ring and
hands each block to the daemon through shared memory.

    workers = CaptureWorkers(interfaces, bpf=True, busy_poll=False)
    for stream, batch in workers.batches(stop, errors):   # the coordinator's loop
        pipe.run_batch(batch)                             # slot freed on the next turn
    workers.close()

Why: in one process the ring is drained only between the pipeline's batches, so a
commit (optimizer step, checkpoint write) or a slow stretch of the reference path
stalls every ring at once, and the kernel drops what arrives meanwhile. A worker does
nothing but wait for retired blocks, copy their frames into a free shared-memory slot
(one memcpy of each block's used part, offsets rebased; cython_ext/ring.pyx indexed
them in place) and give the blocks back to the kernel at once; the coordinator runs the
batch kernel, commits and steps the optimizer. A worker also checks each frame's ICRC
as it hands the slot over (ckptd.fast.icrc.icrc_checker on the bytes it has just copied,
still in its cache), the share of the kernel's work that needs nothing but the frame:
the coordinator's kernel computes no CRC for a frame found good (Batch.icrc_checked)
and decodes the rest as before. The slots add `SLOTS` slots of a turn's bytes
(ckptd.live.ring.turn_bytes) of backlog per interface beyond the ring, and no worker shares the coordinator's GIL. A worker can
be pinned to a CPU and can busy-poll its ring instead of sleeping in poll(2).

A worker that dies is reported (errors, and `worker` in its capture's stats) and the
other streams go on; what its ring held then is lost, counted as `lost` (frames the
kernel passed to it that never reached the coordinator). Kernel drops stay the
kernel's own count (PACKET_STATISTICS), apart from that.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import time
from typing import Callable, Iterator

import numpy as np

from ckptd.fast.batches import Batch
from ckptd.live.hugemem import SharedArea
from ckptd.live.ring import TURN_BYTES, timed_wait
from ckptd.threads import name_os_thread
from parsers.frame import LINKTYPE_ETHERNET

SLOTS = 8  # shared-memory slots per worker, each a turn's bytes of ring blocks (at least one)
_MIN_FRAME_SPACE = 64  # a frame takes more than this much of a block (as in ring.py)
_META = 5  # int64 arrays per slot: offsets, caplen, origlen, ts, frame_no; then a byte per
# frame: 1 where the worker found the frame RoCE with a good ICRC
ERROR_CHECK_S = 0.05  # busy polling: how often a worker looks for its socket's error (poll(2))
STOP_DRAIN_S = 1.0  # after stop, a worker hands over what its ring holds for at most this long
# A worker still running this long after the stop is hung (a healthy one ends within
# STOP_DRAIN_S): it is killed, so the daemon stops in bounded time. What it handed over
# stays readable: its pipe's messages and its slots outlive it.
STOP_GRACE_S = 2 * STOP_DRAIN_S + 2.0


def slot_blocks(block_size: int, slot_bytes: int) -> int:
    """Ring blocks a slot holds: slot_bytes' worth (at least one). slot_bytes is the
    in-process path's turn (ring.turn_bytes of the plan): the coordinator takes a slot
    per stream as it comes, so a slot may not span more of a stream than a turn does
    (ring_batches: no stream an iteration ahead of another within one turn), and the
    larger it may be, the less of the coordinator's fixed cost per batch each frame
    bears."""
    return max(1, slot_bytes // block_size)


def _layout(block_size: int, slot_bytes: int) -> tuple[int, int, int]:
    """(bytes of frame data, frames the arrays hold, bytes) of one slot."""
    data = slot_blocks(block_size, slot_bytes) * block_size
    frames = data // _MIN_FRAME_SPACE
    return data, frames, data + _META * 8 * frames + frames


def _busy_flags(shm: SharedArea, block_size: int, slot_bytes: int) -> np.ndarray:
    """One byte per slot after the slots: 1 while the slot holds frames the coordinator
    has not processed yet. The worker sets it, the coordinator clears it: a slot goes
    back without a message (and the wakeup a message costs)."""
    return np.ndarray(SLOTS, np.uint8, shm.buf, SLOTS * _layout(block_size, slot_bytes)[2])


def _slot_views(shm: SharedArea, slot: int, block_size: int, slot_bytes: int):
    nbytes, frames, size = _layout(block_size, slot_bytes)
    base = slot * size
    data = np.ndarray(nbytes, np.uint8, shm.buf, base)
    meta = np.ndarray((_META, frames), np.int64, shm.buf, base + nbytes)
    checked = np.ndarray(frames, np.uint8, shm.buf, base + nbytes + _META * 8 * frames)
    return data, meta, checked


def _copy_blocks(batch: Batch, block_size: int, block_nr: int, data: np.ndarray, meta: np.ndarray) -> int:
    """The batch's frames (whole consecutive ring blocks, maybe wrapping) into a slot:
    each block's used bytes at block_size x its position in the batch, offsets rebased.
    Returns the frame count."""
    n = len(batch)
    blk = batch.offsets // block_size
    pos = (blk - blk[0]) % block_nr  # the block's place in the batch
    meta[0, :n] = batch.offsets - blk * block_size + pos * block_size
    ends = batch.offsets + batch.caplen
    cuts = np.flatnonzero(np.diff(pos)) + 1  # where each block's frames start
    for lo, hi in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [n])).tolist()):
        src = int(blk[lo]) * block_size
        dst = int(pos[lo]) * block_size
        used = int(ends[lo:hi].max()) - src
        data[dst:dst + used] = batch.buf[src:src + used]
    meta[1, :n] = batch.caplen
    meta[2, :n] = batch.origlen
    meta[3, :n] = batch.ts
    meta[4, :n] = batch.frame_no
    return n


# -- the worker process ---------------------------------------------------------------------
def _worker_main(stream: int, spec: dict, shm: SharedArea, conn, cpu: int | None, busy_poll: bool,
                 slot_bytes: int, drop_capabilities: bool = False, icrc: bool = False):
    """One capture worker: ring -> shared-memory slots -> ("batch", slot, n) messages;
    the coordinator clears the slot's busy flag when done with it; ("stop",) ends the
    worker after the ring is drained. Signals are the coordinator's business: a SIGTERM to the whole
    service must not end a worker before its ring is drained."""
    from ckptd.live.ring import RingCapture
    name_os_thread(f"ckptd-capture{stream}")  # top, ps and capture_rate tell the workers apart
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        cap = RingCapture(**spec)
    except OSError as e:
        conn.send(("error", str(e)))
        return
    if drop_capabilities:  # the ring is open: this process needs no capability any more
        from ckptd.live.privilege import PrivilegeError, drop_capabilities as drop
        try:
            drop()
        except PrivilegeError as e:
            cap.close()
            conn.send(("error", f"capture worker for {spec['ifname']}: {e}"))
            return
    checker = None
    if icrc:
        from ckptd.fast.icrc import icrc_checker  # the kernel's CRC set-up, without torch
        checker = icrc_checker()
    try:
        _capture_loop(stream, cap, shm, conn, busy_poll, slot_bytes, checker)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        cap.close()  # the coordinator is gone: nobody to hand frames to


def _capture_loop(stream: int, cap, shm: SharedArea, conn, busy_poll: bool, slot_bytes: int, checker=None):
    from ckptd.live.ring import GONE
    bs = cap.block_size
    per_slot = slot_blocks(bs, slot_bytes)
    views = [_slot_views(shm, s, bs, slot_bytes) for s in range(SLOTS)]
    busy = _busy_flags(shm, bs, slot_bytes)
    poller = select.poll()
    poller.register(cap.fileno(), select.POLLIN | select.POLLERR)
    poller.register(conn.fileno(), select.POLLIN)
    stop_at = None
    next_check = 0.0  # busy polling: when the socket's error is next looked at
    conn.send(("ready", cap.stats()))
    while True:
        while conn.poll(0):
            if conn.recv()[0] == "stop" and stop_at is None:
                stop_at = time.monotonic() + STOP_DRAIN_S
        if stop_at is not None and time.monotonic() > stop_at:
            break
        free = np.flatnonzero(busy == 0)
        if not len(free):  # the coordinator is behind: the ring holds what comes meanwhile
            conn.poll(0.001)
            continue
        batch = cap.read_batch(stream, per_slot)
        if batch is None:
            if stop_at is not None and not _more_soon(cap, poller):
                break
            # busy polling spins on the ring, yet the socket's error (a link down, the
            # interface deleted) is only seen through poll(2): looked at every ERROR_CHECK_S
            if busy_poll:
                if time.monotonic() < next_check:
                    continue
                next_check = time.monotonic() + ERROR_CHECK_S
            for fd, ev in poller.poll(0 if busy_poll else 50):
                if fd == cap.fileno() and ev & select.POLLERR:
                    # the link went down (told to the coordinator, as the in-process
                    # loop tells it), or the interface is gone: nothing more will come
                    msg = cap.take_error()
                    if cap.gone():
                        conn.send(("error", f"{msg + ': ' if msg else ''}{GONE}"))
                        cap.close()
                        conn.send(("done", cap.stats()))
                        return
                    if msg:
                        conn.send(("error", msg))
            continue
        slot = int(free[0])
        data, meta, checked = views[slot]
        n = _copy_blocks(batch, bs, cap.block_nr, data, meta)
        if checker is not None:
            checked[:n] = checker.check_icrc(data, meta[0, :n], meta[1, :n], meta[2, :n], batch.linktype)
        busy[slot] = 1
        del batch
        cap.release()
        conn.send(("batch", slot, n, cap.stats()))
    cap.close()
    conn.send(("done", cap.stats()))


def _more_soon(cap, poller) -> bool:
    """Stopping: does a block retire within the ring's retire timeout?"""
    poller.poll(100)
    return cap.ready()


# -- the coordinator's side -----------------------------------------------------------------
class WorkerCapture:
    """What the daemon knows of one worker's ring: the counters the worker last sent
    (RingCapture.stats()'s keys) and the worker's state."""

    def __init__(self, pool: "CaptureWorkers", stream: int, ifname: str, netns: str | None):
        self.pool, self.stream, self.ifname, self.netns = pool, stream, ifname, netns
        self.last: dict = {"packets": 0, "drops": 0, "freeze_q_cnt": 0, "delivered": 0, "blocks": 0,
                           "block_nr": None, "ready_peak": 0, "vlan_restored": 0, "errors": {}}
        self.received = 0  # frames that reached the coordinator
        self.pid: int | None = None
        self.pages = ""  # what backs its shared-memory slots (ckptd.live.hugemem: hugetlb, thp, 4k)
        self.slot_bytes = 0  # ring bytes a slot holds: the most the coordinator takes of it at once
        self.exitcode: int | None = None
        self.done = False

    def stats(self) -> dict:
        alive = self.exitcode is None and not self.done
        # frames the kernel passed to this worker's ring that never reached us: only
        # known (and only possible) once the worker has died
        lost = 0 if alive or self.done else max(0, self.last["packets"] - self.last["drops"] - self.received)
        return {"ifname": self.ifname, "netns": self.netns, **self.last,
                "worker": {"pid": self.pid, "alive": alive, "exitcode": self.exitcode, "lost": lost,
                           "pages": self.pages, "slot_bytes": self.slot_bytes}}

    def close(self):
        self.pool.close()


class CaptureWorkers:
    """One capture process per interface (docs/DAEMON.md: workers, pinning, sizing)."""

    def __init__(self, interfaces: list, *, bpf: bool, busy_poll: bool = False, drop_capabilities: bool = False,
                 huge_pages: str = "auto", icrc: bool = False, slot_bytes: int = TURN_BYTES):
        ctx = mp.get_context("spawn")  # the daemon holds torch's threads: no fork
        self.captures: list[WorkerCapture] = []
        self.shms: list[SharedArea] = []
        self.conns, self.procs = [], []
        self._closed = False
        self._views: list[list] = []
        self._busy: list[np.ndarray] = []
        self.icrc = icrc  # the workers check ICRCs: Batches carry icrc_checked
        if drop_capabilities:  # spawning starts multiprocessing's resource tracker: without any capability
            from ckptd.live.privilege import start_resource_tracker_unprivileged
            start_resource_tracker_unprivileged()
        try:
            self._spawn(ctx, interfaces, bpf, busy_poll, drop_capabilities, huge_pages, icrc, slot_bytes)
        except BaseException:
            self.close()  # no shared memory or process left behind
            raise
        # per-frame columns that are the same for every frame of a worker's batches: made once
        frames = max(_layout(i.block_size, slot_bytes)[1] for i in interfaces)
        self._linktype = np.full(frames, LINKTYPE_ETHERNET, np.int32)
        self._stream = [np.full(frames, k, np.int32) for k in range(len(interfaces))]
        self._start()

    def _spawn(self, ctx, interfaces, bpf, busy_poll, drop_capabilities, huge_pages, icrc, slot_bytes):
        for k, i in enumerate(interfaces):
            spec = {"ifname": i.ifname, "netns": i.netns, "block_size": i.block_size, "block_nr": i.block_nr,
                    "frame_size": i.frame_size, "retire_ms": i.retire_ms, "snaplen": i.snaplen, "bpf": bpf,
                    "fanout": None if i.fanout_group is None else (i.fanout_group, i.fanout_mode),
                    "erspan_session": i.erspan_session}
            shm = SharedArea(SLOTS * _layout(i.block_size, slot_bytes)[2] + SLOTS, huge_pages)
            self.shms.append(shm)
            self._views.append([_slot_views(shm, s, i.block_size, slot_bytes) for s in range(SLOTS)])
            self._busy.append(_busy_flags(shm, i.block_size, slot_bytes))
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main,
                            args=(k, spec, shm, child, i.cpu, busy_poll, slot_bytes, drop_capabilities, icrc),
                            name=f"ckptd-capture-{i.name}", daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
            wc = WorkerCapture(self, k, i.ifname, i.netns)
            wc.pid, wc.pages = p.pid, shm.pages
            wc.slot_bytes = slot_blocks(i.block_size, slot_bytes) * i.block_size
            self.captures.append(wc)

    def _start(self):
        """Wait for every worker's ring to be open; a worker that cannot open its ring
        fails the start with its message (as an in-process ring would)."""
        from ckptd.live.ring import CaptureSetupError
        for k, conn in enumerate(self.conns):
            if not conn.poll(30):
                self.close()
                raise CaptureSetupError(f"interfaces[{k}]: capture worker for {self.captures[k].ifname} did not "
                                        "start in 30 s")
            msg = conn.recv()
            if msg[0] == "error":  # named by its config entry, as an in-process ring's is
                self.close()
                raise CaptureSetupError(f"interfaces[{k}]: {msg[1]}")
            self.captures[k].last.update(msg[1])

    def batches(self, stop, errors: list[str], on_poll: Callable[[float], None] | None = None,
                idle: bool = False) -> Iterator[tuple[int, Batch | None]]:
        """(stream, Batch) as the workers hand blocks over, until stop is set and every
        worker has drained its ring (or died). A Batch's slot goes back to its worker
        when the next item is asked for. on_poll gets the seconds each wait for the
        workers took. With idle=True a wait that brought nothing yields (-1, None), as
        ring_batches does: the consumer's clock moves on while the ports are quiet (without
        it a complete iteration waited for the next traffic, or the stop, to commit).

        One poll(2) set for the whole run (each worker's pipe and its process sentinel,
        which turns readable when the process ends): the coordinator pays this per batch,
        so no selector is built per wait and no process is asked whether it lives
        until its sentinel says it ended."""
        live = set(range(len(self.conns)))
        poller = select.poll()
        which = {}  # registered fd -> (worker, is its sentinel)
        pending = []  # per worker: a poll set of its pipe alone (Connection.poll builds a selector a call)
        for k in range(len(self.conns)):
            for fd, sentinel in ((self.conns[k].fileno(), False), (self.procs[k].sentinel, True)):
                poller.register(fd, select.POLLIN)
                which[fd] = (k, sentinel)
            pending.append(select.poll())
            pending[k].register(self.conns[k].fileno(), select.POLLIN)
        exited, closed = set(), set()  # workers whose process ended; whose pipe is read to its end

        def unregister(fd):
            if which.pop(fd, None) is not None:
                poller.unregister(fd)

        def retire(k):
            live.discard(k)
            unregister(self.conns[k].fileno())
            unregister(self.procs[k].sentinel)

        stopping, killed = None, set()
        while live:
            if stop.is_set() and stopping is None:
                stopping = time.monotonic()
                for k in live:
                    self._send(k, ("stop",))
            if stopping is not None and time.monotonic() - stopping > STOP_GRACE_S:
                for k in live - exited - killed:
                    killed.add(k)
                    self.procs[k].kill()
            ready = timed_wait(on_poll, poller.poll, 50)
            if idle and not ready:
                yield -1, None
            for fd, _ in ready:
                k, sentinel = which.get(fd, (None, False))
                if sentinel:  # the process ended; what it sent before is still in its pipe
                    exited.add(k)
                    unregister(fd)
            # one slot per worker and pass, in turn as ring_batches takes the rings, so that
            # no stream gets ahead of the others by more than a slot; a worker that ended too
            for k in sorted({which[fd][0] for fd, _ in ready if fd in which and not which[fd][1]}):
                if k not in live or not pending[k].poll(0):
                    continue
                try:
                    msg = self.conns[k].recv()
                except (EOFError, OSError):  # read to its end: its process ends, or has
                    closed.add(k)
                    unregister(self.conns[k].fileno())  # a hung-up pipe polls ready for ever
                    continue
                if msg[0] == "batch":
                    _, slot, n, st = msg
                    cap = self.captures[k]
                    cap.last.update(st)
                    cap.received += n
                    yield k, self._batch(k, slot, n)
                    self._busy[k][slot] = 0
                elif msg[0] == "error":  # the link went down, or the interface is gone
                    errors.append(f"capture stream {k}: {msg[1]}")
                elif msg[0] == "done":
                    self.captures[k].last.update(msg[1])
                    self.captures[k].done = True
                    retire(k)
            for k in sorted(live & exited & closed):  # ended without "done": it died
                proc, cap = self.procs[k], self.captures[k]
                proc.join(1)
                cap.exitcode = proc.exitcode
                retire(k)
                how = (f"did not stop within {STOP_GRACE_S:g} s of the stop and was killed" if k in killed
                       else f"died (exit code {proc.exitcode})")
                errors.append(f"capture worker for stream {k} on {cap.ifname} (pid {proc.pid}) {how}; "
                              f"{cap.stats()['worker']['lost']} frames lost with it; "
                              + ("the other streams go on" if live else "no stream is left"))

    def _batch(self, k: int, slot: int, n: int) -> Batch:
        data, meta, checked = self._views[k][slot]
        return Batch(data, meta[0, :n], meta[1, :n], meta[2, :n], self._stream[k][:n],
                     self._linktype[:n], meta[4, :n], meta[3, :n], checked[:n] if self.icrc else None)

    def _send(self, k: int, msg):
        try:
            self.conns[k].send(msg)
        except (BrokenPipeError, OSError):
            pass  # the worker is gone; the sentinel reports it

    def close(self):
        if self._closed:
            return
        self._closed = True
        for p in self.procs:
            p.join(2 * STOP_DRAIN_S)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()
        self._views, self._busy = [], []
        for shm in self.shms:
            try:
                shm.close()
            except BufferError:
                pass  # a Batch still points into it: the mapping goes with the last one


__all__ = ["CaptureWorkers", "WorkerCapture", "SLOTS"]
