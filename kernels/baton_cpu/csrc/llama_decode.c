/* A whole decode step of a Llama-family decoder in bfloat16 on CPU, in one call: every layer's
 * add + RMSNorm, qkv linear, rotary, KV-cache write, paged attention, o linear, add + RMSNorm,
 * gate/up linear, SiLU * up and down linear, then the final norm; one token per sequence.
 *
 * Why: the same step driven from Python makes ~12 kernel calls per layer, each paying
 * interpreter, dispatcher and allocation overhead (~1.5 ms per step for the bundled model's 30
 * layers, 15% of a batch-1 step). This file is only the driver: the kernels are the ones the
 * Python path calls (`linear_bf16.c`, `cpu_ops.c`, `paged_decode.c`), reached
 * through function pointers taken from their loaded libraries, so the two paths compute the
 * same bits and there is one copy of each kernel.
 *
 * Layouts: x_in, out [M, hidden]; positions, slots, seq_lens [M] int64 (slot < 0: the row's
 * K/V are not written, a padding row); block_tables [M, bt_stride] int64; each layer's caches
 * [num_blocks, block_size, KVH, D]; weights as the linear kernel takes them (qkv: q outputs,
 * then k, then v; gate_up: gate outputs, then up). The workspace holds `workspace_rows` rows
 * of every intermediate.
 *
 * LoRA (`lora_bf16.c`): with `row_slot` set, each linear `lora_linears[4 l + i]` (i: qkv, o,
 * gate_up, down; NULL: not adapted) gets each row's adapter delta added after it, by the
 * kernel the Python path's LoRALinear calls.
 */
#include <stdint.h>
#include <string.h>

typedef int (*linear_fn)(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int64_t M, int64_t N, int64_t K);
typedef int (*norm_fn)(const uint16_t *x, const uint16_t *res, const uint16_t *w, uint16_t *out,
                       uint16_t *res_out, int64_t rows, int64_t h, float eps);
typedef int (*silu_fn)(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter);
typedef int (*rotary_fn)(const uint16_t *qkv, int64_t stride, const int64_t *positions,
                         const uint16_t *cos, const uint16_t *sin, int64_t P, uint16_t *q_out,
                         uint16_t *k_out, int64_t rows, int64_t H, int64_t KVH, int64_t D);
typedef int (*lora_fn)(const void *linear, const uint16_t *x, const int64_t *row_slot,
                       uint16_t *y, int64_t M);
typedef int (*attn_fn)(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                       const int64_t *bt, int64_t bt_stride, const int64_t *seq_lens,
                       uint16_t *out, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                       float scale);

/* Mirrored field by field by `LlamaStack` in `native_decode.py`. Per-layer arrays have
 * `layers` entries; qkv_bias entries may be NULL. */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, block_size, rope_positions;
    int64_t workspace_rows, cache_slots; /* cache_slots: num_blocks * block_size */
    float eps, scale;
    const uint16_t *const *input_norm, *const *qkv, *const *qkv_bias, *const *o_proj;
    const uint16_t *const *post_norm, *const *gate_up, *const *down;
    uint16_t *const *k_cache, *const *v_cache;
    const uint16_t *final_norm, *cos, *sin;
    uint16_t *workspace; /* workspace_rows * llama_decode_row_elems(stack) elements */
    linear_fn linear;
    norm_fn norm;
    silu_fn silu;
    rotary_fn rotary;
    attn_fn attn;
    lora_fn lora;                      /* NULL: no LoRA */
    const void *const *lora_linears;   /* layers * 4 (qkv, o, gate_up, down); NULL entries */
    const int64_t *row_slot;           /* [M] this step's adapter slot per row; NULL: none */
} llama_stack;

/* Per-row widths of the intermediates, in elements. */
static int64_t qkv_width(const llama_stack *s) {
    return (s->heads + 2 * s->kv_heads) * s->head_dim;
}

int64_t llama_decode_row_elems(const llama_stack *s) {
    return 4 * s->hidden + qkv_width(s) + 2 * s->heads * s->head_dim
           + s->kv_heads * s->head_dim + 3 * s->inter;
}

#define CHECK(call)              \
    do {                         \
        const int rc_ = (call);  \
        if (rc_ != 0) return rc_; \
    } while (0)

/* Linear `i` of layer `l`'s LoRA deltas onto y, when the step has adapter rows. */
static int lora_after(const llama_stack *s, int64_t l, int i, const uint16_t *x, uint16_t *y,
                      int64_t M) {
    if (s->lora == NULL || s->row_slot == NULL || s->lora_linears[4 * l + i] == NULL) return 0;
    return s->lora(s->lora_linears[4 * l + i], x, s->row_slot, y, M);
}

/* Returns 0, -1 for bad arguments (nothing written), or the failing kernel's code (the KV
 * cache may then hold some of this step's rows, as after a failed torch step). */
int llama_decode_step(const llama_stack *s, const uint16_t *x_in, const int64_t *positions,
                      const int64_t *slots, const int64_t *block_tables, int64_t bt_stride,
                      const int64_t *seq_lens, int64_t M, uint16_t *out) {
    if (M < 1 || M > s->workspace_rows || s->layers < 1 || s->kv_heads < 1
        || s->heads % s->kv_heads)
        return -1;
    for (int64_t m = 0; m < M; m++)
        if (positions[m] < 0 || positions[m] >= s->rope_positions || slots[m] >= s->cache_slots)
            return -1;
    const int64_t h = s->hidden, H = s->heads, KVH = s->kv_heads, D = s->head_dim;
    const int64_t I = s->inter, W = qkv_width(s), kv_row = KVH * D;
    uint16_t *normed = s->workspace, *res_a = normed + M * h;
    uint16_t *res_b = res_a + M * h, *x = res_b + M * h;
    uint16_t *qkv = x + M * h, *q = qkv + M * W, *k = q + M * H * D;
    uint16_t *attn = k + M * kv_row, *gate_up = attn + M * H * D;
    uint16_t *act = gate_up + M * 2 * I;

    const uint16_t *hidden = x_in, *residual = NULL;
    for (int64_t l = 0; l < s->layers; l++) {
        /* Without a residual yet (layer 0) the norm's residual output is its input. */
        uint16_t *res_next = residual == res_a ? res_b : res_a;
        CHECK(s->norm(hidden, residual, s->input_norm[l], normed, residual ? res_next : NULL,
                      M, h, s->eps));
        residual = residual ? res_next : hidden;
        CHECK(s->linear(normed, s->qkv[l], s->qkv_bias[l], qkv, M, W, h));
        CHECK(lora_after(s, l, 0, normed, qkv, M));
        CHECK(s->rotary(qkv, W, positions, s->cos, s->sin, s->rope_positions, q, k, M, H, KVH,
                        D));
        for (int64_t m = 0; m < M; m++) {
            if (slots[m] < 0) continue;
            memcpy(s->k_cache[l] + slots[m] * kv_row, k + m * kv_row, kv_row * sizeof(uint16_t));
            memcpy(s->v_cache[l] + slots[m] * kv_row, qkv + m * W + (H + KVH) * D,
                   kv_row * sizeof(uint16_t));
        }
        CHECK(s->attn(q, s->k_cache[l], s->v_cache[l], block_tables, bt_stride, seq_lens, attn,
                      M, H, KVH, D, s->block_size, s->scale));
        CHECK(s->linear(attn, s->o_proj[l], NULL, x, M, h, H * D));
        CHECK(lora_after(s, l, 1, attn, x, M));
        res_next = residual == res_a ? res_b : res_a;
        CHECK(s->norm(x, residual, s->post_norm[l], normed, res_next, M, h, s->eps));
        residual = res_next;
        CHECK(s->linear(normed, s->gate_up[l], NULL, gate_up, M, 2 * I, h));
        CHECK(lora_after(s, l, 2, normed, gate_up, M));
        CHECK(s->silu(gate_up, act, M, I));
        CHECK(s->linear(act, s->down[l], NULL, x, M, h, I));
        CHECK(lora_after(s, l, 3, act, x, M));
        hidden = x;
    }
    uint16_t *res_next = residual == res_a ? res_b : res_a;
    return s->norm(hidden, residual, s->final_norm, out, res_next, M, h, s->eps);
}
