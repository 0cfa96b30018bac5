// Binding of the Trace sink (records.hpp, mirroring lifecycle/engine/records.py and
// events.input_to_record): ``_core.TraceRecords`` renders each record kind from Python values
// into one buffer, so a test compares its bytes with what the trace writer renders for
// ``records.<kind>(...)``. Also the conversions of Python values the other core bindings share
// (input events, block moves, JSON values).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bind_core_convert.hpp"
#include "records.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

// A record's keyword fields as typed Fields (the values kept alive in ``store``).
struct FieldList {
    std::vector<std::string> keys;
    std::vector<std::string> strings;
    std::vector<std::vector<std::int64_t>> ints;
    std::vector<JsonValue> values;
    std::vector<Field> fields;

    explicit FieldList(const py::dict& kwargs) {
        const std::size_t n = kwargs.size();
        keys.reserve(n);
        strings.reserve(n);
        ints.reserve(n);
        values.reserve(n);
        fields.reserve(n);
        for (auto item : kwargs) {
            keys.push_back(item.first.cast<std::string>());
            std::string_view key = keys.back();
            py::handle v = item.second;
            if (v.is_none()) {
                fields.emplace_back(key, std::nullopt);
            } else if (PyBool_Check(v.ptr())) {
                fields.emplace_back(key, v.ptr() == Py_True);
            } else if (PyLong_CheckExact(v.ptr())) {
                fields.emplace_back(key, v.cast<std::int64_t>());
            } else if (PyFloat_CheckExact(v.ptr())) {
                fields.emplace_back(key, v.cast<double>());
            } else if (PyUnicode_Check(v.ptr())) {
                strings.push_back(v.cast<std::string>());
                fields.emplace_back(key, std::string_view(strings.back()));
            } else if (is_int_list(v)) {
                ints.push_back(v.cast<std::vector<std::int64_t>>());
                fields.emplace_back(key, ints.back());
            } else {
                values.push_back(json_value(v));
                fields.emplace_back(key, values.back());
            }
        }
    }

    static bool is_int_list(py::handle v) {
        if (!PyList_Check(v.ptr())) return false;
        for (py::handle item : py::reinterpret_borrow<py::list>(v)) {
            if (!PyLong_CheckExact(item.ptr())) return false;
        }
        return true;
    }
};

std::vector<StepChunk> step_chunks(const py::list& list, std::vector<std::string>& names) {
    std::vector<StepChunk> out;
    names.reserve(names.size() + list.size());
    for (py::handle item : list) {
        py::sequence c = py::reinterpret_borrow<py::sequence>(item);
        names.push_back(c[0].cast<std::string>());
        out.push_back(StepChunk{names.back(), c[1].cast<std::int64_t>(), c[2].cast<std::int64_t>()});
    }
    return out;
}

struct TraceRecords {
    explicit TraceRecords(bool enabled) : trace(enabled ? &out : nullptr) {}
    JsonWriter out{256};
    Trace trace;

    py::bytes take() {
        py::bytes result(out.data(), out.size());
        out.clear();
        return result;
    }
};

}  // namespace

void bind_records(py::module_& m) {
    py::class_<TraceRecords>(m, "TraceRecords",
                             "The native Trace sink over one buffer: each method writes the line the trace writer "
                             "writes for records.<method>(...) (input: events.input_to_record); take() returns the "
                             "bytes written since the last take. enabled=False: a disabled Trace (it writes nothing).")
        .def(py::init<bool>(), py::arg("enabled") = true)
        .def("take", &TraceRecords::take)
        .def("header",
             [](TraceRecords& self, std::int64_t schema, py::handle config, const std::vector<std::string>& policies,
                std::int64_t seed, const py::kwargs& extra) {
                 JsonValue c = json_value(config);
                 FieldList f(extra);
                 self.trace.header(schema, c, policies, seed, f.fields.data(), f.fields.size());
             })
        .def("input", [](TraceRecords& self, py::handle event) { self.trace.input(input_event(event)); })
        .def("transition", [](TraceRecords& self, double t, const std::string& rid, const std::string& source,
                              const std::string& target, const std::string& trigger,
                              const std::string& reason) { self.trace.transition(t, rid, source, target, trigger, reason); })
        .def("decision",
             [](TraceRecords& self, double t, const std::string& rid, const std::string& point,
                const std::string& policy, py::handle value, const std::string& reason) {
                 self.trace.decision(t, rid, point, policy, answer_value(value), reason);
             })
        .def("warning",
             [](TraceRecords& self, double t, const std::string& what, const py::kwargs& fields) {
                 FieldList f(fields);
                 self.trace.warning(t, what, f.fields.data(), f.fields.size());
             })
        .def("stale_lookup",
             [](TraceRecords& self, double t, const std::string& rid, std::int64_t epoch,
                std::optional<std::int64_t> current_epoch, std::optional<std::string> state) {
                 std::optional<std::string_view> s;
                 if (state) s = *state;
                 self.trace.stale_lookup(t, rid, epoch, current_epoch, s);
             })
        .def("lookup_reuse", [](TraceRecords& self, double t, const std::string& rid, double answered,
                                std::int64_t uses, std::int64_t blocks,
                                std::int64_t evicted) { self.trace.lookup_reuse(t, rid, answered, uses, blocks, evicted); })
        .def("job",
             [](TraceRecords& self, double t, std::int64_t job_id, const std::string& op, const std::string& rid,
                py::iterable moves, std::optional<py::dict> named, std::optional<std::int64_t> after) {
                 std::vector<BlockMove> list = block_moves(moves);
                 Positions positions;
                 if (named) {
                     for (auto item : *named) positions.set(item.first.cast<std::int64_t>(), item.second.cast<std::int64_t>());
                 }
                 self.trace.job(t, job_id, op, rid, list.data(), list.size(), named ? &positions : nullptr, after);
             },
             py::arg("t"), py::arg("job_id"), py::arg("op"), py::arg("rid"), py::arg("moves"),
             py::arg("named") = py::none(), py::arg("after") = py::none())
        .def("job_prefetch",
             [](TraceRecords& self, double t, std::int64_t job_id, const std::string& rid, py::iterable moves) {
                 std::vector<TierMove> list = tier_moves(moves);
                 self.trace.job_prefetch(t, job_id, rid, list.data(), list.size());
             })
        .def("job_done",
             [](TraceRecords& self, double t, std::int64_t job_id, const std::string& op, std::int64_t failed, bool late,
                bool abandoned) { self.trace.job_done(t, job_id, op, failed, late, abandoned); },
             py::arg("t"), py::arg("job_id"), py::arg("op"), py::arg("failed"), py::arg("late"),
             py::arg("abandoned") = false)
        .def("free",
             [](TraceRecords& self, double t, const std::vector<BlockId>& blocks) {
                 self.trace.free(t, blocks.data(), blocks.size());
             })
        .def("evict",
             [](TraceRecords& self, double t, const std::string& tier, const std::vector<std::int64_t>& blocks) {
                 self.trace.evict(t, tier, blocks.data(), blocks.size());
             })
        .def("store_rejected", [](TraceRecords& self, double t, const std::string& rid, const std::string& tier,
                                  std::int64_t blocks) { self.trace.store_rejected(t, rid, tier, blocks); })
        .def("step",
             [](TraceRecords& self, double t, std::int64_t step_id, std::int64_t requests, std::int64_t prefill_tokens,
                std::int64_t sync_lookups, const py::list& prompt, const py::list& fills,
                const std::vector<std::int64_t>& flush) {
                 std::vector<std::string> names;
                 names.reserve(prompt.size() + fills.size());
                 std::vector<StepChunk> p = step_chunks(prompt, names);
                 std::vector<StepChunk> f = step_chunks(fills, names);
                 self.trace.step(t, step_id, requests, prefill_tokens, sync_lookups, p, f, flush);
             },
             py::arg("t"), py::arg("step_id"), py::arg("requests"), py::arg("prefill_tokens"), py::arg("sync_lookups"),
             py::arg("prompt"), py::arg("fills"), py::arg("flush") = std::vector<std::int64_t>{})
        .def("reclaim",
             [](TraceRecords& self, double t, std::int64_t job_id, const std::string& op, const std::string& rid,
                const std::vector<std::int64_t>& ranks, std::int64_t blocks, const std::string& reason) {
                 self.trace.reclaim(t, job_id, op, rid, ranks, blocks, reason);
             })
        .def("abandon", [](TraceRecords& self, double t, std::int64_t job_id, const std::string& op,
                           const std::string& rid,
                           const std::string& reason) { self.trace.abandon(t, job_id, op, rid, reason); })
        .def("interrupted",
             [](TraceRecords& self, double t, const std::string& signal, bool clean, const py::dict& requests,
                std::int64_t finished, std::int64_t not_arrived, std::int64_t jobs, std::int64_t quarantined_jobs,
                std::int64_t prefetches, const py::kwargs& open_work) {
                 std::vector<std::pair<std::string, std::int64_t>> r;
                 for (auto item : requests) r.emplace_back(item.first.cast<std::string>(), item.second.cast<std::int64_t>());
                 std::vector<std::pair<std::string, std::int64_t>> w;
                 for (auto item : open_work) w.emplace_back(item.first.cast<std::string>(), item.second.cast<std::int64_t>());
                 self.trace.interrupted(t, signal, clean, r, finished, not_arrived, jobs, quarantined_jobs, prefetches, w);
             });
}

}  // namespace kvlife
