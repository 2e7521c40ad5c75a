/* The decoder layer's pointwise blocks in one pass each (tandem/ops/native.py builds and calls this).
 *
 * A decode step of SmolLM2-135M runs, per layer, RMSNorm twice (float32 cast, square, mean, rsqrt, two
 * products), rotary embedding on q and k (two products, a negation, a concatenation, a sum) and SwiGLU
 * (SiLU, a product): ~25 torch ops, each a pass over its operands and an allocation, ~15 ms of a
 * 64-sequence step (profiled, docs/inference.md). Each function below is one pass, the same arithmetic
 * in float32, rounding to bfloat16 where torch's bfloat16 ops round (the value of each op, so bf16 results
 * match torch's to the rounding of the reordered sums). Rows are split over torch's OpenMP threads when
 * there are enough of them.
 *
 * dtype 0: float32, 1: bfloat16 (inputs, outputs and weights alike; cos/sin in the same dtype).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t i; float f; } u = {.i = (uint32_t)v << 16};
    return u.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    union { float f; uint32_t i; } u = {.f = f};
    if ((u.i & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u.i >> 16) | 0x40);
    return (uint16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}


#define PARALLEL_MIN 65536 /* elements below which one thread does it all */
#define CHUNK 4096          /* elements per unit of work of SwiGLU */

/* Below PARALLEL_MIN the loops run outside any OpenMP region: even `omp parallel if (0)` costs a few
 * microseconds, and a decode step at one sequence makes ~150 of these calls. */
#define SPLIT(work, n, CALL)                                                                                  \
    if ((work) >= PARALLEL_MIN) {                                                                            \
        _Pragma("omp parallel for schedule(static)")                                                         \
        for (int64_t i = 0; i < (n); ++i) CALL;                                                              \
    } else {                                                                                                 \
        for (int64_t i = 0; i < (n); ++i) CALL;                                                              \
    }

/* each kernel is written once for both dtypes: T is the element type, LOAD / STORE / ROUND convert */
#define LOAD_F32(p, i) ((p)[i])
#define STORE_F32(p, i, v) ((p)[i] = (v))
#define ROUND_F32(v) (v)
#define LOAD_BF16(p, i) bf16_to_f32((p)[i])
#define STORE_BF16(p, i, v) ((p)[i] = f32_to_bf16(v))
#define ROUND_BF16(v) bf16_to_f32(f32_to_bf16(v))

/* out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)) over rows of `dim` (HF's RMSNorm: normalise in float32,
 * round to the dtype, then scale) */
#define RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                                                 \
    static inline void NAME##_row(const T *xr, const T *w, T *o, int64_t dim, float eps) {                  \
        float ss = 0.0f;                                                                                     \
        _Pragma("omp simd reduction(+ : ss)")                                                                \
        for (int64_t j = 0; j < dim; ++j) { const float v = LOAD(xr, j); ss += v * v; }                      \
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                               \
        _Pragma("omp simd")                                                                                  \
        for (int64_t j = 0; j < dim; ++j) STORE(o, j, LOAD(w, j) * ROUND(LOAD(xr, j) * inv));               \
    }                                                                                                        \
    static void NAME(const T *x, const T *w, T *out, int64_t rows, int64_t dim, float eps) {                 \
        SPLIT(rows * dim, rows, NAME##_row(x + i * dim, w, out + i * dim, dim, eps))                         \
    }
RMS_NORM(rms_norm_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
RMS_NORM(rms_norm_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)

void tandem_rms_norm(const void *x, const void *w, void *out, int64_t rows, int64_t dim, float eps, int bf16) {
    if (bf16) rms_norm_bf16(x, w, out, rows, dim, eps);
    else rms_norm_f32(x, w, out, rows, dim, eps);
}

/* out = silu(a) * b elementwise, silu(a) = a / (1 + exp(-a)) rounded to the dtype first, as torch does */
#define SWIGLU(NAME, T, LOAD, STORE, ROUND)                                                                   \
    static inline void NAME##_chunk(const T *a, const T *b, T *out, int64_t n) {                            \
        _Pragma("omp simd")                                                                                  \
        for (int64_t i = 0; i < n; ++i) {                                                                    \
            const float v = LOAD(a, i);                                                                      \
            STORE(out, i, ROUND(v / (1.0f + tandem_exp(-v))) * LOAD(b, i));                                 \
        }                                                                                                    \
    }                                                                                                        \
    static void NAME(const T *a, const T *b, T *out, int64_t n) {                                            \
        const int64_t chunks = (n + CHUNK - 1) / CHUNK;                                                      \
        SPLIT(n, chunks, NAME##_chunk(a + i * CHUNK, b + i * CHUNK, out + i * CHUNK,                        \
                                      n - i * CHUNK < CHUNK ? n - i * CHUNK : CHUNK))                        \
    }
SWIGLU(swiglu_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
SWIGLU(swiglu_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)

void tandem_swiglu(const void *a, const void *b, void *out, int64_t n, int bf16) {
    if (bf16) swiglu_bf16(a, b, out, n);
    else swiglu_f32(a, b, out, n);
}

/* x [rows, heads, dim] (row stride `stride` elements, heads contiguous), cos/sin [rows, dim]:
 * out [rows, heads, dim] contiguous = x * cos + rotate_half(x) * sin, rotate_half([p, q]) = [-q, p] */
#define ROTARY(NAME, T, LOAD, STORE, ROUND)                                                                   \
    static inline void NAME##_row(const T *x, const T *c, const T *s, T *out, int64_t heads, int64_t dim) { \
        const int64_t half = dim / 2;                                                                        \
        for (int64_t h = 0; h < heads; ++h) {                                                                \
            const T *xi = x + h * dim;                                                                       \
            T *o = out + h * dim;                                                                            \
            _Pragma("omp simd")                                                                              \
            for (int64_t j = 0; j < half; ++j) {                                                             \
                const float p = LOAD(xi, j), q = LOAD(xi, j + half);                                         \
                STORE(o, j, ROUND(p * LOAD(c, j)) + ROUND(-q * LOAD(s, j)));                                 \
                STORE(o, j + half, ROUND(q * LOAD(c, j + half)) + ROUND(p * LOAD(s, j + half)));             \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    static void NAME(const T *x, int64_t stride, const T *cs, const T *sn, T *out, int64_t rows, int64_t heads, \
                     int64_t dim) {                                                                          \
        SPLIT(rows * heads * dim, rows,                                                                      \
              NAME##_row(x + i * stride, cs + i * dim, sn + i * dim, out + i * heads * dim, heads, dim))     \
    }
ROTARY(rotary_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
ROTARY(rotary_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)

void tandem_rotary(const void *x, int64_t stride, const void *cos_, const void *sin_, void *out, int64_t rows,
                   int64_t heads, int64_t dim, int bf16) {
    if (bf16) rotary_bf16(x, stride, cos_, sin_, out, rows, heads, dim);
    else rotary_f32(x, stride, cos_, sin_, out, rows, heads, dim);
}

/* -- Backward passes (the trainer's lean autograd functions, tandem/models/lean_ops.py) ----------------
 *
 * Each is one pass over its operands where torch's composition of the same formula makes 5-9 passes and as
 * many allocations (SmolLM2-135M, 1,184 packed tokens: SwiGLU's backward ~11 ms a layer in torch ops). The
 * formulas are lean_ops.py's, in float32, rounding to bfloat16 where torch's bfloat16 ops round. Every
 * reduction runs in a fixed order whatever the thread count (RMSNorm's weight gradient: per block of
 * RMS_BLOCK rows, the blocks summed by the caller), so a step's gradients are the same from run to run. */

/* da = dy * b * s * (1 + a * (1 - s)), db = dy * (a * s), s = sigmoid(a); computed in float32, rounded once */
#define SWIGLU_BWD(NAME, T, LOAD, STORE)                                                                      \
    static inline void NAME##_chunk(const T *a, const T *b, const T *dy, T *da, T *db, int64_t n) {          \
        _Pragma("omp simd")                                                                                  \
        for (int64_t i = 0; i < n; ++i) {                                                                    \
            const float v = LOAD(a, i), g = LOAD(dy, i);                                                     \
            const float s = 1.0f / (1.0f + tandem_exp(-v));                                                  \
            STORE(da, i, g * LOAD(b, i) * s * (1.0f + v * (1.0f - s)));                                     \
            STORE(db, i, g * (v * s));                                                                       \
        }                                                                                                    \
    }                                                                                                        \
    static void NAME(const T *a, const T *b, const T *dy, T *da, T *db, int64_t n) {                         \
        const int64_t chunks = (n + CHUNK - 1) / CHUNK;                                                      \
        SPLIT(n, chunks, NAME##_chunk(a + i * CHUNK, b + i * CHUNK, dy + i * CHUNK, da + i * CHUNK,         \
                                      db + i * CHUNK, n - i * CHUNK < CHUNK ? n - i * CHUNK : CHUNK))        \
    }
SWIGLU_BWD(swiglu_bwd_f32, float, LOAD_F32, STORE_F32)
SWIGLU_BWD(swiglu_bwd_bf16, uint16_t, LOAD_BF16, STORE_BF16)

void tandem_swiglu_backward(const void *a, const void *b, const void *dy, void *da, void *db, int64_t n, int bf16) {
    if (bf16) swiglu_bwd_bf16(a, b, dy, da, db, n);
    else swiglu_bwd_f32(a, b, dy, da, db, n);
}

#define RMS_BLOCK 64 /* rows per partial sum of RMSNorm's weight gradient */

/* Per row (r = the forward's float32 rsqrt, n = x * r, g = round(dy * w)):
 * dx = r * (g - n * mean(g * n)); the block's dw partial += round(dy * round(n)). */
#define RMS_NORM_BWD(NAME, T, LOAD, STORE, ROUND)                                                             \
    static inline void NAME##_block(const T *x, const T *w, const float *r, const T *dy, T *dx, float *dw,  \
                                    int64_t rows, int64_t dim) {                                             \
        for (int64_t j = 0; j < dim; ++j) dw[j] = 0.0f;                                                      \
        for (int64_t i = 0; i < rows; ++i) {                                                                 \
            const T *xr = x + i * dim, *gr = dy + i * dim;                                                   \
            const float ri = r[i];                                                                           \
            float dot = 0.0f;                                                                                \
            _Pragma("omp simd reduction(+ : dot)")                                                           \
            for (int64_t j = 0; j < dim; ++j) dot += ROUND(LOAD(gr, j) * LOAD(w, j)) * (LOAD(xr, j) * ri);   \
            const float m = dot / (float)dim;                                                                \
            T *o = dx + i * dim;                                                                             \
            _Pragma("omp simd")                                                                              \
            for (int64_t j = 0; j < dim; ++j) {                                                              \
                const float n = LOAD(xr, j) * ri, g = ROUND(LOAD(gr, j) * LOAD(w, j));                       \
                STORE(o, j, ri * (g - n * m));                                                               \
                dw[j] += ROUND(LOAD(gr, j) * ROUND(n));                                                      \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    static void NAME(const T *x, const T *w, const float *r, const T *dy, T *dx, float *dw, int64_t rows,   \
                     int64_t dim) {                                                                          \
        const int64_t blocks = (rows + RMS_BLOCK - 1) / RMS_BLOCK;                                           \
        SPLIT(rows * dim, blocks,                                                                            \
              NAME##_block(x + i * RMS_BLOCK * dim, w, r + i * RMS_BLOCK, dy + i * RMS_BLOCK * dim,          \
                           dx + i * RMS_BLOCK * dim, dw + i * dim,                                           \
                           rows - i * RMS_BLOCK < RMS_BLOCK ? rows - i * RMS_BLOCK : RMS_BLOCK, dim))        \
    }
RMS_NORM_BWD(rms_norm_bwd_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
RMS_NORM_BWD(rms_norm_bwd_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)

/* dw_partial: [ceil(rows / RMS_BLOCK), dim] float32, one row per block of rows (the caller sums them) */
void tandem_rms_norm_backward(const void *x, const void *w, const float *r, const void *dy, void *dx,
                              float *dw_partial, int64_t rows, int64_t dim, int bf16) {
    if (bf16) rms_norm_bwd_bf16(x, w, r, dy, dx, dw_partial, rows, dim);
    else rms_norm_bwd_f32(x, w, r, dy, dx, dw_partial, rows, dim);
}

int64_t tandem_rms_block(void) { return RMS_BLOCK; }

/* dy [rows, heads, dim] contiguous, cos/sin [rows, dim]: dx = dy * cos + rotate_half^T(dy * sin),
 * rotate_half^T([p, q]) = [q, -p] */
#define ROTARY_BWD(NAME, T, LOAD, STORE, ROUND)                                                               \
    static inline void NAME##_row(const T *dy, const T *c, const T *s, T *out, int64_t heads, int64_t dim) {\
        const int64_t half = dim / 2;                                                                        \
        for (int64_t h = 0; h < heads; ++h) {                                                                \
            const T *g = dy + h * dim;                                                                       \
            T *o = out + h * dim;                                                                            \
            _Pragma("omp simd")                                                                              \
            for (int64_t j = 0; j < half; ++j) {                                                             \
                const float p = LOAD(g, j), q = LOAD(g, j + half);                                           \
                STORE(o, j, ROUND(p * LOAD(c, j)) + ROUND(q * LOAD(s, j + half)));                           \
                STORE(o, j + half, ROUND(q * LOAD(c, j + half)) - ROUND(p * LOAD(s, j)));                    \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    static void NAME(const T *dy, const T *cs, const T *sn, T *out, int64_t rows, int64_t heads, int64_t dim) { \
        SPLIT(rows * heads * dim, rows,                                                                      \
              NAME##_row(dy + i * heads * dim, cs + i * dim, sn + i * dim, out + i * heads * dim, heads, dim)) \
    }
ROTARY_BWD(rotary_bwd_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
ROTARY_BWD(rotary_bwd_bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16)

void tandem_rotary_backward(const void *dy, const void *cos_, const void *sin_, void *out, int64_t rows,
                            int64_t heads, int64_t dim, int bf16) {
    if (bf16) rotary_bwd_bf16(dy, cos_, sin_, out, rows, heads, dim);
    else rotary_bwd_f32(dy, cos_, sin_, out, rows, heads, dim);
}
