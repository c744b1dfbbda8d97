"""`python -m dsv41_jax.serve` as a real server process on 127.0.0.1 (a free port), the embedded tiny model,
talked to by the official `openai` client (a client no one here wrote) and by plain HTTP (httpx).

The server runs float32 with the rounding points off (as tests/test_engine.py: then batching changes at most
GEMM summation order), 4 slots, a 12-request queue, a 512-token context and 16-row segments, so every prompt is
short and prefills row by row inside the decode steps: the one model program compiled at start-up is the decode
step's, ``step[4, 1]`` (the one-row prefill of long prompts is tested in-process, tests/test_serve_slots.py;
32-row segments here would compile ``step[1, 32]`` too, which costs more start-up than it saves on the
tool-schema and chat-template prompts).

One server process serves the module (its names: ``NAMES``); its start-up (mostly compiling) is most of the
module's time.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dsv41_jax.chat import Message, ToolCall, render_reply
from dsv41_jax.serve.__main__ import build_parser, listen, served_names
from dsv41_jax.serve.app import Finish, TextPipeline, _chat_stream, _merged
from dsv41_jax.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")  # the test extra; a GPU machine may lack these: skipped there
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]
SLOTS, QUEUE, CONTEXT = 4, 12, 512
STARTUP_S = 420  # compiling on a loaded 2-core machine
NAMES = ["dsv41-tiny-random", "m", "alias"]  # --served-model-name, given once alone and once as a comma list


def _start(*flags):
    """The tiny random model's server with this module's settings (and ``flags``): (process, url, its lines)."""
    return launch("--config", "tiny", "--dtype", "float32", "--no-quant-rounding", "--max-batch", str(SLOTS),
                  "--max-queue", str(QUEUE), "--max-context", str(CONTEXT), "--segment-rows", "16", *flags)


def launch(*flags):
    """``python -m dsv41_jax.serve --port 0 flags`` on the CPU, once it listens: (process, url, its output lines
    so far; stdout and stderr together, the rest unread)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "dsv41_jax.serve", "--port", "0", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return proc, match.group(1), lines
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(lines))


def stop(proc) -> None:
    """End a server process: SIGTERM (its drain), then a kill if it has not exited after 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


STARTUP: dict = {}
SERVER_LOG: list[str] = []  # the server's stdout and stderr after start-up, read on a thread


@pytest.fixture(scope="module")
def server():
    proc, url, lines = _start("--served-model-name", NAMES[0], "--served-model-name", ",".join(NAMES[1:]))
    threading.Thread(target=lambda: SERVER_LOG.extend(proc.stdout), daemon=True).start()
    STARTUP["compiles"] = _metric(url, "dsv41_compile_events")
    try:
        yield url
    finally:
        stop(proc)
    assert proc.returncode is not None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def _metric(url: str, name: str) -> float:
    """The sum of a metric's samples; ``name`` may go on into its labels (``dsv41_requests_total{endpoint="chat"``)."""
    text = httpx.get(url + "/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines()
              if (line.startswith(name) if "{" in name else line.startswith((name + " ", name + "{")))]
    return sum(values)


def _requests_by_status(http: httpx.Client) -> dict[tuple[str, str], float]:
    text = http.get("/metrics").text
    return {(m[1], m[2]): float(m[3]) for m in
            re.finditer(r'dsv41_requests_total\{endpoint="(\w+)",status="(\d+)"\} (\S+)', text)}


def _local_port(response: httpx.Response) -> int:
    """The client's port of the connection ``response`` came on (equal ports: one keep-alive connection)."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def _ids_prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


# ------------------------------------------------------------------------------------------ the openai client
@pytest.mark.parametrize("thinking", [False, True])
def test_chat_stream_equals_non_stream(client, thinking):
    ask = dict(model="dsv41-tiny-random", messages=[{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "Why is the sky blue?"}],
               max_tokens=10, temperature=1.0, seed=11, extra_body={"thinking": thinking})
    whole = client.chat.completions.create(**ask)
    message = whole.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    parts, stream_reasoning, finish, usage = [], [], None, None
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            stream_reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == (message.content or "")
    assert "".join(stream_reasoning) == (reasoning or "")
    assert finish == whole.choices[0].finish_reason and usage == whole.usage
    assert whole.usage.completion_tokens == 10 or finish == "stop"
    if thinking:  # the reply opens inside <think>: a random model's text is all reasoning
        assert reasoning and not message.content
    else:
        assert reasoning is None and message.content


def test_thinking_changes_the_prompt(client):
    """Thinking on writes the reasoning-effort line into the prompt (chat.py); the usage counts show it."""
    messages = [{"role": "user", "content": "Hi"}]
    off = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    on = client.chat.completions.create(model="m", messages=messages, max_tokens=1, reasoning_effort="low")
    assert on.usage.prompt_tokens > off.usage.prompt_tokens


def test_completions_stream_equals_non_stream(client):
    ask = dict(model="m", prompt="The capital of France is", max_tokens=8, temperature=0.7, seed=5)
    whole = client.completions.create(**ask)
    streamed = [c.choices[0].text for c in client.completions.create(**ask, stream=True) if c.choices]
    assert "".join(streamed) == whole.choices[0].text and whole.usage.completion_tokens == 8


def test_models_health_and_tools(server, client):
    assert [m.id for m in client.models.list().data] == NAMES
    assert httpx.get(server + "/health").json()["status"] == "ok"
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    with_tools = client.chat.completions.create(model="m", messages=messages, max_tokens=1, tools=tools)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the schemas are in the prompt


def test_stop_strings_cut_the_text(client):
    ask = dict(model="m", prompt=[7, 8, 9, 10], max_tokens=16, temperature=0)
    free = client.completions.create(**ask).choices[0].text
    stop = free[4:6]
    assert len(stop) == 2
    cut = client.completions.create(**ask, stop=[stop, "never-there"]).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**ask, stop=stop, stream=True)
                       if c.choices)
    assert cut.text == free[:free.index(stop)] == streamed and cut.finish_reason == "stop"


# ------------------------------------------------------------------------------------------ continuous batching
def _complete(http: httpx.Client, ids, max_tokens):
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                           "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_continuous_batching_is_exact_and_compiles_nothing(server):
    """16 greedy requests of different lengths arriving at different times, 4 slots: each gets exactly the
    tokens it gets alone; slots are reused without a compile, and nothing compiled since start-up (JAX's
    backend-compile events, counted in the server)."""
    lengths = [2, 12, 9, 5, 11, 1, 10, 6, 3, 10, 4, 12, 7, 1, 6, 8]  # all short: fed in the decode steps
    asks = [(_ids_prompt(n, i), 2 + (i * 5) % 4) for i, n in enumerate(lengths)]
    with httpx.Client(base_url=server, timeout=120) as http:
        alone = [_complete(http, ids, m) for ids, m in asks[:2]]  # warm: every program has run once
        compiles = _metric(server, "dsv41_compile_events")
        alone += [_complete(http, ids, m) for ids, m in asks[2:]]

    async def together():
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            async def one(i, ids, m):
                await asyncio.sleep(0.15 * (i % 6))
                r = await http.post("/v1/completions", json={"prompt": ids, "max_tokens": m, "temperature": 0,
                                                             "return_token_ids": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]
            return await asyncio.gather(*(one(i, ids, m) for i, (ids, m) in enumerate(asks)))

    batched = asyncio.run(together())
    assert [len(a) for a in alone] == [m for _, m in asks]  # no end id in these (else the lengths differ)
    assert batched == alone
    assert _metric(server, "dsv41_compile_events") == compiles == STARTUP["compiles"]  # all at start-up


def test_disconnect_frees_the_slot(server):
    before = _metric(server, "vllm:generation_tokens_total")
    with httpx.Client(base_url=server, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": CONTEXT - 2,
                                                          "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]  # a couple of tokens (data lines and blank separators)
        assert any(line.startswith("data: ") for line in got)
        deadline = time.monotonic() + 30
        while httpx.get(server + "/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert httpx.get(server + "/health").json()["running"] == 0
    assert _metric(server, "vllm:generation_tokens_total") - before < CONTEXT - 2


def _wait_idle(server: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(server + "/health").json()
        if not health["running"] and not health["queued"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server never went idle: {health}")


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": [5, 6, 8]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_a_stream_whose_client_leaves_before_its_first_chunk_is_cancelled(server, route, body):
    """The client sends a streamed request and closes its socket at once: Starlette sees the disconnect before
    the response body starts, so the body's generator never runs; the request must still be cancelled (it ran
    all its max_tokens, holding its slot)."""
    before = _metric(server, "vllm:generation_tokens_total")
    max_tokens = CONTEXT - 40
    payload = json.dumps({**body, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    host, port = server.removeprefix("http://").split(":")
    for _ in range(3):  # three at once: each gone before its first chunk
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST {route} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                      f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
    _wait_idle(server)
    # Each ran at most until its cancel reached the engine thread (a few steps), never its max_tokens.
    assert _metric(server, "vllm:generation_tokens_total") - before < max_tokens


# ------------------------------------------------------------------------------------------ errors and load
def _nested(depth: int) -> dict:
    return {"properties": _nested(depth - 1)} if depth else {}


USER = {"role": "user", "content": "x"}
BAD = [  # (route, body: an object sent as JSON or raw bytes, the param the error must name)
    ("chat", b"{not json", None),
    ("chat", b"[1, 2]", None),
    ("chat", b"null", None),
    ("chat", b"[" * 100_000, None),  # deeper than Python's JSON reader recurses
    ("chat", {}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [5]}, "messages[0]"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]},
     "messages[0].content[0].image_url"),  # the tiny model has no vision tower (tests/test_serve_image_parts.py)
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ("chat", {"messages": [{"role": "tool", "content": "r", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]},
                           USER]}, "messages[0].tool_calls[0].function.arguments"),
    ("chat", {"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "x " * 1200}]}, "messages"),
    ("chat", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    ("chat", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content[0].text"),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "\\ud800": 1}', None),
    ("chat", {"messages": [USER], "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": [USER], "max_tokens": 10**6}, "max_tokens"),
    ("chat", {"messages": [USER], "max_tokens": 10**400}, "max_tokens"),
    ("chat", {"messages": [USER], "max_tokens": "ten"}, "max_tokens"),
    ("chat", {"messages": [USER], "max_tokens": 1.5}, "max_tokens"),
    ("chat", {"messages": [USER], "max_completion_tokens": -1}, "max_completion_tokens"),
    ("chat", {"messages": [USER], "temperature": "hot"}, "temperature"),
    ("chat", {"messages": [USER], "temperature": 5}, "temperature"),
    ("chat", {"messages": [USER], "temperature": -0.5}, "temperature"),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "temperature"),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}', "temperature"),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', "top_p"),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -Infinity}',
     "frequency_penalty"),
    ("chat", {"messages": [USER], "top_p": 0}, "top_p"),
    ("chat", {"messages": [USER], "n": 129}, "n"),
    ("chat", {"messages": [USER], "n": 0}, "n"),
    ("chat", {"messages": [USER], "seed": -1}, "seed"),
    ("chat", {"messages": [USER], "seed": 2**64}, "seed"),
    ("chat", {"messages": [USER], "stream": "yes"}, "stream"),
    ("chat", {"messages": [USER], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"messages": [USER], "stop": [5]}, "stop"),
    ("chat", b'{"messages": [{"role": "user", "content": "x"}], "stop": ["ok", "\\ud800"]}', "stop[1]"),
    ("chat", {"messages": [USER], "thinking": "yes"}, "thinking"),
    ("chat", {"messages": [USER], "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("chat", {"messages": [USER], "tools": [{"type": "function"}]}, "tools[0].function"),
    ("chat", {"messages": [USER], "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools[0].function.name"),
    ("chat", {"messages": [USER], "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]},
     "tools[0].function.parameters"),
    ("chat", {"messages": [USER], "tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                                              _nested(70)}}]}, "tools"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": [1, 2, 600]}, "prompt"),
    ("completions", {"prompt": [1, True]}, "prompt[1]"),
    ("completions", {"prompt": [[1, 2]]}, "prompt[0]"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1] * (CONTEXT + 1)}, "prompt"),
    ("completions", {"prompt": [1, 2], "max_tokens": CONTEXT}, "max_tokens"),
    ("completions", {"prompt": [1, 2], "return_token_ids": 1}, "return_token_ids"),
    ("completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    # fields not implemented: refused by name unless at their "off" value (the openai client's cases below)
    ("chat", {"messages": [USER], "logprobs": 0}, "logprobs"),  # not false: 0 == False only in Python
    ("chat", {"messages": [USER], "top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("chat", {"messages": [USER], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"messages": [USER], "logit_bias": {"5": 101}}, "logit_bias"),
    ("chat", {"messages": [USER], "logit_bias": {"512": 1}}, "logit_bias"),  # outside the vocabulary
    ("chat", {"messages": [USER], "logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"messages": [USER], "logit_bias": {"5": "1"}}, "logit_bias"),
    ("chat", {"messages": [USER], "logit_bias": [5]}, "logit_bias"),
    ("chat", {"messages": [USER], "min_p": 1.5}, "min_p"),
    ("chat", {"messages": [USER], "min_tokens": -1}, "min_tokens"),
    ("chat", {"messages": [USER], "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ("chat", {"messages": [USER], "ignore_eos": 1}, "ignore_eos"),
    ("chat", {"messages": [USER], "stop_token_ids": [5, 600]}, "stop_token_ids[1]"),
    ("chat", {"messages": [USER], "stop_token_ids": list(range(17))}, "stop_token_ids"),
    ("chat", {"messages": [USER], "presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"messages": [USER], "frequency_penalty": "1"}, "frequency_penalty"),
    ("chat", {"messages": [USER], "response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"messages": [USER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ("chat", {"messages": [USER], "tool_choice": "required"}, "tool_choice"),
    ("chat", {"messages": [USER], "tool_choice": "any"}, "tool_choice"),
    ("chat", {"messages": [USER], "repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"messages": [USER], "echo": True}, "echo"),  # a completions field: unknown to chat
    ("chat", {"messages": [USER], "chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs"),
    ("chat", {"messages": [USER], "top_k": -2}, "top_k"),
    ("chat", {"messages": [USER], "top_k": 1.5}, "top_k"),
    ("chat", {"messages": [USER], "stream_options": {"include_usage": True}}, "stream_options"),  # not a stream
    ("chat", {"messages": [USER], "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ("chat", {"messages": [USER], "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("completions", {"prompt": [1], "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": [1], "logprobs": True}, "logprobs"),
    ("completions", {"prompt": [1], "echo": True, "logprobs": 1}, "echo"),
    ("completions", {"prompt": [1], "best_of": 2, "n": 3}, "best_of"),  # fewer than n
    ("completions", {"prompt": [1], "best_of": 2, "stream": True}, "best_of"),
    ("completions", {"prompt": [1], "suffix": "x"}, "suffix"),
    ("completions", {"prompt": [1], "min_tokens": 17}, "min_tokens"),  # above the default max_tokens, 16
    ("completions", {"prompt": [1], "tools": []}, "tools"),  # a chat field: unknown to completions
    ("completions", {"prompt": [1], "foo": None}, "foo"),
]


def test_a_lone_surrogate_is_a_400_and_the_next_request_on_its_connection_is_served(server):
    """JSON's \\ud800 escape makes a string no Unicode text holds: it was a 500 from the tokenizer, the connection
    closed under the next request, and the 500 not counted."""
    with httpx.Client(base_url=server, timeout=60) as http:
        before = _requests_by_status(http).get(("chat", "400"), 0)
        bad = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "messages[0].content" and "surrogate" in bad.json()["error"]["message"]
        good = http.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 1})
        assert good.status_code == 200 and _local_port(good) == _local_port(bad)
        assert _requests_by_status(http)[("chat", "400")] == before + 1


def test_bad_requests_get_400_and_the_connection_lives(server):
    """Each mistake is a 400 with OpenAI's error body naming the field, on one keep-alive connection that every
    answer leaves open (a lone surrogate was a 500 that closed it); each is counted; the log has no traceback."""
    with httpx.Client(base_url=server, timeout=60) as http:
        before, ports = _requests_by_status(http), set()
        for route, body, param in BAD:
            path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
            r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["type"] == "invalid_request_error" and error["message"], (body, error)
            assert error["param"] == param, (body, error)
            assert "Traceback" not in r.text
            ports.add(_local_port(r))
        good = http.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 1})
        assert good.status_code == 200, good.text
        ports.add(_local_port(good))
        assert http.get("/health").json()["status"] == "ok"
        nowhere = http.get("/v1/nowhere")
        assert nowhere.status_code == 404 and nowhere.json()["error"]["type"] == "not_found_error"
        assert http.get("/v1/completions").status_code == 405
        ports.add(_local_port(nowhere))
        after = _requests_by_status(http)
    assert len(ports) == 1
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    n_chat = sum(route == "chat" for route, _, _ in BAD)
    assert delta == {("chat", "400"): n_chat, ("completions", "400"): len(BAD) - n_chat, ("chat", "200"): 1,
                     ("health", "200"): 1, ("other", "404"): 1, ("completions", "405"): 1, ("metrics", "200"): 1}
    assert not [line for line in SERVER_LOG if "Traceback" in line], "".join(SERVER_LOG)


def test_the_openai_client_gets_400s_naming_the_field(client):
    user = [{"role": "user", "content": "x"}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    weather = [{"type": "function", "function": {"name": "get_weather"}}]
    asks = [
        (client.chat.completions.create, dict(messages=user, top_logprobs=2), "top_logprobs"),
        (client.chat.completions.create, dict(messages=user, presence_penalty=3), "presence_penalty"),
        (client.chat.completions.create, dict(messages=user, frequency_penalty=-2.5), "frequency_penalty"),
        (client.chat.completions.create, dict(messages=user, logit_bias={"5": 200}), "logit_bias"),
        (client.chat.completions.create, dict(messages=user, response_format={"type": "json_object"}),
         "response_format"),
        (client.chat.completions.create, dict(messages=user, tools=weather, tool_choice="required"), "tool_choice"),
        (client.chat.completions.create, dict(messages=user, tools=weather, tool_choice={
            "type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
        (client.chat.completions.create, dict(messages=user, max_tokens=2, extra_body={"min_tokens": 3}),
         "min_tokens"),
        (client.chat.completions.create, dict(messages=user, extra_body={"min_p": -0.1}), "min_p"),
        (client.chat.completions.create, dict(messages=user, extra_body={"stop_token_ids": [-5]}),
         "stop_token_ids[0]"),
        (client.chat.completions.create, dict(messages=user, extra_body={"not_a_field": 1}), "not_a_field"),
        (client.completions.create, dict(prompt="x", logprobs=30), "logprobs"),
        (client.completions.create, dict(prompt="x", echo=True, logprobs=0), "echo"),
        (client.completions.create, dict(prompt="x", best_of=200), "best_of"),
        (client.completions.create, dict(prompt="x", suffix="!"), "suffix"),
        (client.completions.create, dict(prompt="x", presence_penalty=-3), "presence_penalty"),
        (client.completions.create, dict(prompt="x", extra_body={"repetition_penalty": -1.1}), "repetition_penalty"),
        (client.chat.completions.create, dict(messages=image), "messages[0].content[0].image_url"),
        (client.chat.completions.create, dict(messages=user, max_tokens=10**6), "max_tokens"),
        (client.chat.completions.create, dict(messages=user, n=-3), "n"),
        (client.chat.completions.create, dict(messages=user, stop=[5]), "stop"),
        (client.chat.completions.create, dict(messages=user, extra_body={"thinking": "on"}), "thinking"),
        (client.chat.completions.create, dict(messages=user, tools=[{"type": "function", "function": {"name": ""}}]),
         "tools[0].function.name"),
        (client.completions.create, dict(prompt=["one", "two"]), "prompt"),
        (client.completions.create, dict(prompt="x", temperature=-1), "temperature"),
    ]
    for create, ask, param in asks:
        with pytest.raises(openai.BadRequestError) as e:
            create(model="m", **ask)
        assert e.value.status_code == 400 and e.value.param == param and e.value.type == "invalid_request_error", \
            (ask, e.value.body)
        if param == "echo":
            assert "not supported by this server" in e.value.message, e.value.message
        if param in ("tool_choice", "response_format"):  # the tiny model folds the tokenizer's ids: no grammar
            assert "cannot be enforced by this server" in e.value.message, e.value.message
    assert client.chat.completions.create(model="m", messages=user, max_tokens=1).usage.completion_tokens == 1


def test_off_values_of_unimplemented_fields_mean_what_their_absence_means(client):
    """What OpenAI clients send by default (``logprobs: false``, penalties 0, ``n: 1``, ...) is accepted and
    changes nothing: greedy replies equal those of the bare request, the official client's defaults included."""
    user = [{"role": "user", "content": "Hi there"}]
    weather = [{"type": "function", "function": {"name": "get_weather"}}]
    bare = client.chat.completions.create(model="m", messages=user, max_tokens=6, temperature=0, tools=weather)
    off = client.chat.completions.create(
        model="m", messages=user, max_tokens=6, temperature=0, tools=weather, tool_choice="auto", logprobs=False,
        presence_penalty=0, frequency_penalty=0.0, n=1, logit_bias={}, response_format={"type": "text"},
        parallel_tool_calls=True, store=False, user="someone", top_p=1,
        extra_body={"top_k": -1, "repetition_penalty": 1, "min_p": 0, "ignore_eos": False, "stop_token_ids": [],
                    "min_tokens": 0, "best_of": 1})
    assert off.choices[0].message.content == bare.choices[0].message.content and off.usage == bare.usage
    ask = dict(model="m", prompt="Once upon", max_tokens=6, temperature=0)
    bare = client.completions.create(**ask)
    off = client.completions.create(**ask, echo=False, best_of=1, logprobs=None, presence_penalty=0,
                                    frequency_penalty=0, logit_bias={}, n=1, user="someone")
    assert off.choices[0].text == bare.choices[0].text
    # the official client's own defaults: only model and messages / prompt
    assert client.chat.completions.create(model="m", messages=user).choices[0].finish_reason in ("stop", "length")
    assert client.completions.create(model="m", prompt="x").usage.completion_tokens <= 16


def test_an_unknown_model_is_404_and_the_served_names_answer(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[USER], max_tokens=1)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and "gpt-4" in e.value.message
    assert set(e.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="dsv41-tiny", prompt="x", max_tokens=1)
    assert client.completions.create(model="alias", prompt="x", max_tokens=1).model == "alias"
    unnamed = httpx.post(server + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=60)
    assert unnamed.status_code == 200 and unnamed.json()["model"] == NAMES[0]


def test_stream_options_include_usage(client):
    """A stream ends with a usage chunk unless ``include_usage`` is false (then none: honoured, not ignored)."""
    ask = dict(model="m", prompt=[4, 5, 6], max_tokens=3, temperature=0, stream=True)
    for options, want in ((None, True), ({"include_usage": True}, True), ({"include_usage": False}, False)):
        extra = {} if options is None else {"stream_options": options}
        chunks = list(client.completions.create(**ask, **extra))
        usage = [c.usage for c in chunks if c.usage is not None]
        assert (usage[0].completion_tokens == 3 if want else not usage), (options, usage)
        assert chunks[-1 - want].choices[0].finish_reason == "length"


def test_top_k_one_is_greedy(server, client):
    """vLLM's ``top_k``: with k = 1 a hot sampler draws the argmax, the greedy tokens; off (-1) it does not."""
    def ids(**fields):
        r = httpx.post(server + "/v1/completions", timeout=60, json={
            "prompt": [9, 8, 7], "max_tokens": 12, "seed": 3, "return_token_ids": True, **fields})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    greedy = ids(temperature=0)
    assert ids(temperature=1.5, top_k=1) == greedy
    assert ids(temperature=1.5, top_k=-1) == ids(temperature=1.5) != greedy
    chat = dict(model="m", messages=[USER], max_tokens=8, seed=4)
    assert (client.chat.completions.create(**chat, temperature=2, extra_body={"top_k": 1}).choices[0].message.content
            == client.chat.completions.create(**chat, temperature=0).choices[0].message.content)


def test_load_queue_bound_and_metrics(server):
    """200 requests from 32 concurrent clients (streaming and not): each is answered 200 with exactly the
    tokens the prompt gets alone (none lost or repeated) or a clean 503 (queue full); the server is healthy
    after, its counters add up."""
    prompts = [(_ids_prompt(1 + k, 100 + k), 3) for k in range(4)]
    with httpx.Client(base_url=server, timeout=120) as http:
        want = [_complete(http, ids, m) for ids, m in prompts]
    tokenizer_text = {}
    start_requests = _metric(server, 'dsv41_requests_total{endpoint="completions"')

    async def client_loop(http, c, results):
        for i in range(c, 200, 32):
            ids, m = prompts[i % 4]
            body = {"prompt": ids, "max_tokens": m, "temperature": 0}
            if i % 2:
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    if r.status_code != 200:
                        results.append((i, r.status_code, json.loads(await r.aread())))
                        continue
                    chunks = [json.loads(line[6:]) async for line in r.aiter_lines()
                              if line.startswith("data: ") and line != "data: [DONE]"]
                    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
                    usage = chunks[-1]["usage"]
                    results.append((i, 200, (text, usage["completion_tokens"])))
            else:
                r = await http.post("/v1/completions", json={**body, "return_token_ids": True})
                results.append((i, r.status_code, r.json()))

    async def run():
        results = []
        async with httpx.AsyncClient(base_url=server, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as http:
            await asyncio.gather(*(client_loop(http, c, results) for c in range(32)))
        return results

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    assert len(results) == 200 and elapsed < 120
    with httpx.Client(base_url=server, timeout=60) as http:
        for ids, m in prompts:
            r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": m, "temperature": 0})
            tokenizer_text[tuple(ids)] = r.json()["choices"][0]["text"]
    ok = 0
    for i, status, payload in results:
        ids, m = prompts[i % 4]
        if status == 503:
            assert payload["error"]["code"] == "queue_full"
            continue
        assert status == 200, payload
        ok += 1
        if i % 2:
            assert payload == (tokenizer_text[tuple(ids)], m)
        else:
            assert payload["choices"][0]["token_ids"] == want[i % 4]
    assert ok >= SLOTS + QUEUE  # at least the first wave is served
    assert ok < 200  # 32 clients at once against 4 slots + 12 queued: some were refused at once
    assert httpx.get(server + "/health").json() == {"status": "ok", "running": 0, "queued": 0}
    assert _metric(server, 'dsv41_requests_total{endpoint="completions"') - start_requests == 200 + len(prompts)
    assert _metric(server, "vllm:time_to_first_token_seconds_count") >= ok
    assert _metric(server, "vllm:num_requests_waiting") == 0


def test_bad_flags_exit_2_with_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for flags in (["--max-batch", "0"], ["--port", "70000"], ["--nonsense"], ["--drain-timeout", "-1"],
                  ["--drain-timeout", "inf"], ["--served-model-name", "a,,b"], ["--api-key", ""],
                  ["--api-key", " k"]):
        r = subprocess.run([sys.executable, "-m", "dsv41_jax.serve", *flags], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr, r.stderr


def test_served_names():
    parse = build_parser().parse_args
    assert served_names(parse([])) == ("bard",)  # the embedded trained model
    assert served_names(parse(["--config", "tiny"])) == ("dsv41-tiny-random",)
    assert served_names(parse(["--layers", "2"])) == ("dsv41-2-layer-random",)
    assert served_names(parse(["--checkpoint", "/models/DeepSeek-V4.1-Flash/"])) == ("DeepSeek-V4.1-Flash",)
    assert served_names(parse(["--served-model-name", "a, b", "--served-model-name", "a"])) == ("a", "b")


def test_tool_calls_stream_as_openai_chunks():
    """A reply with a DSML tool call (the V4.1 format, rendered by chat.render_reply and tokenized by the real
    tokenizer) goes through the server's pipeline and SSE writer; the official client's chunk type reads a
    tool_calls delta with the call, and finish_reason tool_calls."""

    tokenizer, _ = load_tokenizer()
    reply = Message("assistant", "Let me look.", reasoning_content="Weather needs a tool.",
                    tool_calls=(ToolCall("get_weather", '{"city": "Paris", "days": 3}'),))
    ids = tokenizer.encode(render_reply(reply, thinking=True))
    pipeline = TextPipeline(tokenizer, (), chat=True, thinking=True)

    async def events():
        for i in ids[:-1]:  # the end id is not reported by the engine
            for e in pipeline.push(i):
                yield e
        for e in pipeline.finish():
            yield e
        yield Finish("stop", tuple(ids[:-1]))

    async def collect():
        return [line async for line in _chat_stream({"id": "x", "created": 0, "model": "m"}, _merged([events()]),
                                                    10)]

    lines = asyncio.run(collect())
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate(json.loads(line[6:])) for line in lines[:-1]]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert "".join(d.content or "" for d in deltas) == "Let me look."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "Weather needs a tool."
    assert chunks[-2].choices[0].finish_reason == "tool_calls" and chunks[-1].usage.completion_tokens == len(ids) - 1


def test_parallel_tool_calls_false_ends_the_reply_with_its_first_call():
    """Two DSML tool calls in one reply: with ``parallel_tool_calls: false`` the pipeline gives the first one only
    and stops (finish reason tool_calls), what follows never sent; by default both."""
    tokenizer, _ = load_tokenizer()
    reply = Message("assistant", "", tool_calls=(ToolCall("get_weather", '{"city": "Paris"}'),
                                                 ToolCall("get_time", '{"zone": "CET"}')))
    ids = tokenizer.encode(render_reply(reply, thinking=False))[:-1]

    def calls(one_call: bool):
        pipeline = TextPipeline(tokenizer, (), chat=True, one_call=one_call)
        events, pushed = [], 0
        for i in ids:
            events += pipeline.push(i)
            pushed += 1
            if pipeline.stop.stopped:  # as the server's loop: the generation is cancelled here
                break
        events += pipeline.finish()
        return [e.call.name for e in events if type(e).__name__ == "ToolCallEvent"], pushed

    assert calls(False) == (["get_weather", "get_time"], len(ids))
    names, pushed = calls(True)
    assert names == ["get_weather"] and pushed < len(ids)


def test_the_socket_accepts_connections_before_uvicorn_starts():
    """`serve` prints "listening on" once its socket listens: a client connecting right away waits in the backlog
    instead of being refused while uvicorn starts (a CI run saw the refusal when the socket was only bound)."""

    sock = listen("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass
    finally:
        sock.close()
