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
 *   Q6_K: w = scale * q, q in [-32, 31]; 32 bytes, and a scale for each half of the block (GGUF's Q6_K
 *         scales every 16 weights).
 * Scales and mins are passed as fp32 arrays [rows, blocks] ([rows, 2 * blocks] for Q6_K), the exact values
 * the file's fp16 scales (times Q4_K's and Q6_K's small integer sub-block scales) stand for.
 */

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Let the softmax loop call glibc's vector expf (libmvec), as math.h would declare it under -ffast-math. */
#pragma omp declare simd notinbranch
extern float expf(float);

#define BLOCK 32
#define LINE_FLOATS (64 / (int64_t)sizeof(float))

/* The matmul tiles work on vectors of the CPU's own width: 16 floats (one zmm register) with AVX-512, else 8
 * (one ymm register with AVX2; two SSE/NEON registers elsewhere). Wider vectors than the CPU has are split
 * by gcc into scalar code around every conversion, which made these kernels ten times slower than torch's
 * dense matmul on AVX2-only CPUs. ROW_TILE input rows share each dequantized block: with 16 vector
 * registers (AVX2) the WEIGHT_ROWS x ROW_TILE accumulators and the block's vectors must fit in them. */
#ifdef __AVX512F__
#define LANES 16
#define ROW_TILE 8
#else
#define LANES 8
#define ROW_TILE 4
#endif
#define VECTORS_PER_BLOCK (BLOCK / LANES)
/* Weight rows per tile: 2 for a batch of several rows; for one or two input rows (decode of one stream)
 * WIDE_WEIGHT_ROWS, so that enough independent accumulators hide the FMA latency, and for one input row
 * SINGLE_WEIGHT_ROWS. */
#define WEIGHT_ROWS 2
#define SINGLE_WEIGHT_ROWS 4
#ifdef __AVX512F__
#define WIDE_WEIGHT_ROWS 4
#else
/* With AVX2's 16 vector registers, 4 rows' dequantized blocks spill (and batch 8 ran 15 % slower). */
#define WIDE_WEIGHT_ROWS 2
#endif
#define MAX_WEIGHT_ROWS 4 /* the largest of the three */
#define WIDE_MAX_ROWS 2
/* A tile of one input row keeps that row's block in registers and multiplies each weight row's block as soon
 * as it is dequantized, so only one weight block is live at a time and four weight rows fit AVX2's 16
 * registers (the order of every sum is unchanged). On an AMD EPYC Zen 3, one thread, 1 x 576 by 576 x 1536:
 * 1.16x the speed of two weight rows dequantized whole before their multiply-adds. Left to AVX2: AVX-512's
 * tiles of four rows already fit its 32 registers, and no AVX-512 CPU was at hand to measure the change. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define SINGLE_ROW_INTERLEAVED 1
#else
#define SINGLE_ROW_INTERLEAVED 0
#endif
/* Software prefetch distance along a weight row's blocks, for tiles of at most WIDE_MAX_ROWS input rows (larger
 * ones spend more time computing per byte and gained nothing): a batch-1 matvec streams the weights faster than
 * the hardware prefetcher alone ramps up over rows only a few hundred bytes long (measured here: 1.9x the
 * layer matvecs' speed at 2,048 bytes; 256 and 1,024 gained less). Prefetching past a tensor's end is
 * harmless (prefetches never fault). */
#define PREFETCH_BYTES 2048
/* A batch's block matmul dequantizes each weight row once for all its row tiles when those rows and all the
 * input rows fit in L1 (48 KiB a core here; 32 on older CPUs, which then read some from L2): SmolLM2's
 * 576-wide rows at batch 16 do. With wider input rows, read from L2 for every tile, the buffer only added
 * traffic at two row tiles (its down projection, 1,536 wide, at batch 16 with AVX-512: 0.8x the speed on an
 * Intel Xeon, 0.95x on an AMD EPYC); from WIDE_BUFFER_TILES tiles on, it saves more dequantizing than it
 * costs (batch 16 in AVX2's 4-row tiles on that AMD EPYC: the down projection 1.3x as fast). */
#define BUFFER_BYTES (48 << 10)
#define WIDE_BUFFER_TILES 4

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
/* Unaligned view for loads; a memcpy into a vector made gcc assemble bytes through scalar registers. */
typedef float vf_u __attribute__((vector_size(LANES * 4), aligned(1)));

static inline vf load_vf(const float *p) { return *(const vf_u *)p; }

/* Sum of the lanes as a tree of halves (gcc compiles a plain loop into dependent scalar adds). */
static inline float hsum(vf v) {
    typedef float f32x4 __attribute__((vector_size(16)));
#if LANES == 16
    typedef float f32x8 __attribute__((vector_size(32)));
    const f32x8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                       __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const vf half = v;
#endif
    const f32x4 quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) +
                          __builtin_shufflevector(half, half, 4, 5, 6, 7);
    const f32x4 eighth = quarter + __builtin_shufflevector(quarter, quarter, 2, 3, 0, 1);
    return eighth[0] + eighth[1];
}

/* Lane j of the result is the sum of the lanes of acc[j]: LANES horizontal sums as one tree of pairwise folds
 * (two shuffles and an add each, LANES - 1 in all) rather than a separate reduction of every vector. */
static inline vf sum_each(const vf acc[LANES]) {
#if LANES == 16
    vf c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                       22, 23) +
               __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                       29, 30, 31);
    for (int i = 0; i < 4; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                       29) +
               __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vf c[4], d[2];
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

/* One Q4_1 block as floats in element order: out[v] holds elements v * LANES ... (v + 1) * LANES - 1.
 * Elements 0-15 are the low nibbles of the 16 bytes, 16-31 the high nibbles. */
static inline void q4_1_block(const uint8_t *packed, float d, float mn, vf out[VECTORS_PER_BLOCK]) {
#if defined(__AVX512F__)
    /* The 16 values a nibble can stand for, scale * q + min (one rounding, as the FMA of the other paths:
     * scale * q is exact in fp32), then each element looked up by its nibble: vpermps reads only the low four
     * bits of each index, so the bytes need no masking and the high nibbles only a shift. Three vector
     * operations fewer per block than converting every nibble to float, the same values. */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(mn));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)packed));
    out[0] = (vf)_mm512_permutexvar_ps(bytes, table);
    out[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
#elif defined(__AVX2__)
    /* The 16 bytes in both halves of a register; one in-lane byte shuffle puts bytes 0-7 (the other bytes
     * 8-15) each in the low byte of a 32-bit lane, zeroing the rest, and a mask or a shift then leaves the
     * low or the high nibbles as 32-bit integers. Two shuffles, two masks and two shifts a block where
     * widening each 8 nibbles took a shuffle of its own and the halves two more: on an AMD EPYC Zen 3 the
     * batch-1 matvec took 0.82x the time, the same values. */
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)packed));
    const __m256i first = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 4, -1, -1, -1, 5,
                                           -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i second = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1, 12, -1, -1,
                                            -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
    const __m256i low = _mm256_shuffle_epi8(bytes, first), high = _mm256_shuffle_epi8(bytes, second);
    const __m256i mask = _mm256_set1_epi32(0x0F);
    out[0] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(low, mask)) * d + mn;
    out[1] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(high, mask)) * d + mn;
    out[2] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(low, 4)) * d + mn;
    out[3] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(high, 4)) * d + mn;
#else
    float values[BLOCK];
    for (int j = 0; j < 16; j++) {
        values[j] = (float)(packed[j] & 0x0F) * d + mn;
        values[j + 16] = (float)(packed[j] >> 4) * d + mn;
    }
    for (int v = 0; v < VECTORS_PER_BLOCK; v++) out[v] = load_vf(values + v * LANES);
#endif
}

/* One Q8_0 block as floats in element order. */
static inline void q8_0_block(const int8_t *q, float d, vf out[VECTORS_PER_BLOCK]) {
#if defined(__AVX512F__)
    for (int v = 0; v < 2; v++)
        out[v] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * v)))) * d;
#elif defined(__AVX2__)
    for (int v = 0; v < 4; v++)
        out[v] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * v)))) * d;
#else
    float values[BLOCK];
    for (int j = 0; j < BLOCK; j++) values[j] = (float)q[j] * d;
    for (int v = 0; v < VECTORS_PER_BLOCK; v++) out[v] = load_vf(values + v * LANES);
#endif
}

/* One Q6_K-form block as floats in element order: int8 q, elements 0-15 scaled by s[0], 16-31 by s[1]. */
static inline void q6_k_block(const int8_t *q, const float *s, vf out[VECTORS_PER_BLOCK]) {
#if defined(__AVX512F__)
    for (int v = 0; v < 2; v++)
        out[v] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * v)))) * s[v];
#elif defined(__AVX2__)
    for (int v = 0; v < 4; v++)
        out[v] =
            (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * v)))) * s[v / 2];
#else
    float values[BLOCK];
    for (int j = 0; j < BLOCK; j++) values[j] = (float)q[j] * s[j / 16];
    for (int v = 0; v < VECTORS_PER_BLOCK; v++) out[v] = load_vf(values + v * LANES);
#endif
}

/* Keeps a loaded input vector in a register for all the weight rows of a tile. Left alone, gcc folds the load
 * into every multiply-add that uses it (one load per weight row instead of one), and the tiles were bound
 * by loads: batch 16, SmolLM2's shapes, 2 threads on an AMD EPYC, 1.26x (AVX2) and 1.44x (AVX-512) the
 * speed with it, the same sums. An empty asm statement that claims to change the value forces the load
 * (x86 vector registers; other CPUs are left to the compiler). */
#if defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__AVX2__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

/* The tiles below multiply W weight rows by R input rows, W and R compile-time constants after inlining so
 * the W * R accumulators stay in registers. Each block is dequantized once per tile (w = scale * q + min, as
 * the dense weights hold it) and every input-row load feeds W multiply-adds. The accumulator arrays are
 * sized for the largest R any CPU uses; the entries a tile does not use are never touched. */
#define TILE_BODY(PREFETCH, DEQUANT)                                                          \
    vf acc[MAX_WEIGHT_ROWS][8] = {{{0}}};                                                     \
    for (int64_t b = 0; b < blocks; b++) {                                                    \
        vf wv[MAX_WEIGHT_ROWS][VECTORS_PER_BLOCK];                                            \
        if (R == 1 && SINGLE_ROW_INTERLEAVED) {                                               \
            vf xv[VECTORS_PER_BLOCK];                                                         \
            for (int v = 0; v < VECTORS_PER_BLOCK; v++) {                                     \
                xv[v] = load_vf(x + b * BLOCK + v * LANES);                                   \
                IN_REGISTER(xv[v]);                                                           \
            }                                                                                 \
            for (int w = 0; w < W; w++) {                                                     \
                PREFETCH;                                                                     \
                DEQUANT;                                                                      \
                for (int v = 0; v < VECTORS_PER_BLOCK; v++) acc[w][0] += wv[w][v] * xv[v];   \
            }                                                                                 \
            continue;                                                                         \
        }                                                                                     \
        for (int w = 0; w < W; w++) {                                                         \
            if (R <= WIDE_MAX_ROWS) PREFETCH;                                                 \
            DEQUANT;                                                                          \
        }                                                                                     \
        for (int r = 0; r < R; r++)                                                           \
            for (int v = 0; v < VECTORS_PER_BLOCK; v++) {                                     \
                vf xv = load_vf(x + r * k + b * BLOCK + v * LANES);                           \
                IN_REGISTER(xv);                                                              \
                for (int w = 0; w < W; w++) acc[w][r] += wv[w][v] * xv;                       \
            }                                                                                 \
    }                                                                                         \
    TILE_STORE

/* The tile's sums into y: a tile of LANES accumulators (the batch tiles) sums them all in one shuffle tree. */
#define TILE_STORE                                                                            \
    if (W * R == LANES) {                                                                     \
        vf all[LANES];                                                                        \
        for (int w = 0; w < W; w++)                                                           \
            for (int r = 0; r < R; r++) all[w * R + r] = acc[w][r];                           \
        const vf sums = sum_each(all);                                                        \
        for (int w = 0; w < W; w++)                                                           \
            for (int r = 0; r < R; r++) y[r * n + w] = sums[w * R + r];                       \
    } else {                                                                                  \
        for (int w = 0; w < W; w++)                                                           \
            for (int r = 0; r < R; r++) y[r * n + w] = hsum(acc[w][r]);                       \
    }

static inline __attribute__((always_inline)) void q4_1_tile(const uint8_t *qs, const float *scale, const float *min,
                                                            int64_t blocks, const float *x, int64_t k, const int W,
                                                            const int R, float *y, int64_t n) {
    TILE_BODY(__builtin_prefetch(qs + (w * blocks + b) * 16 + PREFETCH_BYTES),
              q4_1_block(qs + (w * blocks + b) * 16, scale[w * blocks + b], min[w * blocks + b], wv[w]))
}

static inline __attribute__((always_inline)) void q8_0_tile(const int8_t *qs, const float *scale, int64_t blocks,
                                                            const float *x, int64_t k, const int W, const int R,
                                                            float *y, int64_t n) {
    TILE_BODY(__builtin_prefetch(qs + (w * blocks + b) * BLOCK + PREFETCH_BYTES),
              q8_0_block(qs + (w * blocks + b) * BLOCK, scale[w * blocks + b], wv[w]))
}

static inline __attribute__((always_inline)) void q6_k_tile(const int8_t *qs, const float *scale, int64_t blocks,
                                                            const float *x, int64_t k, const int W, const int R,
                                                            float *y, int64_t n) {
    TILE_BODY(__builtin_prefetch(qs + (w * blocks + b) * BLOCK + PREFETCH_BYTES),
              q6_k_block(qs + (w * blocks + b) * BLOCK, scale + (w * blocks + b) * 2, wv[w]))
}

/* The tile of W weight rows by R input rows from weights that `dequantize_rows` left in `weights` (rows
 * `stride` floats apart): for batches of several row tiles, which then dequantize each block once. */
static inline __attribute__((always_inline)) void buffered_tile(const float *weights, int64_t stride,
                                                                int64_t blocks, const float *x, int64_t k,
                                                                const int W, const int R, float *y, int64_t n) {
    vf acc[MAX_WEIGHT_ROWS][8] = {{{0}}};
    for (int64_t b = 0; b < blocks; b++)
        for (int v = 0; v < VECTORS_PER_BLOCK; v++) {
            vf wv[MAX_WEIGHT_ROWS];
            for (int w = 0; w < W; w++) wv[w] = load_vf(weights + w * stride + b * BLOCK + v * LANES);
            for (int r = 0; r < R; r++) {
                vf xv = load_vf(x + r * k + b * BLOCK + v * LANES);
                IN_REGISTER(xv);
                for (int w = 0; w < W; w++) acc[w][r] += wv[w] * xv;
            }
        }
    TILE_STORE
}

/* Calls CALL(W, R) with constants: W weight rows (SINGLE_WEIGHT_ROWS for one input row, WIDE_WEIGHT_ROWS for at
 * most WIDE_MAX_ROWS, else WEIGHT_ROWS; 1 for the rows left at the end) and R input rows (ROW_TILE, or the 1
 * to ROW_TILE - 1 rows left at the end). */
#define FOR_TILE_HEIGHT(W, rows, CALL)            \
    if ((rows) >= ROW_TILE) {                     \
        CALL(W, ROW_TILE);                        \
    } else {                                      \
        switch (rows) {                           \
        case 1: CALL(W, 1); break;                \
        case 2: CALL(W, 2); break;                \
        case 3: CALL(W, 3); break;                \
        case 4: CALL(W, 4); break;                \
        case 5: CALL(W, 5); break;                \
        case 6: CALL(W, 6); break;                \
        default: CALL(W, 7); break;               \
        }                                         \
    }

#define FOR_TILE(weight_rows, rows, CALL)                                      \
    if ((weight_rows) == SINGLE_WEIGHT_ROWS && (rows) == 1) {                  \
        CALL(SINGLE_WEIGHT_ROWS, 1);                                           \
    } else if ((weight_rows) == WIDE_WEIGHT_ROWS && (rows) <= WIDE_MAX_ROWS) { \
        if ((rows) == 1) CALL(WIDE_WEIGHT_ROWS, 1);                            \
        else CALL(WIDE_WEIGHT_ROWS, WIDE_MAX_ROWS);                            \
    } else if ((weight_rows) == WEIGHT_ROWS) FOR_TILE_HEIGHT(WEIGHT_ROWS, rows, CALL) \
    else FOR_TILE_HEIGHT(1, rows, CALL)

/* A projection's weight in blocks, as the fused decode layer receives it (mirrored by BlockWeightC in
 * cpu_kernels.py): kind 0 is Q4_1 (qs [n, k / 32, 16], scale and min [n, k / 32]), 1 is Q8_0 (qs
 * [n, k / 32, 32], scale [n, k / 32], min NULL), 2 is Q6_K (qs [n, k / 32, 32], scale [n, k / 16], min
 * NULL); bias [n] or NULL. A fused projection whose parts differ in kind (a Q4_K_M file's Q4_K query and key
 * beside its Q6_K value) is a chain: `next` holds the rows after these n, in its own kind. */
typedef struct block_weight {
    int64_t kind, n, k;
    const void *qs;
    const float *scale, *min, *bias;
    const struct block_weight *next;
} block_weight;

enum { KIND_Q4_1 = 0, KIND_Q8_0 = 1, KIND_Q6_K = 2 };

/* Batches of PANEL_WIDTH input rows or more (AVX2): tiles of PANEL_ROWS weight rows, dequantized into L1, by
 * PANEL_WIDTH input rows read transposed (a panel: each input element's PANEL_WIDTH values side by side), so
 * that one weight broadcast to a vector meets PANEL_VECTORS vectors of inputs: 12 accumulators (the buffered
 * tiles have 8), two vector loads and six broadcasts for twelve multiply-adds. Each sum is the other tiles'
 * to the bit (see panel_tile): summed along k in one chain instead, the tiles ran about 1.09x faster still, but
 * their error against fp64 was 4x the other tiles' (2-4x the dense fp32 matmul's) and results would change
 * with the batch size. On an AMD EPYC Zen 3, 2 threads, batch 16, every projection of a SmolLM2 decode step:
 * 33.7 ms against 35.8 with the buffered tiles (the 1,536-wide down projection 1.15x, the logits 1.12x).
 * The rows after the last whole panel take the buffered tiles: a panel padded with zero rows did more work
 * than those (batch 12: 1.2x the time). Left to AVX2 builds, as the one-row tile: no AVX-512 CPU was at hand
 * to measure it. */
#define PANEL_ROWS 6
#define PANEL_VECTORS 2
#define PANEL_WIDTH (PANEL_VECTORS * LANES)
/* Elements of k per round of panel_tile's passes: a round's weight rows (18 KiB) stay in L1 through its
 * passes, where each pass over a whole 1,536-wide row read 36 KiB from L2 (the down projection 1.09x as fast
 * with rounds). */
#define PANEL_CHUNK 768
#if defined(__AVX2__) && !defined(__AVX512F__)
#define PANELS 1
#else
#define PANELS 0
#endif

/* Floats of the transposed input panels of m rows of k: 0 where m fills no panel, or where PANEL_ROWS
 * weight rows of k do not fit matmul_part's buffer (then no panel tiles run, and none is allocated). */
static int64_t panel_floats(int64_t m, int64_t k) {
    const int fits = PANEL_ROWS * k * (int64_t)sizeof(float) <= BUFFER_BYTES;
    return PANELS && fits ? m / PANEL_WIDTH * PANEL_WIDTH * k : 0;
}

#if PANELS
/* r[j] becomes what was lane j of every r[i] (an 8 x 8 transpose in registers). */
static inline __attribute__((always_inline)) void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
        u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
        u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
        u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
    }
}
#endif

/* The whole panels of x [m, k], each [LANES][k / LANES][PANEL_WIDTH]: element i of the panel's input rows
 * side by side at [i % LANES][i / LANES], in the order panel_tile reads them. In 8 x 8 transposes (k is
 * whole blocks). */
static void transpose_panels(const float *x, int64_t m, int64_t k, float *xt) {
#if PANELS
    for (int64_t p = 0; p < m / PANEL_WIDTH; p++)
        for (int64_t c = 0; c < PANEL_WIDTH; c += 8)
            for (int64_t i = 0; i < k; i += 8) {
                const float *src = x + (p * PANEL_WIDTH + c) * k + i;
                __m256 r[8];
                for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(src + j * k);
                transpose8(r);
                float *dst = xt + (p * k + i / 8) * PANEL_WIDTH + c;
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + j * (k / 8) * PANEL_WIDTH, r[j]);
            }
#else
    (void)x, (void)m, (void)k, (void)xt;
#endif
}

/* The sum of LANES partial sums in the order hsum adds a vector's lanes. */
static inline vf lane_tree(const vf part[LANES]) {
    vf half[8];
    for (int j = 0; j < 8; j++) half[j] = LANES == 16 ? part[j] + part[j + LANES / 2] : part[j];
    const vf quarter[4] = {half[0] + half[4], half[1] + half[5], half[2] + half[6], half[3] + half[7]};
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

/* y[r, w] for W weight rows (k floats each, in `weights`) and the PANEL_WIDTH input rows of a panel (from
 * transpose_panels). Every sum is the other tiles' to the bit, so a row's result does not depend on the
 * batch around it: pass l multiplies the elements i with i % LANES == l in order (what lane l of another
 * tile's accumulator adds), carrying its sums from one round of PANEL_CHUNK elements to the next, and the
 * LANES passes' sums are added as hsum adds lanes. */
static inline __attribute__((always_inline)) void panel_tile(const float *weights, int64_t k, const float *panel,
                                                             const int W, float *y, int64_t n) {
    vf part[PANEL_ROWS][PANEL_VECTORS][LANES];
    for (int64_t first = 0; first < k / LANES; first += PANEL_CHUNK / LANES) {
        const int64_t end = first + PANEL_CHUNK / LANES < k / LANES ? first + PANEL_CHUNK / LANES : k / LANES;
        for (int l = 0; l < LANES; l++) {
            vf acc[PANEL_ROWS][PANEL_VECTORS];
            for (int w = 0; w < W; w++)
                for (int c = 0; c < PANEL_VECTORS; c++) acc[w][c] = first ? part[w][c][l] : (vf){0};
            const float *inputs = panel + l * (k / LANES) * PANEL_WIDTH;
            for (int64_t j = first; j < end; j++) {
                vf xv[PANEL_VECTORS];
                for (int c = 0; c < PANEL_VECTORS; c++) {
                    xv[c] = load_vf(inputs + j * PANEL_WIDTH + c * LANES);
                    IN_REGISTER(xv[c]);
                }
                for (int w = 0; w < W; w++) {
                    const float wv = weights[w * k + j * LANES + l];
                    for (int c = 0; c < PANEL_VECTORS; c++) acc[w][c] += wv * xv[c];
                }
            }
            for (int w = 0; w < W; w++)
                for (int c = 0; c < PANEL_VECTORS; c++) part[w][c][l] = acc[w][c];
        }
    }
    vf acc[PANEL_ROWS][PANEL_VECTORS];
    for (int w = 0; w < W; w++)
        for (int c = 0; c < PANEL_VECTORS; c++) acc[w][c] = lane_tree(part[w][c]);
#if PANELS
    /* The tile transposed in registers, then each input row's W sums written together: written a weight row
     * at a time, the 16 input rows' stores fell in one L1 set wherever n * 4 bytes is a multiple of 4 KiB
     * (SmolLM2's 3,072-row gate/up took 1.2x the time of a 3,000-row one). */
    float rows[PANEL_WIDTH][8] __attribute__((aligned(32)));
    for (int c = 0; c < PANEL_VECTORS; c++) {
        __m256 r[8];
        for (int w = 0; w < 8; w++) r[w] = w < W ? (__m256)acc[w][c] : _mm256_setzero_ps();
        transpose8(r);
        for (int l = 0; l < LANES; l++) _mm256_store_ps(rows[c * LANES + l], r[l]);
    }
    for (int r = 0; r < PANEL_WIDTH; r++)
        for (int w = 0; w < W; w++) y[r * n + w] = rows[r][w];
#else
    for (int w = 0; w < W; w++)
        for (int c = 0; c < PANEL_VECTORS; c++)
            for (int l = 0; l < LANES; l++) y[(c * LANES + l) * n + w] = acc[w][c][l];
#endif
}

#define FOR_PANEL(w, CALL)                 \
    switch (w) {                           \
    case 1: CALL(1); break;                \
    case 2: CALL(2); break;                \
    case 3: CALL(3); break;                \
    case 4: CALL(4); break;                \
    case 5: CALL(5); break;                \
    default: CALL(PANEL_ROWS); break;      \
    }

/* Weight rows [j, j + rows) as floats, row after row (k floats each), into `out`. */
static void dequantize_rows(const block_weight *w, int64_t j, int64_t rows, float *out, int64_t k) {
    const int64_t blocks = k / BLOCK;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = (j + i) * blocks + b;
            vf values[VECTORS_PER_BLOCK];
            if (w->kind == KIND_Q4_1)
                q4_1_block((const uint8_t *)w->qs + at * 16, w->scale[at], w->min[at], values);
            else if (w->kind == KIND_Q6_K)
                q6_k_block((const int8_t *)w->qs + at * BLOCK, w->scale + at * 2, values);
            else
                q8_0_block((const int8_t *)w->qs + at * BLOCK, w->scale[at], values);
            for (int v = 0; v < VECTORS_PER_BLOCK; v++) *(vf_u *)(out + i * k + b * BLOCK + v * LANES) = values[v];
        }
}

/* y[m, w->n] = x[m, k] @ W^T (+ bias) for one part of a chain, y's rows `n` floats apart. An orphaned `omp
 * for`: the calling threads of a parallel region share the weight rows, and wait for each other at its end.
 * With more input rows than one tile holds, each weight row is dequantized once, into `weights` (in L1), for
 * all the row tiles, rather than once per tile. `xt`, this thread's own panel_floats(m, k) floats or NULL,
 * holds the transposed input for the panel tiles (NULL: none). */
static void matmul_part(const block_weight *w, const float *x, int64_t m, float *y, int64_t n, float *xt) {
    const int64_t k = w->k, blocks = k / BLOCK;
    float weights[BUFFER_BYTES / sizeof(float)] __attribute__((aligned(64)));
    const int64_t row_bytes = k * (int64_t)sizeof(float);
    const int panels = xt && panel_floats(m, k) > 0;
    const int64_t whole = panels ? m / PANEL_WIDTH * PANEL_WIDTH : 0; /* the rows in whole panels */
    const int buffered = !panels && m > ROW_TILE && WEIGHT_ROWS * row_bytes <= (int64_t)sizeof(weights) &&
                         ((m + WEIGHT_ROWS) * row_bytes <= BUFFER_BYTES || m >= WIDE_BUFFER_TILES * ROW_TILE);
    const int64_t step = panels ? PANEL_ROWS
                         : m == 1 ? SINGLE_WEIGHT_ROWS
                         : m <= WIDE_MAX_ROWS ? WIDE_WEIGHT_ROWS
                                              : WEIGHT_ROWS;
    if (panels) transpose_panels(x, m, k, xt);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < w->n; row += step) {
        const int64_t weight_rows = w->n - row < step ? w->n - row : step;
        if (buffered || panels) dequantize_rows(w, row, weight_rows, weights, k);
        for (int64_t r0 = 0; r0 < whole; r0 += PANEL_WIDTH) {
#define PANEL_CALL(W) panel_tile(weights, k, xt + r0 * k, W, y + r0 * n + row, n)
            FOR_PANEL(weight_rows, PANEL_CALL)
#undef PANEL_CALL
        }
        for (int64_t r0 = whole; r0 < m; r0 += ROW_TILE) {
            /* A whole tile, or the last rows of the weight one at a time. */
            const int tile = panels ? (weight_rows % WEIGHT_ROWS ? 1 : WEIGHT_ROWS)
                                    : weight_rows == step ? (int)step
                                                          : 1;
            for (int64_t j = row; (buffered || panels) && j < row + weight_rows; j += tile) {
#define BUFFERED_CALL(W, R) buffered_tile(weights + (j - row) * k, k, blocks, x + r0 * k, k, W, R, y + r0 * n + j, n)
                FOR_TILE(tile, m - r0, BUFFERED_CALL)
#undef BUFFERED_CALL
            }
            for (int64_t j = row; !buffered && !panels && j < row + weight_rows; j += tile) {
                if (w->kind == KIND_Q4_1) {
#define Q4_CALL(W, R)                                                                                      \
    q4_1_tile((const uint8_t *)w->qs + j * blocks * 16, w->scale + j * blocks, w->min + j * blocks, blocks, \
              x + r0 * k, k, W, R, y + r0 * n + j, n)
                    FOR_TILE(tile, m - r0, Q4_CALL)
#undef Q4_CALL
                } else if (w->kind == KIND_Q6_K) {
#define Q6_CALL(W, R)                                                                                          \
    q6_k_tile((const int8_t *)w->qs + j * blocks * BLOCK, w->scale + j * blocks * 2, blocks, x + r0 * k, k, W, R, \
              y + r0 * n + j, n)
                    FOR_TILE(tile, m - r0, Q6_CALL)
#undef Q6_CALL
                } else {
#define Q8_CALL(W, R)                                                                                      \
    q8_0_tile((const int8_t *)w->qs + j * blocks * BLOCK, w->scale + j * blocks, blocks, x + r0 * k, k, W, R, \
              y + r0 * n + j, n)
                    FOR_TILE(tile, m - r0, Q8_CALL)
#undef Q8_CALL
                }
            }
        }
        for (int64_t r = 0; w->bias && r < m; r++)
            for (int64_t j = row; j < row + weight_rows; j++) y[r * n + j] += w->bias[j];
    }
}

/* y[m, n] = x[m, k] @ W^T (+ bias), n the rows of all the parts of w's chain. */
static void matmul_rows(const block_weight *w, const float *x, int64_t m, float *y, float *xt) {
    int64_t n = 0;
    for (const block_weight *part = w; part; part = part->next) n += part->n;
    for (int64_t offset = 0; w; offset += w->n, w = w->next) matmul_part(w, x, m, y + offset, n, xt);
}

/* matmul_rows by a team of `threads` threads, each with its own input panels (none, the other tiles doing
 * their rows, if they cannot be allocated). */
static void matmul_team(const block_weight *w, const float *x, int64_t m, float *y, int threads) {
    const int64_t each = panel_floats(m, w->k);
    float *xt = each ? aligned_alloc(64, sizeof(float) * (size_t)(threads * each)) : NULL;
#pragma omp parallel num_threads(threads)
    matmul_rows(w, x, m, y, xt ? xt + omp_get_thread_num() * each : NULL);
    free(xt);
}

/* y[m, n] = x[m, k] @ W^T for W [n, k] in Q4_1 blocks (qs [n, k / 32, 16], scale and min [n, k / 32]). */
void q4_1_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *scale, const float *min,
                 int64_t n, float *y, int threads) {
    const block_weight w = {KIND_Q4_1, n, k, qs, scale, min, NULL, NULL};
    matmul_team(&w, x, m, y, threads);
}

/* y[m, n] = x[m, k] @ W^T for W [n, k] in Q8_0 blocks (qs [n, k / 32, 32], scale [n, k / 32]). */
void q8_0_matmul(const float *x, int64_t m, int64_t k, const int8_t *qs, const float *scale, int64_t n,
                 float *y, int threads) {
    const block_weight w = {KIND_Q8_0, n, k, qs, scale, NULL, NULL, NULL};
    matmul_team(&w, x, m, y, threads);
}

/* y[m, n] = x[m, k] @ W^T for W [n, k] in Q6_K-form blocks (qs [n, k / 32, 32], scale [n, k / 16]). */
void q6_k_matmul(const float *x, int64_t m, int64_t k, const int8_t *qs, const float *scale, int64_t n,
                 float *y, int threads) {
    const block_weight w = {KIND_Q6_K, n, k, qs, scale, NULL, NULL, NULL};
    matmul_team(&w, x, m, y, threads);
}

/* Scaled scores of one query head against LANES keys (rows[i] + offset, dim floats each), DV = dim / LANES
 * vectors: a constant for the common head sizes, so the query stays in registers. */
static inline __attribute__((always_inline)) vf score_tile(const float *qh, const float *const rows[LANES],
                                                           int64_t offset, const int64_t DV, float scale) {
    vf acc[LANES];
    for (int i = 0; i < LANES; i++) {
        vf a = {0};
        for (int64_t v = 0; v < DV; v++) a += load_vf(qh + v * LANES) * load_vf(rows[i] + offset + v * LANES);
        acc[i] = a;
    }
    return sum_each(acc) * scale;
}

/* Query heads per tile of the weighted sum of values, and vectors of their head dimension: the H x DV
 * accumulators stay in registers while the tile's value rows stream past. */
#ifdef __AVX512F__
#define VALUE_HEADS 4
#else
#define VALUE_HEADS 3
#endif
#define VALUE_VECTORS 4

/* Memory the attention reads next, requested a few cache lines at a time while it computes on what it has:
 * `rows` rows (`rows[i]` each, or `base + i * stride` where rows is NULL) of which lines [0, lines) from
 * `offset` floats on, the next one at (row, line). Requesting a whole tile or block at once left the loads
 * behind those requests waiting (batch 16, AVX2: the attention took 1.3x as long as with its requests
 * spread over the work; without any, 1.8x). */
typedef struct {
    const float *const *rows;
    const float *base;
    int64_t stride, count, offset, lines, row, line;
} prefetch_cursor;

/* Requests the cursor's next `n` lines (fewer at its end). */
static inline void prefetch_next(prefetch_cursor *c, int64_t n) {
    for (; n > 0 && c->row < c->count; n--) {
        const float *row = c->rows ? c->rows[c->row] : c->base + c->row * c->stride;
        __builtin_prefetch(row + c->offset + c->line * LINE_FLOATS);
        if (++c->line == c->lines) c->line = 0, c->row++;
    }
}

/* out[h][0 .. DV * LANES) += sum over the tokens i of p[h * p_stride + i] * row i (`tokens` rows, `stride`
 * floats apart), for H heads (out rows `dim` apart) sharing those rows; meanwhile `per_row` lines of `later`
 * are requested with each row. */
static inline __attribute__((always_inline)) void value_tile(const float *rows, int64_t stride, int64_t tokens,
                                                             const float *p, int64_t p_stride, float *out,
                                                             int64_t dim, const int H, const int DV,
                                                             prefetch_cursor *later, int64_t per_row) {
    vf acc[VALUE_HEADS][VALUE_VECTORS];
    for (int h = 0; h < H; h++)
        for (int v = 0; v < DV; v++) acc[h][v] = load_vf(out + h * dim + v * LANES);
    for (int64_t i = 0; i < tokens; i++) {
        prefetch_next(later, per_row);
        for (int v = 0; v < DV; v++) {
            const vf value = load_vf(rows + i * stride + v * LANES);
            for (int h = 0; h < H; h++) acc[h][v] += p[h * p_stride + i] * value;
        }
    }
    for (int h = 0; h < H; h++)
        for (int v = 0; v < DV; v++) *(vf_u *)(out + h * dim + v * LANES) = acc[h][v];
}

/* Calls CALL(H, DV) with constants for h heads (1 to VALUE_HEADS) and dv vectors (1 to VALUE_VECTORS). */
#define FOR_DV(H, dv, CALL)            \
    switch (dv) {                      \
    case 1: CALL(H, 1); break;         \
    case 2: CALL(H, 2); break;         \
    case 3: CALL(H, 3); break;         \
    default: CALL(H, VALUE_VECTORS);   \
    }
#define FOR_VALUE_TILE(h, dv, CALL)                   \
    if ((h) == VALUE_HEADS) FOR_DV(VALUE_HEADS, dv, CALL) \
    else if ((h) == 1) FOR_DV(1, dv, CALL)            \
    else if ((h) == 2) FOR_DV(2, dv, CALL)            \
    else FOR_DV(3, dv, CALL)

/* Heads [first, last) of one sequence's query against its paged context (ctx tokens in the blocks of
 * `table`). Scores come LANES keys at a time for each head (the keys of a tile stay in L1 for the heads that
 * share them), the weighted sum of values one cache block at a time for the heads sharing a K/V head. Head
 * sizes that are not whole vectors take the plain loops. With `stats`, the context is one part of a longer
 * one: out holds each head's sum of values weighted by exp(score - peak), unnormalized, and stats[2 * i]
 * and stats[2 * i + 1] that peak and the weights' total for head first + i. */
static void attend_heads(const float *q, int64_t first, int64_t last, int64_t group, int64_t dim,
                         const float *k_cache, const float *v_cache, int64_t block_size, int64_t token_stride,
                         const int64_t *table, int64_t ctx, float scale, float *out, float *stats) {
    const int64_t block_stride = block_size * token_stride, count = last - first;
    /* What of a token's row these heads read: the floats of their K/V heads. */
    const int64_t span_offset = (first / group) * dim;
    const int64_t span_lines = (((last - 1) / group + 1) * dim - span_offset + LINE_FLOATS - 1) / LINE_FLOATS;
    const int vectors = dim % LANES == 0;
    float *scores = malloc(sizeof(float) * (size_t)(count * ctx));
    for (int64_t t0 = 0; vectors && t0 < ctx; t0 += LANES) {
        const int64_t tokens = ctx - t0 < LANES ? ctx - t0 : LANES;
        const float *rows[LANES];
        for (int64_t i = 0; i < LANES; i++) {
            const int64_t t = t0 + (i < tokens ? i : tokens - 1); /* a short last tile repeats its last key */
            rows[i] = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        }
        /* The next tile's keys (the K/V heads of these query heads), a share with each head's scores: a
         * sequence's blocks lie anywhere in the cache, so the hardware prefetcher loses the stream at every
         * block edge. */
        const float *next[LANES];
        prefetch_cursor keys = {next, NULL, 0, 0, span_offset, span_lines, 0, 0};
        for (int64_t t = t0 + LANES; t < t0 + 2 * LANES && t < ctx; t++)
            next[keys.count++] = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        const int64_t share = (keys.count * span_lines + count - 1) / count;
        for (int64_t h = first; h < last; h++) {
            prefetch_next(&keys, share);
            const float *qh = q + h * dim;
            const int64_t offset = (h / group) * dim;
            const vf dots = dim == 4 * LANES   ? score_tile(qh, rows, offset, 4, scale)
                            : dim == 8 * LANES ? score_tile(qh, rows, offset, 8, scale)
                                               : score_tile(qh, rows, offset, dim / LANES, scale);
            float *dst = scores + (h - first) * ctx + t0;
            if (tokens == LANES) *(vf_u *)dst = dots;
            else
                for (int64_t i = 0; i < tokens; i++) dst[i] = dots[i];
        }
    }
    for (int64_t t = 0; !vectors && t < ctx; t++) {
        const float *row = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t h = first; h < last; h++) {
            const float *qh = q + h * dim, *key = row + (h / group) * dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < dim; i++) dot += qh[i] * key[i];
            scores[(h - first) * ctx + t] = dot * scale;
        }
    }
    for (int64_t h = 0; h < count; h++) {
        float *row = scores + h * ctx, peak = -INFINITY, total = 0.0f;
        /* A vector max: as a plain loop gcc kept `peak` on the stack under AVX-512's register pressure, a
         * store and a reload per score (the attention took 1.27x as long, one thread, batch 16, AMD EPYC). */
#pragma omp simd reduction(max : peak)
        for (int64_t t = 0; t < ctx; t++) peak = row[t] > peak ? row[t] : peak;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < ctx; t++) {
            row[t] = expf(row[t] - peak);
            total += row[t];
        }
        if (stats) {
            stats[2 * h] = peak, stats[2 * h + 1] = total;
            continue;
        }
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < ctx; t++) row[t] *= inv;
    }
    memset(out + first * dim, 0, sizeof(float) * (size_t)(count * dim));
    /* The passes over a block: one for every tile of heads sharing a K/V head and VALUE_VECTORS of its vectors.
     * The next block's values are requested a share with each pass, a few lines with each row. */
    int64_t passes = 0;
    for (int64_t h = first, heads; h < last; h += heads) {
        const int64_t stop = (h / group + 1) * group < last ? (h / group + 1) * group : last;
        heads = stop - h < VALUE_HEADS ? stop - h : VALUE_HEADS;
        passes += (dim + VALUE_VECTORS * LANES - 1) / (VALUE_VECTORS * LANES);
    }
    for (int64_t t0 = 0; vectors && t0 < ctx; t0 += block_size) {
        const int64_t tokens = ctx - t0 < block_size ? ctx - t0 : block_size;
        const float *block = v_cache + table[t0 / block_size] * block_stride;
        const int64_t next_tokens = ctx - t0 - block_size < block_size ? ctx - t0 - block_size : block_size;
        prefetch_cursor values = {NULL, next_tokens > 0 ? v_cache + table[t0 / block_size + 1] * block_stride : NULL,
                                  token_stride, next_tokens > 0 ? next_tokens : 0, span_offset, span_lines, 0, 0};
        const int64_t per_row = (values.count * span_lines + passes * tokens - 1) / (passes * tokens);
        for (int64_t h = first, heads; h < last; h += heads) {
            /* The next heads that share h's K/V head, at most VALUE_HEADS of them. */
            const int64_t kv = h / group, stop = (kv + 1) * group < last ? (kv + 1) * group : last;
            heads = stop - h < VALUE_HEADS ? stop - h : VALUE_HEADS;
            for (int64_t d0 = 0; d0 < dim; d0 += VALUE_VECTORS * LANES) {
                const int64_t dv = (dim - d0) / LANES;
#define VALUE_CALL(H, DV)                                                                                      \
    value_tile(block + kv * dim + d0, token_stride, tokens, scores + (h - first) * ctx + t0, ctx, out + h * dim + d0, \
               dim, H, DV, &values, per_row)
                FOR_VALUE_TILE(heads, dv, VALUE_CALL)
#undef VALUE_CALL
            }
        }
    }
    for (int64_t t = 0; !vectors && t < ctx; t++) {
        const float *row = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int64_t h = first; h < last; h++) {
            const float p = scores[(h - first) * ctx + t], *value = row + (h / group) * dim;
            float *oh = out + h * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) oh[i] += p * value[i];
        }
    }
    free(scores);
}

/* 0 when every block each context uses lies in its table and in the cache, else -1. */
static int check_tables(int64_t seqs, int64_t num_blocks, int64_t block_size, const int64_t *block_tables,
                        int64_t width, const int64_t *context_lens) {
    for (int64_t s = 0; s < seqs; s++) {
        const int64_t ctx = context_lens[s], used = (ctx + block_size - 1) / block_size;
        if (ctx < 1 || used > width) return -1;
        for (int64_t i = 0; i < used; i++)
            if (block_tables[s * width + i] < 0 || block_tables[s * width + i] >= num_blocks) return -1;
    }
    return 0;
}

/* Floats of attend_tasks' `partial` buffer for `threads` threads: every part of every sequence's context when
 * the sequences are few (fewer than 2 * threads sequences in at most 4 * threads parts). */
static int64_t partial_floats(int64_t heads, int64_t dim, int threads) {
    return (4 * threads * heads * (dim + 2) + LINE_FLOATS - 1) / LINE_FLOATS * LINE_FLOATS; /* whole cache lines */
}

/* The attention of paged_decode_attention as an orphaned `omp for` over its tasks. With enough sequences to
 * share out, a task is a whole sequence (its K/V rows stream contiguously). With few, a task is a range of
 * a sequence's context, whole cache blocks, for all its heads: every thread gets a similar share and reads
 * each K/V row once, and the parts' sums, each relative to its own peak score, are combined after (as in
 * flash decoding). Splitting the heads instead read the K/V heads that straddle two ranges twice and left
 * one thread with more heads (SmolLM2's 9 heads, 3 K/V heads, one sequence on 2 threads: 4 and 5 heads,
 * 5/3 of the K/V read). `partial` holds partial_floats(heads, dim, threads) floats. */
static void attend_tasks(const float *q, int64_t q_stride, int64_t seqs, int64_t heads, int64_t kv_heads,
                         int64_t dim, const float *k_cache, const float *v_cache, int64_t block_size,
                         const int64_t *block_tables, int64_t width, const int64_t *context_lens, float scale,
                         float *out, float *partial, int threads) {
    const int64_t group = heads / kv_heads, token_stride = kv_heads * dim;
    const int64_t splits = seqs >= 2 * threads ? 1 : (2 * threads + seqs - 1) / seqs;
    float *sums = partial, *stats = partial + seqs * splits * heads * dim;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < seqs * splits; task++) {
        const int64_t s = task / splits, part = task % splits, ctx = context_lens[s];
        if (splits == 1) {
            attend_heads(q + s * q_stride, 0, heads, group, dim, k_cache, v_cache, block_size, token_stride,
                         block_tables + s * width, ctx, scale, out + s * heads * dim, NULL);
            continue;
        }
        const int64_t blocks = (ctx + block_size - 1) / block_size, per = (blocks + splits - 1) / splits;
        const int64_t begin = part * per * block_size, stop = begin + per * block_size, end = stop < ctx ? stop : ctx;
        float *part_stats = stats + task * heads * 2;
        if (begin >= end) { /* a short context has fewer parts: this one weighs nothing */
            for (int64_t h = 0; h < heads; h++) part_stats[2 * h] = -INFINITY, part_stats[2 * h + 1] = 0.0f;
            continue;
        }
        attend_heads(q + s * q_stride, 0, heads, group, dim, k_cache, v_cache, block_size, token_stride,
                     block_tables + s * width + begin / block_size, end - begin, scale, sums + task * heads * dim,
                     part_stats);
    }
    if (splits == 1) return;
#pragma omp for schedule(static)
    for (int64_t row = 0; row < seqs * heads; row++) {
        const int64_t s = row / heads, h = row % heads;
        float peak = -INFINITY, total = 0.0f, weights[splits];
        for (int64_t part = 0; part < splits; part++) {
            const float p = stats[((s * splits + part) * heads + h) * 2];
            peak = p > peak ? p : peak;
        }
        for (int64_t part = 0; part < splits; part++) {
            const float *st = stats + ((s * splits + part) * heads + h) * 2;
            weights[part] = st[1] > 0.0f ? expf(st[0] - peak) : 0.0f;
            total += weights[part] * st[1];
        }
        float *o = out + row * dim;
        for (int64_t i = 0; i < dim; i++) {
            float sum = 0.0f;
            for (int64_t part = 0; part < splits; part++)
                if (weights[part] > 0.0f) /* an empty part's sums were never written */
                    sum += weights[part] * sums[((s * splits + part) * heads + h) * dim + i];
            o[i] = sum / total;
        }
    }
}

/* One query token per sequence attending to its paged context, grouped-query heads reading shared K/V.
 *
 * q [seqs, heads, dim]; k_cache, v_cache [blocks, block_size, kv_heads, dim]; block_tables [seqs, width];
 * context_lens [seqs]; out [seqs, heads, dim]. Returns -1, having read nothing, for a table or length
 * outside the cache, -2 when out of memory.
 */
int paged_decode_attention(const float *q, int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                           const float *k_cache, const float *v_cache, int64_t num_blocks, int64_t block_size,
                           const int64_t *block_tables, int64_t width, const int64_t *context_lens, float scale,
                           float *out, int threads) {
    if (check_tables(seqs, num_blocks, block_size, block_tables, width, context_lens) != 0) return -1;
    float *partial = malloc(sizeof(float) * (size_t)partial_floats(heads, dim, threads));
    if (!partial) return -2;
#pragma omp parallel num_threads(threads)
    attend_tasks(q, heads * dim, seqs, heads, kv_heads, dim, k_cache, v_cache, block_size, block_tables, width, context_lens,
                 scale, out, partial, threads);
    free(partial);
    return 0;
}

/* One decoder layer's weights for decode_layer (mirrored by DecodeLayerWeightsC in cpu_kernels.py). */
typedef struct {
    block_weight qkv, wo, w13, w2;
    const float *attn_norm, *ffn_norm;
    double eps;
    int64_t dim, heads, kv_heads, head_dim, hidden;
} decode_layer_weights;

/* y = weight * (x * rsqrt(mean(x^2) + eps)) for all m rows, as model.RMSNorm computes it. Every thread of
 * decode_layer computes it whole into its own buffer: a few rows cost less than a barrier waiting for them. */
static void rms_norm_rows(const float *x, int64_t m, int64_t dim, const float *weight, float eps, float *y) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * dim;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; i++) squares += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] = weight[i] * (xr[i] * inv);
    }
}

/* Rotate-half RoPE of one head in place: pairs (i, i + dim / 2), cos and sin [dim] of its position. */
static inline void rope_head(float *h, const float *cos, const float *sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = h[i], b = h[i + half];
        h[i] = a * cos[i] + -b * sin[i];
        h[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* Scratch of a decode step for m rows (one parallel region's buffers): shared by the region's threads, the qkv
 * rows, the attention output, the attention and FFN projections' outputs and gate/up; each thread's own, the
 * normed input, the residual and SiLU(gate) * up, which every thread computes whole (they are a few rows, and
 * so no barrier waits for them: each `omp for` here ends in one, the matmuls' included). */
typedef struct {
    float *qkv, *att, *proj, *ffn_out, *gate_up, *partial, *owned;
    int64_t own; /* floats of each thread's own part */
} layer_scratch;

/* Floats of a thread's transposed input panels for any of a layer's matmuls of m rows (those whose k
 * takes panels: the input's dim, the attention's q_dim, the FFN's hidden). */
static int64_t layer_panel_floats(const decode_layer_weights *lw, int64_t m) {
    const int64_t sizes[3] = {panel_floats(m, lw->dim), panel_floats(m, lw->heads * lw->head_dim),
                              panel_floats(m, lw->hidden)};
    int64_t most = 0;
    for (int i = 0; i < 3; i++) most = sizes[i] > most ? sizes[i] : most;
    return most;
}

/* Cache-line aligned, as are the parts for the usual model sizes (multiples of 16 floats): a vector load
 * across two lines costs two. `extra` floats more follow the buffers (the model step's hidden rows). Returns
 * -2 when out of memory, else 0; the caller frees `qkv`. */
static int layer_scratch_alloc(const decode_layer_weights *lw, int64_t m, int threads, int64_t extra,
                               layer_scratch *s) {
    const int64_t dim = lw->dim, q_dim = lw->heads * lw->head_dim, kv_dim = lw->kv_heads * lw->head_dim;
    const int64_t qkv_dim = q_dim + 2 * kv_dim, hidden = lw->hidden;
    const int64_t partial = partial_floats(lw->heads, lw->head_dim, threads);
    const int64_t shared = m * (qkv_dim + q_dim + 2 * dim + 2 * hidden) + partial;
    s->own = m * (2 * dim + hidden) + layer_panel_floats(lw, m);
    s->qkv = aligned_alloc(64, (sizeof(float) * (size_t)(shared + threads * s->own + extra) + 63) / 64 * 64);
    if (!s->qkv) return -2;
    s->att = s->qkv + m * qkv_dim;
    s->proj = s->att + m * q_dim;
    s->ffn_out = s->proj + m * dim;
    s->gate_up = s->ffn_out + m * dim;
    s->partial = s->gate_up + m * 2 * hidden;
    s->owned = s->partial + partial;
    return 0;
}

/* 0 when every slot lies in the cache and the tables and lengths pass check_tables, else -1. */
static int check_step(int64_t m, int64_t num_blocks, int64_t block_size, const int64_t *slots,
                      const int64_t *block_tables, int64_t width, const int64_t *context_lens) {
    if (check_tables(m, num_blocks, block_size, block_tables, width, context_lens) != 0) return -1;
    for (int64_t r = 0; r < m; r++)
        if (slots[r] < 0 || slots[r] >= num_blocks * block_size) return -1;
    return 0;
}

/* One decoder layer for m decode rows, called by every thread of a parallel region: RMSNorm, the qkv
 * projection, RoPE, the K/V rows written to the cache at `slots`, paged attention, the output projection and
 * residual, RMSNorm, gate/up, SiLU(gate) * up, the down projection and residual. Ends in a barrier, with
 * `out` complete. */
static void layer_step(const decode_layer_weights *lw, const float *x, int64_t m, float *out, const float *cos,
                       const float *sin, float *k_cache, float *v_cache, int64_t block_size, const int64_t *slots,
                       const int64_t *block_tables, int64_t width, const int64_t *context_lens,
                       const layer_scratch *s, int threads) {
    const int64_t dim = lw->dim, heads = lw->heads, kv_heads = lw->kv_heads, hd = lw->head_dim;
    const int64_t q_dim = heads * hd, kv_dim = kv_heads * hd, qkv_dim = q_dim + 2 * kv_dim, hidden = lw->hidden;
    const float eps = (float)lw->eps, scale = 1.0f / sqrtf((float)hd);
    float *qkv = s->qkv, *normed = s->owned + omp_get_thread_num() * s->own, *residual = normed + m * dim;
    float *act = residual + m * dim, *xt = layer_panel_floats(lw, m) ? act + m * hidden : NULL;
    rms_norm_rows(x, m, dim, lw->attn_norm, eps, normed);
    matmul_rows(&lw->qkv, normed, m, qkv, xt);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        float *row = qkv + r * qkv_dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) rope_head(row + h * hd, cos + r * hd, sin + r * hd, hd);
        memcpy(k_cache + slots[r] * kv_dim, row + q_dim, sizeof(float) * (size_t)kv_dim);
        memcpy(v_cache + slots[r] * kv_dim, row + q_dim + kv_dim, sizeof(float) * (size_t)kv_dim);
    }
    attend_tasks(qkv, qkv_dim, m, heads, kv_heads, hd, k_cache, v_cache, block_size, block_tables, width,
                 context_lens, scale, s->att, s->partial, threads);
    matmul_rows(&lw->wo, s->att, m, s->proj, xt);
    /* The residual: this thread's share of `out` (the same share as the last loop's, both static over the
     * same range, so no other thread touches it in between), and the whole of it for its own norm. */
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < m * dim; i++) out[i] = x[i] + s->proj[i];
    for (int64_t i = 0; i < m * dim; i++) residual[i] = x[i] + s->proj[i];
    rms_norm_rows(residual, m, dim, lw->ffn_norm, eps, normed);
    matmul_rows(&lw->w13, normed, m, s->gate_up, xt);
    for (int64_t r = 0; r < m; r++) {
        const float *gate = s->gate_up + r * 2 * hidden, *up = gate + hidden;
        float *a = act + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) a[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    matmul_rows(&lw->w2, act, m, s->ffn_out, xt);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m * dim; i++) out[i] += s->ffn_out[i];
}

/* One decoder layer for m decode rows (one new token per sequence) in one parallel region: layer_step, the
 * same arithmetic as model.Block with the block matmuls and paged_decode_attention, in one call instead of
 * some fifty PyTorch operations and five kernel calls. x, out [m, dim]; cos, sin [m, head_dim]; caches as in
 * paged_decode_attention; slots [m]. Returns -1, having changed nothing, for a slot, table or length outside
 * the cache, -2 when out of memory. */
int decode_layer(const decode_layer_weights *lw, const float *x, int64_t m, float *out, const float *cos,
                 const float *sin, float *k_cache, float *v_cache, int64_t num_blocks, int64_t block_size,
                 const int64_t *slots, const int64_t *block_tables, int64_t width, const int64_t *context_lens,
                 int threads) {
    if (check_step(m, num_blocks, block_size, slots, block_tables, width, context_lens) != 0) return -1;
    layer_scratch s;
    if (layer_scratch_alloc(lw, m, threads, 0, &s) != 0) return -2;
#pragma omp parallel num_threads(threads)
    layer_step(lw, x, m, out, cos, sin, k_cache, v_cache, block_size, slots, block_tables, width, context_lens, &s,
               threads);
    free(s.qkv);
    return 0;
}

/* A whole model's decode step for decode_model (mirrored by DecodeModelWeightsC in cpu_kernels.py): its
 * layers in order (each as decode_layer reads it, all of one shape), the final norm and the logits
 * projection. */
typedef struct {
    const decode_layer_weights *const *layers;
    int64_t num_layers;
    const float *norm;
    double eps;
    block_weight head;
} decode_model_weights;

/* The decode step of every layer, the final RMSNorm and the logits projection for m rows, in one parallel
 * region: per step one call, one scratch allocation and one team of threads instead of one of each per layer
 * and two more Python calls (at batch 1 those cost a tenth of the step). x [m, dim] the embedded tokens;
 * logits [m, vocab]; kv_cache [layers, 2, num_blocks, block_size, kv_heads, head_dim] (K then V of each
 * layer); the rest as in decode_layer. Returns -1, having changed nothing, for a slot, table or length outside
 * the cache, -2 when out of memory. */
int decode_model(const decode_model_weights *mw, const float *x, int64_t m, float *logits, const float *cos,
                 const float *sin, float *kv_cache, int64_t num_blocks, int64_t block_size, const int64_t *slots,
                 const int64_t *block_tables, int64_t width, const int64_t *context_lens, int threads) {
    if (check_step(m, num_blocks, block_size, slots, block_tables, width, context_lens) != 0) return -1;
    const decode_layer_weights *first = mw->layers[0];
    const int64_t dim = first->dim, kv_dim = first->kv_heads * first->head_dim;
    const int64_t cache_stride = num_blocks * block_size * kv_dim; /* floats from a layer's K to its V */
    layer_scratch s;
    /* Two [m, dim] hidden states after the buffers: each layer reads one and writes the other. */
    if (layer_scratch_alloc(first, m, threads, 2 * m * dim, &s) != 0) return -2;
    float *hidden[2] = {s.owned + threads * s.own, s.owned + threads * s.own + m * dim};
#pragma omp parallel num_threads(threads)
    {
        const float *in = x;
        for (int64_t l = 0; l < mw->num_layers; l++) {
            float *k_cache = kv_cache + 2 * l * cache_stride;
            layer_step(mw->layers[l], in, m, hidden[l % 2], cos, sin, k_cache, k_cache + cache_stride, block_size,
                       slots, block_tables, width, context_lens, &s, threads);
            in = hidden[l % 2];
        }
        float *normed = s.owned + omp_get_thread_num() * s.own;
        rms_norm_rows(in, m, dim, mw->norm, (float)mw->eps, normed);
        float *xt = layer_panel_floats(first, m) ? normed + m * (2 * dim + first->hidden) : NULL;
        matmul_rows(&mw->head, normed, m, logits, xt);
    }
    free(s.qkv);
    return 0;
}
