"""pytest plugin for the vLLM peer suite: ``-p vllm_peer.plugin`` (``scripts/`` on ``sys.path``).

Loaded into a run of vLLM's own tests (the sdist's ``tests/``), it

- makes ``facebook/opt-125m``, the model vLLM's scheduler and connector tests configure,
  resolvable offline: its ``config.json`` in a private Hugging Face cache (no weights, no
  tokenizer; nothing is downloaded);
- with ``--peer-mode record`` builds every connector that vLLM's ``KVConnectorFactory``
  creates inside kvlife's ``RecordingConnector`` (``RecordingConnectorHMA`` when the inner
  class supports HMA), its ``record.inner`` the connector the test configured, its trace in
  ``--peer-traces``;
- with ``--peer-mode kvlife`` builds ``KVLifeConnector`` (``kvlife.vllm``, default extra
  config, ``"clock": "steps"``) wherever the factory would have built the configured one;
- with ``--peer-mode baseline`` changes no connector;
- writes each test's outcome (``passed``, ``failed``, ``skipped``, ``error``, ``xfailed``,
  ``xpassed``) and the connector classes the factory built during it to ``--peer-outcomes``
  (JSON).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The model vLLM's scheduler and connector tests configure. Its config.json is the shape kvlife's
# vLLM harness writes (harness.OPT_CONFIG); no weights are needed: the tests build schedulers
# and connectors, never the model.
MODEL = "facebook/opt-125m"
MODES = ("baseline", "record", "kvlife")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-peer", "kvlife's vLLM peer suite")
    group.addoption("--peer-mode", choices=MODES, default="baseline",
                    help="baseline: vLLM's connectors as configured; record: each wrapped in RecordingConnector; "
                         "kvlife: KVLifeConnector in place of each")
    group.addoption("--peer-outcomes", default=None, help="write each test's outcome here (JSON)")
    group.addoption("--peer-traces", default=None, help="record mode: write the traces in this folder")


def offline_model_cache(root: Path) -> None:
    """A Hugging Face cache holding ``MODEL``'s config only, and the environment that reads it
    offline. Hugging Face's hub library reads these variables when it is imported, so this runs
    before anything imports vLLM (``pytest_load_initial_conftests``)."""
    os.environ["HF_HOME"] = str(root)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform: no GPU here
    from kvlife.lifecycle.drivers.vllm.harness import OPT_CONFIG

    repo = root / "hub" / ("models--" + MODEL.replace("/", "--"))
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_CONFIG))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)


class Connectors:
    """Wraps (or replaces) what ``KVConnectorFactory.create_connector`` builds, and notes it."""

    def __init__(self, mode: str, traces: Path) -> None:
        self.mode = mode
        self.traces = traces
        self.built: list[str] = []  # during the current test
        self.written: list[str] = []  # traces, during the current test
        self.count = 0
        self.original: Any = None

    def install(self) -> None:
        """From now on, ``KVConnectorFactory.create_connector`` goes through ``create``."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        self.original = KVConnectorFactory.__dict__["create_connector"]
        original = self.original.__func__
        peer = self

        def create_connector(cls: type, config: Any, role: Any, kv_cache_config: Any) -> Any:
            return peer.create(original, cls, config, role, kv_cache_config)

        KVConnectorFactory.create_connector = classmethod(create_connector)  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        KVConnectorFactory.create_connector = self.original  # type: ignore[method-assign]

    def trace_path(self, name: str) -> str:
        self.count += 1
        path = self.traces / f"{self.count:05d}-{name}.trace.jsonl"
        self.written.append(path.name)
        return str(path)

    def create(self, original: Any, factory: type, config: Any, role: Any, kv_cache_config: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        transfer = config.kv_transfer_config
        if transfer is None or self.mode == "baseline" or transfer.kv_connector_module_path == "kvlife.vllm":
            connector = original(factory, config, role, kv_cache_config)
            self.built.append(type(connector).__name__)
            return connector
        if self.mode == "kvlife":
            extra: dict[str, Any] = {"clock": "steps"}
            if role == KVConnectorRole.SCHEDULER:
                extra["trace"] = self.trace_path("KVLifeConnector")
            replaced = dataclasses.replace(transfer, kv_connector="KVLifeConnector",
                                           kv_connector_module_path="kvlife.vllm", kv_connector_extra_config=extra)
            connector = original(factory, with_transfer(config, replaced), role, kv_cache_config)
            self.built.append(type(connector).__name__)
            return connector
        return self.record(factory, config, role, kv_cache_config)

    def record(self, factory: Any, config: Any, role: Any, kv_cache_config: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma

        from kvlife.vllm import RecordingConnector, RecordingConnectorHMA

        transfer = config.kv_transfer_config
        inner_cls = factory.get_connector_class(transfer)
        name = str(transfer.kv_connector)
        spec = f"{transfer.kv_connector_module_path}:{name}" if transfer.kv_connector_module_path else name
        record: dict[str, Any] = {"inner": spec}
        if role == KVConnectorRole.SCHEDULER:
            record["trace"] = self.trace_path(inner_cls.__name__)
        extra = {**(transfer.kv_connector_extra_config or {}), "record": record}
        wrapped = with_transfer(config, dataclasses.replace(transfer, kv_connector_extra_config=extra))
        wrapper = RecordingConnectorHMA if supports_hma(inner_cls) else RecordingConnector
        connector = seen_by_tests_as(wrapper, inner_cls)(wrapped, role, kv_cache_config)
        self.built.append(f"{wrapper.__name__}({type(connector.inner).__name__})")
        return connector


def _called_from_tests(depth: int) -> bool:
    """Whether the frame ``depth`` up is vLLM's test code (``tests.*`` modules), not vLLM's
    (``isinstance`` of an ABC passes through ``abc.ABCMeta.__instancecheck__``: skipped)."""
    frame = sys._getframe(depth + 1)
    while frame.f_back is not None and frame.f_globals.get("__name__") == "abc":
        frame = frame.f_back
    return str(frame.f_globals.get("__name__", "")).startswith("tests.")


@functools.cache
def seen_by_tests_as(wrapper: type, inner: type) -> type:
    """``wrapper`` as vLLM's test code sees it: ``isinstance`` answers for the inner connector's
    class, and an attribute the wrapper lacks is read from the inner connector. Tests reach into
    ``scheduler.connector`` (``assert isinstance(connector, OffloadingConnector)``, then its
    ``connector_scheduler``); this lets them, while every call vLLM itself makes, and every check
    vLLM makes, meets RecordingConnector as it is."""

    def klass(self: Any) -> type:
        return inner if _called_from_tests(1) else type(self)

    def forward(self: Any, name: str) -> Any:
        if name != "inner" and _called_from_tests(1):
            return getattr(self.inner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    return type(wrapper.__name__, (wrapper,), {"__class__": property(klass), "__getattr__": forward,
                                               "__module__": wrapper.__module__, "__qualname__": wrapper.__qualname__})


def with_transfer(config: Any, transfer: Any) -> Any:
    """A shallow copy of a ``VllmConfig`` with another ``kv_transfer_config`` (the test's own
    config object, and every other part of it, stay as they are)."""
    clone = copy.copy(config)
    object.__setattr__(clone, "kv_transfer_config", transfer)
    return clone


class Outcomes:
    """Each test's outcome, as pytest reports its phases, and what the factory built in it."""

    def __init__(self, connectors: Connectors) -> None:
        self.connectors = connectors
        self.tests: dict[str, dict[str, Any]] = {}

    def note(self, nodeid: str, outcome: str) -> None:
        entry = self.tests.setdefault(nodeid, {"outcome": "passed", "connectors": []})
        rank = ("passed", "xpassed", "skipped", "xfailed", "failed", "error")
        if rank.index(outcome) > rank.index(entry["outcome"]):
            entry["outcome"] = outcome

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        self.connectors.built = []
        self.connectors.written = []
        yield
        entry = self.tests.setdefault(item.nodeid, {"outcome": "passed", "connectors": []})
        entry["connectors"] = sorted(set(self.connectors.built))
        if self.connectors.written:
            entry["traces"] = list(self.connectors.written)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if hasattr(report, "wasxfail"):
            self.note(report.nodeid, "xfailed" if report.skipped else "xpassed")
        elif report.when == "call":
            self.note(report.nodeid, report.outcome)
        elif report.failed:
            self.note(report.nodeid, "error")
        elif report.skipped:
            self.note(report.nodeid, "skipped")
        else:
            self.tests.setdefault(report.nodeid, {"outcome": "passed", "connectors": []})

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.note(report.nodeid, "error")


SCRATCH = pytest.StashKey[Path]()  # the offline model cache (and the traces, without --peer-traces)
OUTCOMES = pytest.StashKey[Outcomes]()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="kvlife-vllm-peer-"))
    early_config.stash[SCRATCH] = scratch
    offline_model_cache(scratch / "hf")


def pytest_configure(config: pytest.Config) -> None:
    scratch = config.stash[SCRATCH]
    traces = Path(config.getoption("--peer-traces") or scratch / "traces")
    traces.mkdir(parents=True, exist_ok=True)
    connectors = Connectors(str(config.getoption("--peer-mode")), traces)
    connectors.install()
    outcomes = Outcomes(connectors)
    config.pluginmanager.register(outcomes, "vllm-peer-outcomes")
    config.stash[OUTCOMES] = outcomes


def pytest_unconfigure(config: pytest.Config) -> None:
    outcomes = config.stash.get(OUTCOMES, None)
    if outcomes is not None:
        outcomes.connectors.uninstall()
    scratch = config.stash.get(SCRATCH, None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--peer-outcomes")
    outcomes = session.config.stash.get(OUTCOMES, None)
    if path and outcomes is not None:
        Path(path).write_text(json.dumps({"mode": session.config.getoption("--peer-mode"),
                                          "tests": outcomes.tests}, indent=1, sort_keys=True) + "\n")
