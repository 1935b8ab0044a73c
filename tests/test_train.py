"""fit()'s schedule, accumulation and stopping, read back from train_log.jsonl."""

import json
import math

import pytest
import torch

from loracls.config import TrainConfig
from loracls.train import train


def run_log(tmp_path, tiny_models, toy_csv, **overrides) -> tuple[list[dict], dict]:
    cfg = TrainConfig(
        model=str(tiny_models["gemma3"]),
        data=str(toy_csv),
        out=str(tmp_path / "run"),
        batch_size=16,
        micro_batch_size=4,
        log_every=1,
        max_length=32,
        min_steps=0,
        **overrides,
    )
    _, metrics = train(cfg)
    log = [json.loads(line) for line in (tmp_path / "run/train_log.jsonl").read_text().splitlines()]
    return log, metrics


def test_warmup_then_cosine_to_zero(tmp_path, tiny_models, toy_csv):
    # 96 training examples / (4 x 4) = 6 optimizer steps per epoch; 2 epochs = 12 steps; the 12 validation
    # examples take 2 batches of 8, so validation runs several batches under autocast as on real data
    log, metrics = run_log(tmp_path, tiny_models, toy_csv, epochs=2, lr=1e-3, warmup_steps=3, eval_every=100)
    lrs = [r["lr"] for r in log if r["kind"] == "train"]
    assert len(lrs) == 12 and metrics["train"]["optimizer_steps"] == 12
    assert lrs[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])  # linear warm-up reaches the peak
    expected = [1e-3 * 0.5 * (1 + math.cos(math.pi * (s - 3) / 9)) for s in range(4, 13)]
    assert lrs[3:] == pytest.approx(expected)
    assert lrs[-1] == pytest.approx(0, abs=1e-12)
    assert metrics["train"]["examples_seen"] == 192


def test_fractional_epochs_stop_part_way(tmp_path, tiny_models, toy_csv):
    log, metrics = run_log(tmp_path, tiny_models, toy_csv, epochs=0.5, eval_every=100)
    assert [r["step"] for r in log if r["kind"] == "train"] == [1, 2, 3]
    assert [r["step"] for r in log if r["kind"] == "eval"] == [3]  # always validated at the end
    assert metrics["best_val"]["step"] == 3


def test_early_stopping_after_patience(tmp_path, tiny_models, toy_csv):
    # a learning rate this small cannot change a prediction, so no validation improves on the first
    log, metrics = run_log(
        tmp_path, tiny_models, toy_csv, epochs=3, lr=1e-12, eval_every=1, early_stopping_patience=2
    )
    evals = [r for r in log if r["kind"] == "eval"]
    assert [r["best"] for r in evals] == [True, False, False]
    assert metrics["train"]["optimizer_steps"] == 3 and metrics["best_val"]["step"] == 1


def test_a_short_last_window_weighs_as_a_full_one():
    """10 micro-batches in windows of 4 make windows of 4, 4 and 2; with each loss times 4 / len(window), as
    fit() scales it (accelerate divides every loss by 4), each window's gradient is the mean of its
    micro-batches', the short one's too."""
    from accelerate import Accelerator

    from loracls.fit import windows

    assert [len(w) for w in windows(range(10), 4)] == [4, 4, 2]
    assert [len(w) for w in windows(range(8), 4)] == [4, 4]

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    weight = torch.nn.Parameter(torch.ones(3))
    model = torch.nn.Linear(3, 1)
    batches = [torch.full((1, 3), float(i)) for i in range(1, 11)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    model, loader = accelerator.prepare(model, loader)
    grads = []
    for window in windows(loader, 4):
        for x in window:
            loss = (model(x) * weight.sum()).sum()
            accelerator.backward(loss * (4 / len(window)))
        grads.append(model.weight.grad.clone())
        model.zero_grad()
    # the mean input of each window: (1+2+3+4)/4, (5+..+8)/4, (9+10)/2, times d loss / d w = 3
    assert [float(g[0, 0]) for g in grads] == pytest.approx([7.5, 19.5, 28.5])


def test_the_step_line_says_when_min_steps_raised_the_steps():
    """5 steps an epoch and `--epochs 1` with the default min_steps trains 60: the line that announces the
    steps says so, and how to train one epoch."""
    from loracls.fit import raised_by_min_steps

    assert raised_by_min_steps(TrainConfig(epochs=1, min_steps=60), 5, 60) == (
        ": raised from 5 (1 epoch) to min_steps=60; --min-steps 0 for 1 epoch only"
    )
    assert raised_by_min_steps(TrainConfig(epochs=2, min_steps=8), 5, 10) == ""  # the epochs gave more
    assert raised_by_min_steps(TrainConfig(epochs=1, min_steps=0), 5, 5) == ""
