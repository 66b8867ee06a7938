"""What a RoCEv2 NIC puts on the wire for NCCL's net_ib transport.

Each connection (sender, receiver, channel) has its data QP(s) on the receiver, a
clear-to-send QP on the sender (the receiver RDMA-writes a 32-byte FIFO entry to it
before each send), and the receiver ACKs every message. Frames are built with the
header classes of parsers/, so the writer and the reader share one definition of
every field.
"""
from __future__ import annotations

import ipaddress
import struct

import numpy as np

from parsers import icrc
from parsers.aeth import AETH
from parsers.bth import BTH
from parsers.ethernet import Ethernet
from parsers.ipv4 import IPv4
from parsers.ipv6 import IPv6
from parsers.reth import RETH
from parsers.udp import UDP

from ckptd.core.psn import psn_add
from ckptd.core.schedule import LL_DATA_PER_LINE

ROCE_PORT = 4791
OP_WRITE_FIRST, OP_WRITE_MIDDLE, OP_WRITE_LAST_IMM, OP_WRITE_ONLY, OP_WRITE_ONLY_IMM = 6, 7, 9, 10, 11
OP_ACK = 17


def ll_encode(data: bytes, flag: int) -> bytes:
    """NCCL LL lines: {u32 data_lo, u32 flag, u32 data_hi, u32 flag} per 8 data bytes."""
    lines = -(-len(data) // LL_DATA_PER_LINE)
    words = np.zeros((lines, 4), "<u4")
    padded = np.frombuffer(data.ljust(lines * LL_DATA_PER_LINE, b"\0"), "<u4").reshape(lines, 2)
    words[:, 0], words[:, 2] = padded[:, 0], padded[:, 1]
    words[:, 1] = words[:, 3] = flag
    return words.tobytes()


class Host:
    def __init__(self, addr: str, mac: int):
        self.ip = ipaddress.ip_address(addr)
        self.mac = mac


def ip_udp_frame(src: Host, dst: Host, sport: int, dport: int, payload: bytes, ttl: int = 64) -> bytes:
    """Ethernet / IPv4|IPv6 / UDP / payload, with a valid IPv4 header checksum."""
    udp = UDP(sport=sport, dport=dport, ulen=8 + len(payload), checksum=0).pack()
    if src.ip.version == 4:
        ip = IPv4(version=4, ihl=5, total_len=20 + len(udp) + len(payload), df=1, ttl=ttl,
                  proto=17, src=int(src.ip), dst=int(dst.ip))
        ip.checksum = ip.header_checksum()
        eth = Ethernet.build(dst.mac, src.mac, 0x0800)
    else:
        ip = IPv6(version=6, plen=len(udp) + len(payload), nxt=17, hlim=ttl,
                  src=int(src.ip), dst=int(dst.ip))
        eth = Ethernet.build(dst.mac, src.mac, 0x86DD)
    return eth.pack() + ip.pack() + udp + payload


def roce_frame(src: Host, dst: Host, sport: int, bth: BTH, ext: bytes, payload: bytes) -> bytes:
    """A complete RoCEv2 frame with pad and a correct ICRC."""
    pad = -len(payload) % 4
    bth.padcnt = pad
    body = bth.pack() + ext + payload + b"\0" * pad
    frame = bytearray(ip_udp_frame(src, dst, sport, ROCE_PORT, body + b"\0\0\0\0"))
    ip_off = 14
    udp_off = ip_off + (20 if src.ip.version == 4 else 40)
    end = len(frame) - 4
    frame[end:] = icrc.pack(icrc.compute(frame, ip_off, udp_off, end))
    return bytes(frame)


class QueuePair:
    """The send side of one RC QP: where its packets go and the next PSN."""

    def __init__(self, src: Host, dst: Host, dest_qp: int, src_qp: int, psn: int, sport: int):
        self.src, self.dst = src, dst
        self.dest_qp, self.src_qp = dest_qp, src_qp
        self.psn = psn
        self.sport = sport
        self.msn = 0

    def write(self, payload: bytes, mtu: int, va: int, rkey: int, imm: bytes | None) -> list[tuple]:
        """One RDMA WRITE[_WITH_IMM] message -> [(frame, first_psn_of_packet, is_last)]."""
        n = max(1, -(-len(payload) // mtu))
        out = []
        for i in range(n):
            chunk = payload[i * mtu:(i + 1) * mtu]
            first, last = i == 0, i == n - 1
            if n == 1:
                op = OP_WRITE_ONLY_IMM if imm is not None else OP_WRITE_ONLY
            elif first:
                op = OP_WRITE_FIRST
            elif last:
                op = OP_WRITE_LAST_IMM if imm is not None else 8
            else:
                op = OP_WRITE_MIDDLE
            ext = b""
            if first:
                ext += RETH(va=va, rkey=rkey, dma_len=len(payload)).pack()
            if last and imm is not None:
                ext += imm
            bth = BTH(opcode=op, pkey=0xFFFF, dest_qp=self.dest_qp, ack_req=int(last), psn=self.psn)
            out.append((roce_frame(self.src, self.dst, self.sport, bth, ext, chunk), self.psn, last))
            self.psn = psn_add(self.psn, 1)
        return out

    def ack(self, psn: int) -> bytes:
        """The responder's ACK of everything up to psn (sent from dst back to src)."""
        self.msn = (self.msn + 1) & 0xFFFFFF
        bth = BTH(opcode=OP_ACK, pkey=0xFFFF, dest_qp=self.src_qp, psn=psn)
        return roce_frame(self.dst, self.src, self.sport, bth, AETH(syndrome=0, msn=self.msn).pack(), b"")


def imm_bytes(size: int, big_endian: bool) -> bytes:
    """NCCL's immediate is the send size in host order (<= 2.28) or network order (2.29+)."""
    return struct.pack(">I" if big_endian else "<I", size)
