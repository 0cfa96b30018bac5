// The sans-IO engine: a mirror of lifecycle/engine/core.py (Engine): the scheduler
// (Scheduler<ConnectorAPI>) and the connector core, the dispatch of each input event, the
// worker books and output aggregator of the ranks the driver plays, and what drivers read.
//
// The engine is Python's Engine(config, policies, tiers=None, recorder, reference=False,
// retire, lookups=None, record_calls=False): the connector answers no lookup itself (the
// driver's LookupAnswer inputs do) and inputs are recorded as handle() takes them.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "connector.hpp"
#include "events.hpp"
#include "scheduler.hpp"
#include "worker_book.hpp"

namespace kvlife {

class Engine {
  public:
    // ``config``: the core's part of EngineConfig; ``scheduler``: the scheduler's part.
    // ``policies``: asked at every decision; ``table``: the compiled spec table (both not
    // owned: they outlive the engine). ``recorder``: where the records go (disabled: nothing
    // is rendered). ``retire``: given each finished request as it leaves ``requests``
    // (nullptr: every request is kept).
    Engine(const CoreConfig& config, const SchedulerConfig& scheduler, PolicyAsker* policies,
           const TransitionTable& table, Trace recorder = Trace(), Retirer* retire = nullptr);
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // Apply one input event; the commands the driver must carry out (Engine.handle): the
    // engine's own buffer, valid (and movable from) until the next call.
    // std::invalid_argument ("time went backwards: ...") for an event older than ``now``.
    std::vector<Command>& handle(const InputEvent& event);
    // The same into ``out`` (its old contents dropped), reusing its buffer.
    void handle(const InputEvent& event, std::vector<Command>& out);

    // ---- what drivers and checks read -----------------------------------------------------
    const CoreConfig& config() const { return core_.state.config; }
    double now() const { return core_.state.now; }
    CoreState& state() { return core_.state; }
    const CoreState& state() const { return core_.state; }
    ConnectorCore& core() { return core_; }
    const ConnectorCore& core() const { return core_; }
    Scheduler<ConnectorAPI>& scheduler() { return scheduler_; }
    const Stats& stats() const { return core_.state.stats; }
    DeviceBlockPool& pool() { return scheduler_.pool(); }
    std::optional<std::int64_t> output_tokens(const std::string& request_id) const {
        return scheduler_.output_tokens(request_id);
    }
    bool busy() const;
    // (transitions, transfer results, free device blocks) since the start.
    std::tuple<std::int64_t, std::int64_t, std::int64_t> progress() const;
    std::optional<double> next_wakeup() { return core_.state.next_wakeup(); }
    // Every request not finished, as "id:state", in arrival order (invariant 7).
    std::vector<std::string> stranded() const;
    // state_counts["finished"]
    std::int64_t finished_count() const {
        return core_.state.state_counts[static_cast<std::size_t>(RequestState::FINISHED)];
    }
    // The simulator's last records: a driver warning "stranded" per unfinished request, in
    // arrival order (drivers/simulator.py, with a recorder); nothing when tracing is off.
    void record_stranded(double now);
    // Invariant 8 on the device and every tier; AssertionError when broken.
    void check_invariants();
    // Engine.sync_lookup: the tier of each leading block some tier holds, by name (what a
    // LookupAnswer carries); the engine's own buffer, valid until the next call.
    const std::vector<std::string>& sync_lookup(const std::vector<BlockHash>& hashes) {
        core_.state.sync_lookup(hashes.data(), hashes.size(), lookup_tiers_);
        core_.state.tier_names(lookup_tiers_, lookup_scratch_);
        return lookup_scratch_;
    }
    std::vector<WorkerBook>& workers() { return workers_; }

  private:
    void dispatch(const InputEvent& event, std::vector<Command>& commands);
    void to_workers(const ConnectorMeta& meta);
    void worker_step(std::int64_t step_id);
    void worker_done(std::int64_t job_id, std::int64_t rank, const std::vector<BlockHash>& failed);
    void on_step_output(const StepOutput& event);
    void on_abort(const Abort& event);
    void fail_step(const std::vector<BlockId>& written);  // the failed step's written blocks

    // The scheduler's block pool, as the core's quarantine holds and releases blocks.
    struct PoolHolder : BlockHolds {
        explicit PoolHolder(Engine& engine) : engine(engine) {}
        void hold_blocks(const std::vector<BlockId>& blocks) override;
        void unhold_blocks(const std::vector<BlockId>& blocks) override;
        Engine& engine;
    };

    ConnectorCore core_;
    ConnectorAPI connector_;
    Scheduler<ConnectorAPI> scheduler_;
    std::vector<WorkerBook> workers_;
    OutputAggregator aggregator_;
    PoolHolder holder_;
    struct WorkerStep {
        std::int64_t step_id;
        std::vector<std::string> holds;
        std::vector<std::int64_t> abandon;
    };
    std::deque<WorkerStep> worker_steps_;
    // Scratch reused across inputs.
    std::vector<Command> commands_;
    std::vector<std::size_t> lookup_tiers_;
    std::vector<std::string> lookup_scratch_;
    KVConnectorOutput report_output_;  // a TransferReport's connector output (one report)
    std::vector<KVOutput> taken_;
    KVOutput combined_;
    std::vector<BlockHash> hashes_scratch_;
    std::vector<std::int64_t> blocks_scratch_;
};

}  // namespace kvlife
