// The simulated driver's loop: a mirror of lifecycle/drivers/simulator.py's Simulator (its
// discrete-event loop, virtual clock and physical model), event for event, with the same heap
// order, the same draws from random.Random(config.sim.seed) and the same doubles. Not mirrored:
// --chaos and --check (the online observer); those configs stay on the Python engine.
//
// The engine is a template parameter (no virtual dispatch). It provides:
//   std::vector<Command>& handle(InputEvent&& event);  // the commands; valid (and movable from)
//                                                      // until the next call
//   std::optional<double> next_wakeup();               // Engine.next_wakeup
//   bool busy();                                        // Engine.busy
//   P progress();                                       // Engine.progress: any P with ==
//   std::optional<int64_t> output_tokens(const std::string& request_id);  // None: left the scheduler
//   T sync_lookup(const std::vector<BlockHash>& hashes);  // the tier of each leading hit; any T
//                                                        // assignable to LookupAnswer::tiers (a
//                                                        // const std::vector<std::string>& will do)
//   int64_t finished_count();                           // state_counts["finished"]
//   void check_invariants();                            // Engine.check_invariants
//   std::vector<std::string> stranded();                // "id:state" of each unfinished request
//   void record_stranded(double now);                   // with a recorder: a driver warning
//                                                       // "stranded" per unfinished request, in
//                                                       // arrival order (records.warning); else nothing
// With keep_requests=False the engine is built with a retire hook that calls
// Simulator::retired(request_id) for each request it lets go (after folding it, as
// Simulator._retire folds it into metrics.RequestTotals).
//
// Hooks (plain function pointers and one context, set by whoever embeds the loop; none is needed):
//   between_events(ctx): at the top of every loop turn, before the next event is popped (where
//     the Python loop calls gate.check()); it may throw to cut the run there (the binding calls
//     PyErr_CheckSignals and the interrupts gate). The loop's state stays valid for a cut record.
//   refill(ctx): the arrival buffer ran dry: append the workload's next chunk (add_arrival,
//     request by request); false when the workload has ended.
//   progress(ctx, done, total): every 200 finished requests, and once at the end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "errors.hpp"
#include "events.hpp"
#include "heapq.hpp"
#include "links.hpp"
#include "lookup_service.hpp"
#include "py_random.hpp"
#include "py_repr.hpp"
#include "sched_request.hpp"
#include "step_cost.hpp"

namespace kvlife {

// What the loop takes from config.engine and config.sim (and physics), resolved.
struct SimSettings {
    std::int64_t ranks = 1;
    bool async_scheduling = false;  // two steps in flight
    bool exact = false;             // sim.completions == "exact"
    double rank_jitter_ms = 0.0;
    std::optional<std::int64_t> max_output_tokens;
    std::int64_t seed = 0;
    double rank_block_bytes = 0.0;  // physics.rank_block_bytes
    std::optional<std::int64_t> check_every;
    std::optional<std::int64_t> size;  // the workload's length, when known
};

// One configured tier: its failure rate and the links of each rank it uses (indexes into the
// rank's links; the same index twice where loads and stores compete, as on a disk).
struct SimTier {
    std::string name;
    double failure_rate = 0.0;
    std::size_t load_link = 0;
    std::size_t store_link = 0;
    bool store_is_write = false;
};

// simulator.stop_rule: the output length at which a request stops, and why.
struct StopRule {
    std::int64_t limit;
    bool length;  // "length" (the limit is lower than its output), else "stopped"
    const char* reason() const { return length ? "length" : "stopped"; }
};

inline StopRule stop_rule(std::int64_t output_length, std::optional<std::int64_t> max_output_tokens) {
    if (max_output_tokens.has_value() && *max_output_tokens < output_length) {
        return StopRule{*max_output_tokens, true};
    }
    return StopRule{output_length, false};
}

// The workload's requests not yet taken, in workload (arrival) order; a chunk at a time.
struct ArrivalBuffer {
    std::vector<std::string> ids;
    std::vector<double> arrival_ms;
    std::vector<std::int64_t> input_length;
    std::vector<std::int64_t> output_length;
    std::vector<std::size_t> hash_start;  // request i's hashes: [hash_start[i], hash_start[i + 1])
    std::vector<BlockHash> hashes;
    std::size_t next = 0;

    std::size_t size() const { return ids.size(); }
    void clear();
};

struct SimHooks {
    void* ctx = nullptr;
    void (*between_events)(void* ctx) = nullptr;
    bool (*refill)(void* ctx) = nullptr;
    void (*progress)(void* ctx, std::int64_t done, std::int64_t total) = nullptr;
};

// SimResult's fields the loop computes.
struct SimOutcome {
    double makespan_ms = 0.0;
    std::int64_t events = 0;
    std::vector<std::string> stranded;
    double critical_path_lookup_ms = 0.0;
};

namespace sim_detail {

// Heap keys of arrivals: below every other event's (those count up from 0), in workload order.
constexpr std::int64_t kArrivalSeq = -(static_cast<std::int64_t>(1) << 62);

enum class Kind : std::uint8_t { ARRIVAL, TICK, LINK_WAKE, LATER, STEP, REPORT, ANSWER };

struct Item {
    double t;
    std::int64_t seq;
    Kind kind;
    std::uint32_t ref;  // the payload's slot (LATER, STEP, REPORT, ANSWER) or the link (LINK_WAKE)
};

// Python's < on (t, seq, event) tuples: seq is unique, so the event is never compared.
struct ItemLess {
    bool operator()(const Item& a, const Item& b) const {
        if (!(a.t == b.t)) {
            return a.t < b.t;
        }
        return a.seq < b.seq;
    }
};

// Payloads of queued events, in reused slots (no allocation once a run has warmed up).
template <class T>
class Slab {
  public:
    std::uint32_t put(T&& value) {
        if (!free_.empty()) {
            std::uint32_t slot = free_.back();
            free_.pop_back();
            items_[slot] = std::move(value);
            return slot;
        }
        items_.push_back(std::move(value));
        return static_cast<std::uint32_t>(items_.size() - 1);
    }
    T& operator[](std::uint32_t slot) { return items_[slot]; }
    T take(std::uint32_t slot) {
        free_.push_back(slot);
        return std::move(items_[slot]);
    }

  private:
    std::vector<T> items_;
    std::vector<std::uint32_t> free_;
};

struct PairHash {
    std::size_t operator()(const std::pair<std::int64_t, std::int64_t>& k) const {
        return std::hash<std::int64_t>()(k.first) * 1000003u ^ std::hash<std::int64_t>()(k.second);
    }
};

struct LookupKey {
    std::string request_id;
    std::int64_t epoch;
    bool operator==(const LookupKey& o) const { return epoch == o.epoch && request_id == o.request_id; }
};

struct LookupKeyHash {
    std::size_t operator()(const LookupKey& k) const {
        return std::hash<std::string>()(k.request_id) * 31u ^ std::hash<std::int64_t>()(k.epoch);
    }
};

// One rank's share of a started transfer: [parts left, failed, jitter].
struct RankJob {
    std::int64_t parts;
    std::vector<BlockHash> failed;
    double delay;
};

// A load's reports so far, per rank (a join started after a rank reported copies at once).
struct LoadReports {
    std::vector<std::optional<std::vector<BlockHash>>> by_rank;
    std::size_t count = 0;
};

// A started transfer's command (a tick's transfers wait for its sync lookups: _Later).
using Transfer = std::variant<StartLoad, StartStore, StartPrefetch>;

}  // namespace sim_detail

template <class Engine>
class Simulator {
  public:
    Simulator(Engine& engine, const SimSettings& settings, const StepCost& cost, const LookupService& lookups,
              const std::vector<Link>& rank_links, std::vector<SimTier> tiers)
        : engine_(engine),
          settings_(settings),
          cost_(cost),
          lookups_(lookups),
          rng_(settings.seed),
          tiers_(std::move(tiers)),
          links_per_rank_(rank_links.size()),
          max_in_flight_(settings.async_scheduling ? 2 : 1) {
        for (std::int64_t rank = 0; rank < settings_.ranks; ++rank) {
            links_.insert(links_.end(), rank_links.begin(), rank_links.end());
        }
        link_due_.assign(links_.size(), std::nullopt);
        for (const SimTier& tier : tiers_) {
            failing_tiers_ = failing_tiers_ || tier.failure_rate != 0.0;
        }
    }

    SimHooks hooks;
    ArrivalBuffer arrivals;

    // Append requests to the arrival buffer (workload order).
    void add_arrival(std::string request_id, double arrival_ms, std::int64_t input_length, std::int64_t output_length,
                     const BlockHash* hashes, std::size_t count) {
        ArrivalBuffer& a = arrivals;
        if (a.hash_start.empty()) {
            a.hash_start.push_back(a.hashes.size());
        }
        a.ids.push_back(std::move(request_id));
        a.arrival_ms.push_back(arrival_ms);
        a.input_length.push_back(input_length);
        a.output_length.push_back(output_length);
        a.hashes.insert(a.hashes.end(), hashes, hashes + count);
        a.hash_start.push_back(a.hashes.size());
    }

    // Simulator._retire's second half: the engine let the request go; forget its stop rule.
    void retired(const std::string& request_id) { stops_.erase(request_id); }

    std::int64_t steps_in_flight() const { return steps_in_flight_; }
    std::int64_t events() const { return events_; }
    std::int64_t taken() const { return taken_; }
    double critical_path_lookup_ms() const { return critical_path_lookup_ms_; }
    // The workload's size: given, or (a stream of unknown length) what was taken so far.
    std::int64_t total() const { return settings_.size.has_value() ? *settings_.size : taken_; }
    const LookupService& lookups() const { return lookups_; }
    const std::vector<Link>& links() const { return links_; }

    SimOutcome run() {
        push_arrival();
        double now = 0.0;
        while (!queue_.empty() || idle_wake()) {
            if (hooks.between_events != nullptr) {
                hooks.between_events(hooks.ctx);
            }
            sim_detail::Item item = heapq::heappop(queue_, sim_detail::ItemLess());
            now = item.t;
            switch (item.kind) {
                case sim_detail::Kind::LINK_WAKE:
                    wake(now, item.ref);
                    continue;
                case sim_detail::Kind::LATER:
                    start_transfer(now, laters_.take(item.ref));
                    continue;
                case sim_detail::Kind::STEP:
                    on_step_end(now, item.ref);
                    continue;
                case sim_detail::Kind::REPORT: {
                    TransferReport report = reports_.take(item.ref);
                    if (steps_in_flight_ != 0 && !settings_.exact) {
                        held_reports_.push_back(std::move(report));
                        continue;
                    }
                    delivered_report(report.job_id);
                    feed(now, InputEvent(std::move(report)));
                    continue;
                }
                case sim_detail::Kind::ANSWER: {
                    bool instant = false;
                    LookupAnswer answer = answer_lookup(answers_.take(item.ref), instant);
                    if (steps_in_flight_ != 0 && !settings_.exact && !instant) {
                        held_answers_.push_back(std::move(answer));
                        continue;
                    }
                    feed(now, InputEvent(std::move(answer)));
                    continue;
                }
                case sim_detail::Kind::ARRIVAL: {
                    Arrival arrival = std::move(pending_arrival_);
                    push_arrival();
                    feed(now, InputEvent(std::move(arrival)));
                    continue;
                }
                case sim_detail::Kind::TICK: {
                    auto found = wakeup_seqs_.find(item.seq);
                    if (found != wakeup_seqs_.end()) {
                        wakeup_seqs_.erase(found);
                        wakeup_times_.erase(now);
                        if (tick_pending_.has_value() || steps_in_flight_ >= max_in_flight_) {
                            continue;  // a regular tick comes anyway (after the step in flight)
                        }
                    }
                    tick_pending_.reset();
                    feed(now, InputEvent(Tick{now}));
                    continue;
                }
            }
        }
        if (hooks.progress != nullptr) {
            hooks.progress(hooks.ctx, engine_.finished_count(), total());
        }
        engine_.check_invariants();
        SimOutcome outcome;
        outcome.stranded = engine_.stranded();
        if (!outcome.stranded.empty()) {
            // Nothing is left to happen: say in the trace which requests never finished.
            engine_.record_stranded(now);
        }
        outcome.makespan_ms = now;
        outcome.events = events_;
        outcome.critical_path_lookup_ms = critical_path_lookup_ms_;
        return outcome;
    }

  private:
    using Item = sim_detail::Item;
    using Kind = sim_detail::Kind;

    void push(double t, Kind kind, std::uint32_t ref = 0) {
        heapq::heappush(queue_, Item{t, seq_, kind, ref}, sim_detail::ItemLess());
        seq_ += 1;
    }

    void push_report(double t, TransferReport&& report);

    // Queue the workload's next arrival (the only one in the queue at any time).
    void push_arrival() {
        ArrivalBuffer& a = arrivals;
        if (a.next >= a.size()) {
            a.clear();
            if (hooks.refill == nullptr || !hooks.refill(hooks.ctx) || a.size() == 0) {
                return;
            }
        }
        std::size_t i = a.next++;
        double arrival_ms = a.arrival_ms[i];
        if (arrival_ms < last_arrival_) {
            throw std::invalid_argument("workload request " + str_repr(a.ids[i]) + " arrives at " +
                                        float_repr(arrival_ms) + " ms, before the " + float_repr(last_arrival_) +
                                        " ms of the one before it: a stream must be in arrival order");
        }
        last_arrival_ = arrival_ms;
        stops_.emplace(a.ids[i], stop_rule(a.output_length[i], settings_.max_output_tokens));
        pending_arrival_.t = arrival_ms;
        pending_arrival_.request_id = a.ids[i];
        pending_arrival_.prompt_tokens = a.input_length[i];
        pending_arrival_.block_hashes.assign(a.hashes.begin() + static_cast<std::ptrdiff_t>(a.hash_start[i]),
                                             a.hashes.begin() + static_cast<std::ptrdiff_t>(a.hash_start[i + 1]));
        pending_arrival_.resumable = false;
        pending_arrival_.max_tokens.reset();
        heapq::heappush(queue_, Item{arrival_ms, sim_detail::kArrivalSeq + taken_, Kind::ARRIVAL, 0},
                        sim_detail::ItemLess());
        taken_ += 1;
    }

    // The step ends: its output, with the requests that stop.
    void on_step_end(double now, std::uint32_t ref) {
        if (tick_pending_.has_value() && *tick_pending_ == now && steps_in_flight_ < max_in_flight_) {
            // Async scheduling: the next step is scheduled before this output is taken.
            push(now, Kind::STEP, ref);
            return;
        }
        StepPlan plan = steps_.take(ref);
        steps_in_flight_ -= 1;
        StepOutput output;
        output.t = now;
        output.step_id = plan.step_id;
        step_finishes(plan, output.finished);
        std::vector<TransferReport> reports;
        reports.swap(held_reports_);
        output.reports.reserve(reports.size());
        for (TransferReport& r : reports) {
            output.reports.push_back(StepReport{r.job_id, r.rank, std::move(r.failed)});
        }
        auto idle_at = idle_steps_.find(plan.step_id);
        bool idle = idle_at != idle_steps_.end();
        if (idle) {
            idle_steps_.erase(idle_at);
        }
        for (const StepReport& r : output.reports) {
            delivered_report(r.job_id);
        }
        bool quiet_output = idle && output.reports.empty() && output.finished.empty();
        feed(now, InputEvent(std::move(output)), quiet_output);
        if (!held_answers_.empty()) {
            std::vector<LookupAnswer> held;
            held.swap(held_answers_);
            for (LookupAnswer& answer : held) {
                answer.t = now;
                feed(now, InputEvent(std::move(answer)));
            }
        }
    }

    // simulator.step_finishes: which sampling requests stop, and why.
    void step_finishes(const StepPlan& plan, std::vector<std::pair<std::string, std::string>>& finished) {
        for (const Scheduled& entry : plan.entries) {
            if (!entry.samples) {
                continue;
            }
            // (A listed owner is the record the lookup by id would find.)
            SchedRequest* owner = entry.owner;
            std::optional<std::int64_t> produced = owner != nullptr && owner->listed
                                                       ? std::optional<std::int64_t>(owner->output_tokens)
                                                       : engine_.output_tokens(entry.id());
            if (!produced.has_value()) {
                continue;  // it finished (or left) meanwhile
            }
            StopRule stop = stop_of(entry);
            if (*produced + 1 >= stop.limit) {
                finished.emplace_back(entry.id(), stop.reason());
            }
        }
    }

    // A scheduled request's stop rule: kept on its scheduler record after the first lookup. (An
    // id's rule is set at its arrival and dropped when the engine lets the request go, after
    // the scheduler has; step_finishes asks only of a request the scheduler still lists.)
    StopRule stop_of(const Scheduled& entry) {
        SchedRequest* owner = entry.owner;
        if (owner != nullptr && owner->stop_known) {
            return StopRule{owner->stop_limit, owner->stop_length};
        }
        auto stop = stops_.find(entry.id());
        if (stop == stops_.end()) {
            throw KeyError(entry.id());  // Python's KeyError(rid)
        }
        if (owner != nullptr) {
            owner->stop_limit = stop->second.limit;
            owner->stop_length = stop->second.length;
            owner->stop_known = true;
        }
        return stop->second;
    }

    // Nothing is queued: if the engine has a deadline ahead, wake for it.
    bool idle_wake() {
        std::optional<double> wake_at = engine_.next_wakeup();
        if (!wake_at.has_value()) {
            return false;
        }
        push_wake(*wake_at);
        return true;
    }

    // A tick at `wake_at` even if nothing else happens then (skipped if one comes anyway).
    void push_wake(double wake_at) {
        if (wakeup_times_.insert(wake_at).second) {
            wakeup_seqs_.insert(seq_);
            push(wake_at, Kind::TICK);
        }
    }

    // Hand one input to the engine and carry out its commands.
    void feed(double now, InputEvent&& event, bool idle = false) {
        std::optional<decltype(engine_.progress())> before;
        if (idle) {
            before.emplace(engine_.progress());
        }
        std::vector<Command>& commands = engine_.handle(std::move(event));
        events_ += 1;
        if (settings_.check_every.has_value() && events_ % *settings_.check_every == 0) {
            engine_.check_invariants();
        }
        bool quiet = false;
        double ready = now;
        StepPlan* plan = nullptr;
        for (Command& command : commands) {
            if (StepPlan* p = std::get_if<StepPlan>(&command)) {
                plan = p;
                if (!p->sync_lookup_keys.empty()) {
                    ready = pay_sync_lookups(now, p->sync_lookup_keys);
                }
            }
        }
        bool plan_empty = false;
        std::int64_t plan_step = 0;
        if (plan != nullptr) {
            for (std::int64_t job_id : plan->flush) {
                flush(ready, job_id);
            }
            plan_empty = plan->entries.empty();
            plan_step = plan->step_id;
        }
        std::size_t count = commands.size();
        for (Command& command : commands) {
            switch (command.index()) {
                case 6:  // StepPlan
                    start_step(ready, std::move(std::get<StepPlan>(command)));
                    break;
                case 2:  // StartLoad
                    start_or_later(now, ready, sim_detail::Transfer(std::move(std::get<StartLoad>(command))));
                    break;
                case 3:  // StartStore
                    start_or_later(now, ready, sim_detail::Transfer(std::move(std::get<StartStore>(command))));
                    break;
                case 4:  // StartPrefetch
                    start_or_later(now, ready, sim_detail::Transfer(std::move(std::get<StartPrefetch>(command))));
                    break;
                case 0:  // SubmitLookup
                    submit_lookup(now, std::get<SubmitLookup>(command));
                    break;
                default:
                    break;
            }
        }
        if (plan != nullptr && plan_empty && count == 1) {
            quiet = true;  // the pass found nothing to do: its (empty) step's output is idle
            idle_steps_.insert(plan_step);
        } else if (idle && count == 0 && engine_.progress() == *before) {
            quiet = true;  // an idle step's output that changed nothing: no spinning
        }
        if (!tick_pending_.has_value() && steps_in_flight_ < max_in_flight_ && !quiet && engine_.busy()) {
            tick_pending_ = now;
            push(now, Kind::TICK);
        }
        std::optional<double> wake_at = engine_.next_wakeup();
        if (wake_at.has_value() && (queue_.empty() || *wake_at < queue_[0].t)) {
            push_wake(*wake_at);
        }
        if (hooks.progress != nullptr) {
            std::int64_t done = engine_.finished_count();
            if (done - progress_mark_ >= 200) {
                progress_mark_ = done;
                hooks.progress(hooks.ctx, done, total());
            }
        }
    }

    void start_or_later(double now, double ready, sim_detail::Transfer&& transfer) {
        if (ready > now) {
            push(ready, Kind::LATER, laters_.put(std::move(transfer)));
        } else {
            start_transfer(now, std::move(transfer));
        }
    }

    // ---- steps ----------------------------------------------------------------------------
    // Send the pass's sync lookups to the lookup service; when the last one answers.
    double pay_sync_lookups(double now, const std::vector<std::int64_t>& key_counts) {
        double ready = now;
        for (std::int64_t keys : key_counts) {
            if (keys != 0) {
                double answered = lookups_.submit(LookupId{}, keys, now);
                if (answered > ready) {
                    ready = answered;
                }
            }
        }
        critical_path_lookup_ms_ += ready - now;
        return ready;
    }

    // The step runs for the cost of its batch, once the step before it has ended.
    void start_step(double start, StepPlan&& plan) {
        if (last_step_end_ > start) {
            start = last_step_end_;
        }
        double end = start;
        if (!plan.entries.empty()) {
            std::int64_t tokens = 0;
            std::int64_t cached = 0;
            std::int64_t twice_pairs = 0;
            for (const Scheduled& entry : plan.entries) {
                std::int64_t n = entry.num_tokens;
                std::int64_t b = entry.computed_before;
                tokens += n;
                cached += b;
                twice_pairs += n * (b + b + n + 1);
            }
            end = start + cost_.totals_ms(tokens, static_cast<long long>(plan.entries.size()),
                                          static_cast<double>(twice_pairs) * 0.5, cached + tokens);
        }
        last_step_end_ = end;
        steps_in_flight_ += 1;
        push(end, Kind::STEP, steps_.put(std::move(plan)));  // becomes the step's StepOutput when it pops
    }

    // A preemption flushed a store in flight: its ranks report it now; one not started yet
    // reports as it starts.
    void flush(double now, std::int64_t job_id) {
        bool started = false;
        for (std::int64_t rank = 0; rank < settings_.ranks; ++rank) {
            auto found = rank_jobs_.find({job_id, rank});
            if (found != rank_jobs_.end()) {
                started = true;
                TransferReport report{now, job_id, rank, std::move(found->second.failed)};
                rank_jobs_.erase(found);
                push(now, Kind::REPORT, reports_.put(std::move(report)));
            }
        }
        if (!started) {
            flushed_.insert(job_id);
        }
    }

    // A report handed to the engine: a load's entries are kept until its last rank's.
    void delivered_report(std::int64_t job_id) {
        auto seen = load_reports_.find(job_id);
        if (seen != load_reports_.end() && seen->second.count >= static_cast<std::size_t>(settings_.ranks) &&
            followers_.find(job_id) == followers_.end()) {
            load_reports_.erase(seen);
        }
    }

    // ---- transfers --------------------------------------------------------------------------
    std::size_t tier_of(const std::string& name) const {
        for (std::size_t i = 0; i < tiers_.size(); ++i) {
            if (tiers_[i].name == name) {
                return i;
            }
        }
        throw KeyError(name);
    }

    void start_transfer(double now, sim_detail::Transfer&& transfer) {
        bool store = transfer.index() == 1;
        if (StartLoad* load = std::get_if<StartLoad>(&transfer)) {
            if (load->after.has_value()) {
                follow(now, std::move(*load));
                return;
            }
        }
        // (hash, tier) of each block, and the tiers in first-seen order with their counts.
        blocks_.clear();
        counts_.clear();
        std::int64_t job_id = 0;
        auto add = [&](BlockHash h, const std::string& name) {
            std::size_t tier = tier_of(name);
            blocks_.emplace_back(h, tier);
            for (auto& c : counts_) {
                if (c.first == tier) {
                    c.second += 1;
                    return;
                }
            }
            counts_.emplace_back(tier, 1);
        };
        if (StartPrefetch* pull = std::get_if<StartPrefetch>(&transfer)) {
            job_id = pull->job_id;
            for (const TierMove& m : pull->moves) {
                add(m.block_hash, m.src_tier);
            }
        } else if (StartLoad* load = std::get_if<StartLoad>(&transfer)) {
            job_id = load->job_id;
            for (const BlockMove& m : load->moves) {
                add(m.block_hash, m.tier);
            }
            sim_detail::LoadReports& fresh = load_reports_[job_id];
            fresh.by_rank.assign(static_cast<std::size_t>(settings_.ranks), std::nullopt);
            fresh.count = 0;
        } else {
            StartStore& st = std::get<StartStore>(transfer);
            job_id = st.job_id;
            for (const BlockMove& m : st.moves) {
                add(m.block_hash, m.tier);
            }
        }
        bool flushed = flushed_.erase(job_id) != 0;
        double jitter = settings_.rank_jitter_ms;
        double share = settings_.rank_block_bytes;
        for (std::int64_t rank = 0; rank < settings_.ranks; ++rank) {
            std::vector<BlockHash> failed;
            if (failing_tiers_) {
                for (const auto& block : blocks_) {
                    double rate = tiers_[block.second].failure_rate;
                    if (rate != 0.0 && rng_.random() < rate) {
                        failed.push_back(block.first);
                    }
                }
            }
            double delay = jitter != 0.0 ? rng_.uniform(0.0, jitter) : 0.0;
            if (flushed) {
                push_report(now, TransferReport{now, job_id, rank, std::move(failed)});
                continue;
            }
            std::size_t base = static_cast<std::size_t>(rank) * links_per_rank_;
            for (const auto& c : counts_) {
                const SimTier& tier = tiers_[c.first];
                std::size_t link = base + (store ? tier.store_link : tier.load_link);
                links_[link].start(TransferId{job_id, rank}, static_cast<double>(c.second) * share, now,
                                   store && tier.store_is_write);
                schedule_wake(link);
            }
            rank_jobs_[{job_id, rank}] =
                sim_detail::RankJob{static_cast<std::int64_t>(counts_.size()), std::move(failed), delay};
        }
    }

    // A join copies what load `join.after` brings: on each rank, once that rank has reported
    // the load (at once if it already has).
    void follow(double now, StartLoad&& join) {
        std::int64_t owner = *join.after;
        std::vector<StartLoad>& joins = followers_[owner];
        joins.push_back(std::move(join));
        const StartLoad& mine = joins.back();
        auto seen = load_reports_.find(owner);
        if (seen == load_reports_.end()) {
            return;
        }
        // Copies: reporting may add to load_reports_ (never for this owner's entry).
        std::vector<std::pair<std::int64_t, std::vector<BlockHash>>> sofar;
        for (std::size_t rank = 0; rank < seen->second.by_rank.size(); ++rank) {
            if (seen->second.by_rank[rank].has_value()) {
                sofar.emplace_back(static_cast<std::int64_t>(rank), *seen->second.by_rank[rank]);
            }
        }
        StartLoad copy = mine;  // the vector of joins may grow while reporting
        for (const auto& r : sofar) {
            report_follower(now, copy, r.first, r.second);
        }
    }

    void report_follower(double t, const StartLoad& join, std::int64_t rank, const std::vector<BlockHash>& failed) {
        std::vector<BlockHash> mine;
        for (BlockHash h : failed) {
            for (const BlockMove& m : join.moves) {
                if (m.block_hash == h) {
                    mine.push_back(h);
                    break;
                }
            }
        }
        push_report(t, TransferReport{t, join.job_id, rank, std::move(mine)});
    }

    // Keep one wake-up pending at the link's next drain (earlier ones become stale).
    void schedule_wake(std::size_t link) {
        std::optional<Completion> upcoming = links_[link].next_completion();
        if (!upcoming.has_value()) {
            link_due_[link].reset();
            return;
        }
        double t = upcoming->t;
        if (!link_due_[link].has_value() || *link_due_[link] != t) {
            link_due_[link] = t;
            push(t, Kind::LINK_WAKE, static_cast<std::uint32_t>(link));
        }
    }

    void wake(double now, std::size_t link) {
        if (!link_due_[link].has_value() || *link_due_[link] != now) {
            return;  // stale: a later start moved this link's next drain
        }
        link_due_[link].reset();
        done_.clear();
        links_[link].advance(now, done_);
        for (const Completion& c : done_) {
            auto found = rank_jobs_.find({c.tid.job_id, c.tid.rank});
            if (found == rank_jobs_.end()) {
                continue;  // flushed: reported when its step started
            }
            found->second.parts -= 1;
            if (found->second.parts == 0) {
                double at = c.t + found->second.delay;
                double t = at > now ? at : now;
                std::vector<BlockHash> failed = std::move(found->second.failed);
                rank_jobs_.erase(found);
                push_report(t, TransferReport{t, c.tid.job_id, c.tid.rank, std::move(failed)});
            }
        }
        schedule_wake(link);
    }

    // ---- lookups ------------------------------------------------------------------------------
    void submit_lookup(double now, const SubmitLookup& command) {
        sim_detail::LookupKey key{command.request_id, command.epoch};
        if (pending_lookup_.find(key) != pending_lookup_.end()) {
            return;  // idempotent: one answer per (request, epoch)
        }
        std::int64_t keys = static_cast<std::int64_t>(command.block_hashes.size());
        double t = now;
        if (keys != 0) {
            t = lookups_.submit(LookupId{true, command.request_id, command.epoch}, keys, now);
        }
        pending_lookup_.emplace(std::move(key), command.block_hashes);
        push(t, Kind::ANSWER, answers_.put(LookupAnswer{t, command.request_id, command.epoch, std::nullopt}));
    }

    // The answer as the tiers stand when it is served; instant: it had nothing to look up.
    LookupAnswer answer_lookup(LookupAnswer&& event, bool& instant) {
        std::vector<BlockHash> hashes;
        auto found = pending_lookup_.find(sim_detail::LookupKey{event.request_id, event.epoch});
        if (found != pending_lookup_.end()) {
            hashes = std::move(found->second);
            pending_lookup_.erase(found);
        }
        event.tiers = engine_.sync_lookup(hashes);
        instant = hashes.empty();
        return std::move(event);
    }

    Engine& engine_;
    SimSettings settings_;
    StepCost cost_;
    LookupService lookups_;
    PyRandom rng_;
    std::vector<SimTier> tiers_;
    std::size_t links_per_rank_;
    std::vector<Link> links_;  // rank r's links: [r * links_per_rank_, (r + 1) * links_per_rank_)
    std::vector<std::optional<double>> link_due_;  // the time of each busy link's pending wake-up
    bool failing_tiers_ = false;
    std::int64_t max_in_flight_;

    std::vector<Item> queue_;
    std::int64_t seq_ = 0;
    std::int64_t events_ = 0;
    std::int64_t progress_mark_ = 0;
    std::unordered_map<std::string, StopRule> stops_;
    std::int64_t taken_ = 0;
    double last_arrival_ = 0.0;
    Arrival pending_arrival_{};
    std::int64_t steps_in_flight_ = 0;
    double last_step_end_ = 0.0;
    std::optional<double> tick_pending_;
    std::unordered_set<std::int64_t> idle_steps_;
    std::unordered_map<sim_detail::LookupKey, std::vector<BlockHash>, sim_detail::LookupKeyHash> pending_lookup_;
    std::unordered_set<std::int64_t> wakeup_seqs_;
    std::unordered_set<double> wakeup_times_;
    std::unordered_map<std::pair<std::int64_t, std::int64_t>, sim_detail::RankJob, sim_detail::PairHash> rank_jobs_;
    std::unordered_set<std::int64_t> flushed_;
    std::unordered_map<std::int64_t, std::vector<StartLoad>> followers_;
    std::unordered_map<std::int64_t, sim_detail::LoadReports> load_reports_;
    double critical_path_lookup_ms_ = 0.0;
    std::vector<TransferReport> held_reports_;
    std::vector<LookupAnswer> held_answers_;

    sim_detail::Slab<sim_detail::Transfer> laters_;
    sim_detail::Slab<StepPlan> steps_;
    sim_detail::Slab<TransferReport> reports_;
    sim_detail::Slab<LookupAnswer> answers_;

    // Scratch, reused.
    std::vector<std::pair<BlockHash, std::size_t>> blocks_;
    std::vector<std::pair<std::size_t, std::int64_t>> counts_;
    std::vector<Completion> done_;
};

// A rank report: a load's joins report with it; then it is queued.
template <class Engine>
void Simulator<Engine>::push_report(double t, TransferReport&& report) {
    auto seen = load_reports_.find(report.job_id);
    if (seen != load_reports_.end()) {
        auto rank = static_cast<std::size_t>(report.rank);
        if (rank >= seen->second.by_rank.size()) {
            seen->second.by_rank.resize(rank + 1);
        }
        if (!seen->second.by_rank[rank].has_value()) {
            seen->second.count += 1;
        }
        seen->second.by_rank[rank] = report.failed;
        auto joins = followers_.find(report.job_id);
        if (joins != followers_.end()) {
            std::vector<StartLoad>& list = joins->second;
            for (std::size_t i = 0; i < list.size(); ++i) {
                report_follower(t, list[i], report.rank, report.failed);
            }
        }
        if (seen->second.count >= static_cast<std::size_t>(settings_.ranks)) {
            followers_.erase(report.job_id);
        }
    }
    push(t, Kind::REPORT, reports_.put(std::move(report)));
}

}  // namespace kvlife
