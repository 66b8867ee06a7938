"""Datagram Extended Transport Header, 8 bytes: UD packets (and RD) carry it."""
from .header import Header


class DETH(Header):
    FIELDS = (
        ("qkey", 32),
        ("resv", 8),
        ("src_qp", 24),      # sender's QP: UD has no connection to name it otherwise
    )
