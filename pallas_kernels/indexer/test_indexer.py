"""The indexer op (scores fused with top-k) against a float64 dense oracle; every implementation passes the
same cases (interpret mode on CPU, compiled on a GPU).

The oracle transcribes MODEL.md §B.8 in float64 with numpy: scores over all heads, visibility, the candidate
mask, and a stable descending order (equal scores: lower entry index first, the op's tie rule). Inputs are
drawn on the fp4 grid (e2m1 levels × a power of two per block of 32, as the rounding points make them), so
every q·k dot is exact in f32 and in bf16/e4m3 MMAs; the only rounding an implementation adds is the f32
weighted sum over heads (≤ (H + 2)·2⁻²⁴·Σ_h|term| ≤ 2⁻¹⁸·mag for H ≤ 32, mag = Σ_h |w_h|·ReLU(q_h·k)·d^(−1/2)).

"Equal selection": the same multiset of scores (to that bound), the same set wherever the K-th
score is not tied within it, and exactly the oracle's lowest-index choice when scores are exact (cases whose
arithmetic is exact in f32: tolerance 0).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels.indexer import index_topk, xla
from pallas_kernels.indexer.kernel import best_groups, fp8_exact, index_topk_pallas, top_k_indices
from pallas_kernels.indexer.tiling import SMS, TARGET_PROGRAMS, key_splits, workspace_bytes
from pallas_kernels.indexer.xla import radix_top_k
from pallas_kernels.registry import IMPLEMENTATIONS as IMPLS

INTERPRET = jax.default_backend() != "gpu"
FP4_LEVELS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
REL_TOL = 2.0**-18


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 1
    rows: int = 5
    heads: int = 4
    head_dim: int = 32
    keys: int = 300
    k: int = 16
    ratio: int = 1
    first_pos: tuple[int, ...] = (0,)
    block_size: int = 4
    keep_blocks: int = 0       # > 0: the candidate source
    masked: bool = False       # a reindex layer: random candidate mask (one row masks everything)
    exact: bool = False        # small-integer scores: exact in f32, ties everywhere (tolerance 0)


def fp4_grid(rng, shape):
    """Values on the fp4 grid: signed e2m1 levels × 2^e per block of 32 (e in −3..1)."""
    v = rng.choice(FP4_LEVELS, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    blocks = v.reshape(*shape[:-1], -1, min(32, shape[-1]))
    scale = 2.0 ** rng.integers(-3, 2, size=blocks.shape[:-1] + (1,))
    return (blocks * scale).reshape(shape)


def make_inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    b, t, h, d, n = case.batch, case.rows, case.heads, case.head_dim, case.keys
    if case.exact:   # scores are small multiples of 2^-k: exact in any summation order; many exact ties
        q = rng.integers(-1, 2, (b, t, h, d)).astype(np.float64)
        keys = rng.integers(0, 2, (b, n, d)).astype(np.float64)
        w = rng.choice([0.0, 0.5, 1.0, 2.0], size=(b, t, h))   # d = 16: d^-1/2 = 1/4, every product exact
        w[0, min(2, t - 1)] = 0.0
    else:
        q, keys = fp4_grid(rng, (b, t, h, d)), fp4_grid(rng, (b, n, d))
        w = rng.standard_normal((b, t, h))
    first = np.resize(np.asarray(case.first_pos), b)
    positions = first[:, None] + np.arange(t)[None, :]
    n_blocks = -(-n // case.block_size)
    kept = None
    if case.masked:
        kept = rng.random((b, t, n_blocks)) < 0.5
        kept[0, min(1, t - 1)] = False
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return (f32(q), f32(w), f32(keys), jnp.asarray(positions, jnp.int32),
            None if kept is None else jnp.asarray(kept))


def oracle(case: Case, q, w, keys, positions, kept):
    """(scores f64 [B,T,N] with −∞ where not visible / masked, mag [B,T,N], kept blocks | None)."""
    q, w, keys = (np.asarray(x, np.float64) for x in (q, w, keys))
    dots = np.maximum(np.einsum("bthd,bnd->bthn", q, keys), 0.0) * q.shape[-1] ** -0.5
    s = np.einsum("bth,bthn->btn", w, dots)
    mag = np.einsum("bth,bthn->btn", np.abs(w), dots)
    n = keys.shape[1]
    nvis = (np.asarray(positions) + 1) // case.ratio
    s = np.where(np.arange(n)[None, None, :] < nvis[..., None], s, -np.inf)
    new_kept = None
    if case.keep_blocks:
        new_kept = oracle_candidates(case, s, nvis)
    if kept is not None:
        s = np.where(np.repeat(np.asarray(kept), case.block_size, axis=-1)[..., :n], s, -np.inf)
    return s, mag, new_kept


def oracle_candidates(case: Case, s, nvis):
    b, t, n = s.shape
    nb = -(-n // case.block_size)
    padded = np.full((b, t, nb * case.block_size), -np.inf)
    padded[..., :n] = s
    block = padded.reshape(b, t, nb, case.block_size).max(-1)
    newest = np.where(nvis > 0, (nvis - 1) // case.block_size, -1)
    block = np.where(np.arange(nb)[None, None, :] == newest[..., None], np.inf, block)
    out = np.zeros((b, t, nb), bool)
    for i in np.ndindex(b, t):
        order = np.argsort(-block[i], kind="stable")[:min(case.keep_blocks, nb)]
        out[i][order[block[i][order] > -np.inf]] = True
    return out, block


def assert_same_selection(picks, s, mag, k: int, exact: bool):
    """picks int32 [B,T,K] against oracle scores s [B,T,N] (module docstring: 'equal selection')."""
    n = s.shape[-1]
    kk = min(k, n)
    assert picks.shape == s.shape[:2] + (kk,)
    for i in np.ndindex(*s.shape[:2]):
        row, p = s[i], picks[i]
        tol = 0.0 if exact else REL_TOL * mag[i].max()
        order = np.argsort(-row, kind="stable")                     # ties: lower index first
        want = order[:min(kk, int(np.isfinite(row).sum()))]
        got = p[p >= 0]
        assert (p < n).all() and len(set(got.tolist())) == len(got), f"row {i}: bad or repeated picks"
        assert len(got) == len(want), f"row {i}: {len(got)} picks, expected {len(want)}"
        if not len(want):
            continue
        assert np.isfinite(row[got]).all(), f"row {i}: picked an invisible or masked entry"
        np.testing.assert_allclose(np.sort(row[got]), np.sort(row[want]), rtol=0, atol=tol,
                                   err_msg=f"row {i}: selected scores differ")
        kth = row[want[-1]]
        differ = set(got.tolist()) ^ set(want.tolist())
        near = set() if exact else {j for j in differ if abs(row[j] - kth) <= 2 * tol}   # exact: the tie rule
        assert differ == near, f"row {i}: sets differ away from the K-th score {kth}: {sorted(differ - near)}"


# Every implementation, and both maxima kernels of the pallas one: one program a row (launches of few rows, the
# default up to tiling.ROW_PROGRAM_MAX rows) and blocks of 16 rows (the prefill kernel).
VARIANTS = {impl: {} for impl in IMPLS} | {"pallas_row_blocks": {"block_rows": 16}}


def run(case: Case, impl: str, seed: int = 0, **kw):
    if impl == "pallas_row_blocks":
        impl, kw = "pallas", VARIANTS[impl] | kw
    q, w, keys, positions, kept = make_inputs(case, seed)
    picks, new_kept = index_topk(q, w, keys, positions, kept, ratio=case.ratio, k=case.k,
                                 keep_blocks=case.keep_blocks, block_size=case.block_size, impl=impl,
                                 interpret=INTERPRET if impl == "pallas" else None, **kw)
    s, mag, want_kept = oracle(case, q, w, keys, positions, kept)
    assert_same_selection(np.asarray(picks), s, mag, case.k, case.exact)
    return np.asarray(picks), None if new_kept is None else np.asarray(new_kept), want_kept, mag


CASES = {
    # the full head count and dims; ragged positions (one sequence from 0: rows with 1..7 visible keys)
    "ragged_full_dims": Case(batch=2, rows=7, heads=32, head_dim=128, first_pos=(0, 250)),
    # ratio 2, a head count that is not a power of two, empty rows (position 0 sees no entry); K = 24 > 18
    # groups of 8, so the pass keeps every key's score (tiling: G = 1; invisible keys must come back −∞)
    "ratio2_heads3_full_buffer": Case(batch=2, rows=6, heads=3, head_dim=16, ratio=2, keys=144, k=24,
                                      first_pos=(0, 300)),
    "near_1M_masked": Case(batch=2, rows=4, keys=2048, ratio=512, k=32, block_size=8, masked=True,
                           first_pos=(1_048_572, 1_000_000)),
    # exact scores with ties everywhere; row (0, 2) has w = 0 (all visible scores tie at 0: picks 0 … K−1);
    # groups tied at the K-th group maximum: the lower ones must be the candidates
    "exact_ties": Case(batch=2, rows=6, heads=2, head_dim=16, keys=300, k=24, exact=True, first_pos=(294, 100)),
    # the same over 19 groups of 8 with K = 24: every key's score kept (G = 1), ties selected among them
    "exact_ties_short": Case(batch=2, rows=6, heads=2, head_dim=16, keys=150, k=24, exact=True,
                             first_pos=(144, 40)),
    # the same over 588 groups of 8 with K = 8: the kernel picks its groups in two levels (kernel.best_groups)
    "exact_ties_two_levels": Case(rows=4, heads=2, head_dim=16, keys=4700, k=8, exact=True, first_pos=(4690,)),
}


@pytest.mark.parametrize("impl", VARIANTS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_selection_matches_oracle(name, impl):
    run(CASES[name], impl, seed=zlib.crc32(name.encode()))


@pytest.mark.parametrize("keys", [240, 60])
@pytest.mark.parametrize("impl", VARIANTS)
def test_candidate_source_blocks(impl, keys):
    """Level 1: the kept blocks equal the oracle's wherever a block's score is not within the tolerance of
    the K_B-th block score (the newest block always kept; −∞ blocks dropped). 60 keys make 15 blocks, fewer
    than K = 16: the kernel keeps every key's score and takes the block maxima from them."""
    case = Case(batch=2, rows=6, keys=keys, block_size=4, keep_blocks=12, first_pos=(200, 30))
    _, kept, (want, block), mag = run(case, impl, seed=3)
    assert kept.shape == want.shape
    for i in np.ndindex(*kept.shape[:2]):
        if (kept[i] == want[i]).all():
            continue
        finite = np.sort(block[i][np.isfinite(block[i])])[::-1]
        kth = finite[min(case.keep_blocks, len(finite)) - 1]
        diff = np.flatnonzero(kept[i] != want[i])
        assert (np.abs(block[i][diff] - kth) <= 2 * REL_TOL * mag[i].max()).all(), f"row {i}: blocks {diff}"


@pytest.mark.parametrize("impl", VARIANTS)
def test_decode_at_300k(impl):
    """Decode: 8 rows at position 300,000 (ratio 64 keeps the keys at 4,688; the kernel splits them over
    programs and merges the splits' candidates)."""
    run(Case(rows=8, heads=4, head_dim=32, keys=4700, ratio=64, k=64, first_pos=(300_000,)), impl, seed=9)


def test_kernel_tiling_and_launches():
    """Another tiling (64-key tiles, groups of 16, 2 splits, 16-row blocks) in launches of 4 rows (ops'
    row blocks) selects what the oracle selects."""
    run(CASES["ragged_full_dims"], "pallas", seed=5, key_tile=64, block_rows=16, group=16, splits=2,
        rows_per_block=4)


def test_every_group_rescored():
    """Groups of 8 forced on a row of fewer than K groups (the default scores every key there): every group is
    a candidate, invisible ones too, and their keys come back −∞."""
    run(CASES["ratio2_heads3_full_buffer"], "pallas", seed=11, group=8)


@pytest.mark.parametrize("per_super", [2, 4, 16])
def test_two_level_group_selection_equals_one_level(per_super):
    """kernel.best_groups through super-groups picks what one lax.top_k over all maxima picks, tie rule
    included: small-integer maxima (ties everywhere), −∞ tails, a row of equal maxima, a row with fewer
    finite groups than it needs; 8 of 700 groups."""
    rng = np.random.default_rng(per_super)
    m = rng.integers(0, 6, (2, 3, 700)).astype(np.float32)
    m[:, :, 650:] = -np.inf
    m[0, 1] = 0.0
    m[1, 2] = -np.inf
    m[1, 2, [5, 300, 699]] = 1.0
    want = np.sort(np.asarray(lax.top_k(jnp.asarray(m), 8)[1]), axis=-1)
    np.testing.assert_array_equal(np.asarray(best_groups(jnp.asarray(m), 8, per_super, INTERPRET)), want)


def test_fp8_scoring_is_exact():
    """e4m3 MMA inputs (fp4-grid values with per-row/per-key powers of two, folded back exactly) select what
    the oracle selects; ``fp8_exact`` accepts these inputs (so ops.index_topk would run e4m3 on them)."""
    case = Case(batch=2, rows=5, heads=4, head_dim=32, first_pos=(0, 250))
    q, w, keys, positions, _ = make_inputs(case, 2)
    assert bool(fp8_exact(q, keys))
    assert not bool(fp8_exact(q * 1.1, keys))   # off the grid: ops falls back to bf16
    picks, _ = index_topk_pallas(q, w, keys, positions, ratio=1, k=case.k, score_dtype="float8_e4m3fn",
                                 interpret=INTERPRET)
    s, mag, _ = oracle(case, q, w, keys, positions, None)
    assert_same_selection(np.asarray(picks), s, mag, case.k, exact=False)


def test_xla_row_blocks_are_invisible():
    """The XLA path over blocks of 2 query rows equals one block of all rows (bitwise)."""
    case = CASES["ragged_full_dims"]
    q, w, keys, positions, _ = make_inputs(case, 4)
    kw = dict(ratio=1, k=case.k, impl="xla")
    a, _ = index_topk(q, w, keys, positions, **kw)
    b, _ = index_topk(q, w, keys, positions, **kw, rows_per_block=2)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("n, k", [(4000, 64), (2000, 512)])
def test_planner_workspace_bounds_xla_temporaries(n, k):
    """tiling.workspace_bytes (what the planner reserves for one launch) ≥ XLA's temporaries of the
    compiled op (the candidate source: 64 rows × 32 heads × 128 dims against 4,000 keys in groups of 8, and
    against 2,000 keys where every key's score is kept, G = 1)."""
    b, t, h, d = 1, 64, 32, 128
    args = (jnp.zeros((b, t, h, d)), jnp.zeros((b, t, h)), jnp.zeros((b, n, d)), jnp.zeros((b, t), jnp.int32))
    kw = dict(keep_blocks=8, block_size=8)
    compiled = index_topk_pallas.lower(*args, ratio=1, k=k, interpret=INTERPRET, **kw).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    planned = sum(workspace_bytes(b, t, n, k, heads=h, head_dim=d, **kw).values())
    assert temp <= planned, (temp, planned)


def test_the_check_catches_a_wrong_selection():
    """The comparison itself: swapping the worst pick for the best unpicked entry must fail."""
    case = CASES["ragged_full_dims"]
    q, w, keys, positions, _ = make_inputs(case, 0)
    s, mag, _ = oracle(case, q, w, keys, positions, None)
    picks = np.argsort(-s, axis=-1, kind="stable")[..., :case.k].astype(np.int32)
    picks = np.where(np.isfinite(np.take_along_axis(s, picks, -1)), picks, -1)
    assert_same_selection(picks, s, mag, case.k, exact=False)
    row = s[1, 3]
    picks[1, 3, -1] = np.argsort(-row, kind="stable")[case.k]
    with pytest.raises(AssertionError):
        assert_same_selection(picks, s, mag, case.k, exact=False)


def test_bad_shapes_are_refused():
    case = CASES["ragged_full_dims"]
    q, w, keys, positions, _ = make_inputs(case, 0)
    with pytest.raises(ValueError, match="w has shape"):
        index_topk(q, w[..., :2], keys, positions, ratio=1, k=4)
    with pytest.raises(ValueError, match="impl"):
        index_topk(q, w, keys, positions, ratio=1, k=4, impl="cuda")


@pytest.mark.parametrize("n,k", [(1000, 64), (777, 777), (300, 1), (4096, 512)])
def test_radix_and_select_kernel_equal_lax_top_k(n, k):
    """The GPU's radix selection and the select kernel (kernel.top_k_indices, in one program and piece by
    piece) pick exactly ``lax.top_k``'s entries (same order of floats, same tie rule: lower index), on rows
    full of ReLU ties (zeros of both signs), −∞ (not visible) and negative scores."""

    rng = np.random.default_rng(n + k)
    s = np.maximum(rng.standard_normal((4, n)), 0).astype(np.float32)  # ~half exact zeros
    s[0, rng.integers(0, n, n // 3)] = -np.inf
    s[1] = np.round(s[1] * 4) / 4  # coarse values: ties above zero too
    s[2] = -np.abs(s[2]) - rng.integers(0, 3, n)  # all negative, integer-spaced ties
    s[3, ::2] = -0.0
    want = np.sort(np.asarray(lax.top_k(jnp.asarray(s), k)[1]), axis=1)
    got = np.sort(np.asarray(jax.jit(radix_top_k, static_argnums=1)(jnp.asarray(s), k)), axis=1)
    np.testing.assert_array_equal(got, want)
    for bits in (1, 2, 4):   # the K-th value's bits one, two or four a step (early stop each way)
        select = jax.jit(functools.partial(top_k_indices, k=k, interpret=INTERPRET, bits=bits))   # key order
        np.testing.assert_array_equal(np.asarray(select(jnp.asarray(s))), want)
    pieces = jax.jit(functools.partial(top_k_indices, k=k, interpret=INTERPRET, max_entries=4 * k))
    np.testing.assert_array_equal(np.asarray(pieces(jnp.asarray(s))), want)   # rows longer than a program's


def test_select_by_radix_marks_invisible_picks(monkeypatch):
    """``select`` on the radix path: −1 for picks whose score is −∞, like the top_k path."""
    s = jnp.asarray(np.where(np.arange(40) < 5, np.arange(40, dtype=np.float32), -np.inf)[None, None])
    want = np.sort(np.asarray(xla.select(s, 8)), axis=-1)
    monkeypatch.setattr(xla, "RADIX_MIN_ENTRIES", 1)
    monkeypatch.setattr(xla.jax, "default_backend", lambda: "gpu")
    got = np.sort(np.asarray(xla.select(s, 8)), axis=-1)
    np.testing.assert_array_equal(got, want)
    assert (got == -1).sum() == 3


def test_key_splits_fill_whole_waves():
    """tiling.key_splits: at least TARGET_PROGRAMS programs where the keys allow, never more splits than key
    tiles, and the last wave at least as full as with the least split count (16 row blocks at 300 K keys: 33
    splits = 4 waves of 132 SMs exactly, not 17 = 272 programs, a nearly empty third wave)."""
    filled = lambda p: p / (-(-p // SMS) * SMS)
    assert key_splits(16, 1180) == 33
    for blocks in (1, 2, 3, 8, 16, 32, 40, 64, 300):
        for tiles in (1, 5, 16, 100, 2360):
            s = key_splits(blocks, tiles)
            least = max(1, min(tiles, -(-TARGET_PROGRAMS // blocks)))
            assert least <= s <= min(tiles, 2 * least)
            assert filled(blocks * s) >= filled(blocks * least)
