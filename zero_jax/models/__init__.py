"""Reference models used by the demo, the benchmarks and the tests: the
reference transformer (:mod:`zero_jax.models.transformer`) and a llama-style
decoder (:mod:`zero_jax.models.llama`), which share the synthetic batch, the
unscanned form and the loss."""

from zero_jax.models.llama import (
    LlamaConfig,
    llama_apply,
    llama_block,
    llama_init_params,
    make_llama_loss_fn,
)
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
    "LlamaConfig",
    "TransformerConfig",
    "block",
    "init_params",
    "llama_apply",
    "llama_block",
    "llama_init_params",
    "make_llama_loss_fn",
    "make_loss_fn",
    "megatron_specs",
    "model_flops",
    "synthetic_batch",
    "unstack_params",
]
