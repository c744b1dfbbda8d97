"""The Mosaic GPU maxima pass (``mosaic.py``) against a float32 reference of the same function.

Inputs are small integers times powers of two, so every product and partial sum is exact in f32 and any
summation order gives the same bits: comparisons are bitwise (−∞ included). On CPU the kernel body runs in
jax's Mosaic GPU interpreter (``jax._src.pallas.mosaic_gpu.interpret``: warpgroups as threads, shared memory,
barriers and TMA copies simulated; private API, so those tests skip where it is missing) and its GPU program is
traced and lowered for CUDA; on an H200 it runs compiled, and the whole op with it selects what the Triton
pass selects.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels.indexer import index_topk, kernel, mosaic
from pallas_kernels.lowering import cuda_text, lowered_for_cuda

ON_H200 = mosaic.supported(group=8, head_dim=128, heads=32, masked=False, score_dtype="bfloat16", interpret=False)


def reference(q, w, keys, nvis):
    """q [H, T, d], w f32 [H, T], keys [N, d], nvis int32 [T] -> f32 [T, ⌈N/8⌉] (float32, HIGHEST)."""
    s = jnp.einsum("htd,nd->htn", q.astype(jnp.float32), keys.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    score = jnp.einsum("htn,ht->tn", jnp.maximum(s, 0.0), w, precision=lax.Precision.HIGHEST)
    n = keys.shape[0]
    score = jnp.where(jnp.arange(n)[None, :] < nvis[:, None], score, -jnp.inf)
    score = jnp.pad(score, ((0, 0), (0, -n % 8)), constant_values=-jnp.inf)
    return jnp.max(score.reshape(score.shape[0], -1, 8), axis=-1)


def inputs(seed, heads, t, n, d=128, nvis=None):
    rng = np.random.default_rng(seed)
    grid = lambda shape, scale: (rng.integers(-3, 4, shape) * scale).astype(np.float32)
    q = jnp.asarray(grid((heads, t, d), 0.5), jnp.bfloat16)
    keys = jnp.asarray(grid((n, d), 0.25), jnp.bfloat16)
    w = jnp.asarray(grid((heads, t), 0.125))
    if nvis is None:
        nvis = rng.integers(0, n + 1, t)
        nvis[:3] = [0, n, 1]
    return q, w, keys, jnp.asarray(nvis, jnp.int32)


def check(args, **tiling):
    if not ON_H200:
        tiling["interpret"] = _interpreter()
    ref = np.asarray(reference(*args))
    out = np.asarray(jax.block_until_ready(mosaic.maxima(*args, **tiling)))
    assert out.shape == ref.shape
    assert np.isfinite(ref).any() and np.isneginf(ref).any()
    np.testing.assert_array_equal(out.view(np.int32), ref.view(np.int32))


def test_permute_keys_is_an_8x8_transpose_per_64_keys():
    k = jnp.arange(256 * 2, dtype=jnp.float32).reshape(256, 2)
    p = mosaic.permute_keys(k)
    assert float(p[1, 0]) == 8 * 2      # position 8i + g = 1 (i = 0, g = 1) holds key 8g + i = 8
    np.testing.assert_array_equal(mosaic.permute_keys(p), k)


def test_maxima_equal_the_reference():
    """Two row blocks and key splits; ragged rows (no keys, all keys, one key)."""
    check(inputs(0, heads=4, t=128, n=1024), splits=2)


@pytest.mark.slow  # tilings beyond the default, in interpret mode (make test-gpu compiles them)
def test_maxima_ragged_shapes_other_tilings_and_dead_steps():
    """T not a multiple of 64 and N not of 8 nor of a step; 64-key halves, a q slot count that does not divide
    the heads, the schedule barrier on; a block that sees at most 70 keys (most steps dead) and one that sees none."""
    check(inputs(1, heads=3, t=100, n=601), kpw=64, key_slots=3, q_slots=2, sched=True, splits=2)
    t, n = 192, 768
    nvis = np.concatenate([np.arange(64) + 7, np.zeros(64, np.int64), np.full(64, n)])
    check(inputs(2, heads=3, t=t, n=n, nvis=nvis), splits=2)


def test_a_jax_that_cannot_lower_it_falls_back_with_a_warning(monkeypatch):
    """``lowers_here`` (the last condition of ``supported``): True with this jax (a small instance lowers for CUDA);
    a kernel that fails to lower (a jax whose Mosaic GPU API moved on) gives False and a warning."""
    assert mosaic.lowers_here.__wrapped__()

    def broken(*args, **kw):
        raise NotImplementedError("no such Mosaic GPU primitive")
    monkeypatch.setattr(mosaic, "maxima", broken)
    with pytest.warns(UserWarning, match="Triton pass runs instead"):
        assert not mosaic.lowers_here.__wrapped__()


def test_lowers_for_cuda_at_the_release_shape():
    """2,048 rows × 302,048 keys, 32 heads of 128: the kernel traces and lowers to a Mosaic GPU call."""
    heads, t, n, d = 32, 2048, 302_048, 128
    args = (jax.ShapeDtypeStruct((heads, t, d), jnp.bfloat16), jax.ShapeDtypeStruct((heads, t), jnp.float32),
            jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((t,), jnp.int32))
    lowered = lowered_for_cuda(mosaic.maxima, *args)
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize("case", ["two sequences, ratio 2", "candidate-masked", "candidate source",
                                  "maximum context"])
def test_the_op_lowers_through_it_for_cuda(monkeypatch, case):
    """With the switch on and the pass supported, the op's prefill launch (512 rows against 302 K keys; a 2,048-row
    segment against 1,048,576 keys) calls the Mosaic GPU kernel (at least once a sequence) and lowers for CUDA
    (its plumbing: operand layouts, the candidate mask applied per group, the candidate source's block maxima)."""
    monkeypatch.setattr(kernel, "SCORE_PASS", "mosaic")
    monkeypatch.setattr(mosaic, "supported", lambda **kw: not kw["masked"])
    b, t, n = {"two sequences, ratio 2": (2, 512, 151_024), "maximum context": (1, 2048, 1 << 20)}.get(
        case, (1, 512, 302_048))
    s = jax.ShapeDtypeStruct
    args = [s((b, t, 32, 128), jnp.bfloat16), s((b, t, 32), jnp.float32), s((b, n, 128), jnp.bfloat16),
            s((b, t), jnp.int32)]
    kw = dict(ratio=2 if case.startswith("two") else 1, k=512, block_size=8)
    if case == "candidate-masked":
        args.append(s((b, t, n // 8), jnp.bool_))
    if case == "candidate source":
        kw["keep_blocks"] = 2048
    text = cuda_text(functools.partial(kernel.index_topk_pallas, **kw), *args)
    assert text.count("mosaic_gpu") >= b and "index_maxima" not in text


@pytest.mark.slow  # the Mosaic pass runs only on an H200: make test-gpu checks it compiled; here interpret mode
def test_the_op_through_it_selects_as_with_the_triton_pass(monkeypatch):
    """The op's plumbing around the pass, run on CPU with the kernel replaced by its float32 reference: two
    sequences, ratio 1 and 2, a candidate-masked layer and the candidate source pick what the Triton pass picks
    (interpret mode)."""
    rng = np.random.default_rng(3)
    b, t, n, heads = 2, 40, 600, 4
    q = jnp.asarray(rng.integers(-3, 4, (b, t, heads, 128)) * 0.5, jnp.bfloat16)
    keys = jnp.asarray(rng.integers(-3, 4, (b, n, 128)) * 0.25, jnp.bfloat16)
    w = jnp.asarray(rng.integers(-3, 4, (b, t, heads)) * 0.125, jnp.float32)
    kept = jnp.asarray(rng.random((b, t, n // 8)) < 0.4)
    cases = [dict(ratio=1), dict(ratio=2), dict(ratio=1, kept=kept), dict(ratio=1, keep_blocks=16)]
    for case in cases:
        kw = dict(ratio=case["ratio"], k=32, block_size=8, keep_blocks=case.get("keep_blocks", 0),
                  interpret=True)
        pos = jnp.asarray(np.arange(t)[None].repeat(b, 0) + case["ratio"] * n - t - np.array([[0], [77]]), jnp.int32)
        extra = (case["kept"],) if "kept" in case else ()
        out = {}
        for score_pass in ("mosaic", "triton"):
            monkeypatch.setattr(kernel, "SCORE_PASS", score_pass)
            monkeypatch.setattr(mosaic, "supported", lambda **kw: not kw["masked"])
            monkeypatch.setattr(mosaic, "maxima", lambda q, w, keys, nvis: reference(q, w, keys, nvis))
            jax.clear_caches()
            picks, blocks = kernel.index_topk_pallas(q, w, keys, pos, *extra, **kw)
            out[score_pass] = (np.sort(np.asarray(picks), axis=-1), None if blocks is None else np.asarray(blocks))
        np.testing.assert_array_equal(out["mosaic"][0], out["triton"][0])
        if out["triton"][1] is not None:
            np.testing.assert_array_equal(out["mosaic"][1], out["triton"][1])


def test_only_compiled_sm90_bf16_unmasked_groups_of_8_use_it():
    kw = dict(group=8, head_dim=128, heads=32, masked=False, score_dtype="bfloat16")
    assert not mosaic.supported(**kw, interpret=True)
    for change in (dict(group=1), dict(head_dim=64), dict(masked=True), dict(score_dtype="float8_e4m3fn")):
        assert not mosaic.supported(**{**kw, **change}, interpret=False)


@pytest.mark.skipif(not ON_H200, reason="the Mosaic GPU pass runs compiled on an H200 only")
def test_index_topk_selects_as_with_the_triton_pass(monkeypatch):
    """The whole op (ratio 1 and 2, and candidate-masked; 256 rows against 40 K keys, 32 heads of 128, K = 512)
    picks the same entries with either maxima pass."""
    rng = np.random.default_rng(7)
    t, n, heads = 256, 40_000, 32
    q = jnp.asarray(rng.integers(-3, 4, (1, t, heads, 128)) * 0.5, jnp.bfloat16)
    keys = jnp.asarray(rng.integers(-3, 4, (1, n, 128)) * 0.25, jnp.bfloat16)
    w = jnp.asarray(rng.integers(-3, 4, (1, t, heads)) * 0.125, jnp.float32)   # exact sums: same bits both ways
    kept = jnp.asarray(rng.random((1, t, n // 8)) < 0.3)
    for ratio, masks in ((1, ()), (2, ()), (1, (kept,))):    # the last: a reindex layer's candidate blocks
        pos = jnp.asarray(np.arange(t)[None] + ratio * n - t, jnp.int32)
        picks = {}
        for score_pass in ("mosaic", "triton"):
            monkeypatch.setattr(kernel, "SCORE_PASS", score_pass)
            jax.clear_caches()   # the kernel's jitted op reads the switch when it is traced
            run = jax.jit(functools.partial(index_topk, ratio=ratio, k=512, block_size=8, impl="pallas"))
            picks[score_pass] = np.sort(np.asarray(run(q, w, keys, pos, *masks)[0]), axis=-1)
        np.testing.assert_array_equal(picks["mosaic"], picks["triton"])


def _interpreter():
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415 - private jax API
        _patch_interpreter_wgmma()
    except Exception as e:  # noqa: BLE001 - a private API: absent or changed in this jax
        pytest.skip(f"no usable Mosaic GPU interpreter in jax {jax.__version__}: {e}")
    return InterpretGPUParams()


_PATCHED = False


def _patch_interpreter_wgmma():
    """The Mosaic GPU interpreter (jax 0.10.2, ``interpret/gpu_callbacks.wgmma``) reads wgmma operands through
    ``to_range``, which only understands NDIndexer transforms: a B operand given as
    ``plgpu.transpose_ref(ref, (1, 0))`` (what FA3 and this kernel do for K) fails with "'TransposeTransform'
    object has no attribute 'indices'". Wrap it: strip a trailing TransposeTransform from the operands'
    transforms, read the buffer with the remaining indexers, then transpose. CPU-interpret only."""
    global _PATCHED
    if _PATCHED:
        return
    from jax._src.pallas.mosaic.interpret import utils as iu  # noqa: PLC0415 - private jax API (the caller skips without it)
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc  # noqa: PLC0415 - private jax API (the caller skips without it)
    from jax._src.state.types import TransposeTransform  # noqa: PLC0415 - private jax API (the caller skips without it)

    def read(key_arr, transforms, gtid, info, sm):
        transforms = tuple(gc._remove_noop_transforms(transforms))
        perm = None
        if transforms and isinstance(transforms[-1], TransposeTransform):
            perm = transforms[-1].permutation
            transforms = transforms[:-1]
        transforms = jax.tree.map(int, transforms)
        x, _, _ = sm.get_buffer_content(gc.HostAllocationKey.from_array(key_arr), iu.to_range(transforms), gtid,
                                        logging_info=info)
        return x if perm is None else np.transpose(x, perm)

    def wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
              acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
              source_info=None):
        device_id = int(device_id)
        grid_point_coords = tuple(int(x) for x in grid_point_coords)
        thread_id = int(thread_id)
        sm = gc._get_shared_memory()
        gtid = sm.get_global_thread_id(device_id, thread_id)
        info = iu.GPULoggingInfo(device_id=device_id, grid_point_coords=grid_point_coords, thread_id=thread_id,
                                 source_info=source_info)
        a = read(a_allocation_key_as_array, a_transforms, gtid, info, sm)
        b = read(b_allocation_key_as_array, b_transforms, gtid, info, sm)
        acc_key = gc.HostAllocationKey.from_array(acc_allocation_key_as_array)
        acc_range = iu.to_range(jax.tree.map(int, gc._remove_noop_transforms(acc_transforms)))
        acc, _, _ = sm.get_buffer_content(acc_key, acc_range, gtid, logging_info=info)
        res = acc + np.matmul(a.astype(np.float32), b.astype(np.float32), dtype=np.float32).astype(acc_dtype)
        sm.store_buffer_content(acc_key, acc_range, res, gtid, logging_info=info)
        return token

    gc.wgmma = wgmma
    _PATCHED = True
