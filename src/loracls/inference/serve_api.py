"""The service's HTTP API: vLLM's `/classify` and text-embeddings-inference's `/predict` requests, the
classifiers and options a request picks (checked before it is queued), and the bodies answered."""

from __future__ import annotations

import time
import uuid

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from loracls.inference.batcher import ServeError
from loracls.inference.predict import MULTI_LABEL_CONFIDENCE
from loracls.inference.serve_limits import ServeLimits
from loracls.objective import objective_kind
from loracls.training.calibration import abstains


class ClassifyRequest(BaseModel):
    """vLLM's `/classify` request: `input` is one text or a list; `model` names the classifier (ignored by a
    server of one), or a list of them for all their answers to the same texts (fan-out); other fields are
    accepted and ignored. `generate`/`max_new_tokens`: also say the response (`objective: lm`).
    `min_confidence`: no label below this top probability (single-label; null: none; left out: the
    server's `--min-confidence`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    input: str | list[str]
    model: str | list[str] | None = None
    generate: bool = False
    max_new_tokens: int | None = None
    min_confidence: float | None = Field(default=None, ge=0.0, le=1.0)


class PredictRequest(BaseModel):
    """Hugging Face text-embeddings-inference's `/predict` request: `inputs`, one text or a list; `model`
    names the classifier where a server holds several."""

    model_config = ConfigDict(extra="allow", strict=True)
    inputs: str | list[str]
    model: str | None = None


def chosen(model: str | list[str] | None, infos: dict[str, dict]) -> list[str]:
    """The classifiers a request names in `model`: a server of one answers with it whatever a single name
    says (as before it held several); a list is a fan-out over distinct names it holds."""
    names = list(infos)
    if isinstance(model, list):
        unknown = [m for m in model if m not in infos]
        if not model or unknown or len(set(model)) < len(model):
            problem = f"unknown {unknown}" if unknown else "an empty list" if not model else "a name twice"
            raise ServeError(404 if unknown else 422, f"model: {problem}; the classifiers are {names}")
        return model
    if len(names) == 1:
        return names
    if model is None:
        raise ServeError(422, f"this server holds {len(names)} classifiers: name one in `model` ({names})")
    if model not in infos:
        raise ServeError(404, f"The model `{model}` does not exist; the classifiers are {names}")
    return [model]


def new_tokens(body: ClassifyRequest, limits: ServeLimits, info: dict) -> int | None:
    """How many tokens a `generate` request may say (None: classification only); refused for a model with
    a head, or outside 1..`max_new_tokens`."""
    if not body.generate:
        return None
    if not objective_kind(info["objective"]).generates:
        raise ServeError(422, "generate needs a model trained with objective: lm (this one has a head)")
    asked = body.max_new_tokens
    generate = limits.default_new_tokens if asked is None else asked
    if not 1 <= generate <= limits.max_new_tokens:
        raise ServeError(
            422,
            f"max_new_tokens must be 1..{limits.max_new_tokens}, not {generate} "
            f"(left out: {limits.default_new_tokens})",
        )
    return generate


def min_confidence(body: ClassifyRequest, limits: ServeLimits, info: dict) -> float | None:
    """The request's `min_confidence` for one classifier: its own (null: none), else the server's; a
    multi-label classifier takes none from the server and refuses the request's own (422)."""
    asked = "min_confidence" in body.model_fields_set
    if info["multi_label"]:
        if asked and body.min_confidence is not None:
            raise ServeError(422, f"{info['name']}: {MULTI_LABEL_CONFIDENCE}")
        return None
    return body.min_confidence if asked else limits.min_confidence


def abstain(records: list[dict], level: float | None) -> list[dict]:
    """Records of texts whose top probability is below `level` lose their `label`; with a level, every
    record says whether it `abstained`."""
    if level is None or not records:
        return records
    unsure = abstains(np.array([r["probs"] for r in records]), level)
    for record, abstained in zip(records, unsure, strict=True):
        record["abstained"] = bool(abstained)
        if abstained:
            record["label"] = None
    return records


def classify_response(records: list[dict], model: str) -> dict:
    """`/classify`'s body, as vLLM's classification API shapes it (with its token usage)."""
    tokens = sum(r.pop("prompt_tokens") for r in records)
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, **r} for i, r in enumerate(records)],
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }


def fan_out_response(answers: dict[str, list[dict]]) -> dict:
    """`/classify` with a list of classifiers: per text, each classifier's record (`results[name]`), and the
    tokens all of them read."""
    bodies = {name: classify_response(records, name) for name, records in answers.items()}
    texts = len(next(iter(answers.values())))
    tokens = sum(body["usage"]["prompt_tokens"] for body in bodies.values())
    some = next(iter(bodies.values()))
    return {
        **some,
        "model": list(answers),
        "data": [
            {"index": i, "results": {name: body["data"][i] | {"index": i} for name, body in bodies.items()}}
            for i in range(texts)
        ],
        "usage": {**some["usage"], "prompt_tokens": tokens, "total_tokens": tokens},
    }


def check_texts(texts: list[str], limits: ServeLimits) -> None:
    """Refuse a request's texts before they are queued: none, too many, too long, not encodable as UTF-8
    (a lone surrogate such as "\\ud800" is valid JSON but no tokenizer reads it)."""
    if not texts:
        raise ServeError(422, "input is an empty list; give at least one text")
    if len(texts) > limits.max_texts:
        raise ServeError(413, f"{len(texts)} texts in one request; at most {limits.max_texts} (--max-texts)")
    for n, text in enumerate(texts):
        if len(text) > limits.max_chars:
            raise ServeError(
                413, f"text {n} has {len(text)} characters; at most {limits.max_chars} (--max-chars)"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ServeError(
                422, f"text {n} is not valid Unicode: a lone surrogate at character {e.start}"
            ) from None
