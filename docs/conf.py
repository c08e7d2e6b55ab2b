"""Sphinx configuration: MyST pages and notebooks (myst-nb), sphinx-book-theme, the API from the docstrings.

Build: ``pip install -e ".[docs]" && sphinx-build -W -b html docs docs/_build/html`` (warnings are errors).
The notebooks (``notebooks/*.ipynb``, copied to ``docs/notebooks/`` per build) and the pages written as MyST notebooks
(``docs/concepts/stages.md``) are executed at build; without an accelerator they simulate 8 CPU devices. With
``ZERO_JAX_EXECUTED_NOTEBOOKS`` set (``.ci/run``), the notebooks as the suite executed them are rendered instead.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no accelerator probing while autodoc imports zero_jax

from zero_jax import __version__  # noqa: E402

# The notebooks live in notebooks/ (Colab opens them there); Sphinx reads sources under docs/ only, and a
# symlink would resolve their relative links against notebooks/. A copy (git-ignored) is made per build.
NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"
NOTEBOOKS.mkdir(exist_ok=True)
# With ZERO_JAX_EXECUTED_NOTEBOOKS=DIR (.ci/run sets it), the copies are the notebooks as tests/test_notebooks.py
# executed them in the same run, rendered without running them a second time; the pages written as MyST notebooks
# still run here. Without it every notebook runs at build.
EXECUTED = os.environ.get("ZERO_JAX_EXECUTED_NOTEBOOKS")
STALE_NOTEBOOK = (
    "{executed}: no executed copy of {source} with the same code cells. Run "
    "`ZERO_JAX_EXECUTED_NOTEBOOKS={dir} python -m pytest tests/test_notebooks.py` first, "
    "or unset ZERO_JAX_EXECUTED_NOTEBOOKS to execute the notebooks in this build."
)


def _code_cells(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
    if EXECUTED:
        executed = Path(EXECUTED) / notebook.name
        if not executed.is_file() or _code_cells(executed) != _code_cells(notebook):
            raise RuntimeError(STALE_NOTEBOOK.format(executed=executed, source=notebook, dir=EXECUTED))
    shutil.copy2(executed if EXECUTED else notebook, NOTEBOOKS / notebook.name)

project = "zero_jax"
author = "the zero_jax authors"
copyright = "2026, the zero_jax authors"
release = version = __version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints", "jupyter_execute"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# Notebooks and MyST-notebook pages run at every build (the notebooks not, when executed copies were given);
# a cell that raises fails the build.
nb_execution_mode = "force"
nb_execution_excludepatterns = ["notebooks/*.ipynb"] if EXECUTED else []
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True

autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = f"zero_jax {__version__}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}


def _drop_type_docstrings(app, what, name, obj, options, lines):  # noqa: ARG001 - Sphinx's signature
    """A constant (a dict, a str) would show its type's docstring (``dict(**kwargs) -> ...``): drop it."""
    if what == "data" and lines and type(obj).__doc__ and "\n".join(lines).strip() == type(obj).__doc__.strip():
        lines.clear()


def setup(app):
    app.connect("autodoc-process-docstring", _drop_type_docstrings)
