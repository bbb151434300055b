/* The batched LoRA step of one projection, every adapter of the batch in one call
 * (Punica's SGMV on the CPU):
 *
 *   y[row] += (x[row] @ A[slot]^T) @ B[slot]^T   for each row of each adapter group
 *
 * The host sorts a step's rows by adapter once (kvyard.workers.lora.batch): `rows`
 * lists them group by group, group g being rows[gstart[g] .. gstart[g + 1]) on slot
 * gslot[g] with rank grank[g]. A is [slots, R, K]; B comes transposed, [slots, R, N]
 * (the LoRA manager stores it so on the CPU), so the expand streams rows of N. R =
 * nsl * rmax for a fused projection of nsl slices (q/k/v: 3, gate/up: 2): slice j
 * owns ranks [j * rmax, j * rmax + rank) and output columns [noff[j], noff[j + 1])
 * (the adapter loader builds B block-diagonal that way), so neither the zero padding
 * of a smaller rank nor B's zero blocks are read. Shrink into a float32 `mid`
 * [rows, R] (one row per sorted position), then expand onto y: float32 throughout,
 * y rounded once. Both phases run on pool.c's team, work split by cost over
 * (row chunk, rank block) and (row chunk, 64-column tile) items.
 *
 * Written with GCC vector types: -march=native compiles them to AVX-512 where the
 * CPU has it, to AVX2 (or SSE, or scalars) elsewhere, so every build has this path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "pool.h"

/* 64-byte vectors in a build without AVX-512 pass differently from one with it: all static here */
#pragma GCC diagnostic ignored "-Wpsabi"

/* A vector is one register: 16 floats with AVX-512, 8 elsewhere (GCC splits wider
 * vectors badly without it). Register blocks: accumulators plus operands must fit the
 * register file, 32 zmm with AVX-512, 16 ymm without. */
#ifdef __AVX512F__
#define VL 16
#define MR 4      /* shrink: rows per register block */
#define RB 4      /* shrink: ranks per item (and register block) */
#define EMR 4     /* expand: rows per register block */
#else
#define VL 8
#define MR 2
#define RB 4
#define EMR 1
#endif
#define BMAX 4    /* the largest block in any build (the arrays' size; unused parts vanish) */
#define TW 64     /* expand: output columns per item */
#define NVMAX 8   /* TW / VL in any build */
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));

static inline __attribute__((always_inline)) vf ldv(const void *p, int64_t i, const int bf) {
    if (bf) {
        vh h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const vu w = __builtin_convertvector(h, vu) << 16;
        vf v;
        memcpy(&v, &w, sizeof v);
        return v;
    }
    vf v;
    memcpy(&v, (const float *)p + i, sizeof v);
    return v;
}

static inline float ld1(const void *p, int64_t i, const int bf) {
    if (bf) {
        const uint32_t w = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &w, 4);
        return f;
    }
    return ((const float *)p)[i];
}

/* Round to nearest even as torch does (bf16.h's rule, a vector at a time). */
static inline __attribute__((always_inline)) void stv(void *p, int64_t i, const vf *v, const int bf) {
    if (!bf) {
        memcpy((float *)p + i, v, sizeof *v);
        return;
    }
    vu u;
    memcpy(&u, v, sizeof u);
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    const vu rnd = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vh h = __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & rnd), vh);
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

static inline __attribute__((always_inline)) float hsum(const vf *v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += (*v)[i];
    return s;
}

typedef struct {
    const void *x; int64_t xs;
    void *y; int64_t ys;
    const void *a, *b;
    const int32_t *rows, *gstart, *gslot, *grank, *noff;
    float *mid; int64_t ms;
    int G, K, R, N, nsl, rmax, bf;
    /* items: row chunks (unit u: group ug[u], sorted positions [up[u], up[u + 1])) times
     * the phase's per-chunk count; nt threads share them by cost */
    int units;
    int *ug, *up;
} Lora;

/* Shrink, one register block: mid[p][r0 .. r0 + nr) for positions p0 .. p0 + mr (constants
 * after inlining, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void shrink_block(const Lora *L, const char *a, int p0, int r0,
                                                               const int mr, const int nr, const int pf,
                                                               const int bf) {
    const int K = L->K, kv = K / VL * VL;
    const size_t esz = bf ? 2 : 4;
    const void *ar[BMAX], *xr[BMAX];
    for (int c = 0; c < nr; c++) ar[c] = a + (int64_t)(r0 + c) * K * esz;
    for (int r = 0; r < mr; r++) xr[r] = (const char *)L->x + (int64_t)L->rows[p0 + r] * L->xs * esz;
    vf acc[BMAX][BMAX];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) acc[r][c] = (vf){0};
    for (int k = 0; k < kv; k += VL) {
        vf w[BMAX];
        /* the next rank block's rows (the item after this one, mostly), a line each step:
         * the weights come from DRAM and a row of A is too short a stream to prefetch itself */
        if (pf)
            for (int c = 0; c < nr; c++) __builtin_prefetch((const char *)ar[c] + ((int64_t)nr * K + k) * esz, 0, 2);
        for (int c = 0; c < nr; c++) w[c] = ldv(ar[c], k, bf);
        for (int r = 0; r < mr; r++) {
            const vf xv = ldv(xr[r], k, bf);
            for (int c = 0; c < nr; c++) acc[r][c] += xv * w[c];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nr; c++) {
            float s = hsum(&acc[r][c]);
            for (int k = kv; k < K; k++) s += ld1(xr[r], k, bf) * ld1(ar[c], k, bf);
            L->mid[(int64_t)(p0 + r) * L->ms + r0 + c] = s;
        }
}

#define SHRINK_ROWS(NR)                                                    \
    switch (mr) {                                                          \
        case 4: shrink_block(L, a, p0, r0, 4, NR, pf, bf); break;          \
        case 3: shrink_block(L, a, p0, r0, 3, NR, pf, bf); break;          \
        case 2: shrink_block(L, a, p0, r0, 2, NR, pf, bf); break;          \
        default: shrink_block(L, a, p0, r0, 1, NR, pf, bf); break;         \
    }

/* Shrink: mid[p][r] for the positions of unit u and ranks [r0, r1) (r1 - r0 <= RB). */
static inline __attribute__((always_inline)) void shrink_item(const Lora *L, int u, int r0, int r1, const int bf) {
    const char *a = (const char *)L->a + (int64_t)L->gslot[L->ug[u]] * L->R * L->K * (bf ? 2 : 4);
    for (int p0 = L->up[u]; p0 < L->up[u + 1]; p0 += MR) {
        const int mr = L->up[u + 1] - p0 < MR ? L->up[u + 1] - p0 : MR, pf = p0 == L->up[u];
        switch (r1 - r0) {
            case 4: SHRINK_ROWS(4) break;
            case 3: SHRINK_ROWS(3) break;
            case 2: SHRINK_ROWS(2) break;
            default: SHRINK_ROWS(1) break;
        }
    }
}

/* Expand, one register block: y[rows of positions p0 .. p0 + mr][n0, n0 + VL nv) += their mid
 * (slice ranks from c0) times B^T's rows, which run along N ([slots, R, N] layout). */
static inline __attribute__((always_inline)) void expand_block(const Lora *L, const char *bt, int c0, int rank,
                                                               int p0, int n0, const int mr, const int nv,
                                                               const int pf, const int bf) {
    const size_t esz = bf ? 2 : 4;
    char *yr[BMAX];
    const float *m[BMAX];
    vf acc[BMAX][NVMAX];
    for (int r = 0; r < mr; r++) {
        yr[r] = (char *)L->y + (int64_t)L->rows[p0 + r] * L->ys * esz;
        m[r] = L->mid + (int64_t)(p0 + r) * L->ms + c0;
        for (int c = 0; c < nv; c++) acc[r][c] = ldv(yr[r], n0 + c * VL, bf);
    }
    for (int k = 0; k < rank; k++) {
        const char *w = bt + ((int64_t)(c0 + k) * L->N + n0) * esz;
        if (pf)  /* the next tile's part of this row (the item after this one, mostly) */
            for (int c = 0; c < nv; c++) __builtin_prefetch(w + (int64_t)(TW + c * VL) * esz, 0, 2);
        for (int c = 0; c < nv; c++) {
            const vf wv = ldv(w, c * VL, bf);
            for (int r = 0; r < mr; r++) acc[r][c] += m[r][k] * wv;
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nv; c++) stv(yr[r], n0 + c * VL, &acc[r][c], bf);
}

#define EXPAND_ROWS(NV)                                                          \
    switch (mr) {                                                                \
        case 4: expand_block(L, bt, c0, rank, p0, n0, 4, NV, pf, bf); break;     \
        case 3: expand_block(L, bt, c0, rank, p0, n0, 3, NV, pf, bf); break;     \
        case 2: expand_block(L, bt, c0, rank, p0, n0, 2, NV, pf, bf); break;     \
        default: expand_block(L, bt, c0, rank, p0, n0, 1, NV, pf, bf); break;    \
    }

/* Expand: y[rows of unit u][n0, n0 + nw) += mid[.][j * rmax + r] * B^T[slot][j * rmax + r][n]
 * over the group's rank; whole 16-column vectors in registers, a last partial one in scalars. */
static inline __attribute__((always_inline)) void expand_item(const Lora *L, int u, int j, int n0, int nw,
                                                              const int bf) {
    const int g = L->ug[u], rank = L->grank[g], c0 = j * L->rmax, nv = nw / VL;
    const char *bt = (const char *)L->b + (int64_t)L->gslot[g] * L->R * L->N * (bf ? 2 : 4);
    for (int p0 = L->up[u]; p0 < L->up[u + 1]; p0 += EMR) {
        const int mr = L->up[u + 1] - p0 < EMR ? L->up[u + 1] - p0 : EMR, pf = p0 == L->up[u];
        switch (nv) {
            case 8: EXPAND_ROWS(8) break;
            case 7: EXPAND_ROWS(7) break;
            case 6: EXPAND_ROWS(6) break;
            case 5: EXPAND_ROWS(5) break;
            case 4: EXPAND_ROWS(4) break;
            case 3: EXPAND_ROWS(3) break;
            case 2: EXPAND_ROWS(2) break;
            case 1: EXPAND_ROWS(1) break;
            default: break;
        }
    }
    for (int n = n0 + nv * VL; n < n0 + nw; n++)
        for (int p = L->up[u]; p < L->up[u + 1]; p++) {
            char *yr = (char *)L->y + (int64_t)L->rows[p] * L->ys * (bf ? 2 : 4);
            const float *m = L->mid + (int64_t)p * L->ms + c0;
            float acc = ld1(yr, n, bf);
            for (int k = 0; k < rank; k++) acc += m[k] * ld1(bt, (int64_t)(c0 + k) * L->N + n, bf);
            if (bf) {
                const uint16_t h = f32_to_bf16(acc);
                memcpy(yr + (int64_t)n * 2, &h, 2);
            } else {
                memcpy(yr + (int64_t)n * 4, &acc, 4);
            }
        }
}

/* Per-chunk item counts: shrink: nsl * rank blocks; expand: 64-column tiles over the slices. */
static int shrink_per_unit(const Lora *L) { return L->nsl * ((L->rmax + RB - 1) / RB); }

static int expand_per_unit(const Lora *L) {
    int n = 0;
    for (int j = 0; j < L->nsl; j++) n += (L->noff[j + 1] - L->noff[j] + TW - 1) / TW;
    return n;
}

/* Item i of a phase: its unit, slice and (rank block | tile); 0 cost means nothing to do. */
static int64_t item_cost(const Lora *L, int expand, int i, int per, int *u, int *j, int *sub) {
    *u = i / per;
    int s = i % per;
    const int rank = L->grank[L->ug[*u]], rows = L->up[*u + 1] - L->up[*u];
    if (!expand) {
        const int nb = (L->rmax + RB - 1) / RB;
        *j = s / nb;
        *sub = s % nb;
        const int lo = *sub * RB, hi = lo + RB < rank ? lo + RB : rank;
        return hi > lo ? (int64_t)(hi - lo) * (rows + 1) * L->K : 0;
    }
    for (*j = 0;; (*j)++) {
        const int t = (L->noff[*j + 1] - L->noff[*j] + TW - 1) / TW;
        if (s < t) break;
        s -= t;
    }
    *sub = s;
    return (int64_t)rank * (rows + 1) * TW;
}

typedef struct {
    const Lora *L;
    int expand, items, per;
    int64_t total;
} Phase;

static inline __attribute__((always_inline)) void phase_run_dt(Phase *ph, int id, int nt, const int bf) {
    const Lora *L = ph->L;
    const int64_t lo = ph->total * id / nt, hi = ph->total * (id + 1) / nt;
    int64_t at = 0;
    for (int i = 0; i < ph->items && at < hi; i++) {
        int u, j, sub;
        const int64_t c = item_cost(L, ph->expand, i, ph->per, &u, &j, &sub);
        const int64_t mine = at >= lo;  /* an item belongs to the thread whose range holds its start */
        at += c;
        if (!c || !mine) continue;
        if (ph->expand) {
            const int n0 = L->noff[j] + sub * TW, end = L->noff[j + 1];
            expand_item(L, u, j, n0, end - n0 < TW ? end - n0 : TW, bf);
        } else {
            const int rank = L->grank[L->ug[u]], r0 = j * L->rmax + sub * RB;
            const int r1 = sub * RB + RB < rank ? r0 + RB : j * L->rmax + rank;
            shrink_item(L, u, r0, r1, bf);
        }
    }
}

static void phase_run(void *arg, int id, int nt) {
    Phase *ph = (Phase *)arg;
    if (ph->L->bf) phase_run_dt(ph, id, nt, 1);
    else phase_run_dt(ph, id, nt, 0);
}

static void run_phase(const Lora *L, int expand, int num_threads) {
    Phase ph = {L, expand, 0, expand ? expand_per_unit(L) : shrink_per_unit(L), 0};
    ph.items = L->units * ph.per;
    for (int i = 0; i < ph.items; i++) {
        int u, j, sub;
        ph.total += item_cost(L, expand, i, ph.per, &u, &j, &sub);
    }
    if (ph.total == 0) return;
    if (num_threads > ph.items) num_threads = ph.items;
    kv_parallel(phase_run, &ph, num_threads);
}

/* Returns 0, or -1 for bad arguments, -3 when out of memory. */
int lora_sgmv(const void *x, int64_t xs, void *y, int64_t ys,
              const void *a, const void *b, const int32_t *noff, int K, int R, int N, int nsl,
              const int32_t *rows, const int32_t *gstart, const int32_t *gslot, const int32_t *grank,
              float *mid, int64_t ms, int G, int bf, int num_threads) {
    if (G <= 0 || K <= 0 || nsl <= 0 || R % nsl || ms < R || noff[0] != 0
        || noff[nsl] != N)
        return -1;
    for (int g = 0; g < G; g++)
        if (gstart[g + 1] < gstart[g] || grank[g] < 0 || grank[g] > R / nsl) return -1;
    const int T = gstart[G];
    if (T == 0) return 0;
    /* row chunks: whole groups at decode sizes, split when rows could keep more threads busy */
    const int nt = num_threads > 1 ? num_threads : 1;
    int chunk = (T + 4 * nt - 1) / (4 * nt);
    if (chunk < 16) chunk = 16;
    int units = 0;
    for (int g = 0; g < G; g++) units += (gstart[g + 1] - gstart[g] + chunk - 1) / chunk;
    int *ug = malloc(sizeof(int) * (size_t)(2 * units + 1));
    if (!ug) return -3;
    int *up = ug + units;
    int n = 0;
    for (int g = 0; g < G; g++)
        for (int p = gstart[g]; p < gstart[g + 1]; p += chunk) {
            ug[n] = g;
            up[n++] = p;
        }
    up[units] = T;
    Lora L = {x, xs, y, ys, a, b, rows, gstart, gslot, grank, noff, mid, ms, G, K, R, N, nsl, R / nsl, bf != 0,
              units, ug, up};
    /* groups are consecutive, so a unit ends where the next one starts */
    run_phase(&L, 0, nt);
    run_phase(&L, 1, nt);
    free(ug);
    return 0;
}
