/* y = x W^T (+ bias) (+ residual) for a few rows of x: the decode step's projections.
 *
 * Why this exists (workers/model/native_linear.py has the measurements): a decode step
 * at batch 1 reads every weight once and does 2 flops per weight, so it is bound by
 * memory bandwidth. oneDNN's packed GEMV read SmolLM2's 513 MiB at ~18 GB/s on the
 * 2-core benchmark machine, where a plain sum streams ~27 GB/s. This kernel streams
 * W four rows at a time, as one sequential stream (the blocked layout of native_gemv.h),
 * with one AVX2 FMA accumulator per row, and splits the rows across threads.
 *
 * Threads: an OpenMP team of torch's own libgomp (see kvs_linear). A pool of our own
 * threads was tried first: between two projections torch's OpenMP threads spin-wait
 * for the next parallel op, ours spun for the next call, and on 2 cores the step took
 * 68 ms against oneDNN's 41 ms (32 ms with OMP_WAIT_POLICY=PASSIVE).
 *
 * The tiles and their layout are in native_gemv.h; native_decode.c runs a whole decode
 * step on them.
 */
#include <omp.h>

#include "native_gemv.h"

/* `num_threads` threads share the rows, in an OpenMP team of the libgomp that torch
 * itself loaded (the library is linked against it): the threads that run torch's own
 * parallel ops run these calls too, so nothing else spins for the cores between them. */
void kvs_linear(const float *x, const float *w, const float *bias, const float *residual, float *y,
                int rows, int in, int out, int num_threads) {
    const job_t j = {x, w, bias, residual, y, rows, in, out};
    /* Fewer than 4 rows of W per thread is not worth the hand-off. */
    int parts = num_threads < out / 4 ? num_threads : out / 4;
    if (parts <= 1) {
        run_rows(&j, 0, out);
        return;
    }
#pragma omp parallel num_threads(parts)
    run_share(&j, omp_get_thread_num(), omp_get_num_threads());
}

/* y = x / sqrt(mean(x^2) + eps) * weight, row by row (native_gemv.h). One thread: a decode
 * step's rows are a few hundred floats, far below a hand-off's cost; torch's own op spent
 * ~13 dispatched ops on them. x, weight, y: [rows, n], [n], [rows, n]; y may alias x. */
void kvs_rms_norm(const float *x, const float *weight, float eps, float *y, int rows, int n) {
    for (int t = 0; t < rows; t++) rms_norm_row(x + (size_t)t * n, weight, eps, y + (size_t)t * n, n);
}

/* The sum of n floats, read once by `num_threads` threads (each a contiguous share) with
 * four accumulators each: a plain streaming read, the floor bench-decode measures its
 * batch-1 MBU against (loadtest/bench_decode.py). */
double kvs_sum(const float *x, long n, int num_threads) {
    double total = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        const long lo = (n * tid / team) & ~31L, hi = tid + 1 == team ? n : (n * (tid + 1) / team) & ~31L;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        long k = lo;
        for (; k + 32 <= hi; k += 32) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + k));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + k + 8));
            a2 = _mm256_add_ps(a2, _mm256_loadu_ps(x + k + 16));
            a3 = _mm256_add_ps(a3, _mm256_loadu_ps(x + k + 24));
        }
        float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; k < hi; k++) s += x[k];
        total += s;
    }
    return total;
}
