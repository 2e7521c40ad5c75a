/* oneDNN's packed layout of a linear weight, written in place (tandem/ops/native.py builds and calls this).
 *
 * oneDNN packs a float32 weight [N, K] for its inner-product kernels as [N/64][K][64] (64 output rows
 * interleaved per input column), and a bfloat16 one as [N/64][K/2][64][2] (the same with pairs of input
 * columns). Both are the same permutation of 32-bit units: with K32 = K (fp32) or K/2 (bf16, a unit is two
 * columns), unit (n, k) of the row-major weight goes to
 *     dst[(n / 64) * K32 * 64 + k * 64 + n % 64].
 * torch's `_reorder_linear_weight` allocates a new tensor and runs oneDNN's generic reorder at 1.6-4 GB/s on
 * this machine; this is a blocked transpose (16 x 16 tiles in AVX-512 or AVX2 registers where available) into the
 * existing packed tensor's memory, near memcpy's rate. When `plain` is given, the row-major source is
 * also copied there in the same pass (a weight sync updates the plain weight and its packed copy reading
 * the source once). Whole aligned tiles are written with non-temporal stores. tandem/ops/linear.py checks, once per shape and dtype in each process, that these
 * bytes equal oneDNN's own packing before using it.
 *
 * Returns 0, or -1 when N is not a multiple of 64 (callers keep oneDNN's reorder).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 64 /* output rows per packed block */
#define TILE 16  /* input units per tile */
#define GROUP 32 /* tiles along a row per work item */

#ifdef __AVX512F__
/* dst[j * dst_stride + i] = src[i * src_stride + j] for a 16 x 16 tile of 32-bit units; `stream`: with
 * non-temporal stores (dst 64-byte aligned), which skip reading the destination's cache lines first */
static inline void transpose16(const uint32_t *src, int64_t src_stride, uint32_t *dst, int64_t dst_stride,
                               int stream) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; ++i) { /* 128-bit lanes, in two rounds */
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
    if (stream)
        for (int i = 0; i < 16; ++i) _mm512_stream_si512((void *)(dst + i * dst_stride), r[i]);
    else
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * dst_stride, r[i]);
}
#elif defined(__AVX2__)
/* AVX2: the 16 x 16 tile as four 8 x 8 transposes in 256-bit registers. Each output row of the tile (16 units, one
 * 64-byte line) is stored as its two halves back to back, so a non-temporal store fills a whole line at once
 * (half lines, left for the other transpose to finish, made the streamed stores no faster than the scalar loop's on
 * an AVX2-only EPYC). All of SmolLM2's linear weights: 10.6 GB/s against memcpy's 10.4; the scalar loop, 4.2, and
 * ordinary stores 7.5 (session 16). */
static inline void transpose8(const uint32_t *src, int64_t src_stride, __m256 out[8]) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps((const float *)(src + i * src_stride));
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) { /* rows 0-3, then 4-7: u[4h + c] holds columns c and c + 4 of those rows */
        u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
        u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
        u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
        u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
        out[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
        out[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
    }
}

static inline void transpose16(const uint32_t *src, int64_t src_stride, uint32_t *dst, int64_t dst_stride,
                               int stream) {
    __m256 a[8], b[8];
    for (int cj = 0; cj < 2; ++cj) {
        transpose8(src + cj * 8, src_stride, a);                   /* rows 0-7 of columns 8cj .. 8cj + 7 */
        transpose8(src + 8 * src_stride + cj * 8, src_stride, b);  /* rows 8-15 */
        for (int i = 0; i < 8; ++i) {
            float *d = (float *)(dst + (cj * 8 + i) * dst_stride);
            if (stream) {
                _mm256_stream_ps(d, a[i]);
                _mm256_stream_ps(d + 8, b[i]);
            } else {
                _mm256_storeu_ps(d, a[i]);
                _mm256_storeu_ps(d + 8, b[i]);
            }
        }
    }
}
#endif

/* one tile: rows [a0, a0 + 16) of block nb (`block` rows a block), units [k0, k0 + width) */
static inline void tile(const uint32_t *restrict src, uint32_t *restrict plain, uint32_t *restrict dst,
                        int64_t k, int64_t block, int64_t nb, int64_t a0, int64_t k0, int64_t width,
                        int stream_dst, int stream_plain) {
    const uint32_t *s = src + (nb * block + a0) * k + k0;
    uint32_t *d = dst + (nb * k + k0) * block + a0;
#if defined(__AVX512F__) || defined(__AVX2__)
    if (width == TILE) {
        transpose16(s, k, d, block, stream_dst);
#ifdef __AVX512F__
        if (plain && stream_plain) {
            for (int64_t i = 0; i < TILE; ++i)
                _mm512_stream_si512((void *)(plain + (nb * block + a0 + i) * k + k0), _mm512_loadu_si512(s + i * k));
            return;
        }
#endif
    } else
#endif
    {
        for (int64_t i = 0; i < TILE; ++i)
            for (int64_t j = 0; j < width; ++j) d[j * block + i] = s[i * k + j];
    }
    if (plain)
        for (int64_t i = 0; i < TILE; ++i)
            memcpy(plain + (nb * block + a0 + i) * k + k0, s + i * k, (size_t)width * sizeof(uint32_t));
}

static int pack_blocked(const uint32_t *restrict src, uint32_t *restrict plain, uint32_t *restrict dst, int64_t n,
                        int64_t k, int64_t block) {
    if (n % block != 0 || n <= 0 || k <= 0) return -1;
    const int64_t blocks = n / block, tiles = (k + TILE - 1) / TILE;
    /* non-temporal stores where every store is a whole aligned 64-byte line: the weights are far larger
     * than the caches and not read back soon (measured: the fused copy + pack 0.5 -> 0.9 of memcpy's rate) */
    const int stream_dst = (uintptr_t)dst % 64 == 0 && k % TILE == 0;
    const int stream_plain = plain && (uintptr_t)plain % 64 == 0 && k % TILE == 0;
    /* a work item is one block's rows x up to GROUP tiles: 16 rows at a time, each read GROUP * 64 bytes
     * straight on (one tile per step read 64 bytes from each of 64 rows, and reached ~0.55 of memcpy's rate;
     * 2 KB runs of each row reach ~1.0 of it, 2 threads, SmolLM2-135M's linear weights) */
    const int64_t groups = (tiles + GROUP - 1) / GROUP;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < blocks * groups; ++t) {
            const int64_t nb = t / groups, first = (t % groups) * GROUP;
            const int64_t last = first + GROUP < tiles ? first + GROUP : tiles;
            for (int64_t a0 = 0; a0 < block; a0 += TILE)
                for (int64_t kt = first; kt < last; ++kt) {
                    const int64_t k0 = kt * TILE, width = k - k0 < TILE ? k - k0 : TILE;
                    tile(src, plain, dst, k, block, nb, a0, k0, width, stream_dst, stream_plain);
                }
        }
#if defined(__AVX512F__) || defined(__AVX2__)
        _mm_sfence(); /* this thread's streamed stores are visible before the region's closing barrier */
#endif
    }
    return 0;
}

int tandem_pack_b64(const uint32_t *restrict src, uint32_t *restrict plain, uint32_t *restrict dst, int64_t n,
                    int64_t k) {
    return pack_blocked(src, plain, dst, n, k, BLOCK);
}

/* The same for oneDNN's blocks of 16 output rows, [N/16][K][16] (float32 only; tandem/ops/linear.py checks that
 * oneDNN lays out the shape so, as on an AVX2-only CPU for a 192-output weight). -1 when N is not a multiple of 16. */
int tandem_pack_b16(const uint32_t *restrict src, uint32_t *restrict plain, uint32_t *restrict dst, int64_t n,
                    int64_t k) {
    return pack_blocked(src, plain, dst, n, k, TILE);
}
