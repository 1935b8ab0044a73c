"""`loracls serve`: a finished run or an export as an HTTP service (FastAPI on uvicorn) with dynamic batching.

Requests wait in one queue. A single worker thread owns the model: it takes up to `max_batch` texts, or what
arrived within `max_wait_ms` of the first, runs them sorted by length (in one forward pass on a GPU, in passes
of `pass_size` on a CPU) and answers every request with its own results in its own order. No request handler
ever touches the model, so the model is never called from two threads at once, and a failing batch fails its
requests, not the worker.
"""

from __future__ import annotations

import asyncio
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict

from loracls.evaluate import predicted_labels
from loracls.predict import Classifier


@dataclass
class ServeLimits:
    """What one request and the queue may hold, and how batches are formed."""

    max_batch: int = 32
    """Texts the worker takes from the queue at once."""
    pass_size: int | None = None
    """Texts in one forward pass: the worker's batch, sorted by length, runs in passes of this many. None: the
    whole batch in one pass on a GPU, passes of `CPU_PASS` on a CPU (see there)."""
    max_wait_ms: float = 5.0
    """How long the worker waits after the first waiting text for more to fill a batch."""
    max_texts: int = 64
    """Texts in one request at most (413 above)."""
    max_chars: int = 20_000
    """Characters in one text at most (413 above); a text is cut to the run's max_length tokens anyway."""
    max_queue: int = 1024
    """Texts waiting at most; a request that would exceed it is answered 503 with Retry-After."""
    max_new_tokens: int = 256
    """The most tokens a `generate` request may ask for (`objective: lm` models)."""


CPU_PASS = 8
"""Texts per forward pass on a CPU. A CPU computes padding as it computes text and gains nothing from wider
passes: on this project's 2-core machine (benchmarks/README.md, serve) 256 real reviews ran at 37 texts/s
length-sorted in passes of 8 against 24 in passes of 32, and groups of 16 arriving texts at 28 texts/s in
sorted passes of 4 against 15 in one padded pass."""


class ServeError(Exception):
    """A request refused with `status` and a message the client reads."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class Job:
    """One request's texts, waiting for the worker; `done` is called (on the event loop) with the results."""

    texts: list[str]
    generate: int | None
    done: Callable[[list[dict] | BaseException], None]
    queued: float = field(default_factory=time.perf_counter)


class Metrics:
    """The Prometheus metrics of one server, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "loracls_requests",
            "Requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "loracls_request_seconds", "Request latency by endpoint", ["endpoint"], registry=self.registry
        )
        buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        self.batch = Histogram(
            "loracls_batch_texts", "Texts per forward pass", buckets=buckets, registry=self.registry
        )
        self.queue = Gauge("loracls_queue_texts", "Texts waiting for the worker", registry=self.registry)
        self.texts = Counter("loracls_texts", "Texts classified", registry=self.registry)


class Batcher:
    """The queue and the one worker thread that owns the classifier (see the module docstring)."""

    def __init__(self, load: Callable[[], Classifier], limits: ServeLimits, metrics: Metrics):
        self.load, self.limits, self.metrics = load, limits, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.waiting = 0  # texts queued, under `lock`
        self.lock = threading.Lock()
        self.classifier: Classifier | None = None
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self.run, name="loracls-model", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.waiting + len(job.texts) > self.limits.max_queue:
                raise ServeError(503, "the queue is full; retry shortly", {"Retry-After": "1"})
            self.waiting += len(job.texts)
            self.metrics.queue.set(self.waiting)
        self.jobs.put(job)

    def stop(self) -> None:
        """Answer everything queued, then end the worker."""
        self.jobs.put(None)
        self.thread.join()

    def run(self) -> None:
        try:
            self.classifier = self.load()
            self.classifier.predict_probs(["warm-up"])  # the first pass pays for lazy initialisation
        except BaseException as e:  # noqa: BLE001 - reported by /ready and the CLI
            self.failed = e
            self.ready.set()
            return
        self.ready.set()
        carried: Job | None = None
        while True:
            first = carried or self.jobs.get()
            carried = None
            if first is None:
                return
            batch, size = [first], len(first.texts)
            deadline = time.perf_counter() + self.limits.max_wait_ms / 1000
            stopping = False
            while size < self.limits.max_batch:
                try:
                    job = self.jobs.get(timeout=max(deadline - time.perf_counter(), 0))
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                if size + len(job.texts) > self.limits.max_batch:
                    carried = job  # starts the next batch
                    break
                batch.append(job)
                size += len(job.texts)
            self.answer(batch)
            if stopping:
                self.jobs.put(None)

    def answer(self, batch: list[Job]) -> None:
        """One forward pass over the batch's texts; each job gets its slice, or the error."""
        texts = [text for job in batch for text in job.texts]
        with self.lock:
            self.waiting -= len(texts)
            self.metrics.queue.set(self.waiting)
        self.metrics.batch.observe(len(texts))
        try:
            encoded = self.classifier.encode(texts)
            probs = self.classifier.probs(encoded)
            tokens = [len(ids) for ids in encoded["input_ids"]]  # what the model read, prompt included
            results, start = [], 0
            for job in batch:
                end = start + len(job.texts)
                records = self.records(job, probs[start:end], tokens[start:end])
                results.append(records)
                start = end
        except Exception as e:  # noqa: BLE001 - the batch's requests fail, the worker stays
            results = [e] * len(batch)
        self.metrics.texts.inc(len(texts))
        for job, result in zip(batch, results, strict=True):
            job.done(result)

    def records(self, job: Job, probs: np.ndarray, tokens: list[int]) -> list[dict]:
        classifier = self.classifier
        labels = classifier.labels
        top = [labels[i] for i in probs.argmax(1)]
        chosen = predicted_labels(probs, labels, classifier.thresholds)
        responses = classifier.generate(job.texts, job.generate) if job.generate else None
        out = []
        for n, p in enumerate(probs):
            record = {"label": top[n], "probs": [float(x) for x in p], "num_classes": len(labels)}
            if classifier.thresholds is not None:
                record["labels"] = chosen[n]
            if responses is not None:
                record["response"] = responses[n]
            record["prompt_tokens"] = tokens[n]
            out.append(record)
        return out


class ClassifyRequest(BaseModel):
    """vLLM's `/classify` request: `input` is one text or a list; `model` and other fields are accepted and
    ignored (one model is served). `generate`/`max_new_tokens`: also say the response (`objective: lm`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    input: str | list[str]
    model: str | None = None
    generate: bool = False
    max_new_tokens: int | None = None


class PredictRequest(BaseModel):
    """Hugging Face text-embeddings-inference's `/predict` request: `inputs`, one text or a list."""

    model_config = ConfigDict(extra="allow", strict=True)
    inputs: str | list[str]


def error_body(status: int, message: str) -> dict:
    """The error shape of vLLM's OpenAI-compatible server."""
    kind = {413: "RequestTooLarge", 422: "BadRequestError", 503: "ServiceUnavailable"}.get(status, "Error")
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def build_app(path: Path, load: Callable[[], Classifier], limits: ServeLimits, info: dict) -> FastAPI:
    """The FastAPI application serving the classifier that `load` returns; `info` describes it."""
    metrics = Metrics()
    batcher = Batcher(load, limits, metrics)

    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, batcher.stop)

    app = FastAPI(title="loracls", lifespan=lifespan)
    app.state.batcher = batcher

    @app.middleware("http")
    async def count(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        endpoint = request.url.path
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        return response

    @app.exception_handler(ServeError)
    async def refused(request: Request, error: ServeError) -> JSONResponse:
        return JSONResponse(error_body(error.status, error.message), error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            return JSONResponse(error_body(422, "the request body is not valid JSON"), 422)
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors
        )
        return JSONResponse(error_body(422, f"invalid request: {problems}"), 422)

    async def classify_texts(texts: list[str], generate: int | None = None) -> list[dict]:
        if batcher.failed is not None:
            raise ServeError(503, f"the model failed to load: {batcher.failed}")
        if not batcher.ready.is_set():
            raise ServeError(503, "the model is loading; retry shortly", {"Retry-After": "5"})
        if not texts:
            raise ServeError(422, "input is an empty list; give at least one text")
        if len(texts) > limits.max_texts:
            raise ServeError(
                413, f"{len(texts)} texts in one request; at most {limits.max_texts} (--max-texts)"
            )
        long = next((i for i, t in enumerate(texts) if len(t) > limits.max_chars), None)
        if long is not None:
            raise ServeError(
                413,
                f"text {long} has {len(texts[long])} characters; at most {limits.max_chars} (--max-chars)",
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def done(result: list[dict] | BaseException) -> None:
            def settle() -> None:
                if future.done():  # the client went away
                    return
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

            loop.call_soon_threadsafe(settle)

        batcher.submit(Job(texts, generate, done))
        try:
            return await future
        except ServeError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed batch: this request gets a 500 with the reason
            raise ServeError(500, f"classification failed: {type(e).__name__}: {e}") from None

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest) -> dict:
        texts = [body.input] if isinstance(body.input, str) else body.input
        generate = None
        if body.generate:
            if info["objective"] != "lm":
                raise ServeError(
                    422, "generate needs a model trained with objective: lm (this one has a head)"
                )
            generate = body.max_new_tokens or 64
            if not 1 <= generate <= limits.max_new_tokens:
                raise ServeError(422, f"max_new_tokens must be 1..{limits.max_new_tokens}")
        records = await classify_texts(texts, generate)
        tokens = sum(r.pop("prompt_tokens") for r in records)
        return {
            "id": f"classify-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": info["name"],
            "data": [{"index": i, **r} for i, r in enumerate(records)],
            "usage": {
                "prompt_tokens": tokens,
                "total_tokens": tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }

    @app.post("/predict")
    async def predict(body: PredictRequest) -> list:
        single = isinstance(body.inputs, str)
        records = await classify_texts([body.inputs] if single else body.inputs)
        ranked = [
            sorted(
                ({"label": label, "score": p} for label, p in zip(info["labels"], r["probs"], strict=True)),
                key=lambda x: -x["score"],
            )
            for r in records
        ]
        return ranked[0] if single else ranked

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if batcher.failed is not None:
            return JSONResponse({"status": "failed", "error": str(batcher.failed)}, 503)
        if not batcher.ready.is_set():
            return JSONResponse({"status": "loading"}, 503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        model = {"id": info["name"], "object": "model", "created": info["created"], "owned_by": "loracls"}
        return {"object": "list", "data": [model]}

    @app.get("/info")
    async def describe() -> dict:
        return {**info, "path": str(path), "limits": limits.__dict__}

    return app


def describe_model(path: Path, allow_unfinished: bool = False) -> dict:
    """What `/info` and `/v1/models` say of a run or an export, read from its files; refuses what
    `loracls predict` refuses (an unfinished run, a folder that is neither)."""
    from loracls.export import EXPORT_INFO, read_export_info
    from loracls.runs import RunFolder

    if (path / "status.json").is_file():
        run = RunFolder(path)
        run.check_finished(allow_unfinished)
        cfg = run.read_config()
        labels, base, objective, multi = run.read_labels(), cfg.model, cfg.objective, cfg.multi_label
    elif (path / EXPORT_INFO).is_file():
        export = read_export_info(path)
        labels, base = export["labels"], export["base_model"]
        objective, multi = export.get("objective", "head"), export.get("thresholds") is not None
    else:
        from loracls.errors import LoraclsError

        raise LoraclsError(f"{path} is neither a loracls run folder nor a loracls export folder")
    return {
        "name": path.resolve().name,
        "labels": labels,
        "base_model": base,
        "objective": objective,
        "multi_label": multi,
        "created": int(path.stat().st_mtime),
    }


def serve(
    path: Path,
    host: str,
    port: int,
    limits: ServeLimits,
    precision: str = "auto",
    allow_unfinished: bool = False,
    int8: bool = False,
) -> int:
    """Run the service until SIGINT/SIGTERM (queued requests are answered first); returns the exit code:
    0, or 1 when the model failed to load."""
    import uvicorn

    from loracls.output import console

    path = Path(path)
    info = describe_model(path, allow_unfinished) | {"int8": None}

    def load() -> Classifier:
        classifier = Classifier.load(path, allow_unfinished=allow_unfinished, int8=int8)
        if int8:  # /info shows how int8 compared with fp32
            info["int8"] = classifier.int8
        else:
            classifier.precision = precision
        on_gpu = next(classifier.model.parameters()).device.type != "cpu"
        classifier.batch_size = limits.pass_size or (limits.max_batch if on_gpu else CPU_PASS)
        return classifier

    app = build_app(path, load, limits, info)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    batcher: Batcher = app.state.batcher

    def watch() -> None:
        batcher.ready.wait()
        if batcher.failed is not None:
            console.print(f"[red]The model failed to load: {batcher.failed}[/]")
            server.should_exit = True
        else:
            console.print(f"ready: {info['name']} ({', '.join(info['labels'])}) on http://{host}:{port}")

    threading.Thread(target=watch, daemon=True).start()
    console.print(f"loading {path} ...")
    for number in (signal.SIGINT, signal.SIGTERM):
        # uvicorn shuts down gracefully on these, then raises the signal again for the handler it found:
        # after a graceful shutdown the process exits 0, not killed by the signal
        signal.signal(number, lambda *_: None)
    server.run()
    return 1 if batcher.failed is not None else 0
