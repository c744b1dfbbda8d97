"""Structured output: an OpenAI ``response_format`` compiled to a grammar, and per-request token masks.

The grammar engine is llguidance (Microsoft's, the one vLLM and SGLang offer as a backend): it compiles JSON
schemas and Lark grammars against a tokenizer and computes the set of allowed next tokens lazily, in tens of
microseconds a step, without a precomputed automaton over the whole vocabulary (``benchmarks/bench_structured.py``
measures it against outlines-core on this tokenizer). It has no Python dependencies.

Contract:
- `grammar_for(response_format)` → a grammar, or `GrammarError` (the server's 400) for a format it cannot
  honour: ``json_object`` (any JSON object), ``json_schema`` (its ``schema``; ``strict`` or not, the output
  always satisfies the schema), ``text`` (no grammar: None).
- `StructuredVocab(tokenizer, model_vocab)`: the tokenizer's tables, built once per server (about a second for
  the DeepSeek vocabulary). Ids at or above the tokenizer's size (the model's padding rows) are never allowed.
- `Constraint` (``vocab.matcher(grammar)``): one request's state; `StructuredVocab.fill_masks` writes each
  constraint's allowed set as a bitmask row (int32 [W], W = ceil(V / 32), bit ``t % 32`` of word ``t // 32`` is
  token t; EOS is allowed exactly where the document may end), in parallel over the rows; ``advance(token)``
  consumes the sampled token; ``done`` once the document is complete and EOS was taken (or nothing but EOS is
  left).
"""

from __future__ import annotations

import json
from typing import Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from .tokenizer import DeepSeekTokenizer

# The document's layout: JSON's default separators and no other whitespace (Python's json.dumps layout; a
# document then ends within its schema's bounds, as free whitespace would let it run on).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A response format or schema that cannot be compiled (the message names what is wrong)."""


def grammar_for(response_format: dict | None) -> str | None:
    """The grammar of an OpenAI ``response_format`` (None: free text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise GrammarError("response_format must be an object with a type")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _from_schema({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format.json_schema must be an object with a schema object")
        return _from_schema(spec.get("schema") or {"type": "object"})
    raise GrammarError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")


def _from_schema(schema: dict) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_LAYOUT)
    except ValueError as e:
        raise GrammarError(f"response_format schema: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"response_format schema: {messages[0]}")
    return grammar


class Constraint:
    """One request's grammar state (see the module docstring)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_id: int):
        self._matcher = matcher
        self._eos_id = eos_id
        self._ended = False

    @property
    def done(self) -> bool:
        return self._ended or self._matcher.is_stopped()

    def advance(self, token: int) -> None:
        """Consume a token the mask allowed (GrammarError if it was not: the mask was not applied)."""
        if token == self._eos_id and self._matcher.is_accepting():
            self._ended = True
            return
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} is outside the grammar: {self._matcher.get_error()}")


class StructuredVocab:
    """The tokenizer's tables for the grammar engine (see the module docstring)."""

    def __init__(self, tokenizer: DeepSeekTokenizer, model_vocab: int):
        self.size = model_vocab
        self.eos_id = tokenizer.eos_id
        text = tokenizer.path.read_text(encoding="utf-8")
        n_vocab = max(model_vocab, tokenizer.vocab_size)
        self._tokenizer = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=tokenizer.eos_id)
        self._executor = llguidance.LLExecutor()
        self._words = (n_vocab + 31) // 32
        self._tail = self._padding_mask(tokenizer.vocab_size, model_vocab)

    def _padding_mask(self, tokenizer_vocab: int, model_vocab: int) -> np.ndarray | None:
        """Words of ids the tokenizer lacks (cleared in every mask), or None when there are none."""
        if tokenizer_vocab >= model_vocab:
            return None
        keep = np.zeros(self._words * 32, bool)
        keep[:tokenizer_vocab] = True
        return np.packbits(keep, bitorder="little").view(np.int32)

    def matcher(self, grammar: str) -> Constraint:
        m = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"response_format: {m.get_error()}")
        return Constraint(m, self.eos_id)

    def empty_masks(self, rows: int) -> np.ndarray:
        """int32 [rows, W], every token allowed (a row with no constraint stays so)."""
        return np.full((rows, self._words), -1, np.int32)

    def fill_masks(self, constraints: Sequence[Constraint | None], masks: np.ndarray) -> None:
        """Row k of ``masks`` ← constraint k's allowed tokens (rows whose constraint is None are left as they are)."""
        pairs = [(c._matcher, k) for k, c in enumerate(constraints) if c is not None]
        if not pairs:
            return
        llg_numpy.fill_next_token_bitmask_par(self._executor, pairs, masks)
        if self._tail is not None:
            rows = [k for _, k in pairs]
            masks[rows] &= self._tail
