/* The gated delta rule of Qwen3.5's linear-attention layers (twins: native/delta_numpy.py, same names and
 * arguments). Per value head h, with state S (dk, dv), decay a = exp(g), learning rate beta:
 *   S = a S;  d = beta (v - S^T k);  S += k d^T;  o = S^T q.
 * kq_gated_delta_step runs that token by token (decode); kq_gated_delta_chunked regroups it per chunk of C tokens:
 * one unit-lower-triangular (C x C) solve per head gives the chunk's corrections D, then one state update.
 * q, k (T, nh, dk); v, out (T, nh, dv); g, beta (T, nh); state (nh, dk, dv) updated in place. Float32 throughout;
 * sums run in a different order than numpy's, so tests compare with a tolerance. Returns 0; -2 when the chunked
 * form's scratch cannot be allocated (before anything is written), -1 for a chunk size below 1.
 * Policy (SIMD): generic C on every architecture, cloned for AVX2 / AVX-512 on x86_64 (KQ_CLONES); its inner loops
 * run along dv over contiguous state rows, which -O3 vectorises on aarch64's baseline NEON as on x86.
 * Policy (threads): both forms split the heads (the token loop: heads x column blocks) over the pool. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kq_internal.h"

/* dot product in 8 lane sums combined in a fixed order: vectorises without reassociation (-ffp-contract=off, no
 * fast-math), and every caller gets the same rounding whatever T or the thread split */
static inline float dot(const float *a, const float *b, int64_t n) {
    float s[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += a[i + l] * b[i + l];
    float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* The token loop, by column blocks. Column j of S evolves on its own given k, q, g, beta and v_j:
 *   d_j = beta (v_j - a (S^T k)_j),  S[:, j] = a S[:, j] + k d_j,  o_j = a (S^T q)_j + (k.q) d_j,
 * so a task owns DELTA_W columns of one head and runs every token over that (dk, W) block, copied into a
 * contiguous stack block (16 KB at dk 128: L1-resident, where rows at the state's stride would fight over a few
 * cache sets). Per token: one read pass (S^T k and S^T q together) and one write pass. Tasks are (head, block)
 * pairs over the pool; a token's arithmetic is the same whatever T and the thread split (decode == prefill). */
#define DELTA_W 32
#define DELTA_LOCAL 8192 /* floats of the stack block: dk <= 256 at W 32; larger dk runs on the state in place */

struct step_ctx {
    const float *q, *k, *v, *g, *beta;
    int64_t T, nh, dk, dv, nblk;
    float *state, *out;
};

/* the block's width in four 8-float vectors (GCC vector extensions: generic C that keeps the 8 accumulators in
 * registers; -O3 on plain arrays kept them on the stack, a store-to-load chain per key row) */
typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));
#define LD8(p) (*(const v8f_u *)(p))
#define ST8(p, x) (*(v8f_u *)(p) = (x))

static inline void step_block32(const struct step_ctx *c, int64_t h, int64_t j0, float *S, int64_t ld) {
    int64_t nh = c->nh, dk = c->dk, dv = c->dv;
    for (int64_t t = 0; t < c->T; t++) {
        const float *qt = c->q + (t * nh + h) * dk, *kt = c->k + (t * nh + h) * dk, *vt = c->v + (t * nh + h) * dv + j0;
        float *o = c->out + (t * nh + h) * dv + j0;
        float a = expf(c->g[t * nh + h]), b = c->beta[t * nh + h], kq = dot(kt, qt, dk);
        v8f k0 = {0}, k1 = {0}, k2 = {0}, k3 = {0}, q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
        for (int64_t i = 0; i < dk; i++) {  /* S^T k, S^T q over the block */
            const float *row = S + i * ld;
            v8f r0 = LD8(row), r1 = LD8(row + 8), r2 = LD8(row + 16), r3 = LD8(row + 24);
            float ki = kt[i], qi = qt[i];
            k0 += r0 * ki; k1 += r1 * ki; k2 += r2 * ki; k3 += r3 * ki;
            q0 += r0 * qi; q1 += r1 * qi; q2 += r2 * qi; q3 += r3 * qi;
        }
        v8f d0 = b * (LD8(vt) - a * k0), d1 = b * (LD8(vt + 8) - a * k1), d2 = b * (LD8(vt + 16) - a * k2),
            d3 = b * (LD8(vt + 24) - a * k3);
        ST8(o, a * q0 + kq * d0); ST8(o + 8, a * q1 + kq * d1); ST8(o + 16, a * q2 + kq * d2);
        ST8(o + 24, a * q3 + kq * d3);
        for (int64_t i = 0; i < dk; i++) {  /* S = a S + k d^T */
            float *row = S + i * ld, ki = kt[i];
            ST8(row, a * LD8(row) + ki * d0); ST8(row + 8, a * LD8(row + 8) + ki * d1);
            ST8(row + 16, a * LD8(row + 16) + ki * d2); ST8(row + 24, a * LD8(row + 24) + ki * d3);
        }
    }
}

/* the same arithmetic for a narrower last block (dv not a multiple of DELTA_W), lane by lane */
static inline void step_block(const struct step_ctx *c, int64_t h, int64_t j0, int64_t W, float *S, int64_t ld) {
    int64_t nh = c->nh, dk = c->dk, dv = c->dv;
    for (int64_t t = 0; t < c->T; t++) {
        const float *qt = c->q + (t * nh + h) * dk, *kt = c->k + (t * nh + h) * dk, *vt = c->v + (t * nh + h) * dv + j0;
        float *o = c->out + (t * nh + h) * dv + j0;
        float a = expf(c->g[t * nh + h]), b = c->beta[t * nh + h], kq = dot(kt, qt, dk);
        float sk[DELTA_W], sq[DELTA_W], d[DELTA_W];
        for (int64_t l = 0; l < W; l++) sk[l] = sq[l] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            const float *row = S + i * ld;
            float ki = kt[i], qi = qt[i];
            for (int64_t l = 0; l < W; l++) { sk[l] += row[l] * ki; sq[l] += row[l] * qi; }
        }
        for (int64_t l = 0; l < W; l++) {
            d[l] = b * (vt[l] - a * sk[l]);
            o[l] = a * sq[l] + kq * d[l];
        }
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * ld;
            float ki = kt[i];
            for (int64_t l = 0; l < W; l++) row[l] = a * row[l] + ki * d[l];
        }
    }
}

KQ_CLONES static void step_task(void *c_, int64_t u0, int64_t u1) {
    const struct step_ctx *c = c_;
    float blk[DELTA_LOCAL];
    const int local = c->dk * DELTA_W <= DELTA_LOCAL; /* else a key width past the stack block: the state in place */
    for (int64_t u = u0; u < u1; u++) {
        int64_t h = u / c->nblk, j0 = (u % c->nblk) * DELTA_W, W = c->dv - j0 < DELTA_W ? c->dv - j0 : DELTA_W;
        float *S = c->state + h * c->dk * c->dv + j0, *B = local ? blk : S;
        int64_t ld = local ? W : c->dv;
        if (local)
            for (int64_t i = 0; i < c->dk; i++) memcpy(blk + i * W, S + i * c->dv, sizeof(float) * (size_t)W);
        if (W == DELTA_W) step_block32(c, h, j0, B, ld);
        else step_block(c, h, j0, W, B, ld);
        if (local)
            for (int64_t i = 0; i < c->dk; i++) memcpy(S + i * c->dv, blk + i * W, sizeof(float) * (size_t)W);
    }
}

int kq_gated_delta_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                        int64_t T, int64_t nh, int64_t dk, int64_t dv, float *state, float *out) {
    if (T <= 0 || nh <= 0 || dv <= 0) return 0;
    int64_t nblk = (dv + DELTA_W - 1) / DELTA_W, units = nh * nblk;
    struct step_ctx c = {q, k, v, g, beta, T, nh, dk, dv, nblk, state, out};
    kq_parallel_for(units, kq_chunk_for(units), step_task, &c);
    return 0;
}

/* one chunk of C tokens starting at t0 for head h; scratch: G (C), L (C*C), D (C*dv) */
static inline void chunk_head(const float *q, const float *k, const float *v, const float *g, const float *beta,
                       int64_t t0, int64_t C, int64_t h, int64_t nh, int64_t dk, int64_t dv, float *S,
                       float *G, float *L, float *D, float *out) {
#define Q(t) (q + ((t0 + (t)) * nh + h) * dk)
#define K(t) (k + ((t0 + (t)) * nh + h) * dk)
#define V(t) (v + ((t0 + (t)) * nh + h) * dv)
#define B(t) (beta[(t0 + (t)) * nh + h])
    float acc = 0.0f;
    for (int64_t t = 0; t < C; t++) { acc += g[(t0 + t) * nh + h]; G[t] = acc; }
    for (int64_t i = 0; i < C; i++)  /* L_ij = beta_i exp(G_i - G_j) k_i.k_j, j < i */
        for (int64_t j = 0; j < i; j++) L[i * C + j] = B(i) * expf(G[i] - G[j]) * dot(K(i), K(j), dk);
    for (int64_t i = 0; i < C; i++) {  /* rhs_i = beta_i (v_i - exp(G_i) S^T k_i); then forward substitution */
        float *Di = D + i * dv, e = expf(G[i]);
        const float *ki = K(i), *vi = V(i);
        for (int64_t j = 0; j < dv; j++) Di[j] = 0.0f;
        for (int64_t a = 0; a < dk; a++) {
            const float *row = S + a * dv;
            for (int64_t j = 0; j < dv; j++) Di[j] += row[j] * ki[a];
        }
        for (int64_t j = 0; j < dv; j++) Di[j] = B(i) * (vi[j] - e * Di[j]);
        for (int64_t m = 0; m < i; m++) {
            float l = L[i * C + m];
            const float *Dm = D + m * dv;
            for (int64_t j = 0; j < dv; j++) Di[j] -= l * Dm[j];
        }
    }
    for (int64_t i = 0; i < C; i++) {  /* o_i = exp(G_i) S^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) D_j */
        float *o = out + ((t0 + i) * nh + h) * dv, e = expf(G[i]);
        const float *qi = Q(i);
        for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
        for (int64_t a = 0; a < dk; a++) {
            const float *row = S + a * dv;
            for (int64_t j = 0; j < dv; j++) o[j] += row[j] * qi[a];
        }
        for (int64_t j = 0; j < dv; j++) o[j] *= e;
        for (int64_t m = 0; m <= i; m++) {
            float w = expf(G[i] - G[m]) * dot(qi, K(m), dk);
            const float *Dm = D + m * dv;
            for (int64_t j = 0; j < dv; j++) o[j] += w * Dm[j];
        }
    }
    float last = G[C - 1], decay = expf(last);  /* S = exp(G_last) S + sum_m exp(G_last - G_m) k_m D_m^T */
    for (int64_t a = 0; a < dk; a++) {
        float *row = S + a * dv;
        for (int64_t j = 0; j < dv; j++) row[j] *= decay;
        for (int64_t m = 0; m < C; m++) {
            float w = expf(last - G[m]) * K(m)[a];
            const float *Dm = D + m * dv;
            for (int64_t j = 0; j < dv; j++) row[j] += w * Dm[j];
        }
    }
#undef Q
#undef K
#undef V
#undef B
}

struct chunk_ctx {
    const float *q, *k, *v, *g, *beta;
    int64_t T, nh, dk, dv, chunk, C, per; /* per: scratch floats of one head, G (C), L (C*C), D (C*dv) */
    float *state, *scratch, *out;
};

KQ_CLONES static void chunk_task(void *c_, int64_t h0, int64_t h1) {  /* heads h0..h1-1, every chunk in order */
    const struct chunk_ctx *c = c_;
    int64_t C = c->C;
    for (int64_t h = h0; h < h1; h++) {
        float *G = c->scratch + h * c->per, *L = G + C, *D = L + C * C;
        for (int64_t t0 = 0; t0 < c->T; t0 += c->chunk) {
            int64_t n = c->T - t0 < c->chunk ? c->T - t0 : c->chunk;
            chunk_head(c->q, c->k, c->v, c->g, c->beta, t0, n, h, c->nh, c->dk, c->dv, c->state + h * c->dk * c->dv,
                       G, L, D, c->out);
        }
    }
}

int kq_gated_delta_chunked(const float *q, const float *k, const float *v, const float *g, const float *beta,
                           int64_t T, int64_t nh, int64_t dk, int64_t dv, float *state, int64_t chunk, float *out) {
    if (chunk < 1) return -1;
    int64_t C = chunk < T ? chunk : T;
    if (C < 1 || nh < 1) return 0;
    int64_t per = C + C * C + C * (dv > 0 ? dv : 1);
    float *scratch = malloc(sizeof(float) * (size_t)(nh * per));
    if (!scratch) return -2;
    struct chunk_ctx c = {q, k, v, g, beta, T, nh, dk, dv, chunk, C, per, state, scratch, out};
    kq_parallel_for(nh, 1, chunk_task, &c);
    free(scratch);
    return 0;
}

/* SiLU's exp: kq_expf on aarch64, where the loop vectorises, as kq_swiglu's; libm's expf elsewhere (measured 3x
 * faster on x86-64 when kq_expf still called rintf per value; it now rounds with an add and vectorises there too,
 * not measured against expf since, and kept so the x86 numbers of the Qwen3.5 tests stay as they were) */
#if defined(__aarch64__)
#define CONV_EXP kq_expf
#else
#define CONV_EXP expf
#endif

static void conv_state(const float *x, float *state, int64_t T, int64_t C, int64_t K) {
    int64_t km1 = K - 1;
    for (int64_t r = 0; r < km1; r++) {  /* the new state: xp rows T..T+K-2 (sources past r: not yet overwritten) */
        const float *src = T + r < km1 ? state + (T + r) * C : x + (T + r - km1) * C;
        memmove(state + r * C, src, sizeof(float) * (size_t)C);
    }
}

int kq_causal_conv1d(const float *x, float *state, const float *w, int64_t T, int64_t C, int64_t K, float *out) {
    if (T < 0 || C < 0 || K < 1) return -1;
    if (T == 0 || C == 0) return 0;
    if (K == 4) {  /* Qwen3.5's width: the taps read in place (stride 4: ld4 on NEON), no transposition */
        for (int64_t t = 0; t < T; t++) {
            const float *r[4];
            for (int64_t j = 0; j < 4; j++) r[j] = t + j < 3 ? state + (t + j) * C : x + (t + j - 3) * C;
            const float *r0 = r[0], *r1 = r[1], *r2 = r[2], *r3 = r[3];
            float *o = out + t * C;
            for (int64_t c = 0; c < C; c++) {
                float v = r0[c] * w[4 * c] + r1[c] * w[4 * c + 1] + r2[c] * w[4 * c + 2] + r3[c] * w[4 * c + 3];
                o[c] = v / (1.0f + CONV_EXP(-v));
            }
        }
        conv_state(x, state, T, C, K);
        return 0;
    }
    float local[4096], *wt = local;  /* a block of B channels' taps, (K, B): tap j of every channel contiguous */
    int64_t B = (int64_t)(sizeof local / sizeof *local) / K, km1 = K - 1;
    if (B < 1) {  /* a kernel wider than the stack block: one channel at a time from the heap */
        if (!(wt = malloc(sizeof(float) * (size_t)K))) return -2;
        B = 1;
    }
    for (int64_t c0 = 0; c0 < C; c0 += B) {
        int64_t nb = C - c0 < B ? C - c0 : B;
        for (int64_t c = 0; c < nb; c++)
            for (int64_t j = 0; j < K; j++) wt[j * nb + c] = w[(c0 + c) * K + j];
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * C + c0;
            for (int64_t j = 0; j < K; j++) {  /* xp row t + j: a carried input, or a new one */
                const float *row = (t + j < km1 ? state + (t + j) * C : x + (t + j - km1) * C) + c0, *wj = wt + j * nb;
                if (j == 0)
                    for (int64_t c = 0; c < nb; c++) o[c] = row[c] * wj[c];
                else
                    for (int64_t c = 0; c < nb; c++) o[c] += row[c] * wj[c];
            }
            for (int64_t c = 0; c < nb; c++) o[c] = o[c] / (1.0f + CONV_EXP(-o[c]));
        }
    }
    conv_state(x, state, T, C, K);
    if (wt != local) free(wt);
    return 0;
}
