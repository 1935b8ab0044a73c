import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loracls.errors import LoraclsError
from loracls.model import (
    fix_tokenizer,
    generic_classifier_class,
    gguf_model,
    load_classifier,
    load_tokenizer,
    load_tokenizer_for,
    quantized_compute_dtype,
    resolve_model,
)
from tests.conftest import FAMILIES, char_tokenizer, invoke, write_tiny_gguf

LABELS = ["negative", "positive"]


def test_missing_pad_and_unk_come_from_eos():
    tokenizer = char_tokenizer(with_pad_and_unk=False)
    changed = fix_tokenizer(tokenizer)
    assert tokenizer.pad_token == tokenizer.eos_token == "<eos>"
    assert tokenizer.unk_token == "<eos>"
    assert len(changed) == 2 and tokenizer.padding_side == "right"


def test_slow_tokenizer_is_the_fallback(tiny_models, monkeypatch):
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained
    calls = []

    def fast_fails(path, **kwargs):
        calls.append(kwargs.get("use_fast", True))
        if kwargs.get("use_fast", True):
            raise ValueError("tokenizer.json is incomplete")
        return real(path)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fast_fails)
    tokenizer = load_tokenizer(str(tiny_models["llama"]))
    assert calls == [True, False]
    assert tokenizer.pad_token == "<eos>" and tokenizer.padding_side == "right"


def test_tokenizer_without_eos_is_refused():
    tokenizer = char_tokenizer(with_pad_and_unk=False)
    tokenizer.eos_token = None
    with pytest.raises(LoraclsError, match="neither a pad_token nor an eos_token"):
        fix_tokenizer(tokenizer)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_gives_the_same_logits_as_single_texts(tiny_models, family):
    path = str(tiny_models[family])
    tokenizer = load_tokenizer(path)
    model = load_classifier(path, LABELS, head_init="normal")  # a zero head gives equal logits trivially
    model.config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    texts = ["good", "the story was very long and awful", "love it"]
    with torch.no_grad():
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        assert batch["attention_mask"][0, -1] == 0  # right padding really happened
        together = model(**batch).logits
        alone = torch.cat([model(**tokenizer([t], return_tensors="pt")).logits for t in texts])
    assert torch.isfinite(together).all()
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)


def test_config_carries_the_label_names(tiny_models):
    model = load_classifier(str(tiny_models["gemma3"]), ["bad", "ok", "good"])
    assert model.config.num_labels == 3 and model.score.out_features == 3
    assert model.config.id2label == {0: "bad", 1: "ok", 2: "good"}


def test_zero_head_starts_with_uniform_predictions(tiny_models):
    path = str(tiny_models["gemma3"])
    tokenizer = load_tokenizer(path)
    batch = tokenizer(["good", "awful plot"], padding=True, return_tensors="pt")
    zero = load_classifier(path, ["a", "b", "c"])
    assert torch.count_nonzero(zero.score.weight) == 0
    with torch.no_grad():
        probs = zero(**batch).logits.softmax(-1)
    torch.testing.assert_close(probs, torch.full((2, 3), 1 / 3))
    normal = load_classifier(path, ["a", "b", "c"], head_init="normal")
    assert normal.score.weight.std() > 0.005


def test_randomly_initialised_backbone_is_refused(tiny_models, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_models["llama"].iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    weights = load_file(broken / "model.safetensors")
    dropped = [k for k in weights if "layers.1.self_attn.q_proj" in k]
    save_file(
        {k: v for k, v in weights.items() if k not in dropped},
        broken / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(LoraclsError, match=r"Refusing to train: 1 weight\(s\).*layers.1.self_attn.q_proj"):
        load_classifier(str(broken), LABELS)


def test_model_resolution_errors(tmp_path):
    with pytest.raises(LoraclsError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(LoraclsError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(LoraclsError, match="Model not found"):
        resolve_model("./no/such/model")
    assert resolve_model("org/name") == "org/name"  # a hub id is passed through to from_pretrained


def test_a_gguf_models_tokenizer_is_read_from_the_file_and_cached_until_a_conversion_is(
    tmp_path, monkeypatch, tiny_models
):
    monkeypatch.setenv("LORACLS_CACHE", str(tmp_path / "cache"))
    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    from_file = load_tokenizer_for(path)
    assert len(from_file) == 30 and from_file.pad_token == from_file.eos_token == "</s>"  # fix_tokenizer's
    assert from_file("ab")["input_ids"] == [1, 3, 4, 5]  # <s>, the word mark, a, b
    assert not (tmp_path / "cache" / "models").exists()

    def read_again(source):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr("loracls.model.gguf_tokenizer", read_again)
    assert load_tokenizer_for(path).get_vocab() == from_file.get_vocab()  # from the cached tokenizer
    shutil.copytree(tiny_models["llama"], gguf_model(path)[1])  # as a finished conversion leaves its folder
    assert load_tokenizer_for(path).get_vocab() == load_tokenizer(str(tiny_models["llama"])).get_vocab()


@pytest.mark.parametrize("family", ["gemma4", "gemma4mm"])
def test_gemma4_gets_our_classifier_on_its_language_model_only(tiny_models, family):
    model = load_classifier(str(tiny_models[family]), LABELS)
    assert type(model).__name__ == "Gemma4TextForSequenceClassification"
    assert model.config.model_type == "gemma4_text" and model.config.id2label == {
        0: "negative",
        1: "positive",
    }
    assert not [n for n, _ in model.named_modules() if "vision" in n or "audio" in n]
    source = load_file(tiny_models[family] / "model.safetensors")
    prefix = "model.language_model." if family == "gemma4mm" else "model."
    for key in ("layers.1.self_attn.q_proj.weight", "embed_tokens_per_layer.weight", "norm.weight"):
        torch.testing.assert_close(model.state_dict()["model." + key], source[prefix + key], rtol=0, atol=0)


@pytest.mark.parametrize(
    "problem_type", ["single_label_classification", "multi_label_classification", "regression"]
)
def test_generic_classifier_follows_transformers_loss_conventions(tiny_models, problem_type):
    """Our class built for Llama computes what transformers' own LlamaForSequenceClassification computes."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    path = tiny_models["llama"]
    num_labels = 1 if problem_type == "regression" else 3
    ours = generic_classifier_class(LlamaConfig).from_pretrained(
        path, num_labels=num_labels, problem_type=problem_type, pad_token_id=1
    )
    theirs = LlamaForSequenceClassification.from_pretrained(
        path, num_labels=num_labels, problem_type=problem_type, pad_token_id=1
    )
    assert type(ours) is not LlamaForSequenceClassification
    theirs.score.load_state_dict(ours.score.state_dict())
    ids = torch.tensor([[5, 6, 7, 1, 1], [8, 9, 10, 11, 12]])
    labels = {
        "single_label_classification": torch.tensor([2, 0]),
        "multi_label_classification": torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]),
        "regression": torch.tensor([0.5, -1.0]),
    }[problem_type]
    a, b = ours(input_ids=ids, labels=labels), theirs(input_ids=ids, labels=labels)
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.loss, b.loss)
    assert a.loss > 0


def test_pickle_weights_are_refused_unless_allowed(tiny_models, tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_models["llama"], folder)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(weights, folder / "pytorch_model.bin")
    with pytest.raises(LoraclsError, match=r"only as pickle files \(pytorch_model.bin\).*--allow-pickle"):
        load_classifier(str(folder), LABELS)
    model = load_classifier(str(folder), LABELS, allow_pickle=True)
    assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"])


def test_remote_code_is_refused_before_it_runs(tiny_models, tmp_path, toy_csv):
    folder = tmp_path / "custom"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my-llama", auto_map={"AutoConfig": "configuration_my.MyConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "code-ran"
    (folder / "configuration_my.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(LoraclsError, match=r"configuration_my.py.*--trust-remote-code"):
        load_classifier(str(folder), LABELS)
    result = invoke("train", "--model", folder, "--data", toy_csv, "--out", tmp_path / "run", "--no-baseline")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "does not run them unless you pass --trust-remote-code" in " ".join(result.output.split())
    assert not marker.exists()


def test_qlora_computes_in_the_run_precision():
    """QLoRA's compute dtype was bf16 whatever the run's precision; `auto` picks fp16 on GPUs without bf16."""
    assert quantized_compute_dtype("fp16") == torch.float16
    assert quantized_compute_dtype("bf16") == torch.bfloat16
    assert quantized_compute_dtype("no") == torch.float32
