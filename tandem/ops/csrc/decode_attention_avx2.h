/* decode_attention.c's (row, key head) pair for CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, most Intel
 * laptop and desktop parts): included by decode_attention.c in a build without __AVX512F__.
 *
 * The same structure as the 512-bit `pair16` there, in 8-lane vectors, for head dimensions that are a multiple
 * of 8: per block of 8 keys, the block's scores for every query row of the group (the block comes from memory
 * for the first row and from L1 for the others); each key's 8-lane partial sums folded into one vector of 8
 * scores by a tree of horizontal adds; the softmax in vector arithmetic (fast_exp.h's polynomial); the weighted
 * values accumulated in registers over blocks of 32 value rows, 64 columns at a time (8 accumulators: a
 * 128-wide head does not fit the 16 ymm registers in one pass, and the block is in L1 for the second).
 *
 * Without it, an AVX2 build ran the portable loop, which reduces every (key, row) dot product horizontally.
 * On an AVX2 EPYC (docs/benchmarks.md, "Decode attention on AVX2"): 64 sequences x 30 layers from memory,
 * 1.3-1.5x the loop's speed in float32 and 1.5-2x in bfloat16; inside the engine (32 sequences x 400 tokens)
 * attention 45 -> 33 ms a step. It reads keys and values at 11-15 GB/s where torch's sum over the same
 * tensors reaches ~20: per thread, computing and reading do not overlap well. Tried and not kept: software
 * prefetch of the keys and values 16-128 keys ahead, or of a block's values while its keys are scored (within
 * +-10%, noise on this VM). Two code-generation traps, both measured: GCC hoists a block's key vectors out of
 * the query-row loop and spills them (hence the empty asm below; ~1.4x slower without it), and AMD runs masked stores
 * (vmaskmovps) slowly, so only a last partial block of keys takes them.
 *
 * Defines pair8_f32 and pair8_bf16 for decode_attention.c's driver (which dispatches on the head dimension).
 */
#ifndef TANDEM_DECODE_ATTENTION_AVX2_H
#define TANDEM_DECODE_ATTENTION_AVX2_H

/* lane j = the sum of the 8 lanes of v[j] */
static inline __m256 reduce8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* [v0..v3 low | v0..v3 high] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* tandem_exp (fast_exp.h) on 8 lanes: the same polynomial and limits */
static inline __m256 exp8(__m256 y) {
    const __m256 c = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), c);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    const __m256 z = _mm256_mul_ps(r, r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, z, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    out = _mm256_blendv_ps(out, _mm256_setzero_ps(), _mm256_cmp_ps(y, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
    return _mm256_blendv_ps(out, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(y, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* lanes < m set (all ones), the others clear: the mask of a block's first m keys (0 <= m <= 8) */
static inline __m256i lanes_below(int64_t m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* One (row, key head) pair: o [G, D] = softmax(q k^T * scale) v over keys 0 .. n-1 (n >= 1), with C = D / 8
 * vectors per row (a constant where the call site passes one). p: G x n floats of scratch. */
#define PAIR8(NAME, T, LOAD8)                                                                              \
    static inline __attribute__((always_inline)) void NAME(                                               \
        const float *qq, const T *kk, const T *vv, int64_t k_l, int64_t v_l, int64_t n, int64_t G,         \
        const int64_t C, float scale, float *p, float *o) {                                                \
        const int64_t D = 8 * C;                                                                           \
        __m256 mv[MAX_GROUP];                                                                              \
        for (int64_t g = 0; g < G; ++g) mv[g] = _mm256_set1_ps(-FLT_MAX);                                  \
        for (int64_t j0 = 0; j0 < n; j0 += 8) { /* a block of 8 keys, read once, scored for every row */   \
            const int64_t jb = n - j0 < 8 ? n - j0 : 8;                                                    \
            int64_t off[8]; /* the block's key rows; past the limit, the last one again (its score masked) */ \
            for (int64_t jj = 0; jj < 8; ++jj) off[jj] = (jj < jb ? jj : jb - 1) * k_l;                    \
            for (int64_t g = 0; g < G; ++g) {                                                              \
                const float *qg = qq + g * D;                                                              \
                const T *kb = kk + j0 * k_l;                                                               \
                /* opaque to the compiler: it would otherwise hoist the block's 8 x C key vectors out of   \
                   the row loop, spill them to the stack and read them back (measured ~1.4x slower) */      \
                __asm__("" : "+r"(kb));                                                                    \
                const T *kr[8];                                                                            \
                for (int64_t jj = 0; jj < 8; ++jj) kr[jj] = kb + off[jj];                                  \
                __m256 acc[8];                                                                             \
                for (int64_t jj = 0; jj < 8; ++jj) acc[jj] = _mm256_setzero_ps();                          \
                for (int64_t c = 0; c < C; ++c) { /* 8 independent sums, one query vector in a register */ \
                    const __m256 qc = _mm256_loadu_ps(qg + 8 * c);                                         \
                    _Pragma("GCC unroll 8")                                                                \
                    for (int64_t jj = 0; jj < 8; ++jj) acc[jj] = _mm256_fmadd_ps(qc, LOAD8(kr[jj] + 8 * c), acc[jj]); \
                }                                                                                          \
                const __m256 s = _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale));                       \
                if (jb == 8) { /* masked stores are slow on AMD: only the last block takes them */         \
                    _mm256_storeu_ps(p + g * n + j0, s);                                                   \
                    mv[g] = _mm256_max_ps(mv[g], s);                                                       \
                } else {                                                                                   \
                    const __m256i mk = lanes_below(jb);                                                    \
                    _mm256_maskstore_ps(p + g * n + j0, mk, s);                                            \
                    mv[g] = _mm256_max_ps(mv[g], _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), s,             \
                                                                  _mm256_castsi256_ps(mk)));               \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        float inv[MAX_GROUP];                                                                              \
        for (int64_t g = 0; g < G; ++g) { /* softmax numerators and 1 / denominator */                    \
            float *pg = p + g * n;                                                                         \
            const __m256 mg = _mm256_set1_ps(hmax8(mv[g]));                                                \
            __m256 sum = _mm256_setzero_ps();                                                              \
            int64_t j = 0;                                                                                 \
            for (; j + 8 <= n; j += 8) {                                                                   \
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pg + j), mg));                         \
                _mm256_storeu_ps(pg + j, e);                                                               \
                sum = _mm256_add_ps(sum, e);                                                               \
            }                                                                                              \
            if (j < n) {                                                                                   \
                const __m256i mk = lanes_below(n - j);                                                     \
                const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(pg + j, mk), mg)),    \
                                               _mm256_castsi256_ps(mk));                                   \
                _mm256_maskstore_ps(pg + j, mk, e);                                                        \
                sum = _mm256_add_ps(sum, e);                                                               \
            }                                                                                              \
            inv[g] = 1.f / hsum8(sum);                                                                     \
        }                                                                                                  \
        for (int64_t g = 0; g < G; ++g) memset(o + g * D, 0, sizeof(float) * (size_t)D);                  \
        for (int64_t j0 = 0; j0 < n; j0 += 32) { /* value rows in blocks: read once, then from L1 */       \
            const int64_t jb = n - j0 < 32 ? n - j0 : 32;                                                  \
            for (int64_t g = 0; g < G; ++g) {                                                              \
                float *og = o + g * D;                                                                     \
                const float *pg = p + g * n + j0;                                                          \
                int64_t c0 = 0;                                                                            \
                for (; c0 + 8 <= C; c0 += 8) { /* 64 columns at a time, in 8 registers */                  \
                    __m256 acc[8];                                                                         \
                    _Pragma("GCC unroll 8")                                                                \
                    for (int64_t c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(og + 8 * (c0 + c));           \
                    for (int64_t jj = 0; jj < jb; ++jj) {                                                  \
                        const __m256 w = _mm256_set1_ps(pg[jj]);                                           \
                        const T *vj = vv + (j0 + jj) * v_l + 8 * c0;                                       \
                        _Pragma("GCC unroll 8")                                                            \
                        for (int64_t c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, LOAD8(vj + 8 * c), acc[c]); \
                    }                                                                                      \
                    _Pragma("GCC unroll 8")                                                                \
                    for (int64_t c = 0; c < 8; ++c) _mm256_storeu_ps(og + 8 * (c0 + c), acc[c]);           \
                }                                                                                          \
                if (c0 < C) { /* the last C % 8 vectors of a head dimension that is not a multiple of 64 */ \
                    const int64_t cb = C - c0;                                                             \
                    __m256 acc[8];                                                                         \
                    for (int64_t c = 0; c < cb; ++c) acc[c] = _mm256_loadu_ps(og + 8 * (c0 + c));          \
                    for (int64_t jj = 0; jj < jb; ++jj) {                                                  \
                        const __m256 w = _mm256_set1_ps(pg[jj]);                                           \
                        const T *vj = vv + (j0 + jj) * v_l + 8 * c0;                                       \
                        for (int64_t c = 0; c < cb; ++c) acc[c] = _mm256_fmadd_ps(w, LOAD8(vj + 8 * c), acc[c]); \
                    }                                                                                      \
                    for (int64_t c = 0; c < cb; ++c) _mm256_storeu_ps(og + 8 * (c0 + c), acc[c]);          \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t g = 0; g < G; ++g) {                                                                  \
            const __m256 s = _mm256_set1_ps(inv[g]);                                                       \
            for (int64_t c = 0; c < C; ++c)                                                                \
                _mm256_storeu_ps(o + g * D + 8 * c, _mm256_mul_ps(s, _mm256_loadu_ps(o + g * D + 8 * c)));  \
        }                                                                                                  \
    }

PAIR8(pair8_f32, float, load8_f32)
PAIR8(pair8_bf16, uint16_t, load8_bf16)

#endif
