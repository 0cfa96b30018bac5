// The connector core: a mirror of lifecycle/engine/connector.py (ConnectorCore) and of the
// scheduler-facing part of lifecycle/engine/connector_api.py (ConnectorAPI as the engine
// builds it). Comments name the Python they mirror where the order of things matters.
#include "connector.hpp"

#include <algorithm>
#include <utility>

#include <cstdio>

#include "errors.hpp"
#include "py_repr.hpp"

namespace kvlife {

namespace {

// f"{x:g}" of a Python float (C's %g formats as Python's "g" does, inf and nan included).
std::string fmt_g(double x) {
    char buf[64];
    int n = std::snprintf(buf, sizeof buf, "%g", x);
    return std::string(buf, static_cast<std::size_t>(n));
}

// str(sorted(ints)) of a list of ints: "[1, 2]".
std::string int_list_repr(const std::vector<std::int64_t>& values) {
    std::string out = "[";
    for (std::size_t i = 0; i < values.size(); ++i) {
        if (i) out += ", ";
        out += std::to_string(values[i]);
    }
    return out + "]";
}

const std::string* as_str(const AnswerValue& value) { return std::get_if<std::string>(&value); }

bool is_str(const AnswerValue& value, std::string_view s) {
    const std::string* v = as_str(value);
    return v != nullptr && *v == s;
}

// Python's bool(value) of a hook's answer.
// Python's a // b for b > 0.
std::int64_t floordiv(std::int64_t a, std::int64_t b) {
    std::int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

bool truthy(const AnswerValue& value) {
    switch (value.index()) {
        case 1: return std::get<bool>(value);
        case 2: return std::get<std::int64_t>(value) != 0;
        case 3: return std::get<double>(value) != 0.0;
        case 4: return !std::get<std::string>(value).empty();
        default: return false;
    }
}

}  // namespace

ConnectorCore::ConnectorCore(const CoreConfig& config, PolicyAsker* policies, const TransitionTable& table,
                             Trace recorder, Retirer* retire)
    : state(config, recorder, retire), lifecycle(state, policies, table), transfers(state, lifecycle) {}

Request* ConnectorCore::find(const std::string& request_id) const {
    const CoreRequestPtr* found = state.requests.find(request_id);
    return found == nullptr ? nullptr : found->get();
}

Request& ConnectorCore::get(const std::string& request_id) const {
    const CoreRequestPtr* found = state.requests.find(request_id);
    if (found == nullptr) {
        throw KeyError(str_repr(request_id));
    }
    if (!*found) {  // (a bug, not an input: doze's callers wake a request before naming it)
        throw std::logic_error("request " + str_repr(request_id) + " is dormant: no record until it is woken");
    }
    return **found;
}

TierIndex* ConnectorCore::tier_or_null(std::string_view name) {
    for (TierIndex& tier : state.tiers) {
        if (tier.name == name) return &tier;
    }
    return nullptr;
}

std::vector<Command> ConnectorCore::take_commands() {
    std::vector<Command> commands;
    commands.swap(state.commands);
    return commands;
}

void ConnectorCore::take_commands(std::vector<Command>& out) {
    out.clear();
    out.swap(state.commands);
}

// ---- the clock --------------------------------------------------------------------------------
void ConnectorCore::tick(double now) {
    state.now = now;
    state.stats.ticks += 1;
    if (!state.lookup_timers.empty() && state.lookup_timers.front().due <= now) {
        expire_lookups();
    }
    const CoreConfig& config = state.config;
    if (config.transfer_deadline_ms.has_value()) {
        transfers.expire_jobs(*config.transfer_deadline_ms, deadline_loads, deadline_stores);
    }
    if (!state.jobs.empty() || !state.prefetches.empty()) {
        transfers.reclaim_jobs(config.reclaim_deadline_ms);
    }
}

// ---- vLLM: on_new_request ---------------------------------------------------------------------
CoreRequestPtr ConnectorCore::on_new_request(const std::string& request_id, std::int64_t prompt_tokens,
                                         const HashList& block_hashes,
                                         std::optional<std::int64_t> max_tokens, bool resumable, bool early) {
    if (state.requests.contains(request_id) || state.retired.contains(request_id)) {
        lifecycle.warn("duplicate_arrival", {Field("req", request_id)});
        return nullptr;
    }
    std::size_t keep = static_cast<std::size_t>(std::max<std::int64_t>(0, prompt_tokens / state.config.block_tokens));
    CoreRequestPtr req = new_record(request_id, state.next_seq, state.now, prompt_tokens,
                                    HashList(block_hashes, std::min(keep, block_hashes.size())), max_tokens, resumable);
    state.next_seq += 1;
    state.list_request(request_id, req);
    state.state_counts[static_cast<std::size_t>(RequestState::WAITING)] += 1;
    if (early && !state.tiers.empty() && state.hit_candidates(*req) > 0) {
        const AnswerValue& action = lifecycle.ask(*req, Hook::ON_ARRIVAL);
        bool lookup = is_str(action, "lookup");
        bool prefetch = is_str(action, "prefetch");
        if (lookup || prefetch) {
            if (prefetch) {
                state.wants_prefetch.set(request_id, req->epoch);
            }
            submit_lookup(*req, lookup ? "early lookup at arrival" : "early prefetch at arrival");
        }
    }
    return req;
}

CoreRequestPtr ConnectorCore::new_record(const std::string& request_id, std::int64_t seq, double arrival_ms,
                                         std::int64_t prompt_tokens, HashList hashes,
                                         std::optional<std::int64_t> max_tokens, bool resumable) const {
    return std::make_shared<Request>(request_id, seq, arrival_ms, prompt_tokens, std::move(hashes), resumable,
                                     state.config.block_tokens, max_tokens);
}

// ---- dormant requests (kvlife's: the record of a request that only waits) ---------------------
std::optional<DormantCore> ConnectorCore::doze(const std::string& request_id) {
    CoreRequestPtr* found = state.requests.find(request_id);
    if (found == nullptr || !*found) {
        return std::nullopt;
    }
    Request& req = **found;
    // Only the map holds the record, and no id-keyed state names it.
    if (found->use_count() != 1 || !req.only_arrived() || state.wants_prefetch.contains(request_id) ||
        state.prefetch_waits.contains(request_id) || state.sync_lookup_version.contains(request_id) ||
        state.given_up_loads.contains(request_id)) {
        return std::nullopt;
    }
    DormantCore dormant{req.seq, req.arrival_ms, req.hashes.size(), std::move(req.last_decisions)};
    found->reset();
    return dormant;
}

CoreRequestPtr ConnectorCore::wake(const std::string& request_id, std::int64_t prompt_tokens,
                                   const HashList& block_hashes, std::optional<std::int64_t> max_tokens,
                                   bool resumable, DormantCore&& dormant) {
    CoreRequestPtr req = new_record(request_id, dormant.seq, dormant.arrival_ms, prompt_tokens,
                                    HashList(block_hashes, dormant.hashes), max_tokens, resumable);
    req->last_decisions = std::move(dormant.decisions);
    state.list_request(request_id, req);  // (the key kept its place: arrival order holds)
    return req;
}

bool ConnectorCore::is_dormant(const std::string& request_id) const {
    const CoreRequestPtr* found = state.requests.find(request_id);
    return found != nullptr && !*found;
}

// ---- vLLM: get_num_new_matched_tokens -----------------------------------------------------------
std::pair<std::optional<std::int64_t>, bool> ConnectorCore::get_num_new_matched_tokens(
    const std::string& request_id, std::int64_t num_computed_tokens) {
    Request& req = get(request_id);
    if (req.state == RequestState::RUNNING) {
        preempted_outside(req);
    }
    req.local_tokens = num_computed_tokens;
    req.plan.clear();
    req.joins.reset();
    req.landed = false;
    if (req.state == RequestState::LOOKUP_PENDING) {
        return {std::nullopt, false};
    }
    if (state.prefetch_waits.contains(request_id) && transfers.prefetch_gate(req)) {
        return {std::nullopt, false};
    }
    std::size_t n = state.hit_candidates(req);
    if (state.tiers.empty() || n == 0) {
        return {0, false};
    }
    const CoreConfig& config = state.config;
    bool have = req.lookup.has_value();
    if (have && !req.lookup_async) {
        const std::int64_t* version = state.sync_lookup_version.find(request_id);
        if (version == nullptr || *version != state.transfer_version) {
            have = false;  // a sync answer is re-done once the tiers may have changed
        }
    } else if (have && req.lookup_async && req.lookup_uses) {
        const Decided* last = req.last_decisions.find(Hook::LOOKUP_REUSE);
        if (last == nullptr || is_str(last->value, "consume")) {
            // Handed out once already and vLLM did not admit it: consumed, a new lookup.
            if (req.async_lookups < config.max_async_lookups) {
                have = false;
            } else if (req.async_lookups == config.max_async_lookups) {
                req.async_lookups += 1;
                lifecycle.warn("lookup_limit", {Field("req", request_id), Field("lookups", config.max_async_lookups)});
            }
        }
    }
    if (!have) {
        if (is_str(lifecycle.ask(req, Hook::LOOKUP_MODE), "async")) {
            if (req.lookup_uses) {
                submit_lookup(req, "async lookup submitted again: the answer of t=" + fmt_g(req.lookup_answered_ms) +
                                       " was consumed by the admission it was used for");
            } else {
                submit_lookup(req, "async lookup submitted");
            }
            return {std::nullopt, false};
        }
        std::vector<std::size_t> found;
        state.sync_lookup(req.hashes.data(), n, found);
        req.lookup = std::move(found);
        req.lookup_async = false;
        req.lookup_uses = 0;
        state.sync_lookup_version.set(request_id, state.transfer_version);
        state.stats.sync_lookups += 1;
        state.sync_keys.push_back(static_cast<std::int64_t>(n));
    } else if (req.lookup_async) {
        lifecycle.ask(req, Hook::LOOKUP_REUSE);
        if (req.lookup_uses) {
            record_reuse(req, n);
        }
        req.lookup_uses += 1;
    }
    std::int64_t bt = config.block_tokens;
    plan(req, n, num_computed_tokens / bt);
    if (plan_.empty()) {
        return {0, false};
    }
    LoadView& view = view_;
    view.device_hit_blocks = num_computed_tokens / bt;
    view.external_hit_blocks = static_cast<std::int64_t>(plan_.size());
    view.tiers.clear();
    view.in_flight.clear();
    for (const auto& item : plan_) {
        view.tiers.push_back(&state.tiers[item.second].name);
    }
    for (const auto& item : plan_) {
        const std::vector<Bringing>* bringing = state.in_flight_loads.find(item.first);
        if (bringing != nullptr) {
            view.in_flight.emplace_back(item.first, bringing->front().request_id);
        }
    }
    const AnswerValue& choice = lifecycle.ask(req, Hook::ADMISSION, HookArg(static_cast<const LoadView*>(&view)));
    if (is_str(choice, "defer")) {
        return {std::nullopt, false};
    }
    if (is_str(choice, "join")) {
        for (const auto& item : view.in_flight) {
            if (!req.joins) req.joins = std::make_unique<OrderedDict<BlockHash, std::int64_t>>();
            req.joins->set(item.first, state.in_flight_loads.find(item.first)->front().job_id);
        }
    }
    req.plan.swap(plan_);
    return {static_cast<std::int64_t>(req.plan.size()) * bt, true};
}

void ConnectorCore::plan(Request& req, std::size_t n, std::int64_t start) {
    plan_.clear();
    if (!req.lookup.has_value()) {
        return;
    }
    const std::vector<std::size_t>& lookup = *req.lookup;
    std::int64_t end = std::min<std::int64_t>(
        std::min<std::int64_t>(static_cast<std::int64_t>(lookup.size()), static_cast<std::int64_t>(n)),
        req.external_hit_limit);
    for (std::int64_t i = start; i < end; ++i) {
        BlockHash block = req.hashes[static_cast<std::size_t>(i)];
        const std::size_t tier = lookup[static_cast<std::size_t>(i)];
        if (!state.tiers[tier].contains(block)) {
            break;
        }
        plan_.emplace_back(block, tier);
    }
}

void ConnectorCore::record_reuse(Request& req, std::size_t n) {
    if (!state.recorder.enabled()) {
        return;  // (the record is all it computes)
    }
    std::size_t blocks = req.lookup.has_value() ? req.lookup->size() : 0;
    std::int64_t gone = 0;
    std::size_t upto = std::min(n, blocks);
    for (std::size_t i = 0; i < upto; ++i) {
        if (!state.tiers[(*req.lookup)[i]].contains(req.hashes[i])) {
            gone += 1;
        }
    }
    state.recorder.lookup_reuse(state.now, req.request_id, req.lookup_answered_ms, req.lookup_uses + 1,
                                static_cast<std::int64_t>(blocks), gone);
}

// ---- vLLM: update_state_after_alloc -------------------------------------------------------------
void ConnectorCore::update_state_after_alloc(const std::string& request_id, const std::vector<BlockId>& block_ids,
                                             std::int64_t num_external_tokens, const NextChunk* chunk) {
    Request& req = get(request_id);
    if (chunk != nullptr && req.state == RequestState::RUNNING) {
        next_chunk(req, block_ids, *chunk);
        return;
    }
    req.block_table.assign(block_ids.begin(), block_ids.end());
    std::int64_t bt = state.config.block_tokens;
    if (req.state == RequestState::LOADING) {
        req.landed = false;
        lifecycle.move(req, Trigger::LOAD_DONE, "every rank reported the load; taken back by the scheduler");
        return;
    }
    if (req.landed) {
        req.landed = false;
        lifecycle.move(req, Trigger::ADMITTED,
                       "recomputes from token " + std::to_string(req.confirmed) + " after its failed load");
        return;
    }
    std::int64_t first = req.local_tokens / bt;
    std::int64_t count = floordiv(num_external_tokens, bt);
    if (req.preemptions == 0 && req.tier_hit_blocks.empty() && !req.device_hit_blocks) {
        req.device_hit_blocks = first;
        std::size_t upto = std::min(req.plan.size(), static_cast<std::size_t>(std::max<std::int64_t>(count, 0)));
        for (std::size_t i = 0; i < upto; ++i) {
            req.tier_hit_blocks.add(state.tiers[req.plan[i].second].name, 1);
        }
    }
    if (count <= 0) {
        req.computed = req.confirmed = req.local_tokens;
        req.plan.clear();
        req.joins.reset();
        lifecycle.move(req, Trigger::ADMITTED, "admitted with " + std::to_string(first) + " hit blocks on device");
        return;
    }
    std::vector<BlockMove> own;
    // owner job -> copies of its device blocks, in first-seen order.
    std::vector<std::pair<std::int64_t, std::vector<BlockMove>>> joined;
    std::size_t upto = std::min(req.plan.size(), static_cast<std::size_t>(count));
    for (std::size_t i = 0; i < upto; ++i) {
        BlockHash block_hash = req.plan[i].first;
        const std::string& tier = state.tiers[req.plan[i].second].name;
        std::int64_t device = block_ids.at(static_cast<std::size_t>(first) + i);
        const std::int64_t* owner = req.joins ? req.joins->find(block_hash) : nullptr;
        const JobPtr* owner_ptr = owner != nullptr ? state.jobs.find(*owner) : nullptr;
        Job* owner_job = owner_ptr != nullptr ? owner_ptr->get() : nullptr;
        if (owner_job != nullptr && !owner_job->timed_out) {
            std::int64_t source = -1;
            for (const BlockMove& m : owner_job->moves) {
                if (m.block_hash == block_hash) {
                    source = m.device_block;
                    break;
                }
            }
            auto it = std::find_if(joined.begin(), joined.end(),
                                   [&](const auto& item) { return item.first == owner_job->job_id; });
            if (it == joined.end()) {
                joined.emplace_back(owner_job->job_id, std::vector<BlockMove>());
                it = joined.end() - 1;
            }
            it->second.push_back(BlockMove{block_hash, device, "device", source});
            state.stats.joined_blocks += 1;
        } else {
            own.push_back(BlockMove{block_hash, device, tier, -1});
        }
    }
    req.load_jobs.clear();
    req.load_failed.clear();
    req.landed = false;
    req.computed = req.confirmed = req.local_tokens;
    req.pending_hit_tokens = (first + count) * bt;
    req.plan.clear();
    req.joins.reset();
    std::string reason = "loading " + std::to_string(own.size()) + " blocks";
    if (!joined.empty()) {
        std::size_t copies = 0;
        std::vector<std::int64_t> owners;
        for (const auto& item : joined) {
            copies += item.second.size();
            owners.push_back(item.first);
        }
        std::sort(owners.begin(), owners.end());
        reason += ", copying " + std::to_string(copies) + " blocks of in-flight jobs " + int_list_repr(owners);
    }
    if (!own.empty()) {
        transfers.start_load(req, own);
    }
    for (const auto& item : joined) {
        transfers.start_load(req, item.second, item.first);
    }
    lifecycle.move(req, Trigger::LOAD_STARTED, reason);
}

// ---- vLLM: build_connector_meta -----------------------------------------------------------------
ConnectorMeta ConnectorCore::build_connector_meta(const StepInfo& step) {
    for (const std::string* rid : step.preempted) {
        Request* req = find(*rid);
        if (req != nullptr && req->state == RequestState::RUNNING && !preempted_early.count(*rid)) {
            preempt(*req);
        }
    }
    preempted_early.clear();
    for (const StepInfo::NewBlocks& item : step.new_blocks) {
        Request* req = find(*item.request_id);
        if (req != nullptr) {
            if (item.replace) {
                req->block_table.assign(item.ids->begin(), item.ids->end());
            } else {
                req->block_table.insert(req->block_table.end(), item.ids->begin(), item.ids->end());
            }
        }
    }
    std::vector<StepEntry> entries;
    if (!spare_entries_.empty()) {
        entries.swap(spare_entries_.back());
        spare_entries_.pop_back();
    }
    std::int64_t bt = state.config.block_tokens;
    std::vector<StepChunk>& prompt_chunks = prompt_chunks_;
    std::vector<StepChunk>& fills = fills_;
    prompt_chunks.clear();
    fills.clear();
    std::int64_t prefill = 0;
    bool recording = state.recorder.enabled();
    for (const StepInfo::Entry& item : step.scheduled) {
        CoreRequestPtr req = item.record != nullptr ? item.record->lock() : CoreRequestPtr();
        if (!req || !req->listed) {
            const CoreRequestPtr* found = state.requests.find(*item.request_id);
            if (found == nullptr || !*found) {
                continue;
            }
            req = *found;
        }
        std::int64_t before = item.before;
        std::int64_t n = item.tokens;
        std::int64_t end = before + n;
        bool samples = end >= req->prompt_tokens + req->generated;
        req->computed = end;
        if (samples) {
            req->placeholders += 1;
        }
        std::int64_t epoch = req->epoch;
        bool in_prompt = before < req->prompt_tokens;
        entries.push_back(StepEntry{std::move(req), epoch, before, n, samples});
        if (n > 1) {
            prefill += n;
        }
        if (recording) {
            if (in_prompt) {
                prompt_chunks.push_back(StepChunk{*item.request_id, before, n});
            } else if (end % bt < n) {
                fills.push_back(StepChunk{*item.request_id, before, n});
            }
        }
    }
    std::size_t requests = entries.size();
    state.steps.emplace_back(step.step_id, std::move(entries));
    if (requests) {
        state.stats.steps += 1;
    }
    ConnectorMeta meta;
    meta.step_id = step.step_id;
    meta.loads.swap(state.out_loads);
    meta.stores.swap(state.out_stores);
    meta.prefetches.swap(state.out_prefetches);
    meta.flush.swap(state.out_flush);
    meta.abandon.swap(state.out_abandon);
    meta.hold_finished.swap(state.out_holds);
    meta.sync_lookup_keys.swap(state.sync_keys);
    if (recording) {
        state.recorder.step(state.now, step.step_id, static_cast<std::int64_t>(requests), prefill,
                          static_cast<std::int64_t>(meta.sync_lookup_keys.size()), prompt_chunks, fills, meta.flush);
    }
    return meta;
}

void ConnectorCore::preempt(Request& req, std::string_view why) {
    transfers.flush_stores(req);
    req.computed = req.confirmed = 0;
    req.placeholders = 0;
    req.block_table.clear();
    req.epoch += 1;
    req.lookup.reset();
    req.lookup_uses = 0;
    req.preemptions += 1;
    state.stats.preemptions += 1;
    lifecycle.move(req, Trigger::PREEMPTED, why);
}

void ConnectorCore::preempted_outside(Request& req) {
    preempt(req,
            "preempted outside a scheduler pass (vLLM's reset_prefix_cache): asked about again "
            "before the pass's build_connector_meta named the preemption");
    preempted_early.insert(req.request_id);
}

void ConnectorCore::next_chunk(Request& req, const std::vector<BlockId>& block_ids, const NextChunk& chunk) {
    std::int64_t bt = state.config.block_tokens;
    std::int64_t kept = chunk.computed_tokens;
    if (req.stored_blocks > floordiv(kept, bt)) {
        transfers.flush_stores(req);
        req.stored_blocks = floordiv(kept, bt);
    }
    req.epoch += 1;
    req.placeholders = 0;
    lifecycle.move(req, Trigger::TURN_ENDED,
                   "its turn stopped (a resumable request: a streaming input session); its next input "
                   "chunk came, and the scheduler kept its " +
                       std::to_string(block_ids.size()) + " blocks and " + std::to_string(kept) + " tokens");
    req.prompt_tokens = chunk.prompt_tokens;
    std::size_t keep = static_cast<std::size_t>(std::max<std::int64_t>(0, floordiv(chunk.prompt_tokens, bt)));
    req.hashes.assign(chunk.hashes.data(), chunk.hashes.data() + std::min(keep, chunk.hashes.size()));
    req.max_tokens = chunk.max_tokens;
    req.generated = 0;
    req.block_table.assign(block_ids.begin(), block_ids.end());
    req.local_tokens = req.computed = req.confirmed = kept;
    req.lookup.reset();
    req.lookup_uses = 0;
    req.plan.clear();
    req.joins.reset();
    req.landed = false;
    lifecycle.move(req, Trigger::ADMITTED,
                   "its next input chunk: " + std::to_string(chunk.prompt_tokens - kept) +
                       " tokens to compute from token " + std::to_string(kept) + ", on the blocks it kept");
}

// ---- vLLM: update_connector_output --------------------------------------------------------------
void ConnectorCore::update_connector_output(const std::vector<TransferReport>& reports,
                                            const std::vector<std::string>& finished_sending) {
    for (const TransferReport& report : reports) {
        transfers.on_report(report);
    }
    for (const std::string& rid : finished_sending) {
        CoreRequestPtr* found = state.held.find(rid);
        if (found == nullptr) {
            continue;
        }
        CoreRequestPtr req = *found;
        state.held.erase(rid);
        req->hold = false;
        if (req->state == RequestState::SENDING) {
            std::string reason = req->finish_reason.has_value() && !req->finish_reason->empty() ? *req->finish_reason
                                                                                                  : "stopped";
            finish(*req, Trigger::COMPLETED, reason,
                   "every rank reported its stores; finished_sending came with a step output");
        }
    }
}

// ---- vLLM: request_finished ---------------------------------------------------------------------
bool ConnectorCore::request_finished(const std::string& request_id, std::string_view reason,
                                     std::optional<std::string> why) {
    Request* found = find(request_id);
    if (found == nullptr || found->state == RequestState::FINISHED) {
        return false;
    }
    Request& req = *found;
    if (req.state == RequestState::LOOKUP_PENDING) {
        state.commands.emplace_back(DiscardLookup{request_id, req.epoch});
    }
    state.sync_lookup_version.erase(request_id);
    state.wants_prefetch.erase(request_id);
    state.prefetch_waits.erase(request_id);
    if (reason == "stopped" || reason == "length") {
        confirm_finishing_step(req);
        transfers.maybe_store(req);
    }
    bool hold_it = req.store_jobs > 0;
    if (reason == "aborted") {
        finish(req, Trigger::ABORTED, "aborted", why.has_value() && !why->empty() ? *why : "client aborted", hold_it);
    } else if (reason == "error") {
        finish(req, Trigger::FAILED, "error",
               why.has_value() && !why->empty() ? *why : "vLLM finished it with an error", hold_it);
    } else if (hold_it && req.state == RequestState::RUNNING &&
               truthy(lifecycle.ask(req, Hook::HOLD_AT_FINISH, HookArg(req.store_jobs)))) {
        // (Only a running request goes to sending: one preempted while its last step ran,
        // whose token stops it, finishes from waiting with its stores' blocks held below.)
        req.finish_reason = std::string(reason);
        req.finish_ms = state.now;
        hold(req);
        req.epoch += 1;
        lifecycle.move(req, Trigger::SEND_STARTED,
                       "finished (" + std::string(reason) + "); " + std::to_string(req.store_jobs) +
                           " stores still read its blocks");
    } else {
        finish(req, Trigger::COMPLETED, reason, "finished (" + std::string(reason) + ")", hold_it);
    }
    return hold_it;
}

void ConnectorCore::hold(Request& req) {
    req.hold = true;
    state.held.set(req.request_id, *state.requests.find(req.request_id));
    state.out_holds.push_back(req.request_id);
}

void ConnectorCore::confirm_finishing_step(Request& req) {
    if (state.steps.empty()) {
        return;
    }
    for (const StepEntry& entry : state.steps.front().second) {
        if (entry.req.get() == &req && entry.epoch == req.epoch) {
            confirm(req, entry.computed_before, entry.num_tokens, entry.samples);
        }
    }
}

void ConnectorCore::finish(Request& req, Trigger trigger, std::string_view reason, std::string_view why, bool hold_it) {
    req.epoch += 1;
    req.finish_reason = std::string(reason);
    if (!req.finish_ms.has_value() || trigger != Trigger::COMPLETED) {
        req.finish_ms = state.now;
    }
    if (hold_it && !req.hold) {
        hold(req);
    }
    lifecycle.move(req, trigger, why);
    if (state.retire != nullptr) {
        state.retiring.set(req.request_id, *state.requests.find(req.request_id));
    }
}

// ---- vLLM: take_events --------------------------------------------------------------------------
void ConnectorCore::take_events() {
    if (state.steps.empty()) {
        return;
    }
    std::vector<StepEntry> entries = std::move(state.steps.front().second);
    state.steps.pop_front();
    struct Recycle {  // the list goes back for a later step's entries (emptied: no request kept)
        std::vector<StepEntry>& entries;
        std::vector<std::vector<StepEntry>>& spare;
        ~Recycle() {
            entries.clear();
            spare.push_back(std::move(entries));
        }
    } recycle{entries, spare_entries_};
    std::int64_t bt = state.config.block_tokens;
    for (const StepEntry& entry : entries) {
        Request& req = *entry.req;
        if (req.epoch != entry.epoch) {
            if (entry.samples && req.state == RequestState::WAITING && req.preemptions) {
                req.generated += 1;
            }
            continue;
        }
        if (req.state != RequestState::RUNNING) {
            continue;
        }
        confirm(req, entry.computed_before, entry.num_tokens, entry.samples);
        if (std::min<std::int64_t>(floordiv(req.computed, bt), static_cast<std::int64_t>(req.block_table.size())) >
                req.stored_blocks &&
            !state.observing) {
            transfers.maybe_store(req);
        }
    }
}

void ConnectorCore::confirm(Request& req, std::int64_t before, std::int64_t n, bool samples) {
    if (before + n > req.confirmed) {
        req.confirmed = before + n;
    }
    if (samples) {
        req.placeholders -= 1;
        req.generated += 1;
        if (!req.first_token_ms.has_value()) {
            req.first_token_ms = state.now;
        }
    }
    std::int64_t full = floordiv(req.confirmed, state.config.block_tokens);
    if (full > static_cast<std::int64_t>(req.hashes.size())) {
        state.ensure_hashes(req, full);
    }
}

// ---- kvlife: lookups ----------------------------------------------------------------------------
void ConnectorCore::submit_lookup(Request& req, std::string_view reason) {
    if (req.state == RequestState::LOOKUP_PENDING) {
        state.stats.duplicate_lookups += 1;
        return;
    }
    state.sync_lookup_version.erase(req.request_id);
    state.stats.async_lookups += 1;
    req.async_lookups += 1;
    req.lookup.reset();
    req.lookup_submitted_ms = state.now;
    state.lookup_timers.push_back(LookupTimer{state.now + state.config.lookup_deadline_ms, req.request_id,
                                              req.async_lookups});
    std::size_t n = state.hit_candidates(req);
    state.commands.emplace_back(SubmitLookup{
        req.request_id, req.epoch, std::vector<BlockHash>(req.hashes.begin(), req.hashes.begin() + static_cast<std::ptrdiff_t>(n))});
    lifecycle.move(req, Trigger::LOOKUP_SUBMITTED, reason);
}

void ConnectorCore::on_lookup_answer(const std::string& request_id, std::int64_t epoch,
                                     const std::optional<std::vector<std::string>>& tiers) {
    Request* found = find(request_id);
    if (found == nullptr || found->state != RequestState::LOOKUP_PENDING || found->epoch != epoch) {
        state.stats.stale_lookup_answers += 1;
        if (state.recorder.enabled()) {
            if (found == nullptr) {
                const std::int64_t* retired = state.retired.find(request_id);
                std::optional<std::int64_t> current;
                std::optional<std::string_view> st;
                if (retired != nullptr) {
                    current = *retired;
                    st = state_name(RequestState::FINISHED);
                }
                state.recorder.stale_lookup(state.now, request_id, epoch, current, st);
            } else {
                state.recorder.stale_lookup(state.now, request_id, epoch, found->epoch, state_name(found->state));
            }
        }
        return;
    }
    Request& req = *found;
    std::string reason;
    if (!tiers.has_value()) {
        state.stats.failed_lookups += 1;
        req.lookup = std::vector<std::size_t>();
        reason = "lookup failed: treated as a miss";
    } else {
        std::vector<std::size_t> kept;  // (a name no tier of this core has is dropped)
        for (const std::string& t : *tiers) {
            if (const TierIndex* tier = tier_or_null(t)) {
                kept.push_back(state.position(*tier));
            }
        }
        reason = "lookup answered: " + std::to_string(kept.size()) + " blocks in tiers";
        req.lookup = std::move(kept);
    }
    req.lookup_async = true;
    req.lookup_answered_ms = state.now;
    req.lookup_uses = 0;
    lifecycle.move(req, Trigger::LOOKUP_ANSWERED, reason);
    const std::int64_t* wanted = state.wants_prefetch.find(request_id);
    if (wanted != nullptr) {
        std::int64_t want = *wanted;
        state.wants_prefetch.erase(request_id);
        if (want == req.epoch) {
            transfers.start_prefetch(req);
        }
    }
}

void ConnectorCore::expire_lookups() {
    double now = state.now;
    auto& timers = state.lookup_timers;
    while (!timers.empty() && timers.front().due <= now) {
        std::string rid = std::move(timers.front().request_id);
        std::int64_t count = timers.front().async_lookups;
        timers.pop_front();
        Request* found = find(rid);
        if (found == nullptr || found->state != RequestState::LOOKUP_PENDING || found->async_lookups != count) {
            continue;
        }
        Request& req = *found;
        state.stats.expired_lookups += 1;
        state.commands.emplace_back(DiscardLookup{rid, req.epoch});
        state.wants_prefetch.erase(rid);
        req.epoch += 1;
        req.lookup = std::vector<std::size_t>();
        req.lookup_async = true;
        req.lookup_answered_ms = now;
        req.lookup_uses = 0;
        lifecycle.move(req, Trigger::LOOKUP_EXPIRED,
                       "lookup deadline: no answer " + fmt_g(now - req.lookup_submitted_ms) +
                           " ms after it was submitted at t=" + fmt_g(req.lookup_submitted_ms) + " (deadline " +
                           fmt_g(state.config.lookup_deadline_ms) +
                           " ms): treated as a miss; its answer is stale now");
    }
}

std::optional<std::string> ConnectorCore::pending_reason(const std::string& request_id) const {
    const Request* req = find(request_id);
    if (req == nullptr) {
        return std::nullopt;
    }
    if (req->state == RequestState::LOOKUP_PENDING) {
        return std::string("lookup");
    }
    return std::string(state.prefetch_waits.contains(request_id) ? "prefetch" : "defer");
}

// ---- retention ----------------------------------------------------------------------------------
void ConnectorCore::retire_finished() {
    if (state.retiring.empty() || state.retire == nullptr) {
        return;
    }
    std::vector<std::pair<std::string, CoreRequestPtr>> items;
    for (const auto& node : state.retiring) {
        items.emplace_back(node.key, node.value);
    }
    for (const auto& item : items) {
        const std::string& rid = item.first;
        const Request& req = *item.second;
        if (req.hold || req.store_jobs || !req.load_jobs.empty() || state.prefetch_waits.contains(rid) ||
            state.wants_prefetch.contains(rid)) {
            continue;
        }
        state.retiring.erase(rid);
        state.unlist_request(rid, *item.second);
        state.retired.set(rid, req.epoch);
        state.sync_lookup_version.erase(rid);
        state.retire->retire(req);
    }
}

// ---- ConnectorAPI ------------------------------------------------------------------------------
void ConnectorAPI::pass() {
    if (in_pass_) {
        return;
    }
    in_pass_ = true;
    passes += 1;
    core.tick(core.state.now);
}

void ConnectorAPI::on_new_request(SchedRequest& request, bool early) {
    // (core.state.now = max(now, clock()): the clock is core.state.now itself.)
    CoreRequestPtr record = core.on_new_request(request.request_id, request.prompt_tokens, request.block_hashes(),
                                                request.max_tokens, request.resumable, early);
    if (record) {
        request.core_record = record;
    }
}

std::optional<DormantCore> ConnectorAPI::doze(const SchedRequest& request) { return core.doze(request.request_id); }

void ConnectorAPI::wake(SchedRequest& request, DormantCore&& dormant) {
    request.core_record = core.wake(request.request_id, request.prompt_tokens, request.hashes, request.max_tokens,
                                    request.resumable, std::move(dormant));
}

bool ConnectorAPI::is_dormant(const std::string& request_id) const { return core.is_dormant(request_id); }

std::pair<std::optional<std::int64_t>, bool> ConnectorAPI::get_num_new_matched_tokens(SchedRequest& request,
                                                                                       std::int64_t computed) {
    pass();
    if (!core.state.requests.contains(request.request_id)) {
        on_new_request(request, true);
    }
    return core.get_num_new_matched_tokens(request.request_id, computed);
}

void ConnectorAPI::update_state_after_alloc(SchedRequest& request, const std::vector<BlockId>& blocks,
                                            std::int64_t external) {
    pass();
    Request* req = core.find(request.request_id);
    if (req != nullptr && req->state == RequestState::RUNNING && request.resumable) {
        NextChunk chunk{request.prompt_tokens, request.block_hashes().to_vector(), request.max_tokens,
                        request.num_computed_tokens};
        core.update_state_after_alloc(request.request_id, blocks, external, &chunk);
        return;
    }
    core.update_state_after_alloc(request.request_id, blocks, external, nullptr);
}

ConnectorMeta ConnectorAPI::build_connector_meta(const SchedulerOutput& output) {
    pass();
    in_pass_ = false;
    StepInfo& step = step_;
    step.clear();
    step.step_id = builds;
    // num_scheduled_tokens[rid]: the scheduler lists it in scheduling order, and the new and
    // cached requests each keep that order, so one cursor per list finds each in turn.
    std::size_t cursor_new = 0;
    std::size_t cursor_cached = 0;
    // (The lists name each request by the same pointer, and num_scheduled_tokens[i] and
    // records[i] name the same request: SchedulerOutput.)
    auto entry_of = [&](const std::string* rid, std::int64_t before, std::size_t& cursor) -> StepInfo::Entry {
        const auto& tokens = output.num_scheduled_tokens;
        for (std::size_t i = cursor; i < tokens.size(); ++i) {
            if (tokens[i].first == rid) {
                cursor = i + 1;
                const std::weak_ptr<Request>* record =
                    i < output.records.size() ? &output.records[i]->core_record : nullptr;
                return StepInfo::Entry{rid, before, tokens[i].second, record};
            }
        }
        throw KeyError(str_repr(*rid));
    };
    // (A request is scheduled once per step: each is new or cached, so new_blocks, a dict in
    // Python, gets each request once, in this order.)
    for (const NewRequestData& n : output.scheduled_new_reqs) {
        step.scheduled.push_back(entry_of(n.req_id, n.num_computed_tokens, cursor_new));
        step.new_blocks.push_back(StepInfo::NewBlocks{n.req_id, &n.block_ids, true});
    }
    static const std::vector<BlockId> none;
    const CachedRequestData& cached = output.scheduled_cached_reqs;
    for (std::size_t i = 0; i < cached.req_ids.size(); ++i) {
        const std::string* rid = cached.req_ids[i];
        step.scheduled.push_back(entry_of(rid, cached.num_computed_tokens[i], cursor_cached));
        bool resumed = std::find(cached.resumed_req_ids.begin(), cached.resumed_req_ids.end(), rid) !=
                       cached.resumed_req_ids.end();
        const auto& ids = cached.new_block_ids[i];
        if (ids.has_value() || resumed) {
            step.new_blocks.push_back(StepInfo::NewBlocks{rid, ids.has_value() ? &*ids : &none, resumed});
        }
    }
    for (const std::string& rid : output.preempted_req_ids) {
        step.preempted.push_back(&rid);
    }
    std::sort(step.preempted.begin(), step.preempted.end(),
              [](const std::string* a, const std::string* b) { return *a < *b; });
    step.preempted.erase(std::unique(step.preempted.begin(), step.preempted.end(),
                                     [](const std::string* a, const std::string* b) { return *a == *b; }),
                         step.preempted.end());
    builds += 1;
    return core.build_connector_meta(step);
}

void ConnectorAPI::update_connector_output(const KVConnectorOutput& output) {
    reports_scratch_.clear();
    if (output.reports.has_value()) {
        for (const WorkerReport& r : *output.reports) {
            reports_scratch_.push_back(TransferReport{core.state.now, r.job_id, r.rank, r.failed});
        }
    }
    std::vector<std::string>& sending = sending_scratch_;
    sending.clear();
    if (output.finished_sending.has_value()) {
        sending.assign(output.finished_sending->begin(), output.finished_sending->end());
        std::sort(sending.begin(), sending.end());
        sending.erase(std::unique(sending.begin(), sending.end()), sending.end());
    }
    core.update_connector_output(reports_scratch_, sending);
}

bool ConnectorAPI::request_finished(SchedRequest& request, const std::vector<BlockId>&) {
    const char* reason = "error";
    switch (request.status) {
        case Status::FINISHED_STOPPED: reason = "stopped"; break;
        case Status::FINISHED_LENGTH_CAPPED: reason = "length"; break;
        case Status::FINISHED_ABORTED: reason = "aborted"; break;
        default: reason = "error"; break;
    }
    return core.request_finished(request.request_id, reason, request.finish_note);
}

bool ConnectorAPI::knows(const std::string& request_id) const {
    return core.state.requests.contains(request_id) || core.state.retired.contains(request_id);
}

void ConnectorAPI::warn_duplicate_arrival(const std::string& request_id) {
    core.lifecycle.warn("duplicate_arrival", {Field("req", request_id)});
}

void ConnectorAPI::freed(const std::vector<BlockId>& blocks) {
    core.state.recorder.free(core.state.now, blocks.data(), blocks.size());
    core.state.commands.emplace_back(FreeBlocks{std::vector<std::int64_t>(blocks.begin(), blocks.end())});
}

}  // namespace kvlife
