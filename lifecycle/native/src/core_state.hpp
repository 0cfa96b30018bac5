// What the connector core knows: a mirror of lifecycle/engine/state.py (Job, PrefetchJob, Stats,
// CoreState with every slot of its __slots__, the same names; moves_record and count_tiers live
// in records.hpp's Trace::job, the one place that renders them).
//
// Orders kept as Python keeps them: every dict whose iteration (or popitem) order can show is an
// OrderedDict (ordered_dict.hpp); deques are std::deque. Jobs, prefetches and requests are held by
// std::shared_ptr: Python shares the one object between ``jobs`` and ``out_loads``, ``prefetches``
// and ``prefetch_waits``, ``requests`` and ``held``/``retiring``/``steps``.
//
// Not mirrored: the ``reference`` slot (python-statemachine double checks: an engine with
// reference=True stays Python); ``recorder`` is a Trace sink (records.hpp), disabled for None;
// ``retire`` a Retirer interface, nullptr for None.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "blocks.hpp"
#include "core_request.hpp"
#include "events.hpp"
#include "ordered_dict.hpp"
#include "ranks.hpp"
#include "records.hpp"
#include "tier_index.hpp"

namespace kvlife {

// One tier of EngineConfig.tiers as the core builds its TierIndex (config.TierConfig).
struct CoreTierConfig {
    std::string name;
    std::int64_t capacity_blocks;
    std::string eviction = "lru";
};

// The fields of lifecycle/config.py EngineConfig the connector core reads (state.config.X).
struct CoreConfig {
    std::int64_t block_tokens = 512;
    std::int64_t ranks = 1;  // EngineConfig.ranks (resolved)
    std::optional<double> transfer_deadline_ms;
    double lookup_deadline_ms = 5000.0;
    double reclaim_deadline_ms = 480000.0;
    std::int64_t max_async_lookups = 1024;
    std::string kv_load_failure_policy = "recompute";
    std::vector<CoreTierConfig> tiers;  // in lookup order (host, disk, remote)
};

enum class JobKind : std::uint8_t { LOAD, STORE };
std::string_view job_kind_name(JobKind kind);  // "load", "store"

struct Job {
    std::int64_t job_id;
    JobKind kind;
    std::string request_id;
    std::int64_t epoch;  // the request's epoch it was started for
    std::vector<BlockMove> moves;
    double started_ms;
    std::optional<std::int64_t> after;  // a join: copies the device blocks job ``after`` fills
    bool timed_out = false;
    bool flushed = false;
    bool abandoned = false;
};
using JobPtr = std::shared_ptr<Job>;

struct PrefetchJob {
    std::int64_t job_id;
    std::string request_id;
    std::int64_t epoch;
    std::vector<TierMove> moves;
    double started_ms;
    double deadline_ms;  // started_ms + the patience the policy chose
    std::string patience_policy;
    bool deferred = false;
    bool abandoned = false;
};
using PrefetchJobPtr = std::shared_ptr<PrefetchJob>;

// state.Stats: every counter, and the two dicts in insertion order.
struct Stats {
    std::int64_t ticks = 0;
    std::int64_t steps = 0;
    std::int64_t sync_lookups = 0;
    std::int64_t async_lookups = 0;
    std::int64_t stale_lookup_answers = 0;
    std::int64_t failed_lookups = 0;
    std::int64_t loads = 0;
    std::int64_t blocks_loaded = 0;
    std::int64_t redundant_block_loads = 0;
    std::int64_t joined_blocks = 0;
    std::int64_t stores = 0;
    std::int64_t blocks_stored = 0;
    std::int64_t failed_blocks = 0;
    std::int64_t failed_loads = 0;
    std::int64_t failed_stores = 0;
    std::int64_t preemptions = 0;
    OrderedDict<std::string, std::int64_t> deferrals;  // policy -> admissions it deferred
    OrderedDict<std::string, std::int64_t> warnings;   // what -> warnings
    std::int64_t rank_timeouts = 0;
    std::int64_t duplicate_lookups = 0;
    std::int64_t prefetches = 0;
    std::int64_t blocks_prefetched = 0;
    std::int64_t prefetch_waits = 0;
    std::int64_t prefetch_gave_up = 0;
    std::int64_t expired_lookups = 0;
    std::int64_t reclaimed_jobs = 0;
    std::int64_t late_reports = 0;
    std::int64_t flushed_stores = 0;
};

// state.StepEntry: (request, its epoch then, tokens computed before, tokens, samples).
struct StepEntry {
    CoreRequestPtr req;
    std::int64_t epoch;
    std::int64_t computed_before;
    std::int64_t num_tokens;
    bool samples;
};

// One of in_flight_loads' (job, block, req): a load bringing a hash, oldest first.
struct Bringing {
    std::int64_t job_id;
    std::int64_t device_block;
    std::string request_id;
};

// One of lookup_timers' (due, request id, its async_lookups count then).
struct LookupTimer {
    double due;
    std::string request_id;
    std::int64_t async_lookups;
};

// state.Retire: given a finished request as it leaves the engine (CoreState.retire).
class Retirer {
  public:
    virtual ~Retirer() = default;
    virtual void retire(const Request& req) = 0;
};

class CoreState {
  public:
    // tiers: built from config.tiers (TierIndex(name, capacity_blocks, eviction)), in order.
    explicit CoreState(CoreConfig config, Trace recorder = Trace(), Retirer* retire = nullptr);

    CoreConfig config;
    // The tier cascade in lookup order; tier(name) is Python's state.tiers[name].
    std::vector<TierIndex> tiers;
    RankAggregator ranks;
    Trace recorder;  // disabled: record nothing
    double now = 0.0;

    OrderedDict<std::string, CoreRequestPtr> requests;
    // Into requests and out of it, each record's listed flag kept (Request::listed).
    void list_request(const std::string& request_id, CoreRequestPtr req) {
        req->listed = true;
        requests.set(request_id, std::move(req));
    }
    void unlist_request(const std::string& request_id, Request& req) {
        req.listed = false;
        requests.erase(request_id);
    }
    std::array<std::int64_t, kNumStates> state_counts{};  // by RequestState (TABLE.states order)
    OrderedDict<std::int64_t, JobPtr> jobs;                // device loads and stores, in start order
    OrderedDict<BlockHash, std::vector<Bringing>> in_flight_loads;
    std::deque<std::pair<std::int64_t, std::vector<StepEntry>>> steps;  // (step id, entries), oldest first
    OrderedDict<std::int64_t, PrefetchJobPtr> prefetches;
    OrderedDict<std::string, PrefetchJobPtr> prefetch_waits;  // rid -> the prefetch it waits for
    OrderedDict<std::string, std::int64_t> wants_prefetch;    // rid -> epoch whose answer starts one
    OrderedDict<std::string, std::int64_t> sync_lookup_version;
    std::int64_t transfer_version = 0;
    std::deque<LookupTimer> lookup_timers;
    OrderedDict<std::int64_t, std::vector<std::int64_t>> reclaimed;  // job -> ranks whose report may come (a set)
    Stats stats;
    std::vector<Command> commands;
    std::int64_t next_job_id = 0;
    std::int64_t next_seq = 0;
    std::vector<JobPtr> out_loads;
    std::vector<JobPtr> out_stores;
    std::vector<PrefetchJobPtr> out_prefetches;
    std::vector<std::int64_t> out_flush;
    std::vector<std::int64_t> out_abandon;
    std::vector<std::string> out_holds;
    std::vector<std::int64_t> sync_keys;
    Retirer* retire = nullptr;
    OrderedDict<std::string, std::int64_t> retired;     // id -> epoch at the end
    OrderedDict<std::string, CoreRequestPtr> retiring;  // finished, still referred to
    OrderedDict<std::int64_t, std::vector<BlockId>> held_blocks;  // job id -> blocks the core holds
    OrderedDict<std::string, NoValue> given_up_loads;              // a set of request ids
    OrderedDict<std::string, CoreRequestPtr> held;                 // finished, blocks held until finished_sending
    std::int64_t moves = 0;
    bool observing = false;

    // state.tiers[name]: KeyError when no tier has that name.
    TierIndex& tier(std::string_view name);
    const TierIndex& tier(std::string_view name) const;
    // A tier's position in ``tiers`` (how a lookup and a plan name it).
    std::size_t position(const TierIndex& tier) const { return static_cast<std::size_t>(&tier - tiers.data()); }

    std::int64_t new_job_id();
    // hit_candidates(req) is req.hashes[:n]: returns n (ensuring the hashes first).
    std::size_t hit_candidates(Request& req);
    void ensure_hashes(Request& req, std::int64_t blocks);
    // sync_lookup(hashes): the tier of each leading block some tier holds (the first that holds
    // it, as its position in ``tiers``), into ``found``
    // (cleared first; its buffers are reused).
    void sync_lookup(const BlockHash* hashes, std::size_t n, std::vector<std::size_t>& found) const;
    // The names of the tiers at ``positions`` (a lookup's), into ``names`` (cleared first).
    void tier_names(const std::vector<std::size_t>& positions, std::vector<std::string>& names) const;
    std::int64_t arrived() const;
    bool busy() const;
    // next_wakeup(): none for Python's None. Drops dead lookup timers from the front (as Python does).
    std::optional<double> next_wakeup();
    bool lookup_timer_live(const LookupTimer& timer) const;  // _lookup_timer_live
    std::vector<CoreRequestPtr> unfinished() const;          // in arrival order
};

}  // namespace kvlife
