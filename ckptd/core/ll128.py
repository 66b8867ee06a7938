"""LL128 wire layout: where NCCL's LL128 protocol puts each data word and each flag.

A warp sends every 1920 data bytes (240 u64) as one 2048-byte wire block: 16 lines of
16 u64, word 15 of every line the flag = the connection's step + 1 as a full u64. Inside
a block the data words are permuted (docs/NCCL.md section 3, from device/prims_ll128.h:
107,149,280-306@v2.22.3, the same in 2.19-2.31): each half h of the block (lines 8h..8h+7)
holds data words 120h..120h+119; lines 8h+m (m < 4) carry 15 consecutive words, lines
8h+4+m carry 14 more and, in word 14, the 16th word of line 8h+m. A partial last block is
still sent whole; the words past the data are whatever the registers held.
"""
from __future__ import annotations

import numpy as np

LINE_WORDS = 16
FLAG_WORD = 15
BLOCK_WORDS = 256  # 2048 B
BLOCK_DATA_WORDS = 240  # 1920 B
BLOCK_BYTES = BLOCK_WORDS * 8
BLOCK_DATA_BYTES = BLOCK_DATA_WORDS * 8
FLAG_MASK = (1 << 64) - 1


def _wire_to_data() -> np.ndarray:
    """For each wire u64 of a block, the data u64 it carries (-1: the line's flag)."""
    m = np.full(BLOCK_WORDS, -1, np.int64)
    for h in (0, 1):
        for k in range(4):
            line = LINE_WORDS * (8 * h + k)
            m[line:line + 15] = 120 * h + 16 * k + np.arange(15)
            line = LINE_WORDS * (8 * h + 4 + k)
            m[line:line + 14] = 120 * h + 64 + 14 * k + np.arange(14)
            m[line + 14] = 120 * h + 16 * k + 15
    return m


WIRE_TO_DATA = _wire_to_data()
DATA_WIRE_WORDS = np.flatnonzero(WIRE_TO_DATA >= 0)  # wire positions of data words, in wire order
DATA_TO_WIRE = DATA_WIRE_WORDS[np.argsort(WIRE_TO_DATA[DATA_WIRE_WORDS])]  # data word d sits at wire DATA_TO_WIRE[d]


def encode(data: bytes, flag: int, pad: int = 0) -> bytes:
    """The wire blocks NCCL writes for `data` at a step whose flag is `flag`; the words past
    the data in the last block are filled with byte `pad` (NCCL leaves register garbage)."""
    nblocks = -(-len(data) // BLOCK_DATA_BYTES)
    padded = data.ljust(nblocks * BLOCK_DATA_BYTES, bytes([pad]))
    dwords = np.frombuffer(padded, "<u8").reshape(nblocks, BLOCK_DATA_WORDS)
    wire = np.empty((nblocks, BLOCK_WORDS), "<u8")
    wire[:, DATA_TO_WIRE] = dwords
    wire[:, FLAG_WORD::LINE_WORDS] = flag & FLAG_MASK
    return wire.tobytes()


def decode(wire, wire_offset: int, expected_flag: int | None):
    """Read whole lines at byte `wire_offset` of a send's wire bytes.

    Returns (runs, flag seen, all flags equal expected): runs are (data byte offset within the
    send, bytes) of data contiguous in the send, in data order, padding included (the caller
    cuts at the send's length). A part of a block (a packet smaller than 1024 B, or a QP's
    share of a split send) can hold non-adjacent data words, hence several runs."""
    if wire_offset % (LINE_WORDS * 8) or len(wire) % (LINE_WORDS * 8):
        raise ValueError("LL128 payload is not whole 128-byte lines")
    words = np.frombuffer(wire, "<u8")
    if len(words) == 0:
        return [], expected_flag, True
    flags = words[FLAG_WORD::LINE_WORDS]
    flag = int(flags[0])
    want = flag if expected_flag is None else expected_flag & FLAG_MASK
    ok = bool((flags == want).all())
    pos = wire_offset // 8 + np.arange(len(words))
    d = WIRE_TO_DATA[pos % BLOCK_WORDS]
    keep = d >= 0
    idx = (pos[keep] // BLOCK_WORDS) * BLOCK_DATA_WORDS + d[keep]
    order = np.argsort(idx, kind="stable")
    idx, vals = idx[order], words[keep][order]
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
    runs = []
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(idx)]):
        runs.append((int(idx[lo]) * 8, vals[lo:hi].tobytes()))
    return runs, flag, ok
