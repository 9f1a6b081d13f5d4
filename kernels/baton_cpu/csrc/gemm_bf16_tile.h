/* The register tile of linear_bf16.c's AVX512-BF16 GEMM, shared with linear_q.c (which
 * de-quantizes GGUF weights into the same packing for prefill-sized batches): y[0:mr,
 * 0:nr * 16] = x[0:mr] @ w.T (+ bias) for nr 16-column blocks of a weight packed
 * [N / 16][K / 2][16][2] (pairs of k), fp32 sums over the whole K, bf16 results (RNE).
 * Needs AVX512-BF16 and AVX512BW (the includer checks). */
#ifndef BATON_GEMM_BF16_TILE_H
#define BATON_GEMM_BF16_TILE_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define BF16_MR 6 /* rows per register tile */
#define BF16_NR 4 /* 16-column blocks per register tile: MR * NR accumulators + NR weight vectors */

/* bf16_round of 16 floats: round to nearest even, inf / nan passed through. */
static inline __m256i round_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 special = _mm512_cmpeq_epi32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, special, u);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* y[0:mr, 0:nr * 16] of one tile; `wp` at the tile's first column block. */
__attribute__((always_inline)) static inline void bf16_tile(
        const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y, const int mr,
        const int nr, int64_t N, int64_t K) {
    __m512 acc[BF16_MR][BF16_NR];
    for (int m = 0; m < mr; m++)
        for (int r = 0; r < nr; r++) acc[m][r] = _mm512_setzero_ps();
    const int64_t KP = K / 2, strip = KP * 32; /* elements per 16-column block */
    for (int64_t kp = 0; kp < KP; kp++) {
        __m512bh wv[BF16_NR];
        for (int r = 0; r < nr; r++)
            wv[r] = (__m512bh)_mm512_loadu_si512(wp + r * strip + kp * 32);
        for (int m = 0; m < mr; m++) {
            int32_t pair;
            memcpy(&pair, x + m * K + 2 * kp, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int r = 0; r < nr; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                    _mm256_loadu_si256((const __m256i *)(bias + r * 16))), 16))
                              : _mm512_setzero_ps();
        for (int m = 0; m < mr; m++)
            _mm256_storeu_si256((__m256i *)(y + m * N + r * 16),
                                round_to_bf16(_mm512_add_ps(acc[m][r], b)));
    }
}


/* bf16_tile for any mr <= BF16_MR, nr <= BF16_NR, dispatched to constant counts (the
 * tile's loops unroll, its accumulators stay in registers). */
static inline void bf16_tile_any(const uint16_t *x, const uint16_t *wp, const uint16_t *bias,
                                 uint16_t *y, int mr, int nr, int64_t N, int64_t K) {
#define BF16_ROWS(NRC)                                             \
    switch (mr) {                                                  \
    case 6: bf16_tile(x, wp, bias, y, 6, NRC, N, K); break;        \
    case 5: bf16_tile(x, wp, bias, y, 5, NRC, N, K); break;        \
    case 4: bf16_tile(x, wp, bias, y, 4, NRC, N, K); break;        \
    case 3: bf16_tile(x, wp, bias, y, 3, NRC, N, K); break;        \
    case 2: bf16_tile(x, wp, bias, y, 2, NRC, N, K); break;        \
    default: bf16_tile(x, wp, bias, y, 1, NRC, N, K); break;       \
    }
    switch (nr) {
    case 4: BF16_ROWS(4) break;
    case 3: BF16_ROWS(3) break;
    case 2: BF16_ROWS(2) break;
    default: BF16_ROWS(1) break;
    }
#undef BF16_ROWS
}
#endif
