"""Tiers: restore time from the daemon's memory (HTTP) against local disk (torch.save)
and DCP, and commit lag / disk bytes per iteration with the persistence tier on and off.

    python -m benchmarks.tiers [--params 100] [--iterations 12]
    python -m benchmarks.tiers --params 25 --restore-from memory://ckptd-bench [--restore-from s3://...]

Restore: a model of --params million float32 parameters (square Linear layers) and its
AdamW state (two moments) after one step, i.e. 3 x 4 bytes per parameter, restored with
`ckptd.restore` into a fresh model and optimizer from (a) `ckptd.live.serve.HttpServer`
serving the memory tier on 127.0.0.1: the raw layout read in place (first request: the
daemon's digests included; second: cached), then the torch.save body as restore read it
before (first request: the encoding included; second: the cached encoding), (b) a torch.save file on local disk (page cache warm: the file was just
written), (c) a DCP directory. GB/s is the state's bytes over the wall time of restore.

Commit lag: the daemon (reference pipeline, from files) on a synthesized job
(--model), persist_sync (every commit written in the commit path, the old default) against
the persistence tier (every 10th, the new default, and every one): the time from an
iteration's last packet to its report (commit_lag + the synchronous write), and the
checkpoint bytes written to disk per iteration.

--restore-from URL (repeatable): only the persisted tiers, side by side in one run: the
same state persisted by `ckptd.live.persist.PersistTier` to a local directory and to
each URL (persist_url), then `ckptd.restore` from each: the plain directory (the
manifest's newest file, loaded), the directory as a file:// URL and each URL (the newest
entry that verifies: file SHA-256 and every tensor's digest, then loaded).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import ckptd
from benchmarks.machine import machine


def make_model(million: float, seed: int = 0):
    width = 2048
    layers = max(1, round(million * 1e6 / (width * width + width)))
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, opt


def trained(million: float):
    model, opt = make_model(million)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def torch_save_http_restore(model, opt, url: str):
    """ckptd.restore from the daemon as it was before the raw layout: the torch.save body
    into one buffer, torch.load, then copied into the model and the optimizer."""
    from ckptd.recovery import _load_model, _load_optimizer, fetch
    ckpt, _ = fetch(url, [n for n, _ in model.named_parameters()], None, 600)
    _load_model(model, ckpt, url)
    _load_optimizer(model, opt, ckpt, url)


CHILD = """
import sys, time, ckptd
from benchmarks.tiers import make_model, torch_save_http_restore
million, how, source = float(sys.argv[1]), sys.argv[2], sys.argv[3]
model, opt = make_model(million, seed=1)
t0 = time.perf_counter()
(ckptd.restore if how == "restore" else torch_save_http_restore)(model, opt, source)
print(time.perf_counter() - t0, float(next(model.parameters()).double().sum()))
"""


def timed_restore(million: float, how: str, source: str, first: torch.Tensor) -> float:
    """Seconds of one restore into a fresh model and optimizer in a new process, as a
    restarted trainer does it: in one process the allocator hands later restores memory
    that earlier ones already faulted in, and the order of the sources sets the figures."""
    got = subprocess.run([sys.executable, "-c", CHILD, str(million), how, source], check=True,
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    seconds, checksum = map(float, got.split())
    assert checksum == float(first.double().sum()), (how, source)
    return seconds


def restore_times(million: float, torch_save_http: bool = True) -> dict:
    """`torch_save_http=False`: without the old HTTP path, which holds the state ~5 times
    at once (too much for 330 M parameters beside other work in 24 GB)."""
    from ckptd.core.formats import TrainerHyper, torch_doc
    from ckptd.live.memory_tier import MemoryTier
    from ckptd.live.serve import HttpServer
    from ckptd.live.status import checkpoint_routes
    from ckptd.testing.synth import trainer_checkpoint

    model, opt = trained(million)
    names = [n for n, _ in model.named_parameters()]
    m, o = trainer_checkpoint(model, opt, 1e-3)
    nparams = sum(p.numel() for p in model.parameters())
    state_bytes = 3 * 4 * nparams
    out = {"parameters": nparams, "state_bytes": state_bytes}
    tier = MemoryTier()
    t0 = time.perf_counter()
    held = tier.commit(0, m, o)
    out["memory_copy_s"] = time.perf_counter() - t0
    hyper = TrainerHyper(opt.state_dict()["param_groups"], None)
    first = m[names[0]].clone()
    # from here on the tier's copy is the only one: at 330 M parameters every copy of the
    # state is 4 GB, and the HTTP encoding and the restored model need room beside it
    del model, opt, m, o
    srv = HttpServer(checkpoint_routes(tier, names, lambda held: hyper, None), "127.0.0.1", 0).start()
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-tiers-"))
    try:
        url = f"http://127.0.0.1:{srv.address[1]}"
        # raw layout read in place (ckptd.restore), then the torch.save body (the old path)
        ways = [("http_first", "restore"), ("http_cached", "restore")]
        if torch_save_http:
            ways += [("http_torch_save_first", "torch_save_http"), ("http_torch_save_cached", "torch_save_http")]
        for label, how in ways:
            out[f"{label}_s"] = timed_restore(million, how, url, first)
        held._encoded = None  # the cached HTTP encoding: 4 GB at 330 M
        held._digests = None
        t0 = time.perf_counter()
        held.digests()  # BLAKE2b over the state: the daemon's first request, the client's check
        out["blake2b_digests_s"] = time.perf_counter() - t0
        srv.stop()
        doc = torch_doc({"iteration": 0, "model": held.model, "optimizer": held.optimizer}, names, hyper)
        torch.save(doc, tmp / "ckpt.pt")
        out["torch_save_file_s"] = timed_restore(million, "restore", str(tmp / "ckpt.pt"), first)
        (tmp / "ckpt.pt").unlink()
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(doc, checkpoint_id=str(tmp / "dcp"))
        out["dcp_s"] = timed_restore(million, "restore", str(tmp / "dcp"), first)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for k in ("http_first", "http_cached", "http_torch_save_first", "http_torch_save_cached",
              "torch_save_file", "dcp"):
        if f"{k}_s" in out:
            out[f"{k}_GBps"] = state_bytes / out[f"{k}_s"] / 1e9
    return out


def persisted_restore_times(million: float, urls: list[str]) -> dict:
    from ckptd.core.store import redact
    from ckptd.live.memory_tier import HeldState
    from ckptd.core.manifest import read_manifest
    from ckptd.live.persist import PersistTier
    from ckptd.testing.synth import trainer_checkpoint

    model, opt = trained(million)
    names = [n for n, _ in model.named_parameters()]
    m, o = trainer_checkpoint(model, opt, 1e-3)
    nparams = sum(p.numel() for p in model.parameters())
    state_bytes = 3 * 4 * nparams
    del model, opt
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-tiers-persist-"))
    out = {"parameters": nparams, "state_bytes": state_bytes, "sources": {}}
    try:
        targets = [("local dir", str(tmp / "dir"), str(tmp / "dir")),
                   ("local dir as file:// URL (verified)", str(tmp / "dir"), f"file://{tmp / 'dir'}")]
        targets += [(f"{redact(u)} (verified)", u, u) for u in urls]
        written = {}
        for label, target, source in targets:
            if target not in written:
                tier = PersistTier(target, every=1, interval_s=None, keep_last=None, keep_every=None)
                tier.offer(HeldState(0, m, o, time.time(), 0.0))
                tier.close()
                entry = read_manifest(target)["checkpoints"][-1]
                written[target] = entry["write_s"]
            back, bopt = make_model(million, seed=1)
            t0 = time.perf_counter()
            r = ckptd.restore(back, bopt, source)
            sec = time.perf_counter() - t0
            assert r.iteration == 0 and torch.equal(next(back.parameters()), m[names[0]])
            del back, bopt
            out["sources"][label] = {"persist_write_s": round(written[target], 3), "restore_s": round(sec, 3),
                                     "restore_GBps": round(state_bytes / sec / 1e9, 3)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def commit_lag(model: str, iterations: int) -> dict:
    from ckptd.live.daemon import Daemon, load_config
    from ckptd.pipeline import file_source
    from ckptd.testing.synth import SynthOptions, synthesize

    job = Path(tempfile.mkdtemp(prefix="ckptd-tiers-job-"))
    try:
        synthesize(SynthOptions(out=str(job), model=model, ranks=2, channels=1, protocol="simple",
                                mtu=4096, iterations=iterations, mirrors=1))
        frames = list(file_source(sorted(str(p) for p in (job / "mirrors").glob("*.pcap")), []))
        out = {}
        for label, extra in (("sync_every_commit", "persist_sync: true\n"),
                             ("async_every_10", ""), ("async_every_1", "persist_every: 1\n")):
            ck = job / f"ck-{label}"
            cfg = job / f"{label}.yaml"
            cfg.write_text(f"plan: {job / 'plan.json'}\ninit: {job / 'init.pt'}\nout: {ck}\n"
                           f"listen: 127.0.0.1:0\nkeep_last: 1000\n{extra}"
                           "interfaces:\n  - {name: mirror0, ifname: m0}\n")
            d = Daemon(load_config(cfg))
            d.run(source=iter(frames), install_signals=False)
            reps = [r for r in d.pipe.reports if r.status == "committed"]
            lag = [r.commit_lag + (r.write_seconds or 0.0) for r in reps]
            if d.persist is not None:
                written = d.persist.bytes_written
            else:
                written = sum(p.stat().st_size for p in ck.glob("iter_*.pt"))
            out[label] = {"iterations": len(reps), "lag_median_s": statistics.median(lag),
                          "lag_max_s": max(lag), "disk_bytes_per_iteration": written / len(reps),
                          "files": len(list(ck.glob("iter_*.pt")))}
        return out
    finally:
        shutil.rmtree(job, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100, help="million parameters (restore)")
    ap.add_argument("--model", default="default", help="synth model size (commit lag)")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--restore-from", action="append", default=[], metavar="URL",
                    help="persisted restore only: local directory against this fsspec URL (repeatable)")
    a = ap.parse_args()
    print(machine())
    if a.restore_from:
        print(json.dumps(persisted_restore_times(a.params, a.restore_from), indent=1))
        return
    r = restore_times(a.params)
    print(json.dumps(r, indent=1))
    c = commit_lag(a.model, a.iterations)
    print(json.dumps(c, indent=1))


if __name__ == "__main__":
    main()
