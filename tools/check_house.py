#!/usr/bin/env python3
"""Check the house rules of a package and draw its floors, with the standard library alone.

    python tools/check_house.py [PACKAGE_DIR] [--max-module-lines 800] [--max-function-lines 80]
    python tools/check_house.py --drawing     # the floor drawing zero_jax/README.md shows
    python tools/check_house.py --numbers     # the house in numbers

PACKAGE_DIR defaults to ``zero_jax/`` beside this script's parent; its directory name is the package
name. Prints one table row per violation and exits 1 if there is any, 0 if the house is clean:

* ``cycle``            an import cycle in the module graph; every import counts, function-local and
                       ``if TYPE_CHECKING:`` ones included (imports point down the floors)
* ``folder-cycle``     two concept folders (or top-level modules) that import each other, through any
                       of their modules: the floors are folders, so imports between them point one way
* ``size``             a module over ``--max-module-lines`` code lines, or a function over
                       ``--max-function-lines``, that does not say why: sizes are a smell to explain,
                       not a cliff to cut at. Code lines leave out blank lines, comments and
                       docstrings. The explanation is a ``# house: <why>`` comment on the ``def`` line
                       or the line above it (a function), or before the first import (a module).
* ``private-access``   ``from pkg.mod import _x``; ``alias._x`` where ``alias`` is another module of the
                       package; or ``obj._x`` (``obj`` not ``self`` / ``cls``) where ``_x`` is not defined
                       in this module
* ``global-mutation``  a module-level list / dict / set mutated inside a function (``.append``,
                       ``[k] = v``, ``del``, ...), or a ``global`` statement
* ``self-import``      the package importing itself (``import zero_jax``, ``from zero_jax import f``)
* ``local-import``     an import inside a function: of a package module, or of anything but the
                       optional third-party packages in ``OPTIONAL`` (a line marked ``# noqa: PLC0415``,
                       as ruff takes it, may import any non-package module locally)

The floors: each concept folder (and each module at the package root) is a unit; a unit's floor is
one above the highest unit it imports. ``--drawing`` prints them top-down with each folder's modules
in the order they import each other and the first sentence of the folder's docstring.

The checks read source only (``ast``); nothing is imported or executed.
"""

from __future__ import annotations

import argparse
import ast
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

OPTIONAL = frozenset({"flax", "equinox", "orbax", "etils", "matplotlib", "safetensors"})
MUTATORS = frozenset({
    "append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "popitem",
    "add", "discard", "appendleft", "popleft", "extendleft", "sort", "reverse",
})  # fmt: skip
MUTABLE_CALLS = frozenset({"list", "dict", "set", "defaultdict", "OrderedDict", "deque", "Counter"})
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})
NOQA = "noqa: PLC0415"  # the same escape as ruff's, for a local import of a non-package module with a reason
KINDS = (
    "cycle", "folder-cycle", "size", "private-access", "global-mutation", "self-import", "local-import",
)  # fmt: skip
EXPLAINED = "# house:"  # a size smell, explained (see the module docstring)


@dataclass(frozen=True, order=True)
class Violation:
    kind: str
    where: str  # "path:line" relative to the package's parent
    detail: str


@dataclass
class Module:
    name: str  # dotted: zero_jax._step.train, zero_jax.adapters (for adapters/__init__.py)
    path: Path
    rel: str
    tree: ast.Module
    lines: int
    source_lines: list[str]
    is_package: bool
    imports: list[tuple[str, int, bool]] = field(default_factory=list)  # (target module, line, local)
    docstrings: set[int] = field(default_factory=set)


def module_name(root: Path, path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def load(root: Path) -> dict[str, Module]:
    modules = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        source = path.read_text(encoding="utf-8")
        name, is_package = module_name(root, path)
        rel = str(path.relative_to(root.parent))
        tree = ast.parse(source, filename=rel)
        lines = source.splitlines()
        modules[name] = Module(name, path, rel, tree, len(lines), lines, is_package, docstrings=docstring_lines(tree))
    return modules


def scopes(tree: ast.AST) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    """Every node with the innermost function that contains it (None at module / class level)."""
    stack: list[tuple[ast.AST, ast.AST | None]] = [(tree, None)]
    while stack:
        node, func = stack.pop()
        yield node, func
        inner = node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) else func
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def resolve(module: Module, node: ast.Import | ast.ImportFrom, known: dict[str, Module]) -> list[tuple[str, str]]:
    """(imported module, the name as written) for each name the statement imports."""
    if isinstance(node, ast.Import):
        return [(alias.name, alias.name) for alias in node.names]
    if node.level:
        base = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{prefix}.{alias.name}"
        out.append((sub if sub in known else prefix, alias.name))
    return out


def collect_imports(modules: dict[str, Module], package: str) -> list[Violation]:
    found = []
    for module in modules.values():
        for node, func in scopes(module.tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            where = f"{module.rel}:{node.lineno}"
            for target, written in resolve(module, node, modules):
                top = target.split(".")[0]
                private = written.startswith("_") and not written.startswith("__") and not target.endswith(written)
                if top == package and private and isinstance(node, ast.ImportFrom) and target != module.name:
                    found.append(Violation("private-access", where, f"imports {written} from {target}: a private "
                                           "name of another module (give it a plain name there)"))
                if top == package:
                    if target in modules:
                        module.imports.append((target, node.lineno, func is not None))
                    if target == package and module.name != package:
                        found.append(Violation("self-import", where, f"imports {package} itself ({written!r})"))
                    if func is not None:
                        found.append(Violation("local-import", where, f"imports {target} inside {func.name}()"))
                elif func is not None and top not in OPTIONAL and NOQA not in module.source_lines[node.lineno - 1]:
                    found.append(Violation("local-import", where, f"imports {target} inside {func.name}() "
                                           f"(only optional packages may: {', '.join(sorted(OPTIONAL))})"))
    return found


def find_cycles(modules: dict[str, Module]) -> list[Violation]:
    """One violation per strongly connected component (Tarjan) of more than one module or a self-loop."""
    graph = {name: sorted({t for t, _, _ in m.imports}) for name, m in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    found = []
    for component in components:
        members = set(component)
        edges = []
        for name in component:
            for target, line, local in modules[name].imports:
                if target in members:
                    edges.append(f"{name} -> {target} (line {line}{', local' if local else ''})")
        path = " -> ".join(shortest_cycle(graph, component[0], members))
        found.append(Violation("cycle", modules[component[0]].rel, f"{path}; edges: " + "; ".join(sorted(set(edges)))))
    return found


def shortest_cycle(graph: dict[str, list[str]], start: str, members: set[str]) -> list[str]:
    """start -> ... -> start, by breadth-first search inside the component."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w in members and w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    return [start]


def docstring_lines(tree: ast.AST) -> set[int]:
    """The line numbers of every module, class and function docstring."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(module: Module, first: int = 1, last: int | None = None) -> int:
    """Lines from ``first`` to ``last`` that hold code: not blank, not a comment, not a docstring."""
    docs = module.docstrings
    last = len(module.source_lines) if last is None else last
    return sum(
        1
        for n in range(first, last + 1)
        if n not in docs and (text := module.source_lines[n - 1].strip()) and not text.startswith("#")
    )


def explained(module: Module, line: int) -> bool:
    """Whether a ``# house: <why>`` comment sits on ``line`` or the line above."""
    return any(EXPLAINED in module.source_lines[n - 1] for n in (line, line - 1) if 0 < n <= len(module.source_lines))


def module_explained(module: Module) -> bool:
    """Whether a ``# house: <why>`` comment sits before the module's first import or definition."""
    body = [n for n in module.tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    end = body[0].lineno if body else len(module.source_lines) + 1
    return any(EXPLAINED in line for line in module.source_lines[: end - 1])


def check_sizes(modules: dict[str, Module], max_module: int, max_function: int) -> list[Violation]:
    found = []
    for module in modules.values():
        lines = code_lines(module)
        if lines > max_module and not module_explained(module):
            found.append(Violation("size", module.rel, f"{lines} code lines (over {max_module}): say why with "
                                   f"'{EXPLAINED} ...' before the first import, or split it by concept"))
        for node in ast.walk(module.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = code_lines(module, node.lineno, node.end_lineno)
                if length > max_function and not explained(module, node.lineno):
                    found.append(Violation("size", f"{module.rel}:{node.lineno}",
                                           f"{node.name}() is {length} code lines (over {max_function}): say why "
                                           f"with '{EXPLAINED} ...' on its def line, or split it"))
    return found


def defined_attributes(tree: ast.Module) -> set[str]:
    """Names this module defines as attributes: ``x._a = ...``, class-body names, methods, fields."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"setattr", "getattr"}:
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                names.add(node.args[1].value)
    return names


def module_aliases(module: Module, modules: dict[str, Module], package: str) -> dict[str, str]:
    """Local names bound to modules of the package (``from zero_jax._audit import hlo``, ``import x as m``)."""
    aliases = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == package:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else package
        elif isinstance(node, ast.ImportFrom):
            for (target, written), alias in zip(resolve(module, node, modules), node.names, strict=True):
                if target in modules and target.endswith(f".{written}"):
                    aliases[alias.asname or written] = target
    return aliases


def check_private(modules: dict[str, Module], package: str) -> list[Violation]:
    found = []
    for module in modules.values():
        aliases = module_aliases(module, modules, package)
        own = defined_attributes(module.tree)
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if node.attr in NAMEDTUPLE_API:
                continue
            value, where = node.value, f"{module.rel}:{node.lineno}"
            if isinstance(value, ast.Name) and value.id in aliases:
                if aliases[value.id] != module.name:
                    found.append(Violation("private-access", where, f"{value.id}.{node.attr}: private name of "
                                           f"{aliases[value.id]} (give it a plain name there)"))
            elif isinstance(value, ast.Name) and value.id in {"self", "cls"}:
                continue
            elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            elif isinstance(value, ast.Name | ast.Attribute | ast.Subscript | ast.Call) and node.attr not in own:
                found.append(Violation("private-access", where, f"{ast.unparse(node)}: {node.attr} is not defined "
                                       "in this module"))
    return found


def is_mutable(value: ast.AST) -> bool:
    if isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in MUTABLE_CALLS
    return False


def module_containers(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and is_mutable(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and node.value is not None and is_mutable(node.value):
            if isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def local_names(func: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    args = func.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    for node in ast.walk(func):
        if isinstance(node, ast.Global):
            names.difference_update(node.names)
    return names


def check_globals(modules: dict[str, Module]) -> list[Violation]:
    found = []
    for module in modules.values():
        containers = module_containers(module.tree)
        shadowed: dict[ast.AST, set[str]] = {}
        for node, func in scopes(module.tree):
            if func is None:
                continue
            where = f"{module.rel}:{node.lineno}" if hasattr(node, "lineno") else module.rel
            if isinstance(node, ast.Global):
                found.append(Violation("global-mutation", where, f"global {', '.join(node.names)} in {func.name}()"))
                continue
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                target, how = node.func.value, f".{node.func.attr}()"
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
                target, how = node.value, "[...] = / del"
            while isinstance(target, ast.Subscript):  # _CACHE[k].append(v), _CACHE[k][j] = v
                target = target.value
            if isinstance(target, ast.Name) and target.id in containers:
                if func not in shadowed:
                    shadowed[func] = local_names(func)
                if target.id not in shadowed[func]:
                    name = getattr(func, "name", "<lambda>")
                    found.append(Violation("global-mutation", where,
                                           f"module-level {target.id} mutated in {name}() ({how})"))
    return found


def unit_of(name: str, package: str) -> str:
    """The floor unit of a module: its concept folder (``_step``), or the module itself at the package root
    (``measure``, ``__init__`` for the package's own ``__init__.py``)."""
    parts = name.split(".")[1:]
    return parts[0] if parts else "__init__"


def unit_graph(modules: dict[str, Module], package: str) -> dict[str, set[str]]:
    """Unit -> the other units its modules import."""
    graph: dict[str, set[str]] = {unit_of(m, package): set() for m in modules}
    for name, module in modules.items():
        for target, _, _ in module.imports:
            a, b = unit_of(name, package), unit_of(target, package)
            if a != b:
                graph[a].add(b)
    return graph


def find_folder_cycles(modules: dict[str, Module], package: str) -> list[Violation]:
    """One violation per pair of units that import each other (directly or around a loop of units)."""
    graph = unit_graph(modules, package)
    found = []
    for unit in sorted(graph):
        reach, frontier = set(), list(graph[unit])
        while frontier:
            v = frontier.pop()
            if v not in reach:
                reach.add(v)
                frontier.extend(graph[v])
        if unit in reach:
            back = sorted(u for u in graph[unit] if unit in _reach(graph, u))
            where = f"{package}/{unit}" if not unit.startswith("__") else package
            found.append(Violation("folder-cycle", where, f"{unit} imports {', '.join(back)}, which import it back"))
    return found


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, frontier = set(), [start]
    while frontier:
        for w in graph[frontier.pop()]:
            if w not in seen:
                seen.add(w)
                frontier.append(w)
    return seen


def floors(modules: dict[str, Module], package: str) -> dict[str, int]:
    """Unit -> its floor: 1 for a unit that imports no other, else one above the highest it imports."""
    graph = unit_graph(modules, package)
    memo: dict[str, int] = {}

    def floor(u: str, seen: frozenset[str] = frozenset()) -> int:
        if u not in memo:
            memo[u] = 1 + max((floor(v, seen | {u}) for v in graph[u] if v not in seen), default=0)
        return memo[u]

    return {u: floor(u) for u in graph}


def reading_order(modules: dict[str, Module], package: str, unit: str) -> list[str]:
    """A unit's modules (their last name) in the order they import each other (imported first); among
    modules free to go next, the one its folder's docstring names first (in ``double backquotes``)."""
    members = {m: mod for m, mod in modules.items() if unit_of(m, package) == unit and not mod.is_package}
    doc = ast.get_docstring(modules[f"{package}.{unit}"].tree) or "" if f"{package}.{unit}" in modules else ""
    named = {m: doc.find(f"``{m.rsplit('.', 1)[-1]}``") % (len(doc) + 1) for m in members}  # unnamed: last
    deps = {m: {t for t, _, _ in mod.imports if t in members and t != m} for m, mod in members.items()}
    order: list[str] = []
    while deps:
        ready = [m for m, d in deps.items() if d <= set(order)] or list(deps)  # a cycle (reported elsewhere)
        first = min(ready, key=lambda m: (named[m], m))
        order.append(first)
        del deps[first]
    return [m.rsplit(".", 1)[-1] for m in order]


def summary(modules: dict[str, Module], package: str, unit: str) -> str:
    """The first sentence of the unit's docstring (its folder's ``__init__.py`` or the module's own)."""
    name = package if unit == "__init__" else f"{package}.{unit}"
    module = modules.get(name)
    doc = ast.get_docstring(module.tree) if module is not None else None
    text = " ".join((doc or "").split())
    cut = text.find(". ")
    return text if cut < 0 else text[: cut + 1]


def load_with_imports(root: Path) -> dict[str, Module]:
    """The package's modules with their imports resolved."""
    root = Path(root).resolve()
    modules = load(root)
    collect_imports(modules, root.name)
    return modules


def drawing(root: Path, width: int = 104) -> str:
    """The floor drawing: one row per floor, top floor first; each unit with its modules and summary."""
    root = Path(root).resolve()
    package = root.name
    modules = load_with_imports(root)
    level = floors(modules, package)
    rows = []
    for f in sorted(set(level.values()), reverse=True):
        cells = []
        for unit in sorted(u for u, lv in level.items() if lv == f):
            folder = (root / unit).is_dir()
            label = f"{unit}/" if folder else ("__init__.py" if unit == "__init__" else f"{unit}.py")
            mods = " ".join(reading_order(modules, package, unit)) if folder else ""
            cells.append((label, mods, summary(modules, package, unit)))
        for k, (label, mods, text) in enumerate(cells):
            head = f"floor {f:<3}" if k == 0 else " " * 9
            left = [label] + (textwrap.wrap(mods, 26, initial_indent="  ", subsequent_indent="  ") if mods else [])
            right = textwrap.wrap(text, width - 40) or [""]
            for n in range(max(len(left), len(right))):
                a = left[n] if n < len(left) else ""
                b = right[n] if n < len(right) else ""
                rows.append(f"{head if n == 0 else ' ' * 9} {a:<29} {b}".rstrip())
        rows.append(" " * 9 + " " + "-" * (width - 10))
    return "\n".join(rows[:-1])


def numbers(root: Path, max_module: int = 800, max_function: int = 80) -> dict[str, object]:
    """The house in numbers: modules, units, floors, flat modules at the root, modules per concept folder,
    the largest module and function (code lines), cycles."""
    root = Path(root).resolve()
    package = root.name
    modules = load_with_imports(root)
    level = floors(modules, package)
    folders = sorted(u for u in level if (root / u).is_dir())
    per_folder = {u: sum(1 for m in modules.values() if unit_of(m.name, package) == u and not m.is_package)
                  for u in folders}  # fmt: skip
    largest = max(modules.values(), key=code_lines)
    functions = [(code_lines(m, n.lineno, n.end_lineno), f"{m.rel}:{n.lineno} {n.name}()")
                 for m in modules.values() for n in ast.walk(m.tree)
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]  # fmt: skip
    flat = sorted(m.rel for m in modules.values() if m.name.count(".") == 1 and not m.is_package
                  and not m.name.endswith(("__main__", "_version")))  # fmt: skip
    return {
        "modules": len(modules),
        "concept folders": len(folders),
        "floors": max(level.values()),
        "flat modules at the root": len(flat),
        "modules per concept folder": per_folder,
        "largest module (code lines)": f"{code_lines(largest)} {largest.rel}",
        "largest function (code lines)": "{} {}".format(*max(functions)),
        "import cycles": len(find_cycles(modules)),
        "folder cycles": len(find_folder_cycles(modules, package)),
    }


def check(root: Path, max_module_lines: int = 800, max_function_lines: int = 80) -> list[Violation]:
    """Every violation of the house rules in the package at ``root``, sorted."""
    root = Path(root).resolve()
    package = root.name
    modules = load(root)
    found = collect_imports(modules, package)
    cycles = find_cycles(modules)
    in_cycles = {unit_of(m, package) for c in cycles for m in c.detail.split(";")[0].split(" -> ")}
    found += cycles
    found += [v for v in find_folder_cycles(modules, package) if v.where.split("/")[-1] not in in_cycles
              and not (v.where == package and "__init__" in in_cycles)]  # a module cycle is named once  # fmt: skip
    found += check_sizes(modules, max_module_lines, max_function_lines)
    found += check_private(modules, package)
    found += check_globals(modules)
    return sorted(set(found), key=sort_key)


def sort_key(v: Violation) -> tuple:
    path, _, line = v.where.partition(":")
    return KINDS.index(v.kind), path, int(line or 0), v.detail


def table(found: list[Violation]) -> str:
    if not found:
        return "house clean: 0 violations"
    width = max(len(v.where) for v in found)
    rows = [f"{'kind':<16} {'where':<{width}} detail"]
    rows += [f"{v.kind:<16} {v.where:<{width}} {v.detail}" for v in found]
    counts = ", ".join(f"{k}: {n}" for k in KINDS if (n := sum(v.kind == k for v in found)))
    return "\n".join(rows + [f"{len(found)} violation{'s' * (len(found) != 1)} ({counts})"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent / "zero_jax")
    parser.add_argument("--max-module-lines", type=int, default=800)
    parser.add_argument("--max-function-lines", type=int, default=80)
    parser.add_argument("--drawing", action="store_true", help="print the floor drawing instead of checking")
    parser.add_argument("--numbers", action="store_true", help="print the house in numbers instead of checking")
    args = parser.parse_args(argv)
    if not (args.package / "__init__.py").is_file():
        parser.error(f"{args.package} is not a package directory (no __init__.py)")
    if args.drawing:
        print(drawing(args.package))
        return 0
    if args.numbers:
        for key, value in numbers(args.package, args.max_module_lines, args.max_function_lines).items():
            print(f"{key}: {value}")
        return 0
    found = check(args.package, args.max_module_lines, args.max_function_lines)
    print(table(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
