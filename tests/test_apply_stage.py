"""The optimizer's thread (ckptd.pipeline.ApplyStage): submit never waits, drain is a
fence, an error comes back at the drain and the stage goes on."""
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
