/* Batch-invariant linear layers on CPU: y[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]), where
 * every output element is computed by the same sequence of floating-point operations
 * whatever the row count M, the row's place in x, or the thread that computes it. A token's
 * activations then do not depend on which other tokens share its step, nor on whether it is
 * part of a prefill chunk or a decode step: the deterministic mode's linear.
 *
 * Why not the other kernels: oneDNN, torch's GEMMs and our own VNNI GEMM pick blockings,
 * split-K and micro-kernels by M, so a row's sums are rounded differently in a decode step
 * of 3 rows than in a prefill chunk of 300 (the bf16 resume divergence of issue 38).
 *
 * Arithmetic of one element (fixed): fp32 accumulation in one 8-lane vector over k blocks of
 * 8 (the last block zero-padded), one FMA per block in k order; a fixed horizontal sum
 * (lanes 0-3 + 4-7, then pairwise); + bias; rounded to bf16 to nearest even (bf16 outputs).
 * Register tiles of up to 4 rows x 2 outputs share loads but never mix sums, so the tile
 * shape (tails included) does not change a result. Built without -fassociative-math
 * (`linear.load_invariant`) so the compiler may not re-associate any of it. Without AVX2 +
 * FMA the same order runs in scalar code (slow).
 *
 * Layouts (contiguous): x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all bfloat16
 * (`*_bf16`) or all float32 (`*_f32`). Threads split the outputs into strips of 64 that stay
 * in L2 while every row tile passes over them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define MR 4     /* rows per register tile */
#define NR 2     /* outputs per register tile */
#define STRIP 64 /* outputs per thread task */

int linear_invariant_vectorised(void) { return HAVE_AVX2; }

#if HAVE_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));             /* lanes 0+2, 1+3 */
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));      /* (0+2) + (1+3) */
    return _mm_cvtss_f32(s);
}

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* sums[i][j] = x row i . w row j for an mr x nr tile: x rows [KP] fp32 zero-padded, w rows
 * [K] in their own type, their last partial block read through a zero-padded copy. */
#define TILE_SUMS(NAME, T, LOAD)                                                             \
    static inline __attribute__((always_inline)) void NAME(                                  \
        const float *x, const T *w, int64_t K, int64_t KP, int mr, int nr,                    \
        float sums[MR][NR]) {                                                                \
        __m256 acc[MR][NR];                                                                  \
        for (int i = 0; i < mr; i++)                                                         \
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();                     \
        const int64_t KF = K / 8 * 8;                                                        \
        for (int64_t k = 0; k < KP; k += 8) {                                                \
            __m256 wv[NR];                                                                   \
            for (int j = 0; j < nr; j++) {                                                   \
                if (k < KF) {                                                                \
                    wv[j] = LOAD(w + j * K + k);                                             \
                } else {                                                                     \
                    T tail[8] = {0};                                                         \
                    memcpy(tail, w + j * K + k, sizeof(T) * (size_t)(K - k));                \
                    wv[j] = LOAD(tail);                                                      \
                }                                                                            \
            }                                                                                \
            for (int i = 0; i < mr; i++) {                                                   \
                const __m256 xv = _mm256_loadu_ps(x + i * KP + k);                           \
                for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < mr; i++)                                                         \
            for (int j = 0; j < nr; j++) sums[i][j] = hsum8(acc[i][j]);                      \
    }
#else
/* The same order in scalar code: lane l of the accumulator holds k = l mod 8. */
#define TILE_SUMS(NAME, T, TO_F32)                                                           \
    static inline void NAME(const float *x, const T *w, int64_t K, int64_t KP, int mr,        \
                            int nr, float sums[MR][NR]) {                                    \
        for (int i = 0; i < mr; i++)                                                         \
            for (int j = 0; j < nr; j++) {                                                   \
                float lane[8] = {0};                                                         \
                for (int64_t k = 0; k < KP; k += 8)                                          \
                    for (int l = 0; l < 8; l++) {                                            \
                        const float wk = k + l < K ? TO_F32(w[j * K + k + l]) : 0.f;         \
                        lane[l] = fmaf(x[i * KP + k + l], wk, lane[l]);                      \
                    }                                                                        \
                const float a = lane[0] + lane[4], b = lane[1] + lane[5];                    \
                const float c = lane[2] + lane[6], d = lane[3] + lane[7];                    \
                sums[i][j] = (a + c) + (b + d);                                              \
            }                                                                                \
    }
#define load8_f32 f32_id
#define load8_bf16 bf16_to_f32
#endif

static inline float f32_id(float v) { return v; }

TILE_SUMS(tile_f32, float, load8_f32)
TILE_SUMS(tile_bf16, uint16_t, load8_bf16)

/* One tile's sums, dispatched to a compile-time shape (the tails take smaller ones). */
#define RUN_TILE(NAME, TILE, T)                                                              \
    static void NAME(const float *x, const T *w, int64_t K, int64_t KP, int mr, int nr,      \
                     float sums[MR][NR]) {                                                   \
        switch (mr * 8 + nr) {                                                               \
        case 4 * 8 + 2: TILE(x, w, K, KP, 4, 2, sums); break;                                \
        case 4 * 8 + 1: TILE(x, w, K, KP, 4, 1, sums); break;                                \
        case 3 * 8 + 2: TILE(x, w, K, KP, 3, 2, sums); break;                                \
        case 3 * 8 + 1: TILE(x, w, K, KP, 3, 1, sums); break;                                \
        case 2 * 8 + 2: TILE(x, w, K, KP, 2, 2, sums); break;                                \
        case 2 * 8 + 1: TILE(x, w, K, KP, 2, 1, sums); break;                                \
        case 1 * 8 + 2: TILE(x, w, K, KP, 1, 2, sums); break;                                \
        default: TILE(x, w, K, KP, 1, 1, sums); break;                                       \
        }                                                                                    \
    }

RUN_TILE(run_tile_f32, tile_f32, float)
RUN_TILE(run_tile_bf16, tile_bf16, uint16_t)

/* The driver: x converted once to fp32 rows of KP = K rounded up to 8 (zero-padded); each
 * thread takes strips of STRIP outputs and passes every row tile over them. */
#define INVARIANT_GEMM(NAME, T, RUN, TO_F32, STORE)                                          \
    int NAME(const T *x, const T *w, const T *bias, T *y, int64_t M, int64_t N, int64_t K) {  \
        if (M < 0 || N < 1 || K < 1) return -1;                                              \
        if (M == 0) return 0;                                                                \
        const int64_t KP = (K + 7) / 8 * 8;                                                  \
        float *xf = (float *)malloc(sizeof(float) * (size_t)(M * KP));                       \
        if (!xf) return -2;                                                                  \
        for (int64_t m = 0; m < M; m++) {                                                    \
            for (int64_t k = 0; k < K; k++) xf[m * KP + k] = TO_F32(x[m * K + k]);           \
            for (int64_t k = K; k < KP; k++) xf[m * KP + k] = 0.f;                           \
        }                                                                                    \
        const int64_t strips = (N + STRIP - 1) / STRIP;                                      \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t s = 0; s < strips; s++) {                                               \
            const int64_t o0 = s * STRIP, n = N - o0 < STRIP ? N - o0 : STRIP;               \
            for (int64_t m = 0; m < M; m += MR) {                                            \
                const int mr = M - m < MR ? (int)(M - m) : MR;                               \
                for (int64_t j = 0; j < n; j += NR) {                                        \
                    const int nr = n - j < NR ? (int)(n - j) : NR;                           \
                    float sums[MR][NR];                                                      \
                    RUN(xf + m * KP, w + (o0 + j) * K, K, KP, mr, nr, sums);                 \
                    for (int i = 0; i < mr; i++)                                             \
                        for (int jj = 0; jj < nr; jj++) {                                    \
                            const int64_t o = o0 + j + jj;                                   \
                            const float b = bias ? TO_F32(bias[o]) : 0.f;                    \
                            y[(m + i) * N + o] = STORE(sums[i][jj] + b);                     \
                        }                                                                    \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        free(xf);                                                                            \
        return 0;                                                                            \
    }

INVARIANT_GEMM(gemm_invariant_bf16, uint16_t, run_tile_bf16, bf16_to_f32, bf16_round)
INVARIANT_GEMM(gemm_invariant_f32, float, run_tile_f32, f32_id, f32_id)
