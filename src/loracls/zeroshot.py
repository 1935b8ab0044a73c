"""The prompt baseline: the base model's causal-LM head scores each label's verbaliser after a prompt.

No generation and no regex: for every prompt, the log-probability of each label's words (summed over their
tokens) is read from the logits, computed only at the positions that predict those tokens.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import gather_object
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from loracls.config import PromptConfig, TrainConfig
from loracls.data import (
    BUILTIN_DATASETS,
    Splits,
    load_splits,
    read_labelled,
    sort_labels,
    stratified_sample,
)
from loracls.errors import LoraclsError
from loracls.evaluate import score, write_predictions_jsonl
from loracls.model import LANGUAGE_MODEL_KEYS, check_remote_code, check_weight_files
from loracls.runs import write_json
from loracls.sizing import CPU_MICRO_BATCH, inference_autocast, inference_device

CONTENT_FREE = ("N/A", "", "[MASK]")
"""Inputs that carry no content: the model's answer to them is its bias (Zhao et al., 2021)."""


@dataclass
class Template:
    """A prompt: the instruction, each shot as `example` + `separator` + verbaliser, then the query."""

    instruction: str
    example: str
    separator: str

    def render(self, text: str, options: list[str], shots: list[tuple[str, str]]) -> str:
        parts = [self.instruction.format(options=", ".join(options))] if self.instruction else []
        parts += [self.example.format(text=t) + self.separator + word for t, word in shots]
        parts.append(self.example.format(text=text))
        return "\n\n".join(parts)


TEMPLATES = {
    "en": Template(
        "Classify the text. Answer with one of: {options}.", "Text: {text}\nAnswer:", separator=" "
    ),
    "zh": Template("判断下面文本的类别，只回答其中之一：{options}。", "文本：{text}\n回答：", separator=""),
}
ZH_WORDS = {"positive": "正面", "negative": "负面", "neutral": "中性"}


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
    `autocast` (default: the precision `auto` picks there); the LM is freed afterwards.

    With `processes` (several), each scores its share of the prompts and all get the whole result.
    """
    device = device or inference_device()
    model = load_causal_lm(model_path, cfg.trust_remote_code, cfg.allow_pickle).to(device)
    with autocast or inference_autocast(device):
        metrics = run_baseline(model, tokenizer, table, labels, train, cfg, out, processes)
    del model
    return metrics


def baseline_for_run(
    model_path: str,
    tokenizer: PreTrainedTokenizerBase,
    splits: Splits,
    cfg: TrainConfig,
    out: Path | None,
    accelerator: Accelerator,
) -> dict:
    """The baseline a training run reports next to its test metrics, on the run's device and precision.

    Every process calls it and scores a share of the test prompts: a rank that only waited for the main
    one's whole baseline would hit the collective timeout (10 minutes by default) on a large test split.
    """
    return baseline_on_device(
        model_path,
        cfg,
        tokenizer,
        splits.test,
        splits.labels,
        splits.train,
        out,
        accelerator.device,
        accelerator.autocast(),
        accelerator.state,
    )


def detect_language(texts: list[str]) -> str:
    """`zh` when CJK characters make up over a fifth of the letters of a sample of texts, else `en`."""
    sample = "".join(texts[:200])
    letters = [c for c in sample if c.isalpha()]
    cjk = sum(1 for c in letters if "\u4e00" <= c <= "\u9fff")
    return "zh" if letters and cjk / len(letters) > 0.2 else "en"


def parse_verbalizers(spec: str | None, labels: list[str]) -> dict[str, str] | None:
    """`positive=good,negative=bad` -> {label: word}; every label needs one."""
    if not spec:
        return None
    pairs = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    missing = [label for label in labels if label not in pairs]
    if missing or not pairs:
        raise LoraclsError(
            f"verbalizers {spec!r} must give a word for every label as label=word,...; missing: {missing}"
        )
    return {label: pairs[label] for label in labels}


def resolve_prompt(labels: list[str], texts: list[str], prompt: PromptConfig) -> tuple[Template, dict, list]:
    """The template, {label: verbaliser} and the label order listed in the prompt, defaults filled in from
    the texts' language."""
    language = detect_language(texts)
    template = TEMPLATES[language]
    if prompt.prompt_template is not None:
        if "{text}" not in prompt.prompt_template:
            raise LoraclsError(f"prompt template {prompt.prompt_template!r} has no {{text}} placeholder")
        template = Template(template.instruction, prompt.prompt_template, template.separator)
    if prompt.prompt_instruction is not None:
        template = Template(prompt.prompt_instruction, template.example, template.separator)
    words = parse_verbalizers(prompt.verbalizers, labels) or {
        label: ZH_WORDS.get(label, label) if language == "zh" else label for label in labels
    }
    order = [x.strip() for x in prompt.label_order.split(",")] if prompt.label_order else labels
    if sorted(order) != sorted(labels):
        raise LoraclsError(f"label_order {order} must list each of the labels {labels} once")
    return template, words, order


def verbalizer_tokens(
    tokenizer: PreTrainedTokenizerBase, template: Template, words: dict[str, str]
) -> dict[str, list[int]]:
    """Each label's verbaliser as the tokens that follow the prompt (tokenised in context, not alone).

    "positive" after "Answer: " is not the same tokens as "positive" at the start of a string; the tokens
    are taken as the difference between the prompt's end with and without the verbaliser.
    """
    tail = template.example.format(text="x")
    base = tokenizer(tail, add_special_tokens=False)["input_ids"]
    tokens = {}
    for label, word in words.items():
        full = tokenizer(tail + template.separator + word, add_special_tokens=False)["input_ids"]
        if full[: len(base)] != base or len(full) == len(base):
            full = base + tokenizer(template.separator + word, add_special_tokens=False)["input_ids"]
        tokens[label] = full[len(base) :]
        if not tokens[label]:
            raise LoraclsError(f"verbaliser {word!r} of label {label!r} is empty after tokenisation")
    seen: dict[tuple[int, ...], str] = {}
    for label, ids in tokens.items():
        if tuple(ids) in seen:
            raise LoraclsError(f"labels {seen[tuple(ids)]!r} and {label!r} have the same verbaliser tokens")
        seen[tuple(ids)] = label
    return tokens


def load_causal_lm(path: str, trust_remote_code: bool = False, allow_pickle: bool = False) -> PreTrainedModel:
    """The language model with its LM head; of a multimodal checkpoint only the text part is loaded."""
    check_remote_code(path, trust_remote_code)
    check_weight_files(path, allow_pickle)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    text = config.get_text_config()
    if text is not config and type(text) in MODEL_FOR_CAUSAL_LM_MAPPING:
        cls, key_mapping = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)], LANGUAGE_MODEL_KEYS
        config = text
    else:
        cls, key_mapping = AutoModelForCausalLM, None
    return cls.from_pretrained(
        path,
        config=config,
        dtype=torch.float32,
        key_mapping=key_mapping,
        trust_remote_code=trust_remote_code,
        use_safetensors=None if allow_pickle else True,
    ).eval()


@torch.inference_mode()
def label_log_probs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    tokens: list[list[int]],
    batch_size: int = 16,
) -> np.ndarray:
    """log P(verbaliser k | prompt i), summed over the verbaliser's tokens: shape (prompts, labels).

    A verbaliser of n tokens is read from the sequence prompt + its first n - 1 tokens; a causal model gives
    the same logits for the prompt's positions in any sequence that starts with it, so shorter verbalisers
    ride along and a prompt costs one forward pass unless two multi-token verbalisers start differently.
    Sequences run longest-first in right-padded batches, and the LM head is applied only at the positions
    that predict a verbaliser token (`logits_to_keep`).
    """
    jobs: dict[tuple[int, ...], list[tuple[int, int, list[int]]]] = {}
    longest_first = sorted(range(len(tokens)), key=lambda k: -len(tokens[k]))
    for i, prompt in enumerate(prompts):
        hosts: list[tuple[int, ...]] = []
        for k in longest_first:
            wanted = tuple(prompt + tokens[k][:-1])
            host = next((h for h in hosts if h[: len(wanted)] == wanted), None)
            if host is None:
                host = wanted
                hosts.append(host)
            jobs.setdefault(host, []).append((i, k, len(prompt) - 1))
    sequences = sorted(jobs, key=len, reverse=True)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    scores = np.zeros((len(prompts), len(tokens)), dtype=np.float64)
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size]
        width = len(batch[0])
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        needed: list[list[tuple[int, int, int, int]]] = []  # (prompt, label, position, target token)
        for row, seq in enumerate(batch):
            input_ids[row, : len(seq)] = torch.tensor(seq)
            attention_mask[row, : len(seq)] = 1
            needed.append(
                [(i, k, first + j, token) for i, k, first in jobs[seq] for j, token in enumerate(tokens[k])]
            )
        positions = sorted({p for row in needed for _, _, p, _ in row})
        logits = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            logits_to_keep=torch.tensor(positions, device=device),
        ).logits
        log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
        column = {p: c for c, p in enumerate(positions)}
        for row, items in enumerate(needed):
            for i, k, position, token in items:
                scores[i, k] += float(log_probs[row, column[position], token])
    return scores


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


@dataclass
class Prompter:
    """Turns texts into prompt token ids, with the shots and the label order fixed."""

    tokenizer: PreTrainedTokenizerBase
    template: Template
    words: dict[str, str]
    shots: list[tuple[str, str]]
    """(text, label) pairs shown before the query."""
    max_length: int

    def prompt(self, text: str, order: list[str]) -> str:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_length:  # cut the text, never the prompt around it
            text = self.tokenizer.decode(ids[: self.max_length])
        examples = [(t, self.words[label]) for t, label in self.shots]
        return self.template.render(text, [self.words[x] for x in order], examples)

    def encode(self, texts: list[str], order: list[str]) -> list[list[int]]:
        return [self.tokenizer(self.prompt(text, order))["input_ids"] for text in texts]


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
) -> dict:
    """Score `table` with the prompt baseline; write `baseline_metrics.json` and predictions into `out`.

    Reports the uncalibrated and calibrated figures and, as a bias check, the figures with the label order
    in the prompt reversed. The headline (`accuracy`, `macro_f1`, `pred_distribution`) is the calibrated one
    with `cfg.calibrate`, else the uncalibrated one. The prompt follows `cfg`'s prompt keys (`PromptConfig`);
    `cfg.max_length` tokens of each text are kept, `cfg.seed` draws the shots. With `processes` (several),
    each process scores every n-th prompt and all of them get the whole result.
    """
    started = time.perf_counter()
    template, words, order = resolve_prompt(labels, list(table["text"]), cfg)
    batch_size = cfg.micro_batch_size or CPU_MICRO_BATCH
    if cfg.baseline_shots and (train is None or train.empty):
        raise LoraclsError("shots > 0 needs training examples to draw them from (--train FILE)")
    shots = draw_shots(train if train is not None else table.iloc[:0], labels, cfg.baseline_shots, cfg.seed)
    tokens = verbalizer_tokens(tokenizer, template, words)
    token_lists = [tokens[label] for label in labels]
    prompter = Prompter(
        tokenizer, template, words, list(zip(shots["text"], shots["label"], strict=True)), cfg.max_length
    )
    texts = list(table["text"])

    def log_probs(inputs: list[str], label_order: list[str]) -> np.ndarray:
        prompts = prompter.encode(inputs, label_order)
        if processes is None or processes.num_processes == 1:
            return label_log_probs(model, tokenizer, prompts, token_lists, batch_size)
        # every n-th prompt per process; the shares are put back in order on every process
        n, rank = processes.num_processes, processes.process_index
        mine = label_log_probs(model, tokenizer, prompts[rank::n], token_lists, batch_size)
        scores = np.zeros((len(prompts), len(token_lists)))
        for r, share in enumerate(gather_object([mine])):
            scores[r::n] = share
        return scores

    scores = log_probs(texts, order)
    content_free = softmax(log_probs(list(CONTENT_FREE), order)).mean(axis=0)
    swapped = log_probs(texts, order[::-1])
    probs = softmax(scores)
    calibrated = calibrate(probs, content_free)
    headline = "calibrated" if cfg.calibrate else "uncalibrated"
    results = {
        "uncalibrated": summary(table, probs, labels),
        "calibrated": {
            **summary(table, calibrated, labels),
            "content_free_probs": dict(zip(labels, content_free.tolist(), strict=True)),
        },
        "swapped_order": {**summary(table, softmax(swapped), labels), "label_order": order[::-1]},
    }
    metrics = {
        **{key: results[headline][key] for key in ("accuracy", "macro_f1", "pred_distribution")},
        "headline": headline,
        **results,
        "prompt": {
            "template": asdict(template),
            "verbalizers": words,
            "verbalizer_tokens": {label: len(ids) for label, ids in tokens.items()},
            "label_order": order,
            "shots": cfg.baseline_shots,
            "example": prompter.prompt(texts[0], order),
        },
        "wall_s": round(time.perf_counter() - started, 2),
        "processes": processes.num_processes if processes is not None else 1,
    }
    if out is not None:
        write_baseline(out, table, labels, scores, probs, calibrated, metrics)
    return metrics


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
