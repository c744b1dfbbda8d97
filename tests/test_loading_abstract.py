"""``loading.abstract_params`` builds the model's skeleton with one fixed key instead of ``nnx.Rngs`` (whose draw
counter made tracing the 40-layer constructor quadratic): the skeleton must be the one ``nnx.Rngs`` gives — the same
graph definition (what the executable store keys on) and the same parameter names, shapes and dtypes."""

from __future__ import annotations

import pytest
from flax import nnx

from dsv41_jax import loading
from dsv41_jax.config import load_named
from dsv41_jax.model import ModelOptions, Transformer


@pytest.mark.parametrize("name,options", [
    ("tiny", ModelOptions()),
    ("tiny_vision", ModelOptions(vision=True, dtype="float32")),
    ("tiny", ModelOptions(dspark=True, expert_format="fp4")),
    ("tiny_engram", ModelOptions(engram_tables="host")),
])
def test_the_skeleton_is_the_one_nnx_rngs_builds(name, options):
    cfg = load_named(name)
    _, graphdef, params, rest = loading.abstract_params(cfg, options)
    want_graph, want_params, want_rest = nnx.split(
        nnx.eval_shape(lambda: Transformer(cfg, options, rngs=nnx.Rngs(0))), nnx.Param, ...)
    assert repr(graphdef) == repr(want_graph)
    assert [(p, v.shape, v.dtype) for p, v in params] == [
        (p, v.shape, v.dtype) for p, v in nnx.to_flat_state(want_params)]
    assert repr(rest) == repr(want_rest)
