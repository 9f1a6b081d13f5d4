/* The small per-token ops of a Llama layer on CPU, each fused into one pass over its rows:
 * residual add + RMSNorm, SiLU(gate) * up, and rotary embedding of the q and k heads.
 *
 * Why: in torch each of these is several ops on a (T, h) tensor, and each op pays ~10-30 us of
 * dispatch and OpenMP start-up, which at decode sizes is far more than its arithmetic.
 *
 * Numerics follow the torch reference in `models/llama.py` and `models/rope.py` op by op:
 * math in fp32, and a bfloat16 result rounded (to nearest even) wherever torch rounds one,
 * e.g. RMSNorm rounds x * rstd to the model dtype before multiplying by the weight, as
 * Hugging Face does. What differs is fp32 summation order (the RMSNorm sum of squares) and the
 * exp polynomial (SiLU): a few fp32 ulps, which rarely move a bfloat16 result by one ulp.
 *
 * Layouts are row-major and contiguous unless a row stride is passed. Rows are split over the
 * OpenMP threads only from PARALLEL_MIN_ELEMS elements of work: below that, starting the
 * parallel region costs more than it saves. Every function returns 0, or a negative code for
 * bad arguments (nothing is written then).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* Work is counted in RMSNorm elements (one thread, AVX-512 development machine, bf16:
 * RMSNorm ~0.34 ns per element, SiLU * up ~0.47 ns per output, rotary ~0.18 ns per element).
 * 32768 of them (~11 us, torch's own grain size) is where splitting them over threads saves
 * clearly more than a parallel region's start-up (~1-5 us, depending on the thread count). */
#define PARALLEL_MIN_ELEMS 32768

/* e^x for any float x, vectorisable: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes'
 * expf polynomial, times 2^n built in the exponent bits; ~1.3 ulp. Written with fmaf: the
 * build allows re-association (-fassociative-math), which would fold the two-step ln2
 * reduction into one and lose ~6 bits; a fused multiply-add is never re-associated. x is
 * clamped to [-87, 88] so that 2^n stays a normal float (SiLU needs e^x there only to be
 * tiny or huge). */
static inline float exp_any(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = __builtin_fmaf(-n, 0.693147182464599609375f, x);  /* ln2 rounded to float */
    r = __builtin_fmaf(-n, -1.904654299957768e-09f, r);          /* and the rest of it */
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, r, 1.3981999507e-3f);
    p = __builtin_fmaf(p, r, 8.3334519073e-3f);
    p = __builtin_fmaf(p, r, 4.1665795894e-2f);
    p = __builtin_fmaf(p, r, 1.6666665459e-1f);
    p = __builtin_fmaf(p, r, 5.0000001201e-1f);
    p = __builtin_fmaf(p * r, r, r) + 1.f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* Per dtype: LOAD an element as float, STORE a float (rounding it), ROUND a float to the
 * dtype's precision while keeping it a float (what a torch op on that dtype returns). */
#define F32_LOAD(p, i) ((p)[i])
#define F32_STORE(p, i, v) ((p)[i] = (v))
#define F32_ROUND(v) (v)
#define BF16_LOAD(p, i) bf16_to_f32((p)[i])
#define BF16_STORE(p, i, v) ((p)[i] = bf16_round(v))
#define BF16_ROUND(v) bf16_to_f32(bf16_round(v))

/* Runs STATEMENT for t in [0, rows), over the OpenMP threads when the work is large enough
 * (without an `if` clause: a region that runs on one thread still costs a call into libgomp). */
#define FOR_ROWS(rows, elems_per_row, STATEMENT)                                               \
    do {                                                                                       \
        if ((rows) > 1 && (rows) * (elems_per_row) >= PARALLEL_MIN_ELEMS) {                    \
            _Pragma("omp parallel for schedule(static)")                                       \
            for (int64_t t = 0; t < (rows); t++) STATEMENT;                                    \
        } else {                                                                               \
            for (int64_t t = 0; t < (rows); t++) STATEMENT;                                    \
        }                                                                                      \
    } while (0)

/* add + RMSNorm. x, residual (may be NULL), out, residual_out: [rows, h]; weight [h].
 * residual_out = s = round(x + residual) (not written when residual is NULL: s = x), and
 * out = round(weight * round(s * rsqrt(mean(s^2) + eps))). The sum of squares is vectorised
 * by re-association, so its order (not its precision) differs from torch's. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                       \
static void NAME##_row(const T *restrict x, const T *restrict res, const T *restrict w,        \
                       T *restrict out, T *restrict res_out, int64_t h, float eps) {           \
    const T *s = x;                                                                            \
    float ss = 0.f;                                                                            \
    if (res) {                                                                                 \
        for (int64_t j = 0; j < h; j++) {                                                      \
            const float v = ROUND(LOAD(x, j) + LOAD(res, j));                                  \
            STORE(res_out, j, v);                                                              \
            ss += v * v;                                                                       \
        }                                                                                      \
        s = res_out;                                                                           \
    } else {                                                                                   \
        for (int64_t j = 0; j < h; j++) ss += LOAD(x, j) * LOAD(x, j);                         \
    }                                                                                          \
    const float rstd = 1.f / sqrtf(ss / (float)h + eps);                                       \
    for (int64_t j = 0; j < h; j++) STORE(out, j, LOAD(w, j) * ROUND(LOAD(s, j) * rstd));      \
}                                                                                              \
int NAME(const T *x, const T *res, const T *w, T *out, T *res_out, int64_t rows, int64_t h,    \
         float eps) {                                                                          \
    if (rows < 0 || h < 1 || (res && !res_out)) return -1;                                     \
    FOR_ROWS(rows, h, NAME##_row(x + t * h, res ? res + t * h : 0, w, out + t * h,             \
                                 res ? res_out + t * h : 0, h, eps));                          \
    return 0;                                                                                  \
}

/* SiLU(gate) * up. gate_up [rows, 2 * inter] (gate columns first), out [rows, inter];
 * out = round(round(silu(gate)) * up), as F.silu(gate) * up rounds in bfloat16. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                           \
static void NAME##_row(const T *restrict gu, T *restrict out, int64_t inter) {                 \
    const T *up = gu + inter;                                                                  \
    for (int64_t j = 0; j < inter; j++) {                                                      \
        const float g = LOAD(gu, j);                                                           \
        const float act = ROUND(g / (1.f + exp_any(-g)));                                      \
        STORE(out, j, act * LOAD(up, j));                                                      \
    }                                                                                          \
}                                                                                              \
int NAME(const T *gate_up, T *out, int64_t rows, int64_t inter) {                              \
    if (rows < 0 || inter < 1) return -1;                                                      \
    FOR_ROWS(rows, inter * 3 / 2,                                                              \
             NAME##_row(gate_up + t * 2 * inter, out + t * inter, inter));                     \
    return 0;                                                                                  \
}

/* Rotary embedding (Hugging Face's rotate-half layout) of the first H + KVH heads of each
 * qkv row: qkv [rows, >= (H + KVH) * D] with row stride `stride`; positions [rows] int64;
 * cos, sin [P, D] in the dtype, sin signed (-sin on the first half, as RotaryEmbedding
 * stores it); q_out [rows, H, D], k_out [rows, KVH, D]. Per element, as apply_rotary's
 * x * cos then addcmul (a fused multiply-add in torch's vectorised kernel):
 * out[j] = round(fma(x[j +- D/2], sin[j], round(x[j] * cos[j]))). */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE, ROUND)                                             \
static void NAME##_head(const T *restrict x, const T *restrict c, const T *restrict s,         \
                        T *restrict o, int64_t D) {                                            \
    const int64_t half = D / 2;                                                                \
    for (int64_t j = 0; j < half; j++) {                                                       \
        STORE(o, j, __builtin_fmaf(LOAD(x, j + half), LOAD(s, j),                              \
                                   ROUND(LOAD(x, j) * LOAD(c, j))));                           \
        STORE(o, j + half, __builtin_fmaf(LOAD(x, j), LOAD(s, j + half),                       \
                                          ROUND(LOAD(x, j + half) * LOAD(c, j + half))));      \
    }                                                                                          \
}                                                                                              \
static void NAME##_row(const T *x, const T *c, const T *s, T *q, T *k, int64_t H, int64_t KVH, \
                       int64_t D) {                                                            \
    for (int64_t hd = 0; hd < H; hd++) NAME##_head(x + hd * D, c, s, q + hd * D, D);           \
    for (int64_t hd = 0; hd < KVH; hd++) NAME##_head(x + (H + hd) * D, c, s, k + hd * D, D);   \
}                                                                                              \
int NAME(const T *qkv, int64_t stride, const int64_t *positions, const T *cos, const T *sin,   \
         int64_t P, T *q_out, T *k_out, int64_t rows, int64_t H, int64_t KVH, int64_t D) {     \
    if (rows < 0 || H < 1 || KVH < 0 || D < 2 || D % 2 || stride < (H + KVH) * D) return -1;   \
    for (int64_t t = 0; t < rows; t++)                                                         \
        if (positions[t] < 0 || positions[t] >= P) return -2;                                  \
    FOR_ROWS(rows, (H + KVH) * D / 2,                                                          \
             NAME##_row(qkv + t * stride, cos + positions[t] * D, sin + positions[t] * D,      \
                        q_out + t * H * D, k_out + t * KVH * D, H, KVH, D));                   \
    return 0;                                                                                  \
}

#define DEFINE_ALL(SUFFIX, T, LOAD, STORE, ROUND)                                              \
    DEFINE_ADD_RMS_NORM(add_rms_norm_##SUFFIX, T, LOAD, STORE, ROUND)                          \
    DEFINE_SILU_MUL(silu_mul_##SUFFIX, T, LOAD, STORE, ROUND)                                  \
    DEFINE_ROTARY(rotary_##SUFFIX, T, LOAD, STORE, ROUND)

DEFINE_ALL(f32, float, F32_LOAD, F32_STORE, F32_ROUND)
DEFINE_ALL(bf16, uint16_t, BF16_LOAD, BF16_STORE, BF16_ROUND)
