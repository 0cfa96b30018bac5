// Python bindings of the native Link (lifecycle/drivers/links.py) and LookupService
// (lifecycle/drivers/lookup_service.py): the same names, arguments, results and ValueErrors.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "links.hpp"
#include "lookup_service.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

py::tuple completion_tuple(const Completion& c) {
    return py::make_tuple(c.t, py::make_tuple(c.tid.job_id, c.tid.rank));
}

}  // namespace

void bind_links(py::module_& m) {
    py::class_<Link>(m, "Link")
        .def(py::init<std::string, double, double, std::optional<double>>(), py::arg("name"),
             py::arg("bandwidth_gb_s"), py::arg("latency_ms") = 0.0, py::arg("write_bandwidth_gb_s") = py::none())
        .def_property_readonly("name", &Link::name)
        .def_property_readonly("bandwidth_gb_s", &Link::bandwidth_gb_s)
        .def_property_readonly("write_bandwidth_gb_s", &Link::write_bandwidth_gb_s)
        .def_property_readonly("latency_ms", &Link::latency_ms)
        .def_property_readonly("bytes_moved", &Link::bytes_moved)
        .def_property_readonly("active", &Link::active)
        .def_property_readonly("in_flight", &Link::in_flight)
        .def("solo_ms", &Link::solo_ms, py::arg("nbytes"), py::arg("write") = false)
        .def(
            "start",
            [](Link& link, std::pair<int64_t, int64_t> transfer_id, double nbytes, double now, bool write) {
                link.start(TransferId{transfer_id.first, transfer_id.second}, nbytes, now, write);
            },
            py::arg("transfer_id"), py::arg("nbytes"), py::arg("now"), py::arg("write") = false)
        .def("next_completion",
             [](const Link& link) -> py::object {
                 auto next = link.next_completion();
                 if (!next) {
                     return py::none();
                 }
                 return completion_tuple(*next);
             })
        .def(
            "advance",
            [](Link& link, double now) {
                std::vector<Completion> done;
                link.advance(now, done);
                py::list out;
                for (const Completion& c : done) {
                    out.append(completion_tuple(c));
                }
                return out;
            },
            py::arg("now"));

    py::class_<LookupService>(m, "LookupService")
        .def(py::init([](const py::object& workers, double base_ms, double per_key_ms) {
                 // The reference's type check (bool and non-int workers refused), before C++ sees an int64.
                 if (py::isinstance<py::bool_>(workers) || !py::isinstance<py::int_>(workers)) {
                     throw py::value_error("workers must be a positive integer, got " +
                                           py::repr(workers).cast<std::string>());
                 }
                 return LookupService(workers.cast<int64_t>(), base_ms, per_key_ms);
             }),
             py::arg("workers"), py::arg("base_ms"), py::arg("per_key_ms"))
        .def_property_readonly("workers", &LookupService::workers)
        .def_property_readonly("base_ms", &LookupService::base_ms)
        .def_property_readonly("per_key_ms", &LookupService::per_key_ms)
        .def_property_readonly("submitted", &LookupService::submitted)
        .def_property_readonly("max_wait_ms", &LookupService::max_wait_ms)
        .def("latency_ms", &LookupService::latency_ms, py::arg("keys"))
        .def(
            "submit",
            [](LookupService& service, const py::object& lookup_id, int64_t keys, double now) {
                // The simulator's two shapes: None (a sync lookup) or (request_id, epoch).
                if (lookup_id.is_none()) {
                    return service.submit(LookupId{}, keys, now);
                }
                auto id = py::reinterpret_borrow<py::tuple>(lookup_id);
                if (!py::isinstance<py::tuple>(lookup_id) || id.size() != 2 || !py::isinstance<py::str>(id[0]) ||
                    py::isinstance<py::bool_>(id[1]) || !py::isinstance<py::int_>(id[1])) {
                    throw py::type_error("lookup_id must be None or a (request_id: str, epoch: int) tuple, got " +
                                         py::repr(lookup_id).cast<std::string>());
                }
                std::string request_id = id[0].cast<std::string>();
                return service.submit(LookupId{true, request_id, id[1].cast<int64_t>()}, keys, now);
            },
            py::arg("lookup_id"), py::arg("keys"), py::arg("now"))
        .def("pending", &LookupService::pending, py::arg("now"));
}

}  // namespace kvlife
