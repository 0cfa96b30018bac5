// BLAKE2b (RFC 7693), unkeyed, for lifecycle/engine/blocks.py's derived_block_hash, which
// hashes with Python's hashlib.blake2b(key, digest_size=8). Written from the reference
// algorithm in RFC 7693 (https://www.rfc-editor.org/rfc/rfc7693, sections 2 and 3 and
// appendix C); no external library.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvlife {

// Streaming BLAKE2b: init with the digest length (1..64 bytes), update any number of times,
// final once. Unkeyed (key length 0), fanout 1, depth 1: hashlib.blake2b's defaults.
class Blake2b {
  public:
    explicit Blake2b(std::size_t digest_size);
    void update(const void* data, std::size_t size);
    // Writes digest_size bytes to out. The object is spent afterwards.
    void final(std::uint8_t* out);

  private:
    void compress(bool last);

    std::uint64_t h_[8];
    std::uint64_t t_[2];      // total bytes hashed so far (128-bit counter, low word first)
    std::uint8_t b_[128];     // input buffer
    std::size_t c_;           // bytes in b_
    std::size_t outlen_;
};

}  // namespace kvlife
