"""`TrainerState`: where a run is (step, position in the data, best so far, the log window in progress, the
counters), what `trainer_state.json` in every checkpoint holds, changed only through its own methods."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate import Accelerator


@dataclass
class TrainerState:
    """`fit()`'s counters: saved with every checkpoint and restored by `--resume`. They change only through
    the methods below."""

    total_steps: int
    """Optimizer steps the run will take (lowered when early stopping ends it, raised when `schedule: wsd`
    trains on while validation improves)."""
    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Pass over the training data in progress (its batch order is seeded by `seed + epoch`)."""
    batches_in_epoch: int = 0
    """Micro-batches of `epoch` already consumed; a resumed run skips them."""
    best_step: int = 0
    best_val: dict | None = None
    """Validation metrics of the best step so far."""
    stale: int = 0
    """Validations since the last improvement (for early stopping)."""
    skipped_nonfinite: int = 0
    """Optimizer steps skipped because the loss or gradient was NaN or infinite."""
    examples: int = 0
    tokens: int = 0
    train_s: float = 0.0
    """Examples, real tokens and seconds of training so far (validation excluded)."""
    window_loss: float = 0.0
    window_micro: int = 0
    window_examples: int = 0
    window_tokens: int = 0
    window_s: float = 0.0
    """The log window in progress: summed loss, micro-batches, examples, tokens and seconds."""

    def count_step(self, batches: int, examples: int, tokens: int, loss: float, finite: bool) -> None:
        """An optimizer step over a window of `batches` micro-batches whose losses sum to `loss`; a non-finite
        step (its update skipped) is counted as such, its loss left out of the log window."""
        self.step += 1
        self.batches_in_epoch += batches
        self.window_examples += examples
        self.window_tokens += tokens
        if finite:
            self.window_loss += loss
            self.window_micro += batches
        else:
            self.skipped_nonfinite += 1

    def count_seconds(self, seconds: float) -> None:
        self.window_s += seconds

    def count_validation(self, val: dict, improved: bool, patience: int | None) -> bool:
        """A validation's metrics `val`; returns whether early stopping (after `patience` validations without
        improvement) ends the run here."""
        if improved:
            self.best_step, self.best_val, self.stale = self.step, val, 0
        else:
            self.stale += 1
        if patience is not None and self.stale >= patience:
            self.total_steps = self.step
            return True
        return False

    def extend(self, total_steps: int) -> None:
        """Train to `total_steps` instead (`schedule: wsd`, validation still improving)."""
        self.total_steps = total_steps

    def set_window(self, loss: float, micro: int, examples: int, tokens: int) -> None:
        """The log window's loss, micro-batches, examples and tokens (a checkpoint gathers the processes')."""
        self.window_loss, self.window_micro = loss, micro
        self.window_examples, self.window_tokens = examples, tokens

    def close_window(self, examples: int, tokens: int) -> None:
        """Fold the log window just logged (`examples`, `tokens`: summed over the processes) into the totals
        and start the next."""
        self.examples += examples
        self.tokens += tokens
        self.train_s += self.window_s
        self.set_window(0.0, 0, 0, 0)
        self.window_s = 0.0

    def next_epoch(self) -> None:
        self.epoch += 1
        self.batches_in_epoch = 0


def window_sums(accelerator: Accelerator, state: TrainerState) -> tuple[float, int, int, int]:
    """The log window's loss, micro-batches, examples and tokens, summed over the processes."""
    if accelerator.num_processes == 1:
        return state.window_loss, state.window_micro, state.window_examples, state.window_tokens
    shares = torch.tensor(
        [state.window_loss, state.window_micro, state.window_examples, state.window_tokens],
        dtype=torch.float64,
        device=accelerator.device,
    )
    loss, micro, examples, tokens = accelerator.reduce(shares, "sum").tolist()
    return loss, int(micro), int(examples), int(tokens)


def gather_window(accelerator: Accelerator, state: TrainerState) -> None:
    """Under several processes, move every process's share of the log window in progress into the main
    process (the others' become 0), so that the one `trainer_state.json` holds the whole window; the window's
    record sums the processes' shares (`fit.log_window`) and comes out the same."""
    if accelerator.num_processes == 1:
        return
    sums = window_sums(accelerator, state)
    state.set_window(*(sums if accelerator.is_main_process else (0.0, 0, 0, 0)))
