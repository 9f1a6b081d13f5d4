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
 * (online softmax over 16-token chunks, vdpbf16ps scores, paced prefetch of the next chunk;
 * `paged_decode_avx512.h`).
 * FP8 caches (`paged_decode_fp8_*`: bf16 or f32 queries, one byte per cache element) are
 * read through a 256-entry table of the format's values (`lut`), or on AVX512-BF16 CPUs
 * converted 16 bytes at a time through fp16 (exact). The layer's scales never touch the
 * elements: the caller folds k_scale into `scale`, and `v_scale` multiplies the output.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

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
    float scale, v_scale; /* v_scale multiplies the output: 1 unless the cache is FP8 */
    const float *lut;     /* FP8 caches: the value of each byte (NULL otherwise) */
    int e4m3;             /* FP8 caches: 1 for e4m3, 0 for e5m2 */
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
#define DEFINE_SEQ(NAME, T, LOAD, STORE, TC, LOADC, GC, DC)                                    \
static int NAME(const void *q_, const void *kc_, const void *vc_, const int64_t *tab,         \
                int64_t L, void *out_, const decode_shape *sh, int64_t h0, int64_t h1) {      \
    const T *q = q_;                                                                          \
    const TC *kc = kc_, *vc = vc_;                                                            \
    const float *lut = sh->lut; /* read by LOADC for FP8 caches */                            \
    (void)lut;                                                                                \
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
    prefetch_rows(kc + tab[0] * blk, blk * (int64_t)sizeof(TC), 3);                           \
    for (int64_t i = 0; i < nblk; i++) {                                                      \
        if (i + 1 < nblk) prefetch_rows(kc + tab[i + 1] * blk, blk * (int64_t)sizeof(TC), 3); \
        prefetch_rows(vc + tab[i] * blk, blk * (int64_t)sizeof(TC), 2);                       \
        const TC *kb = kc + tab[i] * blk;                                                     \
        const int64_t nt = L - i * bs < bs ? L - i * bs : bs;                                 \
        for (int64_t t = 0; t < nt; t++) {                                                    \
            for (int64_t h = h0; h < h1; h++) {                                               \
                float kf[DC ? DC : MAX_D];                                                    \
                for (int64_t d = 0; d < D; d++) kf[d] = LOADC(kb, t * row + h * D + d);      \
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
        inv[j] = sh->v_scale / sum;                                                           \
    }                                                                                         \
    for (int64_t i = 0; i < nblk; i++) {                                                      \
        const TC *vb = vc + tab[i] * blk;                                                     \
        const int64_t nt = L - i * bs < bs ? L - i * bs : bs;                                 \
        for (int64_t t = 0; t < nt; t++) {                                                    \
            for (int64_t h = h0; h < h1; h++) {                                               \
                float vf[DC ? DC : MAX_D];                                                    \
                for (int64_t d = 0; d < D; d++) vf[d] = LOADC(vb, t * row + h * D + d);      \
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
}

/* 0, or the error code for a call with these shapes: -3 a specialisation (GC, DC > 0) given
 * other ones, -1 unsupported. */
static int check_shape(int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t GC, int64_t DC) {
    if ((DC && D != DC) || (GC && H / KVH != GC)) return -3;
    if (bs <= 0 || (bs & (bs - 1))) return -1; /* a power of two */
    if (H / KVH > MAX_G || D > MAX_D) return -1;
    return 0;
}

/* log2 of a block size check_shape accepted (a power of two). */
static int64_t block_shift(int64_t bs) {
    int64_t shift = 0;
    while ((INT64_C(1) << shift) < bs) shift++;
    return shift;
}

/* The exported kernels: a cache of the query's type T, or an FP8 cache (`lut` the value of
 * each byte, `e4m3` 1 or 0 for e5m2, k_scale folded into `scale` by the caller). */
#define DEFINE_ENTRY(NAME, T, SEQ, GC, DC)                                                     \
int NAME(const T *q, const T *kc, const T *vc, const int64_t *bt, int64_t bt_stride,          \
         const int64_t *seq_lens, T *out, int64_t n, int64_t H, int64_t KVH, int64_t d_arg,   \
         int64_t bs, float scale) {                                                           \
    const int rc = check_shape(H, KVH, d_arg, bs, GC, DC);                                    \
    if (rc) return rc;                                                                        \
    const int64_t shift = block_shift(bs);                                                    \
    const decode_shape sh = {H, KVH, d_arg, H / KVH, bs, shift, bt_stride, scale, 1.f, NULL, 0}; \
    return run_tasks(SEQ, q, kc, vc, bt, seq_lens, out, n, sizeof(T), &sh);                   \
}
#define DEFINE_ENTRY_FP8(NAME, T, SEQ, GC, DC)                                                 \
int NAME(const T *q, const uint8_t *kc, const uint8_t *vc, const int64_t *bt,                 \
         int64_t bt_stride, const int64_t *seq_lens, T *out, int64_t n, int64_t H,           \
         int64_t KVH, int64_t d_arg, int64_t bs, float scale, float v_scale,                 \
         const float *lut, int64_t e4m3) {                                                    \
    const int rc = check_shape(H, KVH, d_arg, bs, GC, DC);                                    \
    if (rc) return rc;                                                                        \
    const int64_t shift = block_shift(bs);                                                    \
    const decode_shape sh = {H, KVH, d_arg, H / KVH, bs, shift, bt_stride, scale, v_scale,    \
                             lut, (int)e4m3};                                                 \
    return run_tasks(SEQ, q, kc, vc, bt, seq_lens, out, n, sizeof(T), &sh);                   \
}
#define DEFINE_KERNEL(NAME, T, LOAD, STORE, GC, DC)                                            \
    DEFINE_SEQ(NAME##_seq, T, LOAD, STORE, T, LOAD, GC, DC)                                    \
    DEFINE_ENTRY(NAME, T, NAME##_seq, GC, DC)
#define DEFINE_KERNEL_FP8(NAME, T, LOAD, STORE, GC, DC)                                        \
    DEFINE_SEQ(NAME##_seq, T, LOAD, STORE, uint8_t, FP8_LOAD, GC, DC)                          \
    DEFINE_ENTRY_FP8(NAME, T, NAME##_seq, GC, DC)

#define F32_LOAD(p, i) ((p)[i])
#define F32_STORE(x) (x)
#define BF16_LOAD(p, i) bf16_to_f32((p)[i])
#define BF16_STORE(x) bf16_round(x)
#define FP8_LOAD(p, i) lut[(p)[i]]

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "paged_decode_avx512.h"
#define DEFINE_BF16(SUFFIX, GC, DC) DEFINE_KERNEL_AVX(paged_decode_bf16##SUFFIX, GC, DC)
#define DEFINE_FP8_BF16(SUFFIX, GC, DC) DEFINE_KERNEL_AVX_FP8(paged_decode_fp8_bf16##SUFFIX, GC, DC)
#else
#define DEFINE_BF16(SUFFIX, GC, DC)                                                            \
    DEFINE_KERNEL(paged_decode_bf16##SUFFIX, uint16_t, BF16_LOAD, BF16_STORE, GC, DC)
#define DEFINE_FP8_BF16(SUFFIX, GC, DC)                                                        \
    DEFINE_KERNEL_FP8(paged_decode_fp8_bf16##SUFFIX, uint16_t, BF16_LOAD, BF16_STORE, GC, DC)
#endif

#define DEFINE_BOTH(SUFFIX, GC, DC)                                                            \
    DEFINE_KERNEL(paged_decode_f32##SUFFIX, float, F32_LOAD, F32_STORE, GC, DC)                \
    DEFINE_BF16(SUFFIX, GC, DC)                                                                \
    DEFINE_FP8_BF16(SUFFIX, GC, DC)

DEFINE_KERNEL(paged_decode_f32, float, F32_LOAD, F32_STORE, 0, 0)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, BF16_LOAD, BF16_STORE, 0, 0)
DEFINE_KERNEL_FP8(paged_decode_fp8_f32, float, F32_LOAD, F32_STORE, 0, 0)
DEFINE_KERNEL_FP8(paged_decode_fp8_bf16, uint16_t, BF16_LOAD, BF16_STORE, 0, 0)
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
