/* Linear layers on CPU in bfloat16: y[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]), fp32 sums.
 *
 * With AVX512-BF16 (vdpbf16ps), a GEMM for any row count over weights packed once into pairs
 * of k ("VNNI" layout, the same bytes as the weight): each 512-bit load holds two k of 16
 * output columns, and every row's pair of x values is broadcast against it, so an instruction
 * does 32 multiply-adds with no horizontal sums. A register tile of MR rows x NR * 16 columns
 * (24 fp32 accumulators) runs the whole K; the threads split the columns, each streaming its
 * own strip of the packed weight once (from memory), then from L2 for the next MR rows.
 * Measured against oneDNN's prepacked bf16 GEMM (torch 2.13) over the bundled model's layer
 * linears, weights out of cache, us per layer: M=1 183 vs 250, M=8 213 vs 282, M=60 599 vs
 * 687, M=128 1128 vs 1223, M=2048 16.5k vs 17.8k; and at 1-8 rows as fast as or faster than
 * the row-major GEMV that it replaced (M=4 183 vs 229 us).
 *
 * Without AVX512-BF16: a GEMV over the row-major weight for up to 2 rows (bf16 -> fp32 and
 * FMAs vectorised by -fassociative-math; faster than oneDNN there), and oneDNN above that.
 *
 * Layouts (contiguous): x [M, K], w [N, K], packed [N / 16][K / 2][16][2], bias [N] or NULL,
 * y [M, N]; all bfloat16. Results are rounded to nearest even, as torch rounds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

int linear_bf16_has_vnni(void) { return HAVE_DPBF16; }

/* The VNNI packing of w [N, K]: N a multiple of 16, K even (else -1, nothing written). */
int pack_vnni_bf16(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K) {
    if (N < 16 || N % 16 || K < 2 || K % 2) return -1;
    const int64_t KP = K / 2;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kp = 0; kp < KP; kp++)
            for (int64_t j = 0; j < 16; j++) {
                uint16_t *dst = packed + ((nb * KP + kp) * 16 + j) * 2;
                dst[0] = w[(nb * 16 + j) * K + 2 * kp];
                dst[1] = w[(nb * 16 + j) * K + 2 * kp + 1];
            }
    return 0;
}

#if HAVE_DPBF16
#include "gemm_bf16_tile.h"

/* y = x @ w.T (+ bias) from the packed w; the shape rules of pack_vnni_bf16 (else -1). */
int gemm_vnni_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                   int64_t M, int64_t N, int64_t K) {
    if (M < 1 || N < 16 || N % 16 || K < 2 || K % 2) return -1;
    const int64_t blocks = N / 16, tasks = (blocks + BF16_NR - 1) / BF16_NR;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b0 = t * BF16_NR, nr = blocks - b0 < BF16_NR ? blocks - b0 : BF16_NR;
        const uint16_t *wpn = packed + b0 * (K / 2) * 32;
        const uint16_t *bn = bias ? bias + b0 * 16 : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += BF16_MR) {
            const int mr = M - m0 < BF16_MR ? (int)(M - m0) : BF16_MR;
            const uint16_t *xm = x + m0 * K;
            uint16_t *ym = y + m0 * N + b0 * 16;
            bf16_tile_any(xm, wpn, bn, ym, mr, (int)nr, N, K);
        }
    }
    return 0;
}
#else
int gemm_vnni_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                   int64_t M, int64_t N, int64_t K) {
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return -3; /* built without AVX512-BF16: linear_bf16_has_vnni() is 0 */
}
#endif

#define GEMV_MAX_ROWS 2

int gemv_bf16_max_rows(void) { return GEMV_MAX_ROWS; }

/* The portable small-batch path: up to GEMV_MAX_ROWS rows over the row-major w. */
int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
              int64_t M, int64_t N, int64_t K) {
    if (M < 1 || M > GEMV_MAX_ROWS || N < 1 || K < 1) return -1;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -2;
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < N; o++) {
        const uint16_t *wr = w + o * K;
        const float b = bias ? bf16_to_f32(bias[o]) : 0.f;
        for (int64_t m = 0; m < M; m++) {
            float s = 0.f;
            const float *xr = xf + m * K;
            for (int64_t k = 0; k < K; k++) s += bf16_to_f32(wr[k]) * xr[k];
            y[m * N + o] = bf16_round(s + b);
        }
    }
    free(xf);
    return 0;
}
