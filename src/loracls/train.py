"""`train()`: data → model → LoRA → `fit()` → test report, writing the run folder as it goes."""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass

import psutil
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import Dataset
from peft import PeftModel, set_peft_model_state_dict
from peft.utils import load_peft_weights
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.optim import AdamW
from transformers import PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from loracls.config import TrainConfig
from loracls.data import Splits, load_splits, make_loader, tokenize, truncated_share
from loracls.doctor import check_before_training, collect_facts, diagnose
from loracls.errors import LoraclsError
from loracls.evaluate import predict_probs, score, write_predictions_jsonl
from loracls.lora import apply_lora, targets_line, targets_table
from loracls.model import describe, load_classifier, load_tokenizer, resolve_model
from loracls.runs import RunFolder, environment, write_jsonl
from loracls.zeroshot import baseline_for_run, baseline_line, baseline_summary

console = Console(stderr=True)


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


def mixed_precision(precision: str) -> str:
    """accelerate's name for `precision`: `auto` is bf16 on GPUs that have it, fp16 on others, fp32 on CPU."""
    if precision == "auto":
        if torch.cuda.is_available():
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "no"
    return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]


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
) -> FitResult:
    """Train with AdamW, cosine warm-up schedule, accumulation and clipping; validate and keep the best."""
    loader = make_loader(train_set, tokenizer, cfg.batch_size, shuffle=True, seed=cfg.seed)
    sampler = loader.batch_sampler
    steps_per_epoch = math.ceil(len(loader) / cfg.grad_accum)
    total_steps = max(1, math.ceil(cfg.epochs * steps_per_epoch))
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    console.print(
        f"{len(train_set)} training examples, {steps_per_epoch} optimizer steps per epoch, "
        f"{total_steps} in all (warm-up {warmup}), effective batch {cfg.effective_batch_size}"
    )

    step, epoch, best_step, best_val, stale = 0, 0, 0, None, 0
    window_loss, window_micro, window_examples, window_tokens = 0.0, 0, 0, 0
    examples, tokens, train_s = 0, 0, 0.0
    start = window_start = time.perf_counter()
    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=True,
    )
    task = progress.add_task("", total=total_steps)
    model.train()
    with progress:
        while step < total_steps:
            sampler.set_epoch(epoch)
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        grad_norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                window_loss += loss.detach().float()
                window_micro += 1
                window_examples += len(batch["labels"])
                window_tokens += int(batch["attention_mask"].sum())
                if not accelerator.sync_gradients:
                    continue
                step += 1
                progress.update(task, advance=1)
                if not torch.isfinite(grad_norm):
                    raise LoraclsError(
                        f"Non-finite gradient at optimizer step {step} (loss {float(loss):.4g}). Lower --lr "
                        f"or use --precision fp32. Best checkpoint so far: {run.best if best_val else 'none'}"
                    )

                if step % cfg.log_every == 0 or step == total_steps:
                    elapsed = time.perf_counter() - window_start
                    record = {
                        "kind": "train",
                        "step": step,
                        "epoch": round(step / steps_per_epoch, 3),
                        "loss": float(window_loss) / window_micro,
                        "lr": scheduler.get_last_lr()[0],
                        "grad_norm": float(grad_norm),
                        "examples_per_s": window_examples / elapsed,
                        "tokens_per_s": window_tokens / elapsed,
                        **memory_gb(accelerator.device),
                    }
                    run.append_log(record)
                    progress.update(task, description=f"loss {record['loss']:.4f}")
                    progress.console.print(
                        f"step {step:>5} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                        f"{record['examples_per_s']:.1f} ex/s {record['tokens_per_s']:.0f} tok/s | "
                        + " ".join(f"{k[4:]} {v:.2f}G" for k, v in record.items() if k.startswith("mem_"))
                    )
                    examples += window_examples
                    tokens += window_tokens
                    train_s += elapsed
                    window_loss, window_micro, window_examples, window_tokens = 0.0, 0, 0, 0
                    window_start = time.perf_counter()

                if step % cfg.eval_every == 0 or step == total_steps:
                    eval_start = time.perf_counter()
                    val = validate(
                        accelerator.unwrap_model(model),
                        tokenizer,
                        val_set,
                        splits,
                        cfg,
                        run,
                        step,
                        accelerator,
                    )
                    improved = best_val is None or val[cfg.metric] > best_val[cfg.metric]
                    record = {
                        "kind": "eval",
                        "step": step,
                        "val_accuracy": val["accuracy"],
                        "val_macro_f1": val["macro_f1"],
                        "best": improved,
                    }
                    run.append_log(record)
                    progress.console.print(
                        f"step {step:>5} | [bold]val accuracy {val['accuracy']:.4f} "
                        f"macro-F1 {val['macro_f1']:.4f}[/]" + ("  (best)" if improved else "")
                    )
                    if improved:
                        best_step, best_val, stale = step, val, 0
                        save_checkpoint(accelerator.unwrap_model(model), tokenizer, run)
                    else:
                        stale += 1
                    if cfg.early_stopping_patience is not None and stale >= cfg.early_stopping_patience:
                        console.print(f"Early stopping: no gain in {stale} validations")
                        total_steps = step
                    window_start += time.perf_counter() - eval_start  # validation is not training time
                if step >= total_steps:
                    break
            epoch += 1
    return FitResult(best_step, best_val, step, examples, tokens, train_s, time.perf_counter() - start)


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
    probs = predict_probs(
        model, val_set, tokenizer, cfg.batch_size * 2, accelerator.device, accelerator.autocast()
    )
    write_predictions_jsonl(
        run.file(f"val_predictions/step_{step:06d}.jsonl"), splits.val, probs, splits.labels
    )
    return score(splits.val, probs, splits.labels)


def save_checkpoint(model: PeftModel, tokenizer: PreTrainedTokenizerBase, run: RunFolder) -> None:
    """Adapter, head and tokenizer into RUN/best, replaced in one rename."""
    tmp = run.file("best.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(run.best, ignore_errors=True)
    tmp.rename(run.best)


def train(cfg: TrainConfig) -> tuple[RunFolder, dict]:
    """The whole job; returns the run folder and the metrics written to `RUN/metrics.json`."""
    splits = load_splits(cfg)
    for note in splits.notes:
        console.print(f"[dim]data: {note}[/]")
    console.print(
        f"data: {len(splits.train)} train / {len(splits.val)} val / {len(splits.test)} test, "
        f"labels {splits.labels}"
    )
    run = RunFolder.create(cfg.out, cfg.data)
    cfg.out = str(run.path)
    run.write_config(cfg)
    run.set_status("running")
    try:
        metrics = train_into(run, cfg, splits)
    except BaseException as e:
        run.set_status("failed", error=f"{type(e).__name__}: {e}")
        raise
    run.set_status("finished")
    return run, metrics


def train_into(run: RunFolder, cfg: TrainConfig, splits: Splits) -> dict:
    """Model, LoRA, `fit()` and the test report, written into an open run folder."""
    accelerator = Accelerator(
        mixed_precision=mixed_precision(cfg.precision), gradient_accumulation_steps=cfg.grad_accum
    )
    facts = collect_facts()
    run.write_json(
        "env.json",
        {
            **environment(accelerator.device),
            "mixed_precision": accelerator.mixed_precision,
            "system_rocm": facts.system_rocm,
            "driver": facts.driver,
            "doctor": diagnose(facts).to_json(),
        },
    )
    run.write_json("labels.json", {"id2label": dict(enumerate(splits.labels)), "label2id": splits.label2id})
    write_jsonl(run.file("data/val.jsonl"), splits.val)
    write_jsonl(run.file("data/test.jsonl"), splits.test)

    if cfg.smoke_test and accelerator.device.type == "cuda":
        check_before_training(str(accelerator.device), facts)
    model_path = resolve_model(cfg.model)
    tokenizer = load_tokenizer(model_path, cfg.trust_remote_code)
    baseline = None
    if cfg.baseline:
        baseline = baseline_for_run(
            model_path, tokenizer, splits, cfg, run.path, accelerator.device, accelerator.autocast()
        )
        console.print(baseline_line(baseline))
    set_seed(cfg.seed)  # here, so the head, LoRA and data order do not depend on whether the baseline ran
    model = load_classifier(model_path, splits.labels, cfg.trust_remote_code, cfg.head_init)
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

    result = fit(model, tokenizer, train_set, val_set, splits, cfg, run, accelerator)

    model = accelerator.unwrap_model(model)
    set_peft_model_state_dict(model, load_peft_weights(str(run.best)))
    merged = model.merge_and_unload()
    probs = predict_probs(
        merged, test_set, tokenizer, cfg.batch_size * 2, accelerator.device, accelerator.autocast()
    )
    write_predictions_jsonl(run.file("test_predictions.jsonl"), splits.test, probs, splits.labels)
    metrics = {
        "test": score(splits.test, probs, splits.labels),
        "baseline": baseline_summary(baseline),
        "best_val": {"step": result.best_step, **result.best_val},
        "train": result.throughput,
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
    return metrics
