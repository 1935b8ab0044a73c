"""The prompt baseline's scoring path on tiny local models, checked against brute-force computations."""

import json
import re
import signal

import numpy as np
import pytest
import torch

from loracls.config import PromptConfig, TrainConfig
from loracls.data.prompts import (
    TEMPLATES,
    Prompt,
    Template,
    candidate_prompts,
    detect_language,
    parse_verbalizers,
    resolve_prompt,
    verbalizer_tokens,
)
from loracls.errors import LoraclsError
from loracls.model import load_causal_lm, load_tokenizer
from loracls.training import baseline
from loracls.training.baseline import (
    calibrate,
    draw_shots,
    label_log_probs,
    run_baseline,
)
from tests.conftest import invoke, toy_reviews

LABELS = ["negative", "positive"]


@pytest.fixture(scope="module")
def llama(tiny_models):
    path = str(tiny_models["llama"])
    return load_causal_lm(path), load_tokenizer(path)


def brute_force(model, prompt: list[int], ids: list[int]) -> float:
    """log P(ids | prompt) from one unpadded forward pass over the whole sequence, every position's logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return sum(float(log_probs[len(prompt) - 1 + j, token]) for j, token in enumerate(ids))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gemma4", "gemma4mm"])
def test_label_log_probs_equal_a_brute_force_sum_over_tokens(tiny_models, family):
    model, tokenizer = load_causal_lm(str(tiny_models[family])), load_tokenizer(str(tiny_models[family]))
    # prompts of different lengths in one padded batch, two of them past Gemma's sliding window of 8
    prompts = [
        [5, 9, 11, 30],
        [7, 8],
        [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
        [40],
        list(range(5, 19)),
    ]
    # single-token, multi-token, a multi-token label that shares a first token with another, and one that is
    # the start of another (read from the longer one's row)
    tokens = [[20], [21, 22, 23], [21, 24], [25, 26, 27, 28], [25, 26]]
    got = label_log_probs(model, tokenizer, prompts, tokens, batch_size=3)
    expected = np.array([[brute_force(model, p, ids) for ids in tokens] for p in prompts])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    assert (got < 0).all() and got[:, 1].min() < got[:, 0].max()


def test_one_pass_reads_a_prompt_whatever_the_labels_and_short_rows_read_the_rest(llama):
    model, tokenizer = llama
    seen = []
    hook = model.register_forward_hook(
        lambda m, args, kwargs, out: seen.append((kwargs["input_ids"].shape[1], tuple(out.logits.shape))),
        with_kwargs=True,
    )
    try:
        label_log_probs(model, tokenizer, [[5, 6, 7], [8, 9]], [[20], [21]], batch_size=1)
        # single-token labels: one pass per prompt, the logits of its last position only
        assert seen == [(3, (1, 1, model.config.vocab_size)), (2, (1, 1, model.config.vocab_size))]
        seen.clear()
        many = [[20 + k, 60 + k, 80] for k in range(40)]  # 40 labels of 3 tokens, none a start of another
        label_log_probs(model, tokenizer, [[5, 6, 7], [8, 9]], many, batch_size=2)
        # one pass over both prompts, then the labels' later tokens as rows of 2 tokens on their cache (not
        # the prompt again per label): 2 prompts x 40 rows x 2 positions in passes of at most 256 positions
        assert seen[0] == (3, (2, 1, model.config.vocab_size))
        assert [n for n, _ in seen[1:]] == [2] * len(seen[1:])
        assert sum(shape[0] for _, shape in seen[1:]) == 2 * 40
    finally:
        hook.remove()


def test_verbaliser_tokens_are_read_in_context(llama):
    _, tokenizer = llama

    def prompt(template, words):
        return Prompt("test", template, words, LABELS)

    tokens = verbalizer_tokens(
        tokenizer, prompt(TEMPLATES["en-options"], {"negative": "bad", "positive": "good"})
    )
    # the character tokenizer: the separator space, then one token per letter
    assert tokenizer.decode(tokens["positive"]) == " good" and len(tokens["negative"]) == 4
    with pytest.raises(LoraclsError, match="same verbaliser tokens"):
        verbalizer_tokens(tokenizer, prompt(TEMPLATES["en-options"], {"negative": "ok", "positive": "ok"}))
    with pytest.raises(LoraclsError, match="empty after tokenisation"):
        verbalizer_tokens(tokenizer, prompt(Template("", "{text}", ""), {"negative": "", "positive": "x"}))


def test_calibration_divides_out_the_content_free_distribution():
    probs = np.array([[0.8, 0.2], [0.6, 0.4], [0.9, 0.1]])
    calibrated = calibrate(probs, np.array([0.7, 0.3]))
    # (0.6/0.7, 0.4/0.3) = (0.857, 1.333) -> (0.391, 0.609): the biased "negative" flips
    np.testing.assert_allclose(calibrated[1], [0.857143 / 2.190476, 1.333333 / 2.190476], rtol=1e-5)
    np.testing.assert_allclose(calibrated.sum(axis=1), 1.0)
    assert calibrated.argmax(axis=1).tolist() == [0, 1, 0]
    np.testing.assert_allclose(calibrate(probs, np.array([0.5, 0.5])), probs)


def test_prompt_lists_options_in_the_given_order_and_shots_before_the_query():
    prompt = resolve_prompt(LABELS, ["a text"], PromptConfig(label_order="positive,negative"))
    assert prompt.render("the query", [("shot one", "negative")]) == (
        "Classify the text. Answer with one of: positive, negative.\n\n"
        "Text: shot one\nAnswer: negative\n\nText: the query\nAnswer:"
    )
    recorded = prompt.to_json()
    assert recorded["prefix"] + "the query" + recorded["suffix"] == prompt.render("the query")
    assert Prompt.from_json(recorded) == prompt
    with pytest.raises(LoraclsError, match="must list each of the labels"):
        resolve_prompt(LABELS, ["x"], PromptConfig(label_order="positive"))
    with pytest.raises(LoraclsError, match=r"no \{text\} placeholder"):
        resolve_prompt(LABELS, ["x"], PromptConfig(prompt_template="Review:"))


def test_language_picks_the_template_and_chinese_verbalisers():
    assert detect_language(["质量很好，推荐购买", "太差了"]) == "zh"
    assert detect_language(["great value", "质量"]) == "en"
    prompt = resolve_prompt(LABELS, ["质量很好，推荐购买"], PromptConfig())
    assert prompt.template == TEMPLATES["zh-options"] and prompt.words == {
        "negative": "负面",
        "positive": "正面",
    }
    assert parse_verbalizers("positive=good,negative=bad", LABELS) == {"negative": "bad", "positive": "good"}
    with pytest.raises(LoraclsError, match=r"missing: \['negative'\]"):
        parse_verbalizers("positive=good", LABELS)


def test_shots_are_balanced_seeded_and_refused_when_too_few():
    train = toy_reviews(40).assign(id=lambda t: t.index.astype(str))
    shots = draw_shots(train, LABELS, 4, seed=1)
    assert sorted(shots["label"]) == ["negative", "negative", "positive", "positive"]
    assert shots.index.is_unique
    assert draw_shots(train, LABELS, 4, seed=1).index.tolist() == shots.index.tolist()
    assert draw_shots(train, LABELS, 4, seed=2).index.tolist() != shots.index.tolist()
    with pytest.raises(LoraclsError, match="Not enough training examples of label 'negative'"):
        draw_shots(train.head(3), LABELS, 4, seed=1)


def test_reversed_order_and_distribution_catch_a_position_bias(llama, monkeypatch):
    """A model that always answers with the option listed second: the reversed order exposes it."""
    model, tokenizer = llama
    table = toy_reviews(10).assign(id=lambda t: t.index.astype(str))
    words = "negative=bad,positive=good"

    def second_listed(model, tokenizer, prompts, tokens, batch_size=16, advance=None):
        first_line = tokenizer.decode(prompts[0]).split("\n")[0]  # "Answer one of: bad, good."
        second = first_line.rstrip(".").split(": ")[1].split(", ")[1]
        scores = np.full((len(prompts), 2), -5.0)
        scores[:, LABELS.index({"bad": "negative", "good": "positive"}[second])] = -0.1
        return scores

    monkeypatch.setattr(baseline, "label_log_probs", second_listed)
    options = TrainConfig(verbalizers=words, prompt_instruction="Answer one of: {options}.")
    metrics = run_baseline(model, tokenizer, table, LABELS, None, options)
    assert metrics["pred_distribution"] == {"negative": 0, "positive": 10}
    assert metrics["swapped_order"]["pred_distribution"] == {"negative": 10, "positive": 0}
    assert metrics["swapped_order"]["label_order"] == ["positive", "negative"]
    assert metrics["accuracy"] == metrics["swapped_order"]["accuracy"] == 0.5


def test_a_prompt_without_the_label_list_is_not_read_twice(llama, monkeypatch):
    """Reversing the label order changes nothing in a prompt that does not list them: one reading less."""
    model, tokenizer = llama
    table = toy_reviews(10).assign(id=lambda t: t.index.astype(str))
    calls = []
    scorer = baseline.label_log_probs

    def counted(model, tokenizer, prompts, *args, **kwargs):
        calls.append(len(prompts))
        return scorer(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(baseline, "label_log_probs", counted)
    plain = TrainConfig(verbalizers="negative=bad,positive=good", prompt_instruction="")  # no label list
    metrics = run_baseline(model, tokenizer, table, LABELS, None, plain)
    assert calls == [10, len(baseline.CONTENT_FREE)]  # the texts and the content-free inputs, once each
    assert metrics["swapped_order"]["accuracy"] == metrics["uncalibrated"]["accuracy"]
    assert "the prompt lists no labels" in baseline.baseline_line(metrics)
    calls.clear()
    listed = TrainConfig(verbalizers="negative=bad,positive=good", prompt_instruction="One of: {options}.")
    run_baseline(model, tokenizer, table, LABELS, None, listed)
    assert calls == [10, len(baseline.CONTENT_FREE), 10]  # and the texts in the reversed order


def test_run_baseline_writes_metrics_and_every_prediction(llama, tmp_path):
    model, tokenizer = llama
    table = toy_reviews(12, seed=3).assign(id=lambda t: [f"r{i}" for i in t.index])
    train = toy_reviews(20, seed=4).assign(id=lambda t: t.index.astype(str))
    options = TrainConfig(baseline_shots=2, calibrate=True, verbalizers="negative=bad,positive=good")
    metrics = run_baseline(model, tokenizer, table, LABELS, train, options, tmp_path)
    stored = json.loads((tmp_path / "baseline_metrics.json").read_text())
    assert stored["headline"] == "calibrated" and stored["accuracy"] == stored["calibrated"]["accuracy"]
    assert sum(stored["pred_distribution"].values()) == 12 and metrics["prompt"]["shots"] == 2
    assert stored["prompt"]["example"].count("Answer:") == 3  # two shots and the query
    lines = [json.loads(x) for x in (tmp_path / "baseline_predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"r{i}" for i in range(12)]
    first = lines[0]
    assert first["predicted"] == max(first["calibrated"], key=first["calibrated"].get)
    assert abs(sum(first["probabilities"].values()) - 1) < 1e-4


def test_multimodal_gemma4_baseline_loads_the_language_model_only(tiny_models):
    from transformers import Gemma4ForConditionalGeneration

    path = tiny_models["gemma4mm"]
    text_only = load_causal_lm(str(path))
    assert type(text_only).__name__ == "Gemma4ForCausalLM"
    full = Gemma4ForConditionalGeneration.from_pretrained(path).eval()
    ids = torch.tensor([[2, 10, 11, 12, 13]])
    with torch.no_grad():
        torch.testing.assert_close(text_only(input_ids=ids).logits, full(input_ids=ids).logits)


def test_baseline_command_scores_a_file_in_full(tiny_models, tmp_path):
    data, train = tmp_path / "test.csv", tmp_path / "train.csv"
    toy_reviews(14, seed=5).to_csv(data, index=False)
    toy_reviews(30, seed=6).to_csv(train, index=False)
    out = tmp_path / "baseline"
    args = ["baseline", "--model", tiny_models["qwen3"], "--data", data, "--train", train, "--shots", "2"]
    result = invoke(*args, "--verbalizers", "negative=bad,positive=good", "--out", out)
    assert result.exit_code == 0, result.output
    assert "2-shot" in result.output and "14 examples" in result.output
    assert len((out / "baseline_predictions.jsonl").read_text().splitlines()) == 14
    result = invoke("baseline", "--model", tiny_models["qwen3"], "--data", data, "--shots", "2")
    assert result.exit_code == 2 and "--train FILE" in result.output


def test_training_reports_the_baseline_beside_the_test_metrics(trained):
    run, output = trained["gemma3"]
    metrics = json.loads((run / "metrics.json").read_text())
    baseline = metrics["baseline"]
    assert set(baseline["pred_distribution"]) == set(LABELS)
    assert sum(baseline["pred_distribution"].values()) == metrics["data"]["test"]
    assert (run / "baseline_metrics.json").is_file() and (run / "baseline_predictions.jsonl").is_file()
    assert "prompt baseline (uncalibrated, 0-shot)" in output and "fine-tuned:" in output


def test_no_baseline_skips_it(tiny_models, toy_csv, tmp_path):
    from tests.conftest import FAST

    out = tmp_path / "run"
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", toy_csv, "--out", out, "--no-baseline", *FAST
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "metrics.json").read_text())["baseline"] is None
    assert not (out / "baseline_metrics.json").exists() and "prompt baseline" not in result.output

    with_baseline = tmp_path / "with"
    assert (
        invoke(
            "train", "--model", tiny_models["llama"], "--data", toy_csv, "--out", with_baseline, *FAST
        ).exit_code
        == 0
    )
    # the fine-tune does not depend on whether the baseline ran first
    assert (out / "test_predictions.jsonl").read_text() == (
        with_baseline / "test_predictions.jsonl"
    ).read_text()


def test_baseline_command_runs_on_the_inference_device_in_auto_precision(tiny_models, tmp_path, monkeypatch):
    """`loracls baseline` used to load the LM on the CPU in fp32 whatever the machine; a ROCm or CUDA user's
    baseline runs on the GPU in the precision `auto` picks there."""
    from transformers import Qwen3ForCausalLM

    asked, seen = [], []
    monkeypatch.setattr(baseline, "inference_device", lambda: asked.append(1) or torch.device("cpu"))
    monkeypatch.setattr(
        "loracls.environment.devices.cpu_has_fast_bf16", lambda flags=None: True
    )  # auto = bf16 here
    forward = Qwen3ForCausalLM.forward

    def recording(self, *args, **kwargs):
        seen.append((next(self.parameters()).device.type, torch.is_autocast_enabled("cpu")))
        seen[-1] += (torch.get_autocast_dtype("cpu"),)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Qwen3ForCausalLM, "forward", recording)
    data = tmp_path / "test.csv"
    toy_reviews(6, seed=5).to_csv(data, index=False)
    result = invoke("baseline", "--model", tiny_models["qwen3"], "--data", data)
    assert result.exit_code == 0, result.output
    assert asked and seen and set(seen) == {("cpu", True, torch.bfloat16)}


def test_auto_offers_every_template_of_the_language_with_every_fitting_word_set():
    english = candidate_prompts(LABELS, ["a text"], PromptConfig())
    names = {p.name for p in english}
    assert names == {"en-options", "en-label", "en-sentiment", "en-it-was", "en-review"}
    assert len(english) == 5 * 3  # label names, great/terrible, good/bad: all name both labels
    assert english[0].name == "en-options" and english[0].words == {
        "negative": "negative",
        "positive": "positive",
    }
    # labels a sentiment word set does not name: the label names alone
    assert len(candidate_prompts(["sports", "tech"], ["a text"], PromptConfig())) == 5
    # fixed words or an own template leave less to choose
    assert len(candidate_prompts(LABELS, ["x"], PromptConfig(verbalizers="negative=no,positive=yes"))) == 5
    assert len(candidate_prompts(LABELS, ["x"], PromptConfig(prompt_template="{text} =>"))) == 3
    assert len(candidate_prompts(LABELS, ["x"], PromptConfig(prompt="zh-overall"))) == 4
    with pytest.raises(LoraclsError, match="not one of: auto, en-options"):
        candidate_prompts(LABELS, ["x"], PromptConfig(prompt="fr-options"))


def test_the_baseline_command_interrupted_says_where_and_that_nothing_was_written(tiny_models, tmp_path):
    from tests.test_runs import signal_during

    data, out = tmp_path / "test.csv", tmp_path / "baseline"
    toy_reviews(14, seed=5).to_csv(data, index=False)
    args = ["baseline", "--model", tiny_models["llama"], "--data", data, "--out", out]
    args += ["--verbalizers", "negative=bad,positive=good"]
    code, stderr = signal_during(
        "label_log_probs", signal.SIGINT, args, tmp_path, "loracls.training.baseline"
    )
    assert code == 130 and "Traceback" not in stderr and "Aborted" not in stderr
    said = r"interrupted during baseline: the texts, 0 of \d+ prompts; nothing was written"
    assert re.search(said, stderr), stderr
    assert not out.exists()
