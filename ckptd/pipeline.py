"""The one pipeline: source -> decode -> place -> assemble -> apply -> keep.

    source    frames of every mirror stream, merged in capture-time order
    decode    per transport: parsers.roce.decode_frame (NCCL over RoCEv2) or
              parsers.tcp + ckptd.transports.gloo.tcpstream reassembly (gloo over TCP); frames that
              carry no collective data are counted here
    place     per transport: ckptd.transports.roce.extract.Extractor (flow binding, PSN -> schedule
              message, checks) or ckptd.transports.gloo.extract.GlooExtractor (gloo framing and ring)
    assemble  ckptd.core.assemble.IterationAssembly per iteration, from any number of streams
    apply     ckptd.core.shadow.ShadowModel, only for complete iterations, only in order
    keep      checkpoint files (ckptd.core.checkpoint), gradient dumps, the per-iteration report

A pcap file and a capture ring are two sources of the same frames; nothing after
`source` knows which it got. An iteration is committed the moment its last missing
element arrives (and every earlier one is done); one that stays incomplete is given
up once some flow has reached two iterations beyond it (NCCL cannot start iteration
t+2's allreduce before every rank finished t's, so nothing of t can still be on the
wire) or the input ends.

Joining a running job (ReplayOptions.join): the capture starts mid-job. Flows are placed
by PSN arithmetic from NCCL's connect PSN 0 (ckptd.transports.roce.flows); nothing is finalized until
every flow is bound, then the pipeline joins at the first iteration every flow was seen
from its start and forgets what came before. The shadow continues from the starting
state if that is the state just before, else from the trainer's checkpoint of that
iteration found through ReplayOptions.restart (a restarted daemon's own persisted state)
or ReplayOptions.resume (a file or a directory of checkpoints); until one is found,
complete iterations are reported "complete-not-applied". When no state of the iteration
before the join is there at the join, the iterations between the newest state held and
the join ran while nothing captured them: one "not-captured" report says which (the
daemon's notice asks the trainer for a checkpoint, ckptd.live.notice).
"""
from __future__ import annotations

import copy
import errno
import heapq
import logging
import os
import queue
import threading
import time
from collections import Counter, deque
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from parsers.capfile import CaptureError, CapturedFrame, open_capture

from ckptd.core.assemble import AGREE_WINDOW_MS, IterationAssembly, Missing
from ckptd.core.clock import shift_note, stream_shifts
from ckptd.core.buffers import unflatten_buffers
from ckptd.core.checkpoint import (CheckpointError, CheckpointWriteError, atomic_write, diff_checkpoints,
                                   load_checkpoint)
from ckptd.core.formats import find_checkpoint
from ckptd.core.keep import CheckpointKeeper
from ckptd.core.optim import NoLrForStep
from ckptd.transports import Placement, Transport, transport_for
from ckptd.core.plan import USED_MAP, Plan
from ckptd.core.schedule import RS
from ckptd.errors import CaptureDamage
from ckptd.core.shadow import MapNotSeen, ShadowModel, bucket_step_threads, limit_step_threads
from ckptd.threads import Thread

log = logging.getLogger("ckptd")


def _save_npy(path: Path, array: np.ndarray):
    """A --dump-gradients file, whole or not at all: a full disk is one error naming the
    file (CheckpointWriteError), never a truncated .npy left behind."""
    import io
    buf = io.BytesIO()  # np.save straight to a file reports a short write without its errno
    np.save(buf, array)
    atomic_write(path, lambda f: f.write(buf.getbuffer()), mode=0o644)

FINALIZE_LAG = 2
# Pipeline.errors' entry when joining found nothing to join (`ckptd replay` makes it its one error line)
NOTHING_JOINED = "joining: no flow of the job was recognised, no iteration joined"
SILENT_STREAM_WINDOWS = 10  # a stream silent for this many windows no longer holds commits
# Complete iterations held open at most, waiting for a live stream's copies (_copies_due):
# the memory of that many iterations' buffers (the fast path's kernel has 8 slots).
MAX_HELD = 6
# iterations committed while a stream was written off, remembered so copies it delivers
# of them later mark them unverified (Pipeline.copies_seen)
UNVERIFIED_KEPT = 1024


# -- source --------------------------------------------------------------------------
def file_source(paths: list[str], errors: list[str], warn=None,
                shifts: list[int] | None = None) -> Iterator[tuple[int, CapturedFrame]]:
    """(stream index, frame) of every file, merged by timestamp; one file, one stream.

    A file whose structure breaks mid-way ends its stream there, reported in errors.
    `warn`: open_capture's (a pcapng interface of a link type not decoded). `shifts`: ns
    taken off each stream's capture times first (ckptd.core.clock.stream_shifts)."""
    def one(k, path):
        shift = shifts[k] if shifts else 0
        try:
            for fr in open_capture(path, warn):
                if shift and fr.ts_ns:
                    fr.ts_ns -= shift
                yield (fr.merge_time, k, fr.index), (k, fr)
        except (CaptureError, OSError) as e:
            errors.append(CaptureDamage(path, e))
    for _, item in heapq.merge(*(one(k, p) for k, p in enumerate(paths)), key=lambda x: x[0]):
        yield item


# -- apply: the optimizer on its own thread ----------------------------------------------
@dataclass
class BucketStep:
    """The shadow's step on reduced buckets of one iteration (ShadowModel.apply_buckets)."""
    shadow: object
    iteration: int
    buckets: list  # (bucket, gradient buffer)
    layout_iteration: int

    def __call__(self):
        self.shadow.apply_buckets(self.iteration, self.buckets, self.layout_iteration)


class ApplyStage:
    """Bucket steps run on a worker thread, so the optimizer (torch kernels, which release
    the GIL) overlaps decoding the traffic still to come. `submit` never waits: the
    queue holds at most one iteration's bucket steps and commit hooks (the pipeline
    queues only iteration done+1's buckets, and `drain`s the queue before it commits
    that iteration), so its length is bounded by the plan, not by a depth. A bounded
    queue (8) made the capture loop wait on this thread, which first needs the GIL the
    loop holds: 0.5 ms a bucket on average, 230-340 ms of every 2 s at 400-460k
    frames/s (benchmarks/RESULTS.md, issue 16). `drain` waits for every step submitted
    so far and re-raises a step's error in the caller."""

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = Thread(target=self._work, name="ckptd-apply", daemon=True)
        self.thread.start()

    def _work(self):
        nxt = None  # a job _merged took off the queue that was not a step to merge
        while True:
            job, nxt = nxt if nxt is not None else self.queue.get(), None
            if job is None:
                return
            try:
                if isinstance(job, threading.Event):  # drain's fence: everything before it ran
                    job.set()
                elif self.error is None:
                    if isinstance(job, BucketStep):
                        job, nxt = self._merged(job)
                    job()
            except BaseException as e:  # surfaced by drain()
                self.error = e
            finally:
                job = None  # the job holds a bucket's gradient: let the pool have it back

    def _merged(self, job: "BucketStep") -> tuple["BucketStep", object]:
        """The bucket steps of the same iteration queued right behind `job`, as one step
        (one optimizer call instead of one per bucket: ~0.2 ms less each for a few
        hundred thousand parameters), and the first job that is not one of them."""
        buckets = list(job.buckets)
        while True:
            try:
                nxt = self.queue.get_nowait()
            except queue.Empty:
                nxt = None
            if not (isinstance(nxt, BucketStep) and nxt.shadow is job.shadow
                    and (nxt.iteration, nxt.layout_iteration) == (job.iteration, job.layout_iteration)):
                return BucketStep(job.shadow, job.iteration, buckets, job.layout_iteration), nxt
            buckets += nxt.buckets

    def submit(self, job: Callable[[], None]):
        self.queue.put(job)

    def drain(self):
        fence = threading.Event()
        self.queue.put(fence)
        fence.wait()
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def close(self):
        self.queue.put(None)
        self.thread.join()


# -- report --------------------------------------------------------------------------
@dataclass
class IterationReport:
    iteration: int
    status: str  # committed | unrecoverable | conflict | complete-not-applied | incomplete-not-applied
    # | not-captured (joining: iteration .. through ran before the capture saw the job)
    packets: int = 0
    grad_bytes: int = 0
    coverage: list[float] = field(default_factory=list)  # per stream
    loss: list[float | None] = field(default_factory=list)  # per stream, None: saw nothing
    missing: list[Missing] = field(default_factory=list)
    note: str = ""
    exact: bool | None = None  # against a reference checkpoint, when one was given
    commit_lag: float | None = None  # seconds from the iteration's last packet until the
    # shadow holds the iteration exactly (its checkpoint file is written after: write_seconds)
    write_seconds: float | None = None
    persisted: bool | None = None  # committed, and its checkpoint file written (None: no --out)
    through: int | None = None  # not-captured: the last iteration of the gap
    # committed: the first parameter holding NaN or inf (the job diverged; ckptd.core.finite)
    nonfinite: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "committed"


@dataclass
class ReplayOptions:
    out: str | None = None  # checkpoint directory
    reference: str | None = None  # trainer's checkpoints to compare each commit with
    dump_gradients: str | None = None
    resume: str | None = None  # a checkpoint, or a directory of them, to restart the shadow from
    restart: str | None = None  # a restarted daemon's own newest persisted state (a file), tried first
    join: bool = False  # the capture starts mid-job: align on the first whole iteration
    join_from: int | None = None  # joining: an iteration the job has reached (PSN wraps)
    keep_last: int | None = None  # retention (ckptd.core.keep): None keeps every checkpoint
    keep_every: int | None = None
    retry_writes: bool = False  # a daemon: a failed write is reported and retried, not raised
    # Copies of an iteration's elements that arrive within this much capture time after it
    # became complete are compared before it commits (Pipeline._agreed); 0 commits at once.
    agree_window_ms: float = AGREE_WINDOW_MS
    # what the iteration notes call each stream (the files', the interfaces'); None: its index
    stream_names: tuple[str, ...] | None = None


def _make_dump_dir(path: str) -> None:
    """The gradient dump directory, made if missing. A file (or a link loop) in the way
    was the bare `[Errno 17] File exists: ...`, which reads as if a directory were wanted
    gone: one error naming the path and why, as the checkpoint directory's."""
    from ckptd.core.kernelfs import not_storage
    if why := not_storage(path):
        raise CheckpointWriteError(errno.EINVAL, f"{path}: cannot keep gradient dumps there: {why}")
    try:
        Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        why = e.strerror or e
        if os.path.lexists(path) and not os.path.isdir(path):
            why = "a file is in the way" if os.path.exists(path) else "a broken symbolic link is in the way"
        raise CheckpointWriteError(e.errno, f"{path}: cannot create the gradient dump directory: {why}") from None


class Pipeline:
    """Wires the stages; `run` drives every frame through and reports each iteration.

    The fast path (ckptd.fast.pipeline.FastPipeline) puts its kernel in front of the same
    object through the public calls below: `make_transport` builds the decode + place
    stage, `place` and `after_placement` take what it placed, `count_late` what arrived
    too late, `wants_every_placement` says when it must stop after a placement,
    `open_assembly`/`close_assembly` lend and take back an iteration's buffers, and
    `finish` ends the input."""

    def __init__(self, plan: Plan, start: dict | None, nstreams: int, opts: ReplayOptions,
                 on_iteration: Callable[[IterationReport], None] | None = None,
                 keep_reports: int | None = None, *,
                 make_transport: Callable[[Plan, int | None], Transport] = transport_for,
                 open_assembly: Callable[[int], IterationAssembly] | None = None,
                 close_assembly: Callable[[IterationAssembly], None] | None = None):
        self.plan, self.opts, self.nstreams = plan, opts, nstreams
        self.param_names = plan.state_names  # a trainer's file's optimizer order
        # Wire iteration 0 (the first allreduces of this communicator) is the training
        # iteration after the starting state: a job restarted from checkpoint k runs
        # iteration k+1 first. Reports, checkpoints and the lr schedule use that number.
        self.offset = int(start.get("iteration", -1)) + 1 if start is not None else 0
        self.join_wire = None  # joining: the wire iteration PSN positions are read from
        if opts.join:
            self.join_wire = max(0, (opts.join_from if opts.join_from is not None else self.offset)
                                 - self.offset)
        self.joined: int | None = None  # joining: the (training) iteration joined at
        self.join_unbound: list[str] = []  # joining: links whose flows were not yet seen at the join
        self.before_join = 0  # packets placed into iterations before it, dropped
        self.extract: Transport = make_transport(plan, self.join_wire)  # decode + place
        # where an iteration's buffers come from, and where they go once it is finalized
        # (the fast path's kernel lends its own and takes them back for reuse)
        self.open_assembly = open_assembly or (lambda it: IterationAssembly(it, plan.buckets(it), nstreams))
        self.close_assembly = close_assembly
        self.shadow = ShadowModel(plan, start) if (start is not None and plan.optimizer) else None
        # where a state to restart the shadow from is looked for, in order, and each file's
        # iteration; a file is read again when needed, since the shadow takes over (and
        # then changes) the tensors of the state it starts from
        self.resume_sources = [src for src in (opts.restart, opts.resume) if src]
        self._unreadable: set[str] = set()  # checkpoints _resume_state could not read, warned of once
        self.resume_iterations = {src: int(load_checkpoint(src, self.param_names).get("iteration", -2))
                                  for src in self.resume_sources if not Path(src).is_dir()}
        self.stopped_after: int | None = None  # shadow stops advancing after a gap
        self.next_bucket = 0  # buckets of iteration done+1 already stepped (or queued)
        self.applier = ApplyStage() if self.shadow is not None else None
        if self.shadow is not None and self.shadow.bucketwise:
            self.applier.submit(partial(limit_step_threads, bucket_step_threads()))
        # Called with True once an iteration's last bucket step is queued and with False
        # when that step is done: a stage that shares the cores (the file reader) pauses
        # meanwhile, since the commit waits for that step.
        self.yield_to_commit: Callable[[bool], None] | None = None
        self._yielding = False
        self.open: dict[int, IterationAssembly] = {}
        self.rs_open: dict[int, dict] = {}
        self.highest = -1
        self.done = -1
        self.late = 0
        # the agreement window (AGREE_WINDOW_MS): each stream's newest capture time, the
        # capture time of the frame being processed, and when each complete iteration
        # began to wait for its window
        self.window_ns = int(opts.agree_window_ms * 1e6)
        self.stream_time = [0] * nstreams
        self.now_ns = 0
        self.held_since: dict[int, int] = {}
        # how far each stream's copies have come (copies_seen): the newest wire iteration
        # it carried a packet of, and the capture time of its newest such packet. A clock
        # says when a stream's frames were captured, not which iteration they carry: a
        # mirror link that lags delivers old iterations' copies at today's times.
        self.stream_iter = [-1] * nstreams
        self.stream_copy_ns = [0] * nstreams
        self.first_copy_ns = 0
        self.full_streams: dict[int, set[int]] = {}  # iteration -> streams that delivered all of it
        # streams taken for stopped while they owed copies (capture time then), and per
        # iteration committed meanwhile, which ones; a stream written off that then
        # delivers copies of such an iteration makes it `unverified` (training
        # iteration -> the streams whose copies came after its commit, uncompared)
        self.written_off: dict[int, int] = {}
        self.committed_without: dict[int, set[int]] = {}
        self.went_without: dict[int, set[int]] = {}  # iteration -> streams _copies_due let it go without
        self.unverified: dict[int, set[int]] = {}
        # RoCE: every copy is placed and compared (IterationAssembly); gloo compares its
        # copies in the reassembler and places the bytes once, so its placements do not
        # show how far a stream's copies have come
        self.gate_copies = getattr(self.extract, "places_every_copy", False)
        self.buffers_since: dict[int, int] = {}  # when the buffers after an iteration were whole (NCCL)
        self.classes = [Counter() for _ in range(nstreams)]
        self.errors: list[str] = []
        # a long-running daemon keeps only the newest reports (keep_reports)
        self.reports: deque[IterationReport] = deque(maxlen=keep_reports)
        self.on_iteration = on_iteration
        # features told of each commit with the shadow's live state, before anything steps
        # it again (the daemon's memory tier): (iteration, model, optimizer); called on the
        # optimizer's thread when the shadow steps there (see _apply)
        self.on_commit: list[Callable[[int, dict, dict | None], None]] = []
        if opts.dump_gradients:  # before the keeper makes --out: a failure here leaves nothing behind
            _make_dump_dir(opts.dump_gradients)
        self.keeper = (CheckpointKeeper(opts.out, opts.keep_last, opts.keep_every, opts.retry_writes)
                       if opts.out else None)

    # -- driving -------------------------------------------------------------------
    def run(self, frames: Iterable[tuple[int, CapturedFrame]], abandon: bool = False) -> list[IterationReport]:
        """Drive every frame through. At the end, iterations still open are finalized
        (reported incomplete with their missing ranges), or with abandon=True (a daemon
        told to stop mid-iteration) reported as abandoned."""
        for stream, fr in frames:
            classes = self.classes[stream]
            classes["frames"] += 1
            self.now_ns = fr.ts_ns or 0
            for pl in self.extract.feed_frame(stream, fr, classes):
                self.place(pl)
            if self.now_ns > self.stream_time[stream]:
                self.stream_time[stream] = self.now_ns
                if self.held_since:
                    self.after_placement(self.done + 1)
        return self.finish(abandon)

    def advance_clock(self, stream_time: list[int]):
        """The newest capture time of each stream, once every frame up to it was placed
        (the fast path calls this after each batch; the daemon with the wall clock when
        the rings are idle): iterations whose agreement window has passed commit."""
        for s, t in enumerate(stream_time):
            if t > self.stream_time[s]:
                self.stream_time[s] = t
        if self.held_since:
            self.after_placement(self.done + 1)

    def idle(self, now_ns: int, place_held: bool = False):
        """The capture is quiet up to `now_ns` (the daemon's wall clock, frames older
        than that all delivered): the agreement window moves on; with place_held the
        transport also places what it held back for want of later traffic."""
        if place_held:
            for pl in self.extract.idle():
                self.place(pl)
        self.advance_clock([now_ns] * self.nstreams)

    def finish(self, abandon: bool = False) -> list[IterationReport]:
        """End of input: place what the transport held back, then finalize (or abandon)
        what is open."""
        for pl in self.extract.flush():
            self.place(pl)
        if self.joining:
            self._try_join(force=True)
        if self.joining:  # no flow of the job was ever bound: nothing to join
            self.errors.append(NOTHING_JOINED)
            self._close_applier()
            return self.reports
        if abandon:
            # complete iterations still in their agreement window: every copy captured
            # has been placed and compared, and no more will come. One whose copies
            # disagree is a conflict, not in flight: no copy still to come undoes that
            # (it was "abandoned", and the daemon's exit status 0)
            # A complete one a live stream still owes copies of is not: they were on their way.
            while (nxt := self.open.get(self.done + 1)) is not None and (
                    nxt.conflicts or nxt.complete and self._copies_due(nxt.iteration) is None):
                self._finalize_through(self.done + 1, hold=False)
            for it in sorted(self.open):
                asm = self.open.pop(it)
                self.done = max(self.done, it)
                note = f"stopped with {100 * (1 - asm.coverage()):.2f}% missing"
                if asm.complete and (due := self._copies_due(it)) is not None:
                    note = f"stopped while {self._owed(due, it)}"
                if asm.conflicts:  # (after a conflict above: the shadow stopped there)
                    s, b, lo, hi = asm.conflicts[0]
                    note += (f" and {len(asm.conflicts)} conflicting copies (first: {self._clash(asm, s, b, lo, hi)}, "
                             f"bucket {b}, elements {lo}-{hi})")
                rep = IterationReport(it + self.offset, "abandoned", asm.packets, asm.bytes,
                                      [asm.coverage(s) for s in range(self.nstreams)], note=note,
                                      missing=asm.missing(lambda b, w=asm.iteration: self.plan.param_ranges(w, b)))
                self._close(asm)
                self.reports.append(rep)
                if self.on_iteration:
                    self.on_iteration(rep)
            self._close_applier()
            return self.reports
        last = self.highest
        unplaced = self.extract.unplaced_from()
        if unplaced is not None:  # the iteration it could not go on from is reported, with why
            last = max(last, unplaced)
        if self.plan.iterations is not None:  # the job's total: missing ones are reported
            last = max(last, self.plan.iterations - 1 - self.offset)
        self._finalize_through(last, hold=False)  # every copy captured is in
        self._dump_rs(upto=last)
        self._close_applier()
        return self.reports

    def _close_applier(self):
        if self.applier is not None:
            self.applier.drain()
            self.applier.close()
            self.applier = None

    def place(self, pl: Placement):
        """Assemble one placement (and whatever it sets off: finalizing iterations that
        are two behind, joining, stepping the shadow, committing)."""
        it = pl.iteration
        self.copies_seen(pl.stream, it, self.now_ns)
        if pl.phase == RS:
            if self.opts.dump_gradients and pl.ring_step == 0:
                # a loop's first reduce-scatter send carries the sender's own values
                self.rs_open.setdefault(it, {}).setdefault(pl.sender, []).append(pl)
        elif it <= self.done:
            self.count_late(1)
            return
        else:
            asm = self.open.get(it)
            if asm is None:
                asm = self.open[it] = self.open_assembly(it)
            asm.place(pl.stream, pl.bucket, pl.start, pl.raw)
            asm.last_packet = time.monotonic()
        if it > self.highest:
            self.highest = it
            if not self.joining:
                self._finalize_through(it - FINALIZE_LAG)
                self._dump_rs(upto=it - FINALIZE_LAG)
        if self.joining:
            self._try_join()
        self.after_placement(it)

    @property
    def joining(self) -> bool:
        """Joining a running job, and not yet known where."""
        return self.opts.join and self.joined is None

    def copies_seen(self, stream: int, it: int, ns: int, low: int | None = None):
        """Stream `stream` carried a packet of wire iteration `it`, captured at `ns` (the
        fast path's kernel reports its packets in bulk: the newest iteration it carried,
        and `low`, the oldest since its last report): _copies_due reads how far each
        stream's copies have come."""
        low = it if low is None else low
        if self.committed_without and low <= self.done:
            # copies from a stream written off, of iterations committed without it: they
            # came after all, and were never compared with what was committed (a stream
            # back from a link down carries only new ones)
            for k in [k for k, ss in self.committed_without.items() if low <= k <= it and stream in ss]:
                self.committed_without[k].discard(stream)
                self.unverified.setdefault(k + self.offset, set()).add(stream)
        if stream in self.written_off and it > self.done:
            del self.written_off[stream]  # back in step: its copies are waited for again
        if it > self.stream_iter[stream]:
            self.stream_iter[stream] = it
        if ns > self.stream_copy_ns[stream]:
            self.stream_copy_ns[stream] = ns
            if not self.first_copy_ns:
                self.first_copy_ns = ns

    @property
    def unverified_from(self) -> int | None:
        """The first unverified (training) iteration: every later state stems from it."""
        return min(self.unverified, default=None)

    def unverified_note(self) -> str:
        """One line for the unverified iterations and the streams whose copies came late."""
        names = self.opts.stream_names
        streams = sorted({names[k] if names else str(k) for ks in self.unverified.values() for k in ks})
        return (f"iteration(s) {', '.join(map(str, sorted(self.unverified)))} were committed without the copies "
                f"of stream(s) {', '.join(streams)}, taken for stopped after {SILENT_STREAM_WINDOWS} silent "
                f"agreement windows, which then came: never compared, so the commits from iteration "
                f"{self.unverified_from} on are unverified")

    def count_late(self, n: int):
        """Packets of iterations already done: late, or while joining, before the join."""
        if self.joining:
            self.before_join += n
        else:
            self.late += n

    def _try_join(self, force: bool = False):
        """Join once every flow is bound (or, with force or once the newest iteration is
        FINALIZE_LAG past what the bound flows allow, with the flows bound so far): drop
        what came before, and move on as if those iterations were done."""
        at = self.extract.join_iteration(force=True)
        if at is None:
            return
        if not force and self.extract.join_iteration() is None and self.highest < at + FINALIZE_LAG:
            # Not yet; but the join comes no earlier than `at` (the latest first whole
            # iteration so far), so what precedes it can go now, and the fast path's
            # kernel tracks the iterations that matter meanwhile.
            if at - 1 > self.done:
                self._drop_before(at)
            return
        self.joined = at + self.offset
        self.join_unbound = self.extract.join_unbound()
        self._drop_before(at)
        if self.shadow is not None and int(self.shadow.iteration) != self.joined - 1:
            # wait for the trainer's checkpoint of the iteration before (_resume_state)
            self.stopped_after = int(self.shadow.iteration)
            self._report_gap()
        self._finalize_through(self.highest - FINALIZE_LAG)

    def _report_gap(self):
        """Joined with no state of the iteration before at hand: the iterations after the
        newest state held ran while nothing captured them. One report says which and why,
        before any report of the joined iterations (the daemon's notice sends it on)."""
        if self._resume_state(self.joined - 1) is not None:
            return  # the trainer's checkpoint (or the daemon's own) is there already
        held = [int(self.shadow.iteration)] + [i for i in self.resume_iterations.values() if i < self.joined]
        have = max(held)
        self.stopped_after = have  # what the reports name until a state is found
        where = next((src for src, i in self.resume_iterations.items() if i == have), "the starting state")
        rep = IterationReport(have + 1, "not-captured", through=self.joined - 1)
        span = f"iteration {have + 1}" if have + 1 == self.joined - 1 else f"iterations {have + 1}-{self.joined - 1}"
        rep.note = (f"{span} ran before the capture saw the job (joined at {self.joined}); the newest state "
                    f"held is iteration {have} ({where}): the shadow waits for a checkpoint of the job's own "
                    "state" + (f" in {self.opts.resume}" if self.opts.resume else " (no resume configured)"))
        self.reports.append(rep)
        if self.on_iteration:
            self.on_iteration(rep)

    def _drop_before(self, at: int):
        """Joining: forget every iteration before `at`, as if done."""
        for it in [i for i in self.open if i < at]:
            asm = self.open.pop(it)
            self.before_join += asm.packets
            self._close(asm)
        for it in [i for i in self.rs_open if i < at]:
            del self.rs_open[it]
        self.extract.forget_before(at)
        self.done = self.extract.done = at - 1
        self.highest = max(self.highest, at - 1)

    def after_placement(self, it: int):
        """After a placement into iteration it: step the shadow on the next iteration's
        whole buckets, and commit complete iterations at once, in order. The fast path
        calls this too, after each frame that completed a bucket."""
        if self.joining:
            return
        if it == self.done + 1 and it in self.open:
            self._apply_ready_buckets(self.open[it])
        while (nxt := self.open.get(self.done + 1)) is not None and nxt.complete:
            if not self._agreed(nxt.iteration) or not self._buffers_known(nxt.iteration):
                break
            self._finalize_through(self.done + 1)

    def _buffers_known(self, wire: int) -> bool:
        """Whether iteration `wire` may commit as far as module buffers go: they are not
        captured, or DDP's broadcast of them (in the next forward) has been seen. Until
        then the iteration waits; at the end of input it is finalized without them."""
        if not self.plan.buffers.captured or self.shadow is None or self._buffers_conflict(wire):
            return True
        if self.extract.buffers_after(wire) is None:
            return False
        # as for gradients: every stream has its chance to deliver its copies of them
        since = self.buffers_since.setdefault(wire, self.now_ns or max(self.stream_time))
        return self._window_passed(since)

    def _buffers_conflict(self, wire: int) -> str | None:
        """Where copies of DDP's broadcast of the buffers after `wire` disagreed (NCCL)."""
        return self.extract.buffers_conflict(wire)

    def _agreed(self, it: int) -> bool:
        """Whether a complete iteration may commit: every stream that has carried
        anything has had its chance to deliver its copies, i.e. its capture clock passed
        the agreement window after the iteration became complete (copies that arrive
        meanwhile are placed and compared: a disagreement is a conflict, never a commit).
        A stream silent for SILENT_STREAM_WINDOWS windows holds nothing up. Without
        timestamps (pcapng simple blocks) no clock passes the window: the iteration
        commits when it is finalized, FINALIZE_LAG iterations on or at the end."""
        if self.window_ns <= 0:
            return True
        if not self._window_passed(self.held_since.setdefault(it, self.now_ns or max(self.stream_time))):
            return False
        return self._copies_due(it) is None

    def _copies_due(self, it: int) -> int | None:
        """A stream whose copies of complete iteration `it` may still come, or None. A
        stream is done with it once it carried a packet of a later iteration (a mirror
        link delivers in order, and a rank starts the next iteration's allreduce only
        after this one's), or delivered all of it, or has carried no packet of the job
        for SILENT_STREAM_WINDOWS windows: while the others did (it stopped, or stalls that
        long: written off, see copies_seen; from the capture's first packet, for a stream
        that has carried none yet), or with the whole capture quiet. Waiting for them is
        what keeps a mirror that lags from having its copies arrive after a commit,
        uncompared."""
        if not self.gate_copies or self.window_ns <= 0:
            return None
        # (the fast path moves the streams' clocks after each batch, its copies as it goes)
        now = max(max(self.stream_time), max(self.stream_copy_ns), self.now_ns)
        if not now:  # no capture times (pcapng simple blocks): no stream can be told silent
            return None
        silent = SILENT_STREAM_WINDOWS * self.window_ns
        full = self.full_streams.setdefault(it, set())
        asm = self.open.get(it)
        without = set()
        for s in range(self.nstreams):
            if self.stream_iter[s] > it:
                continue
            if s not in full and asm is not None and self.stream_iter[s] == it and asm.coverage(s) >= 1.0:
                full.add(s)  # (counted only once it carries the iteration)
            if s in full:
                continue
            last = self.stream_copy_ns[s] or self.first_copy_ns or now
            if max(self.stream_copy_ns) - last >= silent:
                # the others carried the job ten windows past its last packet: it stopped,
                # or stalls (written off: copies_seen)
                self.written_off.setdefault(s, now)
                without.add(s)
            elif now - last >= silent:
                # the whole capture quiet that long (a job between iterations): nothing of
                # this stream is on its way, since one that lags delivers its backlog then;
                # what it lacks of the iteration it lost (or holds back: copies_seen)
                without.add(s)
            else:
                return s
        self.went_without[it] = without  # (what a commit now goes without: _finalize)
        return None

    def _window_passed(self, since: int) -> bool:
        """Every stream that carries anything has delivered what it captured up to one
        agreement window after `since` (or the others are that far on: _agreed)."""
        if self.window_ns <= 0:
            return True
        need = since + self.window_ns
        newest = max(self.stream_time)
        if newest < need:  # no stream's clock is past the window yet
            return False
        if newest >= since + SILENT_STREAM_WINDOWS * self.window_ns:
            return True
        return all(t >= need for t in self.stream_time if t)

    def wants_every_placement(self, asm: IterationAssembly) -> bool:
        """Would a placement into asm that completes no bucket make the pipeline act?
        Only when asm is the next iteration and a whole bucket waits to be stepped."""
        return (asm.iteration == self.done + 1 and self._bucketwise()
                and self.next_bucket < len(asm.buckets) and asm.bucket_complete(self.next_bucket))

    def _close(self, asm: IterationAssembly):
        """The pipeline is done with this iteration's buffers: hand them back."""
        if self.close_assembly is not None:
            self.close_assembly(asm)

    # -- finalize, apply, keep -------------------------------------------------------
    def _finalize_through(self, upto: int, hold: bool = True):
        """Finalize every iteration up to `upto`, in order (FINALIZE_LAG on from the newest,
        or the end of input: hold=False). A complete iteration whose copies a live stream
        still owes (_copies_due) is held instead, up to MAX_HELD iterations; past that it
        is refused, never committed on the copies that came first."""
        while self.done < upto:
            it = self.done + 1
            asm = self.open.get(it)
            due = None
            if hold and asm is not None and asm.complete and (due := self._copies_due(it)) is not None:
                if self.highest - it < MAX_HELD:
                    return
            self.held_since.pop(it, None)
            self.buffers_since.pop(it, None)
            self.full_streams.pop(it, None)
            asm = self.open.pop(it, None) or self.open_assembly(it)
            self.done = self.extract.done = it
            self._finalize(asm, owed=due)
            self._close(asm)

    def _finalize(self, asm: IterationAssembly, owed: int | None = None):
        """Report, and commit where it may; owed: the stream whose copies a complete
        iteration still waited for when it could be held no longer (refused)."""
        wire = asm.iteration
        it = wire + self.offset
        rep = IterationReport(it, "", asm.packets, asm.bytes)
        if self.opts.dump_gradients:
            self._dump(asm)
        # gloo: mirror copies of one TCP byte are compared in the reassembler, before framing
        clash = self.extract.copies_conflict(wire)
        if asm.conflicts:
            s, b, lo, hi = asm.conflicts[0]
            rep.status = "conflict"
            what = f"bucket {b}" + (f" = {USED_MAP}" if self.plan.is_used_map(wire, b) else "")
            rep.note = (f"{len(asm.conflicts)} packets disagree with another intact copy of their elements "
                        f"(first: {self._clash(asm, s, b, lo, hi)}, {what}, elements [{lo}, {hi})): plan or "
                        "capture is wrong")
        elif not asm.complete or self.extract.why_unplaced(wire):
            # (gloo: where the count of allreduces broke, even a complete assembly may be
            # another iteration's gradients, placed before the break was seen)
            rep.missing = asm.missing(lambda b: self.plan.param_ranges(wire, b))
            rep.status = "unrecoverable"
            if not asm.packets and self.extract.unmatched_flows():  # packets there were, placed nowhere
                rep.note = "no packet of it was placed: flows of the captures fit none of the plan's (listed below);"
            elif not asm.packets:  # a link down, a capture gap: say it, the ranges alone do not
                rep.note = "no packet of it was captured on any stream;"
            why = self.extract.why_unplaced(wire)
            if why:  # gloo: a gap that hid whole collectives ended the count of allreduces
                rep.note = why
            if any(self.plan.is_used_map(wire, m.bucket) for m in rep.missing):
                rep.note = (f"{USED_MAP} not seen whole: which parameters the trainer stepped "
                            "(those some rank used) is not known")
            if it == self.joined and self.join_unbound:
                rep.note = (f"{rep.note} " if rep.note else "") + (
                    f"joined here before every flow of {', '.join(self.join_unbound)} was bound (taken "
                    f"{FINALIZE_LAG} iterations on without them): their packets of it may have passed "
                    "before the capture saw them")
        elif owed is not None:  # never committed on the first copies
            rep.status = "unrecoverable"
            rep.note = (f"not committed: {self._owed(owed, wire)} when iteration {self.highest + self.offset} "
                        f"began ({MAX_HELD} held); a mirror stream that lags this far, or has stopped for less "
                        f"than {SILENT_STREAM_WINDOWS} agreement windows, holds commits")
        elif clash:  # never resolved by which copy came first
            b, stream, where = clash
            where = f"{self.stream_name(stream)}, {where}"
            what = f"bucket {b}" + (f" = {USED_MAP}" if self.plan.is_used_map(wire, b) else "")
            rep.status = "conflict"
            # (mirror copies, or a retransmission on one stream: the reassembler compares both)
            rep.note = f"copies of {what} disagree (first: {where}): plan or capture is wrong"
        elif layout := self.extract.layout_conflict(wire):  # learned from the first copy: not known
            rep.status = "conflict"
            rep.note = (f"copies of DDP's rebuilt-bucket broadcast, which the plan's layout was learned from, "
                        f"disagree (first: {layout}): the layout its gradients lie in is not known")
        elif self.shadow is not None and (self.plan.find_unused_parameters or self.plan.static_graph):
            try:
                self.shadow.used_of(wire, asm.gradients())
            except ValueError as e:
                rep.status = "unrecoverable"
                rep.note = str(e) if isinstance(e, MapNotSeen) else f"{e}: plan or capture is wrong"
        if self.shadow is None:
            rep.status = rep.status or "complete"
        elif rep.status:
            self.applier.drain()
            self.next_bucket = 0  # buckets stepped so far are abandoned with the shadow
            if self.stopped_after is None:
                self.stopped_after = it - 1
                rep.note += (" " if rep.note.endswith(";") else "; " if rep.note else "") + \
                    f"shadow stops at iteration {it - 1}" + \
                    (f" until resumed from {self.opts.resume}" if self.opts.resume else "")
        else:
            self._apply(asm, rep)
        if self._yielding:  # (the applier let the reader go already, unless a step failed)
            self._yielding = False
            self.yield_to_commit(False)
        # per-stream statistics after the commit: they do not hold it up
        rep.coverage = [asm.coverage(s) for s in range(self.nstreams)]
        rep.loss = [self.extract.stream_loss(s, wire) for s in range(self.nstreams)]
        without = self.went_without.pop(wire, set())
        if without and rep.status in ("committed", "complete"):  # without their copies
            self.committed_without[wire] = without
            for k in [k for k in self.committed_without if k < wire - UNVERIFIED_KEPT]:
                del self.committed_without[k]
        self.reports.append(rep)
        if self.on_iteration:
            self.on_iteration(rep)

    def _clash(self, asm: IterationAssembly, s: int, b: int, lo: int, hi: int) -> str:
        """Which streams' copies of a conflict disagree: the one whose packet was refused
        and those that had placed the elements (neither is taken for right)."""
        others = [t for t in asm.streams_covering(b, lo, hi) if t != s]
        if not others:
            return f"{self.stream_name(s)}, within itself"
        return f"{self.stream_name(s)} against {', '.join(self.stream_name(t) for t in others)}"

    def _owed(self, s: int, wire: int) -> str:
        """Words for stream s still owing copies of wire iteration `wire` (_copies_due)."""
        seen = self.stream_iter[s]
        where = "none of the job's packets yet" if seen < 0 else f"packets of iteration {seen + self.offset} last"
        return f"{self.stream_name(s)} had not delivered its copies of iteration {wire + self.offset} (it carried {where})"

    def stream_name(self, s: int) -> str:
        """What notes call stream s: its file's or interface's name, where known."""
        names = self.opts.stream_names
        return f"stream {names[s]}" if names and s < len(names) else f"stream {s}"

    def _bucketwise(self) -> bool:
        return self.shadow is not None and self.stopped_after is None and self.shadow.bucketwise

    def _apply_ready_buckets(self, asm: IterationAssembly):
        """Step the shadow on each bucket of the next iteration as soon as it is whole,
        in DDP's order, so the optimizer overlaps the traffic still to come."""
        if not self._bucketwise():
            return
        while self.next_bucket < len(asm.buckets) and asm.bucket_complete(self.next_bucket):
            self.applier.submit(BucketStep(self.shadow, asm.iteration + self.offset,
                                           [(self.next_bucket, asm.gradient(self.next_bucket))],
                                           asm.iteration))
            self.next_bucket += 1
        if self.next_bucket == len(asm.buckets) and self.yield_to_commit and not self._yielding:
            self._yielding = True
            self.yield_to_commit(True)
            # The reader goes on once that last step is done, not at the commit: with an
            # agreement window the commit waits for later traffic, which the reader brings.
            self.applier.submit(partial(self.yield_to_commit, False))

    def _apply(self, asm: IterationAssembly, rep: IterationReport):
        it = asm.iteration + self.offset
        if self.stopped_after is not None:
            got = self._resume_state(it - 1)
            if got is not None:
                self.shadow = ShadowModel(self.plan, got[0])
                self.stopped_after = None
                rep.note = f"resumed from {got[1]}"
            else:
                rep.status = "complete-not-applied"
                rep.note = f"shadow stopped at iteration {self.stopped_after}" + \
                    (f"; no checkpoint of iteration {it - 1} in {self.opts.resume}" if self.opts.resume else "")
                return
        try:
            if self._bucketwise():
                self._apply_ready_buckets(asm)  # whatever the last packets completed
                self.applier.drain()
                self.shadow.finish_iteration(it)
            else:
                self.shadow.apply(it, asm.gradients(), layout_iteration=asm.iteration)
        except NoLrForStep as e:  # past the plan's lr_per_step: stepped before any change
            self.next_bucket = 0
            self.stopped_after = it - 1
            rep.status = "complete-not-applied"
            rep.note = f"{e}; the shadow stops at iteration {it - 1}"
            return
        self.next_bucket = 0
        if self.plan.buffers.captured:
            clash = self._buffers_conflict(asm.iteration)
            payloads = self.extract.take_buffers(asm.iteration)
            if clash:  # the shadow is right; which buffers rank 0 held is not known
                rep.status = "conflict"
                rep.note = (f"module buffers after iteration {it}: copies of DDP's broadcast of them "
                            f"disagree (first: {clash}): plan or capture is wrong")
                return
            if payloads is None:  # the shadow is right; the checkpoint would lack the buffers
                rep.status = "unrecoverable"
                rep.note = (f"module buffers after iteration {it} not seen whole: DDP broadcasts "
                            "them at the next forward (none after the job's last iteration)")
                return
            self.shadow.buffers = unflatten_buffers(self.plan, payloads)
        elif self.plan.buffers.tensors:
            rep.note = "without module buffers (not captured on this transport)"
        if asm.last_packet:  # the shadow now holds iteration it exactly
            rep.commit_lag = time.monotonic() - asm.last_packet
        rep.nonfinite = self.shadow.nonfinite
        for hook in self.on_commit:  # e.g. the daemon's memory tier copying the state
            job = partial(hook, it, self.shadow.model_state(copy=False), self.shadow.optimizer_state(copy=False))
            if self._bucketwise():
                # on the optimizer's thread, ahead of any step of the next iteration (its
                # queue is FIFO): the copy sees exactly this state and the commit path
                # (capture, extraction) does not wait for it
                self.applier.submit(job)
            else:
                job()
        if self.keeper:  # written from the live tensors: nothing steps the shadow meanwhile
            t0 = time.monotonic()
            rep.persisted = self.keeper.write(it, self.shadow.model_state(copy=False),
                                              self.shadow.optimizer_state(copy=False))
            rep.write_seconds = time.monotonic() - t0
        rep.status = "committed"
        if self.opts.reference:
            ref = find_checkpoint(self.opts.reference, it, self.param_names)
            if ref is not None:
                mine = {"iteration": it, "model": self.shadow.model_state(copy=False),
                        "optimizer": self.shadow.optimizer_state(copy=False)}
                diffs = diff_checkpoints(mine, _parameters_only(ref, list(mine["model"])), limit=3)
                rep.exact = not diffs
                if diffs:
                    rep.note = "differs from reference: " + "; ".join(diffs)

    def _resume_state(self, iteration: int) -> tuple[dict, str] | None:
        """A state to restart the shadow from that is exactly `iteration`, and where it
        came from: the restart file, the --resume checkpoint, or that iteration's
        checkpoint in the --resume directory."""
        for src in self.resume_sources:
            try:
                if src in self.resume_iterations:
                    if self.resume_iterations[src] == iteration:
                        doc = load_checkpoint(src, self.param_names)
                        self.plan.check_resume(doc, src)
                        return doc, src
                elif (doc := find_checkpoint(src, iteration, self.param_names)) is not None:
                    # another model's file (or one without its optimizer state) is no state
                    # to go on from: it ended the replay (the daemon) with a line naming no
                    # file, or was stepped on with zeroed moments
                    self.plan.check_resume(doc, f"{src} (its checkpoint of iteration {iteration})")
                    return doc, src
            except CheckpointError as e:
                # a trainer's file half written, or replaced by something else: not there
                # yet. The shadow keeps waiting; a daemon must not die of it
                why = " ".join(str(e).split())
                if why not in self._unreadable:
                    self._unreadable.add(why)
                    log.warning("resume: %s; the shadow waits for a readable checkpoint of iteration %d", why, iteration)
        return None

    def _dump(self, asm: IterationAssembly):
        d = Path(self.opts.dump_gradients)
        it = asm.iteration + self.offset
        for b, grad in enumerate(asm.gradients()):
            cov = asm.covered_elements(b)
            if not cov.all():  # the kernel's buffers hold stale bytes where nothing was placed
                grad = np.where(cov, grad, np.zeros((), grad.dtype))
            _save_npy(d / f"iter_{it:06d}_bucket_{b:03d}.npy", grad)
            _save_npy(d / f"iter_{it:06d}_bucket_{b:03d}_coverage.npy", cov)

    def _dump_rs(self, upto: int):
        """Each sender's own values, from its first reduce-scatter sends (diagnostics)."""
        if not self.opts.dump_gradients:
            return
        d = Path(self.opts.dump_gradients)
        for it in [i for i in self.rs_open if i <= upto]:
            self._dump_rs_iteration(d, it, self.rs_open.pop(it))

    def _dump_rs_iteration(self, d: Path, it: int, senders: dict):
        for sender, pls in senders.items():
            for b, bucket in enumerate(self.plan.buckets(it)):
                vals = np.zeros(bucket.count, bucket.dtype)
                cov = np.zeros(bucket.count, bool)
                for pl in pls:
                    if pl.bucket == b:
                        v = np.frombuffer(pl.raw, bucket.dtype.newbyteorder("<"))
                        vals[pl.start:pl.start + len(v)] = v
                        cov[pl.start:pl.start + len(v)] = True
                stem = f"iter_{it + self.offset:06d}_bucket_{b:03d}_rs_rank{sender}"
                _save_npy(d / f"{stem}.npy", vals)
                _save_npy(d / f"{stem}_coverage.npy", cov)


def _parameters_only(ckpt: dict, names: list[str]) -> dict:
    """A trainer's checkpoint with only the model entries the shadow holds (its
    parameters, frozen ones too, and the module buffers where the plan captures them)."""
    model = ckpt.get("model") or {}
    return {**ckpt, "model": {n: model[n] for n in names if n in model}}


def replay(plan: Plan, paths: list[str], start: dict | None, opts: ReplayOptions,
           on_iteration=None, progress: Callable[[int, int], None] | None = None, *,
           own_start: bool = False) -> Pipeline:
    """Offline replay of capture files; progress(bytes read, total bytes) now and then.
    `start` is left as it was (see shadow_start); own_start hands it over instead."""
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"{p}: no such capture file")
    pipe = Pipeline(plan, shadow_start(start, own_start), len(paths), opts, on_iteration)
    shifts = clock_shifts(paths, opts, pipe.errors)
    source = file_source(paths, pipe.errors, shifts=shifts)
    if progress:
        source = _with_progress(source, sum(os.path.getsize(p) for p in paths), progress)
    pipe.run(source)
    return pipe


def clock_shifts(paths: list[str], opts: ReplayOptions, notes: list) -> list[int]:
    """How far each stream's capture clock is off stream 0's (ckptd.core.clock), a note
    for each stream set right."""
    shifts, shifted = stream_shifts(paths)
    names = list(opts.stream_names or [f"stream{k + 1}" for k in range(len(paths))])
    notes += [shift_note(names, *x) for x in shifted]
    # Set to the clock furthest ahead: times only grow, so none reaches 0 (no time) or below,
    # and the order is the same as set to stream 0's.
    top = max(shifts, default=0)
    return [s - top for s in shifts]


def shadow_start(start: dict | None, own: bool) -> dict | None:
    """The starting state the shadow steps in place. A caller's state (a model's
    state_dict, an optimizer's) is copied first, as torch's load_state_dict copies: the
    shadow stepping it would change the caller's model under it. own: the caller hands
    it over (the CLI and the daemon load it for the run), which saves a model's copy."""
    if start is None or own:
        return start
    return copy.deepcopy(start)  # (tensors that shared memory still do: ShadowModel unaliases them)


def _with_progress(source, total: int, progress, every: int = 4096):
    done = 0
    for n, (k, fr) in enumerate(source, 1):
        done += fr.caplen + 16  # record header
        if n % every == 0:
            progress(done, total)
        yield k, fr
    progress(total, total)
