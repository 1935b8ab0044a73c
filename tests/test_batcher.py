"""The serving queue's worker (`loracls.inference.batcher`) with a stand-in classifier: what one failing job
does to the others, generation between batches, and a worker that dies. The real server is tested in
test_serve.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
from datasets import Dataset

from loracls.inference.batcher import Batcher, Job, Metrics, ServeError


class FakeClassifier:
    """Stands in for `Classifier`: probabilities from the text; "boom" fails a forward pass, "\\x00" fails
    the tokenizer, generation takes `GENERATE_SECONDS` a text."""

    labels = ["sports", "politics", "science"]
    thresholds = [0.5, 0.5, 0.5]
    label_type = "str"

    def encode(self, texts, windows=False):
        if any("\x00" in t for t in texts):
            raise ValueError("the tokenizer cannot read NUL")
        return Dataset.from_dict({"input_ids": [[1] * len(t.split()) for t in texts], "text": texts})

    def probs(self, encoded, calibrated=True):
        if "boom" in encoded["text"]:
            raise RuntimeError("a forward pass failed")
        return np.array([[0.9 if label in t else 0.1 for label in self.labels] for t in encoded["text"]])

    def text_probs(self, probs, encoded):  # multi-label, short texts: as the rows are
        return probs

    def predict_probs(self, texts):
        return self.probs(self.encode(texts))

    def generate(self, texts, max_new_tokens):
        time.sleep(GENERATE_SECONDS)
        return [f"about {t}"[:max_new_tokens] for t in texts]


GENERATE_SECONDS = 0.3


class Answers:
    """Each job's result by name, and when it came."""

    def __init__(self) -> None:
        self.results: dict[str, object] = {}
        self.times: dict[str, float] = {}

    def job(self, name: str, texts: list[str], generate: int | None = None) -> Job:
        def done(result) -> None:
            self.results[name], self.times[name] = result, time.perf_counter()

        return Job(texts, generate, done)


def started(**options) -> Batcher:
    batcher = Batcher(FakeClassifier, Metrics(), **options)
    batcher.start()
    assert batcher.ready.wait(10) and batcher.failed is None
    return batcher


def test_a_failing_job_fails_alone_inside_a_shared_batch():
    """One batch holds all four jobs (a long wait, room for all): the forward pass that fails is retried job
    by job and the tokenizer's refusal names the text, so only those two jobs fail."""
    batcher = started(max_batch=64, max_wait_ms=300)
    answers = Answers()
    jobs = {
        "both": ["sports and politics"],
        "failing": ["fine", "boom"],
        "unreadable": ["fine", "nul \x00 here"],
        "after": ["science", "nothing"],
    }
    for name, texts in jobs.items():
        batcher.submit(answers.job(name, texts))
    batcher.stop()
    results = answers.results
    assert results["both"][0]["labels"] == ["sports", "politics"] and results["both"][0]["num_classes"] == 3
    assert isinstance(results["failing"], RuntimeError)
    assert isinstance(results["unreadable"], ServeError) and results["unreadable"].status == 422
    assert "text 1 cannot be tokenized" in results["unreadable"].message
    assert [r["labels"] for r in results["after"]] == [["science"], []]
    assert [r["prompt_tokens"] for r in results["after"]] == [1, 1]
    assert batcher.died is None


def test_a_job_whose_answer_cannot_be_delivered_does_not_stop_the_worker():
    batcher = started(max_batch=1, max_wait_ms=1)
    answers = Answers()

    def undeliverable(result) -> None:
        raise RuntimeError("the event loop is closed")

    batcher.submit(Job(["sports"], None, undeliverable))
    batcher.submit(answers.job("next", ["science"]))
    batcher.stop()
    assert answers.results["next"][0]["labels"] == ["science"] and batcher.died is None


def test_classification_queued_behind_generation_is_answered_first():
    batcher = started(max_batch=8, max_wait_ms=1)
    answers = Answers()
    batcher.submit(answers.job("generate", ["sports", "science", "politics", "art"], generate=12))
    time.sleep(0.05)  # the generating job is taken first, alone
    sent = time.perf_counter()
    batcher.submit(answers.job("classify", ["politics"]))
    batcher.stop()
    assert answers.times["classify"] < answers.times["generate"]
    assert answers.times["classify"] - sent < 2 * GENERATE_SECONDS  # at most one text's generation
    generated = answers.results["generate"]
    assert [r["response"] for r in generated] == ["about sports", "about scienc", "about politi", "about art"]
    assert [r["label"] for r in generated] == ["sports", "science", "politics", "sports"]


class BrokenMetrics(Metrics):
    """Metrics whose batch histogram fails: a bug in the worker's own loop, outside any one job."""

    def __init__(self) -> None:
        super().__init__()
        self.batch = self

    def observe(self, value) -> None:
        raise RuntimeError("a bug in the worker")


def test_a_dead_worker_fails_what_it_holds_and_refuses_what_comes():
    batcher = Batcher(FakeClassifier, BrokenMetrics(), max_batch=8, max_wait_ms=1)
    batcher.start()
    answers = Answers()
    batcher.submit(answers.job("first", ["sports"]))
    batcher.thread.join(10)
    assert not batcher.thread.is_alive() and str(batcher.died) == "a bug in the worker"
    failed = answers.results["first"]
    assert isinstance(failed, ServeError) and failed.status == 503 and "worker stopped" in failed.message
    with pytest.raises(ServeError, match="worker stopped"):
        batcher.submit(answers.job("later", ["science"]))


class IntegerLabels(FakeClassifier):
    """A run trained on labels 0/1/2 (`label_type: int`), single-label."""

    labels = ["0", "1", "2"]
    thresholds = None
    label_type = "int"


def test_an_integer_task_answers_integers_as_predict_does():
    batcher = Batcher(IntegerLabels, Metrics(), max_batch=8, max_wait_ms=1)
    batcher.start()
    assert batcher.ready.wait(10) and batcher.failed is None
    answers = Answers()
    batcher.submit(answers.job("ints", ["2 wins", "then 1"]))
    batcher.stop()
    assert [r["label"] for r in answers.results["ints"]] == [2, 1]
