// Mirrors transfer/eviction.py: the LRU and ARC eviction orders of a tier index. An order only
// ranks block hashes; the tier index passes the predicate that says which may go. victim() is a
// template, so the index's predicate is a direct, inlinable call (no std::function, no virtual).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ordered_dict.hpp"

namespace kvlife {

enum class EvictionKind { lru, arc };

// make_eviction_order's check of the name: "lru" or "arc", else std::invalid_argument (ValueError)
// "unknown eviction policy 'NAME' (expected 'lru' or 'arc')".
EvictionKind eviction_kind(const std::string& name);

// Least recently used first.
class LRU {
  public:
    static constexpr const char* name = "lru";

    explicit LRU(std::int64_t /*capacity: unused, as in Python*/) {}

    void inserted(std::int64_t block);
    void accessed(std::int64_t block);
    void removed(std::int64_t block);

    template <class Evictable>
    std::optional<std::int64_t> victim(Evictable&& evictable) const {
        for (const auto& node : order_) {
            if (evictable(node.key)) {
                return node.key;
            }
        }
        return std::nullopt;
    }

    const OrderedDict<std::int64_t, NoValue>& order() const { return order_; }  // Python's _order, oldest first

  private:
    OrderedDict<std::int64_t, NoValue> order_;
};

// Adaptive Replacement Cache (Megiddo & Modha, 2003): T1 seen once recently, T2 seen at least
// twice, B1/B2 the ghosts of blocks evicted from T1/T2; p is T1's target size.
class ARC {
  public:
    static constexpr const char* name = "arc";

    explicit ARC(std::int64_t capacity_blocks) : capacity(capacity_blocks > 1 ? capacity_blocks : 1) {}

    void inserted(std::int64_t block);
    void accessed(std::int64_t block);
    void removed(std::int64_t block);  // forgotten, not remembered as a ghost
    void evicted(std::int64_t block);  // into the ghost list of the list it left

    template <class Evictable>
    std::optional<std::int64_t> victim(Evictable&& evictable) const {
        bool prefer_t1 = t1_.size() > 0 && static_cast<std::int64_t>(t1_.size()) >= (p_ > 1 ? p_ : 1);
        const OrderedDict<std::int64_t, NoValue>& first = prefer_t1 ? t1_ : t2_;
        const OrderedDict<std::int64_t, NoValue>& second = prefer_t1 ? t2_ : t1_;
        for (const auto& node : first) {
            if (evictable(node.key)) {
                return node.key;
            }
        }
        for (const auto& node : second) {
            if (evictable(node.key)) {
                return node.key;
            }
        }
        return std::nullopt;
    }

    const std::int64_t capacity;
    std::int64_t p() const { return p_; }
    const OrderedDict<std::int64_t, NoValue>& t1() const { return t1_; }
    const OrderedDict<std::int64_t, NoValue>& t2() const { return t2_; }
    const OrderedDict<std::int64_t, NoValue>& b1() const { return b1_; }
    const OrderedDict<std::int64_t, NoValue>& b2() const { return b2_; }

  private:
    void trim_ghosts();

    std::int64_t p_ = 0;
    OrderedDict<std::int64_t, NoValue> t1_;
    OrderedDict<std::int64_t, NoValue> t2_;
    OrderedDict<std::int64_t, NoValue> b1_;
    OrderedDict<std::int64_t, NoValue> b2_;
};

}  // namespace kvlife
