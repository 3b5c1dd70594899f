/* x86_64 SIMD kernels, compiled with function-level target attributes and chosen at run time:
 * AVX2 (maddubs/madd integer dots) and AVX2 + AVX512-VNNI on 256-bit vectors (vpdpbusd); float-weight tiles
 * (matmul_float.inc) on 256-bit vectors at the AVX2 level and 512-bit ones at the AVX-512 level. */
#if defined(__x86_64__)
#include <immintrin.h>
#include "kq_internal.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SFX(n) n##_avx2
#define Q8_BIASED 0 /* maddubs would saturate on w + 128: sign trick instead */
#define DOT(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define DOTS(acc, u, s, s16, s32) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), (s16)))
#define VF __m256
#define VW 8
#define NCF 2 /* 8 accumulators + 4 weight vectors + x of the 16 registers (3 columns spill one) */
#define VZERO() _mm256_setzero_ps()
#define VLDX(p) _mm256_loadu_ps(p)
#define VSTX(p, v) _mm256_storeu_ps((p), (v))
#define VFMA(a, w, x) _mm256_fmadd_ps((w), (x), (a))
#define VHSUM4(o, a, b, c, d) fsum4_avx2((o), (a), (b), (c), (d))
#define WLD_F32(p) _mm256_loadu_ps((const float *)(p))
#define WLD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define WLD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VSET1(f) _mm256_set1_ps(f)
#define PVR 3 /* 12 accumulators + 3 broadcasts + 1 value vector */
#define PVC 4
/* o[0..3] = lane sums of a, b, c, d, each paired as (l0 + l4) + (l2 + l6) + ((l1 + l5) + (l3 + l7)): halves, then
 * lanes two apart, then neighbours, the four vectors transposed in registers as they shrink (13 operations) */
static inline void fsum4_avx2(float *o, __m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ac = _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20), _mm256_permute2f128_ps(a, c, 0x31)); /* [a | c] */
    __m256 bd = _mm256_add_ps(_mm256_permute2f128_ps(b, d, 0x20), _mm256_permute2f128_ps(b, d, 0x31));
    __m256 s = _mm256_add_ps(_mm256_shuffle_ps(ac, bd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(ac, bd, _MM_SHUFFLE(3, 2, 3, 2))); /* [a a b b | c c d d] */
    s = _mm256_add_ps(_mm256_shuffle_ps(s, s, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(s, s, _MM_SHUFFLE(3, 1, 3, 1)));
    __m128d lo = _mm_castps_pd(_mm256_castps256_ps128(s)), hi = _mm_castps_pd(_mm256_extractf128_ps(s, 1));
    _mm_storeu_ps(o, _mm_castpd_ps(_mm_unpacklo_pd(lo, hi))); /* [a b a b], [c d c d] -> [a b c d] */
}
#include "matmul_x86.inc"
#define NC 4
#include "matmul_x8_x86.inc"
#undef NC
#undef SFX
#undef DOT
#undef DOTS
#undef Q8_BIASED
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define SFX(n) n##_avx2vnni
#define KQ_VEC512 1 /* decode columns of Q8_0 / Q4_0 on 512-bit vectors (matmul_x86_vec512.inc) */
#define Q8_BIASED 1 /* vpdpbusd sums in 32 bits: (w + 128) . y - 128 sum(y) */
#define DOT(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define DOTS(acc, u, s, s16, s32) _mm256_add_epi32((acc), _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s)), (s32)))
#define VF __m512
#define VW 16
#define NCF 6 /* 24 accumulators + 4 weight vectors of the 32 registers */
#define VZERO() _mm512_setzero_ps()
#define VLDX(p) _mm512_loadu_ps(p)
#define VSTX(p, v) _mm512_storeu_ps((p), (v))
#define VFMA(a, w, x) _mm512_fmadd_ps((w), (x), (a))
#define VHSUM4(o, a, b, c, d) fsum4_avx512((o), (a), (b), (c), (d))
#define WLD_F32(p) _mm512_loadu_ps((const float *)(p))
#define WLD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define WLD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VSET1(f) _mm512_set1_ps(f)
#define PVR 6 /* 24 accumulators + 6 broadcasts + 1 value vector */
#define PVC 4
/* o[0..3] = lane sums of a, b, c, d, paired like _mm512_reduce_add_ps (256-bit halves, 128-bit quarters, lanes two
 * apart, neighbours), the four vectors transposed in registers as they shrink (14 operations for four sums) */
static inline void fsum4_avx512(float *o, __m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee)); /* [a a b b] */
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
    __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd)); /* [a b c d] */
    z = _mm512_add_ps(z, _mm512_shuffle_ps(z, z, _MM_SHUFFLE(1, 0, 3, 2)));
    z = _mm512_add_ps(z, _mm512_shuffle_ps(z, z, _MM_SHUFFLE(2, 3, 0, 1)));
    __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0); /* lane 0 of each quarter */
    _mm_storeu_ps(o, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, z)));
}
#include "matmul_x86.inc"
#define NC 8 /* 32 vector registers: 8 columns per pass over the weights */
#include "matmul_x8_x86.inc"
#undef NC
#undef SFX
#undef DOT
#undef DOTS
#undef Q8_BIASED
#undef KQ_VEC512
#pragma GCC pop_options
#endif
