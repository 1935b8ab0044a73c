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

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import pandas as pd
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutputWithPast

from loracls.config import TrainConfig
from loracls.data.prompts import Prompt, Prompter, answer_tokens, part_on_first_token, resolve_prompt
from loracls.data.tokenization import tokenize_responses
from loracls.errors import LoraclsError
from loracls.model import from_pretrained, load_causal_lm, load_classifier

CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
"""The key/value cache's name in a model's call and output: `cache` since transformers 5.2x renamed it,
`past_key_values` in the 5.x releases before (a GPU box's image held 5.17)."""


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


SCORE_BATCH = 32
"""Prompts per forward pass of `label_log_probs` in the prompt search and the baseline (where no micro-batch
is set): on a 2-core CPU, 32 read the search's prompts 1.26-1.35x faster than 16 in fp32 storage, and
1.34-1.39x together with the linears stored in bf16 (`benchmarks/prompt_scoring.py`,
`results/prompt_scoring.json`)."""


@torch.inference_mode()
def label_log_probs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    tokens: list[list[int]],
    batch_size: int = SCORE_BATCH,
    advance: Callable[[int], None] | None = None,
) -> np.ndarray:
    """log P(verbaliser k | prompt i), summed over the verbaliser's tokens: shape (prompts, labels).

    One forward pass reads each prompt, whatever the number of labels: every label's first token is scored
    from the prompt's last position. A verbaliser of n > 1 tokens needs the logits after its first n - 1
    tokens too: those run as short rows on the prompt's key/value cache (`Continuations`), so 77 labels of a
    few words each cost a few tokens per label, not the prompt again per label. Prompts run longest-first in
    left-padded batches with their own position ids, so that padding moves no real token's position.
    `advance` is called with each batch's number of prompts once it is scored (a progress bar's).
    """
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    later = Continuations.of(tokens)
    firsts = torch.tensor([ids[0] for ids in tokens])
    scores = np.zeros((len(prompts), len(tokens)), dtype=np.float64)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = len(prompts[batch[0]])
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            attention_mask[row, width - len(prompts[i]) :] = 1
        out = model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0).to(device),
            use_cache=bool(later.rows),
            logits_to_keep=1,
        )
        # (batch, vocabulary): only the labels' first tokens leave the device
        last = out.logits[:, -1].float()
        picked = last[:, firsts.to(last.device)] - torch.logsumexp(last, dim=-1, keepdim=True)
        scores[batch] += picked.cpu().numpy()
        if later.rows:
            scores[batch] += later.score(model, getattr(out, CACHE), attention_mask.to(device))
        if advance is not None:
            advance(len(batch))
    return scores


def later_tokens(tokens: list[list[int]]) -> int:
    """The tokens `label_log_probs` reads after each prompt to score the later tokens of words of several
    tokens (`Continuations`' rows): 0 when every label is one token."""
    return sum(len(row) for row in Continuations.of(tokens).rows)


@dataclass
class Continuations:
    """The rows that read the verbalisers' later tokens after a prompt, on the prompt's key/value cache: a
    verbaliser of n > 1 tokens is read from the row of its first n - 1 tokens, or from a longer row that
    starts with them (`card arrival` and `card` share one)."""

    rows: list[tuple[int, ...]]
    reads: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Per row: the positions, the tokens read there and the labels they count towards."""
    labels: int
    max_positions: int = 256
    """Continuation positions per forward pass (each gives a vocabulary-wide row of logits)."""

    def row_length(self, pair: tuple[int, int]) -> int:
        """The length of a (prompt, row) pair's row."""
        return len(self.rows[pair[1]])

    @classmethod
    def of(cls, tokens: list[list[int]]) -> Continuations:
        rows: list[tuple[int, ...]] = []
        reads: list[list[tuple[int, int, int]]] = []
        for k in sorted(range(len(tokens)), key=lambda k: -len(tokens[k])):
            wanted = tuple(tokens[k][:-1])
            if not wanted:
                continue
            row = next((r for r, seq in enumerate(rows) if seq[: len(wanted)] == wanted), None)
            if row is None:
                rows.append(wanted)
                reads.append([])
                row = len(rows) - 1
            reads[row] += [(j, token, k) for j, token in enumerate(tokens[k][1:])]
        arrays = [tuple(np.array(column, dtype=np.int64) for column in zip(*r, strict=True)) for r in reads]
        return cls(rows, arrays, len(tokens))

    def score(self, model: torch.nn.Module, cache, attention_mask: torch.Tensor) -> np.ndarray:
        """The later tokens' log-probabilities summed per label: shape (prompts of the batch, labels), read
        on the batch's cache (left-padded prompts whose mask is `attention_mask`)."""
        device = attention_mask.device
        prompts = attention_mask.shape[0]
        lengths = attention_mask.sum(1)
        # rows of one length together, so that no pass pads a row or reads a position nobody needs
        pairs = sorted(((i, r) for i in range(prompts) for r in range(len(self.rows))), key=self.row_length)
        chunks: list[list[tuple[int, int]]] = []
        for pair in pairs:
            if (
                chunks
                and self.row_length(chunks[-1][0]) == self.row_length(pair)
                and ((len(chunks[-1]) + 1) * self.row_length(pair) <= self.max_positions)
            ):
                chunks[-1].append(pair)
            else:
                chunks.append([pair])
        scores = np.zeros((prompts, self.labels), dtype=np.float64)
        for chunk in chunks:
            which = torch.tensor([i for i, _ in chunk], device=device)
            ids = torch.tensor([self.rows[r] for _, r in chunk], dtype=torch.long, device=device)
            width = ids.shape[1]
            chunk_cache = copy.deepcopy(cache)
            chunk_cache.batch_select_indices(which)
            logits = model(
                input_ids=ids,
                attention_mask=torch.cat([attention_mask[which], torch.ones_like(ids)], dim=1),
                position_ids=(lengths[which][:, None] + torch.arange(width, device=device)[None, :]),
                use_cache=True,
                **{CACHE: chunk_cache},
            ).logits
            logits = logits.float()
            normaliser = torch.logsumexp(logits, dim=-1)  # (rows, width): log_softmax without its copy
            for n, (i, r) in enumerate(chunk):
                positions, targets, labels = self.reads[r]
                picked = logits[n, positions, targets] - normaliser[n, positions]
                np.add.at(scores[i], labels, picked.cpu().numpy())
        return scores


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
