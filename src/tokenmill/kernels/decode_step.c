/* A whole step of a Llama-family model, in one call, with quantised or AMX-packed projections.
 *
 * It runs exactly the kernels the Python module path calls, in the same order, on the same inputs
 * (norms, quantised products, RoPE, KV writes, paged decode attention, the AMX prefill attention,
 * SiLU-and-mul), so its output is bit-identical to that path; what it saves is the Python between them.
 * models/fused_decode.py decides when it applies (few enough rows for these product paths; prefill
 * chunks only in bfloat16 with AMX and a bfloat16 cache). A one-byte cache (kv_rows) is written and read by
 * the kernels of decode_attention_q8.c, as the module path's cache_write and decode_attention do.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The kernels of cpu_kernels.c and quant_kernels.c. */
void tm_decode_attention(void *out, const void *q, const void *k_cache, const void *v_cache,
                         const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride,
                         int64_t out_row_stride, float scale, int64_t window, int64_t chunk, float softcap,
                         const float *sinks, int bf16);
int tm_prefill_attention(uint16_t *out, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *query_starts, const int64_t *query_lens, const int64_t *context_lens,
                         const int32_t *block_tables, int64_t max_blocks, int64_t num_chunks, int64_t num_heads,
                         int64_t num_kv_heads, int64_t block_size, int64_t head_dim, int64_t q_stride, float scale);
void tm_cache_write(void *k_cache, void *v_cache, const void *k, const void *v, const int64_t *slots,
                    int64_t num_tokens, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                    int64_t k_row_stride, int64_t v_row_stride, int bf16);
/* decode_attention_q8.c: the one-byte caches (--kv-cache-dtype int8 / fp8) */
void tm_decode_attention_q8(void *out, const void *q, const int8_t *k_cache, const int8_t *v_cache,
                            const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride,
                            int64_t out_row_stride, float scale, int64_t window, int64_t chunk, float softcap,
                            const float *sinks, int bf16, int fp8);
void tm_cache_write_q8(int8_t *k_cache, int8_t *v_cache, const void *k, const void *v, const int64_t *slots,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                       int64_t k_row_stride, int64_t v_row_stride, int bf16, int fp8);
void tm_add_rms_norm(void *out, const void *x, void *residual, const void *weight, int64_t num_tokens,
                     int64_t hidden, float eps, int bf16);
void tm_silu_mul(void *out, const void *gate_up, int64_t num_tokens, int64_t inner, int bf16);
void tm_rope(void *x, const int64_t *positions, const float *cos_table, const float *sin_table,
             int64_t num_tokens, int64_t num_heads, int64_t head_dim, int64_t row_stride, int bf16);
void tm_qlinear(void *y, const void *x, const uint8_t *cells, const float *bias, int64_t m, int64_t k, int64_t n,
                int64_t x_stride, int64_t y_stride, int bits, int scales, int bf16);
void tm_amx_linear(uint16_t *y, const uint16_t *x, const uint16_t *packed, const float *bias,
                   int64_t m, int64_t k, int64_t n, int64_t ldx, int64_t ldy);
void tm_amx_qlinear(uint16_t *y, const uint16_t *x, const uint8_t *cells, const float *bias, int64_t m, int64_t k,
                    int64_t n, int64_t ldx, int64_t ldy, int bits, int scales);

/* One projection: bfloat16 in AMX tiles (`amx_packed`, see amx_kernels.c), else block-quantised
 * in cells (see quant_cells.h for the layout). */
typedef struct {
    const uint16_t *amx_packed;
    const uint8_t *cells;
    const float *bias, *amx_bias;  /* NULL: none; amx_bias: bias rounded as the AMX product adds it */
    int64_t rows, cols;
    int32_t bits, scales, amx;  /* scales: the cells' QS_ flags; amx: the AMX product suits this projection's width */
} tm_projection;

/* One decoder layer's weights and KV cache ([2, num_blocks, kv_heads, block_size, head_dim]). */
typedef struct {
    const void *input_norm, *post_norm;
    tm_projection qkv, o, gate_up, down;
    void *kv_cache;
} tm_layer;

/* Shapes and per-step inputs shared by every layer. */
typedef struct {
    int64_t num_tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size, max_blocks;
    float eps, scale;
    int32_t bf16;
    const int64_t *positions, *slots;
    int64_t num_decodes;  /* decode rows: token_index, block_tables [num_decodes, max_blocks], context_lens */
    const int64_t *token_index;
    const int32_t *block_tables, *context_lens;
    int64_t num_prefills;  /* prefill chunks: prefill_chunks [3, num_prefills] (query starts, query lengths,
                              context lengths), prefill_tables [num_prefills, prefill_max_blocks] */
    const int64_t *prefill_chunks;
    const int32_t *prefill_tables;
    int64_t prefill_max_blocks;
    const float *cos, *sin;
    const void *final_norm;
    int64_t amx_from_rows;  /* bfloat16 products of this many rows or more run on AMX; 0: none */
    int32_t kv_rows;  /* the cache's rows: 0 the compute dtype, 1 int8, 2 fp8 (attention/kv_quant.py) */
    int64_t num_taps;  /* EAGLE-3's taps: the residual stream entering layers tap_layers[0 .. num_taps) (ascending),
                          written to taps [num_tokens, num_taps x hidden]; 0: none */
    const int64_t *tap_layers;
    void *taps;
} tm_step;

/* The product QLinearOp would pick for m rows (below the dequantising threshold, which FusedDecode
 * checks). */
static void project(void *y, const void *x, const tm_projection *p, int64_t m, const tm_step *s) {
    if (p->amx_packed)
        tm_amx_linear(y, x, p->amx_packed, p->amx_bias, m, p->cols, p->rows, p->cols, p->rows);
    else if (s->bf16 && p->amx && s->amx_from_rows && m >= s->amx_from_rows)
        tm_amx_qlinear(y, x, p->cells, p->amx_bias, m, p->cols, p->rows, p->cols, p->rows, p->bits, p->scales);
    else
        tm_qlinear(y, x, p->cells, p->bias, m, p->cols, p->rows, p->cols, p->rows, p->bits, p->scales, s->bf16);
}

/* hidden [T, hidden] holds the embeddings on entry and the final-normed hidden states on return: 0. Or -1,
 * hidden untouched (it is written last), where the prefill attention does not take these chunks (float32,
 * shapes it does not suit); the caches then hold this step's K/V, which the module path writes again. */
int tm_decode_step(void *hidden, const tm_layer *layers, int64_t num_layers, const tm_step *s) {
    if (s->num_prefills && (!s->bf16 || s->kv_rows))  /* the prefill attention reads bfloat16 caches */
        return -1;
    const int64_t t = s->num_tokens, elem = s->bf16 ? 2 : 4;
    const int64_t q_size = s->num_heads * s->head_dim, kv_size = s->num_kv_heads * s->head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size;
    char *residual = malloc((size_t)(t * s->hidden * elem));
    char *normed = malloc((size_t)(t * s->hidden * elem));
    char *x = malloc((size_t)(t * s->hidden * elem));
    char *qkv = malloc((size_t)(t * qkv_width * elem));
    char *attn = malloc((size_t)(t * q_size * elem));
    char *gate_up = malloc((size_t)(t * 2 * s->intermediate * elem));
    char *act = malloc((size_t)(t * s->intermediate * elem));
    const int64_t cache_half = s->num_blocks * s->num_kv_heads * s->block_size
                               * (s->kv_rows ? s->head_dim + 4 : s->head_dim * elem);
    int failed = 0;
    int64_t next_tap = 0;

    for (int64_t l = 0; l < num_layers; l++) {
        const tm_layer *layer = &layers[l];
        if (l == 0) {  /* the residual stream starts as the embeddings */
            tm_add_rms_norm(normed, hidden, NULL, layer->input_norm, t, s->hidden, s->eps, s->bf16);
            memcpy(residual, hidden, (size_t)(t * s->hidden * elem));
        } else {       /* residual += the previous layer's output, then norm */
            tm_add_rms_norm(normed, x, residual, layer->input_norm, t, s->hidden, s->eps, s->bf16);
        }
        /* residual now holds the stream entering layer l, rounded as the module path's hidden + residual */
        if (next_tap < s->num_taps && s->tap_layers[next_tap] == l) {
            const int64_t row = s->hidden * elem;
            for (int64_t r = 0; r < t; r++)
                memcpy((char *)s->taps + (r * s->num_taps + next_tap) * row, residual + r * row, (size_t)row);
            next_tap++;
        }
        project(qkv, normed, &layer->qkv, t, s);
        tm_rope(qkv, s->positions, s->cos, s->sin, t, s->num_heads + s->num_kv_heads, s->head_dim, qkv_width,
                s->bf16);
        const char *k = qkv + q_size * elem, *v = qkv + (q_size + kv_size) * elem;
        char *v_cache = (char *)layer->kv_cache + cache_half;
        if (s->kv_rows)
            tm_cache_write_q8(layer->kv_cache, (int8_t *)v_cache, k, v, s->slots, t, s->num_kv_heads, s->block_size,
                              s->head_dim, qkv_width, qkv_width, s->bf16, s->kv_rows == 2);
        else
            tm_cache_write(layer->kv_cache, v_cache, k, v, s->slots, t, s->num_kv_heads, s->block_size, s->head_dim,
                           qkv_width, qkv_width, s->bf16);
        /* window 0, chunk 0, no soft cap, no sinks: models with sliding or chunked layers, capped scores or sinks
         * do not take this step (fused_decode.py) */
        if (s->num_decodes && s->kv_rows)
            tm_decode_attention_q8(attn, qkv, layer->kv_cache, (const int8_t *)v_cache, s->token_index,
                                   s->block_tables, s->context_lens, s->num_decodes, s->num_heads, s->num_kv_heads,
                                   s->head_dim, s->block_size, s->max_blocks, qkv_width, s->head_dim, q_size,
                                   s->scale, 0, 0, 0.0f, NULL, s->bf16, s->kv_rows == 2);
        else if (s->num_decodes)
            tm_decode_attention(attn, qkv, layer->kv_cache, v_cache, s->token_index,
                                s->block_tables, s->context_lens, s->num_decodes, s->num_heads, s->num_kv_heads,
                                s->head_dim, s->block_size, s->max_blocks, qkv_width, s->head_dim, q_size, s->scale,
                                0, 0, 0.0f, NULL, s->bf16);
        const int64_t p = s->num_prefills;
        if (p && tm_prefill_attention((uint16_t *)attn, (const uint16_t *)qkv, layer->kv_cache,
                                      (const uint16_t *)v_cache, s->prefill_chunks, s->prefill_chunks + p,
                                      s->prefill_chunks + 2 * p, s->prefill_tables, s->prefill_max_blocks, p,
                                      s->num_heads, s->num_kv_heads, s->block_size, s->head_dim, qkv_width,
                                      s->scale)) {
            failed = 1;
            break;
        }
        project(x, attn, &layer->o, t, s);
        tm_add_rms_norm(normed, x, residual, layer->post_norm, t, s->hidden, s->eps, s->bf16);
        project(gate_up, normed, &layer->gate_up, t, s);
        tm_silu_mul(act, gate_up, t, s->intermediate, s->bf16);
        project(x, act, &layer->down, t, s);
    }
    if (!failed)
        tm_add_rms_norm(hidden, x, residual, s->final_norm, t, s->hidden, s->eps, s->bf16);
    free(residual);
    free(normed);
    free(x);
    free(qkv);
    free(attn);
    free(gate_up);
    free(act);
    return failed ? -1 : 0;
}
