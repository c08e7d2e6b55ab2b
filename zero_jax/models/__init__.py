"""Reference models used by the demo, the benchmarks and the tests."""

from zero_jax.models.transformer import (
    TransformerConfig,
    block,
    init_params,
    make_loss_fn,
    megatron_specs,
    model_flops,
    synthetic_batch,
    unstack_params,
)

__all__ = [
    "TransformerConfig",
    "block",
    "init_params",
    "make_loss_fn",
    "megatron_specs",
    "model_flops",
    "synthetic_batch",
    "unstack_params",
]
