"""UDP header (RFC 768)."""
from __future__ import annotations

from .header import Header, Malformed

ROCEV2_PORT = 4791   # IANA port for RoCEv2; the source port is flow entropy only


class UDP(Header):
    FIELDS = (
        ("sport", 16),
        ("dport", 16),
        ("ulen", 16),      # header + payload, bytes
        ("checksum", 16),  # masked out of the RoCE ICRC
    )

    @classmethod
    def unpack(cls, buf, offset=0):
        udp = super().unpack(buf, offset)
        if udp.ulen < cls.LEN:
            raise Malformed(f"UDP length {udp.ulen} < 8")
        return udp
