"""``sharding.kernels.index_topk`` under a 2-device mesh: every device runs the whole selection (replicated in
and out, MODEL.md §F.1: the indexer is not split) and the result equals the plain op's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding.kernels import index_topk
from sharding.mesh import make_mesh, replicated


@pytest.mark.devices(2)
def test_replicated_indexer_kernel_under_a_mesh():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.integers(-2, 3, (1, 6, 4, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((1, 6, 4)), jnp.float32)
    keys = jnp.asarray(rng.integers(-2, 3, (1, 200, 32)), jnp.float32)
    positions = jnp.arange(150, 156, dtype=jnp.int32)[None]
    kw = dict(ratio=1, k=16, keep_blocks=4, block_size=8, impl="pallas", interpret=True)
    want = index_topk(q, w, keys, positions, **kw)
    mesh = make_mesh(2)
    args = jax.device_put((q, w, keys, positions), replicated(mesh))
    got = jax.jit(lambda *a: index_topk(*a, mesh=mesh, **kw))(*args)
    np.testing.assert_array_equal(np.sort(np.asarray(got[0]), -1), np.sort(np.asarray(want[0]), -1))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
