/* A product of few rows against a oneDNN-packed float32 weight: y[M, N] = x[M, K] . W[N, K]^T (+ bias).
 * (tandem/ops/native.py builds it; tandem/ops/linear.py calls it for decode-sized products.)
 *
 * oneDNN packs a float32 linear weight as [N/64][K][64] (csrc/pack.c): for each block of 64 outputs, the 64
 * weights of input column k lie side by side, so a block is one contiguous stream. A decode step multiplies a
 * few rows by every weight of the model once and is bound by reading the weights; oneDNN's products read them
 * at 13-20 GB/s here, where a sum over memory reaches 30-40 (docs/inference.md, "Few-row products"). This loop
 * reads a block once per tile of up to 6 rows: per input column, the block's four 16-float vectors against
 * each row's x[m][k] (24 accumulators and 4 weight vectors: 28 of the 32 vector registers). A (block, tile)
 * pair is a work item, numbered block by block, and OpenMP hands each thread one contiguous range of them: a
 * thread's tiles of a block follow one another, those after the first reading it again from L2 (K x 256
 * bytes), and threads stay even where the blocks do not divide among them (3 blocks of a 192-output weight on
 * 2 threads: at 64 rows 1.15x faster than the block-per-item split, 1.05-1.07x for 576 outputs). Tried and
 * not kept: summing each output of a few-block weight in two halves of its inputs (twice the items, so they
 * split evenly at 1 row too): no gain at 1-8 rows, where reading the weights sets the time whichever thread
 * reads them, and 1-10% slower at 64 rows (the partial sums' extra pass). Each output is
 * one sum over k in order, whatever M, the tile or the thread count: a row's result depends on that row alone.
 * Without AVX-512 (AVX2: 16 256-bit registers) the tile is another one, below, with the same sums; it beats
 * oneDNN up to 16 rows only, so tandem/ops/linear.py gives it at most that many (`tandem_skinny_vector_bits`).
 *
 * bfloat16 (`tandem_skinny_bf16`, with AVX-512 BF16): oneDNN packs it as [N/64][K/2][64][2], pairs of input
 * columns side by side, which is what `vdpbf16ps` takes: per pair of columns, the block's four 32-value vectors
 * against each row's (x[m][k], x[m][k+1]) pair, broadcast, summed in float32; the output rounded to bfloat16
 * (nearest even) after the bias.
 *
 * Returns 0, -1 when N is not a multiple of 64 (or K odd, for bfloat16), -2 when built without AVX-512 BF16.
 */
#include <stdint.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define TILE_ROWS 6

#if defined(__AVX512F__) || !defined(__AVX2__)
/* 512-bit vectors: a tile's rows against the whole block, 24 accumulators + 4 weight vectors in the 32 registers.
 * (Without AVX2 the compiler splits the vectors into what the CPU has; no such CPU has been measured.) */
static inline void tile(const float *x, int64_t ldx, int rows, int64_t K, const float *w, const float *bias,
                        float *y, int64_t ldy) {
    v16 acc[TILE_ROWS][4];
    for (int m = 0; m < TILE_ROWS; ++m)
        for (int j = 0; j < 4; ++j) acc[m][j] = (v16){0};
#define BODY(R)                                                                                   \
    for (int64_t k = 0; k < K; ++k) {                                                            \
        const float *wk = w + k * 64;                                                            \
        const v16 w0 = *(const v16 *)wk, w1 = *(const v16 *)(wk + 16), w2 = *(const v16 *)(wk + 32), \
                  w3 = *(const v16 *)(wk + 48);                                                  \
        for (int m = 0; m < R; ++m) {                                                            \
            const float s = x[m * ldx + k];                                                      \
            acc[m][0] += s * w0;                                                                 \
            acc[m][1] += s * w1;                                                                 \
            acc[m][2] += s * w2;                                                                 \
            acc[m][3] += s * w3;                                                                 \
        }                                                                                        \
    }
    switch (rows) { /* a constant row count per loop, so the accumulators stay in registers */
    case 1: BODY(1) break;
    case 2: BODY(2) break;
    case 3: BODY(3) break;
    case 4: BODY(4) break;
    case 5: BODY(5) break;
    default: BODY(6) break;
    }
#undef BODY
    for (int m = 0; m < rows; ++m)
        for (int j = 0; j < 4; ++j) {
            v16 a = acc[m][j];
            if (bias) a += *(const v16 *)(bias + 16 * j);
            *(v16 *)(y + m * ldy + 16 * j) = a;
        }
}
#else
/* AVX2 (256-bit vectors, 16 registers): the 512-bit tile above needs 48 of them and ran 3-4x slower than oneDNN
 * on an AVX2-only AMD EPYC (Zen 3). Here a tile walks the block in stripes of S 8-float vectors, R rows at a
 * time, R * S accumulators: 1 row takes the whole block (8), 2-3 rows two stripes of 32 outputs (8-12), 4-6 rows
 * two halves of 3 rows (the first AVX2 tile's stripes of 16 outputs, without the chunks below, read the block
 * 4 times from memory: 1.25-1.36x slower at 4-6 rows). The inputs go in chunks of KC columns (KC x 256 bytes
 * of the block: in L1), every stripe over a chunk before the next, the partial sums kept in y between chunks:
 * the block streams from memory once per tile. The first stripe of a chunk reads half of each 256-byte row of
 * it; it prefetches the other half as it goes, so the chunk comes from memory in address order (left to the
 * hardware, every other pair of cache lines came late: the whole model's linear layers at 5 rows took 64 ms
 * against 34 at 1 row, 47 with the prefetch; docs/benchmarks.md, session 16). Each output is still one sum over k in order with the same fused multiply-adds (a
 * float32 store and load are exact): the same bits as the 512-bit tile. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

#define KC 64

#define STRIPE(R, S, J0)                                                                          \
    do {                                                                                         \
        v8 acc[R][S];                                                                            \
        for (int m = 0; m < R; ++m)                                                              \
            for (int j = 0; j < S; ++j)                                                          \
                acc[m][j] = k0 ? *(const v8 *)(y + m * ldy + 8 * ((J0) + j)) : (v8){0};          \
        for (int64_t k = k0; k < k1; ++k) {                                                      \
            const float *wk = w + k * 64 + 8 * (J0);                                             \
            if ((S) < 8 && (J0) == 0) { /* the half the second stripe reads: the block streams in order */ \
                __builtin_prefetch(wk + 32);                                                     \
                __builtin_prefetch(wk + 48);                                                     \
            }                                                                                    \
            for (int m = 0; m < R; ++m) {                                                        \
                const float s = x[m * ldx + k];                                                  \
                for (int j = 0; j < S; ++j) acc[m][j] += s * *(const v8 *)(wk + 8 * j);          \
            }                                                                                    \
        }                                                                                        \
        for (int m = 0; m < R; ++m)                                                              \
            for (int j = 0; j < S; ++j) *(v8 *)(y + m * ldy + 8 * ((J0) + j)) = acc[m][j];       \
    } while (0)

/* Rows 1-3 of a tile over inputs k0 .. k1 - 1: 1 row the whole block, 2-3 rows two stripes of 32 outputs. */
static inline void stripes(const float *x, int64_t ldx, int rows, const float *w, float *y, int64_t ldy,
                           int64_t k0, int64_t k1) {
    switch (rows) {
    case 1: STRIPE(1, 8, 0); break;
    case 2: for (int j0 = 0; j0 < 8; j0 += 4) STRIPE(2, 4, j0); break;
    default: for (int j0 = 0; j0 < 8; j0 += 4) STRIPE(3, 4, j0); break;
    }
}

static inline void tile(const float *x, int64_t ldx, int rows, int64_t K, const float *w, const float *bias,
                        float *y, int64_t ldy) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = k0 + KC < K ? k0 + KC : K;
        stripes(x, ldx, rows < 3 ? rows : 3, w, y, ldy, k0, k1);
        if (rows > 3) stripes(x + 3 * ldx, ldx, rows - 3, w, y + 3 * ldy, ldy, k0, k1);
    }
    if (bias)
        for (int m = 0; m < rows; ++m)
            for (int j = 0; j < 8; ++j) *(v8 *)(y + m * ldy + 8 * j) += *(const v8 *)(bias + 8 * j);
}
#undef STRIPE
#undef KC
#endif

/* The float32 tile this build runs: 512 (the 512-bit tile) or 256 (AVX2's stripes). */
int tandem_skinny_vector_bits(void) {
#if defined(__AVX512F__) || !defined(__AVX2__)
    return 512;
#else
    return 256;
#endif
}

int tandem_skinny_f32(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, const float *bias,
                      float *y) {
    if (N % 64) return -1;
    const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < N / 64 * tiles; ++item) {
        const int64_t b = item / tiles, m0 = item % tiles * TILE_ROWS;
        const int rows = (int)(M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS);
        tile(x + m0 * K, K, rows, K, packed + b * K * 64, bias ? bias + b * 64 : 0, y + m0 * N + b * 64, N);
    }
    return 0;
}

/* oneDNN packs some shapes in blocks of 16 outputs instead, [N/16][K][16]: on the AVX2-only EPYC the 192-output
 * key and value projections of SmolLM2 (576 and 1,536 outputs keep blocks of 64). Their products went to oneDNN,
 * ~100 us each at 1 row for a 442 KB weight, 60 of a decode step's 211 products. This tile takes such a block
 * with up to 6 rows: per input column the block's two 8-float vectors against each row's x[m][k], 12
 * accumulators + 2 weight vectors + 1 broadcast in AVX2's 16 registers (built for AVX-512, the same code in its
 * 256-bit registers). A block is one contiguous stream of K x 64 bytes, read in order. Each output is one sum
 * over k in order with fused multiply-adds, as in the 64-output tiles: a row's result depends on that row alone,
 * and equals what those tiles give for the same weight in their layout. */
typedef float v8x __attribute__((vector_size(32), aligned(4)));

static inline void tile16(const float *x, int64_t ldx, int rows, int64_t K, const float *w, const float *bias,
                          float *y, int64_t ldy) {
    v8x acc[TILE_ROWS][2];
    for (int m = 0; m < TILE_ROWS; ++m) acc[m][0] = acc[m][1] = (v8x){0};
#define BODY16(R)                                                                                 \
    for (int64_t k = 0; k < K; ++k) {                                                            \
        const v8x w0 = *(const v8x *)(w + k * 16), w1 = *(const v8x *)(w + k * 16 + 8);         \
        for (int m = 0; m < R; ++m) {                                                            \
            const float s = x[m * ldx + k];                                                      \
            acc[m][0] += s * w0;                                                                 \
            acc[m][1] += s * w1;                                                                 \
        }                                                                                        \
    }
    switch (rows) {
    case 1: BODY16(1) break;
    case 2: BODY16(2) break;
    case 3: BODY16(3) break;
    case 4: BODY16(4) break;
    case 5: BODY16(5) break;
    default: BODY16(6) break;
    }
#undef BODY16
    for (int m = 0; m < rows; ++m)
        for (int j = 0; j < 2; ++j) {
            v8x a = acc[m][j];
            if (bias) a += *(const v8x *)(bias + 8 * j);
            *(v8x *)(y + m * ldy + 8 * j) = a;
        }
}

int tandem_skinny16_f32(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, const float *bias,
                        float *y) {
    if (N % 16) return -1;
    const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < N / 16 * tiles; ++item) {
        const int64_t b = item / tiles, m0 = item % tiles * TILE_ROWS;
        const int rows = (int)(M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS);
        tile16(x + m0 * K, K, rows, K, packed + b * K * 16, bias ? bias + b * 16 : 0, y + m0 * N + b * 16, N);
    }
    return 0;
}

#ifdef __AVX512BF16__
static inline void tile_bf16(const uint32_t *x, int64_t ldx, int rows, int64_t K2, const uint16_t *w,
                             const uint16_t *bias, uint16_t *y, int64_t ldy) {
    __m512 acc[TILE_ROWS][4];
    for (int m = 0; m < TILE_ROWS; ++m)
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
#define BODY(R)                                                                                      \
    for (int64_t k = 0; k < K2; ++k) {                                                              \
        const uint16_t *wk = w + k * 128;                                                           \
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32), \
                       w2 = (__m512bh)_mm512_loadu_si512(wk + 64),                                  \
                       w3 = (__m512bh)_mm512_loadu_si512(wk + 96);                                  \
        for (int m = 0; m < R; ++m) {                                                               \
            const __m512bh s = (__m512bh)_mm512_set1_epi32((int)x[m * ldx + k]);                    \
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, s);                                         \
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, s);                                         \
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, s);                                         \
            acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, s);                                         \
        }                                                                                           \
    }
    switch (rows) {
    case 1: BODY(1) break;
    case 2: BODY(2) break;
    case 3: BODY(3) break;
    case 4: BODY(4) break;
    case 5: BODY(5) break;
    default: BODY(6) break;
    }
#undef BODY
    for (int m = 0; m < rows; ++m)
        for (int j = 0; j < 4; ++j) {
            __m512 a = acc[m][j];
            if (bias) /* bfloat16 -> float32: the 16 bits moved to the top */
                a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(
                                         _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + 16 * j))), 16)));
            _mm256_storeu_si256((__m256i *)(y + m * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(a));
        }
}
#endif

int tandem_skinny_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
                       const uint16_t *bias, uint16_t *y) {
#ifdef __AVX512BF16__
    if (N % 64 || K % 2) return -1;
    const int64_t K2 = K / 2, tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < N / 64 * tiles; ++item) {
        const int64_t b = item / tiles, m0 = item % tiles * TILE_ROWS;
        const int rows = (int)(M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS);
        tile_bf16((const uint32_t *)(x + m0 * K), K2, rows, K2, packed + b * K * 64, bias ? bias + b * 64 : 0,
                  y + m0 * N + b * 64, N);
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)packed; (void)N; (void)bias; (void)y;
    return -2;
#endif
}
