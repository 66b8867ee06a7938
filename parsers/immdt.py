"""Immediate Data Extended Transport Header, 4 opaque bytes.

The IBA treats them as opaque; what they mean is up to the application.  NCCL's
net_ib puts the message size there in host order up to 2.28 (little-endian on the wire
on x86) and big-endian from 2.29, so both readings are offered and the caller picks.
"""
from .header import Header


class ImmDt(Header):
    FIELDS = (
        ("be", 32),          # the bytes read big-endian (network order)
    )

    @property
    def raw(self) -> bytes:
        return self.be.to_bytes(4, "big")

    @property
    def le(self) -> int:
        """The bytes read little-endian (how NCCL <= 2.28 on x86 writes a size)."""
        return int.from_bytes(self.raw, "little")

    @classmethod
    def from_raw(cls, raw: bytes) -> "ImmDt":
        return cls(be=int.from_bytes(raw, "big"))

    def __repr__(self):
        return f"ImmDt(raw={self.raw.hex()}, le={self.le}, be={self.be})"
