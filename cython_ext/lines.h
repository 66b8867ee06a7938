/* NCCL LL lines and coverage bitmaps, for the batch kernel (batch.pyx). */
#ifndef CKPTD_LINES_H
#define CKPTD_LINES_H

#include <stdint.h>

/* LL lines {u32 data_lo, u32 flag, u32 data_hi, u32 flag}: 1 when every flag equals
 * `flag`; the 8 data bytes of each line go to `out` unless it is NULL */
int ckptd_ll_unpack(const uint8_t *in, int64_t lines, uint32_t flag, uint8_t *out);

/* coverage bitmaps (ckptd/core/assemble.py): element k is bit k % 8 of byte k / 8 */
static inline int ckptd_bit(const uint8_t *b, int64_t k) { return (b[k >> 3] >> (k & 7)) & 1; }
int64_t ckptd_bits_count(const uint8_t *b, int64_t s, int64_t n);  /* set bits in [s, s + n) */
void ckptd_bits_set(uint8_t *b, int64_t s, int64_t n);              /* set [s, s + n) */

#endif
