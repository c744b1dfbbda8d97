"""Count XLA backend compiles, as JAX reports them (not an engine's own table): for no-recompile tests; and name
the programs of an engine's table that branch on device values."""

from __future__ import annotations

import contextlib

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles():
    """``with backend_compiles() as compiles: ...``: ``compiles`` lists one event per backend compile inside."""
    compiles: list[str] = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def branching_programs(engine) -> list[str]:
    """Names of the programs in ``engine``'s table whose HLO has a ``conditional``: XLA:GPU reads its predicate on
    the host, so such a step waits for it and chained steps stop queueing ahead (`sampling` module docstring)."""
    return [key[0] for key, exe in engine.runtime.table.compiled.items() if " conditional(" in exe.as_text()]
