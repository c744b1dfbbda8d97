"""The request fields computed inside the device step (`dsv41_jax.sampling`), against a real server process
(tests/test_serve.py's flags and tiny model, its programs from the compile cache) through the official `openai`
client: ``logprobs`` / ``top_logprobs`` (chat and completions, OpenAI's shapes, streamed and not), ``min_p``,
``logit_bias``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, the presence / frequency / repetition
penalties.

Exactness: a greedy request's tokens are the same whichever step variant runs it (the argmax-only step, or the
step with the sampling arrays that every one of these fields needs), and a request's tokens and log-probs are the
same alone and among others (float32, rounding points off: batching changes at most the summation order, so the
log-probs agree to 1e-5).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import _start, stop

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

EOS = 1  # configs/tiny.json's end id
MODEL = "dsv41-tiny-random"


@pytest.fixture(scope="module")
def server():
    proc, url, _ = _start()
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def _ids(client, prompt=(9, 8, 7), max_tokens=8, **fields):
    """(generated ids, finish reason, the choice) of a completion; vLLM's fields go in ``extra_body``."""
    extra = {k: fields.pop(k) for k in ("min_p", "stop_token_ids", "ignore_eos", "min_tokens", "top_k",
                                        "repetition_penalty") if k in fields}
    r = client.completions.create(model=MODEL, prompt=list(prompt), max_tokens=max_tokens,
                                  extra_body={"return_token_ids": True, **extra}, **fields)
    choice = r.choices[0]
    return choice.model_extra["token_ids"], choice.finish_reason, choice


# ------------------------------------------------------------------------------------------ logprobs
def test_completion_logprobs_shape_and_greedy_exactness(client):
    plain, _, _ = _ids(client, temperature=0)
    ids, _, choice = _ids(client, temperature=0, logprobs=3)
    assert ids == plain  # the arrays' step draws what the argmax-only step draws
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    offset = 0
    for token, logprob, top, start in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert start == offset
        offset += len(token)
        assert token in top and len(top) <= 4  # the 3 most likely and the drawn one (fewer: texts alike)
        assert logprob == max(top.values()) <= 0  # greedy: the drawn token is the most likely
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
    _, _, none = _ids(client, temperature=0, logprobs=0)
    assert all(len(top) == 1 for top in none.logprobs.top_logprobs)  # its own only
    assert none.logprobs.token_logprobs == lp.token_logprobs


def test_sampled_logprobs_change_nothing_and_stream_as_whole(client):
    ask = dict(temperature=1.3, seed=21, max_tokens=10)
    plain, _, _ = _ids(client, **ask)
    ids, _, choice = _ids(client, **ask, logprobs=2)
    assert ids == plain
    lp = choice.logprobs
    assert all(logprob <= max(top.values()) + 1e-6 for logprob, top in zip(lp.token_logprobs, lp.top_logprobs))
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=[9, 8, 7], stream=True,
                                                              logprobs=2, **ask) if c.choices]
    streamed = [x for c in chunks if c.logprobs for x in zip(c.logprobs.tokens, c.logprobs.token_logprobs,
                                                             c.logprobs.text_offset)]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))
    assert "".join(c.text for c in chunks) == choice.text


def test_chat_logprobs_shape_stream_and_alone_equals_among_others(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=8, temperature=0,
               logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob
        assert entry.token == entry.top_logprobs[0].token and bytes(entry.bytes).decode("utf-8", "replace") == \
            entry.token
    streamed = [e for c in client.chat.completions.create(**ask, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**{k: v for k, v in ask.items() if "logprobs" not in k})
    assert plain.choices[0].message.content == whole.choices[0].message.content
    assert plain.choices[0].logprobs is None

    def noise(seed):  # sampled neighbours in the other slots
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Noise"}],
                                              max_tokens=12, temperature=1.0, seed=seed, logprobs=seed % 2 == 0)

    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(noise, s) for s in range(3)]
        together = pool.submit(client.chat.completions.create, **ask).result()
        [o.result() for o in others]
    mine = together.choices[0].logprobs.content
    assert [e.token for e in mine] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(mine, content)) < 1e-5


# ------------------------------------------------------------------------------------------ logits processors
def test_min_p_one_keeps_only_the_most_likely(client):
    greedy, _, _ = _ids(client, temperature=0, max_tokens=10)
    assert _ids(client, temperature=2.0, seed=5, max_tokens=10, min_p=1.0)[0] == greedy
    hot = _ids(client, temperature=2.0, seed=5, max_tokens=10)[0]
    assert _ids(client, temperature=2.0, seed=5, max_tokens=10, min_p=0.0)[0] == hot != greedy


def test_logit_bias_moves_the_draw(client):
    greedy, _, _ = _ids(client, temperature=0, max_tokens=6)
    forced = 300
    assert forced not in greedy[:1] and forced != EOS
    assert _ids(client, temperature=0, max_tokens=6, logit_bias={str(forced): 100})[0] == [forced] * 6
    assert _ids(client, temperature=0.8, seed=3, max_tokens=6, logit_bias={str(forced): 100})[0] == [forced] * 6
    banned, _, _ = _ids(client, temperature=0, max_tokens=6, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0] and greedy[0] not in banned
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    biased = client.chat.completions.create(**chat, logit_bias={str(forced): 100}, logprobs=True)
    assert biased.usage.completion_tokens == 4
    assert len({bytes(e.bytes) for e in biased.choices[0].logprobs.content}) == 1  # one token, four times


def test_stop_token_ids_end_the_reply_as_an_end_id(client):
    free, _, _ = _ids(client, temperature=0, max_tokens=12)
    stop = free[4]
    k = free.index(stop)
    ids, reason, _ = _ids(client, temperature=0, max_tokens=12, stop_token_ids=[stop])
    assert (ids, reason) == (free[:k], "stop")
    streamed = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt=[9, 8, 7], max_tokens=12, temperature=0, stream=True,
        extra_body={"stop_token_ids": [stop]}) if c.choices]
    assert streamed[-1].finish_reason == "stop"


def test_ignore_eos_and_min_tokens(client):
    end = {str(EOS): 100}  # the end id first, at every step
    assert _ids(client, temperature=0, logit_bias=end)[:2] == ([], "stop")
    assert _ids(client, temperature=0, max_tokens=5, logit_bias=end, ignore_eos=True)[:2] == ([EOS] * 5, "length")
    ids, reason, _ = _ids(client, temperature=0, max_tokens=8, logit_bias=end, min_tokens=3)
    assert len(ids) == 3 and EOS not in ids and reason == "stop"
    ids, reason, _ = _ids(client, temperature=1.0, seed=2, max_tokens=8, logit_bias={"300": 100},
                          stop_token_ids=[300], min_tokens=2)
    assert len(ids) == 2 and 300 not in ids and reason == "stop"  # min_tokens holds the stop ids back too
    # greedy with min_tokens 0 and the others neutral: the bare greedy tokens (neutral processors change nothing)
    bare, _, _ = _ids(client, temperature=0, max_tokens=8)
    assert _ids(client, temperature=0, max_tokens=8, min_tokens=0, ignore_eos=False, logit_bias={"5": 0})[0] == bare


# ------------------------------------------------------------------------------------------ penalties
def test_penalties_change_the_draws_and_are_the_same_alone_and_among_others(client):
    """Greedy: a huge repetition penalty repeats no id of the prompt or the reply (the plain reply does), the
    presence and frequency penalties change the reply, and neutral penalties change nothing; a penalised
    request among penalised and plain neighbours (the slot engine counts every slot's tokens on the device)
    gets the tokens it gets alone. The processors' arithmetic: tests/test_sampling.py; the counts the slots
    keep: tests/test_serve_slots.py."""
    prompt = [9, 8, 7]
    bare, _, _ = _ids(client, prompt, max_tokens=16, temperature=0)
    assert len(set(bare)) < len(bare)  # the plain greedy reply repeats itself
    no_repeat, _, _ = _ids(client, prompt, max_tokens=16, temperature=0, repetition_penalty=100.0)
    assert len(set(no_repeat)) == len(no_repeat) and not set(no_repeat) & set(prompt)
    ask = dict(max_tokens=16, temperature=0, frequency_penalty=1.5, presence_penalty=0.5)
    alone, _, _ = _ids(client, prompt, **ask)
    assert alone != bare and len(set(alone)) > len(set(bare))
    assert _ids(client, prompt, max_tokens=16, temperature=0, frequency_penalty=0.0, presence_penalty=0,
                repetition_penalty=1.0)[0] == bare

    def other(k):
        penalty = {"presence_penalty": 1.0} if k % 2 else {}
        return _ids(client, [5 + k, 6], max_tokens=20, temperature=0.9, seed=k, **penalty)

    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(other, k) for k in range(3)]
        together = pool.submit(_ids, client, prompt, **ask).result()[0]
        [o.result() for o in others]
    assert together == alone
    sampled = dict(max_tokens=16, temperature=1.0, seed=8, presence_penalty=2.0)
    assert _ids(client, prompt, **sampled)[0] == _ids(client, prompt, **sampled)[0]  # seeded: the same draws


# ------------------------------------------------------------------------------------------ n > 1
def test_n_choices_are_each_the_request_alone_with_its_seed(client):
    """``n`` choices: each its own slot and seed (seed + i), so choice i is the request alone with seed + i;
    greedy choices are equal; streamed, each choice's chunks (by index) add up to its whole; usage counts the
    prompt once and every choice's tokens."""
    ask = dict(model=MODEL, prompt=[9, 8, 7], max_tokens=10, temperature=1.0)
    many = client.completions.create(**ask, n=3, seed=40, logprobs=1, extra_body={"return_token_ids": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, choice in enumerate(many.choices):
        alone = client.completions.create(**ask, seed=40 + i, logprobs=1, extra_body={"return_token_ids": True})
        assert choice.model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
        assert choice.text == alone.choices[0].text and choice.logprobs.tokens == alone.choices[0].logprobs.tokens
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.prompt_tokens == 3 and many.usage.completion_tokens == 30
    texts = ["", "", ""]
    finishes = {}
    for chunk in client.completions.create(**ask, n=3, seed=40, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == [c.text for c in many.choices] and finishes == {0: "length", 1: "length", 2: "length"}
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6)
    greedy = client.chat.completions.create(**chat, temperature=0, n=2)
    assert len(greedy.choices) == 2 and greedy.choices[0].message.content == greedy.choices[1].message.content
    streamed: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(**chat, temperature=0.9, seed=3, n=2, stream=True):
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    whole = client.chat.completions.create(**chat, temperature=0.9, seed=3, n=2)
    assert streamed == {c.index: c.message.content for c in whole.choices} and usage == whole.usage


def test_echo_puts_the_prompt_before_the_completion(client):
    ask = dict(model=MODEL, max_tokens=5, temperature=0)
    plain = client.completions.create(prompt="Once upon", **ask).choices[0].text
    echoed = client.completions.create(prompt="Once upon", echo=True, **ask)
    assert echoed.choices[0].text == "Once upon" + plain and echoed.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="Once upon", echo=True,
                                                                            stream=True, **ask) if c.choices)
    assert streamed == echoed.choices[0].text
    by_ids = client.completions.create(prompt=[300, 301], echo=True, **ask).choices[0]
    plain_ids = client.completions.create(prompt=[300, 301], **ask).choices[0].text
    assert by_ids.text.endswith(plain_ids) and len(by_ids.text) > len(plain_ids)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          parallel_tool_calls=False, temperature=0)
    assert chat.usage.completion_tokens == 3  # accepted; no tool call to cut in a random model's reply


def test_best_of_returns_the_most_likely_of_its_generations(client):
    """best_of 4, n 2: the 2 of the 4 generations (seed + i each, as n = 4 would give) whose tokens' log-probs
    add up highest, best first; usage counts all 4."""
    ask = dict(model=MODEL, prompt=[9, 8, 7], max_tokens=6, temperature=1.2, seed=50)
    four = client.completions.create(**ask, n=4, logprobs=0)
    ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(**ask, n=2, best_of=4)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == four.usage.completion_tokens == 24
    with_logprobs = client.completions.create(**ask, n=2, best_of=4, logprobs=1)
    assert [c.logprobs.token_logprobs for c in with_logprobs.choices] == \
        [c.logprobs.token_logprobs for c in ranked[:2]]
