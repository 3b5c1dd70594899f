/* The gated delta rule of Qwen3.5's linear-attention layers (twins: native/delta_numpy.py, same names and
 * arguments). Per value head h, with state S (dk, dv), decay a = exp(g), learning rate beta:
 *   S = a S;  d = beta (v - S^T k);  S += k d^T;  o = S^T q.
 * kq_gated_delta_step runs that token by token (decode); kq_gated_delta_chunked regroups it per chunk of C tokens:
 * one unit-lower-triangular (C x C) solve per head gives the chunk's corrections D, then one state update.
 * q, k (T, nh, dk); v, out (T, nh, dv); g, beta (T, nh); state (nh, dk, dv) updated in place. Float32 throughout;
 * sums run in a different order than numpy's, so tests compare with a tolerance. Returns 0; -2 when the scratch
 * cannot be allocated (before anything is written), -1 for a chunk size below 1.
 * Policy (SIMD): generic C on every architecture (no x86 specialisation to mirror); its inner loops run along dv
 * over contiguous state rows, which -O3 vectorises on aarch64's baseline NEON as on x86 (aarch64 objdump of
 * delta.o: fmul/fadd v.4s in both entry points). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kq_internal.h"

static void step_head(const float *q, const float *k, const float *v, float g, float beta, int64_t dk, int64_t dv,
                      float *S, float *d, float *o) {
    float a = expf(g);
    for (int64_t j = 0; j < dv; j++) d[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        for (int64_t j = 0; j < dv; j++) { row[j] *= a; d[j] += row[j] * k[i]; }
    }
    for (int64_t j = 0; j < dv; j++) { d[j] = (v[j] - d[j]) * beta; o[j] = 0.0f; }
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        for (int64_t j = 0; j < dv; j++) { row[j] += k[i] * d[j]; o[j] += row[j] * q[i]; }
    }
}

int kq_gated_delta_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                        int64_t T, int64_t nh, int64_t dk, int64_t dv, float *state, float *out) {
    float *d = malloc(sizeof(float) * (size_t)(dv > 0 ? dv : 1));
    if (!d) return -2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nh; h++)
            step_head(q + (t * nh + h) * dk, k + (t * nh + h) * dk, v + (t * nh + h) * dv, g[t * nh + h],
                      beta[t * nh + h], dk, dv, state + h * dk * dv, d, out + (t * nh + h) * dv);
    free(d);
    return 0;
}

static float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* one chunk of C tokens starting at t0 for head h; scratch: G (C), L (C*C), D (C*dv) */
static void chunk_head(const float *q, const float *k, const float *v, const float *g, const float *beta,
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

int kq_gated_delta_chunked(const float *q, const float *k, const float *v, const float *g, const float *beta,
                           int64_t T, int64_t nh, int64_t dk, int64_t dv, float *state, int64_t chunk, float *out) {
    if (chunk < 1) return -1;
    int64_t C = chunk < T ? chunk : T;
    if (C < 1) return 0;
    float *G = malloc(sizeof(float) * (size_t)(C + C * C + C * (dv > 0 ? dv : 1)));
    if (!G) return -2;
    float *L = G + C, *D = L + C * C;
    for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        int64_t n = T - t0 < chunk ? T - t0 : chunk;
        for (int64_t h = 0; h < nh; h++)
            chunk_head(q, k, v, g, beta, t0, n, h, nh, dk, dv, state + h * dk * dv, G, L, D, out);
    }
    free(G);
    return 0;
}

/* SiLU's exp: kq_expf on aarch64, where its rounding is one NEON instruction (frintx) and the loop vectorises, as
 * kq_swiglu's; libm's expf elsewhere (x86-64's baseline has no vector rounding: kq_expf calls rintf per value,
 * measured 3x slower there than expf) */
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
