"""Prompts: how a run stores its label words and label order (any string is a label), label names made
readable, and the texts' language."""

import json

import pytest
import yaml
from tokenizers import processors

from loracls.config import PromptConfig, TrainConfig
from loracls.data.prompts import (
    Prompter,
    candidate_prompts,
    language_note,
    pin_prompt,
    read_descriptions,
    readable_words,
    resolve_prompt,
    text_language,
)
from loracls.errors import LoraclsError
from tests.conftest import FAST, char_tokenizer, invoke, toy_reviews

ODD = ["a,b", "x=y", "1,000+"]
"""Labels with the characters the old `label=word,...` string split at."""


def test_labels_with_commas_and_equals_signs_train_by_default(tiny_models, tmp_path):
    """A default run pins its prompt into config.yaml; as a `label=word,...` string, `a,b` and `x=y` could
    not be read back ("label_order ... must list each of the labels"); a YAML mapping holds any label."""
    table = toy_reviews(120)
    table["label"] = [ODD[i % 3] for i in range(len(table))]
    data = tmp_path / "odd.csv"
    table.to_csv(data, index=False)
    out = tmp_path / "run"
    result = invoke("train", "--model", tiny_models["llama"], "--data", data, "--out", out, *FAST)
    assert result.exit_code == 0, result.output
    stored = yaml.safe_load((out / "config.yaml").read_text())
    assert sorted(stored["label_order"]) == sorted(ODD)
    assert sorted(stored["verbalizers"]) == sorted(ODD)
    assert json.loads((out / "prompt.json").read_text())["label_order"] == stored["label_order"]
    result = invoke("eval", out)  # reads the pinned prompt back from config.yaml
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())["test"]
    assert json.loads((out / "eval/test/metrics.json").read_text())["accuracy"] == metrics["accuracy"]


def test_a_pinned_prompt_reads_back_through_config_yaml(tmp_path):
    labels = ["a,b", "x=y", " spaced"]
    cfg = TrainConfig(prompt="en-label")
    words = {"a,b": "p", "x=y": "q", " spaced": "r"}
    chosen = resolve_prompt(labels, [], PromptConfig(prompt="en-label", verbalizers=words))
    pin_prompt(cfg, chosen)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    again = resolve_prompt(labels, [], TrainConfig.load(path, written=True))
    assert (again.words, again.order) == (chosen.words, chosen.order)


def test_the_string_forms_still_read(tmp_path):
    """A run written before the mapping stored `label=word,...` and `a,b,...`; the command line takes them."""
    path = tmp_path / "config.yaml"
    old = TrainConfig().to_dict() | {"verbalizers": "pos=good,neg=bad", "label_order": "pos, neg"}
    path.write_text(yaml.safe_dump(old))
    prompt = resolve_prompt(["neg", "pos"], [], TrainConfig.load(path, written=True))
    assert prompt.words == {"neg": "bad", "pos": "good"} and prompt.order == ["pos", "neg"]
    cfg = TrainConfig.load(None, {"verbalizers": "pos=good,neg=bad"})
    assert resolve_prompt(["neg", "pos"], [], cfg).words == {"neg": "bad", "pos": "good"}


@pytest.mark.parametrize(
    ("labels", "words"),
    [
        (["AddToPlaylist", "GetWeather"], ["add to playlist", "get weather"]),
        (
            ["card_arrival", "exchange_rate", "Refund_not_showing_up"],
            ["card arrival", "exchange rate", "refund not showing up"],
        ),
        (["route_xx_refund", "route_xx_cancel", "route_xx_payment"], ["refund", "cancel", "payment"]),
        (["HTTPError", "url-path", "a.b/c"], ["http error", "url path", "a b c"]),
    ],
)
def test_label_names_become_words_and_a_shared_prefix_goes(labels, words):
    assert readable_words(labels) == dict(zip(labels, words, strict=True))


@pytest.mark.parametrize(
    "labels",
    [["positive", "negative"], ["1", "2", "3"], ["体育", "财经"], ["x_a", "x_a_"], ["a-b", "a_b"]],
)
def test_names_that_read_already_or_would_collide_stay_as_they_are(labels):
    """Nothing to change, or two labels that would become one word (`x a`, `a b`)."""
    assert readable_words(labels) is None


def test_a_task_that_is_not_sentiment_gets_its_readable_names_as_a_second_word_set():
    labels = ["BookRestaurant", "PlayMusic"]
    candidates = candidate_prompts(labels, ["play some jazz for me"], PromptConfig())
    words = [c.words for c in candidates]
    assert {"BookRestaurant": "book restaurant", "PlayMusic": "play music"} in words
    assert {"BookRestaurant": "BookRestaurant", "PlayMusic": "PlayMusic"} in words
    assert len(candidates) == 2 * len({c.name for c in candidates}) == 10  # every en template, both sets
    sentiment = candidate_prompts(["negative", "positive"], ["fine"], PromptConfig())
    assert all(c.words != readable_words(["negative", "positive"]) for c in sentiment)


@pytest.mark.parametrize(
    ("texts", "language"),
    [
        (
            ["Hola, quiero cancelar mi pedido.", "No he recibido el reembolso de la compra, necesito ayuda."],
            "latin",
        ),
        (["Bonjour, je voudrais annuler ma commande et obtenir le remboursement."], "latin"),
        (["Привет, хочу вернуть деньги за заказ", "Карта не работает"], "ru"),
        (["こんにちは、注文をキャンセルしたいです", "返金してください"], "ja"),
        (["환불하고 싶어요", "카드가 작동하지 않아요"], "ko"),
        (["质量很好，推荐购买", "太差了"], "zh"),
        (["I want my money back, the card is not working", "where is my refund?"], "en"),
        (["", "12345"], "en"),
    ],
)
def test_the_texts_language_is_told_by_script_and_latin_script_english_by_its_words(texts, language):
    assert text_language(texts) == language
    note = language_note(texts)
    assert (note is None) == (language in ("en", "zh"))
    if note:
        assert "the English ones are used" in note


def test_a_run_on_spanish_texts_says_the_english_templates_are_used(tiny_models, tmp_path):
    texts = ["quiero cancelar mi pedido", "el pago de mi tarjeta no funciona", "necesito un reembolso ya"]
    data = tmp_path / "es.csv"
    rows = [f"{texts[i % 3]} {i}, route_es_{['cancel', 'payment', 'refund'][i % 3]}" for i in range(60)]
    data.write_text("text,label\n" + "\n".join(rows) + "\n", encoding="utf-8")
    args = ["train", "--model", tiny_models["llama"], "--data", data, "--out", tmp_path / "run", *FAST]
    result = invoke(*args, "--epochs", "1", "--no-baseline")
    assert result.exit_code == 0, result.output
    assert "the texts look Latin-script but not English" in " ".join(result.output.split())
    chosen = json.loads((tmp_path / "run/prompt.json").read_text())["choice"]
    assert any(
        c["verbalizers"] == "route_es_cancel=cancel,route_es_payment=payment,route_es_refund=refund"
        for c in chosen["candidates"]
    )


DESCRIBED = {"card_arrival": "my card has not arrived", "refund": "money back for a purchase"}


@pytest.mark.parametrize("form", ["mapping", "yaml", "json", "csv", "tsv"])
def test_label_descriptions_read_from_a_mapping_or_a_file_join_the_search(tmp_path, form):
    spec = DESCRIBED
    if form != "mapping":
        spec = tmp_path / f"descriptions.{form}"
        if form in ("csv", "tsv"):
            sep = "," if form == "csv" else "\t"
            lines = [f"label{sep}description"] + [f"{k}{sep}{v}" for k, v in DESCRIBED.items()]
            spec.write_text("\n".join(lines) + "\n", encoding="utf-8")
        else:
            spec.write_text(json.dumps(DESCRIBED) if form == "json" else yaml.safe_dump(DESCRIBED))
        spec = str(spec)
    assert read_descriptions(spec, list(DESCRIBED)) == DESCRIBED
    candidates = candidate_prompts(
        list(DESCRIBED), ["where is my card"], PromptConfig(label_descriptions=spec)
    )
    assert sum(c.words == DESCRIBED for c in candidates) == 5  # with each English template
    options = [c for c in candidates if c.name == "en-options" and c.words == DESCRIBED][0]
    assert "my card has not arrived, money back for a purchase" in options.render("x")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("card_arrival: my card has not arrived\n", r"missing or empty: \['refund'\]"),
        ("card_arrival: late card\nrefund: ''\n", r"missing or empty: \['refund'\]"),
        ("card_arrival: a\nrefund: b\nrefnd: c\n", r"not a label of the data: \['refnd'\]"),
        ("- card_arrival\n- refund\n", "must map each label to its description"),
        ("card_arrival: [unclosed\n", "not YAML or JSON"),
    ],
)
def test_label_descriptions_that_miss_a_label_or_name_an_unknown_one_are_refused(tmp_path, content, message):
    path = tmp_path / "descriptions.yaml"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(LoraclsError, match=message) as caught:
        read_descriptions(str(path), list(DESCRIBED))
    assert str(path) in str(caught.value)
    table = tmp_path / "descriptions.csv"
    table.write_text("name,text\ncard_arrival,late\n", encoding="utf-8")
    with pytest.raises(LoraclsError, match="needs the columns `label` and `description`"):
        read_descriptions(str(table), list(DESCRIBED))
    with pytest.raises(LoraclsError, match="is not a file"):
        read_descriptions(str(tmp_path / "absent.yaml"), list(DESCRIBED))


def test_a_run_scores_its_label_descriptions_and_keeps_them_in_its_config(tiny_models, tmp_path):
    table = toy_reviews(90)
    data, described = tmp_path / "reviews.csv", tmp_path / "labels.yaml"
    table.to_csv(data, index=False)
    words = {"negative": "a bad review", "positive": "a good review"}
    described.write_text(yaml.safe_dump(words), encoding="utf-8")
    args = ["train", "--model", tiny_models["llama"], "--data", data, "--out", tmp_path / "run", *FAST]
    args += ["--label-descriptions", described, "--prompt", "en-label", "--head-init", "verbalizer"]
    result = invoke(*args, "--no-baseline", "--prompt-sample", "20")
    assert result.exit_code == 0, result.output
    chosen = json.loads((tmp_path / "run/prompt.json").read_text())
    assert "negative=a bad review,positive=a good review" in [
        c["verbalizers"] for c in chosen["choice"]["candidates"]
    ]
    config = yaml.safe_load((tmp_path / "run/config.yaml").read_text())
    assert config["label_descriptions"] == words  # the run keeps them, not the file's name

    described.write_text("negative: a bad review\npositiv: a good review\n", encoding="utf-8")
    bad = invoke("train", "--model", tmp_path / "never-loaded", "--data", data, "--out", tmp_path / "bad",
                 "--label-descriptions", described)  # fmt: skip
    assert bad.exit_code == 2 and "not a label of the data: ['positiv']" in " ".join(bad.output.split())
    assert not (tmp_path / "bad").exists()  # refused before a run folder or a model


def test_a_prompter_puts_the_prompts_ids_around_the_texts_own_and_an_export_keeps_them():
    """The prompt's prefix and suffix are tokenised apart from the text (what an export's tokenizer adds to
    any text), the tokenizer's own special tokens first; the text alone is cut to max_length."""
    tokenizer = char_tokenizer()
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)]
    )
    prompt = resolve_prompt(["negative", "positive"], [], PromptConfig(prompt="en-label"))
    prompter = Prompter(tokenizer, prompt, [], 5, answer_start=[7])
    before, after = prompter.around()
    assert before[0] == bos and tokenizer.decode(before[1:]) == "Text: "
    assert tokenizer.decode(after[:-1]) == "\nLabel:" and after[-1] == 7
    own = tokenizer("abcdefgh", add_special_tokens=False)["input_ids"]
    assert prompter.encode(["abcdefgh", "ab"]) == [before + own[:5] + after, before + own[:2] + after]
    joined = Prompter(tokenizer, prompt, [], 5, answer_start=[7], pieces=False)
    assert joined.encode(["abcdefgh"]) == prompter.encode(["abcdefgh"])  # one token a character: the same

    stored = Prompter.from_json(tokenizer, json.loads(json.dumps(prompter.to_json())), 5)
    assert stored.fixed == (before, after) and stored.pieces
    expected = prompter.encode(["abcdefgh"])
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    assert prompter.encode(["abcdefgh"]) != expected  # recomputed: no <bos> now
    assert stored.encode(["abcdefgh"]) == expected  # the ids it recorded, not recomputed
    older = {k: v for k, v in prompter.to_json().items() if k not in ("prefix_ids", "suffix_ids")}
    assert not Prompter.from_json(tokenizer, older, 5).pieces  # an export that read the joined string
