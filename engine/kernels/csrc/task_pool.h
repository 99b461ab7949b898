/*
 * task_pool.h -- one OpenMP region per pass, its work handed out by the kernels
 * themselves (included by decode_kernels.c).
 *
 * Why. libgomp lets an idle thread spin ~300000 times before it sleeps, but only
 * ~100 times as soon as it manages more threads than there are CPUs, and every
 * thread that ever opened a parallel region keeps a team of its own for as long as
 * it lives: pytest's main thread after loading a model, each Gradio worker thread
 * that ran a pass. A pass that opened a region per product (~150, a few per layer)
 * with two such threads alive on a 2-core host would have every region and every
 * barrier wake its helper through the kernel, and a pass on the second thread run no
 * faster than on one thread (docs/kernels.md, "Threads";
 * docs/bench/2026-12-07-notes-from-kernels-and-model.md).
 *
 * How. team_run(body) opens one region; thread 0 (the caller) runs body, and the
 * other threads serve pool_for jobs until body returns, spinning on one atomic word
 * between jobs (ours, not libgomp's throttled wait; they yield the CPU now and
 * then). pool_for(n, per_thread, fn) cuts [0, n) into grains -- per_thread per
 * thread, grain g covering [n g / grains, n (g + 1) / grains) -- and gives each
 * thread a contiguous range of them, which it runs from the front: one long stream
 * of weights per thread and product. A thread whose range is done takes grains from
 * the back of the others' (stealing), so a helper that is late or descheduled (a
 * busy machine) holds up no more than the grain it is running. Outside team_run,
 * pool_for opens a region for its one job (a product called on its own). Two Python
 * threads run their passes in two teams.
 *
 * Results never depend on which thread runs a grain or on how [0, n) is cut: every
 * grain writes only its own outputs (row and block invariance, decode_kernels.c).
 *
 * The words. claim: job id (32 bits) << 32, the announcement helpers spin on. Each
 * thread's range, on a cache line of its own: job id (low 24 bits) | front (20) |
 * back (20), grains [front, back) left; its owner advances front, thieves lower back,
 * each by a compare-and-swap of the whole word. A helper reads the job's function
 * and context after loading claim and runs a grain only if its compare-and-swap of
 * a range word carrying that job's id succeeds. A job's fields and ranges are
 * rewritten only after all its grains have finished (every range then empty), so a
 * successful claim always pairs a grain with its own job's function.
 */
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POOL_PAUSE() _mm_pause()
#else
#define POOL_PAUSE() ((void)0)
#endif

#define POOL_MAX_TASKS 4096 /* grains of one job, < 2^20: the range words' fields */

typedef void (*pool_range_fn)(void *ctx, int64_t begin, int64_t end);

typedef struct {
    uint64_t word; /* atomic: job id (24 bits) << 40 | front << 20 | back */
    char pad[56];  /* one cache line per range: an owner's claims touch no other thread's line */
} pool_range;

typedef struct {
    uint64_t claim;     /* atomic: job id << 32 */
    pool_range_fn fn;   /* the current job (relaxed atomics) */
    void *ctx;
    int64_t n, grains;
    int32_t helpers;    /* threads of the team besides the caller */
    int32_t done;       /* atomic: body returned, the helpers leave */
    pool_range *ranges; /* [helpers + 1], thread t's grains */
    char pad[8];
    int64_t finished;   /* atomic: grains of the current job done (its own cache line) */
    char pad2[56];
} pool_team;

#define POOL_ID_BITS 0xffffffull
static inline uint64_t pool_range_word(uint32_t id, int64_t front, int64_t back) {
    return (id & POOL_ID_BITS) << 40 | (uint64_t)front << 20 | (uint64_t)back;
}

static __thread pool_team *current_team; /* set on thread 0 while its body runs */

/* Thread `self`: run grains of job `id`, its own range's from the front, then the others' from the back,
 * until none is left (or the job is no longer current); then count them done. */
static void pool_take(pool_team *tm, uint32_t id, int self) {
    if ((uint32_t)(__atomic_load_n(&tm->claim, __ATOMIC_ACQUIRE) >> 32) != id) return;
    pool_range_fn fn = __atomic_load_n(&tm->fn, __ATOMIC_RELAXED);
    void *ctx = __atomic_load_n(&tm->ctx, __ATOMIC_RELAXED);
    const int64_t n = __atomic_load_n(&tm->n, __ATOMIC_RELAXED), grains = __atomic_load_n(&tm->grains, __ATOMIC_RELAXED);
    const int threads = tm->helpers + 1;
    int64_t ran = 0;
    for (int v = 0; v < threads; v++) {
        pool_range *r = tm->ranges + (self + v) % threads;
        uint64_t word = __atomic_load_n(&r->word, __ATOMIC_ACQUIRE);
        for (;;) {
            const int64_t front = (int64_t)(word >> 20 & 0xfffff), back = (int64_t)(word & 0xfffff);
            if ((word >> 40) != (id & POOL_ID_BITS) || front >= back) break;
            const int64_t g = v == 0 ? front : back - 1;
            const uint64_t next = v == 0 ? word + (1ull << 20) : word - 1;
            if (__atomic_compare_exchange_n(&r->word, &word, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                fn(ctx, n * g / grains, n * (g + 1) / grains);
                ran++;
                word = __atomic_load_n(&r->word, __ATOMIC_ACQUIRE);
            }
        }
    }
    if (ran) __atomic_add_fetch(&tm->finished, ran, __ATOMIC_RELEASE);
}

/* Helper `self`: serve every job of the team until its body has returned. */
static void pool_serve(pool_team *tm, int self) {
    uint32_t seen = 0;
    for (int64_t i = 1;; i++) {
        const uint32_t id = (uint32_t)(__atomic_load_n(&tm->claim, __ATOMIC_ACQUIRE) >> 32);
        if (id != seen) {
            seen = id;
            pool_take(tm, id, self);
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
    const int64_t threads = tm ? tm->helpers + 1 : 1;
    int64_t grains = per_thread * threads;
    grains = grains < 1 ? 1 : grains > n ? n : grains > POOL_MAX_TASKS ? POOL_MAX_TASKS : grains;
    if (!tm || grains == 1) {
        fn(ctx, 0, n);
        return;
    }
    const uint32_t id = (uint32_t)(__atomic_load_n(&tm->claim, __ATOMIC_RELAXED) >> 32) + 1;
    __atomic_store_n(&tm->fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->n, n, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->grains, grains, __ATOMIC_RELAXED);
    __atomic_store_n(&tm->finished, 0, __ATOMIC_RELAXED);
    for (int64_t t = 0; t < threads; t++)
        __atomic_store_n(&tm->ranges[t].word, pool_range_word(id, grains * t / threads, grains * (t + 1) / threads),
                         __ATOMIC_RELAXED);
    __atomic_store_n(&tm->claim, (uint64_t)id << 32, __ATOMIC_RELEASE);
    pool_take(tm, id, 0);
    /* Grains a helper claimed may still run: wait for them (their writes are then visible). */
    for (int64_t i = 1; __atomic_load_n(&tm->finished, __ATOMIC_ACQUIRE) < grains; i++) {
        POOL_PAUSE();
        if ((i & 1023) == 0) sched_yield(); /* a descheduled helper holds a grain: let it run */
    }
}

/* body(ctx) on the calling thread inside one parallel region whose other threads serve its pool_for jobs. */
static void team_run(void (*body)(void *), void *ctx) {
    if (current_team != NULL || omp_get_max_threads() <= 1) {
        body(ctx); /* already in a team (its jobs go to it), or one thread asked for */
        return;
    }
    pool_team tm __attribute__((aligned(64)));
    memset(&tm, 0, sizeof(tm));
    pool_range *ranges = aligned_alloc(64, sizeof(pool_range) * (size_t)omp_get_max_threads());
    if (!ranges) abort();
    memset(ranges, 0, sizeof(pool_range) * (size_t)omp_get_max_threads());
    tm.ranges = ranges;
#pragma omp parallel
    {
        if (omp_get_thread_num() == 0) {
            tm.helpers = omp_get_num_threads() - 1;
            current_team = &tm;
            body(ctx);
            current_team = NULL;
            __atomic_store_n(&tm.done, 1, __ATOMIC_RELEASE);
        } else {
            pool_serve(&tm, omp_get_thread_num());
        }
    }
    free(ranges);
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
