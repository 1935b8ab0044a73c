"""Private APIs of our dependencies that loracls relies on, each pinned by a test that fails when the library
changes under it (pyproject.toml hides no Deprecation/FutureWarning about them either)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import parse_flag_from_env
from accelerate.utils.memory import should_reduce_batch_size
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
    PreTrainedModel,
)
from transformers.modeling_layers import GenericForSequenceClassification
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    MODEL_MAPPING,
)
from transformers.models.gemma4.modeling_gemma4 import Gemma4PreTrainedModel
from transformers.quantizers.quantizer_gguf import GgufHfQuantizer
from transformers.utils.quantization_config import GgufConfig

from loracls.inference.int8 import check_key
from loracls.model import empty_classifier, generic_classifier_class, load_classifier


def test_accelerator_state_reset_lets_the_next_run_choose_its_precision():
    """`train_into` calls `AcceleratorState._reset_state()`: a sweep or a test runs several trainings in one
    process, and accelerate otherwise keeps the first one's mixed precision for all later ones."""
    AcceleratorState._reset_state()
    assert Accelerator(cpu=True, mixed_precision="no").mixed_precision == "no"
    AcceleratorState._reset_state()
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    AcceleratorState._reset_state()


def test_weight_conversions_off_keeps_the_text_model_names_on_save(tiny_models, tmp_path):
    """`load_classifier` sets `model._weight_conversions = None` on a multimodal checkpoint's language model:
    transformers would otherwise undo the key mapping on save and write `model.language_model.*` keys that the
    text-only classifier cannot load back."""
    model = load_classifier(str(tiny_models["gemma4mm"]), ["a", "b"])
    assert hasattr(model, "_weight_conversions") and model._weight_conversions is None
    model.save_pretrained(tmp_path)
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert keys and not any("language_model" in key for key in keys)
    assert "model.embed_tokens.weight" in keys and any(key.startswith("score.") for key in keys)
    reloaded = type(model).from_pretrained(tmp_path, dtype=torch.float32)
    torch.testing.assert_close(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_from_config_builds_the_classifier_on_the_meta_device(tiny_models):
    """`model.empty_classifier` calls `cls._from_config(config)` inside accelerate's `init_empty_weights`: the
    classifier's names and shapes (for `loracls doctor --model` and target planning), no weights allocated."""
    assert hasattr(PreTrainedModel, "_from_config"), (
        "transformers' PreTrainedModel has no _from_config: loracls.model.empty_classifier calls it"
    )
    for family in ("llama", "gemma4mm"):  # transformers' own class; a multimodal checkpoint's text model
        model = empty_classifier(str(tiny_models[family]), ["a", "b", "c"])
        devices = {p.device.type for p in model.parameters()}
        assert devices == {"meta"}, f"empty_classifier ({family}): _from_config put weights on {devices}"
        assert model.score.weight.shape == (3, 32) and model.config.num_labels == 3


def test_int_mm_multiplies_int8_exactly_with_the_transposed_weight():
    """`int8.Int8Linear.forward` calls `torch._int_mm(rows, weight_t)`: int8 x int8 -> exact int32, with the
    weight stored transposed (a non-contiguous view) and any number of rows (a single token's included)."""
    assert hasattr(torch, "_int_mm"), (
        "torch has no _int_mm: loracls.inference.int8.Int8Linear.forward calls it"
    )
    generator = torch.Generator().manual_seed(0)
    weight_t = torch.randint(-127, 128, (48, 32), dtype=torch.int8, generator=generator).t()
    assert not weight_t.is_contiguous()
    for rows in (1, 5, 17):
        x = torch.randint(-127, 128, (rows, 32), dtype=torch.int8, generator=generator)
        y = torch._int_mm(x, weight_t)
        assert y.dtype == torch.int32 and torch.equal(y, x.int() @ weight_t.int()), (
            f"torch._int_mm ({rows} rows) is no longer int8 x int8 -> exact int32: inference.int8.Int8Linear"
        )


def test_torch_config_names_the_onednn_version(tiny_models):
    """`int8.check_key` reads the oneDNN version out of `torch.__config__.show()` (no public API gives it):
    a stored int8 parity check is measured again when torch's int8 kernels change."""
    key = check_key(str(tiny_models["llama"]), "0" * 64)
    assert key["onednn"] and key["onednn"].startswith("v"), (
        "loracls.inference.int8.check_key found no 'oneDNN vX' / 'MKL-DNN vX' in torch.__config__.show(): "
        + torch.__config__.show()[:300]
    )
    assert key["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_clearing_hf_quantizer_lets_a_dequantised_model_save(tiny_models, tmp_path):
    """`model.convert_gguf` sets `model.hf_quantizer = None` and `model.is_quantized = False` on a model
    transformers de-quantised from GGUF: its quantiser is not serialisable, so save_pretrained refuses (and
    `.float()` refuses a model marked quantized) until both are cleared."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    model.hf_quantizer = GgufHfQuantizer(GgufConfig(dequantize=True))
    model.config.quantization_config = model.hf_quantizer.quantization_config
    model.is_quantized = True
    for refused in (lambda: model.save_pretrained(tmp_path / "refused"), model.float):
        try:
            refused()
        except ValueError as error:
            assert "not serializable" in str(error) or "not supported for quantized model" in str(error)
        else:
            pytest.fail(
                "transformers no longer refuses a model whose hf_quantizer is not serialisable (or that is "
                "marked is_quantized): loracls.model.convert_gguf clears these two attributes; check what "
                "save_pretrained and .float() read now"
            )
    model.hf_quantizer = None  # what convert_gguf does
    model.is_quantized = False
    del model.config.quantization_config
    model.save_pretrained(tmp_path / "saved")
    assert model.float() is model
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert not hasattr(reloaded.config, "quantization_config")
    torch.testing.assert_close(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_should_reduce_batch_size_knows_each_backends_out_of_memory():
    """`micro_batch.fits_on_device` asks accelerate's `should_reduce_batch_size` whether an exception is an
    out-of-memory error (any backend: "no, it does not fit") or a bug to raise."""
    try:
        torch.empty(2**62, dtype=torch.uint8)  # a real CPU allocation failure, raised at once
    except RuntimeError as error:
        cpu = error
    messages = [
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "HIP out of memory. Tried to allocate 2.00 GiB",
        "MPS backend out of memory (MPS allocated: 1.00 GB)",
    ]
    for error in [cpu, torch.OutOfMemoryError(messages[0]), *map(RuntimeError, messages[1:])]:
        assert should_reduce_batch_size(error), f"micro_batch.fits_on_device would raise this OOM: {error}"
    for error in [
        ValueError("CUDA out of memory."),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
    ]:
        assert not should_reduce_batch_size(error), f"micro_batch.fits_on_device hides: {error}"


def test_parse_flag_from_env_reads_the_fsdp_flag(monkeypatch):
    """`train.check_requirements` refuses --quantize under FSDP when accelerate's `parse_flag_from_env` says
    ACCELERATE_USE_FSDP is set (`accelerate launch --use_fsdp` sets it to "true")."""
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert parse_flag_from_env("ACCELERATE_USE_FSDP") is False
    for value, expected in [("true", True), ("True", True), ("1", True), ("false", False), ("0", False)]:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", value)
        assert parse_flag_from_env("ACCELERATE_USE_FSDP") is expected, (
            f"accelerate's parse_flag_from_env({value!r}) changed: training.train.check_requirements reads it"
        )


def test_the_auto_mappings_are_keyed_as_model_py_reads_them():
    """`model.classifier_class`, `generic_classifier_class` and `check_remote_code` import transformers'
    auto mappings from their modules (transformers.models.auto.*), look models up by config class and configs
    by `model_type`, and mix `GenericForSequenceClassification` into a backbone's PreTrainedModel."""
    assert MODEL_MAPPING[LlamaConfig] is LlamaModel, "loracls.model.generic_classifier_class: MODEL_MAPPING"
    assert MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[LlamaConfig] is LlamaForSequenceClassification
    assert MODEL_FOR_CAUSAL_LM_MAPPING[LlamaConfig] is LlamaForCausalLM, "loracls.model: causal LM mapping"
    assert "llama" in CONFIG_MAPPING and "no-such-model" not in CONFIG_MAPPING, (
        "loracls.model.check_remote_code: CONFIG_MAPPING is no longer keyed by model_type"
    )
    cls = generic_classifier_class(Gemma4TextConfig)  # transformers has no Gemma 4 text classifier
    assert issubclass(cls, GenericForSequenceClassification) and issubclass(cls, Gemma4PreTrainedModel)
