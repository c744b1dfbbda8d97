"""The server's error layer (`dsv41_jax.serve.errors`) where no user input can reach it: the real app on a real
uvicorn socket (in this process, on a thread) over a stub engine thread and a stub tokenizer that fail on
purpose, so an internal error is a 500 (or, mid-stream, an error event), counted in ``/metrics``, logged once,
and the keep-alive connection serves the next request. No model, no compile: this module takes a second.

The strict body reader is checked directly; what a user sends to the real server is in tests/test_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from dsv41_jax.engine import check_requests  # noqa: E402
from dsv41_jax.serve.app import ServerState, create_app  # noqa: E402
from dsv41_jax.serve.errors import BadRequest, read_json_object  # noqa: E402
from dsv41_jax.serve.metrics import Metrics  # noqa: E402

VOCAB, CONTEXT = 512, 64
FAIL_TEXT = "make the tokenizer fail"  # a prompt the stub tokenizer raises on
FAIL_ID = 13  # a generated id the stub decoder raises on


class _Decoder:
    def push(self, token: int) -> str:
        if token == FAIL_ID:
            raise RuntimeError("the stub decoder fails on purpose")
        return f"<{token}>"

    def flush(self) -> str:
        return ""


class _Tokenizer:
    vocab_size = VOCAB

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if text == FAIL_TEXT:
            raise RuntimeError("the stub tokenizer fails on purpose")
        return [1] + [3 + ord(c) % 100 for c in text]

    def stream(self, skip_special: bool = True) -> _Decoder:
        return _Decoder()


class _Worker:
    """Answers each request with ids 10, 11, ... (max_tokens of them) at once."""

    class slots:
        active, slots = 0, 4

        class engine:
            @staticmethod
            def check(requests):
                check_requests(requests, VOCAB, CONTEXT)

    queued, alive, draining = 0, True, False

    def __init__(self, silent: bool = False):
        self.cancelled, self.silent = [], silent  # silent: no event ever (a request waiting for a slot)

    def submit(self, request, loop, **job):
        events = asyncio.Queue()
        if self.silent:
            return 1, events
        for i in range(request.max_new_tokens):
            events.put_nowait(("token", 10 + i))
        events.put_nowait(("done", "length"))
        return 1, events

    def cancel(self, job_id):
        self.cancelled.append(job_id)


def _app(worker=None):
    return create_app(ServerState(worker or _Worker(), _Tokenizer(), Metrics({}), ("stub",), VOCAB, CONTEXT))


@pytest.fixture(scope="module")
def server():
    app = _app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert uv.started
    yield url
    uv.should_exit = True
    thread.join(10)


def _counts(http) -> dict[tuple[str, str], float]:
    text = http.get("/metrics").text
    return {(m[1], m[2]): float(m[3]) for m in
            re.finditer(r'dsv41_requests_total\{endpoint="(\w+)",status="(\d+)"\} (\S+)', text)}


def _local_port(response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_an_internal_error_is_one_logged_500_counted_and_the_connection_lives(server, capfd):
    with httpx.Client(base_url=server, timeout=30) as http:
        before = _counts(http)
        capfd.readouterr()
        bad = http.post("/v1/completions", json={"prompt": FAIL_TEXT, "max_tokens": 2})
        assert bad.status_code == 500
        error = bad.json()["error"]
        assert error["type"] == "server_error" and "RuntimeError" in error["message"], error
        good = http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == "<10><11>"
        assert _local_port(good) == _local_port(bad)  # the same keep-alive connection
        after = _counts(http)
    log = capfd.readouterr().err
    assert log.count("Traceback") == 1 and log.count("internal error on POST /v1/completions") == 1, log
    assert "the stub tokenizer fails on purpose" in log
    assert after[("completions", "500")] - before.get(("completions", "500"), 0) == 1
    assert after[("completions", "200")] - before.get(("completions", "200"), 0) == 1


def test_a_stream_that_fails_ends_with_an_error_event_and_done(server, capfd):
    """Ids 10, 11, 12 decode, 13 raises: the client gets the text before it, one error event and [DONE]; the
    status (200) was sent with the first chunk; the error is logged once; the connection serves the next one."""
    with httpx.Client(base_url=server, timeout=30) as http:
        capfd.readouterr()
        with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 6, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            port = _local_port(r)
        assert lines[-1] == "[DONE]"
        events = [json.loads(line) for line in lines[:-1]]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "<10><11><12>"
        assert events[-1]["error"]["type"] == "server_error"
        good = http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 1})
        assert good.status_code == 200 and _local_port(good) == port
    log = capfd.readouterr().err
    assert log.count("Traceback") == 1 and "the stub decoder fails on purpose" in log, log


def test_every_response_is_counted_by_endpoint_and_status(server):
    with httpx.Client(base_url=server, timeout=30) as http:
        before = _counts(http)
        assert http.get("/v1/nowhere").status_code == 404
        assert http.get("/v1/completions").status_code == 405
        assert http.post("/v1/completions", content=b"{").status_code == 400
        assert http.get("/v1/models").status_code == 200
        after = _counts(http)
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert delta == {("other", "404"): 1, ("completions", "405"): 1, ("completions", "400"): 1,
                     ("models", "200"): 1, ("metrics", "200"): 1}  # the first scrape is counted when answered


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "x"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_a_stream_whose_client_left_before_its_first_chunk_is_cancelled(path, body, spec, capfd):
    """The app called as an ASGI server calls it, the client gone by the time the response starts: under ASGI
    2.3 (uvicorn) the disconnect is there at once; under 2.4 the server raises OSError from ``send`` (Starlette:
    ClientDisconnect) before the body's generator starts, so no ``finally`` of it runs. Either way the request is
    cancelled (it held its slot to the end), and nothing is logged as an internal error. A real socket cannot
    order this reliably (tests/test_serve.py closes real sockets early)."""
    worker = _Worker(silent=True)
    app = _app(worker)
    payload = json.dumps({**body, "max_tokens": 3, "stream": True}).encode()
    inbox = [{"type": "http.request", "body": payload, "more_body": False}]
    sent = []

    async def receive():  # no suspension: the disconnect is there at once
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message):
        if spec == "2.4":
            raise OSError("the client is gone")
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    capfd.readouterr()
    asyncio.run(app(scope, receive, send))
    assert worker.cancelled == [1], sent
    assert "internal error" not in capfd.readouterr().err


@pytest.mark.parametrize("raw, param, words", [
    (b'{"a": {"b": ["x", "y\\ud800"]}}', "a.b[1]", "lone surrogate \\ud800"),
    (b'{"a": "\\udfff"}', "a", "lone surrogate \\udfff"),
    (b'{"a": {"\\ud800": 1}}', "a", 'the key "\\ud800" of a'),
    (b'{"a": [1, NaN]}', "a[1]", "NaN is not a JSON number"),
    (b'{"t": -Infinity}', "t", "-Infinity is not a JSON number"),
    (b'{"t": 1e999}', "t", "1e999 is not a JSON number"),
    (b'{"a": ' + b"[" * 63 + b"]" * 63 + b', "b": ' + b"[" * 64 + b"]" * 64 + b"}", "b", "b is nested deeper than 64"),
    (b"[" * 100000, None, "deeper than 64 levels"),
    (b'{"a": 1', None, "not valid JSON"),
    (b'{"a": "\xff"}', None, "not valid JSON"),
    (b"[1]", None, "must be a JSON object, got [1]"),
])
def test_the_body_reader_names_what_json_cannot_carry(raw, param, words):
    with pytest.raises(BadRequest) as e:
        read_json_object(raw)
    assert e.value.param == param and words in str(e.value), str(e.value)


def test_the_body_reader_keeps_what_json_carries():
    raw = '{"a": "a\\ud83d\\ude00b", "b": [1.5, -0.0, 1e308, 12345678901234567890], "c": {"d": null}}'
    assert read_json_object(raw.encode()) == {"a": "a\U0001F600b", "b": [1.5, -0.0, 1e308, 12345678901234567890],
                                              "c": {"d": None}}
