"""`fit()`: the training loop (AdamW, warm-up and schedule, accumulation, clipping), with its validation,
logging, checkpointing and stopping beside it as named helpers; they share one `Training`.

The loop only sees the objective's `loss` (`objective.py`); validation and the final test its `probs`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import resource
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from datasets import Dataset
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from loracls.config import TrainConfig
from loracls.console import Stage, console, duration, progress
from loracls.data.batching import make_loader, padded_per_token
from loracls.data.splits import Splits
from loracls.errors import Interrupted, LoraclsError
from loracls.objective import Objective
from loracls.training import checkpoints
from loracls.training.evaluate import evaluation_probs, score_validation
from loracls.training.runs import RunFolder
from loracls.training.schedule import WarmupStableDecay, optimizer_and_schedule, schedule_words
from loracls.training.trainer_state import TrainerState, window_sums


@dataclass
class FitResult:
    best_step: int
    best_val: dict
    steps: int
    examples: int
    tokens: int
    train_s: float
    """Seconds spent training, validation excluded: the denominator of the throughput figures."""
    wall_s: float
    padded_per_real_token: float = 1.0
    """Tokens computed per real token in the first epoch's micro-batches (each padded to its longest)."""

    @property
    def throughput(self) -> dict:
        return {
            "examples_per_s": self.examples / self.train_s,
            "tokens_per_s": self.tokens / self.train_s,
            "train_s": self.train_s,
            "wall_s": self.wall_s,
            "optimizer_steps": self.steps,
            "examples_seen": self.examples,
            "padded_per_real_token": round(self.padded_per_real_token, 3),
            **peak_memory_gb(),
        }


def memory_gb(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "mem_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"mem_rss_gb": psutil.Process().memory_info().rss / 2**30, **peak_memory_gb()}


def peak_memory_gb() -> dict[str, float]:
    """The process's peak resident memory so far (on a GPU machine too: the host's side)."""
    return {"peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}  # KiB


def log_setup_peak(run: RunFolder, device: torch.device, step: int) -> None:
    """On a GPU, a `setup` record of the peak memory so far (loading, prompt search, probe), then the peak
    reset: the train records' peaks are then training's own, as the memory plan sizes them."""
    if device.type == "cuda":
        run.append_log({"kind": "setup", "step": step, **memory_gb(device)})
        torch.cuda.reset_peak_memory_stats(device)


def fit(
    model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    train_set: Dataset,
    val_set: Dataset,
    splits: Splits,
    cfg: TrainConfig,
    run: RunFolder,
    accelerator: Accelerator,
    objective: Objective,
    resume: Path | None = None,
) -> FitResult:
    """Train with AdamW, its schedule (`schedule.py`), accumulation and clipping; validate, keep the best,
    checkpoint.

    With `resume`, the adapter, optimizer, scheduler, RNG states and data position come from that checkpoint,
    and training continues as if it had never stopped.
    """
    loader = training_loader(train_set, tokenizer, cfg, accelerator.num_processes)
    sampler, accum = loader.batch_sampler, accumulation(cfg)
    # each process takes every n-th batch (a number of batches that n divides: `batching.evened`)
    steps_per_epoch = math.ceil(math.ceil(len(loader) / accelerator.num_processes) / accum)
    total_steps = max(1, math.ceil(cfg.epochs * steps_per_epoch), cfg.min_steps)
    optimizer, scheduler, factor = optimizer_and_schedule(model, cfg, total_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    checkpoints.register_adapter_hooks(accelerator, model)
    describe_shards(model, accelerator)
    state = start_state(total_steps, accelerator, tokenizer, run, resume)
    training = Training(
        model, optimizer, scheduler, accelerator, objective, tokenizer, cfg, run, state, factor
    )
    console.print(plan_line(cfg, len(train_set), steps_per_epoch, total_steps, accelerator.num_processes))
    padding = padded_per_token(sampler.lengths, sampler.batches())
    console.print(f"padding: {padding:.2f} tokens computed per real token (micro-batches of similar length)")

    log_setup_peak(run, accelerator.device, state.step)
    start, first = time.perf_counter(), state.step + 1
    model.train()
    with progress("train", state.total_steps, "steps", state.step) as bar, StopSignals() as stop:
        training.bar, clock = bar, TrainClock(state)
        while state.step < state.total_steps:
            for window in epoch_windows(training, loader, sampler):
                step_loss, examples, tokens = 0.0, 0, 0
                for i, batch in enumerate(window):
                    # the gradients are all-reduced once per window, in its last micro-step's backward
                    with accelerator.no_sync(model) if i < len(window) - 1 else contextlib.nullcontext():
                        loss = objective.loss(model, batch)
                        # accelerate divides by `accum`: each micro-batch counts 1 / len(window), so that an
                        # epoch's short last window weighs as a full one
                        accelerator.backward(loss * (accum / len(window)))
                    step_loss += float(loss.detach())
                    examples += len(batch["labels"])
                    tokens += int(batch["attention_mask"].sum())
                grad_norm, nonfinite = optimizer_step(training, step_loss)
                scheduler.step()
                optimizer.zero_grad()
                state.count_step(len(window), examples, tokens, step_loss, finite=not nonfinite)
                bar.update(done=state.step)
                if nonfinite:
                    log_skipped_step(training, step_loss / len(window), float(grad_norm))

                if state.step % cfg.log_every == 0 or state.step == state.total_steps:
                    clock.lap()
                    log_train(training, grad_norm, state.step / steps_per_epoch)
                elif (
                    state.step == first
                ):  # a slow run's first line comes long before its first log window ends
                    first_step_line(training, step_loss / len(window), time.perf_counter() - start)
                improved = False
                if state.step % cfg.eval_every == 0 or state.step == state.total_steps:
                    with clock.paused():  # validation is not training time
                        improved = validate_and_keep_best(training, val_set, splits)
                    extend_schedule(training, improved)
                with clock.paused():
                    checkpoint_or_stop(training, stop, improved)
                if state.step >= state.total_steps:
                    break
            else:
                state.next_epoch()
    if run.main:  # a resume at the last step writes no checkpoint, and prunes as one does
        checkpoints.prune(run.path, cfg.keep_checkpoints, state.best_step)
    wall = time.perf_counter() - start
    return FitResult(
        state.best_step,
        state.best_val,
        state.step,
        state.examples,
        state.tokens,
        state.train_s,
        wall,
        padded_per_real_token=padding,
    )


@dataclass
class Training:
    """What `fit()`'s helpers share: the prepared model, optimizer and scheduler, the run's settings, folder
    and counters, and the progress bar (`fit()` sets it)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: AcceleratedScheduler
    accelerator: Accelerator
    objective: Objective
    tokenizer: PreTrainedTokenizerBase
    cfg: TrainConfig
    run: RunFolder
    state: TrainerState
    factor: WarmupStableDecay | None
    """`schedule: wsd`'s learning-rate factor (the scheduler's own object, restored with it); None: cosine."""
    params: list[torch.nn.Parameter] = field(init=False)
    """The trainable parameters as the prepared model holds them (FSDP has replaced them with shards)."""
    fingerprint: dict | None = field(init=False)
    """What every checkpoint is trained with, for a resume to compare (main process; config.yaml is final
    by now)."""
    bar: Stage | None = None

    def __post_init__(self) -> None:
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        processes = self.accelerator.num_processes
        self.fingerprint = (
            checkpoints.fingerprint(self.cfg, self.run.path, processes) if self.run.main else None
        )


def plan_line(cfg: TrainConfig, examples: int, steps_per_epoch: int, total_steps: int, processes: int) -> str:
    """What the run will do: examples, optimizer steps, schedule and how a batch is made."""
    return (
        f"{examples} training examples, {steps_per_epoch} optimizer steps per epoch, "
        f"{total_steps} in all{raised_by_min_steps(cfg, steps_per_epoch, total_steps)} "
        f"({schedule_words(cfg, total_steps)}), batch {cfg.batch_size} = {accumulation(cfg)} x "
        f"{cfg.micro_batch_size} examples, x {processes} process(es)"
    )


def training_loader(
    train_set: Dataset, tokenizer: PreTrainedTokenizerBase, cfg: TrainConfig, processes: int = 1
):
    """Length-grouped, label-balanced training micro-batches, reshuffled per epoch, as many as `processes`
    divides."""
    # the loader's own generator: a resumed run's fresh iterator must not draw from the global RNG (dropout's)
    generator = torch.Generator()
    return make_loader(
        train_set,
        tokenizer,
        cfg.micro_batch_size,
        shuffle=True,
        seed=cfg.seed,
        generator=generator,
        group=cfg.length_grouping,
        balance_labels=cfg.balance_labels,
        shards=processes,
    )


def start_state(
    total_steps: int,
    accelerator: Accelerator,
    tokenizer: PreTrainedTokenizerBase,
    run: RunFolder,
    resume: Path | None,
) -> TrainerState:
    """A fresh `TrainerState`, or with `resume` the checkpoint's (adapter, optimizer, scheduler and RNG are
    restored into the prepared objects, and RUN/best is put back to the checkpoint's best)."""
    if resume is None:
        return TrainerState(total_steps=total_steps)
    state = checkpoints.load(accelerator, resume)
    if run.main:
        checkpoints.restore_best(run, tokenizer, state)
    console.print(f"Resumed from {resume}: step {state.step} of {state.total_steps}")
    return state


def epoch_windows(training: Training, loader, sampler) -> Iterator[list[dict]]:
    """The accumulation windows of micro-batches left in the epoch in progress (`windows`): a resumed epoch
    starts after the `batches_in_epoch` already consumed (whole windows: checkpoints come between them)."""
    state, accelerator = training.state, training.accelerator
    # both: accelerate's loader would count its own iterations instead, and under several processes
    # its sharding wrapper does not pass the epoch on to our sampler
    loader.set_epoch(state.epoch)
    sampler.set_epoch(state.epoch)
    skip = state.batches_in_epoch
    yield from windows(
        accelerator.skip_first_batches(loader, skip) if skip else loader, accumulation(training.cfg)
    )


def windows(batches: Iterable, size: int) -> Iterator[list]:
    """`batches` in consecutive lists of `size`: an epoch's accumulation windows, the last one shorter when
    `size` does not divide the epoch's micro-batches."""
    batches = iter(batches)
    while window := list(itertools.islice(batches, size)):
        yield window


class TrainClock:
    """Counts the seconds of training into the log window in progress; what runs `paused()` (validation,
    checkpoint writing) is left out, so the throughput figures are training alone."""

    def __init__(self, state: TrainerState) -> None:
        self.state, self.mark = state, time.perf_counter()

    def lap(self) -> None:
        now = time.perf_counter()
        self.state.count_seconds(now - self.mark)
        self.mark = now

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.lap()
        yield
        self.mark = time.perf_counter()


def describe_shards(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """Under FSDP, print how the model was sharded (shard groups by module type)."""
    if not accelerator.is_fsdp2:
        return
    from torch.distributed.fsdp import FSDPModule  # only where torch has distributed support

    groups = Counter(
        type(m).__name__.removeprefix("FSDP") for m in model.modules() if isinstance(m, FSDPModule)
    )
    console.print(
        f"FSDP: {sum(groups.values())} shard groups over {accelerator.num_processes} processes: "
        + ", ".join(f"{n} x {name}" for name, n in groups.items())
    )


def optimizer_step(training: Training, loss: float) -> tuple[torch.Tensor, bool]:
    """Clip and apply the accumulated update; returns the gradient norm and whether the step was non-finite.

    A non-finite step's update is not applied. Under fp16 the loss scaler decides that itself: clipping has
    unscaled the gradients, and its `step` (which skips an update with inf/NaN gradients) must run so that
    `update` lowers the scale and resets it for the next step; an overflowing scaled gradient is the scaler's
    normal search for a scale and not counted, a non-finite loss is.
    """
    accelerator = training.accelerator
    grad_norm = accelerator.clip_grad_norm_(training.params, training.cfg.max_grad_norm)
    scaled = accelerator.scaler is not None
    nonfinite = agree(accelerator, not math.isfinite(loss) or (not scaled and not torch.isfinite(grad_norm)))
    if scaled or not nonfinite:
        training.optimizer.step()
    return grad_norm, nonfinite


def log_skipped_step(training: Training, loss: float, grad_norm: float) -> None:
    """Log a step whose loss or gradient was NaN/inf (its update was not applied); stop past the allowance."""
    state, cfg, run = training.state, training.cfg, training.run
    run.append_log({"kind": "skipped", "step": state.step, "loss": loss, "grad_norm": grad_norm})
    if state.skipped_nonfinite > cfg.skip_nonfinite:
        last = checkpoints.latest(run.path)
        raise LoraclsError(
            f"Non-finite loss or gradient at optimizer step {state.step} (loss {loss:.4g}, gradient norm "
            f"{grad_norm:.4g}); the update was not applied. Last good checkpoint: {last or 'none yet'}. "
            f"Lower --lr, use --precision fp32, or allow a few such steps with --skip-nonfinite N "
            f"({cfg.skip_nonfinite} allowed now)."
        )
    console.print(
        f"[yellow]step {state.step}: non-finite loss or gradient, update skipped "
        f"({state.skipped_nonfinite} of {cfg.skip_nonfinite} allowed)[/]"
    )


def log_train(training: Training, grad_norm: torch.Tensor, epoch: float) -> None:
    """Close the log window: a `train` record in RUN/train_log.jsonl and the trackers, and a printed line."""
    record = log_window(training, grad_norm, epoch)
    training.run.append_log(record)
    training.accelerator.log(scalars(record), step=training.state.step)
    training.bar.update(note=f"loss {record['loss']:.4f}")
    console.print(
        f"step {training.state.step:>5} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"{record['examples_per_s']:.1f} ex/s {record['tokens_per_s']:.0f} tok/s | "
        + " ".join(f"{k[4:]} {v:.2f}G" for k, v in record.items() if k.startswith("mem_"))
    )


def first_step_line(training: Training, loss: float, seconds: float) -> None:
    """The line after this process's first optimizer step, when it logs no window: that step's loss
    (this process's micro-batches), how long it took, and what the rest will at that pace."""
    state, every = training.state, training.cfg.log_every
    left = duration(seconds * (state.total_steps - state.step))
    console.print(
        f"step {state.step:>5} | loss {loss:.4f} | {seconds:.1f} s for the first step: about {left} for the "
        f"{state.total_steps - state.step} left; a line every {every} steps"
    )


def log_window(training: Training, grad_norm: torch.Tensor, epoch: float) -> dict:
    """The `train_log.jsonl` record of the log window that just ended; folds it into the run's totals.

    Loss, examples and tokens are summed over the processes; time is this process's.
    """
    state, accelerator = training.state, training.accelerator
    loss, micro, examples, tokens = window_sums(accelerator, state)
    record = {
        "kind": "train",
        "step": state.step,
        "epoch": round(epoch, 3),
        "loss": loss / max(micro, 1),
        "lr": training.scheduler.get_last_lr()[0],
        "grad_norm": float(grad_norm),
        "examples_per_s": examples / state.window_s,
        "tokens_per_s": tokens / state.window_s,
        **memory_gb(accelerator.device),
    }
    state.close_window(examples, tokens)
    return record


def validate_and_keep_best(training: Training, val_set: Dataset, splits: Splits) -> bool:
    """Validate, log it, keep RUN/best when the metric improved, and count towards early stopping; returns
    whether this step is the new best."""
    t, state, cfg = training, training.state, training.cfg
    model = t.accelerator.unwrap_model(t.model)
    probs = evaluation_probs(model, val_set, t.tokenizer, cfg, t.accelerator, t.objective, "validation")
    val = score_validation(probs, splits, cfg, t.run, state.step)
    improved = state.best_val is None or val[cfg.metric] > state.best_val[cfg.metric]
    record = {
        "kind": "eval",
        "step": state.step,
        "val_accuracy": val["accuracy"],
        "val_macro_f1": val["macro_f1"],
        "best": improved,
    }
    t.run.append_log(record)
    t.accelerator.log(scalars(record), step=state.step)
    console.print(
        f"step {state.step:>5} | [bold]val accuracy {val['accuracy']:.4f} macro-F1 {val['macro_f1']:.4f}[/]"
        + ("  (best)" if improved else "")
    )
    stopping = state.count_validation(val, improved, cfg.early_stopping_patience)
    if improved:
        checkpoints.save_best(t.accelerator, t.model, t.tokenizer, t.run)
    if stopping:
        console.print(f"Early stopping: no gain in {state.stale} validations")
    return improved


def extend_schedule(training: Training, improved: bool) -> None:
    """`schedule: wsd`: when the last validation before the decay improved, train on at a stable learning
    rate to the next validation (`WarmupStableDecay.extend`), and say so."""
    state, factor = training.state, training.factor
    if factor is None:
        return
    total = factor.extend(state.step, improved, training.cfg.eval_every)
    if total is None:
        return
    state.extend(total)
    training.bar.update(total=total)
    console.print(
        f"step {state.step:>5} | validation still improving before the decay: {total} steps in all "
        f"(at most {factor.limit})"
    )


def checkpoint_or_stop(training: Training, stop: StopSignals, improved: bool) -> None:
    """Write a checkpoint (with `fingerprint`, what it is trained with) at a new best, every `save_every`
    steps, at the end and when a signal asks to stop (in any process); after a signal's checkpoint, stop."""
    state, cfg, run = training.state, training.cfg, training.run
    if agree(training.accelerator, stop.signal is not None) and stop.signal is None:
        stop.signal = "a signal to another process"
    if not (improved or state.step % cfg.save_every == 0 or state.step >= state.total_steps or stop.signal):
        return
    folder = checkpoints.save(
        training.accelerator, state, run.path, cfg.keep_checkpoints, training.fingerprint
    )
    if stop.signal:
        raise Interrupted(
            f"{stop.signal}: stopped after optimizer step {state.step} of {state.total_steps}; "
            f"checkpoint {folder}. Continue with `loracls train --resume {run.path}`."
        )


def raised_by_min_steps(cfg: TrainConfig, steps_per_epoch: int, total_steps: int) -> str:
    """What the step line says when `min_steps` gave more steps than the epochs asked for."""
    asked = math.ceil(cfg.epochs * steps_per_epoch)
    if total_steps != cfg.min_steps or cfg.min_steps <= asked:
        return ""
    epochs = f"{cfg.epochs:g} epoch{'' if cfg.epochs == 1 else 's'}"
    return f": raised from {asked} ({epochs}) to min_steps={cfg.min_steps}; --min-steps 0 for {epochs} only"


def accumulation(cfg: TrainConfig) -> int:
    """Micro-batches per optimizer step."""
    return cfg.batch_size // cfg.micro_batch_size


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a `train_log.jsonl` record, for the trackers."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def agree(accelerator: Accelerator, flag: bool) -> bool:
    """True when `flag` is true in any process, so that all processes take the same branch."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), "max"))


class StopSignals:
    """Within the block, SIGINT (Ctrl-C) and SIGTERM ask the loop to stop after the current optimizer step.

    A second signal stops at once, as Ctrl-C normally does.
    """

    def __enter__(self) -> StopSignals:
        self.signal: str | None = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self.previous[number] = signal.signal(number, self.handle)
        return self

    def handle(self, number: int, frame) -> None:
        if self.signal:
            raise KeyboardInterrupt
        self.signal = signal.Signals(number).name
        console.print(
            f"[yellow]{self.signal}: finishing this step and writing a checkpoint (again: stop now)[/]"
        )

    def __exit__(self, *exc) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
