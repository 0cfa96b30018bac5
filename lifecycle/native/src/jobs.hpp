// Transfer jobs: a mirror of lifecycle/engine/jobs.py's Transfers (every method, the same names,
// the same records, warnings, counters and errors) and its _underivable, on CoreState, Lifecycle,
// the native TierIndex and RankAggregator.
//
// The hold/unhold hooks (Python's ``hold_blocks``/``unhold_blocks`` callables, None by default)
// are one small interface, ``BlockHolds``: nullptr for None. They are called only for jobs given
// up at a deadline and for joins (quarantine), never in the hot path.
//
// Python's ``kinds`` tuple of expire_jobs is two flags (loads, stores).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core_lifecycle.hpp"
#include "core_request.hpp"
#include "core_state.hpp"
#include "events.hpp"
#include "records.hpp"

namespace kvlife {

// The scheduler's block pool, for the quarantine of jobs given up at a deadline.
class BlockHolds {
  public:
    virtual ~BlockHolds() = default;
    virtual void hold_blocks(const std::vector<BlockId>& blocks) = 0;
    virtual void unhold_blocks(const std::vector<BlockId>& blocks) = 0;
};

// jobs._underivable(req, range(start, stop), among): blocks of req at those positions past its
// prompt (of hashes ``among``, when given) whose names are not derived_block_hash's: hash -> position.
Positions underivable(const Request& req, std::int64_t start, std::int64_t stop,
                      const std::vector<BlockHash>* among = nullptr);

class Transfers {
  public:
    Transfers(CoreState& state, Lifecycle& lifecycle) : state(state), lifecycle(lifecycle) {}

    CoreState& state;
    Lifecycle& lifecycle;
    BlockHolds* holds = nullptr;  // hold_blocks / unhold_blocks; nullptr: None (no quarantine)

    // ---- device loads and stores ----
    JobPtr start_load(Request& req, const std::vector<BlockMove>& moves, std::optional<std::int64_t> after = std::nullopt);
    void maybe_store(Request& req);
    void observe_job(Request& req, std::int64_t job_id, JobKind kind, const std::vector<BlockMove>& moves);
    void flush_stores(Request& req);

    // ---- reports ----
    void on_report(const TransferReport& event);
    void on_transfer_report(const TransferReport& event);
    void on_late_report(const TransferReport& event);
    void release_job(Job& job, const std::vector<BlockHash>& failed);
    void job_outcome(Job& job, const std::vector<BlockHash>& failed, const std::optional<std::string>& cause = std::nullopt);
    void load_finished(Request& req, const std::optional<std::string>& cause = std::nullopt);
    void give_up(Job& job, const std::string& note, const std::string& cause);
    void expire_jobs(double deadline, bool loads = true, bool stores = true);
    void reclaim_jobs(double deadline);

    // ---- prefetch ----
    void start_prefetch(Request& req);
    void on_prefetch_report(const TransferReport& event);
    bool prefetch_gate(Request& req);

  private:
    // _report: the job's failed blocks once every rank reported it (sorted, unique); none otherwise.
    bool report(const TransferReport& event, std::vector<BlockHash>& failed);
    void failed(const Job& job, const std::vector<BlockHash>& failed);  // _failed
    void stop_bringing(const Job& job);                                  // _stop_bringing
    void reclaim(std::int64_t job_id, std::string_view op, std::string_view rid, const std::vector<std::int64_t>& missing,
                 std::int64_t blocks, const std::string& silent, double deadline);  // _reclaim

    // {h: i for i, h in enumerate(hashes)}: the last position of each hash, as sorted (hash,
    // position) pairs whose room is reused (a hash map would allocate a node per hash).
    class LastPositions {
      public:
        void index(const BlockHash* hashes, std::size_t n) {
            pairs_.clear();
            for (std::size_t i = 0; i < n; ++i) pairs_.emplace_back(hashes[i], static_cast<std::int64_t>(i));
            std::sort(pairs_.begin(), pairs_.end());
        }
        // The last position of ``h``; -1 if it is not there.
        std::int64_t last(BlockHash h) const {
            auto after = std::upper_bound(pairs_.begin(), pairs_.end(),
                                          std::pair<BlockHash, std::int64_t>{h, std::numeric_limits<std::int64_t>::max()});
            return after == pairs_.begin() || std::prev(after)->first != h ? -1 : std::prev(after)->second;
        }

      private:
        std::vector<std::pair<BlockHash, std::int64_t>> pairs_;
    };

    std::vector<BlockHash> failed_;  // report()'s result
    LastPositions positions_;        // scratch
};

}  // namespace kvlife
