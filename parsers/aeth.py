"""ACK Extended Transport Header, 4 bytes (IBA vol. 1 sec. 9.3.5).

The syndrome's top 3 bits say ACK / RNR NAK / NAK; the low 5 bits are a credit count
(ACK), a timer code (RNR NAK) or an error code (NAK).
"""
from .header import Header

_KINDS = {0b000: "ACK", 0b001: "RNR_NAK", 0b011: "NAK"}
_NAK_CODES = {0: "PSN_SEQUENCE_ERROR", 1: "INVALID_REQUEST", 2: "REMOTE_ACCESS_ERROR",
              3: "REMOTE_OPERATIONAL_ERROR", 4: "INVALID_RD_REQUEST"}


class AETH(Header):
    FIELDS = (
        ("syndrome", 8),
        ("msn", 24),         # message sequence number of the last completed message
    )

    @property
    def kind(self) -> str:
        return _KINDS.get(self.syndrome >> 5, "RESERVED")

    @property
    def value(self) -> int:
        """Credit count, RNR timer or NAK code, depending on kind."""
        return self.syndrome & 0x1F

    @property
    def nak_reason(self) -> str | None:
        return _NAK_CODES.get(self.value, "RESERVED") if self.kind == "NAK" else None
