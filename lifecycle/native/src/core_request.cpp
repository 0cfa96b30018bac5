// Mirrors lifecycle/engine/request.py (Request) and the names it uses: specs/names.py's
// RequestState and Trigger, policies/base.py's Hook; Python's == and str() on a hook's answer.
#include "core_request.hpp"

#include <cmath>
#include <cstring>

#include "py_repr.hpp"

namespace kvlife {

namespace {

constexpr std::array<std::string_view, kNumStates> kStateNames = {
    "waiting", "lookup_pending", "loading", "running", "sending", "finished",
};
constexpr std::array<std::string_view, kNumTriggers> kTriggerNames = {
    "lookup_submitted", "lookup_answered", "lookup_expired", "load_started", "admitted",
    "load_done", "load_failed", "preempted", "turn_ended", "send_started", "completed",
    "aborted", "failed",
};
constexpr std::array<std::string_view, kNumHooks> kHookNames = {
    "on_arrival", "lookup_mode", "lookup_reuse", "prefetch_patience", "admission",
    "store_limit", "hold_at_finish", "on_load_failure",
};

template <class E, std::size_t N>
std::optional<E> find_name(const std::array<std::string_view, N>& names, std::string_view name) {
    for (std::size_t i = 0; i < N; ++i) {
        if (names[i] == name) return static_cast<E>(i);
    }
    return std::nullopt;
}

// A number's value as Python's numeric tower compares it: bool and int as int64, float apart.
struct Number {
    bool is_float;
    std::int64_t i;
    double d;
};

std::optional<Number> number_of(const AnswerValue& v) {
    if (const bool* b = std::get_if<bool>(&v)) return Number{false, *b ? 1 : 0, 0.0};
    if (const std::int64_t* i = std::get_if<std::int64_t>(&v)) return Number{false, *i, 0.0};
    if (const double* d = std::get_if<double>(&v)) return Number{true, 0, *d};
    return std::nullopt;
}

// int == float, exactly (Python compares the mathematical values).
bool int_equals_float(std::int64_t i, double d) {
    if (!(d == std::floor(d)) || d < -9223372036854775808.0 || d >= 9223372036854775808.0) {
        return false;  // NaN, a fraction, an infinity, or out of int64's range
    }
    return static_cast<std::int64_t>(d) == i;
}

}  // namespace

std::string_view state_name(RequestState state) { return kStateNames[static_cast<std::size_t>(state)]; }
std::string_view trigger_name(Trigger trigger) { return kTriggerNames[static_cast<std::size_t>(trigger)]; }
std::string_view hook_name(Hook hook) { return kHookNames[static_cast<std::size_t>(hook)]; }

std::optional<RequestState> state_from_name(std::string_view name) {
    return find_name<RequestState>(kStateNames, name);
}
std::optional<Trigger> trigger_from_name(std::string_view name) { return find_name<Trigger>(kTriggerNames, name); }
std::optional<Hook> hook_from_name(std::string_view name) { return find_name<Hook>(kHookNames, name); }

bool answer_values_equal(const AnswerValue& a, const AnswerValue& b) {
    std::optional<Number> x = number_of(a);
    std::optional<Number> y = number_of(b);
    if (x && y) {
        if (x->is_float && y->is_float) return x->d == y->d;
        if (!x->is_float && !y->is_float) return x->i == y->i;
        return x->is_float ? int_equals_float(y->i, x->d) : int_equals_float(x->i, y->d);
    }
    if (x || y) return false;
    const std::string* s = std::get_if<std::string>(&a);
    const std::string* t = std::get_if<std::string>(&b);
    if (s && t) return *s == *t;
    return a.index() == b.index();  // None == None; a str is not None
}

bool answer_values_identical(const AnswerValue& a, const AnswerValue& b) {
    if (a.index() != b.index()) return false;
    if (const double* x = std::get_if<double>(&a)) {
        const double y = std::get<double>(b);
        return std::memcmp(x, &y, sizeof y) == 0;
    }
    return a == b;
}

std::string answer_value_str(const AnswerValue& value) {
    switch (value.index()) {
        case 1:
            return std::get<bool>(value) ? "True" : "False";
        case 2:
            return std::to_string(std::get<std::int64_t>(value));
        case 3:
            return float_repr(std::get<double>(value));
        case 4:
            return std::get<std::string>(value);
        default:
            return "None";
    }
}

}  // namespace kvlife
