"""One place sets up every pytest process (tests/ and the doctests in
zero_jax/): 8 simulated CPU devices, before any array exists. Warnings are
errors (pyproject's filterwarnings).

Dtype promotion stays "standard": optax itself (``tree.bias_correction``
raises a Python float to an int32 count) fails under "strict", and every
training test runs optax. Our own padding code is checked under "strict" in
tests/test_partition.py.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import pytest  # noqa: E402

NUM_DEVICES = 8


def pytest_configure(config: pytest.Config) -> None:
    # Device tests need all 8 devices: fail loudly instead of skipping.
    assert jax.device_count() == NUM_DEVICES, (
        f"tests need {NUM_DEVICES} simulated CPU devices, got {jax.device_count()}: "
        "was a jax array created before conftest.py ran?"
    )
