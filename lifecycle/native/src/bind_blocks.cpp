// Python binding of blocks.hpp, the mirror of lifecycle/engine/blocks.py: the same names,
// arguments, results and exceptions (OutOfBlocks subclasses the reference's, so a caller
// catching blocks.OutOfBlocks catches the native one too).
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>

#include "blocks.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

// Block ids from any iterable of ints (the reference takes any Iterable[int]). An id that
// no int32 holds is out of range all the same: it maps to one the pool rejects where the
// reference's list indexing raises IndexError.
std::vector<BlockId> block_ids(const py::iterable& blocks) {
    std::vector<BlockId> out;
    for (py::handle item : blocks) {
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
        if (value == -1 && PyErr_Occurred()) {
            throw py::error_already_set();
        }
        if (overflow < 0 || value < 0) {
            out.push_back(-1);
        } else if (overflow > 0 || value > std::numeric_limits<BlockId>::max()) {
            out.push_back(std::numeric_limits<BlockId>::max());
        } else {
            out.push_back(static_cast<BlockId>(value));
        }
    }
    return out;
}

py::list to_list(const std::vector<BlockId>& items) {
    py::list out(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
        out[i] = py::int_(items[i]);
    }
    return out;
}

// The UTF-8 bytes of request_id. Where it has none (a lone surrogate), the reference's
// f"{previous}/{request_id}/{index}".encode() raises UnicodeEncodeError: the same key is
// encoded here, so the error is the very same (its object and position included).
std::string_view request_utf8(const py::str& request_id, std::optional<BlockHash> previous, std::int64_t index) {
    Py_ssize_t size = 0;
    const char* data = PyUnicode_AsUTF8AndSize(request_id.ptr(), &size);
    if (data == nullptr) {
        PyErr_Clear();
        py::str key = py::str("{}/{}/{}").format(previous.has_value() ? py::str(py::int_(*previous)) : py::str(""),
                                                 request_id, index);
        key.attr("encode")();
        throw std::logic_error("request id without UTF-8 that its key encodes");  // unreachable
    }
    return {data, static_cast<std::size_t>(size)};
}

}  // namespace

void bind_blocks(py::module_& m) {
    py::object reference_out_of_blocks = py::module_::import("kvlife.lifecycle.engine.blocks").attr("OutOfBlocks");
    py::register_exception<OutOfBlocks>(m, "OutOfBlocks", reference_out_of_blocks);
    m.attr("NO_HASH") = py::int_(NO_HASH);
    m.def(
        "derived_block_hash",
        [](std::optional<BlockHash> previous, const py::str& request_id, std::int64_t index) {
            return derived_block_hash(previous, request_utf8(request_id, previous, index), index);
        },
        py::arg("previous"), py::arg("request_id"), py::arg("index"));
    m.def(
        "extend_hashes",
        [](const py::sequence& hashes, const py::str& request_id, std::int64_t count) {
            std::vector<BlockHash> out;
            out.reserve(hashes.size());
            for (py::handle h : hashes) {
                out.push_back(h.cast<BlockHash>());
            }
            if (static_cast<std::int64_t>(out.size()) < count) {  // the reference encodes only to derive
                std::optional<BlockHash> previous;
                if (!out.empty()) {
                    previous = out.back();
                }
                extend_hashes(out, request_utf8(request_id, previous, static_cast<std::int64_t>(out.size())),
                              count);
            }
            py::tuple result(out.size());
            for (std::size_t i = 0; i < out.size(); ++i) {
                result[i] = py::int_(out[i]);
            }
            return result;
        },
        py::arg("hashes"), py::arg("request_id"), py::arg("count"));

    py::class_<HashList>(m, "HashList", "blocks.hpp HashList: a request's hashes, one buffer for its two records")
        .def(py::init<std::vector<BlockHash>>(), py::arg("hashes"))
        .def(
            "share",
            [](const HashList& self, std::size_t n) {
                if (n > self.size()) throw py::index_error("share past the list's end");
                return HashList(self, n);
            },
            py::arg("n"))
        .def("extend", &HashList::extend, py::arg("request_id"), py::arg("count"))
        .def(
            "assign", [](HashList& self, const std::vector<BlockHash>& v) { self.assign(v.data(), v.data() + v.size()); },
            py::arg("hashes"))
        .def("tolist", [](const HashList& self) { return self.to_vector(); })
        .def(
            "take_parts",
            [](HashList& self) {
                HashList::Parts parts = self.take_parts();
                return py::make_tuple(py::cast(parts.hashes), parts.given, parts.size);
            },
            "take_parts(): (the buffer's hashes, how many were given, the list's length); the list is left empty")
        .def_static(
            "from_parts",
            [](std::vector<BlockHash> hashes, std::uint32_t given, std::uint32_t size) {
                if (given > hashes.size() || size > hashes.size()) throw py::value_error("parts past the hashes");
                return HashList(HashList::Parts{std::move(hashes), given, size});
            },
            py::arg("hashes"), py::arg("given"), py::arg("size"))
        .def(
            "same_buffer", [](const HashList& self, const HashList& other) { return self.data() == other.data(); },
            py::arg("other"));

    py::class_<DeviceBlockPool>(m, "DeviceBlockPool")
        .def(py::init<std::int64_t>(), py::arg("capacity"))
        .def_property_readonly("capacity", &DeviceBlockPool::capacity)
        .def_property_readonly("free", &DeviceBlockPool::free)
        .def_property_readonly("used", &DeviceBlockPool::used)
        // Snapshots (copies): writing to them changes nothing in the pool.
        .def_property_readonly("refs",
                               [](const DeviceBlockPool& pool) {
                                   py::list out(pool.refs().size());
                                   for (std::size_t i = 0; i < pool.refs().size(); ++i) {
                                       out[i] = py::int_(pool.refs()[i]);
                                   }
                                   return out;
                               })
        .def_property_readonly("hashes",
                               [](const DeviceBlockPool& pool) {
                                   py::list out(pool.hashes().size());
                                   for (std::size_t i = 0; i < pool.hashes().size(); ++i) {
                                       out[i] = py::int_(pool.hashes()[i]);
                                   }
                                   return out;
                               })
        .def_property_readonly("cached",
                               [](const DeviceBlockPool& pool) {
                                   py::dict out;  // hash -> {block: None}, both in the reference's order
                                   for (const auto& [block_hash, blocks] : pool.cached()) {
                                       py::dict copies;
                                       for (BlockId b : blocks) {
                                           copies[py::int_(b)] = py::none();
                                       }
                                       out[py::int_(block_hash)] = copies;
                                   }
                                   return out;
                               })
        .def_property_readonly("free_queue",
                               [](const DeviceBlockPool& pool) { return to_list(pool.free_queue()); })
        .def(
            "block_of",
            [](const DeviceBlockPool& pool, BlockHash block_hash) -> py::object {
                BlockId block = pool.block_of(block_hash);
                if (block == NO_BLOCK) {
                    return py::none();
                }
                return py::int_(block);
            },
            py::arg("block_hash"))
        .def(
            "cached_prefix",
            [](const DeviceBlockPool& pool, const py::iterable& hashes) {
                std::vector<BlockHash> in;
                for (py::handle h : hashes) {
                    in.push_back(h.cast<BlockHash>());
                }
                std::vector<BlockId> out;
                pool.cached_prefix(in.data(), in.size(), out);
                return to_list(out);
            },
            py::arg("hashes"))
        .def(
            "evictable",
            [](const DeviceBlockPool& pool, const py::iterable& blocks) {
                std::vector<BlockId> in = block_ids(blocks);
                return pool.evictable(in.data(), in.size());
            },
            py::arg("blocks"))
        .def(
            "touch",
            [](DeviceBlockPool& pool, const py::iterable& blocks) {
                std::vector<BlockId> in = block_ids(blocks);
                pool.touch(in.data(), in.size());
            },
            py::arg("blocks"))
        .def(
            "allocate",
            [](DeviceBlockPool& pool, std::int64_t count) {
                std::vector<BlockId> out;
                pool.allocate(count, out);
                return to_list(out);
            },
            py::arg("count"))
        .def(
            "release",
            [](DeviceBlockPool& pool, const py::iterable& blocks) {
                std::vector<BlockId> in = block_ids(blocks);
                std::vector<BlockId> out;
                pool.release(in.data(), in.size(), out);
                return to_list(out);
            },
            py::arg("blocks"))
        .def(
            "hold",
            [](DeviceBlockPool& pool, const py::iterable& blocks) {
                std::vector<BlockId> in = block_ids(blocks);
                pool.hold(in.data(), in.size());
            },
            py::arg("blocks"))
        .def(
            "cache",
            [](DeviceBlockPool& pool, std::int64_t block, BlockHash block_hash) {
                pool.cache(block < 0 || block > std::numeric_limits<BlockId>::max()
                               ? std::numeric_limits<BlockId>::max()
                               : static_cast<BlockId>(block),
                           block_hash);
            },
            py::arg("block"), py::arg("block_hash"))
        .def(
            "forget",
            [](DeviceBlockPool& pool, const py::iterable& blocks) {
                std::vector<BlockId> in = block_ids(blocks);
                pool.forget(in.data(), in.size());
            },
            py::arg("blocks"))
        .def("check_accounting", &DeviceBlockPool::check_accounting);
}

}  // namespace kvlife
