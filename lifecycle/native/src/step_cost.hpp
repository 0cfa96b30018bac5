// The step cost's arithmetic: a mirror of StepCostModel.totals_ms (lifecycle/profiles/step_cost.py).
// The constants are derived once in Python (StepCostModel.__init__) and handed over as they are,
// so both engines price a step from the very same doubles, in the same order of operations.
#pragma once

namespace kvlife {

struct StepCostConstants {
    double linear_flops_per_token;
    double lm_head_flops_per_request;
    double ms_per_flop;
    double weight_ms;
    double allreduces;  // 0 without tensor parallelism
    double ring_factor;
    double allreduce_bytes_per_token;
    double link;
    double allreduce_latency_ms;
    double attention_flops_per_pair;
    double ms_per_attention_flop;
    double kv_bytes_per_token;
    double ms_per_byte;
    double overhead_ms;
};

class StepCost {
  public:
    explicit StepCost(const StepCostConstants& c) : c_(c) {}

    // totals_ms(tokens, requests, pairs, kv_tokens): 0 for an empty step.
    double totals_ms(long long tokens, long long requests, double pairs, long long kv_tokens) const;

    const StepCostConstants& constants() const { return c_; }

  private:
    StepCostConstants c_;
};

}  // namespace kvlife
