"""DSpark speculative decoding (issue 17): greedy with speculation emits exactly the engine's greedy tokens, on
the random drafts (nearly every draft rejected), with the target's own tokens forced in as proposals (accept-all,
and a pattern of rejections that exercises every rollback length), and with forced wrong proposals (reject-all);
batches are ragged (prompt lengths and max new tokens differ). The rejection sampler's next-token distribution is
the target's (chi-square at a stated significance) at temperature 1 and with top-k / top-p.

The model is the 5-layer cut of the tiny config that keeps every layer role (window, full r=2, full r=1 as the
candidate source, reindex with candidates, reuse) plus the three stages, in float32 with the rounding points off,
so a 6-row verify step and 1-row decode steps agree to f32 summation order and greedy tokens match exactly.
The engram path is tests/test_speculative_engram.py's, worlds 2 and 4 tests/test_speculative_sharded.py's (files
of their own, so `pytest -n 2 --dist loadfile` runs them beside this one); both use this file's helpers.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_events import branching_programs
from flax import nnx
from jax.scipy.special import gammaincc

from dsv41_jax import speculative
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, EngineInputError, Request, fixed_segments
from dsv41_jax.model.cache import init_cache
from dsv41_jax.model.transformer import ModelOptions, Transformer
from dsv41_jax.sampling import SamplingParams, filtered_logits, sampling_arrays
from dsv41_jax.speculative import Speculator, accept

MAX_CONTEXT = 96
ALPHA = 1e-3  # chi-square significance: a correct sampler fails one run in a thousand


def spec_config(name: str = "tiny"):
    return load_named(name).replace(
        num_hidden_layers=5, compress_ratios=(0, 2, 1, 1, 1, 0, 0, 0), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2, dspark_target_layer_ids=(2, 3, 4))


@pytest.fixture(scope="module")
def setup():
    cfg = spec_config()
    model = Transformer(cfg, ModelOptions(dtype="float32", quant_rounding=False, dspark=True), rngs=nnx.Rngs(0))
    # The reference prefills row by row through the decode program (short_rows: one program, not three); the
    # speculator's prefill takes the segments (16 + 16 + 5 rows: the rings carried across segment programs).
    engine = Engine(model, cfg, max_context=MAX_CONTEXT, cache_dtype="float32", eos_ids=(),
                    segment_plan=lambda n: fixed_segments(n, 16), short_rows=16)
    requests = spec_requests(cfg)
    reference = engine.generate(requests)
    return cfg, engine, Speculator(engine), requests, reference


def spec_requests(cfg) -> list[Request]:
    """Three ragged greedy requests: prompts of 37, 20 and 9 ids, 40, 33 and 29 new tokens."""
    rng = np.random.default_rng(1)
    prompts = [tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n)) for n in (37, 20, 9)]
    return [Request(p, n) for p, n in zip(prompts, (40, 33, 29))]


def _oracle(requests, reference, batch_len=MAX_CONTEXT + 16):
    ref = np.zeros((len(requests), batch_len), np.int32)
    for i, (r, g) in enumerate(zip(requests, reference.generations)):
        seq = list(r.prompt_ids) + list(g.token_ids)
        ref[i, : len(seq)] = seq
    return ref


def stage_drafts(requests, reference):
    """The oracle that forces nothing (``use`` all False): every proposal is the stages' own draft, as with
    ``oracle=None``, through the forced paths' round program, so a test's random-draft and forced runs compile
    one round program instead of two (the oracle only selects the drafts after they are drawn:
    ``speculative._round_in``). The user's program (``oracle=None``) runs in the end-to-end sampling test here
    and greedy in ``tests/test_generate_cli.py`` (``--speculate dspark`` = ``off``)."""
    ref = _oracle(requests, reference)
    return ref, np.zeros(ref.shape, bool)


def _same(out, reference):
    for got, want in zip(out.generations, reference.generations, strict=True):
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason


def test_greedy_random_drafts_match_plain_greedy(setup):
    _, _, spec, requests, reference = setup
    out = spec.generate(requests, 5, oracle=stage_drafts(requests, reference))
    _same(out, reference)
    assert out.timings.rounds >= 28  # random drafts: ~1 token a round


def _forced_accept_all_then_partial(spec, requests, reference):
    """Proposals are the reference tokens (accept-all), then the same with every position ≡ b (mod 3 + b) left to
    the (wrong) draft, so rollbacks of every length happen in one batch: both emit the reference tokens."""
    ref = _oracle(requests, reference)
    out = spec.generate(requests, 5, oracle=(ref, np.ones(ref.shape, bool)))
    _same(out, reference)
    assert out.timings.tokens_per_round > 4.0  # the first draft is the stages' and last rounds are cut short
    use = np.ones(ref.shape, bool)
    for b in range(len(requests)):
        use[b, (np.arange(ref.shape[1]) % (3 + b)) == b] = False
    out = spec.generate(requests, 5, oracle=(ref, use))
    _same(out, reference)
    assert 1.5 < out.timings.tokens_per_round < 5.0


def test_forced_accept_all_and_partial_rejections(setup):
    """Proposals are the reference tokens (accept-all: 6 tokens a round), then the same with every position
    ≡ b (mod 3 + b) left to the (wrong) draft, so rollbacks of every length happen in one batch."""
    _, _, spec, requests, reference = setup
    _forced_accept_all_then_partial(spec, requests, reference)


def test_forced_reject_all_and_fewer_draft_tokens(setup):
    cfg, engine, spec, requests, reference = setup
    ref = (_oracle(requests, reference) + 1) % cfg.vocab_size  # every proposal wrong
    out = spec.generate(requests, 5, oracle=(ref, np.ones(ref.shape, bool)))
    _same(out, reference)
    assert out.timings.tokens_per_round == 1.0
    # 2 drafts: the speculator's cache holds max_context + 3 positions instead of + 6; on the same engine with a
    # context 3 longer it has 5's shape, so the prompt segments run 5's prefill programs (a copy shares the
    # engine's program table) and only the k = 2 start and round programs compile.
    longer = copy.copy(engine)
    longer.max_context = MAX_CONTEXT + 3
    before = longer.compile_count
    out = Speculator(longer).generate(requests, 2, oracle=(_oracle(requests, reference), np.ones(ref.shape, bool)))
    _same(out, reference)
    assert out.timings.tokens_per_round > 2.5
    assert longer.compile_count - before == 2


def test_refuses_bad_draft_tokens(setup):
    _, _, spec, requests, _ = setup
    with pytest.raises(EngineInputError, match="draft-tokens"):
        spec.generate(requests, 6)


# ----------------------------------------------------------------------------------------------- sampling
def _accept_distribution(params: SamplingParams, n: int, vocab: int = 6, k: int = 3, seed: int = 0):
    """Empirical distribution of the first token a round emits, over ``n`` seeds, for fixed target / draft
    logits; the drafts are drawn from the (filtered) draft distribution as the stages draw them. Returns
    (counts [V], the target's filtered probabilities of row 0 [V])."""
    rng = np.random.default_rng(seed)
    target = jnp.asarray(rng.normal(0, 1.5, (1, k + 1, vocab)), jnp.float32)
    draft = jnp.asarray(rng.normal(0, 1.5, (1, k, vocab)), jnp.float32)
    sampling = sampling_arrays([SamplingParams(params.temperature, params.top_k, params.top_p, s) for s in range(n)])
    sampling = jax.tree.map(jnp.asarray, sampling)

    @jax.jit
    def run(sampling, target, draft):  # logits as arguments: closed over, XLA constant-folds them (13 s)
        target_b, draft_b = jnp.broadcast_to(target, (n, k + 1, vocab)), jnp.broadcast_to(draft, (n, k, vocab))
        produced = jnp.ones((n,), jnp.int32)
        keys = jax.vmap(lambda kd: jax.random.wrap_key_data(kd, impl="threefry2x32"))(sampling.keys)
        keys = jax.vmap(lambda key: jax.random.fold_in(key, 99))(keys)
        q = filtered_logits(draft_b.reshape(-1, vocab), *(jnp.repeat(x, k) for x in
                                                           (sampling.temperature, sampling.top_k, sampling.top_p)))
        drafts = jax.vmap(lambda key, row: jax.random.categorical(key, row.reshape(k, vocab), axis=-1))(
            keys, q.reshape(n, k, vocab)).astype(jnp.int32)
        n_acc, fix = accept(target_b, drafts, draft_b, sampling, produced)
        return jnp.where(n_acc > 0, drafts[:, 0], fix), jnp.mean(n_acc)

    first, mean_acc = run(sampling, target, draft)
    p = jax.nn.softmax(filtered_logits(target[:, 0], jnp.full((1,), params.temperature),
                                       jnp.full((1,), params.top_k, jnp.int32), jnp.full((1,), params.top_p)))[0]
    return np.bincount(np.asarray(first), minlength=vocab), np.asarray(p, np.float64), float(mean_acc)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=4, top_p=0.9)],
                         ids=["t1", "topk-topp"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    counts, p, mean_acc = _accept_distribution(params, 20000)
    kept = p > 0
    assert counts[~kept].sum() == 0  # filtered-out tokens never come out
    expected = p[kept] * counts.sum()
    chi2 = float(np.sum((counts[kept] - expected) ** 2 / expected))
    pvalue = float(gammaincc((kept.sum() - 1) / 2, chi2 / 2))  # the chi-square survival function
    assert pvalue > ALPHA, (counts, expected)
    assert 0.2 < mean_acc  # the drafts are accepted sometimes: both branches of the sampler ran


def test_speculative_sampling_matches_the_target_end_to_end(setup, monkeypatch):
    """The whole path (stage drafts drawn after the filters, Markov-corrected, rejection-sampled against the
    6-row verify step): over N seeds of one prompt, the joint distribution of the first two tokens (the prompt's
    draw, then the first round's) is the target's, p(t0) · p(t1 | t0), at temperature 1 with top-k 4 (chi-square
    at ALPHA over the cells expecting ≥ 5, the rest pooled)."""
    cfg, engine, spec, requests, _ = setup
    # Power (measured on these weights): the random stages' drafts rarely fall in the target's top 4, so a sampler
    # that never accepts (t1 always from the residual) moves the pair distribution little. This 2-token prompt is
    # one after which drafts are accepted often enough (probability 0.29 after one of its four first tokens; 0.19
    # after the 9-token prompt used before): the never-accepting sampler moves the 16 cells by Cohen's w = 0.41,
    # which the test (15 degrees of freedom, ALPHA) catches with power 0.999 at n = 400 (1.000 at n = 600, a
    # half more of this test's time; the 9-token prompt needed n = 1500 for 0.98). A sampler drawing t1 from the
    # drafts (w ≈ 1) fails at any n.
    n, params = 400, dict(temperature=1.0, top_k=4)
    prompt = requests[0].prompt_ids[2:4]
    reqs = [Request(prompt, 2, SamplingParams(**params, seed=s)) for s in range(n)]
    # One round in flight: every sequence stops in the first round, and the second round the driver would queue
    # before reading it (ROUNDS_AHEAD) runs every row for nothing (a third of this test's time on CPU).
    monkeypatch.setattr(speculative, "ROUNDS_AHEAD", 1)
    out = spec.generate(reqs, 5)
    pairs = np.array([g.token_ids[:2] for g in out.generations])
    # The sampled round runs filters, draws and rejection sampling unconditionally: a device-side branch would
    # make each round wait on the host for its predicate (greedy batches take the argmax-only programs instead).
    assert branching_programs(engine) == []
    graphdef, state = nnx.split(engine_model(engine))

    @jax.jit
    def probs(ids):
        """ids [4, 3] -> the filtered next-token probabilities after 2 and after 3 ids, [4, 2, V]."""
        model = nnx.merge(graphdef, state)

        logits = model(ids, init_cache(cfg, ids.shape[0], MAX_CONTEXT, "float32"))[0][:, -2:]
        m = ids.shape[0] * 2
        f = filtered_logits(logits.reshape(m, -1), jnp.full((m,), 1.0), jnp.full((m,), 4, jnp.int32),
                            jnp.full((m,), 1.0))
        return jax.nn.softmax(f, axis=-1).reshape(logits.shape)

    # Both calls [4, 3] (one program): row 1 is p(t0) (causal: the third id is not seen), row 2 p(t1 | t0).
    p0 = np.asarray(probs(jnp.asarray([list(prompt) + [0]] * 4, jnp.int32)))[0, 0]
    firsts = np.flatnonzero(p0 > 0)
    assert len(firsts) <= 4  # top-k 4
    rows = [list(prompt) + [int(t)] for t in firsts]
    p1 = np.asarray(probs(jnp.asarray(rows + rows[:1] * (4 - len(rows)), jnp.int32)))[: len(firsts), 1]
    expected, observed = [], []
    for i, t0 in enumerate(firsts):
        for t1 in np.flatnonzero(p1[i] > 0):
            expected.append(n * p0[t0] * p1[i, t1])
            observed.append(int(np.sum((pairs[:, 0] == t0) & (pairs[:, 1] == t1))))
    assert sum(observed) == n  # no pair outside the filtered support
    expected, observed = np.array(expected), np.array(observed, float)
    big = expected >= 5
    e = np.append(expected[big], expected[~big].sum())
    o = np.append(observed[big], observed[~big].sum())
    e, o = (e, o) if e[-1] > 0 else (e[:-1], o[:-1])
    chi2 = float(np.sum((o - e) ** 2 / e))
    assert float(gammaincc((len(e) - 1) / 2, chi2 / 2)) > ALPHA, (o, e)


def engine_model(engine):
    """The model an engine runs (merged back from its state)."""
    return nnx.merge(engine.runtime.graphdef, engine.state.state())


def test_end_id_inside_a_round_stops_like_the_engine(setup):
    """An end id accepted mid-round ends the sequence there (the round's later tokens dropped), as the engine's
    step does; forced accept-all puts it mid-round."""
    _, engine, _, requests, reference = setup
    eos = reference.generations[0].token_ids[12]
    # The same engine with one end id: the programs take the end ids as an argument of the same shape ([1]; no
    # end id is passed as [-1]), so the copy runs `setup`'s compiled programs (a new Engine would trace and
    # compile them all again: 20 s).
    stopping = copy.copy(engine)
    stopping.eos_ids = (eos,)
    want = stopping.generate(requests)
    assert want.timings.programs_compiled == 0
    assert want.generations[0].finish_reason == "eos" and len(want.generations[0].token_ids) <= 13
    ref = _oracle(requests, reference)
    out = Speculator(stopping).generate(requests, 5, oracle=(ref, np.ones(ref.shape, bool)))
    _same(out, want)
