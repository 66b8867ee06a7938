"""The batch kernel's ICRC and opcode set-up, apart from the pipeline so a process that
only checks ICRCs (a capture worker, ckptd.live.workers) need not import the shadow
model's torch: which CRC implementation runs (crc_choices, crc_setting), the constants
the kernel's folding CRC uses (kept here to check batch.pyx's), the opcode tables
decode_frame needs, and `icrc_checker`, a kernel that checks ICRCs and nothing else."""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from cython_ext import batch as _kernel
from parsers.opcodes import EXT_LEN, OPCODES
from parsers.roce import _DECODED


# -- ICRC implementation ---------------------------------------------------------------------
@functools.cache
def isal_crc_address() -> int | None:
    """Address of ISA-L's crc32_gzip_refl (same contract as zlib's crc32) if the `isal`
    package is installed: it links ISA-L statically and exports the symbol."""
    try:
        import isal.isal_zlib as m
        lib = ctypes.CDLL(m.__file__)
        return ctypes.cast(lib.crc32_gzip_refl, ctypes.c_void_p).value
    except (ImportError, OSError, AttributeError):
        return None


def crc_choices() -> list[str]:
    """ICRC implementations this machine can run, fastest first."""
    cpu = _kernel.cpu_features()
    out = [name for name, ok in (("vclmul", cpu["vclmul"]), ("clmul", cpu["clmul"])) if ok]
    if isal_crc_address():
        out.append("isal")
    return out + ["zlib"]


def crc_setting(name: str) -> tuple[int, int]:
    """(kernel implementation index, external address) for a CRC name or 'auto'."""
    if name == "auto":
        name = crc_choices()[0]
    if name == "isal":
        addr = isal_crc_address()
        if not addr:
            raise ValueError("crc 'isal' needs the isal package (pip install isal)")
        return _kernel.CRC_IMPLS.index("external"), addr
    if name not in _kernel.CRC_IMPLS or name == "external":
        raise ValueError(f"unknown crc {name!r}: auto, {', '.join(crc_choices())}")
    if name != "zlib" and name not in crc_choices():
        raise ValueError(f"crc {name!r} needs CPU features this machine lacks")
    return _kernel.CRC_IMPLS.index(name), 0


def fold_constants(distance_bits: int) -> tuple[int, int]:
    """(K_lo, K_hi) the kernel folds a 128-bit lane forward by `distance_bits` with:
    reflect64(x^(D+63) mod P), reflect64(x^(D-1) mod P), P the CRC-32 polynomial.
    Kept here so the constants in batch.pyx can be checked (tests/test_fastpath.py)."""
    poly = 0x104C11DB7

    def xpow(k):
        r = 1
        for _ in range(k):
            r <<= 1
            if r >> 32:
                r ^= poly
        return r

    def reflect64(r):
        return sum(((r >> j) & 1) << (63 - j) for j in range(32))

    return reflect64(xpow(distance_bits + 63)), reflect64(xpow(distance_bits - 1))


def reduction_constants() -> tuple[int, int, int, int]:
    """The kernel's final 128 -> 32 bit reduction: reflect64(x^95 mod P),
    reflect64(x^63 mod P), reflect33(floor(x^64 / P)) and reflect33(P)."""
    poly = 0x104C11DB7
    k95, _ = fold_constants(32)   # x^(32+63) = x^95
    k63, _ = fold_constants(0)    # x^63
    mu, a = 0, 1 << 64
    while a.bit_length() >= poly.bit_length():
        shift = a.bit_length() - poly.bit_length()
        mu |= 1 << shift
        a ^= poly << shift

    def reflect33(v):
        return int(f"{v:033b}"[::-1], 2)

    return k95, k63, reflect33(mu), reflect33(poly)


# -- opcode table (parsers/opcodes.py) ------------------------------------------------------
def opcode_tables() -> dict[str, np.ndarray]:
    """Per opcode: known, may carry payload, is feedback (ACK/CNP), extension header
    bytes, and where the last header decode_frame decodes (RETH/AETH/ImmDt/DETH) ends:
    a capture cut before that is TRUNCATED."""
    known = np.zeros(256, np.uint8)
    payload = np.zeros(256, np.uint8)
    is_ack = np.zeros(256, np.uint8)
    ext_len = np.zeros(256, np.int64)
    decoded_end = np.zeros(256, np.int64)
    for code, op in OPCODES.items():
        known[code], payload[code], is_ack[code] = 1, op.payload, op.is_ack
        ext_len[code] = op.ext_len
        off = 0
        for name in op.headers:
            if name in _DECODED:
                decoded_end[code] = off + EXT_LEN[name]
            off += EXT_LEN[name]
    return dict(op_known=known, op_payload=payload, op_is_ack=is_ack, op_ext_len=ext_len,
                op_decoded_end=decoded_end)


def icrc_checker(crc: str = "auto") -> _kernel.BatchKernel:
    """A kernel that only checks ICRCs (opcode tables and a CRC), for a stage ahead of
    the one that places: the replay's reader thread (stream_batches checks every frame as
    it indexes it, which moves the CRC, ~0.04 of the kernel's ~0.11 s on issue 16's
    replay, off the core that places) and each capture worker (ckptd.live.workers, on the
    slot it has just filled). Their verdicts travel as Batch.icrc_checked; a frame whose
    ICRC is bad, or that is no RoCE, is decoded by the placing kernel as before."""
    checker = _kernel.BatchKernel(1)
    checker.set_crc(*crc_setting(crc))
    checker.set_opcodes(**opcode_tables())
    return checker
