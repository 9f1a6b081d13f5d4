/* The bf16 dot-product path of paged_prefill.c (included by it on CPUs with AVX512-BF16,
 * after its shared definitions: KT, MAX_D, IN_REGISTER, struct call). */
#include <immintrin.h>
#define HAVE_BF16_DOT 1
/* bf16 x bf16 -> fp32 dot products (vdpbf16ps: 2 products per lane and instruction, twice
 * the FMA rate), for bf16 models on CPUs that have them. Operands pair two consecutive
 * elements of the reduced dimension in each 32-bit lane: d for scores, keys for P.V. */

/* kb[KT][D/2]: the tile's keys as bf16 (pairs of d); vp[KT/2][D]: pairs of keys' values,
 * (v[2i][d], v[2i+1][d]); zeros past nk. A bf16 cache is copied as stored; an FP8 one
 * (FP8 = 1) converted through c->lut16 (exact). */
static inline __attribute__((always_inline)) void load_tile_dot(
        const struct call *c, const int64_t *bt, int64_t h, int64_t t0, int64_t nk,
        uint32_t *kb, uint32_t *vp, const int FP8, const int64_t D) {
    static const uint16_t zeros[MAX_D];
    uint16_t vrow[2][FP8 ? MAX_D : 1];
    const int64_t bs = c->bs;
    for (int64_t j = 0; j < KT; j += 2) {
        const uint16_t *vr[2];
        for (int i = 0; i < 2; i++) {
            const int64_t pos = t0 + j + i;
            const int64_t at = j + i < nk
                ? ((bt[pos >> c->shift] * bs + (pos & (bs - 1))) * c->KVH + h) * D : -1;
            uint16_t *kdst = (uint16_t *)(kb + (j + i) * D / 2);
            if (at < 0) {
                __builtin_memcpy(kdst, zeros, 2 * (size_t)D);
                vr[i] = zeros;
            } else if (FP8) {
                const uint8_t *k8 = (const uint8_t *)c->kc + at, *v8 = (const uint8_t *)c->vc + at;
                for (int64_t d = 0; d < D; d++) kdst[d] = c->lut16[k8[d]];
                for (int64_t d = 0; d < D; d++) vrow[i][d] = c->lut16[v8[d]];
                vr[i] = vrow[i];
            } else {
                __builtin_memcpy(kdst, (const uint16_t *)c->kc + at, 2 * (size_t)D);
                vr[i] = (const uint16_t *)c->vc + at;
            }
        }
        for (int64_t d = 0; d < D; d++)
            vp[j / 2 * D + d] = (uint32_t)vr[0][d] | (uint32_t)vr[1][d] << 16;
    }
}

/* As `scores`, from qp[D/2][16 NC] (pairs of q's d, unscaled) and kb; times qscale. */
static inline __attribute__((always_inline)) void scores_dot(
        const uint32_t *qp, const uint32_t *kb, float *s, float qscale, const int NC,
        const int64_t D) {
    for (int64_t j = 0; j < KT; j += 4) {
        __m512 a[4][4];
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < NC; c++) a[i][c] = _mm512_setzero_ps();
        for (int64_t e = 0; e < D / 2; e++) {
            __m512bh x[4];
            for (int c = 0; c < NC; c++) {
                x[c] = (__m512bh)_mm512_loadu_si512(qp + e * 16 * NC + 16 * c);
                IN_REGISTER(x[c]);
            }
            for (int i = 0; i < 4; i++) {
                const __m512bh kd = (__m512bh)_mm512_set1_epi32((int)kb[(j + i) * D / 2 + e]);
                for (int c = 0; c < NC; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], x[c], kd);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < NC; c++)
                _mm512_storeu_ps(s + (j + i) * 16 * NC + 16 * c,
                                 _mm512_mul_ps(a[i][c], _mm512_set1_ps(qscale)));
    }
}

/* As `accumulate`, with the probabilities rounded to bf16 and paired by key:
 * pp[KT/2][16 NC] = (p[2i][v], p[2i+1][v]). */
static inline __attribute__((always_inline)) void accumulate_dot(
        const float *s, uint32_t *pp, const uint32_t *vp, float *acc, int64_t nv,
        const int NC, const int64_t D) {
    const int V = 16 * NC;
    for (int j = 0; j < KT; j += 2)
        for (int v = 0; v < V; v++)
            pp[j / 2 * V + v] = (uint32_t)bf16_round(s[j * V + v])
                                | (uint32_t)bf16_round(s[(j + 1) * V + v]) << 16;
    for (int64_t v = 0; v < nv; v += 4) {
        for (int64_t c = 0; c < D; c += 64) {
            const int64_t nc = D - c >= 64 ? 4 : (D - c) / 16;
            __m512 a[4][4];
            float *at = acc + v * D + c;
            for (int i = 0; i < 4; i++)
                for (int64_t k = 0; k < nc; k++) a[i][k] = _mm512_loadu_ps(at + i * D + 16 * k);
            for (int j = 0; j < KT / 2; j++) {
                __m512bh x[4];
                for (int64_t k = 0; k < nc; k++) {
                    x[k] = (__m512bh)_mm512_loadu_si512(vp + j * D + c + 16 * k);
                    IN_REGISTER(x[k]);
                }
                for (int i = 0; i < 4; i++) {
                    const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[j * V + v + i]);
                    for (int64_t k = 0; k < nc; k++) a[i][k] = _mm512_dpbf16_ps(a[i][k], x[k], p);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int64_t k = 0; k < nc; k++) _mm512_storeu_ps(at + i * D + 16 * k, a[i][k]);
        }
    }
}
