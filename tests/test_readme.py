"""README.md and the documentation pages as a contract (issue 13 item 9; issue 42).

Every ```python block of README.md and of each docs/**/*.md page runs as written, each in a fresh
namespace after the prelude (the README's first Python block, visible to the reader: ``params``,
``loss_fn``, ``batches``, ``batch``, ``mesh``; docs/getting_started.md shows the same block), in an empty
working directory; a block may extend the prelude, never depend on another block. A MyST-NB code cell
(```{code-cell} ipython3, executed again when the docs build) runs the same way. Every
``python -m zero_jax ...`` command in a ```bash block of any of them runs and exits 0 (once, however many
pages show it), and prints what ``PRINTS`` says it must: a command a page shows is tested here, not run again
by another file.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from _models import child_env, run_as_main, working_directory

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# README.md, then the pages Sphinx builds (not its output, nor the notebooks' copies).
DOCUMENTS = [README, *sorted(p for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0].startswith("_"))]

# Blocks that fail today only because another helper's fix has not merged yet.
# Lead: delete an entry once the fix it names has landed (strict: a block that passes fails the mark).
XFAIL: dict[str, str] = {}  # blocks that cannot run yet, with the reason; none today
# Blocks and commands that take more than a few seconds: in the full suite, not in the fast tier
# (tests/slow.txt, chosen by measurement, names the others).
SLOW = {
    "docs/howto/bring_your_model.md:python:bring-your-model-flax-nnx-flax-linen-equinox:1",
    "docs/howto/checkpoints.md:python:preemption-save-on-sigterm:1",
    "demo",
    "audit --devices 8",
    "plan --devices 64 --device-memory 80GB --compile --stages 3",
}
# What a command must print besides exiting 0 (each line a substring of its output, spaces as printed).
GPU_PLAN = "plan --topology h100:2x8 --compile --stages 3 --bf16 --dim 128 --depth 2 --vocab 256 --heads 4 --seq 64"
PRINTS: dict[str, tuple[str, ...]] = {
    GPU_PLAN: (
        "GPU hosts h100:2x8: 2 hosts x 8 GPUs = 16 devices (NVIDIA H100 80GB HBM3)",
        "Compiling for h100:2x8 with the GPU compiler",
        "Compiled: stage 3 is the lowest planned stage that fits",
        "of 79.11 GiB per device",
    ),
}
PRELUDE_NAMES = ("params", "loss_fn", "batches", "batch", "mesh")
COMMAND = "python -m zero_jax "
# A MyST-NB code cell's fence; its language is the kernel's (ipython3).
CODE_CELL = re.compile(r"^```\{code-cell\}\s*(\w+)\s*$")
CELL_OPTION = re.compile(r"^:[\w-]+:")


class Block(NamedTuple):
    id: str  # document:lang:section-slug:k
    lang: str
    path: Path
    line: int  # of the block's first code line in its document
    code: str


def slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


def document_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(text: str, path: Path = README) -> list[Block]:
    """The fenced blocks of ``text``, each named ``document:lang:section-slug:k`` (k-th of its language there)."""
    found, section, counts = [], "top", {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            section = slug(line.lstrip("#"))
        fence = re.match(r"^```(\w+)\s*$", line) or CODE_CELL.match(line)
        if fence:
            end = lines.index("```", i + 1)
            lang = "python" if line.startswith("```{code-cell}") else fence.group(1)
            counts[lang, section] = counts.get((lang, section), 0) + 1
            first = i + 1
            while lang == "python" and first < end and CELL_OPTION.match(lines[first]):
                first += 1  # a code cell's options (":tags: [hide-input]") are MyST's, not Python
            code = "\n".join(lines[first:end]) + "\n"
            key = f"{document_name(path)}:{lang}:{section}:{counts[lang, section]}"
            found.append(Block(key, lang, path, first + 1, code))
            i = end
        i += 1
    return found


BLOCKS = [b for path in DOCUMENTS for b in blocks(path.read_text(encoding="utf-8"), path)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
PRELUDE = PYTHON[0]
# The prelude runs before every other block; a block another page shows again (Getting started repeats
# the README's quick start) runs once, under the id of its first showing.
EXAMPLES = [b for i, b in enumerate(PYTHON) if i and b.code not in {a.code for a in PYTHON[:i]}]


def commands() -> list[str]:
    """Each ``python -m zero_jax ...`` command of the bash blocks (one per line, after any ``&&``), once."""
    out = []
    for b in BLOCKS:
        if b.lang != "bash":
            continue
        for line in b.code.splitlines():
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith(COMMAND) and part[len(COMMAND) :] not in out:
                    out.append(part[len(COMMAND) :])
    return out


def marks(key: str) -> list[pytest.MarkDecorator]:
    out = [pytest.mark.xfail(strict=True, reason=XFAIL[key])] if key in XFAIL else []
    return out + ([pytest.mark.slow] if key in SLOW else [])


def run_python(block: Block, directory: Path) -> dict:
    """The prelude, then ``block``, in a fresh namespace; line numbers are the block's document's."""
    namespace: dict = {"__name__": "__readme__"}
    with working_directory(directory):
        for b in (PRELUDE,) if block is PRELUDE else (PRELUDE, block):
            source = "\n" * (b.line - 1) + b.code
            exec(compile(source, str(b.path), "exec"), namespace)
    return namespace


def test_the_prelude_is_the_first_block_and_defines_the_shared_names(tmp_path: Path) -> None:
    namespace = run_python(PRELUDE, tmp_path)
    assert all(name in namespace for name in PRELUDE_NAMES), [n for n in PRELUDE_NAMES if n not in namespace]
    assert PRELUDE.path == README and len(EXAMPLES) >= 8


def test_getting_started_shows_the_prelude_as_its_first_block() -> None:
    page = [b for b in PYTHON if b.path == DOCS / "getting_started.md"]
    assert page and page[0].code == PRELUDE.code, "docs/getting_started.md's first Python block must be README's"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=marks(b.id)) for b in EXAMPLES])
def test_python_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    run_python(block, tmp_path)


def run_command(argv: list[str], directory: Path) -> str:
    """``python -m zero_jax ARGV``: ``plan`` in this process (cheap, or a compile for a ``--topology``, which
    the command itself runs in a child), the rest in a child process (demo, audit and a ``plan --compile`` on
    simulated devices set up their own devices)."""
    if argv[0] == "plan" and ("--compile" not in argv or "--topology" in argv):
        printed = io.StringIO()
        try:
            with working_directory(directory), contextlib.redirect_stdout(printed):
                run_as_main("zero_jax", argv)
        except SystemExit as e:
            assert e.code in (0, None), f"exit {e.code}:\n{printed.getvalue()}"
        return printed.getvalue()
    env = child_env(optimized=argv[0] == "demo")
    run = subprocess.run([sys.executable, "-m", "zero_jax", *argv], cwd=directory, env=env, capture_output=True,
                         text=True, timeout=600, check=False)  # fmt: skip
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run.stdout


@pytest.mark.parametrize("command", [pytest.param(c, id=c, marks=marks(c)) for c in commands()])
def test_command_runs_as_written(command: str, tmp_path: Path) -> None:
    argv = shlex.split(command)
    out = run_command(argv, tmp_path)
    assert out.strip(), "printed nothing"
    missing = [line for line in PRINTS.get(command, ()) if line not in out]
    assert not missing, f"{command!r} did not print {missing}:\n{out}"
    if "--plot" in argv:
        assert (tmp_path / argv[argv.index("--plot") + 1]).stat().st_size > 0


def test_every_command_with_expected_output_is_shown_on_a_page() -> None:
    assert set(PRINTS) <= set(commands()), set(PRINTS) - set(commands())


def test_runnable_lines_show_no_bracketed_options() -> None:
    assert commands(), "no python -m zero_jax command in a bash block"
    bracketed = [c for c in commands() if re.search(r"\[-", c)]
    assert not bracketed, f"write each alternative on its own line that runs: {bracketed}"


def test_the_test_command_is_what_ci_runs_and_the_quick_check_is_named() -> None:
    test_command = 'pip install -e ".[test]" && ruff check . && python -m pytest -q -n 2'
    text = README.read_text(encoding="utf-8")
    assert test_command in text.splitlines()
    assert "pip install -e . && python -m zero_jax demo" in text.splitlines()
    assert 'python -m pytest -m "not slow" -q' in text.splitlines()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    as_ci_writes_it = [line.replace("python3 -m pip", "pip").replace("python3 ", "python ") for line in ci]
    assert test_command in as_ci_writes_it, ".ci/run must run the README's test command exactly"
