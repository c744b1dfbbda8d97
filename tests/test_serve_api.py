"""The server's deployment surface against a real server process started with an API key (tests/test_serve.py's
flags and tiny model; its start-up programs come from the compile cache that module's server fills): the key
(from ``$DSV41_API_KEY``; ``--api-key`` is the same value, `api_key`), checked by the official `openai` client.
"""

from __future__ import annotations

import subprocess
import threading

import pytest
from test_serve import _start

from dsv41_jax.serve.__main__ import api_key, build_parser

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
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


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
