"""Every ``kvlife`` example in README.md and docs/*.md runs, so the docs cannot drift.

The convention (also in docs/cli.md, "Examples in these docs are tested"):

* A command is a line starting with ``kvlife `` inside a fenced (```) block; in a block that
  uses ``$ `` prompts (a transcript), only the ``$ kvlife`` lines are commands and the rest
  is their output. A line ending in ``\\`` continues on the next.
* A fenced ``python``, ``toml`` or ``csv`` block whose first line is ``# NAME.py`` (``.toml``,
  ``.csv``) is written to that file first.
* Each file's commands run in order, in one fresh directory, as ``python -m kvlife ...``;
  they must exit 0 (or the code of a trailing ``# exit N``) and print no traceback.
* A trailing ``# not run in tests: WHY`` skips a command: only commands that need a Redis
  server or a vLLM run, or take more than a few seconds (the whole bundled trace), with the
  reason written down.
* A ``kvlife`` command in an indented (unfenced) code block is an error: it would not be run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"#\s*not run in tests\b:?\s*(?P<why>.*)$")
EXIT = re.compile(r"#\s*exit\s+(?P<code>\d+)\b")
FILE_BLOCK = re.compile(r"^#\s*(?P<name>[\w.-]+\.(?:py|toml|csv))\s*$")
FILE_FENCES = ("python", "toml", "csv")
# Skipped examples, at most this many across all docs (each with a reason).
MAX_SKIPPED = 5


@attrs.frozen
class Example:
    source: str  # "README.md:42"
    text: str  # the command as written, continuations joined
    argv: tuple[str, ...]
    exit_code: int = 0
    skip: str | None = None


@attrs.frozen
class Doc:
    examples: tuple[Example, ...]
    files: dict[str, str]
    problems: tuple[str, ...]


def _commands(block: list[tuple[int, str]], name: str) -> list[Example]:
    transcript = any(line.strip().startswith("$ ") for _, line in block)
    examples: list[Example] = []
    pending: list[str] = []
    start = 0
    for number, raw in block:
        line = raw.strip()
        if not pending:
            if transcript:
                if not line.startswith("$ kvlife "):
                    continue
                line = line[2:]
            elif not line.startswith("kvlife "):
                continue
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        text = " ".join([*pending, line])
        pending = []
        skip = SKIP.search(text)
        exit_code = EXIT.search(text)
        tokens = shlex.split(text, comments=True)
        examples.append(Example(f"{name}:{start}", text, tuple(tokens[1:]),
                                int(exit_code["code"]) if exit_code else 0,
                                (skip["why"].strip() or "no reason given") if skip else None))
    return examples


def parse_doc(text: str, name: str) -> Doc:
    examples: list[Example] = []
    files: dict[str, str] = {}
    problems: list[str] = []
    fence: str | None = None
    block: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if fence is None:
                fence, block = stripped[3:].strip(), []
                continue
            if fence in FILE_FENCES and block and FILE_BLOCK.match(block[0][1].strip()):
                files[FILE_BLOCK.match(block[0][1].strip())["name"]] = "\n".join(raw for _, raw in block) + "\n"
            elif fence in ("", "console", "sh", "bash", "shell", "text"):
                examples.extend(_commands(block, name))
            fence = None
            continue
        if fence is not None:
            block.append((number, line))
        elif re.match(r"^( {4,}|\t)(\$ )?kvlife ", line):
            problems.append(f"{name}:{number}: a kvlife command in an indented block is never run; "
                            f"put it in a ``` block")
    if fence is not None:
        problems.append(f"{name}: unclosed ``` block")
    return Doc(tuple(examples), files, tuple(problems))


def _load(path: Path) -> Doc:
    return parse_doc(path.read_text(), str(path.relative_to(ROOT)))


def _missing_extra(argv: tuple[str, ...]) -> str | None:
    needs: list[str] = []
    if "--live" in argv or argv[:2] == ("bench", "transfer"):
        needs += ["torch", "redis"]
    if argv[:1] == ("plot",) or argv[:2] == ("sweep", "plot") or "--plot" in argv:
        needs.append("matplotlib")
    if "--ray" in argv:
        needs.append("ray")
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    return missing[0] if missing else None


def test_the_convention_is_parsed_as_documented() -> None:
    doc = parse_doc(
        "text\n"
        "```\n"
        "kvlife run --limit 5 \\\n"
        '    --stack "a,b"   # comment\n'
        "kvlife check --stack x.py:P   # exit 1\n"
        "not a command\n"
        "kvlife bench engine   # not run in tests: ~30 s\n"
        "```\n"
        "```\n"
        "$ kvlife replay t.jsonl\n"
        "kvlife replay: identical (this is output)\n"
        "```\n"
        "```python\n"
        "# p.py\n"
        "X = 1\n"
        "```\n"
        "```csv\n"
        "# t.csv\n"
        "a,b\n"
        "```\n"
        "    kvlife run --forgotten\n",
        "X.md",
    )
    assert [e.argv for e in doc.examples] == [
        ("run", "--limit", "5", "--stack", "a,b"), ("check", "--stack", "x.py:P"), ("bench", "engine"),
        ("replay", "t.jsonl")]
    assert [e.source for e in doc.examples] == ["X.md:3", "X.md:5", "X.md:7", "X.md:10"]
    assert [e.exit_code for e in doc.examples] == [0, 1, 0, 0]
    assert [e.skip for e in doc.examples] == [None, None, "~30 s", None]
    assert doc.files == {"p.py": "# p.py\nX = 1\n", "t.csv": "# t.csv\na,b\n"}
    assert doc.problems == ("X.md:21: a kvlife command in an indented block is never run; put it in a ``` block",)


def test_the_docs_have_examples_and_few_skips() -> None:
    docs = [_load(p) for p in DOC_FILES]
    assert sum(len(d.examples) for d in docs) >= 30
    skipped = [e for d in docs for e in d.examples if e.skip]
    assert len(skipped) <= MAX_SKIPPED, [e.source for e in skipped]
    assert all(e.skip != "no reason given" for e in skipped), [e.source for e in skipped]
    problems = [p for d in docs for p in d.problems]
    assert not problems, problems


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_examples_run(path: Path, tmp_path: Path) -> None:
    doc = _load(path)
    if not doc.examples:
        pytest.skip(f"{path.name} has no kvlife examples")
    for name, content in doc.files.items():
        (tmp_path / name).write_text(content)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("COLUMNS", None)
    for example in doc.examples:
        if example.skip or _missing_extra(example.argv):
            continue
        proc = subprocess.run([sys.executable, "-m", "kvlife", *example.argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
        where = f"{example.source}: {example.text}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
        assert "Traceback" not in proc.stderr + proc.stdout, where
        assert proc.returncode == example.exit_code, where
