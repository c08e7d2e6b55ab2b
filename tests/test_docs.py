"""The documentation's structure (issue 42): every README link resolves, every public name has an API page,
and the Sphinx sources name what the build needs. The pages' code runs in tests/test_readme.py, the notebooks
in tests/test_notebooks.py; the site itself is built by ``sphinx-build -W`` in .ci/run, after the suite (it renders
the notebooks as tests/test_notebooks.py executed them: ``ZERO_JAX_EXECUTED_NOTEBOOKS``)."""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"
# The curated public face and the public packages (CONTRIBUTING.md, rule 1), each with its API page.
PUBLIC = {"zero_jax": "zero_jax", "zero_jax.adapters": "adapters", "zero_jax.checkpoint": "checkpoint",
          "zero_jax.models": "models", "zero_jax.measure": "measure"}  # fmt: skip
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(markdown: str) -> list[str]:
    """The targets of the Markdown links ``[text](target)`` in ``markdown``, outside code blocks."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return LINK.findall(prose)


def test_every_readme_link_resolves_to_a_file() -> None:
    targets = links((ROOT / "README.md").read_text(encoding="utf-8"))
    local = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert local, "the README links into the docs"
    missing = [t for t in local if not (ROOT / t.split("#")[0]).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"
    assert any(t.startswith("docs/") for t in local)


def documented(page: Path) -> tuple[str, set[str]]:
    """The module an API page documents and the names it gives a page (autosummary entries, autodata)."""
    text = page.read_text(encoding="utf-8")
    module = re.search(r"^\.\. currentmodule:: (\S+)$", text, flags=re.M)
    assert module, f"{page} names no currentmodule"
    names = set(re.findall(r"^\.\. autodata:: \S+\.(\w+)$", text, flags=re.M))
    for entries in re.findall(r"^\.\. autosummary::\n(?:   :.*\n)*\n((?:   \S+\n)+)", text, flags=re.M):
        names |= {line.strip() for line in entries.splitlines()}
    return module.group(1), names


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_has_an_api_page(module: str) -> None:
    page = API / f"{PUBLIC[module]}.md"
    assert page.is_file(), f"no API page for {module}: add docs/api/{PUBLIC[module]}.md"
    documents, names = documented(page)
    assert documents == module
    mod = importlib.import_module(module)
    public = set(mod.__all__)
    packages = {n for n in public if isinstance(getattr(mod, n), types.ModuleType) and f"{module}.{n}" in PUBLIC}
    missing = sorted(public - names - packages)
    assert not missing, f"{module}: public names without an API page (add them to {page.relative_to(ROOT)}): {missing}"
    assert not names - public, f"{page.relative_to(ROOT)} documents names {module} does not export"
    assert (API / "index.md").read_text(encoding="utf-8").count(f"\n{PUBLIC[module]}\n") == 1, "not in the toctree"


def test_every_page_is_in_a_toctree_and_the_toolchains_page_is_in_getting_started() -> None:
    pages = {p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.rglob("*.md") if "_build" not in p.parts}
    pages -= {"index"} | {p for p in pages if p.startswith("api/generated/")}
    listed = set()
    for page in DOCS.rglob("*.md"):
        for block in re.findall(r"^```\{toctree\}\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.S | re.M):
            base = page.parent.relative_to(DOCS)
            entries = [line.strip() for line in block.splitlines() if line.strip() and not line.startswith(":")]
            listed |= {(base / e).as_posix().removeprefix("./") for e in entries}
    assert not pages - listed, f"pages in no toctree: {sorted(pages - listed)}"
    assert "toolchains" in (DOCS / "getting_started.md").read_text(encoding="utf-8").split("{toctree}")[1]
