"""The HTTP side: FastAPI routes of the OpenAI API over the engine thread (`worker.Worker`).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (server-sent events with ``"stream": true``),
``GET /v1/models``, vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /health``, ``GET /metrics``
(Prometheus text).

Each body is read by `fields` (a mistake: a 400 naming the field, an unknown model: a 404); a full queue → 503 at
once. Every response is counted in ``/metrics`` and an internal error is one logged 500 (`errors.ErrorGuard`); a
stream that fails after its first chunk ends with an error event and ``[DONE]``.

Generated ids become text through the tokenizer's stream decoder, then ``stop`` strings are cut (text that may
begin one is held back), and for chat the V4.1 reply parser (`chat.ReplyStream`) splits reasoning, answer and
tool calls. Streaming and non-streaming responses run the same pipeline, so their text is the same for the same
tokens. ``n`` choices are n generations (`choice_events`), merged into one response or stream by choice index;
completions' ``echo`` and chat's ``parallel_tool_calls: false`` (`TextPipeline`'s ``one_call``) are the host's;
the log-probs come with the tokens from the device step, in OpenAI's shapes (`LogprobShapes`). While the server
drains (shutting down) a new request is a 503 and ``/health`` says ``draining``. With an API key
(`ApiKeyGuard`) every route but ``/health`` and ``/metrics`` needs it as a Bearer token (else a 401).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..chat import ContentDelta, ReasoningDelta, ReplyStream, ToolCallEvent, UnparsedDelta
from ..engine import Request
from ..tokenizer import fold_ids
from ..vision.preprocess import ImagePrompt
from .errors import BadRequest, ErrorGuard, error_body, error_response, log_internal_error, read_json_object, shown
from .fields import (
    ChatBody,
    ChatPrompt,
    CompletionBody,
    DetokenizeBody,
    ModelNotFound,
    ServerState,
    TokenizeBody,
    TokenizeChatBody,
    best_of_of,
    chat_prompt,
    choices_of,
    completion_prompt,
    echo_text,
    engine_request,
    grammar_of,
    image_prompt,
    include_usage,
    logprobs_of,
    model_of,
    parse_body,
    sampling_of,
    stops_of,
    thinking_of,
    validated,
)
from .worker import QueueFull, ShuttingDown, Worker


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
    """Token ids → reply events (`chat.ReplyEvent`; completions: ContentDelta only). ``one_call`` (chat's
    ``parallel_tool_calls: false``): the reply ends with its first tool call (as a stop string ends it)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], chat: bool, thinking: bool = False,
                 one_call: bool = False):
        self.decoder = tokenizer.stream(skip_special=not chat)  # chat: markers are text for the parser
        self.stop = StopMatcher(stops)
        self.reply = ReplyStream(thinking=thinking) if chat else None
        self.one_call, self.cut = one_call, False

    def _events(self, text: str) -> list:
        if self.reply is None:
            return [ContentDelta(text)] if text else []
        events = self.reply.feed(text)
        calls = [k for k, e in enumerate(events) if isinstance(e, ToolCallEvent)]
        if self.one_call and calls:
            self.cut = self.stop.stopped = True  # what follows the first call is never sent
            return events[:calls[0] + 1]
        return events

    def push(self, token: int) -> list:
        return [] if self.cut else self._events(self.stop.feed(self.decoder.push(token)))

    def finish(self) -> list:
        if self.cut:
            return []
        events = self._events(self.stop.feed(self.decoder.flush()) + self.stop.flush())
        return events + (self.reply.finish() if self.reply is not None and not self.cut else [])


@dataclass(frozen=True)
class Failed:
    """The engine failed on the request (its step raised: a 500), or the server's drain ended it (a 503); an
    error event mid-stream."""

    message: str
    status: int = 500

    @property
    def code(self) -> str | None:
        return "shutting_down" if self.status == 503 else None

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, "server_error", code=self.code)

    def event(self) -> str:
        return _sse(error_body(self.message, "server_error", code=self.code))


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the top ones (as many as the request asked for), reported just
    before the token's text events."""

    token: int
    logprob: float
    top_ids: list[int]
    top: list[float]


@dataclass(frozen=True)
class Finish:
    reason: str  # stop | length
    token_ids: tuple[int, ...]  # the generated ids (an end id not included)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Generation:
    """One submitted request: `close` cancels it unless it ended (a no-op after that, and the second time)."""

    def __init__(self, worker: Worker, job_id: int):
        self.worker, self.job_id, self.ended = worker, job_id, False

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.worker.cancel(self.job_id)


async def generation_events(state: ServerState, request: Request, pipeline: TextPipeline,
                            http: HttpRequest | None, arrived: float, logprobs: int | None = None,
                            grammar: str | None = None) -> tuple[Generation, AsyncIterator]:
    """Submit ``request`` (QueueFull raised at once): its `Generation`, and its reply events (with
    ``logprobs``, a `TokenLogprob` before each token's) then one `Finish` (or `Failed`). The request's
    ``stop_token_ids`` (its sampling's ``held_ids``) end it as an end id does. The request is cancelled when the
    events are closed early (client gone), or by `Generation.close` when they never started (a stream whose
    client left before its first chunk: an async generator never started runs no ``finally``). ``http``: polled
    for a disconnect (non-streaming). ``grammar``: the reply is constrained to it (`structured`), a matcher of its
    own for this generation."""
    worker, metrics = state.worker, state.metrics
    constraint = None if grammar is None else state.structured.matcher(grammar)
    job_id, events = worker.submit(request, asyncio.get_running_loop(), logprobs=logprobs,
                                   stop_ids=request.sampling.held_ids, constraint=constraint)
    metrics.add_prompt_tokens(len(request.prompt_ids))
    generation = Generation(worker, job_id)
    return generation, _events(generation, metrics, events, pipeline, http, arrived)


async def _events(generation, metrics, events, pipeline, http, arrived):
    ids, last, reason, logprob = [], None, "abort", None
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), 1.0)
            except asyncio.TimeoutError:
                if http is not None and await http.is_disconnected():
                    return
                continue
            if kind in ("error", "shutdown"):
                generation.ended = True
                yield Failed(str(value), 503 if kind == "shutdown" else 500)
                return
            if kind == "done":
                generation.ended = True
                end = "length" if value == "length" else "stop"
                break
            if kind == "logprobs":
                logprob = value
                continue
            if logprob is not None:
                yield TokenLogprob(value, *logprob)
                logprob = None
            now = time.perf_counter()
            (metrics.ttft if last is None else metrics.itl).observe(now - (arrived if last is None else last))
            last = now
            ids.append(value)
            for e in pipeline.push(value):
                yield e
            if pipeline.stop.stopped:
                end = "stop"
                break
        reason = end
        metrics.e2e.observe(time.perf_counter() - arrived)
        for e in pipeline.finish():
            yield e
        yield Finish(end, tuple(ids))
    finally:
        generation.close()
        metrics.request_finished(reason)


class EventStream(StreamingResponse):
    """A server-sent-event response over one generation: however the response ends (done, the client gone
    mid-stream, or gone before the first chunk, when the body's generator never starts), its body is closed and
    the generation cancelled at once (not when the garbage collector finds the generator), so its slot is free
    at the next step."""

    def __init__(self, body: AsyncIterator[str], generations: list[Generation]):
        super().__init__(body, media_type="text/event-stream")
        self.generations = generations

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # (ASGI 2.4: the server's send raised) the client is gone: no one to answer
            pass
        finally:
            for generation in self.generations:
                generation.close()
            await self.body_iterator.aclose()


async def choice_events(state: ServerState, request: Request, n: int, pipeline, http: HttpRequest | None,
                        arrived: float, logprobs: int | None, grammar: str | None = None
                        ) -> tuple[list[Generation], AsyncIterator]:
    """Submit ``n`` generations of ``request`` (choice i with seed + i; a greedy one n times the same) and merge
    their events as (choice index, event). ``pipeline()`` makes each choice's `TextPipeline`. QueueFull when
    they do not all fit (those submitted are cancelled)."""
    generations, streams = [], []
    try:
        for i in range(n):
            sampling = replace(request.sampling, seed=(request.sampling.seed + i) % 2**32)
            generation, events = await generation_events(state, replace(request, sampling=sampling), pipeline(),
                                                         http, arrived, logprobs, grammar)
            generations.append(generation)
            streams.append(events)
    except QueueFull:
        for generation in generations:
            generation.close()
        raise
    return generations, _merged(streams)


class _Raised:
    def __init__(self, exc: Exception):
        self.exc = exc


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(index, event) of each stream's events as they come (one stream: in its own task, as it is); closing
    this closes every stream (their requests are cancelled); a stream's exception is raised here."""
    if len(streams) == 1:
        async with aclosing(streams[0]):
            async for event in streams[0]:
                yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async with aclosing(stream):
                async for event in stream:
                    queue.put_nowait((i, event))
        except Exception as exc:  # noqa: BLE001 - raised again in the consumer
            queue.put_nowait((i, _Raised(exc)))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, event = await queue.get()
            if event is done:
                left -= 1
            elif isinstance(event, _Raised):
                raise event.exc
            else:
                yield i, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ------------------------------------------------------------------------------------------------- responses
def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _tool_call_delta(e: ToolCallEvent) -> dict:
    call = replace(e.call, id=e.call.id or f"call_{uuid.uuid4().hex[:24]}")
    return {"index": e.index, **call.to_openai()}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _guarded(stream: AsyncIterator[str], where: str):
    """``stream``'s events; if it raises, the error logged once, then an error event and ``[DONE]`` (the status,
    200, is sent already)."""
    async with aclosing(stream):
        try:
            async for piece in stream:
                yield piece
        except Exception as exc:  # noqa: BLE001 - the server's fault, told to the client in the stream
            log_internal_error(where, exc)
            yield _sse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"))
            yield "data: [DONE]\n\n"


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # as vLLM: JSON has no -inf


class LogprobShapes:
    """`TokenLogprob` events in OpenAI's shapes: chat's ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs"}], "refusal": null}``, completions' ``{"tokens", "token_logprobs", "top_logprobs" (a
    ``{token: logprob}`` per token, the drawn token's always in it, as vLLM's), "text_offset"}`` (each token's
    start in the choice's text, counted across a stream's chunks). A token's text: its own bytes as the reply
    decodes them (completions skip special tokens, chat keeps them), invalid UTF-8 as U+FFFD."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, 0

    def _text(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(int(token), not self.chat)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _entry(self, token: int, logprob: float) -> dict:
        text, raw = self._text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": raw}

    def block(self, entries: list[TokenLogprob]) -> dict:
        if self.chat:
            return {"content": [{**self._entry(e.token, e.logprob),
                                 "top_logprobs": [self._entry(i, lp) for i, lp in zip(e.top_ids, e.top)]}
                                for e in entries], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text, _ = self._text(e.token)
            top: dict[str, float] = {}
            for i, lp in zip(e.top_ids, e.top):  # ids of one text (U+FFFD): the most likely one's
                top.setdefault(self._text(i)[0], _finite(lp))
            top.setdefault(text, _finite(e.logprob))
            for key, value in zip(out, (text, _finite(e.logprob), top, self.offset)):
                out[key].append(value)
            self.offset += len(text)
        return out


async def read_images(state: ServerState, prompt: ChatPrompt) -> ImagePrompt | None:
    """The chat's image prompt (`fields.image_prompt`: decoded, resized, laid out), on a worker thread so the
    event loop serves the other requests meanwhile; None for a text prompt."""
    return await asyncio.to_thread(image_prompt, state, prompt) if prompt.images else None


async def chat_completion(state: ServerState, http: HttpRequest):
    arrived = time.perf_counter()
    body = await parse_body(http, ChatBody)
    name, usage, n = model_of(state, body), include_usage(body), choices_of(body)
    thinking = thinking_of(body)
    logprobs = logprobs_of(body)
    max_field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    prompt, sampling = chat_prompt(state, body, thinking), sampling_of(body, state.vocab_size)
    images = await read_images(state, prompt)
    request = engine_request(state, prompt.ids if images is None else images.ids, getattr(body, max_field),
                             sampling, "messages", max_field=max_field, images=images)
    grammar = grammar_of(state, body, request.sampling, thinking)
    stops = stops_of(body)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
    prompt_tokens = len(request.prompt_ids)
    shapes = None if logprobs is None else [LogprobShapes(state.tokenizer, chat=True) for _ in range(n)]
    one_call = body.parallel_tool_calls is False
    ask = (lambda: TextPipeline(state.tokenizer, stops, chat=True, thinking=thinking, one_call=one_call), arrived,
           logprobs, grammar)
    if body.stream:
        generations, events = await choice_events(state, request, n, ask[0], None, *ask[1:])
        return EventStream(_guarded(_chat_stream(head, events, prompt_tokens, usage, shapes, n), "a chat stream"),
                           generations)
    _, events = await choice_events(state, request, n, ask[0], http, *ask[1:])
    parts = [{"reasoning": [], "content": [], "calls": [], "unparsed": [], "logprobs": []} for _ in range(n)]
    finishes: dict[int, Finish] = {}
    async with aclosing(events):
        async for i, e in events:
            if isinstance(e, Failed):
                return e.response()
            part = parts[i]
            if isinstance(e, ReasoningDelta):
                part["reasoning"].append(e.text)
            elif isinstance(e, ContentDelta):
                part["content"].append(e.text)
            elif isinstance(e, ToolCallEvent):
                part["calls"].append(_tool_call_delta(e))
            elif isinstance(e, UnparsedDelta):
                part["unparsed"].append(e.text)
            elif isinstance(e, TokenLogprob):
                part["logprobs"].append(e)
            else:
                finishes[i] = e
    if len(finishes) < n:  # the client went away
        return PlainTextResponse("", status_code=499)
    choices = []
    for i, part in enumerate(parts):
        message = {"role": "assistant", "content": "".join(part["content"]) + "".join(part["unparsed"]),
                   "reasoning_content": "".join(part["reasoning"]) if thinking else None}
        calls = part["calls"]
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        reason = "tool_calls" if calls and finishes[i].reason == "stop" else finishes[i].reason
        choices.append({"index": i, "message": message, "finish_reason": reason,
                        "logprobs": None if shapes is None else shapes[i].block(part["logprobs"])})
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": _usage(prompt_tokens, sum(f.completion_tokens for f in finishes.values()))})


async def _chat_stream(head: dict, events, prompt_tokens: int, usage: bool = True,
                       shapes: list[LogprobShapes] | None = None, n: int = 1):
    """The chat stream's chunks over ``events`` ((choice index, event), `choice_events`); with ``shapes`` (one
    per choice), the log-probs of a choice's tokens since its last chunk ride on its next one (a token whose text
    is held back, a partial character or a possible stop string, reports its log-prob with the text that
    follows). The usage chunk comes once every choice has finished."""
    pending: list[list[TokenLogprob]] = [[] for _ in range(n)]
    saw_calls, completion_tokens = [False] * n, 0

    def chunk(i: int, delta: dict, finish=None) -> str:
        logprobs = None if shapes is None or not pending[i] else shapes[i].block(pending[i])
        pending[i].clear()
        return _sse({**head, "object": "chat.completion.chunk",
                     "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]})

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async with aclosing(events):
        async for i, e in events:
            if isinstance(e, TokenLogprob):
                pending[i].append(e)
            elif isinstance(e, ReasoningDelta):
                yield chunk(i, {"reasoning_content": e.text})
            elif isinstance(e, (ContentDelta, UnparsedDelta)):
                yield chunk(i, {"content": e.text})
            elif isinstance(e, ToolCallEvent):
                saw_calls[i] = True
                yield chunk(i, {"tool_calls": [_tool_call_delta(e)]})
            elif isinstance(e, Failed):
                yield e.event()
                break
            else:
                if pending[i]:
                    yield chunk(i, {})
                yield chunk(i, {}, "tool_calls" if saw_calls[i] and e.reason == "stop" else e.reason)
                completion_tokens += e.completion_tokens
        else:
            if usage:
                yield _sse({**head, "object": "chat.completion.chunk", "choices": [],
                            "usage": _usage(prompt_tokens, completion_tokens)})
    yield "data: [DONE]\n\n"


async def completion(state: ServerState, http: HttpRequest):
    arrived = time.perf_counter()
    body = await parse_body(http, CompletionBody)
    name, usage, n = model_of(state, body), include_usage(body), choices_of(body)
    best_of, logprobs = best_of_of(body, n), logprobs_of(body)
    if body.echo and logprobs is not None:
        raise BadRequest("echo with logprobs is not supported by this server (it would need the prompt's "
                         "log-probs): echo or logprobs, not both", "echo")
    request = engine_request(state, completion_prompt(state, body), body.max_tokens,
                             sampling_of(body, state.vocab_size), "prompt", default_max=16)  # OpenAI's default
    echo = echo_text(state, body, request.prompt_ids) if body.echo else ""
    stops = stops_of(body)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
    prompt_tokens = len(request.prompt_ids)
    shapes = None if logprobs is None else [LogprobShapes(state.tokenizer, chat=False) for _ in range(n)]
    ask = (lambda: TextPipeline(state.tokenizer, stops, chat=False), arrived, logprobs)
    if body.stream:
        generations, events = await choice_events(state, request, n, ask[0], None, *ask[1:])
        stream = _completion_stream(head, events, prompt_tokens, usage, shapes, n, echo)
        return EventStream(_guarded(stream, "a completion stream"), generations)
    # best_of > n: every generation reports its tokens' log-probs, to rank them
    ask = (*ask[:2], logprobs if best_of == n or logprobs is not None else 0)
    _, events = await choice_events(state, request, best_of, ask[0], http, *ask[1:])
    texts, entries, finishes = [[] for _ in range(best_of)], [[] for _ in range(best_of)], {}
    async with aclosing(events):
        async for i, e in events:
            if isinstance(e, Failed):
                return e.response()
            if isinstance(e, Finish):
                finishes[i] = e
            elif isinstance(e, TokenLogprob):
                entries[i].append(e)
            else:
                texts[i].append(e.text)
    if len(finishes) < best_of:
        return PlainTextResponse("", status_code=499)
    best = sorted(range(best_of), key=lambda i: -sum(e.logprob for e in entries[i]))[:n] if best_of > n else \
        range(n)  # (a stable sort: ties in generation order)
    choices = []
    for k, i in enumerate(best):
        choice = {"index": k, "text": echo + "".join(texts[i]), "finish_reason": finishes[i].reason,
                  "logprobs": None if shapes is None else shapes[k].block(entries[i])}
        if body.return_token_ids:  # as vLLM: the ids, for exact comparisons
            choice["token_ids"] = list(finishes[i].token_ids)
        choices.append(choice)
    return JSONResponse({**head, "object": "text_completion", "choices": choices,
                         "usage": _usage(prompt_tokens, sum(f.completion_tokens for f in finishes.values()))})


async def _completion_stream(head: dict, events, prompt_tokens: int, usage: bool = True,
                             shapes: list[LogprobShapes] | None = None, n: int = 1, echo: str = ""):
    """The completion stream's chunks (``echo``: the prompt's text first, a chunk per choice)."""
    pending: list[list[TokenLogprob]] = [[] for _ in range(n)]
    completion_tokens = 0

    def chunk(i: int, text: str, finish=None) -> str:
        logprobs = None if shapes is None or not pending[i] else shapes[i].block(pending[i])
        pending[i].clear()
        return _sse({**head, "object": "text_completion",
                     "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}]})

    for i in range(n if echo else 0):
        yield chunk(i, echo)
    async with aclosing(events):
        async for i, e in events:
            if isinstance(e, Failed):
                yield e.event()
                break
            if isinstance(e, TokenLogprob):
                pending[i].append(e)
            elif isinstance(e, Finish):
                if pending[i]:
                    yield chunk(i, "")
                yield chunk(i, "", e.reason)
                completion_tokens += e.completion_tokens
            else:
                yield chunk(i, e.text)
        else:
            if usage:
                yield _sse({**head, "object": "text_completion", "choices": [],
                            "usage": _usage(prompt_tokens, completion_tokens)})
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------------- tokenizer
async def tokenize(state: ServerState, http: HttpRequest):
    """vLLM's ``POST /tokenize``: a completion's ``prompt`` (with its BOS unless ``add_special_tokens`` is false),
    or with ``messages`` (and ``tools``, ``thinking``, ``reasoning_effort``) the chat prompt the server would
    run (image parts expanded into their spans), as the model's ids -> ``{"count", "max_model_len", "tokens",
    "token_strs"}`` (``return_token_strs``: each id's text, invalid UTF-8 as U+FFFD)."""
    data = read_json_object(await http.body())
    if "messages" in data:
        chat = validated(data, TokenizeChatBody)
        model_of(state, chat)
        prompt = chat_prompt(state, chat, thinking_of(chat))
        images = await read_images(state, prompt)
        ids = prompt.ids if images is None else images.ids
        strs = chat.return_token_strs
    else:
        body = validated(data, TokenizeBody)
        model_of(state, body)
        text_ids = state.tokenizer.encode(body.prompt, add_bos=body.add_special_tokens is not False)
        ids = tuple(fold_ids(text_ids, state.tokenizer.vocab_size, state.vocab_size)[0])
        strs = body.return_token_strs
    token_strs = [state.tokenizer.token_bytes(int(i), False).decode("utf-8", errors="replace") for i in ids]
    return {"count": len(ids), "max_model_len": state.max_context, "tokens": list(ids),
            "token_strs": token_strs if strs else None}


async def detokenize(state: ServerState, http: HttpRequest):
    """vLLM's ``POST /detokenize``: ``tokens`` (the model's ids) -> ``{"prompt": their text}`` (special tokens
    written out)."""
    body = await parse_body(http, DetokenizeBody)
    model_of(state, body)
    for k, i in enumerate(body.tokens):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < state.vocab_size:
            raise BadRequest(f"tokens[{k}] must be a token id in 0..{state.vocab_size - 1}, got {shown(i)}",
                             f"tokens[{k}]")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special=False)}


# ------------------------------------------------------------------------------------------------- the app
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key (probes and scrapers)


class ApiKeyGuard:
    """ASGI middleware: with an API key set, a request to any path but `OPEN_PATHS` without the header
    ``Authorization: Bearer KEY`` is a 401 with OpenAI's error body (code ``invalid_api_key``)."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, None if key is None else key.encode()

    async def __call__(self, scope, receive, send):
        if self.key is not None and scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                said = "no API key was given" if not given else "the API key given is not this server's"
                response = error_response(401, f"{said}: send the header 'Authorization: Bearer <key>' with the "
                                               f"key the server was started with (--api-key)",
                                          code="invalid_api_key")
                response.headers["www-authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="dsv41-jax", docs_url=None, redoc_url=None, openapi_url=None)
    state.created = state.created or int(time.time())
    app.add_middleware(ApiKeyGuard, key=state.api_key)
    app.add_middleware(ErrorGuard, metrics=state.metrics)  # outermost: counts every response (401s too); an
    # exception: one 500

    def route(handler):
        async def run(http: HttpRequest):
            try:
                if state.worker.draining:
                    raise ShuttingDown("the server is shutting down: it takes no new requests")
                return await handler(state, http)
            except BadRequest as e:
                return error_response(400, str(e), param=e.param)
            except ModelNotFound as e:
                return error_response(404, str(e), param="model", code="model_not_found")
            except ShuttingDown as e:
                return error_response(503, str(e), "server_error", code="shutting_down")
            except QueueFull as e:
                return error_response(503, str(e), "server_overloaded", code="queue_full")
            except ClientDisconnect:  # gone while its body was read
                return PlainTextResponse("", status_code=499)
        return run

    app.post("/v1/chat/completions")(route(chat_completion))
    app.post("/v1/completions")(route(completion))
    app.post("/tokenize")(route(tokenize))
    app.post("/detokenize")(route(detokenize))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                            "owned_by": "dsv41-jax", "max_model_len": state.max_context}
                                           for name in state.model_names]}

    @app.get("/health")
    async def health():
        if not state.worker.alive:
            return error_response(503, "the engine thread has stopped", "server_error")
        if state.worker.draining:
            return JSONResponse({"status": "draining", "running": state.worker.slots.active,
                                 "queued": state.worker.queued}, status_code=503)
        return {"status": "ok", "running": state.worker.slots.active, "queued": state.worker.queued}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    return app
