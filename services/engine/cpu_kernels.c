/* CPU kernels for the decode step, where PyTorch's fp32 kernels are bound by memory bandwidth.
 *
 * A decode step multiplies a handful of rows by every weight of the model. With fp32 weights that reads
 * 540 MB per step for SmolLM2-135M; these kernels read the GGUF file's own 4-bit and 8-bit blocks instead
 * (about 100 MB) and compute in fp32 with the exact values the blocks encode, so results match the dense
 * fp32 path up to summation order. Built and loaded by services/engine/cpu_kernels.py (gcc -O3
 * -march=native -fopenmp); OpenMP resolves to the libgomp that torch already loaded, so these kernels share
 * torch's threads. Each call takes its thread count (torch's setting) explicitly: OpenMP's own default
 * would be every core, whichever thread calls.
 *
 * Block formats (32 weights along the input dimension per block, rows = output features):
 *   Q4_1: w = scale * q + min, q in [0, 15]; 16 bytes of nibbles (byte j: element j low, j + 16 high).
 *   Q8_0: w = scale * q, q in [-128, 127]; 32 bytes.
 * Scales and mins are passed as fp32 arrays [rows, blocks] (exact conversions of the file's fp16 values).
 */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define ROW_TILE 8

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
/* Unaligned views for loads; a memcpy into a vector made gcc assemble bytes through scalar registers. */
typedef float f32x16_u __attribute__((vector_size(64), aligned(1)));
typedef uint8_t u8x16_u __attribute__((vector_size(16), aligned(1)));
typedef int8_t i8x16_u __attribute__((vector_size(16), aligned(1)));

static inline f32x16 load16(const float *p) { return *(const f32x16_u *)p; }

/* Widen through int32: gcc turns a direct 8-bit -> float vector conversion into scalar code. */
#define TO_F32(v) __builtin_convertvector(__builtin_convertvector((v), i32x16), f32x16)

/* 16 signed bytes as floats; gcc scalarises the generic form of this widening inside the Q8_0 loop. */
static inline f32x16 i8_to_f32(const int8_t *p) {
#ifdef __AVX512F__
    return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return TO_F32(*(const i8x16_u *)p);
#endif
}

static inline float hsum(f32x16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* Sum of each 32-wide block of each input row: [m, blocks]. The Q4_1 min term is min * block_sum. */
static void block_sums(const float *x, int64_t m, int64_t k, float *sums) {
    const int64_t blocks = k / BLOCK;
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * k + b * BLOCK;
            sums[r * blocks + b] = hsum(load16(xb) + load16(xb + 16));
        }
}

/* One weight row against `R` input rows, R a compile-time constant after inlining so the accumulators live in
 * registers. Q4_1: sum_b scale_b * (q_b . x_b) + min_b * sum(x_b). */
static inline __attribute__((always_inline)) void q4_1_tile(const uint8_t *qs, const float *scale, const float *min,
                                                            int64_t blocks, const float *x, int64_t k,
                                                            const float *sums, const int R, float *y,
                                                            int64_t n) {
    f32x16 acc[ROW_TILE] = {0};
    float min_acc[ROW_TILE] = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const u8x16 packed = *(const u8x16_u *)(qs + b * 16);
        const f32x16 lo = TO_F32(packed & 0x0F) * scale[b], hi = TO_F32(packed >> 4) * scale[b];
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * k + b * BLOCK;
            acc[r] += lo * load16(xb) + hi * load16(xb + 16);
            min_acc[r] += min[b] * sums[r * blocks + b];
        }
    }
    for (int r = 0; r < R; r++) y[r * n] = hsum(acc[r]) + min_acc[r];
}

static inline __attribute__((always_inline)) void q8_0_tile(const int8_t *qs, const float *scale, int64_t blocks,
                                                            const float *x, int64_t k, const int R, float *y,
                                                            int64_t n) {
    f32x16 acc[ROW_TILE] = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const f32x16 w0 = i8_to_f32(qs + b * BLOCK) * scale[b], w1 = i8_to_f32(qs + b * BLOCK + 16) * scale[b];
        for (int r = 0; r < R; r++) {
            const float *xb = x + r * k + b * BLOCK;
            acc[r] += w0 * load16(xb) + w1 * load16(xb + 16);
        }
    }
    for (int r = 0; r < R; r++) y[r * n] = hsum(acc[r]);
}

/* Calls TILE(..., R, ...) with R as a constant for each possible tile height. */
#define FOR_TILE_HEIGHT(rows, CALL) \
    switch (rows) {                 \
    case 1: CALL(1); break;         \
    case 2: CALL(2); break;         \
    case 3: CALL(3); break;         \
    case 4: CALL(4); break;         \
    case 5: CALL(5); break;         \
    case 6: CALL(6); break;         \
    case 7: CALL(7); break;         \
    default: CALL(8); break;        \
    }

/* y[m, n] = x[m, k] @ W^T for W [n, k] in Q4_1 blocks (qs [n, k / 32, 16], scale and min [n, k / 32]). */
void q4_1_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scale, const float *min,
                 int64_t n, float *y, int threads) {
    const int64_t blocks = k / BLOCK;
    float *sums = malloc(sizeof(float) * (size_t)(m * blocks));
    block_sums(x, m, k, sums);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < n; row++)
        for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
#define Q4_CALL(R)                                                                                        \
    q4_1_tile(qs + row * blocks * 16, scale + row * blocks, min + row * blocks, blocks, x + r0 * k, k, \
              sums + r0 * blocks, R, y + r0 * n + row, n)
            FOR_TILE_HEIGHT(m - r0, Q4_CALL)
#undef Q4_CALL
        }
    free(sums);
}

/* y[m, n] = x[m, k] @ W^T for W [n, k] in Q8_0 blocks (qs [n, k / 32, 32], scale [n, k / 32]). */
void q8_0_matmul(const float *x, int64_t m, int64_t k, const int8_t *qs, const float *scale, int64_t n,
                 float *y, int threads) {
    const int64_t blocks = k / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < n; row++)
        for (int64_t r0 = 0; r0 < m; r0 += ROW_TILE) {
#define Q8_CALL(R) \
    q8_0_tile(qs + row * blocks * BLOCK, scale + row * blocks, blocks, x + r0 * k, k, R, y + r0 * n + row, n)
            FOR_TILE_HEIGHT(m - r0, Q8_CALL)
#undef Q8_CALL
        }
}

/* One query token per sequence attending to its paged context, grouped-query heads reading shared K/V.
 *
 * q [seqs, heads, dim]; k_cache, v_cache [blocks, block_size, kv_heads, dim]; block_tables [seqs, width];
 * context_lens [seqs]; out [seqs, heads, dim]. Each (sequence, K/V head) pair reads its keys and values once
 * for all the query heads that share them.
 */
void paged_decode_attention(const float *q, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                            const float *k_cache, const float *v_cache, int64_t block_size,
                            const int64_t *block_tables, int64_t width, const int64_t *context_lens,
                            float scale, float *out, int threads) {
    const int64_t group = heads / kv_heads;
    const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
#pragma omp parallel for schedule(static) collapse(2) num_threads(threads)
    for (int64_t s = 0; s < seqs; s++)
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
            const int64_t ctx = context_lens[s];
            const int64_t *table = block_tables + s * width;
            const float *qs = q + (s * heads + kvh * group) * dim;
            float *scores = malloc(sizeof(float) * (size_t)(group * ctx));
            for (int64_t t = 0; t < ctx; t++) {
                const float *key = k_cache + table[t / block_size] * block_stride +
                                   (t % block_size) * token_stride + kvh * dim;
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qs + g * dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < dim; i++) dot += qg[i] * key[i];
                    scores[g * ctx + t] = dot * scale;
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *row = scores + g * ctx, peak = -INFINITY, total = 0.0f;
                for (int64_t t = 0; t < ctx; t++) peak = row[t] > peak ? row[t] : peak;
#pragma omp simd reduction(+ : total)
                for (int64_t t = 0; t < ctx; t++) {
                    row[t] = expf(row[t] - peak);
                    total += row[t];
                }
                const float inv = 1.0f / total;
                for (int64_t t = 0; t < ctx; t++) row[t] *= inv;
            }
            float *o = out + (s * heads + kvh * group) * dim;
            memset(o, 0, sizeof(float) * (size_t)(group * dim));
            for (int64_t t = 0; t < ctx; t++) {
                const float *value = v_cache + table[t / block_size] * block_stride +
                                     (t % block_size) * token_stride + kvh * dim;
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * ctx + t];
                    float *og = o + g * dim;
#pragma omp simd
                    for (int64_t i = 0; i < dim; i++) og[i] += p * value[i];
                }
            }
            free(scores);
        }
}
