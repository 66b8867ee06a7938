"""Notice and resync: an unrecoverable iteration is announced (webhook POST, a key in the
job's TCPStore); the training loop's Resync sees the key at its next step boundary and
saves a regular checkpoint into the daemon's resume directory; the shadow restarts from it
and every later iteration commits bit-exact."""
from __future__ import annotations

import json
import shutil
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

import ckptd
from ckptd.core.checkpoint import checkpoint_name, diff_checkpoints, load_checkpoint
from ckptd.core.optim import torch_optimizer
from ckptd.core.plan import load_plan
from ckptd.live.daemon import ConfigError, load_config
from ckptd.live.notice import STORE_KEY, Notifier, NoticeConfig
from ckptd.pipeline import IterationReport, Pipeline, ReplayOptions
from ckptd.resync import Resync
from ckptd.testing.synth.model import build_model
from parsers.capfile import open_capture
from parsers.pcap import write_pcap
from parsers.roce import FrameClass, decode_frame

from helpers import pcaps, run_replay, synth

ITERATIONS = 7
GAP_NS = 50_000_000  # synth leaves 100 ms between iterations: a larger gap is a step boundary


def _lossy_capture(d, tmp_path):
    """One mirror (a single copy of everything) less one allgather packet: an iteration in
    the middle becomes unrecoverable."""
    src = pcaps(d)[0]
    frames = list(open_capture(src))
    middles = [fr.index for fr in frames
               if (f := decode_frame(fr.data)).cls is FrameClass.ROCE_DATA and f.bth.opcode == 7]
    for idx in middles[len(middles) * 2 // 5:]:
        lossy = str(tmp_path / "lossy.pcap")
        write_pcap(lossy, [fr for fr in frames if fr.index != idx])
        shutil.rmtree(d / "out", ignore_errors=True)
        bad = [r.iteration for r in run_replay(d, [lossy]).reports if r.status == "unrecoverable"]
        if bad and bad[0] < ITERATIONS - 3:
            return lossy, bad[0]
    pytest.fail("no allgather packet found whose loss makes an early iteration unrecoverable")


def test_an_unrecoverable_iteration_is_announced_and_the_trainer_resyncs_the_shadow(tmp_path, webhook):
    d = tmp_path / "job"
    synth(d, ranks=2, channels=1, protocol="simple", mtu=1024, mirrors=1, iterations=ITERATIONS, seed=5)
    lossy, lost = _lossy_capture(d, tmp_path)
    url, posts = webhook
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))  # the job's store (torchrun's, in a real job)
    notifier = Notifier(NoticeConfig(webhook=url, webhook_token="s3cret",
                                     store=("127.0.0.1", master.port), timeout_s=5))
    plan = load_plan(d / "plan.json")
    resync_dir = tmp_path / "resync"
    resync_dir.mkdir()  # the daemon's resume directory, shared with the trainer
    pipe = Pipeline(plan, load_checkpoint(d / "init.pt"), 1,
                    ReplayOptions(out=str(tmp_path / "out"), reference=str(d / "reference"),
                                  resume=str(resync_dir)),
                    on_iteration=notifier.on_iteration)

    # The trainer: a real model and optimizer holding, at each step boundary, the job's
    # state (the synthesizer's reference checkpoints), with Resync in its loop.
    model = build_model("tiny", 0)
    optimizer = torch_optimizer(plan.optimizer, model.named_parameters())
    client = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    resync = Resync(client, resync_dir, model, optimizer, rank=0)

    def wire_with_trainer():
        step = 0
        last_ts = None
        for fr in open_capture(lossy):
            if last_ts is not None and fr.ts_ns - last_ts > GAP_NS:
                # the job finished iteration `step`; the daemon has seen all of its traffic
                deadline = time.time() + 10
                while not notifier.idle() and time.time() < deadline:
                    time.sleep(0.01)
                ckptd.restore(model, optimizer, d / "reference" / checkpoint_name(step))
                resync.after_step(step + 1)
                step += 1
            last_ts = fr.ts_ns
            yield 0, fr

    reports = {r.iteration: r for r in pipe.run(wire_with_trainer())}
    notifier.close()

    assert reports[lost].status == "unrecoverable"
    # the announcement: webhook and store name the lost iteration
    assert [(auth, ev["iteration"], ev["status"]) for auth, ev in posts] == [("Bearer s3cret", lost, "unrecoverable")]
    assert client.get(STORE_KEY) == str(lost).encode()
    assert json.loads(client.get(f"{STORE_KEY}/{lost}"))["missing"]
    # the trainer saved once, at the first step boundary after the announcement
    assert len(resync.saved) == 1
    saved = load_checkpoint(resync.saved[0], [p.name for p in plan.parameters])
    resumed_at = int(saved["iteration"]) + 1
    assert lost < resumed_at < ITERATIONS, (lost, resumed_at)
    for it in range(lost + 1, resumed_at):
        assert reports[it].status == "complete-not-applied"
    for it in range(resumed_at, ITERATIONS):
        assert reports[it].status == "committed" and reports[it].exact, (it, reports[it].note)
        assert diff_checkpoints(load_checkpoint(tmp_path / "out" / checkpoint_name(it)),
                                load_checkpoint(d / "reference" / checkpoint_name(it))) == []
    assert "resumed from" in reports[resumed_at].note
    assert notifier.stats() == {"sent": 1, "failed": 0, "dropped": 0}


def test_an_unreachable_webhook_is_counted_never_blocks(tmp_path):
    n = Notifier(NoticeConfig(webhook="http://127.0.0.1:9/none", timeout_s=0.2))
    rep = IterationReport(3, "unrecoverable")
    t0 = time.monotonic()
    n.on_iteration(rep)
    n.on_iteration(IterationReport(4, "committed"))
    assert time.monotonic() - t0 < 0.1  # the core loop only enqueues
    n.close(wait_s=30)
    assert n.stats() == {"sent": 0, "failed": 1, "dropped": 0}


def test_a_notice_still_undelivered_at_the_stop_is_counted_and_named(caplog):
    """A webhook that never answers: the stop waited 10 s, less than one event's retries
    (3 timeouts and the back-off), and the process then exited with the notice neither
    delivered nor counted nor logged; the daemon's last snapshot said sent 0, failed 0,
    dropped 0 (helper 71). Now close() waits out the event in hand's retries, and what
    is still undelivered is counted as dropped and logged by iteration."""
    import socket
    hang = socket.socket()  # listens, never accepts: every POST times out
    hang.bind(("127.0.0.1", 0))
    hang.listen(16)
    try:
        n = Notifier(NoticeConfig(webhook=f"http://127.0.0.1:{hang.getsockname()[1]}/hook", timeout_s=0.3))
        assert 0.3 * 3 < n.retry_budget_s() < 5
        n.on_iteration(IterationReport(4, "unrecoverable"))
        n.on_iteration(IterationReport(5, "unrecoverable"))
        time.sleep(0.05)  # iteration 4's event is in hand
        with caplog.at_level("ERROR", logger="ckptd.notice"):
            n.close(wait_s=0.5)
        assert n.stats()["dropped"] == 2, n.stats()
        lines = [r for r in caplog.records if r.getMessage() == "notices not delivered at the stop"]
        assert len(lines) == 1 and lines[0].fields["iterations"] == [4, 5]
        n = Notifier(NoticeConfig(webhook=f"http://127.0.0.1:{hang.getsockname()[1]}/hook", timeout_s=0.3))
        n.on_iteration(IterationReport(6, "unrecoverable"))
        t0 = time.monotonic()
        n.close()  # the default waits for the event's every retry: failed, not dropped
        assert time.monotonic() - t0 < n.retry_budget_s() + 1
        assert n.stats() == {"sent": 0, "failed": 1, "dropped": 0}
    finally:
        hang.close()


@pytest.mark.parametrize("notice, message", [
    ("notice: 3", "'notice' must be a mapping"),
    ("notice: {webhook: ftp://x}", "'notice.webhook' must be an http:// or https:// URL"),
    ("notice: {store: 'h:0'}", "needs the TCPStore's port"),
    ("notice: {store: 'no port'}", "notice.store"),
    ("notice: {timeout_s: 0}", "'notice.timeout_s'"),
    ("notice: {}", "names neither a webhook nor a store"),
    ("notice: {webhook: 'http://h/x', hook: 1}", "unknown keys ['hook']"),
])
def test_bad_notice_config_names_the_key(tmp_path, notice, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"plan: p.json\ninit: i.pt\nout: o\ninterfaces: [{{ifname: eth0}}]\n{notice}\n")
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        load_config(cfg)


def test_a_good_notice_config_loads(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("plan: p.json\ninit: i.pt\nout: o\ninterfaces: [{ifname: eth0}]\n"
                   "notice: {webhook: 'https://pager.example/hook', store: '[::1]:29500'}\n")
    c = load_config(cfg).notice
    assert c == NoticeConfig(webhook="https://pager.example/hook", store=("::1", 29500))


def test_resync_writes_on_rank_0_only_and_only_for_news(tmp_path):
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
    master.set(STORE_KEY, "2")  # announced before this run started: old news
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r0 = Resync(master, tmp_path / "r", model, opt, rank=0)
    r1 = Resync(master, tmp_path / "r", model, opt, rank=1)
    assert r0.after_step(5) is None and r1.after_step(5) is None
    master.set(STORE_KEY, "7")
    assert r1.after_step(9) is None
    path = r0.after_step(9)
    assert path == tmp_path / "r" / checkpoint_name(8)
    doc = torch.load(path, weights_only=True)
    assert doc["step"] == 9 and set(doc) == {"model", "optimizer", "step"}
    assert r0.after_step(10) is None  # handled
