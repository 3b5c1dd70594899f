/* aarch64 NEON kernels chosen at run time: plain NEON (widening multiply + pairwise add) and NEON with
 * the dot-product extension (sdot; RK3588's Cortex-A76 has it, its A55 cores too). */
#if defined(__aarch64__)
#include <arm_neon.h>
#include "kq_internal.h"

/* sdot's lane structure without the extension: lane i gets the products of bytes 4i..4i+3 (the x8 kernels
 * rely on it). Two products fit int16 (|a|, |b| <= 128, one side <= 127). */
static inline int32x4_t dot16_mull(int32x4_t acc, int8x16_t a, int8x16_t b) {
    int16x8_t p0 = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    int16x8_t p1 = vmull_high_s8(a, b);
    return vpadalq_s16(acc, vpaddq_s16(p0, p1));
}

/* Scheduling fences: the sums given are complete before any later load. Without them clang and GCC hoist a tile's
 * loads and products across its steps and spill (bench/a76_model.py: the x8 and k_cols passes). */
#define VFENCE1(a) __asm__ volatile("" : "+w"(a) :: "memory")
#define VFENCE2(a, b) __asm__ volatile("" : "+w"(a), "+w"(b) :: "memory")
#define VFENCE4(a, b, c, d) __asm__ volatile("" : "+w"(a), "+w"(b), "+w"(c), "+w"(d) :: "memory")

#define SFX(n) n##_neon
#define DOT16(acc, a, b) dot16_mull((acc), (a), (b))
#define DOTL(acc, a, b, lane) dot16_mull((acc), (a), vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(b), lane)))
#include "matmul_neon.inc"
#define NC 4
#define NCW 8 /* the x8 prefill's wide pass (matmul_x8_neon.inc) */
#include "matmul_x8_neon.inc"
#undef NC
#undef NCW
#undef SFX
#undef DOT16
#undef DOTL

#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#define SFX(n) n##_neondot
#define DOT16(acc, a, b) vdotq_s32((acc), (a), (b))
#define DOTL(acc, a, b, lane) vdotq_laneq_s32((acc), (a), (b), lane) /* sdot by element: no broadcast load */
#include "matmul_neon.inc"
#define NC 4
#define NCW 8 /* the x8 prefill's wide pass (matmul_x8_neon.inc) */
#include "matmul_x8_neon.inc"
#undef NC
#undef NCW
#undef SFX
#undef DOT16
#undef DOTL
#pragma GCC pop_options
#endif
