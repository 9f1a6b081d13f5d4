/* Paged prefill attention for CPUs, flash-attention style: every prefill chunk of a step in
 * one call, K/V read in place from the paged cache (the chunk's own K/V are already there),
 * online softmax in fp32, no score matrix in memory.
 *
 * Layouts:
 *   q, out        [T, H, D], row stride q_stride / out_stride elements, head stride D
 *   k/v cache     [num_blocks, block_size, KVH, D] contiguous
 *   block_tables  [n, bt_stride] int64, row i for prefill sequence i
 *   seqs          [n, 3] int64: first query row in q, query count Q, context length ctx
 * Query row r of a sequence sits at position ctx + r and sees keys 0..ctx + r. Keys past a
 * task's last row are never read: those slots can hold another request's data.
 *
 * Work is split over tasks (sequence, kv head, tile of query rows), longest first. A task
 * holds its rows x G query vectors (G = H / KVH, vector v = row * G + g, at most NV) and
 * walks the keys in tiles of KT with an online softmax (running max and sum per vector):
 *   - q is transposed once per task, qt[d][v], so the scores s[j][v] = k[j] . q[v] are
 *     vectorised over the query vectors (a key element broadcast, no horizontal sums) and
 *     the softmax runs lane-wise; the K/V tile is converted row by row (contiguous);
 *   - acc[v][0:D] += s[j][v] * v[j][0:D], vectorised over D;
 *   both register-blocked (SCORE_KEYS keys or ACC_VECS vectors x up to 4 registers of VW
 *   floats: sized for the target's registers, AVX-512 or AVX2).
 * fp32 accumulation. bf16 on CPUs with AVX512-BF16 multiplies bf16 pairs directly
 * (vdpbf16ps, twice the FMA rate), with the probabilities rounded to bf16 for P.V as the
 * torch path does; `dot` = 0 keeps the fp32 path (`paged_prefill_dot.h`). The summation
 * order is fixed at compile time, so results are deterministic whatever the thread count.
 * FP8 caches (`paged_prefill_fp8_*`) are bytes read through a table of the format's values
 * (`lut`, exact in fp32 and in bf16); the layer's k_scale comes folded into `scale` and
 * `v_scale` multiplies the output (1 for the other caches).
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* -std=c11 turns off contraction of a * b + c into FMA in GCC: turn it back on here (one
 * rounding instead of two, half the instructions in the inner loops). */
#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast")
#endif

#define MAX_G 16
#define MAX_D 256
#define KT 32 /* keys per tile (measured: 16 and 64 no faster) */

/* VW floats fill one vector register: 16 with AVX-512, 8 with AVX2. The register blocks are
 * counted in such registers: AVX-512 has 32 of them, AVX2 16, so on AVX2 the blocks below
 * hold half the keys (scores) or query vectors (accumulate) that they hold on AVX-512; with
 * AVX-512's blocks AVX2 spilled its accumulators to the stack on every FMA (5.7 GFLOP/s on
 * two cores, a third of torch's SDPA). */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NV (4 * VW) /* query vectors per task (rows x G): 4 registers */
#define SCORE_KEYS(NC) (VW == 16 || (NC) <= 2 ? 4 : 2) /* keys per block in `scores` */
#define ACC_VECS (VW == 16 ? 4 : 2) /* query vectors per block in `accumulate` */

/* VW floats; unaligned, may alias float. */
typedef float vreg __attribute__((vector_size(4 * VW), aligned(4), may_alias));

struct task { int64_t seq, head, r0, r1, cost; };

/* One call's arguments, as the tasks read them. The cache holds the queries' type, or FP8
 * bytes read through lut (floats) / lut16 (their bf16 bits): the values of the format. */
struct call {
    const void *q, *kc, *vc;
    void *out;
    const int64_t *bt, *seqs;
    int64_t q_stride, bt_stride, out_stride, H, KVH, bs;
    int shift;
    float scale, v_scale; /* scale: q.k's, k_scale folded in; v_scale multiplies the output */
    const float *lut;
    const uint16_t *lut16;
};

/* 2^x for x <= 0 (scores are kept in log2 units: log2(e) is folded into q's scale),
 * vectorisable: x = n + r with |r| <= 1/2, 2^r = e^(r ln2) by a degree-6 Taylor polynomial
 * (relative error < 2e-7), 2^n built in the exponent bits. Below -126 gives ~0; inputs > 0
 * occur only in masked lanes, whose result is discarded. */
static inline float exp2_nonpos(float x) {
    x = x < -126.f ? -126.f : x > 0.f ? 0.f : x;
    const float n = __builtin_roundf(x);
    const float r = x - n;
    float p = 1.5403530393381609e-4f;       /* ln2^6 / 6! */
    p = p * r + 1.3333558146428443e-3f;     /* ln2^5 / 5! */
    p = p * r + 9.6181291076284772e-3f;     /* ln2^4 / 4! */
    p = p * r + 5.5504108664821580e-2f;     /* ln2^3 / 3! */
    p = p * r + 0.24022650695910071f;       /* ln2^2 / 2! */
    p = p * r + 0.69314718055994531f;       /* ln2 */
    p = p * r + 1.f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* Keeps a vector in a register: without it GCC re-loads it as a memory operand of every FMA
 * that uses it, and the loads, not the FMAs, set the pace. Where VW floats fill one register
 * (AVX-512, AVX2); without AVX2 a vector spans two SSE registers and the compiler chooses. */
#if (defined(__AVX512F__) || defined(__AVX2__)) && defined(__GNUC__)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) (void)0
#endif

/* Element i of a bf16 (BF16 = 1) or f32 array, as f32. */
static inline float load(const void *p, int64_t i, const int BF16) {
    return BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Element i of a cache of kind CK: 0 f32, 1 bf16, 2 FP8 (through lut). */
static inline float load_kv(const void *p, int64_t i, const int CK, const float *lut) {
    return CK == 2 ? lut[((const uint8_t *)p)[i]] : load(p, i, CK);
}

static inline void store(void *p, int64_t i, float x, const int BF16) {
    if (BF16) ((uint16_t *)p)[i] = bf16_round(x);
    else ((float *)p)[i] = x;
}

static int by_cost_desc(const void *a, const void *b) {
    const int64_t ca = ((const struct task *)a)->cost, cb = ((const struct task *)b)->cost;
    return (ca < cb) - (ca > cb);
}

/* The tasks of a call, longest first (malloc'd; NULL on failure). Rows per task fill NV
 * query vectors, halved while there are fewer than 4 tasks per thread. */
static struct task *plan_tasks(const int64_t *seqs, int64_t n, int64_t KVH, int64_t G,
                               int64_t *num_tasks) {
    int64_t rows = NV / G, count = 0;
    const int64_t want = 4 * (int64_t)omp_get_max_threads();
    for (;;) {
        count = 0;
        for (int64_t b = 0; b < n; b++) count += KVH * ((seqs[3 * b + 1] + rows - 1) / rows);
        if (count >= want || rows <= 4) break;
        rows /= 2;
    }
    struct task *tasks = (struct task *)malloc(sizeof(struct task) * (size_t)(count ? count : 1));
    if (!tasks) return NULL;
    int64_t i = 0;
    for (int64_t b = 0; b < n; b++) {
        const int64_t Q = seqs[3 * b + 1], ctx = seqs[3 * b + 2];
        for (int64_t r0 = 0; r0 < Q; r0 += rows) {
            const int64_t r1 = r0 + rows < Q ? r0 + rows : Q;
            for (int64_t h = 0; h < KVH; h++)
                tasks[i++] = (struct task){b, h, r0, r1, (r1 - r0) * (ctx + r1)};
        }
    }
    qsort(tasks, (size_t)count, sizeof(struct task), by_cost_desc);
    *num_tasks = count;
    return tasks;
}

/* Keys t0..t0 + nk of kv head h into kf[KT][D] and vf[KT][D] as fp32; zeros past nk. */
static inline __attribute__((always_inline)) void load_tile(
        const struct call *c, const int64_t *bt, int64_t h, int64_t t0, int64_t nk,
        float *kf, float *vf, const int CK, const int64_t D) {
    const int64_t bs = c->bs;
    for (int64_t j = 0; j < KT; j++) {
        float *kr = kf + j * D, *vr = vf + j * D;
        if (j < nk) {
            const int64_t pos = t0 + j;
            const int64_t at = ((bt[pos >> c->shift] * bs + (pos & (bs - 1))) * c->KVH + h) * D;
            for (int64_t d = 0; d < D; d++) kr[d] = load_kv(c->kc, at + d, CK, c->lut);
            for (int64_t d = 0; d < D; d++) vr[d] = load_kv(c->vc, at + d, CK, c->lut);
        } else {
            for (int64_t d = 0; d < D; d++) kr[d] = vr[d] = 0.f;
        }
    }
}

/* s[j][0:VW NC] = kf[j] . qt[:, 0:VW NC] for the tile's keys, SCORE_KEYS at a time (a key
 * element is broadcast, VW query vectors per register, no horizontal sums). */
static inline __attribute__((always_inline)) void scores(
        const float *qt, const float *kf, float *s, const int NC, const int64_t D) {
    const int K = SCORE_KEYS(NC);
    for (int64_t j = 0; j < KT; j += K) {
        vreg a[4][4];
        for (int i = 0; i < K; i++)
            for (int c = 0; c < NC; c++) a[i][c] = (vreg){0};
        for (int64_t d = 0; d < D; d++) {
            vreg x[4];
            for (int c = 0; c < NC; c++) {
                x[c] = *(const vreg *)(qt + d * VW * NC + VW * c);
                IN_REGISTER(x[c]);
            }
            for (int i = 0; i < K; i++) {
                const float kd = kf[(j + i) * D + d];
                for (int c = 0; c < NC; c++) a[i][c] += kd * x[c];
            }
        }
        for (int i = 0; i < K; i++)
            for (int c = 0; c < NC; c++) *(vreg *)(s + (j + i) * VW * NC + VW * c) = a[i][c];
    }
}

/* Online softmax over one key tile, vectorised over the query vectors (lanes): s becomes
 * probabilities (exactly 0 where masked), m / l / acc move to the new running max. Vector v
 * sees keys below lim[v]; MASKED = 0 when every vector sees the whole tile. */
static inline __attribute__((always_inline)) void softmax_tile(
        float *s, float *m, float *l, float *acc, const float *lim, int64_t t0, const int NC,
        const int64_t D, const int MASKED) {
    const int V = VW * NC;
    float mx[NV], sum[NV];
    for (int v = 0; v < V; v++) mx[v] = m[v], sum[v] = 0.f;
    for (int j = 0; j < KT; j++) {
        const float pos = (float)(t0 + j);
        for (int v = 0; v < V; v++) {
            const float x = !MASKED || pos < lim[v] ? s[j * V + v] : -FLT_MAX;
            mx[v] = x > mx[v] ? x : mx[v];
        }
    }
    for (int j = 0; j < KT; j++) {
        const float pos = (float)(t0 + j);
        for (int v = 0; v < V; v++) {
            const float p = exp2_nonpos(s[j * V + v] - mx[v]);
            s[j * V + v] = !MASKED || pos < lim[v] ? p : 0.f;
            sum[v] += s[j * V + v];
        }
    }
    for (int v = 0; v < V; v++) {
        if (mx[v] != m[v]) {
            const float corr = exp2_nonpos(m[v] - mx[v]);
            for (int64_t d = 0; d < D; d++) acc[v * D + d] *= corr;
            l[v] *= corr;
            m[v] = mx[v];
        }
        l[v] += sum[v];
    }
}

/* acc[v][0:D] += sum_j s[j][v] * vf[j][0:D] for v < nv (a multiple of 4), ACC_VECS vectors x
 * 4 VW dims at a time. */
static inline __attribute__((always_inline)) void accumulate(
        const float *s, const float *vf, float *acc, int64_t nv, const int NC, const int64_t D) {
    for (int64_t v = 0; v < nv; v += ACC_VECS) {
        for (int64_t c = 0; c < D; c += 4 * VW) {
            const int64_t nc = D - c >= 4 * VW ? 4 : (D - c) / VW;
            vreg a[ACC_VECS][4];
            for (int i = 0; i < ACC_VECS; i++)
                for (int64_t k = 0; k < nc; k++) a[i][k] = *(vreg *)(acc + (v + i) * D + c + VW * k);
            for (int j = 0; j < KT; j++) {
                vreg x[4];
                for (int64_t k = 0; k < nc; k++) {
                    x[k] = *(const vreg *)(vf + j * D + c + VW * k);
                    IN_REGISTER(x[k]);
                }
                for (int i = 0; i < ACC_VECS; i++) {
                    const float p = s[j * VW * NC + v + i];
                    for (int64_t k = 0; k < nc; k++) a[i][k] += p * x[k];
                }
            }
            for (int i = 0; i < ACC_VECS; i++)
                for (int64_t k = 0; k < nc; k++) *(vreg *)(acc + (v + i) * D + c + VW * k) = a[i][k];
        }
    }
}

#if defined(__AVX512BF16__)
#include "paged_prefill_dot.h"
#else
#define HAVE_BF16_DOT 0
#endif

/* One task with at most VW NC query vectors; w is the thread's workspace (WORKSPACE_FLOATS).
 * BF16: the queries' type (0 f32); CK: the cache's kind (load_kv). */
static inline __attribute__((always_inline)) void run_task(
        const struct call *c, const struct task *t, float *w, const int BF16, const int CK,
        const int DOT, const int NC, const int64_t D) {
    const int64_t V = VW * NC;
    const int64_t G = c->H / c->KVH, h = t->head, r0 = t->r0;
    const int64_t first = c->seqs[3 * t->seq], ctx = c->seqs[3 * t->seq + 2];
    const int64_t nvec = (t->r1 - r0) * G;
    const float qscale = c->scale * 1.44269504088896341f; /* scores in log2 units for exp2 */
    const int64_t *table = c->bt + t->seq * c->bt_stride;
    float *qt = w, *acc = qt + NV * D, *kf = acc + NV * D, *vf = kf + KT * D;
    float *s = vf + KT * D, *m = s + NV * KT, *l = m + NV, *lim = l + NV;
    uint32_t *qp = (uint32_t *)qt, *kb = (uint32_t *)kf, *vp = (uint32_t *)vf;
    uint32_t *pp = (uint32_t *)(lim + NV);
    (void)kb, (void)vp, (void)pp; /* unused where the build has no dot path */
    /* q transposed: qt[d][v] scaled fp32, or qp[d / 2][v] pairs of raw bf16 for DOT */
    for (int64_t v = 0; v < V; v++) {
        const int64_t row = first + r0 + v / G, head = h * G + v % G;
        const int64_t at = row * c->q_stride + head * D;
        if (DOT)
            for (int64_t e = 0; e < D / 2; e++) {
                uint32_t pair = 0;
                if (v < nvec) __builtin_memcpy(&pair, (const uint16_t *)c->q + at + 2 * e, 4);
                qp[e * V + v] = pair;
            }
        else
            for (int64_t d = 0; d < D; d++)
                qt[d * V + v] = v < nvec ? load(c->q, at + d, BF16) * qscale : 0.f;
        /* positions stay exact in float up to 2^24 tokens; padding vectors see nothing */
        lim[v] = v < nvec ? (float)(ctx + r0 + v / G + 1) : 0.f;
        m[v] = -FLT_MAX; /* not -inf: a fully masked tile must give exp(0), not exp(nan) */
        l[v] = 0.f;
    }
    for (int64_t i = 0; i < V * D; i++) acc[i] = 0.f;
    const int64_t kend = ctx + t->r1, nv = (nvec + 3) & ~(int64_t)3;
    for (int64_t t0 = 0; t0 < kend; t0 += KT) {
        const int64_t nk = kend - t0 < KT ? kend - t0 : KT;
#if HAVE_BF16_DOT
        if (DOT) {
            load_tile_dot(c, table, h, t0, nk, kb, vp, CK == 2, D);
            scores_dot(qp, kb, s, qscale, NC, D);
        }
#endif
        if (!DOT) {
            load_tile(c, table, h, t0, nk, kf, vf, CK, D);
            scores(qt, kf, s, NC, D);
        }
        if (t0 + KT <= ctx + r0 + 1) /* below the first row's diagonal */
            softmax_tile(s, m, l, acc, lim, t0, NC, D, 0);
        else
            softmax_tile(s, m, l, acc, lim, t0, NC, D, 1);
#if HAVE_BF16_DOT
        if (DOT) accumulate_dot(s, pp, vp, acc, nv, NC, D);
#endif
        if (!DOT) accumulate(s, vf, acc, nv, NC, D);
    }
    for (int64_t v = 0; v < nvec; v++) {
        const int64_t row = first + r0 + v / G, head = h * G + v % G;
        const float inv = c->v_scale / l[v];
        for (int64_t d = 0; d < D; d++)
            store(c->out, row * c->out_stride + head * D + d, acc[v * D + d] * inv, BF16);
    }
}

/* The task with as few VW-vector register columns as it needs. */
static inline __attribute__((always_inline)) void dispatch(
        const struct call *c, const struct task *t, float *w, const int BF16, const int CK,
        const int DOT, const int64_t D) {
    const int64_t nvec = (t->r1 - t->r0) * (c->H / c->KVH);
    if (nvec > 2 * VW) run_task(c, t, w, BF16, CK, DOT, 4, D);
    else if (nvec > VW) run_task(c, t, w, BF16, CK, DOT, 2, D);
    else run_task(c, t, w, BF16, CK, DOT, 1, D);
}

#define WORKSPACE_FLOATS(D) (2 * NV * (D) + 2 * KT * (D) + NV * KT * 3 / 2 + 3 * NV)

/* 0, or -1 for a shape the kernels do not take. */
static int check_shape(int64_t H, int64_t KVH, int64_t D, int64_t bs) {
    if (KVH <= 0 || H % KVH || H / KVH > MAX_G || D > MAX_D || D % 16) return -1;
    if (bs <= 0 || (bs & (bs - 1))) return -1; /* a power of two: shifts, not divisions */
    return 0;
}

/* T: the queries' type (BF16 = 1 for bf16); FP8 = 1: a cache of FP8 bytes (lut: the value
 * of each byte, k_scale folded into scale), else of T. DC > 0 fixes the head dim at compile
 * time (loops unroll, accumulators stay in registers); 0 = any multiple of 16 up to MAX_D.
 * Returns 0, or -1 bad shape, -2 out of memory, -3 a specialisation called with another
 * head dim. */
#define DEFINE_KERNEL(NAME, T, BF16, FP8, DC)                                                  \
int NAME(const T *q, int64_t q_stride, const void *kc, const void *vc, const int64_t *bt,     \
         int64_t bt_stride, const int64_t *seqs, T *out, int64_t out_stride, int64_t n,       \
         int64_t H, int64_t KVH, int64_t d_arg, int64_t bs, float scale, int64_t dot,        \
         float v_scale, const float *lut) {                                                   \
    if (DC && d_arg != DC) return -3;                                                         \
    if (check_shape(H, KVH, d_arg, bs)) return -1;                                            \
    uint16_t lut16[256];                                                                      \
    for (int i = 0; FP8 && i < 256; i++) lut16[i] = bf16_round(lut[i]);                      \
    struct call c = {q, kc, vc, out, bt, seqs, q_stride, bt_stride, out_stride, H, KVH, bs,  \
                     0, scale, v_scale, lut, FP8 ? lut16 : NULL};                             \
    while ((INT64_C(1) << c.shift) < bs) c.shift++;                                           \
    int64_t num_tasks = 0;                                                                    \
    struct task *tasks = plan_tasks(seqs, n, KVH, H / KVH, &num_tasks);                       \
    if (!tasks) return -2;                                                                    \
    const size_t bytes = sizeof(float) * (size_t)WORKSPACE_FLOATS(d_arg);                     \
    int failed = 0;                                                                           \
    _Pragma("omp parallel")                                                                   \
    {                                                                                         \
        float *w = (float *)aligned_alloc(64, (bytes + 63) & ~(size_t)63);                    \
        _Pragma("omp for schedule(dynamic, 1)")                                               \
        for (int64_t i = 0; i < num_tasks; i++) {                                             \
            if (!w) { failed = 1; continue; }                                                 \
            if (BF16 && HAVE_BF16_DOT && dot)                                                 \
                dispatch(&c, &tasks[i], w, BF16, FP8 ? 2 : BF16, 1, DC ? DC : d_arg);         \
            else                                                                              \
                dispatch(&c, &tasks[i], w, BF16, FP8 ? 2 : BF16, 0, DC ? DC : d_arg);         \
        }                                                                                     \
        free(w);                                                                              \
    }                                                                                         \
    free(tasks);                                                                              \
    return failed ? -2 : 0;                                                                   \
}

#define DEFINE_ALL(SUFFIX, DC)                                                                 \
    DEFINE_KERNEL(paged_prefill_f32##SUFFIX, float, 0, 0, DC)                                  \
    DEFINE_KERNEL(paged_prefill_bf16##SUFFIX, uint16_t, 1, 0, DC)                              \
    DEFINE_KERNEL(paged_prefill_fp8_f32##SUFFIX, float, 0, 1, DC)                              \
    DEFINE_KERNEL(paged_prefill_fp8_bf16##SUFFIX, uint16_t, 1, 1, DC)

DEFINE_ALL(, 0)
/* Specialisations by head dim: those of common models. */
DEFINE_ALL(_d64, 64)
DEFINE_ALL(_d128, 128)

/* 1 when the bf16 kernels can take the dot-product path (their `dot` argument). */
int paged_prefill_has_bf16_dot(void) { return HAVE_BF16_DOT; }
