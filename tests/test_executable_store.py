"""The executable store (`dsv41_jax.compiler`): a program found there runs without tracing or compiling and gives
the bitwise-same outputs as the program compiled in this process; its key changes with everything the executable
depends on; a damaged entry is compiled again; a program whose static arguments have no stable name is never
stored (it could only miss, or worse, be confused with another closure of the same name)."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache
from test_engine import mini_config

from dsv41_jax import compile_cache, compiler, make_tiny
from dsv41_jax.engine import Engine, Request, fixed_segments
from dsv41_jax.loading import build_model
from dsv41_jax.model.transformer import ModelOptions


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The store on under ``tmp_path``, counting loads and compiles; off again after the test."""
    counts = {"loaded": 0, "compiled": 0}
    real_load, real_save = compiler._load, compiler._save

    def load(path):
        out = real_load(path)
        counts["loaded"] += out is not None
        return out

    def save(path, compiled):
        counts["compiled"] += 1
        real_save(path, compiled)

    monkeypatch.setattr(compiler, "_load", load)
    monkeypatch.setattr(compiler, "_save", save)
    enabled = jax.config.jax_enable_compilation_cache
    assert compile_cache.enable(str(tmp_path / "xla")) == tmp_path / "xla"
    yield tmp_path / "xla" / compiler.STORE_DIR, counts
    compiler.use_store(None)
    jax.config.update("jax_enable_compilation_cache", enabled)
    jax_compilation_cache.reset_cache()  # the session's shared JAX cache (conftest) is used again


def _engine():
    cfg = mini_config()
    model = build_model(cfg, ModelOptions(dtype="float32", quant_rounding=False), make_tiny.random_weights(cfg, 0))
    return Engine(model, cfg, max_context=64, cache_dtype="float32", eos_ids=(),
                  segment_plan=lambda n: fixed_segments(n, 16), short_rows=15)


def test_a_stored_program_runs_without_compiling_and_gives_the_same_outputs(store):
    directory, counts = store
    prompt = tuple(range(3, 40))
    first = _engine().generate([Request(prompt, 5)], record_logits=True)
    compiled = counts["compiled"]
    assert compiled >= 2 and counts["loaded"] == 0  # the step programs (init's static is a plain function)
    assert len(list(directory.glob("*.exe"))) == compiled
    second = _engine().generate([Request(prompt, 5)], record_logits=True)  # a new engine: nothing in memory
    assert counts["compiled"] == compiled and counts["loaded"] == compiled
    assert (first.timings.programs_loaded, second.timings.programs_loaded) == (0, compiled)
    assert second.generations[0].token_ids == first.generations[0].token_ids
    np.testing.assert_array_equal(second.prefill_logits, first.prefill_logits)
    np.testing.assert_array_equal(second.decode_logits, first.decode_logits)


def _key(fn=jnp.sin, static=None, x=None, identity="f", options=None):
    x = jnp.ones((4, 8), jnp.float32) if x is None else x
    return compiler._store_path(identity, (x,), static or {}, options or {})


def test_the_key_follows_what_the_executable_depends_on(store, monkeypatch):
    base = _key()
    assert base == _key()  # stable
    assert _key(x=jnp.ones((4, 9), jnp.float32)) != base  # shape
    assert _key(x=jnp.ones((4, 8), jnp.bfloat16)) != base  # dtype
    assert _key(identity="g") != base  # the program (name, graph digest)
    assert _key(static={"k": 2}) != _key(static={"k": 3})
    assert _key(options={"xla_gpu_enable_triton_gemm": False}) != base
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    assert _key() != base
    monkeypatch.delenv("XLA_FLAGS")
    with jax.default_matmul_precision("highest"):  # a jax setting that changes the traced program
        assert _key() != base
    monkeypatch.setattr(compiler, "source_digest", lambda: "edited")
    assert _key() != base


@pytest.mark.devices(2)
def test_the_key_follows_the_sharding_and_a_sharded_program_round_trips(store):
    directory, counts = store
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jnp.arange(32.0).reshape(4, 8)
    xs, xw = jax.device_put(x, split), jax.device_put(x, whole)
    assert _key(x=xs) != _key(x=xw)
    jitted = jax.jit(lambda a: (a * 2.0).sum(axis=0))
    cold, second = {}, {}
    compiled, from_store = compiler.compile(jitted, (xs,), identity="double-sum", timings=cold)
    out = compiled(xs)
    loaded, from_store_again = compiler.compile(jitted, (xs,), identity="double-sum", timings=second)
    assert counts == {"loaded": 1, "compiled": 1} and (from_store, from_store_again) == (False, True)
    assert set(cold) == {"lower_s", "compile_s"} and set(second) == {"load_s"}
    np.testing.assert_array_equal(loaded(xs), out)


def test_a_damaged_entry_is_compiled_again(store):
    directory, counts = store
    jitted = jax.jit(lambda a: a + 1.0)
    x = jnp.ones((3,), jnp.float32)
    compiler.compile(jitted, (x,), identity="plus-one")
    (entry,) = directory.glob("*.exe")
    entry.write_bytes(b"not an executable")
    recompiled, loaded = compiler.compile(jitted, (x,), identity="plus-one")
    np.testing.assert_array_equal(recompiled(x), x + 1.0)
    assert counts == {"loaded": 0, "compiled": 2} and not loaded
    assert compiler.compile(jitted, (x,), identity="plus-one")[1] and counts["loaded"] == 1


def test_static_arguments_without_a_stable_name_are_never_stored(store):
    assert _key(static={"fn": jnp.sin}) is not None  # a module-level function: its qualified name
    assert _key(static={"fn": lambda a: a}) is None
    offset = 2.0
    assert _key(static={"fn": lambda a: a + offset}) is None
    assert _key(static={"obj": object()}) is None  # a repr with an address


def test_the_store_drops_its_least_recently_used_entries_past_its_size(store, monkeypatch):
    directory, counts = store
    x = jnp.ones((3,), jnp.float32)
    entry = {}
    for name in ("a", "b"):  # the same program under two names: entries of one size
        compiler.compile(jax.jit(jnp.sin), (x,), identity=name)
        (entry[name],) = set(directory.glob("*.exe")) - set(entry.values())
    size = entry["a"].stat().st_size
    for age, name in ((200, "a"), (100, "b")):  # explicit ages: file times can be coarser than these steps
        os.utime(entry[name], (time.time() - age, time.time() - age))
    assert compiler.compile(jax.jit(jnp.sin), (x,), identity="a")[1]  # a is now the most recently used
    monkeypatch.setattr(compiler, "STORE_MAX_BYTES", 2 * size + size // 2)  # room for two entries
    compiler.compile(jax.jit(jnp.sin), (x,), identity="c")
    assert entry["a"].exists() and not entry["b"].exists() and len(list(directory.glob("*.exe"))) == 2


def test_a_loaded_executable_for_another_argument_tree_is_compiled_again(store, monkeypatch):
    """Should two programs ever share a key, the argument trees still tell them apart (no wrong call)."""
    directory, counts = store
    monkeypatch.setattr(compiler, "_signature", lambda args: "one key for every argument tree")
    x = jnp.arange(3.0)
    compiler.compile(jax.jit(lambda a: a * 2.0), (x,), identity="f")
    program, loaded = compiler.compile(jax.jit(lambda t: t["a"] * 3.0), ({"a": x},), identity="f")
    assert not loaded and counts["compiled"] == 2  # deserialized, refused, compiled and stored again
    np.testing.assert_array_equal(program({"a": x}), x * 3.0)


@pytest.fixture
def jax_cache(tmp_path):
    """JAX's own persistent cache on, in ``tmp_path``; the session's settings back afterwards."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {name: getattr(jax.config, name) for name in names}
    for name, value in zip(names, (str(tmp_path / "jax"), 0, 0)):
        jax.config.update(name, value)
    jax.config.update("jax_enable_compilation_cache", True)
    jax_compilation_cache.reset_cache()
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    jax_compilation_cache.reset_cache()


def test_an_executable_from_jax_s_own_cache_is_run_but_not_stored(store, jax_cache):
    """JAX's persistent cache (a user's, or the test session's) may serve a program first: that executable does
    not serialize back whole on XLA:CPU, so it is never put in the store."""
    directory, counts = store
    compiler.use_store(None)
    x = jnp.arange(5.0)
    # into JAX's cache, with the options `compiler.compile` passes (on a GPU they are part of JAX's cache key)
    jax.jit(lambda a: jnp.cumsum(a) * 2.0).lower(x).compile(compiler.options())
    compiler.use_store(directory)
    program, loaded = compiler.compile(jax.jit(lambda a: jnp.cumsum(a) * 2.0), (x,), identity="g")
    np.testing.assert_array_equal(program(x), jnp.cumsum(x) * 2.0)
    assert not loaded and not list(directory.glob("*.exe"))
