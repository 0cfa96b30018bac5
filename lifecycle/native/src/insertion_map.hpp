// A Python dict's iteration order for the native mirrors (used by worker_book.hpp, mirroring
// lifecycle/engine/worker_book.py's dicts): keys iterate in first-insertion order, assigning
// to a present key keeps its place, and a key erased then inserted again goes to the end.
// A hash map finds a key's node; the nodes form a doubly linked list over dense indices and
// erased nodes are reused, so a steady state allocates nothing but the hash map's nodes.
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvlife {

template <class K, class V, class Hash = std::hash<K>>
class InsertionMap {
    static constexpr uint32_t NIL = UINT32_MAX;

    struct Node {
        K key;
        V value;
        uint32_t prev;
        uint32_t next;
    };

  public:
    // (key, value) in insertion order.
    class const_iterator {
      public:
        const_iterator(const std::vector<Node>* nodes, uint32_t at) : nodes_(nodes), at_(at) {}
        std::pair<const K&, const V&> operator*() const {
            const Node& node = (*nodes_)[at_];
            return {node.key, node.value};
        }
        const_iterator& operator++() {
            at_ = (*nodes_)[at_].next;
            return *this;
        }
        bool operator!=(const const_iterator& other) const { return at_ != other.at_; }

      private:
        const std::vector<Node>* nodes_;
        uint32_t at_;
    };

    const_iterator begin() const { return const_iterator(&nodes_, head_); }
    const_iterator end() const { return const_iterator(&nodes_, NIL); }

    std::size_t size() const { return index_.size(); }
    bool empty() const { return index_.empty(); }

    V* find(const K& key) {
        auto it = index_.find(key);
        return it == index_.end() ? nullptr : &nodes_[it->second].value;
    }
    const V* find(const K& key) const {
        auto it = index_.find(key);
        return it == index_.end() ? nullptr : &nodes_[it->second].value;
    }

    // The value at ``key`` and whether it was just inserted (appended at the end). A value
    // just inserted may hold what an erased node left there (its buffers kept for reuse):
    // the caller assigns it in full.
    std::pair<V*, bool> try_emplace(const K& key) {
        auto [it, inserted] = index_.try_emplace(key, NIL);
        if (!inserted) {
            return {&nodes_[it->second].value, false};
        }
        uint32_t at;
        if (free_.empty()) {
            at = static_cast<uint32_t>(nodes_.size());
            nodes_.push_back(Node{key, V(), NIL, NIL});
        } else {
            at = free_.back();
            free_.pop_back();
            nodes_[at].key = key;
        }
        it->second = at;
        Node& node = nodes_[at];
        node.prev = tail_;
        node.next = NIL;
        if (tail_ == NIL) {
            head_ = at;
        } else {
            nodes_[tail_].next = at;
        }
        tail_ = at;
        return {&node.value, true};
    }

    // Python's ``del d[key]`` where present; false where absent.
    bool erase(const K& key) {
        auto it = index_.find(key);
        if (it == index_.end()) {
            return false;
        }
        uint32_t at = it->second;
        index_.erase(it);
        Node& node = nodes_[at];
        if (node.prev == NIL) {
            head_ = node.next;
        } else {
            nodes_[node.prev].next = node.next;
        }
        if (node.next == NIL) {
            tail_ = node.prev;
        } else {
            nodes_[node.next].prev = node.prev;
        }
        free_.push_back(at);
        return true;
    }

  private:
    std::vector<Node> nodes_;
    std::vector<uint32_t> free_;
    std::unordered_map<K, uint32_t, Hash> index_;
    uint32_t head_ = NIL;
    uint32_t tail_ = NIL;
};

}  // namespace kvlife
