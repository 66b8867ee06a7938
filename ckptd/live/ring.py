"""Live capture: an AF_PACKET socket with a TPACKET_V3 memory-mapped receive ring.

    cap = RingCapture("eth1", netns="ck-ck", block_size=1 << 20, block_nr=64)
    for frame in cap.frames(stop_event):       # parsers.frame.CapturedFrame
        ...
    batch = cap.read_batch(stream=0)           # or: every retired block as one Batch,
    pipe.run_batch(batch); cap.release()       # indexed in place, then handed back
    cap.stats()   # {'packets', 'drops', 'freeze_q_cnt', 'delivered', ...}, cumulative

The kernel writes packets into fixed-size blocks of a ring shared with us; a block is
handed to user space when it is full or after `retire_ms`, and handed back by writing
TP_STATUS_KERNEL into its header.  When every block is in user hands the kernel drops
packets and counts them (tp_drops, tp_freeze_q_cnt): a reader that falls behind loses
frames, and stats() says how many.  Layouts from include/uapi/linux/if_packet.h and
Documentation/networking/packet_mmap.rst.

A classic BPF program attached before the socket is bound passes only what ckptd can
use: UDP to port 4791 (RoCEv2) and GRE (ERSPAN) over IPv4 or IPv6, with or without one
802.1Q tag.  `ring_source` turns several captures into the (stream, frame) items that
ckptd.pipeline consumes, as `pipeline.file_source` does for files; `ring_batches` turns
them into Batches for ckptd.fast (the frames stay in the ring: cython_ext/ring.pyx
indexes the blocks in place, and each block goes back to the kernel once its batch has
been processed).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import select
import socket
import struct
import threading
import time
from typing import Callable, Iterator

import numpy as np

from cython_ext import ring as _ring_index
from parsers.frame import LINKTYPE_ETHERNET, CapturedFrame
from ckptd.errors import CkptdError
from ckptd.fast.batches import Batch

# -- constants (include/uapi/linux/if_packet.h, if_ether.h, filter.h) ----------------
SOL_PACKET = 263
PACKET_RX_RING = 5
PACKET_STATISTICS = 6
PACKET_VERSION = 10
PACKET_FANOUT = 18
PACKET_FANOUT_DATA = 22
PACKET_IGNORE_OUTGOING = 23
TPACKET_V3 = 2
SO_ATTACH_FILTER = 26
ETH_P_ALL = 0x0003

TP_STATUS_KERNEL = 0
TP_STATUS_USER = 1
TP_STATUS_VLAN_VALID = 0x10
TP_STATUS_VLAN_TPID_VALID = 0x40

# "flow" is ours: PACKET_FANOUT_CBPF (6) with roce_flow_program, the RoCE flow inside a
# mirror tunnel too (the kernel's "hash" hashes the tunnel's outer header)
FANOUT_MODES = {"hash": 0, "lb": 1, "cpu": 2, "qm": 5, "flow": 6}

ROCE_PORT = 4791
IPPROTO_UDP, IPPROTO_GRE = 17, 47

CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = "/run/netns"

# struct tpacket_block_desc: version u32, offset_to_priv u32, then tpacket_hdr_v1:
# block_status u32 @8, num_pkts u32 @12, offset_to_first_pkt u32 @16, blk_len u32 @20,
# seq_num u64 @24, ts_first_pkt, ts_last_pkt.
_BLOCK = struct.Struct("=III")          # block_status, num_pkts, offset_to_first_pkt @8
_BLOCK_STATUS_OFF = 8
# struct tpacket3_hdr: next_offset, sec, nsec, snaplen, len, status u32; mac, net u16;
# hv1: rxhash u32, vlan_tci u32, vlan_tpid u16 (then padding to 48 bytes).
_PKT = struct.Struct("=IIIIIIHHIIH")
_TPACKET3_HDRLEN = 48 + 20             # TPACKET_ALIGN(sizeof tpacket3_hdr) + sockaddr_ll
_STATS3 = struct.Struct("=III")        # tpacket_stats_v3: packets, drops, freeze_q_cnt
BATCH_FRAMES = 1 << 15                 # read_batch: frames per Batch at most (whole blocks)
_MIN_FRAME_SPACE = 64                  # a frame takes more than this much of a block
# ring_batches: ring bytes per ring and turn, at most (turn_bytes: less for a small model).
# Each batch costs the loop a fixed share of Python (its stops, clocks, drop counters): at
# 462k frames/s on 1 MiB blocks, 4 MiB turns took 8-10% less capture-path CPU per frame
# than 1 MiB turns, and the rings peaked at 38-50% instead of 75-94% (benchmarks/RESULTS.md,
# session 15). 4 MiB is also the daemon's default block.
TURN_BYTES = 4 << 20


def turn_bytes(least_link_bytes: int) -> int:
    """Ring bytes per turn for streams that each carry at least `least_link_bytes` an
    iteration (Plan.least_link_bytes): half of that, at most TURN_BYTES. The pipeline
    closes an iteration once some stream has gone two past it, so no stream may get an
    iteration ahead of another within one turn; a turn is at least one block whatever
    this says (ring_batches)."""
    return max(1, min(TURN_BYTES, least_link_bytes // 2))


class CaptureSetupError(CkptdError, OSError):
    """Opening or configuring a capture failed; the message names interface and netns."""

    def __str__(self):  # the message alone, without OSError's "[Errno 19]" in front
        return self.strerror if self.strerror else super().__str__()


# -- network namespaces ---------------------------------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def in_netns(netns: str | None, fn: Callable, *args, **kwargs):
    """Run fn(*args, **kwargs) inside network namespace `netns` (a name under /run/netns).

    setns(2) moves only the calling thread, so fn runs on a short-lived helper thread
    and the rest of the process stays where it was.  Sockets fn opens keep the
    namespace they were created in, so they can be used from any thread afterwards.
    """
    if netns is None:
        return fn(*args, **kwargs)
    box: dict = {}

    def body():
        try:
            fd = os.open(os.path.join(NETNS_RUN_DIR, netns), os.O_RDONLY)
        except OSError as e:
            box["error"] = OSError(e.errno, f"network namespace {netns!r}: {e.strerror}")
            return
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                box["error"] = OSError(err, f"setns({netns!r}): {os.strerror(err)}")
                return
        finally:
            os.close(fd)
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=body, name=f"netns:{netns}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- the kernel filter ----------------------------------------------------------------
# Classic BPF opcodes (include/uapi/linux/filter.h, bpf_common.h).
_LDH_ABS, _LDB_ABS, _LDH_IND = 0x28, 0x30, 0x48     # A = half/byte at k, or at X + k
_LDXB_MSH = 0xB1                                    # X = 4 * (byte at k & 0x0f)
_JEQ, _JSET = 0x15, 0x45                            # if A == k / if A & k
_RET = 0x06
_ACCEPT_ALL = 0xFFFFFFFF                            # keep the whole packet


def _assemble(program: list[tuple]) -> list[tuple[int, int, int, int]]:
    """Resolve labels: items are ("label:",) or (opcode, k[, jt, jf]); jt/jf are label
    names or None (the next instruction).  Classic BPF jumps are forward-only u8
    offsets counted from the instruction after the jump."""
    pos, n = {}, 0
    for ins in program:
        if isinstance(ins, str):
            pos[ins] = n
        else:
            n += 1
    out = []
    for ins in program:
        if isinstance(ins, str):
            continue
        code, k, jt, jf = (ins + (None, None))[:4]
        here = len(out) + 1

        def rel(label):
            if label is None:
                return 0
            off = pos[label] - here
            assert 0 <= off < 256, f"BPF jump to {label} out of range"
            return off
        out.append((code, rel(jt), rel(jf), k & 0xFFFFFFFF))
    return out


def _l3_checks(base: int, tag: str) -> list[tuple]:
    """A holds the EtherType, the IP header starts at byte `base` (14, or 18 after one
    802.1Q tag).  Two copies of this block exist, one per base, because the IPv4 header
    length is loaded with the MSH form, which takes an absolute offset only."""
    v4, v6 = f"v4{tag}", f"v6{tag}"
    return [
        (_JEQ, 0x0800, v4, None),
        (_JEQ, 0x86DD, v6, "drop"),
        v4,
        (_LDB_ABS, base + 9),                     # IPv4 protocol
        (_JEQ, IPPROTO_GRE, "accept", None),
        (_JEQ, IPPROTO_UDP, None, "drop"),
        (_LDH_ABS, base + 6),                     # flags | fragment offset
        (_JSET, 0x1FFF, "drop", None),            # a later fragment has no UDP header
        (_LDXB_MSH, base),                        # X = IPv4 header length (IHL * 4)
        (_LDH_IND, base + 2),                     # UDP destination port at base + X + 2
        (_JEQ, ROCE_PORT, "accept", "drop"),
        v6,
        # RoCEv2 and ERSPAN put UDP / GRE directly after the IPv6 header; packets with
        # extension headers in between are not ours and are dropped.
        (_LDB_ABS, base + 6),                     # IPv6 next header
        (_JEQ, IPPROTO_GRE, "accept", None),
        (_JEQ, IPPROTO_UDP, None, "drop"),
        (_LDH_ABS, base + 40 + 2),                # UDP destination port
        (_JEQ, ROCE_PORT, "accept", "drop"),
    ]


def roce_filter(snaplen: int = _ACCEPT_ALL) -> list[tuple[int, int, int, int]]:
    """The BPF program as (code, jt, jf, k) tuples: accept UDP dport 4791 and GRE,
    keeping `snaplen` bytes of each (a filter's return value is how much of the packet
    the kernel copies into the ring; the wire length is still reported).

    The kernel usually takes a received 802.1Q tag off into skb metadata before packet
    sockets see the frame, so the untagged branch applies; the tagged branch serves
    frames whose tag stayed in the data.  Either way RingCapture puts the tag back from
    the tpacket3 header, as libpcap does."""
    return _assemble([
        (_LDH_ABS, 12),                           # EtherType (or TPID)
        (_JEQ, 0x8100, "tagged", None),
        *_l3_checks(14, "u"),
        "tagged",
        (_LDH_ABS, 16),                           # EtherType after one 802.1Q tag
        *_l3_checks(18, "t"),
        "accept",
        (_RET, snaplen),
        "drop",
        (_RET, 0),
    ])


def _fprog(program: list[tuple[int, int, int, int]]) -> tuple[bytes, ctypes.Array]:
    """struct sock_fprog {u16 len; struct sock_filter *filter} and the array it points to
    (which must live until the setsockopt has copied it)."""
    insns = b"".join(struct.pack("=HBBI", *ins) for ins in program)
    buf = ctypes.create_string_buffer(insns, len(insns))
    return struct.pack("@HP", len(program), ctypes.addressof(buf)), buf


def attach_filter(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    """SO_ATTACH_FILTER: the socket's filter."""
    fprog, _buf = _fprog(program)
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


# -- the flow fanout and the session filter ----------------------------------------
# More classic BPF: loads at X + k, the scratch memory M[], the accumulator's ALU.
_LDW_IND, _LDB_IND = 0x40, 0x50
_LD_MEM, _LDX_MEM, _LDX_IMM, _ST, _STX = 0x60, 0x61, 0x01, 0x02, 0x03
_ADD, _AND, _LSH, _RSH, _MUL, _XOR_X, _ADD_X = 0x04, 0x54, 0x64, 0x74, 0x24, 0xAC, 0x0C
_TAX, _TXA, _RET_A = 0x07, 0x87, 0x16
_TPIDS = (0x8100, 0x88A8, 0x9100)
# M[] slots: the IP header's offset, the key being built, the GRE header's offset, its
# flags, the offset of what follows, a scratch EtherType / ERSPAN III word
_M_IP, _M_KEY, _M_GRE, _M_FLAGS, _M_P, _M_W = range(6)


def _goto(label: str) -> tuple:
    return (_JEQ, 0, label, label)  # both ways to `label`: a forward jump (_assemble's labels)


def _flow_key(version: int) -> list:
    """X holds the offset of an IPv4 or IPv6 header: return a hash of (source address ^
    destination address ^ UDP source port) for RoCEv2 (UDP 4791), else 0. Symmetric, so a
    QP's data and its ACKs (which carry the same UDP source port) share a member; the
    product's high half, since the kernel takes the answer modulo the member count."""
    out = [(_STX, _M_IP)]
    if version == 4:
        out += [(_LDB_IND, 9), (_JEQ, IPPROTO_UDP, None, "ret0"),
                (_LDW_IND, 12), (_ST, _M_KEY), (_LDW_IND, 16), (_LDX_MEM, _M_KEY), (_XOR_X, 0), (_ST, _M_KEY),
                (_LDX_MEM, _M_IP), (_LDB_IND, 0), (_AND, 0x0F), (_LSH, 2), (_ADD_X, 0), (_TAX, 0)]
    else:  # RoCEv2 puts UDP right after the IPv6 header (no extension headers: roce_filter)
        out += [(_LDB_IND, 6), (_JEQ, IPPROTO_UDP, None, "ret0"), (_LDW_IND, 8), (_ST, _M_KEY)]
        for off in range(12, 40, 4):
            out += [(_LDW_IND, off), (_LDX_MEM, _M_KEY), (_XOR_X, 0), (_ST, _M_KEY), (_LDX_MEM, _M_IP)]
        out += [(_TXA, 0), (_ADD, 40), (_TAX, 0)]
    return out + [(_LDH_IND, 2), (_JEQ, ROCE_PORT, None, "ret0"),
                  (_LDH_IND, 0), (_LDX_MEM, _M_KEY), (_XOR_X, 0), (_MUL, 0x9E3779B1), (_RSH, 16), (_RET_A, 0)]


def _add_if(bit: int, n: int, tag: str) -> list:
    """M[P] += n where the GRE flags have `bit`."""
    return [(_LD_MEM, _M_FLAGS), (_JSET, bit, None, f"no{tag}"),
            (_LD_MEM, _M_P), (_ADD, n), (_ST, _M_P), f"no{tag}"]


def roce_flow_program() -> list[tuple[int, int, int, int]]:
    """The PACKET_FANOUT_CBPF program of fanout_mode "flow": the member (the answer modulo
    the member count) of a RoCEv2 frame, by its flow, the same whether the frame came
    bare or inside a mirror tunnel (GRE with ERSPAN I, II, III or transparent Ethernet,
    as cython_ext/batch.pyx _tunnel unwraps them; up to two inner VLAN tags). Members
    joined in the same order on several ports then get every copy of a flow, on every
    port and in either wrapping, at the same index. Anything else goes to member 0.
    A fanout program sees the packet from its network header on (the link header has
    been pulled by then; checked on veth pairs, tests/test_capture.py)."""
    return _assemble([
        (_LDB_ABS, 0), (_RSH, 4), (_JEQ, 4, "o4", None), (_JEQ, 6, "o6", "ret0"),
        "o4",
        (_LDB_ABS, 9), (_JEQ, IPPROTO_GRE, "o4gre", None),
        (_LDX_IMM, 0), *_flow_key(4),
        "o4gre",
        (_LDB_ABS, 0), (_AND, 0x0F), (_LSH, 2), (_TAX, 0), _goto("gre"),
        "o6",
        (_LDB_ABS, 6), (_JEQ, IPPROTO_GRE, "o6gre", None),
        (_LDX_IMM, 0), *_flow_key(6),
        "o6gre",
        (_LDX_IMM, 40),
        "gre",  # X: the GRE header
        (_STX, _M_GRE), (_LDH_IND, 0), (_ST, _M_FLAGS), (_JSET, 0x4007, "ret0", None),  # routing, version
        (_TXA, 0), (_ADD, 4), (_ST, _M_P),
        *_add_if(0x8000, 4, "c"), *_add_if(0x2000, 4, "k"), *_add_if(0x1000, 4, "s"),
        (_LDX_MEM, _M_GRE), (_LDH_IND, 2),
        (_JEQ, 0x6558, "eth", None), (_JEQ, 0x22EB, "erspan3", None), (_JEQ, 0x88BE, None, "ret0"),
        (_LD_MEM, _M_FLAGS), (_JSET, 0x1000, None, "eth"),  # without S: type I, the frame follows
        (_LD_MEM, _M_P), (_ADD, 8), (_ST, _M_P), _goto("eth"),  # type II
        "erspan3",
        (_LDX_MEM, _M_P), (_LDH_IND, 10), (_ST, _M_W),  # P FT(5) HwID D Gra O
        (_LD_MEM, _M_P), (_ADD, 12), (_ST, _M_P),
        (_LD_MEM, _M_W), (_JSET, 1, None, "noplatform"),
        (_LD_MEM, _M_P), (_ADD, 8), (_ST, _M_P),
        "noplatform",
        (_LD_MEM, _M_W), (_RSH, 10), (_AND, 0x1F), (_JEQ, 0, "eth", None), (_JEQ, 2, None, "ret0"),
        (_LDX_MEM, _M_P), (_LDB_IND, 0), (_RSH, 4), (_JEQ, 4, "i4", None), (_JEQ, 6, "i6", "ret0"),
        "eth",  # M[P]: the mirrored Ethernet frame
        (_LDX_MEM, _M_P), (_LDH_IND, 12), (_ST, _M_W), (_TXA, 0), (_ADD, 14), (_ST, _M_P),
        *[ins for k in range(2) for ins in (
            (_LD_MEM, _M_W), (_JEQ, _TPIDS[0], f"tag{k}", None), (_JEQ, _TPIDS[1], f"tag{k}", None),
            (_JEQ, _TPIDS[2], f"tag{k}", "ethertype"),
            f"tag{k}",
            (_LDX_MEM, _M_P), (_LDH_IND, 2), (_ST, _M_W), (_TXA, 0), (_ADD, 4), (_ST, _M_P))],
        "ethertype",
        (_LD_MEM, _M_W), (_JEQ, 0x0800, "i4", None), (_JEQ, 0x86DD, "i6", "ret0"),
        "i4",
        (_LDX_MEM, _M_P), *_flow_key(4),
        "i6",
        (_LDX_MEM, _M_P), *_flow_key(6),
        "ret0",
        (_RET, 0),
    ])


def erspan_session_filter(session: int, snaplen: int = _ACCEPT_ALL) -> list[tuple[int, int, int, int]]:
    """The socket filter of a ring that captures one remote mirror session: accept an
    IPv4 or IPv6 GRE packet carrying ERSPAN type II (GRE 0x88BE with a sequence number) or
    III (0x22EB) whose session ID is `session` (0-1023: the low 10 bits of the ERSPAN
    header's first word in both types), keeping `snaplen` bytes; drop everything else,
    bare frames included. So several sessions arriving at one collector interface are
    captured as streams of their own (interfaces[].erspan_session); type I and gretap carry
    no session ID. A socket filter sees the frame from its Ethernet header on."""
    if not 0 <= session <= 0x3FF:
        raise ValueError(f"ERSPAN session {session} is not in 0..1023")

    def ip(base: int, tag: str) -> list:
        v4, v6 = f"v4{tag}", f"v6{tag}"
        return [
            (_JEQ, 0x0800, v4, None), (_JEQ, 0x86DD, v6, "drop"),
            v4,
            (_LDB_ABS, base + 9), (_JEQ, IPPROTO_GRE, None, "drop"),
            (_LDH_ABS, base + 6), (_JSET, 0x1FFF, "drop", None),    # a later fragment
            (_LDXB_MSH, base), (_TXA, 0), (_ADD, base), (_TAX, 0), _goto("gre"),
            v6,
            (_LDB_ABS, base + 6), (_JEQ, IPPROTO_GRE, None, "drop"),
            (_LDX_IMM, base + 40), _goto("gre"),
        ]
    return _assemble([
        (_LDH_ABS, 12), (_JEQ, 0x8100, "tagged", None),
        *ip(14, "u"),
        "tagged",
        (_LDH_ABS, 16), *ip(18, "t"),
        "gre",  # X: the GRE header
        (_LDH_IND, 0), (_ST, _M_FLAGS), (_JSET, 0x4007, "drop", None),   # routing, not version 0
        (_TXA, 0), (_ADD, 4), (_ST, _M_P),
        *_add_if(0x8000, 4, "c"), *_add_if(0x2000, 4, "k"), *_add_if(0x1000, 4, "s"),
        (_LDH_IND, 2), (_JEQ, 0x22EB, "session", None), (_JEQ, 0x88BE, None, "drop"),
        (_LD_MEM, _M_FLAGS), (_JSET, 0x1000, "session", "drop"),  # type II; type I has no session
        "session",
        (_LDX_MEM, _M_P), (_LDW_IND, 0), (_AND, 0x3FF), (_JEQ, session, "accept", "drop"),
        "accept",
        (_RET, snaplen),
        "drop",
        (_RET, 0),
    ])


def join_fanout(sock: socket.socket, group: int, mode: str) -> None:
    """PACKET_FANOUT: this socket joins `group` in `mode` (FANOUT_MODES); "flow" also sets
    the group's program (every member sets the same one: the last one set is used)."""
    try:
        sock.setsockopt(SOL_PACKET, PACKET_FANOUT, (group & 0xFFFF) | FANOUT_MODES[mode] << 16)
    except OSError as e:
        if e.errno == errno.EINVAL:  # the group is there on another device or in another mode
            raise OSError(e.errno, f"cannot join fanout group {group} ({mode}): another socket in this network "
                                   "namespace holds that group on another interface or in another mode (another "
                                   "capture tool?); choose another fanout_group") from None
        raise
    if mode == "flow":
        fprog, _buf = _fprog(roce_flow_program())
        sock.setsockopt(SOL_PACKET, PACKET_FANOUT_DATA, fprog)


# -- the ring -------------------------------------------------------------------------
class RingCapture:
    """One AF_PACKET TPACKET_V3 ring on one interface (optionally in a named netns).

    block_size: bytes per block (a multiple of the page size; must hold the largest
    frame plus headers); block_nr: blocks in the ring; frame_size: the kernel's
    nominal frame slot (V3 packs packets back to back, it only sizes tp_frame_nr);
    retire_ms: a partly filled block is handed over after this long, which bounds the
    latency of a quiet link; snaplen: bytes kept per frame (origlen keeps the wire
    length); fanout: (group id, "hash"|"lb"|"cpu"|"qm") to share one interface's
    traffic among several RingCaptures; bpf: False to capture everything;
    outgoing: also capture frames this host sends on the interface (a mirror port
    only receives, so the default leaves them out).
    """

    def __init__(self, ifname: str, netns: str | None = None, *, block_size: int = 1 << 20,
                 block_nr: int = 64, frame_size: int = 16384, retire_ms: int = 20,
                 snaplen: int = 65535, fanout: tuple[int, str] | None = None,
                 bpf: bool = True, outgoing: bool = False, erspan_session: int | None = None):
        page = mmap.PAGESIZE
        if block_size % page or block_size < frame_size or frame_size % 16 or frame_size < _TPACKET3_HDRLEN:
            raise ValueError(f"{ifname}: block_size must be a multiple of {page} and >= "
                             f"frame_size, frame_size a multiple of 16 and >= {_TPACKET3_HDRLEN}")
        if fanout is not None and fanout[1] not in FANOUT_MODES:
            raise ValueError(f"{ifname}: fanout mode must be one of {sorted(FANOUT_MODES)}")
        self.ifname, self.netns = ifname, netns
        self.block_size, self.block_nr = block_size, block_nr
        self.snaplen = snaplen
        self._where = f"{ifname}" + (f" (netns {netns})" if netns else "")
        self._index = 0               # frames delivered so far (CapturedFrame.index)
        self._block = 0               # next block to look at
        self._blocks_read = 0
        # the most blocks the kernel had handed over and not yet got back, seen at any
        # read: how close the ring came to full (block_nr: it was, and dropped)
        self._ready_peak = 0
        self._totals = {"packets": 0, "drops": 0, "freeze_q_cnt": 0}
        self._vlan_restored = 0
        self._errors: dict[str, int] = {}
        self._closed = False
        self._lock = threading.Lock()  # stats() may be called from another thread
        try:
            self.sock = in_netns(netns, self._open, block_size, block_nr, frame_size,
                                 retire_ms, fanout, bpf, outgoing, erspan_session)
        except OSError as e:
            raise CaptureSetupError(e.errno, f"capture on {self._where}: {e.strerror or e}") from e
        try:
            self._ring = mmap.mmap(self.sock.fileno(), block_size * block_nr,
                                   mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            self.sock.close()
            raise CaptureSetupError(e.errno, f"capture on {self._where}: mmap of the ring: {e.strerror}") from e
        self._mv = memoryview(self._ring)
        self._array = np.frombuffer(self._ring, np.uint8)  # the Batches' buffer
        self._held = 0                # blocks read_batch handed out, not yet released
        # read_batch's arrays, reused: a block always fits (every frame takes more than
        # _MIN_FRAME_SPACE bytes of it)
        cap = max(BATCH_FRAMES, block_size // _MIN_FRAME_SPACE)
        self._arrays = [np.empty(cap, np.int64) for _ in range(5)]
        self._stream = np.zeros(cap, np.int32)
        self._linktype = np.full(cap, LINKTYPE_ETHERNET, np.int32)
        self._poll = select.poll()
        self._poll.register(self.sock.fileno(), select.POLLIN | select.POLLERR)

    def _open(self, block_size, block_nr, frame_size, retire_ms, fanout, bpf, outgoing, erspan_session):
        # Protocol 0: the socket receives nothing until bind(), so the filter and the
        # ring are in place before the first packet can arrive.
        try:
            socket.if_nametoindex(self.ifname)
        except OSError:
            raise OSError(errno.ENODEV, "no such interface") from None
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            s.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V3)
            if erspan_session is not None:  # one remote mirror session, whatever it carries
                attach_filter(s, erspan_session_filter(erspan_session, self.snaplen))
            elif bpf:
                attach_filter(s, roce_filter(self.snaplen))
            if not outgoing:
                s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            frame_nr = (block_size // frame_size) * block_nr
            req = struct.pack("=IIIIIII", block_size, block_nr, frame_size, frame_nr,
                              retire_ms, 0, 0)
            s.setsockopt(SOL_PACKET, PACKET_RX_RING, req)
            s.bind((self.ifname, ETH_P_ALL))
            if fanout is not None:
                join_fanout(s, *fanout)
            return s
        except BaseException:
            s.close()
            raise

    # -- reading ---------------------------------------------------------------------
    def fileno(self) -> int:
        return self.sock.fileno()

    def ready(self) -> bool:
        """The next block has been handed to user space."""
        off = self._block * self.block_size
        return _BLOCK.unpack_from(self._mv, off + _BLOCK_STATUS_OFF)[0] & TP_STATUS_USER != 0

    def handed_over(self) -> int:
        """Blocks the kernel has handed over and not yet read, from the next one on."""
        return _ring_index.blocks_handed_over(self._array, self.block_size, self.block_nr, self._block)

    def read_block(self, timeout: float | None = 0.0) -> list[CapturedFrame]:
        """Frames of the next retired block, waiting up to `timeout` seconds for one
        (None: forever, 0: not at all); [] when none came.  The block goes back to the
        kernel before this returns: the frames own copies of their bytes."""
        if self._closed:
            return []
        if not self.ready():
            if timeout is not None and timeout <= 0:
                return []
            for _, ev in self._poll.poll(None if timeout is None else max(1, int(timeout * 1000))):
                if ev & select.POLLERR:
                    self.take_error()
            if self._closed or not self.ready():
                return []
        # the high-water mark (stats ready_peak); read_batch has index_blocks count it
        self._ready_peak = max(self._ready_peak, self.handed_over())
        return self._take_block()

    def take_error(self) -> str | None:
        """The socket's pending error, cleared and counted (stats()["errors"]), as text.
        The kernel flags ENETDOWN when the interface goes down (capture resumes when it
        comes back up) and ENODEV-like states when it disappears; poll(2) keeps saying
        POLLERR until the error is read, so readers must call this."""
        err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if not err:
            return None
        name = errno.errorcode.get(err, str(err))
        with self._lock:
            self._errors[name] = self._errors.get(name, 0) + 1
        return f"{self._where}: {name} ({os.strerror(err)})"

    def gone(self) -> bool:
        """Whether the interface the socket was bound to no longer exists: the kernel
        unbinds a packet socket from a device it unregisters (getsockname then names no
        interface), and one made again under the name is another device, never
        captured. A link that only went down keeps its name: capture resumes when it
        comes back up."""
        try:
            return self.sock.getsockname()[0] == ""
        except OSError:
            return True

    def _take_block(self) -> list[CapturedFrame]:
        mv, base = self._mv, self._block * self.block_size
        _, num, off = _BLOCK.unpack_from(mv, base + _BLOCK_STATUS_OFF)
        frames = []
        pos = base + off
        for _ in range(num):
            (next_off, sec, nsec, snaplen, wirelen, status, mac, _net,
             _hash, tci, tpid) = _PKT.unpack_from(mv, pos)
            start = pos + mac
            data = bytes(mv[start:start + snaplen])
            if status & TP_STATUS_VLAN_VALID:
                # The NIC / the stack took the 802.1Q tag off into metadata: put it back
                # so the frame is what was on the wire.
                tpid = tpid if status & TP_STATUS_VLAN_TPID_VALID and tpid else 0x8100
                data = data[:12] + struct.pack("!HH", tpid, tci & 0xFFFF) + data[12:]
                snaplen, wirelen = snaplen + 4, wirelen + 4
                self._vlan_restored += 1
            if len(data) > self.snaplen:
                data = data[:self.snaplen]
            self._index += 1
            frames.append(CapturedFrame(self._index, sec * 1_000_000_000 + nsec, LINKTYPE_ETHERNET,
                                        len(data), wirelen, data, 0))
            pos += next_off
        # Hand the block back; a plain store suffices on the architectures Linux
        # supports for this ring (the kernel reads it with a barrier of its own).
        struct.pack_into("=I", mv, base + _BLOCK_STATUS_OFF, TP_STATUS_KERNEL)
        self._block = (self._block + 1) % self.block_nr
        self._blocks_read += 1
        return frames

    def read_batch(self, stream: int = 0, max_blocks: int | None = None) -> Batch | None:
        """Every block the kernel has handed over (at most max_blocks, never more than
        the ring has, and whole blocks up to BATCH_FRAMES frames) as one Batch whose buffer is the ring itself: frames
        are indexed in place (cython_ext/ring.pyx), with the same bytes, lengths,
        timestamps and numbering `read_block` gives. None when no block is ready.
        The blocks stay out of the kernel's hands until `release()`, which must come
        before the next read_batch; the Batch's arrays are reused by the next call."""
        if self._closed:
            return None
        if self._held:
            raise RuntimeError(f"{self._where}: read_batch before the last batch was released")
        if not self.ready():  # most calls (every ring at each turn): skip index_blocks' call setup
            return None
        offsets, caplen, origlen, ts, frame_no = self._arrays
        nb, n, restored, unrestored, ready = _ring_index.index_blocks(
            self._array, self.block_size, self.block_nr, self._block,
            self.block_nr if max_blocks is None else min(max_blocks, self.block_nr), self.snaplen, self._index,
            offsets, caplen, origlen, ts, frame_no)
        if ready > self._ready_peak:
            self._ready_peak = ready
        if nb == 0:
            return None
        self._held = nb
        self._index += n
        self._vlan_restored += restored
        if unrestored:
            with self._lock:
                self._errors["vlan_unrestored"] = self._errors.get("vlan_unrestored", 0) + unrestored
        self._stream[:n] = stream
        return Batch(self._array, offsets[:n], caplen[:n], origlen[:n], self._stream[:n],
                     self._linktype[:n], frame_no[:n], ts[:n])

    def release(self) -> None:
        """Hand the blocks of the last read_batch back to the kernel (their frames'
        bytes must not be read after this)."""
        if self._held and not self._closed:
            _ring_index.release_blocks(self._array, self.block_size, self.block_nr, self._block, self._held)
            self._block = (self._block + self._held) % self.block_nr
            self._blocks_read += self._held
        self._held = 0

    def blocks(self, stop: threading.Event | None = None, poll_s: float = 0.1) -> Iterator[list[CapturedFrame]]:
        """Blocks of frames until `stop` is set (checked at least every poll_s) or the
        capture is closed."""
        while not self._closed and not (stop is not None and stop.is_set()):
            frames = self.read_block(poll_s)
            if frames:
                yield frames

    def frames(self, stop: threading.Event | None = None, poll_s: float = 0.1) -> Iterator[CapturedFrame]:
        for block in self.blocks(stop, poll_s):
            yield from block

    __iter__ = frames

    def drain(self, idle_s: float = 0.2) -> list[CapturedFrame]:
        """Everything that arrives until the link has been quiet for idle_s (blocks are
        retired after retire_ms, so idle_s should exceed it)."""
        out = []
        while True:
            got = self.read_block(idle_s)
            if not got:
                return out
            out += got

    # -- statistics ------------------------------------------------------------------
    def stats(self) -> dict:
        """Cumulative counters.  packets: frames the filter passed (delivered or not);
        drops: of those, lost because the ring was full; freeze_q_cnt: times the ring
        filled up; delivered: frames handed to the caller so far; ready_peak: the most
        blocks of the ring (block_nr of them) ever found handed over and waiting at a
        read (read_batch or read_block), the ring's high-water mark: block_nr means it
        was full."""
        with self._lock:
            if not self._closed:
                raw = self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, _STATS3.size)
                # Reading the kernel's counters resets them: keep the running sums here.
                for k, v in zip(("packets", "drops", "freeze_q_cnt"), _STATS3.unpack(raw)):
                    self._totals[k] += v
            return {"ifname": self.ifname, "netns": self.netns, **self._totals,
                    "delivered": self._index, "blocks": self._blocks_read,
                    "block_nr": self.block_nr, "ready_peak": self._ready_peak,
                    "vlan_restored": self._vlan_restored, "errors": dict(self._errors)}

    def close(self) -> None:
        if self._closed:
            return
        self.stats()  # fold in the last counters before they disappear with the socket
        self.release()
        self._closed = True
        self._poll.unregister(self.sock.fileno())
        self._mv.release()
        del self._array, self._arrays
        try:
            self._ring.close()
        except BufferError:
            pass  # a Batch still points into the ring: the mapping goes with the last one
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"RingCapture({self._where}, {self.block_nr}x{self.block_size} B)"


# -- several rings as one source -------------------------------------------------------
def timed_wait(on_poll: Callable[[float], None] | None, wait: Callable, *args):
    """wait(*args) (a poll(2) or a wait for capture workers); on_poll, if given, gets the
    seconds it slept: the capture loop's idle time, for /status."""
    if on_poll is None:
        return wait(*args)
    t0 = time.perf_counter()
    try:
        return wait(*args)
    finally:
        on_poll(time.perf_counter() - t0)


def ring_source(captures: list[RingCapture], stop_event: threading.Event,
                errors: list[str], poll_s: float = 0.05, idle: bool = False,
                on_poll: Callable[[float], None] | None = None) -> Iterator[tuple[int, CapturedFrame | None]]:
    """(stream index, frame) from every capture, stream = position in the list, until
    stop_event is set; then whatever the rings still hold is delivered.

    Rings are visited round robin one block at a time, so a busy mirror cannot starve
    a quiet one; when none has a block ready, one poll(2) waits on all of them.  Order
    is arrival order per stream and block-interleaved across streams (the pipeline
    tolerates that: it places packets by PSN, not by arrival).  Socket errors (a link
    going down) are reported in `errors` and the stream goes on; a ring that fails is
    reported and dropped, and the others go on. With idle=True a poll that found
    nothing yields (-1, None), as ring_batches does. on_poll gets the seconds each
    poll(2) slept (the loop's idle time, for /status).
    """
    def frames(k, cap):
        block = cap.read_block(0)
        return [(k, fr) for fr in block] if block else None
    return _round_robin(captures, stop_event, errors, poll_s, idle, on_poll, frames)


def ring_batches(captures: list[RingCapture], stop_event: threading.Event,
                 errors: list[str], poll_s: float = 0.05, idle: bool = False,
                 on_poll: Callable[[float], None] | None = None,
                 turn: int = TURN_BYTES) -> Iterator[tuple[int, Batch | None]]:
    """(stream index, Batch) from every capture, as ring_source gives frames: round
    robin, each ring's ready blocks up to `turn` bytes (at least one block) as one Batch,
    one poll(2) on all rings when none is ready, socket errors reported and the stream
    going on, a failing ring dropped, and on stop what the rings already hold delivered.

    A bounded turn per ring keeps the streams within a turn of each other in
    processing order: the pipeline finalizes an iteration once a stream has gone
    FINALIZE_LAG iterations past it, so a batch spanning several iterations of one
    stream would close iterations before another stream's copies of them came in.

    A Batch's frames are the ring's own bytes: its blocks go back to the kernel when
    the consumer asks for the next item, so it must be done with the Batch by then.
    With idle=True a poll that found nothing yields (-1, None): the consumer's clock
    can move on while the mirror ports are quiet (the agreement window). on_poll gets
    the seconds each poll(2) slept."""
    def batch(k, cap):
        b = cap.read_batch(k, max(1, turn // cap.block_size))
        return None if b is None else [(k, b)]
    return _round_robin(captures, stop_event, errors, poll_s, idle, on_poll, batch, release=True)


GONE = "the interface is gone (deleted): its capture ends"


def _round_robin(captures, stop_event, errors, poll_s, idle, on_poll, read, release: bool = False):
    """The loop of ring_source and ring_batches: `read(k, capture)` gives the items one
    ring has ready (None: nothing); with `release` the ring's blocks go back to the
    kernel once its items have been consumed."""
    live = list(range(len(captures)))
    poller = select.poll()
    for k in live:
        poller.register(captures[k].fileno(), select.POLLIN | select.POLLERR)
    by_fd = {captures[k].fileno(): k for k in live}

    def fail(k, e):
        errors.append(f"capture stream {k} on {captures[k]._where}: {e}")
        live.remove(k)
        try:
            poller.unregister(captures[k].fileno())
        except (KeyError, ValueError, OSError):
            pass

    def sweep():
        got = False
        for k in list(live):
            cap = captures[k]
            try:
                items = read(k, cap)
            except (OSError, ValueError) as e:
                fail(k, e)
                continue
            if items:
                got = True
                try:
                    yield from items
                finally:
                    if release:
                        cap.release()
        return got

    while live and not stop_event.is_set():
        got = yield from sweep()
        if not got:
            ready = timed_wait(on_poll, poller.poll, int(poll_s * 1000))
            for fd, ev in ready:
                if ev & select.POLLERR and by_fd.get(fd) in live:
                    k = by_fd[fd]
                    msg = captures[k].take_error()  # e.g. the link went down
                    if captures[k].gone():  # deleted: this ring captures nothing again
                        fail(k, f"{msg + ': ' if msg else ''}{GONE}")
                    elif msg:
                        errors.append(f"capture stream {k}: {msg}")
            if idle and not ready:
                yield -1, None
    # Stop: hand over the blocks already retired, so nothing captured is silently lost.
    deadline = time.monotonic() + 1.0
    while live and time.monotonic() < deadline:
        got = yield from sweep()
        if not got:
            break
