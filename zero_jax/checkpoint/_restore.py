"""Restore: a checkpoint read straight into the layout of a target policy.

The target state's abstract layout comes from ``init_state(abstract_params,
tx, policy)``; each of its leaves names the checkpoint leaf it is read from
(:func:`_source`), every mismatch between the two is collected before
anything is read, and each leaf is then read by orbax into its target
sharding and stored shape (see :func:`._orbax.read`). Checksums recorded at
save time are compared on what was read.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax._base.tree import PyTree
from zero_jax._layout.leaf import is_layout
from zero_jax._policy.memory import to_device
from zero_jax._policy.placement import to_logical
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._policy.precision import LossScaleState
from zero_jax._processes.multihost import exchange
from zero_jax._step.optimizer import ShardedTransformation
from zero_jax._step.state import TrainState, init_state
from zero_jax.checkpoint._orbax import error_text, quiet, read
from zero_jax.checkpoint._record import (
    RESTORE_ANOTHER,
    CorruptCheckpointError,
    Entry,
    checksums,
    committed_steps,
    leaf_text,
    pick_step,
    read_metadata,
    resolve,
    state_entries,
    tree_from_metadata,
)

OPTIMIZER_STATE_CHOICES = ("restore", "reinit")

NOT_A_POLICY = "{where}: policy must be a zj.ZeroPolicy (the target layout), got {got}."
NOT_SHARDED_TX = (
    "{where}: tx must be the optimizer sharded for the target policy, zj.shard_optimizer(optax_tx, policy); got {got}."
)
BAD_OPTIMIZER_STATE = (
    "{where}: optimizer_state must be 'restore' (read the optimizer state from the checkpoint) or 'reinit' "
    "(start it afresh from tx for the restored parameters), got {got!r}."
)


def restore(
    directory: str | os.PathLike[str],
    *,
    policy: ZeroPolicy,
    tx: ShardedTransformation,
    step: int | None = None,
    like: PyTree | TrainState | None = None,
    verify: bool = True,
    model_state: PyTree = None,
    optimizer_state: str = "restore",
    fallback: bool = False,
) -> TrainState:
    """Restore checkpoint ``step`` (default: the latest) of ``directory`` laid out for ``policy``.

    ``policy`` may have another device count, another stage, or both, than
    the saving run: each leaf is read straight into its target sharding and
    stored shape (the saving N's padding dropped, the target N's added as
    zeros), never gathered whole on one device. ``tx`` is the optimizer
    sharded for ``policy`` (``zj.shard_optimizer(optax_tx, policy)``): it
    rebuilds the optax state's tree, whose leaves are matched by key path.
    ``directory`` may be relative (to the current directory at the call).

    ``like`` (optional): the parameters (arrays or ``jax.ShapeDtypeStruct``)
    or a TrainState of the model being restored. Its tree is used for the
    result and checked against the checkpoint (an error names every
    mismatched leaf and both shapes). Without it the parameter tree is
    rebuilt from the checkpoint (nested dicts and lists).

    The model state (``state.model_state``: batch statistics and the like)
    is restored, replicated, when the checkpoint has one. Its tree comes from
    ``model_state=`` (a template: arrays or ``jax.ShapeDtypeStruct``s, e.g.
    ``adapted.model_state``), from ``like`` when that is a TrainState with
    one, or else is rebuilt from the checkpoint (nested dicts and lists; other
    trees, such as an ``eqx.nn.State``, need the template).

    ``optimizer_state``: ``"restore"`` (default) reads the optimizer state,
    whose tree must match ``tx``'s leaf for leaf (a checkpoint trained with
    Adam restored with an SGD ``tx`` is an error naming the differing
    leaves); ``"reinit"`` ignores the checkpoint's optimizer state and starts
    ``tx``'s afresh for the restored parameters (to change optimizer).

    ``verify`` (default) checks every leaf read in its saved dtype against
    checksums recorded at save time (one pass over the restored state).

    ``fallback``: when the step (default: the latest) is corrupt (a file
    unreadable, truncated, or not matching its checksums), restore the
    newest step before it that reads and verifies instead, with a
    ``UserWarning`` naming each step skipped and why. A step of another
    model or optimizer is not corruption: that error is raised as always.
    On several processes (``jax.distributed``) every process restores the
    same step: the newest that every process reads and verifies (each
    process's verdict on each step goes through the coordinator; a step one
    process alone finds corrupt is skipped by all, the warning naming that
    process).

    Raises ``FileNotFoundError`` for a missing or empty directory or a step
    that does not exist (listing the steps that do), ``ValueError`` for a
    checkpoint of another model or optimizer, and
    :class:`~zero_jax.checkpoint.CorruptCheckpointError` (a ``ValueError``)
    for an unreadable (truncated, corrupted) file.
    """
    where = "zj.restore"
    _check_arguments(policy, tx, optimizer_state, where)
    path = resolve(directory)
    reinit = optimizer_state == "reinit"
    with quiet():
        picked = pick_step(path, step, where)
        candidates = _candidates(path, step, picked, fallback)
        skipped: list[tuple[int, str]] = []
        for candidate in candidates:
            try:
                state = _restore_step(path, candidate, policy, tx, like, model_state, verify, reinit, where)
            except CorruptCheckpointError as e:
                if not fallback:
                    raise
                skipped.append((candidate, str(e).splitlines()[0]))
                continue
            if skipped:
                warnings.warn(_fell_back(where, path, skipped, candidate), UserWarning, stacklevel=2)
            return state
    raise CorruptCheckpointError(ALL_CORRUPT.format(where=where, path=path, steps=_skipped_text(skipped)))


# -- several processes: one step, agreed ---------------------------------------------------------------------


def _candidates(path: Any, step: int | None, picked: int, fallback: bool) -> list[int]:
    """The steps to try, newest first: ``picked``, then (``fallback``) each committed step before it.

    On several processes the lists of all processes are merged (a process
    whose view of ``path`` lacks a step finds it unreadable in
    :func:`_metadata_here`), so every process tries the same steps in the
    same order.
    """
    mine = [s for s in committed_steps(path) if s <= picked]
    if jax.process_count() == 1:
        return list(reversed(mine)) if fallback else [picked]
    seen = exchange("restore_steps", json.dumps([picked, mine]), "zj.restore")
    views = [json.loads(text) for text in seen.values()]
    newest = picked if step is not None else max(view[0] for view in views)
    if not fallback:
        return [newest]
    return sorted({s for view in views for s in view[1] if s <= newest}, reverse=True)


ON_PROCESS = "process {process} of {count}: {error}"
T = TypeVar("T")


def _agreed(attempt: Callable[[], T], step: int) -> T:
    """``attempt()``, with one verdict on every process.

    On several processes each one may read other files (its own shards, its
    own view of a shared directory), so one may find step ``step`` corrupt
    alone. The verdicts go through the coordinator's key-value store (no
    collective, which the others would wait in); when any process failed,
    every process raises the first failing process's error, naming it, and
    all move on to the same earlier step together.
    """
    try:
        result = attempt()
    except CorruptCheckpointError as e:
        _share_verdict(str(e), step)  # the first failing process's error, on several processes
        raise
    _share_verdict("", step)
    return result


def _share_verdict(error: str, step: int) -> None:
    """Publish this process's verdict on ``step`` (``""``: read) and raise the first failing process's error."""
    if jax.process_count() == 1:
        return
    seen = exchange("restore", error, f"zj.restore of checkpoint step {step}")
    failed = [(p, text) for p, text in seen.items() if text]
    if failed:
        process, text = failed[0]
        raise CorruptCheckpointError(ON_PROCESS.format(process=process, count=len(seen), error=text)) from None


MISSING_HERE = (
    "{where}: checkpoint step {step} is not in {path} as this process sees it (steps there: {present}); another "
    "process listed it. Every process must see the same checkpoint directory. " + RESTORE_ANOTHER
)


def _metadata_here(path: Any, step: int, where: str) -> dict[str, Any]:
    """``step``'s record, or a :class:`CorruptCheckpointError` when this process's view lacks the step."""
    present = committed_steps(path)
    if step not in present:
        raise CorruptCheckpointError(MISSING_HERE.format(where=where, step=step, path=path, present=present))
    return read_metadata(path, step, where)


FELL_BACK = (
    "{where}: restored checkpoint step {step} of {path} because the newer step(s) are corrupt: {skipped}. "
    "Training resumes from step {step}; move the corrupt step directories aside before the run saves those step "
    "numbers again (a save refuses a step that exists)."
)
ALL_CORRUPT = (
    "{where}: every checkpoint step of {path} up to the one asked for is corrupt: {steps}. Nothing restorable is "
    "left there; restore from another copy, or start afresh."
)


def _skipped_text(skipped: list[tuple[int, str]]) -> str:
    return "; ".join(f"step {s} ({text})" for s, text in skipped)


def _fell_back(where: str, path: Any, skipped: list[tuple[int, str]], step: int) -> str:
    return FELL_BACK.format(where=where, path=path, skipped=_skipped_text(skipped), step=step)


def _restore_step(
    path: Any,
    step: int,
    policy: ZeroPolicy,
    tx: ShardedTransformation,
    like: Any,
    model_state: Any,
    verify: bool,
    reinit: bool,
    where: str,
) -> TrainState:
    """:func:`restore` of one committed step (inside ``quiet``); each phase that may find it corrupt on one
    process alone is :func:`_agreed` before the next (whose collectives every process must reach)."""
    meta = _agreed(lambda: _metadata_here(path, step, where), step)
    abstract = _target_state(meta, policy, tx, like, model_state, where)
    target = state_entries(abstract)
    sources = _sources(target, meta, reinit, where)
    restored = _agreed(lambda: _read_leaves(path, step, target, sources, where), step)
    restored = _fill_loss_scale(restored, target, policy)
    restored = _zero_overlapping_padding(restored, target, sources, meta)
    if verify:
        what, present = f"{where}: checkpoint step {step} in {path}", committed_steps(path)
        _agreed(lambda: _verify(restored, target, sources, meta, what, present), step)
    leaves = [a if r is None else r for r, a in zip(restored, jax.tree.leaves(abstract), strict=True)]
    state = jax.tree.unflatten(jax.tree.structure(abstract), leaves)
    if reinit:
        state = state.replace(opt_state=_fresh_opt_state(state, abstract, tx))
    return state


def _check_arguments(policy: Any, tx: Any, optimizer_state: Any, where: str) -> None:
    if not isinstance(policy, ZeroPolicy):
        raise TypeError(NOT_A_POLICY.format(where=where, got=type(policy).__name__))
    if not isinstance(tx, ShardedTransformation):
        raise TypeError(NOT_SHARDED_TX.format(where=where, got=type(tx).__name__))
    if optimizer_state not in OPTIMIZER_STATE_CHOICES:
        raise ValueError(BAD_OPTIMIZER_STATE.format(where=where, got=optimizer_state))


# -- the target ------------------------------------------------------------------------------------------------


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), getattr(x, "dtype", np.asarray(x).dtype)), tree
    )


def _abstract_params(like: Any, meta: dict[str, Any], where: str) -> PyTree:
    if like is None:
        return tree_from_metadata(meta, where)
    if isinstance(like, TrainState):
        return jax.tree.map(
            lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype), like.layouts.tree(), is_leaf=is_layout
        )
    return _abstract(like)


NO_SAVED_MODEL_STATE = (
    "{where}: a model state was asked for (model_state= or like=), but the checkpoint has none: it was saved from a "
    "state without model_state. Restore without it, and start the model state afresh with "
    "state.replace(model_state=...) only if that is what you mean."
)


def _abstract_model_state(like: Any, model_state: Any, meta: dict[str, Any], where: str) -> PyTree:
    """The target's model state as ``ShapeDtypeStruct``s: from ``model_state=``, a
    ``like`` TrainState's, or the checkpoint's own tree; ``None`` when neither
    the checkpoint nor the caller has one."""
    saved = meta.get("model_state")
    if model_state is None and isinstance(like, TrainState):
        model_state = like.model_state
    if model_state is None:
        return None if saved is None else tree_from_metadata(meta, where, "model_state")
    if saved is None:
        raise ValueError(NO_SAVED_MODEL_STATE.format(where=where))
    return _abstract(model_state)


NO_TARGET = (
    "{where}: cannot build the target state from the checkpoint's parameters with this tx and policy ({error}). "
    "Is tx the optimizer of this model?"
)


def _target_state(
    meta: dict[str, Any], policy: ZeroPolicy, tx: ShardedTransformation, like: Any, model_state: Any, where: str
) -> TrainState:
    """The abstract state (``ShapeDtypeStruct``s with their target shardings) to read into."""
    params = _abstract_params(like, meta, where)
    abstract_model_state = _abstract_model_state(like, model_state, meta, where)
    try:
        return init_state(params, tx, policy, model_state=abstract_model_state)
    except (ValueError, TypeError) as e:
        raise ValueError(NO_TARGET.format(where=where, error=e)) from e


# -- which checkpoint leaf each target leaf reads, and every mismatch ----------------------------------------------


def _source(e: Entry, leaves: dict[str, Any]) -> str | None:
    """The checkpoint leaf that target entry ``e`` is read from (``None``: start afresh).

    Mixed precision across a restore: ``params`` come from the checkpoint's
    ``params`` when the dtypes agree, else from its float32 ``master``; a
    target ``master`` from the checkpoint's ``master``, else built from its
    ``params``; a float16 loss scale is restored when both sides have one.
    """
    has_master = any(n.startswith("master/") for n in leaves)
    if e.section == "params":
        own = leaves.get(e.name)
        if own is not None and np.dtype(own["dtype"]) != e.dtype and has_master:
            return "master/" + e.rest
        return e.name
    if e.section == "master":
        return e.name if has_master else "params/" + e.rest
    if e.section == "loss_scale":
        return e.name if e.name in leaves else None
    return e.name


def _sources(target: list[Entry], meta: dict[str, Any], reinit: bool, where: str) -> list[str | None]:
    """Each target leaf's source, after checking model, optimizer, model state and shapes."""
    leaves = meta["leaves"]
    _check_params(target, leaves, where)
    if not reinit:
        _check_optimizer(target, leaves, where)
    _check_model_state(target, leaves, where)
    sources = [None if reinit and e.section == "opt_state" else _source(e, leaves) for e in target]
    _check_shapes(target, sources, leaves, where)
    return sources


def _listing(lines: list[str]) -> str:
    shown = lines[:20] + ([f"... and {len(lines) - 20} more"] if len(lines) > 20 else [])
    return "\n".join(f"  {line}" for line in shown)


MODEL_MISMATCH = (
    "{where}: the checkpoint is of another model: {first}. All {count} differing parameter(s):\n{lines}\n"
    "Restore it into the model it was saved from (like= that model's parameters), or check the directory."
)


def _check_params(target: list[Entry], leaves: dict[str, Any], where: str) -> None:
    """Raise once, naming every parameter the checkpoint lacks, has in another shape, or has beyond the model's."""
    saved = {n: leaf for n, leaf in leaves.items() if n.startswith("params/")}
    wanted = [e for e in target if e.section == "params"]
    bad = []
    for e in wanted:
        if e.name not in saved:
            bad.append(f"it has no parameter '{e.rest}' (the model's is {leaf_text(e.shape, e.dtype)})")
        elif tuple(saved[e.name]["shape"]) != e.shape:
            got = tuple(saved[e.name]["shape"])
            bad.append(
                f"parameter '{e.rest}' has shape {got} in the checkpoint but {e.shape} in the model being restored"
            )
    names = {e.name for e in wanted}
    for n, leaf in saved.items():
        if n not in names:
            text = leaf_text(leaf["shape"], leaf["dtype"])
            bad.append(f"it has parameter '{n[len('params/') :]}' ({text}) that the model being restored lacks")
    if bad:
        raise ValueError(MODEL_MISMATCH.format(where=where, first=bad[0], count=len(bad), lines=_listing(bad)))


OPTIMIZER_MISMATCH = (
    "{where}: the checkpoint was saved with another optimizer (or for another model): {first}. All {count} "
    "differing optimizer-state leaves:\n{lines}\nPass the tx the checkpoint was trained with, or "
    'restore(..., optimizer_state="reinit") to start the optimizer state afresh from tx for the restored parameters.'
)


def _check_optimizer(target: list[Entry], leaves: dict[str, Any], where: str) -> None:
    """Raise once, naming every optimizer-state leaf that only one of checkpoint and ``tx`` has."""
    wanted = [e for e in target if e.section == "opt_state"]
    names = {e.name for e in wanted}
    bad = [
        f"its optimizer state has no leaf '{e.name}' ({leaf_text(e.shape, e.dtype)}) that tx's state has"
        for e in wanted
        if e.name not in leaves
    ]
    bad += [
        f"its optimizer state has leaf '{n}' ({leaf_text(leaf['shape'], leaf['dtype'])}) that tx's state lacks"
        for n, leaf in leaves.items()
        if n.startswith("opt_state/") and n not in names
    ]
    if bad:
        raise ValueError(OPTIMIZER_MISMATCH.format(where=where, first=bad[0], count=len(bad), lines=_listing(bad)))


MODEL_STATE_MISMATCH = (
    "{where}: the checkpoint's model state has no leaf '{first}': the model state passed in is of another model. "
    "Missing ({count}): {missing}. Its model-state leaves are {saved}."
)


def _check_model_state(target: list[Entry], leaves: dict[str, Any], where: str) -> None:
    missing = [e.name for e in target if e.section == "model_state" and e.name not in leaves]
    if missing:
        saved = sorted(n for n in leaves if n.startswith("model_state/"))
        shown = f"{saved[:12]}{' ...' if len(saved) > 12 else ''}"
        raise ValueError(
            MODEL_STATE_MISMATCH.format(
                where=where, first=missing[0], count=len(missing), missing=", ".join(missing), saved=shown
            )
        )


SHAPE_MISMATCH = (
    "{where}: the checkpoint is of another model or optimizer: {first}. All {count} differing leaves:\n{lines}\n"
    "Pass the model (like=) and tx the checkpoint was trained with."
)


def _check_shapes(target: list[Entry], sources: list[str | None], leaves: dict[str, Any], where: str) -> None:
    """Raise once, naming every target leaf whose source is absent or of another logical shape."""
    bad = []
    for e, src in zip(target, sources, strict=True):
        if src is None:
            continue
        if src not in leaves:
            bad.append(f"the checkpoint has no leaf '{src}' (wanted {leaf_text(e.shape, e.dtype)})")
        elif tuple(leaves[src]["shape"]) != e.shape:
            got = tuple(leaves[src]["shape"])
            bad.append(f"leaf '{src}' has shape {got} in the checkpoint but {e.shape} in the state being restored")
    if bad:
        raise ValueError(SHAPE_MISMATCH.format(where=where, first=bad[0], count=len(bad), lines=_listing(bad)))


# -- reading ---------------------------------------------------------------------------------------------------

UNREADABLE_STEP = (
    "{where}: checkpoint step {step} in {path} could not be read: a file is missing, truncated or corrupted "
    "({error}). " + RESTORE_ANOTHER
)


def _read_leaves(path: Any, step: int, target: list[Entry], sources: list[str | None], where: str) -> list[Any]:
    """Every target leaf that has a source, read into its target layout (``None`` elsewhere).

    Each target leaf reads one checkpoint leaf; a checkpoint leaf read by two
    targets (params -> params and master) goes in a second pass.
    """
    passes: list[dict[str, int]] = []
    for i, src in enumerate(sources):
        if src is None:
            continue
        free = next((p for p in passes if src not in p), None)
        if free is None:
            passes.append(free := {})
        free[src] = i
    wanted = [
        {
            src: jax.ShapeDtypeStruct(target[i].stored_shape, target[i].dtype, sharding=target[i].sharding)
            for src, i in p.items()
        }
        for p in passes
    ]
    try:
        got = read(path, step, wanted)
    except Exception as e:  # orbax / tensorstore raise many kinds
        error = error_text(e)
        present = committed_steps(path)
        raise CorruptCheckpointError(
            UNREADABLE_STEP.format(where=where, step=step, path=path, error=error, present=present)
        ) from e
    restored: list[Any] = [None] * len(target)
    for p, values in zip(passes, got, strict=True):
        for src, i in p.items():
            restored[i] = values[src]
    return restored


def _fill_loss_scale(restored: list[Any], target: list[Entry], policy: ZeroPolicy) -> list[Any]:
    """A fresh float16 loss scale where the target has one and the checkpoint has not."""
    missing = [i for i, e in enumerate(target) if restored[i] is None and e.section == "loss_scale"]
    if not missing:
        return restored
    fresh = jax.tree.leaves(LossScaleState.create(policy.precision.loss_scale))  # type: ignore[arg-type]
    names = [e.name for e in target if e.section == "loss_scale"]
    by_name = dict(zip(names, fresh, strict=True))
    restored = list(restored)
    for i in missing:
        restored[i] = jax.device_put(by_name[target[i].name], target[i].sharding)
    return restored


def _zero_overlapping_padding(
    restored: list[Any], target: list[Entry], sources: list[str | None], meta: dict[str, Any]
) -> list[Any]:
    """Zero the target padding that orbax filled from the checkpoint's padding.

    Where both the saving and the target layout pad the same dimension, the
    overlap of their padding is read from the file; the library keeps padding
    at zero, but a restore must not depend on it.
    """
    todo = []
    for i, (e, src) in enumerate(zip(target, sources, strict=True)):
        if src is None:
            continue
        saved = meta["leaves"][src]["stored_shape"]
        if any(min(s, t) > n for s, t, n in zip(saved, e.stored_shape, e.shape, strict=True)):
            todo.append(i)
    if not todo:
        return restored

    def mask(xs: list[jax.Array]) -> list[jax.Array]:
        out = []
        for x, i in zip(xs, todo, strict=True):
            x = to_device(x)  # an offloaded leaf is masked in device memory, and put back by out_shardings
            keep = jnp.ones(x.shape, bool)
            for d, n in enumerate(target[i].shape):
                keep &= jax.lax.broadcasted_iota(jnp.int32, x.shape, d) < n
            out.append(jnp.where(keep, x, jnp.zeros((), x.dtype)))
        return out

    shardings = [target[i].sharding for i in todo]
    fixed = jax.jit(mask, out_shardings=shardings, donate_argnums=0)([restored[i] for i in todo])
    restored = list(restored)
    for i, x in zip(todo, fixed, strict=True):
        restored[i] = x
    return restored


CORRUPTED = (
    "{what} is corrupted: leaf '{first}' does not match the checksum recorded when it was saved (a data file was "
    "changed or damaged). Mismatching leaves ({count}): {names}. " + RESTORE_ANOTHER
)


def _verify(
    restored: list[Any], target: list[Entry], sources: list[str | None], meta: dict[str, Any], what: str, present: Any
) -> None:
    """Compare each leaf read as saved (same dtype) with the checksum recorded at save time."""
    leaves = meta["leaves"]
    idx = [
        i
        for i, src in enumerate(sources)
        if src is not None and "checksum" in leaves[src] and np.dtype(leaves[src]["dtype"]) == target[i].dtype
    ]
    if not idx:
        return
    got = checksums([restored[i] for i in idx], [target[i].shape for i in idx])
    bad = [sources[i] for i, sums in zip(idx, got, strict=True) if sums != leaves[sources[i]]["checksum"]]
    if bad:
        raise CorruptCheckpointError(
            CORRUPTED.format(what=what, first=bad[0], count=len(bad), names=", ".join(bad), present=present)  # pyright: ignore[reportArgumentType, reportCallIssue] - the source names of restored leaves are set
        )


# -- a fresh optimizer state -----------------------------------------------------------------------------------


def _fresh_opt_state(state: TrainState, abstract: TrainState, tx: ShardedTransformation) -> Any:
    """``tx``'s initial state for the restored parameters, built in its target layout.

    From the float32 master when there is one (the optimizer's view), else from
    the parameters; inside ``jit`` with the target shardings, as ``init_state``.
    """
    policy = state.policy
    layouts = state.layouts.tree()
    if state.master is not None:
        source, partitioned, axes = state.master, policy.partitions_opt_state, policy.state_axes
    else:
        source, partitioned, axes = state.params, policy.partitions_params, None
    shardings = jax.tree.map(lambda s: s.sharding, abstract.opt_state)

    def init(stored: PyTree) -> Any:
        return tx.init(to_logical(stored, layouts, policy, partitioned, axes=axes))

    return jax.jit(init, out_shardings=shardings)(source)
