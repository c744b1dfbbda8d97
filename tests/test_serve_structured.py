"""Structured output in the server, with the official ``openai`` client against a real server process of the
embedded trained model (its tokenizer's ids are the model's, as the release's are): every reply held to a JSON
schema parses and validates (jsonschema, an independent validator), at temperature 0 and 1; a forced tool choice
answers with tool calls whose arguments validate; what cannot be enforced is a 400 naming the field."""

from __future__ import annotations

import json

import pytest
from test_serve import launch, stop

from dsv41_jax.assets import embedded_checkpoint

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.skipif(not (embedded_checkpoint() / "config.json").is_file(),
                                reason="the trained checkpoint is not in this tree")

PERSON = {  # bounded: a reply ends within max_tokens whatever the model draws
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 120},
                   "mood": {"enum": ["merry", "sad"]}},
    "required": ["name", "age", "mood"], "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
TOOLS = [{"type": "function", "function": {"name": "summon", "parameters": {
    "type": "object", "properties": {"who": {"type": "string", "maxLength": 16},
                                     "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["who", "count"]}}},
         {"type": "function", "function": {"name": "depart", "parameters": {
             "type": "object", "properties": {"where": {"type": "string", "enum": ["London", "Rome"]}},
             "required": ["where"]}}}]
ASK = [{"role": "user", "content": "Who comes hither?"}]


@pytest.fixture(scope="module")
def client():
    proc, url, _ = launch("--max-batch", "4", "--max-context", "2048")  # no model flags: the embedded model
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    finally:
        stop(proc)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_replies_validate(client, temperature):
    for seed in range(3 if temperature else 1):
        r = client.chat.completions.create(model="bard", messages=ASK, response_format=FORMAT, max_tokens=96,
                                           temperature=temperature, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_a_streamed_reply_and_n_choices_validate_too(client):
    chunks = client.chat.completions.create(model="bard", messages=ASK, response_format=FORMAT, max_tokens=96,
                                            temperature=1.0, seed=7, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    r = client.chat.completions.create(model="bard", messages=ASK, response_format=FORMAT, max_tokens=96,
                                       temperature=1.0, seed=1, n=2)
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_starts_an_object(client):
    r = client.chat.completions.create(model="bard", messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=48, temperature=0)
    content = r.choices[0].message.content
    assert content.startswith("{"), content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "depart"}}])
def test_a_forced_tool_choice_answers_with_valid_calls(client, choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(model="bard", messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=160, temperature=temperature, seed=3)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls, r
        for call in message.tool_calls:
            assert choice == "required" or call.function.name == "depart"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": FORMAT, "tools": TOOLS, "tool_choice": "required"}, "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "fly"}}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": FORMAT, "extra_body": {"ignore_eos": True}}, "response_format"),
])
def test_what_cannot_be_enforced_is_a_400_naming_the_field(client, extra, param):
    extra = dict(extra)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="bard", messages=ASK, max_tokens=8,
                                       extra_body=extra.pop("extra_body", None), **extra)
    assert e.value.body["param"] == param, e.value.body
