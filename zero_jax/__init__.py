"""zero_jax: ZeRO stages 0–3 for JAX as sharding policies over any optax optimizer.

>>> import jax, optax, zero_jax as zj
>>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
>>> policy = zj.ZeroPolicy(stage=2, mesh=mesh)
>>> tx = zj.shard_optimizer(optax.adamw(1e-3), policy)
"""

from zero_jax._base.toolchain import check_jax

check_jax()  # before anything else: an unsupported jax says so in one line, with the pip line that fixes it

from zero_jax import adapters, checkpoint, measure
from zero_jax._audit.audit import audit
from zero_jax._audit.hlo import Collective
from zero_jax._audit.report import AuditError, AuditReport, Communication, LeafBytes, Violation
from zero_jax._layerwise.blocks import apply_layer, apply_layers
from zero_jax._layerwise.head import head_cross_entropy
from zero_jax._layerwise.pieces import Sharded, embedding_lookup, gather
from zero_jax._layerwise.scan import scan_layers
from zero_jax._layout.leaf import DEFAULT_MIN_SHARD_SIZE, LeafLayout, ReplicatedLeaf, leaf_layout
from zero_jax._plan.budget import KeepGatheredChoice, choose_keep_gathered
from zero_jax._plan.plan import Plan, plan
from zero_jax._plan.topology import DeviceSlice, TpuSlice, device_slice, gpu_slice, topology_mesh, tpu_slice
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._policy.precision import DynamicLossScale, LossScaleState, Precision
from zero_jax._processes.launch import launch
from zero_jax._processes.multihost import shard_batch
from zero_jax._step.offload import OffloadedLeaf, OffloadPlan, offload_plan
from zero_jax._step.optimizer import (
    ShardedOptState,
    ShardedTransformation,
    frozen_leaves,
    matrix_leaves,
    shard_optimizer,
)
from zero_jax._step.state import TrainState, full_params, init_state
from zero_jax._step.train import TrainStep, make_train_step
from zero_jax._theory.choice import StageChoice, choose_stage
from zero_jax._theory.formulas import (
    ActivationCheckpointBytes,
    KeepGatheredTrade,
    ModelStateBytes,
    activation_checkpoint_bytes,
    comm_bytes,
    comm_bytes_per_axis,
    efficiency,
    keep_gathered_trade,
    model_state_bytes,
    required_bandwidth,
)
from zero_jax._version import __version__ as __version__
from zero_jax.checkpoint._manager import CheckpointManager, save
from zero_jax.checkpoint._restore import restore
from zero_jax.checkpoint._safetensors import export_params, load_params

__all__ = [
    "ActivationCheckpointBytes",
    "AuditError",
    "AuditReport",
    "CheckpointManager",
    "Collective",
    "Communication",
    "DEFAULT_MIN_SHARD_SIZE",
    "DeviceSlice",
    "DynamicLossScale",
    "KeepGatheredChoice",
    "KeepGatheredTrade",
    "LeafBytes",
    "LeafLayout",
    "LossScaleState",
    "ModelStateBytes",
    "OffloadPlan",
    "OffloadedLeaf",
    "Plan",
    "Precision",
    "ReplicatedLeaf",
    "Sharded",
    "ShardedOptState",
    "ShardedTransformation",
    "StageChoice",
    "TpuSlice",
    "TrainState",
    "TrainStep",
    "Violation",
    "ZeroPolicy",
    "activation_checkpoint_bytes",
    "adapters",
    "apply_layer",
    "apply_layers",
    "audit",
    "checkpoint",
    "choose_keep_gathered",
    "choose_stage",
    "comm_bytes",
    "comm_bytes_per_axis",
    "device_slice",
    "efficiency",
    "embedding_lookup",
    "export_params",
    "frozen_leaves",
    "matrix_leaves",
    "full_params",
    "gather",
    "gpu_slice",
    "head_cross_entropy",
    "init_state",
    "keep_gathered_trade",
    "launch",
    "leaf_layout",
    "load_params",
    "make_train_step",
    "measure",
    "model_state_bytes",
    "offload_plan",
    "plan",
    "required_bandwidth",
    "restore",
    "save",
    "scan_layers",
    "shard_batch",
    "shard_optimizer",
    "topology_mesh",
    "tpu_slice",
]
