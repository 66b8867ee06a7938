"""Base class for fixed-layout network headers, and the two decode errors.

A protocol module declares its fields once, as ``(name, width in bits)`` in wire
order; this class derives unpack, pack, equality and repr from that list.  Widths are
in bits rather than struct codes because RoCE packs flags and 24-bit numbers into
shared bytes (BTH byte 1 holds four fields), and one declaration style for every
header keeps each module comparable, line by line, with the figure in its spec.
All fields are unsigned and big-endian (network order), as on the wire.
"""
from __future__ import annotations


class NeedData(ValueError):
    """The buffer ends before the header does (a truncated capture)."""


class Malformed(ValueError):
    """The header is all there but its contents are impossible (bad version, length...)."""


class Header:
    FIELDS: tuple[tuple[str, int], ...] = ()
    LEN = 0  # bytes on the wire, derived from FIELDS

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        bits = sum(width for _, width in cls.FIELDS)
        if bits % 8:
            raise TypeError(f"{cls.__name__}: fields add up to {bits} bits, not whole bytes")
        cls.LEN = bits // 8

    def __init__(self, **values):
        for name, _ in self.FIELDS:
            setattr(self, name, values.pop(name, 0))
        if values:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(values)}")

    @property
    def hdr_len(self) -> int:
        """Bytes this header occupies; variable-length headers override this."""
        return self.LEN

    @classmethod
    def unpack(cls, buf, offset: int = 0):
        """Read the fixed part of the header at buf[offset:]."""
        end = offset + cls.LEN
        if offset < 0 or end > len(buf):
            raise NeedData(f"{cls.__name__} needs {cls.LEN} bytes at offset {offset}, "
                           f"{max(0, len(buf) - offset)} left")
        word = int.from_bytes(buf[offset:end], "big")
        obj = cls.__new__(cls)
        shift = cls.LEN * 8
        for name, width in cls.FIELDS:
            shift -= width
            setattr(obj, name, (word >> shift) & ((1 << width) - 1))
        return obj

    def pack(self) -> bytes:
        word = 0
        for name, width in self.FIELDS:
            value = getattr(self, name)
            if not 0 <= value < (1 << width):
                raise ValueError(f"{type(self).__name__}.{name}={value!r} does not fit {width} bits")
            word = (word << width) | value
        return word.to_bytes(self.LEN, "big")

    def fields(self) -> dict:
        """The declared fields as a dict (handy for comparisons and JSON)."""
        return {name: getattr(self, name) for name, _ in self.FIELDS}

    def __eq__(self, other):
        return type(self) is type(other) and self.fields() == other.fields()

    def __repr__(self):
        body = ", ".join(f"{k}={v:#x}" if v > 9 else f"{k}={v}" for k, v in self.fields().items())
        return f"{type(self).__name__}({body})"
