"""`serve_limits`: the ASGI `BodyGuard` driven directly (no server, no model), the body cap's arithmetic and
the error object. The same refusals through a real server are in test_serve.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from loracls.inference.serve_limits import BodyGuard, ServeLimits, error_body, unreadable_body


class Queue:
    """What `BodyGuard` asks of the batcher."""

    def __init__(self, closed: bool = False):
        self.closed = closed

    def closed_reason(self) -> str:
        return "the server is shutting down"


class App:
    """The app behind the guard: records the body it was handed."""

    def __init__(self):
        self.bodies = []

    async def __call__(self, scope, receive, send):
        self.bodies.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(guard: BodyGuard, messages: list[dict], headers: dict | None = None, delay: float = 0.0):
    """One request through `guard`; returns (status, parsed body or raw bytes, headers, messages received)."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/classify",
        "query_string": b"",
        "http_version": "1.1",
    }
    scope["headers"] = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    pending, sent, received = list(messages), [], []

    async def receive():
        await asyncio.sleep(delay)
        message = pending.pop(0) if pending else {"type": "http.disconnect"}
        received.append(message)
        return message

    async def send(message):
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    head = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    parsed = json.loads(body) if head.get("content-type") == "application/json" else body
    return start["status"], parsed, head, received


def chunks(body: bytes, size: int) -> list[dict]:
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]


def test_a_body_within_the_cap_reaches_the_app_as_it_came():
    app, body = App(), json.dumps({"input": ["好评", "bad"]}).encode()
    status, answer, _, _ = call(BodyGuard(app, ServeLimits(), Queue()), chunks(body, 7))
    assert (status, answer, app.bodies) == (200, b"ok", [body])


def test_a_declared_length_over_the_cap_is_refused_before_a_byte_is_read():
    app, limits = App(), ServeLimits(max_texts=1, max_chars=10)
    headers = {"content-length": str(limits.max_body_bytes + 1)}
    status, answer, head, received = call(BodyGuard(app, limits, Queue()), chunks(b"x", 1), headers)
    assert status == 413 and received == [] and app.bodies == []
    assert answer == error_body(413, answer["message"]) and answer["type"] == "RequestTooLarge"
    assert str(limits.max_body_bytes + 1) in answer["message"] and head["connection"] == "close"


def test_a_streamed_body_is_refused_as_soon_as_it_passes_the_cap():
    app, limits = App(), ServeLimits(max_texts=1, max_chars=10)
    body = b"x" * (3 * limits.max_body_bytes)
    messages = chunks(body, 4096)
    status, answer, _, received = call(BodyGuard(app, limits, Queue()), messages)
    assert status == 413 and app.bodies == [] and "over" in answer["message"]
    assert len(received) < len(messages) / 2  # it stopped reading once past the cap


def test_a_body_that_does_not_arrive_in_time_gets_408():
    app, limits = App(), ServeLimits(body_timeout=0.05)
    status, answer, head, _ = call(BodyGuard(app, limits, Queue()), chunks(b"{}", 1), delay=0.2)
    assert (status, answer["type"], head["connection"]) == (408, "RequestTimeout", "close")
    assert "0.05 s (--body-timeout)" in answer["message"] and app.bodies == []


def test_a_closed_queue_answers_503_without_reading():
    app = App()
    status, answer, _, received = call(BodyGuard(app, ServeLimits(), Queue(closed=True)), chunks(b"{}", 2))
    assert (status, answer["message"], received, app.bodies) == (503, "the server is shutting down", [], [])


def test_a_client_that_goes_away_gets_nothing_and_reaches_no_route():
    app = App()
    scope = {"type": "http", "headers": []}

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise AssertionError(f"sent {message}")

    asyncio.run(BodyGuard(app, ServeLimits(), Queue())(scope, receive, send))
    assert app.bodies == []


@pytest.mark.parametrize("char", ["a", "\u00e9", "\U0001f600", '"'])
def test_the_largest_request_the_limits_allow_fits_under_the_cap(char):
    """max_texts texts of max_chars characters each, JSON-encoded with ASCII escapes (the worst case), fit."""
    limits = ServeLimits(max_texts=8, max_chars=500)
    body = json.dumps({"model": "x", "input": [char * limits.max_chars] * limits.max_texts}).encode()
    assert len(body) <= limits.max_body_bytes


def test_error_body_is_vllms_shape_and_unreadable_bodies_say_why():
    assert error_body(422, "no") == {
        "object": "error",
        "message": "no",
        "type": "BadRequestError",
        "param": None,
        "code": 422,
    }
    assert error_body(418, "tea")["type"] == "Error"
    assert "not UTF-8" in unreadable_body(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"))
    assert "nested too deeply" in unreadable_body(RecursionError())
    assert unreadable_body(ValueError()).endswith("(ValueError)")
