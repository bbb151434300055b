/* Quantized weight tiles for gemm.c: GGUF's 32-weight blocks (Q4_0, Q4_1,
 * Q8_0) kept as they are in the file, and the load-time formats of
 * kvyard.workers.model.quant (int8 and int4 in the same block form, fp8 E4M3
 * codes with per-channel scales: QFP8), expanded one 64-column tile at a
 * time, into a per-thread scratch tile in gemm.c's dense layout.
 *
 * Why: a decode step reads every weight once, so at a few rows per step the
 * GEMM waits on DRAM; 4-bit codes are 5 bits a weight here against 16 (bf16)
 * or 32 (float32). The values are exactly the dequantized file's: every
 * format is w = q * d + m with q a small integer and d, m float16, so q * d
 * is exact in float32 and one FMA rounds exactly where the loader's
 * `q * d` then `+ m` rounds (m = 0 for Q4_0/Q8_0). float32 tiles are therefore
 * bit-identical to the dense float32 weights; bf16 tiles round them to
 * nearest-even, as `.to(torch.bfloat16)` does.
 *
 * Layout, per tile, per block of 32 k (kvyard.workers.cpu_ops.GemmWeight.pack_quant):
 *   d[64] float16, m[64] float16, then 32 rows of codes, one per k:
 *   4-bit: 32 bytes, byte j = column j (low nibble) | column j + 32 (high nibble);
 *   8-bit: 64 signed bytes; QFP8: 64 E4M3 bytes (sign, 4 exponent bits biased by
 *   7, 3 mantissa bits; no infinities, 0x7F/0xFF NaN never written).
 * Not a standalone header: gemm.c includes it after its Gemm struct. */
#ifdef __AVX512F__

#define QFP8 0x108  /* qbits of E4M3 codes: 8-bit rows, decoded by fp8_row */

static inline int64_t quant_block_bytes(int qbits) { return 256 + 32 * (qbits == 4 ? 32 : 64); }

static int64_t quant_tile_bytes(const Gemm *g) { return (int64_t)(g->K / 32) * quant_block_bytes(g->qbits); }

/* A block's 64 scales and mins (float16) as float32, 16 columns a vector, with the
 * code offset folded into the mins: m + off * d. Exact, so each weight stays
 * fma(q, d, m') = the file's value: a format has either off = 0 (Q4_1, Q8_0: m' is m)
 * or m = 0 (Q4_0: m' = -8 d, and q d - 8 d = (q - 8) d needs 15 bits). One add a
 * code fewer than adding off to every code. */
static inline void load_scales(const Gemm *g, const uint8_t *blk, __m512 d[4], __m512 m[4]) {
    for (int c = 0; c < 4; c++) {
        d[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32 * c)));
        m[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c)));
        if (g->qoff != 0.0f) m[c] = _mm512_fmadd_ps(_mm512_set1_ps(g->qoff), d[c], m[c]);
        if (g->qbits == QFP8) d[c] = _mm512_mul_ps(d[c], _mm512_set1_ps(256.0f));  /* fp8_row's 2^-8, exact */
    }
}

/* 16 E4M3 bytes as float32 values times 2^-8, exactly: the byte's sign, exponent and
 * mantissa moved into float16's fields (s eeee mmm -> s 0eeee mmm0000000) read the
 * value with float16's bias 15 instead of 7, and E4M3 subnormals (e = 0: m 2^-9) land
 * on float16 subnormals (m 2^7 2^-24) with the same factor; load_scales folds the 2^8
 * back into d. */
static inline __m512 fp8_row(const uint8_t *codes) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)codes));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, mag));
}

/* 64 float32 weights of one k row into w[0..3] (16 columns each). */
static inline void dequant_row(const Gemm *g, const uint8_t *codes, const __m512 d[4], const __m512 m[4], __m512 w[4]) {
    __m512i q[4];
    if (g->qbits == QFP8) {
        for (int c = 0; c < 4; c++) w[c] = _mm512_fmadd_ps(fp8_row(codes + 16 * c), d[c], m[c]);
        return;
    }
    if (g->qbits == 4) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)codes), mask = _mm256_set1_epi8(0x0F);
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        q[0] = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo));
        q[1] = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1));
        q[2] = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi));
        q[3] = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1));
    } else {
        for (int c = 0; c < 4; c++) q[c] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * c)));
    }
    for (int c = 0; c < 4; c++) w[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[c]), d[c], m[c]);
}

/* Tile t into dst: float32 [K][64], or bf16 [K/2][64][2] (k pairs, gemm.c's layout). */
static void dequant_tile(const Gemm *g, int t, void *dst, int is_bf16) {
    const int64_t bb = quant_block_bytes(g->qbits), row = g->qbits == 4 ? 32 : 64;
    const uint8_t *base = (const uint8_t *)g->w + t * quant_tile_bytes(g);
    for (int kb = 0; kb < g->K / 32; kb++) {
        const uint8_t *blk = base + kb * bb;
        __m512 d[4], m[4];
        load_scales(g, blk, d, m);
        const uint8_t *codes = blk + 256;
        if (!is_bf16) {
            float *out = (float *)dst + (int64_t)kb * 32 * TILE;
            for (int k = 0; k < 32; k++) {
                __m512 w[4];
                dequant_row(g, codes + k * row, d, m, w);
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + k * TILE + 16 * c, w[c]);
            }
            continue;
        }
#ifdef __AVX512BF16__
        uint32_t *out = (uint32_t *)dst + (int64_t)kb * 16 * TILE;  /* one bf16 pair per 32 bits */
        for (int k = 0; k < 32; k += 2) {
            __m512 w0[4], w1[4];
            dequant_row(g, codes + k * row, d, m, w0);
            dequant_row(g, codes + (k + 1) * row, d, m, w1);
            for (int c = 0; c < 4; c++) {
                const __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w0[c]));
                const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w1[c]));
                _mm512_storeu_si512(out + (k / 2) * TILE + 16 * c, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        }
#endif
    }
}
#endif
