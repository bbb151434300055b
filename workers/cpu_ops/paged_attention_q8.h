/* Quantized KV caches for paged_attention.c, which includes it last (it uses
 * that file's Args, run() and limits, and with AVX-512 the helpers of
 * paged_attention_avx512.h). Not a standalone header.
 *
 * A cache row (one token, one kv head) is head_dim one-byte codes, int8 or
 * fp8 E4M3 (fn: no infinities, max 448), then its float32 scale: x = code *
 * scale (workers/attention/kv_quant.py defines the format; the write here is
 * bit-identical to its torch definition). Rows are dequantized as they are
 * read: the scale multiplies a whole q.k dot (K) or a probability (V), so the
 * inner loops only widen codes to float32. Accumulation is float32 as in the
 * unquantized kernels. Prefill runs go per query (no tiles): the tile paths
 * stay float/bf16 only. */

#define Q8_SCALE_BYTES 4
#define Q8_INT8 1
#define Q8_FP8 2

/* ---------------- codes <-> float32, scalar ---------------- */

static inline float i8_to_f32(uint8_t b) { return (float)(int8_t)b; }

/* E4M3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9). */
static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t mag = b & 0x7Fu;
    float f;
    if (mag < 8) {
        f = (float)mag * (1.0f / 512.0f);
    } else {
        const uint32_t u = (mag << 20) + (120u << 23);
        memcpy(&f, &u, 4);
    }
    return (b & 0x80u) ? -f : f;
}

/* Round to nearest even, saturating at 448 (torch's float -> float8_e4m3fn on clamped input). */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7FFFFFFFu;
    float a;
    memcpy(&a, &u, 4);
    if (!(a < 448.0f)) return sign | 0x7E;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.0f);   /* below 2^-6: subnormal */
    u += 0x7FFFFu + ((u >> 20) & 1u);                                  /* round to 3 mantissa bits */
    uint32_t r = (u >> 20) - (120u << 3);
    return sign | (uint8_t)(r > 0x7E ? 0x7E : r);
}

/* One row of x (float32, n values) -> codes + scale, as kv_quant.quantize does. */
static void q8_encode_row(const float *x, int n, int fmt, uint8_t *dst) {
    float amax = 0.0f;
    for (int d = 0; d < n; d++) { const float m = fabsf(x[d]); amax = m > amax ? m : amax; }
    const float scale = amax / (fmt == Q8_INT8 ? 127.0f : 448.0f);
    const float div = scale > 0.0f ? scale : 1.0f;
    for (int d = 0; d < n; d++) {
        const float y = x[d] / div;
        if (fmt == Q8_INT8) {
            float r = nearbyintf(y);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            dst[d] = (uint8_t)(int8_t)r;
        } else {
            dst[d] = f32_to_e4m3(y > 448.0f ? 448.0f : y < -448.0f ? -448.0f : y);
        }
    }
    memcpy(dst + n, &scale, 4);
}

/* The step's new K and V into their slots (slot < 0: skipped). k/v rows: [T][nkv][hd] with
 * the given token and head strides (elements), bf16 or float32. */
int kv_write_q8(const void *k, int64_t k_tok_stride, int64_t k_head_stride,
                const void *v, int64_t v_tok_stride, int64_t v_head_stride,
                void *k_cache, void *v_cache, const int64_t *slots, int T, int nkv, int hd,
                int in_bf16, int fmt) {
    if (hd <= 0 || hd > MAX_HD || (fmt != Q8_INT8 && fmt != Q8_FP8)) return -1;
    const int64_t row = hd + Q8_SCALE_BYTES;
    float x[MAX_HD];
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        for (int kv = 0; kv < 2; kv++) {
            const void *src = kv ? v : k;
            const int64_t ts = kv ? v_tok_stride : k_tok_stride, hs = kv ? v_head_stride : k_head_stride;
            uint8_t *dst = (uint8_t *)(kv ? v_cache : k_cache) + slots[t] * nkv * row;
            for (int h = 0; h < nkv; h++) {
                const int64_t off = (int64_t)t * ts + (int64_t)h * hs;
                for (int d = 0; d < hd; d++)
                    x[d] = in_bf16 ? bf16_to_f32(((const uint16_t *)src)[off + d]) : ((const float *)src)[off + d];
                q8_encode_row(x, hd, fmt, dst + h * row);
            }
        }
    }
    return 0;
}

/* ---------------- portable path ---------------- */

#define DEFINE_ITEM_Q8_C(NAME, T, LOAD, STORE, DECODE)                                          \
static void NAME(const Args *a, int s, int h0, int h1, float *scores) {                        \
    const int g = a->group, hd = a->head_dim, bs = a->block_size, ml = a->max_len;            \
    const int len = a->seq_lens[s] < ml ? a->seq_lens[s] : ml;                                 \
    const int64_t row_b = hd + Q8_SCALE_BYTES, tok_b = (int64_t)a->num_kv_heads * row_b;      \
    const int64_t *bt = a->block_tables + (int64_t)a->q_rows[s] * a->bt_stride;                \
    const T *qs = (const T *)a->q + (int64_t)s * a->q_tok_stride;                              \
    float qf[MAX_GROUP][MAX_HD], acc[MAX_GROUP][MAX_HD], row[MAX_HD], mx[MAX_GROUP], inv[MAX_GROUP]; \
    for (int h = h0; h < h1; h++) {                                                            \
        for (int j = 0; j < g; j++) {                                                          \
            const T *qj = qs + (int64_t)(h * g + j) * a->q_head_stride;                        \
            for (int d = 0; d < hd; d++) qf[j][d] = LOAD(qj[d]);                               \
            mx[j] = -INFINITY;                                                                 \
        }                                                                                      \
        for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) {                                     \
            const int n = len - t0 < bs ? len - t0 : bs;                                       \
            const uint8_t *kb = (const uint8_t *)a->k_cache + bt[b] * bs * tok_b + h * row_b;  \
            for (int i = 0; i < n; i++) {                                                      \
                const uint8_t *r = kb + i * tok_b;                                             \
                float ks;                                                                      \
                memcpy(&ks, r + hd, 4);                                                        \
                for (int d = 0; d < hd; d++) row[d] = DECODE(r[d]);                            \
                for (int j = 0; j < g; j++) {                                                  \
                    float dot = 0.0f;                                                          \
                    for (int d = 0; d < hd; d++) dot += qf[j][d] * row[d];                     \
                    dot = dot * ks * a->scale;                                                 \
                    scores[(int64_t)j * ml + t0 + i] = dot;                                    \
                    mx[j] = dot > mx[j] ? dot : mx[j];                                         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < g; j++) {                                                          \
            float *sj = scores + (int64_t)j * ml, sum = 0.0f;                                  \
            for (int t = 0; t < len; t++) { sj[t] = exp_scalar(sj[t] - mx[j]); sum += sj[t]; } \
            inv[j] = 1.0f / sum;                                                               \
            memset(acc[j], 0, sizeof(float) * hd);                                             \
        }                                                                                      \
        for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) {                                     \
            const int n = len - t0 < bs ? len - t0 : bs;                                       \
            const uint8_t *vb = (const uint8_t *)a->v_cache + bt[b] * bs * tok_b + h * row_b;  \
            for (int i = 0; i < n; i++) {                                                      \
                const uint8_t *r = vb + i * tok_b;                                             \
                float vs;                                                                      \
                memcpy(&vs, r + hd, 4);                                                        \
                for (int d = 0; d < hd; d++) row[d] = DECODE(r[d]);                            \
                for (int j = 0; j < g; j++) {                                                  \
                    const float p = scores[(int64_t)j * ml + t0 + i] * vs;                     \
                    for (int d = 0; d < hd; d++) acc[j][d] += p * row[d];                      \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < g; j++) {                                                          \
            T *oj = (T *)a->out + ((int64_t)s * a->num_heads + h * g + j) * hd;                \
            for (int d = 0; d < hd; d++) oj[d] = STORE(acc[j][d] * inv[j]);                    \
        }                                                                                      \
    }                                                                                          \
}

DEFINE_ITEM_Q8_C(item_q8c_bf16_i8, uint16_t, bf16_to_f32, f32_to_bf16, i8_to_f32)
DEFINE_ITEM_Q8_C(item_q8c_bf16_f8, uint16_t, bf16_to_f32, f32_to_bf16, e4m3_to_f32)
DEFINE_ITEM_Q8_C(item_q8c_f32_i8, float, F32_ID, F32_ID, i8_to_f32)
DEFINE_ITEM_Q8_C(item_q8c_f32_f8, float, F32_ID, F32_ID, e4m3_to_f32)

/* ---------------- AVX-512 path (head_dim % 32 == 0) ---------------- */
#ifdef __AVX512F__

static inline __m512 dec16_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline __m512 dec16_f8(const uint8_t *p) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
    const __m512i sgn = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    const __m512 nrm = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512.0f));
    const __m512 r = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), nrm, sub);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sgn));
}

/* Decoded key rows for scoring. Float32 queries: rows of float32, scored with FMA. bf16
 * queries with AVX512-BF16: rows of bf16 (exact: int8 and E4M3 values have at most 8
 * significant bits), scored with vdpbf16ps on (dim, dim + 1) pairs as the bf16 path scores
 * bf16 keys: half the instructions and half the L1 traffic of float32 rows. */
#define Q8_DEC_F32(DECODE16, r, kr, hd) \
    for (int c = 0; c < (hd) / 16; c++) _mm512_store_ps((float *)(kr) + c * 16, DECODE16((r) + c * 16))
static inline __m512 q8_qprep_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 q8_dot_f32(__m512 acc, __m512 q, const void *k) { return _mm512_fmadd_ps(q, _mm512_load_ps((const float *)k), acc); }
#ifdef __AVX512BF16__
#define Q8_DEC_BF16(DECODE16, r, kr, hd)                                                           \
    for (int c = 0; c < (hd) / 32; c++)                                                            \
        _mm512_store_si512((uint16_t *)(kr) + c * 32,                                              \
                           (__m512i)_mm512_cvtne2ps_pbh(DECODE16((r) + c * 32 + 16), DECODE16((r) + c * 32)))
static inline __m512 q8_qprep_bf16(const uint16_t *p) { return _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
static inline __m512 q8_dot_bf16(__m512 acc, __m512 q, const void *k) {
    return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)_mm512_load_si512(k));
}
#define Q8_BF16_K(DECODE16) Q8_DEC_BF16, DECODE16, uint16_t, 32, q8_qprep_bf16, q8_dot_bf16
#else
static inline __m512 q8_qprep_bf16(const uint16_t *p) { return load16_bf16(p); }
#define Q8_BF16_K(DECODE16) Q8_DEC_F32, DECODE16, float, 16, q8_qprep_bf16, q8_dot_f32
#endif
#define Q8_F32_K(DECODE16) Q8_DEC_F32, DECODE16, float, 16, q8_qprep_f32, q8_dot_f32

/* q.k for key row i of the decoded chunk kf ([16][hd] of KT). */
#define Q8_DOT(KT, DOTK, QCH, i) ({ const KT *kr_ = kf + (i) * hd; __m512 d_ = _mm512_setzero_ps();                  \
                     for (int c = 0; c < nq; c++) d_ = DOTK(d_, qv[c], kr_ + c * QCH);                 \
                     d_; })

/* One item: query s over kv heads [h0, h1). Keys are decoded 16 rows at a time (once per
 * kv head, shared by its `group` query heads), scored with hsum16, and scaled per key by
 * its row scale; values are decoded row by row with the scale folded into p. */
#define DEFINE_ITEM_Q8_512(NAME, T, STOREV, DECODE16_V, DECK, DECODE16, KT, QCH, QPREP, DOTK)      \
static inline __attribute__((always_inline)) void NAME(const Args *a, int s, int h0, int h1,       \
                                                      float *buf, const int hd) {                  \
    const int g = a->group, bs = a->block_size, ml = a->max_len;                                  \
    const int len = a->seq_lens[s] < ml ? a->seq_lens[s] : ml;                                    \
    const int nc = hd / 16, nq = hd / QCH, nheads = (h1 - h0) * g;                               \
    const int64_t row_b = hd + Q8_SCALE_BYTES, tok_b = (int64_t)a->num_kv_heads * row_b;         \
    const int64_t *bt = a->block_tables + (int64_t)a->q_rows[s] * a->bt_stride;                   \
    const T *qs = (const T *)a->q + (int64_t)s * a->q_tok_stride;                                 \
    T *out_base = (T *)a->out + ((int64_t)s * a->num_heads + h0 * g) * hd;                        \
    const Scratch sc = scratch_of(a, buf);                                                        \
    __m512 *qall = (__m512 *)sc.q;                                                                \
    __m512 mxv[MAX_HEADS];                                                                        \
    KT kf[16 * MAX_HD] __attribute__((aligned(64)));                                              \
    float ks[16];                                                                                 \
    for (int hh = 0; hh < nheads; hh++) {                                                         \
        const T *qj = qs + (int64_t)(h0 * g + hh) * a->q_head_stride;                             \
        for (int c = 0; c < nq; c++) qall[hh * nq + c] = QPREP(qj + c * QCH);                     \
        mxv[hh] = _mm512_set1_ps(-INFINITY);                                                      \
    }                                                                                             \
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) {                                            \
        const int n = len - t0 < bs ? len - t0 : bs;                                              \
        const uint8_t *blk = (const uint8_t *)a->k_cache + bt[b] * bs * tok_b;                    \
        for (int i0 = 0; i0 < n; i0 += 16) {                                                      \
            const int m = n - i0 < 16 ? n - i0 : 16;                                              \
            const __mmask16 live = (__mmask16)((1u << m) - 1);                                    \
            for (int h = h0; h < h1; h++) {                                                       \
                for (int i = 0; i < 16; i++) {                                                    \
                    const uint8_t *r = blk + (int64_t)(i0 + (i < m ? i : m - 1)) * tok_b + h * row_b; \
                    DECK(DECODE16, r, kf + i * hd, hd);                                           \
                    memcpy(ks + i, r + hd, 4);                                                    \
                }                                                                                 \
                const __m512 ksv = _mm512_mul_ps(_mm512_loadu_ps(ks), _mm512_set1_ps(a->scale));  \
                for (int j = 0; j < g; j++) {                                                     \
                    const int hh = (h - h0) * g + j;                                              \
                    const __m512 *qv = qall + hh * nq;                                            \
                    __m512 sv = hsum16(Q8_DOT(KT, DOTK, QCH, 0), Q8_DOT(KT, DOTK, QCH, 1), Q8_DOT(KT, DOTK, QCH, 2), Q8_DOT(KT, DOTK, QCH, 3), Q8_DOT(KT, DOTK, QCH, 4), Q8_DOT(KT, DOTK, QCH, 5), \
                                       Q8_DOT(KT, DOTK, QCH, 6), Q8_DOT(KT, DOTK, QCH, 7), Q8_DOT(KT, DOTK, QCH, 8), Q8_DOT(KT, DOTK, QCH, 9), Q8_DOT(KT, DOTK, QCH, 10), Q8_DOT(KT, DOTK, QCH, 11), \
                                       Q8_DOT(KT, DOTK, QCH, 12), Q8_DOT(KT, DOTK, QCH, 13), Q8_DOT(KT, DOTK, QCH, 14), Q8_DOT(KT, DOTK, QCH, 15));           \
                    sv = _mm512_mul_ps(sv, ksv);                                                  \
                    _mm512_mask_storeu_ps(sc.scores + (int64_t)hh * ml + t0 + i0, live, sv);      \
                    mxv[hh] = _mm512_mask_max_ps(mxv[hh], live, mxv[hh], sv);                     \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    float inv[MAX_HEADS];                                                                         \
    for (int hh = 0; hh < nheads; hh++)                                                           \
        inv[hh] = softmax_exp(sc.scores + (int64_t)hh * ml, len, _mm512_reduce_max_ps(mxv[hh]));  \
    for (int i = 0; i < nheads * nc; i++) _mm512_storeu_ps(sc.acc + i * 16, _mm512_setzero_ps());  \
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, b++) {                                            \
        const int n = len - t0 < bs ? len - t0 : bs;                                              \
        const uint8_t *blk = (const uint8_t *)a->v_cache + bt[b] * bs * tok_b;                    \
        for (int h = h0; h < h1; h++) {                                                           \
            __m512 acc[MAX_GROUP][MAX_HD / 16];                                                   \
            float *accm = sc.acc + (int64_t)(h - h0) * g * hd;                                    \
            for (int j = 0; j < g; j++)                                                           \
                for (int c = 0; c < nc; c++) acc[j][c] = _mm512_loadu_ps(accm + j * hd + c * 16);  \
            for (int i = 0; i < n; i++) {                                                         \
                const uint8_t *r = blk + (int64_t)i * tok_b + h * row_b;                          \
                float vs;                                                                         \
                memcpy(&vs, r + hd, 4);                                                           \
                __m512 row[MAX_HD / 16];                                                          \
                for (int c = 0; c < nc; c++) row[c] = DECODE16_V(r + c * 16);                     \
                for (int j = 0; j < g; j++) {                                                     \
                    const __m512 p = _mm512_set1_ps(sc.scores[(int64_t)((h - h0) * g + j) * ml + t0 + i] * vs); \
                    for (int c = 0; c < nc; c++) acc[j][c] = _mm512_fmadd_ps(p, row[c], acc[j][c]); \
                }                                                                                 \
            }                                                                                     \
            for (int j = 0; j < g; j++)                                                           \
                for (int c = 0; c < nc; c++) _mm512_storeu_ps(accm + j * hd + c * 16, acc[j][c]); \
        }                                                                                         \
    }                                                                                             \
    for (int hh = 0; hh < nheads; hh++) {                                                         \
        const __m512 w = _mm512_set1_ps(inv[hh]);                                                 \
        for (int c = 0; c < nc; c++)                                                              \
            STOREV(out_base + (int64_t)hh * hd + c * 16, _mm512_mul_ps(_mm512_loadu_ps(sc.acc + hh * hd + c * 16), w)); \
    }                                                                                             \
}

/* the key-side arguments expand to several macro arguments: go through one more expansion */
#define DEFINE_ITEM_Q8_512_(...) DEFINE_ITEM_Q8_512(__VA_ARGS__)
DEFINE_ITEM_Q8_512_(body_q8_bf16_i8, uint16_t, store16_bf16, dec16_i8, Q8_BF16_K(dec16_i8))
DEFINE_ITEM_Q8_512_(body_q8_bf16_f8, uint16_t, store16_bf16, dec16_f8, Q8_BF16_K(dec16_f8))
DEFINE_ITEM_Q8_512_(body_q8_f32_i8, float, _mm512_storeu_ps, dec16_i8, Q8_F32_K(dec16_i8))
DEFINE_ITEM_Q8_512_(body_q8_f32_f8, float, _mm512_storeu_ps, dec16_f8, Q8_F32_K(dec16_f8))

#define Q8_SPECIALIZE(DT, FMT, HD)                                                                \
static void item_q8_##DT##_##FMT##_##HD(const Args *a, int s, int h0, int h1, float *buf) {      \
    body_q8_##DT##_##FMT(a, s, h0, h1, buf, HD); }
/* head_dim 64 (the demo's) unrolled; others through the generic body (each specialization
 * costs build time at every first start) */
#define Q8_SPECIALIZE_ALL(DT, FMT) Q8_SPECIALIZE(DT, FMT, 64)                                    \
static void item_q8_##DT##_##FMT##_any(const Args *a, int s, int h0, int h1, float *buf) {       \
    body_q8_##DT##_##FMT(a, s, h0, h1, buf, a->head_dim); }
Q8_SPECIALIZE_ALL(bf16, i8) Q8_SPECIALIZE_ALL(bf16, f8) Q8_SPECIALIZE_ALL(f32, i8) Q8_SPECIALIZE_ALL(f32, f8)

/* [q dtype: 0 f32, 1 bf16][fmt - 1][64, any] */
static const item_fn Q8_TABLE[2][2][2] = {
    {{item_q8_f32_i8_64, item_q8_f32_i8_any}, {item_q8_f32_f8_64, item_q8_f32_f8_any}},
    {{item_q8_bf16_i8_64, item_q8_bf16_i8_any}, {item_q8_bf16_f8_64, item_q8_bf16_f8_any}},
};
#endif /* __AVX512F__ */

static item_fn pick_q8(const Args *a, int q_bf16, int fmt) {
#ifdef __AVX512F__
    if (a->head_dim % 32 == 0 && a->num_heads <= MAX_HEADS)
        return Q8_TABLE[q_bf16][fmt - 1][a->head_dim == 64 ? 0 : 1];
#endif
    static const item_fn portable[2][2] = {{item_q8c_f32_i8, item_q8c_f32_f8}, {item_q8c_bf16_i8, item_q8c_bf16_f8}};
    return portable[q_bf16][fmt - 1];
}

/* paged_attention_{bf16,f32} over a quantized cache (k_cache/v_cache: rows of head_dim codes
 * + a float32 scale); q and out bf16 (q_bf16) or float32. */
int paged_attention_q8(const void *q, int64_t q_tok_stride, int64_t q_head_stride,
                       const void *k_cache, const void *v_cache, const int64_t *block_tables, int64_t bt_stride,
                       const int32_t *q_rows, const int32_t *seq_lens, void *out, int num_seqs, int num_heads,
                       int num_kv_heads, int head_dim, int block_size, float scale, int max_len, int num_threads,
                       int q_bf16, int fmt) {
    Args a = {q, q_tok_stride, q_head_stride, k_cache, v_cache, block_tables, bt_stride,
              q_rows, seq_lens, out, num_heads, num_kv_heads, head_dim, block_size, max_len,
              num_kv_heads > 0 ? num_heads / num_kv_heads : 0, scale, 0};
    if (check(&a) || (fmt != Q8_INT8 && fmt != Q8_FP8) || (q_bf16 != 0 && q_bf16 != 1)) return -1;
    return run(&a, num_seqs, num_threads, pick_q8(&a, q_bf16, fmt), NULL);
}
