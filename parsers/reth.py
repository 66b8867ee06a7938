"""RDMA Extended Transport Header, 16 bytes: where an RDMA WRITE/READ goes.

Only the FIRST and ONLY packets of a WRITE carry it (and READ REQUEST); the dma_len
is the length of the whole message, not of this packet.
"""
from .header import Header


class RETH(Header):
    FIELDS = (
        ("va", 64),          # remote virtual address
        ("rkey", 32),        # remote key of the memory region
        ("dma_len", 32),     # bytes in the whole message (0 is legal)
    )
