/* NCCL LL lines and coverage bitmaps, for the batch kernel (batch.pyx). */
#include <string.h>

#include "lines.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define CKPTD_SSE2 1
#include <emmintrin.h>
#else
#define CKPTD_SSE2 0
#endif

/* ---- NCCL LL lines: {u32 data_lo, u32 flag, u32 data_hi, u32 flag} ----------------
 * Returns 1 when every flag of every line equals `flag`; writes the 8 data bytes of
 * each line to `out` (when out is not NULL). The same job as ckptd.transports.roce.extract.ll_unpack
 * two lines per SSE2 step. */
int ckptd_ll_unpack(const uint8_t *in, int64_t lines, uint32_t flag, uint8_t *out) {
    int64_t i = 0;
    uint32_t bad = 0;
#if CKPTD_SSE2
    const __m128i want = _mm_set_epi32((int)flag, 0, (int)flag, 0);
    const __m128i sel = _mm_set_epi32(-1, 0, -1, 0);       /* the flag words */
    __m128i acc = _mm_setzero_si128();
    for (; i + 2 <= lines; i += 2) {
        __m128i v0 = _mm_loadu_si128((const __m128i *)(in + 16 * i));
        __m128i v1 = _mm_loadu_si128((const __m128i *)(in + 16 * i + 16));
        acc = _mm_or_si128(acc, _mm_and_si128(_mm_xor_si128(v0, want), sel));
        acc = _mm_or_si128(acc, _mm_and_si128(_mm_xor_si128(v1, want), sel));
        if (out) {
            __m128i d0 = _mm_shuffle_epi32(v0, _MM_SHUFFLE(3, 1, 2, 0));  /* lo, hi, .. */
            __m128i d1 = _mm_shuffle_epi32(v1, _MM_SHUFFLE(3, 1, 2, 0));
            _mm_storeu_si128((__m128i *)(out + 8 * i), _mm_unpacklo_epi64(d0, d1));
        }
    }
    bad = (uint32_t)(_mm_movemask_epi8(_mm_cmpeq_epi8(acc, _mm_setzero_si128())) != 0xFFFF);
#endif
    for (; i < lines; i++) {
        uint32_t w[4];
        memcpy(w, in + 16 * i, 16);
        bad |= (w[1] != flag) | (w[3] != flag);
        if (out) { memcpy(out + 8 * i, &w[0], 4); memcpy(out + 8 * i + 4, &w[2], 4); }
    }
    return !bad;
}

/* ---- NCCL LL128 half blocks ----------------------------------------------------------
 * Half block h holds data u64 120h..120h+119 of its 2048-B block; inside it, lines m < 4
 * carry data 16m..16m+14 in words 0..14, lines 4+m carry data 64+14m..64+14m+13 in words
 * 0..13 and data 16m+15 in word 14 (the same map as ckptd.core.ll128.WIRE_TO_DATA). */
int ckptd_ll128_unpack(const uint8_t *in, int64_t halves, uint64_t flag, uint8_t *out) {
    uint64_t bad = 0;
    for (int64_t h = 0; h < halves; h++) {
        const uint8_t *src = in + 1024 * h;
        for (int m = 0; m < 8; m++) {
            uint64_t f;
            memcpy(&f, src + 128 * m + 120, 8);
            bad |= f ^ flag;
        }
        if (out) {
            uint8_t *dst = out + 960 * h;
            for (int m = 0; m < 4; m++) {
                memcpy(dst + 128 * m, src + 128 * m, 120);
                memcpy(dst + 128 * m + 120, src + 128 * (4 + m) + 112, 8);
                memcpy(dst + 512 + 112 * m, src + 128 * (4 + m), 112);
            }
        }
    }
    return !bad;
}
