"""`loracls serve`: a finished run or an export as an HTTP service (FastAPI on uvicorn) with dynamic batching.

Requests wait in one queue; a single worker thread owns the model and answers them in batches
(`loracls.inference.batcher`): no request handler touches the model, and a failure stays with the request
that caused it. Requests are parsed and checked before they are queued, and the answers shaped, by
`serve_api`: every error, unknown routes included, is vLLM's error object (`error_body`). A body is capped by
size (`Content-Length` and while it streams) and by time (`body_timeout`: 408, connection closed). The port is
bound before the model loads. SIGTERM/SIGINT drain the server: queued requests are answered, new ones get 503
with `Connection: close` (keep-alive clients move on instead of finding their connection reset), then it exits
0. If the worker dies, `/ready` answers 503 and the process exits 1 so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from loracls.console import console
from loracls.data.labels import label_value
from loracls.errors import LoraclsError
from loracls.inference.batcher import Batcher, Job, Metrics, ServeError
from loracls.inference.export_format import folder_kind, read_export_info
from loracls.inference.predict import MULTI_LABEL_CONFIDENCE, Classifier
from loracls.inference.serve_api import (
    ClassifyRequest,
    PredictRequest,
    abstain,
    check_texts,
    chosen,
    classify_response,
    fan_out_response,
    min_confidence,
    new_tokens,
)
from loracls.inference.serve_limits import BodyGuard, ServeLimits, error_body, unreadable_body
from loracls.inference.shared_base import ClassifierSet, check_same_base, read_member
from loracls.training.runs import RunFolder

DRAIN_LINGER = 1.0
"""Seconds a draining server keeps answering new requests with 503 + `Connection: close` at least, so that a
keep-alive client sending just after the signal is told to go, not reset."""

CPU_PASS_TOKENS = 512
"""Padded tokens per forward pass on a CPU (`ServeLimits.pass_tokens`). A CPU computes padding as it
computes text and gains little from wider passes, so a batch's short texts share a wide pass and its long
ones narrow ones: on this project's 2-core machine, batches of 8 and 16 arriving texts and 256 sorted ones
all ran faster under this budget than in passes of 8 texts, whose long texts pad the short
(benchmarks/README.md, "Serving")."""


ROUTES = "POST /classify, /v1/classify, /predict; GET /health, /ready, /metrics, /v1/models, /info"


def build_app(
    load: Callable[[], dict[str, Classifier] | ClassifierSet], limits: ServeLimits, infos: dict[str, dict]
) -> FastAPI:
    """The FastAPI application serving the classifier(s) that `load` returns; `infos` describes each by
    its name (`describe_model`)."""
    metrics = Metrics()
    batcher = Batcher(load, metrics, limits.max_batch, limits.max_wait_ms, limits.max_queue)

    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, batcher.stop)

    app = FastAPI(title="loracls", lifespan=lifespan)
    app.state.batcher = batcher
    app.add_middleware(BodyGuard, limits=limits, batcher=batcher)

    @app.middleware("http")
    async def count(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        endpoint = request.url.path
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        return response

    add_error_handlers(app)

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest) -> dict:
        texts = [body.input] if isinstance(body.input, str) else body.input
        names = chosen(body.model, infos)
        generate = new_tokens(body, limits, infos[names[0]])
        levels = {name: min_confidence(body, limits, infos[name]) for name in names}
        answers = await asyncio.gather(*(classify_texts(batcher, limits, texts, generate, n) for n in names))
        answers = [abstain(records, levels[name]) for name, records in zip(names, answers, strict=True)]
        if isinstance(body.model, list):
            return fan_out_response(dict(zip(names, answers, strict=True)))
        return classify_response(answers[0], names[0])

    @app.post("/predict")
    async def predict(body: PredictRequest) -> list:
        single = isinstance(body.inputs, str)
        (name,) = chosen(body.model, infos)
        records = await classify_texts(batcher, limits, [body.inputs] if single else body.inputs, None, name)
        labels = infos[name]["labels"]
        ranked = [
            sorted(
                ({"label": label, "score": p} for label, p in zip(labels, r["probs"], strict=True)),
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
        if batcher.died is not None:
            return JSONResponse({"status": "failed", "error": batcher.closed_reason()}, 503)
        if not batcher.ready.is_set():
            return JSONResponse({"status": "loading"}, 503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        listed = [
            {"id": name, "object": "model", "created": info["created"], "owned_by": "loracls"}
            for name, info in infos.items()
        ]
        return {"object": "list", "data": listed}

    @app.get("/info")
    async def describe() -> dict:
        if len(infos) == 1:
            return {**next(iter(infos.values())), "limits": limits.__dict__}
        return {"classifiers": list(infos.values()), "limits": limits.__dict__}

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal as the one error object (`error_body`): loracls's own (`ServeError`), FastAPI's routing
    and body errors, and request validation, each with a message that names the route, field or problem."""

    @app.exception_handler(ServeError)
    async def refused(request: Request, error: ServeError) -> JSONResponse:
        return JSONResponse(error_body(error.status, error.message), error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        status, message = error.status_code, str(error.detail)
        if status == 400:  # FastAPI's "There was an error parsing the body"
            status, message = 422, unreadable_body(error.__cause__)
        elif status == 404:
            message = f"no route {request.url.path}; the routes are {ROUTES}"
        elif status == 405:
            message = f"{request.method} is not allowed on {request.url.path}; the routes are {ROUTES}"
        return JSONResponse(error_body(status, message), status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        if any(e["type"] == "json_invalid" for e in errors):
            return JSONResponse(error_body(422, "the request body is not valid JSON"), 422)
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors
        )
        return JSONResponse(error_body(422, f"invalid request: {problems}"), 422)


async def classify_texts(
    batcher: Batcher,
    limits: ServeLimits,
    texts: list[str],
    generate: int | None = None,
    classifier: str | None = None,
) -> list[dict]:
    """One request's texts through the batcher's queue: refused while the model loads or failed, or past
    the limits (`check_texts`); a failure of this request alone is a 500 with the reason."""
    if batcher.failed is not None:
        raise ServeError(503, f"the model failed to load: {batcher.failed}")
    if not batcher.ready.is_set():
        raise ServeError(503, "the model is loading; retry shortly", {"Retry-After": "5"})
    check_texts(texts, limits)
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

    batcher.submit(Job(texts, generate, done, classifier))
    try:
        return await future
    except ServeError:
        raise
    except Exception as e:  # noqa: BLE001 - this request failed: a 500 with the reason
        raise ServeError(500, f"classification failed: {type(e).__name__}: {e}") from None


def describe_model(path: Path, allow_unfinished: bool = False) -> dict:
    """What `/info` and `/v1/models` say of a run or an export, read from its files; refuses what
    `loracls predict` refuses (an unfinished run, a folder that is neither)."""
    if folder_kind(path) == "run":
        run = RunFolder(path)
        run.check_finished(allow_unfinished)
        cfg = run.read_config()
        labels, base, objective, multi = run.read_labels(), cfg.model, cfg.objective, cfg.multi_label
        label_type = cfg.label_type
    else:
        export = read_export_info(path)
        labels, base = export["labels"], export["base_model"]
        objective, multi = export.get("objective", "head"), export.get("thresholds") is not None
        label_type = export.get("label_type", "str")
    return {
        "name": path.resolve().name,
        "labels": [label_value(label, label_type) for label in labels],
        "base_model": model_name(base),
        "objective": objective,
        "multi_label": multi,
        "created": int(path.stat().st_mtime),
    }


def model_name(model: str) -> str:
    """A base model as the service shows it: a Hub id as it is, a local folder by its name alone (a client
    has no business with the server's filesystem)."""
    local = Path(model).expanduser()
    return local.name if local.is_absolute() or local.exists() else model


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use is refused at once."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise LoraclsError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; free the port or pick another (--port)"
        ) from None
    return sock


class DrainingServer:
    """uvicorn's server with a drain in front of its shutdown (see the module docstring): the first
    SIGINT/SIGTERM closes the queue, the worker answers what is queued, new requests get 503 with
    `Connection: close` for `DRAIN_LINGER` s at least, then uvicorn stops; a second signal stops it now."""

    def __init__(self, app: FastAPI, host: str, port: int):
        import uvicorn

        self.batcher: Batcher = app.state.batcher
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.server.handle_exit = self.handle_exit
        self.draining = threading.Lock()

    def handle_exit(self, sig: int, frame) -> None:
        if not self.drain():
            self.server.should_exit = True

    def drain(self) -> bool:
        """Start draining in a thread; False when a drain had started already."""
        if not self.draining.acquire(blocking=False):
            return False
        threading.Thread(target=self.run_drain, name="loracls-drain", daemon=True).start()
        return True

    def run_drain(self) -> None:
        started = time.monotonic()
        self.batcher.stop()
        time.sleep(max(started + DRAIN_LINGER - time.monotonic(), 0))
        self.server.should_exit = True

    def run(self, sock: socket.socket) -> None:
        for number in (signal.SIGINT, signal.SIGTERM):
            # the handler uvicorn puts back once it has stopped: a late signal does not kill a process
            # that is about to exit with its own code
            signal.signal(number, lambda *_: None)
        self.server.run(sockets=[sock])


def serve(
    paths: dict[str, Path],
    host: str,
    port: int,
    limits: ServeLimits,
    precision: str = "auto",
    allow_unfinished: bool = False,
    int8: bool = False,
) -> int:
    """Run the service of the classifiers `paths` names (several share one base model: `shared_base`) until
    SIGINT/SIGTERM (queued requests are answered first); returns the exit code: 0, or 1 when the model
    failed to load or the worker died. A port in use is refused before the model loads (`LoraclsError`), as
    are classifiers that cannot share a base, and a `--min-confidence` that no classifier can use."""
    infos = {
        name: describe_model(path, allow_unfinished) | {"name": name, "int8": None}
        for name, path in paths.items()
    }
    members = (
        [read_member(name, path, allow_unfinished) for name, path in paths.items()] if len(paths) > 1 else []
    )
    if members:
        if int8:
            raise LoraclsError(
                "--int8 quantises a merged model; classifiers that share a base keep LoRA unmerged"
            )
        check_same_base(members)
    if limits.min_confidence is not None and all(info["multi_label"] for info in infos.values()):
        raise LoraclsError(f"--min-confidence: {MULTI_LABEL_CONFIDENCE}")
    sock = bind(host, port)

    def load() -> dict[str, Classifier] | ClassifierSet:
        loaded = None
        if members:
            loaded = ClassifierSet.load(members, precision=precision)
            classifiers = loaded.classifiers
        else:
            ((name, path),) = paths.items()
            classifier = Classifier.load(path, allow_unfinished=allow_unfinished, int8=int8)
            if int8:  # /info shows how int8 compared with fp32
                infos[name]["int8"] = classifier.int8
            else:
                classifier.precision = precision
            classifiers = {name: classifier}
        for classifier in classifiers.values():
            on_gpu = next(classifier.model.parameters()).device.type != "cpu"
            classifier.batch_size = limits.pass_size or limits.max_batch
            budget = (
                limits.pass_tokens if limits.pass_tokens is not None else None if on_gpu else CPU_PASS_TOKENS
            )
            classifier.pass_tokens = budget or None
        return loaded or classifiers

    server = DrainingServer(build_app(load, limits, infos), host, port)
    batcher = server.batcher

    def watch() -> None:
        batcher.ready.wait()
        if batcher.failed is not None:
            console.print(f"[red]The model failed to load: {batcher.failed}[/]")
            server.server.should_exit = True
            return
        while not server.server.started:
            if server.server.should_exit:
                return
            time.sleep(0.05)
        for info in infos.values():
            console.print(
                f"ready: {info['name']} ({', '.join(map(str, info['labels']))}) on http://{host}:{port}"
            )
        batcher.thread.join()
        if batcher.died is not None:
            console.print(f"[red]{batcher.closed_reason()}: exiting 1 for a supervisor to restart it[/]")
            server.drain()

    threading.Thread(target=watch, daemon=True).start()
    console.print(f"loading {', '.join(map(str, paths.values()))} ...")
    server.run(sock)
    return 1 if batcher.failed is not None or batcher.died is not None else 0
