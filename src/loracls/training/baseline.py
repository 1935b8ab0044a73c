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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from accelerate import Accelerator, PartialState
from sklearn.metrics import cohen_kappa_score
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loracls.config import PromptConfig, TrainConfig
from loracls.console import Stage, console, progress
from loracls.data.labels import label_ids, sort_labels
from loracls.data.prompts import (
    Prompt,
    Prompter,
    answer_tokens,
    format_verbalizers,
    language_note,
    part_on_first_token,
    pin_prompt,
    resolve_prompt,
)
from loracls.data.splits import Splits, load_splits, stratified_sample
from loracls.data.tables import BUILTIN_DATASETS, read_labelled
from loracls.environment.devices import inference_autocast, inference_device
from loracls.environment.micro_batch import CPU_MICRO_BATCH
from loracls.errors import LoraclsError
from loracls.model import load_causal_lm
from loracls.objective import input_prompter, label_log_probs, label_rows, objective_kind
from loracls.training.evaluate import gather_rows, score, write_predictions_jsonl
from loracls.training.prompt_search import SearchPlan, eta_line, plan_search, prompt_table, search_line
from loracls.training.runs import RunFolder, write_json

PROMPT_KAPPA = 0.1
"""The agreement beyond chance (Cohen's kappa) of a prompt's zero-shot answers with the training sample's
labels above which `head_init: auto` starts the head from it. Measured: zh-reviews and en-tweets prompts of
Gemma 3 270M score about 0.15-0.3 and their heads learn faster than zero ones (benchmarks/README.md)."""

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
        choice = choose_prompt(model, tokenizer, train, labels, cfg)
        cfg = dataclasses.replace(cfg)
        pin_prompt(cfg, choice.prompt)
        metrics = run_baseline(model, tokenizer, table, labels, train, cfg, out, processes, choice)
    del model
    return metrics


@dataclass
class PromptChoice:
    """The prompt chosen on a sample of training examples, and every candidate's score there."""

    prompt: Prompt
    candidates: list[dict]
    """Per candidate: template name, verbalisers, accuracy, macro-F1 and predicted distribution on the
    sample (or why it was skipped); empty when there was nothing to choose."""
    sample: int
    """Training examples scored (0: no training examples)."""
    majority: float = 0.0
    """The most frequent label's share of the sample: what answering one label for every text scores."""

    def chosen(self) -> dict:
        """The chosen prompt's row of `candidates`."""
        key = (self.prompt.name, format_verbalizers(self.prompt.words))
        return next(r for r in self.candidates if (r["template"], r["verbalizers"]) == key)

    def informative(self) -> bool:
        """Whether the prompt knows something of the task: its zero-shot answers on the training sample agree
        with the labels beyond chance (Cohen's kappa at least `PROMPT_KAPPA`; 0 is what answers unrelated to
        the text score, whatever the label mix). A head started from a prompt that knows nothing starts
        confidently wrong: the label words' logits differ by several units on every text. A kappa whose 90%
        interval reaches 0 (`sureness`) is noise, however high: 0.125 from 32 examples once chose a head that
        knew nothing."""
        if not self.sample:
            return False
        row = self.chosen()
        return row["kappa"] >= PROMPT_KAPPA and kappa_interval(row)[0] > 0

    def informative_line(self) -> str:
        if not self.sample:
            return "no training examples to score the prompt on"
        row = self.chosen()
        return (
            f"the prompt's zero-shot answers on {self.sample} training examples: accuracy "
            f"{row['accuracy']:.3f} (majority label {self.majority:.3f}), Cohen's kappa {row['kappa']:.3f}"
            f"{sureness(row, self.sample)}; {PROMPT_KAPPA} needed, its interval above 0"
        )

    def to_json(self) -> dict:
        return {
            "chosen": self.prompt.name,
            "verbalizers": self.prompt.words,
            "sample": self.sample,
            "majority": self.majority,
            "candidates": self.candidates,
        }


def kappa_standard_error(gold: np.ndarray, predicted: np.ndarray, classes: int) -> float:
    """The large-sample standard error of Cohen's kappa, sqrt(p_o (1 - p_o) / (n (1 - p_e)^2)) (Cohen 1960):
    how far another sample of as many texts could move it."""
    observed = float((gold == predicted).mean())
    chance = float(sum(np.mean(gold == c) * np.mean(predicted == c) for c in range(classes)))
    if chance >= 1.0:
        return 0.0
    return float(np.sqrt(observed * (1 - observed) / (len(gold) * (1 - chance) ** 2)))


def kappa_interval(row: dict) -> tuple[float, float]:
    """A candidate's kappa's 90% interval (the kappa at both ends where no standard error is stored)."""
    spread = 1.645 * row.get("kappa_se", 0.0)
    return row["kappa"] - spread, row["kappa"] + spread


def sureness(row: dict, sample: int) -> str:
    """How sure a candidate's kappa is, in words: its 90% interval from the sample (none where not stored)."""
    if "kappa_se" not in row:
        return ""
    low, high = kappa_interval(row)
    noise = "; within noise of chance" if low <= 0 else ""
    return f" (90% interval {low:.2f} to {high:.2f} from {sample} examples{noise})"


def choose_prompt(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train: pd.DataFrame | None,
    labels: list[str],
    cfg: PromptConfig,
    plan: SearchPlan | None = None,
) -> PromptChoice:
    """The candidate prompt (`plan_search`) whose uncalibrated zero-shot answers score the best macro-F1 on a
    stratified sample of `cfg.prompt_sample` training examples (fewer over `cfg.prompt_budget`; ties: the
    higher mean log-probability of the right label, then the earlier candidate). Never sees validation or
    test labels. Shows its progress, and once the first candidate is scored how long the rest will take.

    Uncalibrated, because that is what a verbaliser-initialised head answers at step 0; macro-F1, because a
    prompt that gives every text one label (listing the options, a small model copies the first) scores low
    on it.
    """
    plan = plan or plan_search(tokenizer, train, labels, cfg)
    candidates, rows = plan.candidates, [dict(row) for row in plan.rows]
    if train is None or train.empty:
        return PromptChoice(candidates[0], [], 0)
    sample = stratified_sample(train, plan.sample, cfg.seed)
    label2id = label_ids(labels)
    gold = np.array([label2id[x] for x in sample["label"]])
    chat = bool(cfg.chat_template)
    scored: list[tuple[tuple[float, float], int]] = []  # (macro-F1, gold log-prob), candidate
    total = sum(plan.passes) * len(sample)
    with progress("prompt search", total, "prompts") as stage:
        for g, group in enumerate(plan.groups):
            first, last = group[0][0] + 1, group[-1][0] + 1
            which = f"candidate {first}" if first == last else f"candidates {first}-{last}"
            stage.update(at=f"{which} of {len(candidates)}")
            # candidates whose prompts are the same text are scored in one pass: every word set's tokens are
            # read from the same forward passes
            prompts = Prompter(tokenizer, candidates[first - 1], [], cfg.max_length, chat=chat).encode(
                list(sample["text"])
            )
            columns = [tokens[label] for _, tokens in group for label in labels]
            every = label_log_probs(model, tokenizer, prompts, columns, advance=stage.advance)
            for k, (n, _) in enumerate(group):
                probs = softmax(every[:, k * len(labels) : (k + 1) * len(labels)])
                gold_log_prob = float(np.log(probs[np.arange(len(gold)), gold]).mean())
                kappa = cohen_kappa_score(gold, probs.argmax(1), labels=list(range(len(labels))))
                rows[n] |= {
                    **summary(sample, probs, labels),
                    "kappa": round(float(np.nan_to_num(kappa)), 4),
                    "kappa_se": round(kappa_standard_error(gold, probs.argmax(1), len(labels)), 4),
                    "gold_log_prob": round(gold_log_prob, 4),
                }
                scored.append(((rows[n]["macro_f1"], gold_log_prob), n))
            if g == 0 and len(plan.groups) > 1:
                eta_line(stage, which)
    if not scored:
        reasons = sorted({r["skipped"] for r in rows})
        raise LoraclsError(
            f"No candidate prompt can score the labels {labels}: {'; '.join(reasons)}. Give label words that "
            "differ from the first token on with --verbalizers label=word,..."
        )
    best = candidates[max(sorted(scored, key=lambda item: item[1]), key=lambda item: item[0])[1]]
    majority = float(sample["label"].value_counts(normalize=True).max())
    return PromptChoice(best, rows, len(sample), majority)


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


def softmax(scores: np.ndarray) -> np.ndarray:
    """Probabilities over the labels from their log-probabilities (renormalised among the labels)."""
    z = np.exp(scores - scores.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def summary(table: pd.DataFrame, probs: np.ndarray, labels: list[str]) -> dict:
    metrics = score(table, probs, labels)
    return {key: metrics[key] for key in ("accuracy", "macro_f1", "weighted_f1", "pred_distribution", "n")}


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
    in the prompt reversed. The headline (`accuracy`, `macro_f1`, `pred_distribution`) is the calibrated one
    with `cfg.calibrate`, else the uncalibrated one. The prompt follows `cfg`'s prompt keys (`PromptConfig`);
    `cfg.max_length` tokens of each text are kept, `cfg.seed` draws the shots. With `processes` (several),
    each process scores every n-th prompt and all of them get the whole result. `choice`: how the prompt
    was chosen, recorded with the figures.
    """
    started = time.perf_counter()
    prompt = resolve_prompt(labels, list(table["text"]), cfg)
    order = prompt.order
    batch_size = cfg.micro_batch_size or CPU_MICRO_BATCH
    if cfg.baseline_shots and (train is None or train.empty):
        raise LoraclsError("shots > 0 needs training examples to draw them from (--train FILE)")
    shots = draw_shots(train if train is not None else table.iloc[:0], labels, cfg.baseline_shots, cfg.seed)
    pairs = list(zip(shots["text"], shots["label"], strict=True))
    prompter = Prompter(tokenizer, prompt, pairs, cfg.max_length, chat=bool(cfg.chat_template))
    tokens = prompter.label_tokens()
    token_lists = [tokens[label] for label in labels]
    texts = list(table["text"])

    index, count = (0, 1) if processes is None else (processes.process_index, processes.num_processes)

    def log_probs(inputs: list[str], label_order: list[str], stage: Stage) -> np.ndarray:
        prompts = prompter.encode(inputs, label_order)
        if count == 1:
            return label_log_probs(model, tokenizer, prompts, token_lists, batch_size, stage.advance)
        # every n-th prompt per process; the shares are put back in order on every process
        mine = np.arange(index, len(prompts), count)
        scores = np.zeros((len(prompts), len(token_lists)))
        mine_prompts = [prompts[i] for i in mine]
        scores[mine] = label_log_probs(model, tokenizer, mine_prompts, token_lists, batch_size, stage.advance)
        return gather_rows(scores, mine)

    share = 2 * len(range(index, len(texts), count)) + len(range(index, len(CONTENT_FREE), count))
    with progress("baseline", share, "prompts") as stage:
        stage.update(at="the texts")
        scores = log_probs(texts, order, stage)
        stage.update(at="calibration (content-free inputs)")
        content_free = softmax(log_probs(list(CONTENT_FREE), order, stage)).mean(axis=0)
        stage.update(at="the label order reversed")
        swapped = log_probs(texts, order[::-1], stage)
    probs = softmax(scores)
    calibrated = calibrate(probs, content_free)
    headline = "calibrated" if cfg.calibrate else "uncalibrated"
    results = three_readings(table, labels, probs, calibrated, content_free, softmax(swapped), order[::-1])
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
) -> dict:
    """The baseline's figures as scored, as calibrated on the content-free inputs, and with the label order
    reversed (the bias check)."""
    return {
        "uncalibrated": summary(table, probs, labels),
        "calibrated": {
            **summary(table, calibrated, labels),
            "content_free_probs": dict(zip(labels, content_free.tolist(), strict=True)),
        },
        "swapped_order": {**summary(table, swapped, labels), "label_order": swapped_order},
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
    return (
        f"baseline ({metrics['headline']}, {metrics['prompt']['shots']}-shot): accuracy "
        f"{metrics['accuracy']:.4f}, macro-F1 {metrics['macro_f1']:.4f}; {other} "
        f"{metrics[other]['accuracy']:.4f}; label order reversed {metrics['swapped_order']['accuracy']:.4f}; "
        f"predicted: {dist}"
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
        console.print(prompt_table(choice.prompt, choice.candidates, choice.sample))
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
