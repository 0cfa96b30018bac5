// A mirror of CPython's heapq (Modules/_heapqmodule.c: heappush, heappop and their sift loops),
// step for step, over a std::vector and a strict "less" that mirrors Python's < on the
// reference's heap items: the same pushes and pops leave the same items in the same slots, so
// items Python would find equal (or unordered, like a NaN) still come out in Python's order.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace kvlife::heapq {

// _siftdown: move the item at pos up towards startpos while it is less than its parent.
template <class T, class Less>
void sift_down(std::vector<T>& heap, std::size_t startpos, std::size_t pos, Less less) {
    while (pos > startpos) {
        std::size_t parentpos = (pos - 1) >> 1;
        if (!less(heap[pos], heap[parentpos])) {
            break;
        }
        std::swap(heap[pos], heap[parentpos]);
        pos = parentpos;
    }
}

// _siftup: bubble the smaller child up to the leaves from pos, then sift the item down.
template <class T, class Less>
void sift_up(std::vector<T>& heap, std::size_t pos, Less less) {
    std::size_t endpos = heap.size();
    std::size_t startpos = pos;
    std::size_t limit = endpos >> 1;
    while (pos < limit) {
        std::size_t childpos = 2 * pos + 1;
        if (childpos + 1 < endpos && !less(heap[childpos], heap[childpos + 1])) {
            childpos += 1;  // the right child, unless the left one is less
        }
        std::swap(heap[pos], heap[childpos]);
        pos = childpos;
    }
    sift_down(heap, startpos, pos, less);
}

template <class T, class Less>
void heappush(std::vector<T>& heap, T item, Less less) {
    heap.push_back(std::move(item));
    sift_down(heap, 0, heap.size() - 1, less);
}

// The heap must not be empty (Python raises IndexError; callers check first, as the reference does).
template <class T, class Less>
T heappop(std::vector<T>& heap, Less less) {
    T last = std::move(heap.back());
    heap.pop_back();
    if (heap.empty()) {
        return last;
    }
    T top = std::move(heap[0]);
    heap[0] = std::move(last);
    sift_up(heap, 0, less);
    return top;
}

}  // namespace kvlife::heapq
