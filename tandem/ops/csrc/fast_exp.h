/* exp(y) for float32, shared by the native kernels (included by sample.c and pointwise.c).
 *
 * Cephes' expf polynomial (~1e-7 relative) in plain arithmetic that the compiler vectorises (glibc's vector
 * expf needs -ffinite-math-only, which these kernels do not compile with): 0 below -87 (where expf turns
 * subnormal), +inf above 88 (as expf overflows). tandem/ops/native.py hashes this file into every kernel's
 * cache key.
 */
#ifndef TANDEM_FAST_EXP_H
#define TANDEM_FAST_EXP_H

#include <math.h>
#include <stdint.h>

static inline float tandem_exp(float y) {
    const float c = y < -87.0f ? -87.0f : (y > 88.0f ? 88.0f : y);
    const float n = __builtin_rintf(c * 1.44269504088896341f);
    float r = __builtin_fmaf(n, -0.693359375f, c); /* Cody-Waite: ln 2 in two parts, fused (no reassociation) */
    r = __builtin_fmaf(n, 2.12194440e-4f, r);
    const float z = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return y < -87.0f ? 0.0f : (y > 88.0f ? INFINITY : p * scale.f);
}

#endif
