"""TPU slices on any machine: the devices of a slice, by name, for compiling
with the real TPU compiler without a TPU (deviceless, "ahead of time").

``jax.experimental.topologies.get_topology_desc(topology_name=..., platform="tpu")``
gives the compile-only devices of a slice once libtpu is installed
(``pip install -e ".[tpu]"``: the libtpu matching the running jax); a step
lowered on a ``Mesh`` of those devices compiles with the TPU backend: ``memory_analysis()`` is TPU HBM buffer
assignment and ``as_text()`` the scheduled TPU program. ``JAX_PLATFORMS=cpu``
keeps ``jax.devices()`` on the CPU meanwhile. Nothing here runs at import:
libtpu is loaded by the first :func:`tpu_slice` or :func:`topology_mesh`.

Names are libtpu's (``v5p:2x2x2``, ``v5e:4x4``, ``"TPU v5 lite:4x4"``,
``v6e:16x16``, ``v4:2x2x1``) or the Cloud TPU accelerator types users type
(``v5p-128``, ``v4-8``, ``v5litepod-16``, ``v6e-256``), mapped to the shapes the
Cloud TPU documentation gives them (:func:`topology_name`).

>>> topology_name("v5p-128"), topology_name("v5litepod-16"), topology_name("v5p:2x2x2")
('v5p:4x4x4', 'v5e:4x4', 'v5p:2x2x2')
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.experimental import topologies

from zero_jax._base.toolchain import libtpu_install
from zero_jax._base.units import fmt_bytes

#: The pip line that installs the TPU compiler matching the running jax.
INSTALL_LIBTPU = libtpu_install()
NO_LIBTPU = (
    "compiling for a TPU slice needs libtpu, the TPU compiler, which is not installed: {install} "
    "(about 250 MB; no TPU needed, it compiles on any machine), or pip install -e \".[test]\"."
)
#: The forms a topology name may take (named by every topology error).
TOPOLOGY_FORMS = (
    "Write libtpu's TYPE:SHAPE, e.g. 'v5p:2x2x2', 'v5p:4x4x8', 'v4:2x2x1', 'v5e:4x4', 'TPU v5 lite:4x4', "
    "'v6e:16x16' (the shape counts chips), or a Cloud TPU accelerator type: 'v5p-N' / 'v4-N' (N TensorCores, "
    "2 per chip: {cores}) or 'v5litepod-N' / 'v5e-N' / 'v6e-N' (N chips: {chips})"
)
BAD_TOPOLOGY = "topology {name!r} is not a TPU slice name. " + TOPOLOGY_FORMS + "."
UNKNOWN_SIZE = (
    "topology {name!r}: no Cloud TPU {kind} slice of that size has a documented shape; write the shape itself, e.g. "
    "'{example}', or one of the sizes {sizes}."
)
TOPOLOGY_REJECTED = "topology {name!r}{alias}: libtpu rejects it: {reason}. " + TOPOLOGY_FORMS + "."
MESH_SHAPE = (
    "topology_mesh: shape {shape} holds {size} devices, but {name} has {n}; pass a shape whose product is {n}, "
    "e.g. {example}."
)
MESH_AXES = "topology_mesh: {k} axes {axes} need a shape of {k} sizes (product {n}), got shape={shape!r}."

# Cloud TPU accelerator types -> libtpu's shapes, from the Cloud TPU documentation's tables of slice shapes
# (cloud.google.com/tpu/docs/v4, /v5p, /v5e, /v6e, read 2026-12). v4 and v5p count TensorCores (2 per chip:
# v5p-8 is 4 chips, 2x2x1), v5e and v6e count chips (1 TensorCore per chip).
_CORES_SHAPES = {
    8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8", 512: "4x8x8",
    1024: "8x8x8", 2048: "8x8x16", 4096: "8x16x16", 8192: "16x16x16", 12288: "16x16x24",
}  # fmt: skip
_CHIP_SHAPES = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_CLOUD_NAME = re.compile(r"^\s*(?P<kind>v4|v5p|v5e|v5litepod|v6e)-(?P<n>\d+)\s*$", re.IGNORECASE)
#: libtpu's own pattern for a topology name (its error text quotes it).
_LIBTPU_NAME = re.compile(r"^(?P<kind>[a-zA-Z0-9_ ]+)[=_:](?P<shape>[0-9x]+)(_twisted|_untwisted)?$")
_KIND_ALIASES = {"v5litepod": "v5e"}  # a Cloud TPU name libtpu does not know as a type

# HBM per chip, in GiB, by device_kind: the Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4,
# /v5e, /v5p, /v6e; "HBM capacity per chip": v4 32 GiB, v5e 16 GB, v5p 95 GiB (of 96 physical: what JAX can
# allocate), v6e 32 GB; the GB of v5e / v6e taken as GiB, like v5p's). libtpu's own limit for v5p, quoted when
# it refuses a program, is 95.74 GiB. A chip with 2 devices (v4's two TensorCores in a deviceless topology)
# gives each half.
HBM_GIB_PER_CHIP = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95, "TPU v6 lite": 32}

# libtpu reads these while it starts. On a machine without a TPU there is no slice to discover: without them
# it asks the GCE metadata server and prints TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES warnings on stderr
# (measured with libtpu 0.0.42.1); ALLOW_MULTIPLE_LIBTPU_LOAD lets several processes (pytest-xdist workers,
# zj.plan's child) load it at once, since a deviceless compile needs no chip to itself.
DEVICELESS_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_HOST_BOUNDS": "1,1,1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
_GOOGLE_PCI_VENDOR = "0x1ae0"


def topology_name(name: str) -> str:
    """libtpu's name for a slice: a Cloud TPU accelerator type mapped to its
    documented shape, ``v5litepod:SHAPE`` to ``v5e:SHAPE``, anything else of
    libtpu's form as given (libtpu judges the shape when it loads).

    >>> topology_name("v4-8"), topology_name("TPU v5 lite:2x4")
    ('v4:2x2x1', 'TPU v5 lite:2x4')
    """
    if not isinstance(name, str):
        raise TypeError(BAD_TOPOLOGY.format(name=name, cores=_sizes(_CORES_SHAPES), chips=_sizes(_CHIP_SHAPES)))
    m = _CLOUD_NAME.match(name)
    if m:
        kind, n = m["kind"].lower(), int(m["n"])
        table = _CORES_SHAPES if kind in ("v4", "v5p") else _CHIP_SHAPES
        if n not in table:
            example = f"{_KIND_ALIASES.get(kind, kind)}:{next(iter(table.values()))}"
            raise ValueError(UNKNOWN_SIZE.format(name=name, kind=kind, example=example, sizes=_sizes(table)))
        return f"{_KIND_ALIASES.get(kind, kind)}:{table[n]}"
    m = _LIBTPU_NAME.match(name.strip())
    if not m:
        raise ValueError(BAD_TOPOLOGY.format(name=name, cores=_sizes(_CORES_SHAPES), chips=_sizes(_CHIP_SHAPES)))
    kind = _KIND_ALIASES.get(m["kind"].lower(), m["kind"])
    return kind + name.strip()[len(m["kind"]) :]


def _sizes(table: dict[int, str]) -> str:
    return ", ".join(str(n) for n in table)


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU slice as libtpu describes it (picklable; the devices themselves
    come from :func:`topology_devices`).

    Attributes:
      name: the name as given (``"v5p-128"``).
      topology: libtpu's name (``"v5p:4x4x4"``).
      device_kind: ``"TPU v5"``, ``"TPU v5 lite"``, ``"TPU v4"``, ...
      num_devices: the devices a mesh spans (JAX devices, one per chip on
        v5p / v5e / v6e, one per TensorCore on v4).
      num_chips: the chips (distinct chip coordinates).
      hbm_per_chip: HBM bytes per chip (:data:`HBM_GIB_PER_CHIP`; ``None``
        for a kind the table does not know).
    """

    name: str
    topology: str
    device_kind: str
    num_devices: int
    num_chips: int
    hbm_per_chip: int | None

    @property
    def devices_per_chip(self) -> int:
        return self.num_devices // self.num_chips

    @property
    def hbm_per_device(self) -> int | None:
        """HBM bytes each device of a mesh may use: the chip's, split among its devices."""
        return None if self.hbm_per_chip is None else self.hbm_per_chip // self.devices_per_chip

    def __str__(self) -> str:
        alias = f"{self.name} = " if self.name != self.topology else ""
        per_chip = f", {self.devices_per_chip} per chip" if self.devices_per_chip > 1 else ""
        b = self.hbm_per_device
        hbm = "HBM unknown" if b is None else f"{fmt_bytes(b)} ({fmt_bytes(b, decimal=True)}) HBM per device"
        return (
            f"{alias}{self.topology}: {self.num_chips} chips, {self.num_devices} devices "
            f"({self.device_kind}{per_chip}), {hbm}"
        )


def check_libtpu() -> None:
    """Raise ``ImportError`` naming the pip line unless libtpu can be loaded
    (the ``libtpu`` package, or a file at ``TPU_LIBRARY_PATH``)."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path and os.path.isfile(path):
        return
    if importlib.util.find_spec("libtpu") is None:  # found, not imported: JAX loads it
        raise ImportError(NO_LIBTPU.format(install=INSTALL_LIBTPU))


def tpu_attached() -> bool:
    """Whether this machine has a TPU chip on its PCI bus (Google's vendor id),
    as JAX itself decides whether to start a TPU runtime."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == _GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def deviceless_environment() -> None:
    """Before libtpu starts on a machine without a TPU: :data:`DEVICELESS_ENV`
    where the environment does not say otherwise. On a TPU host, nothing (the
    runtime there needs the real values)."""
    if tpu_attached():
        return
    for key, value in DEVICELESS_ENV.items():
        os.environ.setdefault(key, value)


@functools.cache
def _load(topology: str) -> tuple[Any, ...]:
    """The compile-only devices of libtpu's ``topology`` (loaded once per process)."""
    deviceless_environment()
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def topology_devices(name: str) -> tuple[Any, ...]:
    """The compile-only devices of the slice ``name`` (any form :func:`topology_name` takes)."""
    topology = topology_name(name)
    check_libtpu()
    try:
        return _load(topology)
    except jax.errors.JaxRuntimeError as e:
        reason = str(e).splitlines()[0].removeprefix("INVALID_ARGUMENT: ").rstrip(".")
        raise ValueError(
            TOPOLOGY_REJECTED.format(
                name=name, alias="" if topology == name else f" ({topology})", reason=reason,
                cores=_sizes(_CORES_SHAPES), chips=_sizes(_CHIP_SHAPES),
            )  # fmt: skip
        ) from None


def tpu_slice(name: str) -> TpuSlice:
    """What the slice ``name`` is: devices, chips, kind and HBM per device.

    Example (loads libtpu; no TPU needed):

    >>> print(tpu_slice("v5p-8"))
    v5p-8 = v5p:2x2x1: 4 chips, 4 devices (TPU v5), 95.00 GiB (102.0 GB) HBM per device
    """
    devices = topology_devices(name)
    kind = devices[0].device_kind
    chips = len({(d.process_index, tuple(d.coords)) for d in devices})
    gib = HBM_GIB_PER_CHIP.get(kind)
    return TpuSlice(name, topology_name(name), kind, len(devices), chips, None if gib is None else gib * 2**30)


def topology_mesh(
    topology: str,
    axes: str | Sequence[str] = ("data",),
    shape: Sequence[int] | None = None,
    *,
    axis_types: Any = None,
) -> jax.sharding.Mesh:
    """A ``jax.sharding.Mesh`` of a TPU slice's devices, to build and compile a
    step for that slice on this machine (``step.lower(...).compile()``,
    :func:`zero_jax.plan`, :func:`zero_jax.audit`); nothing can run on it.

    Args:
      topology: the slice (:func:`topology_name`'s forms: ``"v5p:4x4x8"``,
        ``"v5p-128"``, ``"v5e:4x4"``, ...).
      axes: the mesh axis names (one name: a 1-D mesh of every device).
      shape: the mesh shape, one size per axis, product = the slice's device
        count (default: all devices on the one axis).
      axis_types: as ``jax.make_mesh`` (default: its default).

    The device order is ``jax.make_mesh``'s for that physical topology (rings
    along the torus). A mesh over several axes:

    >>> mesh = topology_mesh("v5p:2x2x2", ("replica", "data"), (2, 4))
    >>> dict(mesh.shape), mesh.devices.flat[0].platform
    ({'replica': 2, 'data': 4}, 'tpu')
    """
    devices = topology_devices(topology)
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    n = len(devices)
    if shape is None:
        if len(names) != 1:
            raise ValueError(MESH_AXES.format(k=len(names), axes=names, n=n, shape=shape))
        shape = (n,)
    sizes = tuple(shape)
    if len(sizes) != len(names) or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise ValueError(MESH_AXES.format(k=len(names), axes=names, n=n, shape=shape))
    if math.prod(sizes) != n:
        raise ValueError(
            MESH_SHAPE.format(shape=sizes, size=math.prod(sizes), name=topology, n=n, example=_example(len(sizes), n))
        )
    return jax.make_mesh(sizes, names, axis_types=axis_types, devices=list(devices))


def _example(k: int, n: int) -> tuple[int, ...]:
    """A shape of ``k`` sizes with product ``n``, for an error message."""
    if k == 1:
        return (n,)
    return (*(1,) * (k - 2), 2, n // 2) if n % 2 == 0 else (*(1,) * (k - 1), n)
