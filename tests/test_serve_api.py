"""The server's deployment surface against a real server process started with an API key (tests/test_serve.py's
flags and tiny model; its start-up programs come from the compile cache that module's server fills): the key
(from ``$DSV41_API_KEY``; ``--api-key`` is the same value, `api_key`), checked by the official `openai` client;
``/metrics`` (open without the key) under vLLM's names: responses by status, tokens, latencies, gauges.
"""

from __future__ import annotations

import threading
import time

import pytest
from test_serve import CONTEXT, SLOTS, _start, stop

from dsv41_jax.serve.__main__ import api_key, build_parser
from dsv41_jax.tokenizer import load_tokenizer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "sk-test-a-key-only-these-tests-know"
LOG: list[str] = []  # the server's output after start-up


@pytest.fixture(scope="module")
def server():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV41_API_KEY", KEY)
        proc, url, _ = _start()
    threading.Thread(target=lambda: LOG.extend(proc.stdout), daemon=True).start()
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _auth(key: str = KEY) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_the_right_key_is_served_a_wrong_or_missing_one_is_401(server, client):
    reply = client.chat.completions.create(model="dsv41-tiny-random", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2)
    assert reply.usage.completion_tokens == 2
    assert [m.id for m in client.models.list().data] == ["dsv41-tiny-random"]
    wrong = openai.OpenAI(base_url=server + "/v1", api_key=KEY + "x", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model="dsv41-tiny-random", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert set(e.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="dsv41-tiny-random", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for path in ("/v1/models", "/v1/nowhere"):  # before routing: an unknown path tells nothing without the key
        r = httpx.get(server + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server + "/v1/models", headers={"authorization": KEY}).status_code == 401  # no scheme
    assert httpx.get(server + "/v1/models", headers=_auth()).status_code == 200
    assert httpx.get(server + "/v1/nowhere", headers=_auth()).status_code == 404
    # probes and scrapers need no key; the 401s are counted
    assert httpx.get(server + "/health").json()["status"] == "ok"
    metrics = httpx.get(server + "/metrics")
    assert metrics.status_code == 200
    assert 'dsv41_requests_total{endpoint="chat",status="401"} 1' in metrics.text
    assert not [line for line in LOG if "Traceback" in line]


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.delenv("DSV41_API_KEY", raising=False)
    assert api_key(parse([])) is None
    assert api_key(parse(["--api-key", "k1"])) == "k1"
    monkeypatch.setenv("DSV41_API_KEY", "k2")
    assert api_key(parse([])) == "k2" and api_key(parse(["--api-key", "k1"])) == "k1"  # the flag wins
    monkeypatch.setenv("DSV41_API_KEY", "")
    assert api_key(parse([])) is None  # set but empty: none


def _scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics: ``name{labels}`` -> value."""
    samples = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


MODEL = 'model_name="dsv41-tiny-random"'


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_metrics_count_every_status_tokens_and_latencies_under_vllm_names(server, client):
    before = _scrape(server)
    lengths = []
    for n in (2, 3, 4):
        r = client.completions.create(model="dsv41-tiny-random", prompt=[5] * n, max_tokens=n, temperature=0)
        lengths.append((n, r.usage.completion_tokens, r.choices[0].finish_reason))
    streamed = list(client.completions.create(model="dsv41-tiny-random", prompt=[6, 7], max_tokens=5,
                                              temperature=0, stream=True))
    usage = streamed[-1].usage
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="dsv41-tiny-random", prompt="x", temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    assert httpx.get(server + "/v1/models").status_code == 401
    delta = _delta(before, _scrape(server))
    generated = sum(c for _, c, _ in lengths) + usage.completion_tokens
    assert all(reason == "length" for *_, reason in lengths)
    assert delta[f"vllm:prompt_tokens_total{{{MODEL}}}"] == 2 + 3 + 4 + 2
    assert delta[f"vllm:generation_tokens_total{{{MODEL}}}"] == generated
    assert delta[f'vllm:request_success_total{{{MODEL},finished_reason="length"}}'] == 4
    assert delta[f"vllm:time_to_first_token_seconds_count{{{MODEL}}}"] == 4
    assert delta[f"vllm:e2e_request_latency_seconds_count{{{MODEL}}}"] == 4
    assert delta[f"vllm:inter_token_latency_seconds_count{{{MODEL}}}"] == generated - 4
    assert delta[f'vllm:time_to_first_token_seconds_bucket{{{MODEL},le="+Inf"}}'] == 4
    counted = {k: v for k, v in delta.items() if k.startswith("dsv41_requests_total")}
    assert counted == {'dsv41_requests_total{endpoint="completions",status="200"}': 4,
                       'dsv41_requests_total{endpoint="completions",status="400"}': 1,
                       'dsv41_requests_total{endpoint="completions",status="404"}': 1,
                       'dsv41_requests_total{endpoint="models",status="401"}': 1,
                       'dsv41_requests_total{endpoint="metrics",status="200"}': 1}


def test_gauges_show_running_waiting_and_cache_usage(server):
    """4 slots taken by long streams and one request waiting: the gauges say so, and the cache usage is the
    positions the requests hold over slots x context; closing the streams brings all three back to 0."""
    with httpx.Client(base_url=server, headers=_auth(), timeout=60) as http:
        streams, lines = [], []
        for k in range(SLOTS + 1):
            body = {"prompt": [9 + k] * 10, "max_tokens": CONTEXT - 20, "temperature": 0, "stream": True}
            stream = http.stream("POST", "/v1/completions", json=body)
            r = stream.__enter__()
            streams.append(stream)
            if k < SLOTS:  # a first token: it holds its slot
                lines.append(r.iter_lines())
                next(line for line in lines[-1] if line.startswith("data: "))
        try:
            samples = _scrape(server)
            assert samples[f"vllm:num_requests_running{{{MODEL}}}"] == SLOTS
            assert samples[f"vllm:num_requests_waiting{{{MODEL}}}"] == 1
            usage = samples[f"vllm:kv_cache_usage_perc{{{MODEL}}}"]
            # each slot holds its 10 prompt positions and at least its first token, at most a few seconds' more
            assert SLOTS * 11 / (SLOTS * CONTEXT) <= usage < 0.9, usage
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
    for _ in range(200):
        samples = _scrape(server)
        if samples[f"vllm:num_requests_running{{{MODEL}}}"] == 0:
            break
        time.sleep(0.05)
    assert samples[f"vllm:num_requests_running{{{MODEL}}}"] == 0
    assert samples[f"vllm:num_requests_waiting{{{MODEL}}}"] == 0
    assert samples[f"vllm:kv_cache_usage_perc{{{MODEL}}}"] == 0
    assert samples[f'vllm:request_success_total{{{MODEL},finished_reason="abort"}}'] >= SLOTS + 1


def test_tokenize_and_detokenize_as_vllm(server, client):
    """vLLM's shapes: /tokenize of a prompt gives the ids a completion runs (its usage counts them), of messages
    the chat prompt's; /detokenize gives the text back; they need the key; mistakes are 400s naming the field."""
    with httpx.Client(base_url=server, headers=_auth(), timeout=60) as http:
        r = http.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True})
        assert r.status_code == 200, r.text
        out = r.json()
        assert set(out) == {"count", "max_model_len", "tokens", "token_strs"} and out["max_model_len"] == CONTEXT
        assert out["count"] == len(out["tokens"]) == len(out["token_strs"])
        done = client.completions.create(model="dsv41-tiny-random", prompt="Hello there", max_tokens=1)
        assert done.usage.prompt_tokens == out["count"]
        by_ids = client.completions.create(model="dsv41-tiny-random", prompt=out["tokens"], max_tokens=3,
                                           temperature=0, extra_body={"return_token_ids": True})
        by_text = client.completions.create(model="dsv41-tiny-random", prompt="Hello there", max_tokens=3,
                                            temperature=0)
        assert by_ids.choices[0].text == by_text.choices[0].text  # the same ids run
        bare = http.post("/tokenize", json={"prompt": "Hello there", "add_special_tokens": False}).json()
        assert bare["tokens"] == out["tokens"][1:] and bare["token_strs"] is None
        # the tiny model folds the tokenizer's ids into its 512 (id mod 512): ids 0..511 are the tokenizer's own,
        # and a reply's ids read back as the reply's text
        tokenizer, _ = load_tokenizer()
        ids = by_ids.choices[0].model_extra["token_ids"]
        back = http.post("/detokenize", json={"tokens": ids})
        assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(ids, skip_special=False)}
        if tokenizer.decode(ids, skip_special=True) == back.json()["prompt"]:  # no special token among them
            assert back.json()["prompt"] == by_ids.choices[0].text
        assert "".join(out["token_strs"]) == tokenizer.decode(out["tokens"], skip_special=False) or \
            "\ufffd" in "".join(out["token_strs"])  # per token, a split character shows as U+FFFD
        messages = [{"role": "user", "content": "Hi"}]
        chat = http.post("/tokenize", json={"model": "dsv41-tiny-random", "messages": messages}).json()
        reply = client.chat.completions.create(model="dsv41-tiny-random", messages=messages, max_tokens=1)
        assert chat["count"] == reply.usage.prompt_tokens
        thinking = http.post("/tokenize", json={"messages": messages, "reasoning_effort": "low"}).json()
        assert thinking["count"] > chat["count"]
        for path, body, param in [("/tokenize", {"prompt": "x", "messages_": []}, "messages_"),
                                  ("/tokenize", {"prompt": 5}, "prompt"),
                                  ("/tokenize", {"messages": messages, "add_generation_prompt": False},
                                   "add_generation_prompt"),
                                  ("/detokenize", {"tokens": [1, 512]}, "tokens[1]"),
                                  ("/detokenize", {}, "tokens")]:
            r = http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        missing = http.post("/tokenize", json={"prompt": "x", "model": "gpt-4"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.post(server + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(server + "/detokenize", json={"tokens": [1]}).status_code == 401
