// The device block pool: a mirror of lifecycle/engine/blocks.py (DeviceBlockPool,
// derived_block_hash, extend_hashes), method for method, with the same results, the same
// orders and the same errors (as the C++ exceptions below; bind_blocks.cpp turns them into
// the Python reference's exception types with the same messages).
//
// Orders, as the reference keeps them:
// - the free queue (an OrderedDict in Python) is an intrusive doubly-linked list over block
//   ids: popping the front, unlinking any block, appending at the back and pushing at the
//   front are all O(1);
// - the prefix cache (hash -> blocks cached under it, oldest first; the hashes themselves in
//   dict insertion order) is a table of key slots, each heading an intrusive list of its
//   blocks, the slots linked in insertion order; an open-addressing table maps a hash to its
//   slot. Nothing allocates after construction, except what a caller's output vector needs.
//
// Block ids outside [0, capacity) raise std::out_of_range ("list index out of range", which
// pybind11 turns into IndexError) at the same point of an operation where Python's list
// indexing raises it. The one departure: a negative id, which Python's lists wrap around
// (refs[-1] is the last block's) and which no caller passes, is out of range here too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "errors.hpp"

namespace kvlife {

using BlockHash = std::int64_t;  // Python ints below 2**63 (derived ones are >= 0)
using BlockId = std::int32_t;

constexpr BlockHash NO_HASH = -1;
constexpr BlockId NO_BLOCK = -1;  // block_of's "None"

// blocks.OutOfBlocks: allocate asked for more blocks than the free queue holds.
struct OutOfBlocks : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// derived_block_hash(previous, request_id, index): blake2b (8-byte digest) of the UTF-8 text
// "{previous}/{request_id}/{index}" ("" for no previous), read big-endian, shifted right by 1.
// request_id is UTF-8 already.
BlockHash derived_block_hash(std::optional<BlockHash> previous, std::string_view request_id, std::int64_t index);

// extend_hashes(hashes, request_id, count): hashes extended in place with derived hashes up
// to count blocks (left as they are when they already hold count or more).
void extend_hashes(std::vector<BlockHash>& hashes, std::string_view request_id, std::int64_t count);

// A request's block hashes: its full prompt blocks', then the derived ones appended as blocks of
// generated tokens fill (extend, as extend_hashes does). The scheduler's request and the connector
// core's record of it hold the same list, each with its own length, in one shared buffer: a request
// waiting in the queue holds its hashes once, not twice. A derived hash is a function of the one
// before it, the request id and its index, so a list extended past the buffer's given hashes reads
// what another holder derived instead of deriving it again; a list that would extend inside the
// given hashes, or is given others (assign), takes a buffer of its own first. The buffer only grows:
// a pointer from data() is valid until this list or one sharing its buffer extends.
class HashList {
  public:
    HashList() = default;
    explicit HashList(std::vector<BlockHash> hashes);
    // other's first n hashes (n <= other.size()), sharing its buffer.
    HashList(const HashList& other, std::size_t n);

    // A list kept apart from any buffer (a dormant request's): its buffer's hashes, how many of
    // them were given and its own length. HashList(Parts) is the list again, in a buffer of its own.
    struct Parts {
        std::vector<BlockHash> hashes;
        std::uint32_t given = 0;  // (32 bits: a prompt has at most 2^24 tokens, so as many blocks)
        std::uint32_t size = 0;
    };
    explicit HashList(Parts parts);
    // The parts, this list left empty: the buffer's hashes moved out when no other list shares
    // it, copied otherwise (trimmed to their length either way).
    Parts take_parts();

    std::size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }
    BlockHash operator[](std::size_t i) const { return buf_->hashes[i]; }
    BlockHash at(std::size_t i) const;
    BlockHash back() const { return buf_->hashes[size_ - 1]; }
    const BlockHash* data() const { return buf_ ? buf_->hashes.data() : nullptr; }
    const BlockHash* begin() const { return data(); }
    const BlockHash* end() const { return data() + size_; }
    std::vector<BlockHash> to_vector(std::size_t n) const { return std::vector<BlockHash>(begin(), begin() + n); }
    std::vector<BlockHash> to_vector() const { return to_vector(size_); }

    // extend_hashes(self, request_id, count): derived hashes up to count blocks (none when it holds
    // count or more already).
    void extend(std::string_view request_id, std::int64_t count);
    // self[:] = [first, last): a buffer of its own.
    void assign(const BlockHash* first, const BlockHash* last);

  private:
    struct Buffer {
        std::vector<BlockHash> hashes;
        std::size_t given;  // hashes[:given] were given; each one past them is derived from the one before
    };
    std::shared_ptr<Buffer> buf_;
    std::size_t size_ = 0;
};

class DeviceBlockPool {
  public:
    // std::invalid_argument for capacity <= 0 (the reference's ValueError, same message);
    // std::length_error past what block ids (int32) can number.
    explicit DeviceBlockPool(std::int64_t capacity);

    std::int64_t capacity() const { return capacity_; }
    std::int64_t free() const { return free_count_; }
    std::int64_t used() const { return capacity_ - free_count_; }

    // The oldest block cached under block_hash, or NO_BLOCK.
    BlockId block_of(BlockHash block_hash) const;
    // Appends to out the blocks of the longest run of leading hashes that are cached.
    void cached_prefix(const BlockHash* hashes, std::size_t n, std::vector<BlockId>& out) const;
    // How many of blocks are unreferenced (in the free queue).
    std::int64_t evictable(const BlockId* blocks, std::size_t n) const;
    void touch(const BlockId* blocks, std::size_t n);
    // Appends the first count blocks of the free queue to out (none for count <= 0);
    // OutOfBlocks when count exceeds the free queue.
    void allocate(std::int64_t count, std::vector<BlockId>& out);
    // Drops a reference on each block, in the order given; appends to out the blocks that
    // became free, in that order. AssertionError on a block with no reference left.
    void release(const BlockId* blocks, std::size_t n, std::vector<BlockId>& out);
    void hold(const BlockId* blocks, std::size_t n) { touch(blocks, n); }
    void cache(BlockId block, BlockHash block_hash);
    void forget(const BlockId* blocks, std::size_t n);
    // AssertionError when an invariant is broken, with the reference's message.
    void check_accounting() const;

    // Read access, for the engine and the differential test.
    const std::vector<std::int32_t>& refs() const { return refs_; }
    const std::vector<BlockHash>& hashes() const { return hashes_; }
    // The free queue, front (allocated next) first.
    std::vector<BlockId> free_queue() const;
    // The prefix cache: every hash in insertion order, with its blocks oldest first.
    std::vector<std::pair<BlockHash, std::vector<BlockId>>> cached() const;

  private:
    struct Key {                 // one hash of the prefix cache
        BlockHash hash;
        BlockId first, last;     // its blocks (real hashes only; see nohash_blocks_)
        std::int32_t prev, next; // the keys' insertion order; also the free-slot chain
    };
    struct Bucket {
        BlockHash hash;
        std::int32_t key;        // -1: empty
    };

    void check_block(BlockId block) const {
        if (static_cast<std::uint32_t>(block) >= static_cast<std::uint32_t>(capacity_)) {
            throw std::out_of_range("list index out of range");
        }
    }
    bool in_free(BlockId block) const { return free_prev_[block] != NOT_LINKED; }
    void free_unlink(BlockId block);
    void free_push_back(BlockId block);
    void free_push_front(BlockId block);
    void evict(BlockId block);
    // The key slot of block_hash, or -1.
    std::int32_t find_key(BlockHash block_hash) const;
    std::int32_t add_key(BlockHash block_hash);
    void remove_key(std::int32_t key);
    std::size_t bucket_of(BlockHash block_hash) const;

    static constexpr std::int32_t NOT_LINKED = -2;

    std::int64_t capacity_;
    std::vector<std::int32_t> refs_;
    std::vector<BlockHash> hashes_;

    // Free queue: capacity_ is the sentinel; a block out of the queue has prev NOT_LINKED.
    std::vector<BlockId> free_prev_, free_next_;
    std::int64_t free_count_;

    // Prefix cache. A block with a hash other than NO_HASH sits in exactly one key's list
    // (its own hash's), linked by cached_prev_/cached_next_; its key slot is key_of_[block].
    std::vector<BlockId> cached_prev_, cached_next_;
    std::vector<std::int32_t> key_of_;
    std::vector<Key> keys_;          // capacity_ + 1 slots, then the order's sentinel
    std::int32_t keys_sentinel_;
    std::int32_t free_keys_;         // chain of unused slots through Key::next, -1 at its end
    std::vector<Bucket> buckets_;    // open addressing, linear probing, at most half full
    std::size_t bucket_mask_;

    // The reference's one oddity: cache(block, NO_HASH) on a block that holds a hash files the
    // block under NO_HASH in the prefix cache (cached[-1]) while its hash reads as none, so no
    // eviction ever takes it out again. Those blocks, oldest first, without duplicates.
    std::vector<BlockId> nohash_blocks_;
    std::vector<std::uint8_t> in_nohash_;
};

}  // namespace kvlife
