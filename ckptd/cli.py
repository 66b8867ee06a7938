"""ckptd command line: demo, synth, replay, inspect, verify, export, plan."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ckptd.errors import CaptureDamage, CkptdError, one_line

EXIT_UNRECOVERED = 3


def _progress(label: str):
    """A one-line progress indicator on stderr, only when it is a terminal."""
    if not sys.stderr.isatty():
        return lambda done, total: None

    def show(done, total):
        sys.stderr.write(f"\r{label}: {done + 1}/{total}")
        if done + 1 == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


def _byte_progress(label: str):
    """Bytes-read progress on stderr, only when it is a terminal; each iteration's own
    line (stdout) stays clean because the bar is erased before it is printed over."""
    if not sys.stderr.isatty():
        return None

    def show(done, total):
        pct = 100 * done / total if total else 100
        sys.stderr.write(f"\r{label}: {pct:5.1f}% of {total / 1e6:.0f} MB")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


def _fmt_pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def print_iteration(names: list[str]):
    def show(rep):
        cov = " ".join(f"{n}={_fmt_pct(c)}" for n, c in zip(names, rep.coverage))
        loss = " ".join(f"{n}={_fmt_pct(x)}" for n, x in zip(names, rep.loss))
        exact = "" if rep.exact is None else ("  bit-exact" if rep.exact else "  NOT bit-exact")
        line = (f"iteration {rep.iteration:>4}: {rep.status:<14} packets={rep.packets} "
                f"grad_bytes={rep.grad_bytes} coverage[{cov}] loss[{loss}]{exact}")
        if rep.nonfinite:
            line += f"  NaN/inf in {rep.nonfinite}"
        if rep.note:
            line += f"  ({rep.note.strip()})"
        print(line, flush=True)
        for m in rep.missing[:10]:
            params = ", ".join(f"{n}[{a}:{b}]" for n, a, b in m.params) or "no parameter"
            print(f"    missing: bucket {m.bucket} elements [{m.start}, {m.end}) = {params}")
        if len(rep.missing) > 10:
            print(f"    ... and {len(rep.missing) - 10} more missing ranges")
    return show


# -- commands ------------------------------------------------------------------------
def _count(text: str, least: int = 1) -> bool:
    """A whole number of ASCII digits (int() also takes other scripts' and fails on '²')
    of at least `least`."""
    return re.fullmatch(r"[0-9]{1,9}", text) is not None and int(text) >= least


def _other_allreduces(specs: list[str]) -> dict:
    """--other-allreduce WHEN:COUNT[:DTYPE] values as SynthOptions.collectives."""
    from ckptd.core.plan import COLLECTIVE_WHEN, DTYPES
    out: dict = {}
    for spec in specs:
        parts = spec.split(":")
        ok = len(parts) in (2, 3) and parts[0] in COLLECTIVE_WHEN and _count(parts[1]) \
            and (len(parts) == 2 or parts[2] in DTYPES)
        if not ok:
            raise UsageError(f"--other-allreduce {spec!r} is not WHEN:COUNT[:DTYPE] with WHEN one of "
                             f"{', '.join(COLLECTIVE_WHEN)} and COUNT > 0")
        out.setdefault(parts[0], []).append([int(parts[1]), parts[2] if len(parts) == 3 else "float32"])
    return out


def _other_broadcasts(specs: list[str], out: dict) -> dict:
    """--other-broadcast WHEN:COUNT[:DTYPE[:ROOT]] values added to SynthOptions.collectives."""
    from ckptd.core.plan import COLLECTIVE_WHEN, DTYPES
    for spec in specs:
        parts = spec.split(":")
        ok = 2 <= len(parts) <= 4 and parts[0] in COLLECTIVE_WHEN and _count(parts[1]) \
            and (len(parts) < 3 or parts[2] in DTYPES) and (len(parts) < 4 or _count(parts[3], 0))
        if not ok:
            raise UsageError(f"--other-broadcast {spec!r} is not WHEN:COUNT[:DTYPE[:ROOT]] with WHEN one of "
                             f"{', '.join(COLLECTIVE_WHEN)} and COUNT > 0")
        out.setdefault(parts[0], []).append([int(parts[1]), parts[2] if len(parts) > 2 else "float32",
                                             "broadcast", int(parts[3]) if len(parts) > 3 else 0])
    return out


AMP_GROWTH_INTERVAL = 2000  # torch's GradScaler default


def _synth_training(a) -> dict:
    """The trainer's optimizer, groups, lr, AMP, comm hook and parameter dtype options."""
    from ckptd.testing.synth import parse_lr_per_step, parse_spec
    out = {}
    option = None
    try:
        # (`is not None`: an empty value was taken as not given, and the default trained)
        if a.optim is not None:
            option = "--optim"
            kind, hyper = parse_spec(a.optim)
            out.update(opt_kind=kind.lower(), opt_hyper=hyper)
        if a.lr_scheduler is not None:
            option = "--lr-scheduler"
            cls, args = parse_spec(a.lr_scheduler)
            out["lr_scheduler"] = {"class": cls, "args": args}
        if a.lr_per_step is not None:
            option = "--lr-per-step"
            out["lr_per_step"] = parse_lr_per_step(a.lr_per_step)
    except ValueError as e:
        raise UsageError(f"{option} {e}") from None
    if a.amp is None and a.amp_growth_interval is not None:  # (it was dropped without a word)
        raise UsageError("--amp-growth-interval is the GradScaler's growth_interval: it needs --amp")
    if a.amp is not None:
        out.update(amp_init_scale=a.amp, amp_growth_interval=a.amp_growth_interval or AMP_GROWTH_INTERVAL)
    return dict(out, no_decay_group=a.param_groups == "no-decay", inf_at=tuple(a.inf_at),
                comm_hook=a.comm_hook, param_dtype=a.param_dtype)


def cmd_synth(a) -> int:
    from ckptd.testing.synth import SynthOptions, check_options, synthesize
    _check_clip_options(a)
    # --model, --optim and the rest are checked by synthesize (check_options), before --out is made
    opts = SynthOptions(
        out=a.out, ranks=4 if a.ranks is None else a.ranks, channels=a.channels, protocol=a.protocol, mtu=a.mtu,
        mirrors=a.mirrors, iterations=a.iterations, seed=a.seed, model=a.model,
        allreduces_per_step=a.allreduces_per_step, nccl_version=a.nccl_version, qps=a.qps, bucket_cap_kb=a.bucket_cap_kb,
        merged_nics=a.merged_nics, adaptive_routing=a.adaptive_routing,
        optimizer=a.optimizer, loss=a.loss, duplicate=a.duplicate, reorder=a.reorder,
        corrupt=a.corrupt, retransmit=a.retransmit, psn_wrap=a.psn_wrap, ipv6=a.ipv6,
        shuffle_rings=a.shuffle_rings, mirror_direction=a.mirror_direction,
        max_grad_norm=a.max_grad_norm, grad_norm_type=a.grad_norm_type, clip_grad_value=a.clip_grad_value,
        write_hosts=a.write_hosts, nodes=a.nodes,
        gpus_per_node=a.gpus_per_node, nics_per_node=a.nics_per_node, collective=a.collective,
        collectives=_other_broadcasts(a.other_broadcast, _other_allreduces(a.other_allreduce)),
        startup_broadcast=a.startup_broadcast, freeze=tuple(a.freeze), unused=tuple(a.unused),
        static_graph=a.static_graph,
        **_synth_training(a))
    t0 = time.time()
    out_directory(a.out)
    try:
        check_options(opts)
        if a.nodes and a.ranks is not None and a.ranks != a.nodes * a.gpus_per_node:
            # with --nodes the ranks are NODES x --gpus-per-node: a --ranks of another count
            # was dropped without a word (the job synthesized had other ranks than asked for)
            raise UsageError(f"--ranks {a.ranks} with --nodes {a.nodes} x --gpus-per-node {a.gpus_per_node} "
                             f"({a.nodes * a.gpus_per_node} ranks): leave out --ranks, --nodes sets it")
        plan = synthesize(opts, progress=_progress("synth"))
    except ValueError as e:  # options that do not make a job (synthesize says which)
        raise UsageError(str(e)) from None
    nparams = sum(p.numel for p in plan.parameters)
    where = f" on {a.nodes} nodes" if a.nodes else ""
    print(f"synthesized {a.iterations} iterations of a {nparams:,}-parameter model over "
          f"{plan.nranks} ranks{where} ({a.protocol}, {a.channels} channel(s), MTU {a.mtu}) in "
          f"{time.time() - t0:.1f}s -> {a.out}")
    for name, st in opts.stats.items():
        print(f"  {name}: {st['frames']} frames, lost {st['lost']}, corrupted {st['corrupted']}, "
              f"duplicated {st['duplicated']}, reordered {st['reordered']}")
    return 0


def _resume_from_url(url: str, names: list[str]) -> str:
    """--resume given as a URL (the daemon's http://, or a persistence tier's fsspec URL:
    its newest entry that verifies): the state is fetched once and written to a private
    temporary file, removed at exit, which the pipeline then resumes from like any file."""
    import atexit
    from ckptd.core.checkpoint import checkpoint_name, save_checkpoint
    from ckptd.recovery import load_source
    ckpt, where, _ = load_source(url, names)
    tmp = tempfile.mkdtemp(prefix="ckptd-resume-")
    atexit.register(shutil.rmtree, tmp, True)
    path = Path(tmp) / checkpoint_name(int(ckpt["iteration"]))
    save_checkpoint(path, int(ckpt["iteration"]), ckpt["model"], ckpt.get("optimizer"))
    print(f"resume: iteration {int(ckpt['iteration'])} from {where}", file=sys.stderr)
    return str(path)


def cmd_replay(a) -> int:
    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.pipeline import NOTHING_JOINED, ReplayOptions, replay
    from ckptd.core.memory import require_memory
    from ckptd.core.plan import load_plan
    from ckptd.core.streams import stream_faults
    plan = load_plan(a.plan)
    if past := plan.past_the_job(a.join_from, a.plan):
        # it joined there, printed the iterations past the job's end, then refused them
        raise UsageError(f"--join-from {a.join_from}: {past}")
    a.pcap = _stdin_capture(a.pcap)
    names = _stream_names(a.pcap, a.names)
    _distinct_captures(a.pcap)
    start = None
    if a.init:
        start = load_checkpoint(a.init, plan.state_names)
        plan.check_start(start, a.init)
        if extra := plan.not_in_plan(start, a.init, a.plan):  # (an init from another model fails above)
            print(f"warning: {extra}: no checkpoint will carry it", file=sys.stderr)
        require_memory(plan.shadow_bytes(), f"shadowing the plan {a.plan}")
    if a.reference and not Path(a.reference).is_dir():
        why = "no such directory" if not Path(a.reference).exists() else "not a directory"
        print(f"error: --reference {a.reference}: {why} (the trainer's checkpoints, one file per iteration)",
              file=sys.stderr)
        return 2
    if a.out and a.reference and Path(a.out).resolve() == Path(a.reference).resolve():
        # each commit would overwrite the trainer's file it is then compared with (bit-exact,
        # always), and the reference is gone
        raise UsageError(f"--out {a.out} is the --reference directory: the trainer's checkpoints would be "
                         "overwritten by ckptd's; give --out a directory of its own")
    if plan.optimizer is None and plan.parameters and a.out:
        # every iteration was reported complete, then "0 committed", exit 0: nothing written
        raise UsageError(f"--out {a.out}: the plan {a.plan} names no optimizer, so there is no model state to "
                         "step and no checkpoint to write (its `optimizer` is missing or null); leave out --out "
                         "to check the gradients on the wire only, or give the job's plan (ckptd.torch.write_plan)")
    if start is None and plan.optimizer is not None and a.out:
        print("error: --init is needed to rebuild the model (the plan has an optimizer)", file=sys.stderr)
        return 2
    if a.resume and "://" not in a.resume and not Path(a.resume).exists() and not Path(a.resume).is_symlink():
        raise UsageError(f"--resume {a.resume}: no such file or directory (a checkpoint, a directory of the "
                         "trainer's checkpoints, or the daemon's URL)")
    resume = _resume_from_url(a.resume, plan.state_names) if a.resume and "://" in a.resume \
        else a.resume
    opts = ReplayOptions(out=a.out, reference=a.reference, dump_gradients=a.dump_gradients,
                         resume=resume, join=a.join or a.join_from is not None, join_from=a.join_from,
                         agree_window_ms=a.agree_window_ms, stream_names=tuple(names))
    if a.trust_icrc and (a.reference_path or plan.transport != "roce"):
        print("error: --trust-icrc needs the fast path (RoCE plans, without --reference-path)", file=sys.stderr)
        return 2
    before = _checkpoints_in(a.out)
    t0 = time.time()
    if plan.transport == "roce" and not a.reference_path:
        from ckptd.fast.pipeline import fast_replay
        pipe = fast_replay(plan, a.pcap, start, opts, on_iteration=print_iteration(names),
                           trust_icrc=a.trust_icrc, own_start=True)
    else:
        pipe = replay(plan, a.pcap, start, opts, on_iteration=print_iteration(names),
                      progress=_byte_progress("replay"), own_start=True)
    # a join's not-captured gap (iterations before the capture saw the job) is printed, not counted
    reps = [r for r in pipe.reports if r.status != "not-captured"]
    bad = [r for r in reps if not r.ok and r.status != "complete"]
    for k, (name, cls) in enumerate(zip(names, pipe.classes)):
        print(f"stream {name}: " + (", ".join(f"{key}={v}" for key, v in sorted(cls.items())) or "frames=0"))
    for name, cls in zip(names, pipe.classes):
        for line in stream_faults(name, cls).values():
            print(f"warning: {line}", file=sys.stderr)
    c = {**dict(sorted(pipe.extract.counters.items())), "late": pipe.late, **getattr(pipe, "read_waits", {})}
    print("extraction: " + ", ".join(f"{k}={v}" for k, v in c.items()))
    for e in pipe.extract.examples[:5]:
        print(f"  rejected: {e}")
    diagnostics = pipe.extract.diagnostics() + (pipe.extract.suspects() if bad else [])
    for e in diagnostics:
        print(f"  {e}")
    if plan.buffers.tensors and not plan.buffers.captured:
        print(f"  module buffers ({len(plan.buffers.tensors)}, e.g. {plan.buffers.tensors[0].name}) are not "
              "captured on this transport: the checkpoints hold parameters and optimizer state only")
    # a capture damaged mid-file ends its stream there: a diagnostic, so on stderr and one
    # line each (the reader names the file and frame); what it cost shows in the iterations
    nothing_joined = NOTHING_JOINED in pipe.errors  # the error line below, not a warning too
    # a pipe that held no capture at all: the error a file's is up front (_distinct_captures),
    # found only now (its first bytes were the reader's); the line below, not a warning too
    refused = [e for e in pipe.errors if isinstance(e, CaptureDamage) and e.refused]
    for e in pipe.errors:
        if e != NOTHING_JOINED and e not in refused:
            print("warning: " + _as_given(" ".join(e.split())), file=sys.stderr)
    if pipe.joined is not None:
        print(f"joined at iteration {pipe.joined} (the first every flow was seen from its start; "
              f"{pipe.before_join} packets before it dropped)")
    committed = sum(r.ok for r in reps)
    if a.reference and committed and all(r.exact is None for r in reps):
        # a --reference that holds none of the committed iterations compared nothing: without
        # a word the run read as checked (exit 0, as a bit-exact one), e.g. for a wrong directory
        shown = ", ".join(str(r.iteration) for r in [r for r in reps if r.ok][:5])
        print(f"warning: --reference {a.reference}: no checkpoint there is of a committed iteration "
              f"({shown}{', ...' if committed > 5 else ''}): nothing was compared", file=sys.stderr)
    past = [r.iteration for r in reps if plan.iterations is not None and r.iteration >= plan.iterations]
    # (the summary said "3 committed, 0 not recovered" above the error that sets them aside)
    print(f"{len(reps)} iterations, {committed} committed{' but suspect (see the error)' * bool(past and committed)}, "
          f"{len(bad)} not recovered"
          + (f" ({', '.join(str(r.iteration) for r in bad[:20])})" if bad else "")
          + f"; {time.time() - t0:.1f}s")
    if before:
        _warn_older_checkpoints(a.out, before, max((r.iteration for r in reps if r.ok), default=-1))
    diverged = next((r for r in reps if r.ok and r.nonfinite), None)
    if diverged is not None:
        good = [r.iteration for r in reps if r.ok and not r.nonfinite and r.iteration < diverged.iteration]
        print(f"warning: the job diverged: its parameters hold NaN or inf from iteration {diverged.iteration} on "
              f"(first: {diverged.nonfinite}); the newest finite state committed is "
              + (f"iteration {good[-1]}" if good else "none of this replay's"), file=sys.stderr)
    frames = sum(cls.get("frames", 0) for cls in pipe.classes)
    if refused:
        more = f" (and {len(refused) - 1} more not captures)" if len(refused) > 1 else ""
        raise UsageError(" ".join(refused[0].split()) + more)
    if nothing_joined:  # it was a warning ("no iteration joined") and the error below, two lines
        option = f"--join-from {a.join_from}" if a.join_from is not None else "--join"
        wrong = (f", or {a.join_from} is not an iteration the job had reached when the capture began (the "
                 "packets are placed by their PSNs from it)") if a.join_from is not None else ""
        listed = bool(pipe.extract.unmatched_flows())
        raise UsageError(f"{option}: no flow of the job in {a.plan} was recognised in the captures "
                         f"({frames} frames), so no iteration was joined: captures of another job, a plan with "
                         f"other addresses or QPs{wrong}{'; the flows left unmatched are listed above' * listed}")
    if not pipe.reports:  # not one packet of the plan's job: wrong captures or wrong plan
        raise UsageError(f"the captures ({frames} frames) hold no iteration of the job in {a.plan}: "
                         "captures of another job, or a plan with other addresses or QPs "
                         "(`ckptd inspect` lists the captures' flows)")
    if past:
        # the captures held more allreduce rounds than the job has iterations after the
        # start state: the rounds were numbered (and stepped) from the init's iteration + 1,
        # so an init of a later iteration than where the capture began committed every
        # iteration wrong, and numbered some past the job's end, with exit 0
        start = int(start["iteration"]) if start is not None else -1
        if pipe.joined is not None:
            origin = f"{'--join-from ' + str(a.join_from) if a.join_from is not None else '--join'} (iteration " \
                     f"{pipe.joined})"
            cause = "the join is not where the capture began"
        else:
            origin = f"{'--init ' + a.init if a.init else 'the job start'} (iteration {start})"
            cause = "the init is not the state where the capture began"
        misfit = _schedule_misfit(plan, a.plan, pipe)
        broke = pipe.extract.counters.get("schedule_mismatch", 0)
        if not misfit and broke:  # few among many that fit: still the likelier cause than the init
            misfit = (f"{broke} packet(s) broke the schedule of the plan {a.plan} (its ranks[].addr or ring.rings "
                      "may not be the job's)")
        if misfit:
            # packets that fit no message of the schedule are counted as rounds of their own:
            # a ring of another NCCL version or protocol makes "iterations" out of its pieces
            cause = f"{misfit}, or {cause}"
        aside = _set_aside(a.out, [r.iteration for r in reps if r.ok]) if a.out else 0
        raise UsageError(f"the captures hold iterations up to {max(past)} counted from {origin}, past the "
                         f"{plan.iterations} of the plan {a.plan} (0..{plan.iterations - 1}): {cause}, or the plan's "
                         "iterations is wrong; every commit is suspect"
                         + (f": the {aside} written are set aside in {a.out} as iter_*.pt.suspect" if aside else ""))
    if bad and (plan.transport == "gloo" or not committed):
        misfit = _schedule_misfit(plan, a.plan, pipe)
        if misfit:
            print(f"warning: {len(bad)} iteration(s) not recovered: {misfit}", file=sys.stderr)
    if pipe.joined is not None and not reps:
        # every flow was first seen whole only after the captures' last iteration: a join
        # that replays nothing is no success (exit 0 read as "every iteration recovered")
        print(f"warning: joined at iteration {pipe.joined}, after the last iteration the captures hold: "
              "nothing was replayed", file=sys.stderr)
        return EXIT_UNRECOVERED
    if pipe.unverified:
        # committed without a stream taken for stopped (silent ten windows), whose copies of
        # them came after all: never compared, and every later state stems from the first
        first = pipe.unverified_from
        aside = _set_aside(a.out, [r.iteration for r in reps if r.ok and r.iteration >= first]) if a.out else 0
        print(f"warning: {pipe.unverified_note()}"
              + (f": the {aside} written are set aside in {a.out} as iter_*.pt.suspect" if aside else ""),
              file=sys.stderr)
    if any(r.exact is False for r in reps):
        return 4
    if pipe.unverified:
        return EXIT_UNRECOVERED
    damaged = {e.path for e in pipe.errors if isinstance(e, CaptureDamage)}
    if plan.iterations is None and set(a.pcap) <= damaged:
        # where the plan gives no iteration count, only a capture that ends whole shows
        # where the job ended: cut at an iteration boundary, every iteration seen is
        # complete and the lost ones do not show at all
        last = max((r.iteration for r in reps), default=None)
        print(f"every capture ends at damage (warnings on stderr): what the job did after iteration "
              f"{last} is not in them")
        return EXIT_UNRECOVERED
    return EXIT_UNRECOVERED if bad else 0


def _schedule_misfit(plan, path: str, pipe) -> str:
    """Why no message of the captures fits the plan's schedule, where that is what the
    extraction saw (flows it could match to no channel, packets that broke the schedule):
    the plan's ring (NCCL version, protocol, channels) is then the first suspect, since
    each changes the messages' lengths and order on the wire. Empty if all fitted."""
    counters = pipe.extract.counters
    misfits = counters.get("schedule_mismatch", 0) + counters.get("ll_flag_mismatch", 0)
    flows = len(pipe.extract.unmatched_flows())
    if plan.transport == "gloo" and misfits:
        # gloo numbers every collective of the group by one counter: the job's own allreduce
        # (a loss, a metric) on DDP's group takes a bucket's place in the count
        return (f"{misfits} gloo message(s) have sizes the plan {path} does not give them there: the job's "
                "collectives on DDP's process group are not the ones the plan lists (one of its own the plan "
                "does not list, a loss or metric allreduce?, or one listed that the job does not run; list them "
                "in its collectives: write_plan(collectives=...), docs/TRAINING.md; or run them on a group of "
                "their own: dist.new_group), or the plan is another job's")
    mtu = pipe.extract.wire_mtu()
    if mtu and (flows or misfits):  # the MTU cuts messages into packets: nothing else fits then
        return f"{mtu} (the NICs' active MTU: write the plan with `ckptd plan --mtu`, or set its ring.mtu)"
    if pipe.extract.began_mid_job():
        from ckptd.transports.roce.transport import MID_JOB
        return f"{misfits} packet(s) broke the schedule of the plan {path}, and {MID_JOB}"
    placed = counters.get("ag_packets", 0) + counters.get("rs_packets", 0)
    if plan.transport != "roce" or not (flows or misfits > placed):
        # a few misfits among packets that fit are the capture's (a stream that began
        # mid-job, damage), not the ring's: another ring fits next to nothing
        return ""
    r = plan.ring
    seen = ", ".join(x for x in (f"{flows} flow(s) matched no channel" if flows else "",
                                 f"{misfits} packet(s) broke the schedule" if misfits else "") if x)
    return (f"{seen} of the plan {path}: its ring (ring.nccl_version "
            f"{r.nccl_version[0]}.{r.nccl_version[1]}, ring.protocol {r.protocol}, {r.channels} channel(s)) "
            "may not be the job's (NCCL_DEBUG=INFO names the version and protocol)")


def _checkpoints_in(out: str | None) -> dict[str, tuple[int, int]]:
    """{name: (iteration, mtime_ns)} of the checkpoint files (iter_NNNNNN.pt) in `out`."""
    from ckptd.core.checkpoint import iteration_of_name
    found = {}
    try:
        if out and Path(out).is_dir():
            for p in Path(out).iterdir():
                it = iteration_of_name(p.name)
                if it is not None and p.is_file():
                    found[p.name] = (it, p.stat().st_mtime_ns)
    except OSError as e:  # a name too long, a loop of links: the path itself is wrong
        raise UsageError(f"--out {out}: {e.strerror or e}") from None
    return found


def _warn_older_checkpoints(out: str, before: dict, last: int) -> None:
    """Checkpoints `out` held before this replay, newer than its last commit and not
    rewritten by it (another job's, an earlier run's): ckptd.restore(out), --resume and
    verify of the directory take the newest file, which is then not this replay's."""
    now = _checkpoints_in(out)
    left = sorted(it for name, (it, mtime) in before.items() if it > last and now.get(name) == (it, mtime))
    if left:
        shown = ", ".join(map(str, left[:5])) + (", ..." if len(left) > 5 else "")
        print(f"warning: --out {out} still holds checkpoints of iterations {shown} from before this replay, "
              f"newer than its last commit ({last if last >= 0 else 'none'}): ckptd.restore, --resume and verify "
              "of the directory take the newest, which is not this replay's; remove them or give a fresh --out",
              file=sys.stderr)


def _set_aside(out: str, iterations: list[int]) -> int:
    """Rename this replay's checkpoints of `iterations` in `out` to NAME.suspect, where no
    reader of checkpoints (restore, --resume, verify of the directory) takes them for
    committed state; how many were."""
    from ckptd.core.checkpoint import checkpoint_name
    n = 0
    for it in iterations:
        p = Path(out) / checkpoint_name(it)
        if p.is_file():
            p.replace(p.with_name(p.name + ".suspect"))
            n += 1
    return n


def cmd_inspect(a) -> int:
    """The table (or JSON) of what could be read; exit 2 with the first file error on
    stderr when any file was missing, empty or broken (the table says which)."""
    from ckptd.tools.inspect import format_inspect, inspect_captures
    paths = _stdin_capture(a.pcap)
    _distinct_captures(paths, kinds=False)
    res = inspect_captures(paths, _stream_names(paths, a.names))
    if a.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        print(format_inspect(res))
    if res["errors"]:
        more = len(res["errors"]) - 1
        raise UsageError(res["errors"][0] + (f" (and {more} more)" if more else ""))
    return 0


def _as_given(message: str) -> str:
    """A message about the capture read from `-` names it as the user gave it, not as
    the /dev/stdin it is read through."""
    from ckptd.core.streams import STDIN_PATH
    return message.replace(f"{STDIN_PATH}:", "- (stdin):")


def _stdin_capture(paths: list[str]) -> list[str]:
    """The capture paths with `-` (at most one) read as stdin, /dev/stdin: the one place
    `-` is mapped, so both replay paths, inspect and _distinct_captures see a path. A
    terminal on stdin is refused before anything is read (it would wait for typed bytes)."""
    import os
    from ckptd.core.streams import STDIN, STDIN_PATH
    if paths.count(STDIN) > 1:
        raise UsageError(f"{STDIN}: stdin given {paths.count(STDIN)} times: it is one stream, give it once")
    if STDIN not in paths:
        return list(paths)
    try:
        tty = os.isatty(0)
    except OSError:
        tty = False
    if tty:
        raise UsageError(f"{STDIN}: stdin is a terminal; pipe a capture into it "
                         "(tcpdump -w - ... | ckptd ... -, or < capture.pcap)")
    return [STDIN_PATH if p == STDIN else p for p in paths]


def _stream_names(paths: list[str], given: str | None) -> list[str]:
    """--names A,B,C where given, else ckptd.core.streams.stream_names' rules."""
    from ckptd.core.streams import stream_names
    return stream_names(paths) if given is None else _given_names(given, len(paths))


def _given_names(text: str, count: int) -> list[str]:
    """--names A,B,C: exactly one per capture, non-empty, without blanks, distinct."""
    names = text.split(",")
    if len(names) != count:
        raise UsageError(f"--names {text!r}: {len(names)} name(s) for {count} capture(s); give one per capture")
    for k, n in enumerate(names, 1):
        if not n:
            raise UsageError(f"--names {text!r}: name {k} is empty")
        if any(c.isspace() or not c.isprintable() for c in n):
            raise UsageError(f"--names {text!r}: name {k} ({n!r}) has a blank or control character")
        if names.index(n) != k - 1:
            raise UsageError(f"--names {text!r}: {n!r} is given twice; each stream needs a name of its own")
    return names


def _distinct_captures(paths: list[str], kinds: bool = True) -> None:
    """One capture per stream: the same file (or FIFO) twice would be read twice, and a
    FIFO opened twice blocks. Checked on the paths' identities, not their spelling.
    `kinds`: each must also be there and be a capture (inspect leaves those to its table)."""
    import os
    import stat
    from ckptd.core.readfile import misplaced_file
    from parsers.capfile import NotACaptureError, capture_format, not_a_capture
    seen: dict[tuple[int, int], str] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError as e:
            if not kinds:
                continue
            raise UsageError(f"{p}: {e.strerror}") from None
        key = (st.st_dev, st.st_ino)
        if key in seen:
            raise UsageError(f"{p}: the same capture as {seen[key]}: give each stream once")
        seen[key] = p
        if not kinds:
            continue
        if why := not_a_capture(p, st):
            raise UsageError(why)
        if stat.S_ISREG(st.st_mode):  # not a FIFO: its first bytes would be gone
            try:
                capture_format(p)  # an empty file, or no capture at all: one line now, not a stream error later
            except NotACaptureError:
                if what := misplaced_file(p, "capture"):
                    raise UsageError(f"{p}: this is {what}, not a capture") from None
                raise


def _verify_source(src: str, plan):
    """Any source ckptd.restore takes (recovery.load_source). The daemon's body may take
    what a checkpoint of the plan's model can (recovery.body_limit_of), or without a
    plan the memory available: a lying Content-Length or an endless body is refused
    before it fills memory."""
    from ckptd.core.memory import available_memory
    from ckptd.recovery import body_limit_of, load_source
    names = plan.state_names if plan else None
    limit = body_limit_of(plan.state_bytes()) if plan else available_memory()
    ckpt, where, _ = load_source(src, names, limit=limit)
    if plan is not None:  # as export: a checkpoint of another model is no state of the plan's job
        plan.check_state(ckpt, where)  # (two of the same other model were "identical", exit 0)
    return ckpt


def cmd_verify(a) -> int:
    from ckptd.core.checkpoint import diff_checkpoints, one_sided
    from ckptd.core.plan import load_plan
    plan = load_plan(a.plan, check_optimizer=False) if a.plan else None
    names = plan.state_names if plan else None
    first, second = (_verify_source(x, plan) for x in (a.a, a.b))
    if a.parameters_only:  # e.g. ckptd's file (no buffers) against the trainer's
        # the parameters: the plan's (both files hold them all: _verify_source), else the
        # names of the file with fewer (ckptd's, no buffers). Not the names both hold: two
        # models with none in common were "identical" (every entry dropped), and a
        # parameter missing from one went unseen.
        keep = set(names or []) or min((set(first["model"]), set(second["model"])), key=len)
        if not keep:
            raise UsageError("--parameters-only: a checkpoint holds no model entry: nothing to compare")
        for doc in (first, second):
            doc["model"] = {n: t for n, t in doc["model"].items() if n in keep}
    diffs = diff_checkpoints(first, second, limit=a.limit)
    from ckptd.core.store import redact
    if not diffs:
        unseen = one_sided(first, second)  # e.g. a trainer's scheduler state against ckptd's file
        print(f"identical: {redact(a.a)} == {redact(a.b)}" + (f" (not compared: {', '.join(unseen)})" if unseen else ""))
        return 0
    print(f"differ: {redact(a.a)} != {redact(a.b)}")
    for d in diffs:
        print(f"  {d}")
    return 1


def cmd_export(a) -> int:
    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.core.finite import diverged_state, nonfinite_in
    from ckptd.core.formats import export_checkpoint
    from ckptd.core.plan import load_plan
    import os
    if os.path.isfile(a.out) and os.path.exists(a.checkpoint) and os.path.samefile(a.out, a.checkpoint):
        # the export would replace its own source (another format, the iteration now a
        # step count): the checkpoint is gone, with exit 0
        raise UsageError(f"--out {a.out} is the checkpoint being exported ({a.checkpoint}): it would be "
                         "overwritten; give --out a path of its own")
    plan = load_plan(a.plan) if a.plan else None
    ckpt = load_checkpoint(a.checkpoint, plan.state_names if plan else None)
    if plan is not None:  # the plan names the job: a checkpoint of another model is no export of it
        plan.check_state(ckpt, a.checkpoint)
        if extra := plan.not_in_plan(ckpt, a.checkpoint, a.plan):
            # exported as they are (a buffer an older plan does not list is the job's), but a
            # trainer's strict load_state_dict refuses what its model does not have
            print(f"warning: {extra}: exported as they are; a trainer's strict load_state_dict refuses entries "
                  "its model lacks", file=sys.stderr)
    lr = (ckpt.get("optimizer") or {}).get("lr")  # (a finite one: load_checkpoint's check)
    if hasattr(lr, "numel") and lr.numel() != 1:
        # it would be the exported param_groups' lr (the plan's groups follow the first's,
        # without a plan the one group is the first), and a scheduler's _last_lr
        raise UsageError(f"{a.checkpoint}: optimizer.lr is a tensor of {lr.numel()} elements, not one lr "
                         "(param group 0's lr in the export)")
    out = export_checkpoint(ckpt, a.out, a.format, plan)
    print(f"wrote {out} ({a.format}, iteration {ckpt['iteration']}, step {int(ckpt['iteration']) + 1})")
    if bad := nonfinite_in(ckpt):  # written as asked: it is the job's state
        print(f"warning: {diverged_state(a.checkpoint, bad, ckpt['iteration'])}", file=sys.stderr)
    return 0


def cmd_demo(a) -> int:
    """synth + replay of the built-in default scenario, per-iteration bit-exactness
    (cmd_synth refuses a bad --model before --out is made; a temporary one is removed)."""
    if a.out:
        out_directory(a.out)  # as --out itself, not as the synth --out it becomes
    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="ckptd-demo-"))
    try:
        syn = build_parser().parse_args([
            "synth", "--out", str(work), "--ranks", "4", "--channels", "2", "--protocol", a.protocol,
            "--mtu", "4096", "--mirrors", "3", "--loss", str(a.loss), "--iterations", str(a.iterations),
            "--model", a.model, "--bucket-cap-kb", "2048", "--seed", str(a.seed)])
        if cmd_synth(syn):
            return 1
        pcaps = sorted(str(p) for p in (work / "mirrors").glob("*.pcap"))
        rep = build_parser().parse_args(
            ["replay", "--plan", str(work / "plan.json"), "--init", str(work / "init.pt"),
             "--out", str(work / "checkpoints"), "--reference", str(work / "reference")] + pcaps)
        return cmd_replay(rep)
    finally:
        if not a.out:
            shutil.rmtree(work, ignore_errors=True)


RUN_DESCRIPTION = """\
The daemon: capture the job's mirrored RoCEv2 (or gloo/TCP) traffic on every configured
interface (an AF_PACKET TPACKET_V3 ring each), pick the reduced gradients out of the
allreduce, merge the mirror streams, step a shadow copy of the model and keep a
checkpoint of every iteration: in memory (served at /checkpoint), and written to `out`
(or `persist_url`) every `persist_every`-th commit or `persist_interval_s` seconds
(`persist_sync: true`: every commit). /status and /metrics say per iteration what was
committed, and which iterations could not be recovered and why.

A minimal config (YAML; every key is in docs/DAEMON.md, deploy/ckptd.yaml is a sample):

    plan: /etc/ckptd/plan.json       # the job's plan (ckptd.torch.write_plan, ckptd plan)
    init: /etc/ckptd/init.pt         # the state before the first iteration it will see
    out: /var/lib/ckptd              # checkpoints and manifest.json
    interfaces:                      # one per mirror stream; `ckptd mirror-config` writes these
      - {name: mirror0, ifname: ens1f0}
      - {name: mirror1, ifname: ens1f1}

Every value is checked before anything is opened; a bad one is one line naming the file
and the key, exit 2. `--check` goes on through everything a start does before its first
frame and stops there.

SIGINT/SIGTERM stop (the iteration in flight is abandoned and reported); SIGHUP is
ignored (the config is read at start).

Exit status: 0 every iteration seen was committed (or was in flight at the stop);
2 bad config, plan, init or interface; 3 an iteration could not be recovered; 4 frames
dropped on this host cost an iteration (by a capture ring: rings too small or the host
too slow, docs/DAEMON.md "Sizing the rings"; or by the interface before any ring: the
NIC's own ring); 5 the newest committed checkpoint could not be written; 6 capture ended
without a stop (every ring or capture worker failed: the daemon was blind to the rest)."""


def cmd_run(a) -> int:
    from ckptd.live.daemon import (ConfigError, Daemon, load_config, made_dirs_removed_on_failure, parse_listen,
                                   setup_logging)
    from ckptd.live.privilege import PrivilegeError
    cfg = None
    try:
        cfg = load_config(a.config)
        if a.listen:
            parse_listen(a.listen, "--listen")
            cfg.listen = a.listen
        setup_logging(a.log_level or cfg.log_level)
        with made_dirs_removed_on_failure(cfg):
            if a.check:
                daemon = Daemon(cfg)
                daemon.check()
                from ckptd.core.store import redact
                plan = daemon.plan
                print(f"{a.config}: ok: {len(cfg.interfaces)} interface(s) opened "
                      f"({', '.join(f'{i.name}={i.ifname}' for i in cfg.interfaces)}); plan {cfg.plan}: "
                      f"{plan.nranks} ranks, {len(plan.parameters)} parameters, {plan.transport}, shadow "
                      f"{plan.shadow_bytes() / 2**20:.1f} MiB; {'fast' if daemon.fast else 'reference'} path"
                      f"{', capture workers' if cfg.capture_workers else ''}; checkpoints to "
                      f"{redact(daemon.persist_target)}")  # (user:password@ never shown)
                return 0
            return Daemon(cfg).run()
    except (ConfigError, PrivilegeError) as e:
        line = " ".join(str(e).split())
        if cfg is not None and cfg.source and not line.startswith(f"{cfg.source}:"):
            # a check made once the file was read (listen, user, the directories): named by the file too
            line = f"{cfg.source}: {line}"
        print("error: " + _printable(line), file=sys.stderr)
        return 2


def cmd_plan(a) -> int:
    """A plan without running the job: DDP's buckets from a real (one-rank) DDP around
    the model; the ring from the arguments or from the job's NCCL_DEBUG=INFO log. A
    training script should call ckptd.torch.write_plan instead (docs/TRAINING.md)."""
    import dataclasses
    import inspect
    import os

    import torch

    from ckptd.core.optim import optimizer_class
    from ckptd.core.plan import Mirror, Optimizer, Parameter, Plan
    from ckptd.core.readfile import misplaced_file
    from ckptd.core.schedule import RingConfig, ScheduleError
    from ckptd.core.wrappers import unwrap
    from ckptd.torch import (TrainerError, ddp_layouts, model_buffers, model_collectives, one_rank_per_node,
                             plan_parameters, tied_parameters, with_own_collectives)
    if os.path.isfile(a.out) and (what := misplaced_file(a.out, "plan")):  # before the model is built
        raise UsageError(f"--out {a.out}: is {what}, which the plan would overwrite; give --out a path of its own")
    _check_clip_options(a)
    # an option the chosen optimizer does not take was dropped without a word (--optimizer
    # nadam --beta1 0.5 wrote torch's default betas, adamw --momentum 0.9 none)
    takes = {"--beta1": ("adam", "adamw"), "--beta2": ("adam", "adamw"), "--eps": ("adam", "adamw"),
             "--momentum": ("sgd", "rmsprop")}
    for option, kinds in takes.items():
        if getattr(a, option[2:]) is not None and a.optimizer not in kinds:
            raise UsageError(f"{option} is for --optimizer {' or '.join(kinds)}, not {a.optimizer} "
                             "(its other hyperparameters are torch's defaults)")
    topo = None
    if a.nccl_log:
        from ckptd.tools.nccl_log import load_nic_addrs, parse_nccl_log, ring_topology
        if not a.nic_addrs:
            raise UsageError("--nccl-log needs --nic-addrs (each host's NIC addresses in NCCL device order; "
                             "the log names NET/IB devices, not their addresses)")
        job = None
        for f in a.nccl_log:
            from ckptd.core.readfile import read_bounded
            from ckptd.tools.nccl_log import MAX_NCCL_LOG_BYTES
            try:
                # bounded, and a FIFO nobody writes into is an error after a wait:
                # read_text() hung on the FIFO and filled the memory from /dev/zero
                data = read_bounded(f, MAX_NCCL_LOG_BYTES, "an NCCL log (the lines of the communicator's "
                                    "set-up are enough)")
            except OSError as e:
                raise UsageError(f"--nccl-log {f}: {e.strerror or e}") from None
            text = data.decode(errors="replace")
            job = parse_nccl_log(text, f, job)
        topo = ring_topology(job, load_nic_addrs(a.nic_addrs), " + ".join(a.nccl_log))
        if a.ranks is not None and a.ranks != len(topo.addresses) or a.addr:
            raise UsageError(f"--nccl-log gives the ranks ({len(topo.addresses)}) and their NICs: leave out "
                             "--ranks and --addr, or make --ranks agree")
        given = [o for o, v in (("--channels", a.channels), ("--protocol", a.protocol),
                                ("--nccl-version", a.nccl_version)) if v is not None]
        if given:  # the log's value was used and the option silently dropped
            raise UsageError(f"--nccl-log gives the rings, the protocol and the NCCL version: leave out {given[0]}")
    elif a.ranks is None:
        raise UsageError("give --ranks and --addr, or --nccl-log")
    else:  # the defaults, where no log gives them
        given = [o for o, v in (("--channels", a.channels), ("--protocol", a.protocol),
                                ("--nccl-version", a.nccl_version)) if v is not None]
        if a.transport == "gloo" and given:
            # gloo's TCP ring has one channel and no NCCL protocol or version: the option
            # was dropped without a word (--channels 4 wrote a plan of one channel)
            raise UsageError(f"--transport gloo has no NCCL channels, protocol or version: leave out {given[0]}")
        a.channels = 2 if a.channels is None else a.channels
        a.protocol = a.protocol or "simple"
        a.nccl_version = a.nccl_version or "2.19"
    sys.path.insert(0, os.getcwd())  # `--model mymodel:build` from the current directory
    model = _call_named(a.model, "--model")
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--model {a.model!r} returned {type(model).__name__}, not a torch.nn.Module")
    batch = _call_named(a.sample, "--sample") if a.sample else None
    if a.sample and batch is None:  # else "--transport nccl needs --sample", which was given
        raise UsageError(f"--sample {a.sample!r} returned None, not an input batch")
    limits: dict = {}
    try:
        first, rebuilt = ddp_layouts(model, a.bucket_cap_mb, batch, limits_out=limits)
    except CkptdError:
        raise
    except Exception as e:  # DDP's constructor on the model, or its forward or backward on the sample
        if a.sample is None:  # no step ran: DDP refused the model (no trainable parameter, ...)
            raise UsageError(f"--model {a.model!r}: DistributedDataParallel around it {_raised(e)}") from e
        raise UsageError(f"--sample {a.sample!r}: a training step of --model {a.model!r} on it {_raised(e)}") from e
    if rebuilt is None and a.transport == "nccl":
        raise UsageError("--transport nccl needs --sample: the layout DDP rebuilds after "
                         "iteration 0 follows the order gradients become ready")
    model = unwrap(model)[0]  # a compiled model's names carry _orig_mod.: the plan's are the plain model's
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    if a.optimizer in ("adam", "adamw"):
        opt = Optimizer(kind=a.optimizer, lr=a.lr, betas=(0.9 if a.beta1 is None else a.beta1,
                                                          0.999 if a.beta2 is None else a.beta2),
                        eps=1e-8 if a.eps is None else a.eps,
                        weight_decay=a.weight_decay, implementation=a.implementation)
    else:
        hyper = {"lr": a.lr, "weight_decay": a.weight_decay, "foreach": a.implementation == "foreach"}
        if a.implementation == "fused":
            cls = optimizer_class(a.optimizer)
            if "fused" not in inspect.signature(cls.__init__).parameters:
                raise UsageError(f"--implementation fused: torch's {cls.__name__} has no fused step "
                                 "(use for-loop or foreach)")
            hyper["fused"] = True
        if a.optimizer in ("sgd", "rmsprop"):
            hyper["momentum"] = a.momentum or 0.0
        opt = Optimizer(kind=a.optimizer, lr=a.lr, groups=({"params": names, **hyper},))
    opt = dataclasses.replace(opt, max_grad_norm=a.max_grad_norm, grad_norm_type=a.grad_norm_type,
                              clip_grad_value=a.clip_grad_value)
    gloo = a.transport == "gloo"
    if topo is not None:
        if gloo:
            raise UsageError("--nccl-log describes an NCCL job: it cannot go with --transport gloo")
        try:
            ring = RingConfig(len(topo.addresses), topo.rings, topo.protocol, topo.nccl_version, mtu=a.mtu,
                              **topo.settings)
        except ScheduleError as e:  # the log's version, protocol or settings: named as the log's
            raise UsageError(f"--nccl-log {' + '.join(a.nccl_log)}: {e}") from None
        addrs, nodes, nics = topo.addresses, topo.nodes, topo.channel_nics
    else:
        major, minor = _nccl_version(a.nccl_version)
        addrs = a.addr or []
        if len(addrs) != a.ranks:
            raise UsageError(f"give --addr once per rank ({a.ranks} ranks, {len(addrs)} addresses)")
        ring = RingConfig(a.ranks, tuple(tuple(range(a.ranks)) for _ in range(1 if gloo else a.channels)),
                          a.protocol, (major, minor), mtu=a.mtu)
        nodes, nics = (), ()
    # DDP's start-up collectives and per-forward buffer broadcasts share the ring with the
    # buckets (its QP rotation, PSNs and LL steps): without them a capture of the job's
    # start placed nothing (docs/PLAN.md collectives)
    try:
        # PAT: the job's NCCL_ALGO / NCCL_PAT_ENABLE as its log shows them, else as this
        # command's environment has them (run it with the job's)
        collectives = {} if gloo else model_collectives(model, ring, one_rank_per_node(nodes or addrs),
                                                        topo.nccl_env if topo is not None else os.environ)
    except TrainerError as e:
        raise UsageError(str(e)) from None
    # the job's own allreduces on DDP's group (a loss, a metric), after DDP's at each place
    own = {when: tuple(tuple(e) for e in v) for when, v in _other_allreduces(a.other_allreduce).items()}
    collectives = with_own_collectives(collectives, own)
    plan = Plan(plan_parameters([n for n, _ in named], [p for _, p in named]),
                first, rebuilt or first, ring, opt, tuple(addrs), (),
                transport="gloo" if gloo else "roce", rebuilt_learn=gloo and rebuilt is None,
                nodes=nodes, channel_nics=nics, start_iteration=a.start_iteration,
                bucket_limits=limits or None,
                frozen=Parameter.each_of((n, p) for n, p in model.named_parameters() if not p.requires_grad),
                tied=tied_parameters(model, [n for n, _ in model.named_parameters()]),
                buffers=model_buffers(model), collectives=collectives)  # (buffers: DDP broadcasts rank 0's)
    if not gloo:
        plan = dataclasses.replace(plan, mirrors=tuple(Mirror(f"mirror{r}", r, "both")
                                                       for r in default_mirror_ports(plan)))
    plan.save(a.out)
    print(f"wrote {a.out}: {len(named)} parameters, {len(first)} first / "
          f"{'learned from the wire' if plan.rebuilt_learn else len(plan.buckets_rebuilt)} rebuilt buckets, "
          f"{ring.nranks} ranks on {len(set(plan.node_names))} nodes, {ring.channels} channel(s)")
    return 0


def default_mirror_ports(plan, count: int = 3) -> list[int]:
    """NIC ports to mirror (both directions), by owner rank, so that every channel's
    network hops are seen on up to `count` distinct ports (as many as its hops' NICs
    allow): the senders of the hops, taken in ring order and round-robin over the
    channels. On one-NIC hosts of an identity ring that is ranks 0, 1, 2 (every NIC
    carries every channel); with a NIC per channel (rails) each channel needs its own
    ports: before, only channel 0's were chosen, and no iteration could complete from
    them. `ckptd mirror-config` chooses for real cablings."""
    hops = {c: [plan.link_of((src, ring[(i + 1) % len(ring)], c)) for i, src in enumerate(ring)
                if (src, ring[(i + 1) % len(ring)], c) in plan.network_connections]
            for c, ring in enumerate(plan.ring.rings)}
    seen_by = {c: {n for link in links for n in link} for c, links in hops.items()}  # NICs that see it
    want = {c: min(count, len(nics)) for c, nics in seen_by.items()}
    out: list[int] = []
    for k in range(max((len(v) for v in hops.values()), default=0)):
        for c in sorted(hops):
            if k >= len(hops[c]) or hops[c][k][0] in out:
                continue
            if any(len(seen_by[d] & set(out)) < want[d] for d in hops):
                out.append(hops[c][k][0])
    return out


def _call_named(spec: str, option: str):
    """module:function, imported and called. The user's own code: an error in it is one
    line naming the option, the error and where it was raised (CKPTD_DEBUG=1 shows the
    whole traceback); a name that does not resolve is a usage error."""
    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn.isidentifier():
        raise UsageError(f"{option} {spec!r} is not module:function")
    try:
        target = getattr(importlib.import_module(mod), fn)
    except ImportError as e:
        raise UsageError(f"{option} {spec!r}: cannot import {mod!r}: {e}") from None
    except AttributeError:
        raise UsageError(f"{option} {spec!r}: module {mod!r} has no {fn!r}") from None
    except (Exception, SystemExit) as e:  # the module's own import-time code (sys.exit too: no silent exit)
        raise UsageError(f"{option} {spec!r}: importing {mod!r} {_raised(e)}") from e
    try:
        return target()
    except (Exception, SystemExit) as e:
        raise UsageError(f"{option} {spec!r} {_raised(e)}") from e


def _raised(e: BaseException) -> str:
    """'raised TypeError: ... (at file:line)', the line being the innermost frame's."""
    import traceback
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno}; CKPTD_DEBUG=1 shows the traceback)" if frames else ""
    return f"raised {type(e).__name__}: {' '.join(str(e).split())}{where}"


def _nccl_version(text: str) -> tuple[int, int]:
    from ckptd.core.schedule import parse_nccl_version
    try:
        return parse_nccl_version(text)
    except ValueError as e:
        raise UsageError(f"--nccl-version {e}") from None


# -- parser --------------------------------------------------------------------------
def _path(text: str) -> str:
    """A path argument: an empty one would mean the current directory or nothing at all."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError("an empty path" if not text else "a path with a NUL byte")
    return text


PCAP_HELP = ("one capture (pcap or pcapng) per mirror stream: a file, a FIFO, a pipe (<(zcat x.pcap.gz)), "
             "or - for stdin (at most once; tcpdump -w - ... | ckptd ... -)")
NAMES_HELP = ("the streams' names in the per-stream lines, one per capture in order, distinct (default: each "
              "file's stem; stdin for -; streamK, K from 1, for a /dev/fd/N pipe; parent directories "
              "added where stems clash: m0/mirror, m1/mirror)")


class UsageError(CkptdError):
    """An argument that cannot be used as given."""


def out_directory(path: str, option: str = "--out") -> None:
    """A directory argument that is made if missing: a file (or a broken link) at it or
    above it was the bare "Not a directory" or "File exists" of the first file written
    under it, naming neither the option nor what to do."""
    import os
    from ckptd.core.kernelfs import not_storage
    if why := not_storage(path):  # /proc/x: "No such file or directory" of the first file written
        raise UsageError(f"{option} {path}: {why}; give a directory on a disk")
    p = Path(path)
    while not p.is_dir():
        if os.path.lexists(p):
            why = "a file is in the way" if p.exists() else "a broken symbolic link is in the way"
            at = "" if p == Path(path) else f" ({p})"
            raise UsageError(f"{option} {path}: {why}{at}; give a directory")
        if p.parent == p:
            return
        p = p.parent


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one `error: ...` line (exit 2) like every other.
    A value that begins with '-' is taken as an option's argument when it reads as a
    number: argparse's own rule (-1, -.5) left out -1e-3 and -inf, and `--grad-norm-type
    -inf` was "expected one argument" instead of the option's own check."""

    NEGATIVE_NUMBER = re.compile(r"^-(\d[\d_]*(\.[\d_]*)?|\.\d[\d_]*)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$",
                                 re.IGNORECASE)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = self.NEGATIVE_NUMBER

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _ranged(kind, lo, hi):
    """An argparse type: `kind` (int or float) within [lo, hi]."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not lo <= v <= hi:  # NaN fails this too
            raise argparse.ArgumentTypeError(f"{text} is not in {lo}..{hi}")
        return v
    return parse


def _clip_options(p: argparse.ArgumentParser) -> None:
    """The trainer's gradient clipping (the plan's optimizer.max_grad_norm, grad_norm_type,
    clip_grad_value), for `synth` and `plan` alike."""
    p.add_argument("--max-grad-norm", type=_ranged(float, 1e-30, 1e30), default=None, metavar="N",
                   help="the loop calls clip_grad_norm_(model.parameters(), N) before every step "
                        "(default: no clipping)")
    p.add_argument("--grad-norm-type", type=_norm_type_arg, default=2.0, metavar="P",
                   help="clip_grad_norm_'s norm_type with --max-grad-norm: a number > 0 or inf (default 2)")
    p.add_argument("--clip-grad-value", type=_ranged(float, 1e-30, 1e30), default=None, metavar="V",
                   help="the loop calls clip_grad_value_(model.parameters(), V) before every step instead "
                        "(default: no clipping)")


def _check_clip_options(a) -> None:
    """The clipping options, named as given (the plan's check would name its fields)."""
    if a.clip_grad_value is not None and a.max_grad_norm is not None:
        raise UsageError("--clip-grad-value and --max-grad-norm: the loop makes one clipping call "
                         "(clip_grad_value_ or clip_grad_norm_) before the step; give one")
    if a.grad_norm_type != 2.0 and a.max_grad_norm is None:
        raise UsageError("--grad-norm-type is clip_grad_norm_'s norm_type: it needs --max-grad-norm")


def _norm_type_arg(text: str) -> float:
    """An argparse type: clip_grad_norm_'s norm_type, a number > 0 or inf."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or inf") from None
    if not v > 0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text} is not > 0")
    return v


def _ip_address(text: str) -> str:
    """An argparse type: an IPv4 or IPv6 address, in canonical text."""
    import ipaddress
    from ckptd.core.hostaddr import not_a_host
    try:
        a = ipaddress.ip_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 or IPv6 address") from None
    # ::ffff:a.b.c.d (a RoCE GID of an IPv4 address) is the IPv4 address on the wire: it was
    # taken for another NIC than a.b.c.d
    addr = str(getattr(a, "ipv4_mapped", None) or a)
    if why := not_a_host(addr):
        raise argparse.ArgumentTypeError(f"{addr} is {why}, not a NIC's")
    return addr


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or where it is not
    installed (run from a source tree on PYTHONPATH) that it is not."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ckptd")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    from ckptd.core.assemble import AGREE_WINDOW_MS  # not ckptd.pipeline: --help needs no torch
    from ckptd.core.plan import OPTIMIZER_CLASSES
    p = _Parser(
        prog="ckptd", description="Per-iteration checkpoints rebuilt from mirrored RoCEv2 "
        "allreduce traffic, at no cost to the training job.")
    p.add_argument("--version", action="version", version=f"ckptd {_version()}",
                   help="print ckptd's version and exit")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="synthesize the default scenario and replay it, "
                       "printing per iteration whether the checkpoint is bit-exact")
    d.add_argument("--out", type=_path, help="keep the scenario here (default: a temporary directory)")
    d.add_argument("--iterations", type=_ranged(int, 1, 10_000), default=6,
                   help="iterations to train and replay (default 6)")
    d.add_argument("--protocol", choices=["simple", "ll", "ll128"], default="simple",
                   help="the NCCL protocol on the wire (default simple)")
    d.add_argument("--loss", type=_ranged(float, 0, 1), default=1e-3, help="packet loss on every mirror link")
    d.add_argument("--model", default="default", help="synthetic model size: tiny, small, default")
    d.add_argument("--seed", type=_ranged(int, 0, (1 << 32) - 1), default=0,
                   help="seed of the model, the data and the injected loss (default 0)")
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("synth", help="train a small LM over N ranks and write the mirrored "
                       "RoCEv2 traffic, the plan, the initial state and reference checkpoints")
    s.add_argument("--out", type=_path, required=True, help="output directory")
    s.add_argument("--ranks", type=_ranged(int, 2, 64), default=None,
                   help="ranks, one GPU per host (default 4; with --nodes they are NODES x --gpus-per-node)")
    s.add_argument("--channels", type=_ranged(int, 1, 32), default=2,
                   help="NCCL channels (rings) per allreduce (default 2)")
    s.add_argument("--protocol", choices=["simple", "ll", "ll128"], default="simple",
                   help="the NCCL protocol on the wire (default simple)")
    s.add_argument("--mtu", type=int, default=4096, choices=[256, 512, 1024, 2048, 4096],
                   help="RoCE path MTU in bytes (default 4096)")
    s.add_argument("--mirrors", type=_ranged(int, 1, 64), default=2, help="mirror streams (switch ports of ranks 0..K-1; at most one per port: --ranks, "
                   "with --nodes their NICs, times --merged-nics)")
    s.add_argument("--mirror-direction", choices=["tx", "rx", "both"], default="both",
                   help="which direction of each ring link the mirrors copy: tx, rx or both (default)")
    s.add_argument("--loss", type=_ranged(float, 0, 1), default=0.0, help="loss probability per frame per mirror link")
    s.add_argument("--duplicate", type=_ranged(float, 0, 1), default=0.0,
                   help="fraction of frames each mirror copies twice (default 0)")
    s.add_argument("--reorder", type=_ranged(float, 0, 1), default=0.0,
                   help="fraction of frames each mirror swaps with the next one (default 0)")
    s.add_argument("--corrupt", type=_ranged(float, 0, 1), default=0.0, help="bit flips (caught by the ICRC)")
    s.add_argument("--retransmit", type=_ranged(float, 0, 1), default=0.0, help="the fraction of messages (0..1) resent go-back-N, on the wire (every mirror sees the resend)")
    s.add_argument("--iterations", type=_ranged(int, 1, 10_000), default=5, help="training iterations (default 5)")
    s.add_argument("--allreduces-per-step", type=_ranged(int, 1, 64), default=1,
                   help="micro-batches per step, each allreduced (gradient accumulation without no_sync)")
    s.add_argument("--seed", type=_ranged(int, 0, (1 << 32) - 1), default=0,
                   help="seed of the model, the data and the injected faults (default 0)")
    s.add_argument("--model", default="small", help="tiny (~42K params), small (~170K), default (~2.6M); "
                   "tiny-bn, small-bn: with a BatchNorm (module buffers, DDP broadcasts them each forward)")
    s.add_argument("--nccl-version", default="2.19",
                   help="2.14..2.19 (channels interleaved), 2.20, 2.21 (contiguous per channel), 2.22..2.32 "
                        "(NCCL's cell partition; 2.31 and 2.32 with the 2.29 rules, see docs/NCCL.md)")
    s.add_argument("--qps", type=_ranged(int, 1, 128), default=1, help="NCCL_IB_QPS_PER_CONNECTION")
    s.add_argument("--merged-nics", type=_ranged(int, 1, 4), default=1, metavar="K",
                   help="ports of every rank's merged NIC (NCCL_IB_MERGE_NICS, NCCL 2.20+; at most 2 "
                        "before 2.24): port k of 10.77.0.r is 10.(77+k).0.r; mirror m is port m %% K of "
                        "rank m // K (give --mirrors 2K to see two ranks whole)")
    s.add_argument("--adaptive-routing", action="store_true", default=None,
                   help="NCCL_IB_ADAPTIVE_ROUTING=1 (2.16+): sends over 8192 B go as RDMA WRITE + 0-byte "
                        "WRITE_WITH_IMM, as 2.14-2.15 always do (docs/NCCL.md section 4a)")
    s.add_argument("--bucket-cap-kb", type=_ranged(int, 1, 1 << 20), default=64, help="DDP bucket cap (small, for several buckets)")
    s.add_argument("--optimizer", choices=["for-loop", "foreach", "fused"], default="foreach",
                   help="the optimizer's implementation (torch's foreach / fused flags)")
    s.add_argument("--optim", metavar="KIND[:KEY=VALUE,...]", default=None,
                   help="the trainer's torch.optim class and its hyperparameters, e.g. "
                        "sgd:lr=0.1,momentum=0.9,nesterov=true,weight_decay=1e-4 or "
                        "adam:lr=1e-3,betas=0.9/0.95 (A/B: a tuple); KIND is one of adam, adamw, sgd, "
                        "adagrad, rmsprop, adamax, nadam, radam, asgd, adadelta, rprop "
                        "(default: AdamW lr=3e-3 betas=0.9/0.95 weight_decay=0.1)")
    s.add_argument("--param-groups", choices=["one", "no-decay"], default="one",
                   help="no-decay: biases and norm weights in a second param group with weight_decay=0")
    s.add_argument("--lr-scheduler", metavar="CLASS[:KEY=VALUE,...]", default=None,
                   help="a torch.optim.lr_scheduler class stepped after every step, e.g. "
                        "StepLR:step_size=3,gamma=0.5 or MultiStepLR:milestones=2/5 (default: a cosine "
                        "schedule with 2 warm-up steps, set by hand as LambdaLR would)")
    s.add_argument("--lr-per-step", metavar="LR,LR,...", default=None,
                   help="the lr the loop writes into the groups before each step (no scheduler): one per "
                        "iteration, at least --iterations of them; A/B gives each param group its own")
    s.add_argument("--amp", type=_ranged(float, 1.0, 2.0 ** 64), default=None, metavar="INIT_SCALE",
                   help="a GradScaler with this init_scale: the wire carries scaled gradients, steps with "
                        "inf/nan gradients are skipped and the scale backs off")
    s.add_argument("--amp-growth-interval", type=_ranged(int, 1, 1 << 30), default=None,
                   help=f"the GradScaler's growth_interval with --amp (default {AMP_GROWTH_INTERVAL})")
    s.add_argument("--inf-at", type=_ranged(int, 0, 10_000), action="append", default=[], metavar="ITER",
                   help="put an inf into rank 0's gradient at iteration ITER, as an fp16 overflow would: "
                        "with --amp the step is skipped, without it the job steps it and diverges (NaN "
                        "weights from then on); repeatable")
    s.add_argument("--comm-hook", choices=["allreduce", "fp16_compress", "bf16_compress"], default="allreduce",
                   help="DDP's comm hook: the compression hooks put fp16/bf16 on the wire and the ring "
                        "reduces in that dtype")
    s.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the model's parameters and gradients (bfloat16: the plain allreduce carries bf16)")
    _clip_options(s)
    s.add_argument("--psn-wrap", action="store_true", help="start PSNs just below 2^24")
    s.add_argument("--ipv6", action="store_true", help="RoCEv2 over IPv6 instead of IPv4")
    s.add_argument("--shuffle-rings", action="store_true", help="a different ring order per channel")
    s.add_argument("--write-hosts", action="store_true",
                   help="also write hosts/rank<r>.pcap: each rank's outbound frames (for a test network); "
                        "with --nodes, what each NIC sends, under the rank that owns it")
    s.add_argument("--nodes", type=_ranged(int, 0, 64), default=0,
                   help="multi-GPU nodes: ranks = NODES x --gpus-per-node, each node's ranks consecutive, one "
                        "NCCL-style ring per channel through NVLink inside a node; only hops between nodes "
                        "reach the mirrors (default 0: every rank a host of its own, --ranks of them)")
    s.add_argument("--gpus-per-node", type=_ranged(int, 1, 64), default=1,
                   help="with --nodes: GPUs per node, joined by NVLink (only the hops between nodes are on the wire)")
    s.add_argument("--nics-per-node", type=_ranged(int, 0, 64), default=0,
                   help="with --nodes: NICs per node (default: one per GPU, rails); channel c uses NIC c mod this "
                        "on every node; mirror k is the port of NIC k mod this of node k div this")
    s.add_argument("--collective", choices=["allreduce", "reduce_scatter", "tree"], default="allreduce",
                   help="what the wire carries: DDP's ring allreduce, or (to check that ckptd refuses them) "
                        "a reduce-scatter with no allgather (FSDP/ZeRO) or NCCL's Tree allreduce of the "
                        "same buckets (double binary tree over the nodes, docs/NCCL.md section 4b)")
    s.add_argument("--other-allreduce", action="append", default=[], metavar="WHEN:COUNT[:DTYPE]",
                   help="another allreduce on the job's communicator (a loss, a metric), in the plan's "
                        "collectives: WHEN is start (once, before iteration 0), before or after (every "
                        "iteration, around the gradient buckets); repeatable")
    s.add_argument("--other-broadcast", action="append", default=[], metavar="WHEN:COUNT[:DTYPE[:ROOT]]",
                   help="a ring broadcast on the job's communicator (from ROOT, default 0), in the plan's "
                        "collectives like --other-allreduce; repeatable")
    s.add_argument("--startup-broadcast", action="store_true",
                   help="DDP's constructor collectives before iteration 0, first of the plan's start "
                        "collectives: the allgather of the parameter count and broadcast of "
                        "their shapes (verify_params_across_processes), then the broadcast of the "
                        "parameters and buffers from rank 0 (_sync_module_states, 250 MiB buckets)")
    s.add_argument("--freeze", action="append", default=[], metavar="PREFIX",
                   help="freeze (requires_grad=False) every parameter whose name starts with PREFIX, e.g. "
                        "blocks.0. or tok: DDP reduces no gradient of theirs (no bucket), the plan lists "
                        "them in its frozen section and its optimizer groups (the optimizer is built over "
                        "model.parameters(), so torch holds and skips them); repeatable. A PREFIX matching "
                        "no parameter, or freezing them all, is refused")
    s.add_argument("--unused", action="append", default=[], metavar="PREFIX",
                   help="DDP with find_unused_parameters=True: the parameters whose name starts with PREFIX "
                        "are left unused by the forward on every rank at iterations 0, 3, 6, ... and on "
                        "rank 0 only at 1, 4, 7, ...; every round ends with DDP's used-map allreduce (int32, "
                        "one element a parameter) and the trainer steps only what some rank used; repeatable")
    s.add_argument("--static-graph", action="store_true",
                   help="DDP with static_graph=True: the first layout is one bucket; iteration 0 allreduces "
                        "DDP's used map (int32, one element a parameter) FIRST, then the bucket; iteration 1 "
                        "the first layout again; the rebuilt layout from iteration 2 on, no map. With "
                        "--unused PREFIX those parameters are unused on every rank at every iteration (the "
                        "graph is static): zeros on the wire, never stepped. Refused with "
                        "--allreduces-per-step > 1")
    s.set_defaults(func=cmd_synth)

    r = sub.add_parser("replay", help="rebuild the model from recorded mirror captures, one "
                       "checkpoint per iteration (exit 3 if any iteration could not be recovered)",
                       description="Rebuild the model from recorded mirror captures, one checkpoint per "
                       "iteration. Exit 3: an iteration could not be recovered; 4: a commit differs from "
                       "--reference; 2: bad input, or a job that is not ring allreduce, refused in one line "
                       "naming the cause and the fix: a plan whose ring.algorithm allows Tree/NVLS/CollNet, "
                       "traffic that is a ring reduce-scatter without allgather (FSDP/ZeRO), NCCL Tree "
                       "allreduce on ring links (its message sequence), RDMA traffic between NICs that are "
                       "ring neighbours in no channel while nothing matches the plan's ring (Tree/CollNet), "
                       "or traffic of another protocol than the plan's (LL/LL128 flag words in the payload, "
                       "or none). With multi-GPU nodes only the hops between nodes are expected on the wire. "
                       "A capture damaged mid-file (cut inside a frame, a broken record header) is read up "
                       "to the damage, with one warning on stderr naming the file and frame (pcapng: block); "
                       "exit 0 if the other mirror streams still recover every iteration, else 3 as above; "
                       "3 too where every capture is damaged and the plan gives no iteration count "
                       "(the iterations after the damage may be lost without a trace).")
    r.add_argument("--plan", type=_path, required=True, help="the job's plan (ckptd.torch.write_plan or ckptd plan)")
    r.add_argument("--init", type=_path, help="initial state (a checkpoint of iteration -1)")
    r.add_argument("--out", type=_path, help="directory for the per-iteration checkpoints")
    r.add_argument("--reference", type=_path, help="trainer checkpoints to compare each commit with")
    r.add_argument("--dump-gradients", type=_path, metavar="DIR",
                   help="write every allreduce's reduced buckets (and coverage) as .npy")
    r.add_argument("--resume", type=_path, metavar="CKPT|DIR|URL",
                   help="after a gap (or when joining), restart the shadow from this checkpoint, or "
                        "from the checkpoint of the iteration needed in this directory (iter_NNNNNN.pt), "
                        "or from a URL: the daemon's (http://host:port) or a persistence tier's "
                        "(persist_url: its newest entry that verifies)")
    r.add_argument("--join", action="store_true",
                   help="the captures start in the middle of the job: place packets by their PSNs "
                        "(NCCL connects every QP at PSN 0; the plan must describe all the traffic "
                        "its QPs carried), and start at the first iteration every flow shows whole")
    r.add_argument("--join-from", type=_ranged(int, 0, 1 << 31), metavar="N",
                   help="with --join (implies it): an iteration the job had already reached when the "
                        "capture began; needed once a QP has carried over 2**24 packets (PSNs wrap)")
    r.add_argument("--reference-path", action="store_true",
                   help="decode and place with the pure-Python reference path instead of the Cython batch "
                        "kernel (the default for RoCE plans: same results, files read in chunks on a thread "
                        "of their own); gloo plans always take the reference path")
    r.add_argument("--fast", action="store_true",
                   help="the batch kernel, which is the default now (accepted so older command lines work)")
    r.add_argument("--agree-window-ms", type=_ranged(float, 0, 60_000), default=AGREE_WINDOW_MS, metavar="MS",
                   help="an iteration commits only after every stream's capture clock has passed this "
                        "much beyond the moment it became complete, so the other mirrors' copies are "
                        f"compared first (default {AGREE_WINDOW_MS:g}; 0 commits at once and compares "
                        "nothing that arrives later)")
    r.add_argument("--trust-icrc", action="store_true",
                   help="skip ICRC checks (the NIC/switch already verified them); fast path only")
    r.add_argument("--names", metavar="A,B,...", help=NAMES_HELP)
    r.add_argument("pcap", nargs="+", type=_path, help=PCAP_HELP)
    r.set_defaults(func=cmd_replay)

    rn = sub.add_parser("run", help="the daemon: capture mirror ports, keep a checkpoint per "
                        "iteration (retention, retried writes), serve /status and /metrics; SIGTERM "
                        "stops, SIGHUP is ignored; exit 3 if an iteration could not be recovered, 4 if "
                        "frames dropped on this host (a ring, the interface) cost one, 5 if the newest committed checkpoint could not be "
                        "written, 6 if every capture failed (see docs/DAEMON.md)",
                        description=RUN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    rn.add_argument("--config", type=_path, required=True, help="YAML or TOML daemon config")
    rn.add_argument("--check", action="store_true",
                    help="do what a start does before its first frame (check the config, plan and init, "
                         "reserve the shadow, open and close every interface's ring, drop privileges, "
                         "probe the checkpoint directory), print one line and exit 0; nothing is captured")
    rn.add_argument("--listen", help="override the config's status address: HOST:PORT, [IPv6]:PORT "
                    "(default 127.0.0.1:9187)")
    rn.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                    help="default: the config's, else warning (quiet)")
    rn.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="per-flow table of RoCEv2 traffic and frame classes "
                       "(exit 2 if a file is missing, empty (0 bytes) or broken: the table shows what was read; "
                       "a capture of no frames, its header alone, is a capture and exits 0)")
    i.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    i.add_argument("--names", metavar="A,B,...", help=NAMES_HELP)
    i.add_argument("pcap", nargs="+", type=_path, help=PCAP_HELP)
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="exit 0 only if two checkpoints are bit-identical")
    v.add_argument("a", type=_path,
                   help="a checkpoint: a file (ckptd's, torch.save, safetensors), a DCP or checkpoint directory, or the daemon's URL")
    v.add_argument("b", type=_path, help="the other checkpoint, in any of those forms")
    v.add_argument("--limit", type=_ranged(int, 0, 1 << 20), default=10, help="differences to list (0: all)")
    v.add_argument("--plan", type=_path, help="the plan: names the parameters of a trainer's file that "
                   "does not say which model entries they are")
    v.add_argument("--parameters-only", action="store_true",
                   help="compare parameters and optimizer state only, not module buffers "
                   "(ckptd's checkpoints carry none: they are not on the wire)")
    v.epilog = ("A and B may each be anything ckptd.restore reads: a ckptd checkpoint, a trainer's "
                "torch.save of {model, optimizer, step|iteration}, a torch.distributed.checkpoint "
                "directory, a safetensors file, a directory of checkpoints (its newest that loads "
                "whole), a persistence tier's fsspec URL (its newest entry that verifies) or the "
                "daemon's http(s) URL (its /checkpoint; the token from $CKPTD_TOKEN). See "
                "docs/RECOVERY.md for the iteration numbering.")
    v.set_defaults(func=cmd_verify)

    ex = sub.add_parser("export", help="write a checkpoint in a standard format: torch "
                        "(torch.save of {model, optimizer, step, lr_scheduler}), dcp "
                        "(torch.distributed.checkpoint directory) or safetensors (weights)")
    ex.add_argument("checkpoint", type=_path, help="any checkpoint ckptd reads")
    ex.add_argument("--format", choices=["torch", "dcp", "safetensors"], required=True,
                    help="torch (torch.save of the trainer's dict), dcp (a torch.distributed.checkpoint directory) or safetensors (weights only)")
    ex.add_argument("--out", type=_path, required=True, help="file (torch, safetensors) or directory (dcp)")
    ex.add_argument("--plan", type=_path, help="the plan: puts torch's own optimizer param_groups (every "
                    "hyperparameter) in the file, so optimizer.load_state_dict takes it as is")
    ex.set_defaults(func=cmd_export)

    from ckptd.tools import mirror_config, risk
    mirror_config.add_subparser(sub)
    risk.add_subparser(sub)

    pl = sub.add_parser("plan", help="write a plan from a torch model and DDP/NCCL settings",
                        description="Write a plan (docs/PLAN.md) from a torch model and the job's NCCL "
                        "settings: either given (--ranks, --addr, --channels, --protocol, --nccl-version: "
                        "one GPU per host, identity rings) or read from the job's NCCL_DEBUG=INFO output "
                        "(--nccl-log, --nic-addrs): version, every channel's ring, each rank's host (node), "
                        "which hops cross the network and on which NIC, NCCL_PROTO and NCCL_ALGO. A log whose "
                        "settings let allreduce run as Tree/NVLS/CollNet, or with more than one protocol, is "
                        "refused with the setting that fixes it (NCCL_ALGO=Ring, NCCL_PROTO=Simple).")
    pl.add_argument("--model", required=True, help="module:function returning the nn.Module")
    pl.add_argument("--sample", help="module:function returning one input batch (for the "
                    "gradient-ready order DDP rebuilds buckets in)")
    pl.add_argument("--nccl-log", action="append", type=_path, metavar="FILE",
                    help="the job's NCCL_DEBUG=INFO output (repeat for per-rank files): fills the ring, ranks, "
                         "nodes and NICs; rank 0's 'Channel NN/NN :' lines and every network hop's "
                         "'[send]/[receive] via NET' lines must be in it")
    pl.add_argument("--nic-addrs", type=_path, metavar="FILE",
                    help="with --nccl-log: JSON or YAML map host -> its NICs' RoCE addresses in NCCL device "
                         "order (NET/IB/k is the k-th; the order of the log's 'NET/IB : Using [0]... [1]...')")
    pl.add_argument("--ranks", type=_ranged(int, 2, 1 << 16), help="data-parallel world size (without --nccl-log)")
    pl.add_argument("--addr", action="append", type=_ip_address,
                    help="NIC address (IPv4 or IPv6) of rank 0, 1, ... (repeat)")
    pl.add_argument("--channels", type=_ranged(int, 1, 64),
                    help="rings (default 2; without --nccl-log, which gives them)")
    pl.add_argument("--protocol", choices=["simple", "ll", "ll128"],
                    help="NCCL protocol (default simple; without --nccl-log, which gives it)")
    pl.add_argument("--nccl-version", help="the job's NCCL, MAJOR.MINOR (2.14..2.32; default 2.19; without "
                    "--nccl-log, which gives it)")
    pl.add_argument("--mtu", type=int, default=4096, choices=[256, 512, 1024, 2048, 4096],
                    help="RoCE path MTU in bytes (default 4096)")
    pl.add_argument("--bucket-cap-mb", type=_ranged(float, 1e-6, 1 << 20), default=25.0,
                    help="DDP's bucket_cap_mb (default 25)")
    pl.add_argument("--transport", choices=["nccl", "gloo"], default="nccl",
                    help="the process group's backend: nccl (RoCEv2) or gloo (TCP; without "
                    "--sample the rebuilt layout is learned from DDP's broadcast)")
    pl.add_argument("--optimizer", choices=sorted(OPTIMIZER_CLASSES), default="adamw",
                    help="the trainer's torch.optim class (default adamw)")
    pl.add_argument("--momentum", type=_ranged(float, 0, 1), default=None, help="sgd, rmsprop (default 0)")
    pl.add_argument("--implementation", choices=["for-loop", "foreach", "fused"], default="foreach",
                    help="the optimizer's implementation: for-loop, foreach (default) or fused (torch has a "
                         "fused step for sgd, adam, adamw and adagrad; refused for the others)")
    # each checked here, so a bad one is named by its option (the plan's check named optimizer.lr)
    pl.add_argument("--lr", type=_ranged(float, 0, 1e30), default=1e-3, help="the optimizer's lr (default 0.001)")
    pl.add_argument("--beta1", type=_ranged(float, 0, 1), default=None, help="adam, adamw (default 0.9)")
    pl.add_argument("--beta2", type=_ranged(float, 0, 1), default=None, help="adam, adamw (default 0.999)")
    pl.add_argument("--eps", type=_ranged(float, 0, 1e30), default=None, help="adam, adamw (default 1e-8)")
    pl.add_argument("--weight-decay", type=_ranged(float, 0, 1e30), default=0.01,
                    help="the optimizer's weight_decay (default 0.01)")
    _clip_options(pl)
    pl.add_argument("--other-allreduce", action="append", default=[], metavar="WHEN:COUNT[:DTYPE]",
                    help="the job's own allreduce on DDP's process group (a loss, a metric), listed in the "
                         "plan's collectives: WHEN is start (once, before iteration 0), before or after (every "
                         "iteration, around the gradient buckets); repeatable, in the job's order (gloo counts "
                         "them with the buckets; NCCL's ring carries them)")
    pl.add_argument("--start-iteration", type=_ranged(int, 0, 1 << 31), metavar="N",
                    help="the iteration the job (re)starts at: replay and the daemon then refuse an "
                         "init that is not the state of iteration N-1")
    pl.add_argument("--out", type=_path, required=True, help="where to write the plan (JSON)")
    pl.set_defaults(func=cmd_plan)
    for choice in sub._choices_actions:  # `ckptd CMD --help` opens with what CMD does, as `ckptd --help` says
        parser = sub.choices[choice.dest]
        parser.description = parser.description or choice.help
    return p


def _printable(text: str) -> str:
    """`text` with every character a terminal would act on written as its escape (\\x1b):
    an error line quotes what came from outside (an HTTP server's reason and body, a
    file or key name), and ESC, BEL, backspace or NUL in it set the terminal's title,
    cleared the screen or hid the real error."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


class _CommandLog(logging.Handler):
    """ckptd's log records in a command other than `run` (whose log is JSON lines): one
    `warning: ...` line each, as the commands print their own warnings, with the record's
    fields after it. Without a handler Python printed the bare message (a pcapng
    interface's link type, with no `warning:`) and dropped the fields (the error of a
    checkpoint not written). sys.stderr is looked up at each record, not kept."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record):
        fields = getattr(record, "fields", None) or {}
        text = record.getMessage() + (" (" + ", ".join(f"{k}: {v}" for k, v in fields.items()) + ")" if fields else "")
        print(f"{record.levelname.lower()}: {_printable(text)}", file=sys.stderr)


def _file_names_as_bytes():
    """Print a file name that is not UTF-8 (Linux names are bytes; Python holds the bytes
    it cannot decode as lone surrogates) as the bytes it is, as ls does. Python does so
    for stdout in the C locale only: under en_US.UTF-8, say, printing a stream's name
    or an error naming the file was a UnicodeEncodeError traceback."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and getattr(stream, "errors", None) == "strict":
            stream.reconfigure(errors="surrogateescape")


def main(argv=None) -> int:
    """Every error ckptd raises on purpose (CkptdError) and every OS error on a path the
    user gave becomes one line on stderr and exit 2; CKPTD_DEBUG=1 shows the traceback."""
    import os
    import signal
    import threading

    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["run"] and \
            threading.current_thread() is threading.main_thread():
        # a daemon ignores SIGHUP (docs/DAEMON.md) from its first moment, not only once
        # Daemon.run logs it: the imports below take a second or two. A SIGTERM before
        # Daemon.run takes it (a stop) ends the start as Ctrl-C does, with a line: it
        # killed the process without a word, exit 143
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if argv is None:  # the process's own command line: not a caller's process (tests)
            _STARTING_PID[:] = [os.getpid()]
            signal.signal(signal.SIGTERM, _interrupted)
    _file_names_as_bytes()
    if (sys.argv[1:] if argv is None else list(argv))[:1] != ["run"]:  # (the daemon sets up its own)
        logging.getLogger("ckptd").handlers[:] = [_CommandLog()]
    try:
        args = build_parser().parse_args(argv)  # imports torch: Ctrl-C here is no traceback either
        return args.func(args)
    except (CkptdError, OSError) as e:
        if os.environ.get("CKPTD_DEBUG"):
            raise
        if isinstance(e, BrokenPipeError):  # `ckptd inspect x | head`
            _quiet_stdout()
            return 0
        print("error: " + _printable(_as_given(one_line(e))), file=sys.stderr)  # one line, always
        return 2
    except ImportError as e:
        if os.environ.get("CKPTD_DEBUG") or not (e.name or "").startswith("cython_ext"):
            raise
        # a source tree never built (a git clone run with PYTHONPATH): the kernels are
        # compiled modules that `pip install .` builds
        print(f"error: ckptd's compiled kernels are not built (cannot import {e.name}): `pip install .` builds "
              "them, or `python3 setup.py build_ext --inplace` in a source tree; `ckptd replay --reference-path` "
              "replays without them", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # every file ckptd writes is written whole or not at all (atomic_write): say so,
        # rather than end without a word
        print("ckptd: interrupted; the files written before are whole, none is left half-written",
              file=sys.stderr)
        return 130


_STARTING_PID: list[int] = []  # the process whose start a SIGTERM interrupts


def _interrupted(signum, _frame):
    """SIGTERM during the daemon's start: Ctrl-C's way out, with its line. A process forked
    from this one meanwhile (a capture worker, a helper) gets the default action: it must
    end, not run this process's exit path."""
    import os
    import signal
    if os.getpid() not in _STARTING_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt


def _quiet_stdout():
    """After a closed pipe: point stdout at /dev/null so the interpreter's final flush
    does not raise again."""
    import os
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
