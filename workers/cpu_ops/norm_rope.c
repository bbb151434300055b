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

#define PARALLEL_MIN (256 * 1024)  /* elements; below, one thread is faster than waking others */


/* out[r] = rmsnorm(x[r]) * w; rows may be strided (views of wider tensors). */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out,
                   int64_t out_stride, int rows, int dim, float eps, int num_threads) {
    /* A parallel region costs a thread wake-up (tens of us with OMP_WAIT_POLICY=PASSIVE):
     * more than normalizing a decode batch, so small inputs stay on this thread. */
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((int64_t)rows * dim >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (int64_t)r * x_stride;
        uint16_t *o = out + (int64_t)r * out_stride;
        float ss = 0.0f;
#pragma omp simd reduction(+:ss)
        for (int d = 0; d < dim; d++) { float v = bf16_to_f32(xr[d]); ss += v * v; }
        const float rstd = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int d = 0; d < dim; d++) o[d] = f32_to_bf16(bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[d]) * rstd)) * bf16_to_f32(w[d]));
    }
}

/* In place: the first `heads` heads of each token row of qk ([T, >= heads, head_dim],
 * row stride tok_stride) rotated by the table row of the token's position.
 * table: [max_pos, 2, 2, head_dim/2] as built by workers/model/rope.py:
 * [p][0][0] = cos, [p][1][1] = +sin. */
void rope_bf16(uint16_t *qk, int64_t tok_stride, int tokens, int heads, int head_dim,
               const int64_t *positions, const uint16_t *table, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((int64_t)tokens * heads * head_dim >= PARALLEL_MIN)
    for (int t = 0; t < tokens; t++) {
        const uint16_t *row = table + positions[t] * 4 * half;
        const uint16_t *cs = row, *sn = row + 3 * half;
        float c[128], s[128];
        for (int i = 0; i < half; i++) { c[i] = bf16_to_f32(cs[i]); s[i] = bf16_to_f32(sn[i]); }
        for (int h = 0; h < heads; h++) {
            uint16_t *x = qk + (int64_t)t * tok_stride + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
                x[i] = f32_to_bf16(x1 * c[i] - x2 * s[i]);
                x[i + half] = f32_to_bf16(x2 * c[i] + x1 * s[i]);
            }
        }
    }
}

void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out,
                  int64_t out_stride, int rows, int dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((int64_t)rows * dim >= PARALLEL_MIN)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * x_stride;
        float *o = out + (int64_t)r * out_stride;
        float ss = 0.0f;
#pragma omp simd reduction(+:ss)
        for (int d = 0; d < dim; d++) ss += xr[d] * xr[d];
        const float rstd = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int d = 0; d < dim; d++) o[d] = w[d] * (xr[d] * rstd);
    }
}

void rope_f32(float *qk, int64_t tok_stride, int tokens, int heads, int head_dim,
              const int64_t *positions, const float *table, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((int64_t)tokens * heads * head_dim >= PARALLEL_MIN)
    for (int t = 0; t < tokens; t++) {
        const float *row = table + positions[t] * 4 * half;
        const float *c = row, *s = row + 3 * half;
        for (int h = 0; h < heads; h++) {
            float *x = qk + (int64_t)t * tok_stride + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}
