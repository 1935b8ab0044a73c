"""Two processes on the CPU (torchrun, gloo): one set of outputs, every validation example scored once, and
the same result as one process with the same effective batch and seed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import invoke, toy_reviews

# 96 training examples in 48 batches of 2: 24 per process, 6 optimizer steps per epoch either way; validation
# (12 examples, batches of 4) is 3 batches, so the processes score unequal shares
COMMON = [
    *("--epochs", "2", "--micro-batch-size", "2", "--lr", "5e-3", "--max-length", "64", "--eval-every", "3"),
    *("--log-every", "1", "--lora-dropout", "0", "--no-baseline", "--save-every", "4"),
]


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.skipif(
    shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="no torchrun"
)
def test_two_processes_match_one(tiny_models, tmp_path):
    data = tmp_path / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    model = tiny_models["llama"]
    single = tmp_path / "single"
    result = invoke("train", "--model", model, "--data", data, "--out", single, "--batch-size", "16", *COMMON)
    assert result.exit_code == 0, result.output

    multi = tmp_path / "multi"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--nproc_per_node", "2", "-m", "loracls", "train", "--model", str(model)]
    command += ["--data", str(data), "--out", str(multi), "--batch-size", "8", *COMMON]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "batch 8 = 4 x 2 examples, x 2 process(es)" in " ".join(done.stderr.split())

    # one set of outputs: each log line once, each validation example once per validation
    log, reference = read_log(multi), read_log(single)
    assert [(r["kind"], r["step"]) for r in log] == [(r["kind"], r["step"]) for r in reference]
    for path in sorted((multi / "val_predictions").iterdir()):
        ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
        assert sorted(ids) == sorted(json.loads(line)["id"] for line in (multi / "data/val.jsonl").open())
    assert sorted(p.name for p in (multi / "checkpoints/step_000012").glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert json.loads((multi / "status.json").read_text())["state"] == "finished"

    # the same run: DDP averages the two processes' gradients as accumulation over twice the batches would
    for ours, theirs in zip(log, reference, strict=True):
        for key in ("loss", "val_accuracy", "val_macro_f1"):
            if key in ours:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4), (ours, theirs)
    ours, theirs = (json.loads((run / "metrics.json").read_text()) for run in (multi, single))
    assert ours["test"]["accuracy"] == theirs["test"]["accuracy"]
    assert ours["train"]["examples_seen"] == theirs["train"]["examples_seen"] == 192
    for a, b in zip(
        (multi / "test_predictions.jsonl").read_text().splitlines(),
        (single / "test_predictions.jsonl").read_text().splitlines(),
        strict=True,
    ):
        pa, pb = json.loads(a)["probabilities"], json.loads(b)["probabilities"]
        assert pa == pytest.approx(pb, abs=1e-4)
