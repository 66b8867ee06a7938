"""The extractors a user would otherwise write: dpkt or scapy, a few lines each.

Both do the minimum that still yields usable data, and less than ckptd does: parse
Ethernet / IPv4|IPv6 / UDP 4791 / BTH, check the ICRC (zlib over the masked headers, as
parsers/icrc.py describes it), keep RDMA WRITE payloads (de-interleaving NCCL LL lines
and checking their flags) keyed by flow and PSN. No flow binding, no schedule, no
iteration buffers, no coverage: the comparison flatters them.

    extract_dpkt(pcap_bytes, ll)  -> (payloads {(src, dst, dqp): {psn: bytes}}, counts)
    extract_scapy(pcap_bytes, ll, limit) -> the same, for the first `limit` frames
"""
from __future__ import annotations

import io
import struct
import zlib
from collections import Counter

import numpy as np

WRITE_OPCODES = {6, 7, 8, 9, 11}          # RC RDMA WRITE FIRST/MIDDLE/LAST/LAST_IMM/ONLY_IMM
RETH_OPCODES, IMM_OPCODES = {6, 11}, {9, 11}
LRH_CRC = zlib.crc32(b"\xff" * 8)


def _payload(roce: bytes, ll: bool, counts: Counter) -> bytes | None:
    opcode, pad = roce[0], (roce[1] >> 4) & 3
    hdr = 12 + (16 if opcode in RETH_OPCODES else 0) + (4 if opcode in IMM_OPCODES else 0)
    payload = roce[hdr:len(roce) - 4 - pad]
    if ll and payload:
        if len(payload) % 16:  # not LL lines: some other RDMA traffic
            counts["not_ll"] += 1
            return None
        words = np.frombuffer(payload, "<u4").reshape(-1, 4)
        if not ((words[:, 1] == words[0, 1]).all() and (words[:, 3] == words[0, 1]).all()):
            counts["ll_flag_mismatch"] += 1
            return None
        payload = words[:, 0::2].tobytes()
    return payload


def _icrc_ok(frame: bytes, ip_off: int, ip_hdr_len: int, v6: bool) -> bool:
    """ICRC over 8 x 0xFF, IP/UDP/BTH with the variant fields set to ones, the rest."""
    udp = ip_off + ip_hdr_len
    m = bytearray(frame[ip_off:udp + 20])
    if v6:
        m[0] |= 0x0F
        m[1:4] = b"\xff\xff\xff"
        m[7] = 0xFF
    else:
        m[1] = m[8] = 0xFF
        m[10:12] = b"\xff\xff"
    m[ip_hdr_len + 6:ip_hdr_len + 8] = b"\xff\xff"
    m[ip_hdr_len + 12] = 0xFF
    end = len(frame) - 4
    crc = zlib.crc32(memoryview(frame)[udp + 20:end], zlib.crc32(m, LRH_CRC))
    return crc == struct.unpack_from("<I", frame, end)[0]


def extract_dpkt(pcap_bytes: bytes, ll: bool):
    import dpkt

    out: dict = {}
    counts: Counter = Counter()
    for _, buf in dpkt.pcap.Reader(io.BytesIO(pcap_bytes)):
        counts["frames"] += 1
        eth = dpkt.ethernet.Ethernet(buf)
        ip = eth.data
        v6 = isinstance(ip, dpkt.ip6.IP6)
        if not (v6 or isinstance(ip, dpkt.ip.IP)):
            continue
        udp = ip.data
        if not isinstance(udp, dpkt.udp.UDP) or udp.dport != 4791:
            continue
        roce = udp.data
        if not _icrc_ok(buf, 14, 40 if v6 else ip.hl * 4, v6):
            counts["bad_icrc"] += 1
            continue
        if roce[0] not in WRITE_OPCODES:
            continue
        payload = _payload(roce, ll, counts)
        if payload is None:
            continue
        dqp, psn = int.from_bytes(roce[5:8], "big"), int.from_bytes(roce[9:12], "big")
        out.setdefault((ip.src, ip.dst, dqp), {})[psn] = payload
        counts["payloads"] += 1
    return out, counts


def extract_scapy(pcap_bytes: bytes, ll: bool, limit: int | None = None):
    from scapy.contrib.roce import BTH
    from scapy.layers.inet import IP
    from scapy.layers.inet6 import IPv6
    from scapy.utils import PcapReader

    out: dict = {}
    counts: Counter = Counter()
    for pkt in PcapReader(io.BytesIO(pcap_bytes)):
        if limit is not None and counts["frames"] >= limit:
            break
        counts["frames"] += 1
        if BTH not in pkt:
            continue
        bth = pkt[BTH]
        if bth.compute_icrc(None) != struct.pack("!I", bth.icrc):
            counts["bad_icrc"] += 1
            continue
        if bth.opcode not in WRITE_OPCODES:
            continue
        ip = pkt[IPv6] if IPv6 in pkt else pkt[IP]
        roce = bytes(bth)  # BTH, extension headers, payload, pad and ICRC
        payload = _payload(roce, ll, counts)
        if payload is None:
            continue
        out.setdefault((ip.src, ip.dst, bth.dqpn), {})[bth.psn] = payload
        counts["payloads"] += 1
    return out, counts
