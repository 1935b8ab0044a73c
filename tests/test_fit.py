"""fit()'s pieces called directly: the accumulation windows and the line that announces the steps."""

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
