"""Follow a value through zero_jax's calls: how many files it visits, how often it moves between
files, and how often it moves back up a floor.

    python tools/call_path.py                       # the checkout on the path (PYTHONPATH=... for another)

It traces the first call of a stage-3 train step (bf16 compute, ``scan_layers``, so tracing runs
the whole program) with ``sys.setprofile``. The followed values are a ``TrainState`` (the step's
``state``) and a ``GradPlan`` (the gradient program's plan). Two views:

* ``receivers``: the zero_jax calls that receive the value as an argument, in call order; a move is
  two consecutive ones in different files;
* ``extent``: every call from zero_jax code to zero_jax code (the nearest zero_jax caller on the
  stack to the callee: a callback a tree map runs counts from the function that passed it) while a
  call that received the value is on the stack; a move is such a call into another file.

Each counts the files visited, the moves between files and the moves back up a floor (into a file
on a higher floor than the caller's: a callback, or a lower concept calling up). Floors are
``tools/check_house.py``'s: a concept folder, or a module at the package root, one above the highest
it imports. Uses the public API only, so it runs on any checkout.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402

HERE = Path(__file__).resolve().parent
SPEC = importlib.util.spec_from_file_location("check_house", HERE / "check_house.py")
check_house = importlib.util.module_from_spec(SPEC)
sys.modules["check_house"] = check_house
SPEC.loader.exec_module(check_house)

PACKAGE = Path(zj.__file__).resolve().parent
FOLLOWED = ("TrainState", "GradPlan")


def unit_floors() -> dict[str, int]:
    """Each source file of the package -> its floor."""
    modules = check_house.load_with_imports(PACKAGE)
    level = check_house.floors(modules, PACKAGE.name)
    return {str(m.path.resolve()): level[check_house.unit_of(name, PACKAGE.name)] for name, m in modules.items()}


def record(run: Callable[[], Any]) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """For each followed type: ``receivers``, the files of the calls that received one, in order (as
    (previous, this) pairs); ``extent``, the (caller file, callee file) of every zero_jax-to-zero_jax
    call while a receiving call is on the stack."""
    out: dict[str, dict[str, list[tuple[str, str]]]] = {t: {"receivers": [], "extent": []} for t in FOLLOWED}
    stack: list[tuple[str | None, frozenset[str]]] = []  # (zero_jax file or None, the followed values live here)
    last: dict[str, str | None] = {t: None for t in FOLLOWED}

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "return":
            if stack:
                stack.pop()
            return
        if event != "call":
            return
        code = frame.f_code
        mine = code.co_filename.startswith(str(PACKAGE))
        path = str(Path(code.co_filename).resolve()) if mine else None
        live = stack[-1][1] if stack else frozenset()
        if mine:
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            kinds = {type(frame.f_locals.get(n)).__name__ for n in names}
            got = {t for t in FOLLOWED if t in kinds}
            caller = next((f for f, _ in reversed(stack) if f is not None), None)
            for t in FOLLOWED:
                if t in got:
                    if last[t] is not None:
                        out[t]["receivers"].append((last[t], path))
                    last[t] = path
                if (t in live or t in got) and caller is not None:
                    out[t]["extent"].append((caller, path))
            live = live | got
        stack.append((path, live))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return out


def step() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(0)
    params = {
        "layers": {"w": jnp.asarray(rng.normal(size=(4, 64, 64)) / 8, jnp.float32), "b": jnp.zeros((4, 64))},
        "head": jnp.asarray(rng.normal(size=(64, 1)) / 8, jnp.float32),
    }
    policy = zj.ZeroPolicy(3, mesh, stacked="layers", precision=zj.Precision(compute_dtype=jnp.bfloat16))

    def loss(p: dict, batch: dict) -> jax.Array:
        x = zj.scan_layers(lambda w, h: jnp.tanh(h @ w["w"] + w["b"]), p["layers"], batch["x"], policy)
        return jnp.mean((x @ zj.gather(p["head"], policy) - batch["y"]) ** 2)

    tx = zj.shard_optimizer(optax.adamw(1e-3), policy)
    state = zj.init_state(params, tx, policy)
    train_step = zj.make_train_step(loss, tx, policy, gather="manual")
    jax.block_until_ready(train_step(state, {"x": jnp.ones((32, 64)), "y": jnp.ones((32, 1))}))


def summarize(pairs: list[tuple[str, str]], floor: dict[str, int]) -> dict[str, int]:
    moves = [(a, b) for a, b in pairs if a != b]
    up = [(a, b) for a, b in moves if floor[b] > floor[a]]
    return {
        "files visited": len({f for pair in pairs for f in pair}),
        "moves between files": len(moves),
        "moves back up a floor": len(up),
        "distinct moves": len(set(moves)),
        "distinct moves up": len(set(up)),
    }


def main() -> None:
    floor = unit_floors()
    calls = record(step)
    print(f"package: {PACKAGE}")
    for followed, views in calls.items():
        for view, pairs in views.items():
            row = summarize(pairs, floor)
            print(f"{followed} {view}: " + ", ".join(f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
