/* Row-interleaved ("x8") layout of the 32-element formats, made once at load for the native kernels.
 * Rows are taken 8 at a time (the last group padded with zero blocks); for each block index the group
 * stores its 8 fp16 scales (then, for Q4_1, its 8 fp16 mins) and then its quants in 4-byte slices:
 * slice k holds bytes 4k..4k+3 of rows 0..7, so one 32-byte load feeds one 8-lane integer dot whose
 * lane r sums row r: block sums come out per row with no horizontal reduction. Same bytes per block.
 * Policy (SIMD): kq_repack_x8 is byte moves done once at load, generic C everywhere; the x8 products are per
 * level (matmul_x8_x86.inc, matmul_x8_neon.inc), the *_group_scalar ones here only the scalar level's. */
#include <string.h>
#include "kq_internal.h"

int kq_x8_block_bytes(int qtype) {
    switch (qtype) {
    case KQ_Q8_0: return 8 * (int)sizeof(blk_q8_0);
    case KQ_Q4_0: return 8 * (int)sizeof(blk_q4_0);
    case KQ_Q4_1: return 8 * (int)sizeof(blk_q4_1);
    case KQ_Q4_K: return KQ_Q4K_X8_BYTES;
    case KQ_Q5_K: return KQ_Q5K_X8_BYTES;
    case KQ_Q6_K: return KQ_Q6K_X8_BYTES;
    case KQ_IQ4_XS: return KQ_IQ4XS_X8_BYTES;
    default: return 0;
    }
}

/* Q4_K x8 super-block group (1184 bytes): d[8], dmin[8] (fp16), the 6-bit scales and mins unpacked to
 * bytes as [sub-block][row] (64 + 64), then the quants: for each 64-element chunk j, 8 slices of 4 bytes
 * per row (low nibbles are sub-block 2j, high nibbles 2j+1, as in Q4_K). Q5_K's group (1440 bytes) is the same
 * followed by the fifth bits qh in 8 slices of 4 bytes per row: slice k holds qh[4k..4k+3] of each row, the bits
 * of the elements that quants slice k of every chunk holds (bit 2j of the low nibbles', 2j+1 of the high). */
static void fill_q45k(int q5, uint8_t *o, const uint8_t *B, int r) { /* B: d, dmin, scales[12] (, qh[32]), qs */
    const uint8_t *qs = B + (q5 ? 48 : 16);
    memcpy(o + 2 * r, B, 2);
    memcpy(o + 16 + 2 * r, B + 2, 2);
    int32_t sc[8], m[8];
    kq_q4k_scales(B + 4, sc, m);
    for (int s = 0; s < 8; s++) { o[32 + 8 * s + r] = (uint8_t)sc[s]; o[96 + 8 * s + r] = (uint8_t)m[s]; }
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 8; k++) memcpy(o + 160 + (8 * j + k) * 32 + 4 * r, qs + 32 * j + 4 * k, 4);
    if (q5)
        for (int k = 0; k < 8; k++) memcpy(o + KQ_Q4K_X8_BYTES + 32 * k + 4 * r, B + 16 + 4 * k, 4);
}

static void x8k_group_scalar(int q5, const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out,
                             int64_t ldo, int64_t r0, int nr) {
    const int gb = q5 ? KQ_Q5K_X8_BYTES : KQ_Q4K_X8_BYTES;
    for (int r = 0; r < nr; r++)
        for (int64_t t = 0; t < T; t++) {
            const kq_act256 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *o = grp + b * gb;
                int32_t isum = 0, msum = 0;
                for (int j = 0; j < 4; j++) {
                    int32_t lo = 0, hi = 0;
                    for (int k = 0; k < 8; k++)
                        for (int i = 0; i < 4; i++) {
                            uint8_t v = o[160 + (8 * j + k) * 32 + 4 * r + i];
                            uint8_t h = q5 ? o[KQ_Q4K_X8_BYTES + 32 * k + 4 * r + i] : 0;
                            lo += (int32_t)((v & 0xF) | ((h >> (2 * j)) & 1) << 4) * A[b].q[64 * j + 4 * k + i];
                            hi += (int32_t)((v >> 4) | ((h >> (2 * j + 1)) & 1) << 4) * A[b].q[64 * j + 32 + 4 * k + i];
                        }
                    isum += o[32 + 8 * (2 * j) + r] * lo + o[32 + 8 * (2 * j + 1) + r] * hi;
                }
                for (int s = 0; s < 8; s++) msum += o[96 + 8 * s + r] * (A[b].bsums[2 * s] + A[b].bsums[2 * s + 1]);
                float dd = kq_fp16_to_fp32(kq_ld16(o + 2 * r)) * A[b].d;
                float dm = kq_fp16_to_fp32(kq_ld16(o + 16 + 2 * r)) * A[b].d;
                acc = acc + dd * (float)isum;
                acc = acc - dm * (float)msum;
            }
            out[t * ldo + r0 + r] = acc;
        }
}

void kq_x8k_group_scalar(const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out,
                         int64_t ldo, int64_t r0, int nr) {
    x8k_group_scalar(0, grp, nb, act, T, out, ldo, r0, nr);
}

void kq_x8q5_group_scalar(const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out,
                          int64_t ldo, int64_t r0, int nr) {
    x8k_group_scalar(1, grp, nb, act, T, out, ldo, r0, nr);
}

/* Q6_K x8 super-block group (1680 bytes, as 8 rows of Q6_K): d[8] (fp16), the int8 scales as [group][row]
 * (128), the low-bit bytes ql in 4-byte row slices (32 slices), then the high-bit bytes qh likewise (16). */
static void fill_q6k(uint8_t *o, const blk_q6_K *B, int r) {
    memcpy(o + 2 * r, &B->d, 2);
    for (int s = 0; s < 16; s++) o[16 + 8 * s + r] = (uint8_t)B->scales[s];
    for (int s = 0; s < 32; s++) memcpy(o + 144 + 32 * s + 4 * r, B->ql + 4 * s, 4);
    for (int s = 0; s < 16; s++) memcpy(o + 1168 + 32 * s + 4 * r, B->qh + 4 * s, 4);
}

void kq_x8q6_group_scalar(const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out,
                          int64_t ldo, int64_t r0, int nr) {
    for (int r = 0; r < nr; r++)
        for (int64_t t = 0; t < T; t++) {
            const kq_act256 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *o = grp + b * KQ_Q6K_X8_BYTES;
                int32_t isum = 0;
                for (int e = 0; e < 256; e++) { /* element e of the row: half h, position l, part p */
                    int h = e / 128, l = e % 32, p = (e % 128) / 32;
                    int qlb = 64 * h + (p & 1) * 32 + l, qhb = 32 * h + l;
                    uint8_t qlv = o[144 + 32 * (qlb / 4) + 4 * r + qlb % 4], qhv = o[1168 + 32 * (qhb / 4) + 4 * r + qhb % 4];
                    int u = ((p & 2) ? qlv >> 4 : qlv & 0xF) | (((qhv >> (2 * p)) & 3) << 4);
                    isum += (int8_t)o[16 + 8 * (e / 16) + r] * (u - 32) * A[b].q[e];
                }
                float dd = kq_fp16_to_fp32(kq_ld16(o + 2 * r)) * A[b].d;
                acc = acc + dd * (float)isum;
            }
            out[t * ldo + r0 + r] = acc;
        }
}

/* IQ4_XS x8 super-block group (1104 bytes): d[8] (fp16), the signed 6-bit scales as int8 [sub-block][row] (64), then
 * the quants: sub-block j's 16 bytes in 4 slices of 4 bytes per row (slice 4j + k: bytes 16j + 4k.. of rows 0..7;
 * low nibbles are elements 4k.. of the sub-block, high nibbles 16 + 4k..) */
static void fill_iq4xs(uint8_t *o, const blk_iq4_xs *B, int r) {
    int32_t sc[8];
    kq_iq4xs_scales(B, sc);
    memcpy(o + 2 * r, &B->d, 2);
    for (int j = 0; j < 8; j++) o[16 + 8 * j + r] = (uint8_t)(int8_t)sc[j];
    for (int s = 0; s < 32; s++) memcpy(o + 80 + 32 * s + 4 * r, B->qs + 4 * s, 4);
}

void kq_x8iq4_row(const uint8_t *grp, int64_t nb, int r, uint8_t *row) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = grp + b * KQ_IQ4XS_X8_BYTES;
        blk_iq4_xs *B = (blk_iq4_xs *)row + b;
        uint16_t h = 0;
        memcpy(&B->d, o + 2 * r, 2);
        memset(B->scales_l, 0, 4);
        for (int j = 0; j < 8; j++) {
            const int ls = (int8_t)o[16 + 8 * j + r] + 32;
            B->scales_l[j / 2] |= (uint8_t)((ls & 0xF) << (4 * (j % 2)));
            h |= (uint16_t)((ls >> 4) << (2 * j));
        }
        memcpy(&B->scales_h, &h, 2);
        for (int s = 0; s < 32; s++) memcpy(B->qs + 4 * s, o + 80 + 32 * s + 4 * r, 4);
    }
}

void kq_x8iq4_group_scalar(const uint8_t *grp, int64_t nb, const kq_act256 *act, int64_t T, float *out,
                           int64_t ldo, int64_t r0, int nr) {
    for (int r = 0; r < nr; r++)
        for (int64_t t = 0; t < T; t++) {
            const kq_act256 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *o = grp + b * KQ_IQ4XS_X8_BYTES;
                int32_t isum = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t dot = 0;
                    for (int k = 0; k < 4; k++)
                        for (int i = 0; i < 4; i++) {
                            uint8_t v = o[80 + 32 * (4 * j + k) + 4 * r + i];
                            dot += kq_iq4_values[v & 0xF] * A[b].q[32 * j + 4 * k + i]
                                 + kq_iq4_values[v >> 4] * A[b].q[32 * j + 16 + 4 * k + i];
                        }
                    isum += (int8_t)o[16 + 8 * j + r] * dot;
                }
                float dd = kq_fp16_to_fp32(kq_ld16(o + 2 * r)) * A[b].d;
                acc = acc + dd * (float)isum;
            }
            out[t * ldo + r0 + r] = acc;
        }
}

/* the 32-element formats' group: the 8 scales (then Q4_1's 8 mins), then the quants in 4-byte row slices */
static void fill_b32(int qtype, uint8_t *o, const uint8_t *B, int r) {
    const int head = qtype == KQ_Q4_1 ? 4 : 2, qbytes = qtype == KQ_Q8_0 ? 32 : 16;
    memcpy(o + 2 * r, B, 2);                          /* d */
    if (head == 4) memcpy(o + 16 + 2 * r, B + 2, 2);  /* m */
    for (int k = 0; k < qbytes / 4; k++) memcpy(o + 8 * head + 32 * k + 4 * r, B + head + 4 * k, 4);
}

int kq_x8_block_elems(int qtype) {
    return qtype == KQ_Q4_K || qtype == KQ_Q5_K || qtype == KQ_Q6_K || qtype == KQ_IQ4_XS ? 256 : 32;
}

int kq_repack_x8(int qtype, const uint8_t *w, int64_t rows, int64_t n, uint8_t *out) {
    const int gb = kq_x8_block_bytes(qtype), bs = kq_x8_block_elems(qtype);
    const size_t rb = kq_row_bytes(qtype, n), bb = kq_row_bytes(qtype, bs);
    if (!gb || !rb || n % bs) return -1;
    int64_t nb = n / bs, groups = (rows + 7) / 8;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + ((size_t)g * nb + b) * gb;
            memset(o, 0, gb); /* rows past the end stay zero blocks */
            for (int r = 0; r < 8 && 8 * g + r < rows; r++) {
                const uint8_t *B = w + (8 * g + r) * rb + b * bb;
                switch (qtype) {
                case KQ_Q4_K: case KQ_Q5_K: fill_q45k(qtype == KQ_Q5_K, o, B, r); break;
                case KQ_Q6_K: fill_q6k(o, (const blk_q6_K *)B, r); break;
                case KQ_IQ4_XS: fill_iq4xs(o, (const blk_iq4_xs *)B, r); break;
                default: fill_b32(qtype, o, B, r); break;
                }
            }
        }
    return 0;
}

/* scalar reference on the x8 layout: the same per-row arithmetic as the row-layout scalar kernels */
void kq_x8_group_scalar(int qtype, const uint8_t *grp, int64_t nb, const kq_act32 *act, int64_t T,
                        float *out, int64_t ldo, int64_t r0, int nr) {
    int bb = kq_x8_block_bytes(qtype), head = qtype == KQ_Q4_1 ? 4 : 2;
    for (int r = 0; r < nr; r++)
        for (int64_t t = 0; t < T; t++) {
            const kq_act32 *A = act + t * nb;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *o = grp + b * bb, *oq = o + 8 * head;
                int32_t s = 0;
                if (qtype == KQ_Q8_0) {
                    for (int k = 0; k < 32; k++) s += (int32_t)(int8_t)oq[32 * (k / 4) + 4 * r + k % 4] * A[b].q[k];
                } else {
                    for (int j = 0; j < 16; j++) {
                        uint8_t v = oq[32 * (j / 4) + 4 * r + j % 4];
                        s += (int32_t)(v & 0xF) * A[b].q[j] + (int32_t)(v >> 4) * A[b].q[j + 16];
                    }
                    if (qtype == KQ_Q4_0) s -= 8 * A[b].sum;
                }
                float dd = kq_fp16_to_fp32(kq_ld16(o + 2 * r)) * A[b].d;
                acc = acc + dd * (float)s;
                if (qtype == KQ_Q4_1) acc = acc + kq_fp16_to_fp32(kq_ld16(o + 16 + 2 * r)) * (A[b].d * (float)A[b].sum);
            }
            out[t * ldo + r0 + r] = acc;
        }
}
