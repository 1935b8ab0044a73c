"""fit()'s pieces called directly: the accumulation windows and the line that announces the steps; the line
after the first step."""

import json
import re

import pytest
import torch

from loracls.config import TrainConfig


def test_a_short_last_window_weighs_as_a_full_one():
    """10 micro-batches in windows of 4 make windows of 4, 4 and 2; with each loss times 4 / len(window), as
    fit() scales it (accelerate divides every loss by 4), each window's gradient is the mean of its
    micro-batches', the short one's too."""
    from accelerate import Accelerator

    from loracls.training.fit import windows

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
    from loracls.training.fit import raised_by_min_steps

    assert raised_by_min_steps(TrainConfig(epochs=1, min_steps=60), 5, 60) == (
        ": raised from 5 (1 epoch) to min_steps=60; --min-steps 0 for 1 epoch only"
    )
    assert raised_by_min_steps(TrainConfig(epochs=2, min_steps=8), 5, 10) == ""  # the epochs gave more
    assert raised_by_min_steps(TrainConfig(epochs=1, min_steps=0), 5, 5) == ""


def test_a_line_comes_after_the_first_step_long_before_the_first_log_window(tiny_models, toy_csv, tmp_path):
    """6 optimizer steps logged every 10: the first step prints its loss, how long it took and the rest will;
    train_log.jsonl holds the windows as before (the last step's only)."""
    from tests.conftest import invoke

    out = tmp_path / "run"
    args = ["train", "--model", tiny_models["llama"], "--data", toy_csv, "--out", out, "--epochs", "1"]
    args += ["--batch-size", "16", "--micro-batch-size", "8", "--log-every", "10", "--eval-every", "100"]
    args += ["--max-length", "64", "--min-steps", "0", "--no-baseline", "--head-init", "zero"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    first = r"step 1 \| loss \d\.\d{4} \| [\d.]+ s for the first step: about \d+ s for the 5 left; "
    first += "a line every 10 steps"
    assert re.search(first, said), said
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "train"] == [6]
