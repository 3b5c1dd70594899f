/* Persistent thread pool with dynamic chunking: a job is n items; every participant (the caller and the
 * workers) claims chunks from one atomic counter until none are left, so a worker the OS has descheduled
 * (shared machines, little cores) delays the job by at most one chunk instead of a static share.
 * Workers spin briefly after each job (decode issues jobs back to back), then sleep on a condition
 * variable; the poster likewise spins briefly for the job's last chunks, then sleeps until the last one ends,
 * so a pool that does not have every core to itself (a browser on the same board) yields them instead of
 * burning its time slices. The caller is thread 0; threads may be pinned to given CPUs. Which thread computes an item
 * never changes its result. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include "kq_internal.h"

#define KQ_MAX_THREADS 64
#define SPIN_LIMIT 4000

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static struct {
    _Atomic int nth;               /* read without a lock by callers: a stale value only changes who runs a job */
    pthread_t th[KQ_MAX_THREADS];
    int cpus[KQ_MAX_THREADS];      /* written under job_mu; read by the job's poster (holding it) and new workers */
    int ncpus;
    _Atomic unsigned gen;          /* bumped per job: wakes the workers */
    unsigned start_gen;            /* gen when the workers were created */
    _Atomic uint64_t work;         /* (job gen << 32) | next item: claims are tied to their job */
    _Atomic int64_t done;          /* items finished in the current job */
    _Atomic int stop;
    /* the posted job: written after `work` is closed under the new generation and before it is opened, read
     * (relaxed) by claimants after acquiring it; a claimant that read them for a job that has since changed
     * fails its compare-exchange and drops them */
    _Atomic(kq_range_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n, chunk;
    _Atomic int caller_sleeping;   /* the poster gave up spinning and waits on done_cv */
    pthread_mutex_t mu;
    pthread_cond_t cv, done_cv;
    long pinned_tid;               /* under job_mu */
} P = {.nth = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER,
       .done_cv = PTHREAD_COND_INITIALIZER};

static pthread_mutex_t config_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t job_mu = PTHREAD_MUTEX_INITIALIZER; /* held while a job is posted */

static void pin_self(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof set, &set);
}

/* claim and run chunks of job `g` until none are left */
static void run_chunks(unsigned g) {
    for (;;) {
        uint64_t w = atomic_load_explicit(&P.work, memory_order_acquire);
        if ((unsigned)(w >> 32) != g) return;
        kq_range_fn fn = atomic_load_explicit(&P.fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&P.ctx, memory_order_relaxed);
        int64_t n = atomic_load_explicit(&P.n, memory_order_relaxed);
        int64_t chunk = atomic_load_explicit(&P.chunk, memory_order_relaxed), i = (int64_t)(w & 0xffffffffu);
        if (i >= n) return;
        atomic_thread_fence(memory_order_acquire); /* pairs with the poster's fence: fields of a newer job imply
                                                     the compare-exchange below sees that job's word */
        int64_t e = i + chunk < n ? i + chunk : n;
        if (!atomic_compare_exchange_weak_explicit(&P.work, &w, ((uint64_t)g << 32) | (uint64_t)e,
                                                   memory_order_acq_rel, memory_order_acquire))
            continue; /* lost the race, or the job changed: fields read above are discarded */
        fn(ctx, i, e);
        if (atomic_fetch_add(&P.done, e - i) + (e - i) >= n && atomic_load(&P.caller_sleeping)) {
            pthread_mutex_lock(&P.mu); /* the last chunk: wake a poster that stopped spinning */
            pthread_cond_broadcast(&P.done_cv);
            pthread_mutex_unlock(&P.mu);
        }
    }
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
        run_chunks(g);
    }
}

static void stop_workers(void) {
    pthread_mutex_lock(&P.mu);
    atomic_store(&P.stop, 1);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 1; i < atomic_load(&P.nth); i++) pthread_join(P.th[i], NULL);
    atomic_store(&P.stop, 0);
    atomic_store(&P.nth, 1);
}

int kq_set_threads(int n, const int *cpus, int ncpus) {
    if (n < 1) n = 1;
    if (n > KQ_MAX_THREADS) n = KQ_MAX_THREADS;
    if (ncpus > KQ_MAX_THREADS) ncpus = KQ_MAX_THREADS;
    pthread_mutex_lock(&config_mu);
    pthread_mutex_lock(&job_mu);
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
    atomic_store(&P.nth, started);
    pthread_mutex_unlock(&job_mu);
    pthread_mutex_unlock(&config_mu);
    return started;
}

int kq_get_threads(void) { return atomic_load(&P.nth); }

void kq_parallel_for(int64_t n, int64_t chunk, kq_range_fn fn, void *ctx) {
    if (n <= 0) return;
    if (chunk < 1) chunk = 1;
    /* one job at a time: a second caller thread (or a task calling back in) runs its job alone, unpinned */
    if (atomic_load_explicit(&P.nth, memory_order_relaxed) == 1 || n <= chunk || pthread_mutex_trylock(&job_mu) != 0) {
        fn(ctx, 0, n);
        return;
    }
    if (P.ncpus > 0) { /* the thread that posts jobs is thread 0 of the plan */
        long tid = syscall(SYS_gettid);
        if (tid != P.pinned_tid) { pin_self(P.cpus[0]); P.pinned_tid = tid; }
    }
    /* first close the previous job's work word under the new generation (index past any n): a claimant that
     * read the old word and then this job's fields can no longer succeed with the old word, which is still
     * "fully claimed" but compared with this job's larger n would pass (that claim ran this job's items a
     * second time and over-counted `done`, so a caller returned while a worker still ran a chunk on its
     * dead stack frame: the x8 kernel's segfaults) */
    unsigned g = atomic_load(&P.gen) + 1;
    atomic_store(&P.work, ((uint64_t)g << 32) | 0xffffffffu);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&P.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&P.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&P.n, n, memory_order_relaxed);
    atomic_store_explicit(&P.chunk, chunk, memory_order_relaxed);
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    pthread_mutex_lock(&P.mu);
    atomic_store_explicit(&P.work, (uint64_t)g << 32, memory_order_release);
    atomic_store_explicit(&P.gen, g, memory_order_release);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    run_chunks(g);
    /* spin briefly (the usual case: the others finish their last chunks within microseconds), then sleep: a
     * worker the OS descheduled (a busy process on the same cores) gets the core instead of our spinning */
    for (int spins = 0; atomic_load_explicit(&P.done, memory_order_acquire) < n; spins++) {
        if (spins < SPIN_LIMIT) { cpu_relax(); continue; }
        atomic_store(&P.caller_sleeping, 1);
        pthread_mutex_lock(&P.mu);
        while (atomic_load(&P.done) < n) pthread_cond_wait(&P.done_cv, &P.mu);
        pthread_mutex_unlock(&P.mu);
        atomic_store(&P.caller_sleeping, 0);
    }
    pthread_mutex_unlock(&job_mu);
}

int64_t kq_chunk_for(int64_t n) { /* about 4 claims per thread: balance without much contention */
    int64_t c = n / (4 * (int64_t)atomic_load_explicit(&P.nth, memory_order_relaxed));
    return c < 1 ? 1 : c;
}

/* Per-thread scratch kept between calls: large malloc/free pairs would be fresh zeroed pages every call
 * (prefill spent ~5% in the kernel clearing them). Grows to the largest request; never shrinks. */
/* kq_test_fail_alloc: while a test has armed it, scratch requests are counted and the n-th one fails */
static _Atomic int scratch_test = 0;
static _Atomic int64_t scratch_fail_in = 0, scratch_requests = 0;

int64_t kq_test_fail_alloc(int64_t n) {
    atomic_store(&scratch_fail_in, n > 0 ? n : 0);
    atomic_store(&scratch_test, n > 0);
    return atomic_exchange(&scratch_requests, 0);
}

void *kq_scratch(int slot, size_t bytes) {
    static __thread void *buf[5];
    static __thread size_t cap[5];
    if (slot < 0 || slot >= 5) return NULL;
    if (atomic_load_explicit(&scratch_test, memory_order_relaxed)) { /* a test's injected failure */
        atomic_fetch_add(&scratch_requests, 1);
        if (atomic_fetch_sub(&scratch_fail_in, 1) == 1) return NULL;
    }
    if (bytes == 0) bytes = 1; /* NULL means only a failed allocation, never an empty request */
    if (bytes > cap[slot]) {
        free(buf[slot]);
        buf[slot] = malloc(bytes);
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
}
