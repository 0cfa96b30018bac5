// Mirrors transfer/index.py's TierIndex, method by method, with the same errors and the same order
// of every dict, list and eviction-order operation.
#include "tier_index.hpp"

#include <algorithm>

#include "py_repr.hpp"

namespace kvlife {

namespace {

std::int64_t checked_capacity(const std::string& name, std::int64_t capacity_blocks) {
    if (capacity_blocks < 0) {
        throw std::invalid_argument("tier " + str_repr(name) + ": capacity_blocks must be >= 0, got " +
                                    std::to_string(capacity_blocks));
    }
    return capacity_blocks;
}

}  // namespace

TierIndex::TierIndex(std::string name_, std::int64_t capacity_blocks, const std::string& eviction)
    : name(std::move(name_)),
      capacity(checked_capacity(name, capacity_blocks)),
      kind_(eviction_kind(eviction)),
      lru_(capacity_blocks),
      arc_(capacity_blocks) {
    // Lowest slots are handed out first so slot assignment is deterministic.
    free_slots_.reserve(static_cast<std::size_t>(capacity));
    for (std::int64_t slot = capacity - 1; slot >= 0; --slot) {
        free_slots_.push_back(slot);
    }
}

TierIndex TierIndex::adopting(std::string name, std::int64_t capacity_blocks, const std::string& eviction,
                              const std::pair<std::int64_t, std::int64_t>* blocks, std::size_t n) {
    TierIndex index(std::move(name), capacity_blocks, eviction);
    for (std::size_t i = 0; i < n; ++i) {
        index.adopt(blocks[i].first, blocks[i].second);
    }
    return index;
}

std::string TierIndex::prefix() const { return "tier " + str_repr(name) + ": "; }

// ---- queries ---------------------------------------------------------------------------------

bool TierIndex::has_room() const { return !free_slots_.empty() || victim().has_value(); }

const std::vector<std::int64_t>& TierIndex::busy() const {
    busy_out_.clear();
    for (const auto& node : entries_) {
        const TierEntry& e = node.value;
        if (!e.ready || e.pins != 0 || e.doomed) {
            busy_out_.push_back(node.key);
        }
    }
    return busy_out_;
}

bool TierIndex::contains(std::int64_t block) const { return readable(entries_.find(block)); }

std::int64_t TierIndex::slot_of(std::int64_t block) const {
    const TierEntry* entry = entries_.find(block);
    if (entry == nullptr) {
        throw KeyError(block);  // self._entries[block]
    }
    return entry->slot;
}

std::int64_t TierIndex::lookup(const std::int64_t* blocks, std::size_t n) const {
    std::int64_t count = 0;
    for (std::size_t i = 0; i < n; ++i) {
        if (!readable(entries_.find(blocks[i]))) {
            break;
        }
        ++count;
    }
    return count;
}

std::int64_t TierIndex::pinned() const {
    std::int64_t count = 0;
    for (const auto& node : entries_) {
        if (node.value.pins > 0 || !node.value.ready) {
            ++count;
        }
    }
    return count;
}

// ---- loads -----------------------------------------------------------------------------------

const std::vector<std::int64_t>& TierIndex::prepare_load(const std::int64_t* blocks, std::size_t n) {
    load_out_.clear();
    for (std::size_t i = 0; i < n; ++i) {
        std::int64_t block = blocks[i];
        TierEntry* entry = entries_.find(block);
        if (!readable(entry)) {
            throw KeyError(prefix() + "block " + std::to_string(block) + " is not readable");
        }
        entry->pins += 1;
        accessed(block);
        load_out_.push_back(entry->slot);
    }
    return load_out_;
}

void TierIndex::complete_load(const std::int64_t* blocks, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
        std::int64_t block = blocks[i];
        TierEntry* entry = entries_.find(block);
        if (entry == nullptr || entry->pins == 0) {
            throw KeyError(prefix() + "block " + std::to_string(block) + " was not pinned for load");
        }
        entry->pins -= 1;
        if (entry->doomed && entry->pins == 0) {
            drop(block);
        }
    }
}

// ---- stores ----------------------------------------------------------------------------------

const StorePlan& TierIndex::prepare_store(const std::int64_t* blocks, std::size_t n) {
    StorePlan& plan = store_out_;
    plan.accepted.clear();
    plan.evicted.clear();
    plan.skipped_present = 0;
    plan.rejected_full = 0;
    // The Python also keeps a set of the blocks accepted by this call; each of them is in the
    // entries until the call returns (not ready, so never a victim), so the entries alone decide.
    for (std::size_t i = 0; i < n; ++i) {
        std::int64_t block = blocks[i];
        if (entries_.contains(block)) {
            plan.skipped_present += 1;
            accessed(block);
            continue;
        }
        if (free_slots_.empty()) {
            std::optional<std::int64_t> found = victim();
            if (!found) {
                plan.rejected_full += 1;
                continue;
            }
            evict(*found);
            plan.evicted.push_back(*found);
        }
        std::int64_t slot = free_slots_.back();
        free_slots_.pop_back();
        TierEntry& entry = entries_.set(block);
        entry.slot = slot;
        entry.ready = false;
        if (kind_ == EvictionKind::arc) {
            arc_.inserted(block);
        } else {
            lru_.inserted(block);
        }
        plan.accepted.emplace_back(block, slot);
    }
    return plan;
}

void TierIndex::complete_store(const std::int64_t* blocks, std::size_t n, bool ok) {
    for (std::size_t i = 0; i < n; ++i) {
        std::int64_t block = blocks[i];
        TierEntry* entry = entries_.find(block);
        if (entry == nullptr || entry->ready) {
            throw KeyError(prefix() + "block " + std::to_string(block) + " has no store in flight");
        }
        if (ok) {
            entry->ready = true;
        } else {
            drop(block);
        }
    }
}

void TierIndex::adopt(std::int64_t block, std::int64_t slot) {
    if (entries_.contains(block)) {
        throw KeyError(prefix() + "block " + std::to_string(block) + " is already indexed");
    }
    // list.remove: the first occurrence, the rest keeps its order.
    auto it = std::find(free_slots_.begin(), free_slots_.end(), slot);
    if (it == free_slots_.end()) {
        throw KeyError(prefix() + "slot " + std::to_string(slot) + " is not free");
    }
    free_slots_.erase(it);
    TierEntry& entry = entries_.set(block);
    entry.slot = slot;
    entry.ready = true;
    if (kind_ == EvictionKind::arc) {
        arc_.inserted(block);
    } else {
        lru_.inserted(block);
    }
}

// ---- removal ---------------------------------------------------------------------------------

const std::vector<std::int64_t>& TierIndex::discard(const std::int64_t* blocks, std::size_t n) {
    discard_out_.clear();
    for (std::size_t i = 0; i < n; ++i) {
        std::int64_t block = blocks[i];
        TierEntry* entry = entries_.find(block);
        if (!readable(entry)) {
            continue;
        }
        if (entry->pins == 0) {
            drop(block);
            discard_out_.push_back(block);
        } else {
            entry->doomed = true;
        }
    }
    return discard_out_;
}

bool TierIndex::evictable(std::int64_t block) const {
    const TierEntry* entry = entries_.find(block);
    if (entry == nullptr) {  // the Python's self._entries[block]: the order holds only indexed blocks
        throw KeyError(block);
    }
    return entry->ready && entry->pins == 0 && !entry->doomed;
}

std::optional<std::int64_t> TierIndex::victim() const {
    auto pred = [this](std::int64_t block) { return evictable(block); };
    return kind_ == EvictionKind::arc ? arc_.victim(pred) : lru_.victim(pred);
}

void TierIndex::accessed(std::int64_t block) {
    if (kind_ == EvictionKind::arc) {
        arc_.accessed(block);
    } else {
        lru_.accessed(block);
    }
}

void TierIndex::evict(std::int64_t block) {
    if (kind_ == EvictionKind::arc) {
        arc_.evicted(block);
    } else {
        lru_.removed(block);
    }
    TierEntry entry = entries_.take(block);
    free_slots_.push_back(entry.slot);
    evictions_ += 1;
}

void TierIndex::drop(std::int64_t block) {
    if (kind_ == EvictionKind::arc) {
        arc_.removed(block);
    } else {
        lru_.removed(block);
    }
    TierEntry entry = entries_.take(block);
    free_slots_.push_back(entry.slot);
}

void TierIndex::check_accounting() const {
    std::size_t used_slots = entries_.size();
    if (static_cast<std::int64_t>(used_slots + free_slots_.size()) != capacity) {
        throw AssertionError(prefix() + "used " + std::to_string(used_slots) + " + free " +
                                 std::to_string(free_slots_.size()) + " != capacity " + std::to_string(capacity));
    }
    std::vector<std::int64_t> slots(free_slots_);
    for (const auto& node : entries_) {
        slots.push_back(node.value.slot);
    }
    std::sort(slots.begin(), slots.end());
    std::int64_t distinct = static_cast<std::int64_t>(std::unique(slots.begin(), slots.end()) - slots.begin());
    if (distinct != capacity) {
        throw AssertionError(prefix() + "a slot is owned twice");
    }
}

}  // namespace kvlife
