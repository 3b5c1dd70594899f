/* Persistent thread pool: workers spin briefly after each job (decode issues jobs back to back), then
 * sleep on a condition variable. The caller is thread 0; workers may be pinned to given CPUs. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include "kq.h"

#define KQ_MAX_THREADS 64
#define SPIN_LIMIT 20000

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static struct {
    int nth;
    pthread_t th[KQ_MAX_THREADS];
    int cpus[KQ_MAX_THREADS];
    int ncpus;
    _Atomic unsigned gen;
    unsigned start_gen; /* gen when the workers were created: a job posted before a worker runs is not missed */
    _Atomic int pending;
    _Atomic int stop;
    kq_task fn;
    void *ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    long pinned_tid;
} P = {.nth = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static pthread_mutex_t config_mu = PTHREAD_MUTEX_INITIALIZER;

static void pin_self(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

static void *worker(void *arg) {
    int ith = (int)(intptr_t)arg;
    if (P.ncpus > 0) pin_self(P.cpus[ith % P.ncpus]);
    unsigned seen = P.start_gen;
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            if (atomic_load(&P.stop)) return NULL;
            if (++spins < SPIN_LIMIT) { cpu_relax(); continue; }
            pthread_mutex_lock(&P.mu);
            while (atomic_load(&P.gen) == seen && !atomic_load(&P.stop)) pthread_cond_wait(&P.cv, &P.mu);
            pthread_mutex_unlock(&P.mu);
        }
        seen = g;
        if (atomic_load(&P.stop)) return NULL;
        P.fn(P.ctx, ith, P.nth);
        atomic_fetch_sub_explicit(&P.pending, 1, memory_order_release);
    }
}

static void stop_workers(void) {
    pthread_mutex_lock(&P.mu);
    atomic_store(&P.stop, 1);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 1; i < P.nth; i++) pthread_join(P.th[i], NULL);
    atomic_store(&P.stop, 0);
    P.nth = 1;
}

int kq_set_threads(int n, const int *cpus, int ncpus) {
    if (n < 1) n = 1;
    if (n > KQ_MAX_THREADS) n = KQ_MAX_THREADS;
    if (ncpus > KQ_MAX_THREADS) ncpus = KQ_MAX_THREADS;
    pthread_mutex_lock(&config_mu);
    stop_workers();
    P.ncpus = cpus ? ncpus : 0;
    for (int i = 0; i < P.ncpus; i++) P.cpus[i] = cpus[i];
    P.pinned_tid = 0;
    P.start_gen = atomic_load(&P.gen);
    int started = 1;
    for (int i = 1; i < n; i++) {
        if (pthread_create(&P.th[i], NULL, worker, (void *)(intptr_t)i) != 0) break;
        started++;
    }
    P.nth = started;
    pthread_mutex_unlock(&config_mu);
    return started;
}

int kq_get_threads(void) { return P.nth; }

void kq_parallel(kq_task fn, void *ctx) {
    if (P.ncpus > 0) {
        long tid = syscall(SYS_gettid);
        if (tid != P.pinned_tid) { pin_self(P.cpus[0]); P.pinned_tid = tid; }
    }
    if (P.nth == 1) { fn(ctx, 0, 1); return; }
    P.fn = fn;
    P.ctx = ctx;
    atomic_store(&P.pending, P.nth - 1);
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    fn(ctx, 0, P.nth);
    int spins = 0;
    while (atomic_load_explicit(&P.pending, memory_order_acquire) > 0) {
        if (++spins < SPIN_LIMIT) cpu_relax(); else sched_yield();
    }
}
