// The connector core's record of one request: a mirror of lifecycle/engine/request.py's
// ``Request`` (every field, the same names), with the names it is written in: the spec's
// states and triggers (specs/names.py RequestState, Trigger) and the policies' decision
// points (policies/base.py Hook), each an enum whose order is the Python enum's, and the
// value a hook answers (``AnswerValue``).
//
// The spec's states and triggers are names here; the edges between them are data, read from
// specs/lifecycle_table.json into core_lifecycle.hpp's TransitionTable (declared once, in specs/).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "blocks.hpp"
#include "ordered_dict.hpp"

namespace kvlife {

// specs/names.py RequestState, in its order (which is also specs/lifecycle_table.json's "states"
// order, and so the order of CoreState::state_counts).
enum class RequestState : std::uint8_t { WAITING, LOOKUP_PENDING, LOADING, RUNNING, SENDING, FINISHED };
constexpr std::size_t kNumStates = 6;

// specs/names.py Trigger, in its order.
enum class Trigger : std::uint8_t {
    LOOKUP_SUBMITTED,
    LOOKUP_ANSWERED,
    LOOKUP_EXPIRED,
    LOAD_STARTED,
    ADMITTED,
    LOAD_DONE,
    LOAD_FAILED,
    PREEMPTED,
    TURN_ENDED,
    SEND_STARTED,
    COMPLETED,
    ABORTED,
    FAILED,
};
constexpr std::size_t kNumTriggers = 13;

// policies/base.py Hook, in its order.
enum class Hook : std::uint8_t {
    ON_ARRIVAL,
    LOOKUP_MODE,
    LOOKUP_REUSE,
    PREFETCH_PATIENCE,
    ADMISSION,
    STORE_LIMIT,
    HOLD_AT_FINISH,
    ON_LOAD_FAILURE,
};
constexpr std::size_t kNumHooks = 8;

// The Python values ("lookup_pending", "load_done", "store_limit"...).
std::string_view state_name(RequestState state);
std::string_view trigger_name(Trigger trigger);
std::string_view hook_name(Hook hook);
// The enum named ``name``; none when it names none.
std::optional<RequestState> state_from_name(std::string_view name);
std::optional<Trigger> trigger_from_name(std::string_view name);
std::optional<Hook> hook_from_name(std::string_view name);

// What a hook may answer (policies/base.py HOOK_VALUES: a str of a fixed set, an int, a float
// or int of ms, a bool); none only for completeness (a Decision's value is never None). A hook
// answering an int keeps it an int (prefetch_patience may be 5 or 5.0: str() and the trace tell
// them apart).
using AnswerValue = std::variant<std::monostate, bool, std::int64_t, double, std::string>;

// Python's ``a == b`` on two answer values: numbers compare by value across bool, int and float
// (True == 1 == 1.0), a str only with an equal str, None only with None.
bool answer_values_equal(const AnswerValue& a, const AnswerValue& b);
// Python's str(value): "True", "12", float repr ("inf", "1e+16", "0.5"), the str itself, "None".
std::string answer_value_str(const AnswerValue& value);

// Request.tier_hit_blocks: tier -> blocks, in the order the tiers were first hit (a dict's order).
// A handful of tiers at most, so a scan finds one.
class TierCounts {
  public:
    void add(const std::string& tier, std::int64_t blocks) {
        for (auto& item : items_) {
            if (item.first == tier) {
                item.second += blocks;
                return;
            }
        }
        items_.emplace_back(tier, blocks);
    }
    bool empty() const { return items_.empty(); }
    std::vector<std::pair<std::string, std::int64_t>>::const_iterator begin() const { return items_.begin(); }
    std::vector<std::pair<std::string, std::int64_t>>::const_iterator end() const { return items_.end(); }

  private:
    std::vector<std::pair<std::string, std::int64_t>> items_;
};

// The same value, kind and bits: what two Decided must hold to be one object (an int 1 is not True
// nor 1.0, -0.0 is not 0.0, and a NaN is the same as its own bits).
bool answer_values_identical(const AnswerValue& a, const AnswerValue& b);

// One entry of Request.last_decisions: (policy, value, reason). Immutable once made, so requests
// given the same answer share one (Lifecycle::ask keeps the last one made per hook).
struct Decided {
    std::string policy;
    AnswerValue value;
    std::string reason;

    bool same_as(const std::string& policy_, const AnswerValue& value_, const std::string& reason_) const {
        return policy == policy_ && answer_values_identical(value, value_) && reason == reason_;
    }
};
using DecidedPtr = std::shared_ptr<const Decided>;

// Request.last_decisions: hook -> (policy, value, reason), in the order the hooks were first
// answered (a dict's order: a hook answered again keeps its place). At most one entry per hook, so
// a scan of a few entries finds one; each entry is a handle to a shared Decided (24 bytes), not a
// copy of the policy's name and reason: a waiting request holds two or three of them.
class Decisions {
  public:
    struct Entry {
        Hook hook;
        DecidedPtr decided;
    };

    const Decided* find(Hook hook) const {
        for (const Entry& e : entries_) {
            if (e.hook == hook) return e.decided.get();
        }
        return nullptr;
    }
    // d[hook] = decided: a new hook goes to the end; one already there keeps its place.
    void set(Hook hook, DecidedPtr decided) {
        for (Entry& e : entries_) {
            if (e.hook == hook) {
                e.decided = std::move(decided);
                return;
            }
        }
        entries_.push_back(Entry{hook, std::move(decided)});
    }
    std::vector<Entry>::const_iterator begin() const { return entries_.begin(); }
    std::vector<Entry>::const_iterator end() const { return entries_.end(); }
    std::size_t size() const { return entries_.size(); }

  private:
    std::vector<Entry> entries_;
};

// How many Requests exist in the process (every core's; the cores run under the GIL): what a test
// reads to see that a retired request is freed, not kept by a container's spare slot.
struct RequestCount {
    static inline std::int64_t live = 0;
    RequestCount() noexcept { ++live; }
    RequestCount(const RequestCount&) noexcept { ++live; }
    RequestCount& operator=(const RequestCount&) noexcept = default;
    ~RequestCount() { --live; }
};

struct Request {
    Request(std::string request_id_, std::int64_t seq_, double arrival_ms_, std::int64_t prompt_tokens_,
            HashList hashes_, bool resumable_, std::int64_t block_tokens_,
            std::optional<std::int64_t> max_tokens_ = std::nullopt)
        : request_id(std::move(request_id_)),
          seq(seq_),
          arrival_ms(arrival_ms_),
          prompt_tokens(prompt_tokens_),
          hashes(std::move(hashes_)),
          resumable(resumable_),
          block_tokens(block_tokens_),
          max_tokens(max_tokens_) {}

    std::string request_id;
    std::int64_t seq;  // arrival order
    double arrival_ms;
    // state.requests maps request_id to this record (set where it is put there, cleared where
    // it is taken out): a handle to it read elsewhere is the record a lookup by id finds.
    bool listed = false;
    std::int64_t prompt_tokens;
    // Block hashes: the full prompt blocks' from the arrival, then derived ones appended as
    // blocks of generated tokens fill (blocks.hpp extend_hashes).
    HashList hashes;
    bool resumable;
    std::int64_t block_tokens;
    std::optional<std::int64_t> max_tokens;
    RequestState state = RequestState::WAITING;
    // Python's state is still the RequestState member it was created with (no move yet); after a
    // move it is the table's plain str. Only reprs tell them apart: IllegalTransition's message
    // and the RequestView a policy gets carry the same object as Python's.
    bool state_is_member = true;
    // Bumped on preemption, abort, finish, failed load and lookup expiry (invariant 4).
    std::int64_t epoch = 0;
    std::int64_t generated = 0;
    std::int64_t placeholders = 0;  // sampled tokens whose step output has not arrived
    std::int64_t computed = 0;      // tokens computed or scheduled in a step still in flight
    std::int64_t confirmed = 0;     // tokens whose step output arrived (or that a hit made valid)
    std::vector<BlockId> block_table;  // the scheduler's blocks for it, as it was told
    std::int64_t local_tokens = 0;     // the device prefix hit the scheduler found at the last match
    // The tier of each leading hit block, this epoch, as its position in CoreState::tiers (a
    // lookup names only the core's own tiers: an answer's unknown names are dropped).
    std::optional<std::vector<std::size_t>> lookup;
    bool lookup_async = false;
    double lookup_answered_ms = 0.0;
    std::int64_t lookup_uses = 0;
    std::int64_t async_lookups = 0;
    double lookup_submitted_ms = 0.0;
    // The last match's external hit: (hash, tier) per block past the device hit, the tier as
    // its position in CoreState::tiers (fixed once the core is made: no name copied per block);
    // and the in-flight loads it joins (hash -> job).
    std::vector<std::pair<BlockHash, std::size_t>> plan;
    // (None until a policy answers "join": most requests never join a load.)
    std::unique_ptr<OrderedDict<BlockHash, std::int64_t>> joins;
    std::int64_t stored_blocks = 0;
    std::vector<std::int64_t> load_jobs;   // loads it waits for
    std::vector<BlockHash> load_failed;    // block hashes that failed in those loads
    std::int64_t external_hit_limit = std::int64_t{1} << 30;
    bool landed = false;
    std::int64_t pending_hit_tokens = 0;
    std::int64_t store_jobs = 0;
    bool hold = false;
    RequestCount counted;
    std::optional<std::string> finish_reason;
    std::optional<double> first_token_ms;
    std::optional<double> finish_ms;
    std::int64_t preemptions = 0;
    std::int64_t device_hit_blocks = 0;
    TierCounts tier_hit_blocks;                              // tier -> blocks, first hit first
    Decisions last_decisions;                                // hook -> (policy, value, reason)

    // Whether nothing but its arrival happened to it: every field the constructor does not set
    // still holds its default (last_decisions aside: its arrival may have asked a policy). Such
    // a record can be rebuilt from what the constructor takes, its decisions and nothing else
    // (ConnectorCore::doze and wake).
    bool only_arrived() const {
        return state == RequestState::WAITING && state_is_member && epoch == 0 && generated == 0 &&
               placeholders == 0 && computed == 0 && confirmed == 0 && block_table.empty() && local_tokens == 0 &&
               !lookup.has_value() && !lookup_async && lookup_answered_ms == 0.0 && lookup_uses == 0 &&
               async_lookups == 0 && lookup_submitted_ms == 0.0 && plan.empty() && !joins && stored_blocks == 0 &&
               load_jobs.empty() && load_failed.empty() && external_hit_limit == (std::int64_t{1} << 30) &&
               !landed && pending_hit_tokens == 0 && store_jobs == 0 && !hold && !finish_reason.has_value() &&
               !first_token_ms.has_value() && !finish_ms.has_value() && preemptions == 0 &&
               device_hit_blocks == 0 && tier_hit_blocks.empty();
    }

    // Request.view(): the RequestView a policy sees is built from these fields by the binding
    // that asks the Python policies (bind_policy_asker.hpp), field for field as request.py's view().
};

using CoreRequestPtr = std::shared_ptr<Request>;

// What the connector core keeps of a dormant request (ConnectorCore::doze): with what the
// scheduler keeps of it (its id, prompt, hashes, max tokens, resumable), all its record held.
struct DormantCore {
    std::int64_t seq;
    double arrival_ms;
    std::size_t hashes;  // how many hashes its record's list held
    Decisions decisions;
};

}  // namespace kvlife
