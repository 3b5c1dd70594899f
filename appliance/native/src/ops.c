/* Float32 decoder operations (RMSNorm, rotate-half RoPE, causal attention over a float32 or float16 KV cache,
 * SwiGLU) and the whole per-layer decoder sequence in one call (kq_forward), so a decode step costs one ctypes
 * call instead of a few hundred numpy calls. Twins: appliance/native/ops_numpy.py and engine/qwen3.py.
 *
 * Policy (SIMD): the products inside attention (scores, probability x value) and kq_forward (the linears, the
 * experts) are matmul.c's dispatched kernels, NEON on aarch64 (matmul_float.inc, matmul_pv.inc). The rest here is
 * generic C: RMSNorm, RoPE, SwiGLU, the online softmax, the float16 cache store, a few flops per element they
 * stream. On x86_64 it is built as target_clones (KQ_CLONES: AVX2 and AVX-512 copies of the same C) because the
 * x86_64 baseline is SSE2; the aarch64 baseline already has Advanced SIMD at the A76's full width (128 bits), so
 * the one -O3 build is the NEON version: gcc 12.2 for aarch64 with the library's flags vectorises these loops to
 * 4-lane float ops (aarch64-linux-gnu-objdump -d of ops.o: kq_rms_norm's sum of squares and scaling fmul/fadd
 * v.4s; kq_rope fmul/fsub/fadd v.4s; kq_swiglu 127 of 408 instructions vector, the kq_expf polynomial as
 * fmul/fadd/shl v.4s; attn_task 238 of 1299, the max / exp-sum / rescale passes). A hand-written NEON copy
 * would issue the same instructions (no FMA contraction either way: -ffp-contract=off), so none is kept (kq_max,
 * kq_internal.h, is the exception: GCC left its lanes scalar); the system test tests/system/test_native_qemu_aarch64.py
 * checks the vector code is still there. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "kq_internal.h"

KQ_CLONES void kq_rms_norm(const float *x, const float *w, int64_t T, int64_t n, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *v = x + t * n;
        float acc[8] = {0};
        int64_t k = 0;
        for (; k + 8 <= n; k += 8)
            for (int j = 0; j < 8; j++) acc[j] += v[k + j] * v[k + j];
        for (; k < n; k++) acc[0] += v[k] * v[k];
        double ss = 0.0;
        for (int j = 0; j < 8; j++) ss += acc[j];
        float inv = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
        for (k = 0; k < n; k++) out[t * n + k] = v[k] * inv * w[k];
    }
}

KQ_CLONES void kq_rope(float *x, int64_t T, int64_t nh, int64_t hd, const float *cos, const float *sin) {
    int64_t half = hd / 2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nh; h++) {
            float *v = x + (t * nh + h) * hd;
            const float *c = cos + t * half, *s = sin + t * half;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i] + a * s[i];
            }
        }
}

KQ_CLONES void kq_swiglu(const float *g, const float *u, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + kq_expf(-g[i])) * u[i];
}

/* ---- KV cache elements: float32, or float16 (IEEE half: stored rounded, read widened by the tile kernels) ---- */

/* float -> half, round to nearest even like numpy's astype(float16); past the half range: +-inf */
static inline uint16_t f2h(float x) {
    uint32_t u, sign;
    memcpy(&u, &x, 4);
    sign = (u >> 16) & 0x8000;
    u &= 0x7fffffff;
    if (u >= 0x47800000u) return (uint16_t)(sign | (u > 0x7f800000u ? 0x7e00 : 0x7c00));
    if (u < 0x38800000u) { /* subnormal or zero: align the mantissa with a float add (rounds to even) */
        float f;
        memcpy(&f, &u, 4);
        f += 0.5f;
        memcpy(&u, &f, 4);
        return (uint16_t)(sign | (u - 0x3f000000u));
    }
    u += 0xc8000fffu + ((u >> 13) & 1); /* exponent -112, round half to even */
    return (uint16_t)(sign | (u >> 13));
}

/* store one head's row (hd floats) at element offset `at` of a cache */
static void kv_store(void *cache, int f16, int64_t at, const float *x, int64_t hd) {
    if (f16) {
        uint16_t *d = (uint16_t *)cache + at;
        for (int64_t i = 0; i < hd; i++) d[i] = f2h(x[i]);
    } else {
        memcpy((float *)cache + at, x, (size_t)hd * 4);
    }
}

/* ---- attention: q (T, H, hd), caches (KV, max_len, hd) holding S positions, out (T, H, hd) ----
 * Policy: a task is one KV head, a group of the query heads sharing it and a block of query tokens (its rows:
 * head-group x tokens). Keys and values are walked in blocks of KV_BLOCK positions, read as stored (float16 is
 * widened in registers); a block's scores for all rows are one multi-token tile product (kq_f32_tiles /
 * kq_f16_tiles) and its values one probability x value tile product (kq_pv_tiles), so prefill reads each block
 * once per task instead of once per (head, token). The softmax is online (running max and sum per row; the
 * accumulated values rescaled when the max grows). A row's result depends only on its query, the cache and its
 * causal limit (blocks start at fixed multiples of KV_BLOCK; a block past the limit is skipped), never on T, the
 * task it falls in or the thread count: chunked prefill, whole prefill and decode agree. Keys of its block past
 * a row's limit get probability 0, so a value that overflowed float16 to inf there would make the row NaN
 * (0 * inf), as in the numpy twin; a cache holding inf has already made the rows that see it inf or NaN. */
#define KV_BLOCK 256 /* positions per key/value block */
#define ATT_ROWS 64  /* rows (query head x token) per task at most */
#define ATT_WIDEN 2  /* a task's widening of a block, in query rows' work (bench/a76_context.py's per-key costs on the
                      * A76: 1.9 rows at head_dim 64, 2.3 at 128; not measured on x86, where 2 threads split no
                      * real model's groups) */
typedef struct {
    const float *q;
    const void *kc, *vc;
    float *out;
    int64_t max_len, T, S, H, KV, hd, group, qb, ngroups, nqb; /* group heads x qb tokens per task */
    int f16;
    _Atomic int err; /* a task could not get its scratch: the result is incomplete */
} attn_ctx;

KQ_CLONES static void attn_task(void *c_, int64_t a, int64_t b) { /* tasks (kv, head group, token block) */
    const attn_ctx *c = c_;
    const int64_t hd = c->hd, R = c->group * c->qb, esz = c->f16 ? 2 : 4;
    float *qs = kq_scratch(2, (size_t)(R * (2 * hd + KV_BLOCK + 2)) * sizeof(float));
    if (!qs) { atomic_store(&((attn_ctx *)c_)->err, 1); return; }
    float *acc = qs + R * hd, *sc = acc + R * hd, *mx = sc + R * KV_BLOCK, *sum = mx + R;
    const float scale = (float)(1.0 / sqrt((double)hd));
    for (int64_t j = a; j < b; j++) {
        const int64_t kv = j / (c->ngroups * c->nqb), h0 = kv * (c->H / c->KV) + (j / c->nqb) % c->ngroups * c->group;
        const int64_t t0 = j % c->nqb * c->qb, nt = c->T - t0 < c->qb ? c->T - t0 : c->qb, rows = c->group * nt;
        const int64_t first = c->S - c->T + t0 + 1, base = kv * c->max_len * hd; /* row (tok, hh) sees first + tok keys */
        for (int64_t tok = 0; tok < nt; tok++) /* rows tok * group + hh: (rows, hd) */
            memcpy(qs + tok * c->group * hd, c->q + ((t0 + tok) * c->H + h0) * hd, (size_t)(c->group * hd) * 4);
        memset(acc, 0, (size_t)(rows * hd) * 4);
        for (int64_t s0 = 0; s0 < first + nt - 1; s0 += KV_BLOCK) {
            const int64_t m = first + nt - 1 - s0 < KV_BLOCK ? first + nt - 1 - s0 : KV_BLOCK;
            const uint8_t *K = (const uint8_t *)c->kc + (base + s0 * hd) * esz, *V = (const uint8_t *)c->vc + (base + s0 * hd) * esz;
            if (c->f16) kq_f16_tiles((const uint16_t *)K, m, hd, qs, rows, sc, KV_BLOCK); /* sc[r][s] = q_r . k_s */
            else kq_f32_tiles((const float *)K, m, hd, qs, rows, sc, KV_BLOCK);
            for (int64_t r = 0; r < rows; r++) {
                int64_t n = first + r / c->group - s0; /* this row's keys in the block */
                float *p = sc + r * KV_BLOCK, *o = acc + r * hd;
                n = n < 0 ? 0 : n < m ? n : m;
                if (n > 0) {
                    /* the scale applied in the exp pass; max(p) * scale == max(p * scale) (rounding is monotonic) */
                    const float bm = kq_max(p, n) * scale, top = s0 == 0 || bm > mx[r] ? bm : mx[r];
                    const float bs = kq_exp_sum_scaled(p, n, scale, top);
                    if (s0 == 0) {
                        sum[r] = bs;
                    } else { /* rescale what the earlier blocks gave to the new running max (by 1 if it held) */
                        const float f = kq_expf(mx[r] - top);
                        sum[r] = sum[r] * f + bs;
                        if (f != 1.0f)
                            for (int64_t i = 0; i < hd; i++) o[i] *= f;
                    }
                    mx[r] = top;
                }
                for (int64_t s = n; s < m; s++) p[s] = 0.0f; /* keys past the row's causal limit add exact zeros */
            }
            kq_pv_tiles(c->f16, sc, KV_BLOCK, rows, V, m, hd, acc, hd); /* acc[r] += p_r @ V */
        }
        for (int64_t r = 0; r < rows; r++) {
            const float inv = 1.0f / sum[r], *o = acc + r * hd;
            float *dst = c->out + ((t0 + r / c->group) * c->H + h0 + r % c->group) * hd;
            for (int64_t i = 0; i < hd; i++) dst[i] = o[i] * inv;
        }
    }
}

int kq_attention(const float *q, const void *kc, const void *vc, int64_t max_len, int64_t T, int64_t S,
                 int64_t H, int64_t KV, int64_t hd, int kv_f16, float *out) {
    if (T <= 0 || S < T || S > max_len || KV <= 0 || H < KV || H % KV || hd <= 0) return -1;
    const int64_t rep = H / KV, nth = kq_get_threads();
    int64_t group = rep, qb = ATT_ROWS / rep < 1 ? 1 : ATT_ROWS / rep;
    qb = qb < T ? qb : T;
    /* the head group split into equal parts (decode: fewer tasks than threads) only where that finishes sooner:
     * each part reads and widens every key and value block once more, about ATT_WIDEN query rows' work, and the
     * call takes ceil(tasks / threads) rounds of equal tasks; the largest group of the least rounds x
     * (ATT_WIDEN + group). So a group of 8 on 1-2 KV heads is split over 4 threads, but SmolLM2's 3 heads on 3 KV
     * heads stay whole on 4 threads (9 tasks of 1 would take 3 rounds of widening). */
    int64_t cost = -1;
    for (int64_t g = rep; g >= 1; g--) {
        const int64_t tasks = KV * (rep / g) * ((T + qb - 1) / qb), c = (tasks + nth - 1) / nth * (ATT_WIDEN + g);
        if (rep % g == 0 && (cost < 0 || c < cost)) { cost = c; group = g; }
    }
    attn_ctx c = {q, kc, vc, out, max_len, T, S, H, KV, hd, group, qb, rep / group, (T + qb - 1) / qb,
                  kv_f16 != 0, 0};
    kq_parallel_for(KV * c.ngroups * c.nqb, 1, attn_task, &c);
    return atomic_load(&c.err) ? -2 : 0;
}

/* ---- the decoder layers ---- */

static int linear(const kq_linear *L, const float *x, int64_t T, float *out) {
    return kq_matmul(L->qtype, L->w, L->rows, L->n, x, T, out);
}

/* bytes of `rows` rows of n values of qtype, in the x8 layout when qtype has KQ_X8 (repack.c); 0 when not served */
static int64_t weight_bytes(int qtype, int64_t rows, int64_t n) {
    const int q = qtype & ~KQ_X8;
    const int64_t rb = (int64_t)kq_row_bytes(q, n);
    if (!(qtype & KQ_X8)) return rows * rb;
    if (!kq_x8_block_bytes(q)) return 0;
    return (rows + 7) / 8 * (rb / (int64_t)kq_row_bytes(q, kq_x8_block_elems(q))) * kq_x8_block_bytes(q);
}

/* the linear is (rows, n) and its weight holds exactly that many bytes of its type */
static int linear_ok(const kq_linear *L, int64_t rows, int64_t n) {
    return L->w && L->rows == rows && L->n == n && L->nbytes > 0 && L->nbytes == weight_bytes(L->qtype, rows, n);
}

static int layers_ok(const kq_model *m) {
    const int64_t D = m->hidden, qd = m->n_heads * m->head_dim, kd = m->n_kv * m->head_dim, I = m->inter;
    if (m->n_layers < 0 || (m->n_layers && !m->layers)) return 0;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kq_layer *L = m->layers + l;
        if (!L->attn_norm || !L->mlp_norm || !linear_ok(&L->q, qd, D) || !linear_ok(&L->k, kd, D) ||
            !linear_ok(&L->v, kd, D) || !linear_ok(&L->o, D, qd))
            return 0;
        if (L->moe ? L->moe->hidden != D
                   : !linear_ok(&L->gate, I, D) || !linear_ok(&L->up, I, D) || !linear_ok(&L->down, D, I))
            return 0;
    }
    return 1;
}

/* a failing status returns at once: the layers after it (and the rest of this one) never run on bad values */
#define TRY(call) do { int rc_ = (call); if (rc_) return rc_; } while (0)

int kq_forward(const kq_model *m, void *const *k_cache, void *const *v_cache, int64_t max_len, int kv_f16,
               float *h, int64_t T, int64_t pos, const float *cos, const float *sin) {
    const int64_t D = m->hidden, H = m->n_heads, KV = m->n_kv, hd = m->head_dim, I = m->inter;
    if (pos + T > max_len) return -3;
    if (T <= 0 || pos < 0 || D <= 0 || hd <= 0 || hd % 2 || KV <= 0 || H < KV || H % KV || !layers_ok(m)) return -1;
    const int64_t qd = H * hd, kd = KV * hd;
    size_t need = (size_t)T * (size_t)(2 * D + 2 * qd + 2 * kd + 2 * I) * 4;
    float *base = kq_scratch(1, need);
    if (!base) return -2;
    float *xn = base, *o = xn + T * D, *q = o + T * D, *att = q + T * qd, *k = att + T * qd, *v = k + T * kd;
    float *g = v + T * kd, *u = g + T * I;
    for (int64_t l = 0; l < m->n_layers; l++) {
        const kq_layer *L = m->layers + l;
        kq_rms_norm(h, L->attn_norm, T, D, m->eps, xn);
        TRY(linear(&L->q, xn, T, q));
        TRY(linear(&L->k, xn, T, k));
        TRY(linear(&L->v, xn, T, v));
        if (L->q_bias)
            for (int64_t t = 0; t < T; t++) {
                for (int64_t i = 0; i < qd; i++) q[t * qd + i] += L->q_bias[i];
                for (int64_t i = 0; i < kd; i++) { k[t * kd + i] += L->k_bias[i]; v[t * kd + i] += L->v_bias[i]; }
            }
        if (L->q_norm) {
            kq_rms_norm(q, L->q_norm, T * H, hd, m->eps, q);
            kq_rms_norm(k, L->k_norm, T * KV, hd, m->eps, k);
        }
        kq_rope(q, T, H, hd, cos, sin);
        kq_rope(k, T, KV, hd, cos, sin);
        void *kc = k_cache[l], *vc = v_cache[l];
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < KV; j++) {
                kv_store(kc, kv_f16, (j * max_len + pos + t) * hd, k + (t * KV + j) * hd, hd);
                kv_store(vc, kv_f16, (j * max_len + pos + t) * hd, v + (t * KV + j) * hd, hd);
            }
        TRY(kq_attention(q, kc, vc, max_len, T, pos + T, H, KV, hd, kv_f16, att));
        TRY(linear(&L->o, att, T, o));
        for (int64_t i = 0; i < T * D; i++) h[i] += o[i];
        kq_rms_norm(h, L->mlp_norm, T, D, m->eps, xn);
        if (L->moe) {
            TRY(kq_moe_ffn(L->moe, xn, T, o));
        } else {
            TRY(linear(&L->gate, xn, T, g));
            TRY(linear(&L->up, xn, T, u));
            kq_swiglu(g, u, T * I, g);
            TRY(linear(&L->down, g, T, o));
        }
        for (int64_t i = 0; i < T * D; i++) h[i] += o[i];
    }
    return 0;
}
#undef TRY
