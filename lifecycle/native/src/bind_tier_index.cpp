// Python bindings of the mirrors of transfer/index.py (TierIndex, StorePlan) and transfer/eviction.py
// (LRU, ARC, make_eviction_order). Blocks come in as any iterable of ints, lists go out as lists,
// a StorePlan's fields as tuples; KeyError becomes KeyError (its message, or the missing key
// itself), AssertionError AssertionError, std::invalid_argument ValueError.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <sstream>
#include <utility>
#include <vector>

#include "eviction.hpp"
#include "tier_index.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

std::vector<std::int64_t> ints_of(const py::handle& iterable) {
    std::vector<std::int64_t> out;
    for (py::handle item : py::iter(iterable)) {
        out.push_back(item.cast<std::int64_t>());
    }
    return out;
}

py::list list_of(const std::vector<std::int64_t>& values) {
    py::list out(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
        out[i] = py::int_(values[i]);
    }
    return out;
}

py::list list_of(const OrderedDict<std::int64_t, NoValue>& keys) {
    py::list out;
    for (const auto& node : keys) {
        out.append(py::int_(node.key));
    }
    return out;
}

py::object optional_int(const std::optional<std::int64_t>& value) {
    return value ? py::object(py::int_(*value)) : py::object(py::none());
}

// The Python's `if evictable(block)`: the callable's result, by truth value.
auto truth_of(const py::function& evictable) {
    return [&evictable](std::int64_t block) {
        py::object result = evictable(block);
        int truth = PyObject_IsTrue(result.ptr());
        if (truth < 0) {
            throw py::error_already_set();
        }
        return truth == 1;
    };
}

py::tuple accepted_of(const StorePlan& plan) {
    py::tuple out(plan.accepted.size());
    for (std::size_t i = 0; i < plan.accepted.size(); ++i) {
        out[i] = py::make_tuple(plan.accepted[i].first, plan.accepted[i].second);
    }
    return out;
}

py::tuple evicted_of(const StorePlan& plan) { return py::tuple(list_of(plan.evicted)); }

}  // namespace

void bind_tier_index(py::module_& m) {
    py::class_<LRU> lru(m, "LRU", "Least recently used first (transfer/eviction.py's LRU).");
    lru.def(py::init<std::int64_t>(), py::arg("capacity"))
        .def("inserted", &LRU::inserted, py::arg("block"))
        .def("accessed", &LRU::accessed, py::arg("block"))
        .def("removed", &LRU::removed, py::arg("block"))
        .def(
            "victim", [](const LRU& o, const py::function& evictable) { return optional_int(o.victim(truth_of(evictable))); },
            py::arg("evictable"))
        .def_property_readonly("_order", [](const LRU& o) { return list_of(o.order()); });
    lru.attr("name") = LRU::name;

    py::class_<ARC> arc(m, "ARC", "Adaptive Replacement Cache (transfer/eviction.py's ARC).");
    arc.def(py::init<std::int64_t>(), py::arg("capacity"))
        .def("inserted", &ARC::inserted, py::arg("block"))
        .def("accessed", &ARC::accessed, py::arg("block"))
        .def("removed", &ARC::removed, py::arg("block"))
        .def("evicted", &ARC::evicted, py::arg("block"))
        .def(
            "victim", [](const ARC& o, const py::function& evictable) { return optional_int(o.victim(truth_of(evictable))); },
            py::arg("evictable"))
        .def_readonly("capacity", &ARC::capacity)
        .def_property_readonly("p", &ARC::p)
        .def_property_readonly("t1", [](const ARC& o) { return list_of(o.t1()); })
        .def_property_readonly("t2", [](const ARC& o) { return list_of(o.t2()); })
        .def_property_readonly("b1", [](const ARC& o) { return list_of(o.b1()); })
        .def_property_readonly("b2", [](const ARC& o) { return list_of(o.b2()); });
    arc.attr("name") = ARC::name;

    m.def(
        "make_eviction_order",
        [](const std::string& name, std::int64_t capacity) -> py::object {
            if (eviction_kind(name) == EvictionKind::arc) {
                return py::cast(ARC(capacity));
            }
            return py::cast(LRU(capacity));
        },
        py::arg("name"), py::arg("capacity"));

    py::class_<StorePlan>(m, "StorePlan", "Outcome of prepare_store: blocks accepted with their slots, blocks evicted.")
        .def_property_readonly("accepted", &accepted_of)
        .def_property_readonly("evicted", &evicted_of)
        .def_readonly("skipped_present", &StorePlan::skipped_present)
        .def_readonly("rejected_full", &StorePlan::rejected_full)
        .def("__repr__", [](const StorePlan& plan) {
            return "StorePlan(accepted=" + py::repr(accepted_of(plan)).cast<std::string>() +
                   ", evicted=" + py::repr(evicted_of(plan)).cast<std::string>() +
                   ", skipped_present=" + std::to_string(plan.skipped_present) +
                   ", rejected_full=" + std::to_string(plan.rejected_full) + ")";
        });

    py::class_<TierIndex>(m, "TierIndex", "Index of one tier with a fixed number of block slots (transfer/index.py).")
        .def(py::init<std::string, std::int64_t, const std::string&>(), py::arg("name"), py::arg("capacity_blocks"),
             py::arg("eviction") = "lru")
        .def_static(
            "adopting",
            [](std::string name, std::int64_t capacity_blocks, const std::string& eviction, const py::iterable& blocks) {
                std::vector<std::pair<std::int64_t, std::int64_t>> pairs;
                for (py::handle item : blocks) {
                    auto pair = item.cast<std::pair<std::int64_t, std::int64_t>>();
                    pairs.push_back(pair);
                }
                return TierIndex::adopting(std::move(name), capacity_blocks, eviction, pairs.data(), pairs.size());
            },
            py::arg("name"), py::arg("capacity_blocks"), py::arg("eviction"), py::arg("blocks"))
        .def_readonly("name", &TierIndex::name)
        .def_readonly("capacity", &TierIndex::capacity)
        .def_property_readonly("used", &TierIndex::used)
        .def_property_readonly("free", &TierIndex::free)
        .def_property_readonly("evictions", &TierIndex::evictions)
        .def("has_room", &TierIndex::has_room)
        .def("busy", [](const TierIndex& t) { return list_of(t.busy()); })
        .def("contains", &TierIndex::contains, py::arg("block"))
        .def("slot_of", &TierIndex::slot_of, py::arg("block"))
        .def(
            "lookup",
            [](const TierIndex& t, const py::iterable& blocks) {
                std::vector<std::int64_t> v = ints_of(blocks);
                return t.lookup(v.data(), v.size());
            },
            py::arg("blocks"))
        .def("pinned", &TierIndex::pinned)
        .def(
            "prepare_load",
            [](TierIndex& t, const py::iterable& blocks) {
                std::vector<std::int64_t> v = ints_of(blocks);
                return list_of(t.prepare_load(v.data(), v.size()));
            },
            py::arg("blocks"))
        .def(
            "complete_load",
            [](TierIndex& t, const py::iterable& blocks) {
                std::vector<std::int64_t> v = ints_of(blocks);
                t.complete_load(v.data(), v.size());
            },
            py::arg("blocks"))
        .def(
            "prepare_store",
            [](TierIndex& t, const py::iterable& blocks) {
                std::vector<std::int64_t> v = ints_of(blocks);
                return StorePlan(t.prepare_store(v.data(), v.size()));
            },
            py::arg("blocks"))
        .def(
            "complete_store",
            [](TierIndex& t, const py::iterable& blocks, bool ok) {
                std::vector<std::int64_t> v = ints_of(blocks);
                t.complete_store(v.data(), v.size(), ok);
            },
            py::arg("blocks"), py::arg("ok") = true)
        .def("adopt", &TierIndex::adopt, py::arg("block"), py::arg("slot"))
        .def(
            "discard",
            [](TierIndex& t, const py::iterable& blocks) {
                std::vector<std::int64_t> v = ints_of(blocks);
                return list_of(t.discard(v.data(), v.size()));
            },
            py::arg("blocks"))
        .def("check_accounting", &TierIndex::check_accounting)
        .def_property_readonly("_order",
                               [](py::object self) -> py::object {
                                   const TierIndex& t = self.cast<const TierIndex&>();
                                   if (t.eviction() == EvictionKind::arc) {
                                       return py::cast(&t.arc(), py::return_value_policy::reference_internal, self);
                                   }
                                   return py::cast(&t.lru(), py::return_value_policy::reference_internal, self);
                               })
        .def_property_readonly("_free_slots", [](const TierIndex& t) { return list_of(t.free_slots()); });
}

}  // namespace kvlife
