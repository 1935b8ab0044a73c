"""Faults: a killed or interrupted run resumes to the same result, NaN steps stop or are skipped, a failed
checkpoint write leaves the previous one whole, and unfinished runs are refused unless asked for."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import LlamaForSequenceClassification

from loracls.training import checkpoints
from tests.conftest import invoke, toy_reviews

# 96 training examples, micro-batch 4, 2 accumulated: 12 optimizer steps per epoch, 48 in all; LoRA dropout
# is on, so an exact resume needs the RNG state as well as the weights, optimizer and data position
LONG = [
    *(
        "--epochs",
        "4",
        "--batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--eval-every",
        "4",
        "--save-every",
        "3",
    ),
    *("--log-every", "2", "--lr", "5e-3", "--max-length", "64", "--no-baseline", "--keep-checkpoints", "2"),
    *("--min-steps", "0"),
]


def train_args(model: Path, data: Path, out: Path, *extra) -> list:
    return ["train", "--model", model, "--data", data, "--out", out, *LONG, *extra]


def start(model: Path, data: Path, out: Path, *extra) -> subprocess.Popen:
    """`loracls train` in a child process, as a user's terminal or a scheduler would run it."""
    command = [sys.executable, "-m", "loracls", *map(str, train_args(model, data, out, *extra))]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_mid_run(
    model: Path, data: Path, out: Path, step: int, signal_number: int, *extra
) -> subprocess.Popen:
    """Start training in a child process and send it `signal_number` once a checkpoint of `step` or later
    exists; returns the child (not waited for)."""
    child = start(model, data, out, *extra)
    deadline = time.monotonic() + 180
    while not any(int(p.name[5:]) >= step for p in checkpoints.complete(out)):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    child.send_signal(signal_number)
    return child


def outputs(run: Path) -> dict[str, str]:
    """Every file whose content must not depend on whether the run was interrupted."""
    files = sorted((run / "val_predictions").iterdir()) + [run / "test_predictions.jsonl"]
    found = {f.name: f.read_text() for f in files}
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    found["log"] = json.dumps(
        [{k: r[k] for k in ("kind", "step", "loss", "val_accuracy") if k in r} for r in log]
    )
    metrics = json.loads((run / "metrics.json").read_text())
    found["metrics"] = json.dumps([metrics["test"], metrics["best_val"], metrics["train"]["examples_seen"]])
    found["best"] = str(load_file(run / "best/adapter_model.safetensors"))
    return found


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted run of the Llama tiny model: (run folder, data)."""
    from tests.conftest import toy_reviews

    root = tmp_path_factory.mktemp("reference")
    data = root / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    result = invoke(*train_args(tiny_models["llama"], data, root / "run"))
    assert result.exit_code == 0, result.output
    return root / "run", data


def test_checkpoints_keep_the_last_and_the_best(reference):
    run, _ = reference
    kept = [p.name for p in checkpoints.complete(run)]
    best = json.loads((run / "metrics.json").read_text())["best_val"]["step"]
    assert kept[-2:] == ["step_000045", "step_000048"]  # the last two saves (every 3 steps, and the end)
    assert f"step_{best:06d}" in kept and len(kept) <= 3
    assert not list((run / "checkpoints").glob("*.tmp"))
    state = json.loads((run / "checkpoints/step_000048/trainer_state.json").read_text())
    assert state["step"] == 48 and state["epoch"] == 3 and state["batches_in_epoch"] == 24
    assert (run / "checkpoints/step_000048/adapter/adapter_model.safetensors").is_file()
    assert (run / "checkpoints/step_000048/optimizer.bin").is_file()
    assert not list((run / "checkpoints/step_000048").glob("model*.safetensors"))  # no frozen base weights


def test_killed_run_resumes_to_identical_results(reference, tiny_models, tmp_path):
    run, data = reference
    out = tmp_path / "killed"
    killed = stop_mid_run(tiny_models["llama"], data, out, 9, signal.SIGKILL)
    killed.wait()
    assert json.loads((out / "status.json").read_text())["state"] == "running"  # never marked finished
    assert not (out / "metrics.json").exists()
    for command in (["eval", out], ["export", out, "--out", tmp_path / "export"]):
        result = invoke(*command)
        assert result.exit_code == 2 and "did not finish (status: running)" in result.output
    stopped_at = checkpoints.latest(out).name
    assert stopped_at != "step_000048"

    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert f"from {stopped_at}" in " ".join(result.output.split())
    # the killed process's lock is recognised as stale and taken over
    assert f"the lock of pid {killed.pid} on host {socket.gethostname()} is stale" in " ".join(
        result.output.split()
    )
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    assert outputs(out) == outputs(run)  # bit-identical on CPU: predictions, losses, metrics, adapter
    assert len(json.loads((out / "env.json").read_text())["resumes"]) == 1


def test_sigint_checkpoints_the_current_step_and_exits_130(reference, tiny_models, tmp_path):
    run, data = reference
    out = tmp_path / "interrupted"
    child = stop_mid_run(tiny_models["llama"], data, out, 6, signal.SIGINT)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 130, stderr
    assert "Traceback" not in stderr and f"loracls train --resume {out}" in " ".join(stderr.split())
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "interrupted" and "SIGINT" in status["error"]
    stopped = json.loads((checkpoints.latest(out) / "trainer_state.json").read_text())["step"]
    assert stopped >= 6 and f"stopped after optimizer step {stopped} of 48" in " ".join(stderr.split())

    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert outputs(out) == outputs(run)


def nan_at(monkeypatch, calls: set[int]) -> None:
    """Make the training forward passes numbered in `calls` (from 0) return NaN logits (so a NaN loss)."""
    forward, seen = LlamaForSequenceClassification.forward, [0]

    def patched(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        if self.training:
            if seen[0] in calls:
                output.logits = output.logits * float("nan")
            seen[0] += 1
        return output

    monkeypatch.setattr(LlamaForSequenceClassification, "forward", patched)


def test_nan_loss_stops_at_the_step_naming_the_last_checkpoint(monkeypatch, tiny_models, toy_csv, tmp_path):
    nan_at(monkeypatch, {8})  # micro-batch 9 = optimizer step 5
    out = tmp_path / "run"
    result = invoke(*train_args(tiny_models["llama"], toy_csv, out))
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert "Non-finite loss or gradient at optimizer step 5" in message
    assert "Last good checkpoint: " in message and "step_000004" in message  # the best of step 4
    assert "--skip-nonfinite" in message
    assert json.loads((out / "status.json").read_text())["state"] == "failed"
    weights = load_file(out / "checkpoints/step_000004/adapter/adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_skip_nonfinite_skips_and_finishes(monkeypatch, tiny_models, toy_csv, tmp_path):
    nan_at(monkeypatch, {8, 20})
    out = tmp_path / "run"
    result = invoke(*train_args(tiny_models["llama"], toy_csv, out), "--skip-nonfinite", "2")
    assert result.exit_code == 0, result.output
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "skipped"] == [5, 11]
    assert all(r["loss"] == r["loss"] for r in log if r["kind"] == "train")  # no NaN in the logged losses
    weights = load_file(out / "best/adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_failed_checkpoint_write_leaves_the_previous_one_whole(monkeypatch, tiny_models, toy_csv, tmp_path):
    save_state, calls = Accelerator.save_state, []

    def disk_full(self, output_dir, **kwargs):
        calls.append(output_dir)
        if len(calls) == 2:  # half a checkpoint on disk, then no space
            os.makedirs(output_dir, exist_ok=True)
            Path(output_dir, "optimizer.bin").write_bytes(b"\0" * 100)
            raise OSError(28, "No space left on device")
        return save_state(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", disk_full)
    out = tmp_path / "run"
    args = train_args(tiny_models["llama"], toy_csv, out)
    result = invoke(*args[: args.index("--eval-every")], *LONG[2:], "--eval-every", "100")
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert "Could not write the checkpoint of step 6" in message and "No space left on device" in message
    assert "previous checkpoint is intact" in message and "step_000003" in message
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000003"]  # no half-written folder
    assert json.loads((out / "status.json").read_text())["state"] == "failed"

    monkeypatch.setattr(Accelerator, "save_state", save_state)  # space freed: resume from step 3
    result = invoke("train", "--resume", out)
    assert result.exit_code == 0 and "from step_000003" in " ".join(result.output.split()), result.output


def test_resume_refusals_and_allow_unfinished(reference, monkeypatch, tiny_models, toy_csv, tmp_path):
    run, _ = reference
    result = invoke("train", "--resume", run)
    assert result.exit_code == 2 and "already finished" in result.output
    result = invoke("train", "--resume", run, "--lr", "1e-3")
    assert result.exit_code == 2 and "--resume takes no other options" in result.output

    nan_at(monkeypatch, {24})  # fails at step 13, after the validation of step 12 kept a best checkpoint
    out = tmp_path / "failed"
    assert invoke(*train_args(tiny_models["llama"], toy_csv, out)).exit_code == 2
    result = invoke("predict", out, "a good book")
    assert result.exit_code == 2 and "--allow-unfinished" in result.output
    result = invoke("predict", out, "a good book", "--allow-unfinished")
    assert result.exit_code == 0 and json.loads(result.stdout)["label"] in ("negative", "positive")
    result = invoke("export", out, "--out", tmp_path / "export", "--allow-unfinished")
    assert result.exit_code == 0, result.output
    info = json.loads((tmp_path / "export/loracls.json").read_text())
    assert info["run_status"] == "failed"


def test_failed_best_write_keeps_the_previous_best(monkeypatch, tiny_models, toy_csv, tmp_path):
    from peft import PeftModel

    save_pretrained, calls = PeftModel.save_pretrained, []

    def disk_full(self, folder, *args, **kwargs):
        if Path(folder).name == "best.tmp":
            calls.append(folder)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
        return save_pretrained(self, folder, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "save_pretrained", disk_full)
    out = tmp_path / "run"
    # validating every step: the first validation is a best, and a later one improves on it
    result = invoke(*train_args(tiny_models["llama"], toy_csv, out), "--eval-every", "1")
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = " ".join(result.output.split())
    assert "Could not write the new best checkpoint" in message and "previous best is intact" in message
    assert (out / "best/adapter_model.safetensors").is_file() and not (out / "best.tmp").exists()


def test_fp16_scaler_steps_past_a_nan_loss(monkeypatch, tiny_models, toy_csv, tmp_path):
    """fp16 with loss scaling (what `auto` picks on a GPU without bf16) and --skip-nonfinite: after a NaN
    loss the scaler must still step and update; skipping `optimizer.step()` left it unscaled and the next
    step raised "unscale_() has already been called on this optimizer since the last update()"."""
    init, scalers = Accelerator.__init__, []

    def with_scaler(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.mixed_precision == "fp16":  # accelerate gives a CPU no scaler; a GPU's fp16 run has one
            self.native_amp, self.scaler = True, torch.amp.GradScaler("cpu")
            scalers.append(self.scaler)

    monkeypatch.setattr(Accelerator, "__init__", with_scaler)
    nan_at(monkeypatch, {8})  # optimizer step 5
    out = tmp_path / "run"
    args = [*train_args(tiny_models["llama"], toy_csv, out), "--precision", "fp16", "--skip-nonfinite", "1"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "skipped"] == [5]
    assert log[-1]["step"] == 48 and all(r["loss"] == r["loss"] for r in log if r["kind"] == "train")
    # the scaler saw the NaN step: its scale was halved (from 2**16) at least once
    assert len(scalers) == 1 and scalers[0].get_scale() < 2.0**16
    weights = load_file(out / "best/adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


# --- resume: a resume at the final step, and a DDP resume in the middle of a log window ---


def test_a_resume_at_the_final_step_prunes_as_a_normal_end_does(reference, tiny_models, tmp_path):
    """Killed after the last checkpoint (during the test), with every checkpoint kept, and `keep_checkpoints`
    lowered to 2 in config.yaml (it does not change training): the resume trains no step and still keeps
    only the last two and the best."""
    run, data = reference
    out = tmp_path / "killed"
    stop_mid_run(tiny_models["llama"], data, out, 48, signal.SIGKILL, "--keep-checkpoints", "20").wait()
    assert not (out / "metrics.json").exists() and len(checkpoints.complete(out)) > 3
    config = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(config.replace("keep_checkpoints: 20", "keep_checkpoints: 2"))

    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert [p.name for p in checkpoints.complete(out)] == [p.name for p in checkpoints.complete(run)]
    assert outputs(out) == outputs(run)


def test_ddp_resume_in_the_middle_of_a_log_window_logs_the_uninterrupted_loss(tiny_models, tmp_path):
    """Two processes, a log window of 3 steps and a checkpoint at step 8, inside the window 7-9: the
    resumed run logs the loss of step 9 as the uninterrupted one did (each process's share of the window,
    not rank 0's twice). The same run resumed by one process is refused: the effective batch would halve."""
    from tests.test_distributed import COMMON, launcher, read_log

    data = tmp_path / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    options = list(COMMON)
    options[options.index("--log-every") + 1] = "3"
    torchrun = [launcher("torchrun"), "--nproc_per_node", "2", "-m", "loracls", "train"]
    multi = tmp_path / "multi"
    command = [*torchrun, "--model", str(tiny_models["llama"]), "--data", str(data), "--out", str(multi)]
    command += ["--batch-size", "8", *options, "--keep-checkpoints", "10"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (multi / "checkpoints/step_000008").is_dir()

    resumed = tmp_path / "resumed"
    shutil.copytree(multi, resumed)
    for folder in checkpoints.complete(resumed):
        if int(folder.name[5:]) > 8:
            shutil.rmtree(folder)
    (resumed / "status.json").write_text(json.dumps({"state": "interrupted"}))

    result = invoke("train", "--resume", resumed)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "processes: 2 trained step_000008, 1 resumes it" in " ".join(result.output.split())

    done = subprocess.run([*torchrun, "--resume", str(resumed)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = read_log(resumed), read_log(multi)
    assert [(r["kind"], r["step"]) for r in ours] == [(r["kind"], r["step"]) for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        for key in ("loss", "val_accuracy"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-6), (a, b)
    metrics = [json.loads((r / "metrics.json").read_text()) for r in (resumed, multi)]
    assert metrics[0]["train"]["examples_seen"] == metrics[1]["train"]["examples_seen"] == 192
    assert metrics[0]["test"] == metrics[1]["test"]
