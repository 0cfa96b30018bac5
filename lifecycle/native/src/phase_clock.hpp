// Where each request's time went: a mirror of lifecycle/breakdown.py's ``PhaseClock``.
//
// The Python clock folds records (``record(dict)``); the native engine calls the two record
// kinds the clock reads directly, where it writes them: ``transition`` (a ``transition``
// record: request, from, to, t) and ``arrival`` (an ``arrival`` input: request, t). ``take``
// hands a request's phases over (breakdown.PHASES order) and forgets it, so the clock holds
// only the requests not made into rows yet, and a request's slot (with its spans' buffer) is
// reused by a later one: a clock at its working size allocates nothing.
//
// The floats are the reference's, bit for bit: a phase is ``0.0 + (t - since) + ...`` in the
// order the request left its states (``spent.get(phase, 0.0) + (t - since)``), and the
// running spans are kept and folded in order at ``take``, split at the first token there.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ordered_dict.hpp"

namespace kvlife {

class PhaseClock {
  public:
    // specs/names.py RequestState, in its order (the numbering of every native mirror of it).
    enum class State : std::uint8_t { WAITING, LOOKUP_PENDING, LOADING, RUNNING, SENDING, FINISHED };
    static constexpr std::size_t kStates = 6;

    // breakdown.PHASES: queue, lookup, load, prefill, decode, hold.
    static constexpr std::size_t kPhases = 6;
    using Phases = std::array<double, kPhases>;

    // record({"kind": "transition", "req": rid, "from": source, "to": target, "t": t}): the
    // request's time in the state it leaves (the one the clock holds for it; ``source`` for a
    // request it holds none for, which then counts from ``t``) is added to that state's phase.
    void transition(const std::string& rid, State source, State target, double t);

    // record({"kind": "input", "type": "arrival", "request_id": rid, "t": t}): the request waits
    // from ``t`` unless the clock already holds a state for it.
    void arrival(const std::string& rid, double t);

    // take(rid, first_token_ms, end_ms): the request's phases (PHASES order), its figures
    // forgotten. Running time before ``first_token_ms`` is prefill, after it decode (none: all
    // prefill). A request still in a state is cut at ``end_ms`` (none: ``end_ms`` the member).
    // A request the clock holds nothing for gives zeros.
    Phases take(const std::string& rid, std::optional<double> first_token_ms,
                std::optional<double> end_ms = std::nullopt);

    // The request's state and since when (``_since.get(rid)``); none when it holds none.
    std::optional<std::pair<State, double>> since(const std::string& rid) const;

    // The requests it holds figures for (``len(_since)``; a request with spent time or running
    // spans always has a state here).
    std::size_t size() const { return entries_.size(); }

    double end_ms = 0.0;  // the latest time seen: where a request still in a state is cut

  private:
    // The phases but prefill/decode, indexed by ``kSpentOf``: queue, lookup, load, hold.
    static constexpr std::size_t kSpent = 4;

    // What a request has spent so far: none until it leaves its first state (a request that
    // only waits, as most do under a backlog, holds 24 bytes, not 72).
    struct Spent {
        std::array<double, kSpent> spent{};              // 0.0 where Python has no key yet
        std::vector<std::pair<double, double>> running;  // (since, until) in order
    };
    struct Entry {
        State state;
        double since;
        std::unique_ptr<Spent> spent;  // null: nothing spent yet
    };

    void close(Entry& entry, State state, double since, double t);

    OrderedDict<std::string, Entry> entries_;
};

}  // namespace kvlife
