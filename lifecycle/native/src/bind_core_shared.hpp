// What the bind files of the connector core (bind_core_lifecycle.cpp, bind_engine.cpp) share: the
// PolicyAsker that asks a Python PolicyStack as lifecycle.py asks it (PyPolicyAsker), and the
// core's Stats as a dict (stats_dict: attrs.asdict(state.Stats) of the reference). A binding-only
// header: the core's plain C++ never includes it.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <string>
#include <unordered_map>
#include <utility>

#include "bind_core_convert.hpp"
#include "core_lifecycle.hpp"
#include "core_request.hpp"
#include "core_state.hpp"

namespace kvlife {

namespace py = pybind11;

// policies/base.py's view classes are called positionally, in their attrs field order.
class PyPolicyAsker final : public PolicyAsker {
  public:
    explicit PyPolicyAsker(py::object stack) : stack_(std::move(stack)) {
        py::module_ base = py::module_::import("kvlife.policies.base");
        request_view_ = base.attr("RequestView");
        engine_view_ = base.attr("EngineView");
        load_view_ = base.attr("LoadView");
        prefetch_view_ = base.attr("PrefetchView");
        ask_ = stack_.attr("ask");
        for (std::size_t i = 0; i < kNumHooks; ++i) hooks_[i] = py::str(std::string(hook_name(static_cast<Hook>(i))));
        py::object members = py::module_::import("kvlife.specs.names").attr("RequestState");
        for (std::size_t i = 0; i < kNumStates; ++i) {
            states_[i] = py::str(std::string(state_name(static_cast<RequestState>(i))));
            members_[i] = members(states_[i]);
        }
    }

    void ask(Hook hook, const Request& req, const HookArg& arg, const EngineView& engine, Answer& out) override {
        py::object view = request_view(req);
        py::object ev = engine_view_(engine.now_ms, engine.running, engine.waiting, engine.loading,
                                     engine.free_device_blocks, engine.device_blocks);
        py::object answer;
        const py::str& name = hooks_[static_cast<std::size_t>(hook)];
        switch (arg.index()) {
            case 1: {
                const LoadView& load = *std::get<const LoadView*>(arg);
                py::tuple tiers(load.tiers.size());
                for (std::size_t i = 0; i < load.tiers.size(); ++i) tiers[i] = py::str(load.tiers[i]);
                py::tuple in_flight(load.in_flight.size());
                for (std::size_t i = 0; i < load.in_flight.size(); ++i) {
                    in_flight[i] = py::make_tuple(load.in_flight[i].first, py::str(load.in_flight[i].second));
                }
                answer = ask_(name, view, load_view_(load.device_hit_blocks, load.external_hit_blocks, tiers, in_flight),
                              ev);
                break;
            }
            case 2: {
                const PrefetchView& pull = *std::get<const PrefetchView*>(arg);
                py::tuple tiers(pull.source_tiers.size());
                for (std::size_t i = 0; i < pull.source_tiers.size(); ++i) tiers[i] = py::str(pull.source_tiers[i]);
                answer = ask_(name, view, prefetch_view_(pull.blocks, pull.tokens, tiers, pull.started_ms), ev);
                break;
            }
            case 3:
                answer = ask_(name, view, std::get<std::int64_t>(arg), ev);
                break;
            default:
                answer = ask_(name, view, ev);
                break;
        }
        out.policy = answer.attr("policy").cast<std::string>();
        py::object value = answer.attr("value");
        if (PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr())) {
            int overflow = 0;
            PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
            if (overflow != 0) {  // a valid answer (store_limit 2**70) the native core cannot hold
                py::object error = py::module_::import("kvlife.policies.base").attr("PolicyError");
                PyErr_SetString(error.ptr(), ("policy " + out.policy + ": hook " + name.cast<std::string>() +
                                              " answered " + py::repr(value).cast<std::string>() +
                                              ": the native engine takes integers within 64 bits; "
                                              "run it with --engine python")
                                                 .c_str());
                throw py::error_already_set();
            }
        }
        out.value = answer_value(value);
        out.reason = answer.attr("reason").cast<std::string>();
    }

  private:
    // Request.view(): the id and the hashes tuple are kept per request and rebuilt only when
    // the hashes grew (a request's hashes only ever get derived ones appended).
    py::object request_view(const Request& req) {
        if (cache_.size() >= kCacheMax && cache_.find(req.request_id) == cache_.end()) cache_.clear();
        Cached& c = cache_[req.request_id];
        if (!c.hashes || c.size != req.hashes.size()) {
            py::tuple hashes(req.hashes.size());
            for (std::size_t i = 0; i < req.hashes.size(); ++i) hashes[i] = py::int_(req.hashes[i]);
            c.hashes = std::move(hashes);
            c.size = req.hashes.size();
            if (!c.rid) c.rid = py::str(req.request_id);
        }
        const std::size_t state = static_cast<std::size_t>(req.state);
        return request_view_(c.rid, req.state_is_member ? members_[state] : py::object(states_[state]),
                             req.arrival_ms, req.prompt_tokens,
                             req.generated, req.computed, req.confirmed, req.placeholders, req.block_tokens,
                             c.hashes, req.stored_blocks, req.resumable, req.preemptions);
    }

    // Requests whose view parts are kept: past this many, the cache starts over (it only saves
    // building the id and the hashes tuple again).
    static constexpr std::size_t kCacheMax = 1 << 14;
    struct Cached {
        std::size_t size = 0;
        py::object hashes;
        py::object rid;
    };

    py::object stack_, ask_, request_view_, engine_view_, load_view_, prefetch_view_;
    std::array<py::str, kNumHooks> hooks_;
    std::array<py::str, kNumStates> states_;
    std::array<py::object, kNumStates> members_;  // RequestState members
    std::unordered_map<std::string, Cached> cache_;
};

// attrs.asdict(stats): every counter, the two dicts in insertion order.
inline py::dict stats_dict(const Stats& s) {
    py::dict d;
    d["ticks"] = s.ticks;
    d["steps"] = s.steps;
    d["sync_lookups"] = s.sync_lookups;
    d["async_lookups"] = s.async_lookups;
    d["stale_lookup_answers"] = s.stale_lookup_answers;
    d["failed_lookups"] = s.failed_lookups;
    d["loads"] = s.loads;
    d["blocks_loaded"] = s.blocks_loaded;
    d["redundant_block_loads"] = s.redundant_block_loads;
    d["joined_blocks"] = s.joined_blocks;
    d["stores"] = s.stores;
    d["blocks_stored"] = s.blocks_stored;
    d["failed_blocks"] = s.failed_blocks;
    d["failed_loads"] = s.failed_loads;
    d["failed_stores"] = s.failed_stores;
    d["preemptions"] = s.preemptions;
    py::dict deferrals;
    for (const auto& node : s.deferrals) deferrals[py::str(node.key)] = node.value;
    d["deferrals"] = deferrals;
    py::dict warnings;
    for (const auto& node : s.warnings) warnings[py::str(node.key)] = node.value;
    d["warnings"] = warnings;
    d["rank_timeouts"] = s.rank_timeouts;
    d["duplicate_lookups"] = s.duplicate_lookups;
    d["prefetches"] = s.prefetches;
    d["blocks_prefetched"] = s.blocks_prefetched;
    d["prefetch_waits"] = s.prefetch_waits;
    d["prefetch_gave_up"] = s.prefetch_gave_up;
    d["expired_lookups"] = s.expired_lookups;
    d["reclaimed_jobs"] = s.reclaimed_jobs;
    d["late_reports"] = s.late_reports;
    d["flushed_stores"] = s.flushed_stores;
    return d;
}

}  // namespace kvlife
