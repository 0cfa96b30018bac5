// What the two bindings of Simulator<Engine> share (bind_simulator.cpp: around the Python
// engine; bind_native_simulator.cpp: around the native one): the tiers as Python hands them
// over, and the check between two events. Binding-only (pybind11).
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "bind_slots.hpp"
#include "simulator.hpp"

namespace kvlife {

namespace py = pybind11;

// (name, failure rate, load link, store link, whether a store writes), one per tier
// (bridge.sim_links).
using TierTuples = std::vector<std::tuple<std::string, double, std::size_t, std::size_t, bool>>;

// The tiers as the loop takes them; std::invalid_argument for a link index past ``links`` or
// fewer than one rank.
inline std::vector<SimTier> sim_tiers(const TierTuples& tiers, std::size_t links, std::int64_t ranks) {
    std::vector<SimTier> out;
    for (const auto& t : tiers) {
        if (std::get<2>(t) >= links || std::get<3>(t) >= links) {
            throw std::invalid_argument("tier " + std::get<0>(t) + ": no such link");
        }
        out.push_back(SimTier{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t)});
    }
    if (ranks < 1) {
        throw std::invalid_argument("ranks must be at least 1");
    }
    return out;
}

// Between two events (where the Python loop calls gate.check()): run the Python signal
// handlers (a handler that raises, a second signal or no gate, stops the loop here), then
// cut the run if the interrupts gate holds a signal. ``pending``: the attribute's name;
// ``offset``: its slot in the gate (StopGate's __slots__), read in place; -1: got by name.
inline void check_between_events(const py::object& gate, const py::object& pending, Py_ssize_t offset) {
    if (PyErr_CheckSignals() != 0) {
        throw py::error_already_set();
    }
    if (gate.is_none()) {
        return;
    }
    PyObject* value = offset >= 0 ? slot_get(gate.ptr(), offset, pending.ptr())  // (borrowed)
                                  : PyObject_GetAttr(gate.ptr(), pending.ptr());  // (a new reference)
    if (value == nullptr) {
        throw py::error_already_set();
    }
    const bool held = value != Py_None;
    if (offset < 0) {
        Py_DECREF(value);
    }
    if (held) {
        gate.attr("check")();
    }
}

}  // namespace kvlife
