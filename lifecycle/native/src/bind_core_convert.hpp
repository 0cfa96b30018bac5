// Python values -> the native core's (engine/events.py inputs and moves, JSON values, a hook's
// answer), shared by the core's bind files (bind_records.cpp, bind_core_lifecycle.cpp). A
// binding-only header: the core's plain C++ never includes it.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "core_request.hpp"
#include "events.hpp"
#include "records.hpp"

namespace kvlife {

namespace py = pybind11;

// Any JSON-able Python value (str, bool, int in int64, float, None, list, tuple, dict with str keys).
inline JsonValue json_value(py::handle v) {
    JsonValue out;
    if (v.is_none()) {
        out.type = JsonValue::Type::NONE;
    } else if (PyBool_Check(v.ptr())) {
        out.type = JsonValue::Type::BOOL;
        out.b = v.ptr() == Py_True;
    } else if (PyLong_Check(v.ptr())) {
        out.type = JsonValue::Type::INT;
        out.i = v.cast<std::int64_t>();
    } else if (PyFloat_Check(v.ptr())) {
        out.type = JsonValue::Type::FLOAT;
        out.d = v.cast<double>();
    } else if (PyUnicode_Check(v.ptr())) {
        out.type = JsonValue::Type::STR;
        out.s = v.cast<std::string>();
    } else if (PyList_Check(v.ptr()) || PyTuple_Check(v.ptr())) {
        out.type = JsonValue::Type::LIST;
        for (py::handle item : py::reinterpret_borrow<py::sequence>(v)) out.items.push_back(json_value(item));
    } else if (PyDict_Check(v.ptr())) {
        out.type = JsonValue::Type::OBJECT;
        for (auto item : py::reinterpret_borrow<py::dict>(v)) {
            out.fields.emplace_back(item.first.cast<std::string>(), json_value(item.second));
        }
    } else {
        throw py::type_error(std::string("Type is not JSON serializable: ") + Py_TYPE(v.ptr())->tp_name);
    }
    return out;
}

// A hook's answer value: None, bool, int (in int64), float or str; TypeError for anything else.
inline AnswerValue answer_value(py::handle v) {
    if (v.is_none()) return std::monostate{};
    if (PyBool_Check(v.ptr())) return v.ptr() == Py_True;
    if (PyLong_Check(v.ptr())) return v.cast<std::int64_t>();
    if (PyFloat_Check(v.ptr())) return v.cast<double>();
    if (PyUnicode_Check(v.ptr())) return v.cast<std::string>();
    throw py::type_error(std::string("a hook's value must be a str, int, float, bool or None, not ") +
                         Py_TYPE(v.ptr())->tp_name);
}

inline py::object answer_value_py(const AnswerValue& v) {
    switch (v.index()) {
        case 1:
            return py::bool_(std::get<bool>(v));
        case 2:
            return py::int_(std::get<std::int64_t>(v));
        case 3:
            return py::float_(std::get<double>(v));
        case 4:
            return py::str(std::get<std::string>(v));
        default:
            return py::none();
    }
}

// events.BlockMove objects (block_hash, device_block, tier, slot).
inline std::vector<BlockMove> block_moves(py::iterable moves) {
    std::vector<BlockMove> out;
    for (py::handle m : moves) {
        out.push_back(BlockMove{m.attr("block_hash").cast<BlockHash>(), m.attr("device_block").cast<std::int64_t>(),
                                m.attr("tier").cast<std::string>(), m.attr("slot").cast<std::int64_t>()});
    }
    return out;
}

// events.TierMove objects (block_hash, src_tier, src_slot, dst_tier, dst_slot).
inline std::vector<TierMove> tier_moves(py::iterable moves) {
    std::vector<TierMove> out;
    for (py::handle m : moves) {
        out.push_back(TierMove{m.attr("block_hash").cast<BlockHash>(), m.attr("src_tier").cast<std::string>(),
                               m.attr("src_slot").cast<std::int64_t>(), m.attr("dst_tier").cast<std::string>(),
                               m.attr("dst_slot").cast<std::int64_t>()});
    }
    return out;
}

// One of events.py's input events (by its ``type``).
inline InputEvent input_event(py::handle e) {
    const std::string type = e.attr("type").cast<std::string>();
    const double t = e.attr("t").cast<double>();
    if (type == "arrival") {
        return Arrival{t, e.attr("request_id").cast<std::string>(), e.attr("prompt_tokens").cast<std::int64_t>(),
                       e.attr("block_hashes").cast<std::vector<BlockHash>>(), e.attr("resumable").cast<bool>(),
                       e.attr("max_tokens").cast<std::optional<std::int64_t>>()};
    }
    if (type == "abort") return Abort{t, e.attr("request_id").cast<std::string>()};
    if (type == "tick") return Tick{t};
    if (type == "lookup_answer") {
        return LookupAnswer{t, e.attr("request_id").cast<std::string>(), e.attr("epoch").cast<std::int64_t>(),
                            e.attr("tiers").cast<std::optional<std::vector<std::string>>>()};
    }
    if (type == "transfer_report") {
        return TransferReport{t, e.attr("job_id").cast<std::int64_t>(), e.attr("rank").cast<std::int64_t>(),
                              e.attr("failed").cast<std::vector<BlockHash>>()};
    }
    if (type == "step_output") {
        StepOutput out{t, e.attr("step_id").cast<std::int64_t>(), {}, {}, {}};
        for (py::handle pair : e.attr("finished")) {
            py::sequence p = py::reinterpret_borrow<py::sequence>(pair);
            out.finished.emplace_back(p[0].cast<std::string>(), p[1].cast<std::string>());
        }
        for (py::handle report : e.attr("reports")) {
            py::sequence r = py::reinterpret_borrow<py::sequence>(report);
            out.reports.push_back(StepReport{r[0].cast<std::int64_t>(), r[1].cast<std::int64_t>(),
                                             r[2].cast<std::vector<BlockHash>>()});
        }
        out.failed_ranks = e.attr("failed_ranks").cast<std::vector<std::int64_t>>();
        return out;
    }
    throw py::value_error("unknown input event type " + type);
}

}  // namespace kvlife
