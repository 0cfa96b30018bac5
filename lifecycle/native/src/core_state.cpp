// Mirrors lifecycle/engine/state.py: CoreState's methods (Job, PrefetchJob and Stats are plain
// data in core_state.hpp; moves_record and count_tiers are rendered by records.cpp's Trace::job).
#include "core_state.hpp"

#include <limits>

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

}  // namespace

std::string_view job_kind_name(JobKind kind) { return kind == JobKind::LOAD ? "load" : "store"; }

CoreState::CoreState(CoreConfig config_, Trace recorder_, Retirer* retire_)
    : config(std::move(config_)), ranks(config.ranks), recorder(recorder_), retire(retire_) {
    tiers.reserve(config.tiers.size());
    for (const CoreTierConfig& t : config.tiers) {
        tiers.emplace_back(t.name, t.capacity_blocks, t.eviction);
    }
}

TierIndex& CoreState::tier(std::string_view name) {
    for (TierIndex& t : tiers) {
        if (t.name == name) return t;
    }
    throw KeyError(std::string(name));  // KeyError(name): str() of it is repr(name)
}

const TierIndex& CoreState::tier(std::string_view name) const {
    return const_cast<CoreState*>(this)->tier(name);
}

std::int64_t CoreState::new_job_id() { return next_job_id++; }

std::size_t CoreState::hit_candidates(Request& req) {
    const std::int64_t limit = floor_div(req.prompt_tokens + req.generated - 1, config.block_tokens);
    if (limit > static_cast<std::int64_t>(req.hashes.size())) ensure_hashes(req, limit);
    const std::int64_t size = static_cast<std::int64_t>(req.hashes.size());
    if (limit >= 0) return static_cast<std::size_t>(limit < size ? limit : size);
    return static_cast<std::size_t>(size + limit > 0 ? size + limit : 0);  // hashes[:-k]
}

void CoreState::ensure_hashes(Request& req, std::int64_t blocks) {
    req.hashes.extend(req.request_id, blocks);
}

void CoreState::sync_lookup(const BlockHash* hashes, std::size_t n, std::vector<std::size_t>& found) const {
    found.clear();
    for (std::size_t i = 0; i < n; ++i) {
        std::size_t holder = 0;
        while (holder < tiers.size() && !tiers[holder].contains(hashes[i])) ++holder;
        if (holder == tiers.size()) break;
        found.push_back(holder);
    }
}

void CoreState::tier_names(const std::vector<std::size_t>& positions, std::vector<std::string>& names) const {
    names.clear();
    for (std::size_t at : positions) names.push_back(tiers.at(at).name);
}

std::int64_t CoreState::arrived() const { return static_cast<std::int64_t>(requests.size() + retired.size()); }

bool CoreState::busy() const {
    if (state_counts[static_cast<std::size_t>(RequestState::FINISHED)] <
        static_cast<std::int64_t>(requests.size() + retired.size())) {
        return true;
    }
    if (!prefetches.empty()) return true;
    for (const auto& node : jobs) {
        if (!node.value->timed_out) return true;
    }
    return !held.empty();
}

std::optional<double> CoreState::next_wakeup() {
    const double inf = std::numeric_limits<double>::infinity();
    double soonest = inf;
    for (const auto& node : prefetch_waits) {
        const PrefetchJob& wait = *node.value;
        const CoreRequestPtr* req = requests.find(node.key);
        if (req == nullptr || (*req)->epoch != wait.epoch || !prefetches.contains(wait.job_id)) continue;
        if (now < wait.deadline_ms && wait.deadline_ms < soonest) soonest = wait.deadline_ms;
    }
    while (!lookup_timers.empty() && !lookup_timer_live(lookup_timers.front())) lookup_timers.pop_front();
    for (const LookupTimer& timer : lookup_timers) {
        if (timer.due >= soonest) break;
        if (timer.due > now && lookup_timer_live(timer)) {
            soonest = timer.due;
            break;
        }
    }
    if (config.transfer_deadline_ms) {
        const double transfer = *config.transfer_deadline_ms;
        for (const auto& node : jobs) {
            const Job& job = *node.value;
            if (!job.timed_out && now < job.started_ms + transfer) {
                const double due = job.started_ms + transfer;
                if (due < soonest) soonest = due;
                break;
            }
        }
    }
    const double reclaim = config.reclaim_deadline_ms;
    for (const auto& node : jobs) {
        const Job& job = *node.value;
        if (now < job.started_ms + reclaim) {
            const double due = job.started_ms + reclaim;
            if (due < soonest) soonest = due;
            break;
        }
    }
    for (const auto& node : prefetches) {
        const PrefetchJob& pull = *node.value;
        if (now < pull.started_ms + reclaim) {
            const double due = pull.started_ms + reclaim;
            if (due < soonest) soonest = due;
            break;
        }
    }
    if (soonest != inf) return soonest;
    return std::nullopt;
}

bool CoreState::lookup_timer_live(const LookupTimer& timer) const {
    const CoreRequestPtr* req = requests.find(timer.request_id);
    return req != nullptr && (*req)->state == RequestState::LOOKUP_PENDING &&
           (*req)->async_lookups == timer.async_lookups;
}

std::vector<CoreRequestPtr> CoreState::unfinished() const {
    std::vector<CoreRequestPtr> out;
    for (const auto& node : requests) {
        if (node.value->state != RequestState::FINISHED) out.push_back(node.value);
    }
    return out;
}

}  // namespace kvlife
