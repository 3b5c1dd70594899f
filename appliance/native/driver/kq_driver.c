/* Test driver: serves the library's entry points over stdin/stdout so the Python tests can run the same
 * ctypes wrappers (appliance/native/kernels.py) against a library built for another architecture under qemu
 * user-mode emulation: tests/support/kernel_driver.py's DriverLib stands in for the ctypes library, copies
 * each pointer argument's bytes here and the outputs back.
 *
 * Request: int64 name length, the entry point's name, int64 count + that many int64 scalars (a float argument
 * travels as its float32 bits), int64 count + that many (int64 bytes, int64 direction) buffer headers, then the
 * bytes of every buffer whose direction is IN or INOUT, in order. Reply: int64 byte count, then int64 status
 * (the entry point's return value, 0 for void), then the bytes of every OUT and INOUT buffer, in order.
 * Policy: OUT buffers start as all-ones bytes (NaN as float32), so an output the kernel never writes shows up
 * as a wrong answer; kq_set_threads never pins (the emulated threads run on the host's CPUs); kq_moe_ffn's
 * struct is rebuilt here from its scalars and buffers (router, byte counts, 3 x E expert matrices, counts). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../src/kq.h"

enum { IN = 0, OUT = 1, INOUT = 2 };
#define MAXS 16
#define MAXB 4096

static void rd(void *p, size_t n) { if (n && fread(p, 1, n, stdin) != n) exit(0); }
static int64_t rd64(void) { int64_t v; rd(&v, 8); return v; }
static float f32_of(int64_t bits) { uint32_t u = (uint32_t)bits; float f; memcpy(&f, &u, 4); return f; }

int main(void) {
    static int64_t s[MAXS], nbytes[MAXB], dir[MAXB];
    static uint8_t *b[MAXB];
    for (;;) {
        char name[64] = {0};
        int64_t len = rd64();
        if (len <= 0 || len >= (int64_t)sizeof name) return 2;
        rd(name, (size_t)len);
        int64_t ns = rd64();
        if (ns < 0 || ns > MAXS) return 2;
        for (int64_t i = 0; i < ns; i++) s[i] = rd64();
        int64_t nb = rd64();
        if (nb < 0 || nb > MAXB) return 2;
        for (int64_t i = 0; i < nb; i++) { nbytes[i] = rd64(); dir[i] = rd64(); }
        int64_t reply_bytes = 8;
        for (int64_t i = 0; i < nb; i++) {
            b[i] = malloc((size_t)nbytes[i] + 1);
            if (!b[i]) return 3;
            if (dir[i] == OUT) memset(b[i], 0xff, (size_t)nbytes[i]); else rd(b[i], (size_t)nbytes[i]);
            if (dir[i] != IN) reply_bytes += nbytes[i];
        }
        int64_t rc = 0;
        const char *text = NULL;
#define IS(n) (strcmp(name, n) == 0)
#define F(i) ((float *)b[i])
        if (IS("kq_abi_version")) rc = kq_abi_version();
        else if (IS("kq_struct_size")) rc = kq_struct_size((int)s[0]);
        else if (IS("kq_simd_level")) rc = kq_simd_level();
        else if (IS("kq_simd_max")) rc = kq_simd_max();
        else if (IS("kq_set_simd_level")) rc = kq_set_simd_level((int)s[0]);
        else if (IS("kq_simd_name")) text = kq_simd_name();
        else if (IS("kq_set_threads")) rc = kq_set_threads((int)s[0], NULL, 0);
        else if (IS("kq_get_threads")) rc = kq_get_threads();
        else if (IS("kq_test_fail_alloc")) rc = kq_test_fail_alloc(s[0]);
        else if (IS("kq_quantize_q8_32")) kq_quantize_q8_32(F(0), s[0], s[1], (kq_act32 *)b[1]);
        else if (IS("kq_quantize_q8_K")) kq_quantize_q8_K(F(0), s[0], s[1], (kq_act256 *)b[1]);
        else if (IS("kq_dequantize")) rc = kq_dequantize((int)s[0], b[0], s[1], s[2], F(1));
        else if (IS("kq_get_rows")) rc = kq_get_rows((int)s[0], b[0], s[1], (const int64_t *)b[1], s[2], F(2));
        else if (IS("kq_matmul")) rc = kq_matmul((int)s[0], b[0], s[1], s[2], F(1), s[3], F(2));
        else if (IS("kq_repack_x8")) rc = kq_repack_x8((int)s[0], b[0], s[1], s[2], b[1]);
        else if (IS("kq_rms_norm")) kq_rms_norm(F(0), F(1), s[0], s[1], f32_of(s[2]), F(2));
        else if (IS("kq_rope")) kq_rope(F(0), s[0], s[1], s[2], F(1), F(2));
        else if (IS("kq_swiglu")) kq_swiglu(F(0), F(1), s[0], F(2));
        else if (IS("kq_attention"))
            rc = kq_attention(F(0), b[1], b[2], s[0], s[1], s[2], s[3], s[4], s[5], (int)s[6], F(3));
        else if (IS("kq_gated_delta_step"))
            rc = kq_gated_delta_step(F(0), F(1), F(2), F(3), F(4), s[0], s[1], s[2], s[3], F(5), F(6));
        else if (IS("kq_gated_delta_chunked"))
            rc = kq_gated_delta_chunked(F(0), F(1), F(2), F(3), F(4), s[0], s[1], s[2], s[3], F(5), s[4], F(6));
        else if (IS("kq_causal_conv1d")) rc = kq_causal_conv1d(F(0), F(1), F(2), s[0], s[1], s[2], F(3));
        else if (IS("kq_layer_norm")) kq_layer_norm(F(0), F(1), F(2), s[0], s[1], f32_of(s[2]), F(3));
        else if (IS("kq_gelu_tanh")) kq_gelu_tanh(F(0), s[0], F(1));
        else if (IS("kq_self_attention")) rc = kq_self_attention(F(0), s[0], s[1], s[2], F(1), F(2), F(3));
        else if (IS("kq_moe_ffn")) {
            /* scalars: E, top_k, hidden, inter, norm_topk, 3 qtypes, has_counts, T; buffers: router, 3 byte-count
             * arrays, E gate, E up, E down matrices, counts (when has_counts), x, out */
            int64_t E = s[0];
            if (E < 0 || nb < 3 * E + 6) return 2;
            const uint8_t **mats = malloc((size_t)(3 * E + 1) * sizeof *mats);
            for (int64_t i = 0; i < 3 * E; i++) mats[i] = b[4 + i];
            int64_t next = 4 + 3 * E;
            kq_moe m = {E, s[1], s[2], s[3], (int32_t)s[4], (int32_t)s[5], (int32_t)s[6], (int32_t)s[7],
                        F(0), mats, mats + E, mats + 2 * E, s[8] ? (int32_t *)b[next++] : NULL,
                        (const int64_t *)b[1], (const int64_t *)b[2], (const int64_t *)b[3]};
            rc = kq_moe_ffn(&m, F(next), s[9], F(next + 1));
            free(mats);
        } else return 4; /* an entry point this driver does not serve: the Python side reports the exit */
        int64_t tl = text ? (int64_t)strlen(text) : 0;
        reply_bytes += tl;
        fwrite(&reply_bytes, 8, 1, stdout);
        fwrite(&rc, 8, 1, stdout);
        if (text) fwrite(text, 1, (size_t)tl, stdout);
        for (int64_t i = 0; i < nb; i++) {
            if (dir[i] != IN) fwrite(b[i], 1, (size_t)nbytes[i], stdout);
            free(b[i]);
        }
        fflush(stdout);
    }
}
