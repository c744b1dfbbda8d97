"""The engine's XLA options (`dsv41_jax.compiler.options`) on a GPU: products that share an input keep their own
weights. XLA's dot merger, at its default threshold, joins the shared expert's ``w1``/``w3`` (2 × 23.6 MB at the
release's width) into one GEMM whose weight it concatenates on every call; at 2+ rows that copy ran in every layer
of every decode step (docs/BENCHMARKS.md "The dot merger's threshold": 40-layer batch-8 step 28.59 → 27.10 ms)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dsv41_jax import compiler
from dsv41_jax.model.moe import SharedExpert

D, F = 5120, 2304  # the release's hidden size and shared-expert width


def _optimized_hlo(options: dict, rows: int) -> str:
    module = nnx.eval_shape(lambda: SharedExpert(D, F, 7.0, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(module)
    x = jax.ShapeDtypeStruct((rows, D), jnp.bfloat16)
    run = jax.jit(lambda s, a: nnx.merge(graphdef, s)(a))
    return run.lower(state, x).compile(options).as_text()


def _joined_weight(hlo: str) -> bool:
    """Whether the program builds a [2F, D] array (both weights in one) by concatenation."""
    return re.search(rf"bf16\[{2 * F},{D}\][^\n]*concatenate", hlo) is not None


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="XLA:GPU's dot merger and the engine's GPU options")
@pytest.mark.parametrize("rows", [8, 64])
def test_products_sharing_an_input_keep_their_own_weights(rows):
    joined = {**compiler.options(), "xla_gpu_dot_merger_threshold_mb": 32}  # XLA's default threshold
    assert _joined_weight(_optimized_hlo(joined, rows)), "premise: XLA's default joins the two weights"
    assert not _joined_weight(_optimized_hlo(compiler.options(), rows))
