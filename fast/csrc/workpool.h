/* A small thread pool for the CPU kernels of fast/: the caller works too, and never waits for a late worker.
 *
 * Why not OpenMP: a parallel region ends in a barrier that every thread of the team must reach, so when
 * another process holds the other core (a shared CI machine, a busy laptop) each call waits for the
 * scheduler to run the second thread at least once: measured on the 2-vCPU CI VM under load, an empty
 * 2-thread OpenMP region cost 35 us to 1.5 ms, and 10 MB packed products ran 5-10x slower on 2 threads
 * than on 1. Here a call is cut into runs; the caller posts the job, wakes the workers and starts
 * claiming runs at once; workers claim runs when they get to run. The caller returns as soon as every
 * run is done: it waits only for runs a worker has claimed and not finished (a few microseconds of work
 * each), never for a worker that has not woken up. With nobody else on the machine this behaves like a
 * parallel for with dynamic scheduling.
 *
 * Use: wp_run(fn, ctx, nruns, nthreads) calls fn(ctx, r, tid) once for every r in [0, nruns), on up to
 * nthreads threads (tid 0 is the caller). One job at a time: a call made while another thread's job is
 * running runs on its caller's thread alone. A forked child starts with no workers (and makes new ones).
 */
#ifndef G4H_WORKPOOL_H
#define G4H_WORKPOOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define WP_PAUSE() _mm_pause()
#else
#define WP_PAUSE() ((void)0)
#endif

#define WP_MAX_WORKERS 63
#define WP_SPIN_NS 50000L /* how long a worker watches for the next job before it sleeps */

typedef void (*wp_fn)(void *ctx, long run, int tid);

static struct {
    pthread_mutex_t job_mu;         /* held by the caller for a whole job */
    pthread_mutex_t mu;             /* guards gen and the job fields, with cv */
    pthread_cond_t cv;
    int started;                    /* worker threads running */
    uint32_t gen;                   /* job generation */
    wp_fn fn;
    void *ctx;
    long nruns;
    int nworkers;                   /* workers (tid 1..nworkers) this job may use */
    _Atomic uint32_t gen_pub;       /* gen, for workers watching without the lock */
    _Atomic uint64_t next;          /* (gen << 32) | index of the next unclaimed run */
    _Atomic long done;              /* runs finished in the current job */
    int atfork;
} wp = {.job_mu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* Claim the next run of job gen; 0 when that job has no run left (or is over). */
static int wp_claim(uint32_t gen, long nruns, long *run) {
    uint64_t v = atomic_load(&wp.next);
    for (;;) {
        if ((uint32_t)(v >> 32) != gen || (long)(v & 0xffffffffu) >= nruns) return 0;
        if (atomic_compare_exchange_weak(&wp.next, &v, v + 1)) {
            *run = (long)(v & 0xffffffffu);
            return 1;
        }
    }
}

static long wp_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *wp_worker(void *arg) {
    const int tid = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&wp.gen_pub);
    for (;;) {
        const long until = wp_ns() + WP_SPIN_NS;
        for (int i = 1; atomic_load(&wp.gen_pub) == seen; i++) {
            WP_PAUSE();
            if (!(i & 63) && wp_ns() > until) break;
        }
        pthread_mutex_lock(&wp.mu);
        while (wp.gen == seen) pthread_cond_wait(&wp.cv, &wp.mu);
        const uint32_t gen = wp.gen;
        const wp_fn fn = wp.fn;
        void *const ctx = wp.ctx;
        const long nruns = wp.nruns;
        const int nworkers = wp.nworkers;
        pthread_mutex_unlock(&wp.mu);
        seen = gen;
        if (tid > nworkers) continue;
        long run;
        while (wp_claim(gen, nruns, &run)) { /* ctx is alive: the caller waits for every claimed run */
            fn(ctx, run, tid);
            atomic_fetch_add(&wp.done, 1);
        }
    }
    return NULL;
}

static void wp_after_fork_child(void) {
    pthread_mutex_init(&wp.job_mu, NULL);
    pthread_mutex_init(&wp.mu, NULL);
    pthread_cond_init(&wp.cv, NULL);
    wp.started = 0;
}

/* Start workers up to n (called with job_mu held). Returns how many run. */
static int wp_grow(int n) {
    if (n > WP_MAX_WORKERS) n = WP_MAX_WORKERS;
    if (!wp.atfork) {
        pthread_atfork(NULL, NULL, wp_after_fork_child);
        wp.atfork = 1;
    }
    while (wp.started < n) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, wp_worker, (void *)(intptr_t)(wp.started + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        wp.started++;
    }
    return wp.started;
}

static void wp_run(wp_fn fn, void *ctx, long nruns, int nthreads) {
    if (nthreads > 1 && nruns > 1 && nruns < (1L << 31) && pthread_mutex_trylock(&wp.job_mu) == 0) {
        int nw = wp_grow(nthreads - 1);
        if (nw > nthreads - 1) nw = nthreads - 1;
        if (nw > 0) {
            pthread_mutex_lock(&wp.mu);
            const uint32_t gen = ++wp.gen;
            wp.fn = fn;
            wp.ctx = ctx;
            wp.nruns = nruns;
            wp.nworkers = nw;
            atomic_store(&wp.done, 0);
            atomic_store(&wp.next, (uint64_t)gen << 32);
            atomic_store(&wp.gen_pub, gen);
            pthread_cond_broadcast(&wp.cv);
            pthread_mutex_unlock(&wp.mu);
            long run, mine = 0;
            while (wp_claim(gen, nruns, &run)) {
                fn(ctx, run, 0);
                mine++;
            }
            atomic_fetch_add(&wp.done, mine);
            for (long i = 0; atomic_load(&wp.done) < nruns; i++) { /* only runs a worker is busy with */
                if (i < 4096) WP_PAUSE();
                else sched_yield();
            }
            pthread_mutex_unlock(&wp.job_mu);
            return;
        }
        pthread_mutex_unlock(&wp.job_mu);
    }
    for (long r = 0; r < nruns; r++) fn(ctx, r, 0);
}

#endif
