"""The prompt baseline: the base model's causal-LM head scores each label's verbaliser after a prompt.

No generation and no regex: for every prompt, the log-probability of each label's words (summed over their
tokens) is read from the logits, computed only at the positions that predict those tokens. A run's first
stage, `prompt_and_baseline`, chooses its prompt here and scores the baseline with the base model loaded once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from accelerate import Accelerator, PartialState
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loracls.config import TrainConfig
from loracls.console import Stage, console, progress
from loracls.data.labels import sort_labels
from loracls.data.prompts import (
    Prompter,
    answer_tokens,
    language_note,
    part_on_first_token,
    pin_prompt,
    resolve_prompt,
)
from loracls.data.splits import Splits, load_splits, stratified_sample
from loracls.data.tables import BUILTIN_DATASETS, read_labelled
from loracls.environment.devices import inference_autocast, inference_device
from loracls.errors import LoraclsError
from loracls.lora import linears_as_computed
from loracls.model import load_causal_lm
from loracls.objective import SCORE_BATCH, input_prompter, label_log_probs, label_rows, objective_kind
from loracls.training.evaluate import gather_rows, write_predictions_jsonl
from loracls.training.prompt_search import (
    PromptChoice,
    choose_prompt,
    plan_search,
    prompt_table,
    search_line,
    softmax,
    summary,
)
from loracls.training.runs import RunFolder, write_json

CONTENT_FREE = ("N/A", "", "[MASK]")
"""Inputs that carry no content: the model's answer to them is its bias (Zhao et al., 2021)."""


def load_baseline_data(
    data: str, split: str, train_file: str | None, cfg: TrainConfig
) -> tuple[pd.DataFrame, pd.DataFrame | None, list[str]]:
    """(table to score, table to draw shots from, labels): a built-in dataset's split, or a whole file."""
    if data in BUILTIN_DATASETS:
        splits = load_splits(cfg)
        if split not in ("train", "val", "test"):
            raise LoraclsError(f"--split must be train, val or test, not {split!r}")
        return getattr(splits, split), splits.train, splits.labels
    table = read_labelled(data, cfg.text_column, cfg.label_column)
    train = read_labelled(train_file, cfg.text_column, cfg.label_column) if train_file else None
    if cfg.max_eval_examples and len(table) > cfg.max_eval_examples:
        table = stratified_sample(table, cfg.max_eval_examples, cfg.seed).reset_index(drop=True)
    values = set(table["label"]) | (set(train["label"]) if train is not None else set())
    labels = sort_labels(values)
    if len(labels) < 2:
        raise LoraclsError(f"{data}: only one label ({labels[0]!r}); a classifier needs at least 2")
    return table, train, labels


def baseline_on_device(
    model_path: str,
    cfg: TrainConfig,
    tokenizer: PreTrainedTokenizerBase,
    table: pd.DataFrame,
    labels: list[str],
    train: pd.DataFrame | None,
    out: Path | None = None,
    device: torch.device | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    processes: PartialState | None = None,
) -> dict:
    """`run_baseline` with the LM loaded onto `device` (default: the GPU when there is one) under
    `autocast` (default: the precision `auto` picks there); the LM is freed afterwards. With training
    examples and `prompt: auto`, the prompt is first chosen on a sample of them (`choose_prompt`).

    With `processes` (several), each scores its share of the prompts and all get the whole result.
    """
    device = device or inference_device()
    model = load_causal_lm(model_path, cfg.trust_remote_code, cfg.allow_pickle).to(device)
    with autocast or inference_autocast(device):
        linears_as_computed(model, device.type)
        choice = choose_prompt(model, tokenizer, train, labels, cfg)
        cfg = dataclasses.replace(cfg)
        pin_prompt(cfg, choice.prompt)
        metrics = run_baseline(model, tokenizer, table, labels, train, cfg, out, processes, choice)
    del model
    return metrics


def calibrate(probs: np.ndarray, content_free: np.ndarray) -> np.ndarray:
    """Contextual calibration: divide out the label distribution the model gives content-free inputs."""
    adjusted = probs / content_free[None, :]
    return adjusted / adjusted.sum(axis=1, keepdims=True)


def draw_shots(train: pd.DataFrame, labels: list[str], k: int, seed: int) -> pd.DataFrame:
    """k examples from `train`, as balanced over the labels as k allows, in a seeded random order."""
    if k == 0:
        return train.iloc[:0]
    rng = np.random.default_rng(seed)
    per_label = {label: train[train["label"] == label] for label in labels}
    chosen = []
    for n in range(k):
        label = labels[n % len(labels)]
        pool = per_label[label].drop(index=[c for c in chosen if c in per_label[label].index])
        if pool.empty:
            raise LoraclsError(f"Not enough training examples of label {label!r} for {k} shots")
        chosen.append(pool.index[rng.integers(len(pool))])
    return train.loc[rng.permutation(chosen)]


def run_baseline(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    table: pd.DataFrame,
    labels: list[str],
    train: pd.DataFrame | None,
    cfg: TrainConfig,
    out: Path | None = None,
    processes: PartialState | None = None,
    choice: PromptChoice | None = None,
) -> dict:
    """Score `table` with the prompt baseline; write `baseline_metrics.json` and predictions into `out`.

    Reports the uncalibrated and calibrated figures and, as a bias check, the figures with the label order
    in the prompt reversed (a prompt that does not list the labels is not read twice: its reversed reading is
    the same prompt). The headline (`accuracy`, `macro_f1`, `pred_distribution`) is the calibrated one
    with `cfg.calibrate`, else the uncalibrated one. The prompt follows `cfg`'s prompt keys (`PromptConfig`);
    `cfg.max_length` tokens of each text are kept, `cfg.seed` draws the shots. With `processes` (several),
    each process scores every n-th prompt and all of them get the whole result. `choice`: how the prompt
    was chosen, recorded with the figures.
    """
    started = time.perf_counter()
    prompt = resolve_prompt(labels, list(table["text"]), cfg)
    order = prompt.order
    batch_size = cfg.micro_batch_size or SCORE_BATCH
    if cfg.baseline_shots and (train is None or train.empty):
        raise LoraclsError("shots > 0 needs training examples to draw them from (--train FILE)")
    shots = draw_shots(train if train is not None else table.iloc[:0], labels, cfg.baseline_shots, cfg.seed)
    pairs = list(zip(shots["text"], shots["label"], strict=True))
    prompter = Prompter(tokenizer, prompt, pairs, cfg.max_length, chat=bool(cfg.chat_template))
    tokens = prompter.label_tokens()
    token_lists = [tokens[label] for label in labels]
    texts = list(table["text"])

    index, count = (0, 1) if processes is None else (processes.process_index, processes.num_processes)

    def log_probs(inputs: list[str], label_order: list[str], stage: Stage, at: str) -> np.ndarray:
        stage.update(at=at)
        prompts = prompter.encode(inputs, label_order)
        if count == 1:
            return label_log_probs(model, tokenizer, prompts, token_lists, batch_size, stage.advance)
        # every n-th prompt per process; the shares are put back in order on every process
        mine = np.arange(index, len(prompts), count)
        scores = np.zeros((len(prompts), len(token_lists)))
        mine_prompts = [prompts[i] for i in mine]
        scores[mine] = label_log_probs(model, tokenizer, mine_prompts, token_lists, batch_size, stage.advance)
        return gather_rows(scores, mine)

    listed = prompter.lists_labels(order)
    share = (1 + listed) * len(range(index, len(texts), count)) + len(range(index, len(CONTENT_FREE), count))
    with progress("baseline", share, "prompts") as stage:
        scores = log_probs(texts, order, stage, "the texts")
        content_free = log_probs(list(CONTENT_FREE), order, stage, "calibration (content-free inputs)")
        content_free = softmax(content_free).mean(axis=0)
        swapped = log_probs(texts, order[::-1], stage, "the label order reversed") if listed else scores
    probs = softmax(scores)
    calibrated = calibrate(probs, content_free)
    headline = "calibrated" if cfg.calibrate else "uncalibrated"
    swapped = softmax(swapped)
    results = three_readings(table, labels, probs, calibrated, content_free, swapped, order[::-1], listed)
    metrics = {
        **{key: results[headline][key] for key in ("accuracy", "macro_f1", "pred_distribution")},
        "headline": headline,
        **results,
        "prompt": {
            **prompt.to_json(),
            "verbalizer_tokens": {label: len(ids) for label, ids in tokens.items()},
            "shots": cfg.baseline_shots,
            "example": prompter.render(texts[0]),
            "chat": prompter.chat,
            "choice": choice.to_json() if choice else None,
        },
        "wall_s": round(time.perf_counter() - started, 2),
        "processes": processes.num_processes if processes is not None else 1,
    }
    if out is not None:
        write_baseline(out, table, labels, scores, probs, calibrated, metrics)
    return metrics


def three_readings(
    table: pd.DataFrame,
    labels: list[str],
    probs: np.ndarray,
    calibrated: np.ndarray,
    content_free: np.ndarray,
    swapped: np.ndarray,
    swapped_order: list[str],
    listed: bool = True,
) -> dict:
    """The baseline's figures as scored, as calibrated on the content-free inputs, and with the label order
    reversed (the bias check; `listed` False: the prompt lists no labels, and that reading is the first)."""
    return {
        "uncalibrated": summary(table, probs, labels),
        "calibrated": {
            **summary(table, calibrated, labels),
            "content_free_probs": dict(zip(labels, content_free.tolist(), strict=True)),
        },
        "swapped_order": {**summary(table, swapped, labels), "label_order": swapped_order, "listed": listed},
    }


def write_baseline(
    out: Path,
    table: pd.DataFrame,
    labels: list[str],
    scores: np.ndarray,
    probs: np.ndarray,
    calibrated: np.ndarray,
    metrics: dict,
) -> None:
    """`baseline_predictions.jsonl` (one line per text) and `baseline_metrics.json` in `out`.

    `probabilities` and `predicted` follow the headline (calibrated with `calibrate`); both variants and the
    raw log-probabilities are kept beside them.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    headline = calibrated if metrics["headline"] == "calibrated" else probs
    extra = {"log_probs": scores, "uncalibrated": probs, "calibrated": calibrated}
    write_predictions_jsonl(out / "baseline_predictions.jsonl", table, headline, labels, extra)
    write_json(out / "baseline_metrics.json", metrics)


def baseline_summary(metrics: dict | None) -> dict | None:
    """What `metrics.json` keeps of the baseline (the full figures are in `baseline_metrics.json`)."""
    if metrics is None:
        return None
    return {
        **{key: metrics[key] for key in ("accuracy", "macro_f1", "pred_distribution", "headline")},
        "calibrated_accuracy": metrics["calibrated"]["accuracy"],
        "uncalibrated_accuracy": metrics["uncalibrated"]["accuracy"],
        "swapped_order_accuracy": metrics["swapped_order"]["accuracy"],
        "shots": metrics["prompt"]["shots"],
        "wall_s": metrics["wall_s"],
    }


def baseline_line(metrics: dict) -> str:
    """One line: headline accuracy/F1, the other calibration state, the swapped order, the distribution."""
    other = "uncalibrated" if metrics["headline"] == "calibrated" else "calibrated"
    dist = ", ".join(f"{k} {v}" for k, v in metrics["pred_distribution"].items())
    swapped = metrics["swapped_order"]
    reversed_order = (
        f"label order reversed {swapped['accuracy']:.4f}"
        if swapped.get("listed", True)
        else "the prompt lists no labels (no order to reverse)"
    )
    return (
        f"baseline ({metrics['headline']}, {metrics['prompt']['shots']}-shot): accuracy "
        f"{metrics['accuracy']:.4f}, macro-F1 {metrics['macro_f1']:.4f}; {other} "
        f"{metrics[other]['accuracy']:.4f}; {reversed_order}; predicted: {dist}"
    )


def prompt_and_baseline(
    model_path: str,
    tokenizer: PreTrainedTokenizerBase,
    splits: Splits,
    cfg: TrainConfig,
    run: RunFolder,
    accelerator: Accelerator,
    resume: Path | None,
) -> tuple[dict | None, torch.Tensor | None]:
    """What needs the base model's LM head, with it loaded once: the prompt (chosen on a training sample
    with `prompt: auto`, then pinned in `cfg`, recorded in prompt.json; what else the objective decides
    first, `pin_defaults`: an `objective: lm` run whether it reads prompts in the chat template), the
    prompt baseline
    on the test split, and the LM-head rows a verbaliser-initialised head starts from. `head_init: auto`
    is decided here and pinned: `verbalizer` when the chosen prompt's answers on the training sample agree
    with the labels beyond chance (`PromptChoice.informative`), else `zero` (and `zero` for multi-label).

    Returns (the baseline's metrics or None, the head rows or None). A resumed run has them all already.
    """
    baseline_file = run.file("baseline_metrics.json")
    stored = None
    if resume is not None and baseline_file.is_file():
        stored = json.loads(baseline_file.read_text(encoding="utf-8"))
    kind = objective_kind(cfg.objective)
    kind.pin_defaults(cfg, tokenizer)
    wants_baseline = stored is None and baseline_applies(cfg, accelerator)
    wants_prompt = resume is None and kind.needs_prompt(cfg)
    wants_rows = wants_prompt and kind.trains_head
    if not (wants_baseline or wants_prompt):
        return stored, None
    lm = load_causal_lm(model_path, cfg.trust_remote_code, cfg.allow_pickle).to(accelerator.device)
    with accelerator.autocast():
        linears_as_computed(lm, accelerator.device.type)
        try:
            plan = plan_search(tokenizer, splits.train, splits.labels, cfg)
            console.print(search_line(plan, cfg, wants_baseline), soft_wrap=True)
            note = language_note(list(splits.train["text"]))
            if note and cfg.prompt == "auto" and cfg.prompt_template is None:
                console.print(f"[yellow]prompt: {note}[/]", soft_wrap=True)
            choice = choose_prompt(lm, tokenizer, splits.train, splits.labels, cfg, plan)
        except LoraclsError as e:  # no prompt can read these labels: without a baseline, `auto` does without
            if not (wants_rows and cfg.head_init == "auto") or wants_baseline:
                raise
            cfg.head_init = "zero"
            console.print(f"head_init auto: zero ({e})", soft_wrap=True)
            return stored, None
        pin_prompt(cfg, choice.prompt)
        if wants_rows and cfg.head_init == "auto":
            apart = part_on_first_token(answer_tokens(tokenizer, choice.prompt, splits.labels)[1])
            cfg.head_init = "verbalizer" if apart and choice.informative() else "zero"
            why = choice.informative_line() if apart else AUTO_NEEDS_APART
            console.print(f"head_init auto: {cfg.head_init} ({why})", soft_wrap=True)
        run.write_json("prompt.json", {**choice.prompt.to_json(), "choice": choice.to_json()})
        console.print(prompt_table(choice.prompt, choice.candidates, choice.sample, choice.first))
        baseline = stored
        if wants_baseline:  # every process scores a share of the test prompts
            out = run.path if run.main else None
            baseline = run_baseline(
                lm, tokenizer, splits.test, splits.labels, splits.train, cfg, out, accelerator.state, choice
            )
            console.print(baseline_line(baseline), soft_wrap=True)
        rows = None
        if wants_rows and cfg.prompted:  # the LM head's rows of each label's word after the prompt
            prompter = input_prompter(tokenizer, cfg, splits.labels)  # refuses words a head cannot read
            following = answer_tokens(tokenizer, prompter.prompt, splits.labels)[1]
            rows = label_rows(lm.get_output_embeddings().weight, following)
    del lm
    return baseline, rows


AUTO_NEEDS_APART = (
    "two labels' words begin with the same token; --head-init verbalizer starts those from the mean of their "
    "tokens' rows, which auto does not choose until measured to help"
)
"""Why `head_init: auto` takes a zero head for labels whose words begin alike (`card arrival`, `card
linking`): their mean-of-rows start (`objective.label_rows`) is not yet measured against a zero head."""


def baseline_applies(cfg: TrainConfig, accelerator: Accelerator) -> bool:
    """Whether the run scores the prompt baseline: asked for, single-label, and not under FSDP."""
    if not cfg.baseline:
        return False
    if cfg.multi_label:
        console.print("[dim]baseline: the prompt baseline scores single-label tasks only; skipped[/]")
        return False
    if accelerator.is_fsdp2:
        console.print(
            "[dim]baseline: skipped under FSDP (it loads the whole model on one device); run "
            "`loracls baseline` on a device it fits[/]"
        )
        return False
    return True
