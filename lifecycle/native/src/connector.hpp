// The connector core: a mirror of lifecycle/engine/connector.py (ConnectorCore, StepInfo,
// NextChunk, ConnectorMeta), call for call, over the kernel (core_state.hpp's CoreState,
// core_lifecycle.hpp's Lifecycle, jobs.hpp's Transfers). Its scheduler-facing adapter
// (connector_api.py's ConnectorAPI, as the engine configures it: no lookup client, no input
// recording, no hash refresh) is ConnectorAPI below: it satisfies Scheduler<Connector>.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core_lifecycle.hpp"
#include "core_request.hpp"
#include "core_state.hpp"
#include "events.hpp"
#include "jobs.hpp"
#include "scheduler.hpp"

namespace kvlife {

// What build_connector_meta reads of vLLM's SchedulerOutput (connector.StepInfo). Its request
// ids and block ids point into the caller's SchedulerOutput, which outlives the call.
struct StepInfo {
    std::int64_t step_id = 0;
    struct Entry {
        const std::string* request_id;
        std::int64_t before;
        std::int64_t tokens;
        // The scheduler's handle to the request's core record (null: none given); a live,
        // listed record is the one a lookup by id finds, else the lookup is made.
        const std::weak_ptr<Request>* record = nullptr;
    };
    std::vector<Entry> scheduled;  // in scheduler order
    struct NewBlocks {
        const std::string* request_id;
        const std::vector<BlockId>* ids;
        bool replace;
    };
    std::vector<NewBlocks> new_blocks;  // a dict in Python: first assignment's order, one per request
    std::vector<const std::string*> preempted;  // sorted, no repeats

    void clear() {
        scheduled.clear();
        new_blocks.clear();
        preempted.clear();
    }
};

// A resumable request's next input chunk (connector.NextChunk).
struct NextChunk {
    std::int64_t prompt_tokens;
    std::vector<BlockHash> hashes;
    std::optional<std::int64_t> max_tokens;
    std::int64_t computed_tokens;
};

// What the workers do for one step (connector.ConnectorMeta). The jobs are the core's own
// (shared with CoreState.jobs / prefetches, as Python shares the objects).
struct ConnectorMeta {
    std::int64_t step_id = 0;
    std::vector<JobPtr> loads;
    std::vector<JobPtr> stores;
    std::vector<PrefetchJobPtr> prefetches;
    std::vector<std::int64_t> flush;
    std::vector<std::int64_t> abandon;
    std::vector<std::string> hold_finished;
    std::vector<std::int64_t> sync_lookup_keys;
};

class ConnectorCore {
  public:
    ConnectorCore(const CoreConfig& config, PolicyAsker* policies, const TransitionTable& table,
                  Trace recorder = Trace(), Retirer* retire = nullptr);

    CoreState state;
    Lifecycle lifecycle;
    Transfers transfers;
    // The jobs engine.transfer_deadline_ms gives up on (deadline_kinds: the engine's are
    // loads and stores).
    bool deadline_loads = true;
    bool deadline_stores = true;
    // Requests preempted outside schedule() whose preemption was taken in this pass.
    std::unordered_set<std::string> preempted_early;

    const CoreConfig& config() const { return state.config; }

    std::vector<Command> take_commands();
    void take_commands(std::vector<Command>& out);

    void tick(double now);
    CoreRequestPtr on_new_request(const std::string& request_id, std::int64_t prompt_tokens,
                              const HashList& block_hashes, std::optional<std::int64_t> max_tokens,
                              bool resumable, bool early);
    // A request that only arrived (Request::only_arrived) and that nothing else refers to goes
    // dormant while it waits: its record is dropped, its place in state.requests kept (holding
    // no record), and what wake needs to rebuild the record is returned. nullopt: it stays.
    // No call may name a dormant request until wake has given its record back.
    std::optional<DormantCore> doze(const std::string& request_id);
    CoreRequestPtr wake(const std::string& request_id, std::int64_t prompt_tokens, const HashList& block_hashes,
                        std::optional<std::int64_t> max_tokens, bool resumable, DormantCore&& dormant);
    bool is_dormant(const std::string& request_id) const;  // in state.requests, holding no record
    std::pair<std::optional<std::int64_t>, bool> get_num_new_matched_tokens(const std::string& request_id,
                                                                             std::int64_t num_computed_tokens);
    void update_state_after_alloc(const std::string& request_id, const std::vector<BlockId>& block_ids,
                                  std::int64_t num_external_tokens, const NextChunk* chunk = nullptr);
    ConnectorMeta build_connector_meta(const StepInfo& step);
    void update_connector_output(const std::vector<TransferReport>& reports,
                                 const std::vector<std::string>& finished_sending);
    bool request_finished(const std::string& request_id, std::string_view reason,
                          std::optional<std::string> why = std::nullopt);
    void take_events();
    void on_lookup_answer(const std::string& request_id, std::int64_t epoch,
                          const std::optional<std::vector<std::string>>& tiers);
    std::optional<std::string> pending_reason(const std::string& request_id) const;
    void retire_finished();

    Request* find(const std::string& request_id) const;  // state.requests.get(rid)
    Request& get(const std::string& request_id) const;   // state.requests[rid]: KeyError
    TierIndex* tier_or_null(std::string_view name);      // state.tiers.get(name)

  private:
    CoreRequestPtr new_record(const std::string& request_id, std::int64_t seq, double arrival_ms,
                              std::int64_t prompt_tokens, HashList hashes, std::optional<std::int64_t> max_tokens,
                              bool resumable) const;
    // _plan(req, candidates, start) into plan_ (candidates: req.hashes[:n]).
    void plan(Request& req, std::size_t n, std::int64_t start);
    void record_reuse(Request& req, std::size_t n);
    void preempt(Request& req, std::string_view why = "out of device blocks: the scheduler preempted it");
    void preempted_outside(Request& req);
    void next_chunk(Request& req, const std::vector<BlockId>& block_ids, const NextChunk& chunk);
    void hold(Request& req);
    void confirm_finishing_step(Request& req);
    void finish(Request& req, Trigger trigger, std::string_view reason, std::string_view why, bool hold = false);
    void confirm(Request& req, std::int64_t before, std::int64_t n, bool samples);
    void submit_lookup(Request& req, std::string_view reason);
    void expire_lookups();

    std::vector<std::pair<BlockHash, std::size_t>> plan_;  // scratch (Request::plan's form)
    LoadView view_;                                       // scratch
    std::vector<StepChunk> prompt_chunks_;                // scratch: a step record's "prompt"
    std::vector<StepChunk> fills_;                        // scratch: its "fills"
    std::vector<std::vector<StepEntry>> spare_entries_;   // steps' entry lists taken, for reuse
};

// connector_api.ConnectorAPI(core, clock=lambda: core.state.now, lookups=None,
// record_inputs=False, refresh_hashes=False): the calls Scheduler<ConnectorAPI> makes.
class ConnectorAPI {
  public:
    explicit ConnectorAPI(ConnectorCore& core) : core(core) {}

    ConnectorCore& core;
    std::int64_t passes = 0;
    std::int64_t builds = 0;

    void begin_pass() { pass(); }
    void begin_output() {}
    void take_events() { core.take_events(); }
    void on_new_request(SchedRequest& request, bool early);
    using Dormant = DormantCore;
    std::optional<DormantCore> doze(const SchedRequest& request);
    void wake(SchedRequest& request, DormantCore&& dormant);
    bool is_dormant(const std::string& request_id) const;
    bool request_finished(SchedRequest& request, const std::vector<BlockId>& blocks);
    std::pair<std::optional<std::int64_t>, bool> get_num_new_matched_tokens(SchedRequest& request,
                                                                             std::int64_t num_computed_tokens);
    void update_state_after_alloc(SchedRequest& request, const std::vector<BlockId>& blocks, std::int64_t external);
    ConnectorMeta build_connector_meta(const SchedulerOutput& output);
    void update_connector_output(const KVConnectorOutput& output);
    bool knows(const std::string& request_id) const;
    void warn_duplicate_arrival(const std::string& request_id);
    void freed(const std::vector<BlockId>& blocks);

  private:
    void pass();
    bool in_pass_ = false;
    std::vector<TransferReport> reports_scratch_;
    std::vector<std::string> sending_scratch_;
    StepInfo step_;  // scratch
};

}  // namespace kvlife
