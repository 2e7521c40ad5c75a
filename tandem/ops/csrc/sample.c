/* Token sampling from float32 logits, one row per sequence (tandem/ops/native.py builds and calls this).
 *
 * Row r of logits [R, V] (row stride `stride` floats) is scaled by its temperature t[r] (s = x / t; t <= 0
 * means greedy: argmax of x, first index of the maximum, and s = x), then:
 *   lse      = max(s) + log(sum_j exp(s_j - max(s)))      (the sum in double, over blocks of 256 tokens)
 *   token    = the first j with CDF(j) > u[r] * total      (inverse CDF in vocabulary order, as
 *              tandem/engines/inference/torch/sampling.py: block masses first, then inside the block;
 *              only tokens of non-zero probability are returned)
 *   logprob  = s_token - lse
 * which is `sample_tokens` without top-k / top-p, in three passes over the row (max, exp + block sums,
 * one block again) instead of torch's five (softmax, block sums, logsumexp, gathers). Rows are split over
 * torch's OpenMP threads; each thread keeps one row's block sums (V / 256 doubles).
 *
 * Returns 0, or -2 when a thread's buffer cannot be allocated.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "fast_exp.h"

#define BLOCK 256


int tandem_sample_f32(const float *logits, int64_t R, int64_t V, int64_t stride, const float *temperature,
                      const double *uniform, int64_t *token, float *logprob) {
    const int64_t nb = (V + BLOCK - 1) / BLOCK;
    int status = 0;
#pragma omp parallel
    {
        double *mass = malloc(sizeof(double) * (size_t)(nb > 0 ? nb : 1));
        if (!mass) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            if (!mass) continue;
            const float *x = logits + r * stride;
            const float t = temperature[r];
            const int greedy = !(t > 0.0f);
            const float div = greedy ? 1.0f : t;
            /* pass 1: the maximum of s (and, greedy, the first index of the maximum of x) */
            float m = -FLT_MAX;
            int64_t arg = 0;
            if (greedy) {
                for (int64_t j = 0; j < V; ++j)
                    if (x[j] > m) { m = x[j]; arg = j; }
            } else {
#pragma omp simd reduction(max : m)
                for (int64_t j = 0; j < V; ++j) { const float v = x[j] / div; m = v > m ? v : m; }
            }
            /* pass 2: block masses exp(s - m), their total */
            double total = 0.0;
            for (int64_t b = 0; b < nb; ++b) {
                const int64_t lo = b * BLOCK, hi = lo + BLOCK < V ? lo + BLOCK : V;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t j = lo; j < hi; ++j) acc += tandem_exp(x[j] / div - m);
                mass[b] = acc;
                total += acc;
            }
            const float lse = m + (float)log(total);
            if (greedy) {
                token[r] = arg;
                logprob[r] = x[arg] - lse;
                continue;
            }
            /* pass 3: the block holding u * total, then the token inside it */
            const double target = uniform[r] * total;
            double before = 0.0;
            int64_t chosen = -1, last = 0;
            for (int64_t b = 0; b < nb; ++b) {
                if (mass[b] <= 0.0) continue;
                last = b;
                if (before + mass[b] > target) { chosen = b; break; }
                before += mass[b];
            }
            if (chosen < 0) { /* u * total rounded up to the total: the last block with mass */
                chosen = last;
                before = total - mass[last];
            }
            const int64_t lo = chosen * BLOCK, hi = lo + BLOCK < V ? lo + BLOCK : V;
            double cum = 0.0, want = target - before;
            int64_t pick = -1, nonzero = lo;
            for (int64_t j = lo; j < hi; ++j) {
                const float p = tandem_exp(x[j] / div - m);
                if (p <= 0.0f) continue;
                nonzero = j;
                cum += p;
                if (cum > want) { pick = j; break; }
            }
            if (pick < 0) pick = nonzero; /* rounding between the two levels: the block's last token with mass */
            token[r] = pick;
            logprob[r] = x[pick] / div - lse;
        }
        free(mass);
    }
    return status;
}
