"""The vocabulary every other concept speaks: key paths as users write them
(``tree``), numbers with units and the one byte formatter (``units``), one
error for every problem a check finds (``problems``), a value set for the
duration of a block (``scoped``: trace-time context), and the one
data-dependence walk over a traced program (``jaxpr``), and the toolchain:
the jax versions supported and which compiler, at which version, compiles
for each backend (``toolchain``)."""
