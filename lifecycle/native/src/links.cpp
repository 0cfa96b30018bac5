// Mirrors Link (lifecycle/drivers/links.py): processor sharing by virtual-time bookkeeping.
#include "links.hpp"

#include <cmath>
#include <stdexcept>
#include <utility>

#include "heapq.hpp"
#include "py_repr.hpp"

namespace kvlife {

Link::Link(std::string name, double bandwidth_gb_s, double latency_ms, std::optional<double> write_bandwidth_gb_s)
    : name_(std::move(name)),
      bandwidth_gb_s_(bandwidth_gb_s),
      write_bandwidth_gb_s_(write_bandwidth_gb_s ? *write_bandwidth_gb_s : bandwidth_gb_s),
      latency_ms_(latency_ms),
      read_rate_(bandwidth_gb_s * 1e6),
      write_rate_(write_bandwidth_gb_s_ * 1e6) {
    if (!(bandwidth_gb_s > 0) || (write_bandwidth_gb_s && !(*write_bandwidth_gb_s > 0))) {
        throw std::invalid_argument("link " + name_ + ": bandwidth must be positive");
    }
    if (!(latency_ms >= 0)) {
        throw std::invalid_argument("link " + name_ + ": latency must be non-negative");
    }
}

double Link::solo_ms(double nbytes, bool write) const {
    return latency_ms_ + nbytes / (write ? write_rate_ : read_rate_);
}

void Link::start(TransferId transfer_id, double nbytes, double now, bool write) {
    if (nbytes < 0) {
        throw std::invalid_argument("link " + name_ + ": negative transfer size " + float_repr(nbytes));
    }
    advance_to(now);
    double service = nbytes / (write ? write_rate_ : read_rate_);
    heapq::heappush(active_, Entry{virtual_ + service, seq_, transfer_id}, Less{});
    seq_ += 1;
    bytes_moved_ += nbytes;
}

std::optional<Completion> Link::next_completion() const {
    std::optional<Entry> best;
    if (!waiting_.empty()) {
        best = waiting_[0];
    }
    if (!active_.empty()) {
        const Entry& top = active_[0];
        double report = drain_time(top.key) + latency_ms_;
        // (report, seq) < (best[0], best[1])
        if (!best || (!(report == best->key) ? report < best->key : top.seq < best->seq)) {
            best = Entry{report, top.seq, top.tid};
        }
    }
    if (!best) {
        return std::nullopt;
    }
    return Completion{best->key, best->tid};
}

void Link::advance(double now, std::vector<Completion>& done) {
    advance_to(now);
    while (!waiting_.empty() && waiting_[0].key <= now) {
        Entry e = heapq::heappop(waiting_, Less{});
        done.push_back(Completion{e.key, e.tid});
    }
}

std::vector<Completion> Link::advance(double now) {
    std::vector<Completion> done;
    advance(now, done);
    return done;
}

double Link::drain_time(double tag) const {
    double behind = tag - virtual_;
    double ahead = behind > 0.0 ? behind : 0.0;  // max(0.0, tag - virtual)
    return now_ + ahead * static_cast<double>(active_.size());
}

void Link::advance_to(double now) {
    if (now < now_) {
        throw std::invalid_argument("link " + name_ + ": time went backwards (" + float_repr(now) + " < " +
                                    float_repr(now_) + ")");
    }
    // A drain computed by next_completion may round an ulp past the time it reported.
    double magnitude = std::fabs(now);
    double slack = 1e-9 * (magnitude > 1.0 ? magnitude : 1.0);  // max(1.0, abs(now))
    while (!active_.empty()) {
        const Entry& top = active_[0];
        double drain = drain_time(top.key);
        if (drain > now + slack) {
            break;
        }
        Entry e = heapq::heappop(active_, Less{});
        if (now < drain) {  // min(drain, now)
            drain = now;
        }
        if (e.key > virtual_) {  // max(virtual, tag)
            virtual_ = e.key;
        }
        now_ = drain;
        heapq::heappush(waiting_, Entry{drain + latency_ms_, e.seq, e.tid}, Less{});
    }
    if (!active_.empty()) {
        virtual_ += (now - now_) / static_cast<double>(active_.size());
    }
    now_ = now;
}

}  // namespace kvlife
