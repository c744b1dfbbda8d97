"""One suite for both implementations of the HC comb (softmax + Sinkhorn, MODEL.md §B.3), against a float64
NumPy oracle written from the spec's formula. Tolerance: both are float32 through 1 softmax and 39 dependent
normalisations (~4 roundings each), so an entry drifts by at most ~160 f32 ulp (relative 2e-5) from the
float64 value; observed ~1e-6. The two float32 implementations differ only in summation order (same bound)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.config import load_named
from dsv41_jax.model.cache import init_cache
from dsv41_jax.model.transformer import ModelOptions, Transformer
from dsv41_jax.profiling.cut import cut_layers
from pallas_kernels.hc_mix.kernel import comb_pallas
from pallas_kernels.hc_mix.ops import IMPLS, comb
from pallas_kernels.lowering import lowered_for_cuda

EPS = 1e-6


def oracle(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    x = logits.astype(np.float64)
    c = np.exp(x - x.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return c


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape,scale", [((1, 1, 4, 4), 1.0), ((2, 7, 4, 4), 3.0), ((300, 4, 4), 30.0),
                                         ((5, 2, 2), 1.0)])
def test_comb_matches_the_oracle(impl, shape, scale):
    logits = (np.random.default_rng(sum(shape)).standard_normal(shape) * scale).astype(np.float32)
    got = np.asarray(comb(jnp.asarray(logits), iters=20, eps=EPS, impl=impl))
    assert got.shape == shape and got.dtype == np.float32
    np.testing.assert_allclose(got, oracle(logits, 20, EPS), rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-5)  # columns last: each column sums to 1


def test_implementations_agree_with_one_iteration_and_bf16_free_inputs():
    logits = np.random.default_rng(1).standard_normal((33, 4, 4)).astype(np.float32)
    a, b = (np.asarray(comb(jnp.asarray(logits), iters=1, eps=EPS, impl=i)) for i in IMPLS)
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-8)
    np.testing.assert_allclose(a, oracle(logits, 1, EPS), rtol=2e-6, atol=1e-8)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="impl"):
        comb(jnp.zeros((1, 4, 4)), iters=20, eps=EPS, impl="triton")
    with pytest.raises(ValueError, match="iters"):
        comb(jnp.zeros((1, 4, 4)), iters=0, eps=EPS)


def test_the_model_gives_the_same_logits_with_either_implementation():
    """The tiny model cut to 2 layers (f32, rounding off) with the kernel in every HC mix against the XLA mixes:
    the comb differs by a few ulp (summation order), which the layers carry to ~1e-6 of logits O(3); bound 1e-4.
    (The sharded Pallas-model test runs the kernel in all 4 mixes of a 4-layer model at worlds 2 and 4.)"""

    cfg = cut_layers(load_named("tiny"), 2)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    logits = []
    for impl in IMPLS:
        model = Transformer(cfg, ModelOptions(dtype="float32", quant_rounding=False, hc_impl=impl),
                            rngs=nnx.Rngs(3))
        graphdef, state = nnx.split(model)
        # The forward as one program: op by op, the XLA mixes' sinkhorn iterations dispatch one at a time (17 s
        # of this test's 24 on CPU; jitted 4 s).
        forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids, init_cache(cfg, 2, 8, "float32"))[0])
        logits.append(np.asarray(forward(state, ids)))
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_comb_lowers_for_a_gpu_at_decode_sizes(rows):
    """pallas_call's default GPU backend (Mosaic GPU) takes vectors of whole warpgroups: the kernel's row tile is
    128 rows at least (16, a decode step's, failed to lower on jax 0.10.2). Lowered for CUDA without a GPU."""

    comb_gpu = functools.partial(comb_pallas, iters=20, eps=EPS, interpret=False)
    lowered_for_cuda(comb_gpu, jax.ShapeDtypeStruct((rows, 4, 4), jnp.float32))
