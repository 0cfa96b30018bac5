// Mirrors lifecycle/engine/lifecycle.py (Lifecycle: record, warn, move, ask, engine_view) and
// specs/table.py's TransitionTable.target / IllegalTransition.
#include "core_lifecycle.hpp"

#include <stdexcept>

#include "py_repr.hpp"

namespace kvlife {

namespace {

// repr() of a StrEnum member: <Enum.NAME: 'value'> (NAME: the value upper-cased, as specs/names.py names them).
std::string member_repr(std::string_view enum_name, std::string_view value) {
    std::string name(value);
    for (char& c : name) c = static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
    return "<" + std::string(enum_name) + "." + name + ": " + str_repr(value) + ">";
}

}  // namespace

IllegalTransition::IllegalTransition(const std::string& request_id_, RequestState state_, Trigger trigger_,
                                     bool state_is_member_)
    : std::runtime_error("request " + request_id_ + ": trigger " + member_repr("Trigger", trigger_name(trigger_)) +
                         " is not allowed in state " +
                         (state_is_member_ ? member_repr("RequestState", state_name(state_))
                                           : str_repr(state_name(state_)))),
      request_id(request_id_),
      state(state_),
      trigger(trigger_),
      state_is_member(state_is_member_) {}

TransitionTable::TransitionTable(const std::vector<std::tuple<std::string, std::string, std::string>>& edges) {
    for (auto& row : edges_) row.fill(kNone);
    for (const auto& [source, trigger, target] : edges) {
        std::optional<RequestState> s = state_from_name(source);
        std::optional<Trigger> t = trigger_from_name(trigger);
        std::optional<RequestState> to = state_from_name(target);
        if (!s || !t || !to) {
            throw std::invalid_argument("transition table: edge (" + source + ", " + trigger + ") -> " + target +
                                        " names a state or trigger specs/names.py does not");
        }
        std::uint8_t& slot = edges_[static_cast<std::size_t>(*s)][static_cast<std::size_t>(*t)];
        if (slot != kNone && slot != static_cast<std::uint8_t>(*to)) {
            throw std::invalid_argument("transition table: edge (" + source + ", " + trigger +
                                        ") is non-deterministic");
        }
        slot = static_cast<std::uint8_t>(*to);
    }
}

RequestState TransitionTable::target(const std::string& request_id, RequestState state, Trigger trigger,
                                     bool state_is_member) const {
    std::optional<RequestState> to = edge(state, trigger);
    if (!to) throw IllegalTransition(request_id, state, trigger, state_is_member);
    return *to;
}

std::size_t AnswerKeyHash::operator()(const AnswerKey& k) const {
    std::size_t h = std::hash<std::string>{}(k.policy);
    h = h * 31 + static_cast<std::size_t>(k.hook);
    return h * 1000003u ^ std::hash<std::string>{}(k.value);
}

Lifecycle::Lifecycle(CoreState& state_, PolicyAsker* policies_, const TransitionTable& table,
                     const DeviceInfo* device_)
    : state(state_), policies(policies_), device(device_), table_(table) {}

void Lifecycle::warn(std::string_view what, const Field* fields, std::size_t n) {
    auto [count, inserted] = state.stats.warnings.try_emplace(std::string(what));
    *count = inserted ? 1 : *count + 1;
    state.recorder.warning(state.now, what, fields, n);
}

void Lifecycle::move(Request& req, Trigger trigger, std::string_view reason) {
    const RequestState source = req.state;
    const RequestState target = table_.target(req.request_id, source, trigger, req.state_is_member);
    req.state = target;
    req.state_is_member = false;
    state.moves += 1;
    state.state_counts[static_cast<std::size_t>(source)] -= 1;
    state.state_counts[static_cast<std::size_t>(target)] += 1;
    state.recorder.transition(state.now, req.request_id, state_name(source), state_name(target),
                              trigger_name(trigger), reason);
}

const AnswerValue& Lifecycle::ask(Request& req, Hook hook, const HookArg& arg) {
    policies->ask(hook, req, arg, engine_view(), answer_);
    key_.policy = answer_.policy;  // (the key's buffers are reused: it is copied only into a new entry)
    key_.hook = hook;
    key_.value = answer_value_str(answer_.value);
    auto [count, inserted] = answers.try_emplace(key_);
    *count = inserted ? 1 : *count + 1;
    const Decided* last = req.last_decisions.find(hook);
    const bool changed = last == nullptr || last->policy != answer_.policy ||
                         !answer_values_equal(last->value, answer_.value) || last->reason != answer_.reason;
    if (changed) {
        DecidedPtr& made = recent_[static_cast<std::size_t>(hook)];
        if (!made || !made->same_as(answer_.policy, answer_.value, answer_.reason)) {
            made = std::make_shared<const Decided>(Decided{answer_.policy, answer_.value, answer_.reason});
        }
        req.last_decisions.set(hook, made);
        if (hook == Hook::ADMISSION) {
            const std::string* value = std::get_if<std::string>(&answer_.value);
            if (value != nullptr && *value == "defer") {
                auto [deferrals, first] = state.stats.deferrals.try_emplace(answer_.policy);
                *deferrals = first ? 1 : *deferrals + 1;
            }
        }
        state.recorder.decision(state.now, req.request_id, hook_name(hook), answer_.policy, answer_.value,
                                answer_.reason);
    }
    return answer_.value;
}

EngineView Lifecycle::engine_view() const {
    const auto& counts = state.state_counts;
    return EngineView{
        state.now,
        counts[static_cast<std::size_t>(RequestState::RUNNING)],
        counts[static_cast<std::size_t>(RequestState::WAITING)] +
            counts[static_cast<std::size_t>(RequestState::LOOKUP_PENDING)],
        counts[static_cast<std::size_t>(RequestState::LOADING)],
        device != nullptr ? device->free() : 0,
        device != nullptr ? device->capacity() : 0,
    };
}

}  // namespace kvlife
