/* The single-pass decode kernels for CPUs with AVX512-BF16 (included by paged_decode.c,
 * after its shared definitions: exp_nonpos, decode_shape, run_tasks, check_shape,
 * block_shift). */
#include <immintrin.h>


/* bf16 on CPUs with AVX512-BF16: one pass per sequence over 16-token chunks with an online
 * softmax (flash-decoding's recurrence), K and V of a chunk read together. Scores are
 * vdpbf16ps dot products of the bf16 query and key rows (exact products, fp32 sums), and
 * P.V accumulates in fp32. The cache lines of the next chunk are prefetched a few at a time
 * between the score computations: a step is bound by streaming the cache from DRAM, and
 * the two-pass kernel above left each core waiting on its misses (measured at 55 sequences
 * x 128-256 tokens, bs 16, shuffled blocks, cache cold: 620-700 -> 370-430 us per layer). */

/* Lane i of the result is the sum of the 16 lanes of a[i]. */
static inline __m512 sum_lanes16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 g0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                    _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 g1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                    _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(g0, g1, 0x88), _mm512_shuffle_f32x4(g0, g1, 0xDD));
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 FP8 bytes as floats, through fp16 (vcvtph2ps, exact): an e5m2 byte is the top byte of
 * the fp16 of the same value; an e4m3 byte's fields moved into fp16's give 2^-8 of its value
 * (exponent bias 15 vs 7, subnormals included), a factor the callers fold into the scales. */
static inline __m512 load_fp8x16(const uint8_t *p, int e4m3) {
    __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    if (e4m3)
        h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7),
                            _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8));
    else
        h = _mm256_slli_epi16(h, 8);
    return _mm512_cvtph_ps(h);
}

/* D FP8 bytes as bf16 (exact: FP8 values have at most 4 significant bits). */
static inline void fp8_row_to_bf16(const uint8_t *p, uint16_t *dst, int64_t D, int e4m3) {
    for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(load_fp8x16(p + d + 16, e4m3),
                                                                  load_fp8x16(p + d, e4m3)));
}

/* Prefetch `lines` cache lines of the next chunk's rows, continuing where the last call
 * stopped: rows[i] + 64 * j for j < per_row. */
typedef struct { const char *rows[32]; int64_t nrows, per_row, row, line; } prefetcher;

static inline void prefetch_some(prefetcher *pf, int64_t lines) {
    for (; lines > 0 && pf->row < pf->nrows; lines--) {
        __builtin_prefetch(pf->rows[pf->row] + 64 * pf->line, 0, 3);
        if (++pf->line == pf->per_row) { pf->line = 0; pf->row++; }
    }
}

/* One sequence, kv heads [h0, h1). acc holds H * D floats, m and l H floats each. */
#define DEFINE_SEQ_AVX(NAME, GC, DC, FP8)                                                      \
static int NAME(const void *q_, const void *kc_, const void *vc_, const int64_t *tab,        \
                int64_t L, void *out_, const decode_shape *sh, int64_t h0, int64_t h1) {      \
    const uint16_t *q = q_;                                                                  \
    const char *kc = kc_, *vc = vc_; /* bytes: cache elements are ES of them */              \
    uint16_t *out = out_;                                                                    \
    const int64_t ES = FP8 ? 1 : 2, e4m3 = sh->e4m3;                                         \
    const int64_t bs = sh->bs, shift = sh->shift, row = sh->KVH * DC, blk = bs * row;        \
    const int64_t span = (h1 - h0) * DC;                                                     \
    uint16_t kb16[FP8 ? 16 : 1][DC]; /* FP8: the head's keys of a chunk as bf16 */           \
    (void)e4m3, (void)kb16;                                                                  \
    const float scale = sh->scale;                                                           \
    float *acc = (float *)malloc(sizeof(float) * (size_t)(sh->H * DC + 2 * sh->H));          \
    if (!acc) return -2;                                                                     \
    float *m = acc + sh->H * DC, *l = m + sh->H;                                             \
    const int64_t steps = (h1 - h0) * GC;                                                    \
    for (int64_t j = h0 * GC; j < h1 * GC; j++) {                                            \
        m[j] = -INFINITY;                                                                    \
        l[j] = 0.f;                                                                          \
        for (int64_t d = 0; d < DC; d++) acc[j * DC + d] = 0.f;                              \
    }                                                                                        \
    for (int64_t c = 0; c < L; c += 16) {                                                    \
        const int64_t nt = L - c < 16 ? L - c : 16;                                          \
        const char *kr[16], *vr[16];                                                         \
        for (int64_t t = 0; t < 16; t++) {                                                   \
            const int64_t tt = c + (t < nt ? t : 0);                                         \
            const int64_t off = tab[tt >> shift] * blk + (tt & (bs - 1)) * row + h0 * DC;    \
            kr[t] = kc + off * ES;                                                           \
            vr[t] = vc + off * ES;                                                           \
        }                                                                                    \
        prefetcher pf = {.nrows = 0, .per_row = (span * ES + 63) / 64};                      \
        for (int64_t t = c + 16; t < c + 32 && t < L; t++) {                                 \
            const int64_t off = tab[t >> shift] * blk + (t & (bs - 1)) * row + h0 * DC;      \
            pf.rows[pf.nrows++] = kc + off * ES;                                             \
            pf.rows[pf.nrows++] = vc + off * ES;                                             \
        }                                                                                    \
        const int64_t total = pf.nrows * pf.per_row;                                         \
        const __mmask16 valid = (__mmask16)(nt == 16 ? 0xffffu : (1u << nt) - 1u);          \
        int64_t step = 0, issued = 0;                                                        \
        for (int64_t h = h0; h < h1; h++) {                                                  \
            const int64_t hd = (h - h0) * DC * ES; /* the head's bytes in a row pointer */   \
            const uint16_t *kh[16]; /* the head's 16 keys as bf16 */                         \
            for (int t = 0; t < 16; t++) {                                                   \
                if (FP8) fp8_row_to_bf16((const uint8_t *)(kr[t] + hd), kb16[t], DC, e4m3);  \
                kh[t] = FP8 ? kb16[t] : (const uint16_t *)(kr[t] + hd);                      \
            }                                                                                \
            float p[GC][16];                                                                 \
            __m512 ac[GC][DC / 16];                                                          \
            for (int g = 0; g < GC; g++) {                                                   \
                const int64_t j = h * GC + g;                                                \
                const int64_t upto = total * ++step / steps;                                 \
                prefetch_some(&pf, upto - issued);                                           \
                issued = upto;                                                               \
                __m512bh qv[DC / 32];                                                        \
                for (int v = 0; v < DC / 32; v++)                                            \
                    qv[v] = (__m512bh)_mm512_loadu_si512(q + j * DC + 32 * v);               \
                __m512 dots[16];                                                             \
                for (int t = 0; t < 16; t++) {                                               \
                    __m512 x = _mm512_setzero_ps();                                          \
                    for (int v = 0; v < DC / 32; v++)                                        \
                        x = _mm512_dpbf16_ps(x, qv[v],                                       \
                                (__m512bh)_mm512_loadu_si512(kh[t] + 32 * v));                \
                    dots[t] = x;                                                             \
                }                                                                            \
                const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,        \
                        _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(scale)));            \
                const float mnew = fmaxf(m[j], _mm512_reduce_max_ps(s));                     \
                const float corr = m[j] == -INFINITY ? 0.f : exp_nonpos(m[j] - mnew);        \
                _mm512_storeu_ps(p[g], _mm512_sub_ps(s, _mm512_set1_ps(mnew)));              \
                for (int t = 0; t < 16; t++) p[g][t] = exp_nonpos(p[g][t]); /* vectorised */ \
                const __m512 e = _mm512_maskz_loadu_ps(valid, p[g]);                         \
                _mm512_storeu_ps(p[g], e);                                                   \
                l[j] = l[j] * corr + _mm512_reduce_add_ps(e);                                \
                m[j] = mnew;                                                                 \
                for (int f = 0; f < DC / 16; f++)                                            \
                    ac[g][f] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * DC + 16 * f),         \
                                             _mm512_set1_ps(corr));                          \
            }                                                                                \
            for (int64_t t = 0; t < nt; t++) {                                               \
                __m512 vv[DC / 16];                                                          \
                for (int f = 0; f < DC / 16; f++)                                            \
                    vv[f] = FP8 ? load_fp8x16((const uint8_t *)(vr[t] + hd) + 16 * f, e4m3)  \
                                : load_bf16x16((const uint16_t *)(vr[t] + hd) + 16 * f);     \
                for (int g = 0; g < GC; g++) {                                               \
                    const __m512 pt = _mm512_set1_ps(p[g][t]);                               \
                    for (int f = 0; f < DC / 16; f++)                                        \
                        ac[g][f] = _mm512_fmadd_ps(pt, vv[f], ac[g][f]);                     \
                }                                                                            \
            }                                                                                \
            for (int g = 0; g < GC; g++)                                                     \
                for (int f = 0; f < DC / 16; f++)                                            \
                    _mm512_storeu_ps(acc + (h * GC + g) * DC + 16 * f, ac[g][f]);             \
        }                                                                                    \
    }                                                                                        \
    for (int64_t j = h0 * GC; j < h1 * GC; j++)                                              \
        for (int64_t d = 0; d < DC; d++)                                                     \
            out[j * DC + d] = bf16_round(FP8 ? acc[j * DC + d] / l[j] * sh->v_scale          \
                                             : acc[j * DC + d] / l[j]);                      \
    free(acc);                                                                               \
    return 0;                                                                                \
}

#define DEFINE_KERNEL_AVX(NAME, GC, DC)                                                        \
    DEFINE_SEQ_AVX(NAME##_seq, GC, DC, 0)                                                      \
    DEFINE_ENTRY(NAME, uint16_t, NAME##_seq, GC, DC)

/* FP8: the e4m3 bytes read as 2^-8 of their value (load_fp8x16), so both scales take 2^8. */
#define DEFINE_KERNEL_AVX_FP8(NAME, GC, DC)                                                    \
    DEFINE_SEQ_AVX(NAME##_seq, GC, DC, 1)                                                      \
int NAME(const uint16_t *q, const uint8_t *kc, const uint8_t *vc, const int64_t *bt,          \
         int64_t bt_stride, const int64_t *seq_lens, uint16_t *out, int64_t n, int64_t H,    \
         int64_t KVH, int64_t d_arg, int64_t bs, float scale, float v_scale,                 \
         const float *lut, int64_t e4m3) {                                                    \
    const int rc = check_shape(H, KVH, d_arg, bs, GC, DC);                                    \
    if (rc) return rc;                                                                        \
    const int64_t shift = block_shift(bs);                                                    \
    const float f = e4m3 ? 256.f : 1.f;                                                       \
    const decode_shape sh = {H, KVH, DC, GC, bs, shift, bt_stride, scale * f, v_scale * f,    \
                             lut, (int)e4m3};                                                 \
    return run_tasks(NAME##_seq, q, kc, vc, bt, seq_lens, out, n, sizeof(uint16_t), &sh);     \
}
