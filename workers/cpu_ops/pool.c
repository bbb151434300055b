/* The kernels' own thread team: kv_parallel(fn, arg, n) runs fn(arg, tid, n)
 * for tid 0..n-1, tid 0 on the calling thread, the rest on helper threads
 * that stay up between calls.
 *
 * Why not OpenMP regions: with OMP_WAIT_POLICY=PASSIVE (which the worker
 * needs, see kvyard/cli.py) every region wakes its sleeping threads through a
 * futex, and on the VMs measured here that cost ~50 us a region, against a
 * decode step of ~200 kernel calls taking 15-70 ms in all. Letting GOMP spin
 * instead (GOMP_SPINCOUNT) made the server slower still: its spin loop uses
 * PAUSE, which hypervisors treat as lock-waiting and deschedule. Helpers here
 * busy-poll a generation counter without PAUSE for up to KV_SPIN_US after
 * their last task, so a step's back-to-back calls find them awake, then sleep
 * on a futex so an idle worker leaves the cores to the HTTP thread. Waiting
 * threads also yield every KV_YIELD_US: with as many compute threads as cores,
 * the HTTP thread and clients get a core without preempting a working one.
 * One caller at a time (the engine thread); a concurrent or nested call runs
 * on its own thread instead.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

#define KV_MAX_THREADS 256
#define KV_SPIN_US 200   /* a helper polls this long after its last task, then sleeps */
#define KV_YIELD_US 20   /* a waiting thread yields its core this often (others may be runnable) */

static struct {
    _Atomic uint32_t gen;      /* bumped once per task; helpers wait on it */
    atomic_int done;           /* helpers finished with the current task */
    atomic_int sleepers;       /* helpers in futex_wait */
    kv_task fn;
    void *arg;
    int nt;
    int helpers;               /* started so far */
    pthread_mutex_t busy;
} P = {.busy = PTHREAD_MUTEX_INITIALIZER};

static __thread int in_helper;

static long futex(_Atomic uint32_t *addr, int op, uint32_t val) {
    return syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* A helper's tid and the generation it was created at (the caller bumps the
 * generation right after creating it, and that task is its first). */
static void *helper(void *p) {
    const int tid = (int)((intptr_t)p & 0xFFFF);
    uint32_t seen = (uint32_t)((uintptr_t)p >> 16);
    in_helper = 1;
    for (;;) {
        uint64_t start = 0, last = 0;
        for (unsigned i = 0; atomic_load_explicit(&P.gen, memory_order_acquire) == seen; i++) {
            if ((i & 1023) == 0) {  /* check the clock now and then: no PAUSE in this loop */
                const uint64_t t = now_us();
                if (!start) start = last = t;
                if (t - start >= KV_SPIN_US) {
                    atomic_fetch_add(&P.sleepers, 1);
                    futex(&P.gen, FUTEX_WAIT_PRIVATE, seen);  /* returns at once if gen moved */
                    atomic_fetch_sub(&P.sleepers, 1);
                    start = 0;
                } else if (t - last >= KV_YIELD_US) {
                    sched_yield();
                    last = t;
                }
            }
        }
        seen = atomic_load_explicit(&P.gen, memory_order_acquire);
        if (tid < P.nt) {
            P.fn(P.arg, tid, P.nt);
            atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
        }
    }
    return NULL;
}

static void after_fork_child(void) {  /* helpers do not survive fork */
    P.helpers = 0;
    atomic_store(&P.sleepers, 0);
    pthread_mutex_init(&P.busy, NULL);
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

static int start_helpers(int want) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_atfork);
    while (P.helpers < want) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        const uintptr_t tag = ((uintptr_t)atomic_load(&P.gen) << 16) | (uintptr_t)(P.helpers + 1);
        const int rc = pthread_create(&th, &at, helper, (void *)tag);
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        P.helpers++;
    }
    return P.helpers;
}

/* KVYARD_CPU_THREADS=omp: OpenMP regions instead (torch's runtime), for comparison. */
static int use_omp(void) {
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("KVYARD_CPU_THREADS");
        v = e && e[0] == 'o';
    }
    return v;
}

void kv_parallel(kv_task fn, void *arg, int nt) {
    if (nt > KV_MAX_THREADS) nt = KV_MAX_THREADS;
    if (nt > 1 && use_omp()) {
#pragma omp parallel num_threads(nt)
        fn(arg, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
    if (nt <= 1 || in_helper || pthread_mutex_trylock(&P.busy) != 0) {
        for (int t = 0; t < (nt > 1 ? nt : 1); t++) fn(arg, t, nt > 1 ? nt : 1);
        return;
    }
    const int have = start_helpers(nt - 1);
    if (have < nt - 1) nt = have + 1;
    P.fn = fn;
    P.arg = arg;
    P.nt = nt;
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_seq_cst);
    if (atomic_load(&P.sleepers) > 0) futex(&P.gen, FUTEX_WAKE_PRIVATE, INT32_MAX);
    fn(arg, 0, nt);
    /* The helpers' share is normally done by now; if one lost its core to another
     * thread (the HTTP server's, a client's), yield ours so it can finish here. */
    uint64_t last = 0;
    for (unsigned i = 0; atomic_load_explicit(&P.done, memory_order_acquire) < nt - 1; i++) {
        if ((i & 1023) == 1023) {
            const uint64_t t = now_us();
            if (!last) last = t;
            else if (t - last >= KV_YIELD_US) {
                sched_yield();
                last = t;
            }
        }
    }
    pthread_mutex_unlock(&P.busy);
}

/* A per-thread buffer kept across calls (never shrinks): a fresh one per call
 * cost a page fault per 4 KiB on every call, as allocations this size are
 * mmap'ed. Valid until the same thread's next kv_scratch. */
void *kv_scratch(size_t bytes) {
    static __thread void *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        cap = 0;
        buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (buf) cap = bytes;
    }
    return buf;
}
