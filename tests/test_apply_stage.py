"""The optimizer's thread (ckptd.pipeline.ApplyStage): submit never waits, drain is a
fence, an error comes back at the drain and the stage goes on, bucket steps queued
together run as one."""
import threading
import time

import pytest

from ckptd.pipeline import ApplyStage


def test_submit_never_waits_for_a_busy_optimizer_and_drain_waits_for_every_job():
    stage = ApplyStage()
    gate, ran = threading.Event(), []
    stage.submit(gate.wait)  # the worker is busy until the gate opens
    opener = threading.Timer(1.5, gate.set)  # (a submit that waited would wait this long)
    opener.start()
    t0 = time.monotonic()
    for k in range(100):  # far more than any bounded depth: a whole iteration's buckets
        stage.submit(lambda k=k: ran.append(k))
    assert time.monotonic() - t0 < 0.75 and ran == []
    stage.drain()  # returns only once every job before it ran, in order
    assert ran == list(range(100))
    stage.close()
    assert not stage.thread.is_alive()


def test_a_failed_job_is_raised_at_the_drain_and_later_jobs_skipped_until_then():
    stage = ApplyStage()
    ran = []

    def boom():
        raise ValueError("step failed")
    stage.submit(lambda: ran.append(1))
    stage.submit(boom)
    stage.submit(lambda: ran.append(2))  # after the error: not run
    with pytest.raises(ValueError, match="step failed"):
        stage.drain()
    assert ran == [1]
    stage.submit(lambda: ran.append(3))  # the error was handed over: the stage goes on
    stage.drain()
    assert ran == [1, 3]
    stage.close()


def test_bucket_steps_queued_together_run_as_one_step_with_the_same_bits(tmp_path):
    """Bucket steps of one iteration that wait behind a busy optimizer run as one
    ShadowModel.apply_buckets call (not one per bucket); a job of another kind in between
    (a commit hook, a fence) ends the merge; the state is bit-identical to stepping the
    buckets one by one."""
    import numpy as np

    from ckptd.core.checkpoint import diff_checkpoints, load_checkpoint
    from ckptd.core.plan import load_plan
    from ckptd.core.shadow import ShadowModel
    from ckptd.pipeline import BucketStep
    from helpers import synth

    synth(tmp_path, ranks=2, channels=1, iterations=1)
    plan = load_plan(tmp_path / "plan.json")
    nb = len(plan.buckets_first)
    assert nb >= 3, "the test needs a plan with several buckets"
    rng = np.random.default_rng(0)
    bufs = [rng.standard_normal(sum(e - s for _, s, e in plan.param_ranges(0, b))).astype(np.float32)
            for b in range(nb)]
    one_by_one = ShadowModel(plan, load_checkpoint(tmp_path / "init.pt"))
    for b in range(nb):
        one_by_one.apply_buckets(0, [(b, bufs[b])], 0)
    merged = ShadowModel(plan, load_checkpoint(tmp_path / "init.pt"))
    calls = []
    real = merged.apply_buckets
    merged.apply_buckets = lambda it, bks, lay: (calls.append([b for b, _ in bks]), real(it, bks, lay))
    stage, gate, hooked = ApplyStage(), threading.Event(), []
    stage.submit(gate.wait)
    for b in range(nb - 1):
        stage.submit(BucketStep(merged, 0, [(b, bufs[b])], 0))
    stage.submit(lambda: hooked.append(len(calls)))  # not a bucket step: the merge ends here
    stage.submit(BucketStep(merged, 0, [(nb - 1, bufs[nb - 1])], 0))
    gate.set()
    stage.drain()
    stage.close()
    assert calls == [list(range(nb - 1)), [nb - 1]] and hooked == [1]
    def state(sh):
        return {"model": sh.model_state(copy=False), "optimizer": sh.optimizer_state(copy=False)}
    assert diff_checkpoints(state(one_by_one), state(merged), limit=0) == []

