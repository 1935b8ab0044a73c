"""Batches: length-grouped, label-balanced training micro-batches (`LengthGroupedBatches`, `make_loader`), and
the length-sorted inference order. Texts are padded per batch, never to `max_length`."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterator

import torch
from datasets import Dataset
from torch.utils.data import DataLoader, Sampler
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase


class LengthGroupedBatches(Sampler[list[int]]):
    """Batches of similar length, so little compute is spent on padding.

    Training (`shuffle=True`): shuffle, cut into mega-batches of `group` batches, sort each by length, cut
    into batches, shuffle the batches (the scheme of transformers' `LengthGroupedSampler`; `group=1` gives
    random batches). With `labels`, each mega-batch is sorted by length within each label and the labels are
    interleaved by rank (an example's place is its rank among its label's examples, as a fraction), so each
    batch holds about the label mix of the mega-batch: where length goes with the label, a plain length sort
    gives label-skewed batches. Evaluation (`shuffle=False`): sort everything by length (`length_passes`, with
    its token budget `max_tokens`); callers restore the original order with the indices.

    The batch size is kept as `size`, not `batch_size`: accelerate's multi-process sharding would read a
    `batch_size` as "every batch is full" and skip the one short batch wherever shuffling put it. With
    `shards` processes taking every `shards`-th batch, training batches are evened (`evened`) so that none is
    trained twice an epoch.
    """

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        shuffle: bool,
        seed: int = 0,
        group: int = 50,
        labels: list[str] | None = None,
        shards: int = 1,
        max_tokens: int | None = None,
    ):
        self.lengths, self.labels, self.size, self.group = lengths, labels, batch_size, group
        self.shuffle, self.seed, self.epoch, self.shards = shuffle, seed, 0, shards
        self.max_tokens = max_tokens  # evaluation only: `length_passes`'s token budget

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed + self.epoch)
        if not self.shuffle:
            return length_passes(self.lengths, self.size, self.max_tokens)
        rng.shuffle(order)
        mega = self.size * self.group
        out = []
        for start in range(0, len(order), mega):
            chunk = sorted(order[start : start + mega], key=lambda i: self.lengths[i], reverse=True)
            if self.labels is not None:
                chunk = self.interleave_labels(chunk)
            out += [chunk[i : i + self.size] for i in range(0, len(chunk), self.size)]
        rng.shuffle(out)
        return evened(out, self.shards)

    def interleave_labels(self, chunk: list[int]) -> list[int]:
        """`chunk` (sorted by length, longest first) reordered by each example's rank within its label."""
        by_label: dict[str, list[int]] = defaultdict(list)
        for i in chunk:
            by_label[self.labels[i]].append(i)
        place = {i: (rank + 0.5) / len(same) for same in by_label.values() for rank, i in enumerate(same)}
        return sorted(chunk, key=place.__getitem__)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        count = math.ceil(len(self.lengths) / self.size)
        if not self.shuffle or count % self.shards == 0:
            return count
        return min(count + self.shards - count % self.shards, len(self.lengths))  # as `evened` splits


def length_passes(lengths: list[int], size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Inference passes: the indices of `lengths` sorted by length (shortest first), cut into passes of at
    most `size` texts and, with `max_tokens`, at most that many padded tokens (texts x the pass's longest;
    a text longer than the budget gets a pass of its own). On a CPU, where padding costs what text does, a
    budget keeps short texts in wide passes and long ones in narrow ones (benchmarks/README.md, "Serving")."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    passes: list[list[int]] = []
    for i in order:
        current = passes[-1] if passes else None
        full = current is None or len(current) >= size
        if full or (max_tokens is not None and (len(current) + 1) * lengths[i] > max_tokens):
            passes.append([i])
        else:
            current.append(i)
    return passes


def padded_per_token(lengths: list[int], batches: list[list[int]]) -> float:
    """Tokens computed per real token when each batch is padded to its longest (1.0: no padding)."""
    real = sum(lengths[i] for batch in batches for i in batch)
    padded = sum(len(batch) * max(lengths[i] for i in batch) for batch in batches if batch)
    return padded / max(real, 1)


def evened(batches: list[list[int]], shards: int) -> list[list[int]]:
    """`batches` with the largest halved until `shards` divides their number (none split when it already
    does). Each of `shards` processes takes every `shards`-th batch; when their number does not divide,
    accelerate fills the last round from the epoch's first batches (`even_batches`), and those examples
    train twice an epoch. Halving keeps every example once; only single-example batches cannot be halved,
    and then the last round is still filled up."""
    batches = list(batches)
    while len(batches) % shards:
        largest = max(range(len(batches)), key=lambda n: len(batches[n]))
        if len(batches[largest]) < 2:
            break
        half = len(batches[largest]) // 2
        batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
    return batches


def make_loader(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    shuffle: bool,
    seed: int = 0,
    generator: torch.Generator | None = None,
    group: int = 50,
    balance_labels: bool = False,
    shards: int = 1,
) -> DataLoader:
    """A loader over length-grouped batches (`LengthGroupedBatches`), padded per batch to its longest text.

    `balance_labels` keeps the label mix in every training batch (the dataset's `labels`; a multi-label
    target counts as one label per combination). `generator` gives the loader its own RNG for the seed it
    draws per iterator; without one that draw comes from torch's global RNG, which dropout also uses.
    `shards`: the processes that share the training batches (`evened`).
    """
    lengths = [len(x) for x in dataset["input_ids"]]
    labels = [str(y) for y in dataset["labels"]] if balance_labels and shuffle else None
    sampler = LengthGroupedBatches(lengths, batch_size, shuffle, seed, group, labels, shards)
    return DataLoader(
        dataset, batch_sampler=sampler, collate_fn=DataCollatorWithPadding(tokenizer), generator=generator
    )
