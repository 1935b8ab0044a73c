"""Export a finished run as a standalone model (LoRA merged) or as its adapter, and check the result."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

from loracls.console import progress
from loracls.data.prompts import Prompter
from loracls.environment.cpu import check_int8_cpu
from loracls.environment.doctor import package_version
from loracls.environment.micro_batch import eval_batch_size
from loracls.errors import LoraclsError
from loracls.files import atomic_folder, share_as_umask_allows
from loracls.inference.export_format import EXPORT_INFO, INT8_RANGES
from loracls.inference.predict import (
    Classifier,
    int8_from_run,
    quantize_checked,
    run_temperature,
    run_thresholds,
)
from loracls.lora import base_rounding
from loracls.model import head_name, load_tokenizer
from loracls.objective import input_prompter, objective_kind
from loracls.training.runs import RunFolder, write_json


def export_run(
    run_dir: str | Path,
    out: str | Path,
    adapter_only: bool = False,
    allow_unfinished: bool = False,
    int8: bool = False,
) -> Path:
    """Write `out`: by default the merged classifier (safetensors, config, tokenizer); else the adapter.

    The folder is built under `out.partial` and renamed only once it has been verified, so a failed or
    interrupted export never leaves a folder that looks usable. `loracls.json` (`EXPORT_INFO`) records what
    `Classifier.from_export` needs: labels, max_length, batch size, text column, base model, whether LoRA is
    merged (and into what), thresholds, and for a verbaliser-initialised run the prompt: its `prefix` +
    text + `suffix` is what the classifier reads (the text cut to max_length tokens first), and the saved
    tokenizer adds it to any text by itself (`prompt_in_tokenizer`), so raw texts are read as loracls reads
    them by `pipeline`, vLLM or any script that tokenises with special tokens (the default). An
    `objective: lm` run exports a causal LM (`AutoModelForCausalLM`) with `objective: "lm"` and each label's
    `label_tokens`: a text's class is the label whose tokens are likeliest after its prompt.

    `int8`: also check the int8 CPU path against fp32 on the run's test split (`int8_from_run`; refused if it
    does not match) and keep its calibration (`INT8_RANGES`, and the check as `int8` in `loracls.json`), so
    that `Classifier.load(export, int8=True)` and `--int8` only quantise.
    """
    if int8:
        check_int8_cpu()
    run = RunFolder(run_dir)
    run.check_finished(allow_unfinished)
    cfg, labels = run.read_config(), run.read_labels()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LoraclsError(f"{out} already exists and is not an empty folder; choose another --out")
    with atomic_folder(out, ".partial") as tmp:
        if adapter_only:
            shutil.copytree(run.best, tmp, dirs_exist_ok=True)
            prompter = input_prompter(load_tokenizer(str(run.best)), cfg, labels)
            in_tokenizer = prompter is not None and prompt_in_tokenizer(tmp, prompter)
        else:
            classifier, in_tokenizer = write_merged(run, tmp, labels, cfg.objective, allow_unfinished)
            prompter = classifier.prompter
        int8_check = None
        if int8:  # the merged fp32 classifier just saved, quantised in place: not loaded a second time
            checked = (
                int8_from_run(run.path, allow_unfinished)
                if adapter_only
                else quantize_checked(classifier, run)
            )
            int8_check = checked.int8
            shutil.copyfile(run.file("int8") / "ranges.safetensors", tmp / INT8_RANGES)
        write_json(
            tmp / EXPORT_INFO,
            {
                "merged": not adapter_only,
                "labels": labels,
                "label_type": cfg.label_type,
                "max_length": cfg.max_length,
                "long_texts": cfg.long_texts,
                "window_stride": cfg.window_stride,
                "batch_size": eval_batch_size(cfg.micro_batch_size),
                "text_column": cfg.text_column,
                "base_model": cfg.model,
                "frozen_base": base_rounding(cfg.frozen_base),
                "run": str(run.path.resolve()),
                "run_status": run.status(),
                "merged_into": "a full-precision base: the run trained LoRA on a 4-bit base (QLoRA)"
                if cfg.quantize and not adapter_only
                else None,
                "thresholds": run_thresholds(run, labels) if cfg.multi_label else None,
                "temperature": run_temperature(run),
                "temperature_in_head": not adapter_only and cfg.objective == "head",
                "prompt": prompter.to_json() if prompter else None,
                "tokenizer_adds_prompt": in_tokenizer,
                "objective": cfg.objective,
                "label_tokens": objective_kind(cfg.objective).label_tokens(prompter),
                "int8": int8_check,
                "loracls": package_version("loracls"),
            },
        )
        share_as_umask_allows(tmp)
    return out


def write_merged(
    run: RunFolder, folder: Path, labels: list[str], objective: str, allow_unfinished: bool
) -> tuple[Classifier, bool]:
    """Merge the run's LoRA into its base and save the model and tokenizer into `folder`, then check the
    files and reload them as users will. Returns the merged classifier and whether the saved tokenizer adds
    the prompt (`prompt_in_tokenizer`)."""
    with progress("export", 4, "steps") as stage:
        stage.update(at="merging LoRA into the base")
        classifier = Classifier.from_run(run.path, torch.device("cpu"), allow_unfinished, full_precision=True)
        fold_temperature(classifier, objective)
        stage.update(1, at="saving the merged model")
        classifier.model.save_pretrained(folder)
        classifier.tokenizer.save_pretrained(folder)
        prompter = classifier.prompter
        in_tokenizer = prompter is not None and prompt_in_tokenizer(folder, prompter)
        stage.update(2, at="checking its files")
        verify_export(folder, labels, objective)
        stage.update(3, at="the reload check (loading it as users will)")
        check_reload(folder, classifier)
        stage.update(4)
    return classifier, in_tokenizer


def fold_temperature(classifier: Classifier, objective: str) -> None:
    """A merged classifier's head divided by its run's temperature, so that every consumer of the export
    (`pipeline`, vLLM) reads the calibrated probabilities; the classifier then applies none of its own. An
    `objective: lm` export keeps its LM head (generation reads it): `loracls.json` carries the temperature."""
    if objective != "head" or classifier.temperature == 1.0:
        return
    head = getattr(classifier.model, head_name(classifier.model))
    with torch.no_grad():
        head.weight.div_(classifier.temperature)
        if head.bias is not None:
            head.bias.div_(classifier.temperature)
    classifier.temperature = 1.0


PROMPT_PARTS = ("LORACLS_PROMPT_PREFIX", "LORACLS_PROMPT_SUFFIX")
"""The names the saved tokenizer's post-processor gives the prompt's ids before and after the text."""


def prompt_in_tokenizer(folder: Path, prompter: Prompter) -> bool:
    """Make the tokenizer saved in `folder` read every text as `prompter` does: its post-processor (a
    `TemplateProcessing`, whose special tokens may hold several ids) puts the prompt's ids
    (`Prompter.around`: the special tokens, the prefix; the suffix) around the text's own whenever special
    tokens are added, which is what `tokenizer(text)`, `pipeline`, vLLM and text-embeddings-inference do.
    Truncation by the tokenizer cuts the text and keeps the prompt.

    transformers rebuilds a post-processor from `add_bos_token`/`add_eos_token` when the tokenizer's config
    names them, so those two keys are dropped (the prompt's ids hold the special tokens already).

    False, and the tokenizer left as it was, when it has no `tokenizer.json` (a slow tokenizer): its
    users must put the prompt around each text themselves (`loracls.json`'s `prompt`)."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return False
    before, after = prompter.around()
    backend = Tokenizer.from_file(str(file))
    single = " ".join([PROMPT_PARTS[0]] * bool(before) + ["$A"] + [PROMPT_PARTS[1]] * bool(after))
    backend.post_processor = processors.TemplateProcessing(
        single=single,
        pair=f"{single} $B:1",
        special_tokens=[
            {"id": name, "ids": ids, "tokens": [backend.id_to_token(i) for i in ids]}
            for name, ids in zip(PROMPT_PARTS, (before, after), strict=True)
            if ids
        ],
    )
    backend.save(str(file))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for key in ("add_bos_token", "add_eos_token"):
        config.pop(key, None)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    check_tokenizer(folder, prompter)
    return True


def check_tokenizer(folder: Path, prompter: Prompter) -> None:
    """Load the tokenizer saved in `folder` as users do and check that raw texts come out as `prompter`
    reads them."""
    probe = ["a short text", "a somewhat longer text to classify, with 标点 and digits 42"]
    got = AutoTokenizer.from_pretrained(str(folder))(probe)["input_ids"]
    if got != prompter.encode(probe):
        raise LoraclsError(
            f"Export to {folder} failed its tokenizer check: the saved tokenizer does not put the run's "
            f"prompt around a text as the run read it (ids {got[0]} against {prompter.encode(probe)[0]})"
        )


def verify_export(folder: Path, labels: list[str], objective: str = "head") -> None:
    """Fail loudly unless `folder` is a classifier: its config says so, its head was saved, no LoRA is left
    (`objective="lm"`: a causal LM, no LoRA left).

    Upstream tools have shipped merged classifiers whose head was silently dropped (the reloaded model then
    gets a fresh random head) or whose config still said `...ForCausalLM`.
    """
    problems = []
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    architecture = (config.get("architectures") or ["(none)"])[0]
    head = objective_kind(objective).trains_head
    wanted, kind = objective_kind(objective).architecture
    if not architecture.endswith(wanted):
        problems.append(f"config.json names architecture {architecture}, not a {kind}")
    id2label = config.get("id2label", {})
    if head and (
        [id2label.get(str(i)) for i in range(len(labels))] != labels or len(id2label) != len(labels)
    ):
        problems.append(f"config.json id2label {id2label} does not match the run's labels {labels}")
    if config.get("pad_token_id") is None and (config.get("text_config") or {}).get("pad_token_id") is None:
        problems.append("config.json has no pad_token_id (batched classification would fail)")
    shapes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})  # noqa: SIM118
    heads = {k: v for k, v in shapes.items() if k.split(".")[-2:-1] in (["score"], ["classifier"])}
    if head and not any(shape[0] == len(labels) for shape in heads.values()):
        problems.append(f"no classification head with {len(labels)} outputs among the saved weights")
    leftovers = [k for k in shapes if "lora_" in k or "modules_to_save" in k]
    if leftovers:
        problems.append(f"unmerged LoRA weights were saved (e.g. {leftovers[0]})")
    if not (folder / "tokenizer_config.json").is_file():
        problems.append("tokenizer_config.json is missing")
    if problems:
        raise LoraclsError(f"Export to {folder} failed its checks: " + "; ".join(problems))


def check_reload(folder: Path, classifier: Classifier) -> None:
    """Load `folder` the way users will (the objective's `load_as_users_do`) and compare the objective's
    class probabilities on probe texts with the merged model's.

    This catches what file checks cannot: weights saved under names the class does not load (they would be
    silently re-initialised) or a config that rebuilds a different model.
    """
    reloaded = dataclasses.replace(classifier, model=type(classifier.objective).load_as_users_do(str(folder)))
    probe = ["a short text", "a somewhat longer text to classify, with padding after the first"]
    gap = float(np.abs(classifier.predict_probs(probe) - reloaded.predict_probs(probe)).max())
    if not gap <= 1e-4:
        raise LoraclsError(
            f"Export to {folder} failed its reload check: class probabilities of the reloaded model differ "
            f"from the merged model's by {gap:.3g}. Some weights were not saved under the names the model "
            "loads."
        )
