"""Packaging: one import package ``kvlife``, a light core, every subpackage and data file
shipped, policies found through entry points.

A real ``pip install .`` into a fresh virtualenv is too slow for the default suite; .ci/run
builds the wheel, checks its contents and installs it into a throwaway venv with only the
core dependencies. These tests check the same promises from the source tree.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import kvlife
from kvlife.lifecycle.workloads.bundled import BUNDLED
from kvlife.policies.base import PolicyError
from kvlife.policies.loading import ENTRY_POINT_GROUP, entry_point_policies, load_policy

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
# The repository's top-level folders that ship as kvlife.<name>.
SUBPACKAGE_ROOTS = ("lifecycle", "policies", "specs", "transfer")
OPTIONAL = ("torch", "redis", "matplotlib")


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter (a clean sys.modules), as this one would import kvlife."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )


# ---- the public API ------------------------------------------------------------------
def test_public_api_names_resolve() -> None:
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.traces.trace import read_trace
    from kvlife.lifecycle.traces.validate import validate
    from kvlife.policies.base import Decision
    from kvlife.specs.model_check import check_policy

    for name in kvlife.__all__:
        assert getattr(kvlife, name) is not None, name
    assert kvlife.Engine is Engine
    assert kvlife.Decision is Decision
    assert kvlife.check_policy is check_policy
    assert kvlife.load_trace is read_trace
    assert kvlife.validate_trace is validate
    assert set(kvlife.__all__) <= set(dir(kvlife))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        kvlife.Nope  # noqa: B018


def test_package_is_kvlife_from_this_checkout() -> None:
    # The tests must exercise this tree's code, reached as kvlife.*, however it is installed.
    import kvlife.lifecycle as lifecycle

    assert Path(lifecycle.__file__).resolve().parent == (ROOT / "lifecycle").resolve()


# ---- the core stays light --------------------------------------------------------------
CORE_MODULES = [
    "kvlife",
    "kvlife.lifecycle.config",
    "kvlife.lifecycle.metrics",
    "kvlife.lifecycle.engine.core",
    "kvlife.lifecycle.drivers.simulator",
    "kvlife.lifecycle.drivers.runner",
    "kvlife.lifecycle.traces.trace",
    "kvlife.lifecycle.traces.replay",
    "kvlife.lifecycle.traces.validate",
    "kvlife.lifecycle.traces.explain",
    "kvlife.lifecycle.traces.export",
    "kvlife.lifecycle.workloads.mooncake",
    "kvlife.lifecycle.workloads.synthetic",
    "kvlife.lifecycle.workloads.bundled",
    "kvlife.lifecycle.cli.main",
    "kvlife.policies.loading",
    "kvlife.policies.registry",
    "kvlife.specs.lifecycle",
    "kvlife.specs.table",
    "kvlife.specs.invariants",
    "kvlife.specs.model_check",
]


def test_core_imports_and_commands_load_no_torch_redis_or_matplotlib(tmp_path: Path) -> None:
    # Import the core, resolve every public name, then run the core commands in the same
    # process: run, validate, replay, explain, check, export. None may pull in an extra.
    done = run_python(
        f"""
        import contextlib, importlib, io, json, sys
        for name in {CORE_MODULES!r}:
            importlib.import_module(name)
        import kvlife
        for name in kvlife.__all__:
            getattr(kvlife, name)
        from kvlife.lifecycle.cli.main import main
        codes = []
        for argv in (["run", "--limit", "20", "--trace", "t.trace.jsonl"], ["validate", "t.trace.jsonl"],
                     ["replay", "t.trace.jsonl"], ["explain", "t.trace.jsonl", "req-1"],
                     ["check", "--examples", "2"], ["export", "--perfetto", "t.json", "t.trace.jsonl"]):
            with contextlib.redirect_stdout(io.StringIO()):
                codes.append(main(argv))
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {OPTIONAL!r})
        print(json.dumps({{"codes": codes, "heavy": heavy}}))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0] * 6
    assert result["heavy"] == []


def test_missing_extra_is_a_one_line_error(tmp_path: Path) -> None:
    # Simulate an install without [plot]/[live]: the command names the extra to install.
    trace = tmp_path / "t.trace.jsonl"
    done = run_python(
        f"""
        import sys
        for name in {OPTIONAL!r}:
            sys.modules[name] = None  # import fails as if not installed
        from kvlife.lifecycle.cli.main import main
        codes = [main(["run", "--limit", "5", "--trace", {str(trace)!r}]),
                 main(["plot", {str(trace)!r}, {str(tmp_path / "p.png")!r}]),
                 main(["run", "--live", "--limit", "2"])]
        print(codes)
        """,
        tmp_path,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[0, 2, 2]"
    assert done.stderr.splitlines() == [
        "kvlife: error: kvlife plot needs matplotlib: pip install 'kvlife[plot]'",
        "kvlife: error: kvlife run --live needs torch: pip install 'kvlife[live]'",
    ]


# ---- one top-level package ------------------------------------------------------------
def all_modules() -> list[str]:
    names = ["kvlife"]
    for top in SUBPACKAGE_ROOTS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts[:3] == ("lifecycle", "drivers", "vllm"):
                continue  # the vLLM connector needs vLLM itself (scripts/install-vllm.sh builds its venv)
            names.append(".".join(("kvlife", *parts)))
    return names


def test_importing_everything_creates_no_top_level_duplicates(tmp_path: Path) -> None:
    # With the repository root on sys.path, `lifecycle` would also be importable on its own:
    # a module imported both ways exists twice (lifecycle.engine.events.Arrival is not
    # kvlife.lifecycle.engine.events.Arrival) and isinstance checks silently fail.
    modules = [m for m in all_modules() if not m.endswith("__main__")]
    done = run_python(
        f"""
        import importlib, json, sys
        for name in {modules!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {SUBPACKAGE_ROOTS!r})))
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_no_source_imports_the_folders_as_top_level_packages() -> None:
    bad = []
    files = [p for top in (*SUBPACKAGE_ROOTS, "kvlife", "tests") for p in (ROOT / top).rglob("*.py")]
    for path in files:
        if "kvlife" in path.relative_to(ROOT).parts[1:]:
            continue  # kvlife/<name> symlinks: the same files again
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] in SUBPACKAGE_ROOTS]
    assert bad == []


# ---- what may import what (docs/design.md, "Layout") -------------------------------------
def imported_names(path: Path) -> set[str]:
    """Every absolute module name a file imports, at any depth (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def forbidden_imports(pattern: str, *forbidden: str, allowed: tuple[str, ...] = ()) -> list[str]:
    found = []
    for path in sorted(ROOT.glob(pattern)):
        for name in sorted(imported_names(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden) and name not in allowed:
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def test_layering_rules_hold() -> None:
    # Policies are decisions only: the protocol, attrs and the standard library.
    assert forbidden_imports("policies/*.py", *OPTIONAL, "kvlife.lifecycle", "kvlife.specs", "kvlife.transfer") == []
    # The sans-IO engine: no IO layers, no drivers, no bytes; the plain tier index only.
    assert forbidden_imports(
        "lifecycle/engine/*.py", *OPTIONAL, "kvlife.lifecycle.drivers", "kvlife.lifecycle.traces",
        "kvlife.lifecycle.cli", "kvlife.transfer", allowed=("kvlife.transfer.index", "kvlife.transfer.eviction"),
    ) == []
    # The spec, invariants and checker need no extra; the plain tier index needs no torch.
    assert forbidden_imports("specs/*.py", *OPTIONAL) == []
    assert forbidden_imports("transfer/index.py", *OPTIONAL) == []
    assert forbidden_imports("transfer/eviction.py", *OPTIONAL) == []
    # Only the live driver and plot reach for the extras inside lifecycle/.
    users = {str(p.relative_to(ROOT)) for p in ROOT.glob("lifecycle/**/*.py")
             if any(n.split(".")[0] in OPTIONAL for n in imported_names(p))}
    # profile_gpu times real kernels (torch imported inside the function that needs a GPU);
    # mrc draws its curve (matplotlib imported inside plot_curve, after `kvlife mrc --plot` checked the extra);
    # sweeps draw with matplotlib and run on Ray (imported inside the functions that need them).
    assert users <= {"lifecycle/drivers/live.py", "lifecycle/traces/plot.py", "lifecycle/profiles/profile_gpu.py",
                     "lifecycle/fidelity/mrc.py", "lifecycle/sweeps/plots.py", "lifecycle/sweeps/executors.py",
                     *(u for u in users if u.startswith("lifecycle/drivers/vllm/"))}, users
    # vLLM is imported by the connector package only.
    vllm_users = {str(p.relative_to(ROOT)) for top in SUBPACKAGE_ROOTS for p in (ROOT / top).rglob("*.py")
                  if "vllm" in {n.split(".")[0] for n in imported_names(p)}}
    assert vllm_users and all(u.startswith("lifecycle/drivers/vllm/") for u in vllm_users), vllm_users


# ---- pyproject: packages and data ----------------------------------------------------
def test_pyproject_packages_cover_every_folder_with_an_init() -> None:
    package_dir: dict[str, str] = SETUPTOOLS["package-dir"]
    # Each kvlife.<name> is the top-level folder <name>, and kvlife/<name> points at it.
    assert package_dir == {"kvlife": "kvlife", **{f"kvlife.{top}": top for top in SUBPACKAGE_ROOTS}}
    for top in SUBPACKAGE_ROOTS:
        assert (ROOT / "kvlife" / top).resolve() == (ROOT / top).resolve()
    found = {"kvlife"}
    for top in SUBPACKAGE_ROOTS:
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(".".join(("kvlife", *init.parent.relative_to(ROOT).parts)))
    assert sorted(SETUPTOOLS["packages"]) == sorted(found)
    # And no folder of modules was left without an __init__.py (it would not ship).
    for top in SUBPACKAGE_ROOTS:
        for module in (ROOT / top).rglob("*.py"):
            assert (module.parent / "__init__.py").is_file(), f"{module.parent} has modules but no __init__.py"


def test_bundled_data_is_package_data() -> None:
    patterns: list[str] = SETUPTOOLS["package-data"]["kvlife.lifecycle.workloads"]
    data = ROOT / "lifecycle" / "workloads" / "data"
    shipped = sorted(p.name for p in data.iterdir() if p.is_file())
    assert {"LICENSE-APACHE", "SOURCE.md", *BUNDLED.values()} <= set(shipped)
    for name in shipped:  # every file in data/ ships: nothing there can be forgotten
        assert any(fnmatch.fnmatch(f"data/{name}", pattern) for pattern in patterns), name
    # The bundled trace's license ships as a license file too.
    assert "lifecycle/workloads/data/LICENSE-APACHE" in PYPROJECT["project"]["license-files"]
    assert SETUPTOOLS["include-package-data"] is False  # only what package-data lists


def test_core_dependencies_exclude_the_extras() -> None:
    project = PYPROJECT["project"]
    core = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    assert core.isdisjoint(OPTIONAL)
    assert "hypothesis" in core  # `kvlife check` is a core command
    extras = project["optional-dependencies"]
    assert any(d.startswith("torch") for d in extras["live"]) and any(d.startswith("redis") for d in extras["live"])
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    assert "kvlife[live,plot]" in extras["dev"]
    assert project["scripts"]["kvlife"] == "kvlife.lifecycle.cli.main:main"


# ---- policies from entry points ----------------------------------------------------
def install_fake_distribution(root: Path, entry_points: str) -> None:
    """A minimal installed distribution: what `pip install` leaves in site-packages."""
    (root / "kvlife_ep_test_policy.py").write_text(textwrap.dedent("""
        from kvlife.policies.base import Decision

        class Eager:
            name = "eager-from-entry-point"

            def lookup_mode(self, request, engine):
                return Decision("async", "an entry-point policy")
    """))
    dist_info = root / "kvlife_ep_test-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvlife-ep-test\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(entry_points)


def test_load_policy_by_entry_point_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_distribution(
        tmp_path, f"[{ENTRY_POINT_GROUP}]\nmy-policy = kvlife_ep_test_policy:Eager\nbroken = nowhere_xyz:Gone\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert entry_point_policies()["my-policy"] == "kvlife_ep_test_policy:Eager"
    policy = load_policy("my-policy")
    assert type(policy).__name__ == "Eager"
    assert policy.name == "eager-from-entry-point"  # type: ignore[attr-defined]
    with pytest.raises(PolicyError) as excinfo:
        load_policy("not-a-policy")
    message = str(excinfo.value)
    assert message.startswith("unknown policy 'not-a-policy' (built-ins: ")
    assert "my-policy" in message and "broken" in message and "shared-loads" in message
    with pytest.raises(PolicyError, match="importing 'nowhere_xyz' failed: ModuleNotFoundError"):
        load_policy("broken")


def test_entry_point_policy_on_the_command_line(tmp_path: Path) -> None:
    install_fake_distribution(tmp_path, f"[{ENTRY_POINT_GROUP}]\nmy-policy = kvlife_ep_test_policy:Eager\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "kvlife", "check", "--stack", "my-policy", "--examples", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
