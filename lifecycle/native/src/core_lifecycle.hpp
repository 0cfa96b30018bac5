// The primitives the connector core's parts share: a mirror of lifecycle/engine/lifecycle.py
// (Lifecycle: record, warn, move, ask, engine_view) and of the compiled spec table it moves by
// (specs/table.py TransitionTable.target and IllegalTransition).
//
// The table is data: its edges come from specs/lifecycle_table.json (read in Python and passed
// to the constructor by the binding), never written down here. No reference mode: an engine
// with reference=True stays Python.
//
// Policies stay Python: ``ask`` goes through PolicyAsker, one virtual call, which the binding
// implements as PolicyStack.ask(hook, req_view, *args, engine_view) answers it
// (bind_policy_asker.hpp: the stack's own chains, checks and errors).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <variant>
#include <vector>

#include "blocks.hpp"
#include "core_request.hpp"
#include "core_state.hpp"
#include "ordered_dict.hpp"
#include "records.hpp"

namespace kvlife {

// specs/table.py IllegalTransition, as the engine raises it: the trigger a Trigger member, the
// state a RequestState member (state_is_member: never moved) or the table's str. Message:
// "request R: trigger <Trigger.T: 't'> is not allowed in state 's'" (reprs of those objects).
struct IllegalTransition : std::runtime_error {
    IllegalTransition(const std::string& request_id, RequestState state, Trigger trigger, bool state_is_member);
    std::string request_id;
    RequestState state;
    Trigger trigger;
    bool state_is_member;
};

// specs/table.py TransitionTable: (state, trigger) -> state.
class TransitionTable {
  public:
    // edges: [state, trigger, target] as lifecycle_table.json lists them; std::invalid_argument
    // for a name that is not one of specs/names.py's, or an edge given twice with two targets.
    explicit TransitionTable(const std::vector<std::tuple<std::string, std::string, std::string>>& edges);
    // The edge's target; none when the spec has no such edge.
    std::optional<RequestState> edge(RequestState state, Trigger trigger) const {
        std::uint8_t t = edges_[static_cast<std::size_t>(state)][static_cast<std::size_t>(trigger)];
        if (t == kNone) return std::nullopt;
        return static_cast<RequestState>(t);
    }
    // TABLE.target(request_id, state, trigger): IllegalTransition when there is no edge.
    RequestState target(const std::string& request_id, RequestState state, Trigger trigger,
                        bool state_is_member = false) const;

  private:
    static constexpr std::uint8_t kNone = 0xff;
    std::array<std::array<std::uint8_t, kNumTriggers>, kNumStates> edges_;
};

// policies/base.py's views, as the native core fills them (the binding turns each into the
// Python view a policy reads).
struct EngineView {
    double now_ms;
    std::int64_t running;
    std::int64_t waiting;
    std::int64_t loading;
    std::int64_t free_device_blocks;
    std::int64_t device_blocks;
};

// A view's tiers are named by pointers to names the caller keeps for the ask (a tier's own name:
// one pointer per block, no copy of its text).
struct LoadView {
    std::int64_t device_hit_blocks;
    std::int64_t external_hit_blocks;
    std::vector<const std::string*> tiers;                        // tier of each external hit block
    std::vector<std::pair<BlockHash, std::string>> in_flight;     // (block hash, loading request)
};

struct PrefetchView {
    std::int64_t blocks;
    std::int64_t tokens;
    std::vector<const std::string*> source_tiers;
    double started_ms;
};

// The arguments between the request view and the engine view, per hook (policies/base.py
// HOOK_ARITY): none; a LoadView (admission); a PrefetchView (prefetch_patience); an int
// (hold_at_finish's stores_in_flight, on_load_failure's failed_blocks).
using HookArg = std::variant<std::monostate, const LoadView*, const PrefetchView*, std::int64_t>;

// policies/base.py Answer.
struct Answer {
    std::string policy;
    AnswerValue value;
    std::string reason;
};

// The policy stack, as the core asks it. ``ask`` fills ``out`` (its strings' buffers reused);
// it raises what PolicyStack.ask raises (the binding lets the Python exception through).
class PolicyAsker {
  public:
    virtual ~PolicyAsker() = default;
    virtual void ask(Hook hook, const Request& req, const HookArg& arg, const EngineView& engine, Answer& out) = 0;
};

// lifecycle.py DeviceInfo: what a policy may know of the scheduler's device blocks (kvlife's
// block pool: DeviceBlockPool has free() and capacity()).
using DeviceInfo = DeviceBlockPool;

// Lifecycle.answers' key: (policy, hook, str(value)).
struct AnswerKey {
    std::string policy;
    Hook hook = Hook::ON_ARRIVAL;
    std::string value;
    bool operator==(const AnswerKey& o) const { return hook == o.hook && policy == o.policy && value == o.value; }
};
struct AnswerKeyHash {
    std::size_t operator()(const AnswerKey& k) const;
};

class Lifecycle {
  public:
    Lifecycle(CoreState& state, PolicyAsker* policies, const TransitionTable& table,
              const DeviceInfo* device = nullptr);

    CoreState& state;
    PolicyAsker* policies;
    const DeviceInfo* device;  // nullptr: None
    // (policy, hook, str(value)) -> answers given, in first-answer order.
    OrderedDict<AnswerKey, std::int64_t, AnswerKeyHash> answers;

    // Python's lifecycle.record(records.X(...)) is state.recorder.X(...): record() is that sink.
    Trace& record() { return state.recorder; }
    // warn(what, **fields): counts stats.warnings[what], records a warning with ``fields`` in order.
    void warn(std::string_view what, const Field* fields, std::size_t n);
    void warn(std::string_view what, std::initializer_list<Field> fields = {}) {
        warn(what, fields.begin(), fields.size());
    }
    // move(req, trigger, reason): the compiled table's target, or IllegalTransition.
    void move(Request& req, Trigger trigger, std::string_view reason);
    // ask(req, hook, *args): the answer's value, valid until the next ask. A changed answer is
    // recorded (and an admission "defer" counted in stats.deferrals); every answer is counted.
    const AnswerValue& ask(Request& req, Hook hook, const HookArg& arg = {});
    EngineView engine_view() const;

  private:
    const TransitionTable& table_;
    Answer answer_;   // the last answer (its buffers reused)
    AnswerKey key_;   // the last answer's key in ``answers``
    // Per hook, the last Decided made: the next request given the same answer shares it.
    std::array<DecidedPtr, kNumHooks> recent_;
};

}  // namespace kvlife
