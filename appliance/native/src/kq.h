/* Kestrel native kernels: the public entry points (loaded with ctypes, native/kernels.py) and the structs they
 * share with Python (native/abi.py). The library's own internals are in kq_internal.h.
 *
 * Policy: every entry point has a numpy twin of the same name (without the kq_ prefix) in
 * appliance/native/twins.py or dequant_numpy.py. Quantized products round the activations to 8-bit blocks
 * (act32 for the 32-element formats, act256 for the K formats) and sum integers exactly; the float
 * combination of a row is one sequential float32 sum per output (no FMA, no reassociation), so every SIMD
 * level and the numpy twin give bit-identical results.
 */
#ifndef KQ_H
#define KQ_H
#include <stdint.h>
#include <stddef.h>

enum { KQ_F32 = 0, KQ_F16 = 1, KQ_Q4_0 = 2, KQ_Q4_1 = 3, KQ_Q5_0 = 6, KQ_Q5_1 = 7, KQ_Q8_0 = 8, KQ_Q2_K = 10,
       KQ_Q3_K = 11, KQ_Q4_K = 12, KQ_Q5_K = 13, KQ_Q6_K = 14, KQ_IQ4_NL = 20, KQ_IQ4_XS = 23, KQ_BF16 = 30 };
enum { KQ_SCALAR = 0, KQ_SIMD = 1, KQ_SIMD_DOT = 2 }; /* x86: AVX2, AVX2+VNNI; arm: NEON, NEON+dotprod */

typedef struct { float d; int32_t sum; int8_t q[32]; } kq_act32;       /* 40 bytes */
typedef struct { float d; int16_t bsums[16]; int8_t q[256]; } kq_act256; /* 292 bytes */

/* ---- public API ---- */
int64_t kq_struct_size(int which); /* abi.py: the C size of each struct shared with ctypes */
int kq_abi_version(void);
int kq_simd_level(void);           /* level in use */
int kq_simd_max(void);             /* best level this CPU supports */
int kq_set_simd_level(int level);  /* clamp to [0, max]; returns the level now in use */
const char *kq_simd_name(void);
int kq_set_threads(int n, const int *cpus, int ncpus); /* cpus may be NULL: no pinning */
int kq_get_threads(void);

void kq_quantize_q8_32(const float *x, int64_t T, int64_t n, kq_act32 *out);
void kq_quantize_q8_K(const float *x, int64_t T, int64_t n, kq_act256 *out);
int kq_dequantize(int qtype, const uint8_t *w, int64_t rows, int64_t n, float *out);
int kq_get_rows(int qtype, const uint8_t *w, int64_t n, const int64_t *ids, int64_t T, float *out);
int kq_matmul(int qtype, const uint8_t *w, int64_t rows, int64_t n, const float *x, int64_t T, float *out);
size_t kq_row_bytes(int qtype, int64_t n); /* bytes of one row of n elements */
/* the x8 layout (repack.c): groups of 8 interleaved rows, which kq_matmul reads with qtype | KQ_X8 */
#define KQ_X8 0x100 /* qtype flag: weights in the x8 layout */
int kq_x8_block_bytes(int qtype); /* bytes of 8 rows' block (0: no x8 layout) */
int kq_x8_block_elems(int qtype); /* elements per row of that block: 256 for the K formats, else 32 */
int kq_repack_x8(int qtype, const uint8_t *w, int64_t rows, int64_t n, uint8_t *out);
#define KQ_Q6K_X8_BYTES 1680 /* one Q6_K super-block of 8 rows in the x8 layout */
#define KQ_Q4K_X8_BYTES 1184 /* one Q4_K super-block of 8 rows in the x8 layout */
#define KQ_IQ4XS_X8_BYTES 1104 /* one IQ4_XS super-block of 8 rows: d[8], int8 scales [sub-block][row], quants */
#define KQ_Q5K_X8_BYTES 1440 /* one Q5_K super-block of 8 rows: Q4_K's x8 group, then the fifth bits' slices */

/* decoder operations (ops.c) */
/* the routed experts of a mixture-of-experts MLP (moe.c): per-expert row pointers, read in place */
typedef struct {
    int64_t n_experts, top_k, hidden, inter;
    int32_t norm_topk, gate_qtype, up_qtype, down_qtype;
    const float *router;                                       /* (n_experts, hidden) */
    const uint8_t *const *gate, *const *up, *const *down;      /* per expert: (inter, hidden) x2, (hidden, inter) */
    int32_t *counts;                                           /* out, may be NULL: tokens per expert last call */
    const int64_t *gate_bytes, *up_bytes, *down_bytes;         /* per expert: its matrix's bytes (checked) */
} kq_moe;
int kq_moe_ffn(const kq_moe *m, const float *x, int64_t T, float *out);
typedef struct { int32_t qtype, pad; const uint8_t *w; int64_t rows, n, nbytes; } kq_linear; /* nbytes: of w (checked) */
typedef struct {
    kq_linear q, k, v, o, gate, up, down;
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm, *q_bias, *k_bias, *v_bias; /* last 5 may be NULL */
    const kq_moe *moe; /* non-NULL: the MLP is these routed experts (gate, up, down unused) */
} kq_layer;
typedef struct {
    int64_t n_layers, hidden, n_heads, n_kv, head_dim, inter;
    float eps;
    int32_t pad;
    const kq_layer *layers;
} kq_model;
void kq_rms_norm(const float *x, const float *w, int64_t T, int64_t n, float eps, float *out);
void kq_rope(float *x, int64_t T, int64_t nh, int64_t hd, const float *cos, const float *sin);
void kq_swiglu(const float *g, const float *u, int64_t n, float *out);
/* caches (KV, max_len, hd) of float32, or of IEEE half when kv_f16 (read as stored, computed in float32) */
int kq_attention(const float *q, const void *kc, const void *vc, int64_t max_len, int64_t T, int64_t S,
                 int64_t H, int64_t KV, int64_t hd, int kv_f16, float *out);
/* every layer of m over the T tokens h (T, hidden), in place, at positions pos.. of the caches; 0, or the first
 * failing status (-1 refused shape, -2 failed allocation, -3 past max_len): nothing runs after a failure, and
 * nothing at all when a linear's (rows, n) is not the model's or its nbytes not rows x n of its type (in its
 * layout), or an MoE layer's hidden size is not the model's (kq_moe_ffn checks its experts' bytes likewise) */
int kq_forward(const kq_model *m, void *const *k_cache, void *const *v_cache, int64_t max_len, int kv_f16,
               float *h, int64_t T, int64_t pos, const float *cos, const float *sin);

/* Qwen3.5's gated delta rule (delta.c): q, k (T, nh, dk), v, out (T, nh, dv), g, beta (T, nh), state (nh, dk, dv) */
int kq_gated_delta_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                        int64_t T, int64_t nh, int64_t dk, int64_t dv, float *state, float *out);
int kq_gated_delta_chunked(const float *q, const float *k, const float *v, const float *g, const float *beta,
                           int64_t T, int64_t nh, int64_t dk, int64_t dv, float *state, int64_t chunk, float *out);
/* its causal depthwise conv1d then SiLU: x, out (T, C), state (K-1, C) replaced by the last K-1 inputs, w (C, K);
 * 0, or -1 for a negative size or K < 1, -2 when the scratch cannot be allocated (before anything is written) */
int kq_causal_conv1d(const float *x, float *state, const float *w, int64_t T, int64_t C, int64_t K, float *out);

/* vision tower operations (vision.c) */
void kq_layer_norm(const float *x, const float *w, const float *b, int64_t T, int64_t n, float eps, float *out);
void kq_gelu_tanh(const float *x, int64_t n, float *out);
int kq_self_attention(const float *qkv, int64_t N, int64_t H, int64_t hd, const float *cos, const float *sin,
                      float *out);

/* test hook (tests/native/test_native_decoder.py): n > 0 arms it, the n-th scratch request from now fails as a
 * failed allocation would and every request is counted; n <= 0 disarms it. Returns the requests counted since the
 * previous call. */
int64_t kq_test_fail_alloc(int64_t n);

/* The busy responder (busy_responder.c): a thread, outside the Python GIL, that accepts what waits `grace_ms` in
 * the backlog of the listening sockets `fds` and answers it with `response` (copied), then closes it; for while
 * the interpreter is held by a model's load. Returns 0 or -errno. kq_busy_stop joins it (the sockets must stay
 * open until then) and returns how many connections it answered. */
int kq_busy_start(const int *fds, int nfds, int grace_ms, const char *response, int64_t response_len);
int64_t kq_busy_stop(void);
/* The busy responder's watchdog: while it runs, "WATCHDOG=1" to the AF_UNIX datagram address `addr` (addr_len
 * bytes, a leading NUL for an abstract one) every interval_ms. addr NULL or interval_ms <= 0 turns it off and
 * returns the pings sent since it was set; otherwise 0 or -errno. */
int64_t kq_busy_watchdog(const char *addr, int addr_len, int interval_ms);

#endif
