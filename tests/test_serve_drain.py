"""The server's drain on SIGTERM, against a real server process (tests/test_serve.py's flags: the tiny model, 4
slots, its start-up programs loaded from the compile cache that module's server filled).

Each case is one start: SIGTERM while every slot is streaming and requests wait for a slot. Default drain: each
running and queued request completes (a finish reason, no error event, ``[DONE]``), a new request gets a 503,
``/health`` says draining, and the process exits 0. ``--drain-timeout 0``: what is left is ended at once, each
stream with an error event and ``[DONE]``, each non-streamed request with a 503.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import CONTEXT, SLOTS, _ids_prompt, _start

httpx = pytest.importorskip("httpx")

RUNNING_TOKENS = 120  # a few seconds of decode steps on a CPU: the drain is probed meanwhile
QUEUED_TOKENS = 20


def _request(url: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    """One completion; what came back: status, and for a stream its data events (``[DONE]`` kept as a string)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    with httpx.Client(base_url=url, timeout=120) as http:
        if not stream:
            r = http.post("/v1/completions", json=body)
            return {"status": r.status_code, "body": r.json()}
        with http.stream("POST", "/v1/completions", json=body) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        return {"status": r.status_code, "events": [e if e == "[DONE]" else json.loads(e) for e in events]}


def _wait_for(url: str, running: int, queued: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health").json()
        if health["running"] == running and health["queued"] == queued:
            return
        time.sleep(0.01)
    raise AssertionError(f"never {running} running and {queued} queued: {health}")


def _sigterm_under_load(url: str, proc, asks) -> tuple[list, list]:
    """Send ``asks`` ((max_tokens, stream) each, in order: the first SLOTS take the slots), SIGTERM once they
    all run or wait; (their results, what the server answered meanwhile: /health and a new request)."""
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = []
        for k, (max_tokens, stream) in enumerate(asks):
            futures.append(pool.submit(_request, url, _ids_prompt(3 + k, 200 + k), max_tokens, stream))
            _wait_for(url, min(k + 1, SLOTS), max(0, k + 1 - SLOTS))
        proc.send_signal(signal.SIGTERM)
        health = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the signal is handled by the server's loop within a moment
            health = _get_or_gone(url + "/health")
            if health is None or health.status_code == 503:
                break
            time.sleep(0.01)
        late = _post_or_gone(url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
        return [f.result() for f in futures], [health, late]


def _get_or_gone(url: str):
    """The response, or None once the server has closed its socket (a short drain may end before a probe)."""
    try:
        return httpx.get(url)
    except httpx.TransportError:
        return None


def _post_or_gone(url: str, body: dict):
    try:
        return httpx.post(url, json=body, timeout=30)
    except httpx.TransportError:
        return None


def _serve(*flags):
    proc, url, lines = _start(*flags)
    log = list(lines)
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()
    return proc, url, log, reader


def _stop(proc) -> int:
    return proc.wait(60)


def _drained(asks, *flags):
    """A server (``flags``) SIGTERMed under ``asks`` (`_sigterm_under_load`): (results, /health, the late
    request, exit status, its log)."""
    proc, url, log, reader = _serve(*flags)
    try:
        results, (health, late) = _sigterm_under_load(url, proc, asks)
        code = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    return results, health, late, code, log


def test_sigterm_drains_running_and_queued_requests_then_exits_0():
    asks = [(RUNNING_TOKENS, True)] * SLOTS + [(QUEUED_TOKENS, True), (QUEUED_TOKENS, False), (QUEUED_TOKENS, True)]
    results, health, late, code, log = _drained(asks)
    assert health is not None and late is not None, "the server closed before the drain was probed"
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    assert health.json()["running"] == SLOTS  # the drain waited on work in flight
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
    for (max_tokens, stream), result in zip(asks, results):
        assert result["status"] == 200, result
        if stream:
            events = result["events"]
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
            finish = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]][-1]
            usage = events[-2]["usage"]
        else:
            finish, usage = result["body"]["choices"][0]["finish_reason"], result["body"]["usage"]
        assert finish in ("length", "stop") and (finish == "stop" or usage["completion_tokens"] == max_tokens)
    assert code == 0, "".join(log)
    assert any("draining" in line for line in log), "".join(log)
    assert not any("Traceback" in line for line in log), "".join(log)


def test_a_drain_timeout_ends_what_is_left_with_an_error_and_done():
    asks = [(CONTEXT - 20, True)] * SLOTS + [(QUEUED_TOKENS, False), (QUEUED_TOKENS, True)]
    results, health, late, code, log = _drained(asks, "--drain-timeout", "0")
    # with no drain time the process may be gone before a probe: then the probe finds the socket closed
    assert all(r is None or r.status_code == 503 for r in (health, late)), (health, late)
    for (max_tokens, stream), result in zip(asks, results):
        if stream:
            assert result["status"] == 200
            events = result["events"]
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
            assert "drain timeout" in events[-2]["error"]["message"]
        else:
            assert result["status"] == 503 and result["body"]["error"]["code"] == "shutting_down", result
    assert code == 0, "".join(log)
    assert any("drain timeout: ended" in line for line in log), "".join(log)
