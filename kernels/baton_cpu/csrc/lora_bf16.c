/* LoRA deltas added onto a bf16 linear's output, each row with its own adapter (or none):
 *
 *     y[m, first_p : first_p + cols_p] += (A_s[p R : (p + 1) R] x[m]) @ B_{p,s}
 *
 * for every part p of the linear (q / k / v, gate / up; one part otherwise), s = row_slot[m]
 * (< 0: the row is the base model's, left as it is). The shrink keeps float32 (no rounding
 * between the two products); each output element is rounded to bf16 once, after the add.
 *
 * Layouts: x [M, in], y [M, out] bf16; A [slots, parts * R, in]; B_p [slots, R, cols_p]
 * (part p's B transposed, the adapter's scaling folded in), as `engine/lora/layer.py` holds
 * them.
 *
 * The rows are grouped by adapter and taken in blocks of up to BLOCK rows of one adapter
 * (blocks run in parallel, OpenMP): each element of A and B read is converted once and used
 * for every row of the block, and the sums run in VL float32 lanes (vector extensions).
 * A row's sums run in the same order whatever block it is in (lane by lane, then the lanes
 * folded left to right), so its result never depends on the rest of the batch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LORA_DPBF16 1
#endif

#define LORA_MAX_PARTS 4
#define LORA_MAX_RANK 512
#ifdef __AVX512F__
#define VL 16 /* float32 lanes of a vector register */
#else
#define VL 8
#endif
#define BLOCK 4
#define PREFETCH (8 * VL) /* elements of B ahead of the columns being read */

/* Mirrored field by field by `LoRALinearDesc` in `lora.py`. */
typedef struct {
    const uint16_t *a;
    const uint16_t *b[LORA_MAX_PARTS];
    int64_t first[LORA_MAX_PARTS], cols[LORA_MAX_PARTS];
    int64_t parts, rank, in_features, out_features;
} lora_linear;

/* bf16_to_f32 in a form the vectoriser takes (no union). */
static inline float widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* VL lanes of float32 (GCC / Clang vector extensions: one register on AVX-512, two on AVX2). */
typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));

static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline vf load_f32(const float *p) {
    vf f;
    memcpy(&f, p, sizeof f);
    return f;
}

/* The lanes of v summed in halves (16 -> 8 -> 4 -> 2 -> 1): the one order every row's sums
 * end in, whatever block the row is in. */
static inline float fold(vf v) {
    float lanes[VL];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = VL / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

/* t[i J + j] = A[j] . xf[i] for the n rows of a block (xf: n rows of K floats); two rows of
 * A at a time, so each load feeds two or more products. */
static inline __attribute__((always_inline)) void shrink(const uint16_t *a, int64_t J, int64_t K,
                                                         const float *xf, float *t, const int n) {
    const int64_t K0 = K - K % VL;
    for (int64_t j = 0; j < J; j += 2) {
        const int pair = j + 1 < J;
        const uint16_t *r0 = a + j * K, *r1 = a + (j + pair) * K;
        vf acc0[BLOCK], acc1[BLOCK];
        for (int i = 0; i < n; i++) acc0[i] = acc1[i] = (vf){0};
        for (int64_t k = 0; k < K0; k += VL) {
            const vf a0 = load_bf16(r0 + k), a1 = load_bf16(r1 + k);
            for (int i = 0; i < n; i++) {
                const vf xv = load_f32(xf + i * K + k);
                acc0[i] += a0 * xv;
                acc1[i] += a1 * xv;
            }
        }
        for (int i = 0; i < n; i++) {
            float s0 = fold(acc0[i]), s1 = fold(acc1[i]);
            for (int64_t k = K0; k < K; k++) {
                s0 += widen(r0[k]) * xf[i * K + k];
                s1 += widen(r1[k]) * xf[i * K + k];
            }
            t[i * J + j] = s0;
            if (pair) t[i * J + j + 1] = s1;
        }
    }
}

#ifdef LORA_DPBF16
/* shrink with vdpbf16ps on the bf16 rows themselves (x[i]: the block's rows): 32 products
 * an instruction, exact, summed in float32 (denormals flushed, as the instruction does). */
static inline __attribute__((always_inline)) void shrink_bf16(const uint16_t *a, int64_t J,
                                                              int64_t K,
                                                              const uint16_t *const *x,
                                                              float *t, const int n) {
    const int64_t K0 = K - K % (2 * VL);
    for (int64_t j = 0; j < J; j += 2) {
        const int pair = j + 1 < J;
        const uint16_t *r0 = a + j * K, *r1 = a + (j + pair) * K;
        __m512 acc0[BLOCK], acc1[BLOCK];
        for (int i = 0; i < n; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K0; k += 2 * VL) {
            __builtin_prefetch(r0 + 2 * K + k);
            __builtin_prefetch(r1 + 2 * K + k);
            const __m512bh a0 = (__m512bh)_mm512_loadu_si512(r0 + k);
            const __m512bh a1 = (__m512bh)_mm512_loadu_si512(r1 + k);
            for (int i = 0; i < n; i++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[i] + k);
                acc0[i] = _mm512_dpbf16_ps(acc0[i], a0, xv);
                acc1[i] = _mm512_dpbf16_ps(acc1[i], a1, xv);
            }
        }
        for (int i = 0; i < n; i++) {
            vf v0, v1;
            memcpy(&v0, &acc0[i], sizeof v0);
            memcpy(&v1, &acc1[i], sizeof v1);
            float s0 = fold(v0), s1 = fold(v1);
            for (int64_t k = K0; k < K; k++) {
                s0 += widen(r0[k]) * widen(x[i][k]);
                s1 += widen(r1[k]) * widen(x[i][k]);
            }
            t[i * J + j] = s0;
            if (pair) t[i * J + j + 1] = s1;
        }
    }
}
#endif

/* 2 VL bf16 as VL uint32 lanes, and their even and odd elements as float32: the even one is
 * the lane's low half moved up, the odd one its high half kept (two instructions, no
 * widening). */
static inline vu load_pairs(const uint16_t *p) {
    vu u;
    memcpy(&u, p, sizeof u);
    return u;
}

static inline vf even_f32(vu u) {
    const vu e = u << 16;
    vf f;
    memcpy(&f, &e, sizeof f);
    return f;
}

static inline vf odd_f32(vu u) {
    const vu o = u & 0xffff0000u;
    vf f;
    memcpy(&f, &o, sizeof f);
    return f;
}

/* bf16_round on the lanes: each float32 lane's bf16 in the lane's low 16 bits. */
static inline vu round_lanes(vf f) {
    vu u;
    memcpy(&u, &f, sizeof u);
    const vu special = (vu)((u & 0x7f800000u) == 0x7f800000u); /* inf, nan: kept */
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (special & (u >> 16)) | (~special & rounded);
}

/* y_i[c] += sum_r t[i tstride + r] B[r, c] for the n rows of a block, rounded once; 2 VL
 * columns at a time, as their even and odd elements, so each broadcast of t feeds two
 * products. */
static inline __attribute__((always_inline)) void expand(const uint16_t *b, const float *t,
                                                         int64_t tstride, int64_t R,
                                                         int64_t cols, uint16_t *const *y,
                                                         const int n) {
    int64_t c = 0;
    for (; c + 2 * VL <= cols; c += 2 * VL) {
        vf even[BLOCK], odd[BLOCK];
        for (int i = 0; i < n; i++) even[i] = odd[i] = (vf){0};
        for (int64_t r = 0; r < R; r++) {
            __builtin_prefetch(b + r * cols + c + PREFETCH);
            const vu pairs = load_pairs(b + r * cols + c);
            const vf be = even_f32(pairs), bo = odd_f32(pairs);
            for (int i = 0; i < n; i++) {
                const vf tr = (vf){0} + t[i * tstride + r];
                even[i] += tr * be;
                odd[i] += tr * bo;
            }
        }
        for (int i = 0; i < n; i++) {
            const vu old = load_pairs(y[i] + c);
            const vu out = round_lanes(even_f32(old) + even[i])
                           | (round_lanes(odd_f32(old) + odd[i]) << 16);
            memcpy(y[i] + c, &out, sizeof out);
        }
    }
    for (; c < cols; c++)
        for (int i = 0; i < n; i++) {
            float s = 0.0f;
            for (int64_t r = 0; r < R; r++) s += t[i * tstride + r] * widen(b[r * cols + c]);
            y[i][c] = bf16_round(widen(y[i][c]) + s);
        }
}

/* One block: rows[0..n) of the batch, all with adapter slot s; xf, t: the thread's scratch. */
static inline __attribute__((always_inline)) void add_block(const lora_linear *L, int64_t s,
                                                            const int64_t *rows,
                                                            const uint16_t *x, uint16_t *y,
                                                            float *xf, float *t, const int n) {
    const int64_t K = L->in_features, R = L->rank, J = L->parts * R;
#ifdef LORA_DPBF16
    (void)xf;
    const uint16_t *xr[BLOCK];
    for (int i = 0; i < n; i++) xr[i] = x + rows[i] * K;
    shrink_bf16(L->a + s * J * K, J, K, xr, t, n);
#else
    for (int i = 0; i < n; i++)
        for (int64_t k = 0; k < K; k++) xf[i * K + k] = widen(x[rows[i] * K + k]);
    shrink(L->a + s * J * K, J, K, xf, t, n);
#endif
    for (int64_t p = 0; p < L->parts; p++) {
        uint16_t *yp[BLOCK];
        for (int i = 0; i < n; i++) yp[i] = y + rows[i] * L->out_features + L->first[p];
        expand(L->b[p] + s * R * L->cols[p], t + p * R, J, R, L->cols[p], yp, n);
    }
}

/* The adapter rows of the batch in order of slot (order[]), and where each block of up to
 * BLOCK rows of one slot starts (starts[0..blocks], the last the end). Returns blocks. */
static int64_t plan_blocks(const int64_t *row_slot, int64_t M, int64_t *order, int64_t *starts) {
    int64_t slots = 0;
    for (int64_t m = 0; m < M; m++)
        if (row_slot[m] + 1 > slots) slots = row_slot[m] + 1;
    int64_t *next = calloc((size_t)slots + 1, sizeof(int64_t));
    if (next == NULL) return -1;
    for (int64_t m = 0; m < M; m++)
        if (row_slot[m] >= 0) next[row_slot[m] + 1]++;
    for (int64_t s = 0; s < slots; s++) next[s + 1] += next[s];
    for (int64_t m = 0; m < M; m++)
        if (row_slot[m] >= 0) order[next[row_slot[m]]++] = m;
    const int64_t n = slots ? next[slots - 1] : 0;
    free(next);
    int64_t blocks = 0;
    for (int64_t i = 0; i < n; i++)
        if (blocks == 0 || i - starts[blocks - 1] == BLOCK
            || row_slot[order[i]] != row_slot[order[starts[blocks - 1]]])
            starts[blocks++] = i;
    starts[blocks] = n;
    return blocks;
}

/* Returns 0, or -1 for bad arguments (nothing written), -2 when out of memory. */
int lora_add_bf16(const lora_linear *L, const uint16_t *x, const int64_t *row_slot,
                  uint16_t *y, int64_t M) {
    if (M < 0 || L->parts < 1 || L->parts > LORA_MAX_PARTS || L->rank < 1
        || L->rank > LORA_MAX_RANK)
        return -1;
    for (int64_t p = 0; p < L->parts; p++)
        if (L->first[p] < 0 || L->first[p] + L->cols[p] > L->out_features) return -1;
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(2 * M + 1));
    if (order == NULL) return -2;
    const int64_t blocks = plan_blocks(row_slot, M, order, order + M);
    const int64_t *starts = order + M;
    int failed = blocks < 0;
#pragma omp parallel if (blocks > 1)
    {
        float *xf = malloc(sizeof(float) * (size_t)(BLOCK * L->in_features));
        float *t = malloc(sizeof(float) * (size_t)(BLOCK * L->parts * L->rank));
        if (xf == NULL || t == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < (blocks > 0 ? blocks : 0); b++) {
            if (xf == NULL || t == NULL) continue;
            const int64_t *rows = order + starts[b];
            const int64_t n = starts[b + 1] - starts[b], s = row_slot[rows[0]];
            if (n == BLOCK) {
                add_block(L, s, rows, x, y, xf, t, BLOCK);
            } else {
                for (int64_t i = 0; i < n; i++) add_block(L, s, rows + i, x, y, xf, t, 1);
            }
        }
        free(xf);
        free(t);
    }
    free(order);
    return failed ? -2 : 0;
}
