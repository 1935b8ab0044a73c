"""Private APIs of our dependencies that loracls relies on, each pinned by a test that fails when the library
changes under it (pyproject.toml hides no Deprecation/FutureWarning about them either)."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from loracls.model import load_classifier


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
