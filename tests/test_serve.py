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
import yaml

from loracls.inference.predict import Classifier
from tests.conftest import FAST, invoke, toy_reviews

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
def server(path: Path | list[str], *options: str, program: tuple[str, ...] = ("-m", "loracls")):
    """`loracls serve PATH` (a list: `loracls serve NAME=PATH ...`) in a child process, ready; yields (base
    URL, process); stopped with SIGTERM. `program`: what the interpreter runs instead of `-m loracls`
    (`-c SCRIPT`, which reads the arguments)."""
    port = free_port()
    paths = [str(p) for p in path] if isinstance(path, list) else [str(path)]
    command = [sys.executable, *program, "serve", *paths, "--port", str(port), *options]
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
def run(tiny_models, tmp_path_factory) -> Path:
    """One tiny finished run served by this module's tests (one family: `trained` trains all of them)."""
    root = tmp_path_factory.mktemp("serve-run")
    data = root / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    out = root / "llama"
    result = invoke("train", "--model", tiny_models["llama"], "--data", data, "--out", out, *FAST)
    assert result.exit_code == 0, result.output
    return out


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
        run, "--precision", "fp32", "--max-texts", "8", "--max-chars", "200", "--max-wait-ms", "20",
        "--body-timeout", "2",
    ) as found:  # fmt: skip
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
    base = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert Path(base).is_absolute() and info["base_model"] == Path(base).name  # not the server's paths
    assert str(run.parent) not in json.dumps(info) and str(Path(base).parent) not in json.dumps(info)
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
        (b'{"input": "caf\xe9"}', 422, "not valid JSON: it is not UTF-8"),  # Latin-1, not UTF-8
        (b'{"input": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 422, "nested too deeply"),
        (b'{"input": ["fine", "\\ud800"]}', 422, "text 1 is not valid Unicode"),
        (b'{"input": "a", "min_confidence": 1.5}', 422, "min_confidence"),
        (b'{"input": "a", "min_confidence": "high"}', 422, "min_confidence"),
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


def test_min_confidence_withholds_unsure_labels_by_default_or_per_request(run, expected):
    """`--min-confidence` is every request's floor; a request's own `min_confidence` replaces it (null: none).
    Below it a text gets `label` null and `abstained` true, its probabilities still given."""
    tops = sorted(max(p) for p in expected.values())
    level = (tops[2] + tops[3]) / 2  # half of TEXTS below it
    with server(run, "--precision", "fp32", "--min-confidence", f"{level:.6f}") as (url, _):
        for body, floor in (({}, level), ({"min_confidence": 0.0}, 0.0), ({"min_confidence": None}, None)):
            data = httpx.post(f"{url}/classify", json={"input": TEXTS, **body}).json()["data"]
            for text, item in zip(TEXTS, data, strict=True):
                np.testing.assert_allclose(item["probs"], expected[text], atol=1e-5)
                if floor is None:
                    assert "abstained" not in item and item["label"] is not None
                    continue
                unsure = max(expected[text]) < floor
                assert item["abstained"] is unsure and (item["label"] is None) is unsure, (text, item)
            if floor == level:
                assert sum(item["abstained"] for item in data) == 3
        info = httpx.get(f"{url}/info").json()
        assert info["limits"]["min_confidence"] == pytest.approx(level)


def test_a_multi_label_classifier_refuses_a_requests_min_confidence_and_ignores_the_default():
    from loracls.inference.batcher import ServeError
    from loracls.inference.serve_api import ClassifyRequest, min_confidence
    from loracls.inference.serve_limits import ServeLimits

    multi, single = {"name": "tags", "multi_label": True}, {"name": "mood", "multi_label": False}
    limits = ServeLimits(min_confidence=0.7)
    assert min_confidence(ClassifyRequest(input="x"), limits, multi) is None
    assert min_confidence(ClassifyRequest(input="x"), limits, single) == 0.7
    assert min_confidence(ClassifyRequest(input="x", min_confidence=None), limits, single) is None
    with pytest.raises(ServeError, match="tags: min_confidence applies to single-label") as refused:
        min_confidence(ClassifyRequest(input="x", min_confidence=0.5), limits, multi)
    assert refused.value.status == 422


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


def test_sigterm_answers_what_is_in_flight_tells_keep_alive_clients_to_go_and_exits_0(run, expected):
    with server(run, "--precision", "fp32", "--max-wait-ms", "3000", "--max-batch", "64") as (url, process):
        answers = []
        idle = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=20)
        idle.sendall(http_request("GET", "/health"))
        assert read_response(idle, close=False)[0] == 200  # a keep-alive connection, idle at the signal

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
        time.sleep(0.2)
        idle.sendall(http_request("POST", "/classify", json.dumps({"input": "good"}).encode()))
        status, headers, body = read_response(idle)  # answered, then closed: not reset
        assert status == 503 and headers["connection"] == "close" and "shutting down" in body["message"]
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


def http_request(method: str, target: str, body: bytes = b"", headers: str = "") -> bytes:
    """An HTTP/1.1 request as bytes, for the tests that need control of the connection itself."""
    head = f"{method} {target} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    if "transfer-encoding" not in headers.lower() and "content-length" not in headers.lower():
        head += f"Content-Length: {len(body)}\r\n"
    return (head + headers + "\r\n").encode() + body


def read_response(sock: socket.socket, close: bool = True) -> tuple[int, dict[str, str], dict]:
    """One response from the socket: (status, headers, JSON body); with `close`, also check that the server
    then closes the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside the body"
        body += chunk
    if close:
        assert sock.recv(65536) == b"", "the server kept the connection open"
    return int(lines[0].split()[1]), headers, json.loads(body)


def connect(url: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=15)


def test_one_unencodable_text_fails_its_own_request_alone(service, expected):
    """A lone surrogate is valid JSON but no tokenizer reads it: its request gets 422 naming the text, while
    16 clients sending good texts at the same time all get their answers."""
    url, _ = service
    answers, refused = [], []

    def client(worker: int) -> None:
        with httpx.Client(timeout=60) as http:
            for n in range(6):
                texts = [TEXTS[(worker + n) % 6], TEXTS[n % 6]]
                answers.append((texts, http.post(f"{url}/classify", json={"input": texts})))

    def bad_client() -> None:
        with httpx.Client(timeout=60) as http:
            for _ in range(12):
                body = b'{"input": ["good", "\\ud800 bad"]}'
                headers = {"content-type": "application/json"}
                refused.append(http.post(f"{url}/classify", content=body, headers=headers))

    threads = [threading.Thread(target=client, args=(w,)) for w in range(16)]
    threads.append(threading.Thread(target=bad_client))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 96 and len(refused) == 12
    for texts, response in answers:
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(
            [d["probs"] for d in response.json()["data"]], [expected[t] for t in texts], atol=1e-5
        )
    for response in refused:
        assert response.status_code == 422 and "text 1 is not valid Unicode" in response.json()["message"]


def test_unknown_routes_and_methods_get_the_error_object(service):
    url, _ = service
    for method, route, status in [("GET", "/", 404), ("POST", "/nothing", 404), ("GET", "/classify", 405)]:
        response = httpx.request(method, f"{url}{route}")
        body = response.json()
        assert response.status_code == status and body["object"] == "error" and body["code"] == status, body
        assert "/classify" in body["message"] and "detail" not in body


def test_a_body_over_the_cap_is_refused_before_it_is_read(service):
    """413 on `Content-Length` alone (the 100 MB are never sent) and, for a chunked body, as soon as it passes
    the cap (the rest never comes): the server answers without waiting for the body's end."""
    url, _ = service
    cap = 8 * (12 * 200 + 64) + 65_536  # ServeLimits.max_body_bytes at --max-texts 8 --max-chars 200
    with connect(url) as sock:
        sock.sendall(http_request("POST", "/classify", headers="Content-Length: 100000000\r\n"))
        status, headers, body = read_response(sock)
        assert status == 413 and "100000000 bytes" in body["message"] and headers["connection"] == "close"
    with connect(url) as sock:
        sock.sendall(http_request("POST", "/classify", headers="Transfer-Encoding: chunked\r\n"))
        piece = b"x" * 4096
        for _ in range(cap // len(piece) + 1):  # past the cap, and no final chunk
            sock.sendall(b"1000\r\n" + piece + b"\r\n")
        status, headers, body = read_response(sock)
        assert status == 413 and f"over {cap} bytes" in body["message"] and headers["connection"] == "close"
    assert httpx.post(f"{url}/classify", json={"input": "good"}).status_code == 200


def test_bodies_that_do_not_arrive_get_408_and_their_connections_closed(service):
    url, _ = service
    started = time.monotonic()
    sockets = [connect(url) for _ in range(20)]
    for sock in sockets:  # 13 bytes of the 100 announced
        sock.sendall(http_request("POST", "/classify", b'{"input": "go', "Content-Length: 100\r\n"))
    for sock in sockets:
        status, headers, body = read_response(sock)  # and closed
        assert status == 408 and "within 2 s (--body-timeout)" in body["message"]
        assert headers["connection"] == "close"
        sock.close()
    assert time.monotonic() - started < 10


def test_a_port_in_use_is_refused_before_the_model_loads(run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "loracls", "serve", str(run), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in output, output
    assert f"loading {run}" not in output and "ready:" not in output


BROKEN_WORKER = """
import sys, threading
import prometheus_client
observe = prometheus_client.Histogram.observe

def broken(self, *args, **kwargs):  # a bug in the worker's own loop, outside any one job
    if threading.current_thread().name == "loracls-model":
        raise RuntimeError("a bug in the worker")
    return observe(self, *args, **kwargs)

prometheus_client.Histogram.observe = broken
from loracls.cli import app
app(sys.argv[1:], prog_name="loracls")
"""


def test_a_dead_worker_fails_its_requests_reads_unready_and_exits_1(run):
    with server(run, program=("-c", BROKEN_WORKER)) as (url, process):
        response = httpx.post(f"{url}/classify", json={"input": "good"}, timeout=20)
        assert response.status_code == 503 and "worker stopped" in response.json()["message"], response.text
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and "a bug in the worker" in ready.text
        assert process.wait(timeout=60) == 1
        assert "a bug in the worker" in process.communicate()[0]


@pytest.fixture(scope="module")
def lm_run(lm_models, tmp_path_factory) -> Path:
    """A tiny `objective: lm` run (it learns little; generation only has to match `predict --generate`)."""
    root = tmp_path_factory.mktemp("serve-lm")
    data = root / "reviews.csv"
    table = toy_reviews(120)
    table["comment"] = [f"it says {'good' if y == 'positive' else 'bad'}" for y in table["label"]]
    table.to_csv(data, index=False)
    out = root / "run"
    result = invoke(
        "train", "--model", lm_models["qwen3"], "--data", data, "--out", out, *FAST, "--objective", "lm",
        "--response-column", "comment", "--prompt-sample", "20",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_generate_answers_what_predict_generate_says(lm_run):
    texts = ["good story", "awful plot and bad"]
    offline = [json.loads(x) for x in invoke("predict", lm_run, *texts, "--generate").output.splitlines()]
    with server(lm_run) as (url, _):
        info = httpx.get(f"{url}/info").json()
        assert info["limits"]["default_new_tokens"] == 64 and info["limits"]["max_new_tokens"] == 256
        body = httpx.post(f"{url}/classify", json={"input": texts, "generate": True}, timeout=120).json()
        for record, item in zip(offline, body["data"], strict=True):
            assert item["response"] == record["response"] and item["label"] == record["label"]
            np.testing.assert_allclose(item["probs"], list(record["probabilities"].values()), atol=1e-4)
        for tokens, status in [(0, 422), (257, 422), (1, 200)]:
            response = httpx.post(
                f"{url}/classify", json={"input": texts[0], "generate": True, "max_new_tokens": tokens}
            )
            assert response.status_code == status, response.text
            if status == 422:
                assert f"max_new_tokens must be 1..256, not {tokens}" in response.json()["message"]
