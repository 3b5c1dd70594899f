/* Activation quantization (float32 rows -> 8-bit blocks) and weight dequantization (GGML blocks ->
 * float32 rows). Rounding: round-half-to-even (lrintf in the default mode), like the SIMD conversions.
 * Policy (SIMD): kq_quantize_q8_32 runs the level's quant32 (AVX2 / NEON in matmul_x86.inc / matmul_neon.inc; the
 * scalar one here at level 0). The rest is generic C on every architecture (x86 has no specialisation either):
 * kq_quantize_q8_K is T x n roundings once per product against that product's rows x T x n multiply-adds, 1/rows
 * of its work (rows >= 192 in every served shape's linears: SmolLM2-135M's k and v), built as target_clones (KQ_CLONES)
 * so -O3 vectorises it: with a libm lrintf call per value it was 3.6% of a Q5_K_M Qwen3-1.7B-shaped prefill (perf,
 * AMD EPYC), now 4.3x faster;
 * kq_dequantize / kq_get_rows run at load and for one embedding row per token, and -O3 vectorises the dequantizer's widen / convert / scale anyway (aarch64 objdump:
 * kq_dequantize_row 332 of 1040 instructions vector, sxtl/scvtf/fmul v.4s). */
#include <math.h>
#include <string.h>
#include "kq_internal.h"

/* round half to even, as lrintf in the default mode, for |x| < 2^22 (quantized values are within 127.0001): adding
 * and taking away 1.5 * 2^23 rounds at the units; unlike lrintf (a libm call per value) it vectorises */
static inline int kq_rint(float x) { return (int)((x + 12582912.0f) - 12582912.0f); }

float kq_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float bf16_to_fp32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

size_t kq_row_bytes(int qtype, int64_t n) {
    switch (qtype) {
    case KQ_F32: return (size_t)n * 4;
    case KQ_F16: case KQ_BF16: return (size_t)n * 2;
    case KQ_Q8_0: return (n % 32) ? 0 : (size_t)(n / 32) * sizeof(blk_q8_0);
    case KQ_Q4_0: return (n % 32) ? 0 : (size_t)(n / 32) * sizeof(blk_q4_0);
    case KQ_Q4_1: return (n % 32) ? 0 : (size_t)(n / 32) * sizeof(blk_q4_1);
    case KQ_Q5_0: return (n % 32) ? 0 : (size_t)(n / 32) * sizeof(blk_q5_0);
    case KQ_Q5_1: return (n % 32) ? 0 : (size_t)(n / 32) * sizeof(blk_q5_1);
    case KQ_IQ4_NL: return (n % 32) ? 0 : (size_t)(n / 32) * sizeof(blk_iq4_nl);
    case KQ_Q2_K: return (n % 256) ? 0 : (size_t)(n / 256) * sizeof(blk_q2_K);
    case KQ_Q3_K: return (n % 256) ? 0 : (size_t)(n / 256) * sizeof(blk_q3_K);
    case KQ_Q4_K: return (n % 256) ? 0 : (size_t)(n / 256) * sizeof(blk_q4_K);
    case KQ_Q5_K: return (n % 256) ? 0 : (size_t)(n / 256) * sizeof(blk_q5_K);
    case KQ_Q6_K: return (n % 256) ? 0 : (size_t)(n / 256) * sizeof(blk_q6_K);
    case KQ_IQ4_XS: return (n % 256) ? 0 : (size_t)(n / 256) * sizeof(blk_iq4_xs);
    default: return 0;
    }
}

void kq_quantize_q8_32_scalar(const float *x, int64_t T, int64_t n, kq_act32 *out) {
    int64_t nb = n / 32;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + t * n + b * 32;
            kq_act32 *o = out + t * nb + b;
            float amax = 0.0f;
            for (int k = 0; k < 32; k++) { float a = fabsf(v[k]); amax = a > amax ? a : amax; }
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int k = 0; k < 32; k++) { int q = kq_rint(v[k] * id); o->q[k] = (int8_t)q; sum += q; }
            o->d = d;
            o->sum = sum;
        }
    }
}

KQ_CLONES void kq_quantize_q8_K(const float *x, int64_t T, int64_t n, kq_act256 *out) {
    int64_t nb = n / 256;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + t * n + b * 256;
            kq_act256 *o = out + t * nb + b;
            float amax = 0.0f;
            for (int k = 0; k < 256; k++) { float a = fabsf(v[k]); amax = a > amax ? a : amax; }
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int k = 16 * g; k < 16 * g + 16; k++) { int q = kq_rint(v[k] * id); o->q[k] = (int8_t)q; s += q; }
                o->bsums[g] = (int16_t)s;
            }
            o->d = d;
        }
    }
}

/* the 6-bit scales and mins of a Q4_K / Q5_K super-block's 8 sub-blocks (12 packed bytes) */
void kq_q4k_scales(const uint8_t *q, int32_t sc[8], int32_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        m[j] = q[j + 4] & 63;
        sc[j + 4] = (q[j + 8] & 0xF) | ((q[j] >> 6) << 4);
        m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
}

const int8_t kq_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

void kq_b32_values(int qtype, const uint8_t *blk, int8_t v[32]) {
    if (qtype == KQ_Q8_0) { memcpy(v, ((const blk_q8_0 *)blk)->qs, 32); return; }
    const uint8_t *qs = qtype == KQ_Q5_0 ? ((const blk_q5_0 *)blk)->qs : qtype == KQ_Q5_1 ? ((const blk_q5_1 *)blk)->qs
                      : qtype == KQ_Q4_1 ? ((const blk_q4_1 *)blk)->qs : blk + 2; /* Q4_0, IQ4_NL: after d */
    if (qtype == KQ_IQ4_NL) {
        for (int k = 0; k < 16; k++) { v[k] = kq_iq4_values[qs[k] & 0xF]; v[k + 16] = kq_iq4_values[qs[k] >> 4]; }
        return;
    }
    uint32_t h = 0; /* the fifth bits (Q5_0, Q5_1) */
    if (qtype == KQ_Q5_0 || qtype == KQ_Q5_1) {
        const uint8_t *qh = qs - 4;
        h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
    }
    const int off = qtype == KQ_Q4_0 ? 8 : qtype == KQ_Q5_0 ? 16 : 0;
    for (int k = 0; k < 16; k++) {
        v[k] = (int8_t)(((qs[k] & 0xF) | ((h >> k) & 1) << 4) - off);
        v[k + 16] = (int8_t)(((qs[k] >> 4) | ((h >> (k + 16)) & 1) << 4) - off);
    }
}

void kq_q3k_scales(const uint8_t *q, int32_t s[16]) {
    for (int j = 0; j < 16; j++) s[j] = (((j < 8 ? q[j] : q[j - 8] >> 4) & 0xF) | (((q[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
}

void kq_q2k_values(const uint8_t *qs, int8_t v[256]) {
    for (int i = 0; i < 256; i++) v[i] = (int8_t)((qs[32 * (i / 128) + i % 32] >> (2 * (i / 32 % 4))) & 3);
}

void kq_q3k_values(const blk_q3_K *B, int8_t v[256]) {
    kq_q2k_values(B->qs, v);
    for (int i = 0; i < 256; i++) v[i] = (int8_t)(v[i] + (((B->hmask[i % 32] >> (i / 32)) & 1) << 2) - 4);
}

void kq_iq4xs_scales(const blk_iq4_xs *B, int32_t s[8]) {
    const uint16_t h = kq_ld16(&B->scales_h);
    for (int j = 0; j < 8; j++) s[j] = (((B->scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((h >> (2 * j)) & 3) << 4)) - 32;
}

void kq_k_unpack(int qtype, const uint8_t *blk, int8_t v[256], int16_t s[16], int16_t m[16], float *d, float *dmin) {
    int32_t a[16], b[16];
    memset(m, 0, 16 * sizeof *m);
    *dmin = 0.0f;
    switch (qtype) {
    case KQ_Q2_K: {
        const blk_q2_K *B = (const blk_q2_K *)blk;
        kq_q2k_values(B->qs, v);
        for (int g = 0; g < 16; g++) { s[g] = B->scales[g] & 0xF; m[g] = B->scales[g] >> 4; }
        *d = kq_fp16_to_fp32(kq_ld16(&B->d));
        *dmin = kq_fp16_to_fp32(kq_ld16(&B->dmin));
        break;
    }
    case KQ_Q3_K:
        kq_q3k_values((const blk_q3_K *)blk, v);
        kq_q3k_scales(((const blk_q3_K *)blk)->scales, a);
        for (int g = 0; g < 16; g++) s[g] = (int16_t)a[g];
        *d = kq_fp16_to_fp32(kq_ld16(&((const blk_q3_K *)blk)->d));
        break;
    case KQ_Q4_K: case KQ_Q5_K: {
        const size_t bb = qtype == KQ_Q4_K ? sizeof(blk_q4_K) : sizeof(blk_q5_K);
        const uint8_t *qh = blk + 16, *qs = blk + bb - 128;
        kq_q4k_scales(blk + 4, a, b);
        for (int i = 0; i < 256; i++) {
            const int j = i / 32, k = i % 32, q = qs[32 * (j / 2) + k];
            v[i] = (int8_t)((j & 1 ? q >> 4 : q & 0xF) | (qtype == KQ_Q5_K ? ((qh[k] >> j) & 1) << 4 : 0));
        }
        for (int g = 0; g < 16; g++) { s[g] = (int16_t)a[g / 2]; m[g] = (int16_t)b[g / 2]; }
        *d = kq_fp16_to_fp32(kq_ld16(blk));
        *dmin = kq_fp16_to_fp32(kq_ld16(blk + 2));
        break;
    }
    case KQ_Q6_K: {
        const blk_q6_K *B = (const blk_q6_K *)blk;
        for (int i = 0; i < 256; i++) { /* element 128 h + 32 c + l */
            const int h = i / 128, c = i / 32 % 4, l = i % 32, q = B->ql[64 * h + 32 * (c & 1) + l];
            v[i] = (int8_t)(((c & 2 ? q >> 4 : q & 0xF) | (((B->qh[32 * h + l] >> (2 * c)) & 3) << 4)) - 32);
        }
        for (int g = 0; g < 16; g++) s[g] = B->scales[g];
        *d = kq_fp16_to_fp32(kq_ld16(&B->d));
        break;
    }
    case KQ_IQ4_XS: {
        const blk_iq4_xs *B = (const blk_iq4_xs *)blk;
        for (int k = 0; k < 128; k++) {
            v[32 * (k / 16) + k % 16] = kq_iq4_values[B->qs[k] & 0xF];
            v[32 * (k / 16) + k % 16 + 16] = kq_iq4_values[B->qs[k] >> 4];
        }
        kq_iq4xs_scales(B, a);
        for (int g = 0; g < 16; g++) s[g] = (int16_t)a[g / 2];
        *d = kq_fp16_to_fp32(kq_ld16(&B->d));
        break;
    }
    }
}

void kq_dequantize_row(int qtype, const uint8_t *w, int64_t n, float *y) {
    switch (qtype) {
    case KQ_F32: memcpy(y, w, (size_t)n * 4); break;
    case KQ_F16: for (int64_t i = 0; i < n; i++) y[i] = kq_fp16_to_fp32(kq_ld16(w + 2 * i)); break;
    case KQ_BF16: for (int64_t i = 0; i < n; i++) y[i] = bf16_to_fp32(kq_ld16(w + 2 * i)); break;
    case KQ_Q8_0: case KQ_Q4_0: case KQ_Q4_1: case KQ_Q5_0: case KQ_Q5_1: case KQ_IQ4_NL: {
        const size_t bb = kq_row_bytes(qtype, 32);
        for (int64_t b = 0; b < n / 32; b++, y += 32) {
            const uint8_t *B = w + b * bb;
            int8_t v[32];
            kq_b32_values(qtype, B, v);
            const int has_min = qtype == KQ_Q4_1 || qtype == KQ_Q5_1;
            float d = kq_fp16_to_fp32(kq_ld16(B)), m = has_min ? kq_fp16_to_fp32(kq_ld16(B + 2)) : 0.0f;
            if (has_min)
                for (int k = 0; k < 32; k++) y[k] = d * (float)v[k] + m;
            else
                for (int k = 0; k < 32; k++) y[k] = d * (float)v[k];
        }
        break;
    }
    case KQ_Q4_K: case KQ_Q5_K: { /* Q5_K: Q4_K's fields with qh (the fifth bits) before the nibbles */
        const size_t bb = qtype == KQ_Q4_K ? sizeof(blk_q4_K) : sizeof(blk_q5_K);
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *B = w + b * bb, *qh = B + 16, *qs = B + bb - 128;
            float d = kq_fp16_to_fp32(kq_ld16(B)), dmin = kq_fp16_to_fp32(kq_ld16(B + 2));
            int32_t sc[8], m[8];
            kq_q4k_scales(B + 4, sc, m);
            for (int j = 0; j < 8; j++) { /* sub-block j: low (j even) or high nibbles of qs[32 (j / 2) ..], bit j of qh */
                const uint8_t *q = qs + 32 * (j / 2);
                float d1 = d * (float)sc[j], m1 = dmin * (float)m[j];
                for (int k = 0; k < 32; k++) {
                    int u = (j & 1 ? q[k] >> 4 : q[k] & 0xF) | (qtype == KQ_Q5_K ? ((qh[k] >> j) & 1) << 4 : 0);
                    *y++ = d1 * (float)u - m1;
                }
            }
        }
        break;
    }
    case KQ_Q2_K: case KQ_Q3_K:
        for (int64_t b = 0; b < n / 256; b++, y += 256) {
            int8_t v[256];
            int32_t s[16];
            float d, dmin = 0.0f;
            if (qtype == KQ_Q3_K) {
                const blk_q3_K *B = (const blk_q3_K *)w + b;
                kq_q3k_values(B, v);
                kq_q3k_scales(B->scales, s);
                d = kq_fp16_to_fp32(kq_ld16(&B->d));
            } else {
                const blk_q2_K *B = (const blk_q2_K *)w + b;
                kq_q2k_values(B->qs, v);
                for (int g = 0; g < 16; g++) s[g] = B->scales[g];
                d = kq_fp16_to_fp32(kq_ld16(&B->d));
                dmin = kq_fp16_to_fp32(kq_ld16(&B->dmin));
            }
            for (int g = 0; g < 16; g++) {
                if (qtype == KQ_Q3_K) {
                    float dl = d * (float)s[g];
                    for (int k = 16 * g; k < 16 * g + 16; k++) y[k] = dl * (float)v[k];
                } else { /* Q2_K: low nibble the scale, high nibble the min */
                    float dl = d * (float)(s[g] & 0xF), ml = dmin * (float)(s[g] >> 4);
                    for (int k = 16 * g; k < 16 * g + 16; k++) y[k] = dl * (float)v[k] - ml;
                }
            }
        }
        break;
    case KQ_IQ4_XS:
        for (int64_t b = 0; b < n / 256; b++) {
            const blk_iq4_xs *B = (const blk_iq4_xs *)w + b;
            const float d = kq_fp16_to_fp32(kq_ld16(&B->d));
            int32_t s[8];
            kq_iq4xs_scales(B, s);
            for (int j = 0; j < 8; j++, y += 32) {
                const float dl = d * (float)s[j];
                for (int k = 0; k < 16; k++) {
                    y[k] = dl * (float)kq_iq4_values[B->qs[16 * j + k] & 0xF];
                    y[k + 16] = dl * (float)kq_iq4_values[B->qs[16 * j + k] >> 4];
                }
            }
        }
        break;
    case KQ_Q6_K:
        for (int64_t b = 0; b < n / 256; b++) {
            const blk_q6_K *B = (const blk_q6_K *)w + b;
            float d = kq_fp16_to_fp32(kq_ld16(&B->d));
            const uint8_t *ql = B->ql, *qh = B->qh;
            const int8_t *sc = B->scales;
            for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * (float)sc[is] * (float)q1;
                    y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                    y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                    y[l + 96] = d * (float)sc[is + 6] * (float)q4;
                }
            }
        }
        break;
    }
}

int kq_dequantize(int qtype, const uint8_t *w, int64_t rows, int64_t n, float *out) {
    size_t rb = kq_row_bytes(qtype, n);
    if (!rb) return -1;
    for (int64_t r = 0; r < rows; r++) kq_dequantize_row(qtype, w + r * rb, n, out + r * n);
    return 0;
}

int kq_get_rows(int qtype, const uint8_t *w, int64_t n, const int64_t *ids, int64_t T, float *out) {
    size_t rb = kq_row_bytes(qtype, n);
    if (!rb) return -1;
    for (int64_t t = 0; t < T; t++) kq_dequantize_row(qtype, w + ids[t] * rb, n, out + t * n);
    return 0;
}
