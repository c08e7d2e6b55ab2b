"""The command line (``python -m zero_jax demo | plan | audit``) on bad input, and the demo's first impression.

CLI tests call ``zero_jax._cli.cli.main`` in this process; only the demo smoke test starts ``python -m zero_jax``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import child_env, make_mesh

import zero_jax as zj
from zero_jax._cli import cli as cli
from zero_jax._cli import demo as _demo
from zero_jax.models import TransformerConfig

PLAN = ["plan", "--params", "7e9", "--device-memory", "80GB"]
TINY = ["--depth", "2", "--dim", "32", "--vocab", "64", "--seq", "16", "--heads", "2", "--batch-per-device", "1"]


def _one_line_error(capsys, words: tuple[str, ...]) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in captured.err + captured.out
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


# -- plan -----------------------------------------------------------------------------------------------------


def test_plan_bandwidth_without_a_unit_is_an_error_naming_the_units(capsys) -> None:
    assert cli.main([*PLAN, "--bandwidth", "300", "--compute-time", "10s"]) == 2
    _one_line_error(capsys, ("--bandwidth", "'300' has no unit", "GB", "GiB", "per second", "'300GB/s'"))
    assert cli.main([*PLAN, "--bandwidth", "300GB/s", "--compute-time", "10s"]) == 0  # with a unit it reads


@pytest.mark.parametrize("flag", ["--replicas", "--devices"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_plan_refuses_zero_and_negative_counts(capsys, flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*PLAN, flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a positive integer (>= 1), got {value}" in err, err


def test_plan_plot_to_an_unwritable_path_is_a_one_line_error(tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    target = str(blocker / "chart.png")
    assert cli.main([*PLAN, "--plot", target]) == 2
    _one_line_error(capsys, ("--plot: cannot write the figure to", target))


def test_sized_config_matches_the_requested_parameter_count() -> None:
    base = TransformerConfig(vocab=32000, dim=2048, depth=1, heads=16, seq=512)  # plan --compile's defaults
    for target in (7e9, 1.3e9, 2e8, 2e7):
        cfg = cli.sized_config(base, target)
        assert cfg.num_params() == pytest.approx(target, rel=0.03), (target, cfg)
        assert cfg.dim % cfg.heads == 0 and cfg.vocab == 32000
    assert cli.sized_config(base, 7e9).dim == 2048  # wide enough: only the depth changes
    assert cli.sized_config(base, 2e7).dim < 2048  # the embeddings alone would be 131M: narrower


@pytest.mark.slow
def test_plan_compile_compiles_a_model_of_the_requested_size(capsys) -> None:
    argv = [*PLAN[:1], "--params", "3M", "--device-memory", "16GB", "--devices", "4", "--compile", "--stages", "3"]
    argv += ["--vocab", "256", "--dim", "128", "--heads", "4", "--seq", "32"]
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    m = re.search(r"sized to --params 3M: dim (\d+), depth (\d+).*?Φ = ([\d,]+) parameters", out)
    assert m, out
    phi = int(m.group(3).replace(",", ""))
    assert phi == pytest.approx(3e6, rel=0.03)
    assert f"Compiled step (reference transformer, Φ = {phi:,}" in out  # the compiled half says the same Φ


def test_plan_compile_with_an_explicit_depth_says_which_model_it_compiles(monkeypatch, capsys) -> None:
    calls = []
    monkeypatch.setattr(cli, "_compiled_table", lambda *a: calls.append(a))  # the compile itself: tested above
    argv = [*PLAN, "--compile", "--depth", "2", "--dim", "64", "--vocab", "64", "--heads", "2", "--seq", "16"]
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    phi = TransformerConfig(vocab=64, dim=64, depth=2, heads=2, seq=16).num_params()
    assert f"as given (--depth 2, --dim 64): Φ = {phi:,} parameters, not --params 7e9" in out, out
    assert calls and calls[0][3]["depth"] == 2


def test_plan_bad_heads_is_a_one_line_error(capsys) -> None:
    assert cli.main([*PLAN, "--compile", "--dim", "64", "--heads", "3"]) == 2
    _one_line_error(capsys, ("dim=64 must divide by heads=3",))


# -- audit ----------------------------------------------------------------------------------------------------


def _tiny_step(n: int) -> tuple[zj.TrainStep, zj.TrainState, jax.Array]:
    policy = zj.ZeroPolicy(stage=2, mesh=make_mesh(n))
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    state = zj.init_state({"w": jnp.ones((256, 64)) * 0.01, "b": jnp.zeros(64)}, tx, policy)
    step = zj.make_train_step(lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2), tx, policy)
    return step, state, jnp.ones((16, 256))


def test_audit_works_on_a_one_device_mesh() -> None:
    step, state, batch = _tiny_step(1)
    report = zj.audit(step, state, batch).check()
    assert report.num_devices == 1 and all(c.group_size == 1 for c in report.collectives)  # no-op collectives
    assert report.comm.measured == report.comm.theory == 0.0
    # Everything whole on the one device: w (256 x 64) + b (64) in fp32, Adam's two moments and its count.
    assert report.state_bytes["params"] == report.state_bytes["grads"] == (256 * 64 + 64) * 4
    assert report.state_bytes["optimizer"] == 2 * (256 * 64 + 64) * 4 + 4
    # The types of the report's fields are public names.
    assert isinstance(report.comm, zj.Communication) and all(isinstance(x, zj.LeafBytes) for x in report.leaves)
    assert report.collectives and all(isinstance(c, zj.Collective) for c in report.collectives)
    assert zj.Violation("kind", "subject", "message").kind == "kind" and "Violation" in zj.__all__


def test_audit_refuses_a_donated_state() -> None:
    step, state, batch = _tiny_step(8)
    new_state, _ = step(state, batch)
    with pytest.raises(ValueError, match=r"zj\.audit: .* donated to an earlier train step"):
        zj.audit(step, state, batch)
    zj.audit(step, new_state, batch, grads=False).check()  # the returned state is fine


def test_audit_cli_devices_zero_is_a_one_line_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["audit", "--devices", "0"])
    assert exit_.value.code == 2
    assert "argument --devices: must be a positive integer (>= 1), got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("heads", "words"), [("3", "dim=64 must divide by heads=3"), ("0", "argument --heads")])
def test_audit_cli_bad_heads_is_a_one_line_error(capsys, heads: str, words: str) -> None:
    argv = ["audit", "--stages", "1", "--dim", "64", "--heads", heads]
    if heads == "0":
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert words in capsys.readouterr().err
    else:
        assert cli.main(argv) == 2
        _one_line_error(capsys, (words,))


def test_audit_cli_on_a_started_backend_of_another_size_is_a_one_line_error(capsys) -> None:
    assert cli.main(["audit", "--devices", "4", *TINY]) == 2  # this process already runs 8 devices
    _one_line_error(capsys, ("--devices 4: JAX already started with 8 devices",))


# -- demo -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_prints_at_once_shows_progress_and_writes_the_memory_figure(tmp_path) -> None:
    png = tmp_path / "memory.png"
    cmd = [sys.executable, "-m", "zero_jax", "demo", "--steps", "3", "--stages", "0", "3", "--devices", "4", *TINY]
    env = child_env(*sys.path, COLUMNS="150")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import zero_jax"], env=env, check=True)
    import_s = time.perf_counter() - start  # what any `python -m zero_jax` pays before its first line
    start = time.perf_counter()
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    with subprocess.Popen([*cmd, "--plot", str(png)], **pipe, env=env) as proc:
        first = proc.stdout.readline().decode()
        first_s = time.perf_counter() - start
        rest = proc.stdout.read().decode()
        assert proc.wait(timeout=600) == 0, first + rest
    total_s = time.perf_counter() - start
    print(f"demo: first line after {first_s:.2f} s (import zero_jax {import_s:.2f} s), total {total_s:.1f} s")
    assert first.startswith("zero_jax demo: ZeRO stages 0 3 on the reference transformer"), first
    # Within 5 s on an idle machine; on a loaded one, right after the import, before any JAX work.
    assert first_s < max(5.0, import_s + 2.0), (first_s, import_s)
    # One progress bar per stage, finished: 3/3 steps and the last loss.
    assert re.search(r"stage 0 DP .*3/3 steps\s+loss \d\.\d{4}", rest), rest
    assert re.search(r"stage 3 P_os\+g\+p .*3/3 steps\s+loss \d\.\d{4}", rest), rest
    assert re.search(r"^\s+3\s+\d\.\d{4}\s", rest, re.M), rest  # the table's stage-3 row
    assert f"memory figure written to {png}" in rest
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000


@pytest.mark.slow
def test_demo_without_matplotlib_says_so_in_one_line(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert _demo.pyplot() is None
    monkeypatch.setattr(_demo, "run_stage", lambda s, stage, on_step=None: _FAKE_RUN)  # training: tested above
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--stages", "2", "--steps", "1", "--devices", "8", *TINY]) == 0
    out = capsys.readouterr().out
    assert _demo.NO_MATPLOTLIB in out.splitlines()
    assert not list(tmp_path.iterdir())  # no figure


_FAKE_RUN = _demo.StageRun(
    2, 3.5, {"params": 4096, "grads": 512, "opt": 1024}, {"params": 4096, "grads": 512, "opt": 1024}, 9000, 1.0
)


def test_demo_figure_draws_measured_beside_formula(tmp_path) -> None:
    plt = _demo.pyplot()
    assert plt is not None
    held = {"params": 4 << 20, "grads": 2 << 20, "opt": 1 << 20}
    runs = [_demo.StageRun(s, 3.0, held, held, 1, 1.0) for s in range(4)]
    _demo.plot_runs(plt, runs, str(tmp_path / "f.png"), "test")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="cannot write the figure to"):
        _demo.plot_runs(plt, runs, str(tmp_path / "missing" / "f.png"), "test")


# -- the house rules, for the analysis and CLI modules ------------------------------------------------------------

MINE = (
    "_units", "_theory", "_plan", "_child", "_report", "_violations", "_audit", "_measure", "_cli", "_demo",
    "__main__", "models.transformer", "models.__init__",
)  # fmt: skip
OPTIONAL = {"matplotlib", "matplotlib.pyplot"}


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _module_imports(path: str) -> tuple[list[tuple[str, int, bool]], ast.Module]:
    """(imported module, line, inside a function) for every import of a source file."""
    tree = ast.parse(_read(path))
    out = []
    functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    local = {id(n) for f in functions for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in local) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "zero_jax" else [node.module]
            out += [(n, node.lineno, id(node) in local) for n in names]
    return out, tree


def test_analysis_and_cli_modules_keep_the_house_rules() -> None:
    root = os.path.dirname(zj.__file__)
    files = {
        ("zero_jax." + os.path.relpath(os.path.join(d, f), root)[:-3].replace(os.sep, ".")).replace(".__init__", ""): (
            os.path.join(d, f)
        )
        for d, _, fs in os.walk(root)
        for f in fs
        if f.endswith(".py")
    }
    graph: dict[str, set[str]] = {}
    problems = []
    for mod, path in files.items():
        imports, tree = _module_imports(path)
        graph[mod] = {m for m, _, _ in imports if m in files and m != mod}
        if not any(mod == f"zero_jax.{m}".replace(".__init__", "") for m in MINE):
            continue
        lines = _read(path).count("\n")
        problems += [f"{mod}: {lines} lines"] if lines > 500 else []
        for f in ast.walk(tree):
            if isinstance(f, ast.FunctionDef) and f.end_lineno - f.lineno + 1 > 100:
                problems.append(f"{mod}.{f.name}: {f.end_lineno - f.lineno + 1} lines")
        for m, line, local in imports:
            if m == "zero_jax" or (local and m not in OPTIONAL):
                problems.append(f"{mod}:{line}: imports {m}" + (" inside a function" if local else ""))
        for node in ast.walk(tree):  # no x._private across modules
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_"):
                if node.value.id in {"_measure", "_demo", "_cli", "_audit", "_plan", "_theory", "_units", "_report"}:
                    problems.append(f"{mod}:{node.lineno}: {node.value.id}.{node.attr}")

    def cycle_through(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return [*trail, start]
                if nxt not in trail:
                    stack.append((nxt, [*trail, nxt]))
        return None

    for m in MINE:
        mod = f"zero_jax.{m}".replace(".__init__", "")
        if mod in graph and (cycle := cycle_through(mod)):
            problems.append("cycle: " + " -> ".join(cycle))
    assert not problems, "\n".join(problems)
