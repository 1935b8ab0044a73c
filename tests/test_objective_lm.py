"""`objective: lm` (instruction tuning): the loss is the response's causal-LM loss computed only where the
response is, classes come from the baseline's scorer, and the run trains, resumes, evaluates, exports and
predicts (and generates) through the CLI like a head run."""

import json
import shutil
import signal

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithPadding

from loracls.config import PromptConfig
from loracls.data.prompts import Prompter, resolve_prompt
from loracls.data.tokenization import tokenize, tokenize_responses
from loracls.environment.devices import inference_autocast
from loracls.model import load_causal_lm, load_tokenizer
from loracls.objective import LanguageModel, label_log_probs
from loracls.training.evaluate import predict_probs
from loracls.training.prompt_search import softmax
from tests.conftest import FAMILIES, FAST, invoke, toy_reviews
from tests.test_learning import LEARN

LABELS = ["negative", "positive"]
LABEL2ID = {"negative": 0, "positive": 1}


def prompter_for(path: str) -> tuple[Prompter, torch.nn.Module]:
    tokenizer = load_tokenizer(path)
    prompt = resolve_prompt(
        LABELS, [], PromptConfig(prompt="en-label", verbalizers="negative=bad,positive=good")
    )
    return Prompter(tokenizer, prompt, [], 64), load_causal_lm(path)


@pytest.mark.parametrize("family", ["gemma3", "gemma4mm", "llama"])
def test_the_loss_is_the_causal_lm_loss_of_the_response_alone(tiny_models, family):
    """Equal to transformers' own loss with every prompt and padding token masked (-100), which computes the
    LM head at every position; ours computes it only at the positions that predict a response token."""
    prompter, lm = prompter_for(str(tiny_models[family]))
    table = toy_reviews(6)
    table["response"] = ["", "a nice one", "", "meh", "x", ""]  # responses of different lengths
    dataset = tokenize_responses(table, prompter, LABEL2ID)
    batch = dict(DataCollatorWithPadding(prompter.tokenizer)([dataset[i] for i in range(6)]))
    words = prompter.label_tokens()
    objective = LanguageModel(prompter.tokenizer, [words[x] for x in LABELS])
    masked = batch["input_ids"].clone()
    for row, start in enumerate(batch["response_start"].tolist()):
        masked[row, :start] = -100
    masked[batch["attention_mask"] == 0] = -100
    expected = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=masked).loss
    torch.testing.assert_close(objective.loss(lm, batch), expected, rtol=1e-5, atol=1e-5)
    # each sequence: prompt, label words, comment after a new line, end-of-sequence
    ids = dataset[1]["input_ids"]
    assert table["label"][1] == "negative"
    assert prompter.tokenizer.decode(ids[dataset[1]["response_start"] :]) == " bad\na nice one<eos>"


def test_class_weights_weigh_each_examples_response_tokens(tiny_models):
    prompter, lm = prompter_for(str(tiny_models["qwen3"]))
    table = toy_reviews(4)
    batch = dict(
        DataCollatorWithPadding(prompter.tokenizer)(list(tokenize_responses(table, prompter, LABEL2ID)))
    )
    words = prompter.label_tokens()
    tokens = [words[x] for x in LABELS]
    plain = LanguageModel(prompter.tokenizer, tokens).loss(lm, batch)
    equal = LanguageModel(prompter.tokenizer, tokens, torch.tensor([2.0, 2.0])).loss(lm, batch)
    only_negative = LanguageModel(prompter.tokenizer, tokens, torch.tensor([1.0, 0.0])).loss(lm, batch)
    negatives = {k: v[[i for i, y in enumerate(batch["labels"]) if y == 0]] for k, v in batch.items()}
    torch.testing.assert_close(equal, plain)
    torch.testing.assert_close(only_negative, LanguageModel(prompter.tokenizer, tokens).loss(lm, negatives))


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "qwen3"])
def test_class_probabilities_are_the_baselines_scores_in_padded_batches(tiny_models, family):
    """Validation, test, eval and predict score prompt-only batches (right-padded, mixed lengths): the same
    numbers as the baseline's scorer on each prompt alone, multi-token label words included."""
    prompter, lm = prompter_for(str(tiny_models[family]))
    table = toy_reviews(10, seed=2)
    words = prompter.label_tokens()
    assert min(len(w) for w in words.values()) > 1  # " good" and " bad": several tokens each
    objective = LanguageModel(prompter.tokenizer, [words[x] for x in LABELS])
    dataset = tokenize(table, prompter.tokenizer, 64, LABEL2ID, prompter)
    got = predict_probs(lm, dataset, prompter.tokenizer, batch_size=4, objective=objective)
    one_by_one = [
        label_log_probs(lm, prompter.tokenizer, [ids], objective.tokens)[0]
        for ids in prompter.encode(list(table["text"]))
    ]
    np.testing.assert_allclose(got, softmax(np.array(one_by_one)), atol=1e-5)


def test_every_family_learns_the_toy_task(lm_models, tmp_path):
    data = tmp_path / "reviews.csv"
    toy_reviews(600).to_csv(data, index=False)
    for family in FAMILIES:
        out = tmp_path / family
        result = invoke(
            "train", "--model", lm_models[family], "--data", data, "--out", out, *LEARN, "--objective", "lm",
            "--lr", "5e-3", "--epochs", "10",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        test = json.loads((out / "metrics.json").read_text())["test"]
        # chance is 0.5; fp32 kernels differ by CPU (AVX2, AVX-512, AMX), and so do the tiny models' paths:
        # at 6 epochs gemma4mm reached 0.82 on an AVX-512-BF16 EPYC, at 10 the lowest family there was 0.92
        assert test["n"] == 60 and test["accuracy"] >= 0.85, (family, test)
        assert json.loads((out / "targets.json").read_text())["head_parameters"] == 0  # LoRA alone


def with_comments(n: int) -> pd.DataFrame:
    table = toy_reviews(n)
    table["comment"] = [
        f"it says {'good' if label == 'positive' else 'bad'}" if i % 3 else ""
        for i, label in enumerate(table["label"])
    ]
    return table


@pytest.fixture(scope="module")
def lm_run(lm_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    data = root / "reviews.csv"
    with_comments(600).to_csv(data, index=False)
    out = root / "run"
    result = invoke(
        "train", "--model", lm_models["qwen3"], "--data", data, "--out", out, *FAST, "--objective", "lm",
        "--response-column", "comment", "--prompt-sample", "40", "--precision", "fp32", "--epochs", "12",
        "--target-modules", "all-linear", "--lora-dropout", "0",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_an_lm_run_records_its_prompt_and_validates_every_prediction(lm_run):
    config = (lm_run / "config.yaml").read_text()
    assert "objective: lm" in config and "prompt: auto" not in config and "chat_template: false" in config
    prompt = json.loads((lm_run / "prompt.json").read_text())
    assert prompt["name"].startswith("en-")
    steps = sorted((lm_run / "val_predictions").glob("step_*.jsonl"))
    val = (lm_run / "data/val.jsonl").read_text().splitlines()
    assert steps and len(steps[-1].read_text().splitlines()) == len(val)
    baseline = json.loads((lm_run / "baseline_metrics.json").read_text())
    assert baseline["prompt"]["name"] == prompt["name"]
    metrics = json.loads((lm_run / "metrics.json").read_text())
    assert metrics["test"]["accuracy"] >= 0.9, metrics["test"]
    assert metrics["test"]["n"] == len((lm_run / "data/test.jsonl").read_text().splitlines()) and set(
        metrics["test"]["pred_distribution"]
    ) == set(LABELS)


def test_eval_predict_generate_and_export_of_an_lm_run(lm_run, tmp_path):
    metrics = json.loads((lm_run / "metrics.json").read_text())
    assert invoke("eval", lm_run).exit_code == 0
    assert (
        json.loads((lm_run / "eval/test/metrics.json").read_text())["accuracy"] == metrics["test"]["accuracy"]
    )

    texts = ["good story", "awful plot and bad", "love it"]
    result = invoke("predict", lm_run, *texts, "--generate", "--max-new-tokens", "12")
    assert result.exit_code == 0, result.output
    records = [json.loads(x) for x in result.stdout.splitlines()]
    assert all(r["label"] in LABELS for r in records)

    export = tmp_path / "export"
    result = invoke("export", lm_run, "--out", export)
    assert result.exit_code == 0, result.output
    assert "merged causal LM" in " ".join(result.output.split())
    info = json.loads((export / "loracls.json").read_text())
    assert info["objective"] == "lm" and set(info["label_tokens"]) == set(LABELS)
    from_export = [json.loads(x) for x in invoke("predict", export, *texts).output.splitlines()]
    for a, b in zip(records, from_export, strict=True):
        assert a["label"] == b["label"]
        np.testing.assert_allclose(
            list(a["probabilities"].values()), list(b["probabilities"].values()), atol=1e-4
        )

    assert plain_transformers_labels(export, texts) == [r["label"] for r in records]
    responses = [r["response"] for r in records]
    assert all(responses) and plain_transformers_responses(export, texts, 12) == responses


def test_int8_reads_an_lm_run_as_fp32_does(lm_run, tmp_path):
    run = shutil.copytree(lm_run, tmp_path / "run")  # the check writes RUN/int8/
    texts = ["good story", "awful plot and bad", "love it"]
    fp32, int8 = (invoke("predict", run, *texts, *extra) for extra in ([], ["--int8"]))
    assert int8.exit_code == 0, int8.output
    assert json.loads((run / "int8/parity.json").read_text())["passed"]
    records = [[json.loads(x) for x in r.output.splitlines() if x.startswith("{")] for r in (fp32, int8)]
    assert [r["label"] for r in records[0]] == [r["label"] for r in records[1]]


def plain_transformers_labels(export, texts: list[str]) -> list[str]:
    """An `objective: lm` export read as docs/serving.md says, with transformers alone: each text's label
    is the one whose tokens are likeliest after the prompt."""
    info = json.loads((export / "loracls.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)  # it puts the run's prompt around each text
    labels = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        scores = {}
        for label, words in info["label_tokens"].items():
            with torch.no_grad():
                log_probs = model(input_ids=torch.tensor([ids + words])).logits[0].log_softmax(-1)
            scores[label] = sum(float(log_probs[len(ids) - 1 + j, t]) for j, t in enumerate(words))
        labels.append(max(scores, key=scores.get))
    return labels


def plain_transformers_responses(export, texts: list[str], max_new_tokens: int) -> list[str]:
    """What the merged export says after each text's prompt, by transformers' greedy `generate` (in the
    precision `predict` autocasts to on this CPU), special tokens dropped."""
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    responses = []
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad(), inference_autocast(torch.device("cpu")):
            out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
        responses.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return responses


def test_a_killed_lm_run_resumes_to_identical_results(lm_models, tmp_path):
    from tests.test_faults import outputs, stop_mid_run, train_args

    data = tmp_path / "reviews.csv"
    with_comments(120).to_csv(data, index=False)
    extra = (
        "--objective",
        "lm",
        "--response-column",
        "comment",
        "--prompt-sample",
        "32",
        "--precision",
        "fp32",
    )
    reference = tmp_path / "reference"
    assert invoke(*train_args(lm_models["gemma3"], data, reference, *extra)).exit_code == 0
    out = tmp_path / "killed"
    stop_mid_run(lm_models["gemma3"], data, out, 9, signal.SIGKILL, *extra).wait()
    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert outputs(out) == outputs(reference)


def test_a_chat_template_wraps_the_prompt_when_the_tokenizer_has_one(lm_models, tmp_path):
    model = tmp_path / "chat-model"
    tokenizer = AutoTokenizer.from_pretrained(lm_models["llama"])
    tokenizer.chat_template = (
        "{% for m in messages %}<bos>[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[model]{% endif %}"
    )
    AutoModelForCausalLM.from_pretrained(lm_models["llama"]).save_pretrained(model)
    tokenizer.save_pretrained(model)
    data = tmp_path / "reviews.csv"
    toy_reviews(80).to_csv(data, index=False)
    out = tmp_path / "run"
    result = invoke(
        "train",
        "--model",
        model,
        "--data",
        data,
        "--out",
        out,
        *FAST,
        "--objective",
        "lm",
        "--prompt-sample",
        "20",
    )
    assert result.exit_code == 0, result.output
    assert "chat_template: true" in (out / "config.yaml").read_text()
    example = json.loads((out / "baseline_metrics.json").read_text())["prompt"]["example"]
    assert example.startswith("<bos>[user]") and example.endswith("[model]")
    export = tmp_path / "export"
    assert invoke("export", out, "--out", export).exit_code == 0
    prompt = json.loads((export / "loracls.json").read_text())["prompt"]
    assert (
        prompt["chat"] and prompt["prefix"].startswith("<bos>[user]") and prompt["suffix"].endswith("[model]")
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--objective", "lm", "--multi-label"), "objective: lm answers one label word per text"),
        (("--response-column", "comment"), "add --objective lm"),
        (("--objective", "lm", "--response-column", "remark"), "no response column 'remark'"),
    ],
)
def test_what_an_lm_run_cannot_do_is_refused_before_a_model_loads(tiny_models, tmp_path, extra, message):
    data = tmp_path / "reviews.csv"
    with_comments(40).to_csv(data, index=False)
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", data, "--out", tmp_path / "run", *extra
    )
    assert result.exit_code == 2 and message in " ".join(result.output.split())
    assert not (tmp_path / "run").exists()


def test_generate_is_refused_for_a_head_run(trained):
    run, _ = trained["llama"]
    result = invoke("predict", run, "good", "--generate")
    assert result.exit_code == 2 and "objective: lm" in " ".join(result.output.split())
