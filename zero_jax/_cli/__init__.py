"""``python -m zero_jax demo | plan | audit``: the command line (``cli``) and
the demo (``demo``)."""
