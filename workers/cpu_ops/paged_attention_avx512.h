/* The AVX-512 (and AVX512-BF16) path of paged_attention.c, which includes it
 * after the portable path so each file holds one path. Not a standalone
 * header: it uses paged_attention.c's Args and MAX_* limits (exp512: vexp.h). */
/* ---------------- AVX-512 path (head_dim % 16 == 0) ---------------- */
#ifdef __AVX512F__

/* The next block sits anywhere in the pool, so the hardware prefetcher cannot
 * guess it: its rows are asked for while the current block is being worked on,
 * a few lines at a time between the dot products (pf_some), into L2. Issued all
 * at once at the block's start (192 lines for a float32 block of 16 tokens x 3
 * kv heads), the prefetches filled the core's miss buffers and stalled it until
 * the block had arrived, so memory time and compute added up; spread out, they
 * overlap, and decode attention runs at about the time the same bytes take to
 * stream with no compute. L2, not L1 (T0): L1's miss buffers are the scarce
 * ones, so the spread gains much less there. */
typedef struct {
    const char *p;
    int64_t stride;
    int row_lines, rows, row, line;
} PfCursor;

/* The rows of the block after `b` (none past the context's end). */
static inline PfCursor pf_next_block(const void *cache, const int64_t *bt, int b, int t0, int len,
                                     int bs, int64_t tok_stride_bytes, int64_t range_off_bytes,
                                     int row_bytes) {
    PfCursor c = {NULL, tok_stride_bytes, (row_bytes + 63) / 64, 0, 0, 0};
    if (t0 + bs < len) {
        c.p = (const char *)cache + bt[b + 1] * bs * tok_stride_bytes + range_off_bytes;
        c.rows = bs;
    }
    return c;
}

/* Lines of the cursor's block still to ask for, spread over `steps` calls of pf_some. */
static inline int pf_share(const PfCursor *c, int steps) {
    return steps > 0 ? (c->rows * c->row_lines + steps - 1) / steps : 0;
}

static inline __attribute__((always_inline)) void pf_some(PfCursor *c, int k) {
    while (k-- > 0 && c->row < c->rows) {
        _mm_prefetch(c->p + (int64_t)c->row * c->stride + c->line * 64, _MM_HINT_T1);
        if (++c->line == c->row_lines) {
            c->line = 0;
            c->row++;
        }
    }
}

static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void store16_bf16(uint16_t *p, __m512 v) {
#ifdef __AVX512BF16__
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
    uint32_t tmp[16];
    _mm512_storeu_si512(tmp, _mm512_castps_si512(v));
    for (int i = 0; i < 16; i++) { union { uint32_t u; float f; } c = {tmp[i]}; p[i] = f32_to_bf16(c.f); }
#endif
}

/* exp, sum and 1/sum of one head's scores, in place. */
static inline float softmax_exp(float *sj, int len, float mx) {
    __m512 m = _mm512_set1_ps(mx), sum = _mm512_setzero_ps();
    int t = 0;
    for (; t + 16 <= len; t += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sj + t), m));
        _mm512_storeu_ps(sj + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (t < len) {
        __mmask16 k = (__mmask16)((1u << (len - t)) - 1);
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sj + t), m));
        _mm512_mask_storeu_ps(sj + t, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* Sum each of 16 vectors into one lane: out[i] = sum(v_i), in 45 shuffles/adds
 * instead of 16 horizontal reductions (scores come 16 keys at a time). The
 * vectors are separate arguments, not an array: with an array gcc kept them
 * on the stack, and the 512-bit store-to-load round trips made scoring ~3x slower. */
static inline __attribute__((always_inline)) __m512 hsum16(
        __m512 v0, __m512 v1, __m512 v2, __m512 v3, __m512 v4, __m512 v5, __m512 v6, __m512 v7,
        __m512 v8, __m512 v9, __m512 v10, __m512 v11, __m512 v12, __m512 v13, __m512 v14, __m512 v15) {
#define HALVES(a, b) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE))
#define QUARTERS(a, b) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD))
#define PAIRS_(a, b) _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE))
#define SINGLES(a, b) _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD))
    const __m512 w0 = HALVES(v0, v8), w1 = HALVES(v1, v9), w2 = HALVES(v2, v10), w3 = HALVES(v3, v11);
    const __m512 w4 = HALVES(v4, v12), w5 = HALVES(v5, v13), w6 = HALVES(v6, v14), w7 = HALVES(v7, v15);
    /* quarters of x_k hold partial sums of v_k, v_k+8, v_k+4, v_k+12 */
    const __m512 x0 = QUARTERS(w0, w4), x1 = QUARTERS(w1, w5), x2 = QUARTERS(w2, w6), x3 = QUARTERS(w3, w7);
    const __m512 y0 = PAIRS_(x0, x2), y1 = PAIRS_(x1, x3);
    const __m512 z = SINGLES(y0, y1);
#undef HALVES
#undef QUARTERS
#undef PAIRS_
#undef SINGLES
    /* z[l] = sum(v_perm[l]) with perm an involution, so the same index undoes it */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), z);
}

/* The per-thread scratch an item works in, carved from one allocation:
 * scores [heads][max_len] float, probabilities [heads][max_len + 2] bf16,
 * accumulators [heads][head_dim] float, q [heads][head_dim] float. */
typedef struct {
    float *scores, *acc, *q;
    uint16_t *probs;
    int64_t pstride;
} Scratch;

static size_t scratch_floats(const Args *a) {
    const size_t nh = (size_t)a->num_heads, ml = (size_t)(a->max_len > 0 ? a->max_len : 1);
    return nh * ml + (nh * (ml + 2) + 1) / 2 + 2 * nh * (size_t)a->head_dim + 64;
}

static Scratch scratch_of(const Args *a, float *buf) {
    const int64_t nh = a->num_heads, ml = a->max_len > 0 ? a->max_len : 1;
    Scratch sc;
    sc.scores = buf;
    sc.probs = (uint16_t *)(buf + nh * ml);
    sc.pstride = ml + 2;
    float *rest = buf + nh * ml + (nh * (ml + 2) + 1) / 2;
    rest = (float *)(((uintptr_t)rest + 63) & ~(uintptr_t)63);
    sc.acc = rest;
    sc.q = rest + nh * a->head_dim;
    return sc;
}

/* q . key for each of 16 keys of a chunk (rows past the chunk's end re-read
 * its last row; their lanes get masked), reduced to one vector of 16 scores. */
#define DOTQ(DOTK, QCHUNK, i) ({ __typeof__(kr0) kr_ = kr0 + (int64_t)((i) < m ? (i) : m - 1) * tok_stride; \
                   __m512 d_ = _mm512_setzero_ps();                                            \
                   for (int c = 0; c < nq; c++) d_ = DOTK(d_, qj[c], kr_ + c * QCHUNK);        \
                   d_; })

/* One item: query s against its context, for kv heads [h0, h1).
 * Keys are walked once, in 16-key chunks, and every head in the range is
 * scored on a chunk while its rows are in L1 (walking each head separately
 * re-streamed the rows from L2 per head: measured ~2x slower).
 * LOADV(ptr): 16 elements as float32; QPREP stores q chunks in the form DOTK
 * takes; DOTK(acc, q chunk, k row) adds q.k over QCHUNK dims; PAIRS: the PV
 * pass uses vdpbf16ps on token pairs (bf16 with AVX512-BF16 only).
 * Always inlined into wrappers with constant (group, head_dim) so loops unroll. */
#define DEFINE_ITEM_512(NAME, T, LOADV, STOREV, QCHUNK, QPREP, DOTK, PAIRS)                      \
static inline __attribute__((always_inline)) void NAME(const Args *a, int s, int h0, int h1,     \
                                                      float *buf, const int g, const int hd) {   \
    const int bs = a->block_size, ml = a->max_len, nkv = a->num_kv_heads;                       \
    const int len = a->seq_lens[s] < ml ? a->seq_lens[s] : ml;                                  \
    const int nc = hd / 16, nq = hd / QCHUNK, nheads = (h1 - h0) * g;                           \
    const int64_t tok_stride = (int64_t)nkv * hd;                                               \
    const int64_t *bt = a->block_tables + (int64_t)a->q_rows[s] * a->bt_stride;                 \
    const T *qs = (const T *)a->q + (int64_t)s * a->q_tok_stride;                               \
    T *out_base = (T *)a->out + ((int64_t)s * a->num_heads + h0 * g) * hd;                      \
    const Scratch sc = scratch_of(a, buf);                                                      \
    __m512 *qv = (__m512 *)sc.q;                                                                \
    __m512 mxv[MAX_HEADS];                                                                      \
    const __m512 scale = _mm512_set1_ps(a->scale);                                              \
    for (int hh = 0; hh < nheads; hh++) {                                                       \
        const T *qj = qs + (int64_t)(h0 * g + hh) * a->q_head_stride;                           \
        for (int c = 0; c < nq; c++) qv[hh * nq + c] = QPREP(qj + c * QCHUNK);                  \
        mxv[hh] = _mm512_set1_ps(-INFINITY);                                                    \
    }                                                                                           \
    const int64_t range_off = (int64_t)h0 * hd, range_bytes = (int64_t)(h1 - h0) * hd * sizeof(T); \
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) {                                          \
        const int n = len - t0 < bs ? len - t0 : bs;                                            \
        const T *blk = (const T *)a->k_cache + bt[b] * bs * tok_stride;                         \
        PfCursor pf = pf_next_block(a->k_cache, bt, b, t0, len, bs, tok_stride * (int64_t)sizeof(T), \
                                    range_off * (int64_t)sizeof(T), (int)range_bytes);          \
        const int pf_k = pf_share(&pf, (n + 15) / 16 * nheads);                                 \
        for (int i0 = 0; i0 < n; i0 += 16) {                                                    \
            const int m = n - i0 < 16 ? n - i0 : 16;                                            \
            const __mmask16 live = (__mmask16)((1u << m) - 1);                                  \
            for (int h = h0; h < h1; h++) {                                                     \
                const T *kr0 = blk + (int64_t)i0 * tok_stride + (int64_t)h * hd;                \
                for (int j = 0; j < g; j++) {                                                   \
                    const int hh = (h - h0) * g + j;                                            \
                    const __m512 *qj = qv + hh * nq;                                            \
                    pf_some(&pf, pf_k);                                                         \
                    __m512 sv = hsum16(DOTQ(DOTK, QCHUNK, 0), DOTQ(DOTK, QCHUNK, 1), DOTQ(DOTK, QCHUNK, 2), \
                                       DOTQ(DOTK, QCHUNK, 3), DOTQ(DOTK, QCHUNK, 4), DOTQ(DOTK, QCHUNK, 5), \
                                       DOTQ(DOTK, QCHUNK, 6), DOTQ(DOTK, QCHUNK, 7), DOTQ(DOTK, QCHUNK, 8), \
                                       DOTQ(DOTK, QCHUNK, 9), DOTQ(DOTK, QCHUNK, 10), DOTQ(DOTK, QCHUNK, 11), \
                                       DOTQ(DOTK, QCHUNK, 12), DOTQ(DOTK, QCHUNK, 13), DOTQ(DOTK, QCHUNK, 14), \
                                       DOTQ(DOTK, QCHUNK, 15));                                 \
                    sv = _mm512_mul_ps(sv, scale);                                              \
                    _mm512_mask_storeu_ps(sc.scores + (int64_t)hh * ml + t0 + i0, live, sv);    \
                    mxv[hh] = _mm512_mask_max_ps(mxv[hh], live, mxv[hh], sv);                   \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    float inv[MAX_HEADS];                                                                       \
    for (int hh = 0; hh < nheads; hh++)                                                         \
        inv[hh] = softmax_exp(sc.scores + (int64_t)hh * ml, len, _mm512_reduce_max_ps(mxv[hh])); \
    if (PAIRS && bs % 2 == 0) {                                                                 \
        pv_bf16_pairs(a, bt, h0, h1, len, &sc, inv, (uint16_t *)out_base, g, hd);               \
        return;                                                                                 \
    }                                                                                           \
    for (int i = 0; i < nheads * nc; i++) _mm512_storeu_ps(sc.acc + i * 16, _mm512_setzero_ps()); \
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) {                                          \
        const int n = len - t0 < bs ? len - t0 : bs;                                            \
        const T *blk = (const T *)a->v_cache + bt[b] * bs * tok_stride;                         \
        PfCursor pf = pf_next_block(a->v_cache, bt, b, t0, len, bs, tok_stride * (int64_t)sizeof(T), \
                                    range_off * (int64_t)sizeof(T), (int)range_bytes);          \
        const int pf_k = pf_share(&pf, n * (h1 - h0));                                          \
        for (int h = h0; h < h1; h++) {                                                         \
            __m512 acc[MAX_GROUP][MAX_HD / 16];                                                 \
            float *accm = sc.acc + (int64_t)(h - h0) * g * hd;                                  \
            for (int j = 0; j < g; j++)                                                         \
                for (int c = 0; c < nc; c++) acc[j][c] = _mm512_loadu_ps(accm + j * hd + c * 16); \
            for (int i = 0; i < n; i++) {                                                       \
                const T *vr = blk + (int64_t)i * tok_stride + (int64_t)h * hd;                  \
                pf_some(&pf, pf_k);                                                             \
                __m512 row[MAX_HD / 16];                                                        \
                for (int c = 0; c < nc; c++) row[c] = LOADV(vr + c * 16);                       \
                for (int j = 0; j < g; j++) {                                                   \
                    const __m512 p = _mm512_set1_ps(sc.scores[(int64_t)((h - h0) * g + j) * ml + t0 + i]); \
                    for (int c = 0; c < nc; c++) acc[j][c] = _mm512_fmadd_ps(p, row[c], acc[j][c]); \
                }                                                                               \
            }                                                                                   \
            for (int j = 0; j < g; j++)                                                         \
                for (int c = 0; c < nc; c++) _mm512_storeu_ps(accm + j * hd + c * 16, acc[j][c]); \
        }                                                                                       \
    }                                                                                           \
    for (int hh = 0; hh < nheads; hh++) {                                                       \
        const __m512 w = _mm512_set1_ps(inv[hh]);                                               \
        for (int c = 0; c < nc; c++)                                                            \
            STOREV(out_base + (int64_t)hh * hd + c * 16, _mm512_mul_ps(_mm512_loadu_ps(sc.acc + hh * hd + c * 16), w)); \
    }                                                                                           \
}

#ifdef __AVX512BF16__
/* out = sum_t p[t] * V[t] with vdpbf16ps on token pairs: rows t and t+1
 * interleaved into (V[t][d], V[t+1][d]) pairs, times the bf16 pair
 * (p[t], p[t+1]). p is the normalized softmax rounded to bf16, as HF's bf16
 * attention rounds it before its PV matmul. The 16-bit unpacks permute dims
 * within 128-bit lanes; one permute per output vector restores the order. */
static inline __attribute__((always_inline)) void pv_bf16_pairs(
        const Args *a, const int64_t *bt, int h0, int h1, int len, const Scratch *sc, const float *inv,
        uint16_t *out_base, const int g, const int hd) {
    const int bs = a->block_size, nc = hd / 32, ml = a->max_len, nheads = (h1 - h0) * g;
    const int64_t tok_stride = (int64_t)a->num_kv_heads * hd, ps = sc->pstride;
    for (int hh = 0; hh < nheads; hh++) {   /* normalized p in bf16, zero-padded to even length */
        const float *sj = sc->scores + (int64_t)hh * ml;
        uint16_t *pj = sc->probs + hh * ps;
        const __m512 w = _mm512_set1_ps(inv[hh]);
        int t = 0;
        for (; t + 16 <= len; t += 16) store16_bf16(pj + t, _mm512_mul_ps(_mm512_loadu_ps(sj + t), w));
        for (; t < len; t++) pj[t] = f32_to_bf16(sj[t] * inv[hh]);
        pj[len] = 0;
    }
    for (int i = 0; i < nheads * 2 * nc; i++) _mm512_storeu_ps(sc->acc + i * 16, _mm512_setzero_ps());
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) {
        const int n = len - t0 < bs ? len - t0 : bs;
        const uint16_t *blk = (const uint16_t *)a->v_cache + bt[b] * bs * tok_stride;
        PfCursor pf = pf_next_block(a->v_cache, bt, b, t0, len, bs, tok_stride * 2, (int64_t)h0 * hd * 2,
                                    (h1 - h0) * hd * 2);
        const int pf_k = pf_share(&pf, (n + 1) / 2 * (h1 - h0));
        for (int h = h0; h < h1; h++) {
            __m512 acc[MAX_GROUP][MAX_HD / 16];
            float *accm = sc->acc + (int64_t)(h - h0) * g * hd;
            for (int j = 0; j < g; j++)
                for (int c = 0; c < 2 * nc; c++) acc[j][c] = _mm512_loadu_ps(accm + j * hd + c * 16);
            for (int i = 0; i < n; i += 2) {
                const uint16_t *r0 = blk + (int64_t)i * tok_stride + (int64_t)h * hd, *r1 = r0 + tok_stride;
                pf_some(&pf, pf_k);
                __m512i lo[MAX_HD / 32], hi[MAX_HD / 32];
                for (int c = 0; c < nc; c++) {
                    __m512i x0 = _mm512_loadu_si512(r0 + c * 32);
                    __m512i x1 = i + 1 < n ? _mm512_loadu_si512(r1 + c * 32) : _mm512_setzero_si512();
                    lo[c] = _mm512_unpacklo_epi16(x0, x1);
                    hi[c] = _mm512_unpackhi_epi16(x0, x1);
                }
                for (int j = 0; j < g; j++) {
                    uint32_t pair;
                    memcpy(&pair, sc->probs + ((h - h0) * g + j) * ps + t0 + i, 4);
                    const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                    for (int c = 0; c < nc; c++) {
                        acc[j][2 * c] = _mm512_dpbf16_ps(acc[j][2 * c], (__m512bh)lo[c], pp);
                        acc[j][2 * c + 1] = _mm512_dpbf16_ps(acc[j][2 * c + 1], (__m512bh)hi[c], pp);
                    }
                }
            }
            for (int j = 0; j < g; j++)
                for (int c = 0; c < 2 * nc; c++) _mm512_storeu_ps(accm + j * hd + c * 16, acc[j][c]);
        }
    }
    /* lo lane 4L+m holds dim 8L+m, hi lane 4L+m holds dim 8L+4+m (within each 32-dim chunk) */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int hh = 0; hh < nheads; hh++) {
        const float *am = sc->acc + (int64_t)hh * hd;
        uint16_t *oj = out_base + (int64_t)hh * hd;
        for (int c = 0; c < nc; c++) {
            const __m512 lo = _mm512_loadu_ps(am + 32 * c), hi = _mm512_loadu_ps(am + 32 * c + 16);
            store16_bf16(oj + c * 32, _mm512_permutex2var_ps(lo, first, hi));
            store16_bf16(oj + c * 32 + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
    }
}
#define BF16_PAIRS 1
#else
static inline void pv_bf16_pairs(const Args *a, const int64_t *bt, int h0, int h1, int len, const Scratch *sc,
                                 const float *inv, uint16_t *out_base, const int g, const int hd) {
    (void)a; (void)bt; (void)h0; (void)h1; (void)len; (void)sc; (void)inv; (void)out_base; (void)g; (void)hd;
}
#define BF16_PAIRS 0
#endif

static inline __m512 f32_prep(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 f32_dot(__m512 acc, __m512 q, const float *k) { return _mm512_fmadd_ps(q, _mm512_loadu_ps(k), acc); }
DEFINE_ITEM_512(body_512_f32, float, _mm512_loadu_ps, _mm512_storeu_ps, 16, f32_prep, f32_dot, 0)

#ifdef __AVX512BF16__
/* 32 bf16 of q as 16 bf16 pairs; vdpbf16ps multiplies pairs exactly and adds in float32. */
static inline __m512 bf16_prep(const uint16_t *p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
static inline __m512 bf16_dot(__m512 acc, __m512 q, const uint16_t *k) {
    return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)_mm512_loadu_si512(k));
}
#define BF16_QCHUNK 32
#else
static inline __m512 bf16_prep(const uint16_t *p) { return load16_bf16(p); }
static inline __m512 bf16_dot(__m512 acc, __m512 q, const uint16_t *k) { return _mm512_fmadd_ps(q, load16_bf16(k), acc); }
#define BF16_QCHUNK 16
#endif
DEFINE_ITEM_512(body_512_bf16, uint16_t, load16_bf16, store16_bf16, BF16_QCHUNK, bf16_prep, bf16_dot, BF16_PAIRS)

typedef void (*item_fn)(const Args *, int, int, int, float *);

#define SPECIALIZE(DT, G, HD) \
static void item_512_##DT##_##G##_##HD(const Args *a, int s, int h0, int h1, float *buf) { body_512_##DT(a, s, h0, h1, buf, G, HD); }
#define SPECIALIZE_G(DT, HD) SPECIALIZE(DT, 1, HD) SPECIALIZE(DT, 2, HD) SPECIALIZE(DT, 3, HD) \
    SPECIALIZE(DT, 4, HD) SPECIALIZE(DT, 5, HD) SPECIALIZE(DT, 6, HD) SPECIALIZE(DT, 7, HD) SPECIALIZE(DT, 8, HD)
SPECIALIZE_G(bf16, 64) SPECIALIZE_G(bf16, 128) SPECIALIZE_G(f32, 64) SPECIALIZE_G(f32, 128)
static void item_512_bf16_any(const Args *a, int s, int h0, int h1, float *buf) { body_512_bf16(a, s, h0, h1, buf, a->group, a->head_dim); }
static void item_512_f32_any(const Args *a, int s, int h0, int h1, float *buf) { body_512_f32(a, s, h0, h1, buf, a->group, a->head_dim); }

#define TABLE_ROW(DT, HD) {item_512_##DT##_1_##HD, item_512_##DT##_2_##HD, item_512_##DT##_3_##HD, \
    item_512_##DT##_4_##HD, item_512_##DT##_5_##HD, item_512_##DT##_6_##HD, item_512_##DT##_7_##HD, item_512_##DT##_8_##HD}
static const item_fn TABLE_BF16[2][8] = {TABLE_ROW(bf16, 64), TABLE_ROW(bf16, 128)};
static const item_fn TABLE_F32[2][8] = {TABLE_ROW(f32, 64), TABLE_ROW(f32, 128)};

static item_fn pick_512(const item_fn table[2][8], item_fn any, const Args *a) {
    if (a->head_dim % 32 || a->num_heads > MAX_HEADS) return NULL;
    int row = a->head_dim == 64 ? 0 : a->head_dim == 128 ? 1 : -1;
    if (row >= 0 && a->group >= 1 && a->group <= 8) return table[row][a->group - 1];
    return any;
}
#endif /* __AVX512F__ */
