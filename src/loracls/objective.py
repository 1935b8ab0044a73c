"""What a training objective is to the rest of loracls: how a batch becomes a loss, and how a batch becomes
class probabilities.

`fit()`, validation, the final test, `eval`, `predict` and `export` call only `loss`, `probs` and
`classes`: the classification head (`ClassificationHead`) and instruction tuning (`LanguageModel`: the
causal-LM loss on the response, classes read from the label words' log-probabilities) are two classes with
these methods, not two loops. What else differs between them is asked of the class that `objective_kind`
names for a config's `objective`: how the base model loads, how a text is read (`prompter`), what LoRA
trains, what the training set holds, how an export is checked and reloaded, what is refused. As peft's tuners
sit behind one interface, nothing else asks which objective it holds; a third objective is a third class
here and an entry in `OBJECTIVES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import pandas as pd
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from loracls.config import TrainConfig
from loracls.data.prompts import Prompt, Prompter, answer_tokens, part_on_first_token, resolve_prompt
from loracls.data.tokenization import tokenize_responses
from loracls.errors import LoraclsError
from loracls.model import from_pretrained, load_causal_lm, load_classifier


class Objective(Protocol):
    generates: ClassVar[bool]
    """The model can say more than the class (`predict --generate`, serve's `generate`)."""

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar training loss of a padded batch with `labels`."""

    def probs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Class probabilities of a padded batch, shape (examples, classes), float32."""

    def classes(self, model: torch.nn.Module) -> int:
        """How many classes `probs` scores."""


@dataclass
class ClassificationHead:
    """A sequence-classification model's head: cross-entropy on its logits (binary cross-entropy per label
    for multi-label), softmax probabilities (a sigmoid per label)."""

    multi_label: bool = False
    loss_fn: torch.nn.Module | None = None
    """The training loss (`for_training`); None for inference only."""

    name: ClassVar[str] = "head"
    trains_head: ClassVar[bool] = True
    """LoRA wraps a sequence classifier whose new head is trained and saved with it (`modules_to_save`)."""
    architecture: ClassVar[tuple[str, str]] = ("ForSequenceClassification", "sequence classifier")
    """How an export's `config.json` names the class (its suffix), in words."""
    exported: ClassVar[str] = "merged classifier (checked: config, head, tokenizer, reloaded probabilities)"
    """What `loracls export` says it wrote."""
    generates: ClassVar[bool] = False
    """The model can say more than the class (`predict --generate`, serve's `generate`)."""

    @staticmethod
    def load(path: str, labels: list[str], **options) -> PreTrainedModel:
        """The base model LoRA wraps: a classifier with a new head (`load_classifier` and its `options`:
        trust_remote_code, head_init, allow_pickle, multi_label, quantize, attention, mixed_precision,
        head_rows)."""
        return load_classifier(path, labels, **options)

    @staticmethod
    def load_export(path: str) -> PreTrainedModel:
        """A merged export, as loracls and its users load it: `AutoModelForSequenceClassification` with
        loracls's classes registered (`model.from_pretrained`)."""
        return from_pretrained(path, dtype=torch.float32)

    @staticmethod
    def load_as_users_do(path: str) -> PreTrainedModel:
        """A merged export the way a plain-transformers user loads it (what `check_reload` compares): as
        loracls does."""
        return ClassificationHead.load_export(path).eval()

    @staticmethod
    def prompter(tokenizer: PreTrainedTokenizerBase, cfg: TrainConfig, labels: list[str]) -> Prompter | None:
        """A verbaliser-initialised head reads each text inside the prompt, followed by the start its
        labels' words share (the head's rows read the token after it); any other head reads the text."""
        if cfg.head_init != "verbalizer":
            return None
        prompt = pinned_prompt(cfg, labels)
        return Prompter(tokenizer, prompt, [], cfg.max_length, answer_tokens(tokenizer, prompt, labels)[0])

    @staticmethod
    def pin_defaults(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        """What is decided before the prompt: a multi-label run starts its head at zero (`head_init: auto`
        reads one label word per text)."""
        if cfg.head_init == "auto" and cfg.multi_label:
            cfg.head_init = "zero"

    @staticmethod
    def needs_prompt(cfg: TrainConfig) -> bool:
        """The head starts from the prompt's label words (`verbalizer`, or `auto` deciding whether to)."""
        return cfg.head_init in ("verbalizer", "auto")

    @staticmethod
    def why_prompt(cfg: TrainConfig) -> str | None:
        if cfg.head_init in ("auto", "verbalizer"):
            return f"the head's start (head_init: {cfg.head_init}; --head-init zero: raw text, no prompt)"
        return None

    @staticmethod
    def training_set(tokenized: Dataset, table: pd.DataFrame, prompter: Prompter | None, label2id) -> Dataset:
        """What `fit()` trains on: the texts as the model reads them, with their labels."""
        return tokenized

    @staticmethod
    def label_tokens(prompter: Prompter | None) -> None:
        """What an export records of the label words' tokens: nothing (the head scores the classes)."""
        return None

    @classmethod
    def for_inference(
        cls, model: torch.nn.Module, prompter: Prompter | None, labels: list[str]
    ) -> ClassificationHead:
        return cls.for_model(model)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> ClassificationHead:
        """The objective a saved classifier was trained with, read from its config (`problem_type`)."""
        return cls(multi_label=model.config.problem_type == "multi_label_classification")

    @classmethod
    def for_training(
        cls,
        cfg: TrainConfig,
        train_set: Dataset,
        prompter: Prompter | None,
        labels: list[str],
        accelerator: Accelerator,
    ) -> ClassificationHead:
        """The loss of `cfg`, weighted against class imbalance with `class_weights`: inverse class frequency
        (single-label), or negatives/positives per label (multi-label)."""
        return cls.weighted(cfg, train_set, len(labels), accelerator.device)

    @classmethod
    def weighted(
        cls, cfg: TrainConfig, train_set: Dataset, num_labels: int, device: torch.device
    ) -> ClassificationHead:
        """`for_training`'s loss on `device`."""
        targets = torch.tensor(train_set["labels"])
        if cfg.multi_label:
            positives = targets.sum(dim=0)
            weight = (len(targets) - positives).clamp(min=1) / positives.clamp(min=1)
            loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=weight if cfg.class_weights else None)
        else:
            weight = class_weights(train_set["labels"], num_labels)
            loss_fn = torch.nn.CrossEntropyLoss(weight=weight if cfg.class_weights else None)
        return cls(cfg.multi_label, loss_fn.to(device))

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return self.loss_fn(model(**inputs).logits.float(), batch["labels"])

    def probs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(**batch).logits.float()
        return torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, -1)

    def classes(self, model: torch.nn.Module) -> int:
        return model.config.num_labels


def class_weights(targets: list[int], num_labels: int) -> torch.Tensor:
    """Inverse class frequency, normalised so that balanced data weighs every class 1."""
    counts = torch.bincount(torch.tensor(targets), minlength=num_labels).float()
    return counts.sum() / (num_labels * counts.clamp(min=1))


@dataclass
class LanguageModel:
    """Instruction tuning of a causal LM: the loss is the cross-entropy of the response tokens after the
    prompt (the prompt's own tokens are not predicted), with the LM head applied only at the positions
    that predict them; a class's probability is its label words' log-probability after the prompt,
    renormalised over the labels (the baseline's exact scorer, `label_log_probs`)."""

    tokenizer: PreTrainedTokenizerBase
    tokens: list[list[int]]
    """Each label's words as tokens after the prompt, in label order."""
    weight: torch.Tensor | None = None
    """Per class, the weight of its examples' response tokens in the loss (`class_weights`); None: equal."""

    name: ClassVar[str] = "lm"
    trains_head: ClassVar[bool] = False
    """LoRA alone is trained: the causal LM's own head stays frozen."""
    architecture: ClassVar[tuple[str, str]] = ("ForCausalLM", "causal LM")
    exported: ClassVar[str] = (
        "merged causal LM (checked: config, tokenizer, reloaded probabilities; loads with "
        "AutoModelForCausalLM)"
    )
    generates: ClassVar[bool] = True

    @staticmethod
    def load(
        path: str,
        labels: list[str],
        trust_remote_code: bool = False,
        allow_pickle: bool = False,
        attention: str | None = None,
        **head_options,
    ) -> PreTrainedModel:
        """The base model LoRA wraps: the causal LM with its LM head (`load_causal_lm`). `head_options`
        shape a classifier's head (head_init, head_rows, multi_label...): not a causal LM's business
        (config refuses `quantize` and multi-label for it)."""
        return load_causal_lm(path, trust_remote_code, allow_pickle, attention)

    @staticmethod
    def load_export(path: str) -> PreTrainedModel:
        """A merged export as loracls loads it: `load_causal_lm` (no pickles, no remote code)."""
        return load_causal_lm(path)

    @staticmethod
    def load_as_users_do(path: str) -> PreTrainedModel:
        """A merged export the way a plain-transformers user loads it: `AutoModelForCausalLM`."""
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @staticmethod
    def prompter(tokenizer: PreTrainedTokenizerBase, cfg: TrainConfig, labels: list[str]) -> Prompter:
        """Every text is read inside the prompt (in the chat template if the run used it); the label words
        follow it as they are, scored token by token."""
        prompt = pinned_prompt(cfg, labels)
        return Prompter(tokenizer, prompt, [], cfg.max_length, chat=bool(cfg.chat_template))

    @staticmethod
    def pin_defaults(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        """What is decided before the prompt: prompts go in the chat template when the tokenizer has one."""
        if cfg.chat_template is None:
            cfg.chat_template = tokenizer.chat_template is not None

    @staticmethod
    def needs_prompt(cfg: TrainConfig) -> bool:
        return True

    @staticmethod
    def why_prompt(cfg: TrainConfig) -> str | None:
        return "objective: lm, which reads every text inside the prompt"

    @staticmethod
    def training_set(tokenized: Dataset, table: pd.DataFrame, prompter: Prompter, label2id) -> Dataset:
        """What `fit()` trains on: each prompt followed by its label's words and response
        (`tokenize_responses`); validation and the test score the prompt alone (`tokenized`)."""
        return tokenize_responses(table, prompter, label2id)

    @staticmethod
    def label_tokens(prompter: Prompter) -> dict[str, list[int]]:
        """What an export records of the label words: each label's tokens after the prompt."""
        return prompter.label_tokens()

    @classmethod
    def for_inference(cls, model: torch.nn.Module, prompter: Prompter, labels: list[str]) -> LanguageModel:
        return cls.reading(prompter, labels)

    @classmethod
    def reading(
        cls, prompter: Prompter, labels: list[str], weight: torch.Tensor | None = None
    ) -> LanguageModel:
        """The objective of a model that reads its texts through `prompter`: each label's words as it
        tokenises them after the prompt."""
        words = prompter.label_tokens()
        return cls(prompter.tokenizer, [words[label] for label in labels], weight)

    @classmethod
    def for_training(
        cls,
        cfg: TrainConfig,
        train_set: Dataset,
        prompter: Prompter,
        labels: list[str],
        accelerator: Accelerator,
    ) -> LanguageModel:
        """The response loss, each class's tokens weighted with `class_weights`; refused under FSDP."""
        if accelerator.is_fsdp2:
            raise LoraclsError(
                "objective: lm is not supported under FSDP (its scorer runs a varying number of forward "
                "passes per batch); use DDP, or objective: head"
            )
        weight = class_weights(train_set["labels"], len(labels)) if cfg.class_weights else None
        return cls.reading(prompter, labels, None if weight is None else weight.to(accelerator.device))

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over every response token of a right-padded batch with `response_start`."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        places = torch.arange(ids.shape[1], device=ids.device)[None, :]
        wanted = (places >= batch["response_start"][:, None]) & (places < mask.sum(1)[:, None])
        rows, targets = wanted.nonzero(as_tuple=True)  # token `targets` of row `rows` is predicted ...
        positions = torch.unique(targets - 1)  # ... from the position before; sorted, shared by the rows
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=positions).logits
        picked = logits[rows, torch.searchsorted(positions, targets - 1)].float()
        losses = torch.nn.functional.cross_entropy(picked, ids[rows, targets], reduction="none")
        if self.weight is None:
            return losses.mean()
        weight = self.weight[batch["labels"][rows]]
        return (losses * weight).sum() / weight.sum()

    def probs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Softmax over the labels of their words' log-probabilities after each prompt of the batch."""
        lengths = batch["attention_mask"].sum(1).tolist()
        prompts = [row[:n].tolist() for row, n in zip(batch["input_ids"], lengths, strict=True)]
        scores = label_log_probs(model, self.tokenizer, prompts, self.tokens, batch_size=len(prompts))
        return torch.softmax(torch.from_numpy(scores), -1).float()

    def classes(self, model: torch.nn.Module) -> int:
        return len(self.tokens)


def label_rows(weight: torch.Tensor, following: list[list[int]]) -> torch.Tensor:
    """A verbaliser-initialised head's starting rows (labels x hidden size), from each label's word's tokens
    after the start every word shares (`answer_tokens`): the LM head's row of the first of them where those
    differ between all labels, so that step 0 ranks the labels as the zero-shot prompt ranks those tokens;
    where two labels' words begin alike (`card arrival`, `card linking`), the mean of the rows of all its
    tokens, so that they still start apart. benchmarks/head_rows.py measured both (`head_rows.json`)."""
    if part_on_first_token(following):
        return weight[[ids[0] for ids in following]].detach().float().cpu().clone()
    return torch.stack([weight[ids].float().mean(0) for ids in following]).detach().cpu().clone()


@torch.inference_mode()
def label_log_probs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    tokens: list[list[int]],
    batch_size: int = 16,
    advance: Callable[[int], None] | None = None,
) -> np.ndarray:
    """log P(verbaliser k | prompt i), summed over the verbaliser's tokens: shape (prompts, labels).

    A verbaliser of n tokens is read from the sequence prompt + its first n - 1 tokens; a causal model gives
    the same logits for the prompt's positions in any sequence that starts with it, so shorter verbalisers
    ride along and a prompt costs one forward pass unless two multi-token verbalisers start differently
    (`label_hosts`). Sequences run longest-first in right-padded batches, and the LM head is applied only
    at the positions that predict a verbaliser token (`logits_to_keep`). `advance` is called with each
    batch's number of sequences once it has run (a progress bar's).
    """
    jobs: dict[tuple[int, ...], list[tuple[int, int, list[int]]]] = {}
    hosts = label_hosts(tokens)
    for i, prompt in enumerate(prompts):
        for k, host in hosts.items():
            jobs.setdefault(tuple(prompt) + host, []).append((i, k, len(prompt) - 1))
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
        if advance is not None:
            advance(len(batch))
    return scores


def label_hosts(tokens: list[list[int]]) -> dict[int, tuple[int, ...]]:
    """For each label k (longest words first), the tokens after the prompt of the sequence `label_log_probs`
    reads its words from: its own tokens but the last, or a longer label's that start with them. As many
    forward passes a prompt costs as there are distinct values (1 when every label is one token)."""
    hosts: dict[int, tuple[int, ...]] = {}
    for k in sorted(range(len(tokens)), key=lambda k: -len(tokens[k])):
        wanted = tuple(tokens[k][:-1])
        hosts[k] = next((h for h in hosts.values() if h[: len(wanted)] == wanted), wanted)
    return hosts


OBJECTIVES: dict[str, type[ClassificationHead] | type[LanguageModel]] = {
    "head": ClassificationHead,
    "lm": LanguageModel,
}
"""The objectives by the name `TrainConfig.objective` (and an export's `loracls.json`) gives them."""


def objective_kind(name: str) -> type[ClassificationHead] | type[LanguageModel]:
    """The objective class `name` stands for (config validation has refused any other name)."""
    return OBJECTIVES[name]


def pinned_prompt(cfg: TrainConfig, labels: list[str]) -> Prompt:
    """The run's prompt as config.yaml pinned it; refused while it is still `auto`."""
    if cfg.prompt == "auto":
        raise LoraclsError("the run's prompt was never chosen (config.yaml says prompt: auto)")
    return resolve_prompt(labels, [], cfg)


def input_prompter(
    tokenizer: PreTrainedTokenizerBase, cfg: TrainConfig, labels: list[str]
) -> Prompter | None:
    """How a run's model reads a text: inside the run's pinned prompt (a verbaliser-initialised head, or an
    `objective: lm` run, in the chat template if the run used it), or as it is (None)."""
    return objective_kind(cfg.objective).prompter(tokenizer, cfg, labels)
