/* Small-batch linear layers on CPU in bfloat16: y[m, o] = sum_k x[m, k] * w[o, k] (+ bias[o]).
 *
 * At one to a few rows a linear layer reads its whole weight to do little arithmetic, so its
 * speed is the speed of streaming the weight from memory. oneDNN's packed GEMM runs such
 * shapes on one core (measured ~25 GB/s on the development machine against ~60 GB/s of copy
 * bandwidth); here the output rows are split over every OpenMP thread, each streaming its own
 * contiguous slice of `w`, with fp32 accumulation: vdpbf16ps where the CPU has AVX512-BF16
 * (up to 8 rows), else bf16 -> fp32 conversion and FMAs vectorised by -fassociative-math (up
 * to 2 rows pay off). Measured on the bundled model's 120 layer linears, weights out of
 * cache, ms per pass: M=1 5.9 (oneDNN 8.1), M=2 6.0 (8.0), M=4 6.0 (7.5), M=8 6.9 (8.7); at
 * 12 rows and up the accumulators no longer fit the registers and oneDNN wins.
 *
 * Layouts (contiguous): x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all bfloat16.
 */
#include <stdint.h>
#include <stdlib.h>

#include "../../csrc/bf16.h"

#define MAX_M 8

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#if HAVE_DPBF16
/* With AVX512-BF16, vdpbf16ps multiplies bf16 pairs straight from the weight stream into fp32
 * lanes, so each weight vector loaded serves all M rows at one instruction per row. Each
 * thread walks its output rows one at a time (interleaving several rows' streams measured 2x
 * slower with the weights out of cache); U accumulators per row over alternate 32-element
 * steps hide the instruction's latency when M is small. Sums are reduced once per output. */
__attribute__((always_inline)) static inline void gemv_row_dp(
        const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, const int M,
        const int U, int64_t o, int64_t N, int64_t K) {
    __m512 acc[8][4];
    for (int m = 0; m < M; m++)
        for (int u = 0; u < U; u++) acc[m][u] = _mm512_setzero_ps();
    const uint16_t *wr = w + o * K;
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U)
        for (int u = 0; u < U; u++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * u);
            for (int m = 0; m < M; m++)
                acc[m][u] = _mm512_dpbf16_ps(
                    acc[m][u], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u), wv);
        }
    for (; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? 0xffffffffu : (1u << (K - k)) - 1u;
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
        for (int m = 0; m < M; m++)
            acc[m][0] = _mm512_dpbf16_ps(
                acc[m][0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k), wv);
    }
    const float b = bias ? bf16_to_f32(bias[o]) : 0.f;
    for (int m = 0; m < M; m++) {
        __m512 sum = acc[m][0];
        for (int u = 1; u < U; u++) sum = _mm512_add_ps(sum, acc[m][u]);
        y[m * N + o] = bf16_round(_mm512_reduce_add_ps(sum) + b);
    }
}

#define GEMV_DP_CASE(MC, UC)                                                               \
    case MC: {                                                                             \
        _Pragma("omp parallel for schedule(static)")                                       \
        for (int64_t o = 0; o < N; o++) gemv_row_dp(x, w, bias, y, MC, UC, o, N, K);       \
        return 0;                                                                          \
    }

static int gemv_dp(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int64_t M, int64_t N, int64_t K) {
    switch (M) { /* rows x accumulators per row: at most 8 registers */
        GEMV_DP_CASE(1, 4) GEMV_DP_CASE(2, 4) GEMV_DP_CASE(3, 2) GEMV_DP_CASE(4, 2)
        GEMV_DP_CASE(5, 1) GEMV_DP_CASE(6, 1) GEMV_DP_CASE(7, 1) GEMV_DP_CASE(8, 1)
    }
    return -1;
}
#endif

/* Rows up to which gemv_bf16 beats oneDNN here (measured): 8 with vdpbf16ps, else 2. */
int gemv_bf16_max_rows(void) { return HAVE_DPBF16 ? MAX_M : 2; }

int gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
              int64_t M, int64_t N, int64_t K) {
    if (M < 1 || M > MAX_M || N < 1 || K < 1) return -1;
#if HAVE_DPBF16
    return gemv_dp(x, w, bias, y, M, N, K);
#endif
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -2;
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < N; o++) {
        const uint16_t *wr = w + o * K;
        const float b = bias ? bf16_to_f32(bias[o]) : 0.f;
        for (int64_t m = 0; m < M; m++) {
            const float *xr = xf + m * K;
            float s = 0.f;
            for (int64_t k = 0; k < K; k++) s += bf16_to_f32(wr[k]) * xr[k];
            y[m * N + o] = bf16_round(s + b);
        }
    }
    free(xf);
    return 0;
}
