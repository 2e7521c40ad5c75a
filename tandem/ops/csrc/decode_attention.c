/* Attention of single query rows over Tandem's slot KV cache (tandem/ops/native.py builds and calls this).
 *
 * R query rows (a decode token per sequence, or the rows of a short prompt / verification chunk), with
 * grouped-query heads: for row r and key head h, the G query rows q[r, h, :, :] attend over the keys and
 * values of slot slot[r], positions j < limit[r] (a chunk's row i sees its own position: limit = start +
 * i + 1). Keys and values are read in place from the cache: element (slot, h, j, d) lies at
 * base + slot*k_s + h*k_h + j*k_l + d (the head dimension is contiguous). q and out are contiguous
 * [R, H, G, D] fp32; keys/values fp32 or bf16; softmax in fp32. Work is split over (r, h) pairs with
 * OpenMP (torch's libgomp, torch's thread count). Each thread keeps the scores of one pair, G x limit
 * floats, in a buffer of G x max_len (max_len >= every limit).
 *
 * With AVX-512 and a head dimension that is a multiple of 16 (64 and 128 specialised), a (row, head) pair runs
 * `pair16`: per block of 16 keys, the block's scores for every query row of the group (the block comes from
 * memory for the first row, from L1 for the others; scoring row by row over all keys instead, which re-reads
 * the keys from L2, was 1.06-1.13x slower from 512 keys up in float32 (0-6% faster at 90-160 keys) and
 * 1.04-1.21x slower in bfloat16 at every length: the same sums in the same order, so the same bits). Each
 * key's 16-lane partial sums are folded into one vector of 16
 * scores by a transpose-add tree (15 adds instead of 16 horizontal reductions), the softmax in vector
 * arithmetic (fast_exp.h), and the weighted values accumulated in registers over blocks of 32 value rows.
 * Tried and not kept: software prefetch along keys, values and the next pair's keys (no measurable change at
 * 83 or 400 keys), a one-pass online softmax reading each key block with its values (1.1-1.5x slower), the
 * key / value blocks of bf16 converted once for all query rows (slower at 400 keys). Otherwise (or without
 * AVX-512) the portable loop below. Both read only keys and values at positions < limit. An AVX2 build without
 * AVX-512 runs `pair8` instead (decode_attention_avx2.h: the same structure in 8-lane vectors, for head
 * dimensions that are a multiple of 8).
 *
 * With new_k / new_v ([R, H, D] contiguous, the cache's dtype; or NULL), row r's own key and value are first
 * written into the cache at position limit[r] - 1 of its slot (where the torch path's index_copy_ puts them),
 * all rows before any is read: one pass over cold cache lines in C, not a separate indexed copy.
 *
 * Returns 0, -1 when G or D exceed the limits below, -2 when a thread's buffer cannot be allocated.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(TANDEM_PORTABLE_ATTENTION) /* a test or bench's build of the portable loop alone (native.load_variant) */
#define TANDEM_PAIR_SIMD 0
#elif defined(__AVX512F__)
#define TANDEM_PAIR_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__)
#define TANDEM_PAIR_SIMD 256
#else
#define TANDEM_PAIR_SIMD 0
#endif
#if TANDEM_PAIR_SIMD
#include <immintrin.h>
#endif

#include "fast_exp.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define AS_FLOAT(x) (x)

#if TANDEM_PAIR_SIMD == 512
/* reduce16(v): lane l = the sum of the 16 lanes of v[SIGMA[l]] (SIGMA is its own inverse: key j's partial
 * sums go in at v[SIGMA[j]] and its score comes out in lane j) */
static const int SIGMA[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

static inline __m512 reduce16(const __m512 *v) {
    __m512 u[8], w[4], x[2];
    for (int i = 0; i < 8; ++i)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
    for (int i = 0; i < 4; ++i)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[i], u[i + 4], 0x88), _mm512_shuffle_f32x4(u[i], u[i + 4], 0xDD));
    for (int i = 0; i < 2; ++i)
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[i], w[i + 2], 0x44), _mm512_shuffle_ps(w[i], w[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
}

/* tandem_exp (fast_exp.h) on 16 lanes: the same polynomial and limits */
static inline __m512 exp16(__m512 y) {
    const __m512 c = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), c);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    const __m512 z = _mm512_mul_ps(r, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, z, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 out = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    out = _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(y, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
    return _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(y, _mm512_set1_ps(88.0f), _CMP_GT_OQ),
                              _mm512_set1_ps(INFINITY));
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* One (row, key head) pair: o [G, D] = softmax(q k^T * scale) v over keys 0 .. n-1 (n >= 1), with C = D / 16
 * vectors per row (a constant where the call site passes one, so the accumulators stay in registers).
 * p: G x n floats of scratch. */
#define PAIR16(NAME, T, LOAD16)                                                                            \
    static inline __attribute__((always_inline)) void NAME(                                               \
        const float *qq, const T *kk, const T *vv, int64_t k_l, int64_t v_l, int64_t n, int64_t G,         \
        const int64_t C, float scale, float *p, float *o) {                                                \
        const int64_t D = 16 * C;                                                                          \
        __m512 mv[MAX_GROUP];                                                                              \
        for (int64_t g = 0; g < G; ++g) mv[g] = _mm512_set1_ps(-FLT_MAX);                                  \
        for (int64_t j0 = 0; j0 < n; j0 += 16) { /* a block of 16 keys, read once, scored for every row */ \
            const int64_t jb = n - j0 < 16 ? n - j0 : 16;                                                  \
            const __mmask16 mk = (__mmask16)(jb == 16 ? 0xFFFFu : (1u << jb) - 1u);                        \
            for (int64_t g = 0; g < G; ++g) {                                                              \
                const float *qg = qq + g * D;                                                              \
                __m512 q[MAX_HEAD_DIM / 16];                                                               \
                for (int64_t c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qg + 16 * c);                       \
                __m512 acc[16];                                                                            \
                for (int64_t jj = 0; jj < 16; ++jj) {                                                      \
                    __m512 a = _mm512_setzero_ps();                                                        \
                    if (jj < jb) { /* keys at or past the limit are never read */                         \
                        const T *kj = kk + (j0 + jj) * k_l;                                                \
                        for (int64_t c = 0; c < C; ++c) a = _mm512_fmadd_ps(q[c], LOAD16(kj + 16 * c), a); \
                    }                                                                                      \
                    acc[SIGMA[jj]] = a;                                                                    \
                }                                                                                          \
                const __m512 s = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));                      \
                _mm512_mask_storeu_ps(p + g * n + j0, mk, s);                                              \
                mv[g] = _mm512_mask_max_ps(mv[g], mk, mv[g], s);                                           \
            }                                                                                              \
        }                                                                                                  \
        float m[MAX_GROUP];                                                                                \
        for (int64_t g = 0; g < G; ++g) m[g] = _mm512_reduce_max_ps(mv[g]);                                \
        float inv[MAX_GROUP];                                                                              \
        for (int64_t g = 0; g < G; ++g) { /* softmax numerators and 1 / denominator */                    \
            float *pg = p + g * n;                                                                         \
            const __m512 mg = _mm512_set1_ps(m[g]);                                                        \
            __m512 sum = _mm512_setzero_ps();                                                              \
            for (int64_t j = 0; j < n; j += 16) {                                                          \
                const __mmask16 mk = (__mmask16)(n - j >= 16 ? 0xFFFFu : (1u << (n - j)) - 1u);            \
                const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, pg + j), mg));              \
                _mm512_mask_storeu_ps(pg + j, mk, e);                                                      \
                sum = _mm512_mask_add_ps(sum, mk, sum, e);                                                 \
            }                                                                                              \
            inv[g] = 1.f / _mm512_reduce_add_ps(sum);                                                      \
        }                                                                                                  \
        for (int64_t g = 0; g < G; ++g) memset(o + g * D, 0, sizeof(float) * (size_t)D);                  \
        for (int64_t j0 = 0; j0 < n; j0 += 32) { /* value rows in blocks: read once, then from L1 */       \
            const int64_t jb = n - j0 < 32 ? n - j0 : 32;                                                  \
            for (int64_t g = 0; g < G; ++g) {                                                              \
                __m512 acc[MAX_HEAD_DIM / 16];                                                             \
                float *og = o + g * D;                                                                     \
                const float *pg = p + g * n + j0;                                                          \
                for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_loadu_ps(og + 16 * c);                     \
                for (int64_t jj = 0; jj < jb; ++jj) {                                                      \
                    const __m512 w = _mm512_set1_ps(pg[jj]);                                               \
                    const T *vj = vv + (j0 + jj) * v_l;                                                    \
                    for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(w, LOAD16(vj + 16 * c), acc[c]); \
                }                                                                                          \
                for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(og + 16 * c, acc[c]);                     \
            }                                                                                              \
        }                                                                                                  \
        for (int64_t g = 0; g < G; ++g) {                                                                  \
            const __m512 s = _mm512_set1_ps(inv[g]);                                                       \
            for (int64_t c = 0; c < C; ++c)                                                                \
                _mm512_storeu_ps(o + g * D + 16 * c, _mm512_mul_ps(s, _mm512_loadu_ps(o + g * D + 16 * c))); \
        }                                                                                                  \
    }

PAIR16(pair16_f32, float, load16_f32)
PAIR16(pair16_bf16, uint16_t, load16_bf16)

#define PAIR_F32 pair16_f32
#define PAIR_BF16 pair16_bf16
#elif TANDEM_PAIR_SIMD == 256
#include "decode_attention_avx2.h" /* pair8_f32, pair8_bf16 */
#define PAIR_F32 pair8_f32
#define PAIR_BF16 pair8_bf16
#endif

#if TANDEM_PAIR_SIMD
#define PAIR_LANES (TANDEM_PAIR_SIMD / 32) /* floats a vector: 16 or 8 */
/* the pair with C = D / PAIR_LANES a constant for the common head dimensions */
#define PAIR_DISPATCH(FN, q, k, v, k_l, v_l, n, G, D, scale, p, o)                                        \
    do {                                                                                                   \
        if ((D) == 64) FN(q, k, v, k_l, v_l, n, G, 64 / PAIR_LANES, scale, p, o);                          \
        else if ((D) == 128) FN(q, k, v, k_l, v_l, n, G, 128 / PAIR_LANES, scale, p, o);                   \
        else FN(q, k, v, k_l, v_l, n, G, (D) / PAIR_LANES, scale, p, o);                                   \
    } while (0)
#define FAST_PAIR(D) ((D) % PAIR_LANES == 0)
#else
#define FAST_PAIR(D) 0
#define PAIR_DISPATCH(FN, q, k, v, k_l, v_l, n, G, D, scale, p, o) do { } while (0)
#define PAIR_F32 none
#define PAIR_BF16 none
#endif

#define DECODE_ATTENTION(NAME, T, LOAD, PAIR_FN)                                                               \
    int NAME(const float *q, T *k, T *v, int64_t k_s, int64_t k_h, int64_t k_l,                      \
             int64_t v_s, int64_t v_h, int64_t v_l, const int64_t *slot, const int64_t *limit,       \
             const T *new_k, const T *new_v,                                                         \
             float *out, int64_t S, int64_t H, int64_t G, int64_t D, float scale, int64_t max_len) {  \
        if (G < 1 || G > MAX_GROUP || D < 1 || D > MAX_HEAD_DIM) return -1;                          \
        int status = 0;                                                                              \
        _Pragma("omp parallel")                                                                      \
        {                                                                                            \
            if (new_k) { /* each row's own key and value into the cache first, then every row reads */ \
                _Pragma("omp for schedule(static)")                                                  \
                for (int64_t pair = 0; pair < S * H; ++pair) {                                       \
                    const int64_t s = pair / H, h = pair % H, j = limit[s] - 1;                      \
                    if (j < 0) continue;                                                             \
                    memcpy(k + slot[s] * k_s + h * k_h + j * k_l, new_k + pair * D, sizeof(T) * (size_t)D); \
                    memcpy(v + slot[s] * v_s + h * v_h + j * v_l, new_v + pair * D, sizeof(T) * (size_t)D); \
                } /* the loop's barrier: all rows written before any is read */                       \
            }                                                                                        \
            float *p = malloc(sizeof(float) * (size_t)(G * (max_len > 0 ? max_len : 1)));           \
            if (!p) {                                                                                \
                _Pragma("omp atomic write")                                                          \
                status = -2;                                                                         \
            }                                                                                        \
            _Pragma("omp for schedule(static)")                                                      \
            for (int64_t pair = 0; pair < S * H; ++pair) {                                           \
                if (!p) continue;                                                                    \
                const int64_t s = pair / H, h = pair % H;                                            \
                int64_t n = limit[s] < max_len ? limit[s] : max_len;                                 \
                float *o = out + pair * G * D;                                                       \
                memset(o, 0, sizeof(float) * (size_t)(G * D));                                       \
                if (n <= 0) continue;                                                                \
                const float *qq = q + pair * G * D;                                                  \
                const T *kk = k + slot[s] * k_s + h * k_h, *vv = v + slot[s] * v_s + h * v_h;         \
                if (FAST_PAIR(D)) {                                                                  \
                    PAIR_DISPATCH(PAIR_FN, qq, kk, vv, k_l, v_l, n, G, D, scale, p, o);                \
                    continue;                                                                        \
                }                                                                                    \
                float m[MAX_GROUP], inv[MAX_GROUP];                                                  \
                for (int64_t g = 0; g < G; ++g) m[g] = -FLT_MAX;                                     \
                for (int64_t j = 0; j < n; ++j) { /* scores: each key row read once for the group */ \
                    const T *kj = kk + j * k_l;                                                      \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        const float *qg = qq + g * D;                                                \
                        float acc = 0.f;                                                             \
                        _Pragma("omp simd reduction(+ : acc)")                                       \
                        for (int64_t d = 0; d < D; ++d) acc += qg[d] * LOAD(kj[d]);                  \
                        acc *= scale;                                                                \
                        p[g * n + j] = acc;                                                          \
                        if (acc > m[g]) m[g] = acc;                                                  \
                    }                                                                                \
                }                                                                                    \
                for (int64_t g = 0; g < G; ++g) { /* softmax numerators and 1 / denominator */      \
                    float sum = 0.f, mg = m[g], *pg = p + g * n;                                     \
                    _Pragma("omp simd reduction(+ : sum)")                                           \
                    for (int64_t j = 0; j < n; ++j) {                                                \
                        pg[j] = expf(pg[j] - mg);                                                    \
                        sum += pg[j];                                                                \
                    }                                                                                \
                    inv[g] = 1.f / sum;                                                              \
                }                                                                                    \
                for (int64_t j = 0; j < n; ++j) { /* weighted values: each value row read once */    \
                    const T *vj = vv + j * v_l;                                                      \
                    for (int64_t g = 0; g < G; ++g) {                                                \
                        const float w = p[g * n + j];                                                \
                        float *og = o + g * D;                                                       \
                        _Pragma("omp simd")                                                          \
                        for (int64_t d = 0; d < D; ++d) og[d] += w * LOAD(vj[d]);                    \
                    }                                                                                \
                }                                                                                    \
                for (int64_t g = 0; g < G; ++g)                                                      \
                    for (int64_t d = 0; d < D; ++d) o[g * D + d] *= inv[g];                          \
            }                                                                                        \
            free(p);                                                                                 \
        }                                                                                            \
        return status;                                                                               \
    }

/* the vector width of the pair kernel this build runs: 512 (pair16), 256 (pair8, AVX2), 0 (the portable loop) */
int tandem_decode_attention_vector_bits(void) { return TANDEM_PAIR_SIMD; }

DECODE_ATTENTION(tandem_decode_attention_f32, float, AS_FLOAT, PAIR_F32)
DECODE_ATTENTION(tandem_decode_attention_bf16, uint16_t, bf16_to_f32, PAIR_BF16)
