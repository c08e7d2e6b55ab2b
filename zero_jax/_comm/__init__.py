"""Communication inside a step: the few ``shard_map`` collectives every stage
composes (``collectives``: reduce-scatter, all-gather, all-reduce, per model
shard under tensor parallelism) and ZeRO++'s int8 block quantization for the
wire (``quantized``). Nothing else in the library calls ``jax.lax``
collectives on state-sized data."""
