"""``ModelOptions.indexer_impl="pallas"`` (the fused scores + top-k kernel, interpret mode on CPU) selects what
the XLA path selects inside the tiny model cut to 3 layers (``profiling.cut``: a ratio-2 full layer, the
ratio-1 candidate source with its level-1 blocks, a candidate-masked reindex layer), over two segments (the
second sees cached index keys; its padding rows score the unwritten, all-zero keys: exact ties at 0), then two
one-row decode steps.

With the rounding points on, q and the index keys are on the fp4 grid, so both paths form every q·k exactly
and differ only in the order of the f32 sum over heads (last bits); with continuous random weights no two
scores sit that close at the K-th place, so the picks are compared as sets, exactly.
"""

from __future__ import annotations

import numpy as np
from model_helpers import Runner, model_state

from dsv41_jax.config import load_named
from dsv41_jax.make_tiny import random_weights
from dsv41_jax.model import ModelOptions
from dsv41_jax.profiling.cut import cut_layers


def test_pallas_indexer_selects_what_the_xla_path_selects():
    cfg = cut_layers(load_named("tiny"), 3)
    assert [cfg.role(i) for i in range(3)] == ["full", "full", "reindex"]
    flat = random_weights(cfg, 0)
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size - 3, 58)
    picks, logits = {}, {}
    for impl in ("xla", "pallas"):
        options = ModelOptions(dtype="float32", indexer_impl=impl)
        runner = Runner(cfg, options, model_state(cfg, options, flat), rows=32, max_context=64)
        steps = [runner.step([ids[:32]]), runner.step([ids[32:56]])]
        runner.rows = 1   # then two decode steps: one row a program in the kernel (tiling.ROW_PROGRAM_MAX)
        steps += [runner.step([ids[56:57]]), runner.step([ids[57:]])]
        picks[impl] = [{layer: np.sort(np.asarray(sel), -1) for layer, sel in s[1].items()} for s in steps]
        logits[impl] = np.concatenate([s[0][0] for s in steps])
    for step_ref, step_pallas in zip(picks["xla"], picks["pallas"]):
        assert step_ref.keys() == step_pallas.keys() and len(step_ref) == len(cfg.index_source_layer_ids)
        for layer in step_ref:
            np.testing.assert_array_equal(step_pallas[layer], step_ref[layer], err_msg=f"layer {layer}")
    assert (picks["xla"][1][cfg.candidate_source_layer_id] >= 0).sum(-1).min() == cfg.index_topk
    np.testing.assert_allclose(logits["pallas"], logits["xla"], rtol=0, atol=1e-5)
