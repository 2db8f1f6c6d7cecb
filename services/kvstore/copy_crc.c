// CRC32C (Castagnoli) computed while copying, in one pass over the bytes (copy_crc.py builds and loads it).
//
// The SSE4.2 crc32 instruction takes 3 cycles but can start one every cycle, so a single chain of it runs at
// a third of its speed. The loop below keeps three chains busy: a block is cut into three lanes of LANE bytes
// (what is left after the whole blocks, into three shorter lanes), each lane's CRC runs on its own, and the
// three are joined by shifting the earlier lanes' CRCs past the later lanes' bytes (a carry-less multiply by
// x^(8 * lane bytes) modulo the polynomial). Each 64 bytes of a lane are copied with two AVX2 loads and
// stores, and the same two registers are kept in an L1 scratch that the lane's chain reads as 8-byte words,
// so the CRC is of the bytes as they were stored (a source that changed during the copy shows as a mismatch,
// never as a good CRC). The next block is prefetched while this one is copied (the hardware prefetcher stops
// at every 4 KiB page). Large copies store past the cache (streaming stores): the destination is not read
// again soon, and skipping the read-for-ownership of each destination line saves a third of the memory
// traffic.

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82F63B78u  // CRC-32C, bit-reflected
#define LANE 4096         // bytes per lane (a page each: the prefetch of the next block starts 3 pages on)
#define STREAM_MIN (4u << 20)  // copies at least this large store past the cache
#define MAX_DEPTH 8            // levels of repeats a gathered range may have (ranges.MAX_REPEATS)

// a * b modulo the polynomial, both bit-reflected (bit 31 is x^0).
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) return p;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
}

// x^n modulo the polynomial.
static uint32_t xpow(uint64_t n) {
    uint32_t p = 1u << 31, square = 1u << 30;  // x^0, x^1
    while (n) {
        if (n & 1) p = multmodp(square, p);
        square = multmodp(square, square);
        n >>= 1;
    }
    return p;
}

// Shifting a CRC past k zero bytes is a multiply by x^(8k). clmul(crc, K) is crc * K * x^-1 as a 64-bit
// reflected value, and crc32 of a 64-bit word from zero multiplies by x^32 and reduces: K = x^(8k - 33).
// K for lanes of 64 * m bytes: lane_shift[m][0] shifts past one lane, lane_shift[m][1] past two. Lanes
// shorter than LANE serve a copy's last, partial block (a gathered range's pieces are often that short).
static uint32_t lane_shift[LANE / 64 + 1][2];

__attribute__((constructor)) static void init_constants(void) {
    for (uint64_t m = 1; m <= LANE / 64; m++) {
        lane_shift[m][0] = xpow(8 * 64 * m - 33);
        lane_shift[m][1] = xpow(16 * 64 * m - 33);
    }
}

static inline uint32_t shift(uint32_t crc, uint32_t k) {
    __m128i product = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)crc), _mm_cvtsi32_si128((int)k), 0);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(product));
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

// Copies whole blocks of three lanes of `lane` bytes (a multiple of 64, at most LANE); `stream` is a
// constant at each call, so each loop is specialised.
static inline uint32_t copy_blocks(uint8_t *dst, const uint8_t *src, size_t blocks, size_t lane, uint32_t crc,
                                   int stream) {
    uint32_t k1 = lane_shift[lane / 64][0], k2 = lane_shift[lane / 64][1];
    for (size_t b = 0; b < blocks; b++, dst += 3 * lane, src += 3 * lane) {
        uint64_t c0 = crc, c1 = 0, c2 = 0;
        int ahead = b + 1 < blocks;  // past the last block lie bytes the copy does not read (a gather's gaps)
        for (size_t i = 0; i < lane; i += 64) {
            // What was stored, per lane, for the CRC (read back from the store buffer or L1).
            uint64_t stored[3][8] __attribute__((aligned(32)));
            for (size_t l = 0; l < 3; l++) {
                const uint8_t *from = src + l * lane + i;
                uint8_t *to = dst + l * lane + i;
                if (ahead) _mm_prefetch((const char *)from + 3 * lane, _MM_HINT_T0);
                __m256i low = _mm256_loadu_si256((const __m256i *)from);
                __m256i high = _mm256_loadu_si256((const __m256i *)(from + 32));
                if (stream) {
                    _mm256_stream_si256((__m256i *)to, low);
                    _mm256_stream_si256((__m256i *)(to + 32), high);
                } else {
                    _mm256_storeu_si256((__m256i *)to, low);
                    _mm256_storeu_si256((__m256i *)(to + 32), high);
                }
                _mm256_store_si256((__m256i *)stored[l], low);
                _mm256_store_si256((__m256i *)(stored[l] + 4), high);
            }
            for (size_t j = 0; j < 8; j++) {
                c0 = _mm_crc32_u64(c0, stored[0][j]);
                c1 = _mm_crc32_u64(c1, stored[1][j]);
                c2 = _mm_crc32_u64(c2, stored[2][j]);
            }
        }
        crc = shift((uint32_t)c0, k2) ^ shift((uint32_t)c1, k1) ^ (uint32_t)c2;
    }
    return crc;
}

// Copies n bytes word by word on one chain (a head, or a tail shorter than 192 bytes); crc is raw.
static uint32_t copy_words(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc) {
    uint64_t c64 = crc;
    for (; n >= 8; n -= 8, src += 8, dst += 8) {
        uint64_t w = load64(src);
        memcpy(dst, &w, 8);
        c64 = _mm_crc32_u64(c64, w);
    }
    uint32_t c = (uint32_t)c64;
    for (; n; n--, src++, dst++) {
        *dst = *src;
        c = _mm_crc32_u8(c, *src);
    }
    return c;
}

// Copies n bytes from src to dst (not overlapping), continuing the raw CRC c over them.
static uint32_t copy_raw(uint8_t *dst, const uint8_t *src, size_t n, uint32_t c) {
    int stream = n >= STREAM_MIN;
    if (stream) {  // streaming stores need 32-byte aligned destinations
        size_t head = (size_t)(-(uintptr_t)dst & 31);
        c = copy_words(dst, src, head, c);
        dst += head, src += head, n -= head;
    }
    size_t blocks = n / (3 * LANE);
    if (blocks) {
        c = stream ? copy_blocks(dst, src, blocks, LANE, c, 1) : copy_blocks(dst, src, blocks, LANE, c, 0);
        dst += blocks * 3 * LANE, src += blocks * 3 * LANE, n -= blocks * 3 * LANE;
    }
    size_t lane = n / 3 / 64 * 64;  // what is left, in one block of shorter lanes
    if (lane) {
        c = stream ? copy_blocks(dst, src, 1, lane, c, 1) : copy_blocks(dst, src, 1, lane, c, 0);
        dst += 3 * lane, src += 3 * lane, n -= 3 * lane;
    }
    c = copy_words(dst, src, n, c);
    if (stream) _mm_sfence();  // streamed stores are visible before the caller reports the copy done
    return c;
}

// Copies n bytes from src to dst (not overlapping) and returns the CRC32C of them, continuing from crc
// (a finished CRC32C, as the crc32c package takes and returns: 0 to start).
uint32_t copy_crc32c(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc) {
    return ~copy_raw(dst, src, n, ~crc);
}

// Gathers the pieces of one strided range into dst, one after another, and returns their CRC32C
// continuing from crc: pieces of `length` bytes at src + i0 * strides[0] + i1 * strides[1] + ..., for
// i_k below counts[k] (depth levels, outermost first, every count >= 1), in row-major order.
uint32_t gather_crc32c(uint8_t *dst, const uint8_t *src, size_t length, size_t depth, const uint64_t *strides,
                       const uint64_t *counts, uint32_t crc) {
    uint64_t index[MAX_DEPTH] = {0};
    uint32_t c = ~crc;
    if (depth > MAX_DEPTH) return crc;  // copy_crc.py refuses such a range before the call
    for (;;) {
        c = copy_raw(dst, src, length, c);
        dst += length;
        size_t level = depth;
        while (level > 0 && ++index[level - 1] == counts[level - 1]) {  // odometer: innermost level first
            index[level - 1] = 0;
            src -= strides[level - 1] * (counts[level - 1] - 1);
            level--;
        }
        if (level == 0) return ~c;
        src += strides[level - 1];
    }
}

// CRC32C of n bytes, continuing from crc (a finished CRC32C): the same three lanes without the copy.
uint32_t crc32c(const uint8_t *src, size_t n, uint32_t crc) {
    uint32_t c = ~crc;
    for (; n >= 3 * LANE; n -= 3 * LANE, src += 3 * LANE) {
        uint64_t c0 = c, c1 = 0, c2 = 0;
        for (size_t i = 0; i < LANE; i += 64) {
            for (size_t lane = 0; lane < 3; lane++)
                _mm_prefetch((const char *)src + (lane + 3) * LANE + i, _MM_HINT_T0);
            for (size_t j = i; j < i + 64; j += 8) {
                c0 = _mm_crc32_u64(c0, load64(src + j));
                c1 = _mm_crc32_u64(c1, load64(src + LANE + j));
                c2 = _mm_crc32_u64(c2, load64(src + 2 * LANE + j));
            }
        }
        c = shift((uint32_t)c0, lane_shift[LANE / 64][1]) ^ shift((uint32_t)c1, lane_shift[LANE / 64][0]) ^
            (uint32_t)c2;
    }
    uint64_t c64 = c;
    for (; n >= 8; n -= 8, src += 8) c64 = _mm_crc32_u64(c64, load64(src));
    c = (uint32_t)c64;
    for (; n; n--, src++) c = _mm_crc32_u8(c, *src);
    return ~c;
}
