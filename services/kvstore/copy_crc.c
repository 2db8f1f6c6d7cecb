// CRC32C (Castagnoli) computed while copying, in one pass over the bytes (copy_crc.py builds and loads it).
//
// The SSE4.2 crc32 instruction takes 3 cycles but can start one every cycle, so a single chain of it
// runs at a third of its speed. The loop below keeps three chains busy: a block is cut into three lanes
// of LANE bytes, each lane's CRC runs on its own, and the three are joined by shifting the earlier lanes'
// CRCs past the later lanes' bytes (a carry-less multiply by x^(8 * LANE) modulo the polynomial). Every
// 8-byte word is loaded once, stored to the destination and fed to its lane's chain, so the CRC is of the
// bytes as they were copied. Large copies store past the cache (movnti): the destination is not read
// again soon, and skipping the read-for-ownership of each destination line saves a third of the traffic.

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82F63B78u  // CRC-32C, bit-reflected
#define LANE 4096         // bytes per lane: three lanes (12 KiB of source) stay in L1 for the join
#define STREAM_MIN (4u << 20)  // copies at least this large store past the cache

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
static uint32_t lane_shift_1, lane_shift_2;  // K for LANE and 2 * LANE bytes

__attribute__((constructor)) static void init_constants(void) {
    lane_shift_1 = xpow(8ull * LANE - 33);
    lane_shift_2 = xpow(16ull * LANE - 33);
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

static inline void store64(uint8_t *p, uint64_t v, int stream) {
    if (stream)
        _mm_stream_si64((long long *)p, (long long)v);
    else
        memcpy(p, &v, 8);
}

// Three lanes of LANE bytes per block; `stream` is a constant at each call, so each loop is specialised.
static inline uint32_t copy_blocks(uint8_t *dst, const uint8_t *src, size_t blocks, uint32_t crc, int stream) {
    for (size_t b = 0; b < blocks; b++, dst += 3 * LANE, src += 3 * LANE) {
        uint64_t c0 = crc, c1 = 0, c2 = 0;
        for (size_t i = 0; i < LANE; i += 8) {
            uint64_t w0 = load64(src + i), w1 = load64(src + LANE + i), w2 = load64(src + 2 * LANE + i);
            store64(dst + i, w0, stream);
            store64(dst + LANE + i, w1, stream);
            store64(dst + 2 * LANE + i, w2, stream);
            c0 = _mm_crc32_u64(c0, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
        }
        crc = shift((uint32_t)c0, lane_shift_2) ^ shift((uint32_t)c1, lane_shift_1) ^ (uint32_t)c2;
    }
    return crc;
}

// Copies n bytes from src to dst (not overlapping) and returns the CRC32C of them, continuing from crc
// (a finished CRC32C, as the crc32c package takes and returns: 0 to start).
uint32_t copy_crc32c(uint8_t *dst, const uint8_t *src, size_t n, uint32_t crc) {
    uint32_t c = ~crc;
    size_t blocks = n / (3 * LANE);
    if (blocks) {
        int stream = n >= STREAM_MIN && ((uintptr_t)dst & 7) == 0;  // movnti needs 8-byte alignment
        c = stream ? copy_blocks(dst, src, blocks, c, 1) : copy_blocks(dst, src, blocks, c, 0);
        if (stream) _mm_sfence();  // streamed stores become visible before the caller reports the copy
        dst += blocks * 3 * LANE;
        src += blocks * 3 * LANE;
        n -= blocks * 3 * LANE;
    }
    uint64_t c64 = c;
    for (; n >= 8; n -= 8, src += 8, dst += 8) {
        uint64_t w = load64(src);
        memcpy(dst, &w, 8);
        c64 = _mm_crc32_u64(c64, w);
    }
    c = (uint32_t)c64;
    for (; n; n--, src++, dst++) {
        *dst = *src;
        c = _mm_crc32_u8(c, *src);
    }
    return ~c;
}
