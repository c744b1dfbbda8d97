"""The HTTP side: FastAPI routes of the OpenAI API over the engine thread (`worker.Worker`).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (server-sent events with ``"stream": true``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

A request body is parsed here (not by FastAPI's validation, whose errors are 422s of another shape): malformed
JSON, a field of the wrong type, a value out of range, a prompt that does not fit the context → 400 with
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``; a full queue → 503 at once.

Generated ids become text through the tokenizer's stream decoder, then ``stop`` strings are cut (text that may
begin one is held back), and for chat the V4.1 reply parser (`chat.ReplyStream`) splits reasoning, answer and
tool calls. Streaming and non-streaming responses run the same pipeline, so their text is the same for the same
tokens. Unknown request fields are ignored, as OpenAI-compatible servers do; fields of known names are checked.
Completions take `"return_token_ids": true` (as vLLM) to get the generated ids in the choice (`token_ids`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import types
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import ChatFormatError, ContentDelta, ReasoningDelta, ReplyStream, ToolCallEvent, UnparsedDelta, \
    effort_budget, message_from_openai, tool_function
from ..engine import EngineInputError, Request
from ..sampling import SamplingError, SamplingParams
from .metrics import Metrics
from .worker import QueueFull, Worker

MAX_STOPS = 4  # as OpenAI


class BadRequest(ValueError):
    """Becomes a 400 with OpenAI's error body; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


# ------------------------------------------------------------------------------------------------- bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: dict | None = None


class ChatBody(_Body):
    messages: list
    max_completion_tokens: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    thinking: bool | dict | None = None
    reasoning_effort: str | int | None = None


class CompletionBody(_Body):
    prompt: str | list


async def parse_body(http: HttpRequest, model: type[BaseModel]) -> Any:
    raw = await http.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]  # its loc: the field, then (for a union) the member type tried
        field = str(err["loc"][0]) if err["loc"] else None
        given = f" (got {json.dumps(err['input'])[:40]})" if err["type"] != "missing" else ""
        raise BadRequest(f"{field}: {err['msg']}{given}" if field else err["msg"], param=field) from None


# ------------------------------------------------------------------------------------------------- settings
@dataclass
class ServerState:
    """What the routes share: the engine thread, the tokenizer, metrics and the model's limits."""

    worker: Worker
    tokenizer: Any
    metrics: Metrics
    model_name: str
    vocab_size: int
    max_context: int
    created: int = 0


def sampling_of(body: _Body) -> SamplingParams:
    """temperature 0..2 (0 greedy; default 1, as OpenAI), top_p (0, 1], seed 0..2^32-1 (default: random)."""
    if body.n not in (None, 1):
        raise BadRequest("only n = 1 is supported", "n")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    seed = secrets.randbelow(2**32) if body.seed is None else body.seed
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    try:
        params.validate()
    except SamplingError as e:
        raise BadRequest(str(e).replace("--", "").replace("top-p", "top_p"),
                         "seed" if "seed" in str(e) else "top_p") from None
    return params


def stops_of(body: _Body) -> tuple[str, ...]:
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return tuple(s for s in stops if s)


def engine_request(state: ServerState, ids: tuple[int, ...], max_tokens: int | None, sampling,
                   prompt_field: str, default_max: int | None = None) -> Request:
    """The engine request; 400 for a prompt or max_tokens that does not fit. Without max_tokens:
    ``default_max`` (None: the rest of the context), cut to what fits. ``prompt_field``: the body field the
    prompt came from (the error's param)."""
    if not ids:
        raise BadRequest("the prompt is empty", prompt_field)
    room = state.max_context - len(ids) + 1
    if len(ids) > state.max_context:
        raise BadRequest(f"the prompt has {len(ids)} tokens, longer than the context of {state.max_context} "
                         f"tokens", prompt_field)
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    if not 1 <= max_tokens <= room:
        raise BadRequest(f"max_tokens must be in 1 .. {room} (the context of {state.max_context} tokens minus the "
                         f"{len(ids)}-token prompt, plus one), got {max_tokens}", "max_tokens")
    request = Request(tuple(ids), max_tokens, sampling)
    try:
        state.worker.slots.engine.check([request])
    except EngineInputError as e:
        raise BadRequest(str(e), prompt_field) from None
    return request


def thinking_of(body: ChatBody) -> bool:
    """``thinking``: a bool or DeepSeek's ``{"type": "enabled" | "disabled"}``; default: on when a
    ``reasoning_effort`` is given, else off."""
    t = body.thinking
    if isinstance(t, dict):
        if t.get("type") not in ("enabled", "disabled"):
            raise BadRequest('thinking must be true, false or {"type": "enabled" | "disabled"}', "thinking")
        return t["type"] == "enabled"
    return body.reasoning_effort is not None if t is None else t


def chat_prompt(state: ServerState, body: ChatBody, thinking: bool) -> tuple[int, ...]:
    """Prompt ids of the chat: DeepSeek-V4.1's format (`chat.encode_messages`), folded into a smaller model
    vocabulary as `generate` does (the tiny model)."""
    from ..generate import PromptSpec, UsageError, tokenize  # noqa: PLC0415

    if not body.messages:
        raise BadRequest("messages must not be empty", "messages")
    try:
        messages = tuple(message_from_openai(m, f"messages[{i}]") for i, m in enumerate(body.messages))
    except ChatFormatError as e:
        raise BadRequest(str(e), "messages") from None
    tools = tuple(body.tools or ())
    try:
        for i, t in enumerate(tools):
            tool_function(t, f"tools[{i}]")
    except ChatFormatError as e:
        raise BadRequest(str(e), "tools") from None
    if body.tool_choice not in (None, "auto", "none", "required") and not isinstance(body.tool_choice, dict):
        raise BadRequest('tool_choice must be "auto", "none", "required" or a function', "tool_choice")
    try:
        effort_budget(body.reasoning_effort)
    except ChatFormatError as e:
        raise BadRequest(str(e), "reasoning_effort") from None
    if body.tool_choice == "none":
        tools = ()
    options = types.SimpleNamespace(thinking=thinking, reasoning_effort=body.reasoning_effort, chat=True,
                                    system=None)
    try:
        ids, _ = tokenize([PromptSpec(messages=messages, tools=tools, label="messages")], state.tokenizer, options,
                          state.vocab_size)
    except (UsageError, ChatFormatError) as e:
        raise BadRequest(str(e).removeprefix("messages: "), "messages") from None
    return ids[0]


def completion_prompt(state: ServerState, body: CompletionBody) -> tuple[int, ...]:
    """A string (BOS + its ids, folded as `generate` does), a list of token ids, or a list of one string."""
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt, add_bos=True)
        return tuple(i % state.vocab_size for i in ids) if state.vocab_size < state.tokenizer.vocab_size else \
            tuple(ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        raise BadRequest("prompt must be a string, a list of token ids or a list of one string", "prompt")
    bad = [i for i in prompt if not 0 <= i < state.vocab_size]
    if bad:
        raise BadRequest(f"prompt has token ids outside the model's vocabulary 0..{state.vocab_size - 1}: {bad[0]}",
                         "prompt")
    return tuple(prompt)


# ------------------------------------------------------------------------------------------------- pipeline
class StopMatcher:
    """Cuts text at the first ``stop`` string; holds back a tail that may begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self.held + text
        hits = [buf.find(s) for s in self.stops if s in buf]
        if hits:
            self.stopped, self.held = True, ""
            return buf[:min(hits)]
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


class TextPipeline:
    """Token ids → reply events (`chat.ReplyEvent`; completions: ContentDelta only)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], chat: bool, thinking: bool = False):
        self.decoder = tokenizer.stream(skip_special=not chat)  # chat: markers are text for the parser
        self.stop = StopMatcher(stops)
        self.reply = ReplyStream(thinking=thinking) if chat else None

    def _events(self, text: str) -> list:
        if self.reply is None:
            return [ContentDelta(text)] if text else []
        return self.reply.feed(text)

    def push(self, token: int) -> list:
        return self._events(self.stop.feed(self.decoder.push(token)))

    def finish(self) -> list:
        events = self._events(self.stop.feed(self.decoder.flush()) + self.stop.flush())
        return events + (self.reply.finish() if self.reply is not None else [])


@dataclass(frozen=True)
class Failed:
    """The engine failed on the request (its step raised): a 500, or an error event mid-stream."""

    message: str


@dataclass(frozen=True)
class Finish:
    reason: str  # stop | length
    token_ids: tuple[int, ...]  # the generated ids (an end id not included)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


async def generation_events(state: ServerState, request: Request, pipeline: TextPipeline,
                            http: HttpRequest | None, arrived: float) -> AsyncIterator:
    """Submit ``request`` (QueueFull raised at once) and yield its reply events, then one `Finish` (or `Failed`).
    The slot is freed when the generator is closed early (client gone). ``http``: polled for a disconnect
    (non-streaming)."""
    worker, metrics = state.worker, state.metrics
    job_id, events = worker.submit(request, asyncio.get_running_loop())
    metrics.add_prompt_tokens(len(request.prompt_ids))
    return _events(worker, metrics, job_id, events, pipeline, http, arrived)


async def _events(worker, metrics, job_id, events, pipeline, http, arrived):
    ids, last, done = [], None, False
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), 1.0)
            except asyncio.TimeoutError:
                if http is not None and await http.is_disconnected():
                    return
                continue
            if kind == "error":
                done = True
                yield Failed(str(value))
                return
            if kind == "done":
                done = True
                reason = "length" if value == "length" else "stop"
                break
            now = time.perf_counter()
            (metrics.ttft if last is None else metrics.itl).observe(now - (arrived if last is None else last))
            last = now
            ids.append(value)
            for e in pipeline.push(value):
                yield e
            if pipeline.stop.stopped:
                reason = "stop"
                break
        for e in pipeline.finish():
            yield e
        yield Finish(reason, tuple(ids))
    finally:
        if not done:
            worker.cancel(job_id)


# ------------------------------------------------------------------------------------------------- responses
def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _tool_call_delta(e: ToolCallEvent) -> dict:
    call = replace(e.call, id=e.call.id or f"call_{uuid.uuid4().hex[:24]}")
    return {"index": e.index, **call.to_openai()}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def chat_completion(state: ServerState, http: HttpRequest):
    arrived = time.perf_counter()
    body = await parse_body(http, ChatBody)
    thinking = thinking_of(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = engine_request(state, chat_prompt(state, body, thinking), max_tokens, sampling_of(body), "messages")
    pipeline = TextPipeline(state.tokenizer, stops_of(body), chat=True, thinking=thinking)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    prompt_tokens = len(request.prompt_ids)
    if body.stream:
        events = await generation_events(state, request, pipeline, None, arrived)
        return StreamingResponse(_chat_stream(head, events, prompt_tokens), media_type="text/event-stream")
    events = await generation_events(state, request, pipeline, http, arrived)
    reasoning, content, calls, unparsed, finish = [], [], [], [], None
    async for e in events:
        if isinstance(e, Failed):
            return error_response(500, e.message, "server_error")
        if isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallEvent):
            calls.append(_tool_call_delta(e))
        elif isinstance(e, UnparsedDelta):
            unparsed.append(e.text)
        else:
            finish = e
    if finish is None:  # the client went away
        return PlainTextResponse("", status_code=499)
    message = {"role": "assistant", "content": "".join(content) + "".join(unparsed),
               "reasoning_content": "".join(reasoning) if thinking else None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    reason = "tool_calls" if calls and finish.reason == "stop" else finish.reason
    return JSONResponse({**head, "object": "chat.completion",
                         "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
                         "usage": _usage(prompt_tokens, finish.completion_tokens)})


async def _chat_stream(head: dict, events, prompt_tokens: int):
    def chunk(delta: dict, finish=None) -> str:
        return _sse({**head, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    saw_calls = False
    async for e in events:
        if isinstance(e, ReasoningDelta):
            yield chunk({"reasoning_content": e.text})
        elif isinstance(e, (ContentDelta, UnparsedDelta)):
            yield chunk({"content": e.text})
        elif isinstance(e, ToolCallEvent):
            saw_calls = True
            yield chunk({"tool_calls": [_tool_call_delta(e)]})
        elif isinstance(e, Failed):
            yield _sse({"error": {"message": e.message, "type": "server_error", "param": None, "code": None}})
        else:
            yield chunk({}, "tool_calls" if saw_calls and e.reason == "stop" else e.reason)
            yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                        "usage": _usage(prompt_tokens, e.completion_tokens)})
    yield "data: [DONE]\n\n"


async def completion(state: ServerState, http: HttpRequest):
    arrived = time.perf_counter()
    body = await parse_body(http, CompletionBody)
    request = engine_request(state, completion_prompt(state, body), body.max_tokens, sampling_of(body), "prompt",
                             default_max=16)  # OpenAI's default for completions
    pipeline = TextPipeline(state.tokenizer, stops_of(body), chat=False)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    prompt_tokens = len(request.prompt_ids)
    if body.stream:
        events = await generation_events(state, request, pipeline, None, arrived)
        return StreamingResponse(_completion_stream(head, events, prompt_tokens), media_type="text/event-stream")
    events = await generation_events(state, request, pipeline, http, arrived)
    text, finish = [], None
    async for e in events:
        if isinstance(e, Failed):
            return error_response(500, e.message, "server_error")
        if isinstance(e, Finish):
            finish = e
        else:
            text.append(e.text)
    if finish is None:
        return PlainTextResponse("", status_code=499)
    choice = {"index": 0, "text": "".join(text), "finish_reason": finish.reason, "logprobs": None}
    if body.model_extra.get("return_token_ids") is True:  # as vLLM: the ids, for exact comparisons
        choice["token_ids"] = list(finish.token_ids)
    return JSONResponse({**head, "object": "text_completion", "choices": [choice],
                         "usage": _usage(prompt_tokens, finish.completion_tokens)})


async def _completion_stream(head: dict, events, prompt_tokens: int):
    def chunk(text: str, finish=None) -> str:
        return _sse({**head, "object": "text_completion",
                     "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]})

    async for e in events:
        if isinstance(e, Failed):
            yield _sse({"error": {"message": e.message, "type": "server_error", "param": None, "code": None}})
        elif isinstance(e, Finish):
            yield chunk("", e.reason)
            yield _sse({**head, "object": "text_completion", "choices": [],
                        "usage": _usage(prompt_tokens, e.completion_tokens)})
        else:
            yield chunk(e.text)
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------------- the app
def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="dsv41-jax", docs_url=None, redoc_url=None, openapi_url=None)
    state.created = state.created or int(time.time())

    def route(endpoint: str, handler):
        async def run(http: HttpRequest):
            try:
                response = await handler(state, http)
            except BadRequest as e:
                response = error_response(400, str(e), param=e.param)
            except QueueFull as e:
                response = error_response(503, str(e), "server_overloaded", code="queue_full")
            state.metrics.request_done(endpoint, response.status_code)
            return response
        return run

    app.post("/v1/chat/completions")(route("chat", chat_completion))
    app.post("/v1/completions")(route("completions", completion))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "dsv41-jax", "max_model_len": state.max_context}]}

    @app.get("/health")
    async def health():
        if not state.worker.alive:
            return error_response(503, "the engine thread has stopped", "server_error")
        return {"status": "ok", "running": state.worker.slots.active, "queued": state.worker.queued}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def server_error(_, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    return app
