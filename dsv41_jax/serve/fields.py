"""The request side of the HTTP routes: each body read strictly, field by field, into an engine request.

A request body is parsed here (not by FastAPI's validation, whose errors are 422s of another shape): malformed
JSON or values JSON cannot carry (`errors.read_json_object`), a field of the wrong type, a value out of range, a
message or tool of the wrong shape, a prompt that does not fit the context → `BadRequest` (a 400 with OpenAI's
error body, ``param`` naming the field: ``messages[0].content``).

No request field is silently ignored (`check_fields`): a field is implemented, or accepted only at the value that
means "off" (what clients send by default) and otherwise a 400 saying it is not supported by this server, or,
unknown, a 400 naming it. Besides OpenAI's fields (``logprobs`` / ``top_logprobs``, ``logit_bias`` and the
presence and frequency penalties included, computed in the device step: `sampling`): vLLM's ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids`` and ``return_token_ids``
(completions: the generated ids in the choice, ``token_ids``), DeepSeek's ``thinking`` and ``reasoning_effort``
(chat). A ``model`` the server does not serve is a 404 ``model_not_found`` (`ModelNotFound`).

Images (`media`): a user message's content may hold ``image_url`` parts among its text parts; each is one image
placeholder in the chat text where it stands (parts joined by a blank line, as text parts are), the text ids then
laid out as ``generate --image`` lays them (`image_prompt_ids`), and the decoded images expanded into their
spans (`image_prompt`: ``vision.preprocess``, the same preprocessing as generate's), counted against the
context.
"""

from __future__ import annotations

import secrets
import types
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, ValidationError

from .. import distributed
from ..chat import ROLES, ChatFormatError, chat_ids, effort_budget, encode_messages, message_from_openai
from ..engine import EngineInputError, Request
from ..sampling import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, TOP_LOGPROBS, SamplingParams
from ..structured import GrammarError, grammar_for, tool_grammar
from ..tokenizer import IMAGE_PLACEHOLDER, fold_ids, image_text_ids
from ..vision.preprocess import ImagePrompt, expand_prompt, plan_image, prepare_image
from .errors import BadRequest, read_json_object, shown
from .media import ImagePart, MediaPolicy, check_image_part, read_image
from .metrics import Metrics
from .worker import Worker

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
    response_format: dict | None = None  # text, json_object or json_schema: the reply constrained (`structured`)


class CompletionBody(_Body):
    prompt: str | list
    return_token_ids: bool | None = None  # as vLLM
    logprobs: int | None = None  # the top log-probs reported with each token's (0: its own only)
    echo: bool | None = None  # the prompt's text before the completion's
    best_of: int | None = None  # generate this many, return the n of the highest log-probability


# Fields not implemented, accepted only at the values that mean "off" (what OpenAI clients and SDKs send).
OFF_VALUES = {
    ChatBody: {"best_of": (None, 1), "modalities": (None, ["text"]),
               "store": (None, False), "metadata": (None,), "service_tier": (None, "auto", "default"),
               "audio": (None,), "prediction": (None,), "web_search_options": (None,), "functions": (None,),
               "function_call": (None,), "verbosity": (None,), "prompt_cache_key": (None,),
               "safety_identifier": (None,)},
    CompletionBody: {"suffix": (None,)},
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
    structured: Any = None  # structured.StructuredVocab: the grammars' token tables (None: no structured output)
    structured_off: str = ""  # why there is none (said in the 400)
    media: MediaPolicy = MediaPolicy()  # where image URLs may come from (`--allowed-local-media-path`)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def vision(self):
        """The model's `config.VisionConfig` when it runs the image path (its tower loaded), else None."""
        engine = self.worker.slots.engine
        return engine.cfg.vision if engine.runtime.has_vision else None

    @property
    def image_token_id(self) -> int:
        return self.worker.slots.engine.cfg.image_token_id


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


def best_of_of(body: CompletionBody, n: int) -> int:
    """Completions' ``best_of``: n..MAX_CHOICES generations (default n), of which the n whose tokens have the
    highest total log-probability are returned; not with ``stream``."""
    best_of = n if body.best_of is None else body.best_of
    if not n <= best_of <= MAX_CHOICES:
        raise BadRequest(f"best_of must be in n ({n}) .. {MAX_CHOICES}, got {shown(body.best_of)}", "best_of")
    if best_of > n and body.stream:
        raise BadRequest("best_of above n cannot be streamed (the best are known at the end)", "best_of")
    return best_of


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
                   prompt_field: str, default_max: int | None = None, max_field: str = "max_tokens",
                   images: ImagePrompt | None = None) -> Request:
    """The engine request; 400 for a prompt or max_tokens that does not fit. Without max_tokens:
    ``default_max`` (None: the rest of the context), cut to what fits. ``prompt_field``, ``max_field``: the body
    fields the prompt and max_tokens came from (the errors' param). ``images``: the prompt's image spans
    (`image_prompt`; then ``ids`` are its expanded ids, image positions counted in the context)."""
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
    request = Request(tuple(ids), max_tokens, sampling, images=images)
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


@dataclass(frozen=True)
class ChatPrompt:
    """A chat's prompt before its images are read: ``ids`` with one image token id where each of ``images``
    goes (in order; none: a text prompt, its ids final)."""

    ids: tuple[int, ...]
    images: tuple[ImagePart, ...] = ()


def chat_prompt(state: ServerState, body: ChatBody, thinking: bool) -> ChatPrompt:
    """Prompt ids of the chat: DeepSeek-V4.1's format (`chat.encode_messages`), folded into a smaller model
    vocabulary as `generate` does (the tiny model); image parts as `generate --image` places images
    (`image_prompt_ids`). 400 for an image part when the model has no vision tower, or over several processes."""
    images = check_messages(body.messages)
    if images and state.vision is None:
        raise BadRequest(f"{images[0].field}: the model {state.model_name} reads no images (it runs no vision "
                         f"tower): send text parts only", images[0].field)
    if images and distributed.several():  # the followers take a request's ids, not its images (`lockstep`)
        raise BadRequest(f"{images[0].field}: image prompts are not served over several processes",
                         images[0].field)
    try:
        messages = tuple(message_from_openai(_placeholders(m), f"messages[{i}]") for i, m in enumerate(body.messages))
    except ChatFormatError as e:
        raise BadRequest(str(e), "messages") from None
    tools = tuple(body.tools or ())
    check_tools(tools)
    if not (body.tool_choice in (None, "auto", "none", "required") or isinstance(body.tool_choice, dict)):
        raise BadRequest(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": '
                         f'{{"name": ...}}}}, got {shown(body.tool_choice)}', "tool_choice")
    try:
        effort_budget(body.reasoning_effort)
    except ChatFormatError as e:
        raise BadRequest(str(e), "reasoning_effort") from None
    if body.tool_choice == "none":
        tools = ()
    options = dict(thinking=thinking, reasoning_effort=body.reasoning_effort, tools=tools)
    try:
        if images:
            text = encode_messages(messages, **options)
            ids = image_prompt_ids(state.tokenizer, text, len(images), state.image_token_id, state.vocab_size)
            return ChatPrompt(ids, tuple(images))
        ids = chat_ids(state.tokenizer, messages, **options)
    except ChatFormatError as e:
        raise BadRequest(str(e), "messages") from None
    return ChatPrompt(tuple(fold_ids(ids, state.tokenizer.vocab_size, state.vocab_size)[0]))


def _placeholders(message: Any) -> Any:
    """A message whose image parts are text parts holding the image placeholder (each image block, as the V4
    chat encoder writes it, joined to its neighbours by a blank line as text parts are)."""
    content = message.get("content")
    if not isinstance(content, list) or not any(p.get("type") == "image_url" for p in content):
        return message
    parts = [{"type": "text", "text": IMAGE_PLACEHOLDER} if p.get("type") == "image_url" else p for p in content]
    return {**message, "content": parts}


def image_prompt_ids(tokenizer, text: str, n_images: int, image_id: int, model_vocab: int) -> tuple[int, ...]:
    """Ids of a chat prompt ``text`` holding ``n_images`` image placeholders: each one ``image_id``, the text
    between them encoded piece by piece and folded into a smaller model vocabulary, a folded text id never
    landing on ``image_id`` (it steps one below): `generate`'s layout for ``--image``, id for id. ChatFormatError
    when the text holds other placeholders (a message's own text)."""
    found = text.count(IMAGE_PLACEHOLDER)
    if found != n_images:
        raise ChatFormatError(f"the messages' text holds the image placeholder {IMAGE_PLACEHOLDER} "
                              f"{found - n_images} time(s) besides the {n_images} image part(s): it "
                              f"marks where an image goes, so text may not hold it where images are sent")
    return tuple(image_text_ids(tokenizer, text, image_id, model_vocab)[0])


def image_prompt(state: ServerState, prompt: ChatPrompt) -> ImagePrompt:
    """``prompt``'s images read (`media.read_image`), planned and laid out in their spans as `generate` does
    (`vision.preprocess`): the expanded prompt. 400 naming the image part that is refused or unreadable, or
    with which the prompt (text and image spans, each ``Hl·(Wl+1)+2`` positions) passes the context. Slow for
    large images (decoding, resizing): run off the event loop."""
    vc, context = state.vision, state.max_context
    length = len(prompt.ids) - len(prompt.images)
    if length > context:
        raise BadRequest(f"the prompt's text has {length} tokens, longer than the context of {context} tokens",
                         "messages")
    prepared = []
    for k, part in enumerate(prompt.images):  # one decoded image at a time: each is resized before the next
        image = read_image(part, state.media)
        span = plan_image(image.width, image.height, vc).span_len
        length += span
        if length > context:
            raise BadRequest(f"{part.field}: with this image ({image.width}×{image.height} pixels: {span} "
                             f"positions) the prompt passes the context of {context} tokens ({length} positions: "
                             f"the text and {k + 1} image(s)); send fewer or smaller images", part.field)
        prepared.append(prepare_image(image, vc))
    return expand_prompt(prompt.ids, prepared, state.image_token_id)


def forced_tools(body: ChatBody) -> bool:
    """``tool_choice`` "required" or a named function: the reply must be tool calls (a grammar enforces it)."""
    return body.tool_choice == "required" or isinstance(body.tool_choice, dict)


def grammar_of(state: ServerState, body: ChatBody, sampling: SamplingParams, thinking: bool) -> str | None:
    """The grammar a chat reply is held to: the ``response_format``'s, or DSML tool calls for a forced
    ``tool_choice``; None for free text. 400 for what cannot be enforced (named in ``param``)."""
    text = body.response_format is None or body.response_format == {"type": "text"}
    if text and not forced_tools(body):
        return None
    param = "tool_choice" if text else "response_format"
    if not text and forced_tools(body):
        raise BadRequest("response_format and a forced tool_choice cannot both hold a reply: give one", param)
    if state.structured is None:
        raise BadRequest(f"{param} {shown(body.tool_choice if text else body.response_format)} cannot be enforced "
                         f"by this server: {state.structured_off}", param)
    if sampling.ignore_eos or sampling.min_tokens:
        raise BadRequest(f"{param} ends the reply where its grammar does: it does not go with ignore_eos or "
                         f"min_tokens", param)
    special = state.structured.special
    try:
        if text:
            return tool_grammar(body.tools or (), body.tool_choice, parallel=body.parallel_tool_calls is not False,
                                thinking=thinking, special=special)
        return grammar_for(body.response_format, thinking=thinking, special=special)
    except GrammarError as e:
        raise BadRequest(str(e), param) from None


def check_messages(messages: list) -> list[ImagePart]:
    """Each message's shape, the field named (`chat.message_from_openai` reads them): a role, content (a string
    or text parts, a user's also image parts; may be null or absent only for an assistant), string
    reasoning_content and tool_call_id, tool calls with a function name. Returns the image parts, in order."""
    if not messages:
        raise BadRequest("messages must not be empty", "messages")
    images = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with a role and content, got {shown(m)}", where)
        if m.get("role") not in ROLES:
            got = f"got {shown(m['role'])}" if "role" in m else "none given"
            raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)} ({got})", f"{where}.role")
        images += check_content(m.get("content"), f"{where}.content", m["role"], "content" in m)
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
    return images


def check_content(content: Any, where: str, role: str, given: bool) -> list[ImagePart]:
    """A message's content: a string, or text parts (a user's: text and ``image_url`` parts, `media`); its
    image parts, in order."""
    parts = "text and image_url parts" if role == "user" else "text parts"
    if content is None:
        if role == "assistant":
            return []
        raise BadRequest(f"{where} of a {role} message must be a string or an array of {parts} "
                         f"({'got null' if given else 'none given'})", where)
    if isinstance(content, str):
        return []
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of {parts}, got {shown(content)}", where)
    images = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise BadRequest(f'{where}[{j}] must be a part {{"type": "text", "text": ...}}, got {shown(part)}',
                             f"{where}[{j}]")
        if part.get("type") == "image_url" and role == "user":
            images.append(check_image_part(part, f"{where}[{j}]"))
            continue
        if part.get("type") != "text":
            kinds = '"text" or "image_url"' if role == "user" else '"text" (images go in user messages)'
            raise BadRequest(f'{where}[{j}].type must be {kinds}, got {shown(part.get("type"))}',
                             f"{where}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}[{j}].text must be a string, got {shown(part.get('text'))}", f"{where}[{j}].text")
    return images


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
