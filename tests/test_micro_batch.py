"""Micro-batch and accumulation: what the probe finds, and that accumulating micro-batches trains exactly as
one large batch does."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loracls.config import TrainConfig
from loracls.environment import micro_batch
from loracls.errors import LoraclsError
from loracls.training.train import train


def test_micro_batches_divide_the_batch_largest_first():
    assert micro_batch.divisors(32) == [32, 16, 8, 4, 2, 1]
    assert micro_batch.divisors(24, cap=16) == [12, 8, 6, 4, 3, 2, 1]
    tried = []

    def fits(n):  # a device where at most 10 examples fit
        tried.append(n)
        return n <= 10

    assert micro_batch.largest_fitting(micro_batch.divisors(48), fits) == 8
    assert tried == [48, 24, 16, 12, 8]
    with pytest.raises(LoraclsError, match="Not even a micro-batch of 1"):
        micro_batch.largest_fitting([4, 2, 1], lambda n: False)


def test_requested_micro_batch_wins_and_cpu_takes_the_cap():
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert micro_batch.micro_batch_size(4, 32, cpu, None, {}, ()) == (4, "set")
    assert micro_batch.micro_batch_size(None, 32, cpu, None, {}, ()) == (16, "cpu cap")
    assert micro_batch.micro_batch_size(None, 12, cpu, None, {}, ()) == (12, "cpu cap")
    # FSDP: the probe would need the whole model on one GPU; nothing touches the (absent) GPU here
    sharded = SimpleNamespace(device=torch.device("cuda"), is_fsdp2=True)
    assert micro_batch.micro_batch_size(None, 64, sharded, None, {}, ()) == (16, "FSDP: not probed")


def step_options(tmp_path, tiny_models, toy_csv, name, **overrides) -> dict:
    """The options of one optimizer step over exactly 16 training examples."""
    return dict(
        model=str(tiny_models["llama"]),
        data=str(toy_csv),
        out=str(tmp_path / name),
        max_train_examples=16,
        batch_size=16,
        epochs=1,
        min_steps=0,
        lr=1e-2,
        lora_dropout=0.0,
        log_every=1,
        max_length=64,
        baseline=False,
        # fp32 unless a test asks: `auto` is bf16 on CPUs with AVX-512-BF16, which rounds sums apart
        **{"precision": "fp32", **overrides},
    )


# `train(TrainConfig(**options))` in a fresh interpreter, the options given as JSON
TRAIN = """import json, sys
from loracls.config import TrainConfig
from loracls.training.train import train
train(TrainConfig(**json.loads(sys.argv[1])))"""


def first_record(out: Path) -> dict:
    return json.loads((out / "train_log.jsonl").read_text().splitlines()[0])


def one_step(tmp_path, tiny_models, toy_csv, name, **overrides):
    """One optimizer step over exactly 16 training examples; its log record and the trained head."""
    _, metrics = train(TrainConfig(**step_options(tmp_path, tiny_models, toy_csv, name, **overrides)))
    return first_record(tmp_path / name), metrics


def test_accumulation_gives_the_gradient_of_one_batch(tmp_path, tiny_models, toy_csv):
    whole, _ = one_step(tmp_path, tiny_models, toy_csv, "whole", micro_batch_size=16)
    parts, metrics = one_step(tmp_path, tiny_models, toy_csv, "parts", micro_batch_size=4)
    assert (metrics["train"]["accumulation"], metrics["train"]["optimizer_steps"]) == (4, 1)
    assert parts["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)
    assert parts["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert whole["grad_norm"] > 0


def test_bf16_gradient_checkpointing_and_eager_attention_train(tmp_path, tiny_models, toy_csv):
    reference, _ = one_step(tmp_path, tiny_models, toy_csv, "ref", micro_batch_size=8)
    checkpointed, _ = one_step(
        tmp_path, tiny_models, toy_csv, "ckpt", micro_batch_size=8, gradient_checkpointing=True
    )
    assert checkpointed["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
    eager, _ = one_step(tmp_path, tiny_models, toy_csv, "eager", micro_batch_size=8, attention="eager")
    assert eager["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-3)
    bf16, metrics = one_step(tmp_path, tiny_models, toy_csv, "bf16", precision="bf16")
    assert metrics["train"]["mixed_precision"] == "bf16"
    assert bf16["grad_norm"] == pytest.approx(reference["grad_norm"], rel=0.05)  # same step, fewer bits
    assert (tmp_path / "bf16/config.yaml").read_text().count("micro_batch_size: 16") == 1


@pytest.mark.slow
def test_compiled_layers_train_like_eager_ones(tmp_path, tiny_models, toy_csv):
    """The compiled run is a process of its own: `torch.compile` leaves process-wide state behind (its
    compile workers, the loaded kernels, dynamo's caches) that the rest of the suite should not run beside,
    and a crash inside compiled code fails this test with its message instead of aborting the suite. Its
    kernels go to a cache of its own: inductor's cache in /tmp outlives a run, and a kernel that another
    process cached under `ATEN_CPU_CAPABILITY=avx2` (scripts/as_avx2.sh) aborted a later plain run on
    loading it (`free(): invalid pointer`, torch 2.13), which is what failed two CI runs."""
    reference, _ = one_step(tmp_path, tiny_models, toy_csv, "eager-run", micro_batch_size=8)
    options = step_options(tmp_path, tiny_models, toy_csv, "compiled", micro_batch_size=8, compile=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    command = [sys.executable, "-c", TRAIN, json.dumps(options)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert first_record(tmp_path / "compiled")["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-3)
    assert (tmp_path / "compiled/best/adapter_model.safetensors").is_file()  # names unchanged by compiling


def test_the_probe_leaves_the_random_stream_as_it_was(monkeypatch):
    """The probe's passes draw dropout masks: without a forked RNG a seed's first (probed) run and its later
    (cached) runs would train differently."""

    def fits_on_device(model, example, device, autocast, loss=None):
        def fits(n):
            torch.nn.functional.dropout(torch.ones(n, 4), 0.5, training=True)
            return n <= 4

        return fits

    monkeypatch.setattr(micro_batch, "fits_on_device", fits_on_device)
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    assert micro_batch.probe(model, {}, 16, torch.device("cpu"), None) == 4
    assert torch.equal(torch.random.get_rng_state(), state)
