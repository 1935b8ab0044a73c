"""The training configuration: one dataclass whose fields are the command-line options and YAML keys."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from loracls.errors import LoraclsError


@dataclass
class PromptConfig:
    """How the prompt baseline builds and reads its prompts: the keys `loracls train` (options and YAML) and
    `loracls baseline` share, defined once here."""

    prompt: str = "auto"
    """The prompt of the baseline and of a verbaliser-initialised head: a built-in template or `auto`. The
    templates: `en-options`, `en-label`, `en-sentiment`, `en-it-was`, `en-review`, `zh-options`, `zh-label`,
    `zh-sentiment`, `zh-overall`, `zh-review`. `auto`: every built-in template of the texts' language, with
    every fitting label-word set, is scored zero-shot on `prompt_sample` training examples and the best
    macro-F1 wins (without training data: the language's `-options` template). config.yaml stores the
    choice."""
    prompt_sample: int = 128
    """Training examples (a stratified sample, at least 2 of each label) that `prompt: auto` chooses the
    prompt on. The search runs in two rounds: every candidate reads 32 of them (stratified, at least 2 a
    label), the best quarter of the candidates (at least 2) the rest, and the choice is the best of those on
    all of them (one round where that would not read less)."""
    prompt_budget: int = 262_144
    """The tokens `prompt: auto` may read at most: over the candidates, each sample text inside each prompt
    and the later tokens of label words of several tokens. Over it, the sample shrinks to fit (down to 2
    examples per label), then the last candidates go unscored; the run says when (0: no limit). zh-reviews'
    search reads about 29,000 tokens in its two rounds (65,000 if every candidate read the whole sample),
    BANKING77's (77 intents, one round) would read 430,000 (Gemma 3)."""
    baseline_shots: int = 0
    """Examples shown in each baseline prompt, drawn balanced from the training split (0: zero-shot)."""
    verbalizers: str | dict[str, str] | None = None
    """The label words: `label=word,...`, or in YAML a mapping of label to word; unset: chosen with the
    prompt. `label=word,...` serves labels without `,` or `=`, a YAML mapping any label. Unset, they are
    chosen among the label names and, for sentiment labels, word sets such as great/terrible (正面/负面,
    好/差, 好评/差评 for Chinese). config.yaml stores the mapping."""
    label_descriptions: str | dict[str, str] | None = None
    """A few words for each label, for the prompt: a YAML or JSON file mapping label to description, a CSV
    with the columns `label` and `description`, or in YAML a mapping. They join the prompt search as one more
    set of label words (what an `-options` prompt lists and the others answer), and a head started from the
    chosen prompt starts from their tokens."""
    prompt_template: str | None = None
    """An own query block with `{text}`, ending where the answer starts; replaces the template's."""
    prompt_instruction: str | None = None
    """An own first line of the prompt, may use `{options}` (verbalisers in label_order)."""
    label_order: str | list[str] | None = None
    """Order of the labels listed in the prompt: comma-separated, or in YAML a list (any label); default:
    label-id order."""
    calibrate: bool = False
    """Headline the calibrated baseline (bias measured on content-free inputs, divided out); both are kept."""
    chat_template: bool | None = None
    """Read each prompt as a user turn of the tokenizer's chat template (the answer starts the model's turn).
    Unset: yes for an `objective: lm` run whose tokenizer has a chat template (config.yaml stores what was
    used), no otherwise."""


@dataclass
class TrainConfig(PromptConfig):
    """Everything `loracls train` needs; `RUN/config.yaml` stores the resolved copy."""

    model: str = "gemma3-270m"
    """Base model: an alias (`gemma3-270m`), a local Hugging Face model folder, a `.gguf` file, or a hub id
    that is already in the local hub cache."""
    data: str = "zh-reviews"
    """Training data: a file (`.csv`, `.tsv`, `.jsonl`, `.json`, `.parquet`, or `.xlsx`: the first sheet,
    with `pip install 'loracls[excel]'`; CSV, TSV and JSON also compressed: `.gz`, `.bz2`, `.xz`, `.zip`,
    as in `train.csv.gz`), or a built-in dataset (`zh-reviews`, `en-tweets`)."""
    val: str | None = None
    """Validation file (any format `data` reads); when unset, a stratified `val_fraction` of `data` is held
    out."""
    test: str | None = None
    """Test file (any format `data` reads); when unset, a stratified `test_fraction` of `data` is held out."""
    text_column: str = "text"
    """Column holding the text to classify."""
    label_column: str = "label"
    """Column holding the label (a string or an integer)."""
    multi_label: bool = False
    """Each row may carry several labels (or none): a JSON list, or a string split at `label_separator`.
    Sigmoid outputs, binary cross-entropy, and a decision threshold per label tuned on validation."""
    label_separator: str = ","
    """Separator between the labels of one row in a CSV/TSV label column (with `multi_label`)."""
    label_type: str = "auto"
    """The type outputs (predictions, `test_predictions.jsonl`, `eval`) give labels in: `int` or `str`.
    `auto`: `int` when every training label is an integer (a number, or digits such as `3` or `-1` in a
    CSV), else `str`. config.yaml stores what was used."""
    merge_label_case: bool = False
    """Merge labels that differ only in case (`Positive`, `positive`) into their commonest spelling. Off:
    such labels are refused, since they would train as separate classes. Surrounding whitespace is always
    stripped from labels (RUN/data/notes.json says where)."""
    class_weights: bool = False
    """Weight the loss against class imbalance: inverse class frequency (single-label) or negatives/positives
    per label (multi-label), from the training split."""
    val_fraction: float = 0.1
    """Share of `data` held out for validation when no `val` file is given."""
    test_fraction: float = 0.1
    """Share of `data` held out for testing when no `test` file is given."""
    dedup: str = "drop"
    """Repeated texts and texts shared between splits: `drop` (keep one copy; drop texts labelled two ways;
    remove from train what val/test hold), `keep` (report only) or `error` (refuse)."""
    max_train_examples: int | None = None
    """Keep at most this many training examples (a stratified sample), after the splits are made. Both this
    and `train_fraction` stay: a count is a fixed labelling budget whatever the data's size, a share keeps a
    learning-curve sweep meaningful on any data set."""
    train_fraction: float | None = None
    """Keep this share of the training examples (a stratified sample), after the splits are made; with
    `max_train_examples` as well, the smaller wins. Sweeps use it for learning curves."""
    max_eval_examples: int | None = None
    """Keep at most this many validation and test examples each (a stratified sample)."""
    max_length: int = 256
    """Truncate texts to this many tokens."""
    long_texts: str = "cut"
    """How validation, test, `eval` and `predict` read a text over `max_length` tokens: `cut` there (as
    training reads it), or in overlapping windows of `max_length` tokens whose probabilities are averaged
    (`mean`) or, per label, the highest taken (`max`). Texts that fit are read as before."""
    window_stride: int | None = None
    """`long_texts` `mean`/`max`: tokens between two windows' starts (None: half a window)."""
    epochs: float = 2.0
    """Passes over the training data; a fraction stops part-way through the last one."""
    min_steps: int = 60
    """Train at least this many optimizer steps, repeating the data past `epochs` where it is small (0: just
    `epochs`). 100 examples at batch 32 are 4 steps an epoch; 2 epochs of them left a head near where it
    started."""
    lr: float = 1e-3
    """Peak learning rate of AdamW for the LoRA matrices and the classification head."""
    batch_size: int = 32
    """Examples per optimizer step in each process; gradients are accumulated over micro-batches of
    `micro_batch_size` to reach it. Under N processes (DDP/FSDP) one step sees N x this many examples."""
    micro_batch_size: int | None = None
    """Examples per forward pass; must divide `batch_size`; unset: the largest that fits. On a GPU that is
    the largest divisor of `batch_size` that fits in memory at the longest training text (probed once,
    cached per model, length, precision and device), on a CPU the largest divisor up to 16. The run's
    `config.yaml` stores the value used."""
    length_grouping: int = 50
    """Training micro-batches are cut from length-sorted groups of this many micro-batches: little padding,
    faster (1: random micro-batches). This is the scheme of transformers' `group_by_length`; at 1 each
    micro-batch is padded to its longest text."""
    balance_labels: bool = True
    """Interleave the labels within each length-sorted group, so every micro-batch keeps about the label mix
    of the data. Each group is sorted by length per label (single-label: per label; multi-label: per label
    set), then the labels take turns. A plain length sort gives label-skewed micro-batches where length
    goes with the label (zh-reviews: positive reviews are longer); balanced ones scored above the plain
    sort and tied or beat random batches in every paired run of `benchmarks/README.md` ("Label-balanced
    length grouping"), at a little more padding than a plain sort and far less than random batches. False:
    a plain length sort (transformers' `group_by_length`)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_ratio: float = 0.06
    """Share of optimizer steps spent warming the learning rate up (ignored when `warmup_steps` is set)."""
    warmup_steps: int | None = None
    """Warm-up length in optimizer steps; overrides `warmup_ratio`."""
    schedule: str = "cosine"
    """Learning-rate schedule after the warm-up: `cosine` (decays to 0 over the planned steps) or `wsd`
    (warm-up, stable, decay: constant until the last `decay_ratio` of the steps, then linear to 0; when the
    last validation before the decay still improves on an earlier one, the stable phase goes on to the next
    validation, up to `extend_up_to` times the planned steps, so a task that is still learning gets more
    steps; it needs two validations before the decay: `eval_every` at most 40% of the steps)."""
    decay_ratio: float = 0.2
    """`schedule: wsd`: share of the planned steps over which the learning rate decays to 0."""
    extend_up_to: float = 2.0
    """`schedule: wsd`: at most this many times the planned steps (`epochs`, `min_steps`) while validation
    still improves (1: never more than planned)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value before each optimizer step."""
    lora_r: int | None = None
    """LoRA rank. Unset: 16 where `target_modules: auto` chose every linear layer (many classes), else 8; the
    run's config.yaml stores the rank used."""
    lora_alpha: float | None = None
    """LoRA scaling numerator: updates are scaled by `lora_alpha / lora_r`. Unset: 2 x `lora_r` (16 at rank
    8, a scale of 2)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (0: none, and peft skips it). The write-up's 0.05 scored the same on
    validation (3 seeds, zh-reviews and en-tweets), and drawing its masks took 12% of a step
    (benchmarks/README.md, "LoRA dropout")."""
    head_init: str = "auto"
    """How the new classification head starts: `auto`, `verbalizer`, `zero` or `normal`. `verbalizer`: every
    text is read inside the run's prompt, and each label's row is the LM head's row of its verbaliser's token,
    so step 0 answers what the uncalibrated zero-shot prompt answers. `zero`: raw text, every class equally
    likely at step 0. `normal`: raw text, transformers' N(0, initializer_range) (on Gemma's large hidden
    states it starts confidently wrong). `auto`: `verbalizer` when the chosen prompt's zero-shot answers on
    the training sample agree with the labels beyond chance (Cohen's kappa at least 0.1, its 90% interval
    above 0), else `zero` (always `zero` for multi-label); the run's config.yaml stores what was decided."""
    objective: str = "head"
    """What is trained: `head` (a classification head) or `lm` (instruction tuning: the label word). `head`: a
    classification head on the last token (started as `head_init` says). `lm`: no new head; LoRA is trained
    with the causal-LM loss on the response after the run's prompt (the label's word, then with
    `response_column` a new line and that column's text, then end-of-sequence), and a text's class is the
    label word the model gives the highest log-probability after the prompt (the baseline's scorer: a forced
    choice, never an unparsable answer). Single-label only."""
    response_column: str | None = None
    """With `objective: lm`: a column of free text (a comment, a reason) the training response carries after
    the label word; `predict --generate` then writes what the model says. Rows may leave it empty."""
    target_modules: str = "auto"
    """Modules that get LoRA: `auto`, a preset (`attn-qv`, `attn`, `all-linear`), comma-separated names or one
    regular expression. `attn-qv` = q_proj,v_proj; `attn` = q,k,v,o_proj; names such as `q_proj,v_proj`.
    Only ever linear layers inside the language model's decoder layers. `auto`: `attn-qv` for up to
    `lora.FEW_CLASSES` classes (sentiment: more capacity measured no better), `all-linear` (at rank 16 unless
    `lora_r` is set) for more: topics and intents need the capacity (benchmarks/README.md, "LoRA's capacity
    by the number of classes"); the run's config.yaml stores what was chosen."""
    allow_few_targets: bool = False
    """Train even when target_modules gives under a quarter of the LoRA parameters of `attn-qv`."""
    eval_every: int = 50
    """Evaluate on the validation set every this many optimizer steps (and always at the end)."""
    log_every: int = 10
    """Log loss, learning rate, memory and throughput every this many optimizer steps."""
    save_every: int = 100
    """Write a full checkpoint every this many optimizer steps, at each new best and at the end; `loracls
    train --resume RUN` continues from the last. A checkpoint holds the adapter, head, optimizer,
    scheduler, RNG and data position."""
    keep_checkpoints: int = 2
    """Keep this many most recent checkpoints in `RUN/checkpoints/` (the best one is always kept as well)."""
    skip_nonfinite: int = 0
    """Skip up to this many optimizer steps whose loss or gradient is NaN/inf; one more stops the run."""
    early_stopping_patience: int | None = None
    """Stop after this many validations without improvement of the best validation metric."""
    metric: str = "macro_f1"
    """Validation metric that picks the best checkpoint: `macro_f1` or `accuracy`."""
    temperature_scaling: bool = True
    """After training, fit one temperature on the validation split (single-label) that every later reading
    of the run applies (`eval`, `predict`, `serve`, the export): probabilities you can threshold, the same
    labels. metrics.json's `calibration` has the test ECE before and after."""
    quantize: str | None = None
    """`4bit`: QLoRA, the base model's linear layers in 4-bit NF4 through bitsandbytes. Needs a CUDA GPU (or
    ROCm with a bitsandbytes build that supports it: `loracls doctor` tells); refused elsewhere."""
    precision: str = "auto"
    """Number format: `auto` (the fastest the device supports), `fp32`, `bf16` or `fp16`. `auto` is bf16 on
    GPUs that compute it in hardware (NVIDIA Ampere+, AMD gfx908/gfx90a/gfx94x/gfx95x, RDNA 3-4), fp16 with
    loss scaling on other GPUs (V100, T4, gfx906), bf16 on CPUs with AVX-512-BF16 or AMX, else
    fp32."""
    frozen_base: str = "auto"
    """How the frozen base's decoder linear weights are kept. `auto`: under bf16 (fp16) autocast in bf16
    (fp16), the numbers autocast computes with anyway, without casting every weight on every forward (faster:
    benchmarks/README.md, "The frozen base"); else, and always under FSDP or QLoRA, in fp32. `fp32`, `bf16`,
    `fp16`: as named. The run records what `auto` chose, and every later reading of it (the test, `predict`,
    `eval`, `serve`, the export) rounds the base's linears alike before LoRA is merged: they all answer as
    the model that trained."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of storing them: less memory (a larger micro-batch
    fits), about a third more compute per step."""
    attention: str = "sdpa"
    """Attention kernel: `sdpa` (PyTorch's fused scaled-dot-product attention) or `eager` (the plain one)."""
    compile: bool = False
    """`torch.compile` the model before training (opt-in: the first steps pay for compilation)."""
    baseline: bool = True
    """Score the prompt baseline (the base model's LM head, no training) on the test split before training;
    the prompt search still runs without it when the head starts from the prompt (`--head-init zero` skips
    both). The prompt is chosen on training examples when the head starts from it (`head_init` `auto` or
    `verbalizer`) or with `objective: lm`."""
    smoke_test: bool = True
    """On a GPU, run `loracls doctor`'s child-process smoke test before loading the model."""
    track: str | None = None
    """Also log the curves through accelerate's trackers: `tensorboard` or `mlflow`. `tensorboard` writes
    into RUN/tracking, `mlflow` into the store in MLFLOW_TRACKING_URI (default a local `./mlruns`, no server
    needed)."""
    seed: int = 42
    """Seed for the splits, the data order, LoRA initialisation and dropout."""
    out: str | None = None
    """Run folder; default `runs/<data>-<timestamp>`."""
    trust_remote_code: bool = False
    """Run code shipped with a hub model. Off: standard architectures never need it."""
    allow_pickle: bool = False
    """Also load `.bin` (pickle) model weights, which can run code when read; off: safetensors only."""

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr > 0,
            "batch_size": self.batch_size >= 1,
            "length_grouping": self.length_grouping >= 1,
            "micro_batch_size": self.micro_batch_size is None
            or (
                1 <= self.micro_batch_size <= self.batch_size and self.batch_size % self.micro_batch_size == 0
            ),
            "attention": self.attention in ("sdpa", "eager"),
            "epochs": self.epochs > 0,
            "min_steps": self.min_steps >= 0,
            "max_length": self.max_length >= 2,
            "long_texts": self.long_texts in ("cut", "mean", "max"),
            "window_stride": self.window_stride is None or self.window_stride >= 1,
            "lora_r": self.lora_r is None or self.lora_r >= 1,
            "lora_alpha": self.lora_alpha is None or self.lora_alpha > 0,
            "lora_dropout": 0 <= self.lora_dropout < 1,
            "weight_decay": self.weight_decay >= 0,
            "warmup_ratio": 0 <= self.warmup_ratio < 1,
            "warmup_steps": self.warmup_steps is None or self.warmup_steps >= 0,
            "schedule": self.schedule in ("cosine", "wsd"),
            "decay_ratio": 0 < self.decay_ratio <= 1,
            "extend_up_to": self.extend_up_to >= 1,
            "early_stopping_patience": self.early_stopping_patience is None
            or self.early_stopping_patience >= 1,
            "max_grad_norm": self.max_grad_norm > 0,
            "val_fraction": 0 < self.val_fraction < 1,
            "test_fraction": 0 < self.test_fraction < 1 and self.val_fraction + self.test_fraction < 1,
            "eval_every": self.eval_every >= 1,
            "log_every": self.log_every >= 1,
            "metric": self.metric in ("macro_f1", "accuracy"),
            "head_init": self.head_init in ("auto", "zero", "normal", "verbalizer"),
            "objective": self.objective in ("head", "lm"),
            "prompt_sample": self.prompt_sample >= 2,
            "prompt_budget": self.prompt_budget >= 0,
            "precision": self.precision in ("auto", "fp32", "bf16", "fp16"),
            "frozen_base": self.frozen_base in ("auto", "fp32", "bf16", "fp16"),
            "max_train_examples": self.max_train_examples is None or self.max_train_examples >= 2,
            "max_eval_examples": self.max_eval_examples is None or self.max_eval_examples >= 2,
            "train_fraction": self.train_fraction is None or 0 < self.train_fraction <= 1,
            "baseline_shots": self.baseline_shots >= 0,
            "save_every": self.save_every >= 1,
            "keep_checkpoints": self.keep_checkpoints >= 1,
            "skip_nonfinite": self.skip_nonfinite >= 0,
            "dedup": self.dedup in ("drop", "keep", "error"),
            "label_type": self.label_type in ("auto", "int", "str"),
            "track": self.track in (None, "tensorboard", "mlflow"),
            "quantize": self.quantize in (None, "4bit"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            docs = field_docs()
            lines = [f"  {name} = {getattr(self, name)!r}: {docs[name]}" for name in bad]
            raise LoraclsError("Out-of-range configuration value(s):\n" + "\n".join(lines))
        if self.multi_label and self.head_init == "verbalizer":
            raise LoraclsError(
                "head_init: verbalizer reads one label word per text (a single-label task); a multi-label "
                "run needs head_init: zero"
            )

        if self.objective == "lm" and self.multi_label:
            raise LoraclsError(
                "objective: lm answers one label word per text (a single-label task); a multi-label run "
                "needs objective: head"
            )
        if self.objective == "lm" and self.quantize:
            raise LoraclsError("objective: lm does not support --quantize yet; use objective: head for QLoRA")
        if self.response_column is not None and self.objective != "lm":
            raise LoraclsError(
                f"response_column {self.response_column!r} is the text an `objective: lm` run learns to say "
                "after the label word; add --objective lm, or drop --response-column"
            )

    @property
    def prompted(self) -> bool:
        """The model reads each text inside the run's prompt (a verbaliser-initialised head, or `lm`)."""
        return self.head_init == "verbalizer" or self.objective == "lm"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(
        cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None, written: bool = False
    ) -> TrainConfig:
        """Build a config from an optional YAML file, then apply `overrides` (which win).

        `written`: the file is a run's own config.yaml, which an earlier version may have written; its retired
        keys are translated (a user's config with them is refused, saying what replaced them).
        """
        values: dict[str, Any] = {}
        if path is not None:
            values.update(read_yaml_config(Path(path)))
            if written:
                values = upgrade(values)
        values.update(overrides or {})
        check_known_keys(values, source=str(path) if path else "overrides")
        types = field_types()
        return cls(**{k: coerce(k, v, types[k]) for k, v in values.items()})


def read_yaml_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LoraclsError(f"Config file not found: {path}")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise LoraclsError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise LoraclsError(
            f"{path} must hold a mapping of config keys to values, not {type(values).__name__}"
        )
    return values


RETIRED = {
    "grad_accum": "`batch_size` is now the whole batch per optimizer step and `micro_batch_size` the "
    "examples per forward pass (default: the largest that fits). Replace `batch_size: B, grad_accum: A` with "
    "`batch_size: B*A` (and `micro_batch_size: B` to keep the old micro-batch).",
}
"""Keys of earlier versions, with what replaced them."""


def upgrade(values: dict[str, Any]) -> dict[str, Any]:
    """A config written by an earlier version in today's keys, meaning the same run: `batch_size: B` with
    `grad_accum: A` (B per forward pass, A passes per step) is `batch_size: B*A`, `micro_batch_size: B`;
    without `balance_labels` its batches were sorted by length alone (false); without `min_steps` it trained
    `epochs` alone (0); without `label_type` it wrote labels as strings."""
    values = dict(values)
    values.setdefault("label_type", "str")
    values.setdefault("balance_labels", False)  # runs written before it sorted by length alone
    values.setdefault("min_steps", 0)
    if "grad_accum" in values:
        accumulated = values.pop("grad_accum") or 1
        micro = values.get("batch_size", 16)  # its default while it meant one forward pass
        values |= {"batch_size": micro * accumulated, "micro_batch_size": micro}
    return values


def check_known_keys(values: dict[str, Any], source: str) -> None:
    known = [f.name for f in fields(TrainConfig)]
    for key in values:
        if key in RETIRED:
            raise LoraclsError(f"Config key '{key}' in {source} is retired: {RETIRED[key]}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(known)}."
            raise LoraclsError(f"Unknown config key '{key}' in {source}.{hint}")


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """Turn `key=value` strings into a dict; values are read as YAML scalars (`lr=1e-4`, `val=null`)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise LoraclsError(f"Override '{pair}' is not of the form key=value (e.g. lora_r=16)")
        out[key.strip().replace("-", "_")] = yaml.safe_load(raw) if raw else None
    return out


def coerce(name: str, value: Any, annotation: Any) -> Any:
    """Convert `value` to the field's type, so `lr: 2e-4` (a YAML string) and `epochs=3` both work."""
    if value is None:
        if type(None) in typing.get_args(annotation):
            return None
        raise LoraclsError(f"Config key '{name}' cannot be empty")
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(value, dict | list) and any(typing.get_origin(a) is type(value) for a in kinds):
        if isinstance(value, dict):  # label words keyed by label: YAML may read `1: one` as a number
            return {str(k): str(v) for k, v in value.items()}
        return [str(v) for v in value]
    base = kinds[0] if kinds else annotation
    try:
        if base is bool and isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("true", "1", "yes")
        if base is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        if base in (int, float):
            return base(float(value)) if base is int else float(value)
        return base(value)
    except (TypeError, ValueError):
        raise LoraclsError(
            f"Config key '{name}' expects {getattr(base, '__name__', base)}, got {value!r}"
        ) from None


@functools.cache
def field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


@functools.cache
def field_docs() -> dict[str, str]:
    """The docstring under each field (of TrainConfig and PromptConfig), read from the source so that help
    text has one home."""
    docs = {}
    for cls in (PromptConfig, TrainConfig):
        body = ast.parse(inspect.getsource(cls)).body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
            ):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs
