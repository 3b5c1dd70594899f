/* Stress of the native thread pool (src/pool.c) for tests/native/test_native_pool.py: back-to-back jobs of different
 * sizes (9, 72 and 192 items, as a decode step's products), each item checking that the job's context is still
 * the one its poster built and counting itself; the poster wipes the context when it returns (its stack frame
 * dies). A chunk run twice or run after its poster returned shows as "bad". Prints "jobs N bad B". */
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include "kq_internal.h"
typedef struct { volatile long magic; long job; _Atomic long items; } ctx_t;
static _Atomic long bad = 0;
static void task(void *c_, int64_t a, int64_t b) {
    ctx_t *c = c_;
    for (int64_t i = a; i < b; i++) {
        long m = c->magic;
        if (m != 0x5eed + c->job) { atomic_fetch_add(&bad, 1); }
        for (volatile int k = 0; k < 200; k++);
        atomic_fetch_add(&c->items, 1);
    }
}
static __attribute__((noinline)) void one_job(long j, int64_t n) {
    ctx_t c; c.magic = 0x5eed + j; c.job = j; atomic_store(&c.items, 0);
    kq_parallel_for(n, kq_chunk_for(n), task, &c);
    if (atomic_load(&c.items) != n) { printf("job %ld: items %ld != %ld\n", j, (long)atomic_load(&c.items), (long)n); atomic_fetch_add(&bad, 1); }
    memset((void *)&c, 0xAB, sizeof c); /* the frame dies: garbage */
}
int main(int argc, char **argv) {
    long jobs = argc > 1 ? atol(argv[1]) : 200000;
    kq_set_threads(2, NULL, 0);
    for (long j = 0; j < jobs; j++) { one_job(j, (j % 3 == 0) ? 9 : (j % 3 == 1) ? 72 : 192); }
    printf("jobs %ld bad %ld\n", jobs, (long)atomic_load(&bad));
    return atomic_load(&bad) != 0;
}
