"""Structured output: an OpenAI ``response_format`` compiled to a grammar, and per-request token masks.

The grammar engine is llguidance (Microsoft's, the one vLLM and SGLang offer as a backend): it compiles JSON
schemas and Lark grammars against a tokenizer and computes the set of allowed next tokens lazily, in tens of
microseconds a step, without a precomputed automaton over the whole vocabulary (``benchmarks/bench_structured.py``
measures it against outlines-core on this tokenizer). It has no Python dependencies.

Contract:
- `grammar_for(response_format)` → a grammar, or `GrammarError` (the server's 400) for a format it cannot
  honour: ``json_object`` (any JSON object), ``json_schema`` (its ``schema``; ``strict`` or not, the output
  always satisfies the schema), ``text`` (no grammar: None).
- `tool_grammar(tools, tool_choice, parallel=, thinking=, special=)` → the grammar of a reply that is only tool calls in
  DeepSeek's DSML markup (exactly as `chat.render_reply` writes a reply without content, so `chat.parse_reply`
  reads it back): ``tool_choice`` "required" (any of ``tools``) or ``{"type": "function", "function": {"name":
  N}}``; ``parallel`` False: exactly one call; ``thinking``: free reasoning up to ``</think>`` first;
  ``special``: the tokenizer's markers that are tokens of their own (`StructuredVocab.special`). Parameters
  follow the function's JSON schema in its ``properties`` order (required ones always, the others optional);
  a ``string`` parameter is written raw (``string="true"``) and may constrain ``enum``, ``pattern``,
  ``minLength``, ``maxLength``; any other parameter is a JSON value under its schema. A schema keyword a raw
  string cannot honour (``format``...) is refused.
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
from typing import Mapping, Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from .chat import (
    CALLS_END,
    CALLS_START,
    INVOKE_END,
    INVOKE_START,
    PARAM_END,
    PARAM_START,
    ChatFormatError,
    tool_function,
)
from .tokenizer import THINK_END, DeepSeekTokenizer

# The document's layout: JSON's default separators and no other whitespace (Python's json.dumps layout; a
# document then ends within its schema's bounds, as free whitespace would let it run on).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A response format or schema that cannot be compiled (the message names what is wrong)."""


def grammar_for(response_format: dict | None, *, thinking: bool = False,
                special: Mapping[str, int] | None = None) -> str | None:
    """The grammar of an OpenAI ``response_format`` (None: free text); ``thinking``: free reasoning up to
    ``</think>``, then the document; ``special``: the tokenizer's special tokens (`StructuredVocab.special`)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise GrammarError("response_format must be an object with a type")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _from_schema({"type": "object"}, thinking, special)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format.json_schema must be an object with a schema object")
        return _from_schema(spec.get("schema") or {"type": "object"}, thinking, special)
    raise GrammarError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")


def _from_schema(schema: dict, thinking: bool = False, special: Mapping[str, int] | None = None) -> str:
    try:
        if not thinking:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_LAYOUT)
        else:  # the schema's options ride in it ("x-guidance"), as the inline %json takes them
            laid_out = json.dumps({**schema, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
            grammar = llguidance.LLMatcher.grammar_from_lark(
                f"start: think document\n{_Lark(special or {}).think_rule()}\ndocument: %json {laid_out}")
    except ValueError as e:
        raise GrammarError(f"response_format schema: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"response_format schema: {messages[0]}")
    return grammar


class Constraint:
    """One request's grammar state (see the module docstring)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_id: int, vocab: "StructuredVocab"):
        self._matcher = matcher
        self._eos_id = eos_id
        self.vocab = vocab  # whose `fill_masks` writes this constraint's rows
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
        # markers the grammar engine reads as tokens of their own, never as their text (grammars name them)
        self.special = {text: i for i, text in tokenizer.added_tokens().items()
                        if i < n_vocab and self._tokenizer.is_special_token(i)}
        self._words = (n_vocab + 31) // 32

    def matcher(self, grammar: str) -> Constraint:
        m = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"response_format: {m.get_error()}")
        return Constraint(m, self.eos_id, self)

    def empty_masks(self, rows: int) -> np.ndarray:
        """int32 [rows, W], every token allowed (a row with no constraint stays so)."""
        return np.full((rows, self._words), -1, np.int32)

    def fill_masks(self, constraints: Sequence[Constraint | None], masks: np.ndarray) -> None:
        """Row k of ``masks`` ← constraint k's allowed tokens (rows whose constraint is None are left as they are)."""
        pairs = [(c._matcher, k) for k, c in enumerate(constraints) if c is not None]
        if not pairs:
            return
        llg_numpy.fill_next_token_bitmask_par(self._executor, pairs, masks)


# String-schema keywords a raw (unquoted) DSML string parameter enforces, and those that only describe it.
_RAW_STRING_KEYWORDS = {"type", "enum", "pattern", "minLength", "maxLength"}
_DESCRIPTIVE_KEYWORDS = {"description", "title", "default", "examples", "$comment"}


def tool_grammar(tools: Sequence[dict], tool_choice, *, parallel: bool = True, thinking: bool = False,
                 special: Mapping[str, int] | None = None) -> str:
    """The grammar of a reply made of DSML tool calls (see the module docstring)."""
    try:
        functions = [tool_function(t, f"tools[{i}]") for i, t in enumerate(tools or [])]
    except ChatFormatError as e:
        raise GrammarError(str(e)) from None
    if not functions:
        raise GrammarError("tool_choice needs tools")
    if tool_choice != "required":
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools")
        functions = chosen
    lark = _Lark(special or {})
    rules = [f"invoke: {' | '.join(f'invoke_{i}' for i in range(len(functions)))}"]
    for i, fn in enumerate(functions):
        rules += lark.invoke_rules(i, fn)
    calls = '"\\n" invoke' if not parallel else '"\\n" invoke ("\\n" invoke)*'
    head = f'think {lark.lit(chr(10) * 2)} calls' if thinking else f'{lark.lit(chr(10) * 2)} calls'
    rules = [f"start: {head}", f"calls: {lark.lit(CALLS_START)} {calls} {lark.lit(chr(10) + CALLS_END)}", *rules]
    if thinking:
        rules.append(lark.think_rule())
    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(rules))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"tools: {messages[0]}")
    return grammar


class _Lark:
    """Lark pieces for a tokenizer whose ``special`` tokens (text → id) the grammar engine reads as tokens of
    their own, never as their text: a literal holding such a text names the token (``<[id]>``) there, and text
    that must end at one is a greedy lexeme followed by the token (text cannot run into a special token); other
    markers are text, ended lazily (the first end marker ends the text)."""

    def __init__(self, special: Mapping[str, int]):
        self.special = dict(special)
        self._order = sorted(self.special, key=len, reverse=True)

    def lit(self, text: str) -> str:
        """``text`` as a sequence of Lark string literals and special tokens."""
        items, start, k = [], 0, 0
        while k < len(text):
            found = next((t for t in self._order if text.startswith(t, k)), None)
            if found is None:
                k += 1
                continue
            if k > start:
                items.append(json.dumps(text[start:k], ensure_ascii=False))
            items.append(f"<[{self.special[found]}]>")
            start = k = k + len(found)
        if start < len(text) or not items:
            items.append(json.dumps(text[start:], ensure_ascii=False))
        return " ".join(items)

    def ended(self, rule: str, body: str, end: str) -> list[str]:
        """Rule ``rule``: text matching the regex ``body`` (may hold ``&``), then the marker ``end``."""
        if end in self.special:
            terminal = rule.upper().replace("_", "") + "TEXT"
            return [f"{rule}: {terminal} <[{self.special[end]}]>", f"{terminal}: {body}"]
        return [f"{rule}[lazy]: {body} {self.lit(end)}"]

    def think_rule(self) -> str:
        """Free reasoning up to ``</think>``."""
        rules = self.ended("think", "/(?s:.*)/", THINK_END)
        return "\n".join(rules)

    def invoke_rules(self, i: int, fn: dict) -> list[str]:
        """``invoke_i`` for function ``fn``: its head, each parameter on its line, its end (as `chat` renders
        it)."""
        params = fn.get("parameters") or {}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise GrammarError(f"tool {fn['name']!r}: parameters must be an object schema")
        properties = params.get("properties") or {}
        required = set(params.get("required") or ())
        missing = required - set(properties)
        if missing:
            raise GrammarError(f"tool {fn['name']!r}: required parameters {sorted(missing)} have no schema")
        head = self.lit(f'{INVOKE_START} name="{fn["name"]}">\n')
        if not properties:
            return [f"invoke_{i}: {head} {self.lit(chr(10) + INVOKE_END)}"]
        rules, items = [], []
        for j, (key, schema) in enumerate(properties.items()):
            rules += self.param_rules(f"p_{i}_{j}", key, schema if isinstance(schema, dict) else {}, fn["name"])
            items.append(f"p_{i}_{j}" if key in required else f"p_{i}_{j}?")
        return [f"invoke_{i}: {head} {' '.join(items)} {self.lit(INVOKE_END)}", *rules]

    def param_rules(self, rule: str, key: str, schema: dict, tool: str) -> list[str]:
        """One parameter line: ``<｜DSML｜ parameter name="key" string="...">value</｜DSML｜ parameter>\\n``."""
        head = f'{PARAM_START} name="{key}" string='
        if schema.get("type") == "string":
            extra = set(schema) - _RAW_STRING_KEYWORDS - _DESCRIPTIVE_KEYWORDS
            if extra:
                raise GrammarError(f"tool {tool!r}, parameter {key!r}: {sorted(extra)} cannot be enforced on a "
                                   f"string")
            return [f"{rule}: {self.lit(head + chr(34) + 'true' + chr(34) + '>')} {rule}_v {self.lit(chr(10))}",
                    *self.raw_string(rule, schema)]
        return [f"{rule}: {self.lit(head + chr(34) + 'false' + chr(34) + '>')} {rule}_v "
                f"{self.lit(PARAM_END + chr(10))}",
                f"{rule}_v: %json {json.dumps(schema, ensure_ascii=False)}"]

    def raw_string(self, rule: str, schema: dict) -> list[str]:
        """The raw text of a string parameter: one of its ``enum``, or text bounded as the schema says, then the
        parameter's end marker."""
        if "enum" in schema:
            if not all(isinstance(v, str) for v in schema["enum"]):
                raise GrammarError(f"parameter rule {rule}: a string enum must list strings")
            return [f"{rule}_v: ({' | '.join(self.lit(v) for v in schema['enum'])}) {self.lit(PARAM_END)}"]
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        body = f"/(?s:.{{{low},{'' if high is None else int(high)}}})/"
        if "pattern" in schema:
            body = f"{body} & /{_anchored(schema['pattern'])}/"
        return self.ended(f"{rule}_v", body, PARAM_END)


def _anchored(pattern: str) -> str:
    """A JSON-schema pattern (a search, unanchored unless it says so) as a whole-string regex."""
    start = "" if pattern.startswith("^") else "(?s:.*)"
    end = "" if pattern.endswith("$") and not pattern.endswith("\\$") else "(?s:.*)"
    core = pattern.removeprefix("^")
    core = core[:-1] if end == "" else core
    return f"{start}({core}){end}".replace("/", "\\/")
