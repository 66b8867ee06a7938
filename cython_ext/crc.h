/* CRC-32 (zlib's polynomial, reflected) and the RoCE ICRC, for the batch kernel
 * (batch.pyx); how the folding works is in crc.c. */
#ifndef CKPTD_CRC_H
#define CKPTD_CRC_H

#include <stdint.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define CKPTD_X86 1
#include <immintrin.h>
/* fold a 128-bit lane D bits on: K_lo = reflect64(x^(D+63) mod P), K_hi = reflect64(x^(D-1) mod P) */
#define K128_LO 0x65673b4600000000ULL
#define K128_HI 0x9ba54c6f00000000ULL
#define K256_LO 0x9570d49500000000ULL
#define K256_HI 0x01b5fd1d00000000ULL
#define K512_LO 0x653d982200000000ULL
#define K512_HI 0xcad38e8f00000000ULL
#define K1024_LO 0x7d657a1000000000ULL
#define K1024_HI 0x7406fa9500000000ULL
#define K95 0xccaa009e00000000ULL       /* reflect64(x^95 mod P) */
#define K63 0xb8bc676500000000ULL       /* reflect64(x^63 mod P) */
#define CRC_MU_REFL 0x1f7011641ULL      /* reflect33(floor(x^64 / P)) */
#define CRC_P_REFL 0x1db710641ULL       /* reflect33(P) */
#else
#define CKPTD_X86 0
#define K128_LO 0
#define K128_HI 0
#define K256_LO 0
#define K256_HI 0
#define K512_LO 0
#define K512_HI 0
#define K1024_LO 0
#define K1024_HI 0
#define K95 0
#define K63 0
#define CRC_MU_REFL 0
#define CRC_P_REFL 0
#endif

/* zlib's contract: crc32(crc, p, n) */
typedef uint32_t (*ckptd_crc_fn)(uint32_t, const uint8_t *, uint64_t);

uint32_t ckptd_crc_zlib(uint32_t crc, const uint8_t *p, uint64_t n);
uint32_t ckptd_crc_clmul(uint32_t crc, const uint8_t *p, uint64_t n);   /* PCLMULQDQ */
uint32_t ckptd_crc_vclmul(uint32_t crc, const uint8_t *p, uint64_t n);  /* VPCLMULQDQ, AVX2 */
/* the ICRC: crc32 of 8 x 0xFF || hdr[0:hn] || p[0:n], hn + 8 <= 128; wide: VPCLMULQDQ */
uint32_t ckptd_icrc_clmul(const uint8_t *hdr, uint64_t hn, const uint8_t *p, uint64_t n, int wide);
int ckptd_cpu_clmul(void);
int ckptd_cpu_vclmul(void);
void ckptd_crc_table_init(void);  /* once, before the first ckptd_crc_*clmul call */

#endif
