"""The toolchain zero_jax runs on: the jax versions it supports, and which
compiler (and version of it) compiles for each backend.

The supported range is the one the suite runs on (``.ci/run``): the oldest
end is jax 0.10.2 on Python 3.11 (the newest jax the registries serve for
3.11), the newest end jax 0.12.1 on Python 3.12 and 3.13. An older jax is
refused at import with the pip line that fixes it; a newer one is allowed
with one warning (no break is known, none is tested).

>>> parse_version("0.0.46.3"), parse_version("0.12.0rc1"), parse_version("unknown")
((0, 0, 46, 3), (0, 12, 0), ())
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import warnings

import jax

#: The oldest jax the suite runs on (``.ci/run``'s oldest toolchain: Python 3.11).
OLDEST_JAX = (0, 10, 2)
#: The newest jax minor the suite runs on (``.ci/run``'s newest toolchain: Python 3.12 / 3.13, jax 0.12.1).
NEWEST_JAX_TESTED = (0, 12)

TOO_OLD = (
    "zero_jax needs jax >= {oldest} (found jax {found}); tested with jax {oldest} (Python 3.11) to {newest}.x "
    '(Python 3.12 / 3.13): pip install -U "jax>={oldest}" "jaxlib>={oldest}"'
)
NEWER_THAN_TESTED = (
    "zero_jax was tested with jax {oldest} to {newest}.x, not with jax {found}: report what breaks, or "
    'pip install "jax<{next_minor}" "jaxlib<{next_minor}"'
)

#: The package whose compiler compiles for each backend (XLA:CPU is in jaxlib; GPU: the CUDA plugin).
COMPILER_PACKAGES: dict[str, tuple[str, ...]] = {
    "cpu": ("jaxlib",),
    "tpu": ("libtpu", "libtpu-nightly"),
    "gpu": ("jax-cuda12-plugin", "jax-cuda13-plugin", "jaxlib"),
    "cuda": ("jax-cuda12-plugin", "jax-cuda13-plugin", "jaxlib"),
}


#: The libtpu each jax minor compiles deviceless with, as the ``tpu`` extra installs it: jax 0.10's and 0.11's
#: own pairings; jax 0.12.1's own extra asks for libtpu 0.0.53, which no registry serves (2026-12-06), and 0.0.52
#: compiles with it.
LIBTPU_FOR_JAX: dict[tuple[int, int], str] = {(0, 10): "0.0.42.1", (0, 11): "0.0.46.3", (0, 12): "0.0.52"}


def libtpu_install(jax_version: str | None = None) -> str:
    """The pip line that installs the TPU compiler matching ``jax_version``
    (the running jax by default), leaving jax as it is: the pinned libtpu of
    a tested jax minor, else jax's own ``tpu`` extra.

    >>> libtpu_install("0.12.1"), libtpu_install("0.13.0")
    ('pip install "libtpu==0.0.52"', 'pip install "jax[tpu]==0.13.0"')
    """
    version = jax_version or jax.__version__
    pinned = LIBTPU_FOR_JAX.get(parse_version(version)[:2])  # pyright: ignore[reportArgumentType] - two ints
    return f'pip install "libtpu=={pinned}"' if pinned else f'pip install "jax[tpu]=={version}"'


#: The CUDA major each jax minor's GPU plugin is served for, as the ``gpu`` extra installs it: the registries
#: serve jax-cuda12-plugin up to 0.12.0.1 and jax-cuda13-plugin from 0.12 on (2026-12-07), so jax 0.12.1 compiles
#: for GPUs with the CUDA 13 plugin.
CUDA_FOR_JAX: dict[tuple[int, int], int] = {(0, 10): 12, (0, 11): 12, (0, 12): 13}


def cuda_plugin_install(jaxlib_version: str | None = None) -> str:
    """The pip line that installs what compiles for NVIDIA GPUs here, without a
    GPU, matching ``jaxlib_version`` (the running jaxlib by default): the CUDA
    plugin and its PJRT library pinned to it (none of the CUDA runtime wheels
    ``jax[cuda12]`` adds), and ptxas (the CUDA compiler's wheel).

    >>> cuda_plugin_install("0.10.2")
    'pip install "jax-cuda12-plugin==0.10.2" "jax-cuda12-pjrt==0.10.2" nvidia-cuda-nvcc-cu12'
    >>> cuda_plugin_install("0.12.1")
    'pip install "jax-cuda13-plugin==0.12.1" "jax-cuda13-pjrt==0.12.1" "nvidia-cuda-nvcc>=13"'
    """
    version = jaxlib_version or importlib.metadata.version("jaxlib")
    v = parse_version(version)
    cuda = CUDA_FOR_JAX.get((v[0], v[1]) if len(v) > 1 else (0, 0), 13)
    nvcc = "nvidia-cuda-nvcc-cu12" if cuda == 12 else f'"nvidia-cuda-nvcc>={cuda}"'
    return f'pip install "jax-cuda{cuda}-plugin=={version}" "jax-cuda{cuda}-pjrt=={version}" {nvcc}'


def parse_version(text: str) -> tuple[int, ...]:
    """The leading dotted integers of a version string (``()`` when there are none)."""
    m = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@functools.cache  # asked at every trace of a layer-wise block; the installed packages do not change under a process
def compiler_version(backend: str) -> tuple[str, tuple[int, ...]]:
    """(package, version) of the compiler that compiles for ``backend`` here:
    jaxlib's XLA for CPU, libtpu for TPU, the CUDA plugin for GPU (``()``
    when the package is not installed).

    >>> compiler_version("cpu")[0]
    'jaxlib'
    """
    packages = COMPILER_PACKAGES.get(backend, ("jaxlib",))
    for package in packages:
        try:
            return package, parse_version(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            continue
    return packages[0], ()


def check_jax(found: str | None = None) -> None:
    """Refuse a jax older than the oldest tested one (ImportError naming the
    range and the pip line), warn once about one newer than the newest tested.

    >>> check_jax("0.10.2"), check_jax("0.12.1")
    (None, None)
    >>> try:
    ...     check_jax("0.9.2")
    ... except ImportError as e:
    ...     print(str(e)[:48], "...", str(e)[-46:])
    zero_jax needs jax >= 0.10.2 (found jax 0.9.2); ... pip install -U "jax>=0.10.2" "jaxlib>=0.10.2"
    """
    found = jax.__version__ if found is None else found
    version, oldest, newest = parse_version(found), version_text(OLDEST_JAX), version_text(NEWEST_JAX_TESTED)
    if version < OLDEST_JAX:
        raise ImportError(TOO_OLD.format(oldest=oldest, found=found, newest=newest))
    if version[:2] > NEWEST_JAX_TESTED:
        next_minor = f"{NEWEST_JAX_TESTED[0]}.{NEWEST_JAX_TESTED[1] + 1}"
        message = NEWER_THAN_TESTED.format(oldest=oldest, newest=newest, found=found, next_minor=next_minor)
        warnings.warn(message, UserWarning, stacklevel=3)
