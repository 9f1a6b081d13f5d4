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
 * them. Rows run in parallel (OpenMP); a row's A and B stay in cache for the next row of
 * the same adapter.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define LORA_MAX_PARTS 4
#define LORA_MAX_RANK 512

/* Mirrored field by field by `LoRALinearDesc` in `lora.py`. */
typedef struct {
    const uint16_t *a;
    const uint16_t *b[LORA_MAX_PARTS];
    int64_t first[LORA_MAX_PARTS], cols[LORA_MAX_PARTS];
    int64_t parts, rank, in_features, out_features;
} lora_linear;

static void shrink(const lora_linear *L, const uint16_t *a, const uint16_t *x, float *t) {
    const int64_t K = L->in_features;
    for (int64_t j = 0; j < L->parts * L->rank; j++) {
        const uint16_t *row = a + j * K;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc += bf16_to_f32(row[k]) * bf16_to_f32(x[k]);
        t[j] = acc;
    }
}

static void expand(const uint16_t *b, const float *t, int64_t rank, int64_t cols, float *acc,
                   uint16_t *y) {
    for (int64_t c = 0; c < cols; c++) acc[c] = 0.0f;
    for (int64_t r = 0; r < rank; r++) {
        const float tr = t[r];
        const uint16_t *row = b + r * cols;
        for (int64_t c = 0; c < cols; c++) acc[c] += tr * bf16_to_f32(row[c]);
    }
    for (int64_t c = 0; c < cols; c++) y[c] = bf16_round(bf16_to_f32(y[c]) + acc[c]);
}

/* Returns 0, or -1 for bad arguments (nothing written), -2 when out of memory. */
int lora_add_bf16(const lora_linear *L, const uint16_t *x, const int64_t *row_slot,
                  uint16_t *y, int64_t M) {
    if (M < 0 || L->parts < 1 || L->parts > LORA_MAX_PARTS || L->rank < 1
        || L->rank > LORA_MAX_RANK)
        return -1;
    int64_t widest = 0;
    for (int64_t p = 0; p < L->parts; p++) {
        if (L->first[p] < 0 || L->first[p] + L->cols[p] > L->out_features) return -1;
        if (L->cols[p] > widest) widest = L->cols[p];
    }
    int failed = 0;
#pragma omp parallel
    {
        float t[LORA_MAX_PARTS * LORA_MAX_RANK];
        float *acc = malloc(sizeof(float) * (size_t)widest);
        if (acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const int64_t s = row_slot[m];
            if (s < 0 || acc == NULL) continue;
            const int64_t R = L->rank;
            shrink(L, L->a + s * L->parts * R * L->in_features, x + m * L->in_features, t);
            for (int64_t p = 0; p < L->parts; p++)
                expand(L->b[p] + s * R * L->cols[p], t + p * R, R, L->cols[p], acc,
                       y + m * L->out_features + L->first[p]);
        }
        free(acc);
    }
    return failed ? -2 : 0;
}
