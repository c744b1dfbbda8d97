"""How the server answers what it cannot serve: OpenAI's error body, the strict reader of request bodies, and
the ASGI layer under every route that counts each response and turns an unexpected exception into one 500.

* `BadRequest` (the user's mistake) becomes a 400 ``{"error": {"message", "type": "invalid_request_error",
  "param", "code"}}`` where ``param`` names the field.
* `read_json_object`: a body is a JSON object of JSON values. Python's reader also takes what JSON has not
  (``NaN``, ``Infinity``), numbers past the double range (``1e400`` reads as infinity) and ``\\ud800`` escapes that
  make strings no Unicode text can hold (the tokenizer refuses them); each is a 400 naming where it is.
* `ErrorGuard` counts every response by endpoint and status (404s, 405s and 500s included). An exception that
  escapes a route is logged once on stderr with its traceback and answered 500, and the connection stays open
  for the client's next request: the exception goes no further (an ASGI server that sees one closes the
  connection, and logs it a second time).
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from typing import Any

from fastapi.responses import JSONResponse

MAX_DEPTH = 64  # nesting of arrays and objects in a body (a tool schema needs a handful)

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/models": "models",
             "/tokenize": "tokenize", "/detokenize": "detokenize", "/health": "health",
             "/metrics": "metrics"}  # any other path counts as "other"


class BadRequest(ValueError):
    """Becomes a 400 with OpenAI's error body; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def shown(value: Any, limit: int = 40) -> str:
    """``value`` as JSON for an error message, cut to about ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------------------------- bodies
class _NotFinite:
    """What the reader makes of ``NaN``, ``Infinity`` or a number past the double range (found by `_check`)."""

    def __init__(self, literal: str):
        self.literal = literal


def _parse_float(literal: str):
    value = float(literal)
    return value if math.isfinite(value) else _NotFinite(literal)


def read_json_object(raw: bytes) -> dict:
    """The body as a JSON object; BadRequest for anything else (see the module's docstring)."""
    try:
        data = json.loads(raw, parse_constant=_NotFinite, parse_float=_parse_float)
    except RecursionError:
        raise BadRequest(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise BadRequest(f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {shown(data, 20)}")
    _check(data)
    return data


_TO_CHECK = (str, dict, list, _NotFinite)


def _check(data: dict) -> None:
    """BadRequest at the first value JSON cannot carry: too deep, not a finite number, not Unicode text."""
    todo: list[tuple[str, Any, int, str]] = [("", data, 0, "")]  # path, value, depth, the body field it is in
    while todo:
        path, value, depth, field = todo.pop()
        if isinstance(value, _NotFinite):
            raise BadRequest(f"{path}: {value.literal} is not a JSON number (numbers must be finite)", path)
        if isinstance(value, str):
            _check_text(value, path, path)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise BadRequest(f"{field} is nested deeper than {MAX_DEPTH} levels", field)
            if isinstance(value, dict):
                for key in value:
                    _check_text(key, f"the key {shown(key)} of {path or 'the body'}", path or None)
                items = [(f"{path}.{k}" if path else k, v, field or k) for k, v in value.items()
                         if isinstance(v, _TO_CHECK)]
            else:  # (a prompt of token ids builds no paths)
                items = [(f"{path}[{i}]", v, field) for i, v in enumerate(value) if isinstance(v, _TO_CHECK)]
            todo += [(p, v, depth + 1, f) for p, v, f in reversed(items)]


def _check_text(text: str, where: str, param: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise BadRequest(f"{where}: the text holds a lone surrogate \\u{ord(bad):04x} (at character {e.start}), "
                         f"which is no Unicode character (an escape in \\ud800-\\udfff must be half of a pair)",
                         param) from None


# ------------------------------------------------------------------------------------------------- the guard
class ErrorGuard:
    """ASGI middleware (`FastAPI.add_middleware`): counts each response in ``metrics`` (`Metrics.request_done`,
    by `ENDPOINTS` and status) and answers an exception that escapes the app with one logged 500."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = ENDPOINTS.get(scope.get("path", ""), "other")
        started = finished = False

        async def counted_send(message):
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
                self.metrics.request_done(endpoint, message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        except Exception as exc:  # noqa: BLE001 - the server's fault: logged and answered, never re-raised
            log_internal_error(f"{scope.get('method', '')} {scope.get('path', '')}", exc)
            if not started:
                response = error_response(500, f"internal error: {type(exc).__name__}: {exc} (the server log "
                                               f"has the traceback)", "server_error")
                await response(scope, receive, counted_send)
            elif not finished:  # mid-body: end the response (what was sent stands) so the connection lives
                try:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except Exception:  # noqa: BLE001 - a body shorter than its length: the server closes the connection
                    pass


def log_internal_error(where: str, exc: BaseException) -> None:
    """One report on stderr: what failed, then the traceback."""
    print(f"dsv41_jax.serve: internal error on {where}:", file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.flush()
