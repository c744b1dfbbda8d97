"""The HTTP side: FastAPI routes of the OpenAI API over the engine thread (`worker.Worker`).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (server-sent events with ``"stream": true``),
``GET /v1/models``, vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /health``, ``GET /metrics``
(Prometheus text).

A request body is parsed here (not by FastAPI's validation, whose errors are 422s of another shape): malformed
JSON or values JSON cannot carry (`errors.read_json_object`), a field of the wrong type, a value out of range, a
message or tool of the wrong shape, a prompt that does not fit the context → 400 with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field (``messages[0].content``); a full
queue → 503 at once. Every response is counted in ``/metrics`` and an internal error is one logged 500
(`errors.ErrorGuard`); a stream that fails after its first chunk ends with an error event and ``[DONE]``.

Generated ids become text through the tokenizer's stream decoder, then ``stop`` strings are cut (text that may
begin one is held back), and for chat the V4.1 reply parser (`chat.ReplyStream`) splits reasoning, answer and
tool calls. Streaming and non-streaming responses run the same pipeline, so their text is the same for the same
tokens.

No request field is silently ignored (`check_fields`): a field is implemented, or accepted only at the value that
means "off" (``presence_penalty: 0``, ...: what clients send by default) and otherwise a 400 saying it is not
supported by this server, or, unknown, a 400 naming it. Besides OpenAI's fields (``logprobs`` /
``top_logprobs``, ``logit_bias`` and the presence and frequency penalties included, computed in the device step:
`sampling`): vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids`` and ``return_token_ids`` (completions: the generated
ids in the choice, ``token_ids``), DeepSeek's ``thinking`` and ``reasoning_effort`` (chat); ``n`` choices are n
generations (`choice_events`), merged into one response or stream by choice index; completions' ``echo`` and
chat's ``parallel_tool_calls: false`` (`TextPipeline`'s ``one_call``) are the host's. A ``model`` the server
does not serve is a 404 ``model_not_found``. While the server drains (shutting down) a new request is a 503 and
``/health`` says ``draining``. With an API key (`ApiKeyGuard`) every route but ``/health`` and ``/metrics`` needs
it as a Bearer token (else a 401).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import types
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Union, get_args, get_origin

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..chat import (
    ROLES,
    ChatFormatError,
    ContentDelta,
    ReasoningDelta,
    ReplyStream,
    ToolCallEvent,
    UnparsedDelta,
    chat_ids,
    effort_budget,
    message_from_openai,
)
from ..engine import EngineInputError, Request
from ..sampling import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, TOP_LOGPROBS, SamplingParams
from ..tokenizer import fold_ids
from .errors import BadRequest, ErrorGuard, error_body, error_response, log_internal_error, read_json_object, shown
from .metrics import Metrics
from .worker import QueueFull, ShuttingDown, Worker

MAX_STOPS = 4  # as OpenAI
MAX_CHOICES = 128  # n, as OpenAI


# ------------------------------------------------------------------------------------------------- bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # every field is checked first (`check_fields`)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: dict | None = None
    top_k: int | None = None  # as vLLM
    user: str | None = None  # an end-user id (OpenAI's abuse monitoring): it changes nothing here
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's, as the four below
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list | None = None


class ChatBody(_Body):
    messages: list
    max_completion_tokens: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    thinking: bool | dict | None = None
    reasoning_effort: str | int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None  # false: the reply ends with its first tool call


class CompletionBody(_Body):
    prompt: str | list
    return_token_ids: bool | None = None  # as vLLM
    logprobs: int | None = None  # the top log-probs reported with each token's (0: its own only)
    echo: bool | None = None  # the prompt's text before the completion's


# Fields not implemented, accepted only at the values that mean "off" (what OpenAI clients and SDKs send).
_OFF_BOTH = {"best_of": (None, 1)}  # vLLM's
OFF_VALUES = {
    ChatBody: {**_OFF_BOTH, "response_format":
               (None, {"type": "text"}), "modalities": (None, ["text"]),
               "store": (None, False), "metadata": (None,), "service_tier": (None, "auto", "default"),
               "audio": (None,), "prediction": (None,), "web_search_options": (None,), "functions": (None,),
               "function_call": (None,), "verbosity": (None,), "prompt_cache_key": (None,),
               "safety_identifier": (None,)},
    CompletionBody: {**_OFF_BOTH, "suffix": (None,)},
}
class TokenizeBody(BaseModel):
    """vLLM's ``/tokenize`` of a prompt (completions) or, with ``messages``, of a chat (`TokenizeChatBody`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None  # default true: the BOS, as a completion's prompt has it
    return_token_strs: bool | None = None


class TokenizeChatBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    messages: list
    tools: list | None = None
    tool_choice: str | dict | None = None
    thinking: bool | dict | None = None
    reasoning_effort: str | int | None = None
    return_token_strs: bool | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list


OFF_VALUES[TokenizeBody] = {}
OFF_VALUES[TokenizeChatBody] = {"add_generation_prompt": (None, True),  # the chat prompt always ends with it
                                "add_special_tokens": (None, False)}  # the format writes its own BOS
OFF_VALUES[DetokenizeBody] = {}
API_NAMES = {ChatBody: "chat completions", CompletionBody: "completions", TokenizeBody: "tokenize",
             TokenizeChatBody: "tokenize (chat)", DetokenizeBody: "detokenize"}


def _is_off(value: Any, off: tuple) -> bool:
    """``value`` equals one of ``off``, a bool only a bool (``0 == False`` in Python)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) and (value is None) == (v is None)
               for v in off)


def _off_words(off: tuple) -> str:
    return " or ".join("null" if v is None else shown(v) for v in off)


def check_fields(data: dict, model: type[BaseModel]) -> None:
    """400 for a field this server does not read: not implemented (at a value other than "off") or unknown."""
    off_values = OFF_VALUES[model]
    for field, value in data.items():
        if field in model.model_fields:
            continue
        if field in off_values:
            off = off_values[field]
            if not _is_off(value, off):
                raise BadRequest(f"{field} is not supported by this server (accepted only as {_off_words(off)}), "
                                 f"got {shown(value)}", field)
            continue
        raise BadRequest(f"{field} is not a field of the {API_NAMES[model]} API this server serves (unknown "
                         f"fields are refused, not ignored)", field)


async def parse_body(http: HttpRequest, model: type[BaseModel]) -> Any:
    return validated(read_json_object(await http.body()), model)


def validated(data: dict, model: type[BaseModel]) -> Any:
    """``data`` as a ``model`` body: 400 for a field not read (`check_fields`) or of the wrong type."""
    check_fields(data, model)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]  # its loc: the field, then (for a union) the member type tried
        field = str(err["loc"][0]) if err["loc"] else None
        if field not in model.model_fields:
            raise BadRequest(err["msg"], field) from None
        if err["type"] == "missing":
            raise BadRequest(f"{field} is required", field) from None
        raise BadRequest(f"{field} must be {_described(model.model_fields[field].annotation)}, got "
                         f"{shown(data[field])}", field) from None


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
               list: "an array"}


def _described(annotation) -> str:
    """A body field's type in words: ``str | list[str] | None`` → "a string or an array of strings"."""
    union = get_origin(annotation) in (Union, types.UnionType)
    members = [m for m in get_args(annotation) if m is not type(None)] if union else [annotation]
    return " or ".join(f"an array of {_described(get_args(m)[0]).split(' ', 1)[1]}s" if get_origin(m) is list
                       else _TYPE_NAMES[m] for m in members)


# ------------------------------------------------------------------------------------------------- settings
@dataclass
class ServerState:
    """What the routes share: the engine thread, the tokenizer, metrics and the model's limits."""

    worker: Worker
    tokenizer: Any
    metrics: Metrics
    model_names: tuple[str, ...]  # the names served (`--served-model-name`); a request without one gets the first
    vocab_size: int
    max_context: int
    created: int = 0
    api_key: str | None = None  # `--api-key`: every route but /health and /metrics needs it as a Bearer token

    @property
    def model_name(self) -> str:
        return self.model_names[0]


class ModelNotFound(LookupError):
    """A ``model`` this server does not serve (a 404 ``model_not_found``, as OpenAI)."""


def model_of(state: ServerState, body: _Body) -> str:
    """The served name the request asks for (none given: the first one)."""
    if body.model is None:
        return state.model_name
    if body.model not in state.model_names:
        raise ModelNotFound(f"The model `{body.model}` does not exist: this server serves "
                            f"{', '.join(state.model_names)}")
    return body.model


def include_usage(body: _Body) -> bool:
    """``stream_options``: only with ``"stream": true``; ``include_usage`` (default true here: a stream ends
    with a usage chunk unless it is false)."""
    options = body.stream_options
    if options is None:
        return True
    if not body.stream:
        raise BadRequest('stream_options is only allowed with "stream": true', "stream_options")
    for key, value in options.items():
        if key == "include_usage":
            if value is not None and not isinstance(value, bool):
                raise BadRequest(f"stream_options.include_usage must be true or false, got {shown(value)}",
                                 "stream_options.include_usage")
        elif key == "include_obfuscation":
            if value is not None and value is not False:
                raise BadRequest("stream_options.include_obfuscation is not supported by this server (accepted "
                                 "only as false or null)", "stream_options.include_obfuscation")
        else:
            raise BadRequest(f"stream_options.{key} is not an option this server knows",
                             f"stream_options.{key}")
    return options.get("include_usage") is not False


def sampling_of(body: _Body, vocab_size: int) -> SamplingParams:
    """temperature 0..2 (0 greedy; default 1, as OpenAI), top_p (0, 1], top_k (as vLLM: -1 or 0 off, else the k
    most likely ids), seed 0..2^32-1 (default: random); presence_penalty and frequency_penalty [-2, 2];
    vLLM's repetition_penalty (0, 100], min_p [0, 1], min_tokens, ignore_eos; logit_bias (`logit_bias_of`);
    stop_token_ids (`stop_token_ids_of`: min_tokens holds them back with the end ids)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if body.seed is not None and not 0 <= body.seed < 2**32:
        raise BadRequest(f"seed must be in 0 .. 2^32 - 1, got {shown(body.seed)}", "seed")
    top_k = 0 if body.top_k is None else body.top_k
    if top_k < -1:
        raise BadRequest(f"top_k must be -1 or 0 (off) or a positive number of ids, got {top_k}", "top_k")
    seed = secrets.randbelow(2**32) if body.seed is None else body.seed
    min_p = 0.0 if body.min_p is None else body.min_p
    if not 0 <= min_p <= 1:
        raise BadRequest(f"min_p must be in [0, 1], got {min_p}", "min_p")
    min_tokens = 0 if body.min_tokens is None else body.min_tokens
    if min_tokens < 0:
        raise BadRequest(f"min_tokens must be >= 0, got {min_tokens}", "min_tokens")
    penalties = {}
    for field in ("presence_penalty", "frequency_penalty"):  # OpenAI's range
        value = getattr(body, field) or 0.0
        if not -2 <= value <= 2:
            raise BadRequest(f"{field} must be in [-2, 2], got {value}", field)
        penalties[field] = float(value)
    repetition = 1.0 if body.repetition_penalty is None else body.repetition_penalty
    if not 0 < repetition <= 100:
        raise BadRequest(f"repetition_penalty must be in (0, 100] (1: off), got {repetition}", "repetition_penalty")
    return SamplingParams(temperature=temperature, top_k=max(0, top_k), top_p=top_p, seed=seed, min_p=min_p,
                          logit_bias=logit_bias_of(body, vocab_size), min_tokens=min_tokens,
                          held_ids=stop_token_ids_of(body, vocab_size), ignore_eos=bool(body.ignore_eos),
                          repetition_penalty=float(repetition), **penalties)


def logit_bias_of(body: _Body, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: ``{"<token id>": bias in [-100, 100]}`` (at most MAX_LOGIT_BIAS ids), added to
    the logits before sampling (greedy too)."""
    bias = body.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size or str(token) != key.strip():
            raise BadRequest(f"logit_bias keys must be token ids in 0..{vocab_size - 1} (as strings), got "
                             f"{shown(key)}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequest(f"logit_bias[{shown(key)}] must be a number in [-100, 100], got {shown(value)}",
                             "logit_bias")
        out[token] = out.get(token, 0.0) + float(value)
    return tuple(sorted(out.items()))


def stop_token_ids_of(body: _Body, vocab_size: int) -> tuple[int, ...]:
    ids = body.stop_token_ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}", "stop_token_ids")
    for k, i in enumerate(ids):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise BadRequest(f"stop_token_ids[{k}] must be a token id in 0..{vocab_size - 1}, got {shown(i)}",
                             f"stop_token_ids[{k}]")
    return tuple(dict.fromkeys(ids))


def choices_of(body: _Body) -> int:
    """``n``: the choices to generate, 1..MAX_CHOICES (each its own slot; sampled ones each from its own seed)."""
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be in 1..{MAX_CHOICES}, got {shown(body.n)}", "n")
    return n


def logprobs_of(body: _Body) -> int | None:
    """How many top log-probs each token reports with its own (0: its own only), or None: no log-probs. Chat:
    ``logprobs: true`` and ``top_logprobs`` 0..TOP_LOGPROBS; completions: ``logprobs`` 0..TOP_LOGPROBS."""
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest('top_logprobs needs "logprobs": true', "top_logprobs")
        if not body.logprobs:
            return None
        count, field = (0 if body.top_logprobs is None else body.top_logprobs), "top_logprobs"
    else:
        if body.logprobs is None:
            return None
        count, field = body.logprobs, "logprobs"
    if not 0 <= count <= TOP_LOGPROBS:
        raise BadRequest(f"{field} must be in 0..{TOP_LOGPROBS}, got {count}", field)
    return count


def stops_of(body: _Body) -> tuple[str, ...]:
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return tuple(s for s in stops if s)


def engine_request(state: ServerState, ids: tuple[int, ...], max_tokens: int | None, sampling,
                   prompt_field: str, default_max: int | None = None, max_field: str = "max_tokens") -> Request:
    """The engine request; 400 for a prompt or max_tokens that does not fit. Without max_tokens:
    ``default_max`` (None: the rest of the context), cut to what fits. ``prompt_field``, ``max_field``: the body
    fields the prompt and max_tokens came from (the errors' param)."""
    if not ids:
        raise BadRequest("the prompt is empty", prompt_field)
    room = state.max_context - len(ids) + 1
    if len(ids) > state.max_context:
        raise BadRequest(f"the prompt has {len(ids)} tokens, longer than the context of {state.max_context} "
                         f"tokens", prompt_field)
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    if not 1 <= max_tokens <= room:
        raise BadRequest(f"{max_field} must be in 1 .. {room} (the context of {state.max_context} tokens minus the "
                         f"{len(ids)}-token prompt, plus one), got {shown(max_tokens)}", max_field)
    if sampling.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({sampling.min_tokens}) must be at most {max_field} ({max_tokens})",
                         "min_tokens")
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
    check_messages(body.messages)
    try:
        messages = tuple(message_from_openai(m, f"messages[{i}]") for i, m in enumerate(body.messages))
    except ChatFormatError as e:
        raise BadRequest(str(e), "messages") from None
    tools = tuple(body.tools or ())
    check_tools(tools)
    if body.tool_choice in ("required",) or isinstance(body.tool_choice, dict):
        raise BadRequest(f'tool_choice {shown(body.tool_choice)} is not supported by this server (the reply is not '
                         f'constrained to call a tool): "auto" or "none"', "tool_choice")
    if body.tool_choice not in (None, "auto", "none"):
        raise BadRequest(f'tool_choice must be "auto" or "none", got {shown(body.tool_choice)}', "tool_choice")
    try:
        effort_budget(body.reasoning_effort)
    except ChatFormatError as e:
        raise BadRequest(str(e), "reasoning_effort") from None
    if body.tool_choice == "none":
        tools = ()
    try:
        ids = chat_ids(state.tokenizer, messages, thinking=thinking, reasoning_effort=body.reasoning_effort,
                       tools=tools)
    except ChatFormatError as e:
        raise BadRequest(str(e), "messages") from None
    return tuple(fold_ids(ids, state.tokenizer.vocab_size, state.vocab_size)[0])


def check_messages(messages: list) -> None:
    """Each message's shape, the field named (`chat.message_from_openai` reads them): a role, content (a string
    or text parts; may be null or absent only for an assistant), string reasoning_content and tool_call_id, tool
    calls with a function name."""
    if not messages:
        raise BadRequest("messages must not be empty", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with a role and content, got {shown(m)}", where)
        if m.get("role") not in ROLES:
            got = f"got {shown(m['role'])}" if "role" in m else "none given"
            raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)} ({got})", f"{where}.role")
        check_content(m.get("content"), f"{where}.content", m["role"], "content" in m)
        for field in ("reasoning_content", "tool_call_id"):
            if m.get(field) is not None and not isinstance(m[field], str):
                raise BadRequest(f"{where}.{field} must be a string, got {shown(m[field])}", f"{where}.{field}")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise BadRequest(f"{where}.tool_calls must be an array, got {shown(calls)}", f"{where}.tool_calls")
        for k, call in enumerate(calls or ()):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise BadRequest(f"{where}.tool_calls[{k}] must be {{\"type\": \"function\", \"function\": "
                                 f"{{\"name\": ..., \"arguments\": ...}}}}, got {shown(call)}",
                                 f"{where}.tool_calls[{k}]")
            if not isinstance(fn.get("arguments", ""), (str, dict)):
                raise BadRequest(f"{where}.tool_calls[{k}].function.arguments must be a string (a JSON object's "
                                 f"text), got {shown(fn['arguments'])}", f"{where}.tool_calls[{k}].function.arguments")


def check_content(content: Any, where: str, role: str, given: bool) -> None:
    if content is None:
        if role == "assistant":
            return
        raise BadRequest(f"{where} of a {role} message must be a string or an array of text parts "
                         f"({'got null' if given else 'none given'})", where)
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of text parts, got {shown(content)}", where)
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise BadRequest(f'{where}[{j}] must be a part {{"type": "text", "text": ...}}, got {shown(part)}',
                             f"{where}[{j}]")
        if part.get("type") != "text":
            raise BadRequest(f'{where}[{j}].type must be "text" (this server reads text parts only), got '
                             f'{shown(part.get("type"))}', f"{where}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}[{j}].text must be a string, got {shown(part.get('text'))}", f"{where}[{j}].text")


def check_tools(tools: tuple) -> None:
    """Each tool is ``{"type": "function", "function": {"name", "description"?, "parameters"?}}`` with a name,
    a string description and an object of parameters (they are written into the prompt)."""
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}, got '
                             f'{shown(tool)}', where)
        if tool.get("type", "function") != "function":
            raise BadRequest(f'{where}.type must be "function", got {shown(tool["type"])}', f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"{where}.function must be an object with a name, got {shown(fn)}", f"{where}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"{where}.function.name must be a non-empty string, got {shown(fn.get('name'))}",
                             f"{where}.function.name")
        for field, kind, name in (("description", str, "a string"), ("parameters", dict, "an object")):
            if fn.get(field) is not None and not isinstance(fn[field], kind):
                raise BadRequest(f"{where}.function.{field} must be {name}, got {shown(fn[field])}",
                                 f"{where}.function.{field}")


def echo_text(state: ServerState, body: CompletionBody, ids: tuple[int, ...]) -> str:
    """``echo``: the prompt as given when it is text, else its ids' text (as a reply's is decoded)."""
    prompt = body.prompt[0] if isinstance(body.prompt, list) and len(body.prompt) == 1 else body.prompt
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(ids, skip_special=True)


def completion_prompt(state: ServerState, body: CompletionBody) -> tuple[int, ...]:
    """A string (BOS + its ids, folded as `generate` does), a list of token ids, or a list of one string."""
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tuple(fold_ids(state.tokenizer.encode(prompt, add_bos=True), state.tokenizer.vocab_size,
                              state.vocab_size)[0])
    if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"prompt holds {len(prompt)} prompts: one prompt per request is supported", "prompt")
    for k, i in enumerate(prompt):
        if not isinstance(i, int) or isinstance(i, bool):
            raise BadRequest(f"prompt[{k}] must be a token id (prompt is a string, an array of token ids or an "
                             f"array of one string), got {shown(i)}", f"prompt[{k}]")
    bad = [i for i in prompt if not 0 <= i < state.vocab_size]
    if bad:
        raise BadRequest(f"prompt has token ids outside the model's vocabulary 0..{state.vocab_size - 1}: "
                         f"{shown(bad[0])}", "prompt")
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
                            http: HttpRequest | None, arrived: float, logprobs: int | None = None
                            ) -> tuple[Generation, AsyncIterator]:
    """Submit ``request`` (QueueFull raised at once): its `Generation`, and its reply events (with
    ``logprobs``, a `TokenLogprob` before each token's) then one `Finish` (or `Failed`). The request's
    ``stop_token_ids`` (its sampling's ``held_ids``) end it as an end id does. The request is cancelled when the
    events are closed early (client gone), or by `Generation.close` when they never started (a stream whose
    client left before its first chunk: an async generator never started runs no ``finally``). ``http``: polled
    for a disconnect (non-streaming)."""
    worker, metrics = state.worker, state.metrics
    job_id, events = worker.submit(request, asyncio.get_running_loop(), logprobs=logprobs,
                                   stop_ids=request.sampling.held_ids)
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
                        arrived: float, logprobs: int | None) -> tuple[list[Generation], AsyncIterator]:
    """Submit ``n`` generations of ``request`` (choice i with seed + i; a greedy one n times the same) and merge
    their events as (choice index, event). ``pipeline()`` makes each choice's `TextPipeline`. QueueFull when
    they do not all fit (those submitted are cancelled)."""
    generations, streams = [], []
    try:
        for i in range(n):
            sampling = replace(request.sampling, seed=(request.sampling.seed + i) % 2**32)
            generation, events = await generation_events(state, replace(request, sampling=sampling), pipeline(),
                                                         http, arrived, logprobs)
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


async def chat_completion(state: ServerState, http: HttpRequest):
    arrived = time.perf_counter()
    body = await parse_body(http, ChatBody)
    name, usage, n = model_of(state, body), include_usage(body), choices_of(body)
    thinking = thinking_of(body)
    logprobs = logprobs_of(body)
    max_field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    request = engine_request(state, chat_prompt(state, body, thinking), getattr(body, max_field),
                             sampling_of(body, state.vocab_size), "messages", max_field=max_field)
    stops = stops_of(body)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
    prompt_tokens = len(request.prompt_ids)
    shapes = None if logprobs is None else [LogprobShapes(state.tokenizer, chat=True) for _ in range(n)]
    one_call = body.parallel_tool_calls is False
    ask = (lambda: TextPipeline(state.tokenizer, stops, chat=True, thinking=thinking, one_call=one_call), arrived,
           logprobs)
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
    logprobs = logprobs_of(body)
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
    _, events = await choice_events(state, request, n, ask[0], http, *ask[1:])
    texts, entries, finishes = [[] for _ in range(n)], [[] for _ in range(n)], {}
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
    if len(finishes) < n:
        return PlainTextResponse("", status_code=499)
    choices = []
    for i in range(n):
        choice = {"index": i, "text": echo + "".join(texts[i]), "finish_reason": finishes[i].reason,
                  "logprobs": None if shapes is None else shapes[i].block(entries[i])}
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
    run, as the model's ids -> ``{"count", "max_model_len", "tokens", "token_strs"}`` (``return_token_strs``:
    each id's text, invalid UTF-8 as U+FFFD)."""
    data = read_json_object(await http.body())
    if "messages" in data:
        chat = validated(data, TokenizeChatBody)
        model_of(state, chat)
        ids = chat_prompt(state, chat, thinking_of(chat))
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
