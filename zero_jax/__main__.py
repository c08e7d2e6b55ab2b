"""``python -m zero_jax demo | plan | audit``: see :mod:`zero_jax._cli.cli`."""

import sys

from zero_jax._cli.cli import main

if __name__ == "__main__":
    sys.exit(main())
