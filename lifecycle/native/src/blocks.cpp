// Mirror of lifecycle/engine/blocks.py: DeviceBlockPool, derived_block_hash, extend_hashes.
#include "blocks.hpp"

#include <charconv>
#include <limits>

#include "blake2b.hpp"

namespace kvlife {

namespace {

// Python's str() of an int, appended to a hash.
void update_decimal(Blake2b& h, std::int64_t value) {
    char buf[24];
    std::to_chars_result r = std::to_chars(buf, buf + sizeof buf, value);
    h.update(buf, static_cast<std::size_t>(r.ptr - buf));
}

// Python's repr of a list of ints: "[1, 2, 3]".
std::string list_repr(const std::vector<BlockId>& items) {
    std::string out = "[";
    for (std::size_t i = 0; i < items.size(); ++i) {
        if (i > 0) {
            out += ", ";
        }
        out += std::to_string(items[i]);
    }
    out += "]";
    return out;
}

// splitmix64's finalizer: spreads any int64 hash (workload hashes may be small or sequential)
// over the buckets.
inline std::uint64_t mix64(std::uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

}  // namespace

BlockHash derived_block_hash(std::optional<BlockHash> previous, std::string_view request_id, std::int64_t index) {
    // The key f"{'' if previous is None else previous}/{request_id}/{index}", fed in pieces.
    Blake2b h(8);
    if (previous.has_value()) {
        update_decimal(h, *previous);
    }
    h.update("/", 1);
    h.update(request_id.data(), request_id.size());
    h.update("/", 1);
    update_decimal(h, index);
    std::uint8_t digest[8];
    h.final(digest);
    std::uint64_t value = 0;  // int.from_bytes(digest, "big")
    for (std::uint8_t byte : digest) {
        value = (value << 8) | byte;
    }
    return static_cast<BlockHash>(value >> 1);
}

void extend_hashes(std::vector<BlockHash>& hashes, std::string_view request_id, std::int64_t count) {
    while (static_cast<std::int64_t>(hashes.size()) < count) {
        std::optional<BlockHash> previous;
        if (!hashes.empty()) {
            previous = hashes.back();
        }
        hashes.push_back(derived_block_hash(previous, request_id, static_cast<std::int64_t>(hashes.size())));
    }
}

HashList::HashList(std::vector<BlockHash> hashes) : size_(hashes.size()) {
    const std::size_t given = hashes.size();
    buf_ = std::make_shared<Buffer>(Buffer{std::move(hashes), given});
}

HashList::HashList(const HashList& other, std::size_t n) : buf_(other.buf_), size_(n) {}

HashList::HashList(Parts parts) : size_(parts.size) {
    buf_ = std::make_shared<Buffer>(Buffer{std::move(parts.hashes), parts.given});
}

HashList::Parts HashList::take_parts() {
    Parts parts;
    parts.size = static_cast<std::uint32_t>(size_);
    if (buf_) {
        parts.given = static_cast<std::uint32_t>(buf_->given);
        if (buf_.use_count() == 1) {
            parts.hashes = std::move(buf_->hashes);
            parts.hashes.shrink_to_fit();
        } else {
            parts.hashes = buf_->hashes;
        }
    }
    buf_.reset();
    size_ = 0;
    return parts;
}

BlockHash HashList::at(std::size_t i) const {
    if (i >= size_) throw std::out_of_range("HashList::at: " + std::to_string(i) + " >= " + std::to_string(size_));
    return buf_->hashes[i];
}

void HashList::assign(const BlockHash* first, const BlockHash* last) {
    *this = HashList(std::vector<BlockHash>(first, last));
}

void HashList::extend(std::string_view request_id, std::int64_t count) {
    if (count <= static_cast<std::int64_t>(size_)) {
        return;
    }
    if (!buf_) {
        buf_ = std::make_shared<Buffer>(Buffer{{}, 0});
    } else if (size_ < buf_->given) {
        // Past this list come given hashes that are not its own: a buffer of its own first.
        std::vector<BlockHash> own(buf_->hashes.begin(), buf_->hashes.begin() + static_cast<std::ptrdiff_t>(size_));
        buf_ = std::make_shared<Buffer>(Buffer{std::move(own), size_});
    }
    std::vector<BlockHash>& hashes = buf_->hashes;
    const std::size_t want = static_cast<std::size_t>(count);
    if (hashes.size() > size_) {
        size_ = std::min(want, hashes.size());  // derived by a list sharing the buffer: the same values
    }
    if (size_ < want) {  // this list is at the buffer's end: derive the rest
        extend_hashes(hashes, request_id, count);
        size_ = want;
    }
}

DeviceBlockPool::DeviceBlockPool(std::int64_t capacity) : capacity_(capacity), free_count_(0) {
    if (capacity <= 0) {
        throw std::invalid_argument("device pool capacity must be positive, got " + std::to_string(capacity));
    }
    if (capacity > std::numeric_limits<std::int32_t>::max() - 2) {
        throw std::length_error("device pool capacity " + std::to_string(capacity) +
                                " is more blocks than the native pool numbers");
    }
    const auto cap = static_cast<BlockId>(capacity);
    refs_.assign(cap, 0);
    hashes_.assign(cap, NO_HASH);

    // Every block free, in id order (the reference's OrderedDict over range(capacity)).
    free_prev_.resize(cap + 1);
    free_next_.resize(cap + 1);
    for (BlockId b = 0; b <= cap; ++b) {
        free_prev_[b] = b == 0 ? cap : b - 1;
        free_next_[b] = b == cap ? 0 : b + 1;
    }
    free_count_ = cap;

    cached_prev_.assign(cap, NO_BLOCK);
    cached_next_.assign(cap, NO_BLOCK);
    key_of_.assign(cap, -1);
    // At most one key per block with a hash, plus NO_HASH's (see nohash_blocks_).
    keys_.resize(static_cast<std::size_t>(cap) + 2);
    keys_sentinel_ = cap + 1;
    keys_[keys_sentinel_].prev = keys_sentinel_;
    keys_[keys_sentinel_].next = keys_sentinel_;
    for (std::int32_t k = 0; k <= cap; ++k) {
        keys_[k].next = k < cap ? k + 1 : -1;
    }
    free_keys_ = 0;
    std::size_t buckets = 8;
    while (buckets < 2 * (static_cast<std::size_t>(cap) + 1)) {
        buckets *= 2;
    }
    buckets_.assign(buckets, Bucket{0, -1});
    bucket_mask_ = buckets - 1;
}

// ---- the free queue ----

void DeviceBlockPool::free_unlink(BlockId block) {
    BlockId p = free_prev_[block];
    BlockId n = free_next_[block];
    free_next_[p] = n;
    free_prev_[n] = p;
    free_prev_[block] = NOT_LINKED;
    --free_count_;
}

void DeviceBlockPool::free_push_back(BlockId block) {
    const auto sentinel = static_cast<BlockId>(capacity_);
    BlockId p = free_prev_[sentinel];
    free_next_[p] = block;
    free_prev_[block] = p;
    free_next_[block] = sentinel;
    free_prev_[sentinel] = block;
    ++free_count_;
}

void DeviceBlockPool::free_push_front(BlockId block) {
    const auto sentinel = static_cast<BlockId>(capacity_);
    BlockId n = free_next_[sentinel];
    free_prev_[n] = block;
    free_next_[block] = n;
    free_prev_[block] = sentinel;
    free_next_[sentinel] = block;
    ++free_count_;
}

// ---- the prefix cache's keys ----

std::size_t DeviceBlockPool::bucket_of(BlockHash block_hash) const {
    return static_cast<std::size_t>(mix64(static_cast<std::uint64_t>(block_hash))) & bucket_mask_;
}

std::int32_t DeviceBlockPool::find_key(BlockHash block_hash) const {
    for (std::size_t i = bucket_of(block_hash);; i = (i + 1) & bucket_mask_) {
        const Bucket& bucket = buckets_[i];
        if (bucket.key < 0) {
            return -1;
        }
        if (bucket.hash == block_hash) {
            return bucket.key;
        }
    }
}

std::int32_t DeviceBlockPool::add_key(BlockHash block_hash) {
    std::int32_t k = free_keys_;  // never -1: there are more slots than keys can be
    free_keys_ = keys_[k].next;
    std::int32_t last = keys_[keys_sentinel_].prev;  // a new dict key goes last
    keys_[k] = Key{block_hash, NO_BLOCK, NO_BLOCK, last, keys_sentinel_};
    keys_[last].next = k;
    keys_[keys_sentinel_].prev = k;
    std::size_t i = bucket_of(block_hash);
    while (buckets_[i].key >= 0) {
        i = (i + 1) & bucket_mask_;
    }
    buckets_[i] = Bucket{block_hash, k};
    return k;
}

void DeviceBlockPool::remove_key(std::int32_t k) {
    Key& key = keys_[k];
    keys_[key.prev].next = key.next;
    keys_[key.next].prev = key.prev;
    key.next = free_keys_;
    free_keys_ = k;

    std::size_t i = bucket_of(key.hash);
    while (buckets_[i].key != k) {
        i = (i + 1) & bucket_mask_;
    }
    // Backward-shift deletion: pull later entries of the probe run into the hole unless their
    // home bucket lies cyclically in (hole, entry].
    for (;;) {
        std::size_t j = i;
        for (;;) {
            j = (j + 1) & bucket_mask_;
            if (buckets_[j].key < 0) {
                buckets_[i].key = -1;
                return;
            }
            std::size_t home = bucket_of(buckets_[j].hash);
            bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
            if (!stays) {
                break;
            }
        }
        buckets_[i] = buckets_[j];
        i = j;
    }
}

// ---- the pool ----

BlockId DeviceBlockPool::block_of(BlockHash block_hash) const {
    std::int32_t k = find_key(block_hash);
    if (k < 0) {
        return NO_BLOCK;
    }
    return block_hash == NO_HASH ? nohash_blocks_.front() : keys_[k].first;
}

void DeviceBlockPool::cached_prefix(const BlockHash* hashes, std::size_t n, std::vector<BlockId>& out) const {
    for (std::size_t i = 0; i < n; ++i) {
        BlockId block = block_of(hashes[i]);
        if (block == NO_BLOCK) {
            break;
        }
        out.push_back(block);
    }
}

std::int64_t DeviceBlockPool::evictable(const BlockId* blocks, std::size_t n) const {
    std::int64_t count = 0;
    for (std::size_t i = 0; i < n; ++i) {
        check_block(blocks[i]);
        if (refs_[blocks[i]] == 0) {
            ++count;
        }
    }
    return count;
}

void DeviceBlockPool::touch(const BlockId* blocks, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
        BlockId block = blocks[i];
        check_block(block);
        if (refs_[block] == 0) {
            if (!in_free(block)) {
                throw KeyError(block);  // del self._free[block]
            }
            free_unlink(block);
        }
        ++refs_[block];
    }
}

void DeviceBlockPool::allocate(std::int64_t count, std::vector<BlockId>& out) {
    if (count > free_count_) {
        throw OutOfBlocks("need " + std::to_string(count) + " blocks, " + std::to_string(free_count_) + " free");
    }
    const auto sentinel = static_cast<BlockId>(capacity_);
    for (std::int64_t i = 0; i < count; ++i) {
        BlockId block = free_next_[sentinel];  // popitem(last=False)
        free_unlink(block);
        evict(block);
        refs_[block] = 1;
        out.push_back(block);
    }
}

void DeviceBlockPool::release(const BlockId* blocks, std::size_t n, std::vector<BlockId>& out) {
    const std::size_t start = out.size();
    for (std::size_t i = 0; i < n; ++i) {
        BlockId block = blocks[i];
        check_block(block);
        if (refs_[block] <= 0) {
            throw AssertionError("double release of device block " + std::to_string(block));
        }
        --refs_[block];
        if (refs_[block] == 0) {
            if (hashes_[block] != NO_HASH && !in_free(block)) {
                free_push_back(block);  // free[block] = None keeps a present key where it is
            }
            out.push_back(block);
        }
    }
    // The unhashed ones (release leaves hashes alone, so they are read off the freed list) go
    // to the front, the first freed first.
    for (std::size_t i = out.size(); i-- > start;) {
        BlockId block = out[i];
        if (hashes_[block] == NO_HASH) {
            if (in_free(block)) {
                free_unlink(block);
            }
            free_push_front(block);
        }
    }
}

void DeviceBlockPool::cache(BlockId block, BlockHash block_hash) {
    check_block(block);
    BlockHash old = hashes_[block];
    if (old == block_hash) {
        return;
    }
    if (old != NO_HASH) {
        evict(block);
    }
    hashes_[block] = block_hash;
    std::int32_t k = find_key(block_hash);
    if (k < 0) {
        k = add_key(block_hash);
    }
    if (block_hash == NO_HASH) {  // the reference's cached[-1] (see nohash_blocks_)
        if (in_nohash_.empty()) {
            in_nohash_.assign(static_cast<std::size_t>(capacity_), 0);
            nohash_blocks_.reserve(static_cast<std::size_t>(capacity_));
        }
        if (!in_nohash_[block]) {
            in_nohash_[block] = 1;
            nohash_blocks_.push_back(block);
        }
        return;
    }
    Key& key = keys_[k];  // the block goes behind the copies already cached under its hash
    cached_prev_[block] = key.last;
    cached_next_[block] = NO_BLOCK;
    if (key.last == NO_BLOCK) {
        key.first = block;
    } else {
        cached_next_[key.last] = block;
    }
    key.last = block;
    key_of_[block] = k;
}

void DeviceBlockPool::forget(const BlockId* blocks, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
        check_block(blocks[i]);
        evict(blocks[i]);
    }
}

void DeviceBlockPool::evict(BlockId block) {
    if (hashes_[block] == NO_HASH) {
        return;
    }
    std::int32_t k = key_of_[block];
    Key& key = keys_[k];
    BlockId p = cached_prev_[block];
    BlockId n = cached_next_[block];
    if (p == NO_BLOCK) {
        key.first = n;
    } else {
        cached_next_[p] = n;
    }
    if (n == NO_BLOCK) {
        key.last = p;
    } else {
        cached_prev_[n] = p;
    }
    if (key.first == NO_BLOCK) {
        remove_key(k);  // del self.cached[old]
    }
    key_of_[block] = -1;
    hashes_[block] = NO_HASH;
}

void DeviceBlockPool::check_accounting() const {
    const auto sentinel = static_cast<BlockId>(capacity_);
    std::vector<BlockId> free_refs;
    for (BlockId b = free_next_[sentinel]; b != sentinel; b = free_next_[b]) {
        if (refs_[b] != 0 && free_refs.size() < 5) {
            free_refs.push_back(b);
        }
    }
    if (!free_refs.empty()) {
        throw AssertionError("device blocks " + list_repr(free_refs) + " are free but referenced");
    }
    std::int64_t used = 0;
    for (std::int32_t r : refs_) {
        if (r > 0) {
            ++used;
        }
    }
    if (used + free_count_ != capacity_) {
        throw AssertionError("device: used " + std::to_string(used) + " + free " + std::to_string(free_count_) +
                                 " != capacity " + std::to_string(capacity_));
    }
    for (const auto& [block_hash, blocks] : cached()) {
        for (BlockId block : blocks) {
            if (hashes_[block] != block_hash) {
                throw AssertionError("device block " + std::to_string(block) + " cached under " +
                                         std::to_string(block_hash) + " holds " + std::to_string(hashes_[block]));
            }
        }
    }
}

std::vector<BlockId> DeviceBlockPool::free_queue() const {
    const auto sentinel = static_cast<BlockId>(capacity_);
    std::vector<BlockId> out;
    out.reserve(static_cast<std::size_t>(free_count_));
    for (BlockId b = free_next_[sentinel]; b != sentinel; b = free_next_[b]) {
        out.push_back(b);
    }
    return out;
}

std::vector<std::pair<BlockHash, std::vector<BlockId>>> DeviceBlockPool::cached() const {
    std::vector<std::pair<BlockHash, std::vector<BlockId>>> out;
    for (std::int32_t k = keys_[keys_sentinel_].next; k != keys_sentinel_; k = keys_[k].next) {
        const Key& key = keys_[k];
        if (key.hash == NO_HASH) {
            out.emplace_back(key.hash, nohash_blocks_);
            continue;
        }
        std::vector<BlockId> blocks;
        for (BlockId b = key.first; b != NO_BLOCK; b = cached_next_[b]) {
            blocks.push_back(b);
        }
        out.emplace_back(key.hash, std::move(blocks));
    }
    return out;
}

}  // namespace kvlife
