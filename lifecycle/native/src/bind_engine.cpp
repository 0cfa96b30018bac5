// The native engine (engine.hpp, a mirror of lifecycle/engine/core.py's Engine) bound for
// Python: NativeEngine(config, policies, trace=False, retire=None) built from the reference
// run's EngineConfig and PolicyStack. handle() takes a Python input event
// (lifecycle/engine/events.py) and returns the commands as the same Python classes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bind_core_convert.hpp"
#include "bind_core_shared.hpp"
#include "engine.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

template <class Int>
py::tuple int_tuple(const std::vector<Int>& values) {
    py::tuple out(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
        out[i] = py::int_(values[i]);
    }
    return out;
}

// The Python classes of events.py's commands, looked up once.
struct EventTypes {
    py::module_ events;
    py::object SubmitLookup, DiscardLookup, StartLoad, StartStore, StartPrefetch, FreeBlocks, StepPlan;
    py::object BlockMove, TierMove, Scheduled;

    EventTypes() : events(py::module_::import("kvlife.lifecycle.engine.events")) {
        SubmitLookup = events.attr("SubmitLookup");
        DiscardLookup = events.attr("DiscardLookup");
        StartLoad = events.attr("StartLoad");
        StartStore = events.attr("StartStore");
        StartPrefetch = events.attr("StartPrefetch");
        FreeBlocks = events.attr("FreeBlocks");
        StepPlan = events.attr("StepPlan");
        BlockMove = events.attr("BlockMove");
        TierMove = events.attr("TierMove");
        Scheduled = events.attr("Scheduled");
    }

    py::tuple block_moves(const std::vector<kvlife::BlockMove>& moves) const {
        py::tuple out(moves.size());
        for (std::size_t i = 0; i < moves.size(); ++i) {
            const kvlife::BlockMove& m = moves[i];
            out[i] = BlockMove(m.block_hash, m.device_block, m.tier, m.slot);
        }
        return out;
    }

    py::object to_python(const Command& command) const {
        switch (command.index()) {
            case 0: {
                const auto& c = std::get<kvlife::SubmitLookup>(command);
                return SubmitLookup(c.request_id, c.epoch, int_tuple(c.block_hashes));
            }
            case 1: {
                const auto& c = std::get<kvlife::DiscardLookup>(command);
                return DiscardLookup(c.request_id, c.epoch);
            }
            case 2: {
                const auto& c = std::get<kvlife::StartLoad>(command);
                return StartLoad(c.job_id, c.request_id, block_moves(c.moves),
                                 c.after.has_value() ? py::object(py::int_(*c.after)) : py::object(py::none()));
            }
            case 3: {
                const auto& c = std::get<kvlife::StartStore>(command);
                return StartStore(c.job_id, c.request_id, block_moves(c.moves));
            }
            case 4: {
                const auto& c = std::get<kvlife::StartPrefetch>(command);
                py::tuple moves(c.moves.size());
                for (std::size_t i = 0; i < c.moves.size(); ++i) {
                    const kvlife::TierMove& m = c.moves[i];
                    moves[i] = TierMove(m.block_hash, m.src_tier, m.src_slot, m.dst_tier, m.dst_slot);
                }
                return StartPrefetch(c.job_id, c.request_id, moves);
            }
            case 5: {
                const auto& c = std::get<kvlife::FreeBlocks>(command);
                return FreeBlocks(int_tuple(c.device_blocks));
            }
            default: {
                const auto& plan = std::get<kvlife::StepPlan>(command);
                py::tuple entries(plan.entries.size());
                for (std::size_t i = 0; i < plan.entries.size(); ++i) {
                    const kvlife::Scheduled& s = plan.entries[i];
                    entries[i] = Scheduled(s.request_id, s.num_tokens, s.computed_before, s.samples,
                                           int_tuple(s.block_table), int_tuple(s.block_hashes));
                }
                return StepPlan(plan.step_id, entries, plan.sync_lookups, int_tuple(plan.sync_lookup_keys),
                                int_tuple(plan.flush));
            }
        }
    }
};

// The retire callback: given each retired request's final fields as a dict.
class PyRetirer : public Retirer {
  public:
    explicit PyRetirer(py::object fn) : fn_(std::move(fn)) {}
    void retire(const Request& req) override { fn_(request_dict(req)); }

    static py::dict request_dict(const Request& req) {
        py::dict d;
        d["request_id"] = req.request_id;
        d["seq"] = req.seq;
        d["arrival_ms"] = req.arrival_ms;
        d["prompt_tokens"] = req.prompt_tokens;
        d["block_tokens"] = req.block_tokens;
        d["state"] = std::string(state_name(req.state));
        d["epoch"] = req.epoch;
        d["generated"] = req.generated;
        d["finish_reason"] = req.finish_reason;
        d["first_token_ms"] = req.first_token_ms;
        d["finish_ms"] = req.finish_ms;
        d["preemptions"] = req.preemptions;
        d["device_hit_blocks"] = req.device_hit_blocks;
        py::dict hits;
        for (const auto& [tier, blocks] : req.tier_hit_blocks) hits[py::str(tier)] = blocks;
        d["tier_hit_blocks"] = hits;
        return d;
    }

  private:
    py::object fn_;
};

class NativeEngine {
  public:
    NativeEngine(const CoreConfig& core, const SchedulerConfig& scheduler, py::object table, py::object policies,
                 bool trace, py::object retire)
        : asker_(std::move(policies)), table_(std::move(table)) {
        if (!retire.is_none()) retirer_ = std::make_unique<PyRetirer>(std::move(retire));
        if (trace) writer_ = std::make_unique<JsonWriter>(1 << 16);
        engine_ = std::make_unique<Engine>(core, scheduler, &asker_, table_.cast<const TransitionTable&>(),
                                           Trace(writer_.get()), retirer_.get());
    }

    py::list handle(const py::handle& event) {
        InputEvent native = input_event(event);
        engine_->handle(native, commands_);
        py::list out;
        for (const Command& command : commands_) {
            out.append(types_.to_python(command));
        }
        return out;
    }

    py::bytes trace_bytes() const {
        if (!writer_) return py::bytes("");
        std::string_view view = writer_->view();
        return py::bytes(view.data(), view.size());
    }

    py::dict stats() const { return stats_dict(engine_->stats()); }

    py::dict answers() const {
        py::dict out;
        for (const auto& node : engine_->core().lifecycle.answers) {
            out[py::make_tuple(node.key.policy, std::string(hook_name(node.key.hook)), node.key.value)] = node.value;
        }
        return out;
    }

    py::dict state_counts() const {
        py::dict out;
        const CoreState& state = engine_->state();
        for (std::size_t i = 0; i < kNumStates; ++i) {
            out[py::str(std::string(state_name(static_cast<RequestState>(i))))] = state.state_counts[i];
        }
        return out;
    }

    Engine& get() { return *engine_; }

  private:
    EventTypes types_;
    PyPolicyAsker asker_;
    py::object table_;  // the TransitionTable the engine moves by (kept alive here)
    std::unique_ptr<PyRetirer> retirer_;
    std::unique_ptr<JsonWriter> writer_;
    std::unique_ptr<Engine> engine_;
    std::vector<Command> commands_;
};

}  // namespace

void bind_engine(py::module_& m) {
    py::class_<NativeEngine>(m, "NativeEngine",
                             "engine.hpp's Engine: built by bridge.engine from an EngineConfig and a PolicyStack")
        .def(py::init([](const CoreConfig& core, std::int64_t device_blocks, std::int64_t max_batched_tokens,
                         std::int64_t max_running, bool async_scheduling, const std::string& kv_load_failure_policy,
                         py::object table, py::object policies, bool trace, py::object retire) {
                 SchedulerConfig scheduler{core.block_tokens, device_blocks, max_batched_tokens, max_running,
                                           async_scheduling, kv_load_failure_policy == "fail"};
                 return std::make_unique<NativeEngine>(core, scheduler, std::move(table), std::move(policies), trace,
                                                       std::move(retire));
             }),
             py::kw_only(), py::arg("core"), py::arg("device_blocks"), py::arg("max_batched_tokens"),
             py::arg("max_running"), py::arg("async_scheduling"), py::arg("kv_load_failure_policy"),
             py::arg("table"), py::arg("policies"), py::arg("trace") = false, py::arg("retire") = py::none())
        .def("handle", &NativeEngine::handle, py::arg("event"))
        .def("trace_bytes", &NativeEngine::trace_bytes)
        .def("stats", &NativeEngine::stats)
        .def("answers", &NativeEngine::answers)
        .def("state_counts", &NativeEngine::state_counts)
        .def("stranded", [](NativeEngine& e) { return e.get().stranded(); })
        .def("busy", [](NativeEngine& e) { return e.get().busy(); })
        .def("progress", [](NativeEngine& e) { return e.get().progress(); })
        .def("next_wakeup", [](NativeEngine& e) { return e.get().next_wakeup(); })
        .def("output_tokens", [](NativeEngine& e, const std::string& rid) { return e.get().output_tokens(rid); })
        .def("sync_lookup",
             [](NativeEngine& e, const std::vector<std::int64_t>& hashes) {
                 return py::tuple(py::cast(e.get().sync_lookup(hashes)));
             })
        .def("check_invariants", [](NativeEngine& e) { e.get().check_invariants(); })
        .def("finished_count", [](NativeEngine& e) { return e.get().finished_count(); })
        .def("record_stranded", [](NativeEngine& e, double now) { e.get().record_stranded(now); }, py::arg("now"))
        .def_property_readonly("now", [](NativeEngine& e) { return e.get().now(); })
        .def_property(
            "dormant_arrivals", [](NativeEngine& e) { return e.get().scheduler().dormant_arrivals; },
            [](NativeEngine& e, bool on) { e.get().scheduler().dormant_arrivals = on; },
            "Scheduler::dormant_arrivals (the native simulator's loop turns it on)")
        .def("dormant", [](NativeEngine& e) { return e.get().scheduler().dormant(); },
             "how many requests wait dormant now");
}

}  // namespace kvlife
