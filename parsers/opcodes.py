"""BTH opcode table: for each opcode, its name, the extension headers that follow the
BTH (in wire order), and whether the packet may carry payload.

Sources: IBA vol. 1 sec. 9.2 / table 35 and linux drivers/infiniband/sw/rxe/rxe_opcode.c.
The top 3 bits pick the transport (RC 0x00, UC 0x20, RD 0x40, UD 0x60, CNP 0x80,
XRC 0xA0); the low 5 bits the operation.  Only RC, UC, UD and the RoCEv2 CNP are in
the table: RD is implemented by no NIC, and XRC is absent on purpose (it needs the
XRCETH and is not used by NCCL), so those codes come back as unknown rather than
being guessed at.
"""
from __future__ import annotations

from dataclasses import dataclass

# Extension header sizes, bytes.  RETH, AETH, IMMDT and DETH are decoded into objects
# by roce.py; the others are only skipped over.
EXT_LEN = {
    "RETH": 16,          # RDMA: va, rkey, dma_len
    "AETH": 4,           # ACK: syndrome, msn
    "IMMDT": 4,          # immediate data
    "DETH": 8,           # datagram: qkey, src_qp
    "ATOMICETH": 28,     # atomic request: va, rkey, swap/add, compare
    "ATOMICACKETH": 8,   # atomic response: original value
    "IETH": 4,           # send-with-invalidate: rkey to invalidate
    "FETH": 4,           # flush: selectivity / placement type
    "CNP_RSVD": 16,      # a CNP carries 16 reserved bytes after the BTH (RoCEv2 annex A17)
}

TRANSPORTS = {0x00: "RC", 0x20: "UC", 0x40: "RD", 0x60: "UD", 0x80: "CNP", 0xA0: "XRC"}


@dataclass(frozen=True)
class Opcode:
    code: int
    name: str                     # e.g. "RC_RDMA_WRITE_FIRST" (scapy's spelling)
    headers: tuple[str, ...]      # extension headers after the BTH, wire order
    payload: bool                 # may carry payload bytes
    position: str | None          # FIRST / MIDDLE / LAST / ONLY within a message; None
                                  # for feedback packets (ACKs, CNP), which are no message
    known: bool = True

    @property
    def transport(self) -> str:
        return TRANSPORTS.get(self.code & 0xE0, "?")

    @property
    def ext_len(self) -> int:
        return sum(EXT_LEN[h] for h in self.headers)

    @property
    def is_ack(self) -> bool:
        """Feedback to a requester with no data of its own: ACK/NAK, atomic ACK, CNP."""
        return self.known and self.position is None

    @property
    def starts_message(self) -> bool:
        return self.position in ("FIRST", "ONLY")

    @property
    def ends_message(self) -> bool:
        return self.position in ("LAST", "ONLY")

    @property
    def is_write(self) -> bool:
        return "_RDMA_WRITE_" in self.name

    @property
    def has_imm(self) -> bool:
        return "IMMDT" in self.headers


# (operation, code within the transport, extension headers, payload, position).
# Single-packet requests (read request, atomics, flush) are ONLY: one-packet messages.
_RC_OPS = [
    ("SEND_FIRST", 0x00, (), True, "FIRST"),
    ("SEND_MIDDLE", 0x01, (), True, "MIDDLE"),
    ("SEND_LAST", 0x02, (), True, "LAST"),
    ("SEND_LAST_WITH_IMMEDIATE", 0x03, ("IMMDT",), True, "LAST"),
    ("SEND_ONLY", 0x04, (), True, "ONLY"),
    ("SEND_ONLY_WITH_IMMEDIATE", 0x05, ("IMMDT",), True, "ONLY"),
    ("RDMA_WRITE_FIRST", 0x06, ("RETH",), True, "FIRST"),
    ("RDMA_WRITE_MIDDLE", 0x07, (), True, "MIDDLE"),
    ("RDMA_WRITE_LAST", 0x08, (), True, "LAST"),
    ("RDMA_WRITE_LAST_WITH_IMMEDIATE", 0x09, ("IMMDT",), True, "LAST"),
    ("RDMA_WRITE_ONLY", 0x0A, ("RETH",), True, "ONLY"),
    ("RDMA_WRITE_ONLY_WITH_IMMEDIATE", 0x0B, ("RETH", "IMMDT"), True, "ONLY"),
    ("RDMA_READ_REQUEST", 0x0C, ("RETH",), False, "ONLY"),
    ("RDMA_READ_RESPONSE_FIRST", 0x0D, ("AETH",), True, "FIRST"),
    ("RDMA_READ_RESPONSE_MIDDLE", 0x0E, (), True, "MIDDLE"),
    ("RDMA_READ_RESPONSE_LAST", 0x0F, ("AETH",), True, "LAST"),
    ("RDMA_READ_RESPONSE_ONLY", 0x10, ("AETH",), True, "ONLY"),
    ("ACKNOWLEDGE", 0x11, ("AETH",), False, None),
    ("ATOMIC_ACKNOWLEDGE", 0x12, ("AETH", "ATOMICACKETH"), False, None),
    ("COMPARE_SWAP", 0x13, ("ATOMICETH",), False, "ONLY"),
    ("FETCH_ADD", 0x14, ("ATOMICETH",), False, "ONLY"),
    ("SEND_LAST_WITH_INVALIDATE", 0x16, ("IETH",), True, "LAST"),
    ("SEND_ONLY_WITH_INVALIDATE", 0x17, ("IETH",), True, "ONLY"),
    # IBA 1.5 memory-placement extensions, as in rxe_opcode.c
    ("FLUSH", 0x1C, ("FETH", "RETH"), False, "ONLY"),
    ("ATOMIC_WRITE", 0x1D, ("RETH",), True, "ONLY"),
]
# UC has the SEND and RDMA WRITE operations only (no reads, acks or atomics).
_UC_OPS = [op for op in _RC_OPS if op[1] <= 0x0B]
_UD_OPS = [
    ("SEND_ONLY", 0x04, ("DETH",), True, "ONLY"),
    ("SEND_ONLY_WITH_IMMEDIATE", 0x05, ("DETH", "IMMDT"), True, "ONLY"),
]

CNP_OPCODE = 0x81

OPCODES: dict[int, Opcode] = {}
for _base, _prefix, _ops in ((0x00, "RC", _RC_OPS), (0x20, "UC", _UC_OPS), (0x60, "UD", _UD_OPS)):
    for _op, _code, _hdrs, _payload, _pos in _ops:
        OPCODES[_base + _code] = Opcode(_base + _code, f"{_prefix}_{_op}", _hdrs, _payload, _pos)
OPCODES[CNP_OPCODE] = Opcode(CNP_OPCODE, "CNP", ("CNP_RSVD",), False, None)
BY_NAME = {op.name: op for op in OPCODES.values()}


def lookup(code: int) -> Opcode:
    """The table entry for `code`; unknown codes get an entry with known=False whose
    name says which transport range they fall in, e.g. 'UNKNOWN_0xaa(XRC)'."""
    op = OPCODES.get(code)
    if op is None:
        op = Opcode(code, f"UNKNOWN_{code:#04x}({TRANSPORTS.get(code & 0xE0, '?')})", (), False,
                    None, known=False)
    return op


def name(code: int) -> str:
    return lookup(code).name
