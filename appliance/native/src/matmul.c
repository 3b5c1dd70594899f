/* Quantized and float matrix products out (T, rows) = x (T, n) @ W.T, W given as GGML rows.
 * The row range is split across the pool in tiles of 4 rows; a tile kernel walks all T columns, so a
 * tile's weights are read from memory once and reused from cache.
 * The scalar kernels (matmul_scalar.c) define the arithmetic that the SIMD kernels and the numpy twins reproduce. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "kq_internal.h"

#if defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

/* ---------------- dispatch ---------------- */

/* One filled table per level, built once (pthread_once) before any kernel runs; the level in use is an atomic
 * pointer to one of them, so a change of level (tests, benches) never exposes a half-filled table to a
 * thread in the middle of a product, and two threads making their first call at once cannot see an empty one. */
static kq_kernels tables[3];
static _Atomic(const kq_kernels *) active;
static _Atomic int level;
static int level_max;
static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
#define K (*atomic_load_explicit(&active, memory_order_acquire))

static void detect_now(void) {
    level_max = KQ_SCALAR;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        level_max = KQ_SIMD;
        if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("avx512bw"))
            level_max = KQ_SIMD_DOT;
    }
#elif defined(__aarch64__)
    level_max = KQ_SIMD;
    if (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) level_max = KQ_SIMD_DOT;
#endif
    for (int l = 0; l <= level_max; l++) {
        kq_kernels_scalar(&tables[l]);
#if defined(__x86_64__)
        if (l == KQ_SIMD) kq_kernels_avx2(&tables[l]);
        if (l == KQ_SIMD_DOT) kq_kernels_avx2vnni(&tables[l]);
#elif defined(__aarch64__)
        if (l == KQ_SIMD) kq_kernels_neon(&tables[l]);
        if (l == KQ_SIMD_DOT) kq_kernels_neondot(&tables[l]);
#endif
    }
    const char *env = getenv("KESTREL_SIMD");
    int want = env && *env ? atoi(env) : level_max;
    want = want > level_max ? level_max : want < 0 ? 0 : want;
    atomic_store(&level, want);
    atomic_store_explicit(&active, &tables[want], memory_order_release);
}

static void detect(void) { pthread_once(&detect_once, detect_now); }

int kq_set_simd_level(int want) {
    detect();
    want = want > level_max ? level_max : want < 0 ? 0 : want;
    atomic_store(&level, want);
    atomic_store_explicit(&active, &tables[want], memory_order_release);
    return want;
}

int kq_simd_level(void) { detect(); return level; }
int kq_simd_max(void) { detect(); return level_max; }

const char *kq_simd_name(void) {
    detect();
#if defined(__x86_64__)
    static const char *names[] = {"scalar", "avx2", "avx2+avx512vnni"};
#elif defined(__aarch64__)
    static const char *names[] = {"scalar", "neon", "neon+dotprod"};
#else
    static const char *names[] = {"scalar", "scalar", "scalar"};
#endif
    return names[level];
}

int kq_abi_version(void) { return 8; } /* 8: kq_causal_conv1d; 7: byte counts in kq_linear, kq_moe; 2: kq_layer.moe;
                                                3: float16 KV caches; 4: Q5_K; 5: Q5_0, Q5_1, IQ4_NL; 6: Q2_K, Q3_K, IQ4_XS */

void kq_quantize_q8_32(const float *x, int64_t T, int64_t n, kq_act32 *out) {
    detect();
    K.quant32(x, T, n, out);
}

/* ---------------- driver ---------------- */

void kq_f32_dots(const float *rows, int64_t nrows, int64_t n, const float *x, float *out) {
    detect();
    for (int64_t r0 = 0; r0 < nrows; r0 += 4)
        K.f32((const uint8_t *)rows, (size_t)n * 4, r0, nrows - r0 < 4 ? (int)(nrows - r0) : 4, n, x, 0, 1, out, nrows);
}

void kq_f32_tiles(const float *rows, int64_t nrows, int64_t n, const float *x, int64_t T, float *out, int64_t ldo) {
    detect();
    for (int64_t r0 = 0; r0 < nrows; r0 += 4)
        K.f32((const uint8_t *)rows, (size_t)n * 4, r0, nrows - r0 < 4 ? (int)(nrows - r0) : 4, n, x, 0, T, out, ldo);
}

void kq_f16_tiles(const uint16_t *rows, int64_t nrows, int64_t n, const float *x, int64_t T, float *out, int64_t ldo) {
    detect();
    for (int64_t r0 = 0; r0 < nrows; r0 += 4)
        K.f16((const uint8_t *)rows, (size_t)n * 2, r0, nrows - r0 < 4 ? (int)(nrows - r0) : 4, n, x, 0, T, out, ldo);
}

void kq_pv_tiles(int f16, const float *p, int64_t ldp, int64_t nrows, const void *V, int64_t m, int64_t hd, float *o,
                 int64_t ldo) {
    detect();
    (f16 ? K.pv_f16 : K.pv_f32)(p, ldp, nrows, V, m, hd, o, ldo);
}

typedef struct {
    kq_tile_fn fn;
    const uint8_t *w;
    size_t rb;
    int64_t rows, nb, T, tb;
    const void *act;
    float *out;
} mm_ctx;

/* Policy (cache blocking): with float weights (F32, F16, BF16: float activations, 4 bytes per element) a task's
 * row tiles run over one block of tb columns at a time, the block's activations (at most KQ_ACT_BLOCK_BYTES) staying
 * in L2 while every row tile of the task reads them. Without it each 4-row tile streamed all T columns from L3 or
 * memory: a 784-patch vision product reads 3.2 MB of activations per 4 rows, bound near 2 flops per byte of L3
 * (58 -> 110-145 GFLOP/s on one Xeon core). The quantized tiles keep one pass over all T: their activations are a
 * quarter the size and each call unpacks its weights once for all its columns, so blocking measured 3-7% slower at
 * 256 tokens. Each output is still computed by the same tile code over the same k: the numbers do not change. */
#define KQ_ACT_BLOCK_BYTES (256 * 1024) /* half the A76's L2 */

static void mm_task(void *c_, int64_t a, int64_t b) { /* row tiles a .. b-1 */
    const mm_ctx *c = c_;
    for (int64_t t0 = 0; t0 < c->T; t0 += c->tb) {
        int64_t t1 = t0 + c->tb < c->T ? t0 + c->tb : c->T;
        for (int64_t i = a; i < b; i++) {
            int64_t r0 = 4 * i;
            int nr = c->rows - r0 < 4 ? (int)(c->rows - r0) : 4;
            if (i + KQ_PF_TILES < b) kq_prefetch_rows(c->w, c->rb, r0 + 4 * KQ_PF_TILES, c->rows);
            c->fn(c->w, c->rb, r0, nr, c->nb, c->act, t0, t1, c->out, c->rows);
        }
    }
}

static int64_t column_block(size_t act_row_bytes, int64_t T) { /* a multiple of 12 (whole tiles of 2, 4 and 6) */
    int64_t tb = (int64_t)(KQ_ACT_BLOCK_BYTES / (act_row_bytes ? act_row_bytes : 1)) / 12 * 12;
    return tb < 12 ? 12 : tb > T ? T : tb;
}

typedef struct { const float *x; int64_t n; void *out; int k; } aq_ctx;

static void aq_task(void *c_, int64_t a, int64_t b) { /* quantize activation rows a .. b-1 */
    const aq_ctx *c = c_;
    if (c->k) kq_quantize_q8_K(c->x + a * c->n, b - a, c->n, (kq_act256 *)c->out + a * (c->n / 256));
    else kq_quantize_q8_32(c->x + a * c->n, b - a, c->n, (kq_act32 *)c->out + a * (c->n / 32));
}

static void quantize_act(const float *x, int64_t T, int64_t n, void *out, int k) {
    aq_ctx c = {x, n, out, k};
    if (T * n < 65536) aq_task(&c, 0, T); /* small: not worth waking the pool */
    else kq_parallel_for(T, kq_chunk_for(T), aq_task, &c);
}

typedef struct {
    int qtype;
    const uint8_t *w;
    size_t gbytes;
    int64_t rows, nb, T;
    const void *act;
    float *out;
} x8_ctx;

/* IQ4_XS groups from K.x8iq4_row_t columns on (the AVX2 level's choice, matmul_x86.inc): the row-layout tiles over the
 * group's rows copied back out of the x8 layout into a per-thread buffer (the same results). */
static int x8iq4_by_rows(const x8_ctx *c, int64_t g, int64_t r0, int nr) {
    const size_t rb = (size_t)c->nb * sizeof(blk_iq4_xs);
    uint8_t *rows = kq_scratch(4, 8 * rb);
    if (!rows) return 0; /* the x8 kernel then */
    const uint8_t *grp = c->w + (size_t)g * c->gbytes;
    for (int r = 0; r < nr; r++) kq_x8iq4_row(grp, c->nb, r, rows + r * rb);
    for (int r = 0; r < nr; r += 4)
        K.iq4_xs(rows + r * rb, rb, 0, nr - r < 4 ? nr - r : 4, c->nb, c->act, 0, c->T, c->out + r0 + r, c->rows);
    return 1;
}

/* row groups a .. b-1; no prefetch of whole groups here (one contiguous stream: a burst per group measured
 * slower than the hardware prefetcher alone); the decode kernels fetch a stream ahead block by block */
static void x8_task(void *c_, int64_t a, int64_t b) {
    const x8_ctx *c = c_;
    const kq_x8k_fn k256 = c->qtype == KQ_Q4_K ? K.x8k : c->qtype == KQ_Q5_K ? K.x8q5 : c->qtype == KQ_Q6_K ? K.x8q6
                         : c->qtype == KQ_IQ4_XS ? K.x8iq4 : NULL; /* NULL: a 32-element format */
    for (int64_t g = a; g < b; g++) {
        int64_t r0 = 8 * g;
        int nr = c->rows - r0 < 8 ? (int)(c->rows - r0) : 8;
        const uint8_t *grp = c->w + (size_t)g * c->gbytes;
        if (c->qtype == KQ_IQ4_XS && K.x8iq4_row_t && c->T >= K.x8iq4_row_t && x8iq4_by_rows(c, g, r0, nr))
            continue;
        if (k256) k256(grp, c->nb, (const kq_act256 *)c->act, c->T, c->out, c->rows, r0, nr);
        else K.x8(c->qtype, grp, c->nb, c->act, c->T, c->out, c->rows, r0, nr);
    }
}

static int matmul_x8(int qtype, const uint8_t *w, int64_t rows, int64_t n, const float *x, int64_t T, float *out) {
    int bb = kq_x8_block_bytes(qtype), bs = kq_x8_block_elems(qtype);
    if (!bb || n % bs || rows <= 0 || T <= 0) return -1;
    x8_ctx c = {.qtype = qtype, .w = w, .rows = rows, .nb = n / bs, .T = T, .out = out};
    c.gbytes = (size_t)c.nb * bb;
    size_t ab = bs == 256 ? sizeof(kq_act256) : sizeof(kq_act32);
    void *scratch = kq_scratch(0, (size_t)(T * c.nb) * ab);
    if (!scratch) return -2;
    quantize_act(x, T, n, scratch, bs == 256);
    c.act = scratch;
    int64_t groups = (rows + 7) / 8;
    kq_parallel_for(groups, kq_chunk_for(groups), x8_task, &c);
    return 0;
}

kq_tile_fn kq_tile_kernel(int qtype, int *act_kind) {
    detect();
    switch (qtype) {
    case KQ_F32: *act_kind = KQ_ACT_F32; return K.f32;
    case KQ_F16: *act_kind = KQ_ACT_F32; return K.f16;
    case KQ_BF16: *act_kind = KQ_ACT_F32; return K.bf16;
    case KQ_Q8_0: *act_kind = KQ_ACT_Q32; return K.q8_0;
    case KQ_Q4_0: *act_kind = KQ_ACT_Q32; return K.q4_0;
    case KQ_Q4_1: *act_kind = KQ_ACT_Q32; return K.q4_1;
    case KQ_Q5_0: *act_kind = KQ_ACT_Q32; return K.q5_0;
    case KQ_Q5_1: *act_kind = KQ_ACT_Q32; return K.q5_1;
    case KQ_IQ4_NL: *act_kind = KQ_ACT_Q32; return K.iq4_nl;
    case KQ_Q2_K: *act_kind = KQ_ACT_Q256; return K.q2_K;
    case KQ_Q3_K: *act_kind = KQ_ACT_Q256; return K.q3_K;
    case KQ_Q4_K: *act_kind = KQ_ACT_Q256; return K.q4_K;
    case KQ_Q5_K: *act_kind = KQ_ACT_Q256; return K.q5_K;
    case KQ_Q6_K: *act_kind = KQ_ACT_Q256; return K.q6_K;
    case KQ_IQ4_XS: *act_kind = KQ_ACT_Q256; return K.iq4_xs;
    default: return NULL;
    }
}

size_t kq_act_row_bytes(int act_kind, int64_t n) {
    return act_kind == KQ_ACT_Q32 ? (size_t)(n / 32) * sizeof(kq_act32)
         : act_kind == KQ_ACT_Q256 ? (size_t)(n / 256) * sizeof(kq_act256) : (size_t)n * sizeof(float);
}

void kq_prepare_act(int act_kind, const float *x, int64_t T, int64_t n, void *out) {
    if (act_kind == KQ_ACT_F32) memcpy(out, x, (size_t)(T * n) * sizeof(float));
    else quantize_act(x, T, n, out, act_kind == KQ_ACT_Q256);
}

int kq_matmul(int qtype, const uint8_t *w, int64_t rows, int64_t n, const float *x, int64_t T, float *out) {
    detect();
    if (qtype & KQ_X8) return matmul_x8(qtype & ~KQ_X8, w, rows, n, x, T, out);
    size_t rb = kq_row_bytes(qtype, n);
    if (!rb || rows <= 0 || T <= 0) return -1;
    int ak;
    kq_tile_fn fn = kq_tile_kernel(qtype, &ak); /* the activations it reads: float rows, act32 or act256 blocks */
    if (!fn) return -1;
    mm_ctx c = {.fn = fn, .w = w, .rb = rb, .rows = rows, .T = T, .out = out, .act = x,
                .nb = ak == KQ_ACT_Q32 ? n / 32 : ak == KQ_ACT_Q256 ? n / 256 : n,
                .tb = ak == KQ_ACT_F32 ? column_block(kq_act_row_bytes(ak, n), T) : T};
    if (ak != KQ_ACT_F32) {
        void *scratch = kq_scratch(0, (size_t)T * kq_act_row_bytes(ak, n));
        if (!scratch) return -2;
        quantize_act(x, T, n, scratch, ak == KQ_ACT_Q256);
        c.act = scratch;
    }
    int64_t tiles = (rows + 3) / 4;
    kq_parallel_for(tiles, kq_chunk_for(tiles), mm_task, &c);
    return 0;
}
