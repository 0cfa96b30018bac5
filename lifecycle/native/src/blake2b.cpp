// BLAKE2b from RFC 7693 (https://www.rfc-editor.org/rfc/rfc7693): the reference algorithm of
// its appendix C, buffered with memcpy. Used by the mirror of lifecycle/engine/blocks.py.
#include "blake2b.hpp"

#include <cstring>

namespace kvlife {

namespace {

// RFC 7693 section 2.6: the initialization vector (SHA-512's, FIPS 180-4 section 5.3.5).
constexpr std::uint64_t IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

// RFC 7693 section 2.7: the message word schedule SIGMA; rounds 10 and 11 reuse rows 0 and 1.
constexpr std::uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

inline std::uint64_t rotr64(std::uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

// Little-endian load (RFC 7693 section 2.4: words are read little-endian), on any host.
inline std::uint64_t load64(const std::uint8_t* p) {
    std::uint64_t v = 0;
    for (int i = 7; i >= 0; --i) {
        v = (v << 8) | p[i];
    }
    return v;
}

// RFC 7693 section 3.1: the mixing function G with rotations R1..R4 = 32, 24, 16, 63.
inline void mix(std::uint64_t* v, int a, int b, int c, int d, std::uint64_t x, std::uint64_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr64(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = rotr64(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr64(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr64(v[b] ^ v[c], 63);
}

}  // namespace

Blake2b::Blake2b(std::size_t digest_size) : t_{0, 0}, c_(0), outlen_(digest_size) {
    for (int i = 0; i < 8; ++i) {
        h_[i] = IV[i];
    }
    // RFC 7693 section 2.5, parameter block word 0: depth 1, fanout 1, key length 0, digest length.
    h_[0] ^= 0x01010000ULL ^ static_cast<std::uint64_t>(digest_size);
    std::memset(b_, 0, sizeof b_);
}

// RFC 7693 section 3.2: the compression function F.
void Blake2b::compress(bool last) {
    std::uint64_t v[16];
    std::uint64_t m[16];
    for (int i = 0; i < 8; ++i) {
        v[i] = h_[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t_[0];
    v[13] ^= t_[1];
    if (last) {
        v[14] = ~v[14];
    }
    for (int i = 0; i < 16; ++i) {
        m[i] = load64(b_ + 8 * i);
    }
    for (int r = 0; r < 12; ++r) {
        const std::uint8_t* s = SIGMA[r];
        mix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
        mix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
        mix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
        mix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
        mix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
        mix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
        mix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
        mix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) {
        h_[i] ^= v[i] ^ v[i + 8];
    }
}

// RFC 7693 appendix C's blake2b_update: a full buffer is compressed only once more input
// arrives, so the last block is always left for final() (which flags it as last).
void Blake2b::update(const void* data, std::size_t size) {
    const auto* in = static_cast<const std::uint8_t*>(data);
    while (size > 0) {
        if (c_ == sizeof b_) {
            t_[0] += c_;
            if (t_[0] < c_) {
                ++t_[1];
            }
            compress(false);
            c_ = 0;
        }
        std::size_t take = sizeof b_ - c_;
        if (take > size) {
            take = size;
        }
        std::memcpy(b_ + c_, in, take);
        c_ += take;
        in += take;
        size -= take;
    }
}

void Blake2b::final(std::uint8_t* out) {
    t_[0] += c_;
    if (t_[0] < c_) {
        ++t_[1];
    }
    std::memset(b_ + c_, 0, sizeof b_ - c_);  // zero padding
    compress(true);
    for (std::size_t i = 0; i < outlen_; ++i) {  // the state words, little-endian
        out[i] = static_cast<std::uint8_t>(h_[i >> 3] >> (8 * (i & 7)));
    }
}

}  // namespace kvlife
