/* Scalar reference tile kernels of every weight type (the KQ_SCALAR level): they define the arithmetic that the
 * SIMD kernels (matmul_x86*.inc, matmul_neon*.inc) and the numpy twins (twins.py) reproduce bit for bit. */
#include <string.h>
#include "kq.h"

#define ROW(T_, r) ((const T_ *)(w + (size_t)(r0 + (r)) * rb))

static void q8_0_scalar(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act_,
                        int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const kq_act32 *act = act_;
    for (int r = 0; r < nr; r++) {
        const blk_q8_0 *W = ROW(blk_q8_0, r);
        for (int64_t t = t0; t < t1; t++) {
            const kq_act32 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t s = 0;
                for (int k = 0; k < 32; k++) s += (int32_t)W[b].qs[k] * A[b].q[k];
                float dd = kq_fp16_to_fp32(kq_ld16(&W[b].d)) * A[b].d;
                acc = acc + dd * (float)s;
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}

static void q4_0_scalar(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act_,
                        int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const kq_act32 *act = act_;
    for (int r = 0; r < nr; r++) {
        const blk_q4_0 *W = ROW(blk_q4_0, r);
        for (int64_t t = t0; t < t1; t++) {
            const kq_act32 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t s = 0;
                for (int k = 0; k < 16; k++)
                    s += (int32_t)(W[b].qs[k] & 0xF) * A[b].q[k] + (int32_t)(W[b].qs[k] >> 4) * A[b].q[k + 16];
                s -= 8 * A[b].sum;
                float dd = kq_fp16_to_fp32(kq_ld16(&W[b].d)) * A[b].d;
                acc = acc + dd * (float)s;
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}

static void q4_1_scalar(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act_,
                        int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const kq_act32 *act = act_;
    for (int r = 0; r < nr; r++) {
        const blk_q4_1 *W = ROW(blk_q4_1, r);
        for (int64_t t = t0; t < t1; t++) {
            const kq_act32 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t s = 0;
                for (int k = 0; k < 16; k++)
                    s += (int32_t)(W[b].qs[k] & 0xF) * A[b].q[k] + (int32_t)(W[b].qs[k] >> 4) * A[b].q[k + 16];
                float dd = kq_fp16_to_fp32(kq_ld16(&W[b].d)) * A[b].d;
                float ms = kq_fp16_to_fp32(kq_ld16(&W[b].m)) * (A[b].d * (float)A[b].sum);
                acc = acc + dd * (float)s;
                acc = acc + ms;
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}

/* Q5_0, Q5_1, IQ4_NL: one integer dot per block over kq_b32_values (Q5_0's values already hold its -16), then
 * acc + dd * s (and Q5_1's + m * (d_x * sum(y)), as Q4_1) */
static inline void b32_scalar(int qtype, const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb,
                              const kq_act32 *act, int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const size_t bb = kq_row_bytes(qtype, 32);
    for (int r = 0; r < nr; r++) {
        const uint8_t *W = w + (size_t)(r0 + r) * rb;
        for (int64_t t = t0; t < t1; t++) {
            const kq_act32 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int8_t v[32];
                kq_b32_values(qtype, W + b * bb, v);
                int32_t s = 0;
                for (int k = 0; k < 32; k++) s += (int32_t)v[k] * A[b].q[k];
                float dd = kq_fp16_to_fp32(kq_ld16(W + b * bb)) * A[b].d;
                acc = acc + dd * (float)s;
                if (qtype == KQ_Q5_1) acc = acc + kq_fp16_to_fp32(kq_ld16(W + b * bb + 2)) * (A[b].d * (float)A[b].sum);
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}

#define B32_SCALAR(name, qtype)                                                                               \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act,           \
                     int64_t t0, int64_t t1, float *out, int64_t ldo) {                                       \
        b32_scalar(qtype, w, rb, r0, nr, nb, act, t0, t1, out, ldo);                                          \
    }
B32_SCALAR(q5_0_scalar, KQ_Q5_0)
B32_SCALAR(q5_1_scalar, KQ_Q5_1)
B32_SCALAR(iq4_nl_scalar, KQ_IQ4_NL)

static void q4_K_scalar(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act_,
                        int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const kq_act256 *act = act_;
    for (int r = 0; r < nr; r++) {
        const blk_q4_K *W = ROW(blk_q4_K, r);
        for (int64_t t = t0; t < t1; t++) {
            const kq_act256 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t sc[8], m[8], isum = 0, msum = 0;
                kq_q4k_scales(W[b].scales, sc, m);
                for (int j = 0; j < 4; j++) {
                    const uint8_t *q = W[b].qs + 32 * j;
                    const int8_t *y = A[b].q + 64 * j;
                    int32_t lo = 0, hi = 0;
                    for (int k = 0; k < 32; k++) { lo += (int32_t)(q[k] & 0xF) * y[k]; hi += (int32_t)(q[k] >> 4) * y[k + 32]; }
                    isum += sc[2 * j] * lo + sc[2 * j + 1] * hi;
                }
                for (int j = 0; j < 8; j++) msum += m[j] * (A[b].bsums[2 * j] + A[b].bsums[2 * j + 1]);
                float dd = kq_fp16_to_fp32(kq_ld16(&W[b].d)) * A[b].d;
                float dm = kq_fp16_to_fp32(kq_ld16(&W[b].dmin)) * A[b].d;
                acc = acc + dd * (float)isum;
                acc = acc - dm * (float)msum;
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}

static void q5_K_scalar(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act_,
                        int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const kq_act256 *act = act_;
    for (int r = 0; r < nr; r++) {
        const blk_q5_K *W = ROW(blk_q5_K, r);
        for (int64_t t = t0; t < t1; t++) {
            const kq_act256 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t sc[8], m[8], isum = 0, msum = 0;
                kq_q4k_scales(W[b].scales, sc, m); /* once per super-block */
                for (int j = 0; j < 8; j++) {
                    const uint8_t *q = W[b].qs + 32 * (j / 2), *qh = W[b].qh;
                    const int8_t *y = A[b].q + 32 * j;
                    int32_t s = 0;
                    for (int k = 0; k < 32; k++)
                        s += (int32_t)((j & 1 ? q[k] >> 4 : q[k] & 0xF) | (((qh[k] >> j) & 1) << 4)) * y[k];
                    isum += sc[j] * s;
                }
                for (int j = 0; j < 8; j++) msum += m[j] * (A[b].bsums[2 * j] + A[b].bsums[2 * j + 1]);
                float dd = kq_fp16_to_fp32(kq_ld16(&W[b].d)) * A[b].d;
                float dm = kq_fp16_to_fp32(kq_ld16(&W[b].dmin)) * A[b].d;
                acc = acc + dd * (float)isum;
                acc = acc - dm * (float)msum;
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}

/* Q2_K, Q3_K, IQ4_XS: a super-block's values and scales unpacked once, one integer sum over its groups
 * (isum = sum_g scale_g * dot_g), then acc + dd * isum (Q2_K: - dmin * sum_g min_g * bsums_g, as Q4_K) */
static void k16_scalar(int qtype, const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act_,
                       int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const kq_act256 *act = act_;
    const size_t bb = kq_row_bytes(qtype, 256);
    for (int r = 0; r < nr; r++) {
        const uint8_t *W = w + (size_t)(r0 + r) * rb;
        for (int64_t t = t0; t < t1; t++) {
            const kq_act256 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *B = W + b * bb;
                int8_t v[256];
                int32_t s[16], m[16] = {0}, gs = 16, isum = 0, msum = 0; /* gs: elements per scale */
                uint16_t d, dmin = 0;
                if (qtype == KQ_Q2_K) {
                    const blk_q2_K *Q = (const blk_q2_K *)B;
                    kq_q2k_values(Q->qs, v);
                    for (int g = 0; g < 16; g++) { s[g] = Q->scales[g] & 0xF; m[g] = Q->scales[g] >> 4; }
                    d = kq_ld16(&Q->d); dmin = kq_ld16(&Q->dmin);
                } else if (qtype == KQ_Q3_K) {
                    const blk_q3_K *Q = (const blk_q3_K *)B;
                    kq_q3k_values(Q, v);
                    kq_q3k_scales(Q->scales, s);
                    d = kq_ld16(&Q->d);
                } else {
                    const blk_iq4_xs *Q = (const blk_iq4_xs *)B;
                    for (int k = 0; k < 128; k++) {
                        v[32 * (k / 16) + k % 16] = kq_iq4_values[Q->qs[k] & 0xF];
                        v[32 * (k / 16) + k % 16 + 16] = kq_iq4_values[Q->qs[k] >> 4];
                    }
                    kq_iq4xs_scales(Q, s);
                    d = kq_ld16(&Q->d);
                    gs = 32;
                }
                for (int g = 0; g < 256 / gs; g++) {
                    int32_t dot = 0;
                    for (int k = gs * g; k < gs * g + gs; k++) dot += (int32_t)v[k] * A[b].q[k];
                    isum += s[g] * dot;
                }
                for (int g = 0; g < 16; g++) msum += m[g] * A[b].bsums[g];
                acc = acc + kq_fp16_to_fp32(d) * A[b].d * (float)isum;
                if (qtype == KQ_Q2_K) acc = acc - kq_fp16_to_fp32(dmin) * A[b].d * (float)msum;
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}

#define K16_SCALAR(name, qtype)                                                                               \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act,           \
                     int64_t t0, int64_t t1, float *out, int64_t ldo) {                                       \
        k16_scalar(qtype, w, rb, r0, nr, nb, act, t0, t1, out, ldo);                                          \
    }
K16_SCALAR(q2_K_scalar, KQ_Q2_K)
K16_SCALAR(q3_K_scalar, KQ_Q3_K)
K16_SCALAR(iq4_xs_scalar, KQ_IQ4_XS)

static void q6_K_scalar(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act_,
                        int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const kq_act256 *act = act_;
    for (int r = 0; r < nr; r++) {
        const blk_q6_K *W = ROW(blk_q6_K, r);
        for (int64_t t = t0; t < t1; t++) {
            const kq_act256 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t isum = 0;
                for (int h = 0; h < 2; h++) {
                    const uint8_t *ql = W[b].ql + 64 * h, *qh = W[b].qh + 32 * h;
                    const int8_t *y = A[b].q + 128 * h, *sc = W[b].scales + 8 * h;
                    for (int c = 0; c < 4; c++) {
                        for (int g = 0; g < 2; g++) {
                            int32_t s = 0;
                            for (int l = 16 * g; l < 16 * g + 16; l++) {
                                int lo = c & 1 ? ql[l + 32] : ql[l];
                                lo = c & 2 ? lo >> 4 : lo & 0xF;
                                int u = lo | (((qh[l] >> (2 * c)) & 3) << 4);
                                s += (u - 32) * y[32 * c + l];
                            }
                            isum += sc[2 * c + g] * s;
                        }
                    }
                }
                float dd = kq_fp16_to_fp32(kq_ld16(&W[b].d)) * A[b].d;
                acc = acc + dd * (float)isum;
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}

/* float weights: act is the float32 input x (T, n); nb is n */
#define FLOAT_SCALAR(name, conv)                                                                          \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t n, const void *act_,       \
                     int64_t t0, int64_t t1, float *out, int64_t ldo) {                                   \
        const float *x = act_;                                                                            \
        for (int r = 0; r < nr; r++) {                                                                    \
            const uint8_t *W = w + (size_t)(r0 + r) * rb;                                                 \
            for (int64_t t = t0; t < t1; t++) {                                                           \
                float acc = 0.0f;                                                                         \
                for (int64_t k = 0; k < n; k++) acc += conv * x[t * n + k];                               \
                out[t * ldo + r0 + r] = acc;                                                              \
            }                                                                                             \
        }                                                                                                 \
    }
static inline float ldf32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }
static inline float ldbf16(const uint8_t *p) { uint32_t u = (uint32_t)kq_ld16(p) << 16; float f; memcpy(&f, &u, 4); return f; }
FLOAT_SCALAR(f32_scalar, ldf32(W + 4 * k))
FLOAT_SCALAR(f16_scalar, kq_fp16_to_fp32(kq_ld16(W + 2 * k)))
FLOAT_SCALAR(bf16_scalar, ldbf16(W + 2 * k))

/* o += p @ V, one multiply-add chain over s per output (matmul_pv.inc's order) */
#define PV_SCALAR(name, conv)                                                                                 \
    static void name(const float *p, int64_t ldp, int64_t nrows, const uint8_t *V, int64_t m, int64_t hd,    \
                     float *o, int64_t ldo) {                                                                 \
        for (int64_t r = 0; r < nrows; r++)                                                                   \
            for (int64_t s = 0; s < m; s++)                                                                   \
                for (int64_t i = 0; i < hd; i++) o[r * ldo + i] += p[r * ldp + s] * conv;                    \
    }
PV_SCALAR(pv_f32_scalar, ldf32(V + 4 * (s * hd + i)))
PV_SCALAR(pv_f16_scalar, kq_fp16_to_fp32(kq_ld16(V + 2 * (s * hd + i))))

void kq_kernels_scalar(kq_kernels *k) {
    k->q8_0 = q8_0_scalar; k->q4_0 = q4_0_scalar; k->q4_1 = q4_1_scalar;
    k->q5_0 = q5_0_scalar; k->q5_1 = q5_1_scalar; k->iq4_nl = iq4_nl_scalar;
    k->q2_K = q2_K_scalar; k->q3_K = q3_K_scalar; k->q4_K = q4_K_scalar; k->q5_K = q5_K_scalar;
    k->q6_K = q6_K_scalar; k->iq4_xs = iq4_xs_scalar;
    k->f32 = f32_scalar; k->f16 = f16_scalar; k->bf16 = bf16_scalar;
    k->pv_f32 = pv_f32_scalar; k->pv_f16 = pv_f16_scalar;
    k->x8 = kq_x8_group_scalar;
    k->quant32 = kq_quantize_q8_32_scalar;
    k->x8k = kq_x8k_group_scalar;
    k->x8q6 = kq_x8q6_group_scalar;
}
