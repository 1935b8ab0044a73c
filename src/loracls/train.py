"""`train()`: data → model → LoRA → `fit()` → test report, writing the run folder as it goes."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, broadcast_object_list, parse_flag_from_env, set_seed
from datasets import Dataset
from peft import PeftModel, set_peft_model_state_dict
from peft.utils import load_peft_weights
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.optim import AdamW
from transformers import PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from loracls import checkpoints
from loracls.config import TrainConfig
from loracls.data import Splits, load_splits, make_loader, tokenize, truncated_share
from loracls.doctor import check_before_training, check_quantization, collect_facts, diagnose
from loracls.errors import LoraclsError
from loracls.evaluate import predict_probs, score, tune_thresholds, write_predictions_jsonl
from loracls.lora import apply_lora, targets_line, targets_table
from loracls.model import describe, load_classifier, load_tokenizer, resolve_model
from loracls.output import console
from loracls.report import build_report
from loracls.runs import RunFolder, default_out, environment, write_jsonl
from loracls.sizing import OFFLOAD_COST, eval_batch_size, micro_batch_size, mixed_precision, offload_in_use
from loracls.zeroshot import baseline_for_run, baseline_line, baseline_summary


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


def cpu_only() -> bool:
    """No GPU: accelerate then runs several processes on the CPU (gloo) instead of expecting one per GPU."""
    return not torch.cuda.is_available() and not torch.backends.mps.is_available()


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
    resume: Path | None = None,
) -> FitResult:
    """Train with AdamW, cosine warm-up, accumulation and clipping; validate, keep the best, checkpoint.

    With `resume`, the adapter, optimizer, scheduler, RNG states and data position come from that checkpoint,
    and training continues as if it had never stopped.
    """
    # the loader's own generator: a resumed run's fresh iterator must not draw from the global RNG (dropout's)
    loader = make_loader(
        train_set,
        tokenizer,
        cfg.micro_batch_size,
        shuffle=True,
        seed=cfg.seed,
        generator=torch.Generator(),
        group=cfg.length_grouping,
        balance_labels=cfg.balance_labels,
    )
    sampler = loader.batch_sampler
    accum = accumulation(cfg)
    # each process takes every n-th batch (the last round is filled up from the start by accelerate)
    steps_per_epoch = math.ceil(math.ceil(len(loader) / accelerator.num_processes) / accumulation(cfg))
    total_steps = max(1, math.ceil(cfg.epochs * steps_per_epoch))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total_steps)
    loss_fn = make_loss(cfg, train_set, model.config.num_labels).to(accelerator.device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    params = [p for p in model.parameters() if p.requires_grad]  # FSDP has replaced them with shards
    checkpoints.register_adapter_hooks(accelerator, model)
    if accelerator.is_fsdp2:
        from torch.distributed.fsdp import FSDPModule  # only where torch has distributed support

        groups = Counter(
            type(m).__name__.removeprefix("FSDP") for m in model.modules() if isinstance(m, FSDPModule)
        )
        console.print(
            f"FSDP: {sum(groups.values())} shard groups over {accelerator.num_processes} processes: "
            + ", ".join(f"{n} x {name}" for name, n in groups.items())
        )
    state = checkpoints.TrainerState(total_steps=total_steps)
    if resume is not None:
        state = checkpoints.load(accelerator, resume)
        if run.main:
            restore_best(run, tokenizer, state)
        console.print(f"Resumed from {resume}: step {state.step} of {state.total_steps}")
    console.print(
        f"{len(train_set)} training examples, {steps_per_epoch} optimizer steps per epoch, "
        f"{total_steps} in all (warm-up {warmup}), batch {cfg.batch_size} = {accumulation(cfg)} x "
        f"{cfg.micro_batch_size} examples, x {accelerator.num_processes} process(es)"
    )

    start = time.perf_counter()
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=True,
    )
    task = progress.add_task("", total=state.total_steps, completed=state.step)
    step_loss, step_micro, nonfinite = 0.0, 0, False
    model.train()
    with progress, StopSignals() as stop:
        clock = time.perf_counter()
        while state.step < state.total_steps:
            # both: accelerate's loader would count its own iterations instead, and under several processes
            # its sharding wrapper does not pass the epoch on to our sampler
            loader.set_epoch(state.epoch)
            sampler.set_epoch(state.epoch)
            batches = (
                accelerator.skip_first_batches(loader, state.batches_in_epoch)
                if state.batches_in_epoch
                else loader
            )
            for batch in batches:
                state.batches_in_epoch += 1
                with accelerator.accumulate(model):
                    labels = batch.pop("labels")
                    loss = loss_fn(model(**batch).logits.float(), labels)
                    # accelerate divides every loss by the accumulation count; a short last window of an
                    # epoch would weigh less than a full one
                    accelerator.backward(loss * window_weight(state.batches_in_epoch, len(loader), accum))
                    step_loss += float(loss.detach())
                    step_micro += 1
                    state.window_examples += len(labels)
                    state.window_tokens += int(batch["attention_mask"].sum())
                    if accelerator.sync_gradients:
                        grad_norm, nonfinite = optimizer_step(
                            accelerator, optimizer, params, cfg.max_grad_norm, step_loss
                        )
                        scheduler.step()
                    optimizer.zero_grad()
                if not accelerator.sync_gradients:
                    continue
                state.step += 1
                progress.update(task, completed=state.step)
                if nonfinite:
                    skip_nonfinite_step(state, cfg, run, step_loss / step_micro, float(grad_norm))
                else:
                    state.window_loss += step_loss
                    state.window_micro += step_micro
                step_loss, step_micro = 0.0, 0

                if state.step % cfg.log_every == 0 or state.step == state.total_steps:
                    now = time.perf_counter()
                    state.window_s += now - clock
                    clock = now
                    record = log_window(
                        state,
                        state.step / steps_per_epoch,
                        scheduler.get_last_lr()[0],
                        grad_norm,
                        accelerator,
                    )
                    run.append_log(record)
                    accelerator.log(scalars(record), step=state.step)
                    progress.update(task, description=f"loss {record['loss']:.4f}")
                    progress.console.print(
                        f"step {state.step:>5} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                        f"{record['examples_per_s']:.1f} ex/s {record['tokens_per_s']:.0f} tok/s | "
                        + " ".join(f"{k[4:]} {v:.2f}G" for k, v in record.items() if k.startswith("mem_"))
                    )

                improved = False
                if state.step % cfg.eval_every == 0 or state.step == state.total_steps:
                    state.window_s += time.perf_counter() - clock  # validation is not training time
                    val = validate(
                        accelerator.unwrap_model(model),
                        tokenizer,
                        val_set,
                        splits,
                        cfg,
                        run,
                        state.step,
                        accelerator,
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
                        f"step {state.step:>5} | [bold]val accuracy {val['accuracy']:.4f} "
                        f"macro-F1 {val['macro_f1']:.4f}[/]" + ("  (best)" if improved else "")
                    )
                    if improved:
                        state.best_step, state.best_val, state.stale = state.step, val, 0
                        save_best(accelerator, model, tokenizer, run)
                    else:
                        state.stale += 1
                    if cfg.early_stopping_patience is not None and state.stale >= cfg.early_stopping_patience:
                        console.print(f"Early stopping: no gain in {state.stale} validations")
                        state.total_steps = state.step
                    clock = time.perf_counter()

                if agree(accelerator, stop.signal is not None) and stop.signal is None:
                    stop.signal = "a signal to another process"
                saving = state.step % cfg.save_every == 0 or state.step >= state.total_steps
                if improved or saving or stop.signal:
                    state.window_s += time.perf_counter() - clock
                    folder = checkpoints.save(accelerator, state, run.path, cfg.keep_checkpoints)
                    clock = time.perf_counter()
                if stop.signal:
                    raise Interrupted(
                        f"{stop.signal}: stopped after optimizer step {state.step} of {state.total_steps}; "
                        f"checkpoint {folder}. Continue with `loracls train --resume {run.path}`."
                    )
                if state.step >= state.total_steps:
                    break
            else:
                state.epoch += 1
                state.batches_in_epoch = 0
    return FitResult(
        state.best_step,
        state.best_val,
        state.step,
        state.examples,
        state.tokens,
        state.train_s,
        time.perf_counter() - start,
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


def window_weight(batch: int, batches: int, accumulation: int) -> float:
    """Factor on the loss of micro-batch `batch` (1-based) of an epoch of `batches`, so that the epoch's
    short last accumulation window (when `accumulation` does not divide `batches`) weighs as a full one."""
    short = batches % accumulation
    return accumulation / short if short and batch > batches - short else 1.0


def accumulation(cfg: TrainConfig) -> int:
    """Micro-batches per optimizer step."""
    return cfg.batch_size // cfg.micro_batch_size


def speed_options(model: PeftModel, cfg: TrainConfig) -> None:
    """Gradient checkpointing and `torch.compile` (of each decoder layer, in place), when asked for."""
    if cfg.gradient_checkpointing:
        # non-reentrant: works with frozen inputs (no enable_input_require_grads) and with LoRA's dropout
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:
        # in place, layer by layer: the parameter names (and so the saved adapter) stay as they are
        layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
        for layer in max(layers, key=lambda m: sum(p.numel() for p in m.parameters())):
            layer.compile(dynamic=True)


def choose_micro_batch(
    model: PeftModel, train_set: Dataset, cfg: TrainConfig, run: RunFolder, accelerator: Accelerator
) -> None:
    """Set `cfg.micro_batch_size` (probing the device when unset) and the accumulation that reaches
    `batch_size`; the run's `config.yaml` records the value, so a resume uses the same one."""
    lengths = [len(x) for x in train_set["input_ids"]]
    longest = torch.tensor([train_set[int(np.argmax(lengths))]["input_ids"]])
    example = {"input_ids": longest, "attention_mask": torch.ones_like(longest)}
    key = (cfg.model, max(lengths), accelerator.mixed_precision, cfg.lora_r, cfg.target_modules)
    key += (cfg.gradient_checkpointing, cfg.quantize, cfg.attention, len(model.config.id2label))
    size, how = micro_batch_size(cfg.micro_batch_size, cfg.batch_size, accelerator, model, example, key)
    if how != "set":
        console.print(f"micro-batch {size} ({how}; set --micro-batch-size to choose)")
        cfg.micro_batch_size = size
        run.write_config(cfg)
    accelerator.gradient_accumulation_steps = accumulation(cfg)


def check_requirements(cfg: TrainConfig) -> None:
    """What the config asks of the machine, checked before a run folder exists."""
    if cfg.track is not None and importlib.util.find_spec(cfg.track) is None:
        raise LoraclsError(f"--track {cfg.track} needs the package: pip install {cfg.track}")
    if cfg.quantize and parse_flag_from_env("ACCELERATE_USE_FSDP"):  # how accelerate launch asks for FSDP
        raise LoraclsError(
            f"--quantize {cfg.quantize} is not supported under FSDP (loracls shards full-precision weights "
            "only): use DDP, where each GPU holds the 4-bit base, or FSDP without --quantize."
        )
    if cfg.quantize and cpu_only():
        check_quantization(torch.device("cpu"), None)


def start_tracking(accelerator: Accelerator, cfg: TrainConfig, run: RunFolder) -> None:
    """With `track`, start accelerate's tracker (TensorBoard or MLflow) with the run's config."""
    if cfg.track is None:
        return
    config = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in cfg.to_dict().items()}
    accelerator.init_trackers(
        "loracls" if cfg.track == "mlflow" else run.path.name,
        config=config,
        init_kwargs={"mlflow": {"run_name": run.path.name}},
    )


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a `train_log.jsonl` record, for the trackers."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def make_loss(cfg: TrainConfig, train_set: Dataset, num_labels: int) -> torch.nn.Module:
    """Cross-entropy (single-label) or binary cross-entropy per label (multi-label), weighted against class
    imbalance with `class_weights`: inverse class frequency, or negatives/positives per label."""
    targets = torch.tensor(train_set["labels"])
    if cfg.multi_label:
        positives = targets.sum(dim=0)
        weight = (
            (len(targets) - positives).clamp(min=1) / positives.clamp(min=1) if cfg.class_weights else None
        )
        return torch.nn.BCEWithLogitsLoss(pos_weight=weight)
    counts = torch.bincount(targets, minlength=num_labels).float()
    weight = counts.sum() / (num_labels * counts.clamp(min=1)) if cfg.class_weights else None
    return torch.nn.CrossEntropyLoss(weight=weight)


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


def evaluation_probs(
    model: torch.nn.Module,
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    cfg: TrainConfig,
    accelerator: Accelerator,
) -> np.ndarray:
    """`predict_probs` as a run evaluates: batches of twice the micro-batch, shared by the processes."""
    return predict_probs(
        model,
        dataset,
        tokenizer,
        eval_batch_size(cfg.micro_batch_size),
        accelerator.device,
        accelerator.autocast(),
        accelerator,
    )


def validate(
    model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    val_set: Dataset,
    splits: Splits,
    cfg: TrainConfig,
    run: RunFolder,
    step: int,
    accelerator: Accelerator,
) -> dict:
    """Score the validation split and write every prediction to `RUN/val_predictions/step_NNNNNN.jsonl`."""
    probs = evaluation_probs(model, val_set, tokenizer, cfg, accelerator)
    # multi-label: checkpoints are compared at 0.5; thresholds are tuned once, on the best one
    thresholds = np.full(len(splits.labels), 0.5) if cfg.multi_label else None
    if run.main:
        path = run.file(f"val_predictions/step_{step:06d}.jsonl")
        write_predictions_jsonl(path, splits.val, probs, splits.labels, thresholds=thresholds)
    return score(splits.val, probs, splits.labels, thresholds)


def save_best(
    accelerator: Accelerator, model: PeftModel, tokenizer: PreTrainedTokenizerBase, run: RunFolder
) -> None:
    """Adapter, head and tokenizer into RUN/best, replaced in one rename; a failed write keeps the old one.

    Every process calls this (under FSDP the adapter is gathered from all); the main one writes.
    """
    tmp = run.file("best.tmp")
    if run.main:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        checkpoints.save_adapter(accelerator, model, tmp)
        if not run.main:
            return
        tokenizer.save_pretrained(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LoraclsError(
            f"Could not write the new best checkpoint to {run.best}: {e}. The previous best is intact; free "
            f"space, then `loracls train --resume {run.path}`."
        ) from None
    shutil.rmtree(run.best, ignore_errors=True)
    tmp.rename(run.best)


def restore_best(run: RunFolder, tokenizer: PreTrainedTokenizerBase, state: checkpoints.TrainerState) -> None:
    """On resume, RUN/best may hold a later step than the checkpoint's best: put that best back."""
    if state.best_val is None:
        shutil.rmtree(run.best, ignore_errors=True)
        return
    tmp = run.file("best.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoints.step_folder(run.path, state.best_step) / checkpoints.ADAPTER, tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(run.best, ignore_errors=True)
    tmp.rename(run.best)


def train(cfg: TrainConfig) -> tuple[RunFolder, dict]:
    """The whole job; returns the run folder and the metrics written to `RUN/metrics.json`.

    Under `accelerate launch` or `torchrun`, every process runs this; only the main one writes.
    """
    check_requirements(cfg)
    processes = PartialState(cpu=cpu_only())
    console.quiet = not processes.is_main_process
    splits = load_splits(cfg)
    for note in splits.notes:
        console.print(f"[dim]data: {note}[/]")
    console.print(
        f"data: {len(splits.train)} train / {len(splits.val)} val / {len(splits.test)} test, "
        f"labels {splits.labels}"
    )
    out = [cfg.out or default_out(cfg.data)]
    if processes.num_processes > 1:
        broadcast_object_list(out)  # one folder, even when the processes' clocks read different seconds
    run = RunFolder.create(out[0], cfg.data, processes.is_main_process)
    processes.wait_for_everyone()  # every process has checked the folder before the main one writes
    cfg.out = str(run.path)
    run.write_config(cfg)
    run.write_json("labels.json", {"id2label": dict(enumerate(splits.labels)), "label2id": splits.label2id})
    if run.main:
        for name in ("train", "val", "test"):
            write_jsonl(run.file(f"data/{name}.jsonl"), getattr(splits, name))
    run.write_json("data/notes.json", splits.notes)
    return guarded(run, cfg, splits, resume=None)


def resume(run_dir: str | Path) -> tuple[RunFolder, dict]:
    """Continue an unfinished run from its last checkpoint, with its own config and data splits."""
    processes = PartialState(cpu=cpu_only())
    console.quiet = not processes.is_main_process
    run = RunFolder(Path(run_dir), processes.is_main_process)
    state = run.status()
    if state == "finished":
        raise LoraclsError(f"{run.path} already finished; nothing to resume")
    checkpoint = checkpoints.latest(run.path)
    if checkpoint is None:
        raise LoraclsError(
            f"{run.path} (status: {state}) has no complete checkpoint to resume from; start the run again"
        )
    cfg = run.read_config()
    check_requirements(cfg)
    splits = run.read_splits()
    step = json.loads((checkpoint / checkpoints.STATE_FILE).read_text(encoding="utf-8"))["step"]
    run.truncate_log(step)  # what the stopped process logged after its last checkpoint is done again
    console.print(f"Resuming {run.path} from {checkpoint.name} (status was: {state})")
    return guarded(run, cfg, splits, resume=checkpoint)


def guarded(run: RunFolder, cfg: TrainConfig, splits: Splits, resume: Path | None) -> tuple[RunFolder, dict]:
    """`train_into()` with `RUN/status.json` saying running, then finished, interrupted or failed."""
    run.set_status("running", resumed_from=str(resume) if resume else None)
    try:
        metrics = train_into(run, cfg, splits, resume)
    except (Interrupted, KeyboardInterrupt) as e:
        run.set_status("interrupted", error=str(e) or "KeyboardInterrupt")
        raise
    except BaseException as e:
        run.set_status("failed", error=f"{type(e).__name__}: {e}")
        raise
    run.set_status("finished")
    if run.main:  # after the status: the report says whether the run finished
        console.print(f"report: {build_report(run.path)}", soft_wrap=True)
    return run, metrics


def train_into(run: RunFolder, cfg: TrainConfig, splits: Splits, resume: Path | None = None) -> dict:
    """Model, LoRA, `fit()` and the test report, written into an open run folder."""
    # an earlier run in this process (a sweep, a test) may have used another precision; the processes stay
    AcceleratorState._reset_state()
    accelerator = Accelerator(
        cpu=cpu_only(),
        mixed_precision=mixed_precision(cfg.precision),
        step_scheduler_with_optimizer=False,  # fit() steps it once per optimizer step, whatever the processes
        log_with=cfg.track,
        project_dir=str(run.file("tracking")),
    )
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise LoraclsError(
            "FSDP version 1 is not supported: set `fsdp_version: 2` under `fsdp_config` in the accelerate "
            "config (see configs/accelerate/fsdp-1node.yaml) or FSDP_VERSION=2."
        )
    start_tracking(accelerator, cfg, run)
    offload = offload_in_use(accelerator)
    if offload:
        console.print(f"[yellow]{offload}: {OFFLOAD_COST}[/]")
    facts = collect_facts()
    env = {
        **environment(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "distributed": {
            "type": accelerator.distributed_type.value,
            "processes": accelerator.num_processes,
            "fsdp_version": accelerator.state.fsdp_plugin.fsdp_version if accelerator.is_fsdp2 else None,
        },
        "offload": offload,
        "system_rocm": facts.system_rocm,
        "driver": facts.driver,
        "doctor": diagnose(facts).to_json(),
    }
    if resume is None:
        run.write_json("env.json", env)
    else:  # the first environment stays; each resume adds where and on what it continued
        first = json.loads(run.file("env.json").read_text(encoding="utf-8"))
        first.setdefault("resumes", []).append({"from": str(resume), **env})
        run.write_json("env.json", first)

    if cfg.smoke_test and accelerator.device.type == "cuda":
        check_before_training(str(accelerator.device), facts)
    if cfg.quantize:
        check_quantization(accelerator.device, facts)
    model_path = resolve_model(cfg.model)
    tokenizer = load_tokenizer(model_path, cfg.trust_remote_code)
    baseline = None
    if cfg.baseline and cfg.multi_label:
        console.print("[dim]baseline: the prompt baseline scores single-label tasks only; skipped[/]")
    elif cfg.baseline and accelerator.is_fsdp2:
        console.print(
            "[dim]baseline: skipped under FSDP (it loads the whole model on one device); run "
            "`loracls baseline` on a device it fits[/]"
        )
    elif cfg.baseline and resume is not None and run.file("baseline_metrics.json").is_file():
        baseline = json.loads(run.file("baseline_metrics.json").read_text(encoding="utf-8"))
    elif cfg.baseline:  # every process scores a share
        baseline = baseline_for_run(
            model_path, tokenizer, splits, cfg, run.path if run.main else None, accelerator
        )
        console.print(baseline_line(baseline))
    set_seed(cfg.seed)  # here, so the head, LoRA and data order do not depend on whether the baseline ran
    model = load_classifier(
        model_path,
        splits.labels,
        cfg.trust_remote_code,
        cfg.head_init,
        cfg.allow_pickle,
        cfg.multi_label,
        cfg.quantize,
        cfg.attention,
        accelerator.mixed_precision,
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    console.print(describe(model))

    train_set, val_set, test_set = (
        tokenize(t, tokenizer, cfg.max_length, splits.label2id)
        for t in (splits.train, splits.val, splits.test)
    )
    share = truncated_share(train_set, cfg.max_length)
    if share > 0.05:
        console.print(
            f"[yellow]{share:.0%} of training texts are truncated at max_length={cfg.max_length}[/]"
        )

    model, plan = apply_lora(model, cfg)
    run.write_json("targets.json", plan.to_json())
    console.print(targets_table(plan, f"LoRA targets: {cfg.target_modules}"))
    console.print(targets_line(plan))
    speed_options(model, cfg)
    choose_micro_batch(model, train_set, cfg, run, accelerator)

    result = fit(model, tokenizer, train_set, val_set, splits, cfg, run, accelerator, resume)

    # the best step scores the test split: merged into the base; under FSDP sharded with LoRA unmerged; under
    # QLoRA unmerged on the 4-bit base, as validation scored it (merging would re-quantise LoRA's update)
    if accelerator.is_fsdp2:
        accelerator.load_state(str(checkpoints.step_folder(run.path, result.best_step)))
        best = model
    else:
        model = accelerator.unwrap_model(model)
        set_peft_model_state_dict(model, load_peft_weights(str(run.best)))
        best = model if cfg.quantize else model.merge_and_unload()
    thresholds = None
    if cfg.multi_label:
        val_probs = evaluation_probs(best, val_set, tokenizer, cfg, accelerator)
        thresholds = tune_thresholds(splits.val, val_probs, splits.labels)
        run.write_json("thresholds.json", dict(zip(splits.labels, thresholds.tolist(), strict=True)))
    probs = evaluation_probs(best, test_set, tokenizer, cfg, accelerator)
    if run.main:
        path = run.file("test_predictions.jsonl")
        write_predictions_jsonl(path, splits.test, probs, splits.labels, thresholds=thresholds)
    metrics = {
        "test": score(splits.test, probs, splits.labels, thresholds),
        "baseline": baseline_summary(baseline),
        "best_val": {"step": result.best_step, **result.best_val},
        "train": {
            **result.throughput,
            "micro_batch_size": cfg.micro_batch_size,
            "accumulation": accumulation(cfg),
            "mixed_precision": accelerator.mixed_precision,
        },
        "data": {
            "train": len(splits.train),
            "val": len(splits.val),
            "test": len(splits.test),
            "notes": splits.notes,
            "truncated_share": share,
        },
        "trainable_parameters": {
            "lora": plan.lora_parameters,
            "head": plan.head_parameters,
            "trainable": plan.trainable,
            "base": plan.base_parameters,
            "share": plan.share,
        },
    }
    run.write_json("metrics.json", metrics)
    test = metrics["test"]
    accelerator.log({"test_accuracy": test["accuracy"], "test_macro_f1": test["macro_f1"]}, step=result.steps)
    accelerator.end_training()
    return metrics
