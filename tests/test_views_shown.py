"""``kvlife check`` holds the views a policy is shown at an ask to the truth (13, ``Views``):
an admission's ``LoadView`` that misstates the device hit, or names as in flight a block
no load of the named request is bringing in, is a counterexample."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from kvlife.lifecycle.engine import connector
from kvlife.policies.base import LoadView
from kvlife.specs.model_check import run_check


@pytest.mark.parametrize("field, lie", [
    ("device_hit_blocks", lambda view: attrs.evolve(view, device_hit_blocks=view.device_hit_blocks + 1)),
    ("in flight", lambda view: attrs.evolve(view, in_flight=tuple((h, f"{rid}-other") for h, rid in view.in_flight))),
])
def test_a_load_view_that_misstates_what_it_shows_is_found(monkeypatch: pytest.MonkeyPatch, field: str,
                                                          lie: Any) -> None:
    monkeypatch.setattr(connector, "LoadView", lambda **fields: lie(LoadView(**fields)))
    result = run_check(["shared-loads"], examples=100, steps=50, shrink=False)
    assert result.violation is not None and result.violation.invariant == 13, result.report()
    assert result.violation.message.startswith("a policy was shown ")
    assert field in result.violation.message


def test_the_load_views_of_a_correct_engine_pass() -> None:
    assert run_check(["shared-loads"], examples=100, steps=50, shrink=False).ok
