/* float32 prefill tiles for paged_attention.c, included after the bf16 tiles
 * (paged_attention_tiles.h: transpose16, chunk_rows, take, QT) and the AVX-512
 * helpers (softmax_exp). Not a standalone header.
 *
 * Why: per query, float32 prefill attention ran at ~75 GFLOP/s on the demo
 * model (4x256 and 1x2048 alike), a third of the FMA peak: each query re-reads
 * its keys, and every 16 scores cost a cross-lane reduction. A tile is up to QT
 * consecutive queries of one sequence times the `group` heads sharing a KV
 * head; its keys are transposed once (16 keys per vector, one vector per dim),
 * so a row's scores for 32 keys come out of 2 x head_dim FMAs with the query
 * broadcast, 8 rows at a time, and the PV product broadcasts each row's
 * probability against value rows read in place, 6 rows at a time.
 *
 * Arithmetic: the per-query items' except the order of q.k's sums (here one
 * chain over the dims; there 16 lane chains then a tree), so scores may differ
 * in the last bit: scores = q.k * scale, exact max, vexp.h's exp, the sum, the
 * p.V chain over tokens in order from zero on unnormalized p, then * 1/sum, as
 * there. */

static inline size_t tile_bytes_f32(int rows, int lpad, int hd) {
    return (size_t)lpad * hd * 4 + (size_t)rows * lpad * 4 + (size_t)rows * hd * 4 + 4 * 64;
}

/* scores [R][lpad]: exp(score - max) up to each row's length, zero after; inv[r] = 1/sum. */
static inline __attribute__((always_inline)) void tile_scores_f32(const Args *a, float *kt, float *scores,
                                                                  const float *q, const int64_t *bt, int h, int R,
                                                                  int len0, int lmax, int lpad, float *inv,
                                                                  const int g, const int hd) {
    const int bs = a->block_size;
    const int64_t tok_stride = (int64_t)a->num_kv_heads * hd;
    for (int c = 0; c < lpad / 16; c++) {  /* keys, transposed: kt[c][d][16] */
        const int t0 = c * 16, n = lmax - t0 < 16 ? lmax - t0 : 16;
        const char *rows[16];
        chunk_rows(a->k_cache, bt, t0, n, bs, tok_stride, h, hd, 4, rows);
        for (int d0 = 0; d0 < hd; d0 += 16) {
            __m512 r16[16];
            for (int i = 0; i < 16; i++) r16[i] = _mm512_loadu_ps((const float *)rows[i] + d0);
            transpose16(r16);
            for (int j = 0; j < 16; j++) _mm512_store_ps(kt + ((int64_t)c * hd + d0 + j) * 16, r16[j]);
        }
    }
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int r0 = 0; r0 < R; r0 += 8) {
        const int nr = R - r0 < 8 ? R - r0 : 8, last = len0 + (r0 + nr - 1) / g;
        __m512 mx[8];
        for (int k = 0; k < 8; k++) mx[k] = _mm512_set1_ps(-INFINITY);
        const float *qr[8];
        for (int k = 0; k < 8; k++) qr[k] = q + (int64_t)(r0 + (k < nr ? k : nr - 1)) * hd;
        for (int c = 0; c * 16 < last; c += 2) {
            const int two = (c + 1) * 16 < last;  /* a second chunk of 16 keys in range */
            __m512 acc[8][2];
            for (int k = 0; k < 8; k++) acc[k][0] = acc[k][1] = _mm512_setzero_ps();
            const float *k0 = kt + (int64_t)c * hd * 16, *k1 = k0 + (int64_t)hd * 16;
            if (two) {
                for (int d = 0; d < hd; d++) {
                    const __m512 a0 = _mm512_load_ps(k0 + d * 16), a1 = _mm512_load_ps(k1 + d * 16);
                    for (int k = 0; k < 8; k++) {
                        const __m512 b = _mm512_set1_ps(qr[k][d]);
                        acc[k][0] = _mm512_fmadd_ps(b, a0, acc[k][0]);
                        acc[k][1] = _mm512_fmadd_ps(b, a1, acc[k][1]);
                    }
                }
            } else {
                for (int d = 0; d < hd; d++) {
                    const __m512 a0 = _mm512_load_ps(k0 + d * 16);
                    for (int k = 0; k < 8; k++) acc[k][0] = _mm512_fmadd_ps(_mm512_set1_ps(qr[k][d]), a0, acc[k][0]);
                }
            }
            for (int k = 0; k < nr; k++) {
                const int len = len0 + (r0 + k) / g;
                for (int half = 0; half <= two; half++) {
                    const int t0 = (c + half) * 16;
                    const int live_n = len - t0 >= 16 ? 16 : len - t0 > 0 ? len - t0 : 0;
                    const __mmask16 live = (__mmask16)((1u << live_n) - 1);
                    const __m512 sv = _mm512_mul_ps(acc[k][half], scale);
                    _mm512_store_ps(scores + (int64_t)(r0 + k) * lpad + t0, _mm512_maskz_mov_ps(live, sv));
                    mx[k] = _mm512_mask_max_ps(mx[k], live, mx[k], sv);
                }
            }
        }
        for (int k = 0; k < nr; k++) {
            const int r = r0 + k, len = len0 + r / g;
            float *sr = scores + (int64_t)r * lpad;
            inv[r] = softmax_exp(sr, len, _mm512_reduce_max_ps(mx[k]));
            for (int t = len; t < lpad; t++) sr[t] = 0.0f;
        }
    }
}

/* out = (p.V) * inv, the chain over tokens in order; V rows read in place, 16 tokens at a time. */
static inline __attribute__((always_inline)) void tile_pv_f32(const Args *a, const float *scores, const float *inv,
                                                              const int64_t *bt, int q0, int h, int R, int len0,
                                                              int lpad, const int g, const int hd) {
    const int bs = a->block_size, nv = hd / 16, RG = 24 / nv;  /* 24 accumulators */
    const int64_t tok_stride = (int64_t)a->num_kv_heads * hd;
    for (int r0 = 0; r0 < R; r0 += RG) {
        const int nr = R - r0 < RG ? R - r0 : RG, last = len0 + (r0 + nr - 1) / g;
        __m512 acc[6][MAX_HD / 16];
        for (int k = 0; k < RG; k++)
            for (int v = 0; v < nv; v++) acc[k][v] = _mm512_setzero_ps();
        const float *pr[6];
        for (int k = 0; k < RG; k++) pr[k] = scores + (int64_t)(r0 + (k < nr ? k : nr - 1)) * lpad;
        for (int t0 = 0; t0 < last; t0 += 16) {
            const int n = last - t0 < 16 ? last - t0 : 16;
            const char *rows[16];
            chunk_rows(a->v_cache, bt, t0, n, bs, tok_stride, h, hd, 4, rows);
            for (int i = 0; i < n; i++) {
                __m512 vr[MAX_HD / 16];
                for (int v = 0; v < nv; v++) vr[v] = _mm512_loadu_ps((const float *)rows[i] + v * 16);
                for (int k = 0; k < RG; k++) {
                    const __m512 p = _mm512_set1_ps(pr[k][t0 + i]);
                    for (int v = 0; v < nv; v++) acc[k][v] = _mm512_fmadd_ps(p, vr[v], acc[k][v]);
                }
            }
        }
        for (int k = 0; k < nr; k++) {
            const int r = r0 + k;
            float *o = (float *)a->out + ((int64_t)(q0 + r / g) * a->num_heads + h * g + r % g) * hd;
            const __m512 w = _mm512_set1_ps(inv[r]);
            for (int v = 0; v < nv; v++) _mm512_storeu_ps(o + v * 16, _mm512_mul_ps(acc[k][v], w));
        }
    }
}

/* One item: queries [q0, q0 + nq) of one sequence (lengths consecutive), kv head h. */
static inline __attribute__((always_inline)) void tile_body_f32(const Args *a, int q0, int nq, int h, void *buf,
                                                                const int g, const int hd) {
    const int R = nq * g;
    const int len0 = a->seq_lens[q0], lmax = a->seq_lens[q0 + nq - 1], lpad = (lmax + 15) & ~15;
    const int64_t *bt = a->block_tables + (int64_t)a->q_rows[q0] * a->bt_stride;
    char *p = (char *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
    float *kt = take(&p, (size_t)lpad * hd * 4), *scores = take(&p, (size_t)R * lpad * 4);
    float *q = take(&p, (size_t)R * hd * 4);
    float inv[QT * MAX_GROUP];
    for (int r = 0; r < R; r++)
        memcpy(q + (size_t)r * hd,
               (const float *)a->q + (int64_t)(q0 + r / g) * a->q_tok_stride + (int64_t)(h * g + r % g) * a->q_head_stride,
               (size_t)hd * 4);
    tile_scores_f32(a, kt, scores, q, bt, h, R, len0, lmax, lpad, inv, g, hd);
    tile_pv_f32(a, scores, inv, bt, q0, h, R, len0, lpad, g, hd);
}

TILE_SPECS(tile_f32, tile_body_f32, 64) TILE_SPECS(tile_f32, tile_body_f32, 128)
static const tile_fn TILES_F32[2][8] = {TILE_ROW(tile_f32, 64), TILE_ROW(tile_f32, 128)};
