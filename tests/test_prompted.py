"""A verbaliser-initialised classifier (`head_init: verbalizer`): step 0 answers what the zero-shot prompt
answers, and the prompt travels with the run through eval, predict, export and resume."""

import html
import json
import re
import signal

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from loracls.config import PromptConfig
from loracls.data.prompts import Prompter, answer_tokens, format_verbalizers, resolve_prompt
from loracls.data.tokenization import tokenize
from loracls.model import load_causal_lm, load_classifier, load_tokenizer
from loracls.objective import label_log_probs, label_rows
from loracls.training.evaluate import predict_probs
from tests.conftest import FAMILIES, FAST, invoke, toy_reviews

LABELS = ["negative", "positive"]


@pytest.mark.parametrize(
    ("family", "softcapped"),
    [(family, False) for family in FAMILIES]
    + [(family, True) for family in ("gemma3", "gemma4", "gemma4mm")],
)
def test_step_zero_answers_what_the_zero_shot_prompt_answers(tiny_models, family, softcapped):
    """Where the labels' words part on their first token, the head built from the LM head's rows of those
    tokens gives, on every text, the label whose token the uncalibrated zero-shot prompt ranks first, and its
    logits are the LM's logits for those tokens before the LM's final softcap (Gemma's
    `final_logit_softcapping`: cap * tanh(logit / cap), which the head lacks)."""
    path = str(tiny_models[family])
    tokenizer, lm = load_tokenizer(path), load_causal_lm(path)
    text_config = lm.config.get_text_config()
    assert getattr(text_config, "final_logit_softcapping", None) is None  # the tiny models have no cap
    prompt = resolve_prompt(
        LABELS, [], PromptConfig(prompt="en-label", verbalizers="negative=bad,positive=good")
    )
    shared, following = answer_tokens(tokenizer, prompt, LABELS)
    assert tokenizer.decode(shared) == " "  # the character tokenizer splits off the separator's space
    assert [tokenizer.decode(ids) for ids in following] == ["bad", "good"]  # read from `b` and `g`
    rows = label_rows(lm.get_output_embeddings().weight, following)
    classifier = load_classifier(path, LABELS, head_init="verbalizer", head_rows=rows).eval()
    classifier.config.pad_token_id = tokenizer.pad_token_id
    table = toy_reviews(24, seed=5)
    prompter = Prompter(tokenizer, prompt, [], 64, shared)
    dataset = tokenize(table, tokenizer, 64, {"negative": 0, "positive": 1}, prompter)
    with torch.no_grad():
        head = predict_probs(classifier, dataset, tokenizer, batch_size=5)  # padded batches of mixed length
        logits = np.array(
            [classifier(input_ids=torch.tensor([x])).logits[0].numpy() for x in dataset["input_ids"]]
        )
        cap = None
        if softcapped:  # Gemma 2 ships 30.0; this one at the tiny logits' scale, where tanh bends them
            cap = text_config.final_logit_softcapping = float(np.abs(logits).max()) / 2  # read in forward
        firsts = [ids[:1] for ids in following]
        zero_shot = label_log_probs(lm, tokenizer, prompter.encode(list(table["text"])), firsts)
    assert head.argmax(1).tolist() == zero_shot.argmax(1).tolist()  # a softcap keeps the order
    np.testing.assert_allclose(head, softmax(logits), atol=1e-4)
    capped = logits if cap is None else cap * np.tanh(logits / cap)
    # softmax over the two label tokens, from the head's logits capped as the LM caps its own, and from the
    # LM's full-vocabulary log-probabilities
    np.testing.assert_allclose(softmax(capped), softmax(zero_shot), atol=1e-4)
    if softcapped:  # the cap is in force: the head's uncapped probabilities are not the LM's
        assert np.abs(head - softmax(zero_shot)).max() > 1e-3


def softmax(scores: np.ndarray) -> np.ndarray:
    return np.exp(scores) / np.exp(scores).sum(1, keepdims=True)


def test_words_of_several_tokens_start_from_the_mean_of_their_rows(tiny_models):
    """Where two labels' words begin alike (no/nah), each word is read from all its tokens: at step 0 each
    label's logit is the mean of the LM's logits of its word's tokens at the prompt's end."""
    path = str(tiny_models["llama"])
    tokenizer, lm = load_tokenizer(path), load_causal_lm(path)
    labels = ["negative", "neutral", "positive"]
    words = PromptConfig(prompt="en-label", verbalizers="negative=no,neutral=nah,positive=yes")
    prompt = resolve_prompt(labels, [], words)
    shared, following = answer_tokens(tokenizer, prompt, labels)
    assert [tokenizer.decode(ids) for ids in following] == ["no", "nah", "yes"]  # after the shared " "
    rows = label_rows(lm.get_output_embeddings().weight, following)
    classifier = load_classifier(path, labels, head_init="verbalizer", head_rows=rows).eval()
    prompter = Prompter(tokenizer, prompt, [], 64, shared)
    with torch.no_grad():
        for ids in prompter.encode(list(toy_reviews(6, seed=2)["text"])):
            head = classifier(input_ids=torch.tensor([ids])).logits[0]
            lm_logits = lm(input_ids=torch.tensor([ids])).logits[0, -1]
            expected = torch.stack([lm_logits[t].mean() for t in following])
            torch.testing.assert_close(head, expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(rows[0], rows[1])  # `n` is shared, the rest is not


@pytest.mark.parametrize("head_init", ["verbalizer", "auto"])
def test_labels_whose_words_begin_alike_train_a_verbalizer_head_when_asked(tiny_models, tmp_path, head_init):
    """`verbalizer` starts them from the mean of their tokens' rows; `auto` keeps a zero head for them until
    that start is measured to help, and says why."""
    data = tmp_path / "three.csv"
    table = toy_reviews(60)
    table.loc[::3, "label"] = "neutral"
    table.to_csv(data, index=False)
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", data, "--out", tmp_path / "run", *FAST,
        "--head-init", head_init, "--prompt", "en-label", "--no-baseline",
        "--verbalizers", "negative=no,neutral=nah,positive=yes",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    chosen = json.loads((tmp_path / "run/prompt.json").read_text())
    assert chosen["verbalizers"] == {"negative": "no", "neutral": "nah", "positive": "yes"}
    config = yaml.safe_load((tmp_path / "run/config.yaml").read_text())
    assert config["head_init"] == ("verbalizer" if head_init == "verbalizer" else "zero")
    if head_init == "auto":
        assert "head_init auto: zero (two labels' words begin with the same token" in " ".join(
            result.output.split()
        )


@pytest.fixture(scope="module")
def prompted_run(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("prompted")
    data = root / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    out = root / "run"
    result = invoke(
        "train", "--model", tiny_models["qwen3"], "--data", data, "--out", out, *FAST,
        "--head-init", "verbalizer", "--prompt-sample", "40", "--precision", "fp32",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out, result.output


def test_a_run_chooses_its_prompt_on_training_examples_and_pins_it(prompted_run):
    run, output = prompted_run
    chosen = json.loads((run / "prompt.json").read_text())
    assert chosen["name"] in ("en-options", "en-label", "en-sentiment", "en-it-was", "en-review")
    candidates = chosen["choice"]["candidates"]
    assert len(candidates) == 15 and 38 <= chosen["choice"]["sample"] <= 40
    scored = [c for c in candidates if "macro_f1" in c]
    best = max(scored, key=lambda c: (c["macro_f1"], c["gold_log_prob"]))
    assert (best["template"], best["verbalizers"]) == (
        chosen["name"],
        format_verbalizers(chosen["verbalizers"]),
    )
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["prompt"] == chosen["name"] and config["verbalizers"] == chosen["verbalizers"]
    assert config["label_order"] == chosen["label_order"]
    assert "prompt: chose" in " ".join(output.split())
    baseline = json.loads((run / "baseline_metrics.json").read_text())
    assert baseline["prompt"]["name"] == chosen["name"]  # the baseline scored the same prompt
    example = baseline["prompt"]["example"]
    assert example.startswith(chosen["prefix"]) and example.endswith(chosen["suffix"])


def test_eval_export_and_predict_read_texts_inside_the_runs_prompt(prompted_run, tmp_path):
    run, _ = prompted_run
    metrics = json.loads((run / "metrics.json").read_text())
    result = invoke("eval", run)
    assert result.exit_code == 0, result.output
    again = json.loads((run / "eval/test/metrics.json").read_text())
    assert again["accuracy"] == metrics["test"]["accuracy"]  # the test split read through the same prompt

    export = tmp_path / "export"
    assert invoke("export", run, "--out", export).exit_code == 0
    info = json.loads((export / "loracls.json").read_text())["prompt"]
    texts = ["good story", "awful plot, very long and bad", "love"]
    records = [json.loads(x) for x in invoke("predict", run, *texts).output.splitlines()]
    from_export = [json.loads(x) for x in invoke("predict", export, *texts).output.splitlines()]
    assert [r["label"] for r in records] == [r["label"] for r in from_export]

    # plain transformers, as the README tells: prefix + text + suffix, then the answer_start ids
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    for text, record in zip(texts, records, strict=True):
        ids = tokenizer(info["prefix"] + text + info["suffix"])["input_ids"] + info["answer_start"]
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
        expected = [record["probabilities"][label] for label in LABELS]
        np.testing.assert_allclose(probs.numpy(), expected, atol=2e-2)  # predict ran in bf16 where it can
        # the raw text alone is not what the classifier was trained on
        assert tokenizer(text)["input_ids"] != ids


def test_a_killed_verbalizer_run_resumes_to_identical_results(tiny_models, tmp_path):
    """The resumed run reads its pinned prompt from config.yaml and its head from the checkpoint."""
    from tests.test_faults import outputs, stop_mid_run, train_args

    data = tmp_path / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    extra = ("--head-init", "verbalizer", "--prompt-sample", "32", "--precision", "fp32")
    reference = tmp_path / "reference"
    assert invoke(*train_args(tiny_models["gemma3"], data, reference, *extra)).exit_code == 0
    out = tmp_path / "killed"
    stop_mid_run(tiny_models["gemma3"], data, out, 9, signal.SIGKILL, *extra).wait()
    assert "prompt: auto" not in (out / "config.yaml").read_text()
    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert "prompt: chose" not in " ".join(result.output.split())  # chosen once, before the kill
    assert outputs(out) == outputs(reference)


def test_the_report_shows_the_prompt_and_every_candidate(prompted_run):
    run, _ = prompted_run
    assert invoke("report", run).exit_code == 0
    page = (run / "report.html").read_text()
    chosen = json.loads((run / "prompt.json").read_text())
    section = page.split('<h2 id="prompt">Prompt</h2>')[1].split("<h2")[0]
    assert section.count('<td class="">en-') == 15  # one row per candidate
    assert html.escape(chosen["prefix"] + "{text}" + chosen["suffix"]) in section


@pytest.mark.parametrize("knows", [True, False])
def test_auto_starts_from_the_prompt_only_where_it_knows_the_task(knows, tiny_models, tmp_path, monkeypatch):
    """A prompt whose answers follow the texts' keywords starts the head (`verbalizer`); one that answers
    the same label whatever the text agrees with the labels no better than chance (kappa 0): `zero`."""
    from loracls.training import prompt_search

    def answers(model, tokenizer, prompts, tokens, batch_size=16, advance=None):
        scores = np.full((len(prompts), len(tokens)), -1.0)  # a pair of columns per word set
        for i, ids in enumerate(prompts):
            positive = bool({"good", "great", "love"} & set(tokenizer.decode(ids).replace("\n", " ").split()))
            scores[i, 0::2] = -0.1 if not (knows and positive) else -1.0
            scores[i, 1::2] = -0.1 if knows and positive else -1.0
        return scores

    monkeypatch.setattr(prompt_search, "label_log_probs", answers)
    data = tmp_path / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    out = tmp_path / "run"
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", data, "--out", out, *FAST, "--no-baseline"
    )
    assert result.exit_code == 0, result.output
    decided = "verbalizer" if knows else "zero"
    assert f"head_init: {decided}" in (out / "config.yaml").read_text()
    said = " ".join(result.output.split())
    assert f"head_init auto: {decided}" in said
    # how sure the choice is: the kappa's 90% interval from the sample, and whether chance is inside it
    assert re.search(r"Cohen's kappa [\d.-]+ \(90% interval [\d.-]+ to [\d.-]+ from \d+ examples", said), said
    assert ("within noise of chance" in said) == (not knows)
    # why the search runs although the baseline is off, and what skips it
    searched = r"prompt: scoring \d+ candidate prompts on \d+ training examples "
    searched += r"\([\d,]+ prompts, [\d,]+ tokens\), for the head's start "
    assert re.search(searched + r"\(head_init: auto; --head-init zero: raw text, no prompt\)", said), said
    assert "baseline (--no-baseline)" not in said
    kappa = json.loads((out / "prompt.json").read_text())["choice"]["candidates"][0]["kappa"]
    assert kappa == (1.0 if knows else 0.0)
