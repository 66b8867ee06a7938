"""RoCEv2 packet sequence numbers: 24-bit, all arithmetic modulo 2**24.

Every PSN computation in ckptd goes through this module, so wrap-around is handled
in one place (IBA spec vol. 1, 9.7.1; linux drivers/infiniband/sw/rxe/rxe_hdr.h).
"""
PSN_BITS = 24
PSN_MOD = 1 << PSN_BITS
PSN_MASK = PSN_MOD - 1
_HALF = PSN_MOD >> 1


def psn_add(psn: int, n: int) -> int:
    """The PSN n packets after psn."""
    return (psn + n) & PSN_MASK


def psn_diff(a: int, b: int) -> int:
    """a - b as a signed distance in (-2**23, 2**23]: how far a lies after b."""
    d = (a - b) & PSN_MASK
    return d - PSN_MOD if d > _HALF else d


def psn_unwrap(psn: int, near: int) -> int:
    """The unbounded packet position whose low 24 bits are psn, closest to `near`.

    `near` is an unbounded position (a previous packet's); the result can be
    compared and subtracted without ever wrapping.
    """
    return near + psn_diff(psn, near & PSN_MASK)
