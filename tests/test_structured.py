"""Structured output's grammar side (`dsv41_jax.structured`) on the DeepSeek vocabulary, checked against an
independent validator (jsonschema) rather than against the grammar engine itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsv41_jax.structured import GrammarError, StructuredVocab, grammar_for
from dsv41_jax.tokenizer import DeepSeekTokenizer

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {  # every value bounded, so a document drawn under the masks ends within the draw's length
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def tok():
    return DeepSeekTokenizer()


@pytest.fixture(scope="module")
def vocab(tok):
    return StructuredVocab(tok, tok.vocab_size + 64)  # a model vocabulary padded past the tokenizer's


def allowed(mask_row: np.ndarray, size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:size])


def test_a_valid_document_is_allowed_token_by_token_and_ends_with_eos(tok, vocab):
    doc = json.dumps({"name": "Ada", "age": 36, "role": "admin", "tags": ["math"]})
    c, mask = vocab.matcher(grammar_for(FORMAT)), vocab.empty_masks(1)
    for token in tok.encode(doc):
        vocab.fill_masks([c], mask)
        assert token in set(allowed(mask[0], vocab.size)), tok.decode([token])
        c.advance(token)
    vocab.fill_masks([c], mask)
    assert list(allowed(mask[0], vocab.size)) == [tok.eos_id]  # complete: only the end
    c.advance(tok.eos_id)
    assert c.done


def test_documents_drawn_under_the_masks_validate(tok, vocab):
    """Uniform draws over the allowed set (the harshest sampler: no model steering it): every one ends, parses
    and satisfies the schema; the padding ids past the tokenizer are never allowed."""
    rng, grammar = np.random.default_rng(0), grammar_for(FORMAT)
    rows = 8
    constraints, masks = [vocab.matcher(grammar) for _ in range(rows)], vocab.empty_masks(rows)
    ids = [[] for _ in range(rows)]
    for _ in range(300):
        live = [c if not c.done else None for c in constraints]
        if not any(live):
            break
        vocab.fill_masks(live, masks)
        for k, c in enumerate(live):
            if c is None:
                continue
            choices = allowed(masks[k], vocab.size)
            assert choices.max() < tok.vocab_size
            token = int(rng.choice(choices))
            c.advance(token)
            ids[k].append(token)
    for k in range(rows):
        assert constraints[k].done, tok.decode(ids[k])
        jsonschema.validate(json.loads(tok.decode(ids[k])), SCHEMA)


def test_json_object_allows_any_object_and_nothing_else(tok, vocab):
    c, mask = vocab.matcher(grammar_for({"type": "json_object"})), vocab.empty_masks(1)
    vocab.fill_masks([c], mask)
    first = {tok.decode([int(t)]) for t in allowed(mask[0], vocab.size)}
    assert first and all(s.startswith("{") for s in first), sorted(first)[:10]


def test_a_token_outside_the_grammar_is_an_error(tok, vocab):
    c = vocab.matcher(grammar_for(FORMAT))
    with pytest.raises(GrammarError, match="outside the grammar"):
        c.advance(tok.encode("[")[0])


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "not supported"),
    ({"kind": "json_object"}, "with a type"),
    ({"type": "json_schema", "json_schema": {"schema": []}}, "schema object"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}},
     "schema"),
])
def test_formats_that_cannot_be_honoured_are_refused(response_format, message):
    with pytest.raises(GrammarError, match=message):
        grammar_for(response_format)


def test_text_means_no_grammar():
    assert grammar_for({"type": "text"}) is None and grammar_for(None) is None
