# cython: boundscheck=False, wraparound=False, cdivision=True
"""NCCL LL lines, de-interleaved without the GIL: the same job as ckptd.extract.ll_unpack.

A line is {u32 data_lo, u32 flag, u32 data_hi, u32 flag}; every flag of a step must
equal the expected value. Returns the number of lines whose flags differ (0: intact),
and writes the 8 data bytes of each line to `out`.
"""
from libc.stdint cimport uint32_t
from libc.string cimport memcpy


def ll_unpack_into(const unsigned char[::1] payload, unsigned char[::1] out, uint32_t flag):
    cdef Py_ssize_t lines = payload.shape[0] // 16
    cdef Py_ssize_t i
    cdef Py_ssize_t bad = 0
    cdef uint32_t w[4]
    if out.shape[0] < lines * 8:
        raise ValueError(f"out holds {out.shape[0]} bytes, {lines * 8} needed")
    with nogil:
        for i in range(lines):
            memcpy(w, &payload[i * 16], 16)
            if w[1] != flag or w[3] != flag:
                bad += 1
            memcpy(&out[i * 8], &w[0], 4)
            memcpy(&out[i * 8 + 4], &w[2], 4)
    return bad
