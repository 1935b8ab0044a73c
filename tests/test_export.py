"""`targets` and `export` through the CLI, and reloading an export the way users would."""

import json
import os

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

import loracls
from loracls.errors import LoraclsError
from loracls.inference.export import export_run, fold_temperature, verify_export
from loracls.inference.export_format import EXPORT_INFO, folder_kind
from loracls.inference.predict import Classifier, run_temperature
from loracls.inference.serve import describe_model
from loracls.lora import round_frozen_base
from loracls.model import load_classifier, load_tokenizer
from loracls.training.runs import RunFolder
from tests.conftest import FAMILIES, FAST, invoke, toy_reviews

TEXTS = ["good story", "awful plot, very long and bad", "love"]
WITH_TRANSFORMERS_CLASS = ("gemma3", "llama", "qwen3")


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    folders = {}
    for family, (run, _) in trained.items():
        result = invoke("export", run, "--out", root / family)
        assert result.exit_code == 0, result.output
        folders[family] = root / family
    return folders


def unmerged_logits(run_dir, batch) -> torch.Tensor:
    """The run's adapter on its base model as it trained on it (its linears rounded to `frozen_base`), LoRA
    kept separate: the reference an export must reproduce."""
    run = RunFolder(run_dir)
    cfg = run.read_config()
    base = load_classifier(cfg.model, run.read_labels())
    round_frozen_base(base, cfg.frozen_base)
    base.config.pad_token_id = batch["pad_token_id"]
    model = PeftModel.from_pretrained(base, str(run.best)).eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_targets_prints_the_plan_without_training(tiny_models, family):
    result = invoke("targets", "--model", tiny_models[family], "--preset", "attn", "--lora-r", "4")
    assert result.exit_code == 0, result.output
    assert "0-1" in result.output and "self_attn.q_proj, self_attn.k_proj" in result.output
    assert "LoRA on 8 modules" in result.output and "head 64" in result.output
    plan = json.loads(invoke("targets", "--model", tiny_models[family], "--json").output)
    assert sorted(plan["by_layer"]) == ["0", "1"]
    assert plan["trainable"] == plan["lora_parameters"] + plan["head_parameters"]


def test_targets_follow_auto_as_training_would_for_many_classes(tiny_models):
    result = invoke("targets", "--model", tiny_models["llama"], "--num-labels", "5")
    assert result.exit_code == 0, result.output
    assert "all-linear at rank 16 for 5 classes" in " ".join(result.output.split())
    plan = json.loads(
        invoke("targets", "--model", tiny_models["llama"], "--num-labels", "5", "--json").output
    )
    assert {m.rsplit(".", 1)[-1] for m in plan["modules"]} >= {"q_proj", "gate_proj", "down_proj"}
    assert plan["target_modules"] == "all-linear"


def test_targets_refusal_exits_2_with_the_linear_names(tiny_models):
    result = invoke("targets", "--model", tiny_models["gemma4mm"], "--target-modules", r".*embed_tokens")
    assert result.exit_code == 2
    assert "outside the decoder layers" in result.output and "q_proj" in result.output


@pytest.mark.parametrize("family", FAMILIES)
def test_run_targets_json_matches_the_targets_command(trained, tiny_models, family):
    run, output = trained[family]
    stored = json.loads((run / "targets.json").read_text())
    printed = json.loads(invoke("targets", "--model", tiny_models[family], "--json").output)
    assert stored["modules"] == printed["modules"] and len(stored["modules"]) == 4
    assert f"LoRA on 4 modules (q_proj, v_proj in 2 layers); trainable {stored['trainable']:,}" in output
    assert "LoRA targets: attn-qv" in output and "self_attn.q_proj, self_attn.v_proj" in output


@pytest.mark.parametrize("family", FAMILIES)
def test_export_reloads_and_matches_the_unmerged_run(trained, exported, family):
    folder = exported[family]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")
    assert config["id2label"] == {"0": "negative", "1": "positive"} and config["pad_token_id"] is not None
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir() if p.is_file()}
    assert modes and set(modes.values()) == {0o666 & ~mask}, modes  # others on the machine can read it
    if family in WITH_TRANSFORMERS_CLASS:
        model = AutoModelForSequenceClassification.from_pretrained(folder)  # nothing from loracls
    else:
        model = loracls.from_pretrained(str(folder))  # Gemma 4: the one documented call
        assert type(model).__name__ == "Gemma4TextForSequenceClassification"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = dict(tokenizer(TEXTS, padding=True, return_tensors="pt"))
    with torch.no_grad():
        exported_logits = model.eval()(**batch).logits
    reference = unmerged_logits(trained[family][0], {**batch, "pad_token_id": tokenizer.pad_token_id})
    assert reference.abs().max() > 0.01  # the trained head is there, not a zero or fresh one
    reference /= run_temperature(RunFolder(trained[family][0]))  # folded into the exported head
    # merging adds W + BA in float32: equal up to rounding
    torch.testing.assert_close(exported_logits, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_predict_accepts_run_and_exports(trained, exported, tmp_path, monkeypatch, family):
    # in float32 on every CPU: bf16 autocast (AMX machines) rounds the merged and the unmerged logits apart
    monkeypatch.setattr("loracls.environment.devices.cpu_has_fast_bf16", lambda flags=None: False)
    run = trained[family][0]
    adapter = tmp_path / "adapter"
    result = invoke("export", run, "--out", adapter, "--adapter-only")
    assert result.exit_code == 0, result.output
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "config.json").exists()
    outputs = [invoke("predict", path, *TEXTS) for path in (run, exported[family], adapter)]
    records = [[json.loads(line) for line in out.output.splitlines()] for out in outputs]
    assert all(out.exit_code == 0 for out in outputs)
    assert (
        [r["label"] for r in records[0]]
        == [r["label"] for r in records[1]]
        == [r["label"] for r in records[2]]
    )
    # the same temperature on all three; T < 1 sharpens, and scales the merge's rounding up with it
    temperature = run_temperature(RunFolder(run))
    assert json.loads((exported[family] / EXPORT_INFO).read_text())["temperature"] == temperature
    probs = [np.array([list(r["probabilities"].values()) for r in rs]) for rs in records]
    for merged in probs[1:]:  # an adapter-only export is merged into its base when it loads
        np.testing.assert_allclose(merged, probs[0], atol=1e-4 * max(1.0, 1 / temperature))


def test_export_refuses_an_existing_folder_and_leaves_nothing_half_written(trained, tmp_path):
    run = trained["llama"][0]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    result = invoke("export", run, "--out", busy)
    assert result.exit_code == 2 and "not an empty folder" in result.output
    unfinished = tmp_path / "unfinished"
    (unfinished / "best").mkdir(parents=True)
    RunFolder(unfinished).set_status("running")
    with pytest.raises(LoraclsError, match="did not finish"):
        export_run(unfinished, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_verify_export_catches_a_dropped_head_and_a_causal_lm_config(exported, tmp_path):
    good = exported["llama"]
    verify_export(good, ["negative", "positive"])

    no_head = tmp_path / "no_head"
    no_head.mkdir()
    for item in good.iterdir():
        (no_head / item.name).write_bytes(item.read_bytes())
    weights = load_file(no_head / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("score.")}, no_head / "model.safetensors")
    with pytest.raises(LoraclsError, match="no classification head with 2 outputs"):
        verify_export(no_head, ["negative", "positive"])

    config = json.loads((no_head / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (no_head / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoraclsError, match="names architecture LlamaForCausalLM, not a sequence classifier"):
        verify_export(no_head, ["negative", "positive"])
    with pytest.raises(LoraclsError, match="does not match the run's labels"):
        verify_export(good, ["neg", "pos"])


def test_the_export_tokenizer_is_the_fixed_one(exported):
    """pad/unk filled in from eos for Llama and Qwen are saved, so plain transformers can batch."""
    tokenizer = load_tokenizer(str(exported["llama"]))
    assert AutoTokenizer.from_pretrained(exported["llama"]).pad_token == tokenizer.pad_token == "<eos>"


def test_reload_check_catches_weights_saved_under_foreign_names(trained, exported, tmp_path):
    """transformers re-prefixes keys of a model loaded with a key mapping; the reload check must notice."""
    from loracls.inference.export import check_reload
    from loracls.inference.predict import Classifier

    folder = tmp_path / "renamed"
    folder.mkdir()
    for item in exported["gemma4mm"].iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    weights = load_file(folder / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}
    save_file(renamed, folder / "model.safetensors")
    classifier = Classifier.load(trained["gemma4mm"][0], torch.device("cpu"))
    fold_temperature(classifier, "head")  # as the export did
    check_reload(exported["gemma4mm"], classifier)
    with pytest.raises(LoraclsError, match="failed its reload check"):
        check_reload(folder, classifier)


def test_a_folder_is_a_run_an_export_or_refused_alike_by_predict_and_serve(tmp_path):
    run, export, other = tmp_path / "run", tmp_path / "export", tmp_path / "other"
    for folder in (run, export, other):
        folder.mkdir()
    (run / "status.json").write_text('{"state": "finished"}')
    (export / EXPORT_INFO).write_text("{}")
    (other / "model.safetensors").write_text("")
    assert (folder_kind(run), folder_kind(export)) == ("run", "export")
    refusal = f"{other} is neither a loracls run folder nor a loracls export folder"
    for read in (folder_kind, Classifier.load, describe_model):
        with pytest.raises(LoraclsError) as error:
            read(other)
        assert str(error.value) == refusal


def test_export_shows_its_steps_and_an_interrupt_leaves_nothing(quick_run, tmp_path, log_file, monkeypatch):
    """In a log, each step of the export (merge, save, check, reload check) gets a line; Ctrl-C in the reload
    check ends with exit 130, where it stopped, and no folder (not even the partial one)."""
    from loracls.inference import export

    out = tmp_path / "export"
    assert invoke("export", quick_run, "--out", out).exit_code == 0
    steps = [line for line in log_file.getvalue().splitlines() if line.startswith("export: ")]
    assert [line.split(",")[0] for line in steps] == [
        "export: merging LoRA into the base",
        "export: saving the merged model",
        "export: checking its files",
        "export: the reload check (loading it as users will)",
        "export: the reload check (loading it as users will)",
        "export: the reload check (loading it as users will)",
    ]  # the last two: 4 of 4 steps, then done
    assert steps[-1].startswith("export: the reload check (loading it as users will), 4 of 4 steps, done in")

    def stopped(folder, classifier):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "check_reload", stopped)
    again = tmp_path / "again"
    result = invoke("export", quick_run, "--out", again)
    assert result.exit_code == 130, result.output
    said = " ".join(result.output.split())
    where = "interrupted during export: the reload check (loading it as users will), 3 of 4 steps; "
    assert where + "nothing was written (the partial export folder was removed)" in said
    assert not again.exists() and not (tmp_path / "again.partial").exists()


@pytest.fixture(scope="module")
def prompted_exports(tiny_models, tmp_path_factory) -> dict:
    """A run per family whose head starts from the prompt (`head_init: verbalizer`), exported: (export
    folder, the export command's output)."""
    root = tmp_path_factory.mktemp("prompted")
    data = root / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    exports = {}
    for family, model in tiny_models.items():
        args = ("--head-init", "verbalizer", "--prompt", "en-label", "--no-baseline")
        result = invoke("train", "--model", model, "--data", data, "--out", root / family, *FAST, *args)
        assert result.exit_code == 0, result.output
        result = invoke("export", root / family, "--out", root / f"{family}-export")
        assert result.exit_code == 0, result.output
        exports[family] = (root / f"{family}-export", result.output)
    return exports


@pytest.mark.parametrize("family", FAMILIES)
def test_a_plain_pipeline_on_raw_texts_answers_as_loracls_predict(prompted_exports, family):
    """The export's tokenizer puts the run's prompt around a raw text, so transformers' `pipeline` (and any
    consumer that tokenises with special tokens) gives loracls's labels and probabilities."""
    folder, output = prompted_exports[family]
    assert "its tokenizer puts the run's prompt around every text ('Text: ' + text + '\\nLabel:')" in output
    info = json.loads((folder / EXPORT_INFO).read_text())
    assert info["tokenizer_adds_prompt"] and info["prompt"]["prefix"] == "Text: "
    texts = list(toy_reviews(40, seed=3)["text"]) + ["", "good " * 40]  # an empty one, one over max_length
    classifier = Classifier.load(folder)
    classifier.precision = "fp32"  # as plain transformers runs; `auto` is bf16 on CPUs that compute it
    probs = classifier.predict_probs(texts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert "Text: good story\nLabel:" in tokenizer.decode(tokenizer("good story")["input_ids"])
    assert tokenizer("good story")["input_ids"] == classifier.prompter.encode(["good story"])[0]
    if family in WITH_TRANSFORMERS_CLASS:
        model = AutoModelForSequenceClassification.from_pretrained(folder)
    else:
        model = loracls.from_pretrained(str(folder))
    classify = pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None, device="cpu")
    added = len(tokenizer("")["input_ids"])  # the prompt's ids: truncation cuts the text alone
    # the long text: plain transformers reads all of it unless told to cut, loracls its first 64 tokens
    theirs = classify(texts[:-1]) + classify(texts[-1:], truncation=True, max_length=64 + added)
    assert all(len(t) == len(classifier.labels) for t in theirs)
    scores = [{x["label"]: x["score"] for x in t} for t in theirs]
    got = np.array([[row[label] for label in classifier.labels] for row in scores])
    assert (got.argmax(1) == probs.argmax(1)).all()
    np.testing.assert_allclose(got, probs, atol=1e-3)
