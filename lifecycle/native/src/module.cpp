// kvlife.lifecycle.native._core: one extension module; each building block binds itself.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace kvlife {
void bind_step_cost(py::module_& m);
void bind_links(py::module_& m);
}  // namespace kvlife

PYBIND11_MODULE(_core, m) {
    m.doc() = "kvlife's native core (C++17 mirrors of the Python reference, held to it by differential tests)";
    kvlife::bind_step_cost(m);
    kvlife::bind_links(m);
}
