/* Paged decode attention for CPUs: one query token per sequence, grouped-query attention,
 * K/V read in place from the paged cache through the block table (no gather copy).
 *
 * Layouts (all contiguous):
 *   q, out        [n, H, D]
 *   k/v cache     [num_blocks, block_size, KVH, D]
 *   block_tables  [n, bt_stride] int64
 *   seq_lens      [n] int64 (tokens to attend to, the new one included)
 * One OpenMP task per sequence, all heads: a cache block's rows (every kv head of a token)
 * are read front to back, and while one block is scored the next K block and this block's
 * V are prefetched. A decode step is bound by reading the cache from DRAM (a step of the
 * bundled model at 55 sequences x 260 tokens reads ~330 MB), and tasks per (sequence, kv
 * head) read a third of each row and left the hardware prefetchers short streams (measured
 * 780 -> 580 us per layer at 55 x 128-256 tokens, cache cold). Accumulation is fp32. The dot
 * products are vectorised by allowing re-association (-fassociative-math): the summation
 * order differs from SDPA's by rounding only, and is fixed at compile time, so results stay
 * deterministic.
 * On CPUs with AVX512-BF16 the bf16 specialisations below take a single-pass kernel instead
 * (online softmax over 16-token chunks, vdpbf16ps scores, paced prefetch of the next chunk).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/bf16.h"

#define MAX_G 16
#define MAX_D 256

/* exp for x <= 0 (softmax after subtracting the max), vectorisable: x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by a degree-6 Taylor polynomial (relative error < 2e-7 in that
 * range), times 2^n built in the exponent bits. Inputs below -87 give 0. */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    /* fmaf keeps the two-step ln2 reduction apart under -fassociative-math */
    const float r = fmaf(-n, 1.428606765330187e-06f, fmaf(-n, 0.693145751953125f, x));
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

static inline void prefetch_rows(const void *p, int64_t bytes, int locality) {
    const char *c = (const char *)p;
    for (int64_t off = 0; off < bytes; off += 64) {
        if (locality == 3) __builtin_prefetch(c + off, 0, 3);
        else __builtin_prefetch(c + off, 0, 2);
    }
}

/* The shapes of one call, as the per-sequence functions see them. */
typedef struct {
    int64_t H, KVH, D, G, bs, shift, bt_stride;
    float scale;
} decode_shape;

/* One sequence's attention for kv heads [h0, h1): q and out point at its rows, tab at its
 * block-table row. Returns 0, or -2 when out of memory. */
typedef int (*decode_seq_fn)(const void *q, const void *kc, const void *vc, const int64_t *tab,
                             int64_t L, void *out, const decode_shape *sh, int64_t h0,
                             int64_t h1);

/* Runs `seq` over the batch on the OpenMP threads: one task per sequence or, with few
 * sequences, one per (sequence, kv head) so that every thread has work. A sequence of length
 * <= 0 (a padding row) gets a zero output (all-zero bits in f32 and bf16 alike). */
static int run_tasks(decode_seq_fn seq, const void *q, const void *kc, const void *vc,
                     const int64_t *bt, const int64_t *seq_lens, void *out, int64_t n,
                     int64_t elem, const decode_shape *sh) {
    const int64_t parts = n < 2 * omp_get_max_threads() ? sh->KVH : 1;
    const int64_t seq_bytes = sh->H * sh->D * elem, head_bytes = sh->G * sh->D * elem;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * parts; task++) {
        const int64_t b = task / parts, h0 = task % parts * sh->KVH / parts;
        const int64_t h1 = (task % parts + 1) * sh->KVH / parts;
        char *ob = (char *)out + b * seq_bytes;
        if (seq_lens[b] <= 0)
            memset(ob + h0 * head_bytes, 0, (size_t)((h1 - h0) * head_bytes));
        else if (seq((const char *)q + b * seq_bytes, kc, vc, bt + b * sh->bt_stride,
                     seq_lens[b], ob, sh, h0, h1))
            failed = 1;
    }
    return failed ? -2 : 0;
}

/* GC / DC > 0 fix the query-group size / head dim at compile time, so the inner loops
 * unroll and vectorise (measured 1.5-2x faster than the generic version, 0 = any). */
#define DEFINE_KERNEL(NAME, T, LOAD, STORE, GC, DC)                                            \
static int NAME##_seq(const void *q_, const void *kc_, const void *vc_, const int64_t *tab,    \
                      int64_t L, void *out_, const decode_shape *sh, int64_t h0, int64_t h1) { \
    const T *q = q_, *kc = kc_, *vc = vc_;                                                    \
    T *ob = out_;                                                                             \
    const int64_t H = sh->H, bs = sh->bs, D = DC ? DC : sh->D, G = GC ? GC : sh->G;           \
    const int64_t row = sh->KVH * D, blk = bs * row; /* elements per token row, per block */  \
    const int64_t nblk = (L + bs - 1) / bs;                                                   \
    /* scores s[j * L + t] of the H query heads; fp32 q, accumulators, 1 / sums */          \
    float *s = (float *)malloc(sizeof(float) * (size_t)(H * L + 2 * H * D + H));              \
    if (!s) return -2;                                                                        \
    float *qf = s + H * L, *acc = qf + H * D, *inv = acc + H * D;                             \
    for (int64_t i = h0 * G * D; i < h1 * G * D; i++) {                                       \
        qf[i] = LOAD(q, i) * sh->scale;                                                       \
        acc[i] = 0.f;                                                                         \
    }                                                                                         \
    prefetch_rows(kc + tab[0] * blk, blk * (int64_t)sizeof(T), 3);                            \
    for (int64_t i = 0; i < nblk; i++) {                                                      \
        if (i + 1 < nblk) prefetch_rows(kc + tab[i + 1] * blk, blk * (int64_t)sizeof(T), 3);  \
        prefetch_rows(vc + tab[i] * blk, blk * (int64_t)sizeof(T), 2);                        \
        const T *kb = kc + tab[i] * blk;                                                      \
        const int64_t nt = L - i * bs < bs ? L - i * bs : bs;                                 \
        for (int64_t t = 0; t < nt; t++) {                                                    \
            for (int64_t h = h0; h < h1; h++) {                                               \
                float kf[DC ? DC : MAX_D];                                                    \
                for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kb, t * row + h * D + d);       \
                for (int64_t g = 0; g < G; g++) {                                             \
                    const float *qj = qf + (h * G + g) * D;                                   \
                    float dot = 0.f;                                                          \
                    for (int64_t d = 0; d < D; d++) dot += qj[d] * kf[d];                     \
                    s[(h * G + g) * L + i * bs + t] = dot;                                    \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int64_t j = h0 * G; j < h1 * G; j++) {                                               \
        float *sj = s + j * L, m = -INFINITY, sum = 0.f;                                      \
        for (int64_t t = 0; t < L; t++) m = sj[t] > m ? sj[t] : m;                            \
        for (int64_t t = 0; t < L; t++) {                                                     \
            const float e = exp_nonpos(sj[t] - m);                                            \
            sj[t] = e;                                                                        \
            sum += e;                                                                         \
        }                                                                                     \
        inv[j] = 1.f / sum;                                                                   \
    }                                                                                         \
    for (int64_t i = 0; i < nblk; i++) {                                                      \
        const T *vb = vc + tab[i] * blk;                                                      \
        const int64_t nt = L - i * bs < bs ? L - i * bs : bs;                                 \
        for (int64_t t = 0; t < nt; t++) {                                                    \
            for (int64_t h = h0; h < h1; h++) {                                               \
                float vf[DC ? DC : MAX_D];                                                    \
                for (int64_t d = 0; d < D; d++) vf[d] = LOAD(vb, t * row + h * D + d);       \
                for (int64_t g = 0; g < G; g++) {                                             \
                    const float p = s[(h * G + g) * L + i * bs + t];                          \
                    float *aj = acc + (h * G + g) * D;                                        \
                    for (int64_t d = 0; d < D; d++) aj[d] += p * vf[d];                       \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int64_t j = h0 * G; j < h1 * G; j++)                                                 \
        for (int64_t d = 0; d < D; d++) ob[j * D + d] = STORE(acc[j * D + d] * inv[j]);      \
    free(s);                                                                                  \
    return 0;                                                                                 \
}                                                                                             \
int NAME(const T *q, const T *kc, const T *vc, const int64_t *bt, int64_t bt_stride,          \
         const int64_t *seq_lens, T *out, int64_t n, int64_t H, int64_t KVH, int64_t d_arg,   \
         int64_t bs, float scale) {                                                           \
    const int64_t D = DC ? DC : d_arg;                                                        \
    const int64_t G = GC ? GC : H / KVH;                                                      \
    if ((DC && d_arg != DC) || (GC && H / KVH != GC)) return -3;                              \
    if (bs & (bs - 1)) return -1; /* a power of two */                                        \
    if (G > MAX_G || D > MAX_D) return -1;                                                    \
    const decode_shape sh = {H, KVH, D, G, bs, 0, bt_stride, scale};                          \
    return run_tasks(NAME##_seq, q, kc, vc, bt, seq_lens, out, n, sizeof(T), &sh);            \
}

#define F32_LOAD(p, i) ((p)[i])
#define F32_STORE(x) (x)
#define BF16_LOAD(p, i) bf16_to_f32((p)[i])
#define BF16_STORE(x) bf16_round(x)

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
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
#define DEFINE_SEQ_AVX(NAME, GC, DC)                                                           \
static int NAME(const void *q_, const void *kc_, const void *vc_, const int64_t *tab,        \
                int64_t L, void *out_, const decode_shape *sh, int64_t h0, int64_t h1) {      \
    const uint16_t *q = q_, *kc = kc_, *vc = vc_;                                            \
    uint16_t *out = out_;                                                                    \
    const int64_t bs = sh->bs, shift = sh->shift, row = sh->KVH * DC, blk = bs * row;        \
    const int64_t span = (h1 - h0) * DC;                                                     \
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
        const uint16_t *kr[16], *vr[16];                                                     \
        for (int64_t t = 0; t < 16; t++) {                                                   \
            const int64_t tt = c + (t < nt ? t : 0);                                         \
            const int64_t off = tab[tt >> shift] * blk + (tt & (bs - 1)) * row + h0 * DC;    \
            kr[t] = kc + off;                                                                \
            vr[t] = vc + off;                                                                \
        }                                                                                    \
        prefetcher pf = {.nrows = 0, .per_row = (span * 2 + 63) / 64};                       \
        for (int64_t t = c + 16; t < c + 32 && t < L; t++) {                                 \
            const int64_t off = tab[t >> shift] * blk + (t & (bs - 1)) * row + h0 * DC;      \
            pf.rows[pf.nrows++] = (const char *)(kc + off);                                  \
            pf.rows[pf.nrows++] = (const char *)(vc + off);                                  \
        }                                                                                    \
        const int64_t total = pf.nrows * pf.per_row;                                         \
        const __mmask16 valid = (__mmask16)(nt == 16 ? 0xffffu : (1u << nt) - 1u);          \
        int64_t step = 0, issued = 0;                                                        \
        for (int64_t h = h0; h < h1; h++) {                                                  \
            const int64_t hd = (h - h0) * DC; /* the head's offset in a row pointer */        \
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
                                (__m512bh)_mm512_loadu_si512(kr[t] + hd + 32 * v));          \
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
                for (int f = 0; f < DC / 16; f++) vv[f] = load_bf16x16(vr[t] + hd + 16 * f); \
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
        for (int64_t d = 0; d < DC; d++) out[j * DC + d] = bf16_round(acc[j * DC + d] / l[j]); \
    free(acc);                                                                               \
    return 0;                                                                                \
}

#define DEFINE_KERNEL_AVX(NAME, GC, DC)                                                        \
DEFINE_SEQ_AVX(NAME##_seq, GC, DC)                                                             \
int NAME(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *bt,        \
         int64_t bt_stride, const int64_t *seq_lens, uint16_t *out, int64_t n, int64_t H,    \
         int64_t KVH, int64_t d_arg, int64_t bs, float scale) {                              \
    if (d_arg != DC || H / KVH != GC) return -3;                                              \
    if (bs <= 0 || (bs & (bs - 1))) return -1; /* a power of two */                           \
    int64_t shift = 0;                                                                        \
    while ((INT64_C(1) << shift) < bs) shift++;                                               \
    const decode_shape sh = {H, KVH, DC, GC, bs, shift, bt_stride, scale};                    \
    return run_tasks(NAME##_seq, q, kc, vc, bt, seq_lens, out, n, sizeof(uint16_t), &sh);     \
}
#define DEFINE_BF16(SUFFIX, GC, DC) DEFINE_KERNEL_AVX(paged_decode_bf16##SUFFIX, GC, DC)
#else
#define DEFINE_BF16(SUFFIX, GC, DC)                                                            \
    DEFINE_KERNEL(paged_decode_bf16##SUFFIX, uint16_t, BF16_LOAD, BF16_STORE, GC, DC)
#endif

#define DEFINE_BOTH(SUFFIX, GC, DC)                                                            \
    DEFINE_KERNEL(paged_decode_f32##SUFFIX, float, F32_LOAD, F32_STORE, GC, DC)                \
    DEFINE_BF16(SUFFIX, GC, DC)

DEFINE_KERNEL(paged_decode_f32, float, F32_LOAD, F32_STORE, 0, 0)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, BF16_LOAD, BF16_STORE, 0, 0)
/* Specialisations: (query heads per kv head, head dim) of common models. */
DEFINE_BOTH(_g1_d64, 1, 64)
DEFINE_BOTH(_g2_d64, 2, 64)
DEFINE_BOTH(_g3_d64, 3, 64)
DEFINE_BOTH(_g4_d64, 4, 64)
DEFINE_BOTH(_g1_d128, 1, 128)
DEFINE_BOTH(_g2_d128, 2, 128)
DEFINE_BOTH(_g4_d128, 4, 128)
DEFINE_BOTH(_g5_d128, 5, 128)
DEFINE_BOTH(_g7_d128, 7, 128)
DEFINE_BOTH(_g8_d128, 8, 128)
