/* Kestrel native kernels: what the library's sources share (thread pool, scratch, block layouts, tile kernels,
 * inline helpers); not part of the API ctypes sees (kq.h). */
#ifndef KQ_INTERNAL_H
#define KQ_INTERNAL_H
#include "kq.h"

typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;
typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[16]; } blk_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;    /* fifth bits: bit j of qh (LE) for element j */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_1;
typedef struct { uint16_t d; uint8_t qs[16]; } blk_iq4_nl;                 /* d * kq_iq4_values[nibble] */
/* Q2_K / Q3_K: element 128 h + 32 j + l is bits 2j, 2j + 1 of qs[32 h + l]; Q3_K adds 4 when bit 4 h + j of hmask[l]
 * is set and subtracts 4; 16 groups of 16, each with its scale (Q2_K: a 4-bit scale and min per byte) */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } blk_q2_K;
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } blk_q3_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_K;
typedef struct { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } blk_iq4_xs; /* 8 IQ4_NL-like sub-blocks */


typedef void (*kq_range_fn)(void *ctx, int64_t start, int64_t end);
void kq_parallel_for(int64_t n, int64_t chunk, kq_range_fn fn, void *ctx); /* fn over [0, n) in chunks */
int64_t kq_chunk_for(int64_t n);
void *kq_scratch(int slot, size_t bytes); /* per-thread buffers kept between calls (slot < 5) */
void kq_f32_dots(const float *rows, int64_t nrows, int64_t n, const float *x, float *out); /* out = rows @ x, this thread */
/* out[t * ldo + r] = rows[r] . x[t] for T columns x (T, n), in this thread (multi-token float tiles) */
void kq_f32_tiles(const float *rows, int64_t nrows, int64_t n, const float *x, int64_t T, float *out, int64_t ldo);
/* the same over float16 rows (each widened exactly, in registers: equal to widening them first) */
void kq_f16_tiles(const uint16_t *rows, int64_t nrows, int64_t n, const float *x, int64_t T, float *out, int64_t ldo);
/* o (nrows, hd) += p (nrows, m) @ V (m, hd), V float16 when f16 (attention's value product), in this thread */
void kq_pv_tiles(int f16, const float *p, int64_t ldp, int64_t nrows, const void *V, int64_t m, int64_t hd, float *o,
                 int64_t ldo);
float kq_fp16_to_fp32(uint16_t h);
void kq_dequantize_row(int qtype, const uint8_t *w, int64_t n, float *out);
void kq_q4k_scales(const uint8_t *q, int32_t sc[8], int32_t m[8]);
extern const int8_t kq_iq4_values[16]; /* IQ4_NL / IQ4_XS: the non-linear grid a nibble indexes */
/* the 32 integer values of one block of a 32-element format, in element order: Q8_0's, Q4_0's nibble - 8, Q4_1's
 * nibble, Q5_0's u - 16, Q5_1's u (u: nibble + 16 * its qh bit), IQ4_NL's grid values */
void kq_b32_values(int qtype, const uint8_t *blk, int8_t v[32]);
void kq_q3k_scales(const uint8_t *q, int32_t s[16]);      /* Q3_K: the 16 signed 6-bit scales of 12 packed bytes */
void kq_q3k_values(const blk_q3_K *B, int8_t v[256]);      /* Q3_K: the values -4..3 in element order */
void kq_q2k_values(const uint8_t *qs, int8_t v[256]);      /* Q2_K: the values 0..3 in element order */
void kq_iq4xs_scales(const blk_iq4_xs *B, int32_t s[8]); /* IQ4_XS: the 8 signed 6-bit scales */
/* one super-block of a K format (Q2_K..Q6_K, IQ4_XS) as plain integers: its signed values v (element order), a scale
 * per 16 values s, a min per 16 values m (0 but for Q2_K, Q4_K, Q5_K) and the fp16 factors d, dmin as floats, so that
 * its dot with act256 y is d * d_y * sum_g s_g (v_g . y_g) - dmin * d_y * sum_g m_g bsums_g (the tile kernels' sums) */
void kq_k_unpack(int qtype, const uint8_t *blk, int8_t v[256], int16_t s[16], int16_t m[16], float *d, float *dmin);

/* A row-tile kernel: outputs out[t*ldo + r] for rows r0..r0+nr-1 (nr <= 4) and columns t0..t1-1.
 * w points at row 0; act is the quantized (or float) activation matrix. */
typedef void (*kq_tile_fn)(const uint8_t *w, size_t rb, int64_t r0, int nr, int64_t nb,
                           const void *act, int64_t t0, int64_t t1, float *out, int64_t ldo);
/* x8 layout (repack.c): one group of 8 interleaved rows (r0.., nr <= 8 real) against all T columns */
typedef void (*kq_x8_fn)(int qtype, const uint8_t *grp, int64_t nb, const kq_act32 *act, int64_t T, float *out,
                         int64_t ldo, int64_t r0, int nr);
typedef void (*kq_quant32_fn)(const float *x, int64_t T, int64_t n, kq_act32 *out);
typedef void (*kq_x8k_fn)(const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out, int64_t ldo,
                          int64_t r0, int nr);
/* the row-layout tile kernel of a qtype (NULL if none) and the activation rows it reads; kq_prepare_act turns
 * float rows x (T, n) into them (float copy, act32 or act256 blocks; the pool helps with large T * n) */
enum { KQ_ACT_F32 = 0, KQ_ACT_Q32 = 1, KQ_ACT_Q256 = 2 };
kq_tile_fn kq_tile_kernel(int qtype, int *act_kind);
size_t kq_act_row_bytes(int act_kind, int64_t n);
void kq_prepare_act(int act_kind, const float *x, int64_t T, int64_t n, void *out);
/* o (nrows, hd; row stride ldo) += p (nrows, m; row stride ldp) @ V (m, hd) of float32 or float16 rows (matmul_pv.inc) */
typedef void (*kq_pv_fn)(const float *p, int64_t ldp, int64_t nrows, const uint8_t *V, int64_t m, int64_t hd, float *o,
                         int64_t ldo);
typedef struct { kq_tile_fn q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_xs, f32, f16, bf16; kq_x8_fn x8; kq_quant32_fn quant32; kq_x8k_fn x8k, x8q5, x8q6, x8iq4; kq_pv_fn pv_f32, pv_f16;
                int x8iq4_row_t; /* IQ4_XS x8 groups from this many columns on: the row tiles on the rows copied out (0: never) */ } kq_kernels;
void kq_x8q6_group_scalar(const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out,
                          int64_t ldo, int64_t r0, int nr);
void kq_x8k_group_scalar(const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out,
                         int64_t ldo, int64_t r0, int nr);
void kq_x8iq4_group_scalar(const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out,
                           int64_t ldo, int64_t r0, int nr);
void kq_x8iq4_row(const uint8_t *grp, int64_t nb, int r, uint8_t *row); /* row r of an IQ4_XS x8 group, as in the file */
void kq_x8q5_group_scalar(const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out,
                          int64_t ldo, int64_t r0, int nr);
void kq_quantize_q8_32_scalar(const float *x, int64_t T, int64_t n, kq_act32 *out);
void kq_x8_group_scalar(int qtype, const uint8_t *grp, int64_t nb, const kq_act32 *act, int64_t T,
                        float *out, int64_t ldo, int64_t r0, int nr);
void kq_kernels_scalar(kq_kernels *k);
#if defined(__x86_64__)
void kq_kernels_avx2(kq_kernels *k);
void kq_kernels_avx2vnni(kq_kernels *k);
#elif defined(__aarch64__)
void kq_kernels_neon(kq_kernels *k);
void kq_kernels_neondot(kq_kernels *k);
#endif

#include <string.h>
/* built for the baseline ISA and, on x86_64, cloned for AVX2 and AVX-512 (chosen at load time by the dynamic
 * linker; no float reassociation, so every clone computes the same numbers) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(KQ_NO_CLONES) /* no IFUNCs under TSan */
#define KQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KQ_CLONES
#endif

/* `a > b ? a : b` and `a < b ? a : b` for a non-NaN b (so a NaN a gives b): on aarch64 C's fmaxf / fminf, one
 * instruction each (fmaxnm / fminnm) that vectorizes, where GCC turns the comparisons into compare-and-select
 * sequences several times as long; on x86-64 the comparisons, which are maxps / minps. The two differ only in which
 * zero max(+0, -0) returns, and the softmax and exp only subtract the max or clamp with it, where the sign of a zero
 * never reaches a result. */
#if defined(__aarch64__)
#include <arm_neon.h>
#define KQ_FMAX(a, b) __builtin_fmaxf(a, b)
#define KQ_FMIN(a, b) __builtin_fminf(a, b)
#else
#define KQ_FMAX(a, b) ((a) > (b) ? (a) : (b))
#define KQ_FMIN(a, b) ((a) < (b) ? (a) : (b))
#endif

/* exp(x) for the softmax and SiLU: Cephes' expf polynomial (about 1 ulp), written so loops vectorize. The clamp
 * sends NaN to the low end; the result is NaN again for a NaN x, like expf. k = rint(x log2 e) is rounded by
 * adding 1.5 * 2^23 (|x log2 e| <= 128 after the clamp, so the sum's last place is 1 and round-to-nearest-even
 * is rint's rounding), and 2^k is built from the sum's own bits: plain adds and shifts on both pipes of a NEON
 * core, where frintx and the float -> int conversion each hold one pipe for two cycles (bench/a76_context.py). */
static inline float kq_expf(float x) {
    const float xin = x;
    x = KQ_FMAX(x, -87.3f);
    x = KQ_FMIN(x, 88.7f);
    const float t = x * 1.44269504088896341f + 12582912.0f, k = t - 12582912.0f; /* k = rint(x log2 e) */
    float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
    float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
               1.6666665459e-1f) * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    uint32_t e;
    float sc;
    memcpy(&e, &t, 4);
    e = (e + (127u - 0x4B400000u)) << 23; /* t's bits are 0x4B400000 + k: 2^k */
    memcpy(&sc, &e, 4);
    return xin != xin ? xin : y * sc;
}

/* Softmax pieces (vision and decoder attention): the max of p[0..n), and p[i] = exp(p[i] (* scale) - mx) returning
 * their sum; 16 lanes, then the lanes' result, then the tail, so the reductions vectorize. */
static inline float kq_max(const float *p, int64_t n) {
    float mx = -__builtin_inff();
    int64_t i = 0;
#if defined(__aarch64__) /* GCC leaves the 16 lanes below as 16 scalar fmaxnm there: four vectors instead */
    float32x4_t m0 = vdupq_n_f32(mx), m1 = m0, m2 = m0, m3 = m0;
    for (; i + 16 <= n; i += 16) {
        m0 = vmaxnmq_f32(m0, vld1q_f32(p + i));
        m1 = vmaxnmq_f32(m1, vld1q_f32(p + i + 4));
        m2 = vmaxnmq_f32(m2, vld1q_f32(p + i + 8));
        m3 = vmaxnmq_f32(m3, vld1q_f32(p + i + 12));
    }
    mx = vmaxnmvq_f32(vmaxnmq_f32(vmaxnmq_f32(m0, m1), vmaxnmq_f32(m2, m3)));
#else
    float m16[16];
    for (int j = 0; j < 16; j++) m16[j] = -__builtin_inff();
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) m16[j] = KQ_FMAX(p[i + j], m16[j]);
    for (int j = 0; j < 16; j++) mx = KQ_FMAX(m16[j], mx);
#endif
    for (; i < n; i++) mx = KQ_FMAX(p[i], mx);
    return mx;
}

static inline float kq_exp_sum_scaled(float *p, int64_t n, float scale, float mx) { /* p[i] = exp(p[i] * scale - mx) */
    float acc[16] = {0}, sum = 0.0f;
    int64_t i;
    for (i = 0; i < n; i++) p[i] = kq_expf(p[i] * scale - mx);
    for (i = 0; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += p[i + j];
    for (; i < n; i++) sum += p[i];
    for (int j = 0; j < 16; j++) sum += acc[j];
    return sum;
}

static inline float kq_exp_sum(float *p, int64_t n, float mx) { return kq_exp_sum_scaled(p, n, 1.0f, mx); }

/* Row tiles' weights ahead of their use: rows r .. r+3 (clamped to rows) of a matrix with rb bytes per row into
 * L2. The hardware prefetcher loses track of short rows; matmul and the MoE experts fetch KQ_PF_TILES tiles ahead. */
#define KQ_PF_TILES 4
static inline void kq_prefetch_rows(const uint8_t *w, size_t rb, int64_t r, int64_t rows) {
    if (r >= rows) return;
    const uint8_t *p = w + (size_t)r * rb, *e = w + (size_t)(r + 4 < rows ? r + 4 : rows) * rb;
    for (; p < e; p += 64) __builtin_prefetch(p, 0, 3);
}

static inline uint16_t kq_ld16(const void *p) { uint16_t v; __builtin_memcpy(&v, p, 2); return v; }

#endif
