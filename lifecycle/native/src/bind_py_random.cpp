// The binding of kvlife::PyRandom (py_random.hpp), the mirror of Python's random.Random:
// Python's argument conversions and exceptions around the plain C++ class.
#include <pybind11/pybind11.h>

#include <climits>
#include <string>
#include <vector>

#include "py_random.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

[[noreturn]] void raise(PyObject* type, const std::string& message) {
    PyErr_SetString(type, message.c_str());
    throw py::error_already_set();
}

// operator.index(obj) as a Python int (TypeError for a float, as random.py's _index).
py::int_ index(const py::handle& obj) {
    PyObject* n = PyNumber_Index(obj.ptr());
    if (n == nullptr) {
        throw py::error_already_set();
    }
    return py::reinterpret_steal<py::int_>(n);
}

// An int argument of randrange/randint as int64_t. Python's ints are unbounded; the native
// generator's range is int64 (what a config holds): beyond it, OverflowError.
int64_t to_int64(const py::handle& obj, const char* name) {
    py::int_ n = index(obj);
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(n.ptr(), &overflow);
    if (overflow != 0) {
        raise(PyExc_OverflowError,
              std::string("PyRandom: ") + name + " is outside int64, the native generator's range");
    }
    return v;
}

// Argument Clinic's `int` converter (getrandbits's k): OverflowError past a C int.
int to_c_int(const py::handle& obj) {
    py::int_ n = index(obj);
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(n.ptr(), &overflow);
    if (overflow != 0 || v > INT_MAX || v < INT_MIN) {
        raise(PyExc_OverflowError, "Python int too large to convert to C int");
    }
    return static_cast<int>(v);
}

// Modules/_randommodule.c random_seed for an int: int.__abs__(arg), then its 32-bit words.
void seed_from(PyRandom& rng, const py::object& a) {
    if (!PyLong_Check(a.ptr())) {
        raise(PyExc_TypeError, std::string("PyRandom seeds from an int only (random.Random also hashes or "
                                           "SHA-512s other seeds), not ") +
                                   Py_TYPE(a.ptr())->tp_name);
    }
    int overflow = 0;
    long long small = PyLong_AsLongLongAndOverflow(a.ptr(), &overflow);
    if (overflow == 0) {
        rng.seed(small);
        return;
    }
    py::int_ n = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyLong_Type)).attr("__abs__")(a);
    auto bits = n.attr("bit_length")().cast<std::size_t>();
    std::size_t count = (bits - 1) / 32 + 1;
    std::string raw = py::bytes(n.attr("to_bytes")(count * 4, "little"));
    std::vector<uint32_t> words(count);
    for (std::size_t i = 0; i < count; i++) {
        const auto* b = reinterpret_cast<const unsigned char*>(raw.data()) + 4 * i;
        words[i] = uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
    }
    rng.seed_words(words.data(), count);
}

// A Python sequence as PyRandom::choice reads one.
struct Sequence {
    py::object seq;
    std::size_t size() const { return py::len(seq); }
    py::object operator[](std::size_t i) const { return seq[py::int_(i)]; }
};

}  // namespace

void bind_py_random(py::module_& m) {
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const PyRandom::IndexErrorLike& e) {
            PyErr_SetString(PyExc_IndexError, e.what());
        } catch (const PyRandom::ZeroDivisionErrorLike& e) {
            PyErr_SetString(PyExc_ZeroDivisionError, e.what());
        } catch (const PyRandom::EmptyRangeError& e) {
#if PY_VERSION_HEX < 0x030C0000
            PyErr_SetString(PyExc_ValueError, e.python311.c_str());
#else
            PyErr_SetString(PyExc_ValueError, e.what());
#endif
        }
    });

    py::class_<PyRandom>(m, "PyRandom",
                         "random.Random(seed) for an int seed, drawing the same numbers bit for bit")
        .def(py::init([](const py::object& seed) {
                 PyRandom rng(0);
                 seed_from(rng, seed);
                 return rng;
             }),
             py::arg("seed"))
        .def("seed", &seed_from, py::arg("a"))
        .def("random", &PyRandom::random)
        .def("uniform", &PyRandom::uniform, py::arg("a"), py::arg("b"))
        .def(
            "getrandbits",
            [](PyRandom& rng, const py::object& k) -> py::object {
                int bits = to_c_int(k);
                if (bits <= 64) {
                    return py::int_(rng.getrandbits(bits));  // ValueError for bits < 0
                }
                std::vector<uint32_t> words = rng.getrandbits_words(bits);
                std::string raw(words.size() * 4, '\0');
                for (std::size_t i = 0; i < words.size(); i++) {
                    for (int b = 0; b < 4; b++) {
                        raw[4 * i + b] = static_cast<char>((words[i] >> (8 * b)) & 0xffU);
                    }
                }
                return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyLong_Type))
                    .attr("from_bytes")(py::bytes(raw), "little");
            },
            py::arg("k"))
        .def(
            "_randbelow",
            [](PyRandom& rng, const py::object& n) -> uint64_t {
                py::int_ i = index(n);
                if (PyObject_RichCompareBool(i.ptr(), py::int_(0).ptr(), Py_LE) == 1) {
                    return rng.randbelow(0);  // ValueError (Python's loops forever)
                }
                unsigned long long v = PyLong_AsUnsignedLongLong(i.ptr());
                if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
                    throw py::error_already_set();  // OverflowError past 2**64 - 1
                }
                return rng.randbelow(v);
            },
            py::arg("n"))
        .def(
            "randrange",
            [](PyRandom& rng, const py::object& start, const py::object& stop, const py::object& step) -> int64_t {
                int64_t istart = to_int64(start, "start");
                if (stop.is_none()) {
                    // random.py: `if step is not _ONE`, _ONE being the cached int 1.
                    if (!(PyLong_CheckExact(step.ptr()) && step.equal(py::int_(1)))) {
                        raise(PyExc_TypeError, "Missing a non-None stop argument");
                    }
                    return rng.randrange(istart);
                }
                int64_t istop = to_int64(stop, "stop");
                return rng.randrange(istart, istop, to_int64(step, "step"));
            },
            py::arg("start"), py::arg("stop") = py::none(), py::arg("step") = py::int_(1))
        .def(
            "randint",
            [](PyRandom& rng, const py::object& a, const py::object& b) {
                int64_t ia = to_int64(a, "a");
                return rng.randint(ia, to_int64(b, "b"));
            },
            py::arg("a"), py::arg("b"))
        .def(
            "choice", [](PyRandom& rng, const py::object& seq) { return rng.choice(Sequence{seq}); },
            py::arg("seq"))
        .def(
            "shuffle",
            [](PyRandom& rng, const py::object& x) {
                std::size_t n = py::len(x);
                std::vector<py::object> items;
                items.reserve(n);
                for (std::size_t i = 0; i < n; i++) {
                    items.emplace_back(x[py::int_(i)]);
                }
                rng.shuffle(items);
                for (std::size_t i = 0; i < n; i++) {
                    x[py::int_(i)] = items[i];
                }
            },
            py::arg("x"))
        .def("expovariate", &PyRandom::expovariate, py::arg("lambd"))
        .def("getstate", [](const PyRandom& rng) {
            // Lib/random.py Random.getstate: (VERSION, _random.Random.getstate(), gauss_next).
            py::tuple internal(PyRandom::N + 1);
            for (int i = 0; i < PyRandom::N; i++) {
                internal[i] = py::int_(rng.state()[i]);
            }
            internal[PyRandom::N] = py::int_(rng.index());
            return py::make_tuple(3, internal, py::none());
        });
}

}  // namespace kvlife
