// Python binding of ranks.hpp (mirroring lifecycle/engine/ranks.py): RankAggregator,
// ReportStatus (whose ``value`` is the Python member's value) and ReportOutcome.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ranks.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

py::tuple int_tuple(const std::vector<int64_t>& items) {
    py::tuple out(items.size());
    std::size_t i = 0;
    for (int64_t item : items) {
        out[i++] = py::int_(item);
    }
    return out;
}

}  // namespace

void bind_ranks(py::module_& m) {
    py::enum_<ReportStatus>(m, "ReportStatus")
        .value("PENDING", ReportStatus::PENDING)
        .value("DONE", ReportStatus::DONE)
        .value("DUPLICATE", ReportStatus::DUPLICATE)
        .value("UNKNOWN_JOB", ReportStatus::UNKNOWN_JOB)
        .value("BAD_RANK", ReportStatus::BAD_RANK)
        .def_property_readonly("value", [](ReportStatus status) { return report_status_value(status); });

    py::class_<ReportOutcome>(m, "ReportOutcome")
        .def_property_readonly("status", [](const ReportOutcome& o) { return o.status; })
        .def_property_readonly("failed", [](const ReportOutcome& o) { return int_tuple(o.failed); })
        .def("__eq__", [](const ReportOutcome& a, const ReportOutcome& b) {
            return a.status == b.status && a.failed == b.failed;
        })
        .def("__repr__", [](const ReportOutcome& o) {
            return py::str("ReportOutcome(status={}, failed={})")
                .format(py::cast(o.status).attr("name"), py::repr(int_tuple(o.failed)));
        });

    py::class_<RankAggregator>(m, "RankAggregator")
        .def(py::init<int64_t>(), py::arg("world_size"))
        .def_property_readonly("world_size", &RankAggregator::world_size)
        .def("open", &RankAggregator::open, py::arg("job_id"))
        .def("in_flight", &RankAggregator::in_flight, py::arg("job_id"))
        .def("close", &RankAggregator::close, py::arg("job_id"))
        .def("missing_ranks", [](const RankAggregator& a, int64_t job_id) { return int_tuple(a.missing_ranks(job_id)); },
             py::arg("job_id"))
        .def("report", &RankAggregator::report, py::arg("job_id"), py::arg("rank"), py::arg("failed"));
}

}  // namespace kvlife
