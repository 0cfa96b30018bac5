"""``--engine python|native``: which engine a simulated run uses, and the header line and
notice that say why not native (``kvlife.lifecycle.native.choice``)."""

from __future__ import annotations

import types

import attrs
import pytest

from kvlife.lifecycle import native
from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.native import choice


def _engine_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("engine ")]
    assert len(lines) == 1, out
    return lines[0].split(None, 1)[1]


def test_without_a_built_core_the_run_says_so_in_one_header_line(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(native, "why_not", lambda: "its build failed at install: CompileError: no g++")
    assert main(["run", "--limit", "5"]) == 0
    captured = capsys.readouterr()
    assert _engine_line(captured.out) == "python (native core not built: its build failed at install: " \
                                         "CompileError: no g++)"
    assert captured.err == ""  # the default engine falls back without a notice


def test_asking_for_native_where_it_cannot_run_gives_one_notice_and_runs_python(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(native, "why_not", lambda: "no compiler")
    assert main(["run", "--limit", "5", "--engine", "native"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "kvlife run: --engine native: running on the python engine: native core not built: no compiler"]
    assert _engine_line(captured.out).startswith("python (native core not built")


def test_the_json_output_names_the_engine_and_why(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import json

    monkeypatch.setattr(native, "why_not", lambda: "no compiler")
    assert main(["run", "--limit", "5", "--engine", "python", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["engine"] == {"engine": "python", "requested": "python",
                                  "why_not_native": "native core not built: no compiler"}


def test_what_the_native_engine_does_not_cover_stays_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a core that has the entry point, the default is native, except where the run
    needs what only the Python engine has (the adversary, the online observer)."""
    monkeypatch.setattr(native, "why_not", lambda: None)
    monkeypatch.setattr(native, "load", lambda: types.SimpleNamespace(**{choice.ENTRY_POINT: object()}))
    config = RunConfig()
    assert choice.choose(None, config) == choice.EngineChoice("native", None, None)
    assert choice.choose(None, config).header() == "native"
    assert choice.choose("python", config).header() == "python (--engine python)"
    chaos = attrs.evolve(config, sim=attrs.evolve(config.sim, chaos=3))
    picked = choice.choose("native", chaos)
    assert picked.engine == "python" and "--chaos" in (picked.why_not_native or "")
    assert picked.notice() is not None
    checked = attrs.evolve(config, sim=attrs.evolve(config.sim, check=True))
    assert "--check" in (choice.choose(None, checked).why_not_native or "")
    # Without the entry point the core is not complete: python, whatever was asked.
    monkeypatch.setattr(native, "load", lambda: types.SimpleNamespace())
    assert choice.choose("native", config).engine == "python"
    with pytest.raises(ValueError, match="engine must be one of python, native"):
        choice.choose("rust", config)


def test_engine_is_a_simulated_run_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--live", "--engine", "python"]) == 2
    assert "--engine applies to simulated runs" in capsys.readouterr().err
