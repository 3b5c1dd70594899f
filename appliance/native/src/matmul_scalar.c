/* Scalar reference tile kernels of every weight type (the KQ_SCALAR level): they define the arithmetic that the
 * SIMD kernels (matmul_x86*.inc, matmul_neon*.inc) and the numpy twins (twins.py) reproduce bit for bit. */
#include <string.h>
#include "kq_internal.h"

/* the 32-element formats: one integer dot per block over kq_b32_values (Q4_0's and Q5_0's offsets are in the
 * values), then acc + dd * s, dd = d_w * d_x (Q4_1, Q5_1: then + m * (d_x * sum(y))) */
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
                if (qtype == KQ_Q4_1 || qtype == KQ_Q5_1)
                    acc = acc + kq_fp16_to_fp32(kq_ld16(W + b * bb + 2)) * (A[b].d * (float)A[b].sum);
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}

/* a tile kernel of one type over a kernel shared by several (impl takes the qtype first) */
#define TYPED_SCALAR(name, impl, qtype)                                                                       \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act,           \
                     int64_t t0, int64_t t1, float *out, int64_t ldo) {                                       \
        impl(qtype, w, rb, r0, nr, nb, act, t0, t1, out, ldo);                                                \
    }
TYPED_SCALAR(q8_0_scalar, b32_scalar, KQ_Q8_0)
TYPED_SCALAR(q4_0_scalar, b32_scalar, KQ_Q4_0)
TYPED_SCALAR(q4_1_scalar, b32_scalar, KQ_Q4_1)
TYPED_SCALAR(q5_0_scalar, b32_scalar, KQ_Q5_0)
TYPED_SCALAR(q5_1_scalar, b32_scalar, KQ_Q5_1)
TYPED_SCALAR(iq4_nl_scalar, b32_scalar, KQ_IQ4_NL)

/* the K formats (Q2_K .. Q6_K, IQ4_XS): each super-block unpacked by kq_k_unpack, isum = sum_g s_g (v_g . y_g) and
 * msum = sum_g m_g bsums_g in integers, then acc + dd * isum (dd = d_w * d_y) and, for the formats with mins (Q2_K,
 * Q4_K, Q5_K), - dmin_w * d_y * msum */
static void k_scalar(int qtype, const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb, const void *act_,
                     int64_t t0, int64_t t1, float *out, int64_t ldo) {
    const kq_act256 *act = act_;
    const size_t bb = kq_row_bytes(qtype, 256);
    const int has_min = qtype == KQ_Q2_K || qtype == KQ_Q4_K || qtype == KQ_Q5_K;
    for (int r = 0; r < nr; r++) {
        const uint8_t *W = w + (size_t)(r0 + r) * rb;
        for (int64_t t = t0; t < t1; t++) {
            const kq_act256 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int8_t v[256];
                int16_t s[16], m[16];
                float d, dmin;
                kq_k_unpack(qtype, W + b * bb, v, s, m, &d, &dmin);
                int32_t isum = 0, msum = 0;
                for (int g = 0; g < 16; g++) {
                    int32_t dot = 0;
                    for (int k = 16 * g; k < 16 * g + 16; k++) dot += (int32_t)v[k] * A[b].q[k];
                    isum += s[g] * dot;
                    msum += m[g] * A[b].bsums[g];
                }
                acc = acc + d * A[b].d * (float)isum;
                if (has_min) acc = acc - dmin * A[b].d * (float)msum;
            }
            out[t * ldo + r0 + r] = acc;
        }
    }
}
TYPED_SCALAR(q2_K_scalar, k_scalar, KQ_Q2_K)
TYPED_SCALAR(q3_K_scalar, k_scalar, KQ_Q3_K)
TYPED_SCALAR(q4_K_scalar, k_scalar, KQ_Q4_K)
TYPED_SCALAR(q5_K_scalar, k_scalar, KQ_Q5_K)
TYPED_SCALAR(q6_K_scalar, k_scalar, KQ_Q6_K)
TYPED_SCALAR(iq4_xs_scalar, k_scalar, KQ_IQ4_XS)

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
    k->x8q5 = kq_x8q5_group_scalar;
    k->x8iq4 = kq_x8iq4_group_scalar;
    k->x8q6 = kq_x8q6_group_scalar;
}
