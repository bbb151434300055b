/* y = x @ W^T (+ bias) (then + other | * other | silu) for steps of few rows:
 * decode steps, where the engine spends most of its time.
 *
 * Why not oneDNN there: at 1-32 rows a step's weights (hundreds of MB) come
 * from DRAM and each layer's matrices are small (0.6-1.8 MB), so the time goes
 * to waiting for them, not to arithmetic. Measured on the demo model's shapes
 * (2 Zen 4 cores, bf16, weights cold): oneDNN read them at ~9 GB/s at 1 row
 * and reached ~200 GFLOP/s at 32 rows, against ~30 GB/s and ~450 GFLOP/s the
 * machine has. This kernel lays each 64-column tile of W out as one
 * sequential stream and prefetches the next tile while it computes the
 * current one, so the weights arrive while the FMAs run.
 *
 * Packed layouts (built once at load by kvyard.workers.cpu_ops.pack_gemm_weight),
 * N padded with zero columns to a multiple of 64:
 *   bf16: [N/64][K/2][64][2]  (pairs of k per column: one vdpbf16ps operand per 16 columns)
 *   f32:  [N/64][K][64]
 * Each output element is one float32 dot product in k order, rounded once.
 * Work splits over column tiles; rows go MR at a time against a tile that
 * stays in L2 once its first row block has pulled it in.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include "pool.h"
#include "vexp.h"
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>

#define NB 4   /* 16-column vectors per tile */
#define MR 6   /* rows per register block: MR x NB accumulators (BLOCK_CASES lists 1..MR) */
#define TILE (NB * 16)
#ifndef QREG_ROWS
#define QREG_ROWS 12  /* quantized float32: items of up to this many rows expand in registers, per register
                       * block of balanced size, instead of once into scratch: at decode sizes the
                       * expansion is cheaper than a scratch round trip; at 16-32 rows (18 or 24 here)
                       * it gains nothing, the expansion being shared by fewer rows' work */
#endif

enum { EPI_NONE = 0, EPI_ADD = 1, EPI_MUL = 2, EPI_SILU = 3, EPI_OUT_F32 = 16 };

typedef struct {
    const void *x; int64_t xs;
    const void *w;
    void *y; int64_t ys;
    const void *bias;
    const void *other; int64_t os;
    int M, N, K, epi;
    int qbits;    /* 0: w is dense tiles; 4, 8 or QFP8: w is quantized tiles (gemm_quant.h) */
    float qoff;   /* added to every 4-bit code (-8 for Q4_0) */
    int yf32;     /* bf16 inputs, float32 output (EPI_OUT_F32: greedy.c's screen keeps every bit it can) */
} Gemm;

static inline __m512 silu16(__m512 v) {  /* v / (1 + exp(-v)) */
    const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), v), _mm512_set1_ps(88.0f)));
    return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline __m512 ld_bf16(const uint16_t *p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

static inline __m512 epilogue(__m512 acc, int epi, int is_bf16, const void *bias, const void *other, __mmask16 k) {
    if (bias) acc = _mm512_add_ps(acc, is_bf16 ? ld_bf16(bias, k) : _mm512_maskz_loadu_ps(k, bias));
    if (epi == EPI_ADD || epi == EPI_MUL) {
        __m512 o = is_bf16 ? ld_bf16(other, k) : _mm512_maskz_loadu_ps(k, other);
        acc = epi == EPI_ADD ? _mm512_add_ps(acc, o) : _mm512_mul_ps(acc, o);
    } else if (epi == EPI_SILU) {
        acc = silu16(acc);
    }
    return acc;
}

/* Ask for `bytes` at p (the next tile) a slice at a time: part `i` of `parts`. */
static inline void prefetch_part(const char *p, int64_t bytes, int i, int parts) {
    if (!p) return;
    const int64_t lines = (bytes + 63) / 64, per = (lines + parts - 1) / parts;
    const int64_t a = (int64_t)i * per, b = a + per < lines ? a + per : lines;
    for (int64_t l = a; l < b; l++) _mm_prefetch(p + l * 64, _MM_HINT_T1);
}

#include "gemm_quant.h"

/* One register block: rows [m0, m0 + mr) of tile t over all of K.
 * DT = 1: bf16 (k in pairs), 0: float32. float32 with wtile NULL reads the
 * quantized tile t itself, expanding each k row in registers (few rows: no
 * scratch round trip; measured ~1.3x faster at 1 row). */
static inline __attribute__((always_inline)) void block(const Gemm *g, const void *wtile, int t, int m0, const int mr,
                                                        const int is_bf16, const char *next, int64_t next_bytes) {
    __m512 acc[MR][NB];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < NB; c++) acc[r][c] = _mm512_setzero_ps();
    const int K = g->K;
#ifdef __AVX512BF16__
    if (is_bf16) {
        const uint16_t *wt = (const uint16_t *)wtile;
        const uint16_t *xr[MR];
        for (int r = 0; r < mr; r++) xr[r] = (const uint16_t *)g->x + (int64_t)(m0 + r) * g->xs;
        const int steps = K / 2;
        for (int k = 0; k < steps; k++) {
            if (next && (k & 7) == 0) prefetch_part(next, next_bytes, k >> 3, (steps + 7) >> 3);
            const uint16_t *wk = wt + (int64_t)k * TILE * 2;
            __m512bh w[NB];
            for (int c = 0; c < NB; c++) w[c] = (__m512bh)_mm512_loadu_si512(wk + c * 32);
            for (int r = 0; r < mr; r++) {
                int32_t pair;
                memcpy(&pair, xr[r] + 2 * k, 4);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int c = 0; c < NB; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[c], xb);
            }
        }
    } else
#endif
    if (!wtile) {
        const float *xr[MR];
        for (int r = 0; r < mr; r++) xr[r] = (const float *)g->x + (int64_t)(m0 + r) * g->xs;
        const int64_t bb = quant_block_bytes(g->qbits), row = g->qbits == 4 ? 32 : 64;
        const uint8_t *base = (const uint8_t *)g->w + t * quant_tile_bytes(g);
        const int nkb = K / 32;
        for (int kb = 0; kb < nkb; kb++) {
            if (next) prefetch_part(next, next_bytes, kb, nkb);
            const uint8_t *blk = base + kb * bb;
            __m512 d[4], m[4];
            load_scales(g, blk, d, m);
            for (int k = 0; k < 32; k++) {
                __m512 w[4];
                dequant_row(g, blk + 256 + k * row, d, m, w);
                for (int r = 0; r < mr; r++) {
                    const __m512 xb = _mm512_set1_ps(xr[r][kb * 32 + k]);
                    for (int c = 0; c < NB; c++) acc[r][c] = _mm512_fmadd_ps(xb, w[c], acc[r][c]);
                }
            }
        }
    } else {
        const float *wt = (const float *)wtile;
        const float *xr[MR];
        for (int r = 0; r < mr; r++) xr[r] = (const float *)g->x + (int64_t)(m0 + r) * g->xs;
        for (int k = 0; k < K; k++) {
            if (next && (k & 7) == 0) prefetch_part(next, next_bytes, k >> 3, (K + 7) >> 3);
            const float *wk = wt + (int64_t)k * TILE;
            __m512 w[NB];
            for (int c = 0; c < NB; c++) w[c] = _mm512_loadu_ps(wk + c * 16);
            for (int r = 0; r < mr; r++) {
                const __m512 xb = _mm512_set1_ps(xr[r][k]);
                for (int c = 0; c < NB; c++) acc[r][c] = _mm512_fmadd_ps(xb, w[c], acc[r][c]);
            }
        }
    }
    const int esz = is_bf16 ? 2 : 4;
    for (int c = 0; c < NB; c++) {
        const int col = t * TILE + c * 16;
        if (col >= g->N) break;
        const __mmask16 k = g->N - col >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (g->N - col)) - 1);
        const char *bias = g->bias ? (const char *)g->bias + (int64_t)col * esz : NULL;
        for (int r = 0; r < mr; r++) {
            const char *other = g->other ? (const char *)g->other + ((int64_t)(m0 + r) * g->os + col) * esz : NULL;
            __m512 v = epilogue(acc[r][c], g->epi, is_bf16, bias, other, k);
            char *y = (char *)g->y + ((int64_t)(m0 + r) * g->ys + col) * (g->yf32 ? 4 : esz);
#ifdef __AVX512BF16__
            if (is_bf16 && !g->yf32) _mm256_mask_storeu_epi16(y, k, (__m256i)_mm512_cvtneps_pbh(v));
            else
#endif
                _mm512_mask_storeu_ps((float *)y, k, v);
        }
    }
}

#define BLOCK_CASES(BF)                                                     \
    switch (mr) {                                                           \
        case 6: block(g, wt, t, m0, 6, BF, nx, nb); break;                      \
        case 5: block(g, wt, t, m0, 5, BF, nx, nb); break;                      \
        case 4: block(g, wt, t, m0, 4, BF, nx, nb); break;                      \
        case 3: block(g, wt, t, m0, 3, BF, nx, nb); break;                      \
        case 2: block(g, wt, t, m0, 2, BF, nx, nb); break;                      \
        default: block(g, wt, t, m0, 1, BF, nx, nb); break;                     \
    }

/* Work items are (tile, row chunk), tile-major; a thread takes a contiguous
 * range, so it streams its own tiles. Rows split into chunks only as far as
 * needed to balance threads on narrow matrices (9 tiles on 2 threads would
 * leave one idle a tenth of the time); the first block of an item prefetches
 * the next item's tile when that differs. */
static void run_items(const Gemm *g, int i0, int i1, int nchunks, int chunk, int is_bf16, void *scratch) {
    const int64_t tile_bytes = g->qbits ? quant_tile_bytes(g) : (int64_t)g->K * TILE * (is_bf16 ? 2 : 4);
    int have = -1;  /* the tile now dequantized in scratch */
    for (int i = i0; i < i1; i++) {
        const int t = i / nchunks, r0 = (i % nchunks) * chunk;
        const int r1 = r0 + chunk < g->M ? r0 + chunk : g->M;
        const int tn = (i + 1) / nchunks;
        const void *wt = (const char *)g->w + t * tile_bytes;
        int step = MR;
        if (g->qbits && !is_bf16 && r1 - r0 <= QREG_ROWS) {
            wt = NULL;  /* expand in registers, once per register block (see block) */
            const int passes = (r1 - r0 + MR - 1) / MR;
            step = (r1 - r0 + passes - 1) / passes;  /* balanced: 8 rows as 4 + 4, not 6 + 2 */
        } else if (g->qbits) {
            if (have != t) dequant_tile(g, t, scratch, is_bf16);
            have = t;
            wt = scratch;
        }
        for (int m0 = r0; m0 < r1; m0 += step) {
            const int mr = r1 - m0 < step ? r1 - m0 : step;
            const char *nx = m0 == r0 && i + 1 < i1 && tn != t ? (const char *)g->w + tn * tile_bytes : NULL;
            const int64_t nb = tile_bytes;
            if (is_bf16) { BLOCK_CASES(1) } else { BLOCK_CASES(0) }
        }
    }
}

typedef struct {
    const Gemm *g;
    int items, nchunks, chunk, is_bf16;
    size_t scratch_bytes;
    atomic_int failed;
} Job;

static void job_run(void *arg, int id, int nt) {
    Job *j = (Job *)arg;
    void *scratch = j->scratch_bytes ? kv_scratch(j->scratch_bytes) : NULL;
    if (j->scratch_bytes && !scratch) {
        atomic_store(&j->failed, 1);
        return;
    }
    run_items(j->g, (int)((int64_t)j->items * id / nt), (int)((int64_t)j->items * (id + 1) / nt), j->nchunks,
              j->chunk, j->is_bf16, scratch);
}

static int gemm(Gemm *g, int is_bf16, int num_threads) {
    if (g->M <= 0 || g->N <= 0 || g->K <= 0 || (is_bf16 && g->K % 2)) return -1;
    if (g->qbits && (g->K % 32 || (g->qbits != 4 && g->qbits != 8 && g->qbits != QFP8))) return -1;
    const size_t scratch_bytes = g->qbits ? (size_t)g->K * TILE * (is_bf16 ? 2 : 4) : 0;
    const int tiles = (g->N + TILE - 1) / TILE;
    /* chunks: enough items for ~8 per thread, but never below 4 register blocks of rows */
    int nchunks = num_threads > 1 ? (8 * num_threads + tiles - 1) / tiles : 1;
    const int max_chunks = (g->M + 4 * MR - 1) / (4 * MR);
    if (nchunks > max_chunks) nchunks = max_chunks;
    if (nchunks < 1) nchunks = 1;
    int chunk = (g->M + nchunks - 1) / nchunks;
    chunk = (chunk + MR - 1) / MR * MR;
    nchunks = (g->M + chunk - 1) / chunk;
    const int items = tiles * nchunks;
    if (num_threads > items) num_threads = items;
    Job job = {g, items, nchunks, chunk, is_bf16, scratch_bytes, 0};
    kv_parallel(job_run, &job, num_threads);
    return atomic_load(&job.failed) ? -3 : 0;
}
#endif

#define GEMM_ARGS const void *x, int64_t xs, const void *w, void *y, int64_t ys, const void *bias, \
                  const void *other, int64_t os, int M, int N, int K, int epi, int qbits, float qoff, int num_threads
#if defined(__AVX512F__) && defined(__AVX512BF16__)
int gemm_bf16(GEMM_ARGS) {
    Gemm g = {x, xs, w, y, ys, bias, other, os, M, N, K, epi & ~EPI_OUT_F32, qbits, qoff, (epi & EPI_OUT_F32) != 0};
    return gemm(&g, 1, num_threads);
}
#else
int gemm_bf16(GEMM_ARGS) {
    (void)x; (void)xs; (void)w; (void)y; (void)ys; (void)bias; (void)other; (void)os;
    (void)M; (void)N; (void)K; (void)epi; (void)qbits; (void)qoff; (void)num_threads;
    return -2;  /* not built here: callers keep oneDNN */
}
#endif
#ifdef __AVX512F__
int gemm_f32(GEMM_ARGS) {
    Gemm g = {x, xs, w, y, ys, bias, other, os, M, N, K, epi & ~EPI_OUT_F32, qbits, qoff, 1};
    return gemm(&g, 0, num_threads);
}
#else
int gemm_f32(GEMM_ARGS) {
    (void)x; (void)xs; (void)w; (void)y; (void)ys; (void)bias; (void)other; (void)os;
    (void)M; (void)N; (void)K; (void)epi; (void)qbits; (void)qoff; (void)num_threads;
    return -2;
}
#endif
