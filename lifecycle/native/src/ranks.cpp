// A mirror of lifecycle/engine/ranks.py (RankAggregator.open, in_flight, close, missing_ranks,
// report), statement for statement.
#include "ranks.hpp"

#include <algorithm>

namespace kvlife {

const char* report_status_value(ReportStatus status) {
    switch (status) {
        case ReportStatus::PENDING:
            return "pending";
        case ReportStatus::DONE:
            return "done";
        case ReportStatus::DUPLICATE:
            return "duplicate";
        case ReportStatus::UNKNOWN_JOB:
            return "unknown_job";
        case ReportStatus::BAD_RANK:
            return "bad_rank";
    }
    return "";
}

RankAggregator::RankAggregator(int64_t world_size) : world_size_(world_size) {
    if (world_size < 1) {
        throw std::invalid_argument("world_size must be >= 1, got " + std::to_string(world_size));
    }
}

void RankAggregator::open(int64_t job_id) {
    auto [it, inserted] = jobs_.try_emplace(job_id, 0);
    if (!inserted) {
        throw AssertionError("job " + std::to_string(job_id) + " opened twice");
    }
    uint32_t at;
    if (free_.empty()) {
        at = static_cast<uint32_t>(slots_.size());
        slots_.emplace_back();
    } else {
        at = free_.back();
        free_.pop_back();
    }
    it->second = at;
    Pending& pending = slots_[at];
    pending.reported.assign(static_cast<std::size_t>(world_size_), 0);
    pending.failed.clear();
    pending.remaining = world_size_;
}

bool RankAggregator::in_flight(int64_t job_id) const { return jobs_.count(job_id) != 0; }

void RankAggregator::close(int64_t job_id) {
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) {
        free_.push_back(it->second);
        jobs_.erase(it);
    }
}

std::vector<int64_t> RankAggregator::missing_ranks(int64_t job_id) const {
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
        throw KeyError(job_id);
    }
    std::vector<int64_t> missing;
    int64_t rank = 0;
    for (uint8_t done : slots_[it->second].reported) {
        if (!done) {
            missing.push_back(rank);
        }
        ++rank;
    }
    return missing;
}

ReportOutcome RankAggregator::report(int64_t job_id, int64_t rank, const std::vector<BlockHash>& failed) {
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
        return ReportOutcome{ReportStatus::UNKNOWN_JOB, {}};
    }
    if (!(0 <= rank && rank < world_size_)) {
        return ReportOutcome{ReportStatus::BAD_RANK, {}};
    }
    Pending& pending = slots_[it->second];
    uint8_t& reported = pending.reported[static_cast<std::size_t>(rank)];
    if (reported) {
        return ReportOutcome{ReportStatus::DUPLICATE, {}};
    }
    reported = 1;
    pending.failed.insert(pending.failed.end(), failed.begin(), failed.end());
    pending.remaining -= 1;
    if (pending.remaining != 0) {
        return ReportOutcome{ReportStatus::PENDING, {}};
    }
    free_.push_back(it->second);
    jobs_.erase(it);
    // Python's tuple(sorted(set)): the union, ascending.
    std::sort(pending.failed.begin(), pending.failed.end());
    pending.failed.erase(std::unique(pending.failed.begin(), pending.failed.end()), pending.failed.end());
    return ReportOutcome{ReportStatus::DONE, std::move(pending.failed)};
}

}  // namespace kvlife
