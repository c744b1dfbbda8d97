"""Count XLA backend compiles, as JAX reports them (not an engine's own table): for no-recompile tests."""

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
