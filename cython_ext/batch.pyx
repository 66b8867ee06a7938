# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The batch kernel: decode + place + assemble for many frames in one pass, without the GIL.

It is the compiled twin of the reference path, stage for stage and name for name:

    decode_frame, icrc_ok     parsers/roce.py decode_frame (link layer with VLAN/QinQ tags,
                              IPv4/IPv6 and extension headers, UDP 4791, BTH, extension
                              headers, FrameClass precedence) and parsers/icrc.py verify
    lookup_flow               ckptd/transports/roce/flows.py FlowBinder.bound (bindings made in Python)
    place, find_message,      ckptd/transports/roce/extract.py Extractor._place: FlowBinder.locate (PSN
    check, _reject            unwrap, FlowTimeline), Extractor._check, LL lines and flags
                              (ll_unpack), counters
    ack                       Extractor.feed's ACK branch
    assemble                  ckptd/core/assemble.py IterationAssembly.place: copy, coverage
                              (total, per stream, per bucket), conflicts

The kernel never decides anything the reference has not already decided for it: flows
are bound by Python's FlowBinder and registered here; LL flag bases are learned by the
reference Extractor and copied here; iterations are opened and finalized by the Python
pipeline and their IterationAssembly arrays handed in. Whenever a frame needs a
decision the kernel does not hold (a flow it does not know, an iteration it does not
track, a connection whose flag base is unknown, a rejection the reference must describe
in its examples, a GRE-wrapped frame, ...), `run` stops *before* changing any state for
that frame and returns its index and the reason; Python runs the reference path on that
one frame, updates the kernel's tables and resumes at the next frame. After a frame that
completed a bucket it stops too, so the pipeline steps and commits when the reference
would. So frames are processed in exactly the order the reference processes them, and
every counter, buffer and coverage map comes out identical.
"""
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

import numpy as np

cdef extern from *:
    """
    /* ---- ICRC: CRC-32 (zlib's polynomial, reflected) -------------------------------
     * Stock zlib runs at 2-4 GB/s, far below a memcpy, so on x86 every frame goes
     * through a carry-less-multiply folding CRC written for this kernel: the message is
     * folded 128 bits at a time (a lane times x^D mod P moves it D bits on), then one
     * lane is reduced to 32 bits (two more folds and a Barrett step) and a < 16-byte
     * tail goes through a byte table. Fold constants K_lo = reflect64(x^(D+63) mod P),
     * K_hi = reflect64(x^(D-1) mod P): ckptd/fast/pipeline.py fold_constants(), and the
     * reduction's reduction_constants(); the tests check both and every length
     * against zlib. zlib stays the fallback where the CPU has no PCLMULQDQ. */
    #include <stdint.h>
    #include <stddef.h>
    #include <string.h>
    #include <zlib.h>

    typedef uint32_t (*ckptd_crc_fn)(uint32_t, const uint8_t *, uint64_t);

    static uint32_t ckptd_crc_zlib(uint32_t crc, const uint8_t *p, uint64_t n) {
        while (n > 0x40000000u) {  /* zlib takes uInt lengths */
            crc = (uint32_t)crc32(crc, p, 0x40000000u); p += 0x40000000u; n -= 0x40000000u;
        }
        return n ? (uint32_t)crc32(crc, p, (uInt)n) : crc;
    }

    #if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    #define CKPTD_X86 1
    #include <immintrin.h>
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

    static void ckptd_crc_table_init(void) {
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
    static uint32_t ckptd_crc_clmul(uint32_t crc, const uint8_t *p, uint64_t n) {
        if (n < 64) return ckptd_crc_zlib(crc, p, n);
        __m128i a = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)~crc));
        return ~ckptd_pure_clmul(a, p + 16, n - 16);
    }

    __attribute__((target("avx2,vpclmulqdq,pclmul,sse4.1")))
    static uint32_t ckptd_crc_vclmul(uint32_t crc, const uint8_t *p, uint64_t n) {
        if (n < 64) return ckptd_crc_zlib(crc, p, n);
        __m128i a = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)~crc));
        return ~ckptd_pure_vclmul(a, p + 16, n - 16);
    }

    /* The ICRC: crc32 of  8 x 0xFF || hdr[0:hn] || p[0:n]  with hn + 8 <= 128. The 8-byte
     * LRH stand-in with zlib's initial ~0 XORed in is 00 00 00 00 FF FF FF FF; zero bytes
     * in front make the block a whole number of lanes, folded into one, then the rest. */
    __attribute__((target("pclmul,sse4.1")))
    static uint32_t ckptd_icrc_clmul(const uint8_t *hdr, uint64_t hn, const uint8_t *p, uint64_t n, int wide) {
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

    static int ckptd_cpu_clmul(void) { return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"); }
    static int ckptd_cpu_vclmul(void) {
        return ckptd_cpu_clmul() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
    }
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
    static uint32_t ckptd_crc_clmul(uint32_t c, const uint8_t *p, uint64_t n) { return ckptd_crc_zlib(c, p, n); }
    static uint32_t ckptd_crc_vclmul(uint32_t c, const uint8_t *p, uint64_t n) { return ckptd_crc_zlib(c, p, n); }
    static uint32_t ckptd_icrc_clmul(const uint8_t *h, uint64_t hn, const uint8_t *p, uint64_t n, int w) { return 0; }
    static int ckptd_cpu_clmul(void) { return 0; }
    static void ckptd_crc_table_init(void) {}
    #define K95 0
    #define K63 0
    #define CRC_MU_REFL 0
    #define CRC_P_REFL 0
    static int ckptd_cpu_vclmul(void) { return 0; }
    #endif

    /* ---- NCCL LL lines: {u32 data_lo, u32 flag, u32 data_hi, u32 flag} ----------------
     * Returns 1 when every flag of every line equals `flag`; writes the 8 data bytes of
     * each line to `out` (when out is not NULL). The same job as ckptd.transports.roce.extract.ll_unpack
     * two lines per SSE2 step. */
    static int ckptd_ll_unpack(const uint8_t *in, int64_t lines, uint32_t flag, uint8_t *out) {
        int64_t i = 0;
        uint32_t bad = 0;
    #if CKPTD_X86
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

    /* ---- coverage bitmaps (ckptd/core/assemble.py: element k is bit k % 8 of byte k / 8) ---- */
    static inline int ckptd_bit(const uint8_t *b, int64_t k) { return (b[k >> 3] >> (k & 7)) & 1; }

    /* elements of [s, s + n) covered: bit by bit to a byte boundary, then 64 at a time */
    static int64_t ckptd_bits_count(const uint8_t *b, int64_t s, int64_t n) {
        int64_t c = 0, k = s, e = s + n;
        for (; k < e && (k & 7); k++) c += ckptd_bit(b, k);
        for (; k + 64 <= e; k += 64) { uint64_t w; memcpy(&w, b + (k >> 3), 8); c += __builtin_popcountll(w); }
        for (; k + 8 <= e; k += 8) c += __builtin_popcount(b[k >> 3]);
        for (; k < e; k++) c += ckptd_bit(b, k);
        return c;
    }

    static void ckptd_bits_set(uint8_t *b, int64_t s, int64_t n) {
        int64_t k = s, e = s + n;
        for (; k < e && (k & 7); k++) b[k >> 3] |= (uint8_t)(1u << (k & 7));
        if (k + 8 <= e) { int64_t full = (e - k) >> 3; memset(b + (k >> 3), 0xFF, full); k += full << 3; }
        for (; k < e; k++) b[k >> 3] |= (uint8_t)(1u << (k & 7));
    }
    """
    ctypedef uint32_t (*ckptd_crc_fn)(uint32_t, const uint8_t *, uint64_t) noexcept nogil
    uint32_t ckptd_crc_zlib(uint32_t crc, const uint8_t *p, uint64_t n) noexcept nogil
    uint32_t ckptd_crc_clmul(uint32_t crc, const uint8_t *p, uint64_t n) noexcept nogil
    uint32_t ckptd_crc_vclmul(uint32_t crc, const uint8_t *p, uint64_t n) noexcept nogil
    int ckptd_cpu_clmul() noexcept nogil
    int ckptd_cpu_vclmul() noexcept nogil
    uint32_t ckptd_icrc_clmul(const uint8_t *hdr, uint64_t hn, const uint8_t *p, uint64_t n, int wide) noexcept nogil
    uint64_t K128_LO, K128_HI, K256_LO, K256_HI, K512_LO, K512_HI, K1024_LO, K1024_HI
    uint64_t K95, K63, CRC_MU_REFL, CRC_P_REFL
    void ckptd_crc_table_init() noexcept nogil
    int ckptd_ll_unpack(const uint8_t *inp, int64_t lines, uint32_t flag, uint8_t *out) noexcept nogil
    int ckptd_bit(const uint8_t *b, int64_t k) noexcept nogil
    int64_t ckptd_bits_count(const uint8_t *b, int64_t s, int64_t n) noexcept nogil
    void ckptd_bits_set(uint8_t *b, int64_t s, int64_t n) noexcept nogil


# -- constants shared with ckptd/fast/pipeline.py ---------------------------------------------
# Link types (parsers/frame.py)
cdef enum:
    LT_ETHERNET = 1
    LT_RAW = 101
    LT_LINUX_SLL = 113
    LT_IPV4 = 228
    LT_IPV6 = 229
    LT_LINUX_SLL2 = 276

# Frame classes: index into the per-stream class counts (order: CLASS_NAMES)
cdef enum:
    K_FRAMES = 0
    K_ROCE_DATA = 1
    K_ROCE_ACK = 2
    K_OTHER = 3
    K_TRUNCATED = 4
    K_BAD_ICRC = 5
    K_UNKNOWN_OPCODE = 6
    K_MALFORMED = 7
    K_OTHER_ROCE = 8
    NCLASSES = 9
    K_ENCAPSULATED = -1  # GRE (ERSPAN): the reference decapsulates it
CLASS_NAMES = ("frames", "roce_data", "roce_ack", "other", "truncated", "bad_icrc",
               "unknown_opcode", "malformed", "other_roce")

# Extractor counters (ckptd/transports/roce/extract.py) plus the pipeline's `late`
cdef enum:
    C_BEFORE_START = 0
    C_SCHEDULE_MISMATCH = 1
    C_LL_FLAG_MISMATCH = 2
    C_UNRELATED = 3
    C_AG_PACKETS = 4
    C_RS_PACKETS = 5
    C_LATE = 6
    C_ACKS = 7
    NCOUNTERS = 8
COUNTER_NAMES = ("before_start", "schedule_mismatch", "ll_flag_mismatch", "unrelated",
                 "ag_packets", "rs_packets", "late", "acks")

# Why `run` stopped (0: it reached the end of the range)
cdef enum:
    STOP_END = 0
    STOP_UNKNOWN_FLOW = 1  # flow not in the table: FlowBinder must see it
    STOP_ITERATION = 2  # iteration not open (or not held by the kernel)
    STOP_FLAG_BASE = 3  # LL connection whose flag base is not learned yet
    STOP_EXAMPLE = 4  # a rejection, while the reference still keeps examples
    STOP_RS_DUMP = 5  # reduce-scatter step 0 while gradients are dumped
    STOP_RANGE = 6  # placement past the bucket's end: the reference raises
    STOP_CONFLICTS_FULL = 7  # conflict buffer full: drain and resume at this frame
    STOP_ACK = 8  # an ACK the FlowBinder still learns from (its hop is not bound yet)
    STOP_ENCAPSULATED = 9  # GRE/ERSPAN-wrapped frame: parsers.roce unwraps it
    STOP_COMPLETE = 10  # AFTER the frame: it completed a bucket (the pipeline may step or commit)
STOP_NAMES = ("end", "unknown_flow", "iteration", "flag_base", "example", "rs_dump",
              "range", "conflicts_full", "ack", "encapsulated", "complete")

# Flow table entry kinds
cdef enum:
    FLOW_BOUND = 1
    FLOW_UNRELATED = 2

# RC RDMA WRITE opcodes NCCL's data QPs use (ckptd/transports/roce/flows.py)
cdef enum:
    WRITE_FIRST = 6
    WRITE_MIDDLE = 7
    WRITE_LAST = 8
    WRITE_LAST_IMM = 9
    WRITE_ONLY_IMM = 11
    ACKNOWLEDGE = 17
    ACK_QP = 0xFFFFFFFF  # dest-QP field of ACK keys (QPNs have 24 bits: no clash)

cdef enum:
    PROTO_UDP = 17
    PROTO_GRE = 47
    ROCEV2_PORT = 4791
    BTH_LEN = 12
    UDP_LEN = 8
    ICRC_LEN = 4
    PSN_MASK = 0xFFFFFF
    PSN_MOD = 0x1000000
    PSN_HALF = 0x800000
    KEY_LEN = 40  # flow key: ver, pad[3], dest QP u32 LE, src[16], dst[16]
    HDR_MAX = 120  # masked ICRC headers copied to the stack up to this size
    LL_LINE = 16
    MAX_MTU = 4096
    MAX_LL_DATA = 2048  # the data of one MTU of LL lines

MAX_SLOTS = 8                  # open iterations the kernel holds at once
CONFLICT_CAP = 4096

# the ICRC starts with 8 bytes of 0xFF standing in for the InfiniBand LRH: fold them once
cdef uint8_t _LRH[8]
memset(_LRH, 0xFF, 8)
cdef uint32_t LRH_CRC = ckptd_crc_zlib(0, _LRH, 8)


cdef struct Frame:
    # What decode_frame found (parsers/roce.py RoceFrame, the fields the kernel needs)
    int cls
    int ip_ver
    int64_t ip_off
    int64_t udp_off
    int64_t bth_off
    int64_t icrc_off
    int64_t payload_off
    int64_t payload_len
    int opcode


cdef inline uint32_t be16(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 8) | p[1]

cdef inline uint32_t be24(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 16) | (<uint32_t>p[1] << 8) | p[2]

cdef inline uint32_t be32(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]

cdef inline uint32_t le32(const uint8_t *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v  # x86 and every other target we build for are little-endian

cdef inline bint is_tpid(uint32_t t) noexcept nogil:
    # parsers/ethernet.py VLAN_TPIDS: 802.1Q, 802.1ad (QinQ), pre-standard 0x9100
    return t == 0x8100 or t == 0x88A8 or t == 0x9100

cdef inline int64_t psn_diff(int64_t a, int64_t b) noexcept nogil:
    # ckptd/core/psn.py psn_diff: a - b as a signed distance in (-2**23, 2**23]
    cdef int64_t d = (a - b) & PSN_MASK
    return d - PSN_MOD if d > PSN_HALF else d

cdef inline int64_t psn_unwrap(int64_t psn, int64_t near) noexcept nogil:
    # ckptd/core/psn.py psn_unwrap: the unbounded position with these low 24 bits nearest `near`
    return near + psn_diff(psn, near & PSN_MASK)


# -- CRC entry points for tests and benchmarks ---------------------------------------------
CRC_IMPLS = ("zlib", "clmul", "vclmul", "external")

# fold distance in bits -> (K_lo, K_hi), as compiled (see ckptd.fast.pipeline.fold_constants)
FOLD_CONSTANTS = {128: (K128_LO, K128_HI), 256: (K256_LO, K256_HI), 512: (K512_LO, K512_HI),
                  1024: (K1024_LO, K1024_HI)}
# the final reduction: (x^95 mod P, x^63 mod P) reflected, mu and P reflected
REDUCTION_CONSTANTS = (K95, K63, CRC_MU_REFL, CRC_P_REFL)
ckptd_crc_table_init()


def cpu_features():
    """{'clmul': bool, 'vclmul': bool}: which folding CRCs this CPU runs."""
    return {"clmul": bool(ckptd_cpu_clmul()), "vclmul": bool(ckptd_cpu_vclmul())}


cdef ckptd_crc_fn _crc_fn(int impl, size_t external) noexcept:
    if impl == 1:
        return ckptd_crc_clmul
    if impl == 2:
        return ckptd_crc_vclmul
    if impl == 3 and external:
        return <ckptd_crc_fn>external
    return ckptd_crc_zlib


def crc32(const uint8_t[::1] data, uint32_t crc=0, int impl=0, size_t external=0):
    """zlib.crc32(data, crc) through implementation `impl` (index into CRC_IMPLS)."""
    if impl in (1, 2) and not ckptd_cpu_clmul() or impl == 2 and not ckptd_cpu_vclmul():
        raise ValueError(f"CRC implementation {CRC_IMPLS[impl]} needs a CPU feature this one lacks")
    cdef ckptd_crc_fn f = _crc_fn(impl, external)
    cdef uint64_t n = data.shape[0]
    if n == 0:
        return crc
    with nogil:
        crc = f(crc, &data[0], n)
    return crc


def crc32_frames(const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] lengths,
                 int impl=0, size_t external=0):
    """XOR of the CRC-32 of every frame: a benchmark of `impl` on frame-sized calls."""
    cdef ckptd_crc_fn f = _crc_fn(impl, external)
    cdef Py_ssize_t i
    cdef uint32_t acc = 0
    with nogil:
        for i in range(offsets.shape[0]):
            acc ^= f(0, &buf[offsets[i]], lengths[i])
    return acc


def ll_unpack_into(const uint8_t[::1] payload, uint8_t[::1] out, uint32_t flag):
    """(ckptd.transports.roce.extract.ll_unpack without the flag learning) data of whole lines into
    `out`; True when every flag equals `flag`."""
    cdef int64_t lines = payload.shape[0] // LL_LINE
    if out.shape[0] < lines * 8:
        raise ValueError(f"out holds {out.shape[0]} bytes, {lines * 8} needed")
    if lines == 0:
        return True
    cdef int ok
    with nogil:
        ok = ckptd_ll_unpack(&payload[0], lines, flag, &out[0])
    return bool(ok)


# -- source helpers --------------------------------------------------------------------------
def index_pcap(const uint8_t[::1] buf, int64_t start, bint big_endian, int64_t base,
               int64_t[::1] offsets, int64_t[::1] caplen, int64_t[::1] origlen,
               int64_t[::1] ts_sec, int64_t[::1] ts_frac):
    """Walk pcap records from byte `start` (after the file header) and fill the arrays
    (offsets get `base` added). Returns (frames, clean): clean is False when the file
    ends inside a record or a record is implausible, where parsers/pcap.py would raise
    CaptureError; the caller then asks that reader for the exact error."""
    cdef int64_t n = buf.shape[0], pos = start, k = 0, cap = offsets.shape[0]
    cdef uint32_t sec, frac, cl, ol
    cdef bint clean = True
    with nogil:
        while pos < n:
            if pos + 16 > n or k >= cap:
                clean = pos + 16 <= n and k < cap
                break
            if big_endian:
                sec, frac, cl, ol = be32(&buf[pos]), be32(&buf[pos + 4]), be32(&buf[pos + 8]), be32(&buf[pos + 12])
            else:
                sec, frac, cl, ol = le32(&buf[pos]), le32(&buf[pos + 4]), le32(&buf[pos + 8]), le32(&buf[pos + 12])
            if cl > 262144 or pos + 16 + cl > n:  # parsers.frame.MAX_SNAPLEN
                clean = False
                break
            offsets[k] = base + pos + 16
            caplen[k] = cl
            origlen[k] = ol
            ts_sec[k] = sec
            ts_frac[k] = frac
            k += 1
            pos += 16 + cl
    return k, clean


def merge_order(list ts_per_stream):
    """The order heapq.merge(key=(ts, stream, index)) yields the frames of several
    streams in (ckptd/pipeline.py file_source): repeatedly the smallest head. Returns
    (stream, index) int64 arrays. Exact even when a stream's times go backwards."""
    cdef Py_ssize_t k = len(ts_per_stream), total = 0, i, s, best
    arrays = [np.ascontiguousarray(ts, dtype=np.int64) for ts in ts_per_stream]
    for a in arrays:
        total += a.shape[0]
    out_s = np.empty(total, np.int64)
    out_i = np.empty(total, np.int64)
    cdef int64_t[::1] os_ = out_s, oi = out_i
    heads = np.zeros(k, np.int64)
    lens = np.array([a.shape[0] for a in arrays], np.int64)
    ptrs = np.array([a.ctypes.data for a in arrays], np.uint64)
    cdef int64_t[::1] h = heads, ln = lens
    cdef uint64_t[::1] pp = ptrs
    cdef int64_t t, bt
    with nogil:
        for i in range(total):
            best = -1
            bt = 0
            for s in range(k):
                if h[s] < ln[s]:
                    t = (<int64_t *>pp[s])[h[s]]
                    if best < 0 or t < bt:  # ties: the lower stream number, as the key says
                        best, bt = s, t
            os_[i] = best
            oi[i] = h[best]
            h[best] += 1
    return out_s, out_i


# -- the kernel ----------------------------------------------------------------------------
cdef class BatchKernel:
    """Decode, place and assemble frames; see the module docstring for the contract.

    All tables are numpy arrays owned by ckptd/fast/pipeline.py (it builds them from the plan,
    the FlowBinder and the open IterationAssembly objects); the kernel keeps typed views.
    """
    # options
    cdef public bint trust_icrc       # skip the ICRC check: the NIC already did it
    cdef public bint ll               # protocol LL (else Simple)
    cdef public bint examples_open    # the reference still records rejection examples
    cdef public bint dump_rs          # hand reduce-scatter step-0 placements to Python
    cdef public int64_t done          # pipeline: iterations <= done are finalized
    cdef public int64_t highest       # pipeline: the newest iteration a placement reached
    cdef public int64_t mtu
    cdef public int crc_impl
    cdef ckptd_crc_fn crc_fn
    cdef int64_t nstreams

    # opcode table (parsers/opcodes.py)
    cdef uint8_t[::1] op_known, op_payload, op_is_ack
    cdef int64_t[::1] op_ext_len, op_decoded_end

    # compiled schedule (ckptd/fast/pipeline.py CompiledSchedule)
    cdef int64_t[::1] tl_conn                 # timeline -> connection index
    cdef int64_t[:, ::1] tl_npkts             # [layout, timeline]
    cdef int64_t[:, ::1] tl_mlo, tl_mhi       # [layout, timeline] message index range
    cdef int64_t[:, ::1] tl_recv_off          # [layout, timeline] offset in a received map
    cdef int64_t[::1] recv_total              # [layout] packets of all timelines
    cdef int64_t[:, ::1] conn_steps           # [layout, connection] sends per iteration
    cdef int64_t[::1] m_start, m_npkts, m_wire_len, m_wire_offset, m_bucket, m_offset
    cdef int64_t[::1] m_nelem, m_phase, m_step, m_ring_step
    cdef uint32_t[::1] m_imm                  # the immediate's 4 wire bytes, read LE
    cdef int64_t[:, ::1] b_itemsize, b_count  # [layout, bucket]

    # flow table: open addressing over entries
    cdef int64_t[::1] ft_slots                # hash slot -> entry, -1 empty
    cdef uint8_t[:, ::1] fe_key
    cdef int64_t[::1] fe_kind, fe_tl, fe_base, fe_last, fe_msg
    cdef int64_t nflows

    # LL flag bases per connection (Extractor.flag_base)
    cdef uint8_t[::1] fb_known
    cdef int64_t[::1] fb_value

    # live iterations (done < it <= highest): their received maps, and the assembly
    # once the pipeline has opened one
    cdef int64_t[::1] slot_iter, slot_layout, slot_has_asm
    cdef int64_t[:, :, ::1] slot_ptr          # [slot, bucket, 0 data | 1 covered | 2+s by_stream]
    cdef int64_t[::1] slot_recv               # pointer to uint8[nstreams, recv_total[layout]]
    cdef int64_t[:, ::1] slot_counts          # [slot, 0 packets | 1 bytes | 2 stop after any placement]
    cdef int64_t[:, :, ::1] slot_bucket       # [slot, bucket, 0 newly covered | 1 still uncovered]

    # outputs drained by Python
    cdef int64_t[:, ::1] classes              # [stream, class]
    cdef int64_t[::1] counters
    cdef int64_t[:, ::1] conflicts            # (iteration, stream, bucket, start, end)
    cdef public int64_t nconflicts

    # the batch being processed (set_batch), and what decode found in the last frame
    cdef const uint8_t[::1] b_buf
    cdef const int64_t[::1] b_offsets, b_caplen, b_origlen
    cdef const int32_t[::1] b_stream, b_linktype
    cdef Frame last

    def __init__(self, int nstreams):
        self.nstreams = nstreams
        self.trust_icrc = False
        self.examples_open = True
        self.dump_rs = False
        self.done = -1
        self.highest = -1
        self.crc_impl = 0
        self.crc_fn = ckptd_crc_zlib
        self.nflows = 0
        self.nconflicts = 0

    def set_crc(self, int impl, size_t external=0):
        if impl in (1, 2) and not ckptd_cpu_clmul() or impl == 2 and not ckptd_cpu_vclmul():
            raise ValueError(f"CRC implementation {CRC_IMPLS[impl]} needs a CPU feature this one lacks")
        if impl == 3 and not external:
            raise ValueError("external CRC implementation needs a function address")
        self.crc_impl = impl
        self.crc_fn = _crc_fn(impl, external)

    def set_tables(self, *, op_known, op_payload, op_is_ack, op_ext_len, op_decoded_end,
                   tl_conn, tl_npkts, tl_mlo, tl_mhi, tl_recv_off, recv_total, conn_steps,
                   m_start, m_npkts, m_wire_len, m_wire_offset, m_bucket, m_offset, m_nelem,
                   m_phase, m_step, m_ring_step, m_imm, b_itemsize, b_count, mtu, ll,
                   fb_known, fb_value, slot_iter, slot_layout, slot_has_asm, slot_ptr, slot_recv,
                   slot_counts, slot_bucket, classes, counters, conflicts):
        self.op_known, self.op_payload, self.op_is_ack = op_known, op_payload, op_is_ack
        self.op_ext_len, self.op_decoded_end = op_ext_len, op_decoded_end
        self.tl_conn, self.tl_npkts, self.tl_mlo, self.tl_mhi = tl_conn, tl_npkts, tl_mlo, tl_mhi
        self.tl_recv_off, self.recv_total, self.conn_steps = tl_recv_off, recv_total, conn_steps
        self.m_start, self.m_npkts, self.m_wire_len = m_start, m_npkts, m_wire_len
        self.m_wire_offset, self.m_bucket, self.m_offset = m_wire_offset, m_bucket, m_offset
        self.m_nelem, self.m_phase, self.m_step, self.m_ring_step = m_nelem, m_phase, m_step, m_ring_step
        self.m_imm = m_imm
        self.b_itemsize, self.b_count = b_itemsize, b_count
        self.mtu, self.ll = mtu, ll
        if mtu > MAX_MTU:
            raise ValueError(f"path MTU {mtu} above {MAX_MTU}")
        self.fb_known, self.fb_value = fb_known, fb_value
        self.slot_iter, self.slot_layout, self.slot_ptr = slot_iter, slot_layout, slot_ptr
        self.slot_has_asm = slot_has_asm
        self.slot_recv, self.slot_counts, self.slot_bucket = slot_recv, slot_counts, slot_bucket
        if slot_ptr.shape[2] < 2 + self.nstreams or classes.shape[0] < self.nstreams:
            raise ValueError("slot_ptr/classes are too small for the number of streams")
        self.classes, self.counters, self.conflicts = classes, counters, conflicts

    def set_flow_table(self, ft_slots, fe_key, fe_kind, fe_tl, fe_base, fe_last, fe_msg, int64_t nflows):
        """The table ckptd/fast/pipeline.py FlowTable maintains (size of ft_slots: a power of 2)."""
        self.ft_slots, self.fe_key = ft_slots, fe_key
        self.fe_kind, self.fe_tl, self.fe_base, self.fe_last, self.fe_msg = fe_kind, fe_tl, fe_base, fe_last, fe_msg
        self.nflows = nflows

    # -- decode (parsers/roce.py decode_frame) ---------------------------------------------
    cdef int decode_frame(self, const uint8_t *d, int64_t n, int64_t origlen, int linktype,
                          Frame *f) noexcept nogil:
        """Class of one frame, with parsers.roce's precedence; fills f for RoCE frames."""
        cdef int cls = self._decode(d, n, linktype, n >= origlen, f)
        # decode_frame: a frame shorter than on the wire is TRUNCATED unless MALFORMED
        if n < origlen and cls != K_MALFORMED and cls != K_ENCAPSULATED:
            cls = K_TRUNCATED
        f.cls = cls
        return cls

    cdef int _decode(self, const uint8_t *d, int64_t n, int linktype, bint complete,
                     Frame *f) noexcept nogil:
        cdef int64_t off = 0, hdr_len, total_len, pos, size, ip_end, udp_off, udp_end, bth_off
        cdef int64_t icrc_off, payload_off, payload_len
        cdef uint32_t ethertype, version, want, b0, ihl, proto, word, nxt, ulen, op, padcnt
        cdef bint fragment
        # _link: Ethernet [+ tags] | raw IP | Linux SLL/SLL2
        if linktype == LT_ETHERNET:
            if n < 14:
                return K_TRUNCATED
            ethertype = be16(d + 12)
            off = 14
            while is_tpid(ethertype):      # parse_tags: 4-byte tags while the type is a TPID
                if off + 4 > n:
                    return K_TRUNCATED
                ethertype = be16(d + off + 2)
                off += 4
        elif linktype == LT_RAW or linktype == LT_IPV4 or linktype == LT_IPV6:
            if n == 0:
                return K_TRUNCATED
            version = d[0] >> 4
            want = 4 if linktype == LT_IPV4 else (6 if linktype == LT_IPV6 else version)
            if version != want:
                return K_MALFORMED
            ethertype = 0x0800 if version == 4 else (0x86DD if version == 6 else 0)
        elif linktype == LT_LINUX_SLL or linktype == LT_LINUX_SLL2:
            if linktype == LT_LINUX_SLL:
                if n < 16:
                    return K_TRUNCATED
                ethertype = be16(d + 14)
                off = 16
            else:
                if n < 20:
                    return K_TRUNCATED
                ethertype = be16(d)
                off = 20
            while is_tpid(ethertype):
                if off + 4 > n:
                    return K_TRUNCATED
                ethertype = be16(d + off + 2)
                off += 4
        else:
            return K_OTHER                  # link type not decoded

        # IPv4 | IPv6
        if ethertype == 0x0800:
            if off + 20 > n:
                return K_TRUNCATED
            b0 = d[off]
            ihl = b0 & 0x0F
            if b0 >> 4 != 4 or ihl < 5:
                return K_MALFORMED
            hdr_len = ihl * 4
            total_len = be16(d + off + 2)
            if total_len < hdr_len:
                return K_MALFORMED
            if off + hdr_len > n:
                return K_TRUNCATED          # options cut off
            proto = d[off + 9]
            word = be16(d + off + 6)        # rf, df, mf, fragment offset
            fragment = ((word >> 13) & 1) != 0 or (word & 0x1FFF) != 0
            f.ip_ver = 4
        elif ethertype == 0x86DD:
            if off + 40 > n:
                return K_TRUNCATED
            if d[off] >> 4 != 6:
                return K_MALFORMED
            nxt = d[off + 6]
            pos = off + 40
            fragment = False
            # hop-by-hop, routing, destination options are skipped; a fragment header is
            # 8 bytes and makes it a fragment unless it is an atomic one (offset 0, M 0)
            while nxt == 0 or nxt == 43 or nxt == 60 or nxt == 44:
                if pos + 8 > n:
                    return K_TRUNCATED
                if nxt == 44:
                    size = 8
                    word = be16(d + pos + 2)
                    fragment = (word & 0xFFF8) != 0 or (word & 1) != 0
                else:
                    size = (<int64_t>d[pos + 1] + 1) * 8
                nxt = d[pos]
                pos += size
            total_len = 40 + be16(d + off + 4)
            if pos - off - 40 > total_len - 40:
                return K_MALFORMED
            hdr_len = pos - off
            proto = nxt
            f.ip_ver = 6
        else:
            return K_OTHER                  # not IP
        f.ip_off = off
        if proto == PROTO_GRE:
            return K_ENCAPSULATED           # a mirror tunnel: the reference unwraps it
        if proto != PROTO_UDP:
            return K_OTHER
        if fragment:
            return K_OTHER
        ip_end = off + total_len            # Ethernet may pad past this; the IP length rules
        udp_off = off + hdr_len
        if udp_off + UDP_LEN > n:
            return K_TRUNCATED
        ulen = be16(d + udp_off + 4)
        if ulen < UDP_LEN:
            return K_MALFORMED
        if be16(d + udp_off + 2) != ROCEV2_PORT:
            return K_OTHER
        udp_end = udp_off + ulen
        if udp_end > ip_end:
            return K_MALFORMED
        if ulen < UDP_LEN + BTH_LEN + ICRC_LEN:
            return K_MALFORMED
        bth_off = udp_off + UDP_LEN
        if bth_off + BTH_LEN > n:
            return K_TRUNCATED
        op = d[bth_off]
        padcnt = (d[bth_off + 1] >> 4) & 3
        icrc_off = udp_end - ICRC_LEN
        if self.op_known[op]:
            payload_off = bth_off + BTH_LEN + self.op_ext_len[op]
            payload_len = icrc_off - padcnt - payload_off
            if payload_len < 0:
                return K_MALFORMED
            if payload_len and not self.op_payload[op]:
                return K_MALFORMED
            if bth_off + BTH_LEN + self.op_decoded_end[op] > n:
                return K_TRUNCATED          # RETH/AETH/ImmDt/DETH cut off
            f.payload_off = payload_off
            f.payload_len = payload_len
        if ip_end > n:
            return K_TRUNCATED
        f.udp_off = udp_off
        f.bth_off = bth_off
        f.icrc_off = icrc_off
        f.opcode = op
        if not self.op_known[op]:
            return K_UNKNOWN_OPCODE         # the ICRC does not change this class
        if not self.trust_icrc and complete and not self.icrc_ok(d, f):
            return K_BAD_ICRC
        if self.op_is_ack[op]:
            return K_ROCE_ACK
        return K_ROCE_DATA

    cdef bint icrc_ok(self, const uint8_t *d, Frame *f) noexcept nogil:
        """parsers/icrc.py verify: CRC-32 over 8 x 0xFF, the IP/UDP/BTH headers with the
        fields routers may rewrite set to all ones, and the rest up to the ICRC."""
        cdef uint8_t hdr[HDR_MAX]
        cdef int64_t ip_off = f.ip_off, udp = f.udp_off - f.ip_off
        cdef int64_t hlen = f.bth_off + BTH_LEN - ip_off, fixed
        cdef uint32_t crc
        cdef const uint8_t *rest = d + f.bth_off + BTH_LEN
        cdef int64_t nrest = f.icrc_off - f.bth_off - BTH_LEN
        if hlen <= HDR_MAX:
            memcpy(hdr, d + ip_off, hlen)
            self._mask_ip(hdr, f.ip_ver)
            hdr[udp + 6] = 0xFF                # UDP checksum
            hdr[udp + 7] = 0xFF
            hdr[udp + UDP_LEN + 4] = 0xFF      # BTH byte 4: FECN, BECN, reserved
            if self.crc_impl == 1 or self.crc_impl == 2:   # headers and payload: one stream
                return ckptd_icrc_clmul(hdr, hlen, rest, nrest, self.crc_impl == 2) == le32(d + f.icrc_off)
            crc = self.crc_fn(LRH_CRC, hdr, hlen)
        else:
            # long IPv4 options or IPv6 extension headers: covered unmasked, in pieces
            fixed = 20 if f.ip_ver == 4 else 40
            memcpy(hdr, d + ip_off, fixed)
            self._mask_ip(hdr, f.ip_ver)
            crc = self.crc_fn(LRH_CRC, hdr, fixed)
            crc = self.crc_fn(crc, d + ip_off + fixed, udp - fixed)
            memcpy(hdr, d + f.udp_off, UDP_LEN + BTH_LEN)
            hdr[6] = 0xFF
            hdr[7] = 0xFF
            hdr[UDP_LEN + 4] = 0xFF
            crc = self.crc_fn(crc, hdr, UDP_LEN + BTH_LEN)
        return self.crc_fn(crc, rest, nrest) == le32(d + f.icrc_off)

    cdef inline void _mask_ip(self, uint8_t *h, int ver) noexcept nogil:
        if ver == 4:
            h[1] = 0xFF                         # TOS (DSCP/ECN)
            h[8] = 0xFF                         # TTL
            h[10] = 0xFF                        # header checksum
            h[11] = 0xFF
        else:
            h[0] |= 0x0F                        # traffic class, flow label, hop limit
            h[1] = 0xFF
            h[2] = 0xFF
            h[3] = 0xFF
            h[7] = 0xFF

    # -- flows (ckptd/transports/roce/flows.py FlowBinder.bound) ------------------------------------------------
    cdef int64_t lookup_flow(self, const uint8_t *key) noexcept nogil:
        # the key's five 64-bit words, multiply-xorshift mixed (ckptd.fast.pipeline.flow_hash)
        cdef uint64_t h = 0, w
        cdef int64_t i, e, mask = self.ft_slots.shape[0] - 1
        for i in range(KEY_LEN // 8):
            memcpy(&w, key + 8 * i, 8)
            h = (h ^ w) * 0x9E3779B97F4A7C15ULL
            h ^= h >> 29
        i = <int64_t>(h & <uint64_t>mask)
        while True:
            e = self.ft_slots[i]
            if e < 0:
                return -1
            if memcmp(&self.fe_key[e, 0], key, KEY_LEN) == 0:
                return e
            i = (i + 1) & mask

    cdef inline void flow_key(self, const uint8_t *d, Frame *f, uint32_t dqp, uint8_t *key) noexcept nogil:
        memset(key, 0, KEY_LEN)
        key[0] = f.ip_ver
        memcpy(&key[4], &dqp, 4)
        if f.ip_ver == 4:
            memcpy(&key[8], d + f.ip_off + 12, 4)
            memcpy(&key[24], d + f.ip_off + 16, 4)
        else:
            memcpy(&key[8], d + f.ip_off + 8, 16)
            memcpy(&key[24], d + f.ip_off + 24, 16)

    cdef int ack(self, const uint8_t *d, Frame *f, int64_t *flow_out) noexcept nogil:
        """Extractor.feed for an ACK: counted; while its hop is unbound the binder also
        takes it as evidence (FlowBinder.note_ack), which only Python does."""
        cdef uint8_t key[KEY_LEN]
        self.flow_key(d, f, ACK_QP, key)
        flow_out[0] = self.lookup_flow(key)
        if flow_out[0] < 0:
            return STOP_ACK
        self.counters[C_ACKS] += 1
        return 0

    # -- place (ckptd/transports/roce/extract.py Extractor._place) ---------------------------------------------
    cdef inline int64_t find_message(self, int64_t e, int64_t layout, int64_t tl, int64_t local) noexcept nogil:
        """FlowSchedule.locate: the message holding packet `local`; the flow's last
        message is tried first, since packets mostly arrive in order."""
        cdef int64_t lo = self.tl_mlo[layout, tl], hi = self.tl_mhi[layout, tl], mid
        cdef int64_t m = self.fe_msg[e]
        if lo <= m < hi and self.m_start[m] <= local < self.m_start[m] + self.m_npkts[m]:
            return m
        if m + 1 < hi and lo <= m + 1 and self.m_start[m + 1] <= local < self.m_start[m + 1] + self.m_npkts[m + 1]:
            self.fe_msg[e] = m + 1
            return m + 1
        # bisect_right(starts, local) - 1 over [lo, hi)
        hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if self.m_start[mid] <= local:
                lo = mid
            else:
                hi = mid - 1
        self.fe_msg[e] = lo
        return lo

    cdef inline bint check(self, int64_t m, int64_t i, const uint8_t *d, Frame *f) noexcept nogil:
        """Extractor._check: opcode for the packet's place in the message, payload size,
        RETH DMA length, immediate. True when the packet is what the schedule says."""
        cdef int64_t npk = self.m_npkts[m], wire_len = self.m_wire_len[m]
        cdef int op = f.opcode, want
        if npk == 1:
            want = WRITE_ONLY_IMM
        elif i == 0:
            want = WRITE_FIRST
        elif i == npk - 1:
            want = WRITE_LAST_IMM
        else:
            want = WRITE_MIDDLE
        if op != want:
            return False
        if f.payload_len != min(self.mtu, wire_len - i * self.mtu):
            return False
        cdef const uint8_t *ext = d + f.bth_off + BTH_LEN
        if op == WRITE_FIRST or op == WRITE_ONLY_IMM:
            if be32(ext + 12) != wire_len:   # RETH: va u64, rkey u32, dma_len u32
                return False
        if op == WRITE_LAST_IMM:
            return le32(ext) == self.m_imm[m]
        if op == WRITE_ONLY_IMM:
            return le32(ext + 16) == self.m_imm[m]
        return True

    cdef int place(self, const uint8_t *d, Frame *f, int64_t stream, int64_t *flow_out) noexcept nogil:
        """One RDMA-write packet of the job's traffic. Returns 0 when done (everything
        counted and placed), or a STOP_* reason with no state changed."""
        cdef uint8_t key[KEY_LEN]
        cdef uint8_t lldata[MAX_LL_DATA]
        cdef const uint8_t *bth = d + f.bth_off
        cdef int64_t e, tl, u, pos, layout, it, local, q, m, i, slot = -1, conn
        cdef int64_t woff, doff, dlen, isz, total, n, start, nel, npk0, npk1, gstep, phase
        cdef const uint8_t *data
        cdef uint8_t *recv = NULL             # this packet's flag in the received map
        cdef uint32_t expected, dqp
        # the flow key: (src IP, dst IP, dest QP), as FlowBinder names flows
        self.flow_key(d, f, be24(bth + 5), key)
        e = self.lookup_flow(key)
        flow_out[0] = e
        if e < 0:
            return STOP_UNKNOWN_FLOW
        if self.fe_kind[e] == FLOW_UNRELATED:
            self.counters[C_UNRELATED] += 1
            return 0

        # FlowBinder.locate: unwrap the PSN against the flow's newest, then FlowTimeline
        tl = self.fe_tl[e]
        u = psn_unwrap(be24(bth + 9), self.fe_last[e])
        pos = u - self.fe_base[e]
        npk0 = self.tl_npkts[0, tl]
        npk1 = self.tl_npkts[1, tl]
        if pos < 0 or (pos >= npk0 and npk1 == 0):
            return self._reject(e, u, NULL, C_BEFORE_START)
        if pos < npk0:
            it, layout, local = 0, 0, pos
        else:
            q = (pos - npk0) // npk1
            it, layout, local = q + 1, 1, pos - npk0 - q * npk1
        m = self.find_message(e, layout, tl, local)
        i = local - self.m_start[m]
        if not self.check(m, i, d, f):
            return self._reject(e, u, NULL, C_SCHEDULE_MISMATCH)

        # from here on the reference records the packet as received (stream_loss), so
        # the iteration must be one the kernel tracks; for finalized ones the record is
        # never read again (stream_loss has run), so they need none
        if it > self.done:
            for q in range(self.slot_iter.shape[0]):
                if self.slot_iter[q] == it:
                    slot = q
                    break
            if slot < 0:
                return STOP_ITERATION
            recv = (<uint8_t *>self.slot_recv[slot]) + stream * self.recv_total[layout] \
                + self.tl_recv_off[layout, tl] + local

        phase = self.m_phase[m]
        woff = self.m_wire_offset[m] + i * self.mtu       # wire byte offset within the send
        if self.ll:
            if f.payload_len % LL_LINE:
                return self._reject(e, u, recv, C_SCHEDULE_MISMATCH)
            dlen = f.payload_len // LL_LINE * 8
            if dlen:
                conn = self.tl_conn[tl]
                if not self.fb_known[conn]:
                    return STOP_FLAG_BASE
                gstep = (0 if it == 0 else self.conn_steps[0, conn] + (it - 1) * self.conn_steps[1, conn]) \
                    + self.m_step[m]
                expected = <uint32_t>(self.fb_value[conn] + gstep + 1)  # modulo 2**32
                if not ckptd_ll_unpack(d + f.payload_off, f.payload_len // LL_LINE, expected,
                                       <uint8_t *>lldata if phase == 1 else <uint8_t *>NULL):
                    return self._reject(e, u, recv, C_LL_FLAG_MISMATCH)
            data = <uint8_t *>lldata
            doff = woff // 2
        else:
            data = d + f.payload_off
            dlen = f.payload_len
            doff = woff
        isz = self.b_itemsize[layout, self.m_bucket[m]]
        total = self.m_nelem[m] * isz          # LL pads the last line: drop what is not data
        n = min(dlen, max(<int64_t>0, total - doff))
        if doff % isz or n % isz:
            return self._reject(e, u, recv, C_SCHEDULE_MISMATCH)
        start = self.m_offset[m] + doff // isz
        nel = n // isz
        # Pipeline._assemble gets a placement when there is data: decide whether the
        # kernel can do all it would do
        if n:
            if phase == 0:
                if self.dump_rs and self.m_ring_step[m] == 0:
                    return STOP_RS_DUMP         # the sender's own values, kept for the dump
                if it > self.highest:
                    return STOP_ITERATION       # a new highest iteration finalizes older ones
            elif it > self.done:
                if not self.slot_has_asm[slot]:
                    return STOP_ITERATION       # the pipeline opens its IterationAssembly
                if start + nel > self.b_count[layout, self.m_bucket[m]]:
                    return STOP_RANGE           # IterationAssembly.place raises

        # commit
        if u > self.fe_last[e]:
            self.fe_last[e] = u
        if recv != NULL:
            recv[0] = 1
        self.counters[C_AG_PACKETS if phase == 1 else C_RS_PACKETS] += 1
        if n and phase == 1:
            if it <= self.done:
                self.counters[C_LATE] += 1      # Pipeline._assemble: finalized already
            elif self.assemble(slot, stream, self.m_bucket[m], start, nel, isz, data, it):
                flow_out[0] = it
                return STOP_COMPLETE            # the pipeline may step the bucket, commit
        return 0

    cdef int _reject(self, int64_t e, int64_t u, uint8_t *recv, int counter) noexcept nogil:
        """Extractor._reject: counted here, or handed to Python while the reference
        still writes examples (it names the frame and the reason)."""
        if self.examples_open:
            return STOP_EXAMPLE
        if u > self.fe_last[e]:
            self.fe_last[e] = u
        if recv != NULL:
            recv[0] = 1
        self.counters[counter] += 1
        return 0

    # -- assemble (ckptd/core/assemble.py IterationAssembly.place) -------------------------------
    cdef bint assemble(self, int64_t slot, int64_t stream, int64_t bucket, int64_t start,
                       int64_t nel, int64_t isz, const uint8_t *raw, int64_t it) noexcept nogil:
        """Returns True when this placement completed a bucket (or the pipeline asked
        to hear of every placement into this iteration)."""
        cdef uint8_t *dst = (<uint8_t *>self.slot_ptr[slot, bucket, 0]) + start * isz
        cdef uint8_t *cov = <uint8_t *>self.slot_ptr[slot, bucket, 1]
        cdef uint8_t *mine = <uint8_t *>self.slot_ptr[slot, bucket, 2 + stream]
        cdef int64_t k, fresh = 0, have = ckptd_bits_count(cov, start, nel)
        cdef int state = 0 if have == 0 else (1 if have == nel else 2)
        cdef bint conflict = False
        # two intact copies of an element must agree bit for bit
        if state == 1:
            conflict = memcmp(dst, raw, nel * isz) != 0
        elif state == 2:
            for k in range(nel):
                if ckptd_bit(cov, start + k) and memcmp(dst + k * isz, raw + k * isz, isz) != 0:
                    conflict = True
                    break
        if conflict:
            k = self.nconflicts
            self.conflicts[k, 0] = it
            self.conflicts[k, 1] = stream
            self.conflicts[k, 2] = bucket
            self.conflicts[k, 3] = start
            self.conflicts[k, 4] = start + nel
            self.nconflicts += 1
            return False
        if state != 1:                          # all covered: the bytes are there already
            fresh = nel - have
            memcpy(dst, raw, nel * isz)
            ckptd_bits_set(cov, start, nel)
        ckptd_bits_set(mine, start, nel)
        self.slot_counts[slot, 0] += 1
        self.slot_counts[slot, 1] += nel * isz
        self.slot_bucket[slot, bucket, 0] += fresh     # IterationAssembly.bucket_covered
        if fresh and self.slot_bucket[slot, bucket, 1] > 0:
            self.slot_bucket[slot, bucket, 1] -= fresh  # elements still uncovered
            if self.slot_bucket[slot, bucket, 1] == 0:
                return True
        return self.slot_counts[slot, 2] != 0

    # -- the batch --------------------------------------------------------------------------
    def classify(self, const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] caplen,
                 const int64_t[::1] origlen, const int32_t[::1] linktype):
        """decode_frame's class of every frame (index into CLASS_NAMES; -1: GRE, which
        the reference unwraps), and nothing else: no flows, no counts."""
        cdef Py_ssize_t i, n = offsets.shape[0]
        out = np.empty(n, np.int8)
        cdef int8_t[::1] o = out
        cdef Frame f
        with nogil:
            for i in range(n):
                o[i] = <int8_t>self.decode_frame(&buf[offsets[i]] if caplen[i] else NULL, caplen[i],
                                                 origlen[i], linktype[i], &f)
        return out

    def set_batch(self, const uint8_t[::1] buf, const int64_t[::1] offsets, const int64_t[::1] caplen,
                  const int64_t[::1] origlen, const int32_t[::1] stream, const int32_t[::1] linktype):
        """The frames `run` works on: one buffer, and per frame its offset, captured and
        original length, mirror stream and link type."""
        cdef Py_ssize_t i, n = offsets.shape[0], bad = -1
        if caplen.shape[0] != n or origlen.shape[0] != n or stream.shape[0] != n or linktype.shape[0] != n:
            raise ValueError("per-frame arrays differ in length")
        with nogil:  # the kernel trusts these from here on
            for i in range(n):
                if offsets[i] < 0 or caplen[i] < 0 or offsets[i] + caplen[i] > buf.shape[0] \
                        or stream[i] < 0 or stream[i] >= self.nstreams:
                    bad = i
                    break
        if bad >= 0:
            raise ValueError(f"frame {bad}: outside the buffer or stream {stream[bad]} not in "
                             f"0..{self.nstreams - 1}")
        self.b_buf, self.b_offsets, self.b_caplen, self.b_origlen = buf, offsets, caplen, origlen
        self.b_stream, self.b_linktype = stream, linktype

    def last_frame(self):
        """What decode found in the frame `run` stopped at: (class, IP version, IP, UDP
        and BTH offsets, payload offset and length, opcode)."""
        f = self.last
        return f.cls, f.ip_ver, f.ip_off, f.udp_off, f.bth_off, f.payload_off, f.payload_len, f.opcode

    def run(self, int64_t start, int64_t end):
        """Process frames start..end-1. Returns (index, reason, flow entry): index == end
        and reason 0 when all were processed; reason 'complete': frames before index are
        processed and the last one completed a bucket of iteration `flow entry`; any other
        reason: the frame at index is for Python (nothing of it counted or placed)."""
        cdef int64_t i, s, flow = -1
        cdef int cls, reason = STOP_END
        cdef Frame f
        cdef const uint8_t *d
        if self.ft_slots is None or self.classes is None or self.b_offsets is None:
            raise RuntimeError("tables or batch not set")
        cdef const uint8_t[::1] buf = self.b_buf
        cdef const int64_t[::1] offsets = self.b_offsets, caplen = self.b_caplen, origlen = self.b_origlen
        cdef const int32_t[::1] stream = self.b_stream, linktype = self.b_linktype
        if end > offsets.shape[0] or start < 0:
            raise IndexError("frame range outside the batch")
        cdef int64_t cap = self.conflicts.shape[0]
        with nogil:
            i = start
            while i < end:
                if self.nconflicts >= cap:
                    reason = STOP_CONFLICTS_FULL
                    break
                d = &buf[offsets[i]] if caplen[i] else NULL
                s = stream[i]
                flow = -1
                cls = self.decode_frame(d, caplen[i], origlen[i], linktype[i], &f)
                if cls == K_ENCAPSULATED:
                    reason = STOP_ENCAPSULATED
                    break
                if cls == K_ROCE_DATA:
                    if f.opcode == WRITE_FIRST or f.opcode == WRITE_MIDDLE or f.opcode == WRITE_LAST \
                            or f.opcode == WRITE_LAST_IMM or f.opcode == WRITE_ONLY_IMM:
                        reason = self.place(d, &f, s, &flow)
                        if reason and reason != STOP_COMPLETE:
                            break
                    else:
                        self.classes[s, K_OTHER_ROCE] += 1   # clear-to-send writes, sends, reads
                elif cls == K_ROCE_ACK and f.opcode == ACKNOWLEDGE:
                    reason = self.ack(d, &f, &flow)
                    if reason:
                        break
                self.classes[s, K_FRAMES] += 1
                self.classes[s, cls] += 1
                i += 1
                if reason == STOP_COMPLETE:             # this frame is done; the pipeline acts first
                    break
            self.last = f
        return i, reason, flow
