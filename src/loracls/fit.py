"""`fit()`: the training loop (AdamW, cosine warm-up, accumulation, clipping), with its validation,
logging, checkpointing and stopping beside it as named helpers.

The loop only sees the objective's `loss` (`objective.py`); validation and the final test its `probs`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from accelerate import Accelerator
from datasets import Dataset
from peft import PeftModel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.optim import AdamW
from transformers import PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from loracls import checkpoints
from loracls.batching import make_loader
from loracls.config import TrainConfig
from loracls.data import Splits
from loracls.errors import LoraclsError
from loracls.evaluate import validate
from loracls.objective import Objective
from loracls.output import console
from loracls.runs import RunFolder


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

    @property
    def throughput(self) -> dict:
        return {
            "examples_per_s": self.examples / self.train_s,
            "tokens_per_s": self.tokens / self.train_s,
            "train_s": self.train_s,
            "wall_s": self.wall_s,
            "optimizer_steps": self.steps,
            "examples_seen": self.examples,
        }


def memory_gb(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "mem_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"mem_rss_gb": psutil.Process().memory_info().rss / 2**30}


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
    """Train with AdamW, cosine warm-up, accumulation and clipping; validate, keep the best, checkpoint.

    With `resume`, the adapter, optimizer, scheduler, RNG states and data position come from that checkpoint,
    and training continues as if it had never stopped.
    """
    loader = training_loader(train_set, tokenizer, cfg)
    sampler, accum = loader.batch_sampler, accumulation(cfg)
    # each process takes every n-th batch (the last round is filled up from the start by accelerate)
    steps_per_epoch = math.ceil(math.ceil(len(loader) / accelerator.num_processes) / accum)
    total_steps = max(1, math.ceil(cfg.epochs * steps_per_epoch), cfg.min_steps)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total_steps)
    optimizer = AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    params = [p for p in model.parameters() if p.requires_grad]  # FSDP has replaced them with shards
    checkpoints.register_adapter_hooks(accelerator, model)
    describe_shards(model, accelerator)
    state = start_state(total_steps, accelerator, tokenizer, run, resume)
    # what every checkpoint was trained with, for a resume to compare (config.yaml is final by now)
    fingerprint = checkpoints.fingerprint(cfg, run.path, accelerator.num_processes) if run.main else None
    console.print(
        f"{len(train_set)} training examples, {steps_per_epoch} optimizer steps per epoch, "
        f"{total_steps} in all{raised_by_min_steps(cfg, steps_per_epoch, total_steps)} (warm-up {warmup}), "
        f"batch {cfg.batch_size} = {accum} x {cfg.micro_batch_size} examples, x {accelerator.num_processes} "
        "process(es)"
    )

    start = time.perf_counter()
    model.train()
    with progress_bar(state) as progress, StopSignals() as stop:
        clock = TrainClock(state)
        while state.step < state.total_steps:
            # both: accelerate's loader would count its own iterations instead, and under several processes
            # its sharding wrapper does not pass the epoch on to our sampler
            loader.set_epoch(state.epoch)
            sampler.set_epoch(state.epoch)
            skip = state.batches_in_epoch  # whole windows: checkpoints are written between them
            for window in windows(accelerator.skip_first_batches(loader, skip) if skip else loader, accum):
                step_loss = 0.0
                for i, batch in enumerate(window):
                    # the gradients are all-reduced once per window, in its last micro-step's backward
                    with accelerator.no_sync(model) if i < len(window) - 1 else contextlib.nullcontext():
                        loss = objective.loss(model, batch)
                        # accelerate divides by `accum`: each micro-batch counts 1 / len(window), so that an
                        # epoch's short last window weighs as a full one
                        accelerator.backward(loss * (accum / len(window)))
                    step_loss += float(loss.detach())
                    state.batches_in_epoch += 1
                    state.window_examples += len(batch["labels"])
                    state.window_tokens += int(batch["attention_mask"].sum())
                grad_norm, nonfinite = optimizer_step(
                    accelerator, optimizer, params, cfg.max_grad_norm, step_loss
                )
                scheduler.step()
                optimizer.zero_grad()
                state.step += 1
                progress.update(0, completed=state.step)
                if nonfinite:
                    skip_nonfinite_step(state, cfg, run, step_loss / len(window), float(grad_norm))
                else:
                    state.window_loss += step_loss
                    state.window_micro += len(window)

                if state.step % cfg.log_every == 0 or state.step == state.total_steps:
                    clock.lap()
                    log_train(
                        state, state.step / steps_per_epoch, scheduler, grad_norm, accelerator, run, progress
                    )
                improved = False
                if state.step % cfg.eval_every == 0 or state.step == state.total_steps:
                    with clock.paused():  # validation is not training time
                        improved = validate_and_keep_best(
                            model,
                            tokenizer,
                            val_set,
                            splits,
                            cfg,
                            run,
                            state,
                            accelerator,
                            objective,
                            progress,
                        )
                with clock.paused():
                    checkpoint_or_stop(accelerator, state, cfg, run, stop, improved, fingerprint)
                if state.step >= state.total_steps:
                    break
            else:
                state.epoch += 1
                state.batches_in_epoch = 0
    if run.main:  # a resume at the last step writes no checkpoint, and prunes as one does
        checkpoints.prune(run.path, cfg.keep_checkpoints, state.best_step)
    wall = time.perf_counter() - start
    return FitResult(
        state.best_step, state.best_val, state.step, state.examples, state.tokens, state.train_s, wall
    )


def training_loader(train_set: Dataset, tokenizer: PreTrainedTokenizerBase, cfg: TrainConfig):
    """Length-grouped, label-balanced training micro-batches, reshuffled per epoch."""
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
    )


def start_state(
    total_steps: int,
    accelerator: Accelerator,
    tokenizer: PreTrainedTokenizerBase,
    run: RunFolder,
    resume: Path | None,
) -> checkpoints.TrainerState:
    """A fresh `TrainerState`, or with `resume` the checkpoint's (adapter, optimizer, scheduler and RNG are
    restored into the prepared objects, and RUN/best is put back to the checkpoint's best)."""
    if resume is None:
        return checkpoints.TrainerState(total_steps=total_steps)
    state = checkpoints.load(accelerator, resume)
    if run.main:
        checkpoints.restore_best(run, tokenizer, state)
    console.print(f"Resumed from {resume}: step {state.step} of {state.total_steps}")
    return state


class TrainClock:
    """Counts the seconds of training into the log window in progress; what runs `paused()` (validation,
    checkpoint writing) is left out, so the throughput figures are training alone."""

    def __init__(self, state: checkpoints.TrainerState) -> None:
        self.state, self.mark = state, time.perf_counter()

    def lap(self) -> None:
        now = time.perf_counter()
        self.state.window_s += now - self.mark
        self.mark = now

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.lap()
        yield
        self.mark = time.perf_counter()


def progress_bar(state: checkpoints.TrainerState) -> Progress:
    """The transient bar of optimizer steps (task 0), with the latest loss beside it."""
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=True,
    )
    progress.add_task("", total=state.total_steps, completed=state.step)
    return progress


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


def log_train(
    state: checkpoints.TrainerState,
    epoch: float,
    scheduler,
    grad_norm: torch.Tensor,
    accelerator: Accelerator,
    run: RunFolder,
    progress: Progress,
) -> None:
    """Close the log window: a `train` record in RUN/train_log.jsonl and the trackers, and a printed line."""
    record = log_window(state, epoch, scheduler.get_last_lr()[0], grad_norm, accelerator)
    run.append_log(record)
    accelerator.log(scalars(record), step=state.step)
    progress.update(0, description=f"loss {record['loss']:.4f}")
    progress.console.print(
        f"step {state.step:>5} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"{record['examples_per_s']:.1f} ex/s {record['tokens_per_s']:.0f} tok/s | "
        + " ".join(f"{k[4:]} {v:.2f}G" for k, v in record.items() if k.startswith("mem_"))
    )


def validate_and_keep_best(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    val_set: Dataset,
    splits: Splits,
    cfg: TrainConfig,
    run: RunFolder,
    state: checkpoints.TrainerState,
    accelerator: Accelerator,
    objective: Objective,
    progress: Progress,
) -> bool:
    """Validate, log it, keep RUN/best when the metric improved, and count towards early stopping; returns
    whether this step is the new best."""
    val = validate(
        accelerator.unwrap_model(model),
        tokenizer,
        val_set,
        splits,
        cfg,
        run,
        state.step,
        accelerator,
        objective,
    )
    improved = state.best_val is None or val[cfg.metric] > state.best_val[cfg.metric]
    record = {
        "kind": "eval",
        "step": state.step,
        "val_accuracy": val["accuracy"],
        "val_macro_f1": val["macro_f1"],
        "best": improved,
    }
    run.append_log(record)
    accelerator.log(scalars(record), step=state.step)
    progress.console.print(
        f"step {state.step:>5} | [bold]val accuracy {val['accuracy']:.4f} macro-F1 {val['macro_f1']:.4f}[/]"
        + ("  (best)" if improved else "")
    )
    if improved:
        state.best_step, state.best_val, state.stale = state.step, val, 0
        checkpoints.save_best(accelerator, model, tokenizer, run)
    else:
        state.stale += 1
    if cfg.early_stopping_patience is not None and state.stale >= cfg.early_stopping_patience:
        console.print(f"Early stopping: no gain in {state.stale} validations")
        state.total_steps = state.step
    return improved


def checkpoint_or_stop(
    accelerator: Accelerator,
    state: checkpoints.TrainerState,
    cfg: TrainConfig,
    run: RunFolder,
    stop: StopSignals,
    improved: bool,
    fingerprint: dict | None,
) -> None:
    """Write a checkpoint (with `fingerprint`, what it is trained with) at a new best, every `save_every`
    steps, at the end and when a signal asks to stop (in any process); after a signal's checkpoint, stop."""
    if agree(accelerator, stop.signal is not None) and stop.signal is None:
        stop.signal = "a signal to another process"
    if not (improved or state.step % cfg.save_every == 0 or state.step >= state.total_steps or stop.signal):
        return
    folder = checkpoints.save(accelerator, state, run.path, cfg.keep_checkpoints, fingerprint)
    if stop.signal:
        raise Interrupted(
            f"{stop.signal}: stopped after optimizer step {state.step} of {state.total_steps}; "
            f"checkpoint {folder}. Continue with `loracls train --resume {run.path}`."
        )


def optimizer_step(
    accelerator: Accelerator,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    max_grad_norm: float,
    loss: float,
) -> tuple[torch.Tensor, bool]:
    """Clip and apply the accumulated update; returns the gradient norm and whether the step was non-finite.

    A non-finite step's update is not applied. Under fp16 the loss scaler decides that itself: clipping has
    unscaled the gradients, and its `step` (which skips an update with inf/NaN gradients) must run so that
    `update` lowers the scale and resets it for the next step; an overflowing scaled gradient is the scaler's
    normal search for a scale and not counted, a non-finite loss is.
    """
    grad_norm = accelerator.clip_grad_norm_(params, max_grad_norm)
    scaled = accelerator.scaler is not None
    nonfinite = agree(accelerator, not math.isfinite(loss) or (not scaled and not torch.isfinite(grad_norm)))
    if scaled or not nonfinite:
        optimizer.step()
    return grad_norm, nonfinite


def raised_by_min_steps(cfg: TrainConfig, steps_per_epoch: int, total_steps: int) -> str:
    """What the step line says when `min_steps` gave more steps than the epochs asked for."""
    asked = math.ceil(cfg.epochs * steps_per_epoch)
    if total_steps != cfg.min_steps or cfg.min_steps <= asked:
        return ""
    epochs = f"{cfg.epochs:g} epoch{'' if cfg.epochs == 1 else 's'}"
    return f": raised from {asked} ({epochs}) to min_steps={cfg.min_steps}; --min-steps 0 for {epochs} only"


def windows(batches: Iterable, size: int) -> Iterator[list]:
    """`batches` in consecutive lists of `size`: an epoch's accumulation windows, the last one shorter when
    `size` does not divide the epoch's micro-batches."""
    batches = iter(batches)
    while window := list(itertools.islice(batches, size)):
        yield window


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


def skip_nonfinite_step(
    state: checkpoints.TrainerState, cfg: TrainConfig, run: RunFolder, loss: float, grad_norm: float
) -> None:
    """Count a step whose loss or gradient was NaN/inf (update not applied); stop past the allowance."""
    state.skipped_nonfinite += 1
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


def log_window(
    state: checkpoints.TrainerState,
    epoch: float,
    lr: float,
    grad_norm: torch.Tensor,
    accelerator: Accelerator,
) -> dict:
    """The `train_log.jsonl` record of the log window that just ended; folds it into the run's totals.

    Loss, examples and tokens are summed over the processes; time is this process's.
    """
    if accelerator.num_processes > 1:
        sums = torch.tensor(
            [state.window_loss, state.window_micro, state.window_examples, state.window_tokens],
            dtype=torch.float64,
            device=accelerator.device,
        )
        loss, micro, examples, tokens = accelerator.reduce(sums, "sum").tolist()
        state.window_loss, state.window_micro = loss, int(micro)
        state.window_examples, state.window_tokens = int(examples), int(tokens)
    record = {
        "kind": "train",
        "step": state.step,
        "epoch": round(epoch, 3),
        "loss": state.window_loss / max(state.window_micro, 1),
        "lr": lr,
        "grad_norm": float(grad_norm),
        "examples_per_s": state.window_examples / state.window_s,
        "tokens_per_s": state.window_tokens / state.window_s,
        **memory_gb(accelerator.device),
    }
    state.examples += state.window_examples
    state.tokens += state.window_tokens
    state.train_s += state.window_s
    state.window_loss, state.window_micro, state.window_examples, state.window_tokens, state.window_s = (
        0.0,
        0,
        0,
        0,
        0.0,
    )
    return record


class Interrupted(LoraclsError):
    """Training stopped on SIGINT/SIGTERM after writing a checkpoint."""

    exit_code = 130


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
