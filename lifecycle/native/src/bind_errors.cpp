// errors.hpp's exceptions, translated to Python's with the same message or key.
#include <pybind11/pybind11.h>

#include "errors.hpp"

namespace py = pybind11;

namespace kvlife {

void bind_errors(py::module_& m) {
    static_cast<void>(m);  // the translator is process-wide
    py::register_exception_translator([](std::exception_ptr thrown) {
        try {
            if (thrown) {
                std::rethrow_exception(thrown);
            }
        } catch (const AssertionError& e) {
            PyErr_SetString(PyExc_AssertionError, e.what());
        } catch (const KeyError& e) {
            if (e.key.has_value()) {
                py::int_ key(*e.key);
                PyErr_SetObject(PyExc_KeyError, key.ptr());
            } else {
                PyErr_SetString(PyExc_KeyError, e.what());
            }
        }
    });
}

}  // namespace kvlife
