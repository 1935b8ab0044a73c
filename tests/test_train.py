"""fit()'s schedule, accumulation and stopping, read back from train_log.jsonl."""

import json
import math
import re

import pytest
import torch

from loracls.config import TrainConfig
from loracls.training.train import train


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


def test_metrics_say_where_the_run_s_time_went(tmp_path, tiny_models, toy_csv):
    """metrics.json's `stages`: seconds per stage in the order they ran, the baseline and the training among
    them, with shares of their total that add up to one."""
    _, metrics = run_log(tmp_path, tiny_models, toy_csv, epochs=0.5, eval_every=100, prompt_sample=8)
    seconds, share = metrics["stages"]["seconds"], metrics["stages"]["share"]
    names = list(seconds)
    assert names.index("choosing the prompt and scoring the baseline") < names.index("training")
    assert names.index("training") < names.index("testing the best checkpoint")
    assert all(t >= 0 for t in seconds.values()) and seconds["training"] > 0
    assert sum(share.values()) == pytest.approx(1, abs=0.01)
    assert metrics["stages"]["resumed"] is False
    # and what the micro-batches padded, and the peak memory, beside the throughput
    assert metrics["train"]["padded_per_real_token"] >= 1.0 and metrics["train"]["peak_rss_gb"] > 0.1
    log = [json.loads(line) for line in (tmp_path / "run/train_log.jsonl").read_text().splitlines()]
    assert all(r["peak_rss_gb"] >= r["mem_rss_gb"] * 0.99 for r in log if r["kind"] == "train")


def test_early_stopping_after_patience(tmp_path, tiny_models, toy_csv):
    # a learning rate this small cannot change a prediction, so no validation improves on the first
    log, metrics = run_log(
        tmp_path, tiny_models, toy_csv, epochs=3, lr=1e-12, eval_every=1, early_stopping_patience=2
    )
    evals = [r for r in log if r["kind"] == "eval"]
    assert [r["best"] for r in evals] == [True, False, False]
    assert metrics["train"]["optimizer_steps"] == 3 and metrics["best_val"]["step"] == 1


def test_a_log_gets_a_line_from_every_long_stage(tmp_path, tiny_models, toy_csv, log_file):
    """In a log (no terminal: no bars), each stage that runs long prints where it is and when it is done;
    here every stage counts as long (`log_file`)."""
    run_log(tmp_path, tiny_models, toy_csv, epochs=0.5, eval_every=100, prompt_sample=8)
    written = log_file.getvalue()
    for stage, unit in [
        ("prompt search", "prompts"),
        ("baseline", "prompts"),
        ("train", "steps"),
        ("validation", "examples"),
        ("test", "examples"),
    ]:
        assert re.search(rf"^{stage}: (.*, )?\d+ of \d+ {unit}, about \d+ s left$", written, re.M), stage
        assert re.search(rf"^{stage}: (.*, )?(\d+) of \2 {unit}, done in \d+ s$", written, re.M), stage


def test_wsd_warms_up_holds_then_decays_linearly_to_zero(tmp_path, tiny_models, toy_csv):
    # 12 steps: warm-up 2, stable to step 9, the last 3 (decay_ratio 0.25) linear to 0; extend_up_to 1 never
    # trains more than planned
    log, metrics = run_log(
        tmp_path, tiny_models, toy_csv, epochs=2, lr=1e-3, warmup_steps=2, eval_every=100,
        schedule="wsd", decay_ratio=0.25, extend_up_to=1,
    )  # fmt: skip
    lrs = [r["lr"] for r in log if r["kind"] == "train"]
    assert lrs == pytest.approx([1e-3 * f for f in [0.5] + [1.0] * 8 + [2 / 3, 1 / 3, 0.0]])
    assert metrics["train"]["optimizer_steps"] == 12


def test_wsd_trains_on_while_validation_improves_up_to_its_limit(
    tmp_path, tiny_models, toy_csv, monkeypatch, log_file
):
    """Every validation counts as improved here: the decay due at step 9 moves after the next validation
    (decay 3 steps: 15 in all), again at step 12 (18), and at 15 the limit (1.5 x 12 planned) holds it; the
    progress line counts to the new end."""
    from loracls.training import fit

    real = fit.validate_and_keep_best
    monkeypatch.setattr(fit, "validate_and_keep_best", lambda *args: real(*args) or True)
    log, metrics = run_log(
        tmp_path, tiny_models, toy_csv, epochs=2, lr=1e-3, warmup_steps=2, eval_every=3,
        schedule="wsd", decay_ratio=0.25, extend_up_to=1.5,
    )  # fmt: skip
    lrs = {r["step"]: r["lr"] for r in log if r["kind"] == "train"}
    assert sorted(lrs) == list(range(1, 19)) and metrics["train"]["optimizer_steps"] == 18
    assert [lrs[s] / 1e-3 for s in (14, 15, 16, 17, 18)] == pytest.approx([1, 1, 2 / 3, 1 / 3, 0])
    assert [r["step"] for r in log if r["kind"] == "eval"] == [3, 6, 9, 12, 15, 18]
    out = log_file.getvalue()
    assert "validation still improving before the decay: 15 steps in all (at most 18)" in out
    assert "validation still improving before the decay: 18 steps in all (at most 18)" in out
    assert re.search(r"^train: 18 of 18 steps, done in", out, re.M)


def test_wsd_keeps_its_extended_end_through_the_schedulers_state_dict():
    """A resume restores the scheduler with accelerate (`load_state_dict`): the extended total comes back."""
    from torch.optim.lr_scheduler import LambdaLR

    from loracls.training.schedule import WarmupStableDecay

    def scheduler(factor):
        return LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), factor)

    factor = WarmupStableDecay(warmup=2, decay=3, total=12, limit=24)
    assert factor.extend(step=8, improved=True, eval_every=4) == 15  # 9 is due: after the next validation
    assert factor.extend(step=4, improved=True, eval_every=4) is None  # not the last before the decay
    assert factor.extend(step=12, improved=False, eval_every=4) is None
    first = WarmupStableDecay(warmup=2, decay=3, total=12, limit=24)
    assert first.extend(step=8, improved=True, eval_every=8) is None  # the first validation: no evidence
    restored = WarmupStableDecay(warmup=2, decay=3, total=12, limit=24)
    scheduler(restored).load_state_dict(scheduler(factor).state_dict())
    assert restored.total == 15 and [restored(s) for s in (12, 13, 15)] == pytest.approx([1, 2 / 3, 0])
