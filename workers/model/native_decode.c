/* A whole decode step, every layer, in one call: the eager path's per-layer work without
 * its per-op cost.
 *
 * Why (workers/model/native_decode.py has the measurements): at batch 1 on SmolLM2 (30
 * narrow layers) the eager step dispatched ~930 torch ops and ~180 ctypes calls, a few
 * microseconds each, plus the Python between them, on top of reading the weights. Here
 * Python calls once per step and the layers run inside one OpenMP parallel region of
 * torch's own libgomp (native_linear.c says why that team), the threads meeting at a
 * barrier between phases:
 *
 *   rotary tables for the step's positions                      rows split
 *   per layer:
 *     RMSNorm                          -> normed                 rows split
 *     q/k/v projection (+ bias)        -> qkv                    W rows split
 *     rotary on q and k, K/V to cache  (in qkv, cache slots)     rows split
 *     attention over the paged cache   -> attn                   (row, head) pairs split
 *     o projection (+ bias) + x        -> x                      W rows split
 *     RMSNorm                          -> normed                 rows split
 *     gate/up projection               -> gate_up                W rows split
 *     silu(gate) * up                  -> act                    rows split
 *     down projection + x              -> x                      W rows split
 *   final RMSNorm                      -> out                    rows split
 *
 * The projections are native_gemv.h's tiles, the same code and summation order as a
 * kvs_linear call, so a projection gives the same bits either way. Every step row is one
 * request's single new token (a decode-only step); its context is positions
 * [0, position], the new token's K/V written before any row attends.
 *
 * KV cache, one tensor per layer: [2, KVH, num_blocks, block_size, D] (K then V; each KV
 * head's slots contiguous); slot = block * block_size + offset.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_gemv.h"

/* The model, set up once (native_decode.py's _Model mirrors this struct field by field). */
typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *inv_freq;           /* [D / 2] rotary inverse frequencies */
    const float *const *input_norm;  /* per layer [hidden] */
    const float *const *qkv;         /* per layer [(H + 2 KVH) D, hidden] */
    const float *const *qkv_bias;    /* per layer [(H + 2 KVH) D], or NULL: no biases */
    const float *const *o;           /* per layer [hidden, H D] */
    const float *const *o_bias;      /* per layer [hidden], or NULL */
    const float *const *post_norm;   /* per layer [hidden] */
    const float *const *gate_up;     /* per layer [2 I, hidden]: gate rows, then up rows */
    const float *const *down;        /* per layer [hidden, I] */
    const float *final_norm;         /* [hidden] */
} model_t;

/* exp(x) for 8 lanes: Cody-Waite range reduction and a degree-5 polynomial (Cephes' expf),
 * within 2 ulp of expf over the clamped range; torch's vectorized exp is within 1. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

static inline float exp1(float x) {
    float lanes[8];
    _mm256_storeu_ps(lanes, exp8(_mm256_set1_ps(x)));
    return lanes[0];
}

/* act[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], as torch's
 * F.silu(gate).mul_(up) orders it. */
static void silu_mul(const float *gate, const float *up, float *act, int n) {
    const int vec = n & ~7;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int i = 0; i < vec; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    for (int i = vec; i < n; i++) act[i] = gate[i] / (1.0f + exp1(-gate[i])) * up[i];
}

static inline float dot(const float *a, const float *b, int n) {
    const int vec = n & ~7;
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < vec; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    float s = hsum(acc);
    for (int k = vec; k < n; k++) s += a[k] * b[k];
    return s;
}

/* Ask for the cache lines of n floats from p on (into L1). */
static inline void prefetch_floats(const float *p, int n) {
    for (int i = 0; i < n; i += 16) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

/* q against four consecutive keys (k, k + n, k + 2n, k + 3n): four independent chains of
 * FMAs instead of one (a lone 64-wide dot is a chain of 8 dependent FMAs and a horizontal
 * sum), their sums in one 4-wide result by three hadds. */
static inline __m128 dot4(const float *q, const float *k, int n) {
    const int vec = n & ~7;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < vec; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + n + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * (size_t)n + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * (size_t)n + i), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    if (vec < n) {
        float tails[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int j = 0; j < 4; j++)
            for (int i = vec; i < n; i++) tails[j] += q[i] * k[(size_t)j * n + i];
        sums = _mm_add_ps(sums, _mm_loadu_ps(tails));
    }
    return sums;
}

/* HF's rotate_half rotation of one head in place: dimension i turns with i + D/2.
 *   x1' = x1 cos - x2 sin      x2' = x2 cos + x1 sin */
static inline void rotate(float *v, const float *cos_t, const float *sin_t, int half) {
    for (int i = 0; i < half; i++) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * cos_t[i] - x2 * sin_t[i];
        v[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
    }
}

/* Softmax attention of one query head over its request's context (positions 0..ctx-1,
 * through the block table), written to out [D]. scores: ctx floats of scratch. The
 * context is walked block by block (no division per position), and the weighted sum of
 * V keeps each 64-wide slice of out in eight registers across the whole context (the
 * same fused multiply-adds in the same order as accumulating in memory, so the same bits). */
static void attend_head(const float *q, const float *k_plane, const float *v_plane, const int64_t *table, int ctx,
                        int block_size, int d, float scale, float *scores, float *out) {
    float top = -INFINITY;
    const size_t block_floats = (size_t)block_size * d;
    for (int start = 0, b = 0; start < ctx; start += block_size, b++) {
        const float *k = k_plane + (size_t)table[b] * block_floats;
        /* The next block's keys, fetched as this block's are read (the blocks are scattered
         * pages: the hardware prefetcher starts cold at each). */
        const float *k_next = start + block_size < ctx ? k_plane + (size_t)table[b + 1] * block_floats : NULL;
        const int n = ctx - start < block_size ? ctx - start : block_size;
        int o = 0;
        for (; o + 4 <= n; o += 4) {  /* four keys at a time: the scores were ~45 cycles a key */
            if (k_next != NULL) prefetch_floats(k_next + (size_t)o * d, 4 * d);
            float four[4];
            _mm_storeu_ps(four, _mm_mul_ps(dot4(q, k + (size_t)o * d, d), _mm_set1_ps(scale)));
            for (int j = 0; j < 4; j++) {
                scores[start + o + j] = four[j];
                if (four[j] > top) top = four[j];
            }
        }
        for (; o < n; o++) {
            const float s = dot(q, k + (size_t)o * d, d) * scale;
            scores[start + o] = s;
            if (s > top) top = s;
        }
    }
    const __m256 top8 = _mm256_set1_ps(top);
    const int vec = ctx & ~7;
    __m256 sum8 = _mm256_setzero_ps();
    for (int j = 0; j < vec; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top8));
        _mm256_storeu_ps(scores + j, p);
        sum8 = _mm256_add_ps(sum8, p);
    }
    float sum = hsum(sum8);
    for (int j = vec; j < ctx; j++) {
        scores[j] = exp1(scores[j] - top);
        sum += scores[j];
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    int i0 = 0;
    for (; i0 + 64 <= d; i0 += 64) {
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
        for (int start = 0, b = 0; start < ctx; start += block_size, b++) {
            const float *v = v_plane + (size_t)table[b] * block_floats + i0;
            const float *v_next = start + block_size < ctx ? v_plane + (size_t)table[b + 1] * block_floats + i0 : NULL;
            const int n = ctx - start < block_size ? ctx - start : block_size;
            for (int o = 0; o < n; o++) {
                if (v_next != NULL) prefetch_floats(v_next + (size_t)o * d, 64);
                const __m256 p = _mm256_set1_ps(scores[start + o]);
                for (int c = 0; c < 8; c++)
                    acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + (size_t)o * d + 8 * c), acc[c]);
            }
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + i0 + 8 * c, _mm256_mul_ps(acc[c], inv));
    }
    if (i0 == d) return;
    /* A head dim that is not a multiple of 64: the rest accumulated in memory. */
    for (int i = i0; i < d; i++) out[i] = 0.0f;
    const int dvec = i0 + ((d - i0) & ~7);
    for (int start = 0, b = 0; start < ctx; start += block_size, b++) {
        const float *v_block = v_plane + (size_t)table[b] * block_size * d;
        const int n = ctx - start < block_size ? ctx - start : block_size;
        for (int o = 0; o < n; o++) {
            const float *v = v_block + (size_t)o * d;
            const float weight = scores[start + o];
            const __m256 p = _mm256_set1_ps(weight);
            for (int i = i0; i < dvec; i += 8)
                _mm256_storeu_ps(out + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
            for (int i = dvec; i < d; i++) out[i] += weight * v[i];
        }
    }
    const float inv1 = 1.0f / sum;
    for (int i = i0; i < d; i++) out[i] *= inv1;
}

/* The phases kvs_decode can time (native_decode.py's PHASES names them in this order). */
enum { ROTARY_TABLES, INPUT_NORM, QKV, ROTARY_KV_WRITE, ATTENTION, O, POST_NORM, GATE_UP, SILU_MUL, DOWN, FINAL_NORM,
       KVS_PHASES };

/* Thread 0 charges the time since its last mark to `phase`; called right after a barrier,
 * so a phase's time is its slowest thread's. */
#define MARK(phase)                                   \
    if (seconds != NULL && tid == 0) {                \
        const double now = omp_get_wtime();           \
        seconds[phase] += now - last;                 \
        last = now;                                   \
    }

/* This thread's share of one projection: whole blocks of 4 W rows, and one thread alone
 * when there are fewer than 4 rows per thread (kvs_linear's rule). */
static inline void project(const job_t *j, int tid, int threads) {
    const int parts = threads < j->out / 4 ? threads : j->out / 4;
    if (parts <= 1) {
        if (tid == 0) run_rows(j, 0, j->out);
    } else if (tid < parts) {
        run_share(j, tid, parts);
    }
}

/* One decode step over `rows` requests, every layer.
 *
 * kv: per layer, that layer's cache (layout above) of num_blocks blocks of block_size
 * slots. x [rows, hidden]: the token
 * embeddings, used as the residual stream (overwritten). out [rows, hidden]: the final
 * norm's output. positions, slots [rows]: each row's position and its K/V slot.
 * tables [rows, table_stride]: each row's block table, covering positions 0..position.
 * seconds: NULL, or KVS_PHASES doubles that each phase's wall time (to its closing barrier)
 * is added to, for profiling. Returns 0, or -1 when scratch memory could not be allocated
 * (nothing written then). */
int kvs_decode(const model_t *m, float *const *kv, int num_blocks, int block_size, float *x, float *out,
               const int64_t *positions, const int64_t *slots, const int64_t *tables, int table_stride, int rows,
               int num_threads, double *seconds) {
    const int hidden = m->hidden, heads = m->num_heads, kv_heads = m->num_kv_heads, d = m->head_dim;
    const int half = d / 2, qk_heads = heads + kv_heads, qkv_width = (heads + 2 * kv_heads) * d;
    const int inter = m->intermediate, group = heads / kv_heads;
    const size_t plane = (size_t)num_blocks * block_size * d;  /* one KV head's slots */
    int max_ctx = 1;
    for (int t = 0; t < rows; t++)
        if (positions[t] + 1 > max_ctx) max_ctx = (int)positions[t] + 1;
    const int threads = num_threads < 1 ? 1 : num_threads;
    const size_t per_thread = (size_t)max_ctx + 8;
    const size_t floats = (size_t)rows * (hidden + qkv_width + heads * d + 3 * inter + 2 * d) + threads * per_thread;
    float *scratch = malloc(floats * sizeof(float));
    if (scratch == NULL) return -1;
    float *normed = scratch, *qkv = normed + (size_t)rows * hidden, *attn = qkv + (size_t)rows * qkv_width;
    float *gate_up = attn + (size_t)rows * heads * d, *act = gate_up + (size_t)rows * 2 * inter;
    float *cos_t = act + (size_t)rows * inter, *sin_t = cos_t + (size_t)rows * half;
    float *thread_scores = sin_t + (size_t)rows * half;

#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        float *scores = thread_scores + (size_t)tid * per_thread;
        double last = seconds != NULL && tid == 0 ? omp_get_wtime() : 0.0;
#pragma omp for
        for (int t = 0; t < rows; t++)
            for (int i = 0; i < half; i++) {
                /* The angle in float32, as the eager path's positions.float() * inv_freq. */
                const float angle = (float)positions[t] * m->inv_freq[i];
                cos_t[(size_t)t * half + i] = cosf(angle);
                sin_t[(size_t)t * half + i] = sinf(angle);
            }
        MARK(ROTARY_TABLES)
        for (int l = 0; l < m->num_layers; l++) {
            float *k_cache = kv[l], *v_cache = kv[l] + (size_t)kv_heads * plane;
#pragma omp for
            for (int t = 0; t < rows; t++)
                rms_norm_row(x + (size_t)t * hidden, m->input_norm[l], m->eps, normed + (size_t)t * hidden, hidden);
            MARK(INPUT_NORM)
            const job_t qkv_job = {normed, m->qkv[l], m->qkv_bias ? m->qkv_bias[l] : NULL, NULL, qkv, rows, hidden,
                                   qkv_width};
            project(&qkv_job, tid, team);
#pragma omp barrier
            MARK(QKV)
#pragma omp for
            for (int t = 0; t < rows; t++) {
                float *row = qkv + (size_t)t * qkv_width;
                for (int h = 0; h < qk_heads; h++)
                    rotate(row + (size_t)h * d, cos_t + (size_t)t * half, sin_t + (size_t)t * half, half);
                for (int g = 0; g < kv_heads; g++) {
                    const float *k = row + (size_t)(heads + g) * d, *v = row + (size_t)(qk_heads + g) * d;
                    float *k_slot = k_cache + g * plane + (size_t)slots[t] * d;
                    float *v_slot = v_cache + g * plane + (size_t)slots[t] * d;
                    for (int i = 0; i < d; i++) {
                        k_slot[i] = k[i];
                        v_slot[i] = v[i];
                    }
                }
            }
            MARK(ROTARY_KV_WRITE)
#pragma omp for collapse(2) schedule(static)
            for (int t = 0; t < rows; t++)
                for (int h = 0; h < heads; h++) {
                    const int g = h / group;
                    attend_head(qkv + (size_t)t * qkv_width + (size_t)h * d, k_cache + g * plane, v_cache + g * plane,
                                tables + (size_t)t * table_stride, (int)positions[t] + 1, block_size, d, m->scale,
                                scores, attn + ((size_t)t * heads + h) * d);
                }
            MARK(ATTENTION)
            const job_t o_job = {attn, m->o[l], m->o_bias ? m->o_bias[l] : NULL, x, x, rows, heads * d, hidden};
            project(&o_job, tid, team);
#pragma omp barrier
            MARK(O)
#pragma omp for
            for (int t = 0; t < rows; t++)
                rms_norm_row(x + (size_t)t * hidden, m->post_norm[l], m->eps, normed + (size_t)t * hidden, hidden);
            MARK(POST_NORM)
            const job_t gate_up_job = {normed, m->gate_up[l], NULL, NULL, gate_up, rows, hidden, 2 * inter};
            project(&gate_up_job, tid, team);
#pragma omp barrier
            MARK(GATE_UP)
#pragma omp for
            for (int t = 0; t < rows; t++)
                silu_mul(gate_up + (size_t)t * 2 * inter, gate_up + (size_t)t * 2 * inter + inter,
                         act + (size_t)t * inter, inter);
            MARK(SILU_MUL)
            const job_t down_job = {act, m->down[l], NULL, x, x, rows, inter, hidden};
            project(&down_job, tid, team);
#pragma omp barrier
            MARK(DOWN)
        }
#pragma omp for
        for (int t = 0; t < rows; t++)
            rms_norm_row(x + (size_t)t * hidden, m->final_norm, m->eps, out + (size_t)t * hidden, hidden);
        MARK(FINAL_NORM)
    }
    free(scratch);
    return 0;
}
