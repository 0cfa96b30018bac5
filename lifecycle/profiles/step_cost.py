"""The time of one engine step, from first principles: FLOPs and bytes of the step's batch at
calibrated efficiencies.

A step runs, on each of ``tp`` ranks, every layer over the batch's new tokens: prefill chunks
(``new`` tokens on top of ``cached`` tokens already in the KV cache) and decodes (one new token
on top of ``context`` tokens). Per rank:

- linear FLOPs ``F_lin = 2 x P_rank x T``: ``P_rank`` the rank's matmul weights over all layers,
  ``T`` the step's new tokens; plus the lm_head, ``2 x hidden x vocab / tp`` per request (vLLM
  V1 computes logits at every scheduled request's last token, discarding partial prefills');
- attention FLOPs ``F_att = 4 x (heads / tp) x head_dim x layers x pairs`` (QK^T and AV), where a
  prefill chunk has ``pairs = new x cached + new (new + 1) / 2`` (causal) and a decode
  ``pairs = context + 1``. So a 100k-token prompt costs ~100x a 1k prompt's linear work but
  ~10,000x its attention;
- weight bytes ``B_w``: the rank's weights, read once per step (the embedding table only by the
  rows it gathers: not counted);
- KV bytes ``B_kv``: the cached context each sequence's attention reads plus the new tokens' KV
  written, at ``kv_bytes_per_token(model, tp)``.

Time (a roofline per phase, phases run one after the other)::

    t = max(F_lin / (peak x mfu), B_w / (bw x mbu))          # linear layers: GEMMs stream weights
      + max(F_att / (peak x attention), B_kv / (bw x mbu))   # attention: FLOPs or KV reads
      + tp_comm + overhead_ms

A pure decode step is thus ``(B_w + B_kv) / (bw x mbu)``: memory-bound, growing with the batch's
KV; a long prefill is FLOP-bound; a mixed chunked-prefill + decode step pays the larger term of
each phase. (A whole-step roofline, one ``max`` over all FLOPs and all bytes, would let a
prefill's GEMMs hide the decodes' KV reads, which run in a different kernel.) With ``tp > 1``
each layer adds two all-reduces (after attention and after the MLP) of ``T x hidden x dtype``
bytes, costed as a ring: ``2 (tp-1)/tp x bytes / interconnect + allreduce_latency``.

First-order effects left out: kernel launch gaps inside a step (in ``overhead_ms``), tile and
wave quantization of small GEMMs (in ``mfu``), elementwise ops, the embedding all-reduce and
logits gather, speculative decoding, sliding-window attention, FP8/quantized kernels, and
overlap of communication with compute.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from kvlife.lifecycle.profiles.catalog import Efficiency, Hardware, Model, ProfileError
from kvlife.lifecycle.profiles.derived import (
    check_tp,
    kv_bytes_per_token,
    lm_head_params,
    matmul_params_per_layer,
    weight_bytes_per_rank,
)


@attrs.frozen
class StepCost:
    """One step's cost, with its parts (per rank; FLOPs, bytes, milliseconds)."""

    linear_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float
    linear_ms: float  # max(linear compute, weight reads)
    attention_ms: float  # max(attention compute, KV reads)
    comm_ms: float
    overhead_ms: float
    total_ms: float
    linear_bound: str  # "compute" or "memory"
    attention_bound: str


@attrs.frozen
class StepFeatures:
    """The efficiency-free quantities of a step (what ``calibrate`` regresses on)."""

    linear_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float
    comm_ms: float


class StepCostModel:
    """Step times for one (model, hardware, tp) pair. Built once; ``step_ms`` is pure arithmetic,
    O(requests in the step), deterministic.

    ``step_ms(prefills, decode_contexts)`` prices a step:
    ``prefills`` holds ``(new_tokens, cached_tokens)`` per prefill chunk (``cached_tokens`` =
    tokens of that request already in the KV cache before this step: prefix hits and earlier
    chunks), ``decode_contexts`` the context length of each decoding request before this step.
    """

    def __init__(
        self, model: Model, hardware: Hardware, tp: int = 1, efficiency: Efficiency | None = None
    ) -> None:
        check_tp(model, tp)
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.efficiency = efficiency if efficiency is not None else hardware.efficiency
        layers = model.num_layers
        self._linear_flops_per_token = 2.0 * matmul_params_per_layer(model, tp) * layers
        self._lm_head_flops_per_request = 2.0 * lm_head_params(model, tp)
        # 2 (QK^T) + 2 (AV) FLOPs per query-key pair per head dimension.
        self._attention_flops_per_pair = 4.0 * (model.num_attention_heads // tp) * model.head_dim * layers
        # Weights read per step: everything but the embedding table (gathered by rows).
        embedding = model.hidden_size * -(-model.vocab_size // tp) * model.dtype_bytes
        tables_read = weight_bytes_per_rank(model, tp)
        self._weight_bytes = float(tables_read if model.tie_word_embeddings else tables_read - embedding)
        self._kv_bytes_per_token = float(kv_bytes_per_token(model, tp))
        self._peak = hardware.peak_bf16_flops
        self._bandwidth = hardware.hbm_bandwidth_gb_s * 1e9
        # All-reduce per layer: 2 per layer, ring over tp ranks.
        self._allreduces = 2 * layers if tp > 1 else 0
        self._allreduce_bytes_per_token = float(model.hidden_size * model.dtype_bytes)
        self._ring_factor = 2.0 * (tp - 1) / tp
        self._link = hardware.interconnect_gb_s * 1e9
        self._allreduce_latency_ms = hardware.allreduce_latency_us / 1000.0
        # Per-unit costs, worked out once: what step_ms and totals_ms multiply by.
        eff = self.efficiency
        self._ms_per_flop = 1000.0 / (self._peak * eff.mfu)
        self._ms_per_attention_flop = 1000.0 / (self._peak * eff.attention)
        self._ms_per_byte = 1000.0 / (self._bandwidth * eff.mbu)
        self._weight_ms = self._weight_bytes * self._ms_per_byte
        self._overhead_ms = eff.overhead_ms

    # --- the quantities ----------------------------------------------------------------------

    def features(self, prefills: Iterable[tuple[int, int]] = (), decode_contexts: Iterable[int] = ()) -> StepFeatures:
        """FLOPs, bytes and communication time of a step, before efficiencies."""
        tokens = 0
        requests = 0
        pairs = 0.0
        kv_tokens = 0  # tokens whose KV is read (cached context) or written (new)
        for new, cached in prefills:
            if new < 0 or cached < 0:
                raise ProfileError("prefills", f"token counts must be non-negative, got ({new}, {cached})")
            if new == 0:
                continue
            tokens += new
            requests += 1
            pairs += new * cached + new * (new + 1) / 2.0
            kv_tokens += cached + new
        for context in decode_contexts:
            if context < 0:
                raise ProfileError("decode_contexts", f"context must be non-negative, got {context}")
            tokens += 1
            requests += 1
            pairs += context + 1
            kv_tokens += context + 1
        if tokens == 0:
            return StepFeatures(0.0, 0.0, 0.0, 0.0, 0.0)
        comm = 0.0
        if self._allreduces:
            message = tokens * self._allreduce_bytes_per_token
            per = self._ring_factor * message / self._link * 1000.0 + self._allreduce_latency_ms
            comm = self._allreduces * per
        return StepFeatures(
            linear_flops=self._linear_flops_per_token * tokens + self._lm_head_flops_per_request * requests,
            attention_flops=self._attention_flops_per_pair * pairs,
            weight_bytes=self._weight_bytes,
            kv_bytes=self._kv_bytes_per_token * kv_tokens,
            comm_ms=comm,
        )

    def cost(self, prefills: Iterable[tuple[int, int]] = (), decode_contexts: Iterable[int] = ()) -> StepCost:
        """The step's time and its parts. An empty step costs nothing (not even the overhead)."""
        f = self.features(prefills, decode_contexts)
        return self.cost_of(f)

    def cost_of(self, f: StepFeatures, efficiency: Efficiency | None = None) -> StepCost:
        eff = efficiency if efficiency is not None else self.efficiency
        if f.linear_flops == 0 and f.attention_flops == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "compute", "compute")
        linear_compute = f.linear_flops / (self._peak * eff.mfu) * 1000.0
        weight_reads = f.weight_bytes / (self._bandwidth * eff.mbu) * 1000.0
        attention_compute = f.attention_flops / (self._peak * eff.attention) * 1000.0
        kv_reads = f.kv_bytes / (self._bandwidth * eff.mbu) * 1000.0
        linear = max(linear_compute, weight_reads)
        attention = max(attention_compute, kv_reads)
        total = linear + attention + f.comm_ms + eff.overhead_ms
        return StepCost(
            linear_flops=f.linear_flops,
            attention_flops=f.attention_flops,
            weight_bytes=f.weight_bytes,
            kv_bytes=f.kv_bytes,
            linear_ms=linear,
            attention_ms=attention,
            comm_ms=f.comm_ms,
            overhead_ms=eff.overhead_ms,
            total_ms=total,
            linear_bound="compute" if linear_compute >= weight_reads else "memory",
            attention_bound="compute" if attention_compute >= kv_reads else "memory",
        )

    def step_ms(self, prefills: Iterable[tuple[int, int]] = (), decode_contexts: Sequence[int] = ()) -> float:
        """The step's time in milliseconds (see the module docstring for the formula): the same
        result as ``cost(...).total_ms``, without building the parts (``totals_ms`` does the
        arithmetic; the simulator calls it directly)."""
        tokens = 0
        requests = 0
        pairs = 0.0
        kv_tokens = 0
        for new, cached in prefills:
            if new <= 0 or cached < 0:
                if new == 0 and cached >= 0:
                    continue
                raise ProfileError("prefills", f"token counts must be non-negative, got ({new}, {cached})")
            tokens += new
            pairs += new * cached + new * (new + 1) / 2.0
            kv_tokens += cached + new
            requests += 1
        if decode_contexts:
            count = len(decode_contexts)
            context = sum(decode_contexts)
            if min(decode_contexts) < 0:
                raise ProfileError("decode_contexts", f"context must be non-negative, got {min(decode_contexts)}")
            tokens += count
            requests += count
            pairs += context + count
            kv_tokens += context + count
        return self.totals_ms(tokens, requests, pairs, kv_tokens)

    def totals_ms(self, tokens: int, requests: int, pairs: float, kv_tokens: int) -> float:
        """The step's time from its totals: ``tokens`` new tokens over ``requests`` requests,
        ``pairs`` attention query-key pairs (``new x cached + new (new + 1) / 2`` per chunk, a
        decode being a chunk of one) and ``kv_tokens`` tokens whose KV is read or written
        (``cached + new`` per chunk). ``step_ms`` sums its arguments into these; the simulator
        sums a step plan itself and calls this, allocating nothing."""
        if tokens == 0:
            return 0.0
        linear = max(
            (self._linear_flops_per_token * tokens + self._lm_head_flops_per_request * requests) * self._ms_per_flop,
            self._weight_ms,
        )
        comm = 0.0
        if self._allreduces:
            comm = self._allreduces * (
                self._ring_factor * tokens * self._allreduce_bytes_per_token / self._link * 1000.0
                + self._allreduce_latency_ms
            )
        attention = max(
            self._attention_flops_per_pair * pairs * self._ms_per_attention_flop,
            self._kv_bytes_per_token * kv_tokens * self._ms_per_byte,
        )
        return linear + attention + comm + self._overhead_ms

    # --- conveniences ------------------------------------------------------------------------

    def prefill_ms(self, prompt_tokens: int, chunk_tokens: int | None = None, cached_tokens: int = 0) -> float:
        """Time to prefill a prompt alone, in chunks of ``chunk_tokens`` (None: one step),
        starting after ``cached_tokens`` prefix-cache hits."""
        if prompt_tokens <= cached_tokens:
            return 0.0
        chunk = chunk_tokens or prompt_tokens - cached_tokens
        total = 0.0
        done = cached_tokens
        while done < prompt_tokens:
            new = min(chunk, prompt_tokens - done)
            total += self.step_ms([(new, done)])
            done += new
        return total

    def decode_ms(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` requests each with ``context`` tokens of context."""
        return self.step_ms((), [context] * batch)


def composition_of_row(prefill_tokens: int, decode_requests: int, context_tokens: int) -> tuple[
    Sequence[tuple[int, int]], Sequence[int]
]:
    """The step a timing row describes (the CSV convention of ``calibrate`` and ``profile_gpu``):
    one prefill chunk of ``prefill_tokens`` new tokens on top of ``context_tokens`` cached tokens
    (none when ``prefill_tokens`` is 0), plus ``decode_requests`` decodes each with
    ``context_tokens`` tokens of context."""
    prefills = [(prefill_tokens, context_tokens)] if prefill_tokens > 0 else []
    return prefills, [context_tokens] * decode_requests
