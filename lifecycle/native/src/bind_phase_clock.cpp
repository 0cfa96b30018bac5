// The binding of phase_clock.hpp (lifecycle/breakdown.py's PhaseClock), for the differential test:
// the states are PhaseClock.State, named as specs/names.py's RequestState names them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "phase_clock.hpp"

namespace py = pybind11;

namespace kvlife {

void bind_phase_clock(py::module_& m) {
    py::class_<PhaseClock> clock(m, "PhaseClock");
    py::enum_<PhaseClock::State>(clock, "State")
        .value("WAITING", PhaseClock::State::WAITING)
        .value("LOOKUP_PENDING", PhaseClock::State::LOOKUP_PENDING)
        .value("LOADING", PhaseClock::State::LOADING)
        .value("RUNNING", PhaseClock::State::RUNNING)
        .value("SENDING", PhaseClock::State::SENDING)
        .value("FINISHED", PhaseClock::State::FINISHED);
    clock.def(py::init<>())
        .def("transition", &PhaseClock::transition, py::arg("rid"), py::arg("source"), py::arg("target"),
             py::arg("t"))
        .def("arrival", &PhaseClock::arrival, py::arg("rid"), py::arg("t"))
        .def(
            "take",
            [](PhaseClock& self, const std::string& rid, std::optional<double> first_token_ms,
               std::optional<double> end_ms) {
                PhaseClock::Phases p = self.take(rid, first_token_ms, end_ms);
                return py::make_tuple(p[0], p[1], p[2], p[3], p[4], p[5]);
            },
            py::arg("rid"), py::arg("first_token_ms"), py::arg("end_ms") = py::none())
        .def("since", &PhaseClock::since, py::arg("rid"))
        .def("__len__", &PhaseClock::size)
        .def_readwrite("end_ms", &PhaseClock::end_ms);
}

}  // namespace kvlife
