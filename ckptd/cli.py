"""ckptd command line: demo, synth, replay, inspect, verify, export, plan."""
from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

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
def cmd_synth(a) -> int:
    from ckptd.testing.synth import SynthOptions, synthesize
    opts = SynthOptions(
        out=a.out, ranks=a.ranks, channels=a.channels, protocol=a.protocol, mtu=a.mtu,
        mirrors=a.mirrors, iterations=a.iterations, seed=a.seed, model=a.model,
        nccl_version=a.nccl_version, qps=a.qps, bucket_cap_kb=a.bucket_cap_kb,
        optimizer=a.optimizer, loss=a.loss, duplicate=a.duplicate, reorder=a.reorder,
        corrupt=a.corrupt, retransmit=a.retransmit, psn_wrap=a.psn_wrap, ipv6=a.ipv6,
        shuffle_rings=a.shuffle_rings, mirror_direction=a.mirror_direction,
        max_grad_norm=a.max_grad_norm, write_hosts=a.write_hosts)
    t0 = time.time()
    plan = synthesize(opts, progress=_progress("synth"))
    nparams = sum(p.numel for p in plan.parameters)
    print(f"synthesized {a.iterations} iterations of a {nparams:,}-parameter model over "
          f"{a.ranks} ranks ({a.protocol}, {a.channels} channel(s), MTU {a.mtu}) in "
          f"{time.time() - t0:.1f}s -> {a.out}")
    for name, st in opts.stats.items():
        print(f"  {name}: {st['frames']} frames, lost {st['lost']}, corrupted {st['corrupted']}, "
              f"duplicated {st['duplicated']}, reordered {st['reordered']}")
    return 0


def cmd_replay(a) -> int:
    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.pipeline import ReplayOptions, replay
    from ckptd.core.plan import load_plan
    plan = load_plan(a.plan)
    start = load_checkpoint(a.init, [p.name for p in plan.parameters]) if a.init else None
    if start is None and plan.optimizer is not None and a.out:
        print("error: --init is needed to rebuild the model (the plan has an optimizer)", file=sys.stderr)
        return 2
    names = [Path(p).stem for p in a.pcap]
    opts = ReplayOptions(out=a.out, reference=a.reference, dump_gradients=a.dump_gradients,
                         resume=a.resume, join=a.join or a.join_from is not None, join_from=a.join_from)
    t0 = time.time()
    if a.fast and plan.transport == "roce":
        from ckptd.fast.pipeline import fast_replay
        pipe = fast_replay(plan, a.pcap, start, opts, on_iteration=print_iteration(names),
                           trust_icrc=a.trust_icrc)
    else:
        pipe = replay(plan, a.pcap, start, opts, on_iteration=print_iteration(names),
                      progress=_byte_progress("replay"))
    reps = pipe.reports
    bad = [r for r in reps if not r.ok and r.status != "complete"]
    for k, (name, cls) in enumerate(zip(names, pipe.classes)):
        print(f"stream {name}: " + ", ".join(f"{key}={v}" for key, v in sorted(cls.items())))
    c = pipe.extract.counters
    print("extraction: " + ", ".join(f"{k}={v}" for k, v in sorted(c.items())) + f", late={pipe.late}"
          + f", optimizer_backpressure={pipe.apply_waits}"
          + "".join(f", {k}={v}" for k, v in getattr(pipe, "read_waits", {}).items()))
    for e in pipe.extract.examples[:5]:
        print(f"  rejected: {e}")
    for e in pipe.extract.diagnostics():
        print(f"  {e}")
    for e in pipe.errors:
        print(f"  capture error: {e}")
    if pipe.joined is not None:
        print(f"joined at iteration {pipe.joined} (the first every flow was seen from its start; "
              f"{pipe.before_join} packets before it dropped)")
    committed = sum(r.ok for r in reps)
    print(f"{len(reps)} iterations, {committed} committed, {len(bad)} not recovered"
          + (f" ({', '.join(str(r.iteration) for r in bad[:20])})" if bad else "")
          + f"; {time.time() - t0:.1f}s")
    if any(r.exact is False for r in reps):
        return 4
    return EXIT_UNRECOVERED if bad else 0


def cmd_inspect(a) -> int:
    from ckptd.tools.inspect import format_inspect, inspect_captures
    res = inspect_captures(a.pcap)
    if a.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        print(format_inspect(res))
    return 0


def _plan_names(plan_path) -> list[str] | None:
    if not plan_path:
        return None
    from ckptd.core.plan import load_plan
    return [p.name for p in load_plan(plan_path).parameters]


def cmd_verify(a) -> int:
    from ckptd.core.checkpoint import diff_checkpoints, load_checkpoint
    names = _plan_names(a.plan)
    first, second = load_checkpoint(a.a, names), load_checkpoint(a.b, names)
    if a.parameters_only:  # e.g. ckptd's file (no buffers) against the trainer's
        keep = set(names or []) or (set(first["model"]) & set(second["model"]))
        for doc in (first, second):
            doc["model"] = {n: t for n, t in doc["model"].items() if n in keep}
    diffs = diff_checkpoints(first, second, limit=a.limit)
    if not diffs:
        print(f"identical: {a.a} == {a.b}")
        return 0
    print(f"differ: {a.a} != {a.b}")
    for d in diffs:
        print(f"  {d}")
    return 1


def cmd_export(a) -> int:
    from ckptd.core.checkpoint import load_checkpoint
    from ckptd.core.formats import export_checkpoint
    from ckptd.core.plan import load_plan
    plan = load_plan(a.plan) if a.plan else None
    ckpt = load_checkpoint(a.checkpoint, [p.name for p in plan.parameters] if plan else None)
    out = export_checkpoint(ckpt, a.out, a.format, plan)
    print(f"wrote {out} ({a.format}, iteration {ckpt['iteration']}, step {int(ckpt['iteration']) + 1})")
    return 0


def cmd_demo(a) -> int:
    """synth + replay of the built-in default scenario, per-iteration bit-exactness."""
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


def cmd_run(a) -> int:
    from ckptd.live.daemon import ConfigError, Daemon, load_config, setup_logging
    try:
        cfg = load_config(a.config)
        if a.listen:
            cfg.listen = a.listen
        setup_logging(a.log_level or cfg.log_level)
        return Daemon(cfg).run()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_plan(a) -> int:

    from ckptd.core.plan import BucketLayout, Mirror, Optimizer, Parameter, Plan
    from ckptd.core.schedule import RingConfig
    from ckptd.testing.synth.ddp import first_buckets, grad_ready_order, rebuilt_buckets
    mod, _, fn = a.model.partition(":")
    model = getattr(importlib.import_module(mod), fn)()
    named = list(model.named_parameters())
    params = [p for _, p in named if p.requires_grad]
    names = [n for n, p in named if p.requires_grad]
    cap = int(a.bucket_cap_mb * 1024 * 1024)
    first = first_buckets(params, cap)
    if a.sample:
        smod, _, sfn = a.sample.partition(":")
        batch = getattr(importlib.import_module(smod), sfn)()
        if not hasattr(model, "loss"):
            model.loss = lambda b: model(b).float().sum()
        order = grad_ready_order(model, batch)
    else:
        order = list(reversed(range(len(params))))  # a sequential model's backward order
    rebuilt = rebuilt_buckets(params, order, cap)
    major, minor = (int(x) for x in a.nccl_version.split("."))
    addrs = a.addr or []
    if len(addrs) != a.ranks:
        print(f"error: give --addr once per rank ({a.ranks} ranks, {len(addrs)} addresses)", file=sys.stderr)
        return 2
    opt = Optimizer(kind=a.optimizer, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps,
                    weight_decay=a.weight_decay, implementation=a.implementation)
    plan = Plan(tuple(Parameter(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in zip(names, params)),
                tuple(BucketLayout(tuple(names[i] for i in b)) for b in first),
                tuple(BucketLayout(tuple(names[i] for i in b)) for b in rebuilt),
                RingConfig(a.ranks, tuple(tuple(range(a.ranks)) for _ in range(a.channels)),
                           a.protocol, (major, minor), mtu=a.mtu),
                opt, tuple(addrs), tuple(Mirror(f"mirror{r}", r, "both") for r in range(min(3, a.ranks))))
    plan.save(a.out)
    print(f"wrote {a.out}: {len(params)} parameters, {len(first)} first / {len(rebuilt)} rebuilt buckets")
    return 0


# -- parser --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptd", description="Per-iteration checkpoints rebuilt from mirrored RoCEv2 "
        "allreduce traffic, at no cost to the training job.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="synthesize the default scenario and replay it, "
                       "printing per iteration whether the checkpoint is bit-exact")
    d.add_argument("--out", help="keep the scenario here (default: a temporary directory)")
    d.add_argument("--iterations", type=int, default=6)
    d.add_argument("--protocol", choices=["simple", "ll"], default="simple")
    d.add_argument("--loss", type=float, default=1e-3, help="packet loss on every mirror link")
    d.add_argument("--model", default="default", help="synthetic model size: tiny, small, default")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("synth", help="train a small LM over N ranks and write the mirrored "
                       "RoCEv2 traffic, the plan, the initial state and reference checkpoints")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--ranks", type=int, default=4)
    s.add_argument("--channels", type=int, default=2)
    s.add_argument("--protocol", choices=["simple", "ll"], default="simple")
    s.add_argument("--mtu", type=int, default=4096, choices=[256, 512, 1024, 2048, 4096])
    s.add_argument("--mirrors", type=int, default=2, help="mirror streams (switch ports of ranks 0..K-1)")
    s.add_argument("--mirror-direction", choices=["tx", "rx", "both"], default="both")
    s.add_argument("--loss", type=float, default=0.0, help="loss probability per frame per mirror link")
    s.add_argument("--duplicate", type=float, default=0.0)
    s.add_argument("--reorder", type=float, default=0.0)
    s.add_argument("--corrupt", type=float, default=0.0, help="bit flips (caught by the ICRC)")
    s.add_argument("--retransmit", type=float, default=0.0, help="go-back-N resends per message, on the wire")
    s.add_argument("--iterations", type=int, default=5)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--model", default="small", help="tiny (~42K params), small (~170K), default (~2.6M)")
    s.add_argument("--nccl-version", default="2.19", help="2.14..2.19 (interleaved) or 2.20, 2.21 (contiguous)")
    s.add_argument("--qps", type=int, default=1, help="NCCL_IB_QPS_PER_CONNECTION")
    s.add_argument("--bucket-cap-kb", type=int, default=64, help="DDP bucket cap (small, for several buckets)")
    s.add_argument("--optimizer", choices=["for-loop", "foreach", "fused"], default="foreach")
    s.add_argument("--max-grad-norm", type=float, default=None)
    s.add_argument("--psn-wrap", action="store_true", help="start PSNs just below 2^24")
    s.add_argument("--ipv6", action="store_true")
    s.add_argument("--shuffle-rings", action="store_true", help="a different ring order per channel")
    s.add_argument("--write-hosts", action="store_true",
                   help="also write hosts/rank<r>.pcap: each rank's outbound frames (for a test network)")
    s.set_defaults(func=cmd_synth)

    r = sub.add_parser("replay", help="rebuild the model from recorded mirror captures, one "
                       "checkpoint per iteration (exit 3 if any iteration could not be recovered)")
    r.add_argument("--plan", required=True)
    r.add_argument("--init", help="initial state (a checkpoint of iteration -1)")
    r.add_argument("--out", help="directory for the per-iteration checkpoints")
    r.add_argument("--reference", help="trainer checkpoints to compare each commit with")
    r.add_argument("--dump-gradients", metavar="DIR",
                   help="write every allreduce's reduced buckets (and coverage) as .npy")
    r.add_argument("--resume", metavar="CKPT|DIR",
                   help="after a gap (or when joining), restart the shadow from this checkpoint, or "
                        "from the checkpoint of the iteration needed in this directory (iter_NNNNNN.pt)")
    r.add_argument("--join", action="store_true",
                   help="the captures start in the middle of the job: place packets by their PSNs "
                        "(NCCL connects every QP at PSN 0; the plan must describe all the traffic "
                        "its QPs carried), and start at the first iteration every flow shows whole")
    r.add_argument("--join-from", type=int, metavar="N",
                   help="with --join (implies it): an iteration the job had already reached when the "
                        "capture began; needed once a QP has carried over 2**24 packets (PSNs wrap)")
    r.add_argument("--fast", action="store_true",
                   help="use the Cython batch kernel (same results; the files are read in chunks on a thread of their own)")
    r.add_argument("--trust-icrc", action="store_true",
                   help="with --fast: skip ICRC checks (the NIC/switch already verified them)")
    r.add_argument("pcap", nargs="+", help="one capture (pcap or pcapng) per mirror stream")
    r.set_defaults(func=cmd_replay)

    rn = sub.add_parser("run", help="the daemon: capture mirror ports, keep a checkpoint per "
                        "iteration, serve /status and /metrics (see docs/DAEMON.md)")
    rn.add_argument("--config", required=True, help="YAML or TOML daemon config")
    rn.add_argument("--listen", help="override the config's status address (default 127.0.0.1:9187)")
    rn.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                    help="default: the config's, else warning (quiet)")
    rn.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="per-flow table of RoCEv2 traffic and frame classes")
    i.add_argument("--json", action="store_true")
    i.add_argument("pcap", nargs="+")
    i.set_defaults(func=cmd_inspect)

    v = sub.add_parser("verify", help="exit 0 only if two checkpoints are bit-identical")
    v.add_argument("a")
    v.add_argument("b")
    v.add_argument("--limit", type=int, default=10, help="differences to list")
    v.add_argument("--plan", help="the plan: names the parameters of a trainer's file that "
                   "does not say which model entries they are")
    v.add_argument("--parameters-only", action="store_true",
                   help="compare parameters and optimizer state only, not module buffers "
                   "(ckptd's checkpoints carry none: they are not on the wire)")
    v.epilog = ("A and B may each be a ckptd checkpoint, a trainer's torch.save of "
                "{model, optimizer, step|iteration}, a torch.distributed.checkpoint directory "
                "or a safetensors file (see docs/RECOVERY.md for the iteration numbering).")
    v.set_defaults(func=cmd_verify)

    ex = sub.add_parser("export", help="write a checkpoint in a standard format: torch "
                        "(torch.save of {model, optimizer, step, lr_scheduler}), dcp "
                        "(torch.distributed.checkpoint directory) or safetensors (weights)")
    ex.add_argument("checkpoint", help="any checkpoint ckptd reads")
    ex.add_argument("--format", choices=["torch", "dcp", "safetensors"], required=True)
    ex.add_argument("--out", required=True, help="file (torch, safetensors) or directory (dcp)")
    ex.add_argument("--plan", help="the plan: puts torch's own optimizer param_groups (every "
                    "hyperparameter) in the file, so optimizer.load_state_dict takes it as is")
    ex.set_defaults(func=cmd_export)

    from ckptd.tools import mirror_config, risk
    mirror_config.add_subparser(sub)
    risk.add_subparser(sub)

    pl = sub.add_parser("plan", help="write a plan from a torch model and DDP/NCCL settings")
    pl.add_argument("--model", required=True, help="module:function returning the nn.Module")
    pl.add_argument("--sample", help="module:function returning one input batch (for the "
                    "gradient-ready order DDP rebuilds buckets in)")
    pl.add_argument("--ranks", type=int, required=True)
    pl.add_argument("--addr", action="append", help="NIC address of rank 0, 1, ... (repeat)")
    pl.add_argument("--channels", type=int, default=2)
    pl.add_argument("--protocol", choices=["simple", "ll"], default="simple")
    pl.add_argument("--nccl-version", default="2.19")
    pl.add_argument("--mtu", type=int, default=4096)
    pl.add_argument("--bucket-cap-mb", type=float, default=25.0)
    pl.add_argument("--optimizer", choices=["adam", "adamw"], default="adamw")
    pl.add_argument("--implementation", choices=["for-loop", "foreach", "fused"], default="foreach")
    pl.add_argument("--lr", type=float, default=1e-3)
    pl.add_argument("--beta1", type=float, default=0.9)
    pl.add_argument("--beta2", type=float, default=0.999)
    pl.add_argument("--eps", type=float, default=1e-8)
    pl.add_argument("--weight-decay", type=float, default=0.01)
    pl.add_argument("--out", required=True)
    pl.set_defaults(func=cmd_plan)
    return p


def main(argv=None) -> int:
    """Every error ckptd raises on purpose (CkptdError) and every OS error on a path the
    user gave becomes one line on stderr and exit 2; CKPTD_DEBUG=1 shows the traceback."""
    import os

    from ckptd.errors import CkptdError
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CkptdError, OSError) as e:
        if os.environ.get("CKPTD_DEBUG"):
            raise
        if isinstance(e, BrokenPipeError):  # `ckptd inspect x | head`
            _quiet_stdout()
            return 0
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _quiet_stdout():
    """After a closed pipe: point stdout at /dev/null so the interpreter's final flush
    does not raise again."""
    import os
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
