"""Several classifiers on one base (`inference/shared_base.py`): each member answers as its own merged
classifier does, alone and in mixed batches; what cannot share a base is refused with the reason."""

import random
import threading
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest

from loracls.errors import LoraclsError
from loracls.inference.predict import Classifier
from loracls.inference.shared_base import ClassifierSet, read_member
from tests.conftest import FAST, invoke, toy_reviews
from tests.test_serve import server

TEXTS = ["the book was good", "awful plot", "it was very late", "love it", "the", "hate the story and book"]


def toy_topics(n: int, seed: int = 0) -> pd.DataFrame:
    """A learnable three-class task, labels as codes: the label is decided by one word among filler."""
    rng = random.Random(seed)
    words = {
        "topic_food": ["pizza", "bread"],
        "topic_travel": ["train", "flight"],
        "topic_money": ["bank", "card"],
    }
    filler = ["the", "my", "was", "and", "it", "very", "late", "today"]
    rows = []
    for i in range(n):
        label = list(words)[i % 3]
        parts = rng.sample(filler, rng.randint(1, 5)) + [rng.choice(words[label])]
        rng.shuffle(parts)
        rows.append({"text": " ".join(parts), "label": label})
    return pd.DataFrame(rows)


def train_run(root: Path, model: Path, data: pd.DataFrame, name: str, *args: str) -> Path:
    csv = root / f"{name}.csv"
    data.to_csv(csv, index=False)
    result = invoke("train", "--model", model, "--data", csv, "--out", root / name, *FAST, *args)
    assert result.exit_code == 0, result.output
    return root / name


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Two classifiers on the tiny Llama: sentiment (2 labels, its head from the prompt, read inside it)
    and topics (3 labels, a zero head on the raw text)."""
    root = tmp_path_factory.mktemp("shared")
    llama = tiny_models["llama"]
    return {
        "sentiment": train_run(root, llama, toy_reviews(120), "sentiment", "--head-init", "verbalizer"),
        "topic": train_run(root, llama, toy_topics(120), "topic", "--head-init", "zero", "--no-baseline"),
    }


def own_probs(path: Path) -> np.ndarray:
    classifier = Classifier.load(path)
    classifier.precision = "fp32"
    return classifier.predict_probs(TEXTS)


def test_each_classifier_on_the_shared_base_answers_as_it_does_alone(runs):
    members = [read_member(name, path) for name, path in runs.items()]
    shared = ClassifierSet.load(members, precision="fp32")
    assert shared.classifiers["sentiment"].prompter is not None  # read inside its prompt
    assert shared.classifiers["topic"].prompter is None
    encoded = {}
    for name, path in runs.items():
        alone = own_probs(path)
        classifier = shared.classifiers[name]
        assert alone.shape == (len(TEXTS), len(classifier.labels))
        np.testing.assert_allclose(classifier.predict_probs(TEXTS), alone, atol=1e-5)
        encoded[name] = classifier.encode(TEXTS)["input_ids"]
    # one pass over rows of both, in batches that mix them
    mixed = shared.probs_mixed(encoded, batch_size=4)
    for name, path in runs.items():
        np.testing.assert_allclose(mixed[name], own_probs(path), atol=1e-5)
    # one LoRA base: two adapters, no second copy of the base's weights, one tokenizer (the same files)
    assert set(shared.shared.peft_config) == {"sentiment", "topic"}
    assert shared.classifiers["sentiment"].tokenizer is shared.classifiers["topic"].tokenizer


def test_classifiers_of_different_bases_are_refused_naming_them(runs, tiny_models, tmp_path):
    other = train_run(
        tmp_path, tiny_models["qwen3"], toy_topics(60), "qwen", "--head-init", "zero", "--no-baseline"
    )
    members = [read_member("topic", runs["topic"]), read_member("other", other)]
    with pytest.raises(LoraclsError, match=r"different base models \(topic: .*llama; other: .*qwen3\)"):
        ClassifierSet.load(members)


def test_a_merged_export_is_refused_with_what_to_export_instead(runs, tmp_path):
    result = invoke("export", runs["topic"], "--out", tmp_path / "merged")
    assert result.exit_code == 0, result.output
    with pytest.raises(
        LoraclsError, match="holds its own copy of the base; export the run with --adapter-only"
    ):
        read_member("topic", tmp_path / "merged")
    result = invoke("export", runs["topic"], "--out", tmp_path / "adapter", "--adapter-only")
    assert result.exit_code == 0, result.output
    member = read_member("topic", tmp_path / "adapter")
    shared = ClassifierSet.load([member, read_member("sentiment", runs["sentiment"])], precision="fp32")
    np.testing.assert_allclose(
        shared.classifiers["topic"].predict_probs(TEXTS), own_probs(runs["topic"]), atol=1e-5
    )


def test_one_server_answers_each_classifier_and_fans_out(runs):
    """The real server with two classifiers of 2 and 3 labels on one base: `model` picks one, a list fans out,
    `/v1/models` lists both, and a refused text to one classifier leaves the others' clients answered."""
    expected = {name: own_probs(path) for name, path in runs.items()}
    args = [f"{name}={path}" for name, path in runs.items()]
    with server(args, "--precision", "fp32", "--max-wait-ms", "20") as (url, process):
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["sentiment", "topic"]
        for name in runs:
            body = httpx.post(f"{url}/classify", json={"model": name, "input": TEXTS}).json()
            assert body["model"] == name
            np.testing.assert_allclose([d["probs"] for d in body["data"]], expected[name], atol=1e-5)
        fan = httpx.post(f"{url}/classify", json={"model": ["topic", "sentiment"], "input": TEXTS}).json()
        assert fan["model"] == ["topic", "sentiment"] and len(fan["data"]) == len(TEXTS)
        for n, item in enumerate(fan["data"]):
            assert list(item["results"]) == ["topic", "sentiment"]
            for name in runs:
                np.testing.assert_allclose(item["results"][name]["probs"], expected[name][n], atol=1e-5)
                assert item["results"][name]["num_classes"] == len(expected[name][n])
        ranked = httpx.post(f"{url}/predict", json={"model": "topic", "inputs": TEXTS[0]}).json()
        assert {r["label"] for r in ranked} == {"topic_food", "topic_money", "topic_travel"}
        refused = {
            "no model": ({"input": TEXTS}, 422, "holds 2 classifiers: name one in `model`"),
            "unknown": ({"model": "urgency", "input": TEXTS}, 404, "The model `urgency` does not exist"),
            "unknown in a fan-out": (
                {"model": ["topic", "urgency"], "input": TEXTS},
                404,
                "unknown ['urgency']",
            ),
            "twice": ({"model": ["topic", "topic"], "input": TEXTS}, 422, "a name twice"),
        }
        for case, (body, status, message) in refused.items():
            response = httpx.post(f"{url}/classify", json=body)
            assert response.status_code == status and message in response.json()["message"], case
        answers, bad = [], []

        def client(worker: int) -> None:
            with httpx.Client(timeout=60) as http:
                for n in range(4):
                    model = ["sentiment", "topic", ["sentiment", "topic"]][(worker + n) % 3]
                    answers.append(
                        (model, n, http.post(f"{url}/classify", json={"model": model, "input": TEXTS}))
                    )

        def bad_client() -> None:
            with httpx.Client(timeout=60) as http:
                for _ in range(6):
                    body = b'{"model": "topic", "input": ["good", "\\ud800 bad"]}'
                    bad.append(
                        http.post(
                            f"{url}/classify", content=body, headers={"content-type": "application/json"}
                        )
                    )

        threads = [threading.Thread(target=client, args=(w,)) for w in range(8)] + [
            threading.Thread(target=bad_client)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(answers) == 32 and all(r.status_code == 422 for r in bad)
        for model, _, response in answers:
            assert response.status_code == 200, response.text
            for name in [model] if isinstance(model, str) else model:
                got = [
                    d["probs"] if isinstance(model, str) else d["results"][name]["probs"]
                    for d in response.json()["data"]
                ]
                np.testing.assert_allclose(got, expected[name], atol=1e-5)
        assert process.poll() is None


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "gemma4mm", "qwen3"])
def test_every_family_shares_its_base(family, tiny_models, tmp_path):
    run = train_run(
        tmp_path, tiny_models[family], toy_topics(60), family, "--head-init", "zero", "--no-baseline"
    )
    shared = ClassifierSet.load([read_member("a", run), read_member("b", run)], precision="fp32")
    alone = own_probs(run)
    encoded = {name: c.encode(TEXTS)["input_ids"] for name, c in shared.classifiers.items()}
    for probs in shared.probs_mixed(encoded, batch_size=4).values():
        np.testing.assert_allclose(probs, alone, atol=1e-5)
    np.testing.assert_allclose(shared.classifiers["a"].predict_probs(TEXTS), alone, atol=1e-5)


def test_a_multi_label_classifier_joins_with_its_thresholds(runs, tiny_models, tmp_path):
    from tests.test_learning import topics

    multi = train_run(tmp_path, tiny_models["llama"], topics(60), "multi", "--multi-label", "--no-baseline")
    shared = ClassifierSet.load(
        [read_member("topic", runs["topic"]), read_member("multi", multi)], precision="fp32"
    )
    alone = Classifier.load(multi)
    alone.precision = "fp32"
    classifier = shared.classifiers["multi"]
    assert classifier.thresholds == alone.thresholds is not None
    np.testing.assert_allclose(classifier.predict_probs(TEXTS), own_probs(multi), atol=1e-5)
    assert [r["labels"] for r in classifier.predict(TEXTS)] == [r["labels"] for r in alone.predict(TEXTS)]


def test_the_worker_answers_a_batch_of_several_classifiers_in_mixed_passes(runs, monkeypatch):
    """Jobs for two classifiers in one batch: one call of `probs_mixed`, each job its own answers in order."""
    from loracls.inference.batcher import Batcher, Job, Metrics

    shared = ClassifierSet.load([read_member(name, path) for name, path in runs.items()], precision="fp32")
    batcher = Batcher(lambda: shared, Metrics())
    batcher.shared, batcher.classifiers = shared, shared.classifiers
    calls, mixed = [], shared.probs_mixed
    monkeypatch.setattr(shared, "probs_mixed", lambda *a, **k: calls.append(a) or mixed(*a, **k))
    jobs = [
        Job(TEXTS[:2], None, print, "topic"),
        Job(TEXTS, None, print, "sentiment"),
        Job(TEXTS[2:], None, print, "topic"),
    ]
    records = batcher.classify(jobs)
    assert len(calls) == 1
    topic, sentiment = own_probs(runs["topic"]), own_probs(runs["sentiment"])
    for job, expected in zip(records, [topic[:2], sentiment, topic[2:]], strict=True):
        np.testing.assert_allclose([r["probs"] for r in job], expected, atol=1e-5)
    assert records[1][0]["num_classes"] == 2 and records[0][0]["num_classes"] == 3
