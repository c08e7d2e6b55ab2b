"""examples/train_lm.py: the end-to-end training script.

One chain of child processes (8 simulated CPU devices, a 43k-parameter model over the docs' bytes) holds
it to bitwise resume: 8 steps straight against 8 steps cut twice, by a SIGTERM (the script saves the step
and exits 0) and by a SIGKILL (the steps after the last checkpoint are lost and trained again). The
parameters, optimizer state, every step's batch and loss agree bit for bit. The bad inputs are run in
this process: each is one line naming the fix, before JAX does any work.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _models import REPO, child_env

SCRIPT = Path(REPO) / "examples" / "train_lm.py"
TINY = ["--devices", "8", "--dim", "32", "--depth", "2", "--heads", "2", "--seq", "32", "--batch-per-device", "2",
        "--steps", "10", "--save-every", "3", "--eval-every", "4", "--eval-batches", "1", "--no-progress", "--no-plot"]


def _script():
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start(out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), *TINY, "--out", str(out), *extra], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _signal_after(proc: subprocess.Popen, out: Path, step: int, sig: int) -> tuple[int, str]:
    """Send ``sig`` once the run has logged ``step``: the last step logged, and the output."""
    deadline = time.monotonic() + 120
    while not any(r["kind"] == "train" and r["step"] >= step for r in _records(out)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the child never reached the step"
        time.sleep(0.05)
    proc.send_signal(sig)
    text, _ = proc.communicate(timeout=120)
    return max(r["step"] for r in _records(out) if r["kind"] == "train"), text


def _finish(proc: subprocess.Popen) -> str:
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text
    return text


def _per_step(out: Path) -> dict[int, tuple[str, float]]:
    """Each step's batch CRC and loss, the last logged (a resumed run logs again the steps a kill lost)."""
    return {r["step"]: (r["data"], r["loss"]) for r in _records(out) if r["kind"] == "train"}


@pytest.mark.slow
def test_resume_after_sigterm_and_sigkill_is_bitwise_and_the_loss_falls(tmp_path: Path) -> None:
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert "train_lm: loss " in _finish(_start(straight))

    term = _start(cut, "--pause-per-step", "0.4")
    seen, text = _signal_after(term, cut, 2, signal.SIGTERM)
    assert term.returncode == 0, text  # saved, then a clean exit
    preempted = [r["step"] for r in _records(cut) if r["kind"] == "preempted"]
    assert preempted and preempted[0] in (seen, seen + 1) and preempted[0] < 6, (seen, preempted)

    kill = _start(cut, "--resume", "--pause-per-step", "0.4")
    killed_at, _ = _signal_after(kill, cut, 8, signal.SIGKILL)
    assert kill.returncode == -signal.SIGKILL and 8 <= killed_at < 10

    text = _finish(_start(cut, "--resume"))
    resumed = int(re.search(r"resumed from step (\d+)", text).group(1))
    assert preempted[0] <= resumed < killed_at, (preempted, resumed, killed_at)  # the steps the SIGKILL lost: again

    final = {r["kind"]: r for r in _records(straight) if r["kind"] == "final"}["final"]
    again = [r for r in _records(cut) if r["kind"] == "final"]
    assert len(again) == 1 and again[0] == final  # parameters, optimizer state: the same CRC of every bit
    assert _per_step(cut) == _per_step(straight)  # the same batches in the same order, the same losses
    losses = [loss for _, loss in _per_step(straight).values()]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses  # about log(256) = 5.5 falling
    assert sorted(int(p.stem) for p in (cut / "data").glob("*.json"))[-1] == 10


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--data", "/nonexistent/corpus"], "--data /nonexistent/corpus: no such file, folder or glob match"),
        (["--data", "{binary}"], "is not text (a NUL byte at offset 3); point --data at UTF-8 text files"),
        (["--data", "{tiny}"], "give more text or lower --seq / --batch-per-device"),
        (["--stage", "2", "--quantize-weights", "int8"], "Use stage=3, or drop quantize_weights"),
    ],
)
def test_bad_input_is_one_line_naming_the_fix(argv, expected, tmp_path, capsys) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.md").write_text("text\n")
    (tmp_path / "data" / "b.bin").write_bytes(b"abc\0def")
    tiny = tmp_path / "data" / "a.md"
    argv = [a.format(binary=tmp_path / "data", tiny=tiny) for a in argv]
    assert _script().main([*argv, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train_lm.py: error: ") and expected in err, err


def test_resuming_another_model_or_data_order_is_one_line(tmp_path: Path) -> None:
    lm = _script()
    run = {"data": "d", "global_batch": 16, "dim": 32, "depth": 2, "heads": 2, "mlp": None, "seq": 32, "seed": 0,
           "stage": 2}
    (tmp_path / "run.json").write_text(json.dumps(run))
    lm.check_resumable(tmp_path, {**run, "stage": 3})  # another stage: restored across the layout
    with pytest.raises(ValueError, match=r"another model \(--dim 32 there, 64 here\); pass the same model flags"):
        lm.check_resumable(tmp_path, {**run, "dim": 64})
    with pytest.raises(ValueError, match=r"global_batch 16 there, 32 here.*the saved data order depends on them"):
        lm.check_resumable(tmp_path, {**run, "global_batch": 32})


def test_resuming_a_checkpoint_of_another_model_is_one_line(tmp_path: Path) -> None:
    import zero_jax as zj

    class Manager:  # what zj.restore raises for another model's checkpoint, without training one
        directory = tmp_path

        def all_steps(self):
            return [3, 6]

        def restore(self, **kw):
            assert kw["step"] == 3 and kw["fallback"]  # step 6 has no data state: not resumable
            raise ValueError("zj.restore: the checkpoint is of another model: parameter 'head' has shape (32, 256) "
                             "in the checkpoint but (64, 256) in the model being restored. All 9 differing:\n  ...")

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "3.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^--resume: zj.restore: .* being restored\. Pass the flags it was trained "
                                         r"with, or a new --out\.$"):
        _script().restore(Manager(), tmp_path, {"zj": zj, "policy": None, "tx": None, "params": None})
