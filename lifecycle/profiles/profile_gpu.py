"""Measure step times on a CUDA GPU with random weights of a model's shapes; write the CSV
that ``calibrate`` fits.

For each point ``(prefill_tokens, decode_requests, context_tokens)`` (the row convention of
``step_cost.composition_of_row``) it times one transformer layer as the serving engine runs it,
for one tensor-parallel rank's shard: RMSNorm, the fused QKV projection, attention (prefill
chunk: causal over cached + new keys; decodes: one query over its context; GQA), the output
projection, RMSNorm, the fused gate/up projection, SiLU x up, the down projection; then the
lm_head over one token per request. A step is ``layers x layer + lm_head``. All-reduces are not
measured (one GPU): fit such a file with ``calibrate(..., include_comm=False)``.

Weights and KV are random bf16 tensors; nothing is downloaded. torch is imported lazily, only
here. Without CUDA (or without torch) ``profile_gpu`` raises ``ProfileGpuError`` with the one
line ``profile-gpu needs a CUDA GPU (none found)``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvlife.lifecycle.profiles.catalog import Model
from kvlife.lifecycle.profiles.derived import check_tp, kv_heads_per_rank

NO_GPU = "profile-gpu needs a CUDA GPU (none found)"

Point = tuple[int, int, int]  # (prefill_tokens, decode_requests, context_tokens)

# The default grid: prefill chunks over growing cached context, decode batches over growing
# context, and a few mixed chunked-prefill + decode steps.
DEFAULT_POINTS: tuple[Point, ...] = (
    *((p, 0, c) for p in (256, 1024, 2048, 4096, 8192) for c in (0, 4096, 16384, 32768)),
    *((0, d, c) for d in (1, 4, 16, 32, 64, 128) for c in (512, 2048, 8192, 32768)),
    (2048, 32, 2048), (1024, 64, 4096), (512, 128, 1024),
)

# Skip points whose KV for one layer would exceed this many bytes (keeps small GPUs alive).
_MAX_LAYER_KV_BYTES = 8 << 30


class ProfileGpuError(RuntimeError):
    """profile-gpu cannot run here; ``str()`` is one line."""


def _cuda_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ProfileGpuError(NO_GPU) from None
    if not torch.cuda.is_available():
        raise ProfileGpuError(NO_GPU)
    return torch


def profile_gpu(
    model: Model,
    out: str | Path,
    tp: int = 1,
    points: Iterable[Point] = DEFAULT_POINTS,
    repeats: int = 5,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Time ``points`` on the current CUDA device and write ``prefill_tokens,decode_requests,
    context_tokens,step_ms`` rows to ``out``. Raises ``ProfileGpuError`` without a CUDA GPU."""
    torch = _cuda_torch()
    device = torch.device("cuda")

    def timer(fn: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end))

    name = torch.cuda.get_device_name(device)
    rows = measure(model, tp, list(points), device, timer, repeats, progress)
    return write_csv(out, rows, f"{model.name} tp={tp} on {name}")


def measure(
    model: Model,
    tp: int,
    points: Sequence[Point],
    device: Any,
    timer: Callable[[Callable[[], object]], float],
    repeats: int = 5,
    progress: Callable[[int, int], None] | None = None,
) -> list[tuple[int, int, int, float]]:
    """The timing loop, device-agnostic (``timer(fn)`` returns fn's time in ms): the CUDA path
    passes CUDA events; tests run it on CPU with a tiny model and a wall clock."""
    import torch  # only reached with torch installed

    check_tp(model, tp)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
        model.dtype, torch.bfloat16
    )
    hidden, head_dim = model.hidden_size, model.head_dim
    q_heads = model.num_attention_heads // tp
    kv_heads = kv_heads_per_rank(model, tp)
    inter = model.intermediate_size // tp
    vocab = -(-model.vocab_size // tp)
    gen = torch.Generator(device=device).manual_seed(0)

    def weights(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * 0.02

    w_qkv = weights(hidden, (q_heads + 2 * kv_heads) * head_dim)
    w_o = weights(q_heads * head_dim, hidden)
    w_gate_up = weights(hidden, 2 * inter)
    w_down = weights(inter, hidden)
    w_head = weights(hidden, vocab)
    norm_weight = torch.ones(hidden, device=device, dtype=dtype)
    shapes = _Shard(torch, dtype, hidden, head_dim, q_heads, kv_heads, inter, weights,
                    w_qkv, w_o, w_gate_up, w_down, w_head, norm_weight)
    rows: list[tuple[int, int, int, float]] = []
    todo = [p for p in points if _layer_kv_bytes(p, kv_heads, head_dim, dtype.itemsize) <= _MAX_LAYER_KV_BYTES]
    for index, (prefill, decodes, context) in enumerate(todo):
        layer, head = shapes.step(prefill, decodes, context, device)
        with torch.inference_mode():
            for _ in range(2):  # warm-up
                layer()
                head()
            layer_ms = statistics.median(timer(layer) for _ in range(repeats))
            head_ms = statistics.median(timer(head) for _ in range(repeats))
        rows.append((prefill, decodes, context, model.num_layers * layer_ms + head_ms))
        if progress is not None:
            progress(index + 1, len(todo))
    return rows


class _Shard:
    """One rank's random weights; ``step`` builds the layer and lm_head calls of one point."""

    def __init__(self, torch: Any, dtype: Any, hidden: int, head_dim: int, q_heads: int, kv_heads: int,
                 inter: int, weights: Callable[..., Any], w_qkv: Any, w_o: Any, w_gate_up: Any,
                 w_down: Any, w_head: Any, norm_weight: Any) -> None:
        self.torch, self.dtype = torch, dtype
        self.hidden, self.head_dim, self.q_heads, self.kv_heads, self.inter = hidden, head_dim, q_heads, kv_heads, inter
        self.weights = weights
        self.w_qkv, self.w_o, self.w_gate_up, self.w_down, self.w_head = w_qkv, w_o, w_gate_up, w_down, w_head
        self.norm_weight = norm_weight

    def rms_norm(self, x: Any) -> Any:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * self.torch.rsqrt(variance + 1e-6)).to(self.dtype) * self.norm_weight

    def step(
        self, prefill: int, decodes: int, context: int, device: Any
    ) -> tuple[Callable[[], Any], Callable[[], Any]]:
        torch, weights = self.torch, self.weights
        sdpa = torch.nn.functional.scaled_dot_product_attention
        q_heads, kv_heads, head_dim, inter = self.q_heads, self.kv_heads, self.head_dim, self.inter
        x = weights(prefill + decodes, self.hidden)
        # One layer's KV: the prefill's cached + new keys, each decode's context + its new key.
        kp = weights(1, kv_heads, context + prefill, head_dim) if prefill else None
        vp = weights(1, kv_heads, context + prefill, head_dim) if prefill else None
        kd = weights(decodes, kv_heads, context + 1, head_dim) if decodes else None
        vd = weights(decodes, kv_heads, context + 1, head_dim) if decodes else None
        mask = _prefix_causal_mask(torch, prefill, context, device) if prefill and context else None
        sampled = (1 if prefill else 0) + decodes

        def layer() -> Any:
            h = self.rms_norm(x)
            q = (h @ self.w_qkv)[:, : q_heads * head_dim]  # k, v of new tokens: computed, then cached
            outs = []
            if prefill:
                qp = q[:prefill].view(prefill, q_heads, head_dim).transpose(0, 1).unsqueeze(0)
                if mask is None:
                    o = sdpa(qp, kp, vp, is_causal=True, enable_gqa=True)
                else:
                    o = sdpa(qp, kp, vp, attn_mask=mask, enable_gqa=True)
                outs.append(o.squeeze(0).transpose(0, 1).reshape(prefill, q_heads * head_dim))
            if decodes:
                qd = q[prefill:].view(decodes, q_heads, 1, head_dim)
                outs.append(sdpa(qd, kd, vd, enable_gqa=True).reshape(decodes, q_heads * head_dim))
            attn = torch.cat(outs) if len(outs) > 1 else outs[0]
            y = x + attn @ self.w_o
            gate_up = self.rms_norm(y) @ self.w_gate_up
            act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            return y + act @ self.w_down

        def head() -> Any:
            return self.rms_norm(x[:sampled]) @ self.w_head

        return layer, head


def _layer_kv_bytes(point: Point, kv_heads: int, head_dim: int, itemsize: int) -> int:
    prefill, decodes, context = point
    keys = (context + prefill if prefill else 0) + decodes * (context + 1)
    return 2 * keys * kv_heads * head_dim * itemsize


def _prefix_causal_mask(torch: Any, new: int, cached: int, device: Any) -> Any:
    """Boolean mask [new, cached + new]: query i sees keys up to cached + i (bottom-right causal)."""
    rows = torch.arange(new, device=device).unsqueeze(1)
    cols = torch.arange(cached + new, device=device).unsqueeze(0)
    return cols <= rows + cached


def write_csv(out: str | Path, rows: Iterable[tuple[int, int, int, float]], note: str) -> Path:
    path = Path(out)
    lines = [f"# kvlife profile-gpu: {note}, {time.strftime('%Y-%m-%d')}",
             "prefill_tokens,decode_requests,context_tokens,step_ms"]
    lines += [f"{p},{d},{c},{ms:.4f}" for p, d, c, ms in rows]
    from kvlife.lifecycle.output_files import write_output

    write_output(path, ("\n".join(lines) + "\n").encode())
    return path
