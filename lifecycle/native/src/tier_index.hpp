// Mirrors transfer/index.py: TierIndex, the index of one storage tier (which block hashes it holds,
// in which slot, which are pinned by in-flight transfers, what to evict), and its StorePlan.
//
// Methods keep the Python names, arguments, results and errors. Errors: KeyError is Python's
// KeyError (a message, or for slot_of the missing key itself), AssertionError its
// AssertionError, std::invalid_argument its ValueError. Like the Python, a method that raises
// part way keeps what it did before the failing block (prepare_load's earlier pins stay).
//
// Lists come back as references to buffers the index owns (no allocation per call once warm):
// each stays valid until the next call of the same method.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "errors.hpp"

#include "eviction.hpp"
#include "ordered_dict.hpp"

namespace kvlife {

struct TierEntry {
    std::int64_t slot = 0;
    std::int32_t pins = 0;  // in-flight loads reading it
    bool ready = false;     // false while the store that writes it is in flight
    bool doomed = false;    // found bad while pinned: dropped when the last reader ends
};

// The outcome of prepare_store: blocks accepted with their slots, blocks evicted.
struct StorePlan {
    std::vector<std::pair<std::int64_t, std::int64_t>> accepted;
    std::vector<std::int64_t> evicted;
    std::int64_t skipped_present = 0;
    std::int64_t rejected_full = 0;
};

class TierIndex {
  public:
    TierIndex(std::string name, std::int64_t capacity_blocks, const std::string& eviction = "lru");

    // A new index already holding blocks ((hash, slot) pairs, adopted in that order).
    static TierIndex adopting(std::string name, std::int64_t capacity_blocks, const std::string& eviction,
                              const std::pair<std::int64_t, std::int64_t>* blocks, std::size_t n);

    const std::string name;
    const std::int64_t capacity;

    // ---- queries ----
    std::int64_t used() const { return static_cast<std::int64_t>(entries_.size()); }
    std::int64_t free() const { return static_cast<std::int64_t>(free_slots_.size()); }
    bool has_room() const;
    const std::vector<std::int64_t>& busy() const;  // in the entries' insertion order
    bool contains(std::int64_t block) const;
    std::int64_t slot_of(std::int64_t block) const;
    std::int64_t lookup(const std::int64_t* blocks, std::size_t n) const;
    std::int64_t pinned() const;

    // ---- loads ----
    const std::vector<std::int64_t>& prepare_load(const std::int64_t* blocks, std::size_t n);
    void complete_load(const std::int64_t* blocks, std::size_t n);

    // ---- stores ----
    const StorePlan& prepare_store(const std::int64_t* blocks, std::size_t n);
    void complete_store(const std::int64_t* blocks, std::size_t n, bool ok = true);
    void adopt(std::int64_t block, std::int64_t slot);

    // ---- removal ----
    const std::vector<std::int64_t>& discard(const std::int64_t* blocks, std::size_t n);
    std::int64_t evictions() const { return evictions_; }

    void check_accounting() const;

    // The Python's private state, for the differential test: _order (LRU or ARC, by kind) and _free_slots.
    EvictionKind eviction() const { return kind_; }
    const LRU& lru() const { return lru_; }
    const ARC& arc() const { return arc_; }
    const std::vector<std::int64_t>& free_slots() const { return free_slots_; }

  private:
    bool readable(const TierEntry* entry) const { return entry != nullptr && entry->ready && !entry->doomed; }
    bool evictable(std::int64_t block) const;
    std::optional<std::int64_t> victim() const;
    void accessed(std::int64_t block);
    void evict(std::int64_t block);
    void drop(std::int64_t block);
    std::string prefix() const;  // "tier 'NAME': "

    EvictionKind kind_;
    LRU lru_;
    ARC arc_;
    OrderedDict<std::int64_t, TierEntry> entries_;
    std::vector<std::int64_t> free_slots_;  // a stack: pop from the end, freed slots appended
    std::int64_t evictions_ = 0;

    mutable std::vector<std::int64_t> busy_out_;
    std::vector<std::int64_t> load_out_;
    std::vector<std::int64_t> discard_out_;
    StorePlan store_out_;
};

}  // namespace kvlife
