/* NCCL LL lines and coverage bitmaps, for the batch kernel (batch.pyx). */
#ifndef CKPTD_LINES_H
#define CKPTD_LINES_H

#include <stdint.h>
#include <string.h>

/* LL lines {u32 data_lo, u32 flag, u32 data_hi, u32 flag}: 1 when every flag equals
 * `flag`; the 8 data bytes of each line go to `out` unless it is NULL */
int ckptd_ll_unpack(const uint8_t *in, int64_t lines, uint32_t flag, uint8_t *out);

/* LL128 (ckptd/core/ll128.py, docs/NCCL.md section 3): `halves` whole 1024-B half blocks,
 * 8 lines of 16 u64 each, word 15 of every line the flag. 1 when every flag equals `flag`;
 * the 960 data bytes of each half go to `out` in data order unless it is NULL */
int ckptd_ll128_unpack(const uint8_t *in, int64_t halves, uint64_t flag, uint8_t *out);

/* coverage bitmaps (ckptd/core/assemble.py): element k is bit k % 8 of byte k / 8; here,
 * not in lines.c, so that the kernel's per-packet calls inline */
static inline int ckptd_bit(const uint8_t *b, int64_t k) { return (b[k >> 3] >> (k & 7)) & 1; }

/* elements of [s, s + n) covered: bit by bit to a byte boundary, then 64 at a time */
static inline int64_t ckptd_bits_count(const uint8_t *b, int64_t s, int64_t n) {
    int64_t c = 0, k = s, e = s + n;
    for (; k < e && (k & 7); k++) c += ckptd_bit(b, k);
    for (; k + 64 <= e; k += 64) { uint64_t w; memcpy(&w, b + (k >> 3), 8); c += __builtin_popcountll(w); }
    for (; k + 8 <= e; k += 8) c += __builtin_popcount(b[k >> 3]);
    for (; k < e; k++) c += ckptd_bit(b, k);
    return c;
}

/* mark [s, s + n) */
static inline void ckptd_bits_set(uint8_t *b, int64_t s, int64_t n) {
    int64_t k = s, e = s + n;
    for (; k < e && (k & 7); k++) b[k >> 3] |= (uint8_t)(1u << (k & 7));
    if (k + 8 <= e) { int64_t full = (e - k) >> 3; memset(b + (k >> 3), 0xFF, full); k += full << 3; }
    for (; k < e; k++) b[k >> 3] |= (uint8_t)(1u << (k & 7));
}

#endif
