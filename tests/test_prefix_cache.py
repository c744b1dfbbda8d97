"""Prefix caching in the slot engine (`serve.prefix`): a prompt whose leading blocks match an earlier prompt's
starts its prefill from that prompt's snapshot, and its tokens equal a cold run's (same cut, same state).

Model: tests/test_engine.py's 5-layer cut of the tiny config (every layer role), float32, rounding points off,
16-row segments (the prefix blocks) and ``short_rows`` 8; and the engram model (configs/tiny_engram.json), whose
snapshots carry the host's hash history. What a hit saves is counted (prefill calls and rows), not timed.
"""

from __future__ import annotations

import numpy as np
import pytest
from compile_events import backend_compiles
from test_engine import mini_config

from dsv41_jax import make_tiny
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, Request, fixed_segments
from dsv41_jax.loading import build_model
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.sampling import SamplingParams
from dsv41_jax.serve.prefix import PrefixCache, Snapshot, block_hashes
from dsv41_jax.serve.slots import Job, SlotEngine

SLOTS = 2
GIB = 1 << 30


def _engine(cfg, max_context: int) -> Engine:
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
    return Engine(model, cfg, max_context=max_context, cache_dtype="float32", eos_ids=(),
                  segment_plan=lambda n: fixed_segments(n, 16), short_rows=8)


@pytest.fixture(scope="module")
def engine():
    engine = _engine(mini_config(), 96)
    SlotEngine(engine, SLOTS, prefix_cache=PrefixCache(GIB)).precompile()
    return engine


def _run(slots: SlotEngine, requests) -> list[tuple]:
    """Each request alone through ``slots``, one after another -> their tokens."""
    out = []
    for r in requests:
        got = []
        slots.add(Job(len(out), r, lambda kind, value: got.append(value) if kind == "token" else None))
        while slots.busy:
            slots.step()
        out.append(tuple(got))
    return out


def _prompts(seed: int):
    rng = np.random.default_rng(seed)
    shared = tuple(int(t) for t in rng.integers(3, 500, 40))  # 2 whole blocks and half of a third

    def own(n):
        return tuple(int(t) for t in rng.integers(3, 500, n))

    first = shared + own(10)  # 50 tokens: blocks 0-2 (48) stored
    return [first,
            shared + own(12),  # 52: its third block differs -> starts at 32
            first,  # the same prompt again: 48 of its 50 from the cache, 2 rows left
            first[:48],  # three whole blocks: at least one row is left to prefill -> starts at 32
            own(30)]  # nothing shared: a cold prefill


def test_prefix_hits_equal_a_cold_run_and_save_their_rows(engine):
    prompts = _prompts(0)
    requests = [Request(p, 6, SamplingParams() if i % 2 == 0 else SamplingParams(temperature=1.0, seed=i))
                for i, p in enumerate(prompts)]
    cold = SlotEngine(engine, SLOTS)
    cold_tokens = _run(cold, requests)
    cache = PrefixCache(GIB)
    warm = SlotEngine(engine, SLOTS, prefix_cache=cache)
    with backend_compiles() as compiles:
        warm_tokens = _run(warm, requests)
    assert compiles == []
    assert warm_tokens == cold_tokens
    assert cold.prefill_rows == sum(map(len, prompts))
    hits = [0, 32, 48, 32, 0]
    assert warm.prefill_rows == cold.prefill_rows - sum(hits)
    assert warm.prefill_calls == cold.prefill_calls - sum(h // 16 for h in hits)
    assert (cache.queries, cache.hits) == (sum(map(len, prompts)), sum(hits))
    # stored: the first prompt's blocks 0-2, the second's own block 2, own(30)'s block 0
    assert cache.stored == len(cache) == 5 and cache.bytes == 5 * warm.snapshot_bytes


def test_lru_eviction_within_the_budget(engine):
    """Room for two snapshots: the first prompt's blocks 0-2 leave blocks 1 and 2 (block 0, the oldest, evicted);
    a prompt sharing blocks 0-1 hits 32 tokens and touches block 1; one sharing block 0 only misses, and its own
    block 0 evicts block 2, now the least recently used."""
    slots = SlotEngine(engine, SLOTS, prefix_cache=PrefixCache(2 * SlotEngine(engine, SLOTS).snapshot_bytes))
    cache = slots.prefix_cache
    prompt = _prompts(1)[0]
    k0, k1, k2 = block_hashes(prompt, 16, 3)
    _run(slots, [Request(prompt, 2)])
    assert cache.keys() == [k1, k2] and cache.evicted == 1
    _run(slots, [Request(prompt[:40], 2)])
    assert cache.hits == 32 and cache.keys() == [k2, k1]
    _run(slots, [Request(prompt[:20], 2)])
    assert cache.hits == 32 and cache.keys() == [k1, k0] and cache.evicted == 2


def test_a_snapshot_larger_than_the_budget_turns_the_cache_off(engine):
    slots = SlotEngine(engine, SLOTS, prefix_cache=PrefixCache(1000))
    assert slots.prefix_cache is None and slots.fresh().prefix_cache is None


def test_prefix_cache_unit():
    """Keys name whole prefixes (a chain), LRU order, an oversized snapshot refused."""
    ids = list(range(3, 3 + 64))
    a, b = block_hashes(ids, 16, 3), block_hashes(ids[:16] + [9] * 16 + ids[32:], 16, 3)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # block 2's ids are equal, its prefix is not
    assert block_hashes(ids, 8, 2)[0] != block_hashes(ids, 16, 1)[0]  # the block size is in the chain
    cache = PrefixCache(100)
    snap = [Snapshot(16 * (k + 1), None, None, None, 40) for k in range(3)]
    for k in range(3):
        assert cache.put(a[k], snap[k])
    assert a[0] not in cache and cache.bytes == 80
    assert cache.lookup(a, 64) is snap[2] and cache.lookup(a[:1], 20) is None
    assert (cache.queries, cache.hits) == (84, 48)
    assert not cache.put(b[1], Snapshot(32, None, None, None, 101))


@pytest.mark.slow  # the engram variant; the text model's prefix hits run in make test
def test_engram_prefix_hits_equal_a_cold_run():
    """The engram model: a snapshot's hash history is the prefix's, so a warm start hashes the rest as a cold run
    does (equal tokens after 32 cached tokens)."""
    engine = _engine(load_named("tiny_engram"), 64)
    assert engine.hasher is not None
    base = np.random.default_rng(3).integers(3, 500, 8)
    shared = tuple(int(t) for t in np.concatenate([base, base[:4], base, base[:4], base]))  # 32, repeated n-grams
    requests = [Request(shared + (7, 8, 9), 5), Request(shared + (9, 8, 7, 6, 5), 5, SamplingParams(
        temperature=1.0, seed=2))]
    cold = _run(SlotEngine(engine, SLOTS), requests)
    warm = SlotEngine(engine, SLOTS, prefix_cache=PrefixCache(GIB))
    assert _run(warm, requests) == cold
    assert warm.prefix_cache.hits == 32 and warm.prefill_rows == 35 + 5
