"""ckptd's threads carry their names into the kernel (ckptd.threads), and
benchmarks/capture_rate.py splits a daemon's CPU time by them."""
import os
import threading
from pathlib import Path

import pytest

from benchmarks.capture_rate import LOOP_THREAD, cpu_parts
from ckptd.pipeline import ApplyStage
from ckptd.threads import Thread
from helpers import busy

pytestmark = pytest.mark.skipif(not Path("/proc/thread-self/comm").exists(), reason="needs Linux /proc")


def comm(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().rstrip("\n")


def test_a_ckptd_thread_has_its_name_in_the_kernel():
    seen = {}
    t = Thread(target=lambda: seen.setdefault("comm", comm(threading.get_native_id())), name="ckptd-example")
    t.start()
    t.join()
    assert seen["comm"] == "ckptd-example"
    plain = threading.Thread(target=lambda: seen.setdefault("plain", comm(threading.get_native_id())),
                             name="not-ckptd")
    plain.start()
    plain.join()
    assert seen["plain"] != "not-ckptd"  # what Python alone does: the kernel never hears the name


def test_a_long_name_is_cut_to_what_the_kernel_keeps():
    seen = {}
    t = Thread(target=lambda: seen.setdefault("comm", comm(threading.get_native_id())),
               name="ckptd-a-rather-long-name")
    t.start()
    t.join()
    assert seen["comm"] == "ckptd-a-rather-"  # 15 bytes


def test_the_optimizer_thread_is_named():
    stage = ApplyStage()
    try:
        stage.drain()  # its thread has started running (a thread names itself as it starts)
        assert comm(stage.thread.native_id) == "ckptd-apply"
    finally:
        stage.close()


def test_capture_rate_splits_the_daemons_cpu_by_thread():
    """A thread named as the capture loop, one named as the optimizer's and one unnamed
    burn CPU; the split gives the first two theirs, and the total holds all three. The
    threads stay alive until read: an ended thread leaves /proc/PID/task."""
    burns = ((LOOP_THREAD, 0.3), ("ckptd-apply", 0.15), ("other", 0.1))
    burned = [threading.Event() for _ in burns]
    release = threading.Event()

    def work(s, ev):
        busy(s)
        ev.set()
        release.wait()
    before = cpu_parts(os.getpid())
    threads = [Thread(target=work, args=(s, ev), name=n) for (n, s), ev in zip(burns, burned)]
    for t in threads:
        t.start()
    try:
        for ev in burned:
            assert ev.wait(30)
        after = cpu_parts(os.getpid())
    finally:
        release.set()
        for t in threads:
            t.join()
    capture = after["capture"] - before["capture"]
    shadow = after["shadow"] - before["shadow"]
    total = after["total"] - before["total"]
    assert 0.25 <= capture <= 0.4  # clock ticks: 10 ms steps
    assert 0.1 <= shadow <= 0.25
    assert total >= capture + shadow + 0.05  # the unnamed thread counts in the total only
