// Python's insertion-ordered dict (and collections.OrderedDict) of int keys, as transfer/index.py's
// TierIndex._entries and transfer/eviction.py's LRU/ARC lists use them: iteration in insertion order,
// deletion keeps the remaining order, move_to_end, popitem(last=False).
//
// An open-addressing hash table (linear probing, backward-shift deletion: no tombstones) maps an
// int64 key to a node in a slab; the nodes form a doubly-linked list in insertion order. Freed
// nodes are reused and the table only grows, so a dict at its working size allocates nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kvlife {

struct NoValue {};  // a dict whose values are all None: an ordered set

template <class V>
class OrderedDict {
  public:
    using Id = std::uint32_t;
    static constexpr Id kNil = 0xffffffffu;

    struct Node {
        std::int64_t key;
        Id prev;
        Id next;
        V value;
    };

    class const_iterator {
      public:
        const_iterator(const std::vector<Node>* nodes, Id id) : nodes_(nodes), id_(id) {}
        const Node& operator*() const { return (*nodes_)[id_]; }
        const Node* operator->() const { return &(*nodes_)[id_]; }
        const_iterator& operator++() {
            id_ = (*nodes_)[id_].next;
            return *this;
        }
        bool operator!=(const const_iterator& other) const { return id_ != other.id_; }
        bool operator==(const const_iterator& other) const { return id_ == other.id_; }

      private:
        const std::vector<Node>* nodes_;
        Id id_;
    };

    const_iterator begin() const { return const_iterator(&nodes_, head_); }
    const_iterator end() const { return const_iterator(&nodes_, kNil); }

    std::size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }

    // key in d
    bool contains(std::int64_t key) const { return position(key) != kNoPosition; }

    // d.get(key): nullptr when absent.
    V* find(std::int64_t key) {
        std::size_t pos = position(key);
        return pos == kNoPosition ? nullptr : &nodes_[table_[pos].id].value;
    }
    const V* find(std::int64_t key) const {
        std::size_t pos = position(key);
        return pos == kNoPosition ? nullptr : &nodes_[table_[pos].id].value;
    }

    // d[key] = value: a new key goes to the end; a key already there keeps its place and takes the value.
    V& set(std::int64_t key, V value = V{}) {
        std::size_t pos = position(key);
        if (pos != kNoPosition) {
            V& slot = nodes_[table_[pos].id].value;
            slot = std::move(value);
            return slot;
        }
        return insert_new(key, std::move(value));
    }

    // d.pop(key, None) is not None: removes the key if present and says whether it was.
    bool erase(std::int64_t key) {
        std::size_t pos = position(key);
        if (pos == kNoPosition) {
            return false;
        }
        remove_at(pos);
        return true;
    }

    // d.pop(key) where the caller knows key is present: the value it held.
    V take(std::int64_t key) {
        std::size_t pos = position(key);
        V value = std::move(nodes_[table_[pos].id].value);
        remove_at(pos);
        return value;
    }

    // d.move_to_end(key) when present; a no-op otherwise (callers check membership first, as Python does).
    void move_to_end(std::int64_t key) {
        std::size_t pos = position(key);
        if (pos == kNoPosition) {
            return;
        }
        Id id = table_[pos].id;
        if (id == tail_) {
            return;
        }
        unlink(id);
        link_back(id);
    }

    // d.popitem(last=False)[0] on a non-empty dict.
    std::int64_t pop_front() {
        std::int64_t key = nodes_[head_].key;
        remove_at(position(key));
        return key;
    }

  private:
    struct Bucket {
        std::int64_t key;
        Id id;  // kNil: empty
    };
    static constexpr std::size_t kNoPosition = ~static_cast<std::size_t>(0);

    static std::size_t hash(std::int64_t key) {
        // splitmix64's finalizer: block hashes in tests are small consecutive ints.
        std::uint64_t x = static_cast<std::uint64_t>(key);
        x ^= x >> 30;
        x *= 0xbf58476d1ce4e5b9ULL;
        x ^= x >> 27;
        x *= 0x94d049bb133111ebULL;
        x ^= x >> 31;
        return static_cast<std::size_t>(x);
    }

    std::size_t position(std::int64_t key) const {
        if (table_.empty()) {
            return kNoPosition;
        }
        std::size_t mask = table_.size() - 1;
        for (std::size_t i = hash(key) & mask;; i = (i + 1) & mask) {
            const Bucket& b = table_[i];
            if (b.id == kNil) {
                return kNoPosition;
            }
            if (b.key == key) {
                return i;
            }
        }
    }

    V& insert_new(std::int64_t key, V value) {
        if ((size_ + 1) * 2 > table_.size()) {
            grow();
        }
        Id id;
        if (free_ != kNil) {
            id = free_;
            free_ = nodes_[id].next;
            nodes_[id].key = key;
            nodes_[id].value = std::move(value);
        } else {
            id = static_cast<Id>(nodes_.size());
            nodes_.push_back(Node{key, kNil, kNil, std::move(value)});
        }
        place(key, id);
        link_back(id);
        ++size_;
        return nodes_[id].value;
    }

    void place(std::int64_t key, Id id) {
        std::size_t mask = table_.size() - 1;
        std::size_t i = hash(key) & mask;
        while (table_[i].id != kNil) {
            i = (i + 1) & mask;
        }
        table_[i] = Bucket{key, id};
    }

    void grow() {
        std::vector<Bucket> old = std::move(table_);
        table_.assign(old.empty() ? 8 : old.size() * 2, Bucket{0, kNil});
        for (const Bucket& b : old) {
            if (b.id != kNil) {
                place(b.key, b.id);
            }
        }
    }

    void remove_at(std::size_t pos) {
        Id id = table_[pos].id;
        unlink(id);
        nodes_[id].value = V{};
        nodes_[id].next = free_;
        free_ = id;
        --size_;
        // Backward-shift deletion: pull later buckets of the probe run into the hole when their
        // home bucket does not lie strictly after the hole.
        std::size_t mask = table_.size() - 1;
        std::size_t hole = pos;
        for (std::size_t j = (hole + 1) & mask; table_[j].id != kNil; j = (j + 1) & mask) {
            std::size_t home = hash(table_[j].key) & mask;
            if (((j - home) & mask) >= ((j - hole) & mask)) {
                table_[hole] = table_[j];
                hole = j;
            }
        }
        table_[hole].id = kNil;
    }

    void unlink(Id id) {
        Node& n = nodes_[id];
        if (n.prev != kNil) {
            nodes_[n.prev].next = n.next;
        } else {
            head_ = n.next;
        }
        if (n.next != kNil) {
            nodes_[n.next].prev = n.prev;
        } else {
            tail_ = n.prev;
        }
    }

    void link_back(Id id) {
        Node& n = nodes_[id];
        n.prev = tail_;
        n.next = kNil;
        if (tail_ != kNil) {
            nodes_[tail_].next = id;
        } else {
            head_ = id;
        }
        tail_ = id;
    }

    std::vector<Bucket> table_;  // a power of two in size, at most half full
    std::vector<Node> nodes_;
    Id head_ = kNil;
    Id tail_ = kNil;
    Id free_ = kNil;  // freed nodes, chained through next
    std::size_t size_ = 0;
};

}  // namespace kvlife
