"""The runtime's contracts that need no compile: one program a name in a table, and both model kinds implementing
`ModelLike` themselves (the engine, the slots and speculation never ask which kind they hold). Running the
programs through the runtime's API: tests/test_engine.py."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from flax import nnx

import sharding
from dsv41_jax import make_tiny
from dsv41_jax.config import load_named
from dsv41_jax.loading import build_model
from dsv41_jax.model.transformer import ModelOptions, Transformer
from dsv41_jax.runtime import ModelLike, Program, ProgramTable

MEMBERS = ("vocab_size", "engram_layers", "has_vision", "has_dspark", "__call__", "encode_images", "unwrap")


def test_a_table_holds_one_program_a_name():
    """Keys start with the program's name: a second program of a name is refused, the same one again is not."""
    graphdef, _ = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    table = ProgramTable(graphdef)
    double = Program("double", lambda x: 2 * x, model=False)
    table.register(double)
    table.register(double)
    with pytest.raises(ValueError, match="'double'"):
        table.register(Program("double", lambda x: x + x, model=False))
    np.testing.assert_array_equal(np.asarray(table.run(double, {}, (np.ones(2, np.float32),))), [2.0, 2.0])
    with pytest.raises(ValueError, match="'double'"):
        table.run(Program("double", lambda x: 3 * x, model=False), {}, (np.ones(2, np.float32),))


def test_the_protocol_names_every_member_both_kinds_define():
    protocol = {name for name in vars(ModelLike) if not name.startswith("_") or name == "__call__"}
    assert protocol == set(MEMBERS)
    for cls in (Transformer, sharding.ShardedTransformer):
        defined = set(vars(cls)) | ({"vocab_size"} if cls is sharding.ShardedTransformer else set())  # __init__'s
        assert set(MEMBERS) <= defined, (cls, set(MEMBERS) - defined)


@pytest.mark.devices(2)
def test_a_transformer_and_its_sharded_wrapper_are_model_like():
    """The facts the runtime reads agree between a Transformer and the same model sharded over 2 devices; only
    ``unwrap`` tells them apart: the sharded one names its inner model, its mesh context and its vocabulary
    maps."""
    cfg = load_named("tiny").replace(  # tests/test_speculative.py's 5-layer cut with the stages
        num_hidden_layers=5, compress_ratios=(0, 2, 1, 1, 1, 0, 0, 0), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2, dspark_target_layer_ids=(2, 3, 4))
    options = ModelOptions(dtype="float32", quant_rounding=False, dspark=True)
    flat = make_tiny.random_weights(cfg, 0, dspark=True)
    one = build_model(cfg, options, flat)
    sharded, _ = sharding.prepare(cfg, flat, 2, options)
    for model in (one, sharded):
        assert isinstance(model, ModelLike)
        assert (model.vocab_size, model.engram_layers, model.has_vision, model.has_dspark) == (
            cfg.vocab_size, tuple(cfg.engram_layer_ids), False, True)
    inner, ctx, vocab = one.unwrap()
    assert inner is one and isinstance(ctx, contextlib.nullcontext) and vocab is None
    inner, ctx, vocab = sharded.unwrap()
    assert inner is sharded.inner and isinstance(inner, Transformer) and len(vocab) == 2
    with ctx:
        ids = np.arange(4, dtype=np.int32)[None]
        np.testing.assert_array_equal(np.asarray(vocab[0](ids)), np.asarray(sharded.plan.padded_token_ids(ids)))
