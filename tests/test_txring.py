"""ckptd.testing.txring: a capture sent through a PACKET_TX_RING arrives byte for byte.

A veth pair from a sender namespace into a capture namespace (benchmarks.capture_rate.
Links, the benchmark's own test network); the sender runs as the benchmark runs it
(`ip netns exec NS python -m ckptd.testing.txring`), `tcpdump -w` on the far end is the
independent witness. Run under `flock /tmp/netlab.lock`.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.testing import netlab
from parsers.pcap import read_pcap, write_pcap

SRC_MAC = bytes.fromhex("02c0ffee0001")  # tcpdump keeps only our frames (the kernels stay quiet, but)
ACTUAL = re.compile(r"Actual: (\d+) packets \((\d+) bytes\) sent in ([\d.]+) seconds")


@pytest.fixture(scope="module")
def links():
    reason = netlab.lab_unavailable()
    if reason:
        pytest.skip(f"the TX ring test needs network namespaces: {reason}")
    if not shutil.which("tcpdump"):
        pytest.skip("tcpdump is not installed (scripts/install-deps installs it)")
    from benchmarks.capture_rate import Links
    with Links(1) as ln:
        yield ln


def frames(n: int, seed: int) -> list[tuple[int, bytes]]:
    """n frames of lengths from 60 to 4 KiB + headers: IPv4/UDP to the RoCE port with
    random payloads, every 50th one 802.1Q-tagged."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        size = rnd.choice([60, 61, 64, 1514, rnd.randrange(60, 4200)])
        vlan = b"\x81\x00" + (100 + i % 7).to_bytes(2, "big") if i % 50 == 7 else b""
        head = bytes.fromhex("02c0ffee0002") + SRC_MAC + vlan + b"\x08\x00"
        ip = bytes([0x45, 0]) + (size - len(head)).to_bytes(2, "big") + i.to_bytes(2, "big") + \
            bytes([0x40, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2]) + b"\x12\xb7\x12\xb7"
        out.append((1_000_000 * i, head + ip + rnd.randbytes(size - len(head) - len(ip))))
    return out


def send(links, path: Path, *rate: str, ifname="tx0") -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", links.send_ns, sys.executable, "-m", "ckptd.testing.txring",
                           "-i", ifname, *rate, str(path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def capture(links, tmp: Path, path: Path, count: int, *rate: str) -> tuple[list[bytes], re.Match]:
    """What tcpdump on rx0 saw of one sender run (it stops after `count` of our frames,
    or is stopped 30 s after the sender), and the sender's Actual: line."""
    out = tmp / "rx0.pcap"
    dump = subprocess.Popen(["ip", "netns", "exec", links.cap_ns, "tcpdump", "-i", "rx0", "-n", "-s", "0",
                             "--immediate-mode", "-B", "65536", "-c", str(count), "-w", str(out),
                             "ether", "src", SRC_MAC.hex(":")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        said = [dump.stderr.readline()]
        while said[-1] and "listening on" not in said[-1]:
            said.append(dump.stderr.readline())
        assert said[-1], f"tcpdump did not start: {''.join(said)}"
        r = send(links, path, *rate)
        assert r.returncode == 0, r.stderr
        dump.wait(30)
    except subprocess.TimeoutExpired:
        pass  # frames missing: what did arrive is compared below
    finally:
        if dump.poll() is None:
            dump.send_signal(signal.SIGINT)
        dump.communicate(timeout=30)
    m = ACTUAL.search(r.stdout)
    assert m, r.stdout
    return [f.data for f in read_pcap(out)], m


@pytest.mark.parametrize("rate", [("--pps", "20000"), ("--topspeed",)], ids=["paced", "topspeed"])
def test_frames_arrive_byte_identical(links, tmp_path, rate):
    sent = frames(600, seed=len(rate))
    src = tmp_path / "src.pcap"
    write_pcap(src, sent)
    got, actual = capture(links, tmp_path, src, len(sent), *rate)
    assert int(actual[1]) == len(sent) and int(actual[2]) == sum(len(d) for _, d in sent)
    assert len(got) == len(sent)
    bad = [i for i, ((_, d), g) in enumerate(zip(sent, got)) if d != g]
    assert not bad, f"{len(bad)} frames differ, first {bad[0]}: sent {len(sent[bad[0]][1])} B, got {len(got[bad[0]])} B"
    if rate[0] == "--pps":  # the pace holds: frame i goes no earlier than i / pps after the first
        assert float(actual[3]) >= (len(sent) - 1) / float(rate[1])


def test_frame_longer_than_the_mtu_is_named(links, tmp_path):
    src = tmp_path / "big.pcap"
    write_pcap(src, frames(3, seed=5)[:2] + [(9, bytes(64) + bytes(9100))])
    r = send(links, src, "--topspeed")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "frame 3 (9164 bytes) does not fit tx0's MTU 9000" in r.stderr


def test_missing_interface_is_named(links, tmp_path):
    src = tmp_path / "one.pcap"
    write_pcap(src, frames(1, seed=6))
    r = send(links, src, "--topspeed", ifname="nosuch0")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "TX ring on nosuch0" in r.stderr, r.stderr


def test_unreadable_capture_is_named(tmp_path, capsys):
    from ckptd.testing.txring import main
    bad = tmp_path / "bad.pcap"
    bad.write_bytes(b"not a capture")
    assert main(["-i", "lo", "--topspeed", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "neither pcap nor pcapng" in err


def test_only_an_8021q_tag_is_allowed_past_the_mtu():
    """too_long follows the kernel's rule (af_packet.c packet_extra_vlan_len_allowed):
    4 bytes more for a frame whose ethertype is 0x8100, none for 0x88A8 or untagged."""
    import numpy as np
    from ckptd.testing.txring import too_long
    mtu = 1500
    frames = [bytes(12) + tpid + bytes(mtu + extra)  # 14 bytes of header, then mtu + extra
              for tpid, extra in ((b"\x81\x00", 4), (b"\x08\x00", 0), (b"\x88\xa8", 4), (b"\x81\x00", 5))]
    buf = np.frombuffer(b"".join(frames), np.uint8)
    lengths = np.array([len(f) for f in frames], np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    assert too_long(buf, offsets, lengths, mtu) == 2  # the 802.1ad frame
    assert too_long(buf[:offsets[2]], offsets[:2], lengths[:2], mtu) == -1
    assert too_long(buf, offsets[3:], lengths[3:], mtu) == 0  # one byte over even with 802.1Q
