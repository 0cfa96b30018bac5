// The native simulator loop (simulator.hpp, a mirror of lifecycle/drivers/simulator.py) bound
// around a *Python* Engine (lifecycle/engine/core.py): PyEngine turns each C++ input event into
// the Python event object, calls engine.handle and turns the commands back. This is the seam
// tests/test_native_simulator.py holds the loop to the Python Simulator through; the native
// engine plugs into the same template. lifecycle/native/bridge.py builds it from a RunConfig.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bind_sim_shared.hpp"
#include "simulator.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

py::tuple int_tuple(const std::vector<std::int64_t>& values) {
    py::tuple out(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
        out[i] = py::int_(values[i]);
    }
    return out;
}

std::vector<std::int64_t> ints(py::handle seq) {
    std::vector<std::int64_t> out;
    py::sequence s = py::reinterpret_borrow<py::sequence>(seq);
    out.reserve(s.size());
    for (py::handle item : s) {
        out.push_back(item.cast<std::int64_t>());
    }
    return out;
}

// engine/core.py's Engine, adapted to Simulator<Engine>'s concept (simulator.hpp).
class PyEngine {
  public:
    explicit PyEngine(py::object engine) : engine_(std::move(engine)) {
        py::module_ events = py::module_::import("kvlife.lifecycle.engine.events");
        arrival_ = events.attr("Arrival");
        abort_ = events.attr("Abort");
        tick_ = events.attr("Tick");
        answer_ = events.attr("LookupAnswer");
        report_ = events.attr("TransferReport");
        output_ = events.attr("StepOutput");
        submit_ = events.attr("SubmitLookup");
        discard_ = events.attr("DiscardLookup");
        load_ = events.attr("StartLoad");
        store_ = events.attr("StartStore");
        prefetch_ = events.attr("StartPrefetch");
        free_ = events.attr("FreeBlocks");
        plan_ = events.attr("StepPlan");
        records_ = py::module_::import("kvlife.lifecycle.engine.records");
        handle_ = engine_.attr("handle");
        output_tokens_ = engine_.attr("output_tokens");
    }

    const py::object& engine() const { return engine_; }

    std::vector<Command>& handle(InputEvent&& event) {
        py::object commands = handle_(to_python(event));
        commands_.clear();
        for (py::handle command : commands) {
            commands_.push_back(from_python(command));
        }
        return commands_;
    }

    std::optional<double> next_wakeup() {
        py::object wake = engine_.attr("next_wakeup")();
        if (wake.is_none()) {
            return std::nullopt;
        }
        return wake.cast<double>();
    }

    bool busy() { return engine_.attr("busy")().cast<bool>(); }

    std::array<std::int64_t, 3> progress() {
        py::tuple p = engine_.attr("progress")();
        return {p[0].cast<std::int64_t>(), p[1].cast<std::int64_t>(), p[2].cast<std::int64_t>()};
    }

    std::optional<std::int64_t> output_tokens(const std::string& request_id) {
        py::object n = output_tokens_(request_id);
        if (n.is_none()) {
            return std::nullopt;
        }
        return n.cast<std::int64_t>();
    }

    std::vector<std::string> sync_lookup(const std::vector<BlockHash>& hashes) {
        return engine_.attr("sync_lookup")(int_tuple(hashes)).cast<std::vector<std::string>>();
    }

    std::int64_t finished_count() {
        py::object counts = engine_.attr("state_counts");
        return counts["finished"].cast<std::int64_t>();
    }

    void check_invariants() { engine_.attr("check_invariants")(); }

    std::vector<std::string> stranded() { return engine_.attr("stranded")().cast<std::vector<std::string>>(); }

    void record_stranded(double now) {
        py::object recorder = engine_.attr("recorder");
        if (recorder.is_none()) {
            return;
        }
        for (py::handle req : engine_.attr("state").attr("unfinished")()) {
            py::dict fields;
            fields["origin"] = "driver";
            fields["req"] = req.attr("request_id");
            fields["state"] = req.attr("state");
            recorder(records_.attr("warning")(now, "stranded", **fields));
        }
    }

  private:
    py::object to_python(const InputEvent& event) {
        switch (event.index()) {
            case 0: {
                const Arrival& a = std::get<Arrival>(event);
                py::object max_tokens = a.max_tokens.has_value() ? py::object(py::int_(*a.max_tokens)) : py::none();
                return arrival_(a.t, a.request_id, a.prompt_tokens, int_tuple(a.block_hashes), a.resumable, max_tokens);
            }
            case 1: {
                const Abort& a = std::get<Abort>(event);
                return abort_(a.t, a.request_id);
            }
            case 2:
                return tick_(std::get<Tick>(event).t);
            case 3: {
                const LookupAnswer& a = std::get<LookupAnswer>(event);
                py::object tiers = py::none();
                if (a.tiers.has_value()) {
                    py::tuple names(a.tiers->size());
                    for (std::size_t i = 0; i < a.tiers->size(); ++i) {
                        names[i] = py::str((*a.tiers)[i]);
                    }
                    tiers = names;
                }
                return answer_(a.t, a.request_id, a.epoch, tiers);
            }
            case 4: {
                const TransferReport& r = std::get<TransferReport>(event);
                return report_(r.t, r.job_id, r.rank, int_tuple(r.failed));
            }
            default: {
                const StepOutput& o = std::get<StepOutput>(event);
                py::tuple finished(o.finished.size());
                for (std::size_t i = 0; i < o.finished.size(); ++i) {
                    finished[i] = py::make_tuple(o.finished[i].first, o.finished[i].second);
                }
                py::tuple reports(o.reports.size());
                for (std::size_t i = 0; i < o.reports.size(); ++i) {
                    const StepReport& r = o.reports[i];
                    reports[i] = py::make_tuple(r.job_id, r.rank, int_tuple(r.failed));
                }
                return output_(o.t, o.step_id, finished, reports, int_tuple(o.failed_ranks));
            }
        }
    }

    static std::vector<BlockMove> block_moves(py::handle moves) {
        std::vector<BlockMove> out;
        for (py::handle m : moves) {
            out.push_back(BlockMove{m.attr("block_hash").cast<BlockHash>(), m.attr("device_block").cast<std::int64_t>(),
                                    m.attr("tier").cast<std::string>(), m.attr("slot").cast<std::int64_t>()});
        }
        return out;
    }

    Command from_python(py::handle c) {
        py::handle kind = py::type::handle_of(c);
        if (kind.is(plan_)) {
            StepPlan plan;
            plan.step_id = c.attr("step_id").cast<std::int64_t>();
            for (py::handle e : c.attr("entries")) {
                py::tuple entry = py::reinterpret_borrow<py::tuple>(e);
                Scheduled s;
                s.request_id = entry[0].cast<std::string>();
                s.num_tokens = entry[1].cast<std::int64_t>();
                s.computed_before = entry[2].cast<std::int64_t>();
                s.samples = entry[3].cast<bool>();
                for (py::handle b : entry[4]) {
                    s.block_table.push_back(static_cast<BlockId>(b.cast<std::int64_t>()));
                }
                s.block_hashes = ints(entry[5]);
                plan.entries.push_back(std::move(s));
            }
            plan.sync_lookups = c.attr("sync_lookups").cast<std::int64_t>();
            plan.sync_lookup_keys = ints(c.attr("sync_lookup_keys"));
            plan.flush = ints(c.attr("flush"));
            return plan;
        }
        if (kind.is(submit_)) {
            return SubmitLookup{c.attr("request_id").cast<std::string>(), c.attr("epoch").cast<std::int64_t>(),
                                ints(c.attr("block_hashes"))};
        }
        if (kind.is(load_)) {
            py::object after = c.attr("after");
            std::optional<std::int64_t> owner;
            if (!after.is_none()) {
                owner = after.cast<std::int64_t>();
            }
            return StartLoad{c.attr("job_id").cast<std::int64_t>(), c.attr("request_id").cast<std::string>(),
                             block_moves(c.attr("moves")), owner};
        }
        if (kind.is(store_)) {
            return StartStore{c.attr("job_id").cast<std::int64_t>(), c.attr("request_id").cast<std::string>(),
                              block_moves(c.attr("moves"))};
        }
        if (kind.is(prefetch_)) {
            std::vector<TierMove> moves;
            for (py::handle m : c.attr("moves")) {
                moves.push_back(TierMove{m.attr("block_hash").cast<BlockHash>(), m.attr("src_tier").cast<std::string>(),
                                         m.attr("src_slot").cast<std::int64_t>(), m.attr("dst_tier").cast<std::string>(),
                                         m.attr("dst_slot").cast<std::int64_t>()});
            }
            return StartPrefetch{c.attr("job_id").cast<std::int64_t>(), c.attr("request_id").cast<std::string>(),
                                 std::move(moves)};
        }
        if (kind.is(discard_)) {
            return DiscardLookup{c.attr("request_id").cast<std::string>(), c.attr("epoch").cast<std::int64_t>()};
        }
        if (kind.is(free_)) {
            return FreeBlocks{ints(c.attr("device_blocks"))};
        }
        throw std::invalid_argument("not an engine command: " + py::repr(c).cast<std::string>());
    }

    py::object engine_;
    py::object arrival_, abort_, tick_, answer_, report_, output_;
    py::object submit_, discard_, load_, store_, prefetch_, free_, plan_;
    py::object records_, handle_, output_tokens_;
    std::vector<Command> commands_;
};

// What Python holds: the adapted engine, the loop around it, and the hooks' Python ends.
class PySimulator {
  public:
    PySimulator(py::object engine, const SimSettings& settings, const StepCost& cost, const LookupService& lookups,
                const std::vector<Link>& rank_links, std::vector<SimTier> tiers)
        : engine_(std::move(engine)), sim_(engine_, settings, cost, lookups, rank_links, std::move(tiers)) {
        sim_.hooks.ctx = this;
        sim_.hooks.between_events = &PySimulator::between_events;
    }

    Simulator<PyEngine>& sim() { return sim_; }
    const py::object& engine() const { return engine_.engine(); }

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
            for (py::handle h : hash_ids[i]) {
                hashes.push_back(h.cast<BlockHash>());
            }
            sim_.add_arrival(ids[i], arrival_ms[i], input_length[i], output_length[i], hashes.data(), hashes.size());
        }
    }

    void set_refill(py::object refill) {
        refill_ = std::move(refill);
        sim_.hooks.refill = refill_.is_none() ? nullptr : &PySimulator::refill;
    }

    void set_progress(py::object progress) {
        progress_ = std::move(progress);
        sim_.hooks.progress = progress_.is_none() ? nullptr : &PySimulator::progress;
    }

    // The loop, with the interrupts gate (drivers/interrupts.py's StopGate) checked between
    // events; a held signal raises from there (gate.check), a Python handler's exception too.
    py::tuple run(py::object gate) {
        gate_ = std::move(gate);
        pending_ = py::str("pending");
        pending_offset_ = gate_.is_none() ? -1 : slot_offset(Py_TYPE(gate_.ptr()), "pending");
        SimOutcome out = sim_.run();
        return py::make_tuple(out.makespan_ms, out.events, out.stranded, out.critical_path_lookup_ms);
    }

  private:
    static void between_events(void* ctx) {
        auto* self = static_cast<PySimulator*>(ctx);
        check_between_events(self->gate_, self->pending_, self->pending_offset_);
    }

    static bool refill(void* ctx) { return static_cast<PySimulator*>(ctx)->refill_().cast<bool>(); }

    static void progress(void* ctx, std::int64_t done, std::int64_t total) {
        static_cast<PySimulator*>(ctx)->progress_(done, total);
    }

    PyEngine engine_;
    Simulator<PyEngine> sim_;
    py::object refill_ = py::none();
    py::object progress_ = py::none();
    py::object gate_ = py::none();
    py::object pending_ = py::none();
    Py_ssize_t pending_offset_ = -1;  // the gate's pending slot (bind_slots.hpp)
};

}  // namespace

void bind_simulator(py::module_& m) {
    py::class_<PySimulator>(m, "PyEngineSimulator")
        .def(py::init([](py::object engine, std::int64_t ranks, bool async_scheduling, bool exact,
                         double rank_jitter_ms, std::optional<std::int64_t> max_output_tokens, std::int64_t seed,
                         double rank_block_bytes, std::optional<std::int64_t> check_every,
                         std::optional<std::int64_t> size, const StepCost& cost, const LookupService& lookups,
                         const std::vector<Link>& links,
                         const TierTuples& tiers) {
                 SimSettings s;
                 s.ranks = ranks;
                 s.async_scheduling = async_scheduling;
                 s.exact = exact;
                 s.rank_jitter_ms = rank_jitter_ms;
                 s.max_output_tokens = max_output_tokens;
                 s.seed = seed;
                 s.rank_block_bytes = rank_block_bytes;
                 s.check_every = check_every;
                 s.size = size;
                 std::vector<SimTier> out = sim_tiers(tiers, links.size(), ranks);
                 return new PySimulator(std::move(engine), s, cost, lookups, links, std::move(out));
             }),
             py::arg("engine"), py::kw_only(), py::arg("ranks"), py::arg("async_scheduling"), py::arg("exact"),
             py::arg("rank_jitter_ms"), py::arg("max_output_tokens"), py::arg("seed"), py::arg("rank_block_bytes"),
             py::arg("check_every"), py::arg("size"), py::arg("cost"), py::arg("lookups"), py::arg("links"),
             py::arg("tiers"))
        .def_property_readonly("engine", &PySimulator::engine)
        .def("add_arrivals", &PySimulator::add_arrivals, py::arg("ids"), py::arg("arrival_ms"),
             py::arg("input_length"), py::arg("output_length"), py::arg("hash_ids"))
        .def("set_refill", &PySimulator::set_refill, py::arg("refill"))
        .def("set_progress", &PySimulator::set_progress, py::arg("progress"))
        .def("retired", [](PySimulator& s, const std::string& rid) { s.sim().retired(rid); }, py::arg("request_id"))
        .def("run", &PySimulator::run, py::arg("gate") = py::none())
        .def_property_readonly("steps_in_flight", [](PySimulator& s) { return s.sim().steps_in_flight(); })
        .def_property_readonly("events", [](PySimulator& s) { return s.sim().events(); })
        .def_property_readonly("taken", [](PySimulator& s) { return s.sim().taken(); })
        .def_property_readonly("total", [](PySimulator& s) { return s.sim().total(); })
        .def_property_readonly("critical_path_lookup_ms",
                               [](PySimulator& s) { return s.sim().critical_path_lookup_ms(); });
}

}  // namespace kvlife
