// Mirrors LookupService (lifecycle/drivers/lookup_service.py): FIFO over K workers, each lookup
// taking base + per-key x keys, its completion decided when it is submitted.
#include "lookup_service.hpp"

#include <stdexcept>

#include "heapq.hpp"
#include "py_repr.hpp"

namespace kvlife {

std::string LookupId::repr() const {
    if (!is_async) {
        return "None";
    }
    return "(" + str_repr(request_id) + ", " + std::to_string(epoch) + ")";
}

LookupService::LookupService(int64_t workers, double base_ms, double per_key_ms)
    : workers_(workers), base_ms_(base_ms), per_key_ms_(per_key_ms) {
    if (workers < 1) {
        throw std::invalid_argument("workers must be a positive integer, got " + std::to_string(workers));
    }
    if (!(base_ms >= 0) || !(per_key_ms >= 0)) {
        throw std::invalid_argument("lookup latencies must be non-negative");
    }
    free_.reserve(static_cast<std::size_t>(workers));
    for (int64_t w = 0; w < workers; ++w) {  // [(0.0, w) for w in range(workers)]: already a heap
        free_.push_back(Free{0.0, w});
    }
}

double LookupService::latency_ms(int64_t keys) const {
    return base_ms_ + per_key_ms_ * static_cast<double>(keys);
}

double LookupService::submit(const LookupId& lookup_id, int64_t keys, double now) {
    if (now < last_submit_) {
        throw std::invalid_argument("lookup " + lookup_id.repr() + " submitted at " + float_repr(now) +
                                    " after one at " + float_repr(last_submit_));
    }
    if (keys < 0) {
        throw std::invalid_argument("lookup " + lookup_id.repr() + ": negative key count " + std::to_string(keys));
    }
    last_submit_ = now;
    Free slot = heapq::heappop(free_, FreeLess{});
    double begin = slot.free_at > now ? slot.free_at : now;  // max(now, free_at)
    double done = begin + latency_ms(keys);
    heapq::heappush(free_, Free{done, slot.worker}, FreeLess{});
    while (!finishes_.empty() && finishes_[0] <= now) {  // answered already: kept no longer
        heapq::heappop(finishes_, FinishLess{});
    }
    heapq::heappush(finishes_, done, FinishLess{});
    submitted_ += 1;
    double wait = begin - now;
    if (wait > max_wait_ms_) {  // max(max_wait_ms, begin - now)
        max_wait_ms_ = wait;
    }
    return done;
}

std::size_t LookupService::pending(double now) {
    while (!finishes_.empty() && finishes_[0] <= now) {
        heapq::heappop(finishes_, FinishLess{});
    }
    return finishes_.size();
}

}  // namespace kvlife
