// The engine's inputs and commands: a mirror of lifecycle/engine/events.py, one struct per
// attrs class, with the Python field names. An input is one std::variant (InputEvent), a
// command another (Command); drivers switch on the variant's index, as the Python drivers
// switch on the event's type.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "blocks.hpp"

namespace kvlife {

// ---- inputs -------------------------------------------------------------------------------
struct Arrival {
    double t;
    std::string request_id;
    std::int64_t prompt_tokens;
    std::vector<BlockHash> block_hashes;
    bool resumable = false;
    std::optional<std::int64_t> max_tokens;
};

struct Abort {
    double t;
    std::string request_id;
};

struct Tick {
    double t;
};

struct LookupAnswer {
    double t;
    std::string request_id;
    std::int64_t epoch;
    std::optional<std::vector<std::string>> tiers;  // none: the lookup failed (a miss)
};

struct TransferReport {
    double t;
    std::int64_t job_id;
    std::int64_t rank;
    std::vector<BlockHash> failed;
};

// (job_id, rank, failed): one worker report carried by a step output.
struct StepReport {
    std::int64_t job_id;
    std::int64_t rank;
    std::vector<BlockHash> failed;
};

struct StepOutput {
    double t;
    std::int64_t step_id;
    std::vector<std::pair<std::string, std::string>> finished;  // (request_id, reason)
    std::vector<StepReport> reports;
    std::vector<std::int64_t> failed_ranks;
};

// The index order is the Python union's: Arrival | Abort | Tick | LookupAnswer | TransferReport | StepOutput.
using InputEvent = std::variant<Arrival, Abort, Tick, LookupAnswer, TransferReport, StepOutput>;

inline double event_time(const InputEvent& event) {
    return std::visit([](const auto& e) { return e.t; }, event);
}

// ---- commands -----------------------------------------------------------------------------
struct BlockMove {
    BlockHash block_hash;
    std::int64_t device_block;
    std::string tier;
    std::int64_t slot;
};

struct SubmitLookup {
    std::string request_id;
    std::int64_t epoch;
    std::vector<BlockHash> block_hashes;
};

struct DiscardLookup {
    std::string request_id;
    std::int64_t epoch;
};

struct StartLoad {
    std::int64_t job_id;
    std::string request_id;
    std::vector<BlockMove> moves;
    std::optional<std::int64_t> after;  // a join: copy what job `after` loads
};

struct StartStore {
    std::int64_t job_id;
    std::string request_id;
    std::vector<BlockMove> moves;
};

struct TierMove {
    BlockHash block_hash;
    std::string src_tier;
    std::int64_t src_slot;
    std::string dst_tier;
    std::int64_t dst_slot;
};

struct StartPrefetch {
    std::int64_t job_id;
    std::string request_id;
    std::vector<TierMove> moves;
};

struct FreeBlocks {
    std::vector<std::int64_t> device_blocks;
};

struct SchedRequest;

// One request's share of a step (events.Scheduled).
struct Scheduled {
    std::string request_id;
    std::int64_t num_tokens;
    std::int64_t computed_before;
    bool samples;
    std::vector<BlockId> block_table;
    std::vector<BlockHash> block_hashes;
    // The native scheduler's record of the request, which the scheduler's own step holds until
    // the step's output is taken (so a driver may read it at the step's end instead of looking
    // the id up); null in a plan that came from the Python engine.
    SchedRequest* owner = nullptr;

    // The request's id: the owner's where there is one (request_id may then be left empty).
    const std::string& id() const;
};

// One scheduler pass's step (events.StepPlan).
struct StepPlan {
    std::int64_t step_id;
    std::vector<Scheduled> entries;
    std::int64_t sync_lookups;
    std::vector<std::int64_t> sync_lookup_keys;
    std::vector<std::int64_t> flush;
};

// The index order is the Python union's:
// SubmitLookup | DiscardLookup | StartLoad | StartStore | StartPrefetch | FreeBlocks | StepPlan.
using Command = std::variant<SubmitLookup, DiscardLookup, StartLoad, StartStore, StartPrefetch, FreeBlocks, StepPlan>;

}  // namespace kvlife
