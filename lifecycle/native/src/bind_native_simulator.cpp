// A whole simulated run on the native engine: lifecycle/drivers/simulator.py's Simulator (the loop,
// simulator.hpp) around lifecycle/engine/core.py's Engine (engine.hpp), bound as NativeSimulator.
// lifecycle/native/run.py builds it from a RunConfig and hands its results to the summary.
//
// What Python's Simulator(keep_requests=False) does through recorders and hooks is done here:
// - the trace: the engine renders its records into a JsonWriter; the rendered lines go to the
//   Python TraceWriter (write_rendered) in chunks of about 64 KiB, at the end, and before an
//   error or an interrupt leaves the loop (so the last record written is the engine's last);
// - the breakdown: a PhaseClock (phase_clock.hpp) is fed the transition records and arrival
//   inputs where the engine writes them, even when tracing is off (Trace's clock);
// - retirement: each request the engine lets go becomes a run.py RetiredRequest (the fields
//   metrics.RequestTotals.fold and breakdown.row_of read) handed to a Python ``fold``;
// - signals and progress as PyEngineSimulator (bind_simulator.cpp) does them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bind_core_convert.hpp"
#include "bind_core_shared.hpp"
#include "bind_policy_asker.hpp"
#include "engine.hpp"
#include "phase_clock.hpp"
#include "bind_sim_shared.hpp"
#include "simulator.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

// engine/request.py's Request, final: the fields RequestTotals.fold and breakdown.row_of read,
// as a lifecycle/native/run.py RetiredRequest (an attrs slots class, filled by its slots as the
// policy views are: its fields are read in Python, once per retired request, at slot speed).
class RetiredMaker {
  public:
    RetiredMaker()
        : class_(py::module_::import("kvlife.lifecycle.native.run").attr("RetiredRequest"),
                 {"request_id", "seq", "arrival_ms", "prompt_tokens", "block_tokens", "state", "finish_reason",
                  "generated", "first_token_ms", "finish_ms", "preemptions", "device_hit_blocks", "async_lookups",
                  "tier_hit_blocks", "last_decisions"}) {
        for (std::size_t i = 0; i < kNumStates; ++i) {
            states_[i] = py::str(std::string(state_name(static_cast<RequestState>(i))));
        }
        for (std::size_t i = 0; i < kNumHooks; ++i) {
            hooks_[i] = py::str(std::string(hook_name(static_cast<Hook>(i))));
        }
    }

    py::object make(const Request& req) const {
        py::dict tiers;
        for (const auto& [tier, blocks] : req.tier_hit_blocks) tiers[py::str(tier)] = blocks;
        py::dict decisions;  // hook -> (policy, value, reason)
        for (const auto& entry : req.last_decisions) {
            const Decided& d = *entry.decided;
            decisions[hooks_[static_cast<std::size_t>(entry.hook)]] =
                py::make_tuple(d.policy, answer_value_py(d.value), d.reason);
        }
        return class_.make(std::array<PyObject*, 15>{
            py::str(req.request_id).release().ptr(), PyLong_FromLongLong(req.seq), PyFloat_FromDouble(req.arrival_ms),
            PyLong_FromLongLong(req.prompt_tokens), PyLong_FromLongLong(req.block_tokens),
            states_[static_cast<std::size_t>(req.state)].inc_ref().ptr(), optional_str(req.finish_reason),
            PyLong_FromLongLong(req.generated), optional_float(req.first_token_ms), optional_float(req.finish_ms),
            PyLong_FromLongLong(req.preemptions), PyLong_FromLongLong(req.device_hit_blocks),
            PyLong_FromLongLong(req.async_lookups), tiers.release().ptr(), decisions.release().ptr()});
    }

  private:
    static PyObject* optional_str(const std::optional<std::string>& text) {
        return text.has_value() ? py::str(*text).release().ptr() : py::none().release().ptr();
    }
    static PyObject* optional_float(const std::optional<double>& ms) {
        return ms.has_value() ? PyFloat_FromDouble(*ms) : py::none().release().ptr();
    }

    SlotClass class_;
    std::array<py::str, kNumStates> states_;
    std::array<py::str, kNumHooks> hooks_;
};

class NativeRun;

class RunRetirer final : public Retirer {
  public:
    explicit RunRetirer(NativeRun& run) : run_(run) {}
    void retire(const Request& req) override;

  private:
    NativeRun& run_;
};

constexpr std::size_t kChunkBytes = 1 << 16;

class NativeRun {
  public:
    NativeRun(const CoreConfig& core, const SchedulerConfig& scheduler, py::object table, py::object policies,
              py::object writer, bool clock, py::object fold, const SimSettings& settings, const StepCost& cost,
              const LookupService& lookups, const std::vector<Link>& rank_links, std::vector<SimTier> tiers)
        : asker_(std::move(policies)),
          table_(std::move(table)),
          writer_(std::move(writer)),
          fold_(std::move(fold)),
          retirer_(*this) {
        if (!writer_.is_none()) {
            out_ = std::make_unique<JsonWriter>(kChunkBytes + (kChunkBytes >> 2));
            write_rendered_ = writer_.attr("write_rendered");
        }
        if (clock) clock_ = std::make_unique<PhaseClock>();
        engine_ = std::make_unique<Engine>(core, scheduler, &asker_, table_.cast<const TransitionTable&>(),
                                           Trace(out_.get(), clock_.get()), fold_.is_none() ? nullptr : &retirer_);
        engine_->scheduler().plan_tables = false;  // the loop reads no plan's block tables or hashes
        engine_->scheduler().dormant_arrivals = true;  // (it reads no queue: Scheduler::dormant_arrivals)
        sim_ = std::make_unique<Simulator<Engine>>(*engine_, settings, cost, lookups, rank_links, std::move(tiers));
        sim_->hooks.ctx = this;
        sim_->hooks.between_events = &NativeRun::between_events;
    }

    Simulator<Engine>& sim() { return *sim_; }
    Engine& engine() { return *engine_; }
    PhaseClock* clock() { return clock_.get(); }

    void retire(const Request& req) {
        py::object view = retired_.make(req);
        sim_->retired(req.request_id);
        asker_.forget(req.request_id);
        fold_(view);
    }

    void add_arrivals(const std::vector<std::string>& ids, const std::vector<double>& arrival_ms,
                      const std::vector<std::int64_t>& input_length, const std::vector<std::int64_t>& output_length,
                      py::sequence hash_ids) {
        std::size_t n = ids.size();
        if (arrival_ms.size() != n || input_length.size() != n || output_length.size() != n ||
            static_cast<std::size_t>(py::len(hash_ids)) != n) {
            throw std::invalid_argument("add_arrivals: the five sequences must have the same length");
        }
        std::vector<BlockHash> hashes;
        for (std::size_t i = 0; i < n; ++i) {
            hashes.clear();
            // (each hash read as a C long long: OverflowError past 64 bits, TypeError if no int)
            py::object items = py::reinterpret_steal<py::object>(
                PySequence_Fast(py::object(hash_ids[i]).ptr(), "add_arrivals: each request's hashes are a sequence"));
            if (!items) throw py::error_already_set();
            PyObject** item = PySequence_Fast_ITEMS(items.ptr());
            for (Py_ssize_t k = 0, m = PySequence_Fast_GET_SIZE(items.ptr()); k < m; ++k) {
                const long long h = PyLong_AsLongLong(item[k]);
                if (h == -1 && PyErr_Occurred() != nullptr) throw py::error_already_set();
                hashes.push_back(h);
            }
            sim_->add_arrival(ids[i], arrival_ms[i], input_length[i], output_length[i], hashes.data(), hashes.size());
        }
    }

    void set_refill(py::object refill) {
        refill_ = std::move(refill);
        sim_->hooks.refill = refill_.is_none() ? nullptr : &NativeRun::refill;
    }

    void set_progress(py::object progress) {
        progress_ = std::move(progress);
        sim_->hooks.progress = progress_.is_none() ? nullptr : &NativeRun::progress;
    }

    // The loop; whatever ends it, the records rendered so far reach the trace writer first.
    py::tuple run(py::object gate) {
        gate_ = std::move(gate);
        pending_ = py::str("pending");
        pending_offset_ = gate_.is_none() ? -1 : slot_offset(Py_TYPE(gate_.ptr()), "pending");
        SimOutcome out;
        try {
            out = sim_->run();
        } catch (...) {
            flush();
            throw;
        }
        flush();
        return py::make_tuple(out.makespan_ms, out.events, out.stranded, out.critical_path_lookup_ms);
    }

    // Hand the rendered lines to the trace writer (TraceWriter.write_rendered).
    void flush() {
        if (!out_ || out_->size() == 0) return;
        std::string_view view = out_->view();
        auto lines = static_cast<std::int64_t>(std::count(view.begin(), view.end(), '\n'));
        py::bytes chunk(view.data(), view.size());
        out_->clear();
        write_rendered_(chunk, lines);
    }

    py::dict state_counts() const {
        py::dict out;
        const CoreState& state = engine_->state();
        for (std::size_t i = 0; i < kNumStates; ++i) {
            out[py::str(std::string(state_name(static_cast<RequestState>(i))))] = state.state_counts[i];
        }
        return out;
    }

    // The requests still in the engine, in arrival order.
    py::list requests() const {
        engine_->scheduler().wake_all();  // (each dormant request's record, rebuilt)
        py::list out;
        for (const auto& node : engine_->state().requests) out.append(retired_.make(*node.value));
        return out;
    }

    // Each job still open: (job id, timed out).
    std::vector<std::pair<std::int64_t, bool>> jobs() const {
        std::vector<std::pair<std::int64_t, bool>> out;
        for (const auto& node : engine_->state().jobs) out.emplace_back(node.key, node.value->timed_out);
        return out;
    }

  private:
    static void between_events(void* ctx) {
        auto* self = static_cast<NativeRun*>(ctx);
        if (self->out_ && self->out_->size() >= kChunkBytes) self->flush();
        check_between_events(self->gate_, self->pending_, self->pending_offset_);
    }

    static bool refill(void* ctx) { return static_cast<NativeRun*>(ctx)->refill_().cast<bool>(); }

    static void progress(void* ctx, std::int64_t done, std::int64_t total) {
        static_cast<NativeRun*>(ctx)->progress_(done, total);
    }

    PyPolicyAsker asker_;
    RetiredMaker retired_;
    py::object table_;
    py::object writer_;
    py::object write_rendered_ = py::none();
    py::object fold_;
    RunRetirer retirer_;
    std::unique_ptr<JsonWriter> out_;
    std::unique_ptr<PhaseClock> clock_;
    std::unique_ptr<Engine> engine_;
    std::unique_ptr<Simulator<Engine>> sim_;
    py::object refill_ = py::none();
    py::object progress_ = py::none();
    py::object gate_ = py::none();
    py::object pending_ = py::none();
    Py_ssize_t pending_offset_ = -1;  // the gate's pending slot (bind_slots.hpp)
};

void RunRetirer::retire(const Request& req) { run_.retire(req); }

}  // namespace

void bind_native_simulator(py::module_& m) {
    m.def("live_requests", [] { return RequestCount::live; },
          "how many of the connector core's Request records exist in this process (every core's)");

    py::class_<NativeRun>(m, "NativeSimulator",
                          "simulator.hpp's loop around engine.hpp's Engine: built by lifecycle/native/run.py")
        .def(py::init([](const CoreConfig& core, std::int64_t device_blocks, std::int64_t max_batched_tokens,
                         std::int64_t max_running, const std::string& kv_load_failure_policy, py::object table,
                         py::object policies, py::object writer, bool clock, py::object fold, std::int64_t ranks,
                         bool async_scheduling, bool exact, double rank_jitter_ms,
                         std::optional<std::int64_t> max_output_tokens, std::int64_t seed, double rank_block_bytes,
                         std::optional<std::int64_t> size, const StepCost& cost, const LookupService& lookups,
                         const std::vector<Link>& links,
                         const TierTuples& tiers) {
                 SchedulerConfig scheduler{core.block_tokens, device_blocks, max_batched_tokens, max_running,
                                           async_scheduling, kv_load_failure_policy == "fail"};
                 SimSettings s;
                 s.ranks = ranks;
                 s.async_scheduling = async_scheduling;
                 s.exact = exact;
                 s.rank_jitter_ms = rank_jitter_ms;
                 s.max_output_tokens = max_output_tokens;
                 s.seed = seed;
                 s.rank_block_bytes = rank_block_bytes;
                 s.size = size;
                 std::vector<SimTier> out = sim_tiers(tiers, links.size(), ranks);
                 return std::make_unique<NativeRun>(core, scheduler, std::move(table), std::move(policies),
                                                    std::move(writer), clock, std::move(fold), s, cost, lookups,
                                                    links, std::move(out));
             }),
             py::kw_only(), py::arg("core"), py::arg("device_blocks"), py::arg("max_batched_tokens"),
             py::arg("max_running"), py::arg("kv_load_failure_policy"), py::arg("table"), py::arg("policies"),
             py::arg("writer"), py::arg("clock"), py::arg("fold"), py::arg("ranks"), py::arg("async_scheduling"),
             py::arg("exact"), py::arg("rank_jitter_ms"), py::arg("max_output_tokens"), py::arg("seed"),
             py::arg("rank_block_bytes"), py::arg("size"), py::arg("cost"), py::arg("lookups"), py::arg("links"),
             py::arg("tiers"))
        .def("add_arrivals", &NativeRun::add_arrivals, py::arg("ids"), py::arg("arrival_ms"), py::arg("input_length"),
             py::arg("output_length"), py::arg("hash_ids"))
        .def("set_refill", &NativeRun::set_refill, py::arg("refill"))
        .def("set_progress", &NativeRun::set_progress, py::arg("progress"))
        .def("run", &NativeRun::run, py::arg("gate") = py::none())
        .def("flush", &NativeRun::flush)
        .def("stats", [](NativeRun& r) { return stats_dict(r.engine().stats()); })
        .def("state_counts", &NativeRun::state_counts)
        .def("requests", &NativeRun::requests)
        .def("jobs", &NativeRun::jobs)
        .def("arrived", [](NativeRun& r) { return r.engine().state().arrived(); })
        .def("prefetches", [](NativeRun& r) { return r.engine().state().prefetches.size(); })
        .def("clock_take",
             [](NativeRun& r, const std::string& rid, std::optional<double> first_token_ms,
                std::optional<double> end_ms) {
                 PhaseClock::Phases p = r.clock()->take(rid, first_token_ms, end_ms);
                 return py::make_tuple(p[0], p[1], p[2], p[3], p[4], p[5]);
             },
             py::arg("rid"), py::arg("first_token_ms"), py::arg("end_ms") = py::none())
        .def_property(
            "clock_end_ms", [](NativeRun& r) { return r.clock() != nullptr ? r.clock()->end_ms : 0.0; },
            [](NativeRun& r, double v) {
                if (r.clock() != nullptr) r.clock()->end_ms = v;
            })
        .def_property_readonly("has_clock", [](NativeRun& r) { return r.clock() != nullptr; })
        .def_property_readonly("now", [](NativeRun& r) { return r.engine().now(); })
        .def_property_readonly("steps_in_flight", [](NativeRun& r) { return r.sim().steps_in_flight(); })
        .def_property_readonly("events", [](NativeRun& r) { return r.sim().events(); })
        .def_property_readonly("taken", [](NativeRun& r) { return r.sim().taken(); })
        .def_property_readonly("total", [](NativeRun& r) { return r.sim().total(); });
}

}  // namespace kvlife
