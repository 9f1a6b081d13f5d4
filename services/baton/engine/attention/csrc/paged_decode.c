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
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

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

/* GC / DC > 0 fix the query-group size / head dim at compile time, so the inner loops
 * unroll and vectorise (measured 1.5-2x faster than the generic version, 0 = any). */
#define DEFINE_KERNEL(NAME, T, LOAD, STORE, GC, DC)                                            \
int NAME(const T *q, const T *kc, const T *vc, const int64_t *bt, int64_t bt_stride,          \
         const int64_t *seq_lens, T *out, int64_t n, int64_t H, int64_t KVH, int64_t d_arg,   \
         int64_t bs, float scale) {                                                           \
    const int64_t D = DC ? DC : d_arg;                                                        \
    const int64_t G = GC ? GC : H / KVH;                                                      \
    if ((DC && d_arg != DC) || (GC && H / KVH != GC)) return -3;                              \
    if (bs & (bs - 1)) return -1; /* a power of two */                                        \
    if (G > MAX_G || D > MAX_D) return -1;                                                    \
    const int64_t row = KVH * D, blk = bs * row; /* elements per token row, per block */      \
    /* Few sequences: one task per (sequence, kv head), so every thread has work. */          \
    const int64_t parts = n < 2 * omp_get_max_threads() ? KVH : 1;                            \
    int failed = 0;                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                          \
    for (int64_t task = 0; task < n * parts; task++) {                                        \
        const int64_t b = task / parts, h0 = task % parts * KVH / parts;                      \
        const int64_t h1 = (task % parts + 1) * KVH / parts;                                  \
        const int64_t L = seq_lens[b];                                                        \
        T *ob = out + b * H * D;                                                              \
        if (L <= 0) {                                                                         \
            for (int64_t i = h0 * G * D; i < h1 * G * D; i++) ob[i] = STORE(0.f);             \
            continue;                                                                         \
        }                                                                                     \
        const int64_t nblk = (L + bs - 1) / bs;                                               \
        const int64_t *tab = bt + b * bt_stride;                                              \
        /* scores s[j * L + t] of the H query heads; fp32 q, accumulators, 1 / sums */      \
        float *s = (float *)malloc(sizeof(float) * (size_t)(H * L + 2 * H * D + H));          \
        if (!s) { failed = 1; continue; }                                                     \
        float *qf = s + H * L, *acc = qf + H * D, *inv = acc + H * D;                         \
        for (int64_t i = h0 * G * D; i < h1 * G * D; i++) {                                   \
            qf[i] = LOAD(q, b * H * D + i) * scale;                                           \
            acc[i] = 0.f;                                                                     \
        }                                                                                     \
        prefetch_rows(kc + tab[0] * blk, blk * (int64_t)sizeof(T), 3);                        \
        for (int64_t i = 0; i < nblk; i++) {                                                  \
            if (i + 1 < nblk) prefetch_rows(kc + tab[i + 1] * blk, blk * (int64_t)sizeof(T), 3); \
            prefetch_rows(vc + tab[i] * blk, blk * (int64_t)sizeof(T), 2);                    \
            const T *kb = kc + tab[i] * blk;                                                  \
            const int64_t nt = L - i * bs < bs ? L - i * bs : bs;                             \
            for (int64_t t = 0; t < nt; t++) {                                                \
                for (int64_t h = h0; h < h1; h++) {                                           \
                    float kf[DC ? DC : MAX_D];                                                \
                    for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kb, t * row + h * D + d);   \
                    for (int64_t g = 0; g < G; g++) {                                         \
                        const float *qj = qf + (h * G + g) * D;                               \
                        float dot = 0.f;                                                      \
                        for (int64_t d = 0; d < D; d++) dot += qj[d] * kf[d];                 \
                        s[(h * G + g) * L + i * bs + t] = dot;                                \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int64_t j = h0 * G; j < h1 * G; j++) {                                           \
            float *sj = s + j * L, m = -INFINITY, sum = 0.f;                                  \
            for (int64_t t = 0; t < L; t++) m = sj[t] > m ? sj[t] : m;                        \
            for (int64_t t = 0; t < L; t++) {                                                 \
                const float e = exp_nonpos(sj[t] - m);                                        \
                sj[t] = e;                                                                    \
                sum += e;                                                                     \
            }                                                                                 \
            inv[j] = 1.f / sum;                                                               \
        }                                                                                     \
        for (int64_t i = 0; i < nblk; i++) {                                                  \
            const T *vb = vc + tab[i] * blk;                                                  \
            const int64_t nt = L - i * bs < bs ? L - i * bs : bs;                             \
            for (int64_t t = 0; t < nt; t++) {                                                \
                for (int64_t h = h0; h < h1; h++) {                                           \
                    float vf[DC ? DC : MAX_D];                                                \
                    for (int64_t d = 0; d < D; d++) vf[d] = LOAD(vb, t * row + h * D + d);   \
                    for (int64_t g = 0; g < G; g++) {                                         \
                        const float p = s[(h * G + g) * L + i * bs + t];                      \
                        float *aj = acc + (h * G + g) * D;                                    \
                        for (int64_t d = 0; d < D; d++) aj[d] += p * vf[d];                   \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int64_t j = h0 * G; j < h1 * G; j++)                                             \
            for (int64_t d = 0; d < D; d++) ob[j * D + d] = STORE(acc[j * D + d] * inv[j]);  \
        free(s);                                                                              \
    }                                                                                         \
    return failed ? -2 : 0;                                                                   \
}

#define F32_LOAD(p, i) ((p)[i])
#define F32_STORE(x) (x)
#define BF16_LOAD(p, i) bf16_to_f32((p)[i])
#define BF16_STORE(x) bf16_round(x)

#define DEFINE_BOTH(SUFFIX, GC, DC)                                                            \
    DEFINE_KERNEL(paged_decode_f32##SUFFIX, float, F32_LOAD, F32_STORE, GC, DC)                \
    DEFINE_KERNEL(paged_decode_bf16##SUFFIX, uint16_t, BF16_LOAD, BF16_STORE, GC, DC)

DEFINE_BOTH(, 0, 0)
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
