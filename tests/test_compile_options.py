"""The engine's XLA options: `dsv41_jax.RUNTIME_FLAGS` added to ``XLA_FLAGS`` on import unless the user names
them, and the compile options (`dsv41_jax.compiler.options`), from which a flag the user names is dropped. On a
GPU: products that share an input keep their own weights. XLA's dot merger, at its default threshold, joins the
shared expert's ``w1``/``w3`` (2 × 23.6 MB at the release's width) into one GEMM whose weight it concatenates on
every call; at 2+ rows that copy ran in every layer of every decode step (docs/BENCHMARKS.md "The dot merger's
threshold": 40-layer batch-8 step 28.59 → 27.10 ms)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import dsv41_jax
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


def test_runtime_flags_are_added_unless_the_user_names_them():
    assert dsv41_jax.flags_named("--a=1  --b --c=x=y") == {"a", "b", "c"}
    assert dsv41_jax.with_flags("", dsv41_jax.RUNTIME_FLAGS) == "--xla_gpu_graph_enable_concurrent_region=true"
    mine = "--xla_force_host_platform_device_count=2 --xla_gpu_graph_enable_concurrent_region=false"
    assert dsv41_jax.with_flags(mine, dsv41_jax.RUNTIME_FLAGS) == mine  # the user's value stays, not added twice
    assert dsv41_jax.with_flags("--xla_dump_to=/d", dsv41_jax.RUNTIME_FLAGS).split() == [
        "--xla_dump_to=/d", "--xla_gpu_graph_enable_concurrent_region=true"]


def test_a_fresh_process_starts_jax_with_the_runtime_flags():
    """XLA aborts on a flag its build does not know: this jaxlib must accept every runtime flag."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    code = "import os, dsv41_jax, jax; jax.devices(); print(os.environ['XLA_FLAGS'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["--xla_gpu_graph_enable_concurrent_region=true"]


def test_a_compile_option_named_in_xla_flags_is_left_to_them(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_dot_merger_threshold_mb=32")
    assert compiler.options("gpu") == {"xla_gpu_enable_triton_gemm": False}
    monkeypatch.setenv("XLA_FLAGS", "")
    assert compiler.options("gpu") == compiler.GPU_OPTIONS
    assert compiler.options("cpu") == {}
