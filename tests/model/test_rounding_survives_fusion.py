"""The §C.2 rounding points must survive XLA's fusions: on the H200 an ``astype(float8_e4m3fn).astype(float32)``
round trip inside a fused computation came back off by up to 0.12 (XLA GPU drops narrowing-then-widening
convert pairs, its excess-precision default), so the model writes the e4m3 rounding with ``lax.reduce_precision``
(`quant.round_to_e4m3`). These tests hold that emulation to ml_dtypes' e4m3fn cast exactly, on every e4m3 value,
every midpoint between neighbours (the ties) and their one-ulp neighbours, and random values over the whole
range and the subnormals; and check a jitted rounding point on whatever backend runs the suite (on the GPU this
is the case that failed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax.model.norms import rms_scale
from dsv41_jax.model.quant import fake_quant_fp8, round_to_e4m3


def _e4m3_values() -> np.ndarray:
    vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.unique(vals[np.isfinite(vals)])


def test_round_to_e4m3_equals_the_cast_exactly():
    vals = _e4m3_values()
    mids = (vals[1:] + vals[:-1]) / 2
    rng = np.random.default_rng(0)
    x = np.concatenate([vals, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        rng.uniform(-448, 448, 200_000), rng.normal(0, 0.01, 200_000)]).astype(np.float32)
    x = np.clip(x, -448, 448)
    want = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(round_to_e4m3)(x)), want)


def test_fp8_rounding_point_inside_a_fusion():
    x = np.random.default_rng(1).normal(size=(64, 256)).astype(np.float32)
    v = x.reshape(64, 8, 32)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(v).max(-1, keepdims=True), 1e-4) / 448.0))
    want = ((v / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale).reshape(x.shape)
    got = jax.jit(lambda a: fake_quant_fp8(a) * 2.0 + 1.0)(jnp.asarray(x))  # fused with its consumers
    np.testing.assert_array_equal((np.asarray(got) - 1.0) / 2.0, want)


def test_rms_scale_is_one_over_sqrt_not_rsqrt_inside_a_fusion():
    """``norms.rms_scale`` is 1/sqrt(mean(x²) + eps), as MLX computes it, also when fused with its consumer: the
    same value as its sqrt and its division run as separate programs (on the CPU: both correctly rounded, as
    numpy's float32 ones; XLA:GPU's own sqrt and divide are within an ulp, measured on the H200), never XLA's
    rsqrt (its rewrite of 1/sqrt, off by an ulp at times). Integer inputs keep mean(x²) exact, so the expected
    value does not depend on the summation order."""
    eps = 1e-6
    x = jnp.asarray(np.random.default_rng(2).integers(-64, 65, size=(20_000, 256)).astype(np.float32))
    root = jax.jit(lambda a: jnp.sqrt(jnp.mean(a * a, axis=-1) + eps))(x)
    want = np.asarray(jax.jit(lambda r: 1.0 / r)(root))
    fused = jax.jit(lambda a: rms_scale(a, eps)[:, 0] * 2.0)  # a power-of-two scale: exact
    np.testing.assert_array_equal(np.asarray(fused(x)) / 2.0, want)
    assert " rsqrt(" not in fused.lower(x).compile().as_text()
    if jax.default_backend() == "cpu":
        ms = (np.asarray(x, np.float64) ** 2).mean(-1).astype(np.float32)  # exact: integer sums < 2**24, / 2**8
        np.testing.assert_array_equal(want, np.float32(1.0) / np.sqrt(ms + np.float32(eps)))
