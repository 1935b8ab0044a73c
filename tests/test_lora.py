import pytest

from loracls.config import TrainConfig
from loracls.errors import LoraclsError
from loracls.lora import apply_lora, resolve_target_modules, trainable_summary
from loracls.model import load_classifier

LABELS = ["negative", "positive"]


@pytest.fixture
def gemma(tiny_models):
    return load_classifier(str(tiny_models["gemma3"]), LABELS)


def test_names_and_regex_resolve_to_the_same_modules(gemma):
    by_name = resolve_target_modules(gemma, "q_proj,v_proj")
    by_regex = resolve_target_modules(gemma, r"model\.layers\.\d+\.self_attn\.(q|v)_proj")
    assert by_name == by_regex
    assert by_name == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]


def test_selection_matching_nothing_lists_linear_modules(gemma):
    with pytest.raises(LoraclsError, match=r"matches no module.*down_proj.*q_proj"):
        resolve_target_modules(gemma, "query,value")


def test_embedding_selection_is_refused(gemma):
    # the write-up's wildcard matched embed_tokens only and trained for hours without effect
    with pytest.raises(LoraclsError, match=r"non-linear module\(s\) \(\w*Embedding"):
        resolve_target_modules(gemma, ".*embed_tokens")
    with pytest.raises(LoraclsError, match="non-linear"):
        resolve_target_modules(gemma, ".*norm")


def test_head_is_never_a_lora_target(gemma):
    assert "score" not in resolve_target_modules(gemma, ".*(proj|score)")


def test_head_is_trained_in_full_and_counted(gemma):
    model = apply_lora(gemma, TrainConfig(lora_r=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("score.modules_to_save" in n for n in trainable)
    assert all("lora_" in n or "score" in n for n in trainable)
    summary = trainable_summary(model)
    # 4 modules x r=4 x (in + out); the head is hidden 32 x 2 labels
    q_in, q_out, v_out = 32, 2 * 16, 1 * 16
    assert summary["lora"] == 2 * 4 * ((q_in + q_out) + (q_in + v_out))
    assert summary["head"] == 32 * 2
