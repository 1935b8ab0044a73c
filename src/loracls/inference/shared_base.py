"""Several classifiers on one base model (`loracls serve A B ...`): the base loads once, each classifier is
its LoRA adapter (unmerged, one of several in one `PeftModel`) and its own head, with any number of labels.

The base loads as a sequence classifier whose head is replaced by the identity, so that its output is the
pooled hidden state of each text's last token; a classifier's head (a `Linear` read from its adapter's
`score`/`classifier` weights) maps that to its labels. Each forward pass names the adapter of every row
(peft's `adapter_names`), so rows of different classifiers share one pass of the base (`probs_mixed`), and a
`Classifier` of one member (`ClassifierSet.classifiers`) scores, tokenises and predicts as a merged one does.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers.modeling_outputs import SequenceClassifierOutput

from loracls.data.batching import length_passes
from loracls.data.prompts import Prompter
from loracls.environment.devices import inference_autocast, inference_device
from loracls.environment.micro_batch import eval_batch_size
from loracls.errors import LoraclsError
from loracls.inference.export_format import folder_kind, read_export_info
from loracls.inference.predict import Classifier, run_temperature, run_thresholds
from loracls.lora import base_rounding, round_frozen_base
from loracls.model import head_name, load_tokenizer, resolve_model
from loracls.objective import ClassificationHead, input_prompter, objective_kind
from loracls.training.calibration import with_temperature
from loracls.training.runs import RunFolder


@dataclass
class Member:
    """One classifier as a run folder or an adapter export describes it, before anything loads."""

    name: str
    path: Path
    adapter: Path
    """The folder holding `adapter_config.json` and `adapter_model.safetensors` (a run's `best/`)."""
    base_model: str
    labels: list[str]
    max_length: int
    batch_size: int
    thresholds: list[float] | None
    label_type: str
    prompt: dict | None
    """An export's prompt (`Prompter.to_json`); a run's comes from its config (`run_cfg`)."""
    run_cfg: object | None = None
    temperature: float = 1.0
    """The run's temperature (`predict.run_temperature`), applied to a single-label member's probabilities."""
    trust_remote_code: bool = False
    allow_pickle: bool = False
    frozen_base: str = "fp32"
    """How the base's linears were rounded in training (`TrainConfig.frozen_base`): the shared base is too."""


def read_member(name: str, path: Path, allow_unfinished: bool = False) -> Member:
    """A run folder or an adapter export as one of several classifiers on a shared base; refused, with the
    reason, where it cannot share one: a merged export (it holds its own base), `objective: lm`, QLoRA."""
    if folder_kind(path) == "run":
        run = RunFolder(path)
        run.check_finished(allow_unfinished)
        cfg, labels = run.read_config(), run.read_labels()
        if cfg.quantize:
            refuse(
                name, path, "it trained on a 4-bit base (QLoRA), which the others' full-precision base is not"
            )
        objective = cfg.objective
        member = Member(
            name, path, run.best, cfg.model, labels, cfg.max_length, eval_batch_size(cfg.micro_batch_size),
            run_thresholds(run, labels) if cfg.multi_label else None, cfg.label_type, None, cfg,
            run_temperature(run), cfg.trust_remote_code, cfg.allow_pickle,
            base_rounding(cfg.frozen_base),
        )  # fmt: skip
    else:
        info = read_export_info(path)
        if info["merged"]:
            refuse(
                name,
                path,
                "a merged export holds its own copy of the base; export the run with --adapter-only",
            )
        objective = info.get("objective", "head")
        member = Member(
            name, path, path, info["base_model"], info["labels"], info["max_length"], info["batch_size"],
            info.get("thresholds"), info.get("label_type", "str"), info.get("prompt"), None,
            info.get("temperature", 1.0), frozen_base=info.get("frozen_base", "fp32"),
        )  # fmt: skip
    if objective != "head":
        refuse(name, path, f"objective: {objective} scores with the LM head, not a classification head")
    return member


def refuse(name: str, path: Path, why: str) -> None:
    raise LoraclsError(
        f"{name} ({path}) cannot share a base model with other classifiers: {why}; serve it alone"
    )


def check_same_base(members: list[Member]) -> str:
    """The one base model every member was trained on (as a resolved path or Hub id), its linears rounded
    alike (`frozen_base`); refused otherwise."""
    bases = {m.name: str(resolve_model(m.base_model)) for m in members}
    if len(set(bases.values())) > 1:
        listed = "; ".join(f"{name}: {base}" for name, base in bases.items())
        raise LoraclsError(
            f"the classifiers were trained on different base models ({listed}); one server shares one base: "
            "serve each base's classifiers in a server of their own"
        )
    rounded = {m.name: m.frozen_base for m in members}
    if len(set(rounded.values())) > 1:
        listed = "; ".join(f"{name}: {how}" for name, how in rounded.items())
        raise LoraclsError(
            f"the classifiers trained on the base's linears rounded differently (frozen_base {listed}); one "
            "server shares one base: serve them in servers of their own, or retrain with one --frozen-base"
        )
    return next(iter(bases.values()))


class MemberHead(torch.nn.Module):
    """One member as a sequence classifier: the shared base read through its adapter, then its head. What
    `Classifier` and `predict_probs` call (`model(**batch).logits`, `config.num_labels`)."""

    def __init__(self, shared: PeftModel, name: str, head: torch.nn.Linear, multi_label: bool) -> None:
        super().__init__()
        self.name, self.head = name, head
        self.shared = [shared]  # not a submodule: every member holds the same base
        self.config = copy.copy(shared.get_base_model().config)
        self.config.num_labels = head.out_features
        self.config.problem_type = (
            "multi_label_classification" if multi_label else "single_label_classification"
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_) -> SequenceClassifierOutput:
        pooled = pooled_states(self.shared[0], input_ids, attention_mask, [self.name] * len(input_ids))
        return SequenceClassifierOutput(logits=self.head(pooled.to(self.head.weight.dtype)))


def pooled_states(shared: PeftModel, input_ids, attention_mask, adapters: list[str]) -> torch.Tensor:
    """Each row's last-token hidden state under the adapter its row names (the head is the identity)."""
    return shared(input_ids=input_ids, attention_mask=attention_mask, adapter_names=adapters).logits


@dataclass
class ClassifierSet:
    """The classifiers on one loaded base: `classifiers[name]` scores like a merged `Classifier`."""

    shared: PeftModel
    classifiers: dict[str, Classifier]

    @classmethod
    def load(
        cls, members: list[Member], device: torch.device | None = None, precision: str = "auto"
    ) -> ClassifierSet:
        base_path = check_same_base(members)
        first = members[0]
        base = objective_kind("head").load(
            base_path,
            first.labels,
            trust_remote_code=first.trust_remote_code,
            allow_pickle=first.allow_pickle,
        )
        round_frozen_base(base, first.frozen_base)
        hidden = getattr(base, head_name(base)).in_features
        setattr(base, head_name(base), torch.nn.Identity())
        tokenizers = shared_tokenizers(members)
        pads = {m.name: t.pad_token_id for m, t in zip(members, tokenizers, strict=True)}
        if len(set(pads.values())) > 1:
            raise LoraclsError(
                f"the classifiers' tokenizers pad with different tokens ({pads}); they cannot share"
            )
        base.config.pad_token_id = tokenizers[0].pad_token_id
        shared, heads = None, {}
        for member in members:
            config, lora, head = read_adapter(member, hidden)
            if shared is None:
                shared = PeftModel(base, config, adapter_name=member.name)
            else:
                shared.add_adapter(member.name, config)
            loaded = set_peft_model_state_dict(shared, lora, adapter_name=member.name)
            if loaded.unexpected_keys:
                raise LoraclsError(
                    f"{member.name} ({member.adapter}): LoRA weights that fit no layer of {base_path}: "
                    f"{loaded.unexpected_keys[:3]}"
                )
            heads[member.name] = head
        shared = shared.to(device or inference_device()).eval()
        classifiers = {}
        for member, tokenizer in zip(members, tokenizers, strict=True):
            multi = member.thresholds is not None
            model = MemberHead(shared, member.name, heads[member.name].to(shared.device), multi).eval()
            classifiers[member.name] = Classifier(
                model, tokenizer, member.labels, member.max_length, member.batch_size,
                thresholds=member.thresholds, precision=precision,
                prompter=member_prompter(member, tokenizer), objective=ClassificationHead(multi_label=multi),
                label_type=member.label_type, temperature=member.temperature,
            )  # fmt: skip
        return cls(shared, classifiers)

    @torch.inference_mode()
    def probs_mixed(
        self,
        encoded: dict[str, list[list[int]]],
        batch_size: int,
        calibrated: bool = True,
        max_tokens: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Every member's probabilities of its texts (`encoded[name]`: token ids as `Classifier.encode` gives
        them), in their order, from shared forward passes of at most `batch_size` rows and `max_tokens`
        padded tokens (`length_passes`): rows of several classifiers (length-sorted) padded into one batch,
        each row read through its own adapter, then its own head; with each member's temperature
        (`calibrated`)."""
        rows = [(name, n, ids) for name, texts in encoded.items() for n, ids in enumerate(texts)]
        result = {name: np.zeros((len(texts), len(self.classifiers[name].labels)), np.float32)
                  for name, texts in encoded.items()}  # fmt: skip
        some = next(iter(self.classifiers.values()))
        device, pad = self.shared.device, some.tokenizer.pad_token_id
        with inference_autocast(device, some.precision):
            for indices in length_passes([len(row[2]) for row in rows], batch_size, max_tokens):
                chunk = [rows[i] for i in indices]
                ids = torch.full((len(chunk), max(len(r[2]) for r in chunk)), pad, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for n, (_, _, row) in enumerate(chunk):
                    ids[n, : len(row)], mask[n, : len(row)] = torch.tensor(row), 1
                pooled = pooled_states(self.shared, ids.to(device), mask.to(device), [r[0] for r in chunk])
                for name in {r[0] for r in chunk}:
                    picked = [n for n, r in enumerate(chunk) if r[0] == name]
                    model = self.classifiers[name].model
                    logits = model.head(pooled[picked].to(model.head.weight.dtype)).float()
                    multi = model.config.problem_type == "multi_label_classification"
                    probs = torch.sigmoid(logits) if multi else torch.softmax(logits, -1)
                    result[name][[chunk[n][1] for n in picked]] = probs.cpu().numpy()
        for name, classifier in self.classifiers.items():
            if calibrated and name in result and classifier.thresholds is None:
                result[name] = with_temperature(result[name], classifier.temperature)
        return result


def shared_tokenizers(members: list[Member]) -> list:
    """Each member's tokenizer, one object for the members whose tokenizer files are the same (runs on one
    base usually are): a Gemma tokenizer holds about 250 MB, more than 16 adapters and heads together."""
    loaded: dict[str, object] = {}
    tokenizers = []
    for member in members:
        digest = hashlib.sha256()
        for file in sorted(member.adapter.iterdir()):
            if file.is_file() and not file.name.startswith(("adapter_", "README")):
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
        key = digest.hexdigest()
        if key not in loaded:
            loaded[key] = load_tokenizer(str(member.adapter))
        tokenizers.append(loaded[key])
    return tokenizers


def read_adapter(member: Member, hidden: int) -> tuple[LoraConfig, dict, torch.nn.Linear]:
    """A member's LoRA config (without the head peft would save: the head is the member's own), its LoRA
    weights, and its head as a `Linear` from `hidden` to its labels."""
    config = LoraConfig.from_pretrained(str(member.adapter))
    config.modules_to_save, config.task_type, config.inference_mode = None, None, True
    weights = load_file(member.adapter / "adapter_model.safetensors")
    head_keys = {k for k in weights if k.split(".")[-2] in ("score", "classifier")}
    lora = {k: v for k, v in weights.items() if k not in head_keys}
    weight = next((weights[k] for k in head_keys if k.endswith(".weight")), None)
    if weight is None or weight.shape != (len(member.labels), hidden):
        raise LoraclsError(
            f"{member.name} ({member.adapter}): its adapter holds no head of {len(member.labels)} labels x "
            f"{hidden}"
        )
    bias = next((weights[k] for k in head_keys if k.endswith(".bias")), None)
    head = torch.nn.Linear(hidden, len(member.labels), bias=bias is not None)
    with torch.no_grad():
        head.weight.copy_(weight.float())
        if bias is not None:
            head.bias.copy_(bias.float())
    return config, lora, head


def member_prompter(member: Member, tokenizer) -> Prompter | None:
    """The prompt a member reads each text inside, as its run or export records it."""
    if member.run_cfg is not None:
        return input_prompter(tokenizer, member.run_cfg, member.labels)
    return Prompter.from_json(tokenizer, member.prompt, member.max_length) if member.prompt else None
