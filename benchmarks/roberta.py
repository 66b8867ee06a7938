"""End-to-end replay at the size of the FlowCheck paper's RoBERTa (issue 3).

    python -m benchmarks.roberta [--params 330] [--iterations 3] [--workdir DIR] [--keep]
    python -m benchmarks.roberta --params 2 --layers 2 --bucket-cap-mb 1     # a quick check

1. plan      a RoBERTa-large parameter list (24 layers of d=1024, FFN 4096, embeddings,
             LM head; the vocabulary sized so the total is --params million, 330 by
             default as in the paper; the real RoBERTa-large vocabulary, --vocab 50265,
             gives 355 M), DDP buckets of 25 MB (the first layout and the one rebuilt in
             backward order), 8 ranks, 2 channels, NCCL 2.19 Simple, MTU 4096, AdamW
             (--implementation, foreach by default: torch's default on GPUs)
2. traffic   ckptd.testing.synth.bulk writes --iterations iterations of the ring allreduce as
             3 mirror streams see them: the transmit side of the ports of ranks 0, 3 and
             6 (each stream one hop of the ring per channel; every allgather chunk
             crosses all hops but one, so each element reaches at least two streams),
             reduce-scatter frames, clear-to-send writes and ACKs included. Each rank's
             gradients are random float32, seeded; the reduction follows NCCL's order.
3. expected  meanwhile this process steps its own AdamW (ckptd.core.optim, all parameters at
             once, as the trainer would) on the reduced gradients from the same start,
             and keeps a CRC-32 of every parameter and moment tensor
4. replay    a child process runs ckptd.fast.pipeline.fast_replay on the 3 files (no
             checkpoint files are written: a commit is the shadow state updated) and
             reports per iteration the commit time, commit lag and resident memory, its
             peak resident memory (VmHWM), the sizes of the pipeline's structures, and
             the time ckptd.core.optim takes on the tensors of the last bucket alone
5. table     seconds per iteration, peak RSS against the ideal state (parameters, two
             Adam moments, one gradient buffer: 16 bytes per parameter) and against the
             ideal plus the reader's configured buffers, commit lag against the
             last-bucket optimizer time; and whether the final state is bit-exact

The pcap files (about 7 GB per iteration at full size) go to --workdir (default a new
directory under /var/tmp) and are deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from ckptd.fast import batches
from ckptd.core.optim import full_groups, init_state, lr_at, step_groups
from ckptd.core.plan import BucketLayout, Mirror, Optimizer, Parameter, Plan, load_plan
from ckptd.core.schedule import RingConfig
from ckptd.testing.synth.bulk import BulkSynth
from ckptd.testing.synth.ddp import first_buckets, rebuilt_buckets
from benchmarks.machine import machine

GIB = 1 << 30
POSITIONS = 514  # RoBERTa's max_position_embeddings (512 + padding offset)


# -- the model and the plan -------------------------------------------------------------------
def roberta_parameters(million: float = 330.0, layers: int = 24, hidden: int | None = None,
                       vocab: int | None = None) -> list[Parameter]:
    """(name, shape) of RobertaForMaskedLM's trainable parameters, registration order
    (the decoder weight is tied to the word embeddings). Without --hidden, d is the
    largest multiple of 32 (at most 1024) whose layers take at most 95% of the target;
    without --vocab, the vocabulary makes up the rest."""
    target = million * 1e6
    if hidden is None:
        hidden = 32
        while hidden < 1024 and layers * (12 * (hidden + 32) ** 2 + 13 * (hidden + 32)) <= 0.95 * target:
            hidden += 32
    d = hidden
    body = [("embeddings.position_embeddings.weight", (POSITIONS, d)),
            ("embeddings.token_type_embeddings.weight", (1, d)),
            ("embeddings.LayerNorm.weight", (d,)), ("embeddings.LayerNorm.bias", (d,))]
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for m in ("attention.self.query", "attention.self.key", "attention.self.value",
                  "attention.output.dense"):
            body += [(p + m + ".weight", (d, d)), (p + m + ".bias", (d,))]
        body += [(p + "attention.output.LayerNorm.weight", (d,)), (p + "attention.output.LayerNorm.bias", (d,)),
                 (p + "intermediate.dense.weight", (4 * d, d)), (p + "intermediate.dense.bias", (4 * d,)),
                 (p + "output.dense.weight", (d, 4 * d)), (p + "output.dense.bias", (d,)),
                 (p + "output.LayerNorm.weight", (d,)), (p + "output.LayerNorm.bias", (d,))]
    body += [("lm_head.dense.weight", (d, d)), ("lm_head.dense.bias", (d,)),
             ("lm_head.layer_norm.weight", (d,)), ("lm_head.layer_norm.bias", (d,))]
    if vocab is None:
        rest = sum(int(np.prod(s)) for _, s in body)
        vocab = max(16, round((target - rest) / (d + 1)))  # word embeddings + lm_head.bias
    shapes = [("embeddings.word_embeddings.weight", (vocab, d))] + body + [("lm_head.bias", (vocab,))]
    return [Parameter(n, tuple(s), "float32") for n, s in shapes]


def build_plan(params: list[Parameter], *, ranks: int = 8, channels: int = 2, mtu: int = 4096,
               bucket_cap_mb: float = 25.0, implementation: str = "foreach",
               mirror_ranks: tuple[int, ...] = (0, 3, 6), mirror_direction: str = "tx",
               iterations: int = 3, nccl_version: tuple[int, int] = (2, 19)) -> Plan:
    """The job's plan. DDP's layouts come from ckptd.testing.synth.ddp on meta tensors (shapes
    only, no memory); the rebuilt layout takes gradients in reverse registration order,
    the order a sequential model's backward produces them."""
    meta = [torch.empty(p.shape, device="meta") for p in params]
    cap = int(bucket_cap_mb * (1 << 20))
    first = first_buckets(meta, cap)
    rebuilt = rebuilt_buckets(meta, list(reversed(range(len(meta)))), cap)
    names = [p.name for p in params]
    ring = RingConfig(nranks=ranks, rings=tuple(tuple(range(ranks)) for _ in range(channels)),
                      protocol="simple", nccl_version=nccl_version, mtu=mtu)
    # RoBERTa's pre-training recipe: AdamW, betas (0.9, 0.98), eps 1e-6, decay 0.01, linear decay
    opt = Optimizer(kind="adamw", lr=4e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01,
                    implementation=implementation,
                    lr_schedule={"kind": "linear", "warmup_steps": 0, "total_steps": 1000})
    return Plan(parameters=tuple(params),
                buckets_first=tuple(BucketLayout(params=tuple(names[i] for i in b)) for b in first),
                buckets_rebuilt=tuple(BucketLayout(params=tuple(names[i] for i in b)) for b in rebuilt),
                ring=ring, optimizer=opt, addresses=tuple(f"10.77.0.{r + 1}" for r in range(ranks)),
                mirrors=tuple(Mirror(f"mirror{k}", r, mirror_direction) for k, r in enumerate(mirror_ranks)),
                iterations=iterations)


def start_value(seed: int, index: int, shape) -> torch.Tensor:
    """Parameter `index`'s value before iteration 0 (the same in every process)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randn(shape, generator=g).mul_(0.02)


class LazyModel(Mapping):
    """The starting model state as ShadowModel reads it (start["model"]), each
    parameter built when it is read (the shadow takes the tensor over): the replay
    process needs no 1.3 GB starting checkpoint file, and holds no second copy."""

    def __init__(self, plan: Plan, seed: int):
        self.index = {p.name: i for i, p in enumerate(plan.parameters)}
        self.plan, self.seed = plan, seed

    def __getitem__(self, name):
        i = self.index[name]
        return start_value(self.seed, i, self.plan.parameters[i].shape)

    def __iter__(self):
        return iter(self.index)

    def __len__(self):
        return len(self.index)


def tensor_crc(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(t.detach().contiguous().numpy()).cast("B"))


def state_digest(names, params, state: list[dict]) -> dict:
    """name -> [step, crc(param), crc(exp_avg), crc(exp_avg_sq)]: equal digests mean the
    same bits (up to CRC-32 collisions, 2^-32 per tensor for a random difference)."""
    return {n: [float(state[i]["step"]), tensor_crc(params[i]), tensor_crc(state[i]["exp_avg"]),
                tensor_crc(state[i]["exp_avg_sq"])] for i, n in enumerate(names)}


# -- traffic and the expected state -------------------------------------------------------------
def generate(plan: Plan, paths: list[Path], iterations: int, seed: int, log=print) -> dict:
    """Write the capture files and step the expected state alongside. Returns the
    expected state's digest and what was written."""
    names = [p.name for p in plan.parameters]
    index = {n: i for i, n in enumerate(names)}
    params = [start_value(seed, i, p.shape) for i, p in enumerate(plan.parameters)]
    hyper = full_groups(plan.optimizer, names)[0]
    state = [init_state(plan.optimizer.kind, p, hyper) for p in params]
    finals: dict[int, np.ndarray] = {}
    t0 = time.monotonic()

    def on_bucket(t, b, final):
        finals[b] = final
        nbuckets = len(plan.layout(t))
        if len(finals) < nbuckets:
            return
        grads = [None] * len(names)
        for bb, buf in finals.items():
            flat = torch.from_numpy(buf)
            for name, s, e in plan.param_ranges(t, bb):
                grads[index[name]] = flat[s:e].view(plan.parameters[index[name]].shape)
        step_groups(plan.optimizer.kind, params, grads, state, {**hyper, "lr": lr_at(plan.optimizer, t)})
        finals.clear()
        log(f"  generated iteration {t} ({time.monotonic() - t0:.0f} s)")

    synth = BulkSynth(plan, paths, seed)
    stats = synth.run(iterations, on_bucket)
    return {"digest": state_digest(names, params, state), "seconds": time.monotonic() - t0,
            "frames": [s.frames for s in stats], "bytes": [s.bytes for s in stats],
            "file_bytes": [p.stat().st_size for p in paths]}


# -- the replay (child process) -------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Resident memory every `every` seconds on a thread: the peak between two commits
    says which part of an iteration needs the memory."""

    def __init__(self, every: float = 0.01):
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self.every = every
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), rss_bytes()))
            self._stop.wait(self.every)

    def stop(self):
        self._stop.set()
        self.thread.join()

    def peak_between(self, a: float, b: float) -> int:
        return max((r for t, r in self.samples if a <= t <= b), default=0)


def _pipeline_on_stack():
    """The pipeline finalizing the iteration being reported, and that iteration's
    assembly (on_iteration gets only the report; the benchmark wants structure sizes)."""
    from ckptd.pipeline import Pipeline
    f = sys._getframe(2)
    while f is not None:
        me = f.f_locals.get("self")
        if isinstance(me, Pipeline):
            return me, f.f_locals.get("asm")
        f = f.f_back
    return None, None


def structure_bytes(pipe, finishing) -> dict:
    """Bytes of what the pipeline holds besides the shadow: per-iteration buffers
    (gradient data, the covered map, one covered map per stream) of the open iterations
    and of the one being committed, and the kernel's: buffers and received maps kept for
    reuse, received maps in use."""
    asms = list(pipe.open.values())
    if finishing is not None and all(finishing is not a for a in asms):
        asms.append(finishing)
    out = {"assemblies": len(asms),
           "gradient_data": sum(a.nbytes for asm in asms for a in asm.data),
           "covered": sum(a.nbytes for asm in asms for a in asm.covered),
           "covered_per_stream": sum(a.nbytes for asm in asms for maps in asm.by_stream for a in maps),
           **{k: v for k, v in pipe.extract.kernel.buffer_bytes().items() if k != "lent"}}
    if pipe.shadow is not None:
        state = [t for st in pipe.shadow.state.values() for t in st.values()]
        out["shadow"] = sum(t.nbytes for t in pipe.shadow.params + state)
    return out


def time_optimizer(plan: Plan, layout_iteration: int, reps: int, seed: int) -> dict:
    """ckptd.core.optim.step_groups on fresh tensors shaped like the last bucket's
    parameters, alone: once cold (state pages touched for the first time, as in
    iteration 0), then `reps` times warm; best and median. The best is the reference:
    on these 2 shared cores a step's time varies many-fold when another process takes a
    core in the middle of torch's 2-thread parallel regions. The same with torch on one
    thread, for comparison."""
    last = plan.layout(layout_iteration)[-1]
    shapes = [plan.param(n).shape for n in last.params]
    params = [start_value(seed, 10_000 + i, s) for i, s in enumerate(shapes)]
    grads = [start_value(seed, 20_000 + i, s).mul_(0.01) for i, s in enumerate(shapes)]
    hyper = full_groups(plan.optimizer, list(last.params))[0]
    state = [init_state(plan.optimizer.kind, p, hyper) for p in params]
    out = {"params": sum(int(np.prod(s)) for s in shapes), "tensors": len(shapes)}
    threads = torch.get_num_threads()
    for label, n in (("", threads), ("one_thread_", 1)):
        torch.set_num_threads(n)
        times = []
        for k in range(reps + 1):
            t = time.perf_counter()
            step_groups(plan.optimizer.kind, params, grads, state, {**hyper, "lr": lr_at(plan.optimizer, k)})
            times.append(time.perf_counter() - t)
        out.update({label + "cold": times[0], label + "warm": statistics.median(times[1:]),
                    label + "warm_min": min(times[1:])})
    torch.set_num_threads(threads)
    return out


def instrument() -> dict:
    """Time the steps between an iteration's last packet and its commit, by wrapping
    (in this process only) the methods that make them: the shadow's bucket steps (on the
    apply thread), the commit's wait for them, the report's coverage sums and per-stream
    loss, and _finalize/_apply. One extra Python call per bucket or per stream: noise
    next to what they time."""
    from ckptd.core.assemble import IterationAssembly
    from ckptd.fast.pipeline import FastExtractor
    from ckptd.pipeline import ApplyStage, Pipeline
    from ckptd.core.shadow import ShadowModel

    spans: dict[str, list] = {}

    def wrap(cls, name, label, what=lambda args: None):
        orig = getattr(cls, name)

        def timed(*args, **kw):
            t = time.monotonic()
            try:
                return orig(*args, **kw)
            finally:
                spans.setdefault(label, []).append((t, time.monotonic(), what(args)))
        setattr(cls, name, timed)

    from ckptd.fast import pipeline as fastpath
    from ckptd.fast.pipeline import FastPipeline

    wrap(ShadowModel, "__init__", "shadow_init")
    wrap(FastPipeline, "run_batch", "run_batch")
    wrap(ShadowModel, "apply_buckets", "apply_bucket", lambda a: (a[1], max(b for b, _ in a[2])))
    wrap(ApplyStage, "drain", "drain")
    wrap(IterationAssembly, "coverage", "coverage", lambda a: a[0].iteration)
    wrap(FastExtractor, "stream_loss", "stream_loss", lambda a: a[2])
    wrap(Pipeline, "_finalize", "finalize", lambda a: a[1].iteration)
    wrap(Pipeline, "_apply", "apply", lambda a: a[1].iteration)
    wrap(FastPipeline, "_python_frame", "python_frame", lambda a: a[3])

    def timed_iter(it, label):
        it = iter(it)
        while True:
            t = time.monotonic()
            try:
                b = next(it)
            except StopIteration:
                return
            finally:
                spans.setdefault(label, []).append((t, time.monotonic(), None))
            yield b

    class TimedReader(fastpath.ReaderStage):
        """The reader stage, timing the reader thread's work (read, index, merge) and
        the pipeline's waits for it."""

        def __init__(self, batches, *args, **kw):
            super().__init__(timed_iter(batches, "reader_busy"), *args, **kw)

        def __iter__(self):
            return timed_iter(super().__iter__(), "waiting_for_reader")

    fastpath.ReaderStage = TimedReader
    return spans


def span_total(spans: dict, label: str) -> float:
    return sum(e - s for s, e, _ in spans.get(label, []))


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_info() -> dict:
    """glibc's view of the heap: bytes in arenas (arena), mmapped blocks (hblkhd), in use
    (uordblks) and free but kept in the arenas (fordblks)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
        return {n: getattr(m, n) for n in ("arena", "hblkhd", "uordblks", "fordblks")}
    except (OSError, AttributeError):
        return {}


def smaps_rollup() -> dict:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts[0] in ("Rss:", "Anonymous:", "Private_Dirty:", "AnonHugePages:"):
                out[parts[0][:-1]] = int(parts[1]) * 1024
    return out


def commit_breakdown(spans: dict, commits: list[dict], t0: float, offset: int = 0) -> list[dict]:
    """Per iteration, seconds after its last packet at which each step of the commit
    started and ended (the last packet's time is the commit time less the commit lag)."""
    out = []
    for c in commits:
        if c["commit_lag"] is None:
            continue
        it = c["iteration"] - offset
        last = t0 + c["time"] - c["commit_lag"]
        row = {"iteration": c["iteration"]}
        buckets = [(s, e, w) for s, e, w in spans.get("apply_bucket", []) if w[0] == c["iteration"]]
        if buckets:
            s, e, w = max(buckets, key=lambda x: x[2][1])
            row["last_bucket_step"] = (s - last, e - last, w[1])
            row["steps_after_last_packet"] = sum(1 for s, _, _ in buckets if s >= last)
            row["step_seconds"] = sum(e - s for s, e, _ in buckets)
        for label in ("finalize", "apply"):
            mine = [(s - last, e - last) for s, e, w in spans.get(label, []) if w == it]
            if mine:
                row[label] = mine[0]
        fin = row.get("finalize")
        if fin:
            for label in ("coverage", "stream_loss", "drain"):
                row[label] = sum(e - s for s, e, _ in spans.get(label, [])
                                 if fin[0] <= s - last and e - last <= fin[1])
        out.append(row)
    return out


def child_main(spec_path: str) -> int:
    from ckptd.fast.pipeline import fast_replay
    from ckptd.pipeline import ReplayOptions

    spec = json.loads(Path(spec_path).read_text())
    plan = load_plan(spec["plan"])
    seed = spec["seed"]
    start = {"iteration": -1, "model": LazyModel(plan, seed), "optimizer": None}
    spans = instrument()
    load = [os.getloadavg()]
    baseline = rss_bytes()
    sampler = RssSampler()
    commits = []
    t0 = time.monotonic()

    def on_iteration(rep):
        now = time.monotonic()
        pipe, asm = _pipeline_on_stack()
        commits.append({"iteration": rep.iteration, "status": rep.status, "time": now - t0,
                        "commit_lag": rep.commit_lag, "packets": rep.packets,
                        "grad_bytes": rep.grad_bytes, "coverage": rep.coverage, "rss": rss_bytes(),
                        "smaps": smaps_rollup(), "malloc": malloc_info(),
                        "structures": structure_bytes(pipe, asm) if pipe is not None else {},
                        "note": rep.note})

    # the same step alone before the replay too: on this VM the time of one step on the
    # same shapes differs up to 2x with what the process did before it
    before = time_optimizer(plan, min(1, spec["iterations"] - 1), 5, seed)
    pipe = fast_replay(plan, spec["paths"], start, ReplayOptions(),
                       on_iteration=on_iteration, chunk_bytes=spec["chunk_bytes"])
    wall = time.monotonic() - t0
    load.append(os.getloadavg())
    sampler.stop()
    hwm = vm_hwm_bytes()
    for k, c in enumerate(commits):
        lo = t0 + (commits[k - 1]["time"] if k else 0.0)
        c["peak_rss"] = sampler.peak_between(lo, t0 + c["time"])
    heap = malloc_info()
    rss_end = rss_bytes()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = {"rss_before": rss_end, "rss_after": rss_bytes(), "malloc_before": heap}
    names = [p.name for p in plan.parameters]
    digest = state_digest(names, pipe.shadow.params, [pipe.shadow.state[n] for n in names]) if pipe.shadow else {}
    stops = dict(pipe.stops)
    result = {
        "wall": wall, "vm_hwm": hwm, "baseline_rss": baseline, "commits": commits,
        "digest": digest, "stops": stops, "kernel_frames": pipe.kernel_frames,
        "kernel_seconds": pipe.kernel_seconds, "read_waits": getattr(pipe, "read_waits", {}),
        "late": pipe.late, "errors": pipe.errors,
        "counters": dict(pipe.extract.counters), "binder_errors": pipe.extract.binder.errors,
        "classes": [dict(c) for c in pipe.classes],
        "reader": {"chunk_bytes": spec["chunk_bytes"], "read_depth": batches.READ_DEPTH},
        "end_structures": structure_bytes(pipe, None),
        "torch_threads": torch.get_num_threads(),
        "commit_steps": commit_breakdown(spans, commits, t0),
        "malloc_trim": trimmed, "load_average": load,
        "python_frames": {reason: [sum(1 for *_, w in spans.get("python_frame", []) if w == reason),
                                   sum(e - s for s, e, w in spans.get("python_frame", []) if w == reason)]
                          for reason in {w for *_, w in spans.get("python_frame", [])}},
        "threads": {k: span_total(spans, k) for k in ("shadow_init", "run_batch", "waiting_for_reader",
                                                       "reader_busy", "apply_bucket", "finalize")},
    }
    del pipe
    result["optimizer_before_replay"] = before
    result["optimizer"] = {str(it): time_optimizer(plan, it, spec["optimizer_reps"], seed)
                           for it in sorted({0, min(1, spec["iterations"] - 1)})}
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# -- the parent: plan, traffic, child, table ------------------------------------------------
def reader_buffer_bytes(chunk: int, depth: int, streams: int) -> int:
    """What ckptd.fast.batches' reader may hold at once: one chunk per stream being merged
    (plus the next one being read), merged Batches of up to one chunk per stream each:
    `depth` queued, one the reader waits to queue, one in the kernel."""
    return (streams + 1) * chunk + (depth + 2) * streams * chunk


def fmt_gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def report(plan: Plan, gen: dict, res: dict, iterations: int) -> tuple[list[str], dict]:
    """The tables (markdown lines) and a summary of the targets."""
    nparams = sum(p.numel for p in plan.parameters)
    ideal = 16 * nparams
    streams = len(plan.mirrors)
    buffers = reader_buffer_bytes(res["reader"]["chunk_bytes"], res["reader"]["read_depth"], streams)
    hwm = res["vm_hwm"]
    exact = res["digest"] == gen["digest"]
    commits = res["commits"]
    lines = []
    captured = sum(gen["file_bytes"])
    lines.append(f"{nparams / 1e6:.1f} M parameters, {plan.nranks} ranks, {plan.ring.channels} channels, "
                 f"{len(plan.buckets_first)} first / {len(plan.buckets_rebuilt)} rebuilt buckets, "
                 f"{streams} streams, {captured / 1e9:.1f} GB of pcap ({sum(gen['frames']):,} frames), "
                 f"optimizer {plan.optimizer.kind} {plan.optimizer.implementation}, torch threads "
                 f"{res['torch_threads']}; generated in {gen['seconds']:.0f} s (peak RSS "
                 f"{fmt_gib(gen.get('peak_rss', 0))} GiB); replay {res['wall']:.1f} s "
                 f"({captured / res['wall'] / 1e9:.2f} GB/s of captured bytes); load average "
                 f"{res['load_average'][0][0]:.2f} at the replay's start, {res['load_average'][1][0]:.2f} at its end")
    lines.append("")
    lines.append("| iteration | status | s (commit to commit) | commit lag ms | last bucket alone ms: best "
                 "(median, cold; best on 1 thread) | M params | lag / last bucket | RSS at commit GiB | peak RSS in iteration GiB |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    prev = 0.0
    lags = []
    for c in commits:
        opt = res["optimizer"][str(min(c["iteration"], 1))]
        lag = c["commit_lag"]
        ratio = lag / opt["warm_min"] if lag is not None else None
        if lag is not None:
            lags.append((c["iteration"], lag, opt["warm_min"], ratio))
        lines.append(f"| {c['iteration']} | {c['status']} | {c['time'] - prev:.2f} | "
                     f"{'-' if lag is None else f'{lag * 1e3:.0f}'} | {opt['warm_min'] * 1e3:.0f} "
                     f"({opt['warm'] * 1e3:.0f}, {opt['cold'] * 1e3:.0f}; 1 thread "
                     f"{opt['one_thread_warm_min'] * 1e3:.0f}) | {opt['params'] / 1e6:.1f} | "
                     f"{'-' if ratio is None else f'**{ratio:.2f}**'} | {fmt_gib(c['rss'])} | "
                     f"{fmt_gib(c['peak_rss'])} |")
        prev = c["time"]
    before = res.get("optimizer_before_replay")
    if before:
        lines.append("")
        lines.append(f"The last bucket's step alone in the same process before the replay: best "
                     f"{before['warm_min'] * 1e3:.0f} ms (median {before['warm'] * 1e3:.0f}, cold "
                     f"{before['cold'] * 1e3:.0f}); lag / that: "
                     + ", ".join(f"{lag / before['warm_min']:.2f}" for _, lag, _, _ in lags))
    steps = res.get("commit_steps") or []
    if steps:
        lines.append("")
        lines.append("Between an iteration's last packet and its commit (ms after the last packet):")
        lines.append("")
        lines.append("| iteration | last bucket's step in the replay: start - end | bucket steps started "
                     "after the last packet | all bucket steps, s | _finalize starts | coverage sums | "
                     "per-stream loss | waiting for the steps | commit |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        lag_of = {c["iteration"]: c["commit_lag"] for c in commits}

        def ms(x):
            return "-" if x is None else f"{x * 1e3:.0f}"
        for r in steps:
            lb = r.get("last_bucket_step")
            fin = r.get("finalize")
            lines.append(f"| {r['iteration']} | {ms(lb[0]) if lb else '-'} - {ms(lb[1]) if lb else '-'} | "
                         f"{r.get('steps_after_last_packet', '-')} | {r.get('step_seconds', 0):.2f} | "
                         f"{ms(fin[0]) if fin else '-'} | {ms(r.get('coverage'))} | "
                         f"{ms(r.get('stream_loss'))} | {ms(r.get('drain'))} | {ms(lag_of[r['iteration']])} |")
    steady = [b["time"] - a["time"] for a, b in zip(commits, commits[1:])]
    lines.append("")
    lines.append("| memory | GiB | x ideal |")
    lines.append("|---|---:|---:|")
    lines.append(f"| ideal state (16 B/param: parameters, exp_avg, exp_avg_sq, one gradient buffer) | "
                 f"{fmt_gib(ideal)} | 1.00 |")
    lines.append(f"| reader's configured buffers (bound: {streams} streams x "
                 f"{res['reader']['chunk_bytes'] >> 20} MiB chunks, queue depth "
                 f"{res['reader']['read_depth']}) | {fmt_gib(buffers)} | {buffers / ideal:.2f} |")
    lines.append(f"| **peak RSS of the replay process (VmHWM)** | **{fmt_gib(hwm)}** | "
                 f"**{hwm / ideal:.2f}** |")
    lines.append(f"| peak RSS less the configured buffers (target <= 1.2x ideal) | {fmt_gib(hwm - buffers)} | "
                 f"**{(hwm - buffers) / ideal:.2f}** |")
    lines.append(f"| RSS before the replay (interpreter, torch, numpy, plan) | {fmt_gib(res['baseline_rss'])} | "
                 f"{res['baseline_rss'] / ideal:.2f} |")
    last = commits[-1]["structures"] if commits else {}
    for key, label in (("shadow", "shadow: parameters + 2 moments"),
                       ("gradient_data", "iteration buffers: gradient data"),
                       ("covered", "iteration buffers: covered map"),
                       ("covered_per_stream", f"iteration buffers: {streams} per-stream covered maps"),
                       ("kept", "kernel: buffers and received maps kept for reuse"),
                       ("received_maps", "kernel received-packet maps")):
        if key in last:
            lines.append(f"| at the last commit, {label} | {fmt_gib(last[key])} | {last[key] / ideal:.2f} |")
    trim = res.get("malloc_trim") or {}
    if trim:
        heap = trim.get("malloc_before") or {}
        if heap:
            lines.append(f"| at the end, free memory glibc keeps in its arenas (mallinfo2 fordblks) | "
                         f"{fmt_gib(heap['fordblks'])} | {heap['fordblks'] / ideal:.2f} |")
        drop = trim["rss_before"] - trim["rss_after"]
        lines.append(f"| at the end, RSS given back by malloc_trim(0) | {fmt_gib(drop)} | {drop / ideal:.2f} |")
    th = res.get("threads") or {}
    if th:
        lines.append("")
        lines.append(f"Where the replay's {res['wall']:.1f} s went: main thread in run_batch "
                     f"{th['run_batch']:.1f} s (kernel {res['kernel_seconds']:.1f} s, the rest the "
                     f"reference path and commits), waiting for the reader {th['waiting_for_reader']:.1f} s; "
                     f"reader thread busy (read, index, merge) {th['reader_busy']:.1f} s; apply thread "
                     f"(bucket steps) {th['apply_bucket']:.1f} s; building the shadow from the start state "
                     f"{th['shadow_init']:.1f} s (inside iteration 0).")
    summary = {
        "exact": exact, "committed": sum(c["status"] == "committed" for c in commits),
        "iterations": iterations, "peak_over_ideal": hwm / ideal,
        "peak_less_buffers_over_ideal": (hwm - buffers) / ideal, "lags": lags,
        "seconds_per_iteration": [c["time"] - (commits[k - 1]["time"] if k else 0.0)
                                  for k, c in enumerate(commits)],
        "steady_seconds_per_iteration": statistics.mean(steady) if steady else None,
    }
    return lines, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=330.0, help="million parameters (default 330)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, help="hidden size (default: 1024 at full size, smaller below)")
    ap.add_argument("--vocab", type=int, help="vocabulary (default: what makes --params)")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--channels", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--implementation", choices=["for-loop", "foreach", "fused"], default="foreach")
    ap.add_argument("--mirror-ranks", default="0,3,6", help="ranks whose switch ports are mirrored")
    ap.add_argument("--mirror-direction", choices=["tx", "rx", "both"], default="tx")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer-reps", type=int, default=15)
    ap.add_argument("--chunk-mb", type=float, default=batches.CHUNK_BYTES / (1 << 20),
                    help="bytes the reader reads from a file at a time, MiB (default: ckptd's)")
    ap.add_argument("--workdir", help="where the pcap files go (default: a new directory under /var/tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir (pcaps, plan, results)")
    ap.add_argument("--reuse", action="store_true",
                    help="replay the captures a kept --workdir holds if they were made with the same "
                         "plan, seed and iterations (skips generating)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of the replay process (diagnostics, e.g. MALLOC_MMAP_THRESHOLD_=1048576)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child_main(a.child)
    return run(a)


def run(a) -> int:
    mirror_ranks = tuple(int(x) for x in a.mirror_ranks.split(","))
    params = roberta_parameters(a.params, a.layers, a.hidden, a.vocab)
    plan = build_plan(params, ranks=a.ranks, channels=a.channels, bucket_cap_mb=a.bucket_cap_mb,
                      implementation=a.implementation, mirror_ranks=mirror_ranks,
                      mirror_direction=a.mirror_direction, iterations=a.iterations)
    made = a.workdir is None
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ckptd-roberta-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    paths = [work / f"{m.name}.pcap" for m in plan.mirrors]
    print(f"machine: {machine()}", flush=True)
    print(f"{sum(p.numel for p in params) / 1e6:.1f} M parameters; writing {a.iterations} iterations "
          f"to {work}", flush=True)
    try:
        made_by = {"plan": plan.to_json(), "seed": a.seed, "iterations": a.iterations}
        saved = work / "generate.json"
        gen = None
        if a.reuse and saved.exists() and all(p.exists() for p in paths):
            doc = json.loads(saved.read_text())
            if doc.get("made_by") == json.loads(json.dumps(made_by)):
                gen = doc["generate"]
                print("reusing the captures and expected state in the workdir", flush=True)
        if gen is None:
            plan.save(work / "plan.json")
            gen = generate(plan, paths, a.iterations, a.seed,
                           log=lambda s: print(s, file=sys.stderr, flush=True))
            gen["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            saved.write_text(json.dumps({"made_by": made_by, "generate": gen}))
        spec = {"plan": str(work / "plan.json"), "paths": [str(p) for p in paths],
                "names": [m.name for m in plan.mirrors], "seed": a.seed, "iterations": a.iterations,
                "optimizer_reps": a.optimizer_reps, "result": str(work / "result.json"),
                "chunk_bytes": int(a.chunk_mb * (1 << 20))}
        (work / "spec.json").write_text(json.dumps(spec))
        print(f"replaying {sum(gen['file_bytes']) / 1e9:.1f} GB in a child process", flush=True)
        env = dict(os.environ, **dict(kv.split("=", 1) for kv in a.child_env))
        proc = subprocess.run([sys.executable, "-m", "benchmarks.roberta", "--child", str(work / "spec.json")],
                              cwd=Path(__file__).resolve().parents[1], env=env)
        if proc.returncode != 0:
            print(f"error: the replay process exited with {proc.returncode}", file=sys.stderr)
            return 1
        res = json.loads((work / "result.json").read_text())
        lines, summary = report(plan, gen, res, a.iterations)
        summary["rusage_children_maxrss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print("\n".join(lines))
        print()
        if a.child_env:
            print(f"replay process environment: {' '.join(a.child_env)}")
        frames_py = ", ".join(f"{k} {n} ({t:.2f} s)" for k, (n, t) in sorted(res["python_frames"].items()))
        print(f"frames the reference path handled: {frames_py}")
        print(f"stops to the reference path: {res['stops']}; kernel frames {res['kernel_frames']:,}, "
              f"kernel {res['kernel_seconds']:.1f} s; reader waits {res['read_waits']}; "
              f"late {res['late']}")
        if res["errors"] or res["binder_errors"]:
            print(f"errors: {res['errors'] + res['binder_errors']}")
        bad = [n for n in gen["digest"] if gen["digest"][n] != res["digest"].get(n)]
        print(f"final state bit-exact against the expected AdamW state: "
              f"{'yes' if summary['exact'] else f'NO ({len(bad)} tensors differ, e.g. {bad[:3]})'}; "
              f"{summary['committed']}/{a.iterations} iterations committed")
        if a.json:
            Path(a.json).write_text(json.dumps({"summary": summary, "generate": {k: v for k, v in gen.items()
                                                                                  if k != "digest"},
                                                "replay": {k: v for k, v in res.items() if k != "digest"}},
                                               indent=1))
        ok = summary["exact"] and summary["committed"] == a.iterations
        return 0 if ok else 2
    finally:
        if not a.keep:
            for p in paths:
                p.unlink(missing_ok=True)
            if made:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
