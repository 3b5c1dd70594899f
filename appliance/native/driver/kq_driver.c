/* Test driver: serves the kernel entry points over stdin/stdout so the Python tests can exercise a
 * library built for another architecture under qemu user-mode emulation (tests/support/kernel_driver.py).
 * Request: int64 op, then op arguments (int64) and payloads; reply: int64 byte count, then the bytes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../src/kq.h"

static void rd(void *p, size_t n) { if (n && fread(p, 1, n, stdin) != n) exit(0); }
static int64_t rd64(void) { int64_t v; rd(&v, 8); return v; }
static void *rdbuf(size_t n) { void *p = malloc(n ? n : 1); rd(p, n); return p; }
static void reply(const void *p, int64_t n) { fwrite(&n, 8, 1, stdout); fwrite(p, 1, (size_t)n, stdout); fflush(stdout); }
static void reply_int(int64_t v) { reply(&v, 8); }

enum { OP_MATMUL = 1, OP_Q8_32, OP_Q8_K, OP_DEQUANT, OP_GET_ROWS, OP_SET_SIMD, OP_SIMD_MAX, OP_SET_THREADS,
       OP_GET_THREADS, OP_SIMD_NAME, OP_REPACK_X8, OP_ATTENTION };

int main(void) {
    for (;;) {
        int64_t op = rd64();
        switch (op) {
        case OP_MATMUL: {
            int64_t qt = rd64(), rows = rd64(), n = rd64(), T = rd64(), wb = rd64();
            uint8_t *w = rdbuf((size_t)wb);
            float *x = rdbuf((size_t)(T * n) * 4), *out = malloc((size_t)(T * rows) * 4);
            kq_matmul((int)qt, w, rows, n, x, T, out);
            reply(out, T * rows * 4);
            free(w); free(x); free(out);
            break;
        }
        case OP_Q8_32: case OP_Q8_K: {
            int64_t T = rd64(), n = rd64();
            float *x = rdbuf((size_t)(T * n) * 4);
            size_t sz = op == OP_Q8_32 ? (size_t)(T * (n / 32)) * sizeof(kq_act32) : (size_t)(T * (n / 256)) * sizeof(kq_act256);
            void *out = malloc(sz ? sz : 1);
            if (op == OP_Q8_32) kq_quantize_q8_32(x, T, n, out); else kq_quantize_q8_K(x, T, n, out);
            reply(out, (int64_t)sz);
            free(x); free(out);
            break;
        }
        case OP_DEQUANT: case OP_GET_ROWS: {
            int64_t qt = rd64(), rows = rd64(), n = rd64(), wb = rd64(), T = op == OP_GET_ROWS ? rd64() : rows;
            uint8_t *w = rdbuf((size_t)wb);
            int64_t *ids = op == OP_GET_ROWS ? rdbuf((size_t)T * 8) : NULL;
            float *out = malloc((size_t)(T * n) * 4 + 1);
            if (op == OP_DEQUANT) kq_dequantize((int)qt, w, rows, n, out); else kq_get_rows((int)qt, w, n, ids, T, out);
            reply(out, T * n * 4);
            free(w); free(ids); free(out);
            break;
        }
        case OP_REPACK_X8: {
            int64_t qt = rd64(), rows = rd64(), n = rd64(), wb = rd64();
            uint8_t *w = rdbuf((size_t)wb);
            int64_t ob = ((rows + 7) / 8) * (qt == KQ_Q4_K ? (n / 256) * KQ_Q4K_X8_BYTES : (int64_t)kq_row_bytes((int)qt, n) * 8);
            uint8_t *out = malloc((size_t)ob + 1);
            kq_repack_x8((int)qt, w, rows, n, out);
            reply(out, ob);
            free(w); free(out);
            break;
        }
        case OP_ATTENTION: { /* q (T, H, hd) float32, caches (KV, L, hd) of float32 or float16 */
            int64_t T = rd64(), S = rd64(), H = rd64(), KV = rd64(), L = rd64(), hd = rd64(), f16 = rd64();
            size_t cb = (size_t)(KV * L * hd) * (f16 ? 2 : 4);
            float *q = rdbuf((size_t)(T * H * hd) * 4);
            int64_t *res = malloc(8 + (size_t)(T * H * hd) * 4); /* the status, then out (T, H, hd) */
            void *kc = rdbuf(cb), *vc = rdbuf(cb);
            res[0] = kq_attention(q, kc, vc, L, T, S, H, KV, hd, (int)f16, (float *)(res + 1));
            reply(res, 8 + T * H * hd * 4);
            free(q); free(res); free(kc); free(vc);
            break;
        }
        case OP_SET_SIMD: reply_int(kq_set_simd_level((int)rd64())); break;
        case OP_SIMD_MAX: reply_int(kq_simd_max()); break;
        case OP_SET_THREADS: reply_int(kq_set_threads((int)rd64(), NULL, 0)); break;
        case OP_GET_THREADS: reply_int(kq_get_threads()); break;
        case OP_SIMD_NAME: { const char *s = kq_simd_name(); reply(s, (int64_t)strlen(s)); break; }
        default: return 2;
        }
    }
}
