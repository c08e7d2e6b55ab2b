"""Compile targets on any machine: the devices of a TPU slice or of NVIDIA
GPU hosts, by name, for compiling with the real TPU or GPU compiler without
the hardware (deviceless, "ahead of time").

TPU: ``jax.experimental.topologies.get_topology_desc(topology_name=..., platform="tpu")``
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

GPU: ``get_topology_desc(platform="cuda", topology="1xHOSTSxGPUS",
target_config=...)`` gives the compile-only devices of HOSTS hosts of GPUS
NVIDIA GPUs each once the CUDA plugin is installed (``pip install -e
".[gpu]"``: the plugin at jaxlib's version and ptxas; no GPU and no CUDA
driver needed); ``target_config`` is XLA's own description of the GPU (a
``GpuTargetConfigProto``), shipped with the package (:data:`GPU_SPECS`, the
files in ``gpu_specs/``). Names are ``KIND:HOSTSxGPUS``: ``h100:1x8``,
``h200:2x8``, ``b200:1x8``, ``a100:4x8`` (:func:`gpu_name`).

>>> topology_name("v5p-128"), topology_name("v5litepod-16"), topology_name("v5p:2x2x2")
('v5p:4x4x4', 'v5e:4x4', 'v5p:2x2x2')
>>> gpu_name("H100:2x8"), is_gpu_name("h100:1x8"), is_gpu_name("v5p:2x2x2")
('h100:2x8', True, False)
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.resources
import importlib.util
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.experimental import topologies

from zero_jax._base.toolchain import compiler_version, cuda_plugin_install, libtpu_install
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

NOT_A_TPU = (
    "{fn}: {name!r} names GPU hosts, not a TPU slice; pass a TPU slice ('v5p:2x2x2', 'v5p-128', 'v5e:4x4'), "
    "or describe GPU hosts with zj.gpu_slice({name!r}) (zj.topology_mesh and zj.plan(topology=...) take either)."
)
NOT_A_GPU = (
    "{fn}: {name!r} is not a GPU host name; write KIND:HOSTSxGPUS with KIND one of {kinds} (e.g. 'h100:1x8'), "
    "or describe a TPU slice with zj.tpu_slice({name!r}) (zj.topology_mesh and zj.plan(topology=...) take either)."
)

#: The CUDA plugins' PJRT modules (``jax_plugins.<name>``), as JAX discovers them.
CUDA_PLUGINS = ("xla_cuda12", "xla_cuda13")
#: The pip line that installs the GPU compiler matching the running jaxlib (the CUDA plugin and ptxas).
INSTALL_CUDA_PLUGIN = cuda_plugin_install()
NO_CUDA_PLUGIN = (
    "compiling for GPU hosts needs the CUDA plugin, the GPU compiler, which is not installed: {install} "
    "(about 200 MB; no GPU or CUDA driver needed, it compiles on any machine), or pip install -e \".[gpu]\"."
)
GPU_FORMS = "Write KIND:HOSTSxGPUS (GPUS per host), KIND one of {kinds}: e.g. 'h100:1x8', 'h200:2x8', 'a100:4x8'"
UNKNOWN_GPU = "topology {name!r}: no GPU named {kind!r} is known. " + GPU_FORMS + " (XLA's spec files: gpu_specs/)."
BAD_GPU_SHAPE = "topology {name!r}: {shape!r} is not HOSTSxGPUS (two positive sizes). " + GPU_FORMS + "."
GPU_REJECTED = "topology {name!r}: the CUDA plugin rejects it: {reason}. " + GPU_FORMS + "."


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One of XLA's GPU target descriptions shipped in ``gpu_specs/``.

    Attributes:
      file: the file in ``zero_jax/_plan/gpu_specs/``.
      commit: the openxla/xla commit it was copied from, unchanged, at
        ``xla/backends/gpu/target_config/specs/<file>`` (Apache-2.0, the
        OpenXLA Authors; ``gpu_specs/README.md``).
    """

    file: str
    commit: str

    @property
    def source(self) -> str:
        return f"https://github.com/openxla/xla/blob/{self.commit}/xla/backends/gpu/target_config/specs/{self.file}"

    def text(self) -> str:
        return importlib.resources.files("zero_jax._plan").joinpath("gpu_specs", self.file).read_text()

    @property
    def memory_bytes(self) -> int:
        """The device memory the spec gives one GPU (``device_memory_size``)."""
        return int(re.search(r"device_memory_size:\s*(\d+)", self.text()).group(1))  # pyright: ignore[reportOptionalMemberAccess] - every shipped spec has it


#: The GPUs a name may start with, each from XLA's own GpuTargetConfigProto file (SXM parts where XLA has
#: several).
GPU_SPECS = {
    "h100": GpuSpec("h100_sxm.txtpb", "0774019d97e77dc433ce97604295f6fc0f5b3b65"),
    "h200": GpuSpec("h200.txtpb", "4336d12e0706168f6a382ddb231f3a83853b0657"),
    "b200": GpuSpec("b200.txtpb", "300ec95ab85fa9f40af388054f7d43707407cb52"),
    "a100": GpuSpec("a100_sxm_80.txtpb", "4336d12e0706168f6a382ddb231f3a83853b0657"),
}
#: Fields of XLA's newer spec files an older CUDA plugin's parser does not know -> the first plugin version
#: measured to read them (jax-cuda12-plugin 0.10.2 refuses ``collective_memory_granularity``, jax-cuda13-plugin
#: 0.12.1 reads it): dropped for an older plugin, and whenever the file as written is refused.
NEWER_SPEC_FIELDS = {"collective_memory_granularity": (0, 12)}
_GPU_NAME = re.compile(r"^\s*(?P<kind>[A-Za-z][A-Za-z0-9]*)\s*:\s*(?P<shape>[^\s]+)\s*$")
_TPU_KIND = re.compile(r"^(v\d|tpu)", re.IGNORECASE)

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
# The CUDA plugin checks the CUDA runtime's version when JAX starts its backends, unless JAX_PLATFORMS leaves
# CUDA out; without CUDA that check fails and the plugin is not registered: no GPU topology can be made
# (jax-cuda12-plugin 0.10.2). On a machine without an NVIDIA GPU the check is skipped instead.
DEVICELESS_GPU_ENV = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
_NVIDIA_PCI_VENDOR = "0x10de"
CUDA_NOT_STARTED = (
    "the CUDA plugin is installed but JAX did not start it in this process (no CUDA here, and JAX's backends "
    "started before zero_jax could skip its CUDA version check): set JAX_PLATFORMS=cpu (or "
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) in the environment before JAX starts, then compile for GPU hosts."
)


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


def is_gpu_name(name: Any) -> bool:
    """Whether ``name`` names GPU hosts (``KIND:SHAPE`` whose kind is not a
    TPU's, known GPU or not: :func:`gpu_name` judges it)."""
    m = _GPU_NAME.match(name) if isinstance(name, str) else None
    return m is not None and (m["kind"].lower() in GPU_SPECS or not _TPU_KIND.match(m["kind"]))


def gpu_name(name: str) -> str:
    """The canonical name of GPU hosts, ``kind:HOSTSxGPUS`` (kind in lower case)."""
    m = _GPU_NAME.match(name) if isinstance(name, str) else None
    kinds = ", ".join(GPU_SPECS)
    if m is None or not is_gpu_name(name):
        raise ValueError(NOT_A_GPU.format(fn="gpu_slice", name=name, kinds=kinds))
    kind = m["kind"].lower()
    if kind not in GPU_SPECS:
        raise ValueError(UNKNOWN_GPU.format(name=name, kind=m["kind"], kinds=kinds))
    sizes = m["shape"].lower().split("x")
    if len(sizes) != 2 or not all(p.isdigit() and int(p) > 0 for p in sizes):
        raise ValueError(BAD_GPU_SHAPE.format(name=name, shape=m["shape"], kinds=kinds))
    return f"{kind}:{int(sizes[0])}x{int(sizes[1])}"


@dataclasses.dataclass(frozen=True)
class DeviceSlice:
    """A compile target as its compiler describes it: a TPU slice, or GPU hosts
    (picklable; the devices themselves come from :func:`topology_devices`).

    Attributes:
      name: the name as given (``"v5p-128"``, ``"H100:2x8"``).
      topology: the canonical name (libtpu's ``"v5p:4x4x4"``; ``"h100:2x8"``).
      device_kind: ``"TPU v5"``, ``"TPU v4"``, ``"NVIDIA H100 80GB HBM3"``, ...
      num_devices: the devices a mesh spans (JAX devices, one per chip on
        v5p / v5e / v6e, one per TensorCore on v4, one per GPU).
      num_chips: the chips (distinct chip coordinates; the GPUs).
      hbm_per_chip: memory bytes per chip (TPU: :data:`HBM_GIB_PER_CHIP`;
        GPU: the spec's ``device_memory_size``; ``None`` for a kind no table
        knows).
      platform: ``"tpu"`` or ``"gpu"``.
      num_hosts: the hosts (GPU: HOSTS of ``KIND:HOSTSxGPUS``; TPU: the
        processes libtpu gives the slice's devices).
    """

    name: str
    topology: str
    device_kind: str
    num_devices: int
    num_chips: int
    hbm_per_chip: int | None
    platform: str = "tpu"
    num_hosts: int = 1

    @property
    def devices_per_chip(self) -> int:
        return self.num_devices // self.num_chips

    @property
    def hbm_per_device(self) -> int | None:
        """Memory bytes each device of a mesh may use: the chip's, split among its devices."""
        return None if self.hbm_per_chip is None else self.hbm_per_chip // self.devices_per_chip

    def __str__(self) -> str:
        alias = f"{self.name} = " if self.name != self.topology else ""
        b = self.hbm_per_device
        if self.platform == "gpu":
            mem = "memory unknown" if b is None else f"{fmt_bytes(b)} ({fmt_bytes(b, decimal=True)}) memory per GPU"
            per_host = self.num_devices // self.num_hosts
            hosts = f"{self.num_hosts} host{'s' if self.num_hosts > 1 else ''} x {per_host} GPUs"
            return f"{alias}{self.topology}: {hosts} = {self.num_devices} devices ({self.device_kind}), {mem}"
        per_chip = f", {self.devices_per_chip} per chip" if self.devices_per_chip > 1 else ""
        hbm = "HBM unknown" if b is None else f"{fmt_bytes(b)} ({fmt_bytes(b, decimal=True)}) HBM per device"
        return (
            f"{alias}{self.topology}: {self.num_chips} chips, {self.num_devices} devices "
            f"({self.device_kind}{per_chip}), {hbm}"
        )


#: The name a TPU slice's description had before GPU hosts got one too (:class:`DeviceSlice`).
TpuSlice = DeviceSlice


def check_libtpu() -> None:
    """Raise ``ImportError`` naming the pip line unless libtpu can be loaded
    (the ``libtpu`` package, or a file at ``TPU_LIBRARY_PATH``)."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path and os.path.isfile(path):
        return
    if importlib.util.find_spec("libtpu") is None:  # found, not imported: JAX loads it
        raise ImportError(NO_LIBTPU.format(install=INSTALL_LIBTPU))


def tpu_attached(vendor_id: str = _GOOGLE_PCI_VENDOR) -> bool:
    """Whether this machine has a TPU chip on its PCI bus (Google's vendor id),
    as JAX itself decides whether to start a TPU runtime (``vendor_id``
    ``0x10de``: an NVIDIA GPU)."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == vendor_id:
                    return True
        except OSError:
            continue
    return False


def deviceless_environment() -> None:
    """Before libtpu or the CUDA plugin starts on a machine without a TPU or
    an NVIDIA GPU: :data:`DEVICELESS_ENV` (TPU) and :data:`DEVICELESS_GPU_ENV`
    where the environment does not say otherwise. On a host with the chip,
    nothing (the runtime there needs the real values)."""
    for env, vendor in ((DEVICELESS_ENV, _GOOGLE_PCI_VENDOR), (DEVICELESS_GPU_ENV, _NVIDIA_PCI_VENDOR)):
        if not tpu_attached(vendor):
            for key, value in env.items():
                os.environ.setdefault(key, value)


def check_cuda_plugin() -> None:
    """Raise ``ImportError`` naming the pip line unless the CUDA plugin is installed."""
    if not any(_installed(f"jax_plugins.{m}") for m in CUDA_PLUGINS):
        raise ImportError(NO_CUDA_PLUGIN.format(install=INSTALL_CUDA_PLUGIN))


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (found, not imported: JAX loads a plugin itself)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package (``jax_plugins``) is not there either
        return False


def gpu_target_config(kind: str, drop: Sequence[str] = ()) -> str:
    """XLA's GpuTargetConfigProto text for ``kind`` (a key of :data:`GPU_SPECS`), the fields ``drop`` left out."""
    text = GPU_SPECS[kind].text()
    for field in drop:
        text = re.sub(rf"^\s*{field}:.*\n", "", text, flags=re.M)
    return text


@functools.cache
def _load_gpu(topology: str) -> tuple[Any, ...]:
    """The compile-only devices of GPU hosts ``kind:HOSTSxGPUS`` (loaded once per process): XLA's spec as
    written, or without :data:`NEWER_SPEC_FIELDS` when this plugin's parser refuses them."""
    kind, shape = topology.split(":")
    shape = f"1x{shape}"  # slices x hosts x GPUs per host
    plugin = compiler_version("gpu")[1]
    unknown = [field for field, since in NEWER_SPEC_FIELDS.items() if plugin < since]
    try:
        config = gpu_target_config(kind, unknown)
        desc = topologies.get_topology_desc(platform="cuda", topology=shape, target_config=config)
    except jax.errors.JaxRuntimeError as e:
        if "GpuTargetConfigProto" not in str(e):
            raise
        config = gpu_target_config(kind, list(NEWER_SPEC_FIELDS))
        desc = topologies.get_topology_desc(platform="cuda", topology=shape, target_config=config)
    return tuple(desc.devices)


@functools.cache
def _load(topology: str) -> tuple[Any, ...]:
    """The compile-only devices of libtpu's ``topology`` (loaded once per process)."""
    deviceless_environment()
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def topology_devices(name: str) -> tuple[Any, ...]:
    """The compile-only devices of the slice ``name`` (any form :func:`topology_name`
    or :func:`gpu_name` takes)."""
    if is_gpu_name(name):
        return _gpu_devices(name)
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


def _gpu_devices(name: str) -> tuple[Any, ...]:
    topology = gpu_name(name)
    check_cuda_plugin()
    deviceless_environment()
    try:
        return _load_gpu(topology)
    except NotImplementedError:  # "topology not implemented for cuda": the plugin did not register
        raise RuntimeError(CUDA_NOT_STARTED) from None
    except jax.errors.JaxRuntimeError as e:
        reason = str(e).splitlines()[0].rstrip(".")
        raise ValueError(GPU_REJECTED.format(name=name, reason=reason, kinds=", ".join(GPU_SPECS))) from None


def tpu_slice(name: str) -> DeviceSlice:
    """What the TPU slice ``name`` is: devices, chips, kind and HBM per device.

    Example (loads libtpu; no TPU needed):

    >>> print(tpu_slice("v5p-8"))
    v5p-8 = v5p:2x2x1: 4 chips, 4 devices (TPU v5), 95.00 GiB (102.0 GB) HBM per device
    """
    if is_gpu_name(name):
        raise ValueError(NOT_A_TPU.format(fn="tpu_slice", name=name))
    devices = topology_devices(name)
    kind = devices[0].device_kind
    chips = len({(d.process_index, tuple(d.coords)) for d in devices})
    hosts = len({d.process_index for d in devices})
    gib = HBM_GIB_PER_CHIP.get(kind)
    hbm = None if gib is None else gib * 2**30
    return DeviceSlice(name, topology_name(name), kind, len(devices), chips, hbm, "tpu", hosts)


def gpu_slice(name: str) -> DeviceSlice:
    """What the GPU hosts ``name`` (``KIND:HOSTSxGPUS``) are: devices, hosts,
    kind and memory per GPU (XLA's spec of the GPU, :data:`GPU_SPECS`).

    Example (loads the CUDA plugin, ``pip install -e ".[gpu]"``; no GPU needed):

    >>> try:
    ...     hosts = gpu_slice("h100:2x8")
    ... except ImportError:  # no CUDA plugin here (the error names the pip line): the same description, written out
    ...     hosts = DeviceSlice("h100:2x8", "h100:2x8", "NVIDIA H100 80GB HBM3", 16, 16, 84942979072, "gpu", 2)
    >>> print(hosts)
    h100:2x8: 2 hosts x 8 GPUs = 16 devices (NVIDIA H100 80GB HBM3), 79.11 GiB (84.9 GB) memory per GPU
    """
    if not is_gpu_name(name):
        raise ValueError(NOT_A_GPU.format(fn="gpu_slice", name=name, kinds=", ".join(GPU_SPECS)))
    devices = _gpu_devices(name)
    topology = gpu_name(name)
    hosts = len({d.process_index for d in devices})
    memory = GPU_SPECS[topology.split(":")[0]].memory_bytes
    return DeviceSlice(name, topology, devices[0].device_kind, len(devices), len(devices), memory, "gpu", hosts)


def device_slice(name: str) -> DeviceSlice:
    """The compile target ``name``: a TPU slice (:func:`tpu_slice`) or GPU hosts (:func:`gpu_slice`)."""
    return gpu_slice(name) if is_gpu_name(name) else tpu_slice(name)


def topology_mesh(
    topology: str,
    axes: str | Sequence[str] = ("data",),
    shape: Sequence[int] | None = None,
    *,
    axis_types: Any = None,
) -> jax.sharding.Mesh:
    """A ``jax.sharding.Mesh`` of a TPU slice's or GPU hosts' devices, to build
    and compile a step for them on this machine (``step.lower(...).compile()``,
    :func:`zero_jax.plan`, :func:`zero_jax.audit`); nothing can run on it.

    Args:
      topology: the slice (:func:`topology_name`'s forms: ``"v5p:4x4x8"``,
        ``"v5p-128"``, ``"v5e:4x4"``, ...) or GPU hosts (``"h100:1x8"``,
        ``"h200:2x8"``: :func:`gpu_name`'s form, the CUDA plugin installed).
      axes: the mesh axis names (one name: a 1-D mesh of every device).
      shape: the mesh shape, one size per axis, product = the slice's device
        count (default: all devices on the one axis).
      axis_types: as ``jax.make_mesh`` (default: its default).

    The device order is ``jax.make_mesh``'s for that physical topology (rings
    along the torus; GPU: host by host). A mesh over several axes:

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
