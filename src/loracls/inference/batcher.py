"""The serving queue: requests wait as `Job`s, and one worker thread (`Batcher`) owns the classifier (or the
classifiers that share one base model: a job names its own, and a batch of several runs their rows mixed in
shared forward passes).

The worker takes up to `max_batch` texts, or what arrived within `max_wait_ms` of the first, and answers every
job with its own results in its own order. No request handler touches the model, so it is never called from
two threads at once. A failure stays with the job that caused it: a batch that fails (in the tokenizer or the
forward pass) is retried job by job, so only the culprit fails (a text the tokenizer refuses: 422, naming the
text), and a job whose answer cannot be delivered is skipped. Generation (`objective: lm`) runs one text at a
time between batches, so classification queued behind a long generation is answered first. Only a bug in
the worker's own loop ends it: then `died` is set, every job it holds or that waits is failed with 503, and
the server stops (see `loracls.inference.serve`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from datasets import Dataset
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from loracls.data.labels import label_value
from loracls.inference.predict import Classifier
from loracls.inference.shared_base import ClassifierSet
from loracls.training.evaluate import predicted_labels

log = logging.getLogger("loracls.inference.serve")


class ServeError(Exception):
    """A request refused with `status` and a message the client reads."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class Job:
    """One request's texts, waiting for the worker; `done` is called (from the worker) with the results."""

    texts: list[str]
    generate: int | None
    """Tokens to generate per text (`objective: lm`); None: classify only."""
    done: Callable[[list[dict] | BaseException], None]
    classifier: str | None = None
    """Which of the server's classifiers answers (None: its first, the only one of most servers)."""
    queued: float = field(default_factory=time.perf_counter)
    records: list[dict] = field(default_factory=list)
    answered: bool = False


class Metrics:
    """The Prometheus metrics of one server, in their own registry, with the standard `process_*` ones (CPU
    seconds, resident memory, open files)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
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

    def __init__(
        self,
        load: Callable[[], Classifier | dict[str, Classifier] | ClassifierSet],
        metrics: Metrics,
        max_batch: int = 32,
        max_wait_ms: float = 5.0,
        max_queue: int = 1024,
    ):
        self.load, self.metrics = load, metrics
        self.max_batch, self.max_wait_ms, self.max_queue = max_batch, max_wait_ms, max_queue
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.waiting = 0  # texts queued, under `lock`
        self.closed = False  # no more jobs are taken, under `lock`
        self.lock = threading.Lock()
        self.classifiers: dict[str, Classifier] = {}
        """What `load` returned: the classifiers by name."""
        self.shared: ClassifierSet | None = None
        """Where `load` returned several classifiers on one base: their set, for passes that mix them."""
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        """Why the model failed to load."""
        self.died: BaseException | None = None
        """Why the worker stopped after loading (a bug in its own loop)."""
        self.carried: Job | None = None
        self.current: list[Job] = []  # the batch being answered
        self.generating: deque[Job] = deque()
        self.thread = threading.Thread(target=self.run, name="loracls-model", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.closed:
                raise ServeError(503, self.closed_reason(), {"Connection": "close"})
            if self.waiting + len(job.texts) > self.max_queue:
                raise ServeError(503, "the queue is full; retry shortly", {"Retry-After": "1"})
            self.waiting += len(job.texts)
            self.metrics.queue.set(self.waiting)
            self.jobs.put(job)

    def closed_reason(self) -> str:
        if self.died is not None:
            return f"the model worker stopped ({type(self.died).__name__}: {self.died}); the server exits"
        return "the server is shutting down; retry on another instance or after it restarts"

    def close(self) -> None:
        """Take no more jobs; the worker answers those queued, then ends."""
        with self.lock:
            if not self.closed:
                self.closed = True
                self.jobs.put(None)

    def stop(self) -> None:
        """Answer everything queued, then end the worker."""
        self.close()
        self.thread.join()

    def run(self) -> None:
        try:
            loaded = self.load()
            if isinstance(loaded, ClassifierSet):
                self.shared, loaded = loaded, loaded.classifiers
            self.classifiers = loaded if isinstance(loaded, dict) else {"": loaded}
            for classifier in self.classifiers.values():
                classifier.predict_probs(["warm-up"])  # the first pass pays for lazy initialisation
        except BaseException as e:  # noqa: BLE001 - reported by /ready and the CLI
            self.failed = e
            self.ready.set()
            return
        self.ready.set()
        try:
            self.work()
        except BaseException as e:  # noqa: BLE001 - reported by /ready; the server exits non-zero
            self.died = e
            log.exception("the model worker stopped")
            self.fail_everything()

    def work(self) -> None:
        """Batches until the end-of-queue marker; one generated text after each batch while any is due."""
        while True:
            batch, last = self.take(wait=not self.generating)
            if batch:
                self.current = batch
                self.answer(batch)
                self.current = []
            if self.generating:
                self.generate_next()
            if last:
                while self.generating:
                    self.generate_next()
                return

    def take(self, wait: bool) -> tuple[list[Job], bool]:
        """The next batch (empty when `wait` is False and nothing is queued), and whether the queue ended."""
        first = self.carried
        self.carried = None
        if first is None:
            try:
                first = self.jobs.get() if wait else self.jobs.get_nowait()
            except queue.Empty:
                return [], False
        if first is None:
            return [], True
        batch, size = [first], len(first.texts)
        deadline = time.perf_counter() + self.max_wait_ms / 1000
        while size < self.max_batch:
            try:
                job = self.jobs.get(timeout=max(deadline - time.perf_counter(), 0))
            except queue.Empty:
                break
            if job is None:
                return batch, True
            if size + len(job.texts) > self.max_batch:
                self.carried = job  # starts the next batch
                break
            batch.append(job)
            size += len(job.texts)
        return batch, False

    def answer(self, batch: list[Job]) -> None:
        """Classify the batch's texts together; if that fails, each job on its own, so that each gets its
        records or its own error. Jobs that also generate wait in `generating` for `generate_next`."""
        texts = sum(len(job.texts) for job in batch)
        with self.lock:
            self.waiting -= texts
            self.metrics.queue.set(self.waiting)
        self.metrics.batch.observe(texts)
        try:
            results: list[list[dict] | BaseException] = self.classify(batch)
        except Exception:  # noqa: BLE001 - retried job by job: only the culprit fails
            results = [self.classify_alone(job) for job in batch]
        self.metrics.texts.inc(texts)
        for job, result in zip(batch, results, strict=True):
            if job.generate and not isinstance(result, BaseException):
                job.records = result
                self.generating.append(job)
            else:
                self.finish(job, result)

    def of(self, job: Job) -> Classifier:
        """The classifier that answers `job`."""
        return self.classifiers[job.classifier] if job.classifier else next(iter(self.classifiers.values()))

    def classify(self, jobs: list[Job], encoded: Dataset | None = None) -> list[list[dict]]:
        """Each job's records: per classifier, one encoding of all its jobs' texts (`encoded`: one job's,
        done already; a text over `max_length` as the run reads it: cut, or a row per window); then one
        forward pass (in passes of the classifier's batch size) over them, or with several classifiers of
        one base, passes that mix their rows (`ClassifierSet.probs_mixed`); then each text's windows
        combined (`Classifier.text_probs`)."""
        groups: dict[str | None, list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.classifier, []).append(job)
        encodings = {
            name: encoded
            if encoded is not None
            else self.of(group[0]).encode([t for j in group for t in j.texts], windows=True)
            for name, group in groups.items()
        }
        if self.shared is not None and len(groups) > 1:
            ids = {name: encoding["input_ids"] for name, encoding in encodings.items()}
            some = self.of(jobs[0])
            rows = self.shared.probs_mixed(
                ids, some.batch_size, calibrated=False, max_tokens=some.pass_tokens
            )
        else:
            rows = {
                name: self.of(group[0]).probs(encodings[name], calibrated=False)
                for name, group in groups.items()
            }
        probs = {
            name: self.of(group[0]).text_probs(rows[name], encodings[name]) for name, group in groups.items()
        }
        results: dict[int, list[dict]] = {}
        for name, group in groups.items():
            tokens = tokens_read(encodings[name], sum(len(job.texts) for job in group))
            start = 0
            for job in group:
                end = start + len(job.texts)
                results[id(job)] = self.records(self.of(job), probs[name][start:end], tokens[start:end])
                start = end
        return [results[id(job)] for job in jobs]

    def classify_alone(self, job: Job) -> list[dict] | BaseException:
        """One job's records, or its own error: a text the tokenizer refuses is named (422)."""
        try:
            encoded = self.of(job).encode(job.texts, windows=True)
        except Exception:  # noqa: BLE001 - found and named below
            return self.encoding_error(job)
        try:
            return self.classify([job], encoded)[0]
        except Exception as e:  # noqa: BLE001 - this job's own failure
            return e

    def encoding_error(self, job: Job) -> ServeError:
        for n, text in enumerate(job.texts):
            try:
                self.of(job).encode([text])
            except Exception as e:  # noqa: BLE001 - the client's text, answered 422
                return ServeError(422, f"text {n} cannot be tokenized: {type(e).__name__}: {e}")
        return ServeError(500, "the texts could not be tokenized together (each one alone could)")

    @staticmethod
    def records(classifier: Classifier, probs: np.ndarray, tokens: list[int]) -> list[dict]:
        labels, thresholds = classifier.labels, classifier.thresholds
        kind = classifier.label_type  # an `int` task answers integers, as `predict` does
        top = [label_value(labels[i], kind) for i in probs.argmax(1)]
        chosen = predicted_labels(probs, labels, thresholds)
        out = []
        for n, p in enumerate(probs):
            record = {"label": top[n], "probs": [float(x) for x in p], "num_classes": len(labels)}
            if thresholds is not None:
                record["labels"] = label_value(chosen[n], kind)
            record["prompt_tokens"] = tokens[n]
            out.append(record)
        return out

    def generate_next(self) -> None:
        """Generate the response of the next text of the first job waiting for one; answer the job when its
        last text has its response."""
        job = self.generating[0]
        n = next(i for i, r in enumerate(job.records) if "response" not in r)
        try:
            response = self.of(job).generate([job.texts[n]], job.generate)[0]
        except Exception as e:  # noqa: BLE001 - this job's own failure
            self.generating.popleft()
            self.finish(job, e)
            return
        job.records[n]["response"] = response
        if n == len(job.texts) - 1:
            self.generating.popleft()
            self.finish(job, job.records)

    def finish(self, job: Job, result: list[dict] | BaseException) -> None:
        """Deliver a job's result; a job whose delivery fails is logged and skipped, the worker goes on."""
        if job.answered:
            return
        job.answered = True
        try:
            job.done(result)
        except Exception:  # noqa: BLE001 - that job's client cannot be told; the others can
            log.exception("a job's answer could not be delivered")

    def fail_everything(self) -> None:
        """After the worker died: close the queue and fail every job it held or that waits (503)."""
        with self.lock:
            self.closed = True
        error = ServeError(503, self.closed_reason(), {"Connection": "close"})
        held = self.current + list(self.generating) + ([self.carried] if self.carried else [])
        self.generating.clear()
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                held.append(job)
        for job in held:
            self.finish(job, error)


def tokens_read(encoded: Dataset, texts: int) -> list[int]:
    """The tokens the model read of each of `texts` texts, prompt included: its row's, or its windows'."""
    lengths = [len(ids) for ids in encoded["input_ids"]]
    if "owner" not in encoded.column_names:
        return lengths
    return [int(n) for n in np.bincount(encoded["owner"], weights=lengths, minlength=texts)]
