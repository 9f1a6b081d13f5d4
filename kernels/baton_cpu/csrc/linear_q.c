/* Linear layers over GGUF block-quantized weights on CPU: y[m, o] = sum_k x[m, k] * w[o, k]
 * (+ bias[o]), x and y bfloat16, w in Q8_0, Q4_0 or Q4_1 (32-element blocks, below) or in
 * Q4_K or Q6_K (256-element super-blocks: linear_qk.h), or a chain of such parts (a fused
 * linear whose parts the file stores in different types).
 *
 * The weights keep GGUF's quants and fp16 scales bit for bit, repacked once (as llama.cpp's
 * CPU "repack" does) so that 8 output rows lie side by side: for each group of 8 rows and
 * each 32-element block, d[8] fp16, m[8] fp16, then the quants with row l's 4-byte pieces in
 * lane l of a 32-byte vector. A weight is d * q + m with q unsigned: Q4_1 (q, d, m as in the
 * file), Q4_0 (q = the nibble, m = -8 d), Q8_0 (q = the int8 + 128, m = -128 d). Q4 chunk j
 * (0..3) holds k = 4j..4j+3 in the low nibbles and k = 16+4j.. in the high ones (GGUF's
 * own nibble order); Q8 chunk j (0..7) holds k = 4j..4j+3.
 *
 * The activation row is quantized per 32-block to int8 (d_x = amax / 127, round half to
 * even), with s_x = d_x * sum(q_x), as llama.cpp's Q8_1. A block's dot product is then
 * d_w d_x * sum(q_w q_x) + m_w s_x: integer dot products of 8 rows at once (AVX-VNNI or
 * AVX512-VNNI vpdpbusd; AVX2 vpmaddubsw + vpmaddwd, Q8 with the sign trick since its
 * unsigned quants would saturate vpmaddubsw), scaled in fp32. A register tile of 8 outputs
 * (16 with AVX-512) x up to 4 rows (8) reuses each unpacked weight vector for every row.
 * Without AVX2 a scalar loop computes the same sums.
 *
 * BATON_Q_ISA (0 scalar, 1 AVX2, 2 256-bit VNNI, 3 AVX-512 VNNI: 16 rows per group, 8-row
 * tiles) may be defined to build a narrower path than the compiler targets (the tests build
 * each one the CPU can run).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NATIVE_ISA 3
#elif defined(__AVXVNNI__)
#define NATIVE_ISA 2
#else
#define NATIVE_ISA 1
#endif
#else
#define NATIVE_ISA 0
#endif
#if !defined(BATON_Q_ISA) || BATON_Q_ISA > NATIVE_ISA
#undef BATON_Q_ISA
#define BATON_Q_ISA NATIVE_ISA
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* GGMLQuantizationType values */
#define QK 32
#define QKK 256 /* the K types' super-blocks (linear_qk.h) */
#if BATON_Q_ISA == 3
#define G 16 /* output rows per group: one 512-bit vector of int32 sums */
#define MT 8 /* activation rows per register tile */
#else
#define G 8
#define MT 4
#endif

/* What a packed linear weight is; passed as the `w` of the linear kernel signature. A fused
 * linear whose parts differ in type (a Q4_K_M file's q, k in Q4_K and v in Q6_K) is a chain:
 * `next` holds the rows after these n, NULL ends it. */
typedef struct qweight {
    int64_t type, n, k;
    const uint8_t *data; /* qlinear_packed_bytes(type, n, k) bytes */
    const struct qweight *next;
    int64_t dequant_rows; /* from this many rows on, de-quantize to bf16 (0: never) */
} qweight;

int qlinear_isa(void) { return BATON_Q_ISA; }

#if BATON_Q_ISA == 3 && defined(__AVX512BF16__)
#define HAVE_DEQUANT 1
/* Measured on the bundled model's linears (2-core EPYC, 1 thread): the bf16 tile over
 * de-quantized weights is as fast as the int8 path from about this many rows. */
#define DEQUANT_ROWS 16
#else
#define HAVE_DEQUANT 0
#define DEQUANT_ROWS 0
#endif

/* The batch from which the bf16 path serves by default (0: this build has none). */
int qlinear_dequant_rows(void) { return DEQUANT_ROWS; }

static int64_t quant_bytes(int64_t type) { /* per row per block, packed */
    return type == Q8_0 ? 32 : (type == Q4_0 || type == Q4_1) ? 16 : -1;
}

static int64_t group_block_bytes(int64_t type);
static int64_t block_elems(int64_t type);

/* A group's bytes: the packed blocks of G rows over all k. */
static int64_t group_bytes(int64_t type, int64_t k) { return k / block_elems(type) * group_block_bytes(type); }

int64_t qlinear_packed_bytes(int64_t type, int64_t n, int64_t k) {
    const int64_t be = block_elems(type);
    if (be < 0 || n < 1 || k < be || k % be) return -1;
    return (n + G - 1) / G * group_bytes(type, k);
}

static float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        v.f = (float)man * (1.0f / 16777216.0f);
        v.u |= sign;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return v.f;
}

static uint16_t f32_to_f16_exact(float f) { /* f is a (small) fp16 value times 8 or 128 */
#if NATIVE_ISA > 0
    return _cvtss_sh(f, 0);
#else
    union { uint32_t u; float f; } v = {.f = f};
    const uint32_t sign = (v.u >> 16) & 0x8000u, exp = (v.u >> 23) & 0xff;
    if (exp == 0 || (v.u & 0x7fffffffu) < 0x38800000u) { /* subnormal in fp16 */
        float a = f < 0 ? -f : f;
        return (uint16_t)(sign | (uint32_t)(a * 16777216.0f + 0.5f));
    }
    if (exp >= 143) return (uint16_t)(sign | 0x7c00u);
    return (uint16_t)(sign | ((exp - 112) << 10) | ((v.u >> 13) & 0x3ff));
#endif
}

/* One GGUF row-block (type's raw layout) -> d, m and the unsigned quants q[32]; 0, or -1
 * where m = -8 d or -128 d is past fp16's range. */
static int read_block(int64_t type, const uint8_t *src, uint16_t *d, uint16_t *m, uint8_t *q) {
    uint16_t dh;
    memcpy(&dh, src, 2);
    *d = dh;
    if (type == Q8_0) {
        for (int i = 0; i < QK; i++) q[i] = (uint8_t)((int8_t)src[2 + i] + 128);
        *m = f32_to_f16_exact(-128.0f * f16_to_f32(dh));
        return (*m & 0x7c00u) == 0x7c00u ? -1 : 0;
    }
    const uint8_t *qs = src + (type == Q4_1 ? 4 : 2);
    for (int i = 0; i < 16; i++) q[i] = qs[i] & 0x0f, q[i + 16] = qs[i] >> 4;
    if (type == Q4_1) memcpy(m, src + 2, 2);
    else *m = f32_to_f16_exact(-8.0f * f16_to_f32(dh));
    return type != Q4_1 && (*m & 0x7c00u) == 0x7c00u ? -1 : 0;
}

#if BATON_Q_ISA > 0
static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* One 32-block, as the scalar loop below computes it (cvtps rounds half to even, as
 * nearbyintf does in the default rounding mode): the per-call cost of the activations was
 * ~1 us per 576 elements in the scalar loop, a third of a 576 x 576 linear at 32 rows. */
static inline void quantize_block(const uint16_t *xb, int8_t *q, float *d, float *s, int32_t *s16) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < 4; i++) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(xb + 8 * i));
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float dd = _mm_cvtss_f32(m) / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
    __m256i qi[4];
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                              _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                          packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    s16[0] = hsum8(_mm256_add_epi32(qi[0], qi[1]));
    s16[1] = hsum8(_mm256_add_epi32(qi[2], qi[3]));
    *d = dd, *s = dd * (float)(s16[0] + s16[1]);
}
#else
static inline void quantize_block(const uint16_t *xb, int8_t *q, float *d, float *s, int32_t *s16) {
    float v[QK], amax = 0.f;
    for (int j = 0; j < QK; j++) {
        v[j] = bf16_to_f32(xb[j]);
        const float a = v[j] < 0 ? -v[j] : v[j];
        amax = a > amax ? a : amax;
    }
    const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f;
    s16[0] = s16[1] = 0;
    for (int j = 0; j < QK; j++) {
        const int qj = (int)__builtin_nearbyintf(v[j] * id);
        q[j] = (int8_t)qj;
        s16[j / 16] += qj;
    }
    *d = dd, *s = dd * (float)(s16[0] + s16[1]);
}
#endif

/* x [M, K] bf16 -> xq [M, K] int8, dx / sx [M, K / 32], xs16 [M, K / 16]. */
static void quantize_rows(const uint16_t *x, int64_t M, int64_t K, int8_t *xq, float *dx,
                          float *sx, int32_t *xs16) {
#pragma omp parallel for schedule(static) if (M * K >= 1 << 15)
    for (int64_t i = 0; i < M * (K / QK); i++)
        quantize_block(x + i * QK, xq + i * QK, &dx[i], &sx[i], &xs16[2 * i]);
}

typedef struct {
    const int8_t *xq;
    const float *dx, *sx;
    const int32_t *xs16; /* sum(q_x) of each 16 elements (Q6_K's offset) */
    int64_t K, nb;
} xrows;

#if BATON_Q_ISA == 3
static inline __m512i x4_512(const int8_t *p) { /* 4 activation bytes in every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* out[r][l] = sum over blocks of (d_w d_x isum + m_w s_x) for rows r < mt of one group:
 * 512-bit vpdpbusd over 16 rows of unsigned quants. */
__attribute__((always_inline)) static inline void tile(const int64_t type, const uint8_t *wg,
                                                       const xrows *xr, const int mt,
                                                       float out[MT][G]) {
    const int64_t gb = group_block_bytes(type), K = xr->K, nb = xr->nb;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[MT];
    for (int r = 0; r < mt; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * gb, *qd = blk + 4 * G;
        const int8_t *xb = xr->xq + b * QK;
        __m512i isum[MT];
        for (int r = 0; r < mt; r++) isum[r] = _mm512_setzero_si512();
#define X4(r, off) x4_512(xb + (r) * K + (off))
        if (type == Q8_0) {
            for (int j = 0; j < 8; j++) {
                const __m512i v = _mm512_loadu_si512(qd + 64 * j);
                for (int r = 0; r < mt; r++) isum[r] = _mm512_dpbusd_epi32(isum[r], v, X4(r, 4 * j));
            }
        } else {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(qd + 64 * j);
                const __m512i lo = _mm512_and_si512(v, low);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < mt; r++)
                    isum[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r], lo, X4(r, 4 * j)),
                                                  hi, X4(r, 16 + 4 * j));
            }
        }
#undef X4
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2 * G)));
        for (int r = 0; r < mt; r++) {
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xr->dx[r * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xr->sx[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < mt; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#elif BATON_Q_ISA > 0
static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#if BATON_Q_ISA == 2
/* acc + the sums of 4 products u8 w x s8 x per lane */
static inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_dpbusd_epi32(acc, w, x);
#endif
}
#endif

/* out[r][l] = sum over blocks of (d_w d_x isum + m_w s_x) for rows r < mt of one group. */
__attribute__((always_inline)) static inline void tile(const int64_t type, const uint8_t *wg,
                                                       const xrows *xr, const int mt,
                                                       float out[MT][G]) {
    const int64_t gb = group_block_bytes(type), K = xr->K, nb = xr->nb;
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[MT];
    for (int r = 0; r < mt; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * gb, *qd = blk + 4 * G;
        const int8_t *xb = xr->xq + b * QK;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i isum[MT];
        for (int r = 0; r < mt; r++) isum[r] = _mm256_setzero_si256();
        int with_m = 1;
        if (type == Q8_0) {
            for (int j = 0; j < 8; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qd + 32 * j));
#if BATON_Q_ISA == 2
                for (int r = 0; r < mt; r++) isum[r] = dot4(isum[r], v, bcast4(xb + r * K + 4 * j));
#else           /* signed weights: |w| x sign(x, w) cannot saturate vpmaddubsw */
                const __m256i ws = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
                const __m256i aw = _mm256_abs_epi8(ws);
                for (int r = 0; r < mt; r++) {
                    const __m256i p = _mm256_maddubs_epi16(
                        aw, _mm256_sign_epi8(bcast4(xb + r * K + 4 * j), ws));
                    isum[r] = _mm256_add_epi32(isum[r],
                                               _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
                }
                with_m = 0; /* d sum(w x) is already the block's dot: m = -128 d cancels */
#endif
            }
        } else {
#if BATON_Q_ISA == 1
            __m256i s16[MT]; /* 8 products of <= 15 * 127 * 2 fit int16 */
            for (int r = 0; r < mt; r++) s16[r] = _mm256_setzero_si256();
#endif
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qd + 32 * j));
                const __m256i lo = _mm256_and_si256(v, low);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int r = 0; r < mt; r++) {
                    const int8_t *xr_b = xb + r * K;
#if BATON_Q_ISA == 2
                    isum[r] = dot4(dot4(isum[r], lo, bcast4(xr_b + 4 * j)), hi,
                                   bcast4(xr_b + 16 + 4 * j));
#else
                    s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, bcast4(xr_b + 4 * j)),
                        _mm256_maddubs_epi16(hi, bcast4(xr_b + 16 + 4 * j))));
#endif
                }
            }
#if BATON_Q_ISA == 1
            for (int r = 0; r < mt; r++) isum[r] = _mm256_madd_epi16(s16[r], _mm256_set1_epi16(1));
#endif
        }
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * G)));
        for (int r = 0; r < mt; r++) {
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xr->dx[r * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
            if (with_m) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xr->sx[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < mt; r++) _mm256_storeu_ps(out[r], acc[r]);
}
#endif
#if BATON_Q_ISA == 1 || BATON_Q_ISA == 2
static void group_tile(int64_t type, const uint8_t *wg, const xrows *xr, int mt,
                       float out[MT][G]) {
    switch (mt) { /* constant row counts: the tile's loops unroll, its arrays stay in registers */
    case 4: tile(type, wg, xr, 4, out); break;
    case 3: tile(type, wg, xr, 3, out); break;
    case 2: tile(type, wg, xr, 2, out); break;
    default: tile(type, wg, xr, 1, out); break;
    }
}
#endif
#if BATON_Q_ISA == 3
static void group_tile(int64_t type, const uint8_t *wg, const xrows *xr, int mt,
                       float out[MT][G]) {
    switch (mt) { /* constant row counts: the tile's loops unroll, its arrays stay in registers */
    case 8: tile(type, wg, xr, 8, out); break;
    case 7: tile(type, wg, xr, 7, out); break;
    case 6: tile(type, wg, xr, 6, out); break;
    case 5: tile(type, wg, xr, 5, out); break;
    case 4: tile(type, wg, xr, 4, out); break;
    case 3: tile(type, wg, xr, 3, out); break;
    case 2: tile(type, wg, xr, 2, out); break;
    default: tile(type, wg, xr, 1, out); break;
    }
}
#elif BATON_Q_ISA == 0
static void group_tile(int64_t type, const uint8_t *wg, const xrows *xr, int mt,
                       float out[MT][G]) {
    const int64_t gb = group_block_bytes(type), K = xr->K, nb = xr->nb;
    for (int r = 0; r < mt; r++)
        for (int l = 0; l < G; l++) out[r][l] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = wg + b * gb, *qd = blk + 4 * G;
        for (int l = 0; l < G; l++) {
            uint16_t dh, mh;
            memcpy(&dh, blk + 2 * l, 2);
            memcpy(&mh, blk + 2 * G + 2 * l, 2);
            uint8_t q[QK];
            for (int kk = 0; kk < QK; kk++) {
                if (type == Q8_0) q[kk] = qd[((kk / 4) * G + l) * 4 + kk % 4];
                else {
                    const uint8_t byte = qd[(((kk % 16) / 4) * G + l) * 4 + kk % 4];
                    q[kk] = kk < 16 ? byte & 0x0f : byte >> 4;
                }
            }
            for (int r = 0; r < mt; r++) {
                const int8_t *xb = xr->xq + r * K + b * QK;
                int32_t isum = 0;
                for (int kk = 0; kk < QK; kk++) isum += (int32_t)q[kk] * xb[kk];
                out[r][l] += f16_to_f32(dh) * xr->dx[r * nb + b] * (float)isum
                             + f16_to_f32(mh) * xr->sx[r * nb + b];
            }
        }
    }
}
#endif

#include "linear_qk.h"
#if HAVE_DEQUANT
#include "linear_q_dequant.h"
#endif

static int64_t block_elems(int64_t type) {
    return is_k_type(type) ? QKK : quant_bytes(type) > 0 ? QK : -1;
}

static int64_t group_block_bytes(int64_t type) {
    return is_k_type(type) ? kgroup_block_bytes(type) : 4 * G + G * quant_bytes(type);
}

/* raw: the GGUF tensor's rows [n][k / block elements blocks]; packed: qlinear_packed_bytes
 * of it. Returns 0, -1 for a bad shape or type, -2 for a scale too large to repack. */
int qlinear_repack(int64_t type, const uint8_t *raw, int64_t n, int64_t k, uint8_t *packed) {
    if (qlinear_packed_bytes(type, n, k) < 0) return -1;
    const int64_t nb = k / block_elems(type), gb = group_block_bytes(type), groups = (n + G - 1) / G;
    const int64_t raw_block = type == Q8_0 ? 34 : type == Q4_1 ? 20 : type == Q4_0 ? 18
                            : type == Q4_K ? 144 : 210;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = packed + (g * nb + b) * gb;
            if (is_k_type(type)) { /* rows past n stay zero: d = 0 */
                memset(dst, 0, (size_t)gb);
                for (int l = 0; l < G && g * G + l < n; l++)
                    krepack_row(type, raw + ((g * G + l) * nb + b) * raw_block, l, dst);
                continue;
            }
            uint16_t d[G] = {0}, m[G] = {0};
            uint8_t q[G][QK];
            memset(q, 0, sizeof q);
            for (int l = 0; l < G && g * G + l < n; l++)
                bad |= read_block(type, raw + ((g * G + l) * nb + b) * raw_block, &d[l], &m[l],
                                  q[l]);
            memcpy(dst, d, sizeof d);
            memcpy(dst + 2 * G, m, sizeof m);
            uint8_t *qd = dst + 4 * G;
            const int chunks = type == Q8_0 ? 8 : 4;
            for (int j = 0; j < chunks; j++)
                for (int l = 0; l < G; l++)
                    for (int i = 0; i < 4; i++) {
                        const int kk = 4 * j + i;
                        qd[(j * G + l) * 4 + i] = type == Q8_0
                            ? q[l][kk] : (uint8_t)(q[l][kk] | (q[l][kk + 16] << 4));
                    }
        }
    return bad ? -2 : 0;
}

/* y[:, n_off + G * first : n_off + w->n] of one part of a (chained) weight, from its group
 * `first` on, through the int8 activations; y's rows are N wide. */
static void linear_part(const xrows *all, const qweight *w, const uint16_t *bias, uint16_t *y,
                        int64_t M, int64_t N, int64_t n_off, int64_t first) {
    const int64_t K = all->K, nb = all->nb, groups = (w->n + G - 1) / G;
    const int64_t gbytes = group_bytes(w->type, K);
#pragma omp parallel for schedule(static)
    for (int64_t g = first; g < groups; g++) {
        const uint8_t *wg = w->data + g * gbytes;
        const int64_t n0 = g * G, valid = w->n - n0 < G ? w->n - n0 : G;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int mt = M - m0 < MT ? (int)(M - m0) : MT;
            const xrows xr = {all->xq + m0 * K, all->dx + m0 * nb, all->sx + m0 * nb,
                              all->xs16 + 2 * m0 * nb, K, nb};
            float out[MT][G];
            if (is_k_type(w->type)) kgroup_tile(w->type, wg, &xr, mt, out);
            else group_tile(w->type, wg, &xr, mt, out);
            for (int r = 0; r < mt; r++)
                for (int64_t l = 0; l < valid; l++) {
                    const int64_t o = n_off + n0 + l;
                    const float b = bias ? bf16_to_f32(bias[o]) : 0.f;
                    y[(m0 + r) * N + o] = bf16_round(out[r][l] + b);
                }
        }
    }
}

#define MAX_PARTS 8 /* a fused linear's parts (llama's qkv: 3) */

int qlinear_bf16(const uint16_t *x, const qweight *w, const uint16_t *bias, uint16_t *y,
                 int64_t M, int64_t N, int64_t K) {
    int64_t rows = 0, n_off = 0, parts = 0, left = 0;
    for (const qweight *p = w; p != NULL; p = p->next, parts++) {
        if (parts == MAX_PARTS || p->k != K || qlinear_packed_bytes(p->type, p->n, K) < 0)
            return -1;
        rows += p->n;
    }
    if (M < 1 || w == NULL || rows != N) return -1;
    /* the bf16 path first where it serves; what it leaves (all of it without memory, the
     * rows past a part's last whole group) goes through the int8 activations */
    int64_t done[MAX_PARTS] = {0};
    parts = 0;
    for (const qweight *p = w; p != NULL; n_off += p->n, p = p->next, parts++) {
#if HAVE_DEQUANT
        if (p->dequant_rows > 0 && M >= p->dequant_rows) {
            const int64_t n = dequant_part(x, p, bias, y, M, N, n_off);
            done[parts] = n < 0 ? 0 : n;
        }
#endif
        left += p->n - done[parts];
    }
    if (left == 0) return 0;
    const int64_t nb = K / QK;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *dx = (float *)malloc(2 * sizeof(float) * (size_t)(M * nb));
    int32_t *xs16 = (int32_t *)malloc(2 * sizeof(int32_t) * (size_t)(M * nb));
    if (!xq || !dx || !xs16) {
        free(xq), free(dx), free(xs16);
        return -2;
    }
    float *sx = dx + M * nb;
    quantize_rows(x, M, K, xq, dx, sx, xs16);
    const xrows all = {xq, dx, sx, xs16, K, nb};
    n_off = 0, parts = 0;
    for (const qweight *p = w; p != NULL; n_off += p->n, p = p->next, parts++)
        if (done[parts] < p->n) linear_part(&all, p, bias, y, M, N, n_off, done[parts] / G);
    free(xs16);
    free(dx);
    free(xq);
    return 0;
}
