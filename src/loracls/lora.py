"""Wrap a classifier with LoRA adapters on exactly the modules the user meant, and train its head."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from rich.table import Table

from loracls.config import TrainConfig
from loracls.console import console
from loracls.errors import LoraclsError
from loracls.model import empty_classifier, head_name, resolve_model
from loracls.objective import objective_kind

PRESETS: dict[str, tuple[str, ...] | None] = {
    "attn-qv": ("q_proj", "v_proj"),
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all-linear": None,
}
"""Named selections, always within the language model's decoder layers; `None` means every linear layer
there (attention, MLP and, for Gemma 4, the per-layer-input projections)."""

DEFAULT_PRESET = "attn-qv"
FEW_CLASSES = 3
"""`target_modules: auto` gives up to this many classes `attn-qv`, and more classes `all-linear` at
`MANY_CLASSES_RANK` (benchmarks/README.md, "LoRA's capacity by the number of classes")."""
MANY_CLASSES_PRESET, MANY_CLASSES_RANK, DEFAULT_RANK = "all-linear", 16, 8
MIN_SHARE_OF_DEFAULT = 0.25
"""A selection with fewer LoRA parameters than this share of the default preset's is refused."""

REGEX_CHARACTERS = set("*+?[](){}|^$\\")
TOWER_WORDS = ("vision", "audio", "encoder", "tower")


def parse_target_spec(spec: str) -> list[str] | str:
    """`q_proj,v_proj` becomes a list of names; anything with regex characters stays one pattern."""
    spec = spec.strip()
    if not spec:
        raise LoraclsError("target_modules is empty; e.g. --target-modules attn-qv or q_proj,v_proj")
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


def decoder_layers(model: torch.nn.Module) -> str:
    """The name of the language model's `layers` ModuleList (the largest outside any vision/audio tower)."""
    lists = [
        (sum(p.numel() for p in module.parameters()), name)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        and name.rsplit(".", 1)[-1] == "layers"
        and not any(word in name for word in TOWER_WORDS)
    ]
    if not lists:
        raise LoraclsError(
            f"{type(model).__name__} has no `layers` list of decoder layers; loracls cannot place LoRA on it"
        )
    return max(lists)[1]


@dataclass
class TargetPlan:
    """The modules that get LoRA and what that costs, worked out before any adapter is created."""

    target_modules: str
    modules: dict[str, int]
    """Full module name -> its LoRA parameters; all are linear layers inside the decoder layers."""
    head_parameters: int
    base_parameters: int
    ignored: list[str] = field(default_factory=list)
    """Modules the user's selection also matched outside the decoder layers, left without LoRA."""

    @property
    def lora_parameters(self) -> int:
        return sum(self.modules.values())

    @property
    def trainable(self) -> int:
        return self.lora_parameters + self.head_parameters

    @property
    def share(self) -> float:
        """Trainable parameters as a share of the base model's."""
        return self.trainable / self.base_parameters

    def by_layer(self) -> dict[int, dict[str, int]]:
        """`{0: {"self_attn.q_proj": 13312, ...}, ...}`: each decoder layer's targets and their LoRA sizes."""
        layers: dict[int, dict[str, int]] = {}
        for name, count in self.modules.items():
            index = re.search(r"layers\.(\d+)\.", name).group(1)
            layers.setdefault(int(index), {})[name.split(f"layers.{index}.", 1)[1]] = count
        return layers

    def layer_groups(self) -> list[tuple[str, list[str], int]]:
        """Runs of consecutive layers with equal targets: ("0-17", ["self_attn.q_proj", ...], per layer)."""
        groups: list[tuple[list[int], dict[str, int]]] = []
        for index, targets in sorted(self.by_layer().items()):
            if groups and groups[-1][1] == targets and groups[-1][0][-1] == index - 1:
                groups[-1][0].append(index)
            else:
                groups.append(([index], targets))
        return [
            (f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0]), list(targets), sum(targets.values()))
            for ids, targets in groups
        ]

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "lora_parameters": self.lora_parameters,
            "trainable": self.trainable,
            "share": self.share,
            "by_layer": self.by_layer(),
        }


def targets_line(plan: TargetPlan) -> str:
    """One line for the start of a run: how many modules of which kinds, and what is trained."""
    kinds = sorted({name.rsplit(".", 1)[-1] for name in plan.modules})
    return (
        f"LoRA on {len(plan.modules)} modules ({', '.join(kinds)} in {len(plan.by_layer())} layers); "
        f"trainable {plan.trainable:,} (LoRA {plan.lora_parameters:,} + head {plan.head_parameters:,}) "
        f"= {plan.share:.3%} of {plan.base_parameters:,}"
    )


def targets_table(plan: TargetPlan, title: str = "") -> Table:
    """The plan by layer: runs of layers with the same targets, and their LoRA parameters per layer."""
    table = Table("layers", "modules with LoRA", "LoRA parameters per layer", title=title or None)
    for layers, names, count in plan.layer_groups():
        table.add_row(layers, ", ".join(names), f"{count:,}")
    return table


def lora_parameters(model: torch.nn.Module, names: list[str], r: int) -> dict[str, int]:
    """r x (in + out) per module: the A and B matrices LoRA adds to each linear layer."""
    modules = dict(model.named_modules())
    return {n: r * (modules[n].in_features + modules[n].out_features) for n in names}


def select(model: torch.nn.Module, spec: str) -> tuple[list[str], list[str]]:
    """(targets, ignored): the linear modules in the decoder layers it names, and its matches outside."""
    layers = decoder_layers(model) + "."
    modules = dict(model.named_modules())
    linear = [n for n, m in modules.items() if n.startswith(layers) and isinstance(m, torch.nn.Linear)]
    kinds = ", ".join(sorted(Counter(n.rsplit(".", 1)[-1] for n in linear)))
    if spec in PRESETS:
        wanted = PRESETS[spec]
        chosen = [n for n in linear if wanted is None or n.rsplit(".", 1)[-1] in wanted]
        if not chosen:
            raise LoraclsError(
                f"Preset {spec!r} ({', '.join(wanted)}) matches nothing in this model's decoder layers. "
                f"Linear modules there: {kinds}"
            )
        return chosen, []
    pattern = parse_target_spec(spec)
    matched = [n for n in modules if n and matches(n, pattern)]
    inside = [n for n in matched if n.startswith(layers)]
    not_linear = [n for n in inside if not isinstance(modules[n], torch.nn.Linear)]
    if not_linear:
        raise LoraclsError(
            f"target_modules {spec!r} reaches {len(not_linear)} non-linear module(s) "
            f"({', '.join(sorted({type(modules[n]).__name__ for n in not_linear}))}; e.g. {not_linear[0]}). "
            f"LoRA belongs on linear layers: choose from {kinds}, or a preset ({', '.join(PRESETS)})."
        )
    outside = [n for n in matched if not n.startswith(layers)]
    if not inside:
        if outside:
            found = ", ".join(f"{n} ({type(modules[n]).__name__})" for n in outside[:4])
            raise LoraclsError(
                f"target_modules {spec!r} matches only modules outside the decoder layers: {found}. "
                "LoRA on embeddings, norms or the head trains a small fraction of the parameters and barely "
                f"moves a classifier. Choose from {kinds}, or a preset ({', '.join(PRESETS)})."
            )
        raise LoraclsError(
            f"target_modules {spec!r} matches no module. Linear modules in the decoder layers: {kinds}; "
            f"presets: {', '.join(PRESETS)}"
        )
    return inside, outside


def plan_targets(
    model: torch.nn.Module, spec: str, r: int, allow_few_targets: bool = False, head_trained: bool = True
) -> TargetPlan:
    """Resolve `spec` (a preset, names or a regex) to exact module names; refuse selections that cannot work.

    Only linear layers inside the language model's decoder layers are ever chosen: never the embeddings,
    the norms, the head (trained in full through `modules_to_save`) or a vision/audio tower. A selection
    that trains far fewer LoRA parameters than the default preset is refused unless `allow_few_targets`:
    a wildcard that catches one module trains for hours without moving the accuracy. `head_trained`: the
    model has a new classification head, trained in full (not under `objective: lm`).
    """
    chosen, ignored = select(model, spec)
    modules = lora_parameters(model, chosen, r)
    lora = sum(modules.values())
    if spec != DEFAULT_PRESET and not allow_few_targets:
        try:
            default = sum(lora_parameters(model, select(model, DEFAULT_PRESET)[0], r).values())
        except LoraclsError:
            default = 0
        if lora < MIN_SHARE_OF_DEFAULT * default:
            raise LoraclsError(
                f"target_modules {spec!r} gives {lora:,} LoRA parameters on {len(chosen)} module(s), "
                f"under {MIN_SHARE_OF_DEFAULT:.0%} of the {default:,} that preset {DEFAULT_PRESET!r} gives. "
                "Widen the selection, or set allow_few_targets=true if this is intended."
            )
    if ignored:
        console.print(
            f"[yellow]target_modules {spec!r} also matches {len(ignored)} module(s) outside the decoder "
            f"layers (e.g. {ignored[0]}); they get no LoRA[/]"
        )
    head = getattr(model, head_name(model)) if head_trained else torch.nn.Module()
    return TargetPlan(
        target_modules=spec,
        modules=modules,
        head_parameters=sum(p.numel() for p in head.parameters()),
        base_parameters=sum(p.numel() for p in model.parameters()),
        ignored=ignored,
    )


def plan_for_model(
    model: str,
    spec: str,
    r: int,
    num_labels: int = 2,
    allow_few_targets: bool = False,
    trust_remote_code: bool = False,
) -> TargetPlan:
    """`plan_targets` for a model name or path, without loading its weights (the model is built on meta)."""
    labels = [f"label_{i}" for i in range(num_labels)]
    skeleton = empty_classifier(resolve_model(model), labels, trust_remote_code)
    return plan_targets(skeleton, spec, r, allow_few_targets)


def resolve_capacity(cfg: TrainConfig, classes: int) -> str | None:
    """Settle `target_modules: auto`, an unset `lora_r` and `lora_alpha` for a task of `classes` classes, in
    `cfg`; returns a line saying what `auto` chose and why (None when nothing was `auto`)."""
    chose = cfg.target_modules == "auto"
    many = classes > FEW_CLASSES
    if chose:
        cfg.target_modules = MANY_CLASSES_PRESET if many else DEFAULT_PRESET
    if cfg.lora_r is None:
        cfg.lora_r = MANY_CLASSES_RANK if chose and many else DEFAULT_RANK
    if cfg.lora_alpha is None:
        cfg.lora_alpha = 2 * cfg.lora_r
    if not chose:
        return None
    why = f"more than {FEW_CLASSES} classes" if many else f"{FEW_CLASSES} classes or fewer"
    return (
        f"LoRA capacity (target_modules: auto): {cfg.target_modules} at rank {cfg.lora_r} for {classes} "
        f"classes ({why}; --target-modules and --lora-r choose)"
    )


def apply_lora(model: torch.nn.Module, cfg: TrainConfig) -> tuple[PeftModel, TargetPlan]:
    """Add LoRA to the planned targets; a classifier's head is named in `modules_to_save` so it is trained
    and saved (under `objective: lm` the LM head stays frozen: LoRA alone is trained). A `cfg` not yet
    through `resolve_capacity` (training does it with the task's labels) is resolved here with the head's
    number of classes."""
    head = objective_kind(cfg.objective).trains_head
    resolve_capacity(cfg, model.config.num_labels)
    plan = plan_targets(model, cfg.target_modules, cfg.lora_r, cfg.allow_few_targets, head_trained=head)
    lora_config = LoraConfig(
        task_type=TaskType.SEQ_CLS if head else TaskType.CAUSAL_LM,
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(plan.modules),
        modules_to_save=[head_name(model)] if head else None,
        bias="none",
    )
    return get_peft_model(model, lora_config), plan


FROZEN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""`frozen_base` values that round the base's decoder linears; `fp32`, and `auto` as a run folder from before
the key existed reads it, leave them as loaded."""


def base_rounding(frozen_base: str) -> str:
    """What a run's `frozen_base` rounds the base's linears to: `bf16`, `fp16`, or `fp32` (also for `auto`,
    which only a run folder from before the key was resolved holds)."""
    return frozen_base if frozen_base in FROZEN_DTYPES else "fp32"


def keep_frozen_base(
    model: torch.nn.Module, frozen_base: str, computes: torch.dtype | None
) -> tuple[str, int]:
    """Resolve `frozen_base` (`auto`: the 16-bit dtype autocast `computes` in, else fp32) and keep the
    decoder's frozen linears so: stored in it where autocast computes in it (the same numbers, no cast per
    weight per forward), else rounded to it and kept in fp32 (a resume on another device; FSDP, QLoRA:
    `computes` None). Returns the resolved value and how many weights were stored in 16 bits."""
    stores = {dtype: name for name, dtype in FROZEN_DTYPES.items()}.get(computes)
    if frozen_base == "auto":
        frozen_base = stores or "fp32"
    if frozen_base == stores:
        return frozen_base, frozen_linears_in(model, FROZEN_DTYPES[frozen_base])
    round_frozen_base(model, frozen_base)
    return frozen_base, 0


def round_frozen_base(model: torch.nn.Module, frozen_base: str) -> None:
    """The base's decoder linears rounded as a run with this `frozen_base` trained on them, kept in fp32:
    LoRA then merges into exactly the weights it was trained against. A base just loaded (its weights not yet
    frozen) is rounded alike."""
    dtype = FROZEN_DTYPES.get(frozen_base)
    if dtype is not None:
        frozen_linears_in(model, dtype, unfrozen=True)
        frozen_linears_in(model, torch.float32, unfrozen=True)


def frozen_linears_in(model: torch.nn.Module, dtype: torch.dtype, unfrozen: bool = False) -> int:
    """Store the decoder layers' frozen linear weights (and biases) in `dtype`, the dtype autocast computes
    them in; returns how many weights were cast. Under autocast every frozen fp32 weight is cast again on
    each forward (autocast caches only the casts of trainable leaves) and the copy is held for the backward;
    stored in `dtype` they are read as they are. The numbers do not change: autocast's cast and this one
    round alike. LoRA's matrices, the head and anything trainable stay fp32; so do the embeddings, whose
    lookup autocast leaves in fp32 (a 16-bit table would start the residual stream in 16 bits), and 4-bit
    (QLoRA) layers, which are not float weights. `unfrozen`: also linears whose weights require grad."""
    layers = model.get_submodule(decoder_layers(model))
    cast = 0
    for name, module in layers.named_modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype == dtype or ".lora_" in f".{name}":
            continue
        if not unfrozen and any(p.requires_grad for p in module.parameters()):
            continue
        module.to(dtype)
        cast += 1
    return cast


def linears_as_computed(model: torch.nn.Module, device_type: str) -> int:
    """Inside an autocast context: store a model that only reads (the prompt search's and the baseline's LM)
    with its decoder linears in the dtype autocast computes them in, the same numbers without a cast per
    weight per forward (`frozen_linears_in`); returns how many were cast (0 outside autocast)."""
    if not torch.is_autocast_enabled(device_type):
        return 0
    return frozen_linears_in(model, torch.get_autocast_dtype(device_type), unfrozen=True)
