"""Grammar libraries for structured output, measured on this project's tokenizer: compile time, token-mask time
per decode step at S slots, and correctness (a valid document's tokens are all allowed; documents sampled under
the masks from random logits parse and validate against their schema).

    python benchmarks/bench_structured.py [--slots 32] [--steps 64] [--samples 20]

Prints one table row per (library, grammar): compile ms (grammar -> matcher, tokenizer tables excluded),
mask µs per step for all S slots, mask µs per slot, steps checked, and valid / finished samples (uniform draws over
the allowed tokens: an unbounded value may run past the sample's length, so some do not finish). A library that is not
installed is reported as such (llguidance is the one `dsv41_jax.structured` uses; outlines-core is the other
candidate that installs without torch; xgrammar needs torch and transformers and is left out).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dsv41_jax.chat import Message, ToolCall, parse_reply, render_reply
from dsv41_jax.structured import GrammarError, StructuredVocab, grammar_for, tool_grammar
from dsv41_jax.tokenizer import DeepSeekTokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                          "zip": {"type": "string", "pattern": "^[A-Z0-9]{2,5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PERSON_DOC = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines"],
              "address": {"city": "London", "zip": "W1"}}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"]}}}]
PARIS = '{"city": "Paris", "days": 3}'
CASES = {
    "json_object": ({"type": "json_object"}, {"answer": [1, 2.5, None, True], "note": "any JSON object"}),
    "json_schema": ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
                    PERSON_DOC),
    "tool_call": ({"type": "tool_choice", "tools": WEATHER, "tool_choice": "required"},
                  render_reply(Message("assistant", "", None, (ToolCall("get_weather", PARIS),)), thinking=False)),
}


def grammar_of(case: dict) -> str:
    """A case's grammar: a response_format, or a forced tool choice (``type`` "tool_choice")."""
    if case["type"] == "tool_choice":
        return tool_grammar(case["tools"], case["tool_choice"])
    return grammar_for(case)


def document_text(case: dict, doc) -> str:
    return doc if isinstance(doc, str) else json.dumps(doc)


def bits_allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def sample_under_mask(rng, row: np.ndarray, vocab: int) -> int:
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])
    return int(rng.choice(allowed))


def measure_llguidance(tok, vocab, response_format, doc, args) -> dict:
    t0 = time.perf_counter()
    grammar = grammar_of(response_format)
    matchers = [vocab.matcher(grammar) for _ in range(args.slots)]
    compile_ms = (time.perf_counter() - t0) * 1e3 / args.slots
    doc_ids = tok.encode(document_text(response_format, doc))
    masks = vocab.empty_masks(args.slots)
    times, checked = [], 0
    for step in range(min(args.steps, len(doc_ids))):
        t0 = time.perf_counter()
        vocab.fill_masks(matchers, masks)
        times.append(time.perf_counter() - t0)
        assert bits_allowed(masks[0], doc_ids[step]), (step, tok.decode(doc_ids[: step + 1]))
        for m in matchers:
            m.advance(doc_ids[step])
        checked += 1
    valid = finished = 0
    rng = np.random.default_rng(0)
    for _ in range(args.samples):
        m, mask, ids = vocab.matcher(grammar), vocab.empty_masks(1), []
        while not m.done and len(ids) < 400:
            vocab.fill_masks([m], mask)
            token = sample_under_mask(rng, mask[0], vocab.size)
            m.advance(token)
            ids.append(token)
        finished += m.done
        valid += m.done and valid_reply(tok.decode([i for i in ids if i != tok.eos_id], skip_special=False),
                                        response_format)
    per_step = float(np.median(times)) * 1e6
    return {"compile_ms": compile_ms, "step_us": per_step, "slot_us": per_step / args.slots, "checked": checked,
            "valid": f"{valid}/{finished}",
            "note": f"{args.samples - finished} of {args.samples} samples unfinished at 400 tokens"
            if finished < args.samples else ""}


def valid_reply(text: str, response_format: dict) -> bool:
    import jsonschema  # noqa: PLC0415 - a test extra, only for the check

    if response_format["type"] == "tool_choice":
        reply = parse_reply(text, thinking=False)
        schema = response_format["tools"][0]["function"]["parameters"]
        try:
            for call in reply.tool_calls:
                jsonschema.validate(json.loads(call.arguments), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return bool(reply.tool_calls) and not reply.unparsed
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if response_format["type"] == "json_object":
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, response_format["json_schema"]["schema"])
    except jsonschema.ValidationError:
        return False
    return True


def measure_outlines(tok, response_format, doc, args) -> dict:
    try:
        from outlines_core import Guide, Index, Vocabulary  # noqa: PLC0415 - an optional candidate
        from outlines_core.json_schema import build_regex_from_schema  # noqa: PLC0415
    except ImportError:
        return {"note": "not installed"}
    if response_format["type"] == "tool_choice":
        return {"note": "regexes over JSON only (no DSML tool-call grammar)"}
    if response_format["type"] != "json_schema":
        return {"note": "no grammar for any JSON object (a regex cannot nest without a depth bound)"}
    t0 = time.perf_counter()
    by_bytes: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if b and i != tok.eos_id:
            by_bytes.setdefault(b, []).append(i)
    vocabulary = Vocabulary(tok.eos_id, by_bytes)
    vocab_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(response_format["json_schema"]["schema"])), vocabulary)
    compile_ms = (time.perf_counter() - t0) * 1e3
    guides = [Guide(index) for _ in range(args.slots)]
    words = (tok.vocab_size + 31) // 32
    masks = np.zeros((args.slots, words), np.int32)
    doc_ids = tok.encode(json.dumps(doc, separators=(",", ":")))
    times, checked = [], 0
    for step in range(min(args.steps, len(doc_ids))):
        t0 = time.perf_counter()
        for k, g in enumerate(guides):
            g.write_mask_into(masks[k].ctypes.data, masks[k].size, 4)
        times.append(time.perf_counter() - t0)
        if not bits_allowed(masks[0], doc_ids[step]):
            return {"note": f"refused the document's token {step}", "compile_ms": compile_ms}
        for g in guides:
            g.advance(doc_ids[step])
        checked += 1
    per_step = float(np.median(times)) * 1e6
    return {"compile_ms": compile_ms, "step_us": per_step, "slot_us": per_step / args.slots, "checked": checked,
            "note": f"vocabulary built in {vocab_s:.1f} s"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--samples", type=int, default=20)
    args = p.parse_args()
    tok = DeepSeekTokenizer()
    t0 = time.perf_counter()
    vocab = StructuredVocab(tok, tok.vocab_size)
    print(f"tokenizer: {tok.vocab_size:,} ids; llguidance tables built in {time.perf_counter() - t0:.2f} s; "
          f"{args.slots} slots")
    print(f"{'library':12} {'grammar':12} {'compile ms':>10} {'mask µs/step':>13} {'µs/slot':>8} {'checked':>8} "
          f"{'valid':>6}  note")
    for name, (response_format, doc) in CASES.items():
        try:
            rows = {"llguidance": measure_llguidance(tok, vocab, response_format, doc, args),
                    "outlines-core": measure_outlines(tok, response_format, doc, args)}
        except GrammarError as e:
            print(f"{name}: {e}")
            continue
        for lib, r in rows.items():
            print(f"{lib:12} {name:12} {r.get('compile_ms', float('nan')):10.1f} "
                  f"{r.get('step_us', float('nan')):13.0f} {r.get('slot_us', float('nan')):8.1f} "
                  f"{r.get('checked', '-'):>8} {r.get('valid', '-'):>6}  {r.get('note', '')}")


if __name__ == "__main__":
    main()
