/* Greedy decoding's LM head in float32 without the float32 GEMM over the whole
 * vocabulary: the exact argmax from a bf16 screen plus a few exact dot products.
 *
 * Why: at 32 decode rows the float32 head (49k x 576 on the demo model) is a
 * sixth of a decode step, and a greedy row needs one number from it, the
 * argmax. The caller scores every token with bf16 copies of the row and of
 * the head (gemm.c's vdpbf16ps path, float32 accumulation and output: twice
 * the float32 rate), and bounds each score's distance from the float32 logit
 * the full GEMM would have produced (Cauchy-Schwarz on the rounding errors,
 * see kvyard.workers.model.greedy_screen):
 *     |s_v - f_v| <= B_v = alpha * wn_v + beta * dn_v
 * with wn_v = |w_v|, dn_v = |w_v - bf16(w_v)| per head row and alpha, beta per
 * decode row. Every v with f_v = max f must then satisfy s_v + B_v >= lo =
 * max_u (s_u - B_u), so only those candidates (a handful: median 4 on the
 * demo model) get their float32 logit, computed here as gemm.c computes it
 * (one FMA chain in k order from zero, so bit-identical), and the first
 * maximum wins, as torch.argmax picks. The token equals the full path's
 * token, always; a row with a non-finite score or too many candidates gets
 * -1 and the caller runs the full GEMM for it.
 *
 * Head rows are read through strides: element (v, k) is at
 * w[(v / 64) * ts + (v % 64) * rs + k * ks], so both a row-major matrix
 * (ts = 64 K, rs = K, ks = 1) and gemm.c's float32 tiles (ts = 64 K, rs = 1,
 * ks = 64) work without a copy. */
#include <math.h>
#include <stdint.h>
#include "bf16.h"
#include "pool.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_CAND_FRACTION 16  /* more than V / this candidates: not worth it, fall back */

/* Candidates a row may keep: sizes the scratch and bounds the collection alike. */
static inline int cand_cap(int V) { return V / MAX_CAND_FRACTION > 64 ? V / MAX_CAND_FRACTION : 64; }

typedef struct {
    const float *x; int64_t xs;      /* [n][K] float32 rows, as the full GEMM gets them */
    const float *s; int64_t ss;      /* [n][V] screen scores */
    const float *wn, *dn;            /* [V] */
    const uint16_t *xb; int64_t xbs; /* [n][K] the rows as the screen got them (bf16) */
    const float *w; int64_t ts, rs, ks;
    int n, V, K, idx32;
    int64_t *out;
} Refine;

#ifdef __AVX512F__
static inline int64_t row_offset(const Refine *r, int v) { return (int64_t)(v / 64) * r->ts + (int64_t)(v % 64) * r->rs; }

/* float32 logits of cand[0..nc) for row x, 16 candidates a vector (one gather per k)
 * when every element offset fits 32 bits, else one scalar chain each: same arithmetic. */
static void exact_logits(const Refine *r, const float *x, const int32_t *cand, int nc, float *logit) {
    for (int j = 0; j < nc; j += 16) {
        const int m = nc - j < 16 ? nc - j : 16;
        if (r->idx32) {
            const __mmask16 k16 = m == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1);
            int32_t o32[16] = {0};
            for (int l = 0; l < m; l++) o32[l] = (int32_t)row_offset(r, cand[j + l]);
            __m512i idx = _mm512_loadu_si512(o32);
            const __m512i step = _mm512_set1_epi32((int32_t)r->ks);
            __m512 acc = _mm512_setzero_ps();
            for (int k = 0; k < r->K; k++) {
                const __m512 wv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k16, idx, r->w, 4);
                acc = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), wv, acc);
                idx = _mm512_add_epi32(idx, step);
            }
            float tmp[16];
            _mm512_storeu_ps(tmp, acc);
            for (int l = 0; l < m; l++) logit[j + l] = tmp[l];
            continue;
        }
        for (int l = 0; l < m; l++) {
            const float *wr = r->w + row_offset(r, cand[j + l]);
            float a = 0.0f;
            for (int k = 0; k < r->K; k++) a = fmaf(x[k], wr[(int64_t)k * r->ks], a);
            logit[j + l] = a;
        }
    }
}

/* The bound's per-row factors (kvyard.workers.model.greedy_screen derives them), in
 * double, inflated by 0.1% for their own rounding and for float32's in B_v = alpha wn_v
 * + beta dn_v: alpha = |x - x^| + gamma (|x^| + |x|), beta = |x^| (1 + gamma), where x^
 * is the bf16 row with denormals flushed (vdpbf16ps reads them as zero) and gamma
 * covers one float32 chain of K additions. */
static void row_bound(const Refine *r, int i, float *alpha, float *beta) {
    const float *x = r->x + (int64_t)i * r->xs;
    const uint16_t *xb = r->xb + (int64_t)i * r->xbs;
    double ex = 0.0, xn = 0.0, xbn = 0.0;
    for (int k = 0; k < r->K; k++) {
        float b = bf16_to_f32(xb[k]);
        if (fabsf(b) < 0x1p-126f) b = 0.0f;
        const double d = (double)x[k] - b;
        ex += d * d;
        xn += (double)x[k] * x[k];
        xbn += (double)b * b;
    }
    const double u = 0x1p-24, g = r->K * u / (1.0 - r->K * u), safe = 1.001;
    ex = sqrt(ex), xn = sqrt(xn), xbn = sqrt(xbn);
    *alpha = (float)((ex + g * (xbn + xn)) * safe);
    *beta = (float)(xbn * (1.0 + g) * safe);
}

static int64_t refine_row(const Refine *r, int i, int32_t *cand, float *logit) {
    const float *s = r->s + (int64_t)i * r->ss, *x = r->x + (int64_t)i * r->xs;
    float a1, b1;
    row_bound(r, i, &a1, &b1);
    if (!isfinite(a1) || !isfinite(b1)) return -1;
    const __m512 alpha = _mm512_set1_ps(a1), beta = _mm512_set1_ps(b1);
    const int V = r->V, V16 = V / 16 * 16;
    /* pass 1: lo = max (s - B); any NaN/inf in s fails the row */
    __m512 lo = _mm512_set1_ps(-INFINITY), big = _mm512_setzero_ps();
    __mmask16 bad = 0;
    const __m512 inf = _mm512_set1_ps(INFINITY);
    for (int v = 0; v < V16; v += 16) {
        const __m512 sv = _mm512_loadu_ps(s + v);
        const __m512 b = _mm512_fmadd_ps(alpha, _mm512_loadu_ps(r->wn + v), _mm512_mul_ps(beta, _mm512_loadu_ps(r->dn + v)));
        lo = _mm512_max_ps(lo, _mm512_sub_ps(sv, b));
        big = _mm512_max_ps(big, _mm512_add_ps(_mm512_abs_ps(sv), b));
        bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(sv), inf, _CMP_NLT_UQ);  /* inf or NaN */
    }
    float low = _mm512_reduce_max_ps(lo), mag = _mm512_reduce_max_ps(big);
    int nonfinite = bad != 0;
    for (int v = V16; v < V; v++) {
        const float b = a1 * r->wn[v] + b1 * r->dn[v];
        if (!isfinite(s[v])) nonfinite = 1;
        if (s[v] - b > low) low = s[v] - b;
        if (fabsf(s[v]) + b > mag) mag = fabsf(s[v]) + b;
    }
    if (nonfinite || !isfinite(low) || !isfinite(mag)) return -1;
    /* s - B and s + B were rounded (<= 2^-24 of mag each): 2^-20 of mag covers both;
     * products vdpbf16ps flushed as denormals add at most K * 2^-126 */
    low -= mag * 0x1p-20f + (float)r->K * 0x1p-100f;
    /* pass 2: the candidates, in vocabulary order */
    int nc = 0;
    const int cap = cand_cap(V);
    const __m512 thr = _mm512_set1_ps(low);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int v = 0; v < V16; v += 16) {
        const __m512 sv = _mm512_loadu_ps(s + v);
        const __m512 b = _mm512_fmadd_ps(alpha, _mm512_loadu_ps(r->wn + v), _mm512_mul_ps(beta, _mm512_loadu_ps(r->dn + v)));
        const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_add_ps(sv, b), thr, _CMP_GE_OQ);
        if (keep) {
            if (nc + 16 > cap) return -1;
            _mm512_mask_compressstoreu_epi32(cand + nc, keep, _mm512_add_epi32(lane, _mm512_set1_epi32(v)));
            nc += __builtin_popcount(keep);
        }
    }
    for (int v = V16; v < V; v++) {
        const float b = a1 * r->wn[v] + b1 * r->dn[v];
        if (s[v] + b >= low) {
            if (nc + 1 > cap) return -1;
            cand[nc++] = v;
        }
    }
    if (nc == 0) return -1;  /* cannot happen with a sound bound; be safe */
    exact_logits(r, x, cand, nc, logit);
    int best = 0;
    for (int j = 1; j < nc; j++)
        if (logit[j] > logit[best]) best = j;  /* strict: the first maximum, as argmax */
    if (!isfinite(logit[best])) return -1;
    return cand[best];
}

static void refine_task(void *arg, int tid, int nt) {
    const Refine *r = (const Refine *)arg;
    const int cap = cand_cap(r->V);
    char *buf = (char *)kv_scratch((size_t)(cap + 16) * 8);
    for (int i = (int)((int64_t)r->n * tid / nt); i < (int)((int64_t)r->n * (tid + 1) / nt); i++)
        r->out[i] = buf ? refine_row(r, i, (int32_t *)buf, (float *)(buf + (size_t)(cap + 16) * 4)) : -1;
}

int greedy_refine(const float *x, int64_t xs, const float *s, int64_t ss, const float *wn, const float *dn,
                  const uint16_t *xb, int64_t xbs, const float *w, int64_t ts, int64_t rs, int64_t ks, int n,
                  int V, int K, int64_t *out, int num_threads) {
    if (n <= 0 || V <= 0 || K <= 0) return -1;
    const int64_t last = (int64_t)((V - 1) / 64) * ts + (int64_t)((V - 1) % 64) * rs + (int64_t)(K - 1) * ks;
    Refine r = {x, xs, s, ss, wn, dn, xb, xbs, w, ts, rs, ks, n, V, K, last < INT32_MAX, out};
    kv_parallel(refine_task, &r, num_threads < n ? num_threads : n);
    return 0;
}
#else
int greedy_refine(const float *x, int64_t xs, const float *s, int64_t ss, const float *wn, const float *dn,
                  const uint16_t *xb, int64_t xbs, const float *w, int64_t ts, int64_t rs, int64_t ks, int n,
                  int V, int K, int64_t *out, int num_threads) {
    (void)x; (void)xs; (void)s; (void)ss; (void)wn; (void)dn; (void)xb; (void)xbs; (void)w; (void)ts; (void)rs;
    (void)ks; (void)n; (void)V; (void)K; (void)out; (void)num_threads;
    return -2;  /* not built here: callers keep the full GEMM */
}
#endif
