"""Engine: segmented prefill and decode against an independent one-pass forward, batching, stopping, compiles.

The model is a 5-layer cut of the tiny config that keeps every layer role (window, full r=2, full r=1 as the
candidate source, reindex with candidates, reuse) so programs compile in seconds. It runs in float32 with the
§C.2 rounding points off: then segmentation and batching change only GEMM summation order (`MODEL.md` §D.4),
and logits agree to f32 rounding. Tolerance 2e-4 absolute on logits of magnitude ~5: f32 accumulation over
widths <= 512 through 5 layers leaves ~1e-5; the margin covers the sqrt-softplus router and sinkhorn mixes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_events import backend_compiles
from flax import nnx

from dsv41_jax import make_tiny
from dsv41_jax.config import load_named
from dsv41_jax.engine import Engine, EngineInputError, Request, fixed_segments
from dsv41_jax.loading import build_model
from dsv41_jax.model.cache import init_cache
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.runtime import Program, ProgramTable
from dsv41_jax.sampling import SamplingParams, filtered_logits, sample, sampling_arrays

LOGIT_ATOL = 2e-4
MAX_CONTEXT = 64


def mini_config():
    """Every layer role of the tiny config in 5 layers, no DSpark stages."""
    return load_named("tiny").replace(
        num_hidden_layers=5, compress_ratios=(0, 2, 1, 1, 1), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2, num_nextn_predict_layers=0,
        dspark_target_layer_ids=())


@pytest.fixture(scope="module")
def setup():
    cfg = mini_config()
    assert [cfg.role(i) for i in range(5)] == ["window", "full", "full", "reindex", "reuse"]
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
    rng = np.random.default_rng(1)
    prompts = [tuple(int(t) for t in rng.integers(3, cfg.vocab_size, n)) for n in (37, 20, 9)]
    return cfg, model, prompts


@pytest.fixture(scope="module")
def engine(setup):
    """16-row segments; segments of <= 15 rows run row by row through the decode program. Every test records
    logits so all share one set of compiled programs (recording is a static variant)."""
    cfg, model, _ = setup
    return Engine(model, cfg, max_context=MAX_CONTEXT, cache_dtype="float32", eos_ids=(),
                  segment_plan=lambda n: fixed_segments(n, 16), short_rows=15)


@pytest.fixture(scope="module")
def reference(setup):
    """Logits of one plain forward of prompt 0 + the engine's greedy continuation (independent of the engine)."""
    cfg, model, _ = setup
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids):
        return nnx.merge(graphdef, state)(ids, init_cache(cfg, 1, MAX_CONTEXT, "float32"))[0]

    return lambda ids: np.asarray(forward(state, jnp.asarray([ids], jnp.int32))[0])


def test_segmented_prefill_and_greedy_decode_match_one_forward(setup, engine, reference):
    cfg, _, prompts = setup
    prompt, steps = prompts[0], 8
    out = engine.generate([Request(prompt, steps)], record_logits=True)
    gen = out.generations[0]
    assert out.timings.segments == (16, 16, 5) and len(gen.token_ids) == steps and gen.finish_reason == "length"
    ref = reference(prompt + gen.token_ids[:-1])  # [37 + 7, V]
    np.testing.assert_allclose(out.prefill_logits, ref[: len(prompt)], atol=LOGIT_ATOL)
    np.testing.assert_allclose(out.decode_logits, ref[len(prompt) - 1 :], atol=LOGIT_ATOL)
    # Greedy decode: every token is the argmax of the one-pass logits at the row before it.
    assert list(gen.token_ids) == list(np.argmax(ref[len(prompt) - 1 :], axis=-1))


def test_row_by_row_prefill_equals_segments(setup, engine):
    _, _, prompts = setup
    segmented = engine.generate([Request(prompts[0], 4)], record_logits=True)
    engine.segment_plan, engine.short_rows = (lambda n: [1] * n), 1
    try:
        rows = engine.generate([Request(prompts[0], 4)], record_logits=True)
    finally:
        engine.segment_plan, engine.short_rows = (lambda n: fixed_segments(n, 16)), 15
    assert rows.timings.segments == (1,) * 37
    np.testing.assert_allclose(rows.prefill_logits, segmented.prefill_logits, atol=LOGIT_ATOL)
    assert rows.generations[0].token_ids == segmented.generations[0].token_ids


def test_ragged_batch_equals_one_by_one(setup, engine):
    _, _, prompts = setup
    steps = (6, 3, 5)  # per-sequence max new tokens
    batch = engine.generate([Request(p, n) for p, n in zip(prompts, steps)], record_logits=True)
    for i, (p, n) in enumerate(zip(prompts, steps)):
        alone = engine.generate([Request(p, n)], record_logits=True)
        assert batch.generations[i].token_ids == alone.generations[0].token_ids
        assert len(alone.generations[0].token_ids) == n
        if i == 0:  # the recorded (first) sequence's logits agree too
            np.testing.assert_allclose(batch.prefill_logits, alone.prefill_logits, atol=LOGIT_ATOL)
            np.testing.assert_allclose(batch.decode_logits, alone.decode_logits, atol=LOGIT_ATOL)


def test_stops_at_end_id_per_sequence(setup, engine):
    _, _, prompts = setup
    requests = [Request(p, 6) for p in prompts]
    free = engine.generate(requests, record_logits=True).generations
    stop_id = free[0].token_ids[2]  # make sequence 0's third token an end id
    engine.eos_ids = (stop_id,)
    try:
        stopped = engine.generate(requests, record_logits=True).generations
    finally:
        engine.eos_ids = ()
    assert stopped[0].token_ids == free[0].token_ids[:3] and stopped[0].finish_reason == "eos"
    for got, ref in zip(stopped[1:], free[1:]):  # the others run on, each to its own first end id
        cut = ref.token_ids.index(stop_id) + 1 if stop_id in ref.token_ids else len(ref.token_ids)
        assert got.token_ids == ref.token_ids[:cut]


def test_no_recompiles_while_generating(setup, engine):
    """After one greedy and one sampled request of each batch size, new prompt lengths, more new tokens and
    other sampling settings compile nothing: counted by JAX's own backend-compile events, not by the engine's
    table."""
    _, _, prompts = setup
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):  # warm (no-ops after the tests above)
        engine.generate([Request(prompts[0], 2, sampling)], record_logits=True)
    with backend_compiles() as compiles:
        count = engine.compile_count
        engine.generate([Request(prompts[0][:30], 12, SamplingParams(temperature=0.8, top_k=20, top_p=0.9))],
                        record_logits=True)
        engine.generate([Request(prompts[1][:11], 9, SamplingParams(temperature=1.3, seed=5))], record_logits=True)
        engine.generate([Request(prompts[1][:13], 5)], record_logits=True)
    assert compiles == [] and engine.compile_count == count


def test_seeded_sampling_is_reproducible_and_batch_independent(setup, engine):
    _, _, prompts = setup
    params = SamplingParams(temperature=1.0, top_k=50, seed=7)
    a = engine.generate([Request(prompts[2], 6, params)], record_logits=True).generations[0].token_ids
    b = engine.generate([Request(prompts[2], 6, params)], record_logits=True).generations[0].token_ids
    in_batch = engine.generate([Request(prompts[0], 2, SamplingParams(1.0, seed=3)), Request(prompts[1], 2),
                                Request(prompts[2], 6, params)], record_logits=True).generations[2].token_ids
    assert a == b == in_batch
    other_seed = engine.generate([Request(prompts[2], 6, SamplingParams(1.0, 50, 1.0, seed=8))],
                                 record_logits=True)
    assert other_seed.generations[0].token_ids != a  # 6 draws from ~50 candidates: a collision is ~50^-6


def test_the_runtime_api_alone_runs_the_engines_programs(setup, engine):
    """A prefill (the engine's segments: 16, 16, then 5 rows one at a time) and chained decode steps driven
    through the public `Runtime` API alone give the engine's tokens and recorded logits exactly, with the
    programs the engine compiled (none new)."""
    _, _, prompts = setup
    prompt, steps = prompts[0], 4
    want = engine.generate([Request(prompt, steps)], record_logits=True)
    rt, count = engine.runtime, engine.compile_count
    stop = rt.stop_inputs(engine.eos_ids, [steps])  # no sampling arrays: every sequence greedy
    cache, logits = rt.init_cache(1, MAX_CONTEXT), np.zeros((1, rt.vocab_size), np.float32)
    ids = np.asarray([prompt], np.int32)
    rows = []
    for start, size in [(0, 16), (16, 16)] + [(32 + i, 1) for i in range(5)]:
        out, _ = rt.prefill(cache, logits, ids[:, start:start + size], np.array([size], np.int32), stop,
                            record=True)
        cache, logits = out.cache, out.last_logits
        rows.append(rt.read(out.first)[:size])
    np.testing.assert_array_equal(np.concatenate(rows), want.prefill_logits)
    tokens, decode_rows, run = [int(rt.read(out.tokens)[0, 0])], [rows[-1][-1]], None
    for _ in range(steps - 1):
        args, _ = rt.step_args(out.cache, out.last_logits, out.tokens, out.lengths, out.keep_going, out.next_step,
                               stop)
        if run is None:  # looked up once, called every step
            run = rt.step_program(args, record=True)
        out = run(*args)
        tokens.append(int(rt.read(rt.fetch(out.tokens))[0, 0]))
        decode_rows.append(rt.read(out.first)[0])
    assert tuple(tokens) == want.generations[0].token_ids
    np.testing.assert_array_equal(np.stack(decode_rows), want.decode_logits)
    assert engine.compile_count == count


@pytest.mark.parametrize("request_, message", [
    (Request(()), "empty"),
    (Request((1, 2, 512)), "outside the model's vocabulary"),
    (Request((1,) * (MAX_CONTEXT + 1)), "longer than the context"),
    (Request((1,) * 60, 10), "does not fit the context"),
    (Request((1, 2), 0), "at least 1"),
])
def test_bad_requests_are_refused(engine, request_, message):
    with pytest.raises(EngineInputError, match=message):
        engine.check([request_])


# ------------------------------------------------------------------------------------------------ sampling
def _arrays(n, **kw):
    return sampling_arrays([SamplingParams(**kw, seed=i) for i in range(n)])


def test_greedy_and_top_k_1_are_argmax():
    logits = np.random.default_rng(0).normal(size=(4, 300)).astype(np.float32)
    want = np.argmax(logits, axis=-1)
    draw = jax.jit(sample)
    assert list(np.asarray(draw(logits, _arrays(4), jnp.int32(0)))) == list(want)
    assert list(np.asarray(draw(logits, _arrays(4, temperature=2.0, top_k=1), jnp.int32(3)))) == list(want)


def test_top_k_and_top_p_keep_the_right_sets():
    probs = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = np.log(probs)[None].repeat(2, axis=0).astype(np.float32)
    kept = np.isfinite(np.asarray(jax.jit(filtered_logits)(logits, np.ones(2, np.float32), np.array([3, 0]),
                                                            np.array([1.0, 0.8], np.float32))))
    assert kept[0].tolist() == [True, True, True, False, False]  # top-3
    assert kept[1].tolist() == [True, True, True, False, False]  # 0.5 + 0.2 < 0.8 <= 0.85: three tokens


def test_temperature_sampling_follows_the_softmax():
    """2,000 draws at temperature 2 from 4 tokens: frequencies within 4 standard errors of softmax(l / 2)."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))[None].repeat(2000, axis=0)
    draws = np.asarray(jax.jit(sample)(logits, _arrays(2000, temperature=2.0), jnp.int32(0)))
    want = np.exp(logits[0] / 2.0) / np.exp(logits[0] / 2.0).sum()
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.all(np.abs(freq - want) < 4 * np.sqrt(want * (1 - want) / len(draws)))


def test_program_table_compiles_each_program_once_per_shape():
    """Issue #13: the runtime's table of frozen Programs compiles a program once per static arguments and input
    shapes; a model program gets the graph definition bound and the state first (left out of the key)."""
    graphdef, state = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    table = ProgramTable(graphdef)
    scale = Program("scale", lambda x, *, k: x * k, static=("k",), model=False)
    apply = Program("apply", lambda g, s, x: nnx.merge(g, s)(x))
    x = np.ones((4, 2), np.float32)
    np.testing.assert_array_equal(np.asarray(table.run(scale, {"k": 3.0}, (x,))), 3 * x)
    table.run(scale, {"k": 3.0}, (x + 1,))
    assert len(table.compiled) == 1
    table.run(scale, {"k": 2.0}, (x,))
    table.run(scale, {"k": 2.0}, (x[:1],))
    assert len(table.compiled) == 3
    y = table.run(apply, {}, (state, x))
    np.testing.assert_allclose(np.asarray(y), x @ np.asarray(state["kernel"][...]) + np.asarray(state["bias"][...]),
                               rtol=1e-6)
    _, other = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
    table.run(apply, {}, (other, x))
    assert len(table.compiled) == 4 and sorted(key[0] for key in table.compiled) == ["apply"] + ["scale"] * 3


def test_programs_take_the_state_flat(setup, engine):
    """The programs' state argument flattens to the model's arrays in one step (no per-Variable flatten on each
    call) and gives back the same ``nnx.State``: same tree, the very same arrays."""
    _, model, _ = setup
    _, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(engine.state)
    assert len(leaves) == len(jax.tree.leaves(state)) and treedef.num_nodes == len(leaves) + 1
    assert jax.tree.structure(engine.state.state()) == jax.tree.structure(state)
    assert all(a is b for a, b in zip(jax.tree.leaves(engine.state.state()), jax.tree.leaves(state)))
