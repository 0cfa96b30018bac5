"""Every ``kvlife`` example in README.md and docs/*.md runs, so the docs cannot drift.

The convention (also in docs/cli.md, "Examples in these docs are tested"):

* A command is a line starting with ``kvlife `` inside a fenced (```) block; in a block that
  uses ``$ `` prompts (a transcript), only the ``$ kvlife`` lines are commands and the rest
  is their output. A line ending in ``\\`` continues on the next.
* A fenced ``python``, ``toml`` or ``csv`` block whose first line is ``# NAME.py`` (``.toml``,
  ``.csv``) is written to that file first.
* Each file's commands run in order, in one fresh directory, as ``python -m kvlife ...``;
  they must exit 0 (or the code of a trailing ``# exit N``) and print no traceback.
* In a transcript, the lines after a ``$ kvlife`` command (up to the next ``$`` line or the
  end of the block) are its documented output, and must equal what it prints (stderr's
  lines first, then stdout's; trailing spaces aside), line for line, with two markers:
  a line ``...`` stands for any lines (none included), and ``<N>`` inside a line stands for
  one number (digits with ``,`` and ``.``) that differs from machine to machine. A
  transcript command with no lines after it documents no output.
* A trailing ``# not run in tests: WHY`` skips a command: only commands that need a Redis
  server or a vLLM run, or take more than a few seconds (the whole bundled trace), with the
  reason written down. It and a command that needs an extra not installed here are reported
  as skipped tests, with the reason.
* A ``kvlife`` command in an indented (unfenced) code block is an error: it would not be run.

Each command is a test of its own (``test_example[README.md:75]``); a file's commands run in
order, once, in one directory per file, whichever of them a test asks for first.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"#\s*not run in tests\b:?\s*(?P<why>.*)$")
EXIT = re.compile(r"#\s*exit\s+(?P<code>\d+)\b")
ANY_LINES = "..."  # a documented output line that stands for any lines
NUMBER = "<N>"  # inside a documented output line: one number that differs between machines
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
    output: tuple[str, ...] | None = None  # the documented output of a transcript command


@attrs.frozen
class Doc:
    examples: tuple[Example, ...]
    files: dict[str, str]
    problems: tuple[str, ...]


def _commands(block: list[tuple[int, str]], name: str) -> list[Example]:
    transcript = any(line.strip().startswith("$ ") for _, line in block)
    examples: list[Example] = []
    pending: list[str] = []
    output: list[str] | None = None  # the documented output of the last transcript command
    start = 0
    for number, raw in block:
        line = raw.strip()
        if not pending:
            if transcript:
                if output is not None and not line.startswith("$ "):
                    output.append(raw.rstrip())
                    continue
                _close(examples, output)
                output = None
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
        if transcript:
            output = []
    _close(examples, output)
    return examples


def _close(examples: list[Example], output: list[str] | None) -> None:
    """The last transcript command's documented output, when it shows any."""
    if output:
        examples[-1] = attrs.evolve(examples[-1], output=tuple(output))


def _line_pattern(documented: str) -> re.Pattern[str]:
    parts = documented.rstrip().split(NUMBER)
    return re.compile(r"[\d,.]+".join(re.escape(part) for part in parts))


def output_mismatch(documented: Sequence[str], actual: Sequence[str]) -> str | None:
    """None when ``actual`` (lines) is what ``documented`` shows (module docstring: ``...``
    stands for any lines, ``<N>`` for one number); otherwise the first documented line that
    could not be matched."""
    actual = [line.rstrip() for line in actual]
    segments: list[list[str]] = [[]]
    for line in documented:
        if line.strip() == ANY_LINES:
            segments.append([])
        else:
            segments[-1].append(line)
    anchored_start, anchored_end = bool(segments[0]), bool(segments[-1])
    position = 0
    for index, segment in enumerate(segments):
        if not segment:
            continue
        patterns = [_line_pattern(line) for line in segment]
        last = len(actual) - len(segment)
        if index == 0 and anchored_start:
            candidates: Iterator[int] = iter([0])
        elif index == len(segments) - 1 and anchored_end:
            candidates = iter([max(last, position)])
        else:
            candidates = iter(range(position, last + 1))
        found = next((at for at in candidates if at >= position and all(
            p.fullmatch(actual[at + k]) for k, p in enumerate(patterns)) if at + len(segment) <= len(actual)), None)
        if found is None:
            return f"documented output not printed (in order, at its place): {segment[0]!r}"
        position = found + len(segment)
    if anchored_end and position != len(actual):
        return f"printed past the documented output (no {ANY_LINES!r} at its end): {actual[position]!r}"
    return None


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


def test_documented_output_is_matched_as_documented() -> None:
    """The output comparison and its markers, on made-up output."""
    printed = ["header", "TTFT p50 1,234.5 ms", "a", "b", "total 7"]
    assert output_mismatch(printed, printed) is None
    assert output_mismatch(["header", "...", "total 7"], printed) is None
    assert output_mismatch(["...", "TTFT p50 <N> ms", "...", "total <N>"], printed) is None
    assert output_mismatch(["header", "...", "b", "total 7", "..."], printed) is None
    assert output_mismatch(["header", "TTFT p50 1,234.5 ms", "..."], printed) is None
    assert output_mismatch(["header"], printed) is not None  # no "...": the rest must be shown
    assert output_mismatch(["...", "TTFT p50 9.9 ms", "..."], printed) is not None
    assert output_mismatch(["...", "total 7", "header", "..."], printed) is not None  # order counts
    assert output_mismatch(["...", "TTFT p50 <N> s", "..."], printed) is not None
    assert output_mismatch(["...", "TTFT <N> 1,234.5 ms", "..."], printed) is not None  # <N> is a number
    doc = parse_doc("```\n$ kvlife run --limit 1\nline one\n...\n$ kvlife replay t.jsonl\n"
                    "$ kvlife replay t.jsonl\nidentical\n```\n", "X.md")
    assert [e.output for e in doc.examples] == [("line one", "..."), None, ("identical",)]


def _example_params() -> list[object]:
    params: list[object] = []
    for path in DOC_FILES:
        for index, example in enumerate(_load(path).examples):
            why = example.skip and f"not run in tests: {example.skip}"
            extra = _missing_extra(example.argv)
            why = why or (extra and f"needs {extra}, which is not installed here")
            why = why and f"{example.source}: {why}"
            params.append(pytest.param(path, index, id=example.source,
                                       marks=[pytest.mark.skip(reason=why)] if why else []))
    return params


@attrs.define
class DocRun:
    """One doc's examples, run in order in one directory, each once (by the first test that
    needs it or one after it)."""

    doc: Doc
    where: Path
    results: list[subprocess.CompletedProcess[str] | None] = attrs.field(factory=list)

    def result(self, index: int) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        env.pop("COLUMNS", None)
        while len(self.results) <= index:
            example = self.doc.examples[len(self.results)]
            if example.skip or _missing_extra(example.argv):
                self.results.append(None)
                continue
            self.results.append(subprocess.run(
                [sys.executable, "-m", "kvlife", *example.argv], cwd=self.where, env=env, capture_output=True,
                text=True, timeout=180, stdin=subprocess.DEVNULL))
        result = self.results[index]
        assert result is not None
        return result


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, DocRun]:
    runs: dict[Path, DocRun] = {}
    for path in DOC_FILES:
        where = tmp_path_factory.mktemp(path.stem)
        doc = _load(path)
        for name, content in doc.files.items():
            (where / name).write_text(content)
        runs[path] = DocRun(doc, where)
    return runs


@pytest.mark.parametrize(("path", "index"), _example_params())
def test_example(path: Path, index: int, doc_runs: dict[Path, DocRun]) -> None:
    run = doc_runs[path]
    example = run.doc.examples[index]
    proc = run.result(index)
    where = f"{example.source}: {example.text}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr + proc.stdout, where
    assert proc.returncode == example.exit_code, where
    if example.output is not None:
        mismatch = output_mismatch(example.output, [*proc.stderr.splitlines(), *proc.stdout.splitlines()])
        assert mismatch is None, f"{mismatch}\n{where}"
