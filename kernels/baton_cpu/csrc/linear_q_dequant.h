/* Prefill-sized batches over GGUF weights (included by linear_q.c on its AVX-512 VNNI path,
 * where the CPU has AVX512-BF16): each task de-quantizes up to 4 groups of 16 rows into bf16,
 * packed in pairs of k exactly as linear_bf16.c packs a weight, and runs every activation row
 * over them with linear_bf16.c's register tile (bf16 activations, fp32 sums over the whole K).
 *
 * Why: from `qweight.dequant_rows` rows on, this costs no more than the int8 path (the
 * de-quantization is paid once per 16 rows x K for all M rows), and its results are those of
 * the de-quantized model: a weight is computed as the `gguf` package (and so transformers'
 * GGUF loader) computes it in fp32, (q + qoff) * scale + off, rounded to bf16 to nearest
 * even, and the tile sums each output in the order the bf16 GEMM does. Prefill logits then
 * match `--quantization none` on this CPU; only decode rows take the int8 activations.
 */
#include <omp.h>

#include "gemm_bf16_tile.h"

/* The bf16 pairs (k0, k0 + 1), (k0 + 2, k0 + 3) of 16 rows from q's 4 bytes per lane (row):
 * w = (byte + qoff) * scale + off, in fp32 then to bf16 (RNE; the `gguf` package's order). */
static inline void emit4(__m512i q, int qoff, __m512 scale, __m512 off, uint16_t *dst,
                         int64_t k0) {
    const __m512i byte = _mm512_set1_epi32(0xff), shift = _mm512_set1_epi32(qoff);
    __m512i bits[4];
    for (int i = 0; i < 4; i++) {
        const __m512i qi = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(q, 8 * i), byte), shift);
        const __m512 w = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(qi), scale), off);
        bits[i] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w));
    }
    _mm512_storeu_si512(dst + (k0 / 2) * 32, _mm512_or_si512(bits[0], _mm512_slli_epi32(bits[1], 16)));
    _mm512_storeu_si512(dst + (k0 / 2 + 1) * 32, _mm512_or_si512(bits[2], _mm512_slli_epi32(bits[3], 16)));
}

/* One group's 16 rows x K -> dst [K / 2][16][2] bf16. */
static void dequant_group(int64_t type, const uint8_t *wg, int64_t K, uint16_t *dst) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512 zero = _mm512_setzero_ps();
    const int64_t gb = group_block_bytes(type);
    if (type == Q4_K) {
        for (int64_t b = 0; b < K / QKK; b++) {
            const uint8_t *blk = wg + b * gb, *sc = blk + 4 * G, *mn = sc + 8 * G, *qd = mn + 8 * G;
            const __m512 d = VF_F16(blk), dmin = VF_F16(blk + 2 * G);
            for (int s = 0; s < 8; s++) { /* d sc and dmin mn are exact in fp32 */
                const __m512 scale = _mm512_mul_ps(d, VF_U8(sc + s * G));
                const __m512 off = _mm512_sub_ps(zero, _mm512_mul_ps(dmin, VF_U8(mn + s * G)));
                for (int c = 0; c < 8; c++) {
                    const __m512i v = _mm512_loadu_si512(qd + ((s / 2) * 8 + c) * 4 * G);
                    emit4(_mm512_and_si512(_mm512_srli_epi16(v, 4 * (s % 2)), low), 0, scale, off,
                          dst, b * QKK + 32 * s + 4 * c);
                }
            }
        }
    } else if (type == Q6_K) {
        for (int64_t b = 0; b < K / QKK; b++) {
            const uint8_t *blk = wg + b * gb, *sc = blk + 2 * G, *qd = sc + 16 * G;
            const __m512 d = VF_F16(blk);
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < 4; t++)
                    for (int c = 0; c < 8; c++) {
                        const uint8_t *v = qd + (h * 8 + c) * 12 * G;
                        const __m512i q = q6_quants(_mm512_loadu_si512(v), _mm512_loadu_si512(v + 4 * G),
                                                    _mm512_loadu_si512(v + 8 * G), t);
                        const __m512 scale = _mm512_mul_ps(d, VF_I8(sc + (8 * h + 2 * t + c / 4) * G));
                        emit4(q, -32, scale, zero, dst, b * QKK + 128 * h + 32 * t + 4 * c);
                    }
        }
    } else {
        const int qoff = type == Q8_0 ? -128 : type == Q4_0 ? -8 : 0;
        for (int64_t b = 0; b < K / QK; b++) {
            const uint8_t *blk = wg + b * gb, *qd = blk + 4 * G;
            const __m512 d = VF_F16(blk), m = type == Q4_1 ? VF_F16(blk + 2 * G) : zero;
            if (type == Q8_0) {
                for (int j = 0; j < 8; j++)
                    emit4(_mm512_loadu_si512(qd + 64 * j), qoff, d, m, dst, b * QK + 4 * j);
                continue;
            }
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(qd + 64 * j);
                emit4(_mm512_and_si512(v, low), qoff, d, m, dst, b * QK + 4 * j);
                emit4(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), qoff, d, m, dst, b * QK + 16 + 4 * j);
            }
        }
    }
}

/* y[:, n_off : n_off + 16 * (w->n / 16)] (the part's whole groups) from bf16 x through the
 * bf16 tile. Returns how many of the part's rows it wrote, or -1 (no memory: none). */
static int64_t dequant_part(const uint16_t *x, const qweight *w, const uint16_t *bias, uint16_t *y,
                            int64_t M, int64_t N, int64_t n_off) {
    const int64_t K = w->k, full = w->n / G, gbytes = group_bytes(w->type, K);
    const int64_t tasks = (full + BF16_NR - 1) / BF16_NR, per_task = BF16_NR * G * K;
    if (full == 0) return 0;
    const int threads = omp_get_max_threads();
    uint16_t *bufs = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(per_task * threads));
    if (!bufs) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; t++) {
        uint16_t *buf = bufs + omp_get_thread_num() * per_task;
        const int64_t g0 = t * BF16_NR, nr = full - g0 < BF16_NR ? full - g0 : BF16_NR;
        for (int64_t i = 0; i < nr; i++) dequant_group(w->type, w->data + (g0 + i) * gbytes, K, buf + i * G * K);
        const uint16_t *bn = bias ? bias + n_off + g0 * G : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += BF16_MR) {
            const int mr = M - m0 < BF16_MR ? (int)(M - m0) : BF16_MR;
            bf16_tile_any(x + m0 * K, buf, bn, y + m0 * N + n_off + g0 * G, mr, (int)nr, N, K);
        }
    }
    free(bufs);
    return full * G;
}
