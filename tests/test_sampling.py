"""The sampling filters (`sampling.filtered_logits`) against a float64 NumPy ranking of the whole row.

The kept sets must be those of the definition: top-k, then the smallest set of top-p mass, ties at the cut kept,
nothing dropped without a filter. Rows: peaked (a few hundred tokens hold the mass) and flat (top-p needs most of
a 20,000-entry vocabulary) distributions, both filters, neither, ties, -inf entries. Exactness: the reference
works in float64; each row's top-p cut is checked to lie at least 1e-5 of probability mass away from a float32
rounding flip (asserted on the reference side).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dsv41_jax.sampling import (
    SamplingError,
    SamplingParams,
    filtered_logits,
    processed_logits,
    sample,
    sampling_arrays,
    token_logprobs,
)

VOCAB = 20_000
MARGIN = 1e-5


def reference_kept(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """kept [V] bool by the definition, on the whole row sorted in float64."""
    scaled = logits.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    if top_k == 0 and top_p == 1.0:
        return np.ones(scaled.shape, bool)
    ranked = -np.sort(-scaled)
    k = min(top_k, len(ranked)) if top_k > 0 else len(ranked)
    top = ranked[:k]
    probs = np.exp(top - top[0]) / np.exp(top - top[0]).sum()
    mass_before = np.cumsum(probs) - probs
    kept = mass_before < top_p
    n = int(kept.sum())
    if top_p < 1.0 and n < k:  # the cut: mass_before[n - 1] < top_p <= mass_before[n]
        assert min(top_p - mass_before[n - 1], mass_before[n] - top_p) > MARGIN, "row too close to a flip"
    threshold = max(ranked[k - 1] if top_k > 0 else -np.inf, top[n - 1])
    return scaled >= threshold


def rows() -> tuple[np.ndarray, list[tuple[float, int, float]]]:
    """(logits [B, VOCAB] f32, per-row (temperature, top_k, top_p))."""
    rng = np.random.default_rng(0)
    peaked = rng.normal(size=VOCAB) * 4.0  # a few hundred tokens hold nearly all the mass
    flat = rng.normal(size=VOCAB) * 0.3  # top-p 0.9 needs most of the vocabulary
    tied = np.round(rng.normal(size=VOCAB) * 3.0, 1)  # many exact ties, also at the cuts
    masked = peaked.copy()
    masked[rng.choice(VOCAB, VOCAB // 2, replace=False)] = -np.inf
    table = [
        (peaked, (1.0, 0, 0.9)),
        (peaked, (0.7, 40, 1.0)),
        (peaked, (1.0, 30, 0.5)),  # both
        (peaked, (1.0, 0, 1.0)),  # no filter: only scaled
        (flat, (1.0, 0, 0.897)),
        (flat, (1.0, 5_000, 1.0)),
        (tied, (1.0, 50, 0.95)),
        (masked, (0.8, 0, 0.8)),
        (peaked, (0.0, 3, 0.4)),  # a greedy row's filters (the draft's probabilities use them)
    ]
    logits = np.stack([row for row, _ in table]).astype(np.float32)
    return logits, [settings for _, settings in table]


def _filter(logits, settings):
    t, k, p = (np.array(column, dtype) for column, dtype in zip(zip(*settings), (np.float32, np.int32, np.float32)))
    return np.asarray(jax.jit(filtered_logits)(logits, t, k, p))


def test_filters_keep_the_defined_sets():
    logits, settings = rows()
    out = _filter(logits, settings)
    for b, (t, k, p) in enumerate(settings):
        want = reference_kept(logits[b], t, k, p) & np.isfinite(logits[b])
        np.testing.assert_array_equal(np.isfinite(out[b]), want, err_msg=f"row {b}: t={t} k={k} p={p}")
        scaled = logits[b] / (t if t > 0 else 1.0)
        np.testing.assert_allclose(out[b][want], scaled[want], rtol=1e-6)  # kept: only scaled (XLA may use 1/t)


def test_rows_without_filters_are_only_scaled():
    """top_k 0 and top_p 1 drop nothing, also in the tail of a 129,280-entry row, where the float32 cumsum of
    the ranked probabilities reaches 1 early (the filter cut 81,648 and 1,600 tokens of the first two rows
    before top_p 1 kept all)."""
    logits = (np.random.default_rng(1).normal(size=(3, 129_280)) * 3.0).astype(np.float32)
    out = np.asarray(jax.jit(filtered_logits)(logits, np.array([0.5, 1.0, 0.0], np.float32), np.zeros(3, np.int32),
                                               np.ones(3, np.float32)))
    np.testing.assert_allclose(out, logits / np.array([[0.5], [1.0], [1.0]], np.float32), rtol=1e-6)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_setting_is_named_as_not_a_number(field, value):
    """inf / nan are refused as not finite (not as "must be >= 0, got inf")."""
    with pytest.raises(SamplingError, match=f"--{field.replace('_', '-')} must be a finite number, got"):
        SamplingParams(**{field: value}).validate()
    SamplingParams().validate()


def test_min_p_keeps_the_ids_at_least_min_p_times_as_likely_as_the_top():
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(3, 4096)) * 3).astype(np.float32)
    t, min_p = np.array([1.0, 0.7, 1.0], np.float32), np.array([0.05, 0.2, 0.0], np.float32)
    out = np.asarray(jax.jit(filtered_logits)(logits, t, np.zeros(3, np.int32), np.ones(3, np.float32), min_p))
    for b in range(3):
        scaled = logits[b].astype(np.float64) / t[b]
        ratio = np.exp(scaled - scaled.max())  # p / p_max
        if min_p[b] > 0:
            assert np.abs(ratio - min_p[b]).min() > 1e-5  # no id at a float32 rounding flip
        np.testing.assert_array_equal(np.isfinite(out[b]), ratio >= min_p[b], err_msg=f"row {b}")


def test_processors_bias_hold_the_end_ids_until_min_tokens_and_are_exact_when_neutral():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 64)).astype(np.float32)
    params = [SamplingParams(logit_bias=((5, 2.5), (9, -100.0))), SamplingParams(min_tokens=3, held_ids=(7,)),
              SamplingParams(seed=1)]
    eos = np.array([1, 2], np.int32)
    for step, held in ((2, True), (3, False)):
        out = np.asarray(jax.jit(processed_logits)(logits, sampling_arrays(params), np.full(3, step, np.int32),
                                                   eos))
        want = logits.copy()
        want[0, 5] += 2.5
        want[0, 9] -= 100.0
        if held:
            want[1, [1, 2, 7]] = -np.inf
        np.testing.assert_array_equal(out, want)  # neutral rows (and untouched ids) bit for bit
    greedy = jax.jit(sample)(logits, sampling_arrays([SamplingParams()] * 3), np.zeros(3, np.int32), eos)
    np.testing.assert_array_equal(np.asarray(greedy), logits.argmax(-1))  # as the argmax-only step


def test_token_logprobs_are_the_log_softmax_of_the_logits():
    logits = np.random.default_rng(5).normal(size=(2, 100)).astype(np.float32)
    tokens = np.array([7, 42], np.int32)
    out = jax.jit(token_logprobs)(logits, tokens)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out.token), ref[[0, 1], tokens], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-ref, axis=-1, kind="stable")[:, :20])
    np.testing.assert_allclose(np.asarray(out.top), np.sort(ref, axis=-1)[:, ::-1][:, :20], atol=1e-5)
