// Mirrors lifecycle/engine/jobs.py: Transfers, method for method, and _underivable.
#include "jobs.hpp"

#include <algorithm>
#include <cstdio>

#include "errors.hpp"
#include "py_repr.hpp"

namespace kvlife {

namespace {

// Python's a // b for b > 0.
std::int64_t floor_div(std::int64_t a, std::int64_t b) {
    std::int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
    return q;
}

// f"{x:g}"
std::string fmt_g(double x) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", x);
    return buf;
}

// f"{x:.1f}"
std::string fmt_1f(double x) {
    char buf[512];
    std::snprintf(buf, sizeof buf, "%.1f", x);
    return buf;
}

// str(list_of_ints): "[1, 2]"
std::string list_str(const std::vector<std::int64_t>& values) {
    std::string out = "[";
    for (std::size_t i = 0; i < values.size(); ++i) {
        if (i) out += ", ";
        out += std::to_string(values[i]);
    }
    return out + "]";
}

bool in_sorted(const std::vector<BlockHash>& sorted, BlockHash h) {
    return std::binary_search(sorted.begin(), sorted.end(), h);
}

// set(values) as a sorted vector.
std::vector<BlockHash> as_set(const std::vector<BlockHash>& values) {
    std::vector<BlockHash> out(values);
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

}  // namespace

Positions underivable(const Request& req, std::int64_t start, std::int64_t stop, const std::vector<BlockHash>* among) {
    Positions named;
    const HashList& hashes = req.hashes;
    const std::int64_t first = std::max(start, floor_div(req.prompt_tokens, req.block_tokens));
    const std::int64_t last = std::min(stop, static_cast<std::int64_t>(hashes.size()));
    for (std::int64_t i = first; i < last; ++i) {
        const BlockHash h = hashes[static_cast<std::size_t>(i)];
        if (among != nullptr && std::find(among->begin(), among->end(), h) == among->end()) continue;
        std::optional<BlockHash> previous;
        if (i) previous = hashes[static_cast<std::size_t>(i - 1)];
        if (h != derived_block_hash(previous, req.request_id, i)) named.set(h, i);
    }
    return named;
}

// ---- device loads and stores ------------------------------------------------------------------
JobPtr Transfers::start_load(Request& req, const std::vector<BlockMove>& moves, std::optional<std::int64_t> after) {
    const std::int64_t job_id = state.new_job_id();
    std::vector<BlockMove> placed;
    placed.reserve(moves.size());
    for (const BlockMove& given : moves) {
        placed.push_back(given);
        if (!after) {
            BlockMove& move = placed.back();
            move.slot = state.tier(move.tier).prepare_load(&move.block_hash, 1)[0];
            auto [bringing, inserted] = state.in_flight_loads.try_emplace(move.block_hash);
            if (inserted) bringing->clear();
            if (!bringing->empty()) state.stats.redundant_block_loads += 1;
            bringing->push_back(Bringing{job_id, move.device_block, req.request_id});
        }
    }
    auto job = std::make_shared<Job>(Job{job_id, JobKind::LOAD, req.request_id, req.epoch, std::move(placed), state.now,
                                         after});
    state.jobs.set(job_id, job);
    state.ranks.open(job_id);
    req.load_jobs.push_back(job_id);
    state.stats.loads += 1;
    if (!after) state.stats.blocks_loaded += static_cast<std::int64_t>(job->moves.size());
    if (after && holds != nullptr) {
        std::vector<BlockId> sources;
        sources.reserve(job->moves.size());
        for (const BlockMove& m : job->moves) sources.push_back(static_cast<BlockId>(m.slot));
        holds->hold_blocks(sources);
        state.held_blocks.set(job_id, std::move(sources));
    }
    state.recorder.job(state.now, job_id, "load", req.request_id, job->moves.data(), job->moves.size(), nullptr, after);
    state.out_loads.push_back(job);
    return job;
}

void Transfers::maybe_store(Request& req) {
    const std::int64_t bt = state.config.block_tokens;
    const std::int64_t table = static_cast<std::int64_t>(req.block_table.size());
    if (state.tiers.empty() || std::min(floor_div(req.computed, bt), table) <= req.stored_blocks) return;
    const AnswerValue& answer = lifecycle.ask(req, Hook::STORE_LIMIT);
    const std::int64_t limit = std::get<std::int64_t>(answer);
    const std::int64_t upto = std::min(floor_div(std::min(limit, req.computed), bt), table);
    if (upto <= req.stored_blocks) return;
    if (upto > static_cast<std::int64_t>(req.hashes.size())) state.ensure_hashes(req, upto);
    const std::size_t first = static_cast<std::size_t>(req.stored_blocks);
    const std::size_t n = static_cast<std::size_t>(upto) - first;
    const BlockHash* hashes = req.hashes.data() + first;
    const BlockId* blocks = req.block_table.data() + first;
    req.stored_blocks = upto;
    const bool recording = state.recorder.enabled();
    Positions named;
    if (recording) named = underivable(req, static_cast<std::int64_t>(first), upto);
    bool mapped = false;
    for (TierIndex& tier : state.tiers) {
        const StorePlan& plan = tier.prepare_store(hashes, n);
        if (recording) {
            if (!plan.evicted.empty()) state.recorder.evict(state.now, tier.name, plan.evicted.data(), plan.evicted.size());
            if (plan.rejected_full) state.recorder.store_rejected(state.now, req.request_id, tier.name, plan.rejected_full);
        }
        if (plan.accepted.empty()) continue;
        if (!mapped) {  // dict(zip(hashes, blocks)): the last block of a repeated hash
            positions_.index(hashes, n);
            mapped = true;
        }
        std::vector<BlockMove> moves;
        moves.reserve(plan.accepted.size());
        for (const auto& [h, slot] : plan.accepted) {
            const std::int64_t at = positions_.last(h);
            if (at < 0) throw std::logic_error("a tier accepted block " + std::to_string(h) + " it was not offered");
            moves.push_back(BlockMove{h, blocks[at], tier.name, slot});
        }
        const std::int64_t job_id = state.new_job_id();
        auto job = std::make_shared<Job>(Job{job_id, JobKind::STORE, req.request_id, req.epoch, std::move(moves),
                                             state.now, std::nullopt});
        state.jobs.set(job_id, job);
        state.ranks.open(job_id);
        req.store_jobs += 1;
        state.stats.stores += 1;
        state.stats.blocks_stored += static_cast<std::int64_t>(job->moves.size());
        if (recording) {
            state.recorder.job(state.now, job_id, "store", req.request_id, job->moves.data(), job->moves.size(), &named);
        }
        state.out_stores.push_back(job);
    }
}

void Transfers::observe_job(Request& req, std::int64_t job_id, JobKind kind, const std::vector<BlockMove>& moves) {
    auto job = std::make_shared<Job>(Job{job_id, kind, req.request_id, req.epoch, moves, state.now, std::nullopt});
    state.jobs.set(job_id, job);
    state.ranks.open(job_id);
    const std::int64_t n = static_cast<std::int64_t>(moves.size());
    if (kind == JobKind::LOAD) {
        req.load_jobs.push_back(job_id);
        state.stats.loads += 1;
        state.stats.blocks_loaded += n;
    } else {
        req.store_jobs += 1;
        state.stats.stores += 1;
        state.stats.blocks_stored += n;
    }
    if (!state.recorder.enabled()) return;
    Positions named;
    if (kind == JobKind::STORE) {
        std::vector<BlockHash> among;
        among.reserve(moves.size());
        for (const BlockMove& m : moves) among.push_back(m.block_hash);
        named = underivable(req, 0, static_cast<std::int64_t>(req.hashes.size()), &among);
    }
    state.recorder.job(state.now, job_id, job_kind_name(kind), req.request_id, job->moves.data(), job->moves.size(),
                       &named);
}

void Transfers::flush_stores(Request& req) {
    for (const auto& node : state.jobs) {
        Job& job = *node.value;
        if (job.kind == JobKind::STORE && job.request_id == req.request_id && !job.flushed && !job.timed_out) {
            job.flushed = true;
            state.stats.flushed_stores += 1;
            state.out_flush.push_back(job.job_id);
        }
    }
}

// ---- reports ----------------------------------------------------------------------------------
void Transfers::on_report(const TransferReport& event) {
    state.transfer_version += 1;
    if (state.reclaimed.contains(event.job_id)) {
        on_late_report(event);
    } else if (state.prefetches.contains(event.job_id)) {
        on_prefetch_report(event);
    } else {
        on_transfer_report(event);
    }
}

bool Transfers::report(const TransferReport& event, std::vector<BlockHash>& failed) {
    ReportOutcome outcome = state.ranks.report(event.job_id, event.rank, event.failed);
    if (outcome.status == ReportStatus::PENDING) return false;
    if (outcome.status != ReportStatus::DONE) {
        lifecycle.warn(std::string(report_status_value(outcome.status)) + "_report",
                       {Field("job", event.job_id), Field("rank", event.rank)});
        return false;
    }
    failed = std::move(outcome.failed);
    return true;
}

void Transfers::on_transfer_report(const TransferReport& event) {
    std::vector<BlockHash> bad;
    if (!report(event, bad)) return;
    if (!state.jobs.contains(event.job_id)) throw KeyError(event.job_id);
    JobPtr job = state.jobs.take(event.job_id);
    state.recorder.job_done(state.now, job->job_id, job_kind_name(job->kind), static_cast<std::int64_t>(bad.size()),
                            job->timed_out);
    if (!bad.empty()) failed(*job, bad);
    release_job(*job, bad);
    if (!job->timed_out) job_outcome(*job, bad);
}

void Transfers::failed(const Job& job, const std::vector<BlockHash>& failed_blocks) {
    const std::vector<BlockHash> bad = as_set(failed_blocks);
    std::vector<std::int64_t> blocks;
    for (const BlockMove& m : job.moves) {
        if (in_sorted(bad, m.block_hash)) blocks.push_back(m.block_hash);
    }
    std::string note;
    if (job.kind == JobKind::LOAD) {
        state.stats.failed_loads += 1;
        const std::string& policy = state.config.kv_load_failure_policy;
        note = "kv_load_failure_policy " + str_repr(policy) + ": " +
               (policy == "recompute" ? "the request recomputes from its first failed block" : "the request fails");
    } else {
        state.stats.failed_stores += 1;
        note = "the failed blocks are not kept in the tier; the request's blocks are released as usual";
    }
    lifecycle.warn(std::string(job_kind_name(job.kind)) + "_failed",
                   {Field("job", job.job_id), Field("req", job.request_id), Field("blocks", blocks), Field("note", note)});
}

void Transfers::on_late_report(const TransferReport& event) {
    std::vector<std::int64_t>* missing = state.reclaimed.find(event.job_id);
    if (missing == nullptr) throw KeyError(event.job_id);
    auto it = std::find(missing->begin(), missing->end(), event.rank);
    if (it == missing->end()) {
        const char* status = 0 <= event.rank && event.rank < state.ranks.world_size() ? "duplicate" : "bad_rank";
        lifecycle.warn(std::string(status) + "_report", {Field("job", event.job_id), Field("rank", event.rank)});
        return;
    }
    missing->erase(it);
    if (missing->empty()) state.reclaimed.erase(event.job_id);
    state.stats.late_reports += 1;
    lifecycle.warn("late_report", {Field("job", event.job_id), Field("rank", event.rank),
                                   Field("note", "the job was reclaimed at its deadline: this report is ignored")});
}

void Transfers::stop_bringing(const Job& job) {
    for (const BlockMove& move : job.moves) {
        std::vector<Bringing>* bringing = state.in_flight_loads.find(move.block_hash);
        if (bringing == nullptr) continue;
        bringing->erase(std::remove_if(bringing->begin(), bringing->end(),
                                       [&](const Bringing& b) { return b.job_id == job.job_id; }),
                        bringing->end());
        if (bringing->empty()) state.in_flight_loads.erase(move.block_hash);
    }
}

void Transfers::release_job(Job& job, const std::vector<BlockHash>& failed_blocks) {
    const std::vector<BlockHash> bad = as_set(failed_blocks);
    if (state.observing) {
        // another connector's storage: no index mirrors it
    } else if (job.kind == JobKind::LOAD) {
        if (!job.after) {
            for (const BlockMove& move : job.moves) {
                TierIndex& tier = state.tier(move.tier);
                tier.complete_load(&move.block_hash, 1);
                if (in_sorted(bad, move.block_hash)) tier.discard(&move.block_hash, 1);
            }
            stop_bringing(job);
        }
    } else {
        // by_tier: tier -> its blocks, tiers in order of first appearance
        std::vector<std::pair<std::string_view, std::vector<BlockHash>>> by_tier;
        for (const BlockMove& move : job.moves) {
            auto it = std::find_if(by_tier.begin(), by_tier.end(), [&](const auto& e) { return e.first == move.tier; });
            if (it == by_tier.end()) {
                by_tier.emplace_back(move.tier, std::vector<BlockHash>{});
                it = by_tier.end() - 1;
                it->second.reserve(job.moves.size());  // (a store job's moves are one tier's: one allocation)
            }
            it->second.push_back(move.block_hash);
        }
        const bool clean = bad.empty() && !job.timed_out;
        for (const auto& [name, blocks] : by_tier) {
            TierIndex& tier = state.tier(name);
            if (clean) {
                tier.complete_store(blocks.data(), blocks.size(), true);
                continue;
            }
            std::vector<BlockHash> good;
            std::vector<BlockHash> failed_here;
            for (BlockHash h : blocks) {
                if (!in_sorted(bad, h) && !job.timed_out) good.push_back(h);
            }
            for (BlockHash h : blocks) {
                if (in_sorted(bad, h) || job.timed_out) failed_here.push_back(h);
            }
            tier.complete_store(good.data(), good.size(), true);
            tier.complete_store(failed_here.data(), failed_here.size(), false);
        }
    }
    if (!bad.empty()) {
        std::vector<BlockHash> both;
        for (const BlockMove& m : job.moves) {
            if (in_sorted(bad, m.block_hash)) both.push_back(m.block_hash);
        }
        state.stats.failed_blocks += static_cast<std::int64_t>(as_set(both).size());
    }
    if (state.held_blocks.contains(job.job_id)) {
        std::vector<BlockId> held = state.held_blocks.take(job.job_id);
        if (holds != nullptr) holds->unhold_blocks(held);
    }
}

void Transfers::job_outcome(Job& job, const std::vector<BlockHash>& failed_blocks,
                            const std::optional<std::string>& cause) {
    CoreRequestPtr* found = state.requests.find(job.request_id);
    if (found == nullptr) return;
    Request& req = **found;
    if (job.kind == JobKind::STORE) {
        req.store_jobs -= 1;
        return;
    }
    auto it = std::find(req.load_jobs.begin(), req.load_jobs.end(), job.job_id);
    if (it == req.load_jobs.end()) return;
    req.load_jobs.erase(it);
    const std::vector<BlockHash> bad = as_set(failed_blocks);
    if (cause) state.given_up_loads.set(req.request_id);
    for (const BlockMove& m : job.moves) {
        if (in_sorted(bad, m.block_hash)) req.load_failed.push_back(m.block_hash);
    }
    if (!req.load_jobs.empty()) return;
    if (req.state == RequestState::LOADING && req.epoch == job.epoch) {
        std::optional<std::string> why;
        if (cause) why = "job " + std::to_string(job.job_id) + " was given up: " + *cause;
        load_finished(req, why);
    }
}

void Transfers::load_finished(Request& req, const std::optional<std::string>& cause) {
    const std::int64_t bt = state.config.block_tokens;
    req.landed = true;
    if (req.load_failed.empty()) {
        req.computed = req.confirmed = req.pending_hit_tokens;
        return;
    }
    const std::int64_t failed_count = static_cast<std::int64_t>(req.load_failed.size());
    const std::string what = cause ? std::to_string(failed_count) + " blocks not loaded (" + *cause + ")"
                                   : std::to_string(failed_count) + " blocks failed to load";
    const std::string configured = state.config.kv_load_failure_policy;
    std::string action = configured;
    if (!state.observing) action = std::get<std::string>(lifecycle.ask(req, Hook::ON_LOAD_FAILURE, failed_count));
    if (action != configured) {
        const std::string note = "vLLM's kv_load_failure_policy is " + str_repr(configured) +
                                 ": a connector cannot " + (action == "fail" ? "fail" : "recompute") +
                                 " one request against it";
        lifecycle.warn("decision_refused", {Field("req", req.request_id), Field("point", "on_load_failure"),
                                            Field("value", action), Field("carried_out", configured),
                                            Field("note", note)});
    }
    positions_.index(req.hashes.data(), req.hashes.size());
    std::optional<std::int64_t> first_bad;
    for (BlockHash h : req.load_failed) {
        const std::int64_t at = positions_.last(h);
        if (at >= 0 && (!first_bad || at < *first_bad)) first_bad = at;
    }
    const std::int64_t first = first_bad.value_or(0);
    req.external_hit_limit = std::min(req.external_hit_limit, first);
    const std::int64_t cut = cause ? 0 : std::min(req.confirmed, first * bt);
    req.computed = req.confirmed = cut;
    req.epoch += 1;
    req.lookup.reset();
    req.lookup_uses = 0;
    if (configured == "fail") return;
    lifecycle.move(req, Trigger::LOAD_FAILED, what + ": recompute from token " + std::to_string(cut));
}

void Transfers::give_up(Job& job, const std::string& note, const std::string& cause) {
    job.timed_out = true;
    job.abandoned = true;
    state.out_abandon.push_back(job.job_id);
    state.stats.rank_timeouts += 1;
    const std::vector<std::int64_t> missing = state.ranks.missing_ranks(job.job_id);
    lifecycle.warn("rank_timeout", {Field("job", job.job_id), Field("ranks", missing), Field("note", note)});
    if (job.kind == JobKind::LOAD) {
        stop_bringing(job);
        std::vector<JobPtr> joins;
        for (const auto& node : state.jobs) {
            if (node.value->after && *node.value->after == job.job_id && !node.value->timed_out) joins.push_back(node.value);
        }
        const std::string id = std::to_string(job.job_id);
        for (const JobPtr& join : joins) {
            give_up(*join, "the load it copies from (job " + id + ") was given up",
                    "its source, load job " + id + ", was given up (" + cause + ")");
        }
    }
    if (holds != nullptr && !job.flushed) {
        std::vector<BlockId> blocks;
        blocks.reserve(job.moves.size());
        for (const BlockMove& m : job.moves) blocks.push_back(static_cast<BlockId>(m.device_block));
        holds->hold_blocks(blocks);
        auto [held, inserted] = state.held_blocks.try_emplace(job.job_id);
        if (inserted) held->clear();
        held->insert(held->end(), blocks.begin(), blocks.end());
    }
    std::vector<BlockHash> all;
    all.reserve(job.moves.size());
    for (const BlockMove& m : job.moves) all.push_back(m.block_hash);
    job_outcome(job, all, cause);
}

void Transfers::expire_jobs(double deadline, bool loads, bool stores) {
    std::vector<JobPtr> jobs;
    jobs.reserve(state.jobs.size());
    for (const auto& node : state.jobs) jobs.push_back(node.value);
    for (const JobPtr& job : jobs) {
        const bool kind = job->kind == JobKind::LOAD ? loads : stores;
        if (job->timed_out || !kind || state.now - job->started_ms < deadline) continue;
        const std::string cause = "transfer deadline: ranks " + list_str(state.ranks.missing_ranks(job->job_id)) +
                                  " silent " + fmt_g(state.now - job->started_ms) + " ms after it started (deadline " +
                                  fmt_g(deadline) + " ms)";
        give_up(*job, "job failed on those ranks; its blocks stay held until they report", cause);
    }
}

void Transfers::reclaim_jobs(double deadline) {
    const double now = state.now;
    std::vector<JobPtr> jobs;
    jobs.reserve(state.jobs.size());
    for (const auto& node : state.jobs) jobs.push_back(node.value);
    for (const JobPtr& job : jobs) {
        if (now < job->started_ms + deadline) break;
        const std::vector<std::int64_t> missing = state.ranks.missing_ranks(job->job_id);
        const std::string silent = "ranks " + list_str(missing) + " silent " + fmt_g(now - job->started_ms) +
                                   " ms after it started";
        if (!job->timed_out) {
            give_up(*job, "reclaim deadline (" + fmt_g(deadline) + " ms): job failed on those ranks",
                    "reclaim deadline: " + silent + " (deadline " + fmt_g(deadline) + " ms)");
        }
        reclaim(job->job_id, job_kind_name(job->kind), job->request_id, missing,
                static_cast<std::int64_t>(job->moves.size()), silent, deadline);
        if (!state.jobs.erase(job->job_id)) throw KeyError(job->job_id);
        release_job(*job, {});
    }
    std::vector<PrefetchJobPtr> pulls;
    pulls.reserve(state.prefetches.size());
    for (const auto& node : state.prefetches) pulls.push_back(node.value);
    for (const PrefetchJobPtr& pull : pulls) {
        if (now < pull->started_ms + deadline) break;
        const std::vector<std::int64_t> missing = state.ranks.missing_ranks(pull->job_id);
        reclaim(pull->job_id, "prefetch", pull->request_id, missing, static_cast<std::int64_t>(pull->moves.size()),
                "ranks " + list_str(missing) + " silent " + fmt_g(now - pull->started_ms) + " ms after it started",
                deadline);
        state.prefetches.erase(pull->job_id);
        PrefetchJobPtr* wait = state.prefetch_waits.find(pull->request_id);
        if (wait != nullptr && wait->get() == pull.get()) state.prefetch_waits.erase(pull->request_id);
        TierIndex& host = state.tier(pull->moves[0].dst_tier);
        std::vector<BlockHash> hashes;
        hashes.reserve(pull->moves.size());
        for (const TierMove& move : pull->moves) {
            state.tier(move.src_tier).complete_load(&move.block_hash, 1);
            hashes.push_back(move.block_hash);
        }
        host.complete_store(hashes.data(), hashes.size(), false);
    }
}

void Transfers::reclaim(std::int64_t job_id, std::string_view op, std::string_view rid,
                        const std::vector<std::int64_t>& missing, std::int64_t blocks, const std::string& silent,
                        double deadline) {
    state.ranks.close(job_id);
    state.reclaimed.set(job_id, missing);
    state.stats.reclaimed_jobs += 1;
    state.recorder.reclaim(state.now, job_id, op, rid, missing, blocks,
                           "reclaim deadline: " + silent + " (deadline " + fmt_g(deadline) +
                               " ms); its blocks are given back and a later report is ignored");
}

// ---- prefetch ---------------------------------------------------------------------------------
void Transfers::start_prefetch(Request& req) {
    TierIndex* host = nullptr;
    for (TierIndex& t : state.tiers) {
        if (t.name == "host") host = &t;
    }
    if (host == nullptr || !req.lookup || req.lookup->empty()) return;
    const std::size_t n = state.hit_candidates(req);
    const std::vector<std::size_t>& lookup = *req.lookup;
    std::vector<BlockHash> lower;
    std::vector<std::string_view> lower_tiers;
    for (std::size_t i = 0; i < lookup.size() && i < n; ++i) {
        const TierIndex& tier = state.tiers[lookup[i]];
        if (&tier != host && tier.contains(req.hashes[i])) {
            lower.push_back(req.hashes[i]);
            lower_tiers.push_back(tier.name);
        }
    }
    if (lower.empty()) return;
    const StorePlan& plan = host->prepare_store(lower.data(), lower.size());
    if (!plan.evicted.empty()) state.recorder.evict(state.now, host->name, plan.evicted.data(), plan.evicted.size());
    if (plan.accepted.empty()) return;
    std::vector<TierMove> moves;
    moves.reserve(plan.accepted.size());
    for (const auto& [h, slot] : plan.accepted) {
        std::string_view source;  // dict(lower)[h]: the last tier given for a repeated hash
        for (std::size_t i = 0; i < lower.size(); ++i) {
            if (lower[i] == h) source = lower_tiers[i];
        }
        TierIndex& from = state.tier(source);
        const std::int64_t src_slot = from.prepare_load(&h, 1)[0];
        moves.push_back(TierMove{h, std::string(source), src_slot, host->name, slot});
    }
    const std::int64_t job_id = state.new_job_id();
    PrefetchView view{static_cast<std::int64_t>(moves.size()),
                      static_cast<std::int64_t>(moves.size()) * state.config.block_tokens, {}, state.now};
    view.source_tiers.reserve(moves.size());
    for (const TierMove& m : moves) view.source_tiers.push_back(&m.src_tier);
    const AnswerValue& answer = lifecycle.ask(req, Hook::PREFETCH_PATIENCE, &view);
    const double patience = answer.index() == 2 ? static_cast<double>(std::get<std::int64_t>(answer))
                                                : std::get<double>(answer);
    const Decided* last = req.last_decisions.find(Hook::PREFETCH_PATIENCE);
    auto job = std::make_shared<PrefetchJob>(PrefetchJob{job_id, req.request_id, req.epoch, std::move(moves), state.now,
                                                         state.now + patience, last->policy});
    state.prefetches.set(job_id, job);
    state.prefetch_waits.set(req.request_id, job);
    state.ranks.open(job_id);
    state.stats.prefetches += 1;
    state.stats.blocks_prefetched += static_cast<std::int64_t>(job->moves.size());
    state.recorder.job_prefetch(state.now, job_id, req.request_id, job->moves.data(), job->moves.size());
    state.out_prefetches.push_back(job);
}

void Transfers::on_prefetch_report(const TransferReport& event) {
    std::vector<BlockHash> bad;
    if (!report(event, bad)) return;
    if (!state.prefetches.contains(event.job_id)) throw KeyError(event.job_id);
    PrefetchJobPtr job = state.prefetches.take(event.job_id);
    TierIndex& host = state.tier(job->moves[0].dst_tier);
    std::vector<BlockHash> landed;
    std::vector<BlockHash> lost;
    for (const TierMove& move : job->moves) {
        TierIndex& source = state.tier(move.src_tier);
        source.complete_load(&move.block_hash, 1);
        if (in_sorted(bad, move.block_hash)) {
            source.discard(&move.block_hash, 1);
            lost.push_back(move.block_hash);
        } else {
            landed.push_back(move.block_hash);
        }
    }
    if (job->abandoned) {
        std::vector<BlockHash> all(landed);
        all.insert(all.end(), lost.begin(), lost.end());
        host.complete_store(all.data(), all.size(), false);
    } else {
        host.complete_store(landed.data(), landed.size(), true);
        host.complete_store(lost.data(), lost.size(), false);
    }
    state.stats.failed_blocks += static_cast<std::int64_t>(lost.size());
    state.recorder.job_done(state.now, job->job_id, "prefetch", static_cast<std::int64_t>(lost.size()), false,
                            job->abandoned);
    PrefetchJobPtr* wait = state.prefetch_waits.find(job->request_id);
    if (wait != nullptr && wait->get() == job.get()) state.prefetch_waits.erase(job->request_id);
    CoreRequestPtr* found = state.requests.find(job->request_id);
    if (job->abandoned || found == nullptr || (*found)->epoch != job->epoch || !(*found)->lookup) return;
    Request& req = **found;
    const std::vector<BlockHash> landed_set = as_set(landed);
    const std::vector<BlockHash> lost_set = as_set(lost);
    const std::size_t n = state.hit_candidates(req);
    const std::size_t host_tier = state.position(host);
    std::vector<std::size_t> tiers;
    const std::vector<std::size_t>& lookup = *req.lookup;
    for (std::size_t i = 0; i < lookup.size() && i < n; ++i) {
        if (in_sorted(lost_set, req.hashes[i])) break;
        tiers.push_back(in_sorted(landed_set, req.hashes[i]) ? host_tier : lookup[i]);
    }
    req.lookup = std::move(tiers);
}

bool Transfers::prefetch_gate(Request& req) {
    PrefetchJobPtr* found = state.prefetch_waits.find(req.request_id);
    if (found == nullptr) throw KeyError(req.request_id);
    PrefetchJobPtr job = *found;
    if (req.epoch != job->epoch || !state.prefetches.contains(job->job_id)) {
        state.prefetch_waits.erase(req.request_id);
        return false;
    }
    if (state.now < job->deadline_ms) {
        if (!job->deferred) {
            job->deferred = true;
            state.stats.prefetch_waits += 1;
            auto [deferrals, first] = state.stats.deferrals.try_emplace(job->patience_policy);
            *deferrals = first ? 1 : *deferrals + 1;
        }
        return true;
    }
    state.prefetch_waits.erase(req.request_id);
    std::vector<BlockHash> in_flight;
    in_flight.reserve(job->moves.size());
    for (const TierMove& m : job->moves) in_flight.push_back(m.block_hash);
    in_flight = as_set(in_flight);
    std::vector<std::size_t> lookup;
    if (req.lookup) lookup = *req.lookup;
    const std::size_t n = state.hit_candidates(req);
    const std::size_t bound = std::min(lookup.size(), n);
    std::size_t keep = 0;
    while (keep < bound && !in_sorted(in_flight, req.hashes[keep])) ++keep;
    state.stats.prefetch_gave_up += 1;
    job->abandoned = true;
    const std::string reason = "patience ran out after " + fmt_1f(state.now - job->started_ms) + " ms: " +
                               std::to_string(static_cast<std::int64_t>(lookup.size()) - static_cast<std::int64_t>(keep)) +
                               " hit blocks still in flight are computed";
    state.recorder.decision(state.now, req.request_id, "prefetch_patience", job->patience_policy,
                            AnswerValue(std::string("compute")), reason);
    state.recorder.abandon(state.now, job->job_id, "prefetch", req.request_id,
                           "prefetch deadline: " + reason + "; what it lands later is not published");
    lookup.resize(keep);
    req.lookup = std::move(lookup);
    return false;
}

}  // namespace kvlife
