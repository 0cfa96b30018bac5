"""Quantities derived from a model (and hardware) profile: KV bytes, weights, device capacity.

Tensor parallelism follows vLLM's sharding (``QKVParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``, ``ParallelLMHead``):

- query heads, the MLP and the vocabulary are split evenly across the ``tp`` ranks;
- KV heads are split when ``tp <= num_kv_heads`` (``num_kv_heads % tp == 0`` required); when
  ``tp > num_kv_heads`` each rank holds ONE KV head and every KV head is replicated on
  ``tp / num_kv_heads`` ranks (``tp % num_kv_heads == 0`` required). That is what vLLM does
  (``num_kv_head_replicas``): KV bytes per rank then stop shrinking as ``tp`` grows.
- ``num_attention_heads % tp == 0`` is required, as vLLM's config check requires.

Every size here is per rank: a block's KV on one rank, the weights one rank holds.
"""

from __future__ import annotations

import attrs

from kvlife.lifecycle.profiles.catalog import Hardware, Model, ProfileError

GIB = 1 << 30

# vLLM's defaults for `gpu_memory_utilization` (EngineArgs / CacheConfig: 0.9) and, on
# H100-class GPUs with `vllm serve`, `max_num_batched_tokens` 8192 and `max_num_seqs` 1024
# (vllm/engine/arg_utils.py, usage-context defaults). The activation reserve depends on both.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 1024

# Non-torch memory vLLM measures during profiling (CUDA context growth, cuBLAS workspaces;
# NCCL and custom all-reduce buffers when tp > 1): 0.13 GiB on one H100 and 0.55 GiB per rank
# at TP=2 (https://github.com/llm-d/llm-d-benchmark, config_explorer/empirical-vllm-memory-results.md).
NON_TORCH_BYTES_TP1 = int(0.13 * GIB)
NON_TORCH_BYTES_TP = int(0.55 * GIB)

# Float32 copies of the logits the sampler's dummy run holds at its peak (logits, scaled logits,
# softmax, sort values/indices for top-k/top-p...): fitted, see ``activation_reserve_bytes``.
SAMPLER_LOGIT_COPIES = 8


def check_tp(model: Model, tp: int) -> None:
    """Refuse a tensor-parallel degree vLLM would refuse for this model."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ProfileError("tp", f"must be a positive integer, got {tp!r}")
    if model.num_attention_heads % tp:
        raise ProfileError(
            "tp", f"{tp} does not divide {model.name}'s {model.num_attention_heads} attention heads"
        )
    kv = model.num_kv_heads
    if tp <= kv and kv % tp:
        raise ProfileError("tp", f"{tp} does not divide {model.name}'s {kv} KV heads")
    if tp > kv and tp % kv:
        raise ProfileError(
            "tp", f"{tp} ranks cannot replicate {model.name}'s {kv} KV heads evenly (tp must be a multiple of {kv})"
        )


def kv_heads_per_rank(model: Model, tp: int = 1) -> int:
    """KV heads one rank holds: ``num_kv_heads / tp``, or 1 (replicated) when ``tp > num_kv_heads``."""
    check_tp(model, tp)
    return max(1, model.num_kv_heads // tp)


def kv_replicas(model: Model, tp: int = 1) -> int:
    """How many ranks hold a copy of each KV head (1 unless ``tp > num_kv_heads``)."""
    check_tp(model, tp)
    return max(1, tp // model.num_kv_heads)


def kv_bytes_per_token(model: Model, tp: int = 1) -> int:
    """KV bytes one token takes on one rank: K and V x layers x KV heads per rank x head dim x dtype."""
    return 2 * model.num_layers * kv_heads_per_rank(model, tp) * model.head_dim * model.dtype_bytes


def kv_bytes_per_block(model: Model, block_tokens: int, tp: int = 1) -> int:
    """KV bytes of one block of ``block_tokens`` tokens on one rank (what one rank moves per block)."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ProfileError("block_tokens", f"must be a positive integer, got {block_tokens!r}")
    return block_tokens * kv_bytes_per_token(model, tp)


def _attention_params_per_layer(model: Model, kv_heads: int, q_heads: int) -> int:
    """q, k, v, o projection weights (and q/k/v biases) for ``q_heads`` / ``kv_heads`` heads."""
    h, d = model.hidden_size, model.head_dim
    params = h * q_heads * d + 2 * h * kv_heads * d + q_heads * d * h
    if model.attention_bias:
        params += q_heads * d + 2 * kv_heads * d
    return params


def matmul_params_per_layer(model: Model, tp: int = 1) -> int:
    """Weights of one layer's matmuls held by one rank: attention projections + SwiGLU MLP."""
    check_tp(model, tp)
    q_heads = model.num_attention_heads // tp
    attention = _attention_params_per_layer(model, kv_heads_per_rank(model, tp), q_heads)
    mlp = 3 * model.hidden_size * (model.intermediate_size // tp)
    return attention + mlp


def lm_head_params(model: Model, tp: int = 1) -> int:
    """Output projection weights on one rank (vocabulary split across ranks)."""
    check_tp(model, tp)
    return model.hidden_size * -(-model.vocab_size // tp)


def param_count(model: Model) -> int:
    """All parameters: embedding, layers (matmuls, two RMSNorms each), final norm, lm_head
    unless tied. Llama-3-8B: 8,030,261,248."""
    layer = matmul_params_per_layer(model, 1) + 2 * model.hidden_size
    embedding = model.vocab_size * model.hidden_size
    head = 0 if model.tie_word_embeddings else embedding
    return embedding + model.num_layers * layer + model.hidden_size + head


def weight_bytes_per_rank(model: Model, tp: int = 1) -> int:
    """Weight bytes one rank holds: its matmul shards, its vocabulary slices of the embedding and
    lm_head (one table when tied), replicated norms. (vLLM pads each rank's vocabulary slice to a
    multiple of 64: ignored, < 0.01 %.)"""
    check_tp(model, tp)
    vocab_slice = model.hidden_size * -(-model.vocab_size // tp)
    tables = vocab_slice if model.tie_word_embeddings else 2 * vocab_slice
    norms = (2 * model.num_layers + 1) * model.hidden_size
    params = model.num_layers * matmul_params_per_layer(model, tp) + tables + norms
    return params * model.dtype_bytes


def activation_reserve_bytes(
    model: Model,
    tp: int = 1,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> int:
    """Device memory vLLM keeps out of the KV cache besides the weights: an estimate of what its
    profiling run measures.

    vLLM sizes the KV cache by profiling (``Worker.determine_available_memory``): it runs one
    dummy forward pass of ``max_num_batched_tokens`` tokens plus a dummy sampler pass over
    ``max_num_seqs`` sequences, records torch's peak allocation and the non-torch memory growth,
    and gives the KV cache ``total x gpu_memory_utilization - weights - peak activations -
    non-torch memory``. We estimate the same three terms:

    - forward peak: the tokens' largest live activations, the MLP's gate/up output
      (2 x intermediate / tp) and its activation (intermediate / tp) plus ~4 hidden-sized
      buffers (residual, normed input, attention output, qkv), in the model dtype;
    - sampler peak: ``SAMPLER_LOGIT_COPIES`` float32 copies of a ``max_num_seqs x vocab`` logits
      tensor (all ranks hold the gathered full-vocabulary logits);
    - non-torch memory: 0.13 GiB at TP=1, 0.55 GiB per rank at TP>1 (measured, see constants).

    Fitted on vLLM's log for Llama-3.1-8B on one H100 (llm-d-benchmark, file above): peak
    activations 4.76 GiB + non-torch 0.13 GiB leave 51.38 GiB of KV. The forward term is
    0.91 GiB, so the sampler holds 3.85 GiB = 7.9 logits copies -> 8. Checked against the same
    file: Llama-3.3-70B TP=2 measured 4.84 GiB of activations (this estimate: 5.07 GiB, +5 %);
    Qwen3-0.6B measured 5.56 GiB (estimate 4.84 GiB, -13 %).
    """
    check_tp(model, tp)
    per_token = 3 * (model.intermediate_size // tp) + 4 * model.hidden_size
    forward = max_num_batched_tokens * per_token * model.dtype_bytes
    sampler = SAMPLER_LOGIT_COPIES * max_num_seqs * model.vocab_size * 4
    non_torch = NON_TORCH_BYTES_TP1 if tp == 1 else NON_TORCH_BYTES_TP
    return forward + sampler + non_torch


@attrs.frozen
class DeviceCapacity:
    """How many KV blocks fit on each rank, and why (every figure in bytes, per rank)."""

    blocks: int
    block_bytes: int
    hbm_bytes: int
    requested_bytes: int  # hbm x gpu_memory_utilization
    weight_bytes: int
    reserve_bytes: int  # activation reserve, see activation_reserve_bytes
    kv_bytes: int  # requested - weights - reserve

    def summary(self) -> str:
        return (
            f"{self.blocks} blocks of {self.block_bytes / (1 << 20):.1f} MiB: "
            f"{self.requested_bytes / GIB:.2f} GiB usable - {self.weight_bytes / GIB:.2f} GiB weights "
            f"- {self.reserve_bytes / GIB:.2f} GiB activations = {self.kv_bytes / GIB:.2f} GiB KV per rank"
        )


def device_capacity(
    model: Model,
    hardware: Hardware,
    block_tokens: int,
    tp: int = 1,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> DeviceCapacity:
    """Device KV blocks per rank, derived like vLLM: (HBM x gpu_memory_utilization - weights per
    rank - activation reserve) / KV bytes per block per rank, rounded down.

    Llama-3-8B on one H100 SXM with 512-token blocks: 64 MiB blocks, 821 blocks (vLLM's own log
    for Llama-3.1-8B reports 51.38 GiB of KV = 822 such blocks). A model that does not fit is a
    ``ProfileError``.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ProfileError("gpu_memory_utilization", f"must be in (0, 1], got {gpu_memory_utilization!r}")
    block_bytes = kv_bytes_per_block(model, block_tokens, tp)
    requested = int(hardware.hbm_bytes * gpu_memory_utilization)
    weights = weight_bytes_per_rank(model, tp)
    reserve = activation_reserve_bytes(model, tp, max_num_batched_tokens, max_num_seqs)
    kv = requested - weights - reserve
    blocks = kv // block_bytes if kv > 0 else 0
    if blocks < 1:
        raise ProfileError(
            "tp",
            f"{model.name} does not fit on {hardware.name} at tp={tp}: {requested / GIB:.1f} GiB usable, "
            f"{weights / GIB:.1f} GiB weights + {reserve / GIB:.1f} GiB activations per rank "
            f"leave no room for one {block_bytes / (1 << 20):.0f} MiB block",
        )
    return DeviceCapacity(blocks, block_bytes, hardware.hbm_bytes, requested, weights, reserve, kv)
