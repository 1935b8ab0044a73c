"""What the server accepts, enforced before a request reaches a route: `ServeLimits`, the ASGI `BodyGuard`
(a body over the cap refused before it is read, one that does not arrive in time answered 408, new requests
told to go while draining), and the error object every refusal carries (`error_body`, vLLM's shape)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from loracls.inference.batcher import Batcher


@dataclass
class ServeLimits:
    """What one request and the queue may hold, how batches are formed, and the labels' confidence floor."""

    max_batch: int = 32
    """Texts the worker takes from the queue at once."""
    pass_size: int | None = None
    """Texts in one forward pass at most: the worker's batch, sorted by length, runs in passes of this many.
    None: `max_batch`."""
    pass_tokens: int | None = None
    """Padded tokens in one forward pass at most (texts x the pass's longest; `length_passes`). None: no
    budget on a GPU, `CPU_PASS_TOKENS` on a CPU (see there); 0: no budget."""
    max_wait_ms: float = 5.0
    """How long the worker waits after the first waiting text for more to fill a batch."""
    max_texts: int = 64
    """Texts in one request at most (413 above)."""
    max_chars: int = 20_000
    """Characters in one text at most (413 above); a text is cut to the run's max_length tokens anyway."""
    max_queue: int = 1024
    """Texts waiting at most; a request that would exceed it is answered 503 with Retry-After."""
    body_timeout: float = 10.0
    """Seconds a request's body may take to arrive (408 and the connection closed after)."""
    default_new_tokens: int = 64
    """Tokens a `generate` request without `max_new_tokens` gets (`loracls predict --generate`'s default)."""
    max_new_tokens: int = 256
    """The most tokens a `generate` request may ask for (`objective: lm` models)."""
    min_confidence: float | None = None
    """`/classify` requests that send no `min_confidence` get this one: a single-label classifier gives no
    label (`abstained`) where its top probability is below it. None: every text gets a label."""

    @property
    def max_body_bytes(self) -> int:
        """The largest body a request within `max_texts` and `max_chars` can need: 12 bytes a character
        (a character outside the BMP written as two \\u escapes), a little per text and for the rest."""
        return self.max_texts * (12 * self.max_chars + 64) + 65_536


ERROR_TYPES = {
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeout",
    413: "RequestTooLarge",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


def error_body(status: int, message: str) -> dict:
    """The error shape of vLLM's OpenAI-compatible server."""
    kind = ERROR_TYPES.get(status, "Error")
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


class BodyTooLarge(Exception):
    pass


class BodyGuard:
    """ASGI middleware in front of the app: while draining (or after the worker died) every request gets 503
    with `Connection: close`; a body over `max_body_bytes` gets 413 before it is read (by `Content-Length`) or
    as soon as it streams past the cap; a body not complete within `body_timeout` seconds gets 408. Both close
    the connection. The body read here is handed to the app as it came."""

    def __init__(self, app, limits: ServeLimits, batcher: Batcher):
        self.app, self.limits, self.batcher = app, limits, batcher

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.batcher.closed:
            return await refuse(scope, receive, send, 503, self.batcher.closed_reason())
        cap = self.limits.max_body_bytes
        too_large = f"at most {cap} bytes (--max-texts x --max-chars)"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > cap:
            return await refuse(scope, receive, send, 413, f"the body has {int(length)} bytes; {too_large}")
        try:
            body = await asyncio.wait_for(read_body(receive, cap), self.limits.body_timeout)
        except BodyTooLarge:
            return await refuse(scope, receive, send, 413, f"the body is over {cap} bytes; {too_large}")
        except asyncio.TimeoutError:
            late = f"the request body did not arrive within {self.limits.body_timeout:g} s (--body-timeout)"
            return await refuse(scope, receive, send, 408, late)
        if body is None:  # the client went away
            return None
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)


async def read_body(receive, cap: int) -> bytes | None:
    """The whole body, or None if the client disconnected; `BodyTooLarge` once it passes `cap` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def refuse(scope, receive, send, status: int, message: str) -> None:
    response = JSONResponse(error_body(status, message), status, headers={"Connection": "close"})
    await response(scope, receive, send)


def unreadable_body(cause: BaseException | None) -> str:
    """Why FastAPI could not parse a body that the JSON decoder did not reject as such."""
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not valid JSON: it is not UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON here: it is nested too deeply"
    return f"the request body is not valid JSON ({type(cause).__name__})"
