/* RMSNorm and RoPE for CPU, one pass each (bf16 and float32).
 *
 * torch runs both as chains of elementwise ops on bf16 (upcast, square, mean,
 * multiply, downcast, ...; flip, multiply, addcmul), each a full pass over
 * the activations plus a temporary: measured ~15% of a 1024-token prefill
 * step of the demo model. Here each row is read once and written once,
 * with the arithmetic in float32 and the rounding points of HF's bf16
 * modules: RMSNorm rounds x * rsqrt(mean(x^2) + eps) to bf16, then multiplies
 * by the bf16 weight (rounded again); RoPE computes x * cos + rotate_half(x) * sin
 * from bf16 cos/sin rows and rounds once. The float32 versions do HF's float32
 * arithmetic in the same order (x * rsqrt(mean(x^2) + eps), then * w); only the
 * summation order of mean(x^2) (and FMA contraction) differs from torch's, by
 * an ulp at most: at a few rows per step torch's chain of ~10 small ops per
 * layer cost more than the GEMMs' arithmetic (measured ~6 ms of a 35 ms
 * float32 decode step at batch 1).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "pool.h"

#define PARALLEL_MIN (64 * 1024)  /* elements; below, one thread beats handing work out */

static void norm_row_bf16(const uint16_t *xr, const uint16_t *w, uint16_t *o, int dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+:ss)
    for (int d = 0; d < dim; d++) { float v = bf16_to_f32(xr[d]); ss += v * v; }
    const float rstd = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int d = 0; d < dim; d++) o[d] = f32_to_bf16(bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[d]) * rstd)) * bf16_to_f32(w[d]));
}

static void norm_row_f32(const float *xr, const float *w, float *o, int dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+:ss)
    for (int d = 0; d < dim; d++) ss += xr[d] * xr[d];
    const float rstd = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int d = 0; d < dim; d++) o[d] = w[d] * (xr[d] * rstd);
}

/* table: [max_pos, 2, 2, head_dim/2] as built by workers/model/rope.py: [p][0][0] = cos, [p][1][1] = +sin. */
static void rope_tok_bf16(uint16_t *xt, int heads, int head_dim, const uint16_t *row) {
    const int half = head_dim / 2;
    const uint16_t *cs = row, *sn = row + 3 * half;
    float c[128], s[128];
    for (int i = 0; i < half; i++) { c[i] = bf16_to_f32(cs[i]); s[i] = bf16_to_f32(sn[i]); }
    for (int h = 0; h < heads; h++) {
        uint16_t *x = xt + (int64_t)h * head_dim;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
            x[i] = f32_to_bf16(x1 * c[i] - x2 * s[i]);
            x[i + half] = f32_to_bf16(x2 * c[i] + x1 * s[i]);
        }
    }
}

static void rope_tok_f32(float *xt, int heads, int head_dim, const float *row) {
    const int half = head_dim / 2;
    const float *c = row, *s = row + 3 * half;
    for (int h = 0; h < heads; h++) {
        float *x = xt + (int64_t)h * head_dim;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

typedef struct {
    const void *x; int64_t xs;
    const void *w;
    void *out; int64_t os;
    int rows, dim;
    float eps;
    int f32;
} NormJob;

static void norm_job(void *arg, int tid, int nt) {
    const NormJob *j = (const NormJob *)arg;
    const int r0 = (int)((int64_t)j->rows * tid / nt), r1 = (int)((int64_t)j->rows * (tid + 1) / nt);
    for (int r = r0; r < r1; r++) {
        if (j->f32)
            norm_row_f32((const float *)j->x + r * j->xs, (const float *)j->w, (float *)j->out + r * j->os, j->dim, j->eps);
        else
            norm_row_bf16((const uint16_t *)j->x + r * j->xs, (const uint16_t *)j->w, (uint16_t *)j->out + r * j->os,
                          j->dim, j->eps);
    }
}

typedef struct {
    void *qk; int64_t ts;
    int tokens, heads, head_dim;
    const int64_t *positions;
    const void *table;
    int f32;
} RopeJob;

static void rope_job(void *arg, int tid, int nt) {
    const RopeJob *j = (const RopeJob *)arg;
    const int t0 = (int)((int64_t)j->tokens * tid / nt), t1 = (int)((int64_t)j->tokens * (tid + 1) / nt);
    const int64_t row = 2LL * j->head_dim;  /* table elements per position */
    for (int t = t0; t < t1; t++) {
        if (j->f32)
            rope_tok_f32((float *)j->qk + t * j->ts, j->heads, j->head_dim, (const float *)j->table + j->positions[t] * row);
        else
            rope_tok_bf16((uint16_t *)j->qk + t * j->ts, j->heads, j->head_dim,
                          (const uint16_t *)j->table + j->positions[t] * row);
    }
}

static void norm(NormJob *j, int num_threads) {
    if ((int64_t)j->rows * j->dim >= PARALLEL_MIN && num_threads > 1) kv_parallel(norm_job, j, num_threads);
    else norm_job(j, 0, 1);
}

static void rope(RopeJob *j, int num_threads) {
    if ((int64_t)j->tokens * j->heads * j->head_dim >= PARALLEL_MIN && num_threads > 1) kv_parallel(rope_job, j, num_threads);
    else rope_job(j, 0, 1);
}

/* out[r] = rmsnorm(x[r]) * w; rows may be strided (views of wider tensors). */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out,
                   int64_t out_stride, int rows, int dim, float eps, int num_threads) {
    NormJob j = {x, x_stride, w, out, out_stride, rows, dim, eps, 0};
    norm(&j, num_threads);
}

void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                  int64_t out_stride, int rows, int dim, float eps, int num_threads) {
    NormJob j = {x, x_stride, w, out, out_stride, rows, dim, eps, 1};
    norm(&j, num_threads);
}

/* In place: the first `heads` heads of each token row of qk ([T, >= heads, head_dim],
 * row stride tok_stride) rotated by the table row of the token's position. */
void rope_bf16(uint16_t *qk, int64_t tok_stride, int tokens, int heads, int head_dim,
               const int64_t *positions, const uint16_t *table, int num_threads) {
    RopeJob j = {qk, tok_stride, tokens, heads, head_dim, positions, table, 0};
    rope(&j, num_threads);
}

void rope_f32(float *qk, int64_t tok_stride, int tokens, int heads, int head_dim,
              const int64_t *positions, const float *table, int num_threads) {
    RopeJob j = {qk, tok_stride, tokens, heads, head_dim, positions, table, 1};
    rope(&j, num_threads);
}
