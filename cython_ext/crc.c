/* ---- ICRC: CRC-32 (zlib's polynomial, reflected) -------------------------------
 * Stock zlib runs at 2-4 GB/s, far below a memcpy, so on x86 every frame goes
 * through a carry-less-multiply folding CRC written for this kernel: the message is
 * folded 128 bits at a time (a lane times x^D mod P moves it D bits on), then one
 * lane is reduced to 32 bits (two more folds and a Barrett step) and a < 16-byte
 * tail goes through a byte table. Fold constants K_lo = reflect64(x^(D+63) mod P),
 * K_hi = reflect64(x^(D-1) mod P): ckptd/fast/pipeline.py fold_constants(), and the
 * reduction's reduction_constants(); the tests check both and every length
 * against zlib. zlib stays the fallback where the CPU has no PCLMULQDQ. */
#include <stddef.h>
#include <string.h>
#include <zlib.h>

#include "crc.h"

uint32_t ckptd_crc_zlib(uint32_t crc, const uint8_t *p, uint64_t n) {
    while (n > 0x40000000u) {  /* zlib takes uInt lengths */
        crc = (uint32_t)crc32(crc, p, 0x40000000u); p += 0x40000000u; n -= 0x40000000u;
    }
    return n ? (uint32_t)crc32(crc, p, (uInt)n) : crc;
}

#if CKPTD_X86

__attribute__((target("pclmul,sse4.1")))
static inline __m128i ckptd_fold16(__m128i x, __m128i k, __m128i d) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                                       _mm_clmulepi64_si128(x, k, 0x11)), d);
}

/* The routines below compute the "pure" CRC register (starting at 0, no final
 * inversion) of the stream  a || p[0:n]  where `a` is a 16-byte lane already in a
 * register: zlib's crc32(c, X) is ~pure(X with ~c XORed into its first 4 bytes), and
 * leading zero bytes do not change a pure CRC, which lets the ICRC's masked headers
 * (a stack block) and the frame's payload (in the capture buffer) be one stream. */

/* finish: the last lane's register, then the < 16-byte tail a byte at a time.
 * A lane A = x^64 L + H (L: low qword) gives A x^32 = L x^96 + H x^32; fold L with
 * x^95 mod P (96 bits left), the next 32 bits with x^63 mod P (64 left), then Barrett:
 * q = floor(s_hi mu / x^32) with mu = floor(x^64 / P), r = s_lo + (q P mod x^32).
 * Derived and checked against zlib in ckptd/fast/pipeline.py's reduction_constants(). */
static uint32_t ckptd_crc_table[256];

void ckptd_crc_table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (c & 1 ? 0xEDB88320u : 0);
        ckptd_crc_table[i] = c;
    }
}

__attribute__((target("pclmul,sse4.1")))
static inline uint32_t ckptd_pure_finish(__m128i a, const uint8_t *p, uint64_t n) {
    const __m128i k = _mm_set_epi64x((long long)K63, (long long)K95);
    const __m128i m = _mm_set_epi64x((long long)CRC_P_REFL, (long long)CRC_MU_REFL);
    __m128i t = _mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00),
                              _mm_slli_si128(_mm_srli_si128(a, 8), 4));
    __m128i s = _mm_xor_si128(_mm_clmulepi64_si128(t, k, 0x10),
                              _mm_and_si128(t, _mm_set_epi64x(-1, 0)));
    uint64_t s64 = (uint64_t)_mm_extract_epi64(s, 1);
    __m128i q = _mm_clmulepi64_si128(_mm_cvtsi64_si128((long long)(s64 & 0xFFFFFFFFu)), m, 0x00);
    __m128i qp = _mm_clmulepi64_si128(_mm_cvtsi32_si128(_mm_cvtsi128_si32(q)), m, 0x10);
    uint32_t r = (uint32_t)(s64 >> 32) ^ (uint32_t)((uint64_t)_mm_cvtsi128_si64(qp) >> 32);
    for (uint64_t i = 0; i < n; i++) r = (r >> 8) ^ ckptd_crc_table[(r ^ p[i]) & 0xFF];
    return r;
}

/* PCLMULQDQ: four 128-bit lanes while 64 bytes remain, then one */
__attribute__((target("pclmul,sse4.1")))
static uint32_t ckptd_pure_clmul(__m128i a, const uint8_t *p, uint64_t n) {
    const __m128i k1 = _mm_set_epi64x((long long)K128_HI, (long long)K128_LO);
    if (n >= 112) {
        const __m128i k4 = _mm_set_epi64x((long long)K512_HI, (long long)K512_LO);
        __m128i x0 = a;
        __m128i x1 = _mm_loadu_si128((const __m128i *)p);
        __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 16));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32));
        p += 48; n -= 48;
        while (n >= 64) {
            x0 = ckptd_fold16(x0, k4, _mm_loadu_si128((const __m128i *)p));
            x1 = ckptd_fold16(x1, k4, _mm_loadu_si128((const __m128i *)(p + 16)));
            x2 = ckptd_fold16(x2, k4, _mm_loadu_si128((const __m128i *)(p + 32)));
            x3 = ckptd_fold16(x3, k4, _mm_loadu_si128((const __m128i *)(p + 48)));
            p += 64; n -= 64;
        }
        a = ckptd_fold16(x0, k1, x1);
        a = ckptd_fold16(a, k1, x2);
        a = ckptd_fold16(a, k1, x3);
    }
    while (n >= 16) { a = ckptd_fold16(a, k1, _mm_loadu_si128((const __m128i *)p)); p += 16; n -= 16; }
    return ckptd_pure_finish(a, p, n);
}

/* VPCLMULQDQ on 256-bit registers (AVX2): eight 128-bit lanes in four registers */
__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.1")))
static inline __m256i ckptd_fold32(__m256i x, __m256i k, __m256i d) {
    return _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00),
                                             _mm256_clmulepi64_epi128(x, k, 0x11)), d);
}

__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.1")))
static uint32_t ckptd_pure_vclmul(__m128i a, const uint8_t *p, uint64_t n) {
    if (n < 240) return ckptd_pure_clmul(a, p, n);
    const __m256i k8 = _mm256_set_epi64x((long long)K1024_HI, (long long)K1024_LO,
                                         (long long)K1024_HI, (long long)K1024_LO);
    const __m256i k2 = _mm256_set_epi64x((long long)K256_HI, (long long)K256_LO,
                                         (long long)K256_HI, (long long)K256_LO);
    const __m128i k1 = _mm_set_epi64x((long long)K128_HI, (long long)K128_LO);
    /* lane a comes first in the stream: the low half of the first register */
    __m256i y0 = _mm256_inserti128_si256(_mm256_castsi128_si256(a), _mm_loadu_si128((const __m128i *)p), 1);
    __m256i y1 = _mm256_loadu_si256((const __m256i *)(p + 16));
    __m256i y2 = _mm256_loadu_si256((const __m256i *)(p + 48));
    __m256i y3 = _mm256_loadu_si256((const __m256i *)(p + 80));
    p += 112; n -= 112;
    while (n >= 128) {
        y0 = ckptd_fold32(y0, k8, _mm256_loadu_si256((const __m256i *)p));
        y1 = ckptd_fold32(y1, k8, _mm256_loadu_si256((const __m256i *)(p + 32)));
        y2 = ckptd_fold32(y2, k8, _mm256_loadu_si256((const __m256i *)(p + 64)));
        y3 = ckptd_fold32(y3, k8, _mm256_loadu_si256((const __m256i *)(p + 96)));
        p += 128; n -= 128;
    }
    __m256i y = ckptd_fold32(y0, k2, y1);
    y = ckptd_fold32(y, k2, y2);
    y = ckptd_fold32(y, k2, y3);
    a = ckptd_fold16(_mm256_castsi256_si128(y), k1, _mm256_extracti128_si256(y, 1));
    while (n >= 16) { a = ckptd_fold16(a, k1, _mm_loadu_si128((const __m128i *)p)); p += 16; n -= 16; }
    return ckptd_pure_finish(a, p, n);
}

/* zlib's contract on top: crc32(crc, p, n) */
__attribute__((target("pclmul,sse4.1")))
uint32_t ckptd_crc_clmul(uint32_t crc, const uint8_t *p, uint64_t n) {
    if (n < 64) return ckptd_crc_zlib(crc, p, n);
    __m128i a = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)~crc));
    return ~ckptd_pure_clmul(a, p + 16, n - 16);
}

__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.1")))
uint32_t ckptd_crc_vclmul(uint32_t crc, const uint8_t *p, uint64_t n) {
    if (n < 64) return ckptd_crc_zlib(crc, p, n);
    __m128i a = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)~crc));
    return ~ckptd_pure_vclmul(a, p + 16, n - 16);
}

/* The ICRC: crc32 of  8 x 0xFF || hdr[0:hn] || p[0:n]  with hn + 8 <= 128. The 8-byte
 * LRH stand-in with zlib's initial ~0 XORed in is 00 00 00 00 FF FF FF FF; zero bytes
 * in front make the block a whole number of lanes, folded into one, then the rest. */
__attribute__((target("pclmul,sse4.1")))
uint32_t ckptd_icrc_clmul(const uint8_t *hdr, uint64_t hn, const uint8_t *p, uint64_t n, int wide) {
    uint8_t blk[144];
    const __m128i k1 = _mm_set_epi64x((long long)K128_HI, (long long)K128_LO);
    uint64_t len = (8 + hn + 15) & ~(uint64_t)15, z = len - 8 - hn;
    memset(blk, 0, z + 4);
    memset(blk + z + 4, 0xFF, 4);
    memcpy(blk + z + 8, hdr, hn);
    __m128i a = _mm_loadu_si128((const __m128i *)blk);
    for (uint64_t j = 16; j < len; j += 16)
        a = ckptd_fold16(a, k1, _mm_loadu_si128((const __m128i *)(blk + j)));
    return ~(wide ? ckptd_pure_vclmul(a, p, n) : ckptd_pure_clmul(a, p, n));
}

int ckptd_cpu_clmul(void) { return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"); }
int ckptd_cpu_vclmul(void) {
    return ckptd_cpu_clmul() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
}
#else
uint32_t ckptd_crc_clmul(uint32_t c, const uint8_t *p, uint64_t n) { return ckptd_crc_zlib(c, p, n); }
uint32_t ckptd_crc_vclmul(uint32_t c, const uint8_t *p, uint64_t n) { return ckptd_crc_zlib(c, p, n); }
uint32_t ckptd_icrc_clmul(const uint8_t *h, uint64_t hn, const uint8_t *p, uint64_t n, int w) { return 0; }
int ckptd_cpu_clmul(void) { return 0; }
void ckptd_crc_table_init(void) {}
int ckptd_cpu_vclmul(void) { return 0; }
#endif
