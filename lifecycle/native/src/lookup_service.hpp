// A lookup service with bounded concurrency: a mirror of LookupService
// (lifecycle/drivers/lookup_service.py), K workers serving a FIFO queue, with its heaps of
// (free at, worker) and of completion times ordered as Python's heapq orders them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvlife {

// The id a lookup is submitted under; it shows only in error messages. The simulator submits
// None for a pass's sync lookups and (request_id, epoch) for an async one.
struct LookupId {
    bool is_async = false;       // false: None
    std::string_view request_id;  // async only; must outlive the submit call
    int64_t epoch = 0;            // async only

    // repr(lookup_id): "None" or "('req-1', 3)".
    std::string repr() const;
};

class LookupService {
  public:
    // ValueError (std::invalid_argument) "workers must be a positive integer, got N" /
    // "lookup latencies must be non-negative", as the reference raises them. No defaults: the
    // reference's (DEFAULT_BASE_MS, DEFAULT_PER_KEY_MS) live in Python, handed over by the bridge.
    LookupService(int64_t workers, double base_ms, double per_key_ms);

    int64_t workers() const { return workers_; }
    double base_ms() const { return base_ms_; }
    double per_key_ms() const { return per_key_ms_; }
    int64_t submitted() const { return submitted_; }
    double max_wait_ms() const { return max_wait_ms_; }

    // base_ms + per_key_ms x keys.
    double latency_ms(int64_t keys) const;
    // Queue a lookup of keys block hashes at now; when it answers. Submissions must come in
    // time order (ValueError otherwise, and on a negative key count).
    double submit(const LookupId& lookup_id, int64_t keys, double now);
    // Lookups submitted and not yet answered at now.
    std::size_t pending(double now);

  private:
    struct Free {
        double free_at;
        int64_t worker;
    };
    // Python's < on (float, int) tuples.
    struct FreeLess {
        bool operator()(const Free& a, const Free& b) const {
            if (!(a.free_at == b.free_at)) {
                return a.free_at < b.free_at;
            }
            return a.worker < b.worker;
        }
    };
    struct FinishLess {
        bool operator()(double a, double b) const { return a < b; }
    };

    int64_t workers_;
    double base_ms_;
    double per_key_ms_;
    std::vector<Free> free_;         // heap of (free at, worker)
    std::vector<double> finishes_;   // heap of completion times of submitted lookups
    double last_submit_ = 0.0;
    int64_t submitted_ = 0;
    double max_wait_ms_ = 0.0;
};

}  // namespace kvlife
