/* exp for the kernels: one polynomial, scalar and AVX-512, so the attention
 * softmax and gemm.c's SiLU round alike. */
#ifndef KVYARD_VEXP_H
#define KVYARD_VEXP_H
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Coefficients of exp(r) on |r| <= ln2/2 (Taylor to degree 7: error < 1 ulp
 * of float32 there); exp(x) = 2^n * p(x - n ln2). */
#define EXP_C7 (1.0f / 5040.0f)
#define EXP_C6 (1.0f / 720.0f)
#define EXP_C5 (1.0f / 120.0f)
#define EXP_C4 (1.0f / 24.0f)
#define EXP_C3 (1.0f / 6.0f)
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.42860682030941723212e-6f

static inline float exp_scalar(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = nearbyintf(x * 1.44269504088896341f);
    float r = x - n * LN2_HI;
    r = r - n * LN2_LO;
    float p = EXP_C7;
    p = p * r + EXP_C6; p = p * r + EXP_C5; p = p * r + EXP_C4;
    p = p * r + EXP_C3; p = p * r + 0.5f; p = p * r + 1.0f; p = p * r + 1.0f;
    return ldexpf(p, (int)n);
}

#ifdef __AVX512F__
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C7);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
