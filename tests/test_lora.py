import pytest
import torch
from transformers import AutoConfig, Gemma4ForConditionalGeneration

from loracls.config import TrainConfig
from loracls.errors import LoraclsError
from loracls.lora import PRESETS, apply_lora, plan_for_model, plan_targets
from loracls.model import load_classifier
from tests.conftest import FAMILIES

LABELS = ["negative", "positive"]
FORBIDDEN = ("embed", "norm", "score", "lm_head", "vision", "audio", "tower")


@pytest.fixture
def gemma(tiny_models):
    return load_classifier(str(tiny_models["gemma3"]), LABELS)


def test_names_regex_and_preset_resolve_to_the_same_modules(gemma):
    by_preset = plan_targets(gemma, "attn-qv", r=4)
    by_name = plan_targets(gemma, "q_proj,v_proj", r=4)
    by_regex = plan_targets(gemma, r"model\.layers\.\d+\.self_attn\.(q|v)_proj", r=4)
    assert by_preset.modules == by_name.modules == by_regex.modules
    assert list(by_name.modules) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    # r x (in + out): q is 32 -> 2 heads x 16, v is 32 -> 1 kv head x 16
    assert by_name.modules["model.layers.0.self_attn.q_proj"] == 4 * (32 + 32)
    assert by_name.modules["model.layers.0.self_attn.v_proj"] == 4 * (32 + 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_presets_stay_inside_the_decoder_layers(tiny_models, family):
    model = load_classifier(str(tiny_models[family]), LABELS)
    plans = {preset: plan_targets(model, preset, r=4) for preset in PRESETS}
    for plan in plans.values():
        assert plan.modules and all(".layers." in name for name in plan.modules)
        assert not [name for name in plan.modules if any(word in name for word in FORBIDDEN)]
    assert {k.rsplit(".", 1)[-1] for k in plans["attn"].modules} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert set(plans["attn-qv"].modules) < set(plans["attn"].modules) < set(plans["all-linear"].modules)
    linear_in_layers = [
        n for n, m in model.named_modules() if ".layers." in n and isinstance(m, torch.nn.Linear)
    ]
    assert sorted(plans["all-linear"].modules) == sorted(linear_in_layers)
    assert plans["attn"].by_layer().keys() == {0, 1}


def test_gemma4_towers_are_never_targets(tiny_models):
    """On the full multimodal model a preset, and even a catch-all regex, reach only the language model."""
    config = AutoConfig.from_pretrained(tiny_models["gemma4mm"])
    model = Gemma4ForConditionalGeneration(config)
    model.score = torch.nn.Linear(32, 2)
    assert any("vision_tower" in n for n, _ in model.named_modules())
    for spec in ("all-linear", "attn", r".*_proj", r".*(q_proj|linear)"):
        plan = plan_targets(model, spec, r=4)
        assert plan.modules and all(n.startswith("model.language_model.layers.") for n in plan.modules)
    assert any("tower" in n for n in plan_targets(model, r".*_proj", r=4).ignored)


def test_selection_matching_nothing_lists_linear_modules(gemma):
    with pytest.raises(LoraclsError, match=r"matches no module.*down_proj.*q_proj.*presets: attn-qv"):
        plan_targets(gemma, "query,value", r=8)
    with pytest.raises(LoraclsError, match="not a valid regular expression"):
        plan_targets(gemma, "q_proj(", r=8)


def test_embeddings_norms_and_head_are_refused(gemma):
    # the write-up's wildcard matched embed_tokens only and trained for hours without effect
    with pytest.raises(LoraclsError, match=r"only modules outside the decoder layers: model\.embed_tokens"):
        plan_targets(gemma, ".*embed_tokens", r=8)
    with pytest.raises(LoraclsError, match=r"non-linear module\(s\) \(Gemma3RMSNorm"):
        plan_targets(gemma, ".*norm", r=8)
    with pytest.raises(LoraclsError, match=r"outside the decoder layers: score \(Linear\)"):
        plan_targets(gemma, "score", r=8)


def test_far_fewer_parameters_than_the_default_is_refused_unless_allowed(gemma):
    one_module = r"model\.layers\.0\.self_attn\.k_proj"  # 4 x 48 of the preset's 4 x 224
    with pytest.raises(LoraclsError, match=r"under 25% of the .* preset 'attn-qv' gives"):
        plan_targets(gemma, one_module, r=4)
    assert list(plan_targets(gemma, one_module, r=4, allow_few_targets=True).modules) == [
        "model.layers.0.self_attn.k_proj"
    ]


def test_head_is_trained_in_full_and_counted_as_planned(gemma):
    model, plan = apply_lora(gemma, TrainConfig(lora_r=4, target_modules="attn"))
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert any("score.modules_to_save" in n for n in trainable)
    assert all("lora_" in n or "score" in n for n in trainable)
    assert sum(v for n, v in trainable.items() if "lora_" in n) == plan.lora_parameters
    assert sum(v for n, v in trainable.items() if "score" in n) == plan.head_parameters == 32 * 2
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(plan.modules)


@pytest.mark.parametrize("family", ["gemma4mm", "llama"])
def test_plan_without_weights_equals_the_plan_on_the_loaded_model(tiny_models, family):
    loaded = plan_targets(load_classifier(str(tiny_models[family]), LABELS), "all-linear", r=8)
    skeleton = plan_for_model(str(tiny_models[family]), "all-linear", r=8)
    assert skeleton.modules == loaded.modules
    assert (skeleton.head_parameters, skeleton.base_parameters) == (
        loaded.head_parameters,
        loaded.base_parameters,
    )
