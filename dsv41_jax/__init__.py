"""DeepSeek-V4.1 (Flash) inference in JAX/Flax NNX.

Importing the package adds `RUNTIME_FLAGS` to ``XLA_FLAGS``: XLA options it reads only from that variable when
JAX starts its backend, not from a program's compile options. A flag the user's ``XLA_FLAGS`` names stays the
user's; a backend JAX started before the import keeps the flags it started with.
"""

import os

# XLA's command buffers (CUDA graphs) as graphs whose independent kernels run as concurrent branches, instead of
# one command after another. A one-row decode step is ~140 small, latency-bound launches, many independent (the
# indexer's, the compressor's and the attention query's pieces of a layer). Measured on the H200 (jax 0.11.2,
# 2026-12-03, docs/BENCHMARKS.md "Concurrent command buffers"): the 2-layer cut's batch-1 step 0.97-0.98 ->
# 0.85-0.89 ms, batch 8 2.49 -> 2.30-2.34 ms; the 40-layer batch-1 step 11.9 -> 10.6 ms. As a compile option the
# flag changes nothing.
RUNTIME_FLAGS = {"xla_gpu_graph_enable_concurrent_region": "true"}


def flags_named(xla_flags: str) -> set[str]:
    """The option names an ``XLA_FLAGS`` string sets (``--name=value`` or ``--name``)."""
    return {word.lstrip("-").split("=", 1)[0] for word in xla_flags.split() if word.startswith("--")}


def with_flags(xla_flags: str, flags: dict[str, object]) -> str:
    """``xla_flags`` with ``--name=value`` appended for each of ``flags`` whose name it does not set already."""
    named = flags_named(xla_flags)
    added = [f"--{name}={value}" for name, value in flags.items() if name not in named]
    return " ".join([xla_flags.strip(), *added]).strip()


os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), RUNTIME_FLAGS)
