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
 * Returns 0, -1 when G or D exceed the limits below, -2 when a thread's buffer cannot be allocated.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define AS_FLOAT(x) (x)

#define DECODE_ATTENTION(NAME, T, LOAD)                                                               \
    int NAME(const float *q, const T *k, const T *v, int64_t k_s, int64_t k_h, int64_t k_l,          \
             int64_t v_s, int64_t v_h, int64_t v_l, const int64_t *slot, const int64_t *limit,       \
             float *out, int64_t S, int64_t H, int64_t G, int64_t D, float scale, int64_t max_len) {  \
        if (G < 1 || G > MAX_GROUP || D < 1 || D > MAX_HEAD_DIM) return -1;                          \
        int status = 0;                                                                              \
        _Pragma("omp parallel")                                                                      \
        {                                                                                            \
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

DECODE_ATTENTION(tandem_decode_attention_f32, float, AS_FLOAT)
DECODE_ATTENTION(tandem_decode_attention_bf16, uint16_t, bf16_to_f32)
