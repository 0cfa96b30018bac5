// Python binding of worker_book.hpp (mirroring lifecycle/engine/worker_book.py): WorkerBook and
// OutputAggregator with the reference's arguments and results (Python sets where it gives sets);
// ``jobs``, ``loads_of``, ``stores_of`` and ``holds`` are read-only snapshots.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "worker_book.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

// Any iterable, as the reference iterates its arguments (a str held is its characters).
std::vector<int64_t> ints(py::handle items) {
    std::vector<int64_t> out;
    for (py::handle item : py::iter(items)) {
        out.push_back(item.cast<int64_t>());
    }
    return out;
}

std::vector<std::string> strs(py::handle items) {
    std::vector<std::string> out;
    for (py::handle item : py::iter(items)) {
        out.push_back(item.cast<std::string>());
    }
    return out;
}

template <class Items>
py::set to_set(const Items& items) {
    py::set out;
    for (const auto& item : items) {
        out.add(py::cast(item));
    }
    return out;
}

template <class Items>
py::tuple to_tuple(const Items& items) {
    py::tuple out(items.size());
    std::size_t i = 0;
    for (const auto& item : items) {
        out[i++] = py::cast(item);
    }
    return out;
}

py::tuple moves_tuple(const JobEntry& entry) {
    py::tuple out(entry.moves.size());
    std::size_t i = 0;
    for (const auto& [hash, device] : entry.moves) {
        out[i++] = py::make_tuple(hash, device);
    }
    return out;
}

py::dict job_sets(const OrderedDict<std::string, WorkerBook::JobIds>& book) {
    py::dict out;
    for (const auto& node : book) {
        out[py::str(node.key)] = to_set(node.value);
    }
    return out;
}

}  // namespace

void bind_worker_book(py::module_& m) {
    py::class_<JobEntry>(m, "JobEntry")
        .def_readonly("kind", &JobEntry::kind)
        .def_readonly("request_id", &JobEntry::request_id)
        .def_property_readonly("moves", &moves_tuple)
        .def("__eq__", [](const JobEntry& a, const JobEntry& b) {
            return a.kind == b.kind && a.request_id == b.request_id && a.moves == b.moves;
        })
        .def("__repr__", [](const JobEntry& e) {
            return py::str("JobEntry(kind={!r}, request_id={!r}, moves={!r})")
                .format(e.kind, e.request_id, moves_tuple(e));
        });

    py::class_<WorkerBook>(m, "WorkerBook")
        .def(py::init<>())
        .def(
            "add",
            [](WorkerBook& book, int64_t job_id, const std::string& kind, const std::string& request_id,
               py::handle hashes, py::handle device_blocks, std::optional<int64_t> after) {
                book.add(job_id, kind, request_id, ints(hashes), ints(device_blocks), after);
            },
            py::arg("job_id"), py::arg("kind"), py::arg("request_id"), py::arg("hashes"), py::arg("device_blocks"),
            py::arg("after") = py::none())
        .def("hold", [](WorkerBook& book, py::handle request_ids) { book.hold(strs(request_ids)); },
             py::arg("request_ids"))
        .def("done", [](WorkerBook& book, int64_t job_id, py::handle failed) { book.done(job_id, ints(failed)); },
             py::arg("job_id"), py::arg("failed") = py::tuple())
        .def("take",
             [](WorkerBook& book) {
                 KVOutput out = book.take();
                 return py::make_tuple(to_set(out.recving), to_set(out.sending), to_set(out.invalid));
             })
        .def_property_readonly("busy", &WorkerBook::busy)
        .def_property_readonly("jobs",
                               [](const WorkerBook& book) {
                                   py::dict out;
                                   for (const auto& node : book.jobs()) {
                                       out[py::int_(node.key)] = py::cast(node.value);
                                   }
                                   return out;
                               })
        .def_property_readonly("loads_of", [](const WorkerBook& book) { return job_sets(book.loads_of()); })
        .def_property_readonly("stores_of", [](const WorkerBook& book) { return job_sets(book.stores_of()); })
        .def_property_readonly("holds", [](const WorkerBook& book) { return to_set(book.holds()); });

    py::class_<OutputAggregator>(m, "OutputAggregator")
        .def(py::init<int64_t>(), py::arg("world_size"))
        .def_readonly("world_size", &OutputAggregator::world_size)
        .def(
            "aggregate",
            [](OutputAggregator& aggregator, py::handle outputs) {
                std::vector<KVOutput> native;
                for (py::handle output : py::iter(outputs)) {
                    native.push_back(KVOutput{strs(output[py::int_(0)]), strs(output[py::int_(1)]),
                                              ints(output[py::int_(2)])});
                }
                KVOutput combined = aggregator.aggregate(native);
                return py::make_tuple(to_tuple(combined.recving), to_tuple(combined.sending),
                                      py::frozenset(to_set(combined.invalid)));
            },
            py::arg("outputs"));
}

}  // namespace kvlife
