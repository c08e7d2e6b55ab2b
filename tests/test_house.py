"""The house rules of issue 14, checked by tools/check_house.py (ast only, nothing imported).

The checker is tested on tiny synthetic packages; the last test runs it on zero_jax/ itself.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("check_house", ROOT / "tools" / "check_house.py")
check_house = importlib.util.module_from_spec(SPEC)
sys.modules["check_house"] = check_house  # dataclasses resolve their module by name
SPEC.loader.exec_module(check_house)


def make_package(tmp_path: Path, files: dict[str, str], name: str = "pkg") -> Path:
    root = tmp_path / name
    for rel, source in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def kinds(found) -> list[tuple[str, str]]:
    return [(v.kind, v.where) for v in found]


def test_a_clean_package_passes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = make_package(tmp_path, {
        "_low.py": """
            import json
            LIMITS = {"a": 1}  # read, never mutated
            def helper(x):
                self_like = x
                return json.dumps(self_like)
            """,
        "_high.py": """
            from pkg import _low
            from pkg._low import helper
            class Box:
                def __init__(self):
                    self._v = 1
                def get(self, other):
                    return self._v + other._v  # _v is this module's attribute
            def use(t):
                import flax  # optional package: allowed locally
                return _low.helper(t._replace(a=1)), helper, flax
            """,
        "sub/__init__.py": "from . import mod\n",
        "sub/mod.py": "from .. import _low\nfrom . import other\n",
        "sub/other.py": "from pkg._high import Box\n",
    })  # fmt: skip
    assert check_house.check(root) == []
    assert check_house.main([str(root)]) == 0
    assert "house clean: 0 violations" in capsys.readouterr().out


def test_cycle_through_a_function_local_import(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "_a.py": "from pkg import _b\n",
        "_b.py": "def f():\n    from pkg import _a\n    return _a\n",
        "_c.py": "from pkg import _a\n",  # imports into the cycle, not part of it
    })  # fmt: skip
    found = check_house.check(root)
    assert kinds(found) == [("cycle", "pkg/_a.py"), ("local-import", "pkg/_b.py:2")]
    assert found[0].detail.startswith("pkg._a -> pkg._b -> pkg._a; edges:")
    assert "pkg._b -> pkg._a (line 2, local)" in found[0].detail
    assert "pkg._c" not in found[0].detail


def test_relative_imports_resolve_to_modules(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "sub/__init__.py": "from .mod import x\n",
        "sub/mod.py": "from . import helper\nx = helper\n",
        "sub/helper.py": "from ..sub import mod\n",
    })  # fmt: skip
    (cycle,) = check_house.check(root)
    assert cycle.kind == "cycle"
    assert "pkg.sub.helper -> pkg.sub.mod (line 1)" in cycle.detail
    assert "pkg.sub.mod -> pkg.sub.helper (line 1)" in cycle.detail


def test_sizes_count_code_lines_and_a_reason_excuses_them(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}  # a comment" for i in range(12))
    doc = '    """A docstring\n    of three\n    lines."""\n'
    root = make_package(tmp_path, {
        "_long.py": f"def long():\n{doc}\n    # only a comment\n{body}\n    return 0\n\n\ndef short():\n    return 1\n",
        "_why.py": f"# house: one table, read top to bottom\n\n\ndef long():  # house: one formula per case\n{body}\n",
    })  # fmt: skip
    found = check_house.check(root, max_module_lines=10, max_function_lines=10)
    assert kinds(found) == [("size", "pkg/_long.py"), ("size", "pkg/_long.py:1")]
    assert found[0].detail.startswith("16 code lines (over 10): say why with '# house: ...'")
    assert found[1].detail.startswith("long() is 14 code lines (over 10)")  # docstring, blanks, comments left out
    assert check_house.check(root, max_module_lines=16, max_function_lines=14) == []


def test_folders_that_import_each_other_are_a_cycle(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "_low/__init__.py": "", "_low/a.py": "from pkg._high import b\n", "_low/c.py": "",
        "_high/__init__.py": "", "_high/b.py": "from pkg._low import c\n",
    })  # fmt: skip
    found = check_house.check(root)
    assert sorted(kinds(found)) == [("folder-cycle", "pkg/_high"), ("folder-cycle", "pkg/_low")]
    assert found[0].detail == "_high imports _low, which import it back"


def test_floors_are_folders_and_the_drawing_lists_them_top_down(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "__init__.py": '"""The package."""\nfrom pkg._top.api import run\n',
        "_base/__init__.py": '"""The vocabulary. More words."""\n', "_base/words.py": "",
        "_top/__init__.py": '"""What users call: ``api`` over ``core``."""\n',
        "_top/core.py": "from pkg._base import words\n", "_top/api.py": "from pkg._top import core\n",
    })  # fmt: skip
    assert check_house.floors(check_house.load_with_imports(root), "pkg") == {"__init__": 3, "_top": 2, "_base": 1}
    lines = check_house.drawing(root).splitlines()
    assert lines[0].split() == ["floor", "3", "__init__.py", "The", "package."]
    assert lines[2].split()[:3] == ["floor", "2", "_top/"] and lines[3].split() == ["core", "api"]
    assert lines[-2].split() == ["floor", "1", "_base/", "The", "vocabulary."]


def test_private_access_across_modules(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "_low.py": "_TABLE = {}\nclass Policy:\n    def __init__(self):\n        self._mesh = None\n",
        "_high.py": """
            from pkg import _low
            import pkg._low as low
            from pkg._low import _TABLE as T  # a private name imported from another module
            def f(policy, tree):
                a = _low._TABLE            # module alias: another module's private name
                b = low._TABLE
                c = policy._mesh           # _mesh is not defined in this module
                d = tree.leaves()._count   # nor _count
                e = super()._hidden if False else None
                return a, b, c, d, e, T, policy.__class__, tree._asdict()
            """,
    })  # fmt: skip
    found = check_house.check(root)
    assert kinds(found) == [("private-access", f"pkg/_high.py:{n}") for n in (4, 6, 7, 8, 9)]
    assert "imports _TABLE from pkg._low" in found[0].detail
    assert "_low._TABLE: private name of pkg._low" in found[1].detail
    assert "policy._mesh: _mesh is not defined in this module" in found[3].detail


def test_module_level_containers_mutated_in_functions(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "_state.py": """
            import collections
            _STACK = []
            _CACHE: dict = {}
            _SEEN = collections.defaultdict(list)
            _STACK.append(0)              # at import time: fine
            COUNT = 0
            def push(x):
                _STACK.append(x)
            def remember(k, v):
                _CACHE[k] = v
                del _CACHE[k]
                _SEEN[k].append(v)        # through a subscript: the defaultdict grows
            def shadowed(_STACK):
                _STACK.append(1)          # a parameter, not the module's list
            def bump():
                global COUNT
                COUNT += 1
            """,
    })  # fmt: skip
    found = check_house.check(root)
    assert kinds(found) == [
        ("global-mutation", "pkg/_state.py:9"),
        ("global-mutation", "pkg/_state.py:11"),
        ("global-mutation", "pkg/_state.py:12"),
        ("global-mutation", "pkg/_state.py:13"),
        ("global-mutation", "pkg/_state.py:17"),
    ]
    assert "module-level _STACK mutated in push() (.append())" in found[0].detail
    assert found[4].detail == "global COUNT in bump()"


def test_self_imports_and_local_imports(tmp_path: Path) -> None:
    root = make_package(tmp_path, {
        "__init__.py": "from pkg import _a, models\n__version__ = '1'\n",
        "_a.py": "",
        "models/__init__.py": "import pkg as zj\n",
        "_b.py": """
            from pkg import __version__
            from pkg import _a
            def f():
                import json
                import subprocess  # noqa: PLC0415 (a child process needs it)
                import matplotlib.pyplot as plt
                from pkg.models import zj
                return json, subprocess, plt, zj, _a
            """,
    })  # fmt: skip
    found = check_house.check(root)
    got = [(v.kind, v.where, v.detail) for v in found if v.kind != "cycle"]
    assert got == [
        ("self-import", "pkg/_b.py:2", "imports pkg itself ('__version__')"),
        ("self-import", "pkg/models/__init__.py:1", "imports pkg itself ('pkg')"),
        ("local-import", "pkg/_b.py:5", "imports json inside f() (only optional packages may: "
         "equinox, etils, flax, matplotlib, orbax, safetensors)"),
        ("local-import", "pkg/_b.py:8", "imports pkg.models inside f()"),
    ]  # fmt: skip
    assert {v.kind for v in found} == {"cycle", "self-import", "local-import"}  # pkg -> models -> pkg


def test_command_line_prints_a_table_and_fails_on_violations(tmp_path: Path) -> None:
    root = make_package(tmp_path, {"_a.py": "import pkg\n"})
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "check_house.py"), str(root)],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert run.stdout.splitlines()[0].split() == ["kind", "where", "detail"]
    assert "self-import      pkg/_a.py:1" in run.stdout
    assert run.stdout.rstrip().endswith("\n1 violation (self-import: 1)")


def test_zero_jax_keeps_the_house_rules() -> None:
    found = check_house.check(ROOT / "zero_jax")
    assert found == [], "\n" + check_house.table(found)


def test_the_floor_drawing_in_the_package_readme_is_the_code_s() -> None:
    readme = (ROOT / "zero_jax" / "README.md").read_text()
    start = readme.index("<!-- floors:")
    block = readme[readme.index("```\n", start) + 4 : readme.index("\n```\n<!-- /floors -->", start)]
    assert block == check_house.drawing(ROOT / "zero_jax"), (
        "zero_jax/README.md's floor drawing is stale: paste the output of `python tools/check_house.py --drawing`"
    )
