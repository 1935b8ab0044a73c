"""`loracls serve`: the real server process on a free loopback port, talked to over HTTP with httpx."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from loracls.predict import Classifier

TEXTS = [
    "good book",
    "the plot was awful and the story very bad",
    "love it",
    "hate",
    "it was the book",
    "great story and very good plot #12",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(path: Path, *options: str):
    """`loracls serve PATH` in a child process, ready; yields (base URL, process); stopped with SIGTERM."""
    port = free_port()
    command = [sys.executable, "-m", "loracls", "serve", str(path), "--port", str(port), *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "the server never became ready"
        try:
            if httpx.get(f"{url}/ready").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    try:
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


@pytest.fixture(scope="module")
def run(trained) -> Path:
    return trained["llama"][0]


@pytest.fixture(scope="module")
def expected(run) -> dict[str, list[float]]:
    classifier = Classifier.load(run)
    classifier.precision = "fp32"
    return {
        text: [float(p) for p in probs]
        for text, probs in zip(TEXTS, classifier.predict_probs(TEXTS), strict=True)
    }


@pytest.fixture(scope="module")
def service(run):
    with server(
        run, "--precision", "fp32", "--max-texts", "8", "--max-chars", "200", "--max-wait-ms", "20"
    ) as found:
        yield found


def test_answers_equal_the_classifier_in_vllms_shape(service, expected, run):
    url, _ = service
    body = httpx.post(f"{url}/classify", json={"model": "any", "input": TEXTS}).json()
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == run.name
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, body["data"], strict=True):
        np.testing.assert_allclose(item["probs"], expected[text], atol=1e-5)
        assert (
            item["label"] == ["negative", "positive"][int(np.argmax(expected[text]))]
            and item["num_classes"] == 2
        )
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(TEXTS)
    one = httpx.post(f"{url}/v1/classify", json={"input": TEXTS[0]}).json()["data"]
    assert len(one) == 1 and np.allclose(one[0]["probs"], expected[TEXTS[0]], atol=1e-5)
    ranked = httpx.post(
        f"{url}/predict", json={"inputs": TEXTS[1]}
    ).json()  # text-embeddings-inference's shape
    assert {r["label"]: r["score"] for r in ranked} == pytest.approx(
        dict(zip(["negative", "positive"], expected[TEXTS[1]], strict=True)), abs=1e-5
    )
    info = httpx.get(f"{url}/info").json()
    assert info["labels"] == ["negative", "positive"] and info["objective"] == "head"
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == run.name
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_sixteen_concurrent_clients_each_get_their_own_answers_in_order(service, expected):
    url, _ = service
    rng = np.random.default_rng(0)
    requests = [[TEXTS[i] for i in rng.integers(0, len(TEXTS), size=rng.integers(1, 4))] for _ in range(200)]
    answers: dict[int, list] = {}

    def client(worker: int) -> None:
        with httpx.Client(timeout=60) as http:
            for n in range(worker, len(requests), 16):
                response = http.post(f"{url}/classify", json={"input": requests[n]})
                answers[n] = [response.status_code, response.json()]

    threads = [threading.Thread(target=client, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 200
    for n, (status, body) in answers.items():
        assert status == 200, body
        got = [d["probs"] for d in body["data"]]
        np.testing.assert_allclose(got, [expected[t] for t in requests[n]], atol=1e-5)
    metrics = httpx.get(f"{url}/metrics").text
    batches = next(line for line in metrics.splitlines() if line.startswith("loracls_batch_texts_count"))
    texts = sum(len(r) for r in requests)
    assert float(batches.split()[-1]) < texts  # several requests shared a forward pass


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 422, "not valid JSON"),
        (b'{"input": 5}', 422, "input"),
        (b'{"input": ["ok", 7]}', 422, "valid string"),
        (b'{"text": "no input field"}', 422, "Field required"),
        (b'{"input": []}', 422, "empty list"),
        (json.dumps({"input": ["a"] * 9}).encode(), 413, "at most 8 (--max-texts)"),
        (json.dumps({"input": ["fine", "x" * 201]}).encode(), 413, "text 1 has 201 characters"),
        (b'{"input": "a", "generate": true}', 422, "objective: lm"),
    ],
)
def test_bad_requests_get_their_status_and_the_server_answers_afterwards(
    service, expected, body, status, message
):
    url, _ = service
    before = httpx.get(f"{url}/metrics").text
    response = httpx.post(f"{url}/classify", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status and message in response.json()["message"], response.text
    assert response.json()["object"] == "error" and response.json()["code"] == status
    good = httpx.post(f"{url}/classify", json={"input": TEXTS[2]}).json()["data"][0]
    np.testing.assert_allclose(good["probs"], expected[TEXTS[2]], atol=1e-5)
    after = httpx.get(f"{url}/metrics").text
    key = f'loracls_requests_total{{endpoint="/classify",status="{status}"}}'
    assert count(after, key) == count(before, key) + 1


def count(metrics: str, key: str) -> float:
    return next((float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(key)), 0.0)


def test_a_full_queue_answers_503_with_retry_after(run):
    with server(run, "--max-queue", "4", "--max-texts", "4", "--max-batch", "4", "--max-wait-ms", "300") as (
        url,
        _,
    ):
        statuses = []

        def client() -> None:
            response = httpx.post(f"{url}/classify", json={"input": TEXTS[:3]}, timeout=60)
            statuses.append((response.status_code, response.headers.get("retry-after")))

        threads = [threading.Thread(target=client) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert (503, "1") in statuses and (200, None) in statuses
        assert {s for s, _ in statuses} == {200, 503}
        assert httpx.post(f"{url}/classify", json={"input": TEXTS[:1]}).status_code == 200


def arrived_texts(url: str) -> float:
    """Texts the server has received: waiting in its queue or classified (from /metrics)."""
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return float(values.get("loracls_queue_texts", 0)) + float(values.get("loracls_texts_total", 0))


def test_sigterm_answers_what_is_in_flight_and_exits_0(run, expected):
    with server(run, "--precision", "fp32", "--max-wait-ms", "3000", "--max-batch", "64") as (url, process):
        answers = []

        def client(n: int) -> None:
            response = httpx.post(f"{url}/classify", json={"input": TEXTS[n % 6 :]}, timeout=60)
            answers.append((n, response.status_code, response.json()))

        threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        sent = sum(len(TEXTS[n % 6 :]) for n in range(8))
        deadline = time.monotonic() + 60
        # every request has reached the server (a loaded machine can take seconds to send them); with a batch
        # of 64 and a 3 s wait they are still queued when the signal comes
        while arrived_texts(url) < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join()
        assert process.wait(timeout=60) == 0
    assert len(answers) == 8
    for n, status, body in answers:
        assert status == 200, body
        np.testing.assert_allclose(
            [d["probs"] for d in body["data"]], [expected[t] for t in TEXTS[n % 6 :]], atol=1e-5
        )


def test_an_unfinished_run_is_refused_at_start(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({"state": "running"}))
    done = subprocess.run(
        [sys.executable, "-m", "loracls", "serve", str(tmp_path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "status: running" in " ".join((done.stdout + done.stderr).split())


class FakeClassifier:
    """Stands in for `Classifier` inside the batcher: probabilities from the text, a failure on request."""

    labels = ["sports", "politics", "science"]
    thresholds = [0.5, 0.5, 0.5]

    def encode(self, texts):
        return {"input_ids": [t.split() for t in texts], "texts": texts}

    def probs(self, encoded):
        if "boom" in encoded["texts"]:
            raise RuntimeError("a forward pass failed")
        return np.array([[0.9 if label in t else 0.1 for label in self.labels] for t in encoded["texts"]])

    def predict_probs(self, texts):
        return self.probs(self.encode(texts))


def test_the_batcher_answers_multi_label_sets_and_survives_a_failing_batch():
    from loracls.serve import Batcher, Job, Metrics, ServeLimits

    batcher = Batcher(FakeClassifier, ServeLimits(max_batch=2, max_wait_ms=1), Metrics())
    batcher.start()
    assert batcher.ready.wait(10) and batcher.failed is None
    results: dict[str, object] = {}
    jobs = {
        "both": ["sports and politics"],
        "failing": ["boom"],
        "after": ["science", "nothing"],
    }
    for name, texts in jobs.items():
        batcher.submit(Job(texts, None, lambda result, name=name: results.__setitem__(name, result)))
        time.sleep(0.05)  # one batch each
    batcher.stop()
    assert results["both"][0]["labels"] == ["sports", "politics"] and results["both"][0]["num_classes"] == 3
    assert isinstance(results["failing"], RuntimeError)
    assert [r["labels"] for r in results["after"]] == [["science"], []]
