/* Paged attention for CPU, one query token at a time: each query attends to
 * the first `len` tokens of its sequence's paged K/V, read in place through
 * the block table (no gather into a padded batch, no padding work). A decode
 * is one query with len = context length; a prefill chunk is one query per
 * new token with len = its position + 1 (causality without a mask), whether
 * or not earlier tokens came from the prefix cache: one kernel for every
 * step shape. The step's new K/V must already be in the cache.
 *
 * Built at first use by workers/attention/cpu_kernel.py with the host's
 * compiler (-O3 -march=native) and loaded with ctypes; threads come from pool.c. With AVX-512
 * (most x86 servers) the hot loops use intrinsics, and bf16 dot products use
 * AVX512-BF16 where the CPU has it; elsewhere a portable C path does the same
 * arithmetic. No -ffast-math: it would set flush-to-zero process-wide when
 * the library loads.
 *
 * Prefill chunks (runs of a sequence's consecutive queries) go through tiles
 * instead, up to 16 queries per item: paged_attention_tiles.h (bf16, with
 * AVX512-BF16) and paged_attention_tiles_f32.h (float32, any AVX-512).
 *
 * Work item = (sequence, kv head): the `group` query heads sharing a KV head
 * are scored together, so each K/V row is loaded once. Two passes over
 * float32 scores in a per-thread buffer: scores + max, then exp, sum and the
 * weighted V sum. Scores are q.k then * scale (HF's order); accumulation is
 * float32 whatever the cache dtype; the output is rounded once
 * (round-to-nearest-even for bf16), as torch's matmuls do.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include "bf16.h"
#include "pool.h"
#include "vexp.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_HD 256
#define MAX_GROUP 16
#define MAX_HEADS 128

typedef struct {
    const void *q;
    int64_t q_tok_stride, q_head_stride;  /* in elements */
    const void *k_cache, *v_cache;        /* [num_blocks * block_size, num_kv_heads, head_dim] */
    const int64_t *block_tables;
    int64_t bt_stride;
    const int32_t *q_rows;                /* per query: its sequence's row in block_tables */
    const int32_t *seq_lens;              /* per query: how many leading cached tokens it attends to */
    void *out;                            /* [num_seqs, num_heads, head_dim] */
    int num_heads, num_kv_heads, head_dim, block_size, max_len, group;
    float scale;
    int per_seq;                          /* items are whole sequences (all kv heads), see run() */
} Args;

/* ---------------- portable path ---------------- */

#define DEFINE_ITEM_C(NAME, T, LOAD, STORE)                                                    \
static void NAME(const Args *a, int s, int h, float *scores) {                                 \
    const int g = a->group, hd = a->head_dim, bs = a->block_size, ml = a->max_len;            \
    const int len = a->seq_lens[s] < ml ? a->seq_lens[s] : ml;                                 \
    const int64_t tok_stride = (int64_t)a->num_kv_heads * hd;                                  \
    const int64_t *bt = a->block_tables + (int64_t)a->q_rows[s] * a->bt_stride;                           \
    const T *qs = (const T *)a->q + (int64_t)s * a->q_tok_stride;                              \
    float qf[MAX_GROUP][MAX_HD], acc[MAX_GROUP][MAX_HD], row[MAX_HD], mx[MAX_GROUP];           \
    for (int j = 0; j < g; j++) {                                                              \
        const T *qj = qs + (int64_t)(h * g + j) * a->q_head_stride;                            \
        for (int d = 0; d < hd; d++) qf[j][d] = LOAD(qj[d]);                                   \
        mx[j] = -INFINITY;                                                                     \
    }                                                                                          \
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) {                                         \
        const int n = len - t0 < bs ? len - t0 : bs;                                           \
        const T *kb = (const T *)a->k_cache + bt[b] * bs * tok_stride + (int64_t)h * hd;       \
        for (int i = 0; i < n; i++) {                                                          \
            for (int d = 0; d < hd; d++) row[d] = LOAD(kb[i * tok_stride + d]);                \
            for (int j = 0; j < g; j++) {                                                      \
                float dot = 0.0f;                                                              \
                for (int d = 0; d < hd; d++) dot += qf[j][d] * row[d];                         \
                dot *= a->scale;                                                               \
                scores[(int64_t)j * ml + t0 + i] = dot;                                        \
                mx[j] = dot > mx[j] ? dot : mx[j];                                             \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    float inv[MAX_GROUP];                                                                      \
    for (int j = 0; j < g; j++) {                                                              \
        float *sj = scores + (int64_t)j * ml, sum = 0.0f;                                      \
        for (int t = 0; t < len; t++) { sj[t] = exp_scalar(sj[t] - mx[j]); sum += sj[t]; }     \
        inv[j] = 1.0f / sum;                                                                   \
        memset(acc[j], 0, sizeof(float) * hd);                                                 \
    }                                                                                          \
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) {                                         \
        const int n = len - t0 < bs ? len - t0 : bs;                                           \
        const T *vb = (const T *)a->v_cache + bt[b] * bs * tok_stride + (int64_t)h * hd;       \
        for (int i = 0; i < n; i++) {                                                          \
            for (int d = 0; d < hd; d++) row[d] = LOAD(vb[i * tok_stride + d]);                \
            for (int j = 0; j < g; j++) {                                                      \
                const float p = scores[(int64_t)j * ml + t0 + i];                              \
                for (int d = 0; d < hd; d++) acc[j][d] += p * row[d];                          \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int j = 0; j < g; j++) {                                                              \
        T *oj = (T *)a->out + ((int64_t)s * a->num_heads + h * g + j) * hd;                    \
        for (int d = 0; d < hd; d++) oj[d] = STORE(acc[j][d] * inv[j]);                        \
    }                                                                                          \
}

#define F32_ID(x) (x)
DEFINE_ITEM_C(item_c_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ITEM_C(item_c_f32, float, F32_ID, F32_ID)

#include "paged_attention_avx512.h"  /* the AVX-512 items and pick_512, when the CPU has it */

#ifndef __AVX512F__
typedef void (*item_fn)(const Args *, int, int, int, float *);
static size_t scratch_floats(const Args *a) {
    return (size_t)a->group * (size_t)(a->max_len > 0 ? a->max_len : 1);
}
#endif

/* The portable path, one kv head at a time over a range. */
static void item_c_bf16_range(const Args *a, int s, int h0, int h1, float *buf) {
    for (int h = h0; h < h1; h++) item_c_bf16(a, s, h, buf);
}
static void item_c_f32_range(const Args *a, int s, int h0, int h1, float *buf) {
    for (int h = h0; h < h1; h++) item_c_f32(a, s, h, buf);
}

/* With enough queries to keep every thread busy, an item is a whole query
 * (all kv heads: each K/V row is read once); with few (small-batch decode),
 * items are (query, kv head) so that every thread works. */
typedef struct {
    const Args *a;
    item_fn fn;
    const int *queries;  /* the queries to run (NULL: 0..n-1) */
    int items, nkv;
    size_t floats;
    atomic_int next, failed;
} Job;

/* The calling thread's scratch, or NULL with the job marked failed. */
static void *job_scratch(size_t bytes, atomic_int *failed) {
    void *buf = kv_scratch(bytes);
    if (!buf) atomic_store(failed, 1);
    return buf;
}

/* Items are claimed one at a time (sequences differ in length). */
static void job_run(void *arg, int tid, int nt) {
    (void)tid; (void)nt;
    Job *j = (Job *)arg;
    float *buf = job_scratch(sizeof(float) * j->floats, &j->failed);
    if (!buf) return;
    for (int item; (item = atomic_fetch_add(&j->next, 1)) < j->items;) {
        const int i = j->a->per_seq ? item : item / j->nkv, s = j->queries ? j->queries[i] : i;
        if (j->a->per_seq)
            j->fn(j->a, s, 0, j->a->num_kv_heads, buf);
        else
            j->fn(j->a, s, item % j->nkv, item % j->nkv + 1, buf);
    }
}

static int run(Args *a, int num_seqs, int num_threads, item_fn fn, const int *queries) {
    a->per_seq = num_seqs >= 2 * num_threads;
    const int nkv = a->per_seq ? 1 : a->num_kv_heads;
    Job j = {a, fn, queries, num_seqs * nkv, nkv, scratch_floats(a), 0, 0};  /* covers the portable path too */
    kv_parallel(job_run, &j, num_threads < j.items ? num_threads : j.items);
    return atomic_load(&j.failed) ? -2 : 0;
}

#ifdef __AVX512F__
#include "paged_attention_tiles.h"  /* bf16 prefill tiles: runs of a sequence's consecutive queries */
#include "paged_attention_tiles_f32.h"  /* the same for float32 (AVX-512F is enough) */

typedef struct {
    const Args *a;
    tile_fn fn;
    const int *q0, *n;
    int tiles, items;
    size_t bytes;
    atomic_int next, failed;
} TileJob;

/* (tile, kv head) items, the last tiles (the longest contexts) first. */
static void tile_job_run(void *arg, int tid, int nt) {
    (void)tid; (void)nt;
    TileJob *j = (TileJob *)arg;
    void *buf = job_scratch(j->bytes, &j->failed);
    if (!buf) return;
    const int nkv = j->a->num_kv_heads;
    for (int item; (item = atomic_fetch_add(&j->next, 1)) < j->items;) {
        const int t = j->tiles - 1 - item / nkv;
        j->fn(j->a, j->q0[t], j->n[t], item % nkv, buf);
    }
}

/* Queries that continue their predecessor (same sequence, length + 1) form tiles of
 * up to QT; tiles run as tiles, lone queries (decodes) as per-query items. */
static int run_tiled(Args *a, int num_q, int num_threads, item_fn fn, tile_fn tf,
                     size_t (*bytes_of)(int rows, int lpad, int hd)) {
    if (!tf || num_q < 2) return run(a, num_q, num_threads, fn, NULL);
    int *idx = malloc(sizeof(int) * 3 * (size_t)num_q);
    if (!idx) return run(a, num_q, num_threads, fn, NULL);
    int *q0 = idx, *n = idx + num_q, *lone = idx + 2 * num_q;
    int tiles = 0, nlone = 0;
    size_t need = 0;
    for (int i = 0; i < num_q;) {
        int j = i + 1;
        while (j < num_q && j - i < QT && a->q_rows[j] == a->q_rows[i] && a->seq_lens[j] == a->seq_lens[j - 1] + 1)
            j++;
        const int lmax = a->seq_lens[j - 1];
        const size_t b = bytes_of((j - i) * a->group, (lmax + 15) & ~15, a->head_dim);
        if (j - i >= 2 && a->seq_lens[i] >= 1 && lmax <= a->max_len && b <= TILE_SCRATCH_MAX) {
            q0[tiles] = i;
            n[tiles++] = j - i;
            need = b > need ? b : need;
        } else {
            for (int k = i; k < j; k++) lone[nlone++] = k;
        }
        i = j;
    }
    int rc = 0;
    if (tiles) {
        TileJob tj = {a, tf, q0, n, tiles, tiles * a->num_kv_heads, need, 0, 0};
        kv_parallel(tile_job_run, &tj, num_threads < tj.items ? num_threads : tj.items);
        rc = atomic_load(&tj.failed) ? -2 : 0;
    }
    if (rc == 0 && nlone) rc = run(a, nlone, num_threads, fn, lone);
    free(idx);
    return rc;
}
#endif

static int check(const Args *a) {
    if (a->head_dim <= 0 || a->head_dim > MAX_HD || a->num_kv_heads <= 0 || a->block_size <= 0) return -1;
    if (a->group > MAX_GROUP || a->group * a->num_kv_heads != a->num_heads) return -1;
    return 0;
}

#define DEFINE_ENTRY(NAME, PICK, RUN)                                                           \
int NAME(const void *q, int64_t q_tok_stride, int64_t q_head_stride,                             \
         const void *k_cache, const void *v_cache, const int64_t *block_tables, int64_t bt_stride, \
         const int32_t *q_rows, const int32_t *seq_lens, void *out, int num_seqs, int num_heads,  \
         int num_kv_heads, int head_dim, int block_size, float scale, int max_len, int num_threads) { \
    Args a = {q, q_tok_stride, q_head_stride, k_cache, v_cache, block_tables, bt_stride,          \
              q_rows, seq_lens, out, num_heads, num_kv_heads, head_dim, block_size, max_len,              \
              num_kv_heads > 0 ? num_heads / num_kv_heads : 0, scale, 0};                         \
    if (check(&a)) return -1;                                                                     \
    item_fn fast = PICK;                                                                          \
    return RUN;                                                                                   \
}

#ifdef __AVX512F__
#ifdef __AVX512BF16__
DEFINE_ENTRY(paged_attention_bf16, pick_512(TABLE_BF16, item_512_bf16_any, &a),
             run_tiled(&a, num_seqs, num_threads, fast ? fast : item_c_bf16_range, fast ? pick_tile_in(TILES, &a) : NULL,
                       tile_bytes))
#else
DEFINE_ENTRY(paged_attention_bf16, pick_512(TABLE_BF16, item_512_bf16_any, &a),
             run(&a, num_seqs, num_threads, fast ? fast : item_c_bf16_range, NULL))
#endif
DEFINE_ENTRY(paged_attention_f32, pick_512(TABLE_F32, item_512_f32_any, &a),
             run_tiled(&a, num_seqs, num_threads, fast ? fast : item_c_f32_range, fast ? pick_tile_in(TILES_F32, &a) : NULL,
                       tile_bytes_f32))
#else
DEFINE_ENTRY(paged_attention_bf16, NULL, run(&a, num_seqs, num_threads, fast ? fast : item_c_bf16_range, NULL))
DEFINE_ENTRY(paged_attention_f32, NULL, run(&a, num_seqs, num_threads, fast ? fast : item_c_f32_range, NULL))
#endif

/* Which paths this build has, for tests and logs: bit 0 AVX-512, bit 1 AVX512-BF16. */
int paged_attention_isa(void) {
    int isa = 0;
#ifdef __AVX512F__
    isa |= 1;
#endif
#ifdef __AVX512BF16__
    isa |= 2;
#endif
    return isa;
}

#include "paged_attention_q8.h"  /* int8 / fp8 KV caches: their write and attention */
