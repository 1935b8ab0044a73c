"""Two processes on the CPU (torchrun, gloo): one set of outputs, every validation example scored once, and
the same result as one process with the same effective batch and seed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import invoke, toy_reviews

# 96 training examples in 48 batches of 2: 24 per process, 6 optimizer steps per epoch either way; validation
# (12 examples, batches of 4) is 3 batches, so the processes score unequal shares
COMMON = [
    *("--epochs", "2", "--micro-batch-size", "2", "--lr", "5e-3", "--max-length", "64", "--eval-every", "3"),
    *("--log-every", "1", "--lora-dropout", "0", "--no-baseline", "--save-every", "4"),
    *(
        "--precision",
        "fp32",
        "--min-steps",
        "0",
    ),  # bf16 (auto on CPUs with AVX-512-BF16) rounds each process's sums apart
]


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    """The data and a 1-process run with the effective batch of the 2-process runs (16 = 2 x 8)."""
    root = tmp_path_factory.mktemp("distributed")
    data = root / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    run = root / "single"
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", data, "--out", run, "--batch-size", "16", *COMMON
    )
    assert result.exit_code == 0, result.output
    return data, run


def launcher(name: str) -> str:
    found = shutil.which(name, path=os.path.dirname(sys.executable))
    assert found is not None, f"no {name} beside {sys.executable}: torch and accelerate install it"
    return found


def assert_same_run(multi: Path, single: Path) -> None:
    """The 2-process run logged, validated and tested as the 1-process run did."""
    log, reference = read_log(multi), read_log(single)
    assert [(r["kind"], r["step"]) for r in log] == [(r["kind"], r["step"]) for r in reference]
    # DDP averages the two processes' gradients as accumulation over twice the batches would
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


def test_two_processes_match_one(tiny_models, single, tmp_path):
    data, reference = single
    model = tiny_models["llama"]
    multi = tmp_path / "multi"
    torchrun = launcher("torchrun")
    command = [torchrun, "--nproc_per_node", "2", "-m", "loracls", "train", "--model", str(model)]
    command += ["--data", str(data), "--out", str(multi), "--batch-size", "8", *COMMON]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = " ".join(done.stderr.split())
    assert "batch 8 = 4 x 2 examples, x 2 process(es)" in said
    assert said.count("Tokenizer: set pad_token") == 1  # every stage's lines once, not once per process

    # one set of outputs: each validation example once per validation
    for path in sorted((multi / "val_predictions").iterdir()):
        ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
        assert sorted(ids) == sorted(json.loads(line)["id"] for line in (multi / "data/val.jsonl").open())
    assert sorted(p.name for p in (multi / "checkpoints/step_000012").glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert json.loads((multi / "status.json").read_text())["state"] == "finished"

    assert_same_run(multi, reference)


def test_fsdp_shards_and_matches_one_process(tiny_models, single, tmp_path):
    """FSDP2 with the README's accelerate config: each decoder layer sharded over 2 CPU processes (see
    tests/fsdp_cpu.py), the same result as one process, the adapter gathered whole, and a resume from a
    sharded checkpoint that ends where the uninterrupted run did."""
    data, reference = single
    accelerate = launcher("accelerate")
    config = Path(__file__).parents[1] / "configs/accelerate/fsdp-1node.yaml"
    launch = [accelerate, "launch", "--config_file", str(config), "--num_processes", "2"]
    launch += ["--mixed_precision", "no", "-m", "tests.fsdp_cpu", "train"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}

    run = tmp_path / "fsdp"
    arguments = ["--model", str(tiny_models["llama"]), "--data", str(data), "--out", str(run)]
    with_baseline = [a for a in COMMON if a != "--no-baseline"]  # FSDP skips it, saying so
    command = [*launch, *arguments, "--batch-size", "8", *with_baseline, "--gradient-checkpointing"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    said = " ".join((done.stdout + done.stderr).split())
    groups = "1 x PeftModelForSequenceClassification, 1 x Embedding, 2 x LlamaDecoderLayer"
    assert f"FSDP: 4 shard groups over 2 processes: {groups}" in said, said[-2000:]
    assert "baseline: skipped under FSDP (it loads the whole model on one device)" in said
    assert json.loads((run / "env.json").read_text())["distributed"] == {
        "type": "FSDP",
        "processes": 2,
        "fsdp_version": 2,
    }
    assert (run / "checkpoints/step_000012/pytorch_model_fsdp_0").is_dir()
    assert_same_run(run, reference)
    # RUN/best is the whole adapter (not one process's shard) and holds the single run's weights
    ours, theirs = (load_file(r / "best/adapter_model.safetensors") for r in (run, reference))
    assert sorted(ours) == sorted(theirs) and len(ours) == 9  # q and v LoRA of 2 layers, and the head
    for name, tensor in ours.items():
        assert tensor.shape == theirs[name].shape
        assert torch.allclose(tensor, theirs[name], atol=1e-5), name

    # killed after step 8: resume from the sharded checkpoint of step 8
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints/step_000012")
    (resumed / "status.json").write_text(json.dumps({"state": "interrupted"}))
    done = subprocess.run(
        [*launch, "--resume", str(resumed)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "Resumed from" in done.stdout + done.stderr
    assert len(json.loads((resumed / "env.json").read_text())["resumes"]) == 1
    assert_same_run(resumed, reference)


@pytest.mark.parametrize(
    ("version", "extra", "message"),
    [
        ("1", [], "error: FSDP version 1 is not supported: set `fsdp_version: 2`"),
        ("2", ["--quantize", "4bit"], "error: --quantize 4bit is not supported under FSDP"),
    ],
)
def test_fsdp_refusals(tiny_models, single, tmp_path, version, extra, message):
    data, _ = single
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    env |= {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": version}
    command = [
        launcher("torchrun"),
        "--nproc_per_node",
        "2",
        "-m",
        "tests.fsdp_cpu",
        "train",
        "--no-baseline",
    ]
    command += ["--model", str(tiny_models["llama"]), "--data", str(data), "--out", str(tmp_path / "run")]
    done = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode != 0
    said = " ".join((done.stdout + done.stderr).split())
    assert message in said, said[-2000:]
    assert not (tmp_path / "run/checkpoints").exists()


def test_two_nodes_match_one(tiny_models, single, tmp_path):
    """The README's two-machine recipe, both "machines" on this one: two torchrun launchers (node_rank 0 and
    1, one process each) meeting at a c10d rendezvous, writing one run folder that both see."""
    data, reference = single
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "two-nodes"
    nodes = [
        subprocess.Popen(
            [launcher("torchrun"), "--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1"]
            + ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "loracls-test"]
            + ["-m", "loracls", "train", "--model", str(tiny_models["llama"]), "--data", str(data)]
            + ["--out", str(run), "--batch-size", "8", *COMMON],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    said = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], said[0][-2000:] + said[1][-2000:]
    assert "x 2 process(es)" in " ".join(said[0].split())
    assert sorted(p.name for p in (run / "checkpoints/step_000012").glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert_same_run(run, reference)


def test_ddp_processes_share_the_baseline(tiny_models, single, tmp_path):
    """Under DDP every process scores a share of the baseline's prompts (before, rank 0 scored them all while
    the others waited at a barrier that times out after 10 minutes); the result is the one-process one."""
    from loracls.model import load_causal_lm, load_tokenizer
    from loracls.training.baseline import run_baseline
    from loracls.training.runs import RunFolder

    data, _ = single
    model = str(tiny_models["llama"])
    run = tmp_path / "ddp-baseline"
    command = [launcher("torchrun"), "--nproc_per_node", "2", "-m", "loracls", "train", "--model", model]
    options = [a for a in COMMON if a != "--no-baseline"]
    options[options.index("--epochs") + 1] = "0.5"
    command += ["--data", str(data), "--out", str(run), "--batch-size", "8", *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((run / "baseline_metrics.json").read_text())
    assert metrics["processes"] == 2

    folder = RunFolder(run)
    cfg, labels = folder.read_config(), folder.read_labels()
    alone = run_baseline(
        load_causal_lm(model),
        load_tokenizer(model),
        folder.read_split("test"),
        labels,
        folder.read_split("train"),
        cfg,
        tmp_path / "alone",
    )
    for key in ("uncalibrated", "calibrated", "swapped_order"):
        assert metrics[key]["accuracy"] == alone[key]["accuracy"]
    shared, single_process = (
        [json.loads(line) for line in (where / "baseline_predictions.jsonl").read_text().splitlines()]
        for where in (run, tmp_path / "alone")
    )
    assert len(shared) == len(single_process) == len(folder.read_split("test"))
    for ours, theirs in zip(shared, single_process, strict=True):
        assert ours["id"] == theirs["id"]
        assert ours["log_probs"] == pytest.approx(theirs["log_probs"], abs=1e-5)
