"""The native step cost against the reference (``StepCostModel.totals_ms``): the same doubles,
bit for bit, on every catalog model, hardware and TP degree, for any step's totals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.profiles.catalog import list_profiles, load_hardware, load_model
from kvlife.lifecycle.profiles.step_cost import StepCostModel

pytest.importorskip("kvlife.lifecycle.native._core")
from kvlife.lifecycle.native.bridge import step_cost  # noqa: E402


def _models() -> list[StepCostModel]:
    profiles = list_profiles()
    out = []
    for hw in profiles["hardware"]:
        for m in profiles["models"]:
            for tp in (1, 2, 4, 8):
                try:
                    out.append(StepCostModel(load_model(m), load_hardware(hw), tp))
                except ValueError:
                    continue  # a TP degree the model's heads do not divide
    return out


MODELS = _models()


@settings(max_examples=300, deadline=None)
@given(
    which=st.integers(0, len(MODELS) - 1),
    chunks=st.lists(st.tuples(st.integers(0, 70_000), st.integers(0, 200_000)), max_size=40),
)
def test_a_step_costs_the_same_bits_natively(which: int, chunks: list[tuple[int, int]]) -> None:
    model = MODELS[which]
    native = step_cost(model)
    tokens = requests = cached = twice_pairs = 0
    for n, b in chunks:  # as the simulator sums a plan: n new tokens on top of b cached
        tokens += n
        requests += 1
        cached += b
        twice_pairs += n * (b + b + n + 1)
    want = model.totals_ms(tokens, requests, twice_pairs * 0.5, cached + tokens)
    got = native.totals_ms(tokens, requests, twice_pairs * 0.5, cached + tokens)
    assert got.hex() == want.hex()


def test_the_catalog_gives_models_with_and_without_tensor_parallelism() -> None:
    # The differential above covers the all-reduce term only if some model has one.
    assert any(m._allreduces for m in MODELS) and any(not m._allreduces for m in MODELS)
