// Binding of the trace's JSON writer (json_writer.hpp), mirroring lifecycle/traces/trace.py's
// rendering: render(value) walks a Python value through the C++ writer and returns what
// orjson.dumps(value) returns, and raises TypeError where orjson does (same messages);
// render_lines(records) writes many records as lines into one buffer, as a trace holds them.
#include <pybind11/pybind11.h>

#include "json_writer.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

// orjson refuses to nest deeper than this (its "Recursion limit reached").
constexpr int kMaxDepth = 254;

std::string_view utf8_of(PyObject* text) {
    Py_ssize_t size = 0;
    const char* data = PyUnicode_AsUTF8AndSize(text, &size);
    if (data == nullptr) {
        PyErr_Clear();
        throw py::type_error("str is not valid UTF-8: surrogates not allowed");
    }
    return {data, static_cast<std::size_t>(size)};
}

// The types orjson takes without a default: str and int and their subclasses, bool, None,
// float (not a subclass), dict and list and their subclasses, tuple (not a subclass).
void walk(JsonWriter& out, PyObject* value, int depth) {
    if (PyUnicode_Check(value)) {
        out.string(utf8_of(value));
    } else if (value == Py_True || value == Py_False) {
        out.boolean(value == Py_True);
    } else if (PyLong_Check(value)) {
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow == 0) {
            out.int64(v);
        } else {
            const unsigned long long u = overflow > 0 ? PyLong_AsUnsignedLongLong(value) : 0;
            if (overflow < 0 || PyErr_Occurred()) {
                PyErr_Clear();
                throw py::type_error("Integer exceeds 64-bit range");
            }
            out.uint64(u);
        }
    } else if (value == Py_None) {
        out.null();
    } else if (PyFloat_CheckExact(value)) {
        out.float64(PyFloat_AS_DOUBLE(value));
    } else if (PyDict_Check(value)) {
        if (depth >= kMaxDepth) throw py::type_error("Recursion limit reached");
        out.begin_object();
        Py_ssize_t pos = 0;
        PyObject* k = nullptr;
        PyObject* v = nullptr;
        while (PyDict_Next(value, &pos, &k, &v)) {
            if (!PyUnicode_CheckExact(k)) throw py::type_error("Dict key must be str");
            out.key(utf8_of(k));
            walk(out, v, depth + 1);
        }
        out.end_object();
    } else if (PyList_Check(value) || PyTuple_CheckExact(value)) {
        if (depth >= kMaxDepth) throw py::type_error("Recursion limit reached");
        out.begin_array();
        const bool list = PyList_Check(value);
        const Py_ssize_t n = list ? PyList_GET_SIZE(value) : PyTuple_GET_SIZE(value);
        for (Py_ssize_t i = 0; i < n; ++i) {
            walk(out, list ? PyList_GET_ITEM(value, i) : PyTuple_GET_ITEM(value, i), depth + 1);
        }
        out.end_array();
    } else {
        throw py::type_error(std::string("Type is not JSON serializable: ") + Py_TYPE(value)->tp_name);
    }
}

}  // namespace

void bind_json_writer(py::module_& m) {
    m.def(
        "render",
        [](py::handle value, bool newline) {
            // One writer, reused: rendering calls no Python code, so it cannot re-enter.
            static JsonWriter out(1 << 16);
            out.clear();
            walk(out, value.ptr(), 0);
            if (newline) out.newline();
            return py::bytes(out.data(), out.size());
        },
        py::arg("value"), py::kw_only(), py::arg("newline") = false,
        "The bytes orjson.dumps(value) writes (with its OPT_APPEND_NEWLINE where newline), "
        "rendered by the native JSON writer.");
    m.def(
        "render_lines",
        [](py::sequence records) {
            // One buffer for all the lines, as a trace file holds them: one writer, no clear
            // between; it starts small, so that a long trace crosses many of its growths.
            JsonWriter out(64);
            for (py::handle record : records) {
                walk(out, record.ptr(), 0);
                out.newline();
            }
            return py::bytes(out.data(), out.size());
        },
        py::arg("records"),
        "The lines a trace writer writes for these records, one after another: each as "
        "orjson.dumps(record, option=OPT_APPEND_NEWLINE).");
}

}  // namespace kvlife
