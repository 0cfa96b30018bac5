// kvlife.lifecycle.native._core: one extension module; each building block binds itself.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace kvlife {
void bind_errors(py::module_& m);
void bind_step_cost(py::module_& m);
void bind_blocks(py::module_& m);
void bind_scheduler(py::module_& m);
void bind_core_lifecycle(py::module_& m);
void bind_engine(py::module_& m);
void bind_json_writer(py::module_& m);
void bind_links(py::module_& m);
void bind_native_simulator(py::module_& m);
void bind_phase_clock(py::module_& m);
void bind_py_random(py::module_& m);
void bind_ranks(py::module_& m);
void bind_records(py::module_& m);
void bind_simulator(py::module_& m);
void bind_tier_index(py::module_& m);
void bind_worker_book(py::module_& m);
}  // namespace kvlife

PYBIND11_MODULE(_core, m) {
    m.doc() = "kvlife's native core (C++17 mirrors of the Python reference, held to it by differential tests)";
    kvlife::bind_errors(m);
    kvlife::bind_step_cost(m);
    kvlife::bind_blocks(m);
    kvlife::bind_scheduler(m);
    kvlife::bind_core_lifecycle(m);
    kvlife::bind_engine(m);
    kvlife::bind_json_writer(m);
    kvlife::bind_links(m);
    kvlife::bind_native_simulator(m);
    kvlife::bind_phase_clock(m);
    kvlife::bind_py_random(m);
    kvlife::bind_ranks(m);
    kvlife::bind_records(m);
    kvlife::bind_simulator(m);
    kvlife::bind_tier_index(m);
    kvlife::bind_worker_book(m);
}
