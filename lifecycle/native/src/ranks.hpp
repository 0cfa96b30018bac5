// Per-rank transfer reports folded into one outcome per job: a mirror of RankAggregator,
// ReportStatus and ReportOutcome (lifecycle/engine/ranks.py).
//
// A job is done only when each of ``world_size`` ranks has reported it exactly once; the failed
// blocks are the union over ranks, sorted, and come out with the completion. A duplicate or
// unknown report, or a rank outside 0..world_size-1, is a status, not an error.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "errors.hpp"

namespace kvlife {

using BlockHash = int64_t;  // Python's block hashes are ints below 2**63

// The members in Python's order; ``report_status_value`` gives each one's Python value.
enum class ReportStatus { PENDING, DONE, DUPLICATE, UNKNOWN_JOB, BAD_RANK };

const char* report_status_value(ReportStatus status);

struct ReportOutcome {
    ReportStatus status;
    std::vector<BlockHash> failed;  // union over ranks, sorted ascending, no repeats; set when DONE
};

class RankAggregator {
  public:
    // std::invalid_argument ("world_size must be >= 1, got N") below 1.
    explicit RankAggregator(int64_t world_size);

    // AssertionError ("job N opened twice") where the job is in flight already.
    void open(int64_t job_id);
    bool in_flight(int64_t job_id) const;
    // Stop waiting for a job's reports: a later report for it is UNKNOWN_JOB.
    void close(int64_t job_id);
    // The ranks yet to report, ascending; KeyError for a job not in flight.
    std::vector<int64_t> missing_ranks(int64_t job_id) const;
    ReportOutcome report(int64_t job_id, int64_t rank, const std::vector<BlockHash>& failed);

    int64_t world_size() const { return world_size_; }

  private:
    struct Pending {
        std::vector<uint8_t> reported;  // per rank
        std::vector<BlockHash> failed;  // as reported, repeats and all, until the job is done
        int64_t remaining;
    };

    int64_t world_size_;
    // Jobs in flight, by id, as slots into ``slots_`` (reused, with their buffers): no order
    // of jobs is ever observed, as in Python, where the dict is only looked up.
    std::unordered_map<int64_t, uint32_t> jobs_;
    std::vector<Pending> slots_;
    std::vector<uint32_t> free_;
};

}  // namespace kvlife
