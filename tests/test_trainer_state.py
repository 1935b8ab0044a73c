"""`TrainerState`: the counters `fit()` keeps, changed only through its methods, and the log window's sums."""

from __future__ import annotations

import json
from dataclasses import asdict

from accelerate import Accelerator

from loracls.training.trainer_state import TrainerState, gather_window, window_sums


def test_a_step_counts_its_window_and_a_nonfinite_one_leaves_its_loss_out():
    state = TrainerState(total_steps=10)
    state.count_step(batches=2, examples=8, tokens=100, loss=1.5, finite=True)
    state.count_step(batches=2, examples=8, tokens=90, loss=float("nan"), finite=False)
    assert (state.step, state.batches_in_epoch, state.skipped_nonfinite) == (2, 4, 1)
    assert (state.window_loss, state.window_micro, state.window_examples, state.window_tokens) == (
        1.5,
        2,
        16,
        190,
    )


def test_closing_a_window_folds_it_into_the_totals_and_starts_the_next():
    state = TrainerState(total_steps=10)
    state.count_step(batches=1, examples=4, tokens=40, loss=0.7, finite=True)
    state.count_seconds(2.0)
    state.close_window(examples=12, tokens=120)  # summed over three processes
    state.count_step(batches=1, examples=4, tokens=30, loss=0.5, finite=True)
    state.count_seconds(1.0)
    state.close_window(examples=4, tokens=30)
    assert (state.examples, state.tokens, state.train_s) == (16, 150, 3.0)
    assert (state.window_loss, state.window_micro, state.window_examples, state.window_tokens) == (
        0.0,
        0,
        0,
        0,
    )
    assert state.window_s == 0.0 and state.step == 2


def test_validations_keep_the_best_and_patience_ends_the_run_at_this_step():
    state = TrainerState(total_steps=100)
    state.step = 10
    assert state.count_validation({"macro_f1": 0.6}, improved=True, patience=2) is False
    state.step = 20
    assert state.count_validation({"macro_f1": 0.5}, improved=False, patience=2) is False
    assert (state.best_step, state.best_val, state.stale, state.total_steps) == (
        10,
        {"macro_f1": 0.6},
        1,
        100,
    )
    state.step = 30
    assert state.count_validation({"macro_f1": 0.55}, improved=False, patience=2) is True
    assert (state.total_steps, state.best_step) == (30, 10)


def test_without_patience_a_run_never_stops_early_and_an_improvement_resets_stale():
    state = TrainerState(total_steps=5)
    for step in range(1, 5):
        state.step = step
        assert state.count_validation({"acc": 0.1}, improved=False, patience=None) is False
    assert state.stale == 4
    state.count_validation({"acc": 0.9}, improved=True, patience=None)
    assert (state.stale, state.best_step, state.total_steps) == (0, 4, 5)


def test_next_epoch_restarts_the_position_in_the_data():
    state = TrainerState(total_steps=5, batches_in_epoch=7)
    state.next_epoch()
    assert (state.epoch, state.batches_in_epoch) == (1, 0)


def test_the_state_survives_json_as_a_checkpoint_writes_it():
    state = TrainerState(total_steps=9, step=3, best_val={"accuracy": 0.75}, window_loss=0.25, window_micro=1)
    assert TrainerState(**json.loads(json.dumps(asdict(state)))) == state


def test_one_process_sums_its_own_window_and_gathers_nothing():
    accelerator = Accelerator(cpu=True)
    state = TrainerState(total_steps=3)
    state.count_step(batches=3, examples=6, tokens=60, loss=2.25, finite=True)
    assert window_sums(accelerator, state) == (2.25, 3, 6, 60)
    gather_window(accelerator, state)
    assert (state.window_loss, state.window_micro, state.window_examples) == (2.25, 3, 6)
