"""OpenAI's HTTP API as the server speaks it: errors in OpenAI's JSON shape, and request fields read and checked
one by one so a bad request is answered with the field and what was wrong (HTTP 400), never a traceback.

Fields the server does not implement are refused when they would change the answer (n > 1, logprobs, tools) and
ignored when they would not (user, metadata, a zero penalty).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

MISSING = object()


class APIError(Exception):
    """An error answered as OpenAI does: HTTP status and {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_field(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


async def read_json(request: Request) -> dict[str, Any]:
    """The request's JSON object body, or a 400 saying why not."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def field(body: dict[str, Any], name: str, kind: str, default: Any = MISSING,
          check: Callable[[Any], str | None] | None = None) -> Any:
    """body[name] as `kind` (string, integer, number, boolean, array, object), `default` when absent or null
    (required when no default); check returns what is wrong with a value, or None."""
    value = body.get(name)
    if value is None:
        if default is MISSING:
            raise bad_field(name, f"'{name}' is a required property", code="missing_required_parameter")
        return default
    ok = {"string": isinstance(value, str),
          "integer": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
          "boolean": isinstance(value, bool),
          "array": isinstance(value, list),
          "object": isinstance(value, dict)}[kind]
    if not ok:
        article = "an" if kind[0] in "aio" else "a"
        raise bad_field(name, f"'{name}' must be {article} {kind}, got {json.dumps(value)[:80]}", code="invalid_type")
    problem = check(value) if check is not None else None
    if problem:
        raise bad_field(name, f"'{name}' {problem}, got {json.dumps(value)[:80]}", code="invalid_value")
    return value


def in_range(lo: float, hi: float, low_open: bool = False) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        inside = (lo < v if low_open else lo <= v) and v <= hi
        return None if inside else f"must be in {'(' if low_open else '['}{lo:g}, {hi:g}]"
    return check


def at_least(lo: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= lo else f"must be >= {lo}"


def refuse_unsupported(body: dict[str, Any], names: dict[str, Callable[[Any], bool]]) -> None:
    """400 for a field given with a value the server does not implement (the callable says which are fine)."""
    for name, fine in names.items():
        if body.get(name) is not None and not fine(body[name]):
            raise bad_field(name, f"'{name}' = {json.dumps(body[name])[:80]} is not supported by this server",
                            code="unsupported_parameter")


def string_list(name: str, value: Any, most: int) -> list[str]:
    """A string or a list of strings (the `stop` field)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_field(name, f"'{name}' must be a string or an array of strings", code="invalid_type")
    if len(items) > most:
        raise bad_field(name, f"'{name}' holds at most {most} strings, got {len(items)}", code="invalid_value")
    return items


def int_list(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_field(name, f"'{name}' must be an array of integers", code="invalid_type")
    return value


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


__all__ = ["APIError", "at_least", "bad_field", "field", "in_range", "int_list", "new_id", "now", "read_json",
           "refuse_unsupported", "string_list"]
