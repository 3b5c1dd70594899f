/* x86_64 SIMD kernels, compiled with function-level target attributes and chosen at run time:
 * AVX2 (maddubs/madd integer dots) and AVX2 + AVX512-VNNI on 256-bit vectors (vpdpbusd). */
#if defined(__x86_64__)
#include <immintrin.h>
#include "kq.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SFX(n) n##_avx2
#define Q8_BIASED 0 /* maddubs would saturate on w + 128: sign trick instead */
#define DOT(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define DOTS(acc, u, s, s16, s32) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), (s16)))
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
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#define SFX(n) n##_avx2vnni
#define Q8_BIASED 1 /* vpdpbusd sums in 32 bits: (w + 128) . y - 128 sum(y) */
#define DOT(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define DOTS(acc, u, s, s16, s32) _mm256_add_epi32((acc), _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s)), (s32)))
#include "matmul_x86.inc"
#define NC 8 /* 32 vector registers: 8 columns per pass over the weights */
#include "matmul_x8_x86.inc"
#undef NC
#undef SFX
#undef DOT
#undef DOTS
#undef Q8_BIASED
#pragma GCC pop_options
#endif
