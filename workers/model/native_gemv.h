/* The GEMV tiles (on blocked weights, below) and the RMSNorm row shared by native_linear.c (one
 * projection per call) and native_decode.c (a whole decode step per call). Static inline: each source
 * file gets its own copy, unrolled for its constant tile shapes.
 *
 * Layout:  x [rows, in]   W [out, in] blocked (below)   bias [out] or NULL
 *          residual [rows, out] or NULL   y [rows, out]; y must not alias x or W (it may be
 *          residual: each element is read before it is written, by the same thread).
 *
 * W blocked: each block of 4 rows (r = 0, 4, 8, ...) holds the same 4 * in floats as its
 * rows do row-major, from W + r * in, with the rows' 8-float chunks interleaved, so a tile
 * reads its block as one sequential stream; the rows past the last whole block stay
 * row-major (native_linear.py's `blocked` writes it):
 *
 *   block r:  r0[0:8] r1[0:8] r2[0:8] r3[0:8] r0[8:16] ... r3[vec-8:vec] | r0[vec:in] r1[vec:in] ...
 *             (vec = in rounded down to 8; the tails row by row)
 *
 * Why: reading four row-major rows side by side is four streams in floats apart. On the
 * 2-core EPYC, SmolLM2's projections and head at batch 1 (a C harness, 2 threads, three
 * interleaved rounds of 30 steps, mean step): row-major 25.5-27.3 ms, blocked 14.5-17.5 ms,
 * and a plain sum over the same bytes 17.8-20.2 ms. At 4 rows the two are even; at 16 and
 * 64 (compute-bound) blocked is within +-5%.
 *
 *   thread 0      thread 1           thread n-1
 *   rows of W: [0 .. r1) [r1 .. r2) ... [.. out)     each share a multiple of 4 rows
 */
#ifndef KVS_NATIVE_GEMV_H
#define KVS_NATIVE_GEMV_H

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the native kernels need AVX2 and FMA (they are compiled with -march=native)"
#endif

#include <immintrin.h>
#include <math.h>
#include <stddef.h>

typedef struct {
    const float *x, *w, *bias, *residual;
    float *y;
    int rows, in, out;
} job_t;

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* The dot product of one row of W with one row of x: 8 lanes, then the tail. */
static inline float dot_tail(const float *w, const float *x, int from, int in) {
    float s = 0.0f;
    for (int k = from; k < in; k++) s += w[k] * x[k];
    return s;
}

static inline void finish(const job_t *j, int t, int r, float acc) {
    if (j->bias) acc += j->bias[r];
    if (j->residual) acc += j->residual[(size_t)t * j->out + r];
    j->y[(size_t)t * j->out + r] = acc;
}

/* Row t of y, columns r..r+3, from the four accumulators of W rows r..r+3: the four
 * horizontal sums in three hadds (one 4-wide result), then the tails, bias and residual. */
static inline void finish4(const job_t *j, int t, int r, __m256 a0, __m256 a1, __m256 a2, __m256 a3, int vec) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  /* [r, r+1, r+2, r+3] */
    if (vec < j->in) {
        /* The block's row tails, each in - vec floats, after its 4 * vec interleaved ones;
         * dot_tail indexes from vec, so each tail's base is moved back by vec. */
        const int n = j->in - vec;
        const float *x = j->x + (size_t)t * j->in, *w = j->w + (size_t)r * j->in + 4 * (size_t)vec - vec;
        sums = _mm_add_ps(sums, _mm_setr_ps(dot_tail(w, x, vec, j->in), dot_tail(w + n, x, vec, j->in),
                                            dot_tail(w + 2 * n, x, vec, j->in), dot_tail(w + 3 * n, x, vec, j->in)));
    }
    if (j->bias) sums = _mm_add_ps(sums, _mm_loadu_ps(j->bias + r));
    float *y = j->y + (size_t)t * j->out + r;
    if (j->residual) sums = _mm_add_ps(sums, _mm_loadu_ps(j->residual + (size_t)t * j->out + r));
    _mm_storeu_ps(y, sums);
}

/* NW rows of W (from r) against NX rows of x (from t): NW x NX dot products, each its own
 * 8-lane accumulator, so every product is summed in the same order whatever the grouping:
 * a row of x gets the same bits alone or in a batch. Called with constant NW and NX, so
 * the compiler unrolls the loops and keeps the accumulators in registers (4 x 3 = 12 of
 * AVX2's 16). The W rows are read once per group of x rows; from L1 after the first.
 * NW 4: a whole block (r a multiple of 4), blocked; NW 1: a row past the last block,
 * row-major. */
static inline __attribute__((always_inline)) void tile(const job_t *j, int r, int t, const int NW, const int NX) {
    const int in = j->in, vec = in & ~7;
    const float *w = j->w + (size_t)r * in, *x = j->x + (size_t)t * in;
    __m256 acc[4][3];
    for (int a = 0; a < NW; a++)
        for (int b = 0; b < NX; b++) acc[a][b] = _mm256_setzero_ps();
    for (int k = 0; k < vec; k += 8) {
        /* Both operands in registers: left alone, gcc folds a load into each FMA (a memory
         * operand per FMA; with the blocked W it folds x's, 16 loads for 12 FMAs), and the
         * load ports, not the FMA units, set the pace. One core, 16 rows in cache: 53
         * against 70 GFLOP/s for W's loads folded, 73 against 92 for x's. */
        __m256 xv[3];
        for (int b = 0; b < NX; b++) {
            xv[b] = _mm256_loadu_ps(x + (size_t)b * in + k);
            __asm__("" : "+x"(xv[b]));
        }
        const float *chunk = NW == 4 ? w + 4 * (size_t)k : w + k;
        for (int a = 0; a < NW; a++) {
            __m256 wv = _mm256_loadu_ps(chunk + 8 * a);
            __asm__("" : "+x"(wv));
            for (int b = 0; b < NX; b++) acc[a][b] = _mm256_fmadd_ps(wv, xv[b], acc[a][b]);
        }
    }
    if (NW == 4) {
        for (int b = 0; b < NX; b++) finish4(j, t + b, r, acc[0][b], acc[1][b], acc[2][b], acc[3][b], vec);
        return;
    }
    for (int a = 0; a < NW; a++)
        for (int b = 0; b < NX; b++)
            finish(j, t + b, r + a, hsum(acc[a][b]) + dot_tail(w + (size_t)a * in, x + (size_t)b * in, vec, in));
}

/* Rows [r0, r1) of W against every row of x (r0 a multiple of 4): blocks of four W rows
 * (4 * in floats, in L1), each read from memory once and used for every row of x, three
 * rows at a time.
 *
 *            x rows:  t t+1 t+2 | t+3 t+4 t+5 | ...   (tail: 1 or 2 rows)
 *   W rows r..r+3     [ 4 x 3  ] [  4 x 3    ]
 *   W rows r1-1 (tail) one at a time, same grouping of x
 *
 * No software prefetch: a block is one sequential stream, which the hardware prefetcher
 * follows. Prefetching the next block (as the row-major tiles did) was no faster at 1 and
 * 16 rows and slower at 4 (the same harness: 27-35 against 19-27 ms mean).
 */
static inline void run_rows(const job_t *j, int r0, int r1) {
    const int rows = j->rows, rows3 = rows - rows % 3;
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        int t = 0;
        for (; t < rows3; t += 3) tile(j, r, t, 4, 3);
        if (rows - t == 2) tile(j, r, t, 4, 2);
        else if (rows - t == 1) tile(j, r, t, 4, 1);
    }
    for (; r < r1; r++) {
        int t = 0;
        for (; t < rows3; t += 3) tile(j, r, t, 1, 3);
        if (rows - t == 2) tile(j, r, t, 1, 2);
        else if (rows - t == 1) tile(j, r, t, 1, 1);
    }
}

/* Share `part` of `parts`: a multiple of 4 rows, the last share takes the remainder. */
static inline void run_share(const job_t *j, int part, int parts) {
    int r0 = (int)(((long)j->out * part / parts) & ~3L);
    int r1 = part + 1 == parts ? j->out : (int)(((long)j->out * (part + 1) / parts) & ~3L);
    run_rows(j, r0, r1);
}

/* One row of RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight (the order of torch's float32
 * rms_norm: x times the reciprocal root, then times the weight). y may alias x. */
static inline void rms_norm_row(const float *xr, const float *weight, float eps, float *yr, int n) {
    const int vec = n & ~7;
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < vec; k += 8) {
        __m256 v = _mm256_loadu_ps(xr + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = hsum(acc);
    for (int k = vec; k < n; k++) sum += xr[k] * xr[k];
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    const __m256 s = _mm256_set1_ps(scale);
    for (int k = 0; k < vec; k += 8)
        _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), s), _mm256_loadu_ps(weight + k)));
    for (int k = vec; k < n; k++) yr[k] = xr[k] * scale * weight[k];
}

#endif
