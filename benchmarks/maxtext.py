"""zero_jax beside MaxText on the TPU compiler: the same llama model, the same slice, the same libtpu, both
compiled here without a TPU (deviceless) and read with the same code.

MaxText's side is MaxText's own program: its ``train_compile`` tool (``python -m
maxtext.trainers.pre_train.train_compile``) run in MaxText's own venv, its llama2 decoder block, FSDP over
every chip (``ici_fsdp_parallelism=-1``), per-layer remat (``remat_policy=full``), scanned layers, fp32
weights with bf16 compute, its default attention and optimizer (AdamW). zero_jax's side is layer-wise
stage 3 of ``zero_jax.models``' llama model of the same shape (the same parameter count), bf16 compute
over fp32 master, AdamW, scanned (``scan_layers``) and, for the 1B class, unscanned (``apply_layers``).
Both dump their compiled program (``xla_dump_to``) and one function reads each dump with
``zero_jax.measure`` (``read_compiled``, ``hbm_bytes_from_dump``, ``live_peak_from_dump``): the HBM the
buffer assignment allocates, XLA's live peak, the bytes each chip sends per step by collective kind
(ring-counted, loops times their trips), and the share of those bytes in flight while compute runs.

Flag sets, per side: ``libtpu defaults`` (no options), each side's own recommendation (MaxText: the
``LIBTPU_INIT_ARGS`` of its v5p recipe ``maxtext/configs/tpu/v5p/32b.sh``, read from the installed
package; zero_jax: what its schedule seam picks for the running libtpu), and zero_jax under MaxText's
flags.

MaxText is a benchmark peer, never a dependency. It needs Python >= 3.12 and jax >= 0.11.1, and both sides
must load the same libtpu. Make its venv (2.1 GB; its declared dependencies are a lock of ~235
packages, of which ``train_compile`` imports these: :data:`MAXTEXT_IMPORTS`)::

    $(pyenv root)/versions/3.12.1/bin/python -m venv /work/vmaxtext
    /work/vmaxtext/bin/pip install "maxtext==0.2.5" "jax[tpu]==0.11.1" absl-py flax omegaconf packaging \\
        pathwaysutils jinja2 qwix aqtp tokamax huggingface_hub transformers grain drjax pillow tiktoken \\
        sentencepiece sympy

and run this file from a venv with zero_jax and the same jax[tpu] (Python 3.12)::

    python benchmarks/maxtext.py --maxtext-python /work/vmaxtext/bin/python [--cases 1B:8 1B:64 8B:8 8B:64]

Without MaxText, or with another libtpu than ours, it exits non-zero saying how to make the venv: it
skips nothing silently. Rows are cached in ``benchmarks/results/maxtext.json`` as they finish
(``--fresh`` starts over); ``benchmarks/results/maxtext.txt`` holds the table, the record and the commands.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import LlamaConfig, llama_init_params, make_llama_loss_fn, unstack_params  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GiB, MiB = 2**30, 2**20
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")

#: What MaxText's ``train_compile`` imports beyond ``maxtext`` and ``jax[tpu]`` (found by running it).
MAXTEXT_IMPORTS = ("absl-py", "flax", "omegaconf", "packaging", "pathwaysutils", "jinja2", "qwix", "aqtp", "tokamax",
                   "huggingface_hub", "transformers", "grain", "drjax", "pillow", "tiktoken", "sentencepiece",
                   "sympy")  # fmt: skip
SETUP = (
    "make MaxText's venv (Python >= 3.12, the same jax[tpu] as this one):\n"
    "  $(pyenv root)/versions/3.12.1/bin/python -m venv /work/vmaxtext\n"
    '  /work/vmaxtext/bin/pip install "maxtext==0.2.5" "jax[tpu]=={jax}" ' + " ".join(MAXTEXT_IMPORTS) + "\n"
    "then pass --maxtext-python /work/vmaxtext/bin/python (or set MAXTEXT_PYTHON)"
)
#: MaxText's recommended v5p flags: the ``LIBTPU_INIT_ARGS`` line of this recipe in the installed package.
MAXTEXT_V5P_RECIPE = "configs/tpu/v5p/32b.sh"


@dataclasses.dataclass(frozen=True)
class Model:
    """One model class: zero_jax's llama config and the MaxText overrides of the same shape."""

    name: str
    config: LlamaConfig
    maxtext: tuple[str, ...]


def _llama2_overrides(c: LlamaConfig) -> tuple[str, ...]:
    return ("decoder_block=llama2", f"base_emb_dim={c.dim}", f"base_num_query_heads={c.heads}",
            f"base_num_kv_heads={c.kv_heads or c.heads}", f"head_dim={c.dim // c.heads}", f"base_mlp_dim={c.mlp_dim}",
            f"base_num_decoder_layers={c.depth}", f"vocab_size={c.vocab}")  # fmt: skip


_1B = LlamaConfig(vocab=32000, dim=2048, depth=16, heads=16, mlp=5632, seq=2048)
_8B = LlamaConfig(vocab=128256, dim=4096, depth=32, heads=32, kv_heads=8, mlp=14336, seq=2048, rope_base=500000.0)
MODELS = {  # zero_jax's llama as each MaxText model (attention: zero_jax_step picks it per variant)
    # llama-2 widths at 1B (MaxText's llama2 block, 0.95B parameters)
    "1B": Model("1B", _1B, _llama2_overrides(_1B)),
    # llama-3 8B as MaxText ships it (grouped-query attention, 8 key/value heads, vocabulary 128256)
    "8B": Model("8B", _8B, ("model_name=llama3-8b",)),
}
#: chips -> (zero_jax's topology, MaxText's compile_topology: MaxText counts TensorCores, two per v5p chip).
SLICES = {8: ("v5p:2x2x2", "v5p-16"), 64: ("v5p:4x4x4", "v5p-128")}
COMMON = ("ici_fsdp_parallelism=-1", "remat_policy=full", "per_device_batch_size=1", "scan_layers=true",
          "weight_dtype=float32", "dtype=bfloat16", "dataset_type=synthetic", "enable_checkpointing=false",
          "compile_topology_num_slices=1")  # fmt: skip


class Unusable(RuntimeError):
    """MaxText cannot be run as asked: the message says how to fix it."""


# -- reading a compiled program's dump: one function for both sides ---------------------------------------------


def read_dump(dump: str, num_devices: int) -> dict[str, Any]:
    """The step's compiled program as dumped to ``dump`` (``xla_dump_to``), read with ``zero_jax.measure``: the
    allocated HBM, XLA's live peak, ring bytes sent per chip per step by kind, and the share of them in flight
    while compute runs (an async collective with compute between start and done, or one fused into compute)."""
    programs = [f for f in glob.glob(os.path.join(dump, "*after_optimizations.txt")) if "train_step" in f
                or "_step" in os.path.basename(f)]  # fmt: skip
    if not programs:
        raise RuntimeError(f"no compiled program of a train step in the dump {dump}: {sorted(os.listdir(dump))[:8]}")
    text = Path(max(programs, key=os.path.getsize)).read_text()
    program = zj.measure.read_compiled(text, num_devices)
    by_kind: dict[str, float] = {}
    overlapped = 0.0
    for c in program.collectives:
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.total_ring_bytes
        overlapped += c.total_ring_bytes * c.overlapped
    sent = sum(by_kind.values())
    allocated, peak = zj.measure.hbm_bytes_from_dump(dump), zj.measure.live_peak_from_dump(dump)
    return {
        "allocated_GiB": allocated / GiB if allocated is not None else None,
        "live_peak_GiB": peak.bytes / GiB if peak is not None and peak.bytes else None,
        "sent_MiB": sent / MiB,
        "by_kind_MiB": {k: v / MiB for k, v in sorted(by_kind.items())},
        "overlapped": overlapped / sent if sent else None,
        "collective_ops": len(program.collectives),
    }


# -- MaxText ----------------------------------------------------------------------------------------------------


def maxtext_versions(python: str) -> dict[str, str]:
    """maxtext's, jax's and libtpu's versions in MaxText's venv, or :class:`Unusable` saying how to make it."""
    if not python or not os.path.exists(python):
        raise Unusable(f"MaxText's Python {python!r} does not exist; " + SETUP.format(jax=jax.__version__))
    probe = ("import importlib.metadata as m, json, maxtext; print(json.dumps({p: m.version(p) for p in "
             "('maxtext', 'jax', 'libtpu')} | {'path': maxtext.__path__[0]}))")  # fmt: skip
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise Unusable(f"{python} cannot import maxtext ({r.stderr.strip().splitlines()[-1:]}); "
                       + SETUP.format(jax=jax.__version__))  # fmt: skip
    return json.loads(r.stdout.strip().splitlines()[-1])


def maxtext_flags(package: str) -> list[str]:
    """The ``--name=value`` flags of MaxText's v5p recipe (:data:`MAXTEXT_V5P_RECIPE`) in the installed package."""
    recipe = Path(package) / MAXTEXT_V5P_RECIPE
    for line in recipe.read_text().splitlines():
        if line.startswith("export LIBTPU_INIT_ARGS="):
            return shlex.split(line.split("=", 1)[1])[0].split()
    raise Unusable(f"{recipe} sets no LIBTPU_INIT_ARGS: MaxText's v5p recipe moved; point MAXTEXT_V5P_RECIPE at it")


def compile_maxtext(python: str, package: str, model: Model, chips: int, flags: list[str], timeout: int,
                    dump: str, variant: str = "scan") -> dict[str, Any]:  # fmt: skip
    """Compile MaxText's train step with its own tool, dumping it to ``dump``, and read the dump. ``variant``:
    ``scan`` (its scanned decoder) or ``apply`` (``scan_layers=false``: its layers unrolled)."""
    topology = SLICES[chips][1]
    common = [o if variant == "scan" or o != "scan_layers=true" else "scan_layers=false" for o in COMMON]
    shutil.rmtree(dump, ignore_errors=True)
    with tempfile.TemporaryDirectory() as d:
        argv = [python, "-m", "maxtext.trainers.pre_train.train_compile", str(Path(package) / "configs/base.yml"),
                f"compile_topology={topology}", f"max_target_length={model.config.seq}", *common, *model.maxtext,
                f"base_output_directory={d}", "run_name=zero_jax_benchmark"]  # fmt: skip
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", LIBTPU_INIT_ARGS=" ".join(flags),
                   XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*train_step.*")  # fmt: skip
        t = time.perf_counter()
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=d, env=env)
        seconds = time.perf_counter() - t
        os.makedirs(dump, exist_ok=True)
        Path(dump, "train_compile.log").write_text(r.stdout + r.stderr)
        if r.returncode:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            return {"error": tail, "compile_s": round(seconds, 1), "command": shlex.join(argv[1:])}
        return read_dump(dump, chips) | {"compile_s": round(seconds, 1), "command": shlex.join(argv[1:])}


# -- zero_jax ---------------------------------------------------------------------------------------------------


def zero_jax_step(model: Model, chips: int, variant: str = "scan") -> tuple[Any, Any, Any, Any]:
    """Layer-wise stage 3 of the llama model as ``variant`` (:data:`VARIANTS`) has it: (step, abstract state,
    abstract batch, policy)."""
    scanned, compute_copy = variant != "apply", variant == "scan+copy"
    cfg = dataclasses.replace(model.config, attention="default" if variant == "scan+dense" else "chunked",
                              attention_chunk=math.gcd(model.config.seq, 512),
                              head_chunks=0 if variant == "scan+logits" else HEAD_CHUNKS)  # fmt: skip
    mesh = zj.topology_mesh(SLICES[chips][0])
    if variant == "scan@topology":
        own = topologies.get_topology_desc(topology_name=SLICES[chips][0], platform="tpu").devices
        mesh = jax.sharding.Mesh(np.array(own), ("data",))
    make = (lambda: llama_init_params(cfg, jax.random.key(0))) if scanned else (
        lambda: unstack_params(llama_init_params(cfg, jax.random.key(0))))  # fmt: skip
    params = jax.eval_shape(make)
    policy = zj.ZeroPolicy(3, mesh, stacked="layers" if scanned else (),
                           precision=zj.Precision(compute_dtype=jnp.bfloat16, compute_copy=compute_copy))  # fmt: skip
    tx = zj.shard_optimizer(optax.adamw(1e-4), policy)
    # scan+logits: the targets picked by a one-hot mask, as MaxText's cross-entropy does (and tpu_aot.py advises for
    # TPU): the same gradient bits as take_along_axis, whose backward is a scatter through two float32 logit-sized
    # buffers. (The other variants' chunked head picks each target from its chunk's logits.)
    step = zj.make_train_step(make_llama_loss_fn(cfg, policy, one_hot_labels=True), tx, policy, gather="manual")
    tokens = jax.ShapeDtypeStruct((mesh.size, cfg.seq + 1), jnp.int32, sharding=policy.batch_sharding())
    return step, zj.init_state(params, tx, policy), {"tokens": tokens}, policy


def compile_zero_jax(model: Model, chips: int, variant: str, flags: list[str] | None, dump: str) -> dict[str, Any]:
    """Compile zero_jax's step (``variant``: ``scan``, ``apply``, ``scan+copy``: see :data:`VARIANTS`; ``flags``:
    these options instead of the seam's, ``[]`` libtpu's defaults) and read the dump with :func:`read_dump`."""
    switches = {} if flags is None else {"compiler_options": [f.lstrip("-").split("=", 1) for f in flags],
                                         "fallback_options": ()}  # fmt: skip
    t = time.perf_counter()
    shutil.rmtree(dump, ignore_errors=True)
    with zj.measure.trying_schedule(**switches):
        step, state, batch, policy = zero_jax_step(model, chips, variant)
        schedule = zj.measure.schedule_for(policy).describe()
        step.lower(state, batch).compile(compiler_options={"xla_dump_to": dump})
        row = read_dump(dump, chips)
    return row | {"compile_s": round(time.perf_counter() - t, 1), "schedule": schedule}


# -- the run ----------------------------------------------------------------------------------------------------


#: zero_jax's variants: layer-wise stage 3 over stacked layers (``scan_layers``) or a list of blocks
#: (``apply_layers``), fp32 master weights only (cast to bf16 before each gather: MaxText's 12 bytes of state per
#: parameter) and the llama model's chunked attention (512 queries at a time: what MaxText's flash attention saves
#: of the score matrix); ``scan+copy``: zero_jax's default precision, a bf16 copy kept between steps (16 bytes);
#: ``scan+dense``: XLA's attention, the whole score matrix (``attention="default"``); ``scan@topology``: the mesh's
#: devices in the slice's own order (``get_topology_desc(...).devices``) instead of ``zj.topology_mesh``'s
#: (``jax.make_mesh``'s ring order): libtpu 0.0.46.3 overlaps the SparseCore-offloaded gathers over one order on 8
#: chips and the other on 64. Every variant looks the token embedding up from its pieces (``zj.embedding_lookup``)
#: and runs the head with the cross-entropy in :data:`HEAD_CHUNKS` vocabulary chunks (``zj.head_cross_entropy``)
#: but ``scan+logits``: the head gathered whole, the whole logits, then the loss (what zero_jax's llama did before).
VARIANTS = ("scan", "apply", "scan+copy", "scan+dense", "scan@topology", "scan+logits")
#: The vocabulary chunks of zero_jax's head (``LlamaConfig(head_chunks=...)``).
HEAD_CHUNKS = 8


def rows_of(case: str) -> list[tuple[str, str, str]]:
    """(side, variant, flags) of one case ``MODEL:CHIPS``: each side with libtpu's defaults and its own flags, the
    other variants where they answer a question: unscanned (both sides, each with its own flags; an unrolled step
    compiles for minutes, at 8B on 64 chips for tens of them), zero_jax under MaxText's flags at 1B on 8 chips, the
    whole-logits head where it decided HBM."""
    model, chips = case.split(":")[0], int(case.split(":")[1])
    rows = [("MaxText", "scan", "libtpu defaults"), ("MaxText", "scan", "MaxText v5p flags"),
            ("zero_jax", "scan", "libtpu defaults"), ("zero_jax", "scan", "zero_jax seam")]  # fmt: skip
    if chips == 64:
        rows.append(("zero_jax", "scan@topology", "zero_jax seam"))
    if model == "1B":
        rows.append(("zero_jax", "scan+copy", "zero_jax seam"))
    if (model, chips) in (("1B", 8), ("8B", 64)):
        rows.append(("zero_jax", "scan+logits", "zero_jax seam"))
    rows += [("MaxText", "apply", "MaxText v5p flags"), ("zero_jax", "apply", "zero_jax seam")]
    if model == "1B" and chips == 8:
        rows += [("zero_jax", "scan", "MaxText v5p flags"), ("zero_jax", "scan+dense", "zero_jax seam"),
                 ("zero_jax", "apply", "libtpu defaults")]  # fmt: skip
    return rows


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    head = (f"{'model':<5} {'chips':>5} {'side':<9} {'layers':<13} {'flags':<18} {'HBM GiB':>8} {'live GiB':>8} "
            f"{'sent MiB':>9} {'/theory':>7} {'gather':>8} {'r-scatter':>9} {'a-reduce':>8} {'permute':>8} "
            f"{'a2a':>6} {'overlap':>7} {'compile s':>9}")  # fmt: skip
    out = [head]
    order = [row for case in ("1B:8", "1B:64", "8B:8", "8B:64") for row in rows_of(case)]

    def rank(r: dict[str, Any]) -> tuple[Any, ...]:
        key = (r["side"], r["variant"], r["flags"])
        return r["model"], r["chips"], order.index(key) if key in order else len(order)

    for r in sorted(rows.values(), key=rank):
        lead = f"{r['model']:<5} {r['chips']:>5} {r['side']:<9} {r['variant']:<13} {r['flags']:<18}"
        if "error" in r:
            out.append(f"{lead} failed: {r['error'].splitlines()[-1][:120]}")
            continue
        k = r["by_kind_MiB"]
        out.append(" ".join([
            lead, f"{r['allocated_GiB'] or 0:>8.2f}", f"{r['live_peak_GiB'] or 0:>8.2f}", f"{r['sent_MiB']:>9.0f}",
            f"{r['sent_MiB'] / r['theory_MiB']:>7.3f}",
            *(f"{k.get(kind, 0.0):>{w}.0f}" for kind, w in zip(KINDS, (8, 9, 8, 8, 6), strict=True)),
            f"{r['overlapped'] or 0:>7.0%}", f"{r['compile_s']:>9.0f}"]))  # fmt: skip
    return out


NOTES = """\
Per chip, per step. HBM: the buffer assignment's total (the TPU compiler's own figure); live: XLA's live peak
(HloLiveRange, of the entry computation: a scanned loop's body temporaries are not in it). sent: ring bytes each
chip sends, every collective of the compiled program (an all-reduce counts two passes; loops times their trip counts
from the induction variable; SparseCore-offloaded collectives counted);
/theory: against ZeRO-3's 3 x 2 bytes x params x (N - 1) / N (bf16 gathers twice, bf16 reduce-scatter once), the same
theory for both sides (the same parameter count). The kinds: all-gather, reduce-scatter, all-reduce,
collective-permute (the partitioner's windowed-einsum rings, zero_jax's gradient ring), all-to-all. overlap: the share
of sent bytes in flight while compute runs (async with compute between start and done, or fused into compute).
Flags: libtpu defaults = no options; MaxText v5p flags = the LIBTPU_INIT_ARGS of MaxText's recipe named above;
zero_jax seam = the options zero_jax's schedule picks for the running libtpu (`schedule` in the JSON)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--maxtext-python", default=os.environ.get("MAXTEXT_PYTHON", ""))
    parser.add_argument("--cases", nargs="+", default=["1B:8", "1B:64", "8B:8", "8B:64"],
                        help="MODEL:CHIPS, MODEL in 1B 8B, CHIPS in 8 64")  # fmt: skip
    parser.add_argument("--only", choices=["MaxText", "zero_jax"], help="one side only")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for one MaxText compile")
    parser.add_argument("--fresh", action="store_true", help="measure every row again")
    parser.add_argument("--table-only", action="store_true", help="compile nothing: the table of the rows cached")
    parser.add_argument("--dumps", default=os.path.join(tempfile.gettempdir(), "zero_jax_maxtext"),
                        help="where each row's compiled program is dumped and kept (for --reread)")  # fmt: skip
    parser.add_argument("--reread", action="store_true", help="compile nothing: read the kept dumps again")
    args = parser.parse_args(argv)
    record = common.Record()
    try:
        try:
            ours = importlib.metadata.version("libtpu")
        except importlib.metadata.PackageNotFoundError:
            raise Unusable(f'no libtpu (the TPU compiler) here: pip install "jax[tpu]=={jax.__version__}"') from None
        theirs = maxtext_versions(args.maxtext_python)
        if theirs["libtpu"] != ours:
            raise Unusable(f"MaxText's venv loads libtpu {theirs['libtpu']}, this one {ours}: the same compiler on "
                           "both sides or no comparison; " + SETUP.format(jax=jax.__version__))  # fmt: skip
        flags = maxtext_flags(theirs["path"])
    except (Unusable, subprocess.TimeoutExpired) as e:
        print(f"benchmarks/maxtext.py: {e}", file=sys.stderr)
        return 2
    path = RESULTS / "maxtext.json"
    saved = {} if args.fresh or not path.exists() else json.loads(path.read_text())
    rows: dict[str, dict[str, Any]] = saved.get("rows", {})
    for case in [] if args.table_only else args.cases:
        name, chips = case.split(":")[0], int(case.split(":")[1])
        model = MODELS[name]
        theory = zj.comm_bytes(model.config.num_params(), chips, 3) / MiB
        for side, variant, how in rows_of(case):
            key = f"libtpu {ours} {name} {chips} {side} {variant} {how}"
            dump = os.path.join(args.dumps, re.sub(r"[^\w.]+", "_", key))
            if args.reread and key in rows and os.path.isdir(dump):
                rows[key] |= read_dump(dump, chips)
                continue
            if args.reread or key in rows and "error" not in rows[key] or (args.only and side != args.only):
                continue
            print(f"[{time.strftime('%H:%M:%S')}] {key}", flush=True)
            if side == "MaxText":
                row = compile_maxtext(args.maxtext_python, theirs["path"], model, chips,
                                      flags if how != "libtpu defaults" else [], args.timeout, dump,
                                      variant)  # fmt: skip
            else:
                chosen = {"libtpu defaults": [], "zero_jax seam": None, "MaxText v5p flags": flags}[how]
                row = compile_zero_jax(model, chips, variant, chosen, dump)
            # MaxText logs no parameter count: both sides are the same shape (MODELS), zero_jax's count is both.
            rows[key] = {"libtpu": ours, "model": name, "chips": chips, "side": side, "variant": variant,
                         "flags": how, "theory_MiB": theory, "params": model.config.num_params()} | row  # fmt: skip
            print("  " + json.dumps({k: row.get(k) for k in ("allocated_GiB", "sent_MiB", "overlapped", "compile_s",
                                                              "error")}), flush=True)  # fmt: skip
            common.write_results("maxtext", "", {"rows": rows, "maxtext": theirs, "flags": flags,
                                                 "meta": record.meta()})  # fmt: skip
    meta = saved.get("meta") if args.table_only and saved.get("meta") else record.meta()
    header = record.header(
        "zero_jax beside MaxText on the TPU compiler (deviceless v5p, the same libtpu, the same model shape)",
        f"MaxText {theirs['maxtext']} (its venv: jax {theirs['jax']}, libtpu {theirs['libtpu']}), train_compile, "
        "llama2 block (1B) / llama3-8b (8B), FSDP over every chip, remat full, scanned, fp32 weights, bf16 compute, "
        "seq 2048, one sequence per chip; its v5p flags: maxtext/" + MAXTEXT_V5P_RECIPE + ": " + " ".join(flags),
        "zero_jax: layer-wise stage 3 of zero_jax.models' llama (the same shape and parameter count), bf16 compute "
        "over fp32 master, AdamW, prefetch 1; scan = scan_layers, apply = apply_layers over a list of blocks, both "
        "with fp32 weights only (compute_copy=False, as MaxText) and chunked attention (attention='chunked', 512 "
        "queries a chunk), the token embedding looked up from its pieces (zj.embedding_lookup), the head and the "
        f"cross-entropy in {HEAD_CHUNKS} vocabulary chunks (zj.head_cross_entropy); "
        "scan+copy = zero_jax's default precision (a bf16 copy kept between steps); scan+dense = "
        "XLA's attention (the whole score matrix); scan@topology = the mesh's devices in the slice's own order; "
        "scan+logits = the head gathered whole and the whole logits, targets picked by a one-hot mask (as MaxText's "
        "cross-entropy)",
        f"the rows measured by: {meta['command']} (finished {meta['date']})",
        versions=f"libtpu {ours}",
    )
    text = "\n".join([header, "", *table(rows), "", NOTES])
    common.write_results("maxtext", text, {"rows": rows, "maxtext": theirs, "flags": flags, "meta": meta})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
