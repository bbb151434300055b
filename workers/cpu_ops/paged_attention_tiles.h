/* Prefill tiles for paged_attention.c (the bf16 ones need AVX512-BF16; the helpers
 * up to tile_scores serve the float32 tiles too), which includes it after the
 * per-query path. Not a standalone header: it uses that file's Args and the
 * AVX-512 helpers (softmax_exp, store16_bf16).
 *
 * Why: a prefill chunk's queries all read the same keys. Per query (the
 * per-query items), each key row is loaded and dotted with the query on its
 * own, and every 16 scores cost a cross-lane reduction (hsum16). Here up to QT
 * consecutive queries of one sequence times the `group` heads sharing a KV
 * head (the tile's rows) go together against that KV head: its keys are
 * transposed once, 16 keys per vector of dim pairs, so a row's 16 scores come
 * out of head_dim/2 vdpbf16ps with no reduction, 8 rows in flight; values are
 * re-laid once as token pairs for the PV product. The longer the chunk, the
 * more queries share each transposed key, so the gain grows with prompt length.
 *
 * Arithmetic is the per-query items' in everything but the order of q.k's
 * sums: scores = q.k * scale, exact max, exp (vexp.h), sum, p normalized and
 * rounded to bf16 before PV (as HF's bf16 attention does). Causality: query i
 * attends to the first seq_lens[i] tokens, as everywhere.
 *
 * bf16 here; float32 tiles are in paged_attention_tiles_f32.h (values read in
 * place, two 16-key chunks per pass over the dims). */
#ifdef __AVX512F__

typedef void (*tile_fn)(const Args *, int, int, int, void *);

/* One tile function per (group 1..8, head_dim 64 | 128), constants for the compiler,
 * from a body(a, q0, nq, h, buf, group, head_dim); a table of them; the pick. */
#define TILE_SPEC(PFX, BODY, G, HD) \
static void PFX##_##G##_##HD(const Args *a, int q0, int nq, int h, void *buf) { BODY(a, q0, nq, h, buf, G, HD); }
#define TILE_SPECS(PFX, BODY, HD) TILE_SPEC(PFX, BODY, 1, HD) TILE_SPEC(PFX, BODY, 2, HD) \
    TILE_SPEC(PFX, BODY, 3, HD) TILE_SPEC(PFX, BODY, 4, HD) TILE_SPEC(PFX, BODY, 5, HD) \
    TILE_SPEC(PFX, BODY, 6, HD) TILE_SPEC(PFX, BODY, 7, HD) TILE_SPEC(PFX, BODY, 8, HD)
#define TILE_ROW(PFX, HD) {PFX##_1_##HD, PFX##_2_##HD, PFX##_3_##HD, PFX##_4_##HD, \
    PFX##_5_##HD, PFX##_6_##HD, PFX##_7_##HD, PFX##_8_##HD}

/* The tile function for this call from `table`, or NULL (per-query items only). */
static inline tile_fn pick_tile_in(const tile_fn table[2][8], const Args *a) {
    const int row = a->head_dim == 64 ? 0 : a->head_dim == 128 ? 1 : -1;
    if (row < 0 || a->group < 1 || a->group > 8) return NULL;
    return table[row][a->group - 1];
}

#define QT 16                          /* queries per tile */
#define TILE_SCRATCH_MAX ((size_t)64 << 20) /* bytes per thread; bigger tiles go per query */

/* r[i] lane j <-> r[j] lane i, for 16 vectors of 16 dwords. */
static inline __attribute__((always_inline)) void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

/* One tile's scratch in the thread's buffer, 64-byte aligned parts:
 * kt: [lpad/16][head_dim/2][16] keys transposed (dim pairs of 16 keys); vt:
 * values as token pairs [lpad/2][head_dim][2]; scores [R][lpad]; probs [R][lpad]
 * (normalized p, bf16); q [R][head_dim] bf16. */
typedef struct {
    float *kt, *vt, *scores, *q;
    uint16_t *probs;
} TileScratch;

static inline size_t tile_bytes(int rows, int lpad, int hd) {
    return (size_t)lpad * hd * 4 + (size_t)rows * lpad * 6 + (size_t)rows * hd * 2 + 6 * 64;
}

static inline void *take(char **p, size_t n) {
    char *q = *p;
    *p = (char *)(((uintptr_t)(q + n) + 63) & ~(uintptr_t)63);
    return q;
}

static inline TileScratch tile_scratch(void *buf, int rows, int lpad, int hd) {
    char *p = (char *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    TileScratch s;
    s.kt = take(&p, (size_t)lpad * hd * 2);
    s.vt = take(&p, (size_t)lpad * hd * 2);
    s.scores = take(&p, (size_t)rows * lpad * 4);
    s.probs = take(&p, (size_t)rows * lpad * 2);
    s.q = take(&p, (size_t)rows * hd * 2);
    return s;
}

/* Cache rows of tokens t0 .. t0+15 of the tile's sequence, kv head h; rows at or
 * past n repeat row n-1 (their lanes are masked or zeroed by the caller). One
 * division per chunk: a division per row cost about as much as its arithmetic. */
static inline void chunk_rows(const void *cache, const int64_t *bt, int t0, int n, int bs, int64_t tok_stride,
                              int h, int hd, int esz, const char **rows) {
    int b = t0 / bs, off = t0 % bs;
    for (int i = 0; i < 16; i++) {
        if (i < n) {
            rows[i] = (const char *)cache + ((bt[b] * bs + off) * tok_stride + (int64_t)h * hd) * esz;
            if (++off == bs) {
                off = 0;
                b++;
            }
        } else {
            rows[i] = rows[n - 1];
        }
    }
}

#ifdef __AVX512BF16__
/* Scores of every row (masked past its length), then softmax: normalized p in
 * probs as bf16, zero past each row's length. */
static inline __attribute__((always_inline)) void tile_scores(const Args *a, const TileScratch *sc, const int64_t *bt,
                                                              int h, int R, int len0, int lmax, int lpad,
                                                              const int g, const int hd) {
    const int esz = 2, kvec = hd / 2, bs = a->block_size;
    const int64_t tok_stride = (int64_t)a->num_kv_heads * hd;
    for (int c = 0; c < lpad / 16; c++) {  /* keys, transposed */
        const int t0 = c * 16, n = lmax - t0 < 16 ? lmax - t0 : 16;
        const char *rows[16];
        chunk_rows(a->k_cache, bt, t0, n, bs, tok_stride, h, hd, esz, rows);
        for (int v0 = 0; v0 < kvec; v0 += 16) {
            __m512 r16[16];
            for (int i = 0; i < 16; i++) r16[i] = _mm512_loadu_ps((const float *)rows[i] + v0);
            transpose16(r16);
            for (int j = 0; j < 16; j++) _mm512_store_ps(sc->kt + ((int64_t)c * kvec + v0 + j) * 16, r16[j]);
        }
    }
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int r0 = 0; r0 < R; r0 += 8) {
        const int nr = R - r0 < 8 ? R - r0 : 8, last = len0 + (r0 + nr - 1) / g;
        __m512 mx[8];
        for (int k = 0; k < 8; k++) mx[k] = _mm512_set1_ps(-INFINITY);
        const float *qr[8];  /* the rows' queries as dwords: bf16 pairs */
        for (int k = 0; k < 8; k++) qr[k] = sc->q + (int64_t)(r0 + (k < nr ? k : nr - 1)) * kvec;
        for (int c = 0; c * 16 < last; c++) {
            __m512 acc[8];
            for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_ps();
            const float *kc = sc->kt + (int64_t)c * kvec * 16;
            for (int v = 0; v < kvec; v++) {
                const __m512 kv = _mm512_load_ps(kc + v * 16);
                for (int k = 0; k < 8; k++)
                    acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)kv, (__m512bh)_mm512_set1_ps(qr[k][v]));
            }
            for (int k = 0; k < nr; k++) {
                const int len = len0 + (r0 + k) / g, t0 = c * 16;
                const int live_n = len - t0 >= 16 ? 16 : len - t0 > 0 ? len - t0 : 0;
                const __mmask16 live = (__mmask16)((1u << live_n) - 1);
                const __m512 sv = _mm512_mul_ps(acc[k], scale);
                _mm512_store_ps(sc->scores + (int64_t)(r0 + k) * lpad + t0, _mm512_maskz_mov_ps(live, sv));
                mx[k] = _mm512_mask_max_ps(mx[k], live, mx[k], sv);
            }
        }
        for (int k = 0; k < nr; k++) {
            const int r = r0 + k, len = len0 + r / g;
            float *sr = sc->scores + (int64_t)r * lpad;
            const float inv = softmax_exp(sr, len, _mm512_reduce_max_ps(mx[k]));
            uint16_t *pr = sc->probs + (int64_t)r * lpad;
            const __m512 w = _mm512_set1_ps(inv);
            int t = 0;
            for (; t + 16 <= len; t += 16) store16_bf16(pr + t, _mm512_mul_ps(_mm512_loadu_ps(sr + t), w));
            for (; t < len; t++) pr[t] = f32_to_bf16(sr[t] * inv);
            for (; t < lpad; t++) pr[t] = 0;
        }
    }
}

/* out = p.V with vdpbf16ps on token pairs (as pv_bf16_pairs), RG rows at a time. */
static inline __attribute__((always_inline)) void tile_pv_bf16(const Args *a, const TileScratch *sc, const int64_t *bt,
                                                               int q0, int h, int R, int len0, int lmax, int lpad,
                                                               const int g, const int hd) {
    const int bs = a->block_size, nc = hd / 32, nv = hd / 16, RG = 24 / (hd / 16);
    const int64_t tok_stride = (int64_t)a->num_kv_heads * hd;
    const __m512i zero = _mm512_setzero_si512();
    for (int t0 = 0; t0 < lpad; t0 += 16) {  /* values as token pairs: vector (t/2, v) */
        const int n = lmax - t0 < 16 ? lmax - t0 : 16;
        const char *rows[16];
        chunk_rows(a->v_cache, bt, t0, n, bs, tok_stride, h, hd, 2, rows);
        for (int i = 0; i < 16; i += 2) {
            const int64_t pair = (t0 + i) / 2;
            for (int c = 0; c < nc; c++) {
                const __m512i x0 = i < n ? _mm512_loadu_si512((const uint16_t *)rows[i] + c * 32) : zero;
                const __m512i x1 = i + 1 < n ? _mm512_loadu_si512((const uint16_t *)rows[i + 1] + c * 32) : zero;
                _mm512_store_si512(sc->vt + (pair * nv + 2 * c) * 16, _mm512_unpacklo_epi16(x0, x1));
                _mm512_store_si512(sc->vt + (pair * nv + 2 * c + 1) * 16, _mm512_unpackhi_epi16(x0, x1));
            }
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int r0 = 0; r0 < R; r0 += RG) {
        const int nr = R - r0 < RG ? R - r0 : RG, last = len0 + (r0 + nr - 1) / g;
        __m512 acc[24];
        for (int i = 0; i < RG * nv; i++) acc[i] = _mm512_setzero_ps();
        for (int t = 0; t < last; t += 2) {
            const float *vp = sc->vt + (int64_t)(t / 2) * nv * 16;
            for (int k = 0; k < RG; k++) {
                const int64_t r = r0 + (k < nr ? k : nr - 1);
                uint32_t pair;
                memcpy(&pair, sc->probs + r * lpad + t, 4);
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int v = 0; v < nv; v++)
                    acc[k * nv + v] = _mm512_dpbf16_ps(acc[k * nv + v], (__m512bh)_mm512_load_ps(vp + v * 16), pp);
            }
        }
        for (int k = 0; k < nr; k++) {
            const int r = r0 + k;
            uint16_t *o = (uint16_t *)a->out + ((int64_t)(q0 + r / g) * a->num_heads + h * g + r % g) * hd;
            for (int c = 0; c < nc; c++) {
                const __m512 lo = acc[k * nv + 2 * c], hi = acc[k * nv + 2 * c + 1];
                store16_bf16(o + c * 32, _mm512_permutex2var_ps(lo, first, hi));
                store16_bf16(o + c * 32 + 16, _mm512_permutex2var_ps(lo, second, hi));
            }
        }
    }
}

/* One item: queries [q0, q0 + nq) of one sequence (lengths consecutive), kv head h. */
static inline __attribute__((always_inline)) void tile_body(const Args *a, int q0, int nq, int h, void *buf,
                                                            const int g, const int hd) {
    const int R = nq * g;
    const int len0 = a->seq_lens[q0], lmax = a->seq_lens[q0 + nq - 1], lpad = (lmax + 15) & ~15;
    const int64_t *bt = a->block_tables + (int64_t)a->q_rows[q0] * a->bt_stride;
    const TileScratch sc = tile_scratch(buf, R, lpad, hd);
    for (int r = 0; r < R; r++)
        memcpy((uint16_t *)sc.q + (size_t)r * hd,
               (const uint16_t *)a->q + (int64_t)(q0 + r / g) * a->q_tok_stride + (int64_t)(h * g + r % g) * a->q_head_stride,
               (size_t)hd * 2);
    tile_scores(a, &sc, bt, h, R, len0, lmax, lpad, g, hd);
    tile_pv_bf16(a, &sc, bt, q0, h, R, len0, lmax, lpad, g, hd);
}

TILE_SPECS(tile, tile_body, 64) TILE_SPECS(tile, tile_body, 128)
static const tile_fn TILES[2][8] = {TILE_ROW(tile, 64), TILE_ROW(tile, 128)};
#endif /* __AVX512BF16__ */
#endif /* __AVX512F__ */
