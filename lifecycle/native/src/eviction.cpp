// Mirrors transfer/eviction.py (LRU, ARC, make_eviction_order's name check), statement by
// statement: every OrderedDict operation of the Python is the same operation here, in the same order.
#include "eviction.hpp"

#include <algorithm>
#include <stdexcept>

#include "py_repr.hpp"

namespace kvlife {

EvictionKind eviction_kind(const std::string& name) {
    if (name == "lru") {
        return EvictionKind::lru;
    }
    if (name == "arc") {
        return EvictionKind::arc;
    }
    throw std::invalid_argument("unknown eviction policy " + str_repr(name) + " (expected 'lru' or 'arc')");
}

void LRU::inserted(std::int64_t block) {
    order_.set(block);  // self._order[block] = None
    order_.move_to_end(block);
}

void LRU::accessed(std::int64_t block) {
    order_.move_to_end(block);  // a no-op for a block not in the order, as the Python's membership test
}

void LRU::removed(std::int64_t block) { order_.erase(block); }

void ARC::inserted(std::int64_t block) {
    if (b1_.contains(block)) {
        std::int64_t b1 = static_cast<std::int64_t>(b1_.size());
        std::int64_t b2 = static_cast<std::int64_t>(b2_.size());
        p_ = std::min(capacity, p_ + std::max<std::int64_t>(1, b2 / std::max<std::int64_t>(1, b1)));
        b1_.erase(block);
        t2_.set(block);
    } else if (b2_.contains(block)) {
        std::int64_t b1 = static_cast<std::int64_t>(b1_.size());
        std::int64_t b2 = static_cast<std::int64_t>(b2_.size());
        p_ = std::max<std::int64_t>(0, p_ - std::max<std::int64_t>(1, b1 / std::max<std::int64_t>(1, b2)));
        b2_.erase(block);
        t2_.set(block);
    } else {
        t1_.set(block);
    }
    trim_ghosts();
}

void ARC::accessed(std::int64_t block) {
    if (t1_.erase(block)) {
        t2_.set(block);
    } else {
        t2_.move_to_end(block);  // a no-op unless in T2
    }
}

void ARC::removed(std::int64_t block) {
    t1_.erase(block);
    t2_.erase(block);
}

void ARC::evicted(std::int64_t block) {
    if (t1_.erase(block)) {
        b1_.set(block);
    } else if (t2_.erase(block)) {
        b2_.set(block);
    }
    trim_ghosts();
}

void ARC::trim_ghosts() {
    while (static_cast<std::int64_t>(b1_.size()) > capacity) {
        b1_.pop_front();
    }
    while (static_cast<std::int64_t>(b2_.size()) > capacity) {
        b2_.pop_front();
    }
}

}  // namespace kvlife
