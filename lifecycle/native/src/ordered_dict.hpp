// Python's insertion-ordered dict (and collections.OrderedDict), for every native mirror that iterates
// one: transfer/index.py's TierIndex._entries and transfer/eviction.py's LRU/ARC lists (int keys),
// lifecycle/engine/worker_book.py's WorkerBook.jobs, loads_of, stores_of (int and str keys).
// Iteration in insertion order; assigning to a present key keeps its place; deletion keeps the
// remaining order (a key deleted then inserted again goes to the end); move_to_end,
// popitem(last=False).
//
// An open-addressing hash table (linear probing, backward-shift deletion: no tombstones) maps a key
// to a node in a slab; the nodes form a doubly-linked list in insertion order. Freed nodes are
// reused and the table only grows, so a dict at its working size allocates little: a removed vector
// value keeps its buffer for the node's next user, any other value is reset (a removed request or job
// handle frees what it points at). ``Hash``'s result is mixed with splitmix64's finalizer (block
// hashes in tests are small consecutive ints). Integer keys sit in the bucket itself, so a probe
// never leaves the table; other keys are compared in their node once the bucket's full hash matches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvlife {

struct NoValue {};  // a dict whose values are all None: an ordered set

// A removed node keeps a vector value (its buffer serves the node's next key); any other value is
// reset, so a removed handle (a request's, a job's) frees what it points at now, not when the slot
// is next used.
template <class V>
struct KeepsBufferOnRemove : std::false_type {};
template <class T, class A>
struct KeepsBufferOnRemove<std::vector<T, A>> : std::true_type {};

template <class K, class V, class Hash = std::hash<K>>
class OrderedDict {
  public:
    using Id = std::uint32_t;
    static constexpr Id kNil = 0xffffffffu;

    struct Node {
        K key;
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

    // The nodes (``.key``, ``.value``) in insertion order.
    const_iterator begin() const { return const_iterator(&nodes_, head_); }
    const_iterator end() const { return const_iterator(&nodes_, kNil); }

    std::size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }

    // key in d
    bool contains(const K& key) const { return position(key, hash(key)) != kNoPosition; }

    // d.get(key): nullptr when absent.
    V* find(const K& key) {
        std::size_t pos = position(key, hash(key));
        return pos == kNoPosition ? nullptr : &nodes_[table_[pos].id].value;
    }
    const V* find(const K& key) const {
        std::size_t pos = position(key, hash(key));
        return pos == kNoPosition ? nullptr : &nodes_[table_[pos].id].value;
    }

    // The value at ``key`` and whether it was just inserted (at the end). A value just inserted may
    // hold what an erased node left there (its buffers kept for reuse): the caller assigns it in full.
    std::pair<V*, bool> try_emplace(const K& key) {
        std::size_t h = hash(key);
        std::size_t pos = position(key, h);
        if (pos != kNoPosition) {
            return {&nodes_[table_[pos].id].value, false};
        }
        return {&insert_new(key, h), true};
    }

    // d[key] = value: a new key goes to the end; a key already there keeps its place and takes the value.
    V& set(const K& key, V value = V{}) {
        V& slot = *try_emplace(key).first;
        slot = std::move(value);
        return slot;
    }

    // d.pop(key, None) is not None (del d[key] where present): removes the key if present and says
    // whether it was.
    bool erase(const K& key) {
        std::size_t pos = position(key, hash(key));
        if (pos == kNoPosition) {
            return false;
        }
        remove_at(pos);
        return true;
    }

    // d.pop(key) where the caller knows key is present: the value it held.
    V take(const K& key) {
        std::size_t pos = position(key, hash(key));
        V value = std::move(nodes_[table_[pos].id].value);
        remove_at(pos);
        return value;
    }

    // d.move_to_end(key) when present; a no-op otherwise (callers check membership first, as Python does).
    void move_to_end(const K& key) {
        std::size_t pos = position(key, hash(key));
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
    K pop_front() {
        K key = nodes_[head_].key;
        remove_at(position(key, hash(key)));
        return key;
    }

  private:
    static constexpr bool kKeyInBucket = std::is_integral_v<K>;
    struct Bucket {
        // The key, or the low 32 bits of its hash: all a position needs (a table has fewer than
        // 2^32 slots) and, with the id, 8 bytes a slot rather than 16.
        std::conditional_t<kKeyInBucket, K, std::uint32_t> tag;
        Id id;                                                  // kNil: empty
    };
    static constexpr std::size_t kNoPosition = ~static_cast<std::size_t>(0);

    static std::size_t hash(const K& key) {
        std::uint64_t x = static_cast<std::uint64_t>(Hash{}(key));
        x ^= x >> 30;
        x *= 0xbf58476d1ce4e5b9ULL;
        x ^= x >> 27;
        x *= 0x94d049bb133111ebULL;
        x ^= x >> 31;
        return static_cast<std::size_t>(x);
    }

    static Bucket bucket(const K& key, std::size_t h, Id id) {
        if constexpr (kKeyInBucket) {
            return Bucket{key, id};
        } else {
            return Bucket{static_cast<std::uint32_t>(h), id};
        }
    }

    // The bucket's hash: recomputed from an integer key; for any other, its low 32 bits (the
    // position, h & mask, needs no more).
    static std::size_t hash_of(const Bucket& b) {
        if constexpr (kKeyInBucket) {
            return hash(b.tag);
        } else {
            return b.tag;
        }
    }

    std::size_t position(const K& key, std::size_t h) const {
        if (table_.empty()) {
            return kNoPosition;
        }
        std::size_t mask = table_.size() - 1;
        for (std::size_t i = h & mask;; i = (i + 1) & mask) {
            const Bucket& b = table_[i];
            if (b.id == kNil) {
                return kNoPosition;
            }
            if constexpr (kKeyInBucket) {
                if (b.tag == key) {
                    return i;
                }
            } else {
                if (b.tag == static_cast<std::uint32_t>(h) && nodes_[b.id].key == key) {
                    return i;
                }
            }
        }
    }

    V& insert_new(const K& key, std::size_t h) {
        if ((size_ + 1) * 2 > table_.size()) {
            grow();
        }
        Id id;
        if (free_ != kNil) {
            id = free_;
            free_ = nodes_[id].next;
            nodes_[id].key = key;
        } else {
            id = static_cast<Id>(nodes_.size());
            nodes_.push_back(Node{key, kNil, kNil, V{}});
        }
        place(bucket(key, h, id), h);
        link_back(id);
        ++size_;
        return nodes_[id].value;
    }

    void place(const Bucket& b, std::size_t h) {
        std::size_t mask = table_.size() - 1;
        std::size_t i = h & mask;
        while (table_[i].id != kNil) {
            i = (i + 1) & mask;
        }
        table_[i] = b;
    }

    void grow() {
        std::vector<Bucket> old = std::move(table_);
        table_.assign(old.empty() ? 8 : old.size() * 2, Bucket{{}, kNil});
        for (const Bucket& b : old) {
            if (b.id != kNil) {
                place(b, hash_of(b));
            }
        }
    }

    void remove_at(std::size_t pos) {
        Id id = table_[pos].id;
        unlink(id);
        nodes_[id].next = free_;
        if constexpr (!KeepsBufferOnRemove<V>::value) {
            nodes_[id].value = V{};
        }
        free_ = id;
        --size_;
        // Backward-shift deletion: pull later buckets of the probe run into the hole when their
        // home bucket does not lie strictly after the hole.
        std::size_t mask = table_.size() - 1;
        std::size_t hole = pos;
        for (std::size_t j = (hole + 1) & mask; table_[j].id != kNil; j = (j + 1) & mask) {
            std::size_t home = hash_of(table_[j]) & mask;
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
