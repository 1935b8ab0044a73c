"""Wrap a classifier with LoRA adapters on exactly the modules the user meant, and train its head."""

from __future__ import annotations

import re
from collections import Counter

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model

from loracls.config import TrainConfig
from loracls.errors import LoraclsError
from loracls.model import head_name

REGEX_CHARACTERS = set("*+?[](){}|^$\\")


def parse_target_spec(spec: str) -> list[str] | str:
    """`q_proj,v_proj` becomes a list of names; anything with regex characters stays one pattern."""
    spec = spec.strip()
    if not spec:
        raise LoraclsError("target_modules is empty; e.g. --target-modules q_proj,v_proj")
    if REGEX_CHARACTERS & set(spec):
        try:
            re.compile(spec)
        except re.error as e:
            raise LoraclsError(f"target_modules {spec!r} is not a valid regular expression: {e}") from None
        return spec
    return [name.strip() for name in spec.split(",") if name.strip()]


def matches(module_name: str, spec: list[str] | str) -> bool:
    """PEFT's rule: a list matches the full name or its last dotted parts; a string must match fully."""
    if isinstance(spec, str):
        return re.fullmatch(spec, module_name) is not None
    return any(module_name == name or module_name.endswith("." + name) for name in spec)


def resolve_target_modules(model: torch.nn.Module, spec: str) -> list[str]:
    """The full names of the modules that will get LoRA; refuse selections that cannot work.

    The head is excluded (it is trained in full through `modules_to_save`). A selection that matches
    nothing, or that reaches embeddings or norms, is refused: LoRA on `embed_tokens` alone trains a few
    hundred thousand parameters that barely move a classifier, and nothing says so.
    """
    pattern = parse_target_spec(spec)
    head = head_name(model)
    candidates = {n: m for n, m in model.named_modules() if n and n != head and not n.startswith(head + ".")}
    chosen = [n for n in candidates if matches(n, pattern)]
    linear_kinds = sorted(
        Counter(n.rsplit(".", 1)[-1] for n, m in candidates.items() if isinstance(m, torch.nn.Linear))
    )
    if not chosen:
        raise LoraclsError(
            f"target_modules {spec!r} matches no module. Linear modules of this model: "
            f"{', '.join(linear_kinds)}"
        )
    not_linear = [n for n in chosen if not isinstance(candidates[n], torch.nn.Linear)]
    if not_linear:
        kinds = sorted({type(candidates[n]).__name__ for n in not_linear})
        raise LoraclsError(
            f"target_modules {spec!r} reaches {len(not_linear)} non-linear module(s) "
            f"({', '.join(kinds)}; e.g. "
            f"{not_linear[0]}). LoRA belongs on linear layers: choose from {', '.join(linear_kinds)}."
        )
    return chosen


def apply_lora(model: torch.nn.Module, cfg: TrainConfig) -> PeftModel:
    """Add LoRA to the resolved targets; the head is named in `modules_to_save` so it is trained and saved."""
    targets = resolve_target_modules(model, cfg.target_modules)
    lora_config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        modules_to_save=[head_name(model)],
        bias="none",
    )
    return get_peft_model(model, lora_config)


def trainable_summary(model: torch.nn.Module) -> dict[str, int | float]:
    """Trainable LoRA and head parameters, and their share of the whole model."""
    lora = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {
        "lora": lora,
        "head": trainable - lora,
        "trainable": trainable,
        "total": total,
        "share": trainable / total,
    }
