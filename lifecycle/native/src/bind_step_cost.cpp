#include <pybind11/pybind11.h>

#include "step_cost.hpp"

namespace py = pybind11;

namespace kvlife {

void bind_step_cost(py::module_& m) {
    py::class_<StepCost>(m, "StepCost")
        .def(py::init([](double linear_flops_per_token, double lm_head_flops_per_request, double ms_per_flop,
                         double weight_ms, double allreduces, double ring_factor, double allreduce_bytes_per_token,
                         double link, double allreduce_latency_ms, double attention_flops_per_pair,
                         double ms_per_attention_flop, double kv_bytes_per_token, double ms_per_byte,
                         double overhead_ms) {
                 return StepCost(StepCostConstants{linear_flops_per_token, lm_head_flops_per_request, ms_per_flop,
                                                   weight_ms, allreduces, ring_factor, allreduce_bytes_per_token,
                                                   link, allreduce_latency_ms, attention_flops_per_pair,
                                                   ms_per_attention_flop, kv_bytes_per_token, ms_per_byte,
                                                   overhead_ms});
             }),
             py::kw_only(), py::arg("linear_flops_per_token"), py::arg("lm_head_flops_per_request"),
             py::arg("ms_per_flop"), py::arg("weight_ms"), py::arg("allreduces"), py::arg("ring_factor"),
             py::arg("allreduce_bytes_per_token"), py::arg("link"), py::arg("allreduce_latency_ms"),
             py::arg("attention_flops_per_pair"), py::arg("ms_per_attention_flop"), py::arg("kv_bytes_per_token"),
             py::arg("ms_per_byte"), py::arg("overhead_ms"))
        .def("totals_ms", &StepCost::totals_ms, py::arg("tokens"), py::arg("requests"), py::arg("pairs"),
             py::arg("kv_tokens"));
}

}  // namespace kvlife
