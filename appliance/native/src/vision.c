/* Vision-tower operations (Qwen3-VL): LayerNorm, tanh GELU and bidirectional multi-head self-attention over
 * one image's patches with its 2D rotary embedding. Twins: appliance/engine/vision.py (layer_norm, gelu_tanh,
 * self_attention, the numpy path of the tower), compared with a float tolerance (sums run in another order).
 *
 * Policy: attention runs in blocks of QB queries of one head per pool task, so the score block (QB x N,
 * f32) stays in L2 whatever the image size and both products are the multi-token float tiles of matmul.c
 * (scores = K q, out = V^T p, f32 accumulation); the softmax is in f32 with kq_expf.
 * Policy (SIMD): those products are NEON on aarch64 (matmul_float.inc); LayerNorm, GELU and the softmax are generic
 * C, cloned for AVX2/AVX-512 on x86_64 (KQ_CLONES) and built once on aarch64, whose baseline is NEON at full
 * width: gcc -O3 vectorises them there (objdump of the aarch64 vision.o: ln_task's mean/variance/scale passes
 * fadd/fsub/fmul v.4s; gelu_range 146 of 548 instructions vector, tanh through the kq_expf polynomial in v.4s;
 * sa_task 151 of 947), the instructions a hand-written NEON copy would use; tests/system/test_native_qemu_aarch64.py
 * checks they stay vectorised. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kq_internal.h"

#define QB 48 /* queries per attention task: a multiple of every float tile's column count (2, 3, 6) */

/* ---- LayerNorm over rows: (x - mean) / sqrt(var + eps) * w + b ---- */
typedef struct { const float *x, *w, *b; float *out; int64_t n; float eps; } ln_ctx;

KQ_CLONES static void ln_task(void *c_, int64_t a, int64_t z) {
    const ln_ctx *c = c_;
    const int64_t n = c->n;
    for (int64_t t = a; t < z; t++) {
        const float *v = c->x + t * n;
        float acc[8] = {0};
        int64_t k = 0;
        for (; k + 8 <= n; k += 8)
            for (int j = 0; j < 8; j++) acc[j] += v[k + j];
        double s = 0.0;
        for (; k < n; k++) s += v[k];
        for (int j = 0; j < 8; j++) s += acc[j];
        const float mu = (float)(s / (double)n);
        float acc2[8] = {0};
        for (k = 0; k + 8 <= n; k += 8)
            for (int j = 0; j < 8; j++) acc2[j] += (v[k + j] - mu) * (v[k + j] - mu);
        double ss = 0.0;
        for (; k < n; k++) ss += (double)(v[k] - mu) * (v[k] - mu);
        for (int j = 0; j < 8; j++) ss += acc2[j];
        const float inv = (float)(1.0 / sqrt(ss / (double)n + (double)c->eps));
        float *o = c->out + t * n;
        for (k = 0; k < n; k++) o[k] = (v[k] - mu) * inv * c->w[k] + c->b[k];
    }
}

void kq_layer_norm(const float *x, const float *w, const float *b, int64_t T, int64_t n, float eps, float *out) {
    ln_ctx c = {x, w, b, out, n, eps};
    if (T * n < 65536) ln_task(&c, 0, T);
    else kq_parallel_for(T, kq_chunk_for(T), ln_task, &c);
}

/* ---- GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) ---- */
typedef struct { const float *x; float *out; } gelu_ctx;

KQ_CLONES static void gelu_range(const float *x, float *out, int64_t a, int64_t z) { /* elements a .. z-1 */
    for (int64_t i = a; i < z; i++) {
        float u = 0.7978845608028654f * (x[i] + 0.044715f * x[i] * x[i] * x[i]);
        float th = 1.0f - 2.0f / (1.0f + kq_expf(2.0f * u)); /* tanh(u); kq_expf clamps, so +-1 at the ends */
        out[i] = 0.5f * x[i] * (1.0f + th);
    }
}

static void gelu_task(void *c_, int64_t a, int64_t z) { /* elements 1024 a .. 1024 z - 1 */
    const gelu_ctx *c = c_;
    gelu_range(c->x, c->out, a * 1024, z * 1024);
}

void kq_gelu_tanh(const float *x, int64_t n, float *out) {
    gelu_ctx c = {x, out};
    int64_t whole = n / 1024;
    if (n < 65536) {
        gelu_range(x, out, 0, n);
        return;
    }
    kq_parallel_for(whole, kq_chunk_for(whole), gelu_task, &c);
    gelu_range(x, out, whole * 1024, n); /* the tail */
}

/* ---- self-attention over one image: qkv (N, 3, H, hd) -> out (N, H * hd) ---- */
typedef struct {
    const float *qkv, *cos, *sin;
    float *q, *k, *vt, *out; /* q, k: (H, N, hd) after RoPE (q scaled); vt: (H, hd, N) */
    int64_t N, H, hd;
    float scale;
    _Atomic int err; /* set by any task whose scratch allocation failed */
} sa_ctx;

static void sa_prep(void *c_, int64_t a, int64_t z) { /* patches a .. z-1 */
    sa_ctx *c = c_;
    const int64_t N = c->N, H = c->H, hd = c->hd, half = hd / 2;
    for (int64_t t = a; t < z; t++) {
        const float *cs = c->cos + t * half, *sn = c->sin + t * half;
        for (int64_t h = 0; h < H; h++) {
            const float *q = c->qkv + (t * 3 * H + h) * hd, *k = q + H * hd, *v = k + H * hd;
            float *qo = c->q + (h * N + t) * hd, *ko = c->k + (h * N + t) * hd;
            for (int64_t i = 0; i < half; i++) {
                qo[i] = (q[i] * cs[i] - q[i + half] * sn[i]) * c->scale;
                qo[i + half] = (q[i + half] * cs[i] + q[i] * sn[i]) * c->scale;
                ko[i] = k[i] * cs[i] - k[i + half] * sn[i];
                ko[i + half] = k[i + half] * cs[i] + k[i] * sn[i];
            }
            for (int64_t i = 0; i < hd; i++) c->vt[(h * hd + i) * N + t] = v[i];
        }
    }
}

KQ_CLONES static void softmax_rows(float *s, int64_t rows, int64_t n, float *sums) {
    for (int64_t t = 0; t < rows; t++) sums[t] = kq_exp_sum(s + t * n, n, kq_max(s + t * n, n));
}

static void sa_task(void *c_, int64_t a, int64_t z) { /* (head, query block) pairs a .. z-1 */
    sa_ctx *c = c_;
    const int64_t N = c->N, hd = c->hd, D = c->H * hd, nblk = (N + QB - 1) / QB;
    float *S = kq_scratch(3, (size_t)(QB * N + QB) * sizeof(float));
    if (!S) { c->err = 1; return; }
    float *sums = S + QB * N;
    for (int64_t j = a; j < z; j++) {
        const int64_t h = j / nblk, s0 = (j % nblk) * QB, qb = N - s0 < QB ? N - s0 : QB;
        kq_f32_tiles(c->k + h * N * hd, N, hd, c->q + (h * N + s0) * hd, qb, S, N); /* S[t][r] = q_t . k_r */
        softmax_rows(S, qb, N, sums);
        float *o = c->out + s0 * D + h * hd;
        kq_f32_tiles(c->vt + h * hd * N, hd, N, S, qb, o, D); /* o[t][i] = p_t . v^T_i */
        for (int64_t t = 0; t < qb; t++)
            for (int64_t i = 0; i < hd; i++) o[t * D + i] /= sums[t];
    }
}

int kq_self_attention(const float *qkv, int64_t N, int64_t H, int64_t hd, const float *cos, const float *sin,
                      float *out) {
    if (N <= 0 || H <= 0 || hd <= 0 || hd % 2) return -1;
    float *buf = malloc((size_t)(3 * N * H * hd) * sizeof(float));
    if (!buf) return -2;
    sa_ctx c = {qkv, cos, sin, buf, buf + N * H * hd, buf + 2 * N * H * hd, out, N, H, hd,
                (float)(1.0 / sqrt((double)hd)), 0};
    kq_parallel_for(N, kq_chunk_for(N), sa_prep, &c);
    int64_t tasks = H * ((N + QB - 1) / QB);
    kq_parallel_for(tasks, 1, sa_task, &c);
    free(buf);
    return c.err ? -2 : 0;
}
