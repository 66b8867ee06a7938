"""Replay a capture out of one interface through a PACKET_TX_RING, paced to a frame rate:
the benchmarks' sender (benchmarks/capture_rate.py), one process per interface.

    ip netns exec NS python -m ckptd.testing.txring -i tx0 --pps 100000 mirror0.pcap
    ip netns exec NS python -m ckptd.testing.txring -i tx0 --topspeed mirror0.pcap

The whole capture is read into memory first (ckptd.fast.batches.load_capture: one
buffer, frames indexed in place); then cython_ext.txring copies frames into ring slots
and hands `--batch` of them to the kernel per send(2), the pace kept by the monotonic
clock (no sleep per frame). The socket bypasses the qdisc (PACKET_QDISC_BYPASS): frames
go straight to the driver, as a traffic generator's should. It prints what it sent the
way tcpreplay does ("Actual: N packets (B bytes) sent in S seconds"), then the send(2)
calls, the ENOBUFS retries and its own CPU time over the send.

ckptd.testing.sender (one send(2) per frame, original timing) stays the netlab's
sender; this one is for rates a frame per system call cannot reach.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import mmap
import resource
import signal
import socket
import struct
import sys
from dataclasses import dataclass

import numpy as np

from cython_ext.txring import TxRingError, send_paced

from ckptd.fast.batches import load_capture
from ckptd.live.ring import PACKET_VERSION, SOL_PACKET, in_netns
from ckptd.testing.sender import SendResult

PACKET_TX_RING = 13       # include/uapi/linux/if_packet.h (SOL_PACKET, PACKET_VERSION: ckptd.live.ring)
PACKET_QDISC_BYPASS = 20
TPACKET_V2 = 1
SLOT_DATA = 32            # TPACKET2_HDRLEN - sizeof(struct sockaddr_ll): the frame's place in a slot
SO_SNDBUFFORCE = 32       # include/uapi/asm-generic/socket.h (not in Python's socket module)
SIOCGIFMTU = 0x8921
ETH_HLEN, VLAN_HLEN = 14, 4
BLOCK_SIZE = 1 << 20      # ring block: several slots of the largest frame, one page-multiple allocation
BATCH = 256               # slots per send(2)
TICK_S = 500e-6           # paced: sleep until at least this much sending is due (10k pps: 5 frames)
SNDBUF = 64 << 20         # the socket's send budget counts every frame in flight: never the limit here


@dataclass
class TxRing:
    """A bound TPACKET_V2 TX ring on one interface."""
    sock: socket.socket
    ring: mmap.mmap
    block_size: int
    frame_size: int
    slots: int
    mtu: int
    head: int = 0

    def close(self):
        self.ring.close()
        self.sock.close()


def open_tx_ring(ifname: str, max_frame: int, batch: int = BATCH, netns: str | None = None) -> TxRing:
    """A TX ring on ifname with slots for frames up to max_frame bytes, twice `batch` of
    them at least (a batch is filled while nothing else is in the ring, see txring.pyx)."""
    frame_size = -(-(SLOT_DATA + max_frame) // 16) * 16  # TPACKET_ALIGNMENT
    block_size = max(BLOCK_SIZE, -(-frame_size // mmap.PAGESIZE) * mmap.PAGESIZE)
    per_block = block_size // frame_size
    block_nr = -(-2 * batch // per_block)

    def make():
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: receives nothing
        try:
            s.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V2)
            s.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
            try:
                s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SNDBUF)
            except PermissionError:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
            s.setsockopt(SOL_PACKET, PACKET_TX_RING,
                         struct.pack("=IIII", block_size, block_nr, frame_size, per_block * block_nr))
            s.bind((ifname, 0))
            mtu = struct.unpack_from("=i", fcntl.ioctl(s, SIOCGIFMTU, struct.pack("16si", ifname.encode(), 0)),
                                     16)[0]
            return s, mtu
        except BaseException:
            s.close()
            raise
    try:
        sock, mtu = in_netns(netns, make)
    except OSError as e:
        where = ifname + (f" (netns {netns})" if netns else "")
        raise OSError(e.errno, f"TX ring on {where}: {e.strerror or e}") from e
    ring = mmap.mmap(sock.fileno(), block_size * block_nr, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return TxRing(sock, ring, block_size, frame_size, per_block * block_nr, mtu)


def too_long(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, mtu: int) -> int:
    """Index of the first frame the kernel would refuse on a device of this MTU (longer
    than MTU + Ethernet header, + 4 for an 802.1Q-tagged one: af_packet.c tpacket_snd,
    packet_extra_vlan_len_allowed; an 802.1ad (0x88A8) outer tag gets no allowance),
    or -1."""
    limit = np.full(len(lengths), mtu + ETH_HLEN, np.int64)
    tagged = lengths >= ETH_HLEN
    ethertype = np.zeros(len(lengths), np.int64)
    ethertype[tagged] = buf[offsets[tagged] + 12].astype(np.int64) << 8 | buf[offsets[tagged] + 13]
    limit[ethertype == 0x8100] += VLAN_HLEN
    bad = np.flatnonzero(lengths > limit)
    return int(bad[0]) if len(bad) else -1


def send_capture(path: str, ifname: str, pps: float | None, *, batch: int = BATCH,
                 netns: str | None = None, ready=None) -> tuple[SendResult, int]:
    """Every frame of a capture out of ifname, pps frames per second (None: as fast as
    the ring goes). ready(), if given, is called once the frames are in memory and the
    ring is open, just before the first frame. Returns (what was sent, send(2) calls)."""
    frames, error = load_capture(path)
    if error:  # load_capture's message, naming the file where it does not already
        raise OSError(errno.EINVAL, error if str(path) in error else f"{path}: {error}")
    lengths = np.ascontiguousarray(frames.caplen, np.int64)
    offsets = np.ascontiguousarray(frames.offsets, np.int64)
    tx = open_tx_ring(ifname, int(lengths.max()) if len(lengths) else 64, batch, netns)
    try:
        bad = too_long(frames.buf, offsets, lengths, tx.mtu)
        if bad >= 0:
            raise OSError(errno.EMSGSIZE, f"{path}: frame {bad + 1} ({lengths[bad]} bytes) does not fit "
                                          f"{ifname}'s MTU {tx.mtu}")
        if ready:
            ready()
        try:
            n, nbytes, secs, sends, retries, waits, tx.head = send_paced(
                memoryview(tx.ring), tx.sock.fileno(), tx.block_size, tx.frame_size, tx.slots,
                tx.head, frames.buf, offsets, lengths, pps or 0.0, min(batch, tx.slots // 2), TICK_S)
        except TxRingError as e:
            which = f"frame {e.frame + 1}" if e.frame >= 0 else "a frame"
            raise OSError(e.errno, f"{path}: {which} refused by {ifname}: {e.strerror or e}") from None
    finally:
        tx.close()
    return SendResult(sent=n, bytes=nbytes, retries=retries, seconds=secs), sends


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckptd.testing.txring", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-i", "--interface", required=True)
    rate = ap.add_mutually_exclusive_group(required=True)
    rate.add_argument("--pps", type=float, help="frames per second")
    rate.add_argument("--topspeed", action="store_true", help="as fast as the ring goes")
    ap.add_argument("--batch", type=int, default=BATCH, help="ring slots per send(2)")
    ap.add_argument("--ready", action="store_true",
                    help="print 'ready' once loaded and wait for a line on stdin before sending "
                         "(several senders start together)")
    ap.add_argument("capture", help="pcap (or pcapng) file")
    a = ap.parse_args(argv)
    if a.pps is not None and a.pps <= 0 or a.batch < 1:
        ap.error("--pps and --batch must be > 0")
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the send loop runs without the GIL

    start = []

    def ready():
        if a.ready:
            print("ready", flush=True)
            sys.stdin.readline()
        start.append(resource.getrusage(resource.RUSAGE_SELF))
    try:
        res, sends = send_capture(a.capture, a.interface, None if a.topspeed else a.pps, batch=a.batch,
                                  ready=ready)
        r0, r1 = start[0], resource.getrusage(resource.RUSAGE_SELF)
    except OSError as e:
        print(f"txring: {e.strerror or e}", file=sys.stderr)
        return 2
    bps = res.bytes / res.seconds if res.seconds else 0.0
    print(f"Actual: {res.sent} packets ({res.bytes} bytes) sent in {res.seconds:.6f} seconds")
    print(f"Rated: {bps:.1f} Bps, {bps * 8 / 1e6:.2f} Mbps, {res.pps:.2f} pps")
    print(f"TX ring: {sends} send calls, {res.retries} retried (ENOBUFS); CPU user {r1.ru_utime - r0.ru_utime:.3f} s,"
          f" system {r1.ru_stime - r0.ru_stime:.3f} s (the send)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
