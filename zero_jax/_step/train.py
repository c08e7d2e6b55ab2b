"""make_train_step: one jit-compiled ZeRO step, and its public face.

The step has three parts, each in the view that suits it (one module each):

1. gradients (``grads``), in ``jax.shard_map``: each device runs ``loss_fn``
   on its slice of the batch (in microbatches when accumulating) and the
   collectives of ``_comm.collectives`` reduce the gradients in the precision
   policy's reduce dtype (all-reduce in stage 0, reduce-scatter from stage 1;
   stages 2–3 reduce-scatter each gradient the moment the backward pass
   produces it; stage 3 also gathers the parameters for use). The global
   gradient norm, which is also the overflow check, costs one scalar
   all-reduce;
2. the optimizer (``update``), in the global view: :func:`shard_optimizer`
   runs the optax update on the partitioned (fp32 master) state, where the
   compiler keeps elementwise math local and adds only the small reductions
   an optimizer itself needs;
3. where the optimizer sees a slice of whole parameters (stages 1 and 2),
   the updated pieces are all-gathered (in the compute dtype).

The collectives ZeRO is about are therefore explicit (the compiler never
chooses them), which is what makes their cost provable from the program.
This module holds :class:`TrainStep` (validation that names every bad leaf,
then the jitted program) and :func:`make_train_step`.

A stateful loss (here a running mean of the inputs, averaged over devices):

>>> import jax, jax.numpy as jnp, optax, zero_jax as zj
>>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
>>> policy = zj.ZeroPolicy(stage=2, mesh=mesh)
>>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
>>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
>>> batch = {"x": jnp.ones((8 * jax.device_count(), 4)), "y": jnp.ones((8 * jax.device_count(), 1))}
>>> def stateful_loss(p, ms, b):
...     new = {"mean": 0.5 * ms["mean"] + 0.5 * jnp.mean(b["x"], 0)}
...     return loss_fn(p, b), new
>>> state = zj.init_state({"w": jnp.zeros((4, 1))}, tx, policy, model_state={"mean": jnp.zeros(4)})
>>> step = zj.make_train_step(stateful_loss, tx, policy, stateful=True)
>>> state, metrics = step(state, batch)
>>> state.model_state["mean"].tolist()
[0.5, 0.5, 0.5, 0.5]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zero_jax._base.tree import PyTree, check_live, path_str
from zero_jax._base.units import is_real_number, is_whole_number
from zero_jax._layerwise.schedule import schedule_for
from zero_jax._layout.leaf import LeafLayout, is_float, is_layout
from zero_jax._layout.trees import TreeLayouts, full_shapes
from zero_jax._policy.batch import is_replicated_leaf, legacy_key_hint
from zero_jax._policy.placement import place_batch
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._step.grads import AUX_REDUCTIONS, Grads, compute_grads, grad_plan
from zero_jax._step.optimizer import ShardedOptState, ShardedTransformation, check_tree, frozen_leaves
from zero_jax._step.state import TrainState, check_tx, state_shardings
from zero_jax._step.update import (
    apply_optimizer,
    finish_state,
    keep_non_float,
    master_for_compute,
    optimizer_grads,
    same_dtypes,
    step_metrics,
    updated_params,
)

BATCH_SIZES_DIFFER = (
    "train_step: the batch leaves have different leading (batch) sizes: {listing}. Every batch leaf holds "
    "one row per example along its leading dimension, so they must all agree; pass the same number of "
    "examples in each (e.g. x and y of one batch)."
)
MODEL_STATE_LEAVES = (
    "train_step: model_state leaf {listing}, not a jax.Array. Create the state with "
    "zj.init_state(..., model_state=...)."
)
STORED_SHAPES = (
    "train_step: {count} parameter(s) do not have the shape this policy stores them in: {listing}. Build the "
    "state with zj.init_state(params, tx, policy) rather than by hand."
)


def check_batch_sizes(batch: PyTree) -> None:
    """Every batch leaf must have the same leading size (one row per example)."""
    pairs = [(path_str(p), tuple(getattr(x, "shape", ()))) for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]]
    sizes = {shape[0] for _, shape in pairs if shape}
    if len(sizes) > 1:
        listing = ", ".join(f"'{p}' {shape}" for p, shape in pairs)
        raise ValueError(BATCH_SIZES_DIFFER.format(listing=listing) + legacy_key_hint(batch))


class StepFacts(NamedTuple):
    """What a train step knows about itself, for whoever judges its program
    (``zj.audit``): its policy, how ``loss_fn`` gets parameters, its gradient
    accumulation and the optax transformation its ``tx`` wraps (``None``:
    unknown, for a step not made by :func:`make_train_step`)."""

    policy: ZeroPolicy
    gather: str = "manual"
    accum_mode: str | None = None
    accum_steps: int = 1
    tx: optax.GradientTransformation | None = None
    keep_gathered: bool = False


class TrainStep:
    """A jit-compiled ZeRO train step: ``state, metrics = step(state, batch)``.

    ``step.lower(state, batch).compile()`` works as for any ``jax.jit``
    function; the old state is donated (using it again is an error that says
    so). ``step.grads(state, batch)`` returns the batch-mean gradient as the
    policy holds it (for inspection). Made by :func:`make_train_step`.
    """

    def __init__(
        self,
        loss_fn: Callable[[PyTree, PyTree], Any],
        tx: ShardedTransformation,
        policy: ZeroPolicy,
        *,
        gather: Literal["all", "manual"],
        accum_steps: int,
        accum_mode: Literal["local", "partitioned"],
        clip_norm: float | None,
        donate: bool,
        stateful: bool = False,
        compiler_options: dict[str, Any] | None = None,
        aux_reduce: Any = None,
        keep_gathered: bool = False,
    ) -> None:
        self.loss_fn = loss_fn
        self.keep_gathered = keep_gathered
        self.aux_reduce = aux_reduce
        self.stateful = stateful
        self.tx = tx
        self.policy = policy
        self.gather = gather
        self.accum_steps = accum_steps
        self.accum_mode = accum_mode
        self.clip_norm = clip_norm
        self.donate = donate
        batch_sharding = policy.batch_sharding()
        #: What the step compiles with: the backend's options (the schedule seam; none on XLA:CPU), then the caller's.
        self.compiler_options = {**dict(schedule_for(policy).compiler_options), **(compiler_options or {})} or None
        self.jitted = jax.jit(self._step, in_shardings=(None, batch_sharding), donate_argnums=(0,) if donate else (),
                              compiler_options=self.compiler_options)  # fmt: skip
        # For inspection, and jitted again inside zj.audit: a nested jit takes no compiler options.
        self._grads_jitted = jax.jit(
            functools.partial(self._grads, for_optimizer=False), in_shardings=(None, batch_sharding)
        )
        functools.update_wrapper(self, loss_fn, updated=())

    # -- the public face -------------------------------------------------------------

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        with self.policy.program_mesh():  # the step's own mesh context, whatever jax.set_mesh says
            state, batch = self._validate(state, batch)
            return self._programs(batch)[0](state, batch)

    def lower(self, state: TrainState, batch: PyTree) -> Any:
        with self.policy.program_mesh():
            state, batch = self._validate(state, batch)
            return self._programs(batch)[0].lower(state, batch)

    def grads(self, state: TrainState, batch: PyTree) -> PyTree:
        """The batch-mean gradient as the policy holds it: in the reduce dtype
        (float32 accumulators when accumulating), partitioned and padded in
        stages 2–3, whole in stages 0–1; ``None`` for frozen and non-float
        leaves. Loss scaling is not undone here."""
        with self.policy.program_mesh():
            state, batch = self._validate(state, batch)
            return self._programs(batch)[1](state, batch).grads

    @property
    def facts(self) -> StepFacts:
        """What this step is (see :class:`StepFacts`)."""
        return StepFacts(self.policy, self.gather, self.accum_mode, self.accum_steps, self.tx.inner, self.keep_gathered)

    def _programs(self, batch: PyTree) -> tuple[Any, Any]:
        """The jitted step and gradient program for this batch: :attr:`jitted`
        for a batch split by rows; one with those leaves replicated for a
        batch that holds scalars (a step count, a typed RNG key)."""
        leaves, treedef = jax.tree.flatten(batch)
        scalars = tuple(is_replicated_leaf(x) for x in leaves)
        if not any(scalars):
            return self.jitted, self._grads_jitted
        return self._with_scalars(treedef, scalars)

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a step object lives as long as its training run
    def _with_scalars(self, treedef: Any, scalars: tuple[bool, ...]) -> tuple[Any, Any]:
        rows = self.policy.batch_sharding()
        shardings = treedef.unflatten([self.policy.replicated() if s else rows for s in scalars])
        step = jax.jit(self._step, in_shardings=(None, shardings), donate_argnums=(0,) if self.donate else (),
                       compiler_options=self.compiler_options)  # fmt: skip
        grads = jax.jit(functools.partial(self._grads, for_optimizer=False), in_shardings=(None, shardings))
        return step, grads

    # -- checks with errors that say what to do -----------------------------------------

    def _validate(self, state: Any, batch: PyTree) -> tuple[TrainState, PyTree]:
        """Check the state and batch, naming every bad leaf; returns the state
        (under this step's policy when it was made for one that lays state out
        alike: ``ZeroPolicy.lays_out_like``) and the batch placed on the step's
        layout (see ``_policy.placement.place_batch``)."""
        policy = self.policy
        if not isinstance(state, TrainState):
            raise TypeError(
                f"train_step: expected a zero_jax TrainState, got {type(state).__name__}. "
                "Create it with zj.init_state(params, tx, policy)."
            )
        check_live(state, where="train_step")
        opt = state.opt_state
        if state.policy != policy and policy.lays_out_like(state.policy) and isinstance(opt, ShardedOptState):
            state = dataclasses.replace(state, policy=policy, opt_state=ShardedOptState(
                opt.inner_state, policy, opt.param_layouts, opt.layouts))  # fmt: skip
        if state.policy != policy:
            raise ValueError(
                f"train_step: the state is laid out for {state.policy!r}, but this step is for "
                f"{policy!r}. Re-create the state with zj.init_state(params, tx, policy), or move it "
                "with zj.restore(..., policy=policy)."
            )
        check_tree(
            state.params,
            state.layouts,
            "train_step: the parameter tree changed between init and step; it",
            "Re-create the state with zj.init_state(new_params, tx, policy) after changing the model.",
        )
        self._check_stored_shapes(state)
        opt = state.opt_state
        if not isinstance(opt, ShardedOptState) or opt.policy != policy or opt.param_layouts != state.layouts:
            raise ValueError(
                "train_step: the optimizer state belongs to another policy or another parameter "
                "tree than the parameters. Create both together with zj.init_state(params, tx, policy)."
            )
        expected = self._expected_opt_state(state.layouts)
        if jax.tree.structure(expected) != jax.tree.structure(opt) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(opt), strict=True)
        ):
            raise ValueError(
                "train_step: the optimizer state was made by another optimizer than this step's tx. "
                "Create the state with zj.init_state(params, tx, policy) using the same tx."
            )
        if self.stateful and state.model_state is None:
            raise ValueError(
                "train_step: this step was made with make_train_step(..., stateful=True), but the state has no "
                "model_state. Create the state with zj.init_state(params, tx, policy, model_state=...) (for an "
                "adapted model: adapted.init_state(tx, policy)), or make the step without stateful=True."
            )
        if not self.stateful and state.model_state is not None:
            raise ValueError(
                "train_step: the state carries a model_state, but this step was made without stateful=True, so "
                "it would never update it. Make the step with zj.make_train_step(..., stateful=True) and a "
                "loss_fn(params, model_state, batch) -> (out, new_model_state) (for an adapted model: "
                "adapted.make_train_step(tx, policy)), or create the state without model_state."
            )
        bad = [
            f"'{path_str(path)}' is a {type(leaf).__name__}"
            for path, leaf in jax.tree_util.tree_flatten_with_path(state.model_state)[0]
            if not isinstance(leaf, jax.Array)
        ]
        if bad:
            raise TypeError(MODEL_STATE_LEAVES.format(listing=", ".join(bad)))
        check_batch_sizes(batch)
        policy.check_batch(batch, where="train_step", microbatches=self.accum_steps)
        return state, place_batch(batch, policy.batch_sharding(batch))

    def _check_stored_shapes(self, state: TrainState) -> None:
        pairs = jax.tree_util.tree_flatten_with_path(state.params)[0]
        bad = [
            f"'{path_str(path)}' has shape {tuple(leaf.shape)}, stored as {self._stored_shape(lay)}"
            for (path, leaf), lay in zip(pairs, state.layouts.layouts, strict=True)
            if tuple(leaf.shape) != self._stored_shape(lay)
        ]
        if bad:
            raise ValueError(STORED_SHAPES.format(count=len(bad), listing="; ".join(bad)))

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a step object lives as long as its training run
    def _expected_opt_state(self, layouts: TreeLayouts) -> PyTree:
        return jax.eval_shape(self.tx.init, jax.eval_shape(lambda: full_shapes(layouts)))

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def _frozen(self, layouts: TreeLayouts) -> PyTree:
        """Leaves the step never differentiates: those the optimizer never
        changes (see ``zj.frozen_leaves``) and every non-float leaf (an int
        counter, a bool mask), which passes through the step untouched."""
        frozen = frozen_leaves(self.tx.inner, jax.eval_shape(lambda: full_shapes(layouts)))
        return jax.tree.map(lambda fz, lay: bool(fz) or not is_float(lay), frozen, layouts.tree(), is_leaf=is_layout)

    def _stored_shape(self, lay: LeafLayout) -> tuple[int, ...]:
        return lay.stored_shape if self.policy.partitions_params else lay.shape

    # -- the program ---------------------------------------------------------------------

    def _grads(self, state: TrainState, batch: PyTree, *, for_optimizer: bool) -> Grads:
        """Reduced gradients, loss, aux, the global squared norm of the
        unscaled gradients and the new model state (``None`` unless
        stateful), in one ``shard_map``.

        With ``for_optimizer`` (the step) gradients come back partitioned
        from stage 1 on (the optimizer works on pieces); otherwise as the
        policy holds them (whole in stage 1).
        """
        with self.policy.program_mesh():  # also when a jax.jit of the caller's traces this (zj.audit's)
            plan = grad_plan(
                self.loss_fn,
                self.policy,
                state.layouts.tree(),
                self._frozen(state.layouts),
                gather=self.gather,
                accum_steps=self.accum_steps,
                accum_mode=self.accum_mode,
                stateful=self.stateful,
                scale_loss=state.loss_scale is not None,
                for_optimizer=for_optimizer,
                aux_reduce=self.aux_reduce,
                keep_gathered=self.keep_gathered,
            )
            scale = state.loss_scale.scale if plan.scale_loss else jnp.ones((), jnp.float32)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
            return compute_grads(plan, state.params, batch, scale, state.model_state)

    def _step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        with self.policy.program_mesh():  # also when a jax.jit of the caller's traces this
            return self._step_traced(state, batch)

    def _step_traced(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        prec = self.policy.precision
        shardings = state_shardings(state)  # once per trace: the new state has the same
        out = self._grads(state, batch, for_optimizer=True)
        grad_norm = jnp.sqrt(out.sq_norm)
        grads = optimizer_grads(out.grads, state, grad_norm, self.clip_norm)
        updated = apply_optimizer(self.tx, state, grads, out.sq_norm, shardings)
        model_state = state.model_state
        if self.stateful:  # a skipped (float16 overflow) step keeps the old model state too
            model_state = out.model_state
            if state.loss_scale is not None:
                model_state = jax.lax.cond(updated.finite, lambda n, o: n, lambda n, o: o, model_state,
                                           state.model_state)  # fmt: skip
        new_master = master_for_compute(state, updated.master, shardings)
        new_state = state.replace(
            step=state.step + 1,
            params=updated_params(state, new_master, self._frozen(state.layouts)),
            opt_state=same_dtypes(updated.opt_state, state.opt_state),
            master=None if state.master is None else keep_non_float(new_master, state.master, state.layouts.tree()),
            loss_scale=None if state.loss_scale is None else state.loss_scale.next(updated.finite, prec.loss_scale),  # pyright: ignore[reportArgumentType, reportOptionalMemberAccess] - set here: a check above pyright cannot follow
            model_state=model_state,
        )
        new_state = finish_state(state, new_state, shardings)
        return new_state, step_metrics(out.loss, out.aux, grad_norm, new_state, updated.finite)


def make_train_step(
    loss_fn: Callable[[PyTree, PyTree], Any],
    tx: ShardedTransformation,
    policy: ZeroPolicy,
    *,
    gather: Literal["all", "manual"] = "all",
    accum_steps: int = 1,
    accum_mode: Literal["local", "partitioned"] | None = None,
    clip_norm: float | None = None,
    donate: bool = True,
    stateful: bool = False,
    compiler_options: dict[str, Any] | None = None,
    aux_reduce: Any = None,
    keep_gathered: bool | None = None,
) -> TrainStep:
    """Build the jit-compiled train step for ``policy``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``: the
        **mean** loss over the batch it is given. Each device gives it its
        slice of the global batch and the step averages the devices' losses
        and gradients, so a loss that returns the batch *sum* trains with
        gradients 1/N of the unsharded sum's (N devices x accum_steps) and
        reports a loss N times smaller: divide by the rows it was given
        (``jnp.mean``). It receives ordinary, whole parameters in every
        stage. Aux: see ``aux_reduce``.
      tx: the optimizer, wrapped by :func:`shard_optimizer` for ``policy``.
      policy: the :class:`ZeroPolicy`.
      gather: ``"all"``: the step hands ``loss_fn`` whole parameters (in
        stage 3 it gathers them inside ``jax.checkpoint``, so the backward
        pass gathers again rather than keeping the model alive).
        ``"manual"``: ``loss_fn`` receives the partitioned parameters and
        gathers what it uses, block by block: ``zj.scan_layers`` (stacked),
        ``zj.apply_layers`` (a Python loop; the adapters' ``layers=``),
        ``zj.gather`` for the rest (ZeRO-3 that never holds the whole model;
        plain calls in stages 0–1). Touching a piece otherwise is an error.
      accum_steps: split each device's batch into this many microbatches,
        scanned inside the one compiled step; the update equals one step on
        the whole batch.
      accum_mode: ``"partitioned"`` reduces every microbatch's gradient
        (reduce-scatter from stage 1) into a partitioned float32 accumulator:
        stage 2/3 memory, ``accum_steps`` reductions per step. ``"local"``
        accumulates whole gradients on each device and reduces once: one
        reduction per step, but a whole float32 accumulator (stage 1 memory;
        stage 3 gathers the parameters once per step). Default: partitioned
        in stages 2–3 (their point is memory), local in stages 0–1 (nothing
        to save by reducing more often). Pick local when communication is
        the bottleneck and the whole gradient fits.
      clip_norm: clip the gradient to this global norm (computed across all
        pieces with one scalar all-reduce), exactly as
        ``optax.clip_by_global_norm`` on unsharded gradients.
      donate: donate the old state's buffers to the new one.
      stateful: the model has non-trainable state that training updates
        (batch-norm statistics, RNG counts): ``loss_fn(params, model_state,
        batch) -> (out, new_model_state)``, where ``out`` is what an ordinary
        loss returns (``loss`` or ``(loss, aux)``) and ``new_model_state`` has
        the tree, shapes and dtypes of ``model_state``. The state must carry
        it (``zj.init_state(..., model_state=...)``). Each device runs the
        loss on its slice of the batch (threading the model state through
        its microbatches in order when accumulating); the new state is then
        made one replicated value, as data-parallel training does: float
        leaves are averaged over the devices (``jax.lax.pmean`` over the batch
        axes: batch norm with per-device batch statistics, like PyTorch DDP),
        integer, boolean and key leaves must agree across devices and their
        maximum is taken (``pmax``). A float16 step skipped for overflow keeps
        the old model state.
      aux_reduce: how each leaf of the loss's aux combines over the devices
        (and microbatches), which each computed it on their own rows:
        ``"mean"`` (the default for float leaves: right for a per-device
        mean such as an accuracy), ``"sum"`` (the default for integer leaves:
        counts), ``"max"``, ``"min"``, or ``"gather"`` (the devices' rows
        concatenated in batch order: a per-example array comes back with
        one row per example of the global batch; a scalar, one value per
        device and microbatch). One string for every leaf, or a dict naming
        some keys of an aux dict (``{"per_example": "gather", "worst":
        "max"}``; the other keys take the defaults). Without it, a float aux
        leaf with a row per example of each device's batch is averaged with
        a warning that says so.
      compiler_options: XLA options the step compiles with, over the ones
        zero_jax picks for the mesh's backend (on TPU, libtpu's async
        all-gather: ``zero_jax._layerwise.schedule``); e.g.
        ``{"xla_enable_async_all_gather": "false"}`` turns that one off.
      keep_gathered: stage 3 with ``gather="all"``: keep the parameters
        gathered for the forward pass until the backward pass uses them,
        instead of gathering them again (ZeRO-2's memory for parameters
        during the step, whole; 2Ψ of traffic instead of 3Ψ). Bitwise the same
        training. With ``gather="manual"`` give ``keep_gathered=k`` to
        ``zj.scan_layers`` / ``zj.apply_layers`` (the last k blocks).
        ``None`` (the default): the schedule seam's choice for the backend
        (``keep_gathered_all`` in ``zero_jax._layerwise.schedule``: True on
        XLA:GPU, where gathering again peaks above stage 1; False elsewhere).

    Returns:
      A :class:`TrainStep`: ``state, metrics = step(state, batch)`` with
      ``metrics["loss"]`` (global mean), ``metrics["grad_norm"]`` (the
      global norm of the mean gradient, before clipping; non-finite when any
      gradient holds an inf or NaN) and ``metrics["finite"]`` (a bool: the
      gradient norm is finite), plus ``metrics["aux"]``. To skip non-finite
      steps in float32, wrap the optimizer: ``zj.shard_optimizer(
      optax.apply_if_finite(tx, max_consecutive_errors), policy)`` keeps the
      parameters unchanged after such a step in every stage.

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=2, mesh=mesh)
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> state = zj.init_state({"w": jnp.zeros((4, 1))}, tx, policy)
    >>> step = zj.make_train_step(loss_fn, tx, policy)
    >>> batch = {"x": jnp.ones((8 * jax.device_count(), 4)), "y": jnp.ones((8 * jax.device_count(), 1))}
    >>> state, metrics = step(state, batch)
    >>> float(metrics["loss"])
    1.0

    A stateful loss: see this module's docstring.
    """
    tx = check_tx(tx, policy, "make_train_step")
    accum_mode = _check_options(loss_fn, policy, gather, accum_steps, accum_mode, clip_norm, stateful)  # pyright: ignore[reportAssignmentType] - _check_options resolves the accumulation mode
    if keep_gathered is None:
        keep_gathered = gather == "all" and policy.partitions_params and schedule_for(policy).keep_gathered_all
    _check_keep_gathered(keep_gathered, policy, gather)
    return TrainStep(
        loss_fn,
        tx,
        policy,
        gather=gather,
        accum_steps=int(accum_steps),
        accum_mode=accum_mode,  # pyright: ignore[reportArgumentType] - _check_options resolves the accumulation mode
        clip_norm=None if clip_norm is None else float(clip_norm),
        donate=donate,
        stateful=stateful,
        compiler_options=_checked_compiler_options(compiler_options),
        aux_reduce=_checked_aux_reduce(aux_reduce),
        keep_gathered=keep_gathered,
    )


KEEP_GATHERED_STEP = (
    "make_train_step: keep_gathered=True keeps the parameters gathered for the forward pass for the backward "
    "(stage 3 with gather='all'); {why}. {fix}"
)


def _check_keep_gathered(keep_gathered: Any, policy: ZeroPolicy, gather: str) -> None:
    if not isinstance(keep_gathered, bool):
        why, fix = f"got {keep_gathered!r}", "Pass True or False."
    elif not keep_gathered:
        return
    elif gather != "all":
        why = "with gather='manual' the loss gathers block by block"
        fix = "Pass keep_gathered=k to zj.scan_layers / zj.apply_layers (or the adapters' layers=): the last k blocks."
    elif not policy.partitions_params:
        why = f"stage {policy.stage} hands the loss parameters it already holds whole"
        fix = "Leave keep_gathered out (or use ZeroPolicy(stage=3, ...))."
    else:
        return
    raise ValueError(KEEP_GATHERED_STEP.format(why=why, fix=fix))


COMPILER_OPTIONS = (
    "make_train_step: compiler_options must be a dict of XLA option names to values (strings, bools or numbers), "
    "e.g. {{'xla_enable_async_all_gather': 'false'}}; got {got}."
)


AUX_REDUCE = (
    "make_train_step: aux_reduce must be None, one of {kinds} (for every aux leaf), or a dict of them "
    "mirroring a prefix of the aux tree; {listing}."
)


def _checked_aux_reduce(aux_reduce: Any) -> Any:
    if aux_reduce is None:
        return None
    pairs = jax.tree_util.tree_flatten_with_path(aux_reduce)[0]
    bad = [f"'{path_str(p) or '(the value)'}' is {v!r}" for p, v in pairs if v not in AUX_REDUCTIONS]
    if bad or not pairs:
        raise ValueError(AUX_REDUCE.format(kinds=AUX_REDUCTIONS, listing="; ".join(bad) or "got an empty tree"))
    return aux_reduce


def _checked_compiler_options(options: Any) -> dict[str, Any] | None:
    if options is None:
        return None
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise TypeError(COMPILER_OPTIONS.format(got=repr(options)))
    return dict(options)


def _check_options(
    loss_fn: Any, policy: ZeroPolicy, gather: Any, accum_steps: Any, accum_mode: Any, clip_norm: Any, stateful: Any
) -> str:
    """``make_train_step``'s arguments, each with an error that says what to
    pass; returns the accumulation mode (the policy's default when None)."""
    if gather not in ("all", "manual"):
        raise ValueError(
            f"make_train_step: gather must be 'all' (loss_fn gets whole parameters) or 'manual' "
            f"(loss_fn gathers them with zj.apply_layers / zj.scan_layers / zj.gather), got {gather!r}."
        )
    if not callable(loss_fn):
        raise TypeError(f"make_train_step: loss_fn must be callable, got {type(loss_fn).__name__}.")
    if not is_whole_number(accum_steps) or accum_steps < 1:
        raise ValueError(f"make_train_step: accum_steps must be an int >= 1, got {accum_steps!r}.")
    if accum_mode is None:
        accum_mode = policy.default_accum_mode
    if accum_mode not in ("local", "partitioned"):
        raise ValueError(
            f"make_train_step: accum_mode must be 'local' (reduce once per step) or 'partitioned' "
            f"(reduce every microbatch into a partitioned accumulator), got {accum_mode!r}."
        )
    if clip_norm is not None and not (is_real_number(clip_norm) and math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"make_train_step: clip_norm must be a positive number or None, got {clip_norm!r}.")
    if not isinstance(stateful, bool):
        raise TypeError(f"make_train_step: stateful must be True or False, got {stateful!r}.")
    return accum_mode
