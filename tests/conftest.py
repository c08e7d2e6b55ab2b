"""One place sets up the test process: 8 simulated CPU devices and warnings as
errors (pyproject's filterwarnings).

Dtype promotion stays "standard": optax itself (``tree.bias_correction``
raises a Python float to an int32 count) fails under "strict", and every
test runs optax. Our own code is checked under "strict" in test_partition.py.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

NUM_DEVICES = 8


def pytest_configure(config: pytest.Config) -> None:
    # Device tests need all 8 devices: fail loudly instead of skipping.
    assert jax.device_count() == NUM_DEVICES, (
        f"tests need {NUM_DEVICES} simulated CPU devices, got {jax.device_count()}: "
        "was a jax array created before tests/conftest.py ran?"
    )


def make_mesh(n: int, names: tuple[str, ...] = ("data",), shape: tuple[int, ...] | None = None) -> jax.sharding.Mesh:
    """A mesh over the first ``n`` devices."""
    shape = shape or (n,)
    devices = np.asarray(jax.devices()[:n]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace: dict) -> None:
    doctest_namespace["jax"] = jax
