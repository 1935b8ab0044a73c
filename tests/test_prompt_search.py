"""The prompt search: its plan (what it costs, what `prompt_budget` cuts), the line before it, the choice
(by macro-F1 on training examples, with its kappa's interval), its progress and interrupt, and the table
after it, on the tiny models' character tokenizer."""

import math
import re
import signal

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from loracls.config import TrainConfig
from loracls.data.prompts import TEMPLATES, Prompt, format_verbalizers, pin_prompt, resolve_prompt
from loracls.model import load_causal_lm, load_tokenizer
from loracls.training import prompt_search
from loracls.training.prompt_search import (
    UNSCORED,
    PromptChoice,
    choose_prompt,
    kappa_standard_error,
    plan_search,
    prompt_table,
    search_line,
    within_budget,
)
from tests.conftest import toy_reviews

LABELS = ["negative", "positive"]


@pytest.fixture(scope="module")
def llama(tiny_models):
    path = str(tiny_models["llama"])
    return load_causal_lm(path), load_tokenizer(path)


def test_a_search_over_its_budget_scores_fewer_examples_then_fewer_candidates(llama):
    """Every candidate group reads a text's prompt once (the words' later tokens ride on its cache): 7 groups,
    the 3 word sets of a template that lists the options (3 prompts) and 4 templates that do not (each one
    prompt for its 3 word sets); the character tokenizer makes every word several tokens, counted too."""
    model, tokenizer = llama
    assert within_budget([2, 2, 2, 6, 6, 6, 6], 40, 2, 0) == (7, 40)  # no limit
    assert within_budget([2, 2, 2, 6, 6, 6, 6], 40, 2, 30 * 40) == (7, 40)  # it fits
    assert within_budget([2, 2, 2, 6, 6, 6, 6], 40, 2, 300) == (7, 10)  # a smaller sample fits
    assert within_budget([2, 2, 2, 6, 6, 6, 6], 40, 2, 30) == (3, 4)  # 2 a label, 3 candidates fit

    train = toy_reviews(60).assign(id=lambda t: t.index.astype(str))
    whole = plan_search(tokenizer, train, LABELS, TrainConfig(prompt_sample=40, prompt_budget=0))
    assert whole.passes == [1] * 7 and whole.cut() == ""
    per_text = sum(whole.tokens)  # each group reads the prompt and the text, 20 characters and more
    # two rounds: every group on 32 of the 40 texts, the best 2 of 7 (at their mean) on the other 8
    assert (whole.first, whole.kept) == (32, 2)
    assert per_text > 7 * 20 and whole.total(whole.tokens) == round(per_text * 32 + 8 * 2 * per_text / 7)
    smaller = plan_search(
        tokenizer, train, LABELS, TrainConfig(prompt_sample=40, prompt_budget=math.ceil(per_text * 10))
    )
    assert (smaller.sample, smaller.scored()) == (10, 15) and smaller.cut().startswith(
        "10 of 40 examples to fit"
    )

    budget = math.ceil(
        sum(whole.tokens[:3]) * 4
    )  # the three prompts that list the options, on 2 texts a label
    cfg = TrainConfig(prompt_sample=40, prompt_budget=budget)
    plan = plan_search(tokenizer, train, LABELS, cfg)
    assert (plan.sample, plan.scored(), plan.total(plan.passes)) == (4, 3, 12)
    line = " ".join(search_line(plan, cfg, wants_baseline=False).split())
    assert "scoring 3 candidate prompts on 4 training examples (12 prompts, " in line
    assert (
        f"cut to 4 of 40 examples and 12 candidates left unscored to fit --prompt-budget {budget:,} tokens)"
        in line
    )
    choice = choose_prompt(model, tokenizer, train, LABELS, cfg, plan)
    assert choice.sample == 4 and sum("macro_f1" in row for row in choice.candidates) == 3
    assert [row.get("skipped") for row in choice.candidates[3:]] == [UNSCORED] * 12


def test_every_candidate_reads_a_first_part_of_the_sample_and_the_best_read_the_rest(llama, monkeypatch):
    """64 texts, 7 groups: every group reads 32 of them (a stratified part), the best 2 groups the other 32
    too, and the choice is made among those on all 64. The prompts read are the plan's count; a group's
    second round reads texts its first did not; the rows say on how many texts each was scored."""
    model, tokenizer = llama
    train = toy_reviews(100).assign(id=lambda t: t.index.astype(str))
    good = {"good", "great", "love"}
    calls: list[set[str]] = []  # per call, the texts read (their "#1234" ends)

    def oracle(model, tokenizer, prompts, tokens, batch_size=16, advance=None):
        """Right only after `It was` with great/terrible; half right after `review`."""
        scores = np.full((len(prompts), len(tokens)), -1.0)
        texts = [tokenizer.decode(ids) for ids in prompts]
        calls.append({re.search(r"#\d+", text).group() for text in texts})
        for i, text in enumerate(texts):
            positive = bool(good & set(text.split("\n")[0].split()))
            for pair in range(0, len(tokens), 2):
                right = "It was" in text and tokenizer.decode(tokens[pair + 1]) == " great"
                half = "review" in text.lower() and i % 2 == 0
                scores[i, pair + (int(positive) if right or half else 0)] = -0.1
        return scores

    monkeypatch.setattr(prompt_search, "label_log_probs", oracle)
    cfg = TrainConfig(prompt_sample=64, prompt_budget=0)
    plan = plan_search(tokenizer, train, LABELS, cfg)
    assert (plan.sample, plan.first, plan.kept, len(plan.groups)) == (64, 32, 2, 7)
    choice = choose_prompt(model, tokenizer, train, LABELS, cfg, plan)
    assert choice.prompt.name == "en-it-was" and choice.prompt.words["positive"] == "great"
    assert sum(len(texts) for texts in calls) == plan.total(plan.passes) == 7 * 32 + 2 * 32
    assert [len(texts) for texts in calls] == [32] * 9
    assert all(texts == calls[0] for texts in calls[:7]) and calls[7] == calls[8]
    assert not calls[0] & calls[7]  # the rest: the other texts
    scored_on = sorted(row["n"] for row in choice.candidates)
    assert choice.first == 32 and scored_on.count(64) in (2, 3, 4, 5, 6) and scored_on[0] == 32
    assert choice.chosen()["n"] == 64 and choice.chosen()["macro_f1"] == 1.0
    # the right label's probability among the labels: scores -0.1 against -1.0
    assert choice.chosen()["gold_log_prob"] == pytest.approx(-np.log1p(np.exp(-0.9)), abs=1e-4)
    recorder = Console(record=True, width=200)
    recorder.print(prompt_table(choice.prompt, choice.candidates, choice.sample, choice.first))
    said = " ".join(recorder.export_text().split())
    assert "on 64 training examples (every candidate read 32 of them, the best few all)" in said


def test_a_sample_smaller_than_the_labels_grows_to_two_texts_a_label(llama):
    """`--prompt-sample 8` on 10 intents once stopped the run: a stratified sample of 8 cannot hold 10
    labels. It takes 2 a label (20) instead, and the search runs."""
    model, tokenizer = llama
    labels = [f"intent_{k}" for k in range(10)]
    train = pd.DataFrame(
        {"text": [f"words of {k} number {n}" for k in range(10) for n in range(5)], "label": labels * 5}
    )
    cfg = TrainConfig(prompt_sample=8)
    plan = plan_search(tokenizer, train, labels, cfg)
    assert plan.sample == 20
    choice = choose_prompt(model, tokenizer, train, labels, cfg, plan)
    assert choice.sample == 20 and choice.chosen()["n"] == 20


def test_the_prompt_table_shows_the_best_few_and_the_chosen_one_briefly():
    """Ten labels that are their own words in 20 candidates: the old one-line list repeated every label's
    `name=name` in each; the table shows the best five, `the label names`, and says where all of them are."""
    labels = ["书籍", "平板", "手机", "水果", "洗发水", "热水器", "蒙牛", "衣服", "计算机", "酒店"]
    names = format_verbalizers({label: label for label in labels})
    rows = [
        {
            "template": f"zh-{n}",
            "verbalizers": names if n % 2 else format_verbalizers({label: f"类{label}" for label in labels}),
            **{"accuracy": n / 40, "macro_f1": n / 40, "kappa": n / 50, "gold_log_prob": -1.0},
        }
        for n in range(20)
    ]
    prompt = Prompt("zh-19", TEMPLATES["zh-label"], {label: label for label in labels}, labels)
    choice = PromptChoice(prompt, rows, 128)
    recorder = Console(record=True, width=160)
    recorder.print(prompt_table(choice.prompt, choice.candidates, choice.sample))
    shown = recorder.export_text()
    said = " ".join(shown.split())
    assert "prompt: chose zh-19 (the label names) by zero-shot macro-F1 on 128 training examples" in said
    assert "the best 5 of 20 candidates (all of them in prompt.json)" in said
    best = ["zh-19", "zh-18", "zh-17", "zh-16", "zh-15"]
    assert re.findall(r"zh-\d+", shown) == ["zh-19", *best]  # the title's, then the rows'
    marked = [line for line in shown.splitlines() if "chosen" in line]
    assert len(marked) == 1 and "zh-19" in marked[0] and "the label names" in marked[0]
    assert "书籍=书籍" not in shown and "书籍=类书籍,平板=类平板,手机=类手机," in shown
    assert len(shown) < 1500 and choice.to_json()["candidates"] == rows  # prompt.json keeps all 20


@pytest.mark.parametrize(
    ("kappa", "kappa_se", "sample", "chosen"),
    [(0.125, 0.10, 32, False), (0.125, 0.03, 512, True), (0.08, 0.01, 512, False), (0.3, 0.05, 128, True)],
)
def test_auto_takes_the_prompts_head_only_on_a_kappa_beyond_noise(kappa, kappa_se, sample, chosen):
    """`head_init: auto` once took the verbaliser head on a kappa of 0.125 from 32 examples: its 90% interval
    reaches below 0: chance. It needs `PROMPT_KAPPA` and an interval above 0, and says which it lacked."""
    labels = ["negative", "positive"]
    words = {"negative": "bad", "positive": "good"}
    row = {"template": "en-label", "verbalizers": format_verbalizers(words), "accuracy": 0.6, "macro_f1": 0.6}
    choice = PromptChoice(Prompt("en-label", TEMPLATES["en-label"], words, labels), [row], sample, 0.5)
    row.update(kappa=kappa, kappa_se=kappa_se)
    assert choice.informative() is chosen
    line = choice.informative_line()
    assert f"from {sample} examples" in line and "0.1 needed, its interval above 0" in line
    assert ("within noise of chance" in line) == (kappa - 1.645 * kappa_se <= 0)


def test_the_prompt_is_chosen_by_macro_f1_on_training_examples_and_pinned(llama, monkeypatch):
    """A model that answers right only after `It was` with great/terrible: that candidate is chosen, and
    pinning it into a config resolves to it again without any texts."""
    model, tokenizer = llama
    train = toy_reviews(60).assign(id=lambda t: t.index.astype(str))
    good = {"good", "great", "love"}

    def oracle(model, tokenizer, prompts, tokens, batch_size=16, advance=None):
        # columns come in label pairs, one pair per word set sharing the prompt
        scores = np.full((len(prompts), len(tokens)), -1.0)
        for i, ids in enumerate(prompts):
            text = tokenizer.decode(ids)
            positive = bool(good & set(text.split("\n")[0].split()))
            for pair in range(0, len(tokens), 2):
                right = "It was" in text and tokenizer.decode(tokens[pair + 1]) == " great"
                scores[i, pair + (int(positive) if right else 0)] = -0.1
        return scores

    monkeypatch.setattr(prompt_search, "label_log_probs", oracle)
    cfg = TrainConfig(prompt_sample=40)
    choice = choose_prompt(model, tokenizer, train, LABELS, cfg)
    assert choice.prompt.name == "en-it-was" and choice.prompt.words["positive"] == "great"
    assert 38 <= choice.sample <= 40 and len(choice.candidates) == 15  # a stratified sample of 40
    best = max(r["macro_f1"] for r in choice.candidates)
    assert best == 1.0 and sorted(r["macro_f1"] for r in choice.candidates)[-2] < 0.5
    pin_prompt(cfg, choice.prompt)
    assert resolve_prompt(LABELS, [], cfg) == choice.prompt
    # nothing to choose without training examples: the language's first template
    assert choose_prompt(model, tokenizer, None, LABELS, TrainConfig()).prompt.name == "en-options"


def test_the_prompt_search_shows_where_it_is_and_how_long_the_rest_will_take(llama, terminal, monkeypatch):
    """Its bar counts the prompts read and names the candidates in progress; after the first candidate a
    line says how long that took and the rest will (here always: `ETA_LINE_S` 0)."""
    model, tokenizer = llama
    train = toy_reviews(40).assign(id=lambda t: t.index.astype(str))
    cfg = TrainConfig(prompt_sample=8)
    monkeypatch.setattr(prompt_search, "ETA_LINE_S", 0.0)
    choose_prompt(model, tokenizer, train, LABELS, cfg)
    shown = terminal.getvalue()
    plan = plan_search(tokenizer, train, LABELS, cfg)
    passes = plan.total(plan.passes)
    # the bar's last frame: every prompt read, the last group (en-review's three word sets) in progress
    bar = rf"prompt search .*{passes}/{passes} prompts .*candidates 13-15 of 15"
    assert re.search(bar, shown), shown
    assert re.search(r"prompt: candidate 1 took \d+ s; about \d+ s for the rest", shown), shown


def test_an_interrupt_in_the_prompt_search_says_where_it_stopped(tiny_models, toy_csv, tmp_path):
    """A real SIGINT while the first candidate is scored: exit 130, the message names the stage and the
    candidate, nothing of the prompt was written, and the run is marked interrupted."""
    from tests.test_runs import short_args, signal_during, status

    out = tmp_path / "run"
    args = short_args(tiny_models["llama"], toy_csv, out)
    code, stderr = signal_during(
        "label_log_probs", signal.SIGINT, args, tmp_path, "loracls.training.prompt_search"
    )
    assert code == 130 and "Traceback" not in stderr
    said = "SIGINT: stopped while choosing the prompt and scoring the baseline (prompt search: candidate 1 of"
    assert said + " 15, 0 of " in stderr and "prompts); start it again (no checkpoint yet)" in stderr
    assert not (out / "prompt.json").exists() and status(out)["state"] == "interrupted"


def test_the_kappas_standard_error_is_cohens_large_sample_formula():
    gold = np.array([0, 1] * 50)
    predicted = gold.copy()
    predicted[:20] = 1 - predicted[:20]  # 80 of 100 right, both labels predicted half the time
    # p_o 0.8, p_e 0.5: sqrt(0.8 * 0.2 / (100 * 0.25)) = 0.08
    assert kappa_standard_error(gold, predicted, 2) == pytest.approx(0.08)
    # a quarter of the texts: twice as unsure
    assert kappa_standard_error(gold[:25], predicted[:25], 2) > 1.5 * 0.08
