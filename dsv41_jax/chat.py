"""DeepSeek-V4.1 chat format: OpenAI-style messages → prompt text, and the model's reply text → reasoning,
answer and tool calls (whole, or streamed piece by piece).

The format is the one DeepSeek's own ``encoding/encoding.py`` of the V4.1 release produces (the release ships no
Jinja template); ``tests/fixtures/chat_encoding.json`` holds that encoder's output for a corpus of conversations and
``tests/test_chat.py`` checks this module against it string for string. A prompt reads::

    BOS [<｜System｜>[effort line]system text[\\n\\n tool schemas]]
        <｜User｜>user text<｜Assistant｜></think>answer EOS          (an earlier turn, reasoning dropped)
        <｜User｜><tool_result>r1</tool_result>\\n\\n<tool_result>r2</tool_result>
        <｜Assistant｜><think>                                     (thinking on; </think> when off)

* ``<｜System｜>`` opens a leading system message (even an empty one), and the whole prompt in thinking mode,
  where it is followed by ``Reasoning Effort: N (range 1-100, ...)\\n\\n``; ``low``/``high``/``max`` = 50/75/100,
  default ``high``. A later system message is ``<｜System｜>text`` and is answered like a user turn.
* Tool results (role ``tool``) and consecutive user messages merge into one user turn, parts joined by a blank
  line, tool results ordered as the preceding assistant's calls.
* An assistant turn is ``[reasoning</think>]answer[\\n\\n<｜DSML｜ calls>...</｜DSML｜ calls>]EOS``. Reasoning of
  turns before the last user turn is dropped, unless tools are given (then every turn keeps it).
* Tools (OpenAI function specs) are written into the leading system message; an empty one is added if the
  conversation has none (the official encoder takes tools on the system message).
* A tool call (DSML)::

      <｜DSML｜ invoke name="get_weather">
      <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
      <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
      </｜DSML｜ invoke>

  ``string="true"``: the raw string; ``string="false"``: a JSON value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Union

from .tokenizer import BOS, EOS, THINK_END, THINK_START

SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
DSML = "｜DSML｜"
CALLS_START = f"<{DSML} calls>"
CALLS_END = f"</{DSML} calls>"
INVOKE_START = f"<{DSML} invoke"
INVOKE_END = f"</{DSML} invoke>"
PARAM_START = f"<{DSML} parameter"
PARAM_END = f"</{DSML} parameter>"

ROLES = ("system", "user", "assistant", "tool")
REASONING_EFFORT_LEVELS = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"
ReasoningEffort = Union[str, int]

EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"{CALLS_START}" block like the following:

{CALLS_START}
{INVOKE_START} name="$TOOL_NAME">
{PARAM_START} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_END}
...
{INVOKE_END}
{INVOKE_START} name="$TOOL_NAME2">
...
{INVOKE_END}
{CALLS_END}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside \
{THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatFormatError(ValueError):
    """Messages, tools or a reasoning effort that cannot be encoded (one line, for the user)."""


# ----------------------------------------------------------------------------------------------- messages
@dataclass(frozen=True)
class ToolCall:
    """One function call: ``arguments`` is a JSON object's text, as OpenAI carries it; ``id`` may be ''."""

    name: str
    arguments: str = "{}"
    id: str = ""

    def to_openai(self) -> dict:
        out = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"id": self.id, **out} if self.id else out


@dataclass(frozen=True)
class Message:
    """One OpenAI-style chat message. role: system | user | assistant | tool.

    ``reasoning_content`` and ``tool_calls`` belong to assistant messages, ``tool_call_id`` to tool results.
    """

    role: str
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, null (''), or a list of text parts (joined by a blank line)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n\n".join(p["text"] for p in content)
    raise ChatFormatError(f"{where}: content must be a string or a list of {{\"type\": \"text\", \"text\": ...}} "
                          f"parts")


def tool_call_from_openai(obj: Any, where: str = "tool call") -> ToolCall:
    """``{"id", "type": "function", "function": {"name", "arguments"}}``; arguments as text or an object."""
    fn = obj.get("function") if isinstance(obj, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatFormatError(f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              f"\"arguments\": ...}}}}")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(fn["name"], args, str(obj.get("id") or ""))


def message_from_openai(obj: Any, where: str = "message") -> Message:
    """A Message from an OpenAI chat message dict (what a client sends); ChatFormatError if malformed."""
    if not isinstance(obj, dict) or obj.get("role") not in ROLES:
        raise ChatFormatError(f"{where}: expected an object with \"role\" one of {', '.join(ROLES)}")
    reasoning = obj.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatFormatError(f"{where}: reasoning_content must be a string")
    calls = obj.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}: tool_calls must be a list")
    return Message(obj["role"], _text_of(obj.get("content"), where), reasoning,
                   tuple(tool_call_from_openai(c, f"{where}, tool call {i + 1}") for i, c in enumerate(calls)),
                   None if obj.get("tool_call_id") is None else str(obj["tool_call_id"]))


def message_to_openai(m: Message) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        out["tool_calls"] = [c.to_openai() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def tool_function(tool: Any, where: str = "tool") -> Mapping:
    """The function spec of an OpenAI tool ``{"type": "function", "function": {"name", ...}}``."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatFormatError(f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\": ..., ...}}}}")
    return fn


def effort_budget(effort: ReasoningEffort | None) -> int:
    """The numeric budget 1..100 of a reasoning effort (a level name or the number); default ``high`` = 75."""
    if effort is None:
        effort = DEFAULT_REASONING_EFFORT
    if isinstance(effort, str) and effort in REASONING_EFFORT_LEVELS:
        return REASONING_EFFORT_LEVELS[effort]
    if isinstance(effort, int) and not isinstance(effort, bool) and 1 <= effort <= 100:
        return effort
    raise ChatFormatError(f"reasoning effort {effort!r} must be one of {', '.join(REASONING_EFFORT_LEVELS)} "
                          f"or a whole number 1..100")


# ----------------------------------------------------------------------------------------------- encoder
def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _arguments_object(arguments: str) -> dict:
    """Arguments text → the object whose members become DSML parameters. Like the official encoder, text that
    is JSON of JSON is unwrapped once more, and anything that is no object is passed as one string parameter
    ``arguments``."""
    value: Any = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def render_tool_calls(calls: Sequence[ToolCall]) -> str:
    """The DSML block of ``calls`` (without the blank line that precedes it in a turn)."""
    invokes = []
    for call in calls:
        params = "\n".join(
            f'{PARAM_START} name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else _to_json(v)}{PARAM_END}'
            for key, v in _arguments_object(call.arguments).items())
        invokes.append(f'{INVOKE_START} name="{call.name}">\n{params}\n{INVOKE_END}')
    return CALLS_START + "\n" + "\n".join(invokes) + "\n" + CALLS_END


@dataclass(frozen=True)
class _Turn:
    """A message after merging: user turns carry their parts (texts and tool results) already joined."""

    role: str
    text: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tools: tuple = ()


def _user_turns(messages: Sequence[Message]) -> list[_Turn]:
    """Merge each run of user / tool messages into one user turn; tool results in the order of the preceding
    assistant's calls (a stable sort by call index; an unknown id counts as index 0, as in the official encoder)."""
    turns: list[_Turn] = []
    run: list[tuple[str, Message]] = []  # ("text" | "tool", message)
    order: dict[str, int] = {}

    def close_run():
        if not run:
            return
        results = sorted((m for kind, m in run if kind == "tool"), key=lambda m: order.get(m.tool_call_id or "", 0))
        slots = iter(results)
        parts = [m.content if kind == "text" else f"<tool_result>{next(slots).content}</tool_result>"
                 for kind, m in run]
        turns.append(_Turn("user", "\n\n".join(parts)))
        run.clear()

    for m in messages:
        if m.role in ("user", "tool"):
            run.append(("text" if m.role == "user" else "tool", m))
            continue
        close_run()
        if m.role == "assistant":
            if m.tool_calls:
                order = {c.id: i for i, c in enumerate(m.tool_calls) if c.id}
            turns.append(_Turn("assistant", m.content, m.reasoning_content, m.tool_calls))
        else:
            turns.append(_Turn("system", m.content))
    close_run()
    return turns


def _check(messages: Sequence[Message]) -> None:
    if not messages:
        raise ChatFormatError("a chat needs at least one message")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ChatFormatError(f"message {i + 1}: unknown chat role {m.role!r} (expected one of "
                                  f"{', '.join(ROLES)})")
    last = messages[-1]
    if last.role == "assistant" or (last.role == "system" and len(messages) == 1):
        raise ChatFormatError("the last chat message must be from the user or a tool (or a later system message)")


def encode_messages(messages: Sequence[Message], *, thinking: bool = False,
                    reasoning_effort: ReasoningEffort | None = None, tools: Sequence[Mapping] = ()) -> str:
    """The V4.1 prompt text for ``messages`` (BOS first), ending with the assistant's opening: ``<think>`` with
    ``thinking``, else ``</think>``. ``reasoning_effort`` (``low``/``high``/``max`` or 1..100, default high) is
    written only with ``thinking``; ``tools`` are OpenAI tool specs. ChatFormatError for what cannot be encoded."""
    _check(messages)
    budget = effort_budget(reasoning_effort)
    functions = tuple(tool_function(t, f"tool {i + 1}") for i, t in enumerate(tools))
    turns = _user_turns(messages)
    if functions:
        if turns[0].role != "system":
            turns.insert(0, _Turn("system", ""))
        turns[0] = _Turn("system", turns[0].text, tools=functions)
    # The last turn that asks for an answer: a user turn, or a system message after the first.
    last_ask = max((i for i, t in enumerate(turns) if t.role == "user" or (t.role == "system" and i > 0)),
                   default=-1)
    keep_reasoning = bool(functions)  # with tools every turn keeps its reasoning (the official default)
    parts = [BOS]
    if thinking or turns[0].role == "system":
        parts.append(SYSTEM + (EFFORT_LINE.format(budget) if thinking else ""))
    for i, turn in enumerate(turns):
        parts.append(_render_turn(i, turn, thinking, keep_reasoning or i > last_ask))
        answered = i + 1 == len(turns) or turns[i + 1].role == "assistant"
        if answered and (turn.role == "user" or (turn.role == "system" and i > 0)):
            opens_thought = thinking and (keep_reasoning or i >= last_ask)
            parts.append(ASSISTANT + (THINK_START if opens_thought else THINK_END))
    return "".join(parts)


def _render_turn(i: int, turn: _Turn, thinking: bool, with_reasoning: bool) -> str:
    if turn.role == "system":
        text = (SYSTEM if i > 0 else "") + turn.text
        if turn.tools:
            text += "\n\n" + TOOLS_PROMPT.format(schemas="\n".join(_to_json(f) for f in turn.tools))
        return text
    if turn.role == "user":
        return USER + turn.text
    reasoning = (turn.reasoning or "") + THINK_END if thinking and with_reasoning else ""
    calls = "\n\n" + render_tool_calls(turn.tool_calls) if turn.tool_calls else ""
    return reasoning + turn.text + calls + EOS


def render_reply(reply: Message, *, thinking: bool) -> str:
    """The text the model emits for the assistant ``reply`` after an encode_messages prompt (EOS last)."""
    return _render_turn(1, _Turn("assistant", reply.content, reply.reasoning_content, reply.tool_calls), thinking,
                        True)


def chat_ids(tokenizer, messages: Sequence[Message], **options) -> list[int]:
    """Ids of ``encode_messages(messages, **options)`` (its text already starts with BOS)."""
    return tokenizer.encode(encode_messages(messages, **options))


# ----------------------------------------------------------------------------------------------- replies
@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A complete tool call (streamed only once its ``</｜DSML｜ invoke>`` has arrived); ``index`` counts from 0."""

    index: int
    call: ToolCall


@dataclass(frozen=True)
class UnparsedDelta:
    """Tool-call markup that does not parse (or was cut off): kept out of the answer, reported as is."""

    text: str


ReplyEvent = Union[ReasoningDelta, ContentDelta, ToolCallEvent, UnparsedDelta]


@dataclass(frozen=True)
class Reply:
    """A parsed reply: ``unparsed`` holds malformed or cut-off tool-call markup ('' normally)."""

    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    unparsed: str = ""

    def to_openai(self) -> dict:
        """An OpenAI assistant message (``reasoning_content`` as DeepSeek's API names it)."""
        out: dict = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning}
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return out


_PARAM = re.compile(r' name="(.*?)" string="(true|false)">(.*)', re.DOTALL)
_INVOKE_NAME = re.compile(r'^\s*name="(.*?)">\n', re.DOTALL)


def parse_invoke(body: str) -> ToolCall:
    """One ``<｜DSML｜ invoke`` ... ``</｜DSML｜ invoke>`` body (the text between the two markers) → ToolCall.

    Arguments become JSON text the way the official parser writes them: ``{"key": value, ...}`` with string
    parameters JSON-quoted and the others as written. ValueError when the markup does not parse."""
    head = _INVOKE_NAME.match(body)
    if head is None:
        raise ValueError(f"tool call name not found in {body[:60]!r}")
    pieces = body[head.end():].split(PARAM_START)
    if pieces[0].strip():
        raise ValueError(f"unexpected text in a tool call: {pieces[0][:60]!r}")
    members, seen = [], set()
    for piece in pieces[1:]:
        inner, sep, rest = piece.partition(PARAM_END)
        match = _PARAM.fullmatch(inner)
        if not sep or match is None or rest.strip():
            raise ValueError(f"malformed tool call parameter {piece[:60]!r}")
        key, is_string, value = match.groups()
        if key in seen:
            raise ValueError(f"duplicate tool call parameter {key!r}")
        seen.add(key)
        members.append(f"{_to_json(key)}: {_to_json(value) if is_string == 'true' else value}")
    return ToolCall(head.group(1), "{" + ", ".join(members) + "}")


class ReplyStream:
    """Splits generated text into reasoning, answer and tool calls as it arrives.

    ``feed(piece)`` returns the events the piece completes. Text that might begin a marker (``</think>``, the
    tool-call block, EOS) is held back until it is known not to, so no part of a marker or of a tool call ever
    shows in ``ContentDelta``/``ReasoningDelta``; a tool call is reported whole when its invoke closes.
    ``finish()`` flushes what is held back at the end of generation. With ``thinking`` the reply starts inside
    the reasoning (the prompt ended with ``<think>``); without, it is the answer from the start.
    """

    _TAIL = max(len(INVOKE_END), len(EOS)) - 1  # enough text to see a marker that spans two pieces

    def __init__(self, *, thinking: bool):
        self._state = "reasoning" if thinking else "content"
        self._buf = ""
        self._calls = 0
        # An invoke whose end has not arrived: its pieces, kept apart (a long argument costs linear time).
        self._invoke: list[str] | None = None
        self._tail = ""

    @property
    def done(self) -> bool:
        """EOS was seen: the reply is complete and later text is ignored."""
        return self._state == "done"

    def feed(self, piece: str) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        if self._invoke is not None:
            window = self._tail + piece
            if INVOKE_END not in window and EOS not in window:
                self._invoke.append(piece)
                self._tail = window[-self._TAIL:]
                return events
            self._buf, self._invoke = "".join(self._invoke) + piece, None
        else:
            self._buf += piece
        while self._state != "done" and self._step(events):
            pass
        return events

    def finish(self) -> list[ReplyEvent]:
        events = self.feed("")
        if self._invoke is not None:
            self._buf, self._invoke = "".join(self._invoke), None
        if self._buf and self._state != "done":
            kind = {"reasoning": ReasoningDelta, "content": ContentDelta}.get(self._state, UnparsedDelta)
            events.append(kind(self._buf))
        self._buf, self._state = "", "done"
        return events

    # One transition; False when more text is needed.
    def _step(self, events: list[ReplyEvent]) -> bool:
        if self._state == "reasoning":
            # A tool-call block also ends the reasoning (as in the official parser, which then refuses the reply).
            return self._text_until(events, ReasoningDelta, {THINK_END: "content", "\n\n" + CALLS_START: "calls",
                                                             EOS: "done"})
        if self._state == "content":
            return self._text_until(events, ContentDelta, {"\n\n" + CALLS_START: "calls", CALLS_START: "calls",
                                                           EOS: "done"})
        return self._calls_step(events)

    def _text_until(self, events, kind, markers: dict[str, str]) -> bool:
        """Emit text up to the first marker and switch state; else emit all but a possible marker prefix."""
        hits = [(self._buf.find(m), -len(m), m) for m in markers if m in self._buf]
        if hits:
            pos, _, marker = min(hits)
            if pos:
                events.append(kind(self._buf[:pos]))
            self._buf, self._state = self._buf[pos + len(marker):], markers[marker]
            return True
        keep = max((k for m in markers for k in range(1, len(m)) if self._buf.endswith(m[:k])), default=0)
        if len(self._buf) > keep:
            events.append(kind(self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _calls_step(self, events) -> bool:
        """Inside ``<｜DSML｜ calls>``: one whole invoke, or the block's end (then back to the answer)."""
        text = self._buf.lstrip("\n")
        if text.startswith(EOS):  # the block was never closed
            self._buf, self._state = "", "done"
            return True
        if text.startswith(CALLS_END):
            self._buf, self._state = text[len(CALLS_END):], "content"
            return True
        if text.startswith(INVOKE_START):
            end, eos = text.find(INVOKE_END), text.find(EOS)
            if 0 <= eos and (end < 0 or eos < end):  # cut off by EOS
                events.append(UnparsedDelta(text[:eos]))
                self._buf, self._state = "", "done"
                return True
            if end < 0:
                self._invoke, self._tail, self._buf = [text], text[-self._TAIL:], ""
                return False
            body, self._buf = text[len(INVOKE_START):end], text[end + len(INVOKE_END):]
            try:
                events.append(ToolCallEvent(self._calls, parse_invoke(body)))
                self._calls += 1
            except ValueError:
                events.append(UnparsedDelta(INVOKE_START + body + INVOKE_END))
            return True
        if any(m.startswith(text) for m in (CALLS_END, INVOKE_START, EOS)):
            return False  # a marker may still be arriving
        # Neither an invoke nor the block's end: report the markup as is up to the next marker, stay in the block.
        cut = min((p for p in (text.find(INVOKE_START), text.find(CALLS_END), text.find(EOS)) if p > 0),
                  default=None)
        if cut is None:
            return False
        events.append(UnparsedDelta(text[:cut]))
        self._buf = text[cut:]
        return True


def collect(events: Iterable[ReplyEvent]) -> Reply:
    """Fold stream events into a Reply."""
    reasoning, content, unparsed, calls = [], [], [], []
    for e in events:
        if isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallEvent):
            calls.append(e.call)
        else:
            unparsed.append(e.text)
    return Reply("".join(reasoning), "".join(content), tuple(calls), "".join(unparsed))


def parse_reply(text: str, *, thinking: bool) -> Reply:
    """Reasoning, answer and tool calls of a whole reply (``thinking``: the prompt ended with ``<think>``).

    Text after EOS is ignored; a reply cut off inside its reasoning is all reasoning."""
    stream = ReplyStream(thinking=thinking)
    return collect([*stream.feed(text), *stream.finish()])
