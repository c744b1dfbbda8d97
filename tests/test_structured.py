"""Structured output's grammar side (`dsv41_jax.structured`) on the DeepSeek vocabulary, checked against an
independent validator (jsonschema) rather than against the grammar engine itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsv41_jax.assets import embedded_checkpoint
from dsv41_jax.chat import Message, ToolCall, parse_reply, render_reply
from dsv41_jax.sampling import unpack_bitmask
from dsv41_jax.structured import GrammarError, StructuredVocab, grammar_for, tool_grammar
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


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14},
                       "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "pattern": "^[a-z ]{1,10}$"}},
        "required": ["query"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def draw(tok, vocab, grammar, rng, prefix: str = "", limit: int = 400) -> str:
    """A reply drawn uniformly over the allowed tokens (after forcing ``prefix``); its text, EOS left out."""
    c, mask, ids = vocab.matcher(grammar), vocab.empty_masks(1), []
    for token in tok.encode(prefix):
        c.advance(token)
    while not c.done and len(ids) < limit:
        vocab.fill_masks([c], mask)
        token = int(rng.choice(allowed(mask[0], vocab.size)))
        c.advance(token)
        ids.append(token)
    assert c.done, tok.decode(ids, skip_special=False)
    return prefix + tok.decode([i for i in ids if i != tok.eos_id], skip_special=False)


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                              ({"type": "function", "function": {"name": "search"}}, True)])
def test_tool_calls_drawn_under_the_masks_parse_and_validate(tok, vocab, choice, parallel):
    """Each reply is tool calls only, read back by the chat parser (DSML), each call's arguments valid under
    its function's schema, the named function the only one called, one call when not parallel."""
    grammar, rng = tool_grammar(TOOLS, choice, parallel=parallel), np.random.default_rng(1)
    for _ in range(6):
        text = draw(tok, vocab, grammar, rng)
        reply = parse_reply(text, thinking=False)
        assert reply.content == "" and not reply.unparsed and reply.tool_calls, repr(text)
        assert parallel or len(reply.tool_calls) == 1
        for call in reply.tool_calls:
            assert choice == "required" or call.name == "search"
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_with_thinking_the_reasoning_is_free_then_calls_follow(tok, vocab):
    grammar = tool_grammar(TOOLS, "required", thinking=True, special=vocab.special)
    text = draw(tok, vocab, grammar, np.random.default_rng(2), prefix="The user wants the weather.</think>")
    reply = parse_reply(text, thinking=True)
    assert reply.reasoning == "The user wants the weather." and reply.tool_calls and not reply.unparsed


def test_a_rendered_call_is_in_the_grammar(tok, vocab):
    """What the chat template writes for a call is what the grammar allows (one renderer, one grammar)."""
    text = render_reply(Message("assistant", "", None, (ToolCall("get_weather", '{"city": "Paris", "days": 3}'),)),
                        thinking=False)
    c, mask = vocab.matcher(tool_grammar(TOOLS, "required")), vocab.empty_masks(1)
    for token in tok.encode(text):
        vocab.fill_masks([c], mask)
        assert token in set(allowed(mask[0], vocab.size)), tok.decode([token], skip_special=False)
        c.advance(token)


@pytest.mark.parametrize("tools, choice, message", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ([], "required", "needs tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "date"}}}}}], "required", "format"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "required", "object"),
])
def test_tool_choices_that_cannot_be_enforced_are_refused(tools, choice, message):
    with pytest.raises(GrammarError, match=message):
        tool_grammar(tools, choice)


def test_with_thinking_a_document_follows_the_reasoning(tok, vocab):
    grammar = grammar_for(FORMAT, thinking=True, special=vocab.special)
    text = draw(tok, vocab, grammar, np.random.default_rng(3), prefix="Let me think.</think>")
    reply = parse_reply(text, thinking=True)
    assert reply.reasoning == "Let me think." and not reply.tool_calls
    jsonschema.validate(json.loads(reply.content), SCHEMA)


def test_the_step_unpacks_the_masks_as_they_were_packed(tok, vocab):
    """`sampling.unpack_bitmask` (the device's view) reads each id's bit as `structured` wrote it."""
    c, mask = vocab.matcher(grammar_for(FORMAT)), vocab.empty_masks(2)
    vocab.fill_masks([c, None], mask)
    got = np.asarray(unpack_bitmask(mask, vocab.size))
    assert got[1].all() and set(np.flatnonzero(got[0])) == set(allowed(mask[0], vocab.size))
    assert 0 < got[0].sum() < vocab.size


def test_markers_that_are_special_tokens_are_named_as_tokens():
    """A tokenizer whose DSML markers are special tokens of their own (the embedded model's): the grammar names
    them as tokens, so the rendered call is allowed token by token and drawn calls parse and validate."""
    path = embedded_checkpoint()
    if not (path / "tokenizer.json").is_file():
        pytest.skip("the trained checkpoint is not in this tree")
    tok = DeepSeekTokenizer(path)
    vocab = StructuredVocab(tok, tok.vocab_size)
    assert "<｜DSML｜ calls>" in vocab.special
    grammar = tool_grammar(TOOLS, "required", special=vocab.special)
    text = render_reply(Message("assistant", "", None, (ToolCall("get_weather", '{"city": "Paris", "days": 3}'),)),
                        thinking=False)
    c, mask = vocab.matcher(grammar), vocab.empty_masks(1)
    for token in tok.encode(text):
        vocab.fill_masks([c], mask)
        assert token in set(allowed(mask[0], vocab.size)), tok.decode([token], skip_special=False)
        c.advance(token)
    rng = np.random.default_rng(4)
    for _ in range(4):
        reply = parse_reply(draw(tok, vocab, grammar, rng), thinking=False)
        assert reply.tool_calls and not reply.unparsed
        for call in reply.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
