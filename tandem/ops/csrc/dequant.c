/* Block-FP8 weights back to float32 in one pass (tandem/kernels/fp8.py calls this through tandem/ops/native.py).
 *
 * out[r, c] = lut[codes[r, c]] * scale[r / bm, c / bk]: `lut` holds the 256 e4m3fn values as float32 (built by
 * the caller from torch's own conversion, so NaN and subnormal codes decode as torch decodes them), and the
 * product is one IEEE float32 multiply, the operation of the torch reference (tandem/kernels/reference.py):
 * the same bits. The reference makes ~6 passes and temporaries over the weight (~1 GB/s of output here); a
 * QLoRA step dequantizes its frozen base in every forward and again in every backward. Rows are split over
 * torch's OpenMP threads. */
#include <stdint.h>

#define PARALLEL_MIN 65536 /* elements below which one thread does it all */

static inline void dequant_row(const uint8_t *codes, const float *lut, const float *scale_row, float *out,
                               int64_t k, int64_t bk) {
    for (int64_t c0 = 0; c0 < k; c0 += bk) {
        const float s = scale_row[c0 / bk];
        const int64_t c1 = c0 + bk < k ? c0 + bk : k;
        for (int64_t c = c0; c < c1; ++c) out[c] = lut[codes[c]] * s;
    }
}

/* codes [n, k] uint8, scale [ceil(n / bm), ceil(k / bk)] float32, out [n, k] float32; all contiguous */
void tandem_dequant_fp8_block(const uint8_t *codes, const float *lut, const float *scale, float *out, int64_t n,
                              int64_t k, int64_t bm, int64_t bk) {
    const int64_t kb = (k + bk - 1) / bk;
    if (n * k >= PARALLEL_MIN) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < n; ++r) dequant_row(codes + r * k, lut, scale + (r / bm) * kb, out + r * k, k, bk);
    } else {
        for (int64_t r = 0; r < n; ++r) dequant_row(codes + r * k, lut, scale + (r / bm) * kb, out + r * k, k, bk);
    }
}
