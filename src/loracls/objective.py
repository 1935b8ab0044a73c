"""What a training objective is to the rest of loracls: how a batch becomes a loss, and how a batch becomes
class probabilities.

`fit()`, validation, the final test, `eval`, `predict` and `export` call only `loss` and `probs`; a second
objective (a causal-LM objective that scores label words) is a second class with these two methods, not a
second loop. As peft's tuners sit behind one interface, nothing else asks which objective it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from datasets import Dataset

from loracls.config import TrainConfig


class Objective(Protocol):
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar training loss of a padded batch with `labels`."""

    def probs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Class probabilities of a padded batch, shape (examples, classes), float32."""


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
            counts = torch.bincount(targets, minlength=num_labels).float()
            weight = counts.sum() / (num_labels * counts.clamp(min=1))
            loss_fn = torch.nn.CrossEntropyLoss(weight=weight if cfg.class_weights else None)
        return cls(cfg.multi_label, loss_fn.to(device))

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return self.loss_fn(model(**inputs).logits.float(), batch["labels"])

    def probs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(**batch).logits.float()
        return torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, -1)
