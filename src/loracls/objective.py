"""What a training objective is to the rest of loracls: how a batch becomes a loss, and how a batch becomes
class probabilities.

`fit()`, validation, the final test, `eval`, `predict` and `export` call only `loss`, `probs` and
`classes`: the classification head (`ClassificationHead`) and instruction tuning (`LanguageModel`: the
causal-LM loss on the response, classes read from the label words' log-probabilities) are two classes with
these methods, not two loops. As peft's tuners sit behind one interface, nothing else asks which it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loracls.config import TrainConfig
from loracls.prompts import Prompter


class Objective(Protocol):
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

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> ClassificationHead:
        """The objective a saved classifier was trained with, read from its config (`problem_type`)."""
        return cls(multi_label=model.config.problem_type == "multi_label_classification")

    @classmethod
    def for_training(
        cls, cfg: TrainConfig, train_set: Dataset, num_labels: int, device: torch.device
    ) -> ClassificationHead:
        """The loss of `cfg`, weighted against class imbalance with `class_weights`: inverse class frequency
        (single-label), or negatives/positives per label (multi-label)."""
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
        cls, cfg: TrainConfig, train_set: Dataset, prompter: Prompter, labels: list[str], device: torch.device
    ) -> LanguageModel:
        weight = class_weights(train_set["labels"], len(labels)).to(device) if cfg.class_weights else None
        return cls.reading(prompter, labels, weight)

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
