"""AF_XDP against TPACKET_V3 on this machine's veths: does AF_XDP receive cheaper, or
without drops at a higher rate? (issue 16: "if AF_XDP measurably beats TPACKET_V3
here, offer it too").

    flock /tmp/bench.lock python -m benchmarks.afxdp [--frame-bytes 3000] [--seconds 2]
        [--rates 25000,50000,100000,200000,top] [--receivers tpacket,xdp-native,xdp-generic]
        [--work copy|touch] [--ring-mib 32] [--repeat 2] [--busy] [--huge-umem]

One veth pair from a sender namespace into a capture namespace (MTU 3500: native XDP
on veth takes no larger frames without multi-buffer programs, drivers/net/veth.c
veth_xdp_set). At each rate, each receiver in turn (the order alternates between
repeats) gets the same traffic: `tcpreplay --pps=R` (or --topspeed) of frames of
--frame-bytes (UDP to port 4791), pinned to CPU 0, into tx0; the receiver, pinned to
CPU 1, is benchmarks/afxdp/rx.c (built here with gcc): a TPACKET_V3 ring or an AF_XDP
socket in copy mode (veth has no zero-copy) behind a redirect-to-XSKMAP XDP program,
attached natively (veth's own XDP, run in veth's NAPI poll) or generically (skb mode).
Both do the same work per frame (--work copy: one memcpy into a staging buffer) and
sleep in poll(2) when idle (--busy: spin).

Printed per rate and receiver: frames sent and received, the kernel's drop counter
(tp_drops; AF_XDP's rx_dropped + rx_ring_full), the achieved rate, and CPU-seconds per
million frames of the receiver process, of tcpreplay (its syscalls carry the veth
transmit and, where the softirq runs on the way out of the syscall, the receive path
too) and of softirq time over the whole machine (/proc/stat; other load on this machine
shows up there too, hence the load average per step). "zero-drop" is the highest
achieved rate with no drop and every frame received.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.capture_rate import _ACTUAL, Links
from benchmarks.machine import machine

HERE = Path(__file__).resolve().parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
MTU = 3500
LOOP_FRAMES = 20000  # frames in the pcap tcpreplay loops over
RECEIVERS = {"tpacket": ["tpacket"], "xdp-native": ["xdp", "--xdp-mode", "native"],
             "xdp-generic": ["xdp", "--xdp-mode", "generic"]}


def build(where: Path) -> Path:
    exe = where / "rx"
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(HERE / "rx.c")], check=True)
    return exe


def udp_frame(k: int, size: int) -> bytes:
    """Ethernet / IPv4 / UDP to port 4791, `size` bytes in all, numbered k."""
    payload = struct.pack("!Q", k) * ((size - 42) // 8 + 1)
    payload = payload[:size - 42]
    udp = struct.pack("!HHHH", 49152, 4791, 8 + len(payload), 0)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp) + len(payload), k & 0xFFFF, 0, 64, 17, 0,
                     bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2]))
    ip = ip[:10] + struct.pack("!H", _ip_checksum(ip)) + ip[12:]
    eth = bytes.fromhex("020000000002" "020000000001" "0800")
    return eth + ip + udp + payload


def _ip_checksum(h: bytes) -> int:
    s = sum(struct.unpack(f"!{len(h) // 2}H", h))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def softirq_seconds() -> float:
    """Softirq time of all CPUs so far (/proc/stat's first line, 7th field)."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[7]) / CLK_TCK


def trial(links: Links, exe: Path, receiver: str, pcap: Path, pps: float | None, frames: int, a) -> dict:
    """One receiver, one tcpreplay run; the figures of both."""
    extra = ["--ring-mib", str(a.ring_mib), "--work", a.work] + (["--busy"] if a.busy else []) + \
        (["--huge"] if a.huge_umem and receiver != "tpacket" else [])
    rx = subprocess.Popen(["ip", "netns", "exec", links.cap_ns, "taskset", "-c", "1", str(exe),
                           *RECEIVERS[receiver][:1], "rx0", *RECEIVERS[receiver][1:], *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if rx.stdout.readline().strip() != "ready":
        rx.wait(5)
        raise RuntimeError(f"{receiver} receiver did not start: {rx.stderr.read().strip()}")
    rate = ["--topspeed"] if pps is None else [f"--pps={pps:.0f}"]
    load = open("/proc/loadavg").read().split()[0]
    soft0 = softirq_seconds()
    tx = subprocess.Popen(["ip", "netns", "exec", links.send_ns, "taskset", "-c", "0", "tcpreplay", "-K",
                           f"--loop={max(1, math.ceil(frames / LOOP_FRAMES))}", "-i", "tx0", *rate, str(pcap)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = tx.stdout.read()
    _, status, ru = os.wait4(tx.pid, 0)
    tx.returncode = os.waitstatus_to_exitcode(status)
    time.sleep(0.3)  # the last blocks retire (10 ms) and the receiver takes them
    soft = softirq_seconds() - soft0
    rx.send_signal(2)
    got = json.loads(rx.communicate(timeout=10)[0].strip().splitlines()[-1])
    m = _ACTUAL.search(out)
    if tx.returncode or not m:
        raise RuntimeError(f"tcpreplay failed ({tx.returncode}): {out.strip()[-400:]}")
    sent, nbytes, secs = int(m[1]), int(m[2]), float(m[3])
    return {"receiver": receiver, "target": "top" if pps is None else int(pps), "sent": sent,
            "pps": sent / secs, "gbps": nbytes * 8 / secs / 1e9, "received": got["frames"], "drops": got["drops"],
            "ok": got["drops"] == 0 and got["frames"] >= sent, "rx_cpu": got["utime"] + got["stime"],
            "tx_cpu": ru.ru_utime + ru.ru_stime, "softirq": soft, "load": load}


def per_m(x: float, frames: int) -> str:
    return f"{x / frames * 1e6:.2f}" if frames else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.afxdp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--frame-bytes", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=2.0, help="traffic per trial at the target rate")
    ap.add_argument("--rates", default="25000,50000,100000,200000,top")
    ap.add_argument("--receivers", default="tpacket,xdp-native,xdp-generic")
    ap.add_argument("--work", choices=("copy", "touch"), default="copy")
    ap.add_argument("--ring-mib", type=int, default=32, help="TPACKET ring = UMEM size")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="receivers spin instead of poll(2)")
    ap.add_argument("--huge-umem", action="store_true", help="UMEM in hugetlb pages (needs nr_hugepages)")
    a = ap.parse_args(argv)
    receivers = a.receivers.split(",")
    if bad := [r for r in receivers if r not in RECEIVERS]:
        print(f"--receivers: unknown {bad[0]!r} (one of {', '.join(RECEIVERS)})", file=sys.stderr)
        return 2
    if not 64 <= a.frame_bytes <= MTU + 14:
        print(f"--frame-bytes must be 64..{MTU + 14} (the veths' MTU is {MTU})", file=sys.stderr)
        return 2
    for tool in ("gcc", "tcpreplay", "taskset"):
        if not shutil.which(tool):
            print(f"{tool} not found (scripts/install-deps)", file=sys.stderr)
            return 2
    rates = [None if r == "top" else float(r) for r in a.rates.split(",")]
    print(machine())
    print(f"{a.frame_bytes}-byte frames, work={a.work}, ring/UMEM {a.ring_mib} MiB, "
          f"{'busy-poll' if a.busy else 'poll(2)'}; sender on CPU 0, receiver on CPU 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, Links(1) as links:
        exe = build(Path(tmp))
        from parsers.pcap import write_pcap
        pcap = Path(tmp) / "frames.pcap"
        write_pcap(pcap, [(k * 1000, udp_frame(k, a.frame_bytes)) for k in range(LOOP_FRAMES)])
        for ns, dev in ((links.send_ns, "tx0"), (links.cap_ns, "rx0")):
            subprocess.run(["ip", "-n", ns, "link", "set", "dev", dev, "mtu", str(MTU)], check=True)
        print("| receiver | target pps | sent | achieved pps | Gb/s | received | kernel drops | "
              "receiver CPU-s/M | tcpreplay CPU-s/M | softirq CPU-s/M | load |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for rep in range(a.repeat):
            for pps in rates:
                frames = int((pps or 250_000) * a.seconds)
                for r in (receivers if rep % 2 == 0 else receivers[::-1]):
                    t = trial(links, exe, r, pcap, pps, frames, a)
                    rows.append(t)
                    print(f"| {r} | {t['target']} | {t['sent']} | {t['pps']:.0f} | {t['gbps']:.2f} | "
                          f"{t['received']} | {t['drops']} | {per_m(t['rx_cpu'], t['received'])} | "
                          f"{per_m(t['tx_cpu'], t['sent'])} | {per_m(t['softirq'], t['sent'])} | {t['load']} |",
                          flush=True)
    print("\n| receiver | zero-drop rate (pps, every trial at that rate) | Gb/s |")
    print("|---|---|---|")
    for r in receivers:
        mine = [t for t in rows if t["receiver"] == r]
        by_target: dict = {}
        for t in mine:
            by_target.setdefault(t["target"], []).append(t)
        ok = [min(x["pps"] for x in ts) for ts in by_target.values() if all(x["ok"] for x in ts)]
        best = max(ok, default=0)
        print(f"| {r} | {best:.0f} | {best * a.frame_bytes * 8 / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
