"""InfiniBand Base Transport Header, 12 bytes, first thing in every RoCEv2 UDP payload.

Layout from IBA vol. 1 sec. 9.2 (linux drivers/infiniband/sw/rxe/rxe_hdr.h agrees).
"""
from __future__ import annotations

from .header import Header
from .opcodes import Opcode, lookup

PSN_MASK = 0xFFFFFF


class BTH(Header):
    FIELDS = (
        ("opcode", 8),       # transport (top 3 bits) + operation; see opcodes.py
        ("se", 1),           # solicited event
        ("migreq", 1),       # path migration state
        ("padcnt", 2),       # 0..3 pad bytes between payload and ICRC
        ("tver", 4),         # transport header version, 0
        ("pkey", 16),        # partition key, 0xffff = default partition
        ("fecn", 1),         # forward ECN (byte 4 is masked out of the ICRC:
        ("becn", 1),         #   switches may set these bits in flight)
        ("resv6", 6),
        ("dest_qp", 24),     # destination queue pair number
        ("ack_req", 1),      # requester asks for an ACK for this packet
        ("resv7", 7),
        ("psn", 24),         # packet sequence number, modulo 2**24
    )

    def __init__(self, **values):
        values.setdefault("pkey", 0xFFFF)
        super().__init__(**values)

    @property
    def opcode_info(self) -> Opcode:
        """The Opcode table entry, or an 'unknown' entry (see opcodes.lookup)."""
        return lookup(self.opcode)
