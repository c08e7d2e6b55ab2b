"""ZeRO's formulas, per device: model-state bytes, communication, efficiency.

The formulas are the ZeRO paper's (Rajbhandari et al. 2020, Figure 1 and
Section 7), with Ψ parameters on N data-parallel devices and K bytes of
optimizer state per parameter:

====== =============================== ===============================
stage  model-state bytes               communication per step (ring)
====== =============================== ===============================
0 (DP) (2 + 2 + K)Ψ                    2·(N−1)/N·2Ψ  (all-reduce)
1      (2 + 2)Ψ + KΨ/N                 2·(N−1)/N·2Ψ  (RS + AG)
2      2Ψ + (2 + K)Ψ/N                 2·(N−1)/N·2Ψ  (RS + AG)
3      (2 + 2 + K)Ψ/N                  3·(N−1)/N·2Ψ  (AG, AG, RS)
====== =============================== ===============================

(with the default 2-byte parameters and gradients and K = 12: fp32 master,
Adam's m and v). Sizes and rates are read by :mod:`zero_jax._base.units`.

With tensor parallelism over M devices (``model_parallel=M``: the product
of the model axes' sizes, ``policy.model_parallel``) a device holds 1/M of
each parameter before ZeRO cuts it N ways, so every figure above is divided
by M, and ZeRO's collectives over the data axis move only the local model
shard. The model's own tensor-parallel traffic (activation all-reduces over
the model axis) depends on the model: :func:`zero_jax.audit` measures it.

ZeRO++'s int8 wire formats (``quantize_weights=``: qwZ, stage 3's two
weight gathers; ``quantize_grads=``: qgZ, the gradient reduction of stages
1–3) send 1 + 4/block bytes per element in those passes (:func:`comm_bytes`).

"""

from __future__ import annotations

from typing import Any, NamedTuple

from zero_jax._base.units import parse_bytes, parse_seconds
from zero_jax._theory.checks import check_devices, check_nonneg, check_params, check_stage, wire_rates
from zero_jax._theory.wire import DEFAULT_BLOCK

#: The stages' names in the paper (P_os: optimizer state partitioned, +g gradients, +p parameters).
STAGE_NAMES = ("DP", "P_os", "P_os+g", "P_os+g+p")

# -- the formulas --------------------------------------------------------------------------------------


class ModelStateBytes(NamedTuple):
    """Model-state bytes on one device, by category (``total`` sums them).

    With offload the categories count device memory only.
    """

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
    replicas: int = 1,
    optimizer_over_replicas: bool = False,
    offload_optimizer: float = 0.0,
    offload_params: bool = False,
    model_parallel: int = 1,
    secondary: int = 0,
    frozen_params: float = 0.0,
    frozen_bytes: float = 2.0,
) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state on one device.

    Stage 1 divides the optimizer state by N, stage 2 also the gradients,
    stage 3 also the parameters. The defaults are the paper's mixed-precision
    Adam: 2-byte parameters and gradients, K = 12 (fp32 master, m, v).
    ``offload_optimizer`` (a fraction) and ``offload_params`` (stage 3) leave
    that share out (it lives in host memory), as ``ZeroPolicy``'s arguments of
    the same names do; the host bytes are the difference to the figures
    without offload. The chunk an update streams through the device is not
    counted.

    On a hybrid mesh ``num_devices`` is N, the size of the partition axis,
    and ``replicas`` R, the size of the replica axis: HSDP
    (``ZeroPolicy(..., replica_axis=...)``) holds the same bytes as ZeRO at N
    (replicas add no memory); with ``optimizer_over_replicas`` the optimizer
    state and the reduced gradients are divided by R·N instead.

    With tensor parallelism over M devices (``model_parallel``, the product
    of the model axes' sizes) every term is divided by M too: the figures are
    the ZeRO formula / M, for a model whose parameters are all split M ways
    (leaves the model spec leaves whole, such as norms, add their share).

    ZeRO++'s hpZ (``secondary``: S, the size of ``ZeroPolicy``'s
    ``secondary_axis``, stage 3) adds the secondary pieces the step keeps
    from the forward pass to the backward: Ψ/S parameters' bytes (also with
    ``offload_params``: they are made on the device, in the step), counted
    in ``params``.

    The paper's Figure 1 (Ψ = 7.5B, N = 64):

    >>> import zero_jax as zj
    >>> [round(zj.model_state_bytes(7.5e9, 64, s).total / 1e9, 1) for s in range(4)]
    [120.0, 31.4, 16.6, 1.9]
    >>> round(zj.model_state_bytes(7.5e9, 8, 3, replicas=8, optimizer_over_replicas=True).total / 1e9, 1)
    3.5

    Half the optimizer state offloaded (1B parameters, N = 8, stage 3): on the
    device, and in host memory:

    >>> half = zj.model_state_bytes(1e9, 8, 3, offload_optimizer=0.5)
    >>> half.optimizer / 1e9, (zj.model_state_bytes(1e9, 8, 3).total - half.total) / 1e9
    (0.75, 0.75)

    Tensor parallelism over M = 2 halves every term (Ψ = 1B, N = 4, stage 1):

    >>> [x / 1e9 for x in zj.model_state_bytes(1e9, 4, 1)]
    [2.0, 2.0, 3.0]
    >>> [x / 1e9 for x in zj.model_state_bytes(1e9, 4, 1, model_parallel=2)]
    [1.0, 1.0, 1.5]

    Stage 3 without a persistent compute copy (``zj.Precision(compute_copy=False)``): the fp32
    master is the parameters (4 bytes) and the optimizer holds Adam's moments (8), 12 bytes of
    state per parameter / N instead of 2 + 12 (Ψ = 1B, N = 8; parameters, gradients, optimizer):

    >>> [x / 1e9 for x in zj.model_state_bytes(1e9, 8, 3, param_bytes=4, optimizer_bytes=8)]
    [0.5, 0.25, 1.0]

    hpZ on 8 devices as 2 nodes x 4 chips: Ψ/8 primary plus Ψ/4 secondary parameters:

    >>> zj.model_state_bytes(1e9, 8, 3).params / 1e9, zj.model_state_bytes(1e9, 8, 3, secondary=4).params / 1e9
    (0.25, 0.75)

    A frozen base (``frozen_params`` parameters of ``frozen_bytes`` each: LoRA's base, or QLoRA's int8 codes
    at 1 byte) counts with the parameters (divided by N in stage 3, like them) and adds no gradient and no
    optimizer state; ``num_params`` is then the trained parameters. QLoRA, a 7B int8 base and 40M LoRA
    parameters on 8 devices, stage 3 (parameters, gradients, optimizer):

    >>> [round(x / 1e9, 3) for x in zj.model_state_bytes(40e6, 8, 3, frozen_params=7e9, frozen_bytes=1)]
    [0.885, 0.01, 0.06]
    """
    psi = check_params(num_params, "model_state_bytes")
    n = check_devices(num_devices, "model_state_bytes")
    stage = check_stage(stage, "model_state_bytes")
    p = check_nonneg(param_bytes, "model_state_bytes: param_bytes")
    g = check_nonneg(grad_bytes, "model_state_bytes: grad_bytes")
    k = check_nonneg(optimizer_bytes, "model_state_bytes: optimizer_bytes")
    r = check_devices(replicas, "model_state_bytes", "replicas")
    m = check_devices(model_parallel, "model_state_bytes", "model_parallel")
    finer = (n * r if optimizer_over_replicas else n) * m  # the optimizer's cut
    f = float(offload_optimizer)
    if not 0.0 <= f <= 1.0:
        raise ValueError(
            f"model_state_bytes: offload_optimizer must be a fraction in [0, 1], got {offload_optimizer!r}."
        )
    if offload_params and stage < 3:
        raise ValueError(f"model_state_bytes: offload_params needs stage 3 (got stage {stage}).")
    s = _check_secondary(secondary, n, stage, "model_state_bytes")
    frozen = check_nonneg(frozen_params, "model_state_bytes: frozen_params") * check_nonneg(
        frozen_bytes, "model_state_bytes: frozen_bytes")  # fmt: skip
    params = (p * psi + frozen) / m / (n if stage >= 3 else 1)
    optimizer = k * psi / (finer if stage >= 1 else m)
    return ModelStateBytes(
        params=(0.0 if offload_params else params) + ((p * psi + frozen) / m / s if s else 0.0),
        grads=g * psi / (finer if stage >= 2 else m),
        optimizer=optimizer * (1 - f),
    )


class ActivationCheckpointBytes(NamedTuple):
    """The saved block inputs of a layer-wise step on one device (ZeRO-R's
    activation checkpoints): what stays in device memory, what waits in host
    memory (``offload_activations``), and the host-link traffic per step
    (each offloaded byte goes out after its block's forward pass and comes
    back before its recompute: 2x)."""

    device: float
    host: float
    host_link: float


def activation_checkpoint_bytes(
    batch_per_device: float,
    seq: float,
    dim: float,
    depth: int,
    *,
    element_bytes: float = 2,
    partition_activations: int = 1,
    offload_activations: bool = False,
) -> ActivationCheckpointBytes:
    """Bytes of the block inputs ``scan_layers`` / ``apply_layer(s)`` keep
    for the backward recompute, per device: ``depth`` x ``batch_per_device``
    x ``seq`` x ``dim`` x ``element_bytes`` (the compute dtype's), divided by
    M with P_a (``partition_activations=M``: the model axes' size; 1
    without), in host memory with P_a+cpu (``offload_activations``), where
    they cost 2x their bytes over the host link per step. Other activations
    (one block's temporaries while it runs) are not counted.

    The reference transformer at dim 512, depth 16, seq 1024, one sequence
    per chip in bf16 (``benchmarks/results/offload_activations.txt``):

    >>> import zero_jax as zj
    >>> a = zj.activation_checkpoint_bytes(1, 1024, 512, 16, offload_activations=True)
    >>> a.device, a.host / 2**20, a.host_link / 2**20
    (0.0, 16.0, 32.0)
    """
    where = "activation_checkpoint_bytes"
    b, t, d = (check_nonneg(v, f"{where}: {n}") for v, n in ((batch_per_device, "batch_per_device"), (seq, "seq"),
                                                               (dim, "dim")))  # fmt: skip
    layers = check_devices(depth, where, "depth")
    m = check_devices(partition_activations, where, "partition_activations")
    saved = layers * b * t * d * check_nonneg(element_bytes, f"{where}: element_bytes") / m
    if not isinstance(offload_activations, bool):
        raise TypeError(f"{where}: offload_activations must be True or False, got {offload_activations!r}.")
    if offload_activations:
        return ActivationCheckpointBytes(device=0.0, host=saved, host_link=2 * saved)
    return ActivationCheckpointBytes(device=saved, host=0.0, host_link=0.0)


def comm_bytes(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    dtype_bytes: float = 2,
    model_parallel: int = 1,
    quantize_weights: str | None = None,
    quantize_grads: str | None = None,
    quant_block: int = DEFAULT_BLOCK,
) -> float:
    """Bytes one device sends per step over the data axis, counted as a ring
    moves them.

    Each pass of a tensor of Ψ·``dtype_bytes`` bytes moves (N−1)/N of it per
    device. Stages 0–2 make two passes (an all-reduce, or a reduce-scatter
    plus an all-gather), stage 3 three (gather for the forward, again for the
    backward, reduce-scatter the gradients): 1.5× data parallelism. With
    tensor parallelism over M devices (``model_parallel``) each collective
    moves only the device's model shard: the figure / M. The model's own
    traffic over the model axis is not counted (:func:`comm_bytes_per_axis`).

    ZeRO++, as ``ZeroPolicy``'s arguments of the same names: ``"int8"`` sends
    int8 plus a float32 scale per ``quant_block`` elements, 1 + 4/block bytes
    per element (``wire_bytes`` of a whole block: a real piece pads its last
    block, which ``zj.audit`` counts) in place of ``dtype_bytes``, in stage 3's
    two weight gathers (``quantize_weights``, qwZ) and in the gradient
    reduction of stages 1–3 (``quantize_grads``, qgZ: an all-to-all, the same
    (N−1)/N). Stages 1–2 gather the updated parameters exactly.

    >>> import zero_jax as zj
    >>> zj.comm_bytes(1e9, 8, 0) / 1e9, zj.comm_bytes(1e9, 8, 3) / 1e9
    (3.5, 5.25)
    >>> zj.comm_bytes(1e9, 4, 0, model_parallel=2) / 1e9, zj.comm_bytes(1e9, 4, 3, model_parallel=2) / 1e9
    (1.5, 2.25)

    Stage 3 with both on moves less than data parallelism's 2Ψ (3.5 GB): 3 x 1.015625 B x Ψ x 7/8.

    >>> zj.comm_bytes(1e9, 8, 3, quantize_weights="int8", quantize_grads="int8") / 1e9
    2.666015625
    >>> zj.comm_bytes(1e9, 8, 1, quantize_grads="int8") / 1e9  # (1.015625 + 2) B x Ψ x 7/8
    2.638671875
    """
    psi = check_params(num_params, "comm_bytes")
    n = check_devices(num_devices, "comm_bytes")
    stage = check_stage(stage, "comm_bytes")
    b = check_nonneg(dtype_bytes, "comm_bytes: dtype_bytes")
    m = check_devices(model_parallel, "comm_bytes", "model_parallel")
    qw, qg = wire_rates(stage, quantize_weights, quantize_grads, quant_block, "comm_bytes")
    gathers = 2 if stage == 3 else 1  # stage 0's all-reduce counts as a reduce-scatter + an all-gather
    plain = (0 if qw else gathers) + (0 if qg else 1)
    quantized = (gathers * qw if qw else 0.0) + (qg or 0.0)
    # Unquantized this is exactly the plain formula (+ 0.0): tests compare it with ==.
    return (plain * psi / m * b + quantized * psi / m) * (n - 1) / n


def _check_secondary(secondary: int, n: int, stage: int, where: str) -> int:
    """hpZ's S (0: no hpZ), which must divide N and needs stage 3."""
    if secondary in (0, None):
        return 0
    s = check_devices(secondary, where, "secondary")
    if stage != 3 or n % s or s == n:
        raise ValueError(
            f"{where}: secondary={secondary} (ZeRO++'s hpZ: the chips per node of ZeroPolicy's secondary_axis) "
            f"needs stage 3 and a size dividing num_devices={n} (below it; got stage {stage})."
        )
    return s


def comm_bytes_per_axis(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    replicas: int = 1,
    dtype_bytes: float = 2,
    model_parallel: int = 1,
    quantize_weights: str | None = None,
    quantize_grads: str | None = None,
    quant_block: int = DEFAULT_BLOCK,
    secondary: int = 0,
) -> dict[str, float]:
    """Bytes one device sends per step on a hybrid mesh, by axis (ring-counted).

    ``"shard"``: within the partition axis (N devices, the fast one) -- the
    same as :func:`comm_bytes` at N. ``"replica"``: across the replica axis
    (R, the slow one): only the 1/N gradient piece crosses it, 2·Ψ/N·(R−1)/R,
    whether it is all-reduced (HSDP) or reduce-scattered and gathered back
    (``optimizer_over_replicas``). An all-reduce or all-gather spanning both
    axes (stage 0; stages 1–2 gathering an optimizer cut over both) moves
    exactly the sum of the two, since (RN−1)/(RN) = (N−1)/N + (R−1)/(RN).

    With tensor parallelism over M devices (``model_parallel`` > 1) both
    move only the device's model shard (the figures / M), and a ``"model"``
    entry is added: 0.0, since ZeRO itself puts nothing on the model axis.
    The model's own tensor-parallel traffic there (activation all-reduces)
    depends on the model; :func:`zero_jax.audit` measures it, this does not
    predict it.

    ``quantize_weights``, ``quantize_grads`` and ``quant_block`` quantize
    ``"shard"`` as in :func:`comm_bytes`; ``"replica"`` stays unquantized, in
    ``dtype_bytes``: ``ZeroPolicy`` never quantizes the replica-axis reduction.

    >>> import zero_jax as zj
    >>> {k: v / 1e9 for k, v in zj.comm_bytes_per_axis(1e9, 4, 3, replicas=2).items()}
    {'shard': 4.5, 'replica': 0.5}
    >>> {k: v / 1e9 for k, v in zj.comm_bytes_per_axis(1e9, 4, 3, replicas=2, quantize_grads="int8").items()}
    {'shard': 3.76171875, 'replica': 0.5}
    >>> {k: v / 1e9 for k, v in zj.comm_bytes_per_axis(1e9, 4, 3, replicas=2, model_parallel=2).items()}
    {'shard': 2.25, 'replica': 0.25, 'model': 0.0}

    ZeRO++'s hpZ (``secondary``: S, the size of ``ZeroPolicy``'s
    ``secondary_axis``; ``num_devices``: N, all of ``axis``, A = N/S nodes):
    ``"across"`` the nodes, the forward gather builds the secondary pieces
    and the gradient reduction finishes there, (A−1)/A·Ψ/S each, 2 passes
    instead of stage 3's 3; ``"within"`` the node, the forward gather, the
    backward re-gather and the reduction, (S−1)/S·Ψ each. With qwZ and qgZ
    both sides move int8 blocks: across, 2·(A−1)/A·Ψ/S·(1 + 4/block) bytes,
    ZeRO++'s ≈ 1Ψ (in bf16 bytes) per ring of S.

    >>> {k: v / 1e9 for k, v in zj.comm_bytes_per_axis(1e9, 8, 3, secondary=4).items()}
    {'within': 4.5, 'across': 0.5}
    >>> {k: v / 1e9 for k, v in zj.comm_bytes_per_axis(1e9, 8, 3, secondary=4, quantize_weights="int8",
    ...                                               quantize_grads="int8", quant_block=64).items()}
    {'within': 2.390625, 'across': 0.265625}
    """
    psi = check_params(num_params, "comm_bytes_per_axis")
    n = check_devices(num_devices, "comm_bytes_per_axis")
    r = check_devices(replicas, "comm_bytes_per_axis", "replicas")
    b = check_nonneg(dtype_bytes, "comm_bytes_per_axis: dtype_bytes")
    m = check_devices(model_parallel, "comm_bytes_per_axis", "model_parallel")
    wire = {"quantize_weights": quantize_weights, "quantize_grads": quantize_grads, "quant_block": quant_block}
    s = _check_secondary(secondary, n, stage, "comm_bytes_per_axis")
    if s:
        if r > 1:
            raise ValueError("comm_bytes_per_axis: secondary (hpZ) does not combine with replicas (not built).")
        qw, qg = wire_rates(stage, quantize_weights, quantize_grads, quant_block, "comm_bytes_per_axis")
        weight, grad, nodes = (qw or b) * psi / m, (qg or b) * psi / m, n // s
        return {"within": (2 * weight + grad) * (s - 1) / s, "across": (weight + grad) / s * (nodes - 1) / nodes}
    out = {
        "shard": comm_bytes(psi, n, stage, dtype_bytes=b, model_parallel=m, **wire),
        "replica": 2 * psi / m / n * b * (r - 1) / r,
    }
    return out | ({"model": 0.0} if m > 1 else {})


def efficiency(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    compute_time: float | str,
    bandwidth: float | str,
    dtype_bytes: float = 2,
    model_parallel: int = 1,
    quantize_weights: str | None = None,
    quantize_grads: str | None = None,
    quant_block: int = DEFAULT_BLOCK,
) -> float:
    """The fraction of a step spent computing when communication does not
    overlap compute: ``t_compute / (t_compute + comm_bytes / bandwidth)``.

    ``compute_time`` is seconds per step (``"10s"`` works); ``bandwidth`` is
    bytes per second and per device (``"300GB/s"``, ``"200Gb/s"``);
    ``model_parallel`` and the quantization (``quantize_weights``,
    ``quantize_grads``, ``quant_block``) as in :func:`comm_bytes` (ZeRO's
    data-axis bytes only).

    >>> import zero_jax as zj
    >>> round(zj.efficiency(7e9, 64, 3, compute_time="10s", bandwidth="10GB/s"), 3)
    0.707
    >>> round(zj.efficiency(7e9, 64, 3, compute_time="10s", bandwidth="10GB/s", quantize_weights="int8"), 3)
    0.783
    """
    t_compute = parse_seconds(compute_time, "efficiency: compute_time")
    bw = parse_bytes(bandwidth, "efficiency: bandwidth", rate=True)
    if t_compute <= 0 or bw <= 0:
        raise ValueError(
            f"efficiency: compute_time and bandwidth must be positive, got {compute_time!r}, {bandwidth!r}."
        )
    wire = {"quantize_weights": quantize_weights, "quantize_grads": quantize_grads, "quant_block": quant_block}
    comm = comm_bytes(num_params, num_devices, stage, dtype_bytes=dtype_bytes, model_parallel=model_parallel, **wire)
    return t_compute / (t_compute + comm / bw)


def required_bandwidth(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    compute_time: float | str,
    target: float = 0.9,
    dtype_bytes: float = 2,
    model_parallel: int = 1,
    quantize_weights: str | None = None,
    quantize_grads: str | None = None,
    quant_block: int = DEFAULT_BLOCK,
) -> float:
    """Bytes per second and device needed for :func:`efficiency` to reach
    ``target``: ``comm_bytes / (t_compute · (1/target − 1))`` (ZeRO's
    data-axis bytes, / M with ``model_parallel`` = M, quantized as in
    :func:`comm_bytes`).

    >>> import zero_jax as zj
    >>> zj.required_bandwidth(1e9, 8, 0, compute_time=1.0, target=0.5) / 1e9  # comm (3.5 GB) in 1 s
    3.5
    """
    t_compute = parse_seconds(compute_time, "required_bandwidth: compute_time")
    if t_compute <= 0:
        raise ValueError(f"required_bandwidth: compute_time must be positive, got {compute_time!r}.")
    if not 0 < target < 1:
        raise ValueError(f"required_bandwidth: target efficiency must be in (0, 1), got {target!r}.")
    wire = {"quantize_weights": quantize_weights, "quantize_grads": quantize_grads, "quant_block": quant_block}
    comm = comm_bytes(num_params, num_devices, stage, dtype_bytes=dtype_bytes, model_parallel=model_parallel, **wire)
    return comm / (t_compute * (1 / target - 1))


class KeepGatheredTrade(NamedTuple):
    """What keeping the last ``kept`` blocks gathered from the forward pass to
    the backward (``keep_gathered=kept``, stage 3) saves and costs, per device
    per step.

    Attributes:
      kept: blocks kept (the last ones of the forward pass).
      comm_saved: bytes one device sends less: one backward re-gather per
        kept block, as a ring moves it ((N−1)/N of its gathered bytes).
      memory_spent: bytes held more at the peak, at most: the kept blocks'
        gathered (whole) parameters, alive from their forward to their backward.
    """

    kept: int
    comm_saved: float
    memory_spent: float


BAD_KEEP_KS = "keep_gathered_trade: ks must be ints from 0 to the number of blocks ({count}), got {ks!r}."


def keep_gathered_trade(
    block_bytes: Any, num_devices: int, *, depth: int | None = None, ks: Any = None
) -> tuple[KeepGatheredTrade, ...]:
    """Per k of ``ks`` (default 0 … the number of blocks): the communication
    that ``keep_gathered=k`` saves and the memory it spends.

    ``block_bytes``: one block's gathered bytes (``"4MiB"`` or a number; then
    ``depth`` blocks alike) or a list of each block's, in call order (the
    last ones are kept). A kept block skips its backward re-gather of
    (N−1)/N·B bytes and holds its B whole bytes from its forward to its
    backward; ``zj.audit`` measures both (``report.comm``, ``report.memory``).

    >>> [(t.kept, t.comm_saved, t.memory_spent) for t in keep_gathered_trade("1MiB", 8, depth=16, ks=(0, 1, 4))]
    [(0, 0.0, 0.0), (1, 917504.0, 1048576.0), (4, 3670016.0, 4194304.0)]
    """
    where = "keep_gathered_trade"
    n = check_devices(num_devices, where)
    if not isinstance(block_bytes, (list, tuple)):
        if depth is None:
            raise TypeError(f"{where}: with one block size pass depth=..., or a list of each block's bytes.")
        block_bytes = [block_bytes] * check_devices(depth, where, "depth")
    sizes = [check_nonneg(parse_bytes(b, f"{where}: block_bytes"), f"{where}: block_bytes") for b in block_bytes]
    count = len(sizes)
    ks = range(count + 1) if ks is None else ks
    if not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= count for k in ks):
        raise ValueError(BAD_KEEP_KS.format(count=count, ks=ks))
    kept = [float(sum(sizes[count - k :])) if k else 0.0 for k in ks]
    return tuple(KeepGatheredTrade(k, (n - 1) / n * b, b) for k, b in zip(ks, kept, strict=True))
