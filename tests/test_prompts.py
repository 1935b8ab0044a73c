"""How a run stores its prompt's label words and label order: any string is a label."""

import json

import yaml

from loracls.config import PromptConfig, TrainConfig
from loracls.data.prompts import pin_prompt, resolve_prompt
from tests.conftest import FAST, invoke, toy_reviews

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
