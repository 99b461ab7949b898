/*
 * task_pool.h -- one OpenMP region per pass, its work handed out by the kernels
 * themselves (included by decode_kernels.c).
 *
 * Why. libgomp lets an idle thread spin ~300000 times before it sleeps, but only
 * ~100 times as soon as it manages more threads than there are CPUs, and every
 * thread that ever opened a parallel region keeps a team of its own for as long as
 * it lives: pytest's main thread after loading a model, each Gradio worker thread
 * that ran a pass. A pass used to open ~150 regions (a few per layer), and with two
 * such threads alive on a 2-core host every region and every barrier woke its
 * helper through the kernel: measured on a Sapphire Rapids host, bf16 default model,
 * one-token passes took 21.5 ms on a second thread against 11.5 ms on the main one,
 * no faster than one thread (the Lossless lab: 62 s in the app's thread against 32 s
 * on the main one).
 *
 * How. team_run(body) opens one region; thread 0 (the caller) runs body, and the
 * other threads serve pool_for jobs until body returns, spinning on one atomic word
 * between jobs (ours, not libgomp's throttled wait; they yield the CPU now and
 * then). pool_for(n, per_thread, fn) cuts [0, n) into a few contiguous ranges per
 * thread -- task t covers [n t / tasks, n (t + 1) / tasks) -- and the caller and the
 * helpers claim tasks from that word, so a helper that is descheduled (a busy
 * machine) holds nothing up: the caller takes its tasks. Outside team_run, pool_for
 * opens a region for its one job (a product called on its own). Two Python threads
 * run their passes in two teams, as before.
 *
 * Results never depend on which thread runs a task or on how [0, n) is cut: every
 * task writes only its own outputs (row and block invariance, decode_kernels.c).
 *
 * The claim word: job id (32 bits) | task count (16) | next unclaimed task (16). A
 * helper reads the job's function and context after loading the word, and runs a
 * task only if its compare-and-swap of that same word succeeds. A job's fields are
 * rewritten only after all its tasks have finished, so a successful claim always
 * pairs a task with its own job's function.
 */
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POOL_PAUSE() _mm_pause()
#else
#define POOL_PAUSE() ((void)0)
#endif

#define POOL_MAX_TASKS 4096 /* < 2^16: the claim word's task fields */

typedef void (*pool_range_fn)(void *ctx, int64_t begin, int64_t end);

typedef struct {
    uint64_t claim;     /* atomic: job id << 32 | tasks << 16 | next */
    int64_t finished;   /* atomic: tasks of the current job done */
    pool_range_fn fn;   /* the current job (relaxed atomics) */
    void *ctx;
    int64_t n;
    int32_t helpers;    /* threads of the team besides the caller */
    int32_t done;       /* atomic: body returned, the helpers leave */
} pool_team;

static __thread pool_team *current_team; /* set on thread 0 while its body runs */

/* Claim and run tasks of job `id` until none is left (or the job is no longer current). */
static void pool_take(pool_team *tm, uint32_t id) {
    uint64_t word = __atomic_load_n(&tm->claim, __ATOMIC_ACQUIRE);
    pool_range_fn fn = __atomic_load_n(&tm->fn, __ATOMIC_RELAXED);
    void *ctx = __atomic_load_n(&tm->ctx, __ATOMIC_RELAXED);
    const int64_t n = __atomic_load_n(&tm->n, __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t tasks = (uint32_t)(word >> 16) & 0xffff, next = (uint32_t)word & 0xffff;
        if ((uint32_t)(word >> 32) != id || next >= tasks) return;
        if (__atomic_compare_exchange_n(&tm->claim, &word, word + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            fn(ctx, n * next / tasks, n * (next + 1) / tasks);
            __atomic_add_fetch(&tm->finished, 1, __ATOMIC_RELEASE);
            word = __atomic_load_n(&tm->claim, __ATOMIC_ACQUIRE);
        }
    }
}

/* A helper: serve every job of the team until its body has returned. */
static void pool_serve(pool_team *tm) {
    uint32_t seen = 0;
    for (int64_t i = 1;; i++) {
        const uint32_t id = (uint32_t)(__atomic_load_n(&tm->claim, __ATOMIC_ACQUIRE) >> 32);
        if (id != seen) {
            seen = id;
            pool_take(tm, id);
            i = 0;
        } else if (__atomic_load_n(&tm->done, __ATOMIC_ACQUIRE)) {
            return;
        } else {
            POOL_PAUSE();
            if ((i & 1023) == 0) sched_yield(); /* the caller's serial steps; or a busy machine */
        }
    }
}

/* fn over [0, n) on team tm (NULL: alone). */
static void pool_team_for(pool_team *tm, int64_t n, int64_t per_thread, pool_range_fn fn, void *ctx) {
    int64_t tasks = tm ? per_thread * (tm->helpers + 1) : 1;
    tasks = tasks < 1 ? 1 : tasks > n ? n : tasks > POOL_MAX_TASKS ? POOL_MAX_TASKS : tasks;
    if (tasks == 1) {
        fn(ctx, 0, n);
        return;
    }
    const uint32_t id = (uint32_t)(__atomic_load_n(&tm->claim, __ATOMIC_RELAXED) >> 32) + 1;
    __atomic_store_n(&tm->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->n, n, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->finished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->claim, (uint64_t)id << 32 | (uint64_t)tasks << 16, __ATOMIC_RELEASE);
    pool_take(tm, id);
    /* Tasks a helper claimed may still run: wait for them (their writes are then visible). */
    for (int64_t i = 1; __atomic_load_n(&tm->finished, __ATOMIC_ACQUIRE) < tasks; i++) {
        POOL_PAUSE();
        if ((i & 1023) == 0) sched_yield(); /* a descheduled helper holds a task: let it run */
    }
}

/* body(ctx) on the calling thread inside one parallel region whose other threads serve its pool_for jobs. */
static void team_run(void (*body)(void *), void *ctx) {
    if (current_team != NULL || omp_get_max_threads() <= 1) {
        body(ctx); /* already in a team (its jobs go to it), or one thread asked for */
        return;
    }
    pool_team tm;
    memset(&tm, 0, sizeof(tm));
#pragma omp parallel
    {
        if (omp_get_thread_num() == 0) {
            tm.helpers = omp_get_num_threads() - 1;
            current_team = &tm;
            body(ctx);
            current_team = NULL;
            __atomic_store_n(&tm.done, 1, __ATOMIC_RELEASE);
        } else {
            pool_serve(&tm);
        }
    }
}

typedef struct {
    int64_t n, per_thread;
    pool_range_fn fn;
    void *ctx;
} pool_single_job;

static void pool_single(void *arg) {
    const pool_single_job *job = arg;
    pool_team_for(current_team, job->n, job->per_thread, job->fn, job->ctx);
}

/* fn over [0, n) cut into per_thread ranges per thread of the current team (one region of its own outside one). */
static void pool_for(int64_t n, int64_t per_thread, pool_range_fn fn, void *ctx) {
    if (n <= 0) return;
    if (current_team != NULL || omp_get_max_threads() <= 1 || n == 1) {
        pool_team_for(current_team, n, per_thread, fn, ctx);
        return;
    }
    pool_single_job job = {n, per_thread, fn, ctx};
    team_run(pool_single, &job);
}
