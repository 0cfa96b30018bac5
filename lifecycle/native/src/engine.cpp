// The sans-IO engine: a mirror of lifecycle/engine/core.py (Engine).
#include "engine.hpp"

#include <algorithm>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "errors.hpp"
#include "py_repr.hpp"

namespace kvlife {

namespace {

// A request's state as state.requests holds it: a key without a record is a dormant request,
// which only waits (Scheduler::dormant_arrivals).
RequestState state_of(const CoreRequestPtr& req) { return req ? req->state : RequestState::WAITING; }

}  // namespace

Engine::Engine(const CoreConfig& config, const SchedulerConfig& scheduler, PolicyAsker* policies,
               const TransitionTable& table, Trace recorder, Retirer* retire)
    : core_(config, policies, table, recorder, retire),
      connector_(core_),
      scheduler_(scheduler, connector_),
      aggregator_(config.ranks),
      holder_(*this) {
    core_.lifecycle.device = &scheduler_.pool();
    core_.transfers.holds = &holder_;
    workers_.resize(static_cast<std::size_t>(config.ranks));
}

void Engine::PoolHolder::hold_blocks(const std::vector<BlockId>& blocks) {
    engine.scheduler_.pool().hold(blocks.data(), blocks.size());
}

void Engine::PoolHolder::unhold_blocks(const std::vector<BlockId>& blocks) { engine.scheduler_.release_held(blocks); }

std::vector<Command>& Engine::handle(const InputEvent& event) {
    handle(event, commands_);
    return commands_;
}

void Engine::handle(const InputEvent& event, std::vector<Command>& commands) {
    CoreState& state = core_.state;
    double t = event_time(event);
    if (t < state.now) {
        throw std::invalid_argument("time went backwards: " + float_repr(t) + " < " + float_repr(state.now));
    }
    state.now = t;
    state.recorder.input(event);
    dispatch(event, commands);
    if (!state.retiring.empty()) {
        core_.retire_finished();
    }
}

void Engine::dispatch(const InputEvent& event, std::vector<Command>& commands) {
    switch (event.index()) {
        case 2: {  // Tick
            auto result = scheduler_.schedule();
            ConnectorMeta& meta = result.second;
            to_workers(meta);
            core_.take_commands(commands);
            for (const JobPtr& load : meta.loads) {
                commands.emplace_back(StartLoad{load->job_id, load->request_id, load->moves, load->after});
            }
            for (const JobPtr& store : meta.stores) {
                commands.emplace_back(StartStore{store->job_id, store->request_id, store->moves});
            }
            for (const PrefetchJobPtr& pull : meta.prefetches) {
                commands.emplace_back(StartPrefetch{pull->job_id, pull->request_id, pull->moves});
            }
            commands.emplace_back(std::move(result.first));
            return;
        }
        case 5:  // StepOutput
            on_step_output(std::get<StepOutput>(event));
            break;
        case 4: {  // TransferReport
            const TransferReport& report = std::get<TransferReport>(event);
            worker_done(report.job_id, report.rank, report.failed);
            // KVConnectorOutput(kv_connector_worker_meta=WorkerMeta(((job, rank, failed),))), its
            // buffers reused from one report to the next.
            KVConnectorOutput& output = report_output_;
            if (!output.reports.has_value()) output.reports.emplace(1);
            WorkerReport& one = output.reports->front();
            one.job_id = report.job_id;
            one.rank = report.rank;
            one.failed.assign(report.failed.begin(), report.failed.end());
            connector_.update_connector_output(output);
            break;
        }
        case 3: {  // LookupAnswer
            const LookupAnswer& answer = std::get<LookupAnswer>(event);
            core_.on_lookup_answer(answer.request_id, answer.epoch, answer.tiers);
            break;
        }
        case 0: {  // Arrival
            const Arrival& arrival = std::get<Arrival>(event);
            scheduler_.add_request(arrival.request_id, arrival.prompt_tokens, arrival.block_hashes,
                                   arrival.max_tokens, arrival.resumable);
            break;
        }
        case 1:  // Abort
            on_abort(std::get<Abort>(event));
            break;
    }
    core_.take_commands(commands);
}

void Engine::on_abort(const Abort& event) {
    if (!scheduler_.finish_requests(event.request_id)) {
        const CoreState& state = core_.state;
        const Request* req = core_.find(event.request_id);
        std::optional<std::string_view> st;
        if (req != nullptr) {
            st = state_name(req->state);
        } else if (state.retired.contains(event.request_id)) {
            st = std::string_view("finished");
        }
        core_.lifecycle.warn("abort_ignored", {Field("req", event.request_id), Field("state", st)});
    }
}

void Engine::to_workers(const ConnectorMeta& meta) {
    for (WorkerBook& book : workers_) {
        for (int pass = 0; pass < 2; ++pass) {
            for (const JobPtr& job : pass == 0 ? meta.loads : meta.stores) {
                hashes_scratch_.clear();
                blocks_scratch_.clear();
                for (const BlockMove& m : job->moves) {
                    hashes_scratch_.push_back(m.block_hash);
                    blocks_scratch_.push_back(m.device_block);
                }
                std::optional<std::int64_t> after = job->kind == JobKind::LOAD ? job->after : std::nullopt;
                book.add(job->job_id, std::string(job_kind_name(job->kind)), job->request_id, hashes_scratch_.data(), hashes_scratch_.size(),
                         blocks_scratch_.data(), blocks_scratch_.size(), after);
            }
        }
    }
    if (!meta.hold_finished.empty() || !meta.abandon.empty()) {
        worker_steps_.push_back(WorkerStep{meta.step_id, meta.hold_finished, meta.abandon});
    }
}

void Engine::worker_step(std::int64_t step_id) {
    while (!worker_steps_.empty() && worker_steps_.front().step_id <= step_id) {
        WorkerStep step = std::move(worker_steps_.front());
        worker_steps_.pop_front();
        for (WorkerBook& book : workers_) {
            book.hold(step.holds);
            for (std::int64_t job_id : step.abandon) {
                const JobEntry* entry = book.jobs().find(job_id);
                if (entry != nullptr) {
                    std::vector<BlockHash> failed;
                    for (const auto& move : entry->moves) {
                        failed.push_back(move.first);
                    }
                    book.done(job_id, failed);
                }
            }
        }
    }
}

void Engine::worker_done(std::int64_t job_id, std::int64_t rank, const std::vector<BlockHash>& failed) {
    if (0 <= rank && rank < static_cast<std::int64_t>(workers_.size())) {
        workers_[static_cast<std::size_t>(rank)].done(job_id, failed);
    }
}

void Engine::on_step_output(const StepOutput& event) {
    const auto& steps = scheduler_.steps();
    if (steps.empty() || steps.begin()->first != event.step_id) {
        core_.lifecycle.warn("unknown_step", {Field("step", event.step_id)});
        return;
    }
    if (!event.failed_ranks.empty()) {
        std::vector<BlockId> written = steps.begin()->second.written;
        fail_step(written);
    }
    for (const auto& item : event.finished) {  // (a short list: a scan, no set per step)
        bool sampled = false;
        for (const auto& entry : scheduler_.steps().begin()->second.scheduled) {
            if (entry.samples && entry.req->request_id == item.first) {
                sampled = true;
                break;
            }
        }
        if (!sampled) {
            core_.lifecycle.warn("finish_for_unscheduled_request",
                                 {Field("req", item.first), Field("step", event.step_id)});
        }
    }
    worker_step(event.step_id);
    for (const StepReport& report : event.reports) {
        worker_done(report.job_id, report.rank, report.failed);
    }
    taken_.resize(workers_.size());
    for (std::size_t i = 0; i < workers_.size(); ++i) {
        workers_[i].take(taken_[i]);
    }
    aggregator_.aggregate(taken_, combined_);
    CoreState& state = core_.state;
    std::unordered_set<std::string> given_up;
    for (const auto& node : state.given_up_loads) {
        given_up.insert(node.key);
    }
    state.given_up_loads = OrderedDict<std::string, NoValue>();
    KVConnectorOutput output;
    auto as_set = [](const std::vector<std::string>& ids) {
        std::vector<std::string> out(ids);
        std::sort(out.begin(), out.end());
        out.erase(std::unique(out.begin(), out.end()), out.end());
        return out;
    };
    if (!combined_.sending.empty()) output.finished_sending = as_set(combined_.sending);
    if (!combined_.recving.empty()) output.finished_recving = as_set(combined_.recving);
    if (!event.reports.empty()) {
        std::vector<WorkerReport> reports;
        for (const StepReport& r : event.reports) {
            reports.push_back(WorkerReport{r.job_id, r.rank, r.failed});
        }
        output.reports = std::move(reports);
    }
    output.invalid_block_ids.assign(combined_.invalid.begin(), combined_.invalid.end());
    std::unordered_map<std::string, std::string> stops;
    for (const auto& item : event.finished) {
        stops[item.first] = item.second;  // dict(event.finished): a later pair wins
    }
    scheduler_.update_from_output(event.step_id, stops, &output, given_up);
}

void Engine::fail_step(const std::vector<BlockId>& written) {
    std::unordered_set<BlockId> bad(written.begin(), written.end());
    std::vector<std::string> victims;
    std::unordered_set<std::string> is_victim;
    bool grew = true;
    while (grew) {
        grew = false;
        for (const RequestPtr& req : scheduler_.requests()) {
            if (req->finished || is_victim.count(req->request_id)) {
                continue;
            }
            std::size_t first_bad = req->blocks.size();
            for (std::size_t i = 0; i < req->blocks.size(); ++i) {
                if (bad.count(req->blocks[i])) {
                    first_bad = i;
                    break;
                }
            }
            if (first_bad < req->blocks.size()) {
                for (std::size_t i = first_bad; i < req->blocks.size(); ++i) {
                    bad.insert(req->blocks[i]);
                }
                victims.push_back(req->request_id);
                is_victim.insert(req->request_id);
                grew = true;
            }
        }
    }
    std::vector<BlockId> sorted_bad(bad.begin(), bad.end());
    std::sort(sorted_bad.begin(), sorted_bad.end());
    scheduler_.pool().forget(sorted_bad.data(), sorted_bad.size());
    for (const std::string& rid : victims) {
        scheduler_.finish_requests(rid);
    }
}

// ---- what drivers and checks read -------------------------------------------------------------
bool Engine::busy() const { return core_.state.busy() || scheduler_.any_finished(); }

std::tuple<std::int64_t, std::int64_t, std::int64_t> Engine::progress() const {
    return {core_.state.moves, scheduler_.results(), scheduler_.pool().free()};
}

std::vector<std::string> Engine::stranded() const {
    std::vector<std::string> out;
    for (const auto& node : core_.state.requests) {  // (in arrival order: requests is insertion-ordered)
        RequestState st = state_of(node.value);
        if (st != RequestState::FINISHED) {
            out.push_back(node.key + ":" + std::string(state_name(st)));
        }
    }
    return out;
}

void Engine::record_stranded(double now) {
    Trace& recorder = core_.state.recorder;
    if (!recorder.enabled()) {
        return;
    }
    for (const auto& node : core_.state.requests) {
        RequestState st = state_of(node.value);
        if (st != RequestState::FINISHED) {
            recorder.warning(now, "stranded",
                             {Field("origin", "driver"), Field("req", node.key), Field("state", state_name(st))});
        }
    }
}

void Engine::check_invariants() {
    DeviceBlockPool& pool = scheduler_.pool();
    pool.check_accounting();
    const auto& refs = pool.refs();
    for (const RequestPtr& req : scheduler_.requests()) {
        for (BlockId block : req->blocks) {
            if (refs.at(static_cast<std::size_t>(block)) <= 0) {
                throw AssertionError("request " + req->request_id + " holds device block " + std::to_string(block) +
                                     " with no reference");
            }
        }
    }
    for (const TierIndex& tier : core_.state.tiers) {
        tier.check_accounting();
    }
}

}  // namespace kvlife
