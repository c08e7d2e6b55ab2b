"""benchmarks/maxtext.py: without a usable MaxText it says how to make one and exits non-zero (it skips nothing
silently); the function that reads both sides' compiled programs reads a program XLA dumped as zero_jax's audit
reads the same program compiled."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import zero_jax as zj

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import maxtext as bench  # noqa: E402


@pytest.mark.parametrize(("python", "words"), [("/nonexistent/python", "does not exist"),
                                                (sys.executable, "cannot import maxtext")])  # fmt: skip
def test_without_maxtext_it_says_how_to_make_its_venv_and_exits_2(python: str, words: str, capsys) -> None:
    assert bench.main(["--maxtext-python", python, "--cases", "1B:8"]) == 2
    err = capsys.readouterr().err
    assert words in err and "python -m venv" in err and '"maxtext==0.2.5"' in err and "--maxtext-python" in err


def test_read_dump_reads_a_dumped_step_as_the_audit_reads_it(tmp_path: Path) -> None:
    mesh = jax.make_mesh((8,), ("data",))
    policy = zj.ZeroPolicy(3, mesh, min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)

    def loss(params, batch):
        return jnp.mean(jnp.tanh(batch["x"] @ zj.gather(params["w"], policy)) ** 2)

    step = zj.make_train_step(loss, tx, policy, gather="manual")
    state, batch = zj.init_state({"w": jnp.ones((16, 32))}, tx, policy), {"x": jnp.ones((8, 16))}
    step.lower(state, batch).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    row = bench.read_dump(str(tmp_path), 8)
    report = zj.audit(step, state, batch, grads=False)
    assert report.compiled is not None
    # The same collectives and bytes as the audit of the same step (XLA:CPU: every collective synchronous).
    assert row["by_kind_MiB"] == {k.kind: k.ring_bytes / 2**20 for k in report.compiled.kinds}
    assert row["sent_MiB"] == pytest.approx(report.compiled.ring_bytes / 2**20) and row["overlapped"] == 0.0
    assert row["allocated_GiB"] is not None and row["allocated_GiB"] > 0
