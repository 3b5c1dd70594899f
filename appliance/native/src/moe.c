/* The routed experts of a mixture-of-experts MLP (Qwen3-MoE) in one call: router softmax and top-k per token,
 * tokens grouped per expert, each used expert's gate/up/down products over its tokens, SiLU-gated, weighted and
 * summed. Twin: appliance/native/ops_numpy.py moe_ffn (and engine/qwen3_moe.py's numpy path).
 *
 * Policy: only the routed experts' weights are read (decode: exactly top_k experts), each once per call, in
 * place (per-expert row pointers into the file's mapping: stacked GGUF tensors and per-expert safetensors alike).
 * The pool runs the gate and up row tiles of all used experts in one task list, so a decode step's 8
 * small experts keep every thread busy; down runs per expert, threaded across its rows. Activations are
 * prepared (quantized) once per token for gate/up. Routing matches the twin: float32 softmax over all experts, the k
 * largest (ties: lower expert id), renormalised when asked; the output adds experts in ascending id order.
 * Policy (SIMD): the router and expert products are matmul.c's dispatched tile kernels (NEON on aarch64); the
 * routing, grouping and weighted sums here are generic C, E + k x hidden operations per token against the
 * experts' 3 x k x hidden x inter (vectorised by -O3 where they are loops over hidden). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kq_internal.h"

typedef struct {
    kq_tile_fn gate_fn, up_fn;
    const kq_moe *m;
    const int32_t *used; /* expert ids with tokens, ascending */
    const int64_t *start, *cnt; /* their first grouped row and row count */
    const uint8_t *ag, *au; /* prepared activations of gate and up (grouped rows) */
    size_t agb, aub; /* bytes per prepared row */
    int64_t nbg, nbu; /* the tile kernels' nb argument (blocks, or n for floats) */
    size_t rbg, rbu; /* weight row bytes */
    float *g, *u, *y; /* (R, inter), (R, inter), (R, hidden) */
    int64_t tiles_i, n_used;
} moe_ctx;

static void gate_up_task(void *c_, int64_t a, int64_t b) { /* (matrix, used expert, 4-row tile of inter) a .. b-1 */
    const moe_ctx *c = c_;
    const int64_t I = c->m->inter, per = c->tiles_i * c->n_used;
    for (int64_t j = a; j < b; j++) {
        const int up = j >= per; /* all gate tiles, then all up tiles: one weight stream at a time */
        const int64_t jj = up ? j - per : j;
        int64_t k = jj / c->tiles_i, r0 = 4 * (jj % c->tiles_i), s = c->start[k], T = c->cnt[k];
        int nr = I - r0 < 4 ? (int)(I - r0) : 4, e = c->used[k];
        const uint8_t *w = up ? c->m->up[e] : c->m->gate[e];
        size_t rb = up ? c->rbu : c->rbg;
        if (j + KQ_PF_TILES < b) kq_prefetch_rows(w, rb, r0 + 4 * KQ_PF_TILES, I);
        if (up) c->up_fn(w, rb, r0, nr, c->nbu, c->au + s * c->aub, 0, T, c->u + s * I, I);
        else c->gate_fn(w, rb, r0, nr, c->nbg, c->ag + s * c->agb, 0, T, c->g + s * I, I);
    }
}

/* top-k of one token's router logits (E) -> ids and weights (k) */
static void route_token(const float *logits, int64_t E, int64_t k, int norm, float *p, int32_t *ids, float *w) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
    for (int64_t e = 0; e < E; e++) { p[e] = kq_expf(logits[e] - mx); sum += p[e]; }
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    float wsum = 0.0f;
    for (int64_t j = 0; j < k; j++) { /* selection: the largest left, lower id first on ties */
        /* a NaN probability (a NaN or infinite activation) ranks below every number, like the twin's argsort,
         * so every pick is a real expert id (chosen ones are marked -1; a NaN is never >= 0 nor -1) */
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            if (p[e] == -1.0f) continue;
            if (best < 0 || (isnan(p[best]) && !isnan(p[e])) || p[e] > p[best]) best = e;
        }
        ids[j] = (int32_t)best;
        w[j] = p[best];
        wsum += p[best];
        p[best] = -1.0f;
    }
    if (norm)
        for (int64_t j = 0; j < k; j++) w[j] /= wsum;
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

int kq_moe_ffn(const kq_moe *m, const float *x, int64_t T, float *out) {
    const int64_t E = m->n_experts, k = m->top_k, D = m->hidden, I = m->inter, R = T * k;
    if (T <= 0 || k <= 0 || k > E || D <= 0 || I <= 0) return -1;
    moe_ctx c = {.m = m};
    int akg, aku, akd;
    c.gate_fn = kq_tile_kernel(m->gate_qtype, &akg);
    c.up_fn = kq_tile_kernel(m->up_qtype, &aku);
    c.rbg = kq_row_bytes(m->gate_qtype, D);
    c.rbu = kq_row_bytes(m->up_qtype, D);
    if (!c.gate_fn || !c.up_fn || !kq_tile_kernel(m->down_qtype, &akd) || !c.rbg || !c.rbu ||
        !kq_row_bytes(m->down_qtype, I) || !m->gate_bytes || !m->up_bytes || !m->down_bytes)
        return -1;
    const int64_t gate_bytes = I * (int64_t)c.rbg, up_bytes = I * (int64_t)c.rbu,
                  down_bytes = D * (int64_t)kq_row_bytes(m->down_qtype, I);
    for (int64_t e = 0; e < E; e++)  /* each expert's matrices hold exactly their shape's bytes */
        if (m->gate_bytes[e] != gate_bytes || m->up_bytes[e] != up_bytes || m->down_bytes[e] != down_bytes ||
            !m->gate[e] || !m->up[e] || !m->down[e])
            return -1;
    c.agb = kq_act_row_bytes(akg, D);
    c.aub = kq_act_row_bytes(aku, D);
    c.nbg = akg == KQ_ACT_Q32 ? D / 32 : akg == KQ_ACT_Q256 ? D / 256 : D;
    c.nbu = aku == KQ_ACT_Q32 ? D / 32 : aku == KQ_ACT_Q256 ? D / 256 : D;

    /* one allocation: logits/probs, routing, grouping, prepared activations, products */
    size_t sz[12] = {
        align64((size_t)(T * E) * 4), align64((size_t)E * 4), align64((size_t)R * 4), align64((size_t)R * 4),
        align64((size_t)R * 8), align64((size_t)R * 4), align64((size_t)E * 4) + align64((size_t)E * 16),
        align64((size_t)T * (c.agb > c.aub ? c.agb : c.aub)), align64((size_t)R * c.agb),
        align64(aku != akg ? (size_t)R * c.aub : 0), align64((size_t)R * (size_t)I * 8),
        align64((size_t)R * (size_t)D * 4)};
    size_t total = 0;
    for (int i = 0; i < 12; i++) total += sz[i];
    /* the caller's scratch slot 3 (vision attention's, never live at the same time): a fresh malloc of this size
     * per call was fresh zeroed pages per call, half of a decode step's time */
    uint8_t *base = kq_scratch(3, total), *p = base;
    if (!base) return -2;
    float *logits = (float *)p; p += sz[0];
    float *prob = (float *)p; p += sz[1];
    int32_t *ids = (int32_t *)p; p += sz[2];
    float *w = (float *)p; p += sz[3];
    int64_t *tok = (int64_t *)p; p += sz[4];
    float *wt = (float *)p; p += sz[5];
    int32_t *used = (int32_t *)p; /* (E), then start and cnt (E each) */
    int64_t *start = (int64_t *)(p + align64((size_t)E * 4)), *cnt = start + E;
    p += sz[6];
    uint8_t *xa = p; p += sz[7];
    uint8_t *ag = p; p += sz[8];
    uint8_t *au = aku != akg ? p : ag; p += sz[9];
    c.g = (float *)p; c.u = c.g + R * I; p += sz[10];
    c.y = (float *)p;

    /* route: logits (T, E) = x @ router^T, then per token softmax and top-k */
    int rc = kq_matmul(KQ_F32, (const uint8_t *)m->router, E, D, x, T, logits);
    if (rc) return rc;
    for (int64_t t = 0; t < T; t++) route_token(logits + t * E, E, k, m->norm_topk, prob, ids + t * k, w + t * k);

    /* group (token, weight) rows by expert, ascending ids, tokens in order */
    int64_t *count = cnt, nu = 0;
    memset(count, 0, (size_t)E * 8);
    for (int64_t r = 0; r < R; r++) count[ids[r]]++;
    int64_t *pos = start, acc = 0;
    for (int64_t e = 0; e < E; e++) { pos[e] = acc; acc += count[e]; }
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < k; j++) {
            int64_t r = pos[ids[t * k + j]]++;
            tok[r] = t;
            wt[r] = w[t * k + j];
        }
    if (m->counts)
        for (int64_t e = 0; e < E; e++) m->counts[e] = (int32_t)count[e];
    for (int64_t e = 0, s = 0; e < E; e++) /* compact to the used experts: (id, first row, rows) */
        if (count[e]) { used[nu] = (int32_t)e; start[nu] = s; cnt[nu] = count[e]; s += count[e]; nu++; }

    /* gate/up activations: prepared once per token, gathered per grouped row */
    kq_prepare_act(akg, x, T, D, xa);
    for (int64_t r = 0; r < R; r++) memcpy(ag + r * c.agb, xa + tok[r] * c.agb, c.agb);
    if (aku != akg) {
        kq_prepare_act(aku, x, T, D, xa);
        for (int64_t r = 0; r < R; r++) memcpy(au + r * c.aub, xa + tok[r] * c.aub, c.aub);
    }
    c.ag = ag; c.au = au; c.used = used; c.start = start; c.cnt = cnt;
    c.tiles_i = (I + 3) / 4;
    c.n_used = nu;
    kq_parallel_for(2 * nu * c.tiles_i, kq_chunk_for(2 * nu * c.tiles_i), gate_up_task, &c);
    kq_swiglu(c.g, c.u, R * I, c.g);
    /* down: one pooled product per used expert over its rows of h (a single task list across experts measured
     * 3x slower at decode: it pushed the gate/up weights out of the cache between steps) */
    for (int64_t q = 0; q < nu && rc == 0; q++)
        rc = kq_matmul(m->down_qtype, m->down[used[q]], D, I, c.g + start[q] * I, cnt[q], c.y + start[q] * D);
    if (rc) return rc;

    /* out[t] = sum over its experts (ascending ids) of weight * y */
    memset(out, 0, (size_t)(T * D) * sizeof(float));
    for (int64_t r = 0; r < R; r++) {
        float *o = out + tok[r] * D;
        const float *yr = c.y + r * D, wr = wt[r];
        for (int64_t i = 0; i < D; i++) o[i] += yr[i] * wr;
    }
    return 0;
}
