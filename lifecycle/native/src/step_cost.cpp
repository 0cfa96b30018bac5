#include "step_cost.hpp"

#include <algorithm>

namespace kvlife {

double StepCost::totals_ms(long long tokens, long long requests, double pairs, long long kv_tokens) const {
    if (tokens == 0) {
        return 0.0;
    }
    // linear: compute, or the weights read, whichever bounds (Python's max keeps the first on a tie).
    double linear = std::max(
        (c_.linear_flops_per_token * static_cast<double>(tokens) +
         c_.lm_head_flops_per_request * static_cast<double>(requests)) *
            c_.ms_per_flop,
        c_.weight_ms);
    double comm = 0.0;
    if (c_.allreduces != 0.0) {
        comm = c_.allreduces * (c_.ring_factor * static_cast<double>(tokens) * c_.allreduce_bytes_per_token /
                                    c_.link * 1000.0 +
                                c_.allreduce_latency_ms);
    }
    double attention = std::max(c_.attention_flops_per_pair * pairs * c_.ms_per_attention_flop,
                                c_.kv_bytes_per_token * static_cast<double>(kv_tokens) * c_.ms_per_byte);
    return linear + attention + comm + c_.overhead_ms;
}

}  // namespace kvlife
