// A link shared by processor sharing: a mirror of Link (lifecycle/drivers/links.py), method for
// method, with the same doubles computed in the same order and its heaps ordered as Python's
// heapq orders the reference's tuples: (finish tag, seq, tid) and (report, seq, tid).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvlife {

// What the simulator starts on a link: one rank's share of a transfer job, (job_id, rank).
struct TransferId {
    int64_t job_id;
    int64_t rank;
};

// (t, tid): when a transfer is reported, as next_completion and advance give it.
struct Completion {
    double t;
    TransferId tid;
};

class Link {
  public:
    // ValueError (std::invalid_argument) "link NAME: bandwidth must be positive" /
    // "link NAME: latency must be non-negative", as the reference raises them.
    Link(std::string name, double bandwidth_gb_s, double latency_ms = 0.0,
         std::optional<double> write_bandwidth_gb_s = std::nullopt);

    const std::string& name() const { return name_; }
    double bandwidth_gb_s() const { return bandwidth_gb_s_; }
    double write_bandwidth_gb_s() const { return write_bandwidth_gb_s_; }
    double latency_ms() const { return latency_ms_; }
    double bytes_moved() const { return bytes_moved_; }

    // Transfers still moving bytes.
    std::size_t active() const { return active_.size(); }
    // Transfers not yet reported (moving bytes or paying latency).
    std::size_t in_flight() const { return active_.size() + waiting_.size(); }

    // latency + bytes / bandwidth.
    double solo_ms(double nbytes, bool write = false) const;
    // Begin moving nbytes at now (write: at the write bandwidth). ValueError on a negative size
    // or a time before the link's clock.
    void start(TransferId transfer_id, double nbytes, double now, bool write = false);
    // The earliest report still to come, given the transfers started so far.
    std::optional<Completion> next_completion() const;
    // Account for time up to now; append the transfers reported by then, in order, to done.
    void advance(double now, std::vector<Completion>& done);
    std::vector<Completion> advance(double now);

  private:
    struct Entry {
        double key;  // finish tag (active) or report time (waiting)
        int64_t seq;
        TransferId tid;
    };
    // Python's < on (float, int, (int, int)) tuples: the first unequal field decides.
    struct Less {
        bool operator()(const Entry& a, const Entry& b) const {
            if (!(a.key == b.key)) {
                return a.key < b.key;
            }
            if (a.seq != b.seq) {
                return a.seq < b.seq;
            }
            if (a.tid.job_id != b.tid.job_id) {
                return a.tid.job_id < b.tid.job_id;
            }
            return a.tid.rank < b.tid.rank;
        }
    };

    double drain_time(double tag) const;
    void advance_to(double now);

    std::string name_;
    double bandwidth_gb_s_;
    double write_bandwidth_gb_s_;
    double latency_ms_;
    double read_rate_;   // bytes per ms
    double write_rate_;  // bytes per ms
    double now_ = 0.0;
    double virtual_ = 0.0;  // service (exclusive ms) each active transfer has received so far
    std::vector<Entry> active_;   // heap of (finish tag, seq, tid)
    std::vector<Entry> waiting_;  // drained, paying latency: heap of (report, seq, tid)
    int64_t seq_ = 0;
    double bytes_moved_ = 0.0;
};

}  // namespace kvlife
