/* Linear layers on CPU in float32 for a few rows: y[m, o] = sum_k x[m, k] * w[o, k] (+ b[o]).
 *
 * A decode step of a small batch is bound by reading the weights once. torch's F.linear
 * (MKL's sgemm) does not read them once at 2-8 rows on AVX2: a 1536 x 576 linear took
 * 132 us at 1 row, 239 us at 2, 338 us at 8, so a batch-2 decode step cost 1.8x a batch-1
 * step. Here the threads split the outputs in blocks of 12; a block's weight rows are read
 * from memory once, by the first group of rows, and stay in L2 for the next: register tiles
 * of 4 rows x 3 outputs, 2 x 4 or 1 x 4 (8-12 accumulators of 8 lanes, FMAs over k).
 *
 * Layouts (contiguous, float32): x [M, K], w [N, K] (row-major, torch's nn.Linear weight),
 * bias [N] or NULL, y [M, N]. Up to GEMV_F32_MAX_ROWS rows; the caller takes F.linear above.
 * Sums run in another order than MKL's, so results differ from torch's in the last bits.
 */
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

/* Measured against F.linear over a decode step's worth of distinct weights (the bundled
 * model's 30 layers and head, 540 MB, so they stream from memory as served; one weight
 * timed in a loop stays in cache and favours MKL), one step's linears in ms, F.linear / GEMV:
 * two cores 8 rows 73 / 45, 16 rows 99 / 76, 24 rows 126 / 114, 32 rows 143 / 120, 48 rows
 * 198 / 230; one core 8 rows 107 / 74, 16 rows 131 / 113, 24 rows 166 / 153, 32 rows 187 /
 * 261. Up to 24 rows the GEMV is faster on both. */
#define GEMV_F32_MAX_ROWS 24

int gemv_f32_max_rows(void) { return HAVE_AVX2 ? GEMV_F32_MAX_ROWS : 0; }

#if HAVE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* A register tile of R rows of x (x[r * K]) against C weight rows (w[c * K]): out[r][c]
 * (R * C accumulators of 8 lanes, FMAs over k; the tail of K past a multiple of 8 scalar). */
#define DEFINE_TILE(R, C)                                                                     \
    static void tile_##R##x##C(const float *x, const float *w, int64_t K, float *out) {      \
        __m256 acc[R][C];                                                                     \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                      \
        int64_t k = 0;                                                                        \
        for (; k + 8 <= K; k += 8) {                                                          \
            __m256 wv[C];                                                                     \
            for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_ps(w + c * K + k);               \
            for (int r = 0; r < R; r++) {                                                     \
                const __m256 xv = _mm256_loadu_ps(x + r * K + k);                            \
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]); \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < C; c++) {                                                     \
                float s = hsum(acc[r][c]);                                                    \
                for (int64_t t = k; t < K; t++) s += x[r * K + t] * w[c * K + t];             \
                out[r * C + c] = s;                                                           \
            }                                                                                 \
    }

DEFINE_TILE(1, 4)
DEFINE_TILE(1, 1)
DEFINE_TILE(2, 4)
DEFINE_TILE(2, 1)
DEFINE_TILE(4, 3)
DEFINE_TILE(4, 1)

typedef void (*tile_fn)(const float *, const float *, int64_t, float *);

static void put(float *y, const float *out, int64_t R, int64_t C, int64_t o, int64_t N,
                const float *bias) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) y[r * N + o + c] = out[r * C + c] + (bias ? bias[o + c] : 0.f);
}

/* R (1, 2 or 4) rows of x against outputs [o, o + no): C at a time, the rest one by one. */
static void rows(const float *x, int64_t R, const float *w, const float *bias, float *y,
                 int64_t o, int64_t no, int64_t N, int64_t K) {
    const tile_fn wide = R == 4 ? tile_4x3 : R == 2 ? tile_2x4 : tile_1x4;
    const tile_fn one = R == 4 ? tile_4x1 : R == 2 ? tile_2x1 : tile_1x1;
    const int64_t C = R == 4 ? 3 : 4;
    float out[12];
    int64_t c = o;
    for (; c + C <= o + no; c += C) {
        wide(x, w + c * K, K, out);
        put(y, out, R, C, c, N, bias);
    }
    for (; c < o + no; c++) {
        one(x, w + c * K, K, out);
        put(y, out, R, 1, c, N, bias);
    }
}
#endif

int gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
             int64_t K) {
#if HAVE_AVX2
    if (M < 1 || M > GEMV_F32_MAX_ROWS || N < 1 || K < 1) return -1;
    /* Blocks of 12 outputs (their weight rows stay in L2 while every group of rows passes). */
    const int64_t blocks = (N + 11) / 12;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t o = b * 12, no = N - o < 12 ? N - o : 12;
        for (int64_t m = 0; m < M;) {
            const int64_t R = M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
            rows(x + m * K, R, w, bias, y + m * N, o, no, N, K);
            m += R;
        }
    }
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return -3; /* built without AVX2 + FMA: gemv_f32_max_rows() is 0 */
#endif
}
