// A mirror of lifecycle/breakdown.py's PhaseClock (see phase_clock.hpp).
#include "phase_clock.hpp"

namespace kvlife {

namespace {

constexpr std::size_t kNoSpent = ~static_cast<std::size_t>(0);

// breakdown._STATE_PHASE, as an index into Entry::spent (queue, lookup, load, hold); running and
// finished are never looked up (``_close`` handles them first).
constexpr std::array<std::size_t, PhaseClock::kStates> kSpentOf = {
    0,         // waiting: queue
    1,         // lookup_pending: lookup
    2,         // loading: load
    kNoSpent,  // running: spans
    3,         // sending: hold
    kNoSpent,  // finished: nothing
};

}  // namespace

// _close(rid, state, since, t)
void PhaseClock::close(Entry& entry, State state, double since, double t) {
    if (state == State::FINISHED) {
        return;
    }
    if (!entry.spent) {
        entry.spent = std::make_unique<Spent>();
    }
    if (state == State::RUNNING) {
        entry.spent->running.emplace_back(since, t);
    } else {
        double& spent = entry.spent->spent[kSpentOf[static_cast<std::size_t>(state)]];
        spent = spent + (t - since);
    }
}

void PhaseClock::transition(const std::string& rid, State source, State target, double t) {
    auto [entry, inserted] = entries_.try_emplace(rid);
    if (inserted) {  // (a reused slot was reset when its request was taken)
        entry->spent.reset();
        close(*entry, source, t, t);
    } else {
        close(*entry, entry->state, entry->since, t);
    }
    entry->state = target;
    entry->since = t;
    if (t > end_ms) {
        end_ms = t;
    }
}

void PhaseClock::arrival(const std::string& rid, double t) {
    auto [entry, inserted] = entries_.try_emplace(rid);
    if (inserted) {
        entry->state = State::WAITING;
        entry->since = t;
        entry->spent.reset();
    }
    if (t > end_ms) {
        end_ms = t;
    }
}

PhaseClock::Phases PhaseClock::take(const std::string& rid, std::optional<double> first_token_ms,
                                    std::optional<double> end) {
    Entry* entry = entries_.find(rid);
    if (entry == nullptr) {
        return {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    }
    if (entry->state != State::FINISHED) {
        double cut = end.has_value() ? *end : end_ms;
        close(*entry, entry->state, entry->since, cut > entry->since ? cut : entry->since);  // max(since, cut)
    }
    double prefill = 0.0;
    double decode = 0.0;
    const Spent none;
    const Spent& spent = entry->spent ? *entry->spent : none;
    for (const auto& [start, stop] : spent.running) {
        if (!first_token_ms.has_value() || stop <= *first_token_ms) {
            prefill += stop - start;
        } else if (start >= *first_token_ms) {
            decode += stop - start;
        } else {
            prefill += *first_token_ms - start;
            decode += stop - *first_token_ms;
        }
    }
    Phases phases = {spent.spent[0], spent.spent[1], spent.spent[2], prefill, decode, spent.spent[3]};
    entries_.erase(rid);
    return phases;
}

std::optional<std::pair<PhaseClock::State, double>> PhaseClock::since(const std::string& rid) const {
    const Entry* entry = entries_.find(rid);
    if (entry == nullptr) {
        return std::nullopt;
    }
    return std::make_pair(entry->state, entry->since);
}

}  // namespace kvlife
