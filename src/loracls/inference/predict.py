"""Load a fine-tuned classifier (a run folder or an export) and classify texts with it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from datasets import Dataset
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loracls.console import console, progress
from loracls.data.labels import label_names, label_value, separator
from loracls.data.prompts import Prompter
from loracls.data.tables import read_labelled
from loracls.data.tokenization import tokenize, window_tokens
from loracls.environment.cpu import check_int8_cpu
from loracls.environment.devices import inference_autocast, inference_device
from loracls.environment.micro_batch import eval_batch_size
from loracls.errors import LoraclsError
from loracls.files import atomic_folder
from loracls.inference import int8 as int8_module
from loracls.inference.export_format import INT8_RANGES, folder_kind, read_export_info
from loracls.lora import round_frozen_base
from loracls.model import load_tokenizer, resolve_model
from loracls.objective import ClassificationHead, Objective, input_prompter, objective_kind
from loracls.training.calibration import abstains, with_temperature
from loracls.training.evaluate import (
    combine_windows,
    label_matrix,
    predict_probs,
    predicted_labels,
    rounded,
    score_test,
    write_predictions_jsonl,
)
from loracls.training.runs import RunFolder, write_json


def merge_adapter(
    base_model: str,
    adapter: Path,
    labels: list[str],
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    multi_label: bool = False,
    quantize: str | None = None,
    objective: str = "head",
    frozen_base: str = "fp32",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base classifier with a LoRA adapter (and trained head) merged in, and the adapter's tokenizer;
    with `objective="lm"` the base causal LM with the adapter merged in. The base's linears are rounded as
    the run's `frozen_base` trained on them first (`round_frozen_base`).

    With `quantize` (a QLoRA run read back as it was scored), the base loads in 4-bit as in training and LoRA
    stays unmerged: merging into NF4 weights would re-quantise LoRA's update, a third model that neither
    validation nor the test scored.
    """
    tokenizer = load_tokenizer(str(adapter))
    path = resolve_model(base_model)
    base = objective_kind(objective).load(
        path,
        labels,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        multi_label=multi_label,
        quantize=quantize,
    )
    base.config.pad_token_id = tokenizer.pad_token_id
    if not quantize:
        round_frozen_base(base, frozen_base)
    model = PeftModel.from_pretrained(base, str(adapter))
    return (model if quantize else model.merge_and_unload()), tokenizer


def four_bit_runs_here() -> bool:
    """Whether bitsandbytes' 4-bit layers (a QLoRA run's base) can run here: they need a CUDA/ROCm GPU."""
    return torch.cuda.is_available()


@dataclass
class Classifier:
    """A fine-tuned classifier ready for inference: LoRA merged into the base weights."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    labels: list[str]
    max_length: int
    batch_size: int = 32
    text_column: str = "text"
    thresholds: list[float] | None = None
    """Multi-label: a label is predicted when its probability reaches its threshold; None: single-label."""
    precision: str = "auto"
    """Autocast of the forward passes: `auto` (bf16 on GPUs and CPUs that compute it), `fp32`, `bf16`."""
    prompter: Prompter | None = None
    """The prompt each text is read inside (a verbaliser-initialised run, `objective: lm`); None: the text
    as it is."""
    objective: Objective | None = None
    """How a batch becomes class probabilities (None: the model's classification head, `for_model`)."""
    int8: dict | None = None
    """With the decoder's linear layers in int8 (CPU): how it compared with fp32 on the run's test split."""
    label_type: str = "str"
    """`int`: `predict` gives labels as integers, as the training data had them (`label_value`)."""
    temperature: float = 1.0
    """The run's temperature (fitted on validation: `training/calibration.py`), applied to the probabilities
    of a single-label classifier; 1: none, or already folded into a merged export's head."""
    long_texts: str = "cut"
    """A text over `max_length` tokens: `cut` there, or read in overlapping windows of `max_length` tokens
    whose probabilities are averaged (`mean`) or, per label, the highest taken (`max`: "any part says X";
    single-label: then renormalised)."""
    stride: int | None = None
    """Tokens between the starts of two windows (None: half a window; at most a window)."""
    pass_tokens: int | None = None
    """Padded tokens per forward pass at most (None: passes of `batch_size` texts whatever their length); the
    server sets it on a CPU (`serve.CPU_PASS_TOKENS`)."""

    def __post_init__(self) -> None:
        if self.objective is None:
            self.objective = ClassificationHead.for_model(self.model)
        if self.long_texts not in LONG_TEXTS:
            raise LoraclsError(f"long texts are read as one of {list(LONG_TEXTS)}, not {self.long_texts!r}")

    def read_long_texts(self, how: str | None, stride: int | None) -> bool:
        """Read texts over `max_length` as `how` (`LONG_TEXTS`), windows `stride` tokens apart; None keeps
        what the classifier does now (the run's `long_texts`, `window_stride`). A stride for a classifier
        that cuts is refused rather than ignored. True when the reading changed."""
        how = self.long_texts if how is None else how
        if stride is not None and how == "cut":
            raise LoraclsError(
                f"--stride {stride} spaces the windows of --long-texts mean or max, and this classifier cuts "
                "long texts: add --long-texts mean (or max)"
            )
        stride = self.stride if stride is None else stride
        changed = (how, stride) != (self.long_texts, self.stride)
        self.long_texts, self.stride = how, stride
        self.__post_init__()
        return changed

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: torch.device | None = None,
        allow_unfinished: bool = False,
        int8: bool = False,
    ) -> Classifier:
        """A finished run folder (any run with `allow_unfinished`) or an export folder (merged or adapter);
        `int8`: its decoder's linear layers in int8 on the CPU, once they have matched fp32 on the test split
        (`int8_from_run`; an export carries the check `loracls export --int8` made)."""
        path = Path(path)
        if int8 and device is not None and device.type != "cpu":
            raise LoraclsError(f"--int8 is a CPU inference path; the device here is {device}")
        if int8:
            check_int8_cpu()
        if folder_kind(path) == "run":
            if int8:
                return int8_from_run(path, allow_unfinished)
            return cls.from_run(path, device, allow_unfinished)
        return cls.from_export(path, torch.device("cpu") if int8 else device, int8)

    @classmethod
    def from_run(
        cls,
        run_dir: str | Path,
        device: torch.device | None = None,
        allow_unfinished: bool = False,
        full_precision: bool = False,
    ) -> Classifier:
        """The run's best checkpoint as the run scored it: merged into the base, or for a QLoRA run on the
        4-bit base with LoRA unmerged (on the GPU it was placed on). `full_precision`: merged into the
        full-precision base whatever the run (what an export of a QLoRA run is)."""
        run = RunFolder(run_dir)
        run.check_finished(allow_unfinished)
        cfg, labels = run.read_config(), run.read_labels()
        quantize = None if full_precision else cfg.quantize
        if quantize and not four_bit_runs_here():
            console.print(
                f"{run_dir} trained LoRA on a 4-bit base (QLoRA), whose layers need a CUDA/ROCm GPU; this "
                "machine has none, so it runs merged into the full-precision base (what its export holds): "
                "scores may differ slightly from its metrics.json"
            )
            quantize = None
        model, tokenizer = merge_adapter(
            cfg.model,
            run.best,
            labels,
            cfg.trust_remote_code,
            cfg.allow_pickle,
            cfg.multi_label,
            quantize,
            cfg.objective,
            cfg.frozen_base,
        )
        if not quantize:  # a 4-bit model stays where bitsandbytes put it
            model = model.to(device or inference_device())
        model.config.pad_token_id = tokenizer.pad_token_id
        prompter = input_prompter(tokenizer, cfg, labels)
        return cls(
            model.eval(),
            tokenizer,
            labels,
            cfg.max_length,
            eval_batch_size(cfg.micro_batch_size),
            cfg.text_column,
            run_thresholds(run, labels) if cfg.multi_label else None,
            prompter=prompter,
            objective=objective_kind(cfg.objective).for_inference(model, prompter, labels),
            label_type=cfg.label_type,
            temperature=run_temperature(run),
            long_texts=cfg.long_texts,
            stride=cfg.window_stride,
        )

    @classmethod
    def from_export(
        cls, path: str | Path, device: torch.device | None = None, int8: bool = False
    ) -> Classifier:
        path = Path(path)
        info = read_export_info(path)
        if int8 and not (info.get("int8") or {}).get("passed"):
            raise LoraclsError(
                f"{path} was exported without an int8 check; "
                "export the run again with `loracls export --int8`"
            )
        objective = info.get("objective", "head")
        if info["merged"]:
            tokenizer = load_tokenizer(str(path))
            model = objective_kind(objective).load_export(str(path))
        else:
            multi_label = info.get("thresholds") is not None
            model, tokenizer = merge_adapter(
                info["base_model"],
                path,
                info["labels"],
                multi_label=multi_label,
                objective=objective,
                frozen_base=info.get("frozen_base", "fp32"),
            )
        prompter = None
        if info.get("prompt"):
            prompter = Prompter.from_json(tokenizer, info["prompt"], info["max_length"])
        if int8:
            int8_module.quantize(model.float().cpu(), load_file(path / INT8_RANGES))
        classifier = cls(
            model.to(device or inference_device()).eval(),
            tokenizer,
            info["labels"],
            info["max_length"],
            info["batch_size"],
            info["text_column"],
            info.get("thresholds"),
            prompter=prompter,
            objective=objective_kind(objective).for_inference(model, prompter, info["labels"]),
            label_type=info.get("label_type", "str"),
            temperature=1.0 if info.get("temperature_in_head") else info.get("temperature", 1.0),
            long_texts=info.get("long_texts", "cut"),
            stride=info.get("window_stride"),
        )
        if int8:
            classifier.precision, classifier.int8 = "fp32", info["int8"]
        return classifier

    def encode(self, texts: list[str], windows: bool = False) -> Dataset:
        """The texts as the model reads them (inside the run's prompt, if any), tokenised: `input_ids`;
        `windows`: a text over `max_length` tokens as `long_texts` reads it, a row per window (`owner`)."""
        table = pd.DataFrame({"text": texts, "label": self.labels[0]})
        how = self.long_texts if windows else "cut"
        label = {self.labels[0]: 0}
        return tokenize(table, self.tokenizer, self.max_length, label, self.prompter, None, how, self.stride)

    def predict_probs(self, texts: list[str], stage: str | None = None) -> np.ndarray:
        """Class probabilities of `texts`, in their order; a text over `max_length` tokens as `long_texts`
        says."""
        encoded = self.encode(texts, windows=True)
        return self.text_probs(self.probs(encoded, stage, calibrated=False), encoded)

    def text_probs(self, probs: np.ndarray, encoded: Dataset) -> np.ndarray:
        """Each text's probabilities from the uncalibrated ones of `encoded`'s rows (`encode(windows=True)`):
        a text's windows combined as `long_texts` says (`combine_windows`), then the run's temperature (it
        applies to a text, not to each window)."""
        if "owner" in encoded.column_names:
            probs = combine_windows(
                probs, np.array(encoded["owner"]), self.long_texts, self.thresholds is None
            )
        return with_temperature(probs, self.temperature) if self.thresholds is None else probs

    def window(self) -> int:
        """The text tokens the model reads of a text (`tokenization.window_tokens`)."""
        return window_tokens(self.tokenizer, self.max_length, self.prompter)

    def probs(self, dataset: Dataset, stage: str | None = None, calibrated: bool = True) -> np.ndarray:
        """Class probabilities of texts `encode` tokenised, in their order, with the run's temperature
        (`calibrated`); `stage` names a progress bar."""
        device = next(self.model.parameters()).device
        probs = predict_probs(
            self.model,
            dataset,
            self.tokenizer,
            self.batch_size,
            device,
            inference_autocast(device, self.precision),
            objective=self.objective,
            stage=stage,
            max_tokens=self.pass_tokens,
        )
        return with_temperature(probs, self.temperature) if calibrated and self.thresholds is None else probs

    @torch.inference_mode()
    def generate(self, texts: list[str], max_new_tokens: int = 64, stage: str | None = None) -> list[str]:
        """What an `objective: lm` model says after each text's prompt: greedy decoding of at most
        `max_new_tokens` tokens, one text at a time (no padding to get wrong), special tokens dropped;
        `stage` names a progress bar (None: none)."""
        if not self.objective.generates:
            raise LoraclsError("--generate needs a model trained with objective: lm (this one has a head)")
        device = next(self.model.parameters()).device
        answers = []
        with inference_autocast(device, self.precision), progress(stage, len(texts), "texts") as bar:
            for ids in self.prompter.encode(texts):
                prompt = torch.tensor([ids], device=device)
                out = self.model.generate(
                    input_ids=prompt,
                    attention_mask=torch.ones_like(prompt),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
                answers.append(self.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True).strip())
                bar.advance()
        return answers

    def predict(
        self, texts: list[str], stage: str | None = None, min_confidence: float | None = None
    ) -> list[dict]:
        """One record per text: the predicted `label` (multi-label: `labels`, every one at or above its
        threshold) and every label's probability. `min_confidence` (single-label): a text whose top
        probability is below it gets `label` None, and every record says whether it `abstained`. `stage`
        names a progress bar (None: none)."""
        check_min_confidence(min_confidence, self.thresholds is not None)
        probs = self.predict_probs(texts, stage)
        key = "label" if self.thresholds is None else "labels"
        predicted = predicted_labels(probs, self.labels, self.thresholds)
        unsure = abstains(probs, min_confidence)
        records = []
        for text, chosen, p, abstained in zip(texts, predicted, probs, unsure, strict=True):
            record = {"text": text, key: None if abstained else label_value(chosen, self.label_type)}
            if min_confidence is not None:
                record["abstained"] = bool(abstained)
            records.append(record | {"probabilities": rounded(p, self.labels)})
        return records


LONG_TEXTS = ("cut", "mean", "max")
"""How a text over the run's `max_length` tokens may be read (`Classifier.long_texts`; the config's
`long_texts`, and `--long-texts`' `cli_options.LongTexts`, offer the same)."""


MULTI_LABEL_CONFIDENCE = (
    "min_confidence applies to single-label classifiers; a multi-label one answers each label by its own "
    "threshold (thresholds.json, tuned on validation)"
)


def check_min_confidence(min_confidence: float | None, multi_label: bool) -> None:
    """`--min-confidence` is a probability, and a single-label classifier's: a multi-label one answers each
    label by its own tuned threshold instead."""
    if min_confidence is None:
        return
    if not 0.0 <= min_confidence <= 1.0:
        raise LoraclsError(f"min_confidence is a probability between 0 and 1, not {min_confidence}")
    if multi_label:
        raise LoraclsError(MULTI_LABEL_CONFIDENCE)


def run_temperature(run: RunFolder) -> float:
    """A single-label run's temperature (`temperature.json`, written after training); 1 without one."""
    fitted = run.file("temperature.json")
    return json.loads(fitted.read_text(encoding="utf-8"))["temperature"] if fitted.is_file() else 1.0


def run_thresholds(run: RunFolder, labels: list[str]) -> list[float]:
    """A multi-label run's tuned thresholds; 0.5 (what its validation used) before they are tuned."""
    tuned = run.file("thresholds.json")
    found = json.loads(tuned.read_text(encoding="utf-8")) if tuned.is_file() else {}
    return [found.get(name, 0.5) for name in labels]


def evaluate_run(
    run_dir: str | Path,
    data: str | None = None,
    allow_unfinished: bool = False,
    int8: bool = False,
    long_texts: str | None = None,
    stride: int | None = None,
) -> tuple[dict, Path]:
    """Score a run's best checkpoint, as the run scored it, on its test split (reproducing `metrics.json`)
    or on another labelled file; writes `RUN/eval/<name>/metrics.json` and `predictions.jsonl`
    (`int8`: with the int8 CPU path, into `RUN/eval/<name>-int8/`). `long_texts`, `stride`: read texts over
    max_length otherwise than the run does (`Classifier.long_texts`; into `<name>-windows-mean/` ...)."""
    run = RunFolder(Path(run_dir))
    run.check_finished(allow_unfinished)
    cfg = run.read_config()
    if data is None:
        table = run.read_split("test")
    else:
        table = read_labelled(data, cfg.text_column, cfg.label_column, separator(cfg))
    classifier = Classifier.load(run.path, allow_unfinished=allow_unfinished, int8=int8)
    name = (Path(data).stem if data else "test") + ("-int8" if int8 else "")
    if classifier.read_long_texts(long_texts, stride):
        how = classifier.long_texts
        name += "-cut" if how == "cut" else f"-windows-{how}" + (f"-{stride}" if stride else "")
    unknown = sorted(label_names(table["label"]) - set(classifier.labels))
    if unknown:
        raise LoraclsError(f"{data}: labels {unknown} are not among the run's labels {classifier.labels}")
    probs = classifier.predict_probs(list(table["text"]), "eval")
    thresholds = None if classifier.thresholds is None else np.array(classifier.thresholds)
    metrics = score_test(table, probs, classifier.labels, thresholds)
    out = run.file("eval") / name
    out.mkdir(parents=True, exist_ok=True)
    write_predictions_jsonl(
        out / "predictions.jsonl",
        table,
        probs,
        classifier.labels,
        thresholds=thresholds,
        label_type=classifier.label_type,
    )
    write_json(out / "metrics.json", metrics)
    return metrics, out


def int8_from_run(run_dir: str | Path, allow_unfinished: bool = False) -> Classifier:
    """The run's classifier on the CPU with its decoder's linear layers in int8 (`loracls.inference.int8`),
    refused unless it matches fp32 on the run's test split (`quantize_checked`)."""
    run = RunFolder(run_dir)
    run.check_finished(allow_unfinished)
    classifier = Classifier.from_run(run.path, torch.device("cpu"), allow_unfinished, full_precision=True)
    return quantize_checked(classifier, run)


def quantize_checked(classifier: Classifier, run: RunFolder) -> Classifier:
    """`classifier` (the run's, fp32 on the CPU) quantised in place, refused unless it matches fp32.

    The first call calibrates on the run's training texts and compares int8 with fp32 on (at most
    `PARITY_TEXTS` of) its test split; both results are kept in RUN/int8/ for the best checkpoint they were
    measured with: the adapter, the base model's weights, the recipe and the torch build (`int8.check_key`),
    so later calls with the same ones only quantise."""
    classifier.precision = "fp32"
    stored = run.file("int8")
    key = int8_module.check_key(
        resolve_model(run.read_config().model), sha256(run.best / "adapter_model.safetensors")
    )
    result = None
    if (stored / "parity.json").is_file():
        result = json.loads((stored / "parity.json").read_text(encoding="utf-8"))
    if result and all(result.get(name) == value for name, value in key.items()):
        int8_module.quantize(classifier.model, load_file(stored / "ranges.safetensors"))
    else:
        result, ranges = measure_int8(classifier, run)
        result |= key
        with atomic_folder(stored) as tmp:
            save_file(ranges, tmp / "ranges.safetensors")
            write_json(tmp / "parity.json", result)
    int8_module.check_parity(result, str(run.path))
    classifier.int8 = result
    return classifier


def measure_int8(classifier: Classifier, run: RunFolder) -> tuple[dict, dict[str, torch.Tensor]]:
    """Calibrate `classifier` (fp32, CPU) on the run's training texts, quantise it in place, and compare its
    test-split predictions with fp32's: the parity record and the input ranges."""
    train, test = run.read_split("train"), run.read_split("test").iloc[: int8_module.PARITY_TEXTS]
    calibration = train.sample(min(len(train), int8_module.CALIBRATION_TEXTS), random_state=0)
    ranges = int8_module.input_ranges(
        classifier.model, lambda: classifier.predict_probs(list(calibration["text"]), "int8 calibration")
    )
    texts = list(test["text"])
    reference = classifier.predict_probs(texts, "int8 check: fp32")
    int8_module.quantize(classifier.model, ranges)
    candidate = classifier.predict_probs(texts, "int8 check: int8")
    if classifier.thresholds is None:
        ids = {name: i for i, name in enumerate(classifier.labels)}
        gold, decide = np.array([ids[x] for x in test["label"]]), lambda p: p.argmax(-1)
    else:
        thresholds = np.array(classifier.thresholds)
        gold, decide = label_matrix(test, classifier.labels), lambda p: (p >= thresholds).astype(int)
    return int8_module.parity(decide(reference), decide(candidate), gold), ranges


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
