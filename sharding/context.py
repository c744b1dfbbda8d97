"""The active mesh while a sharded model is traced, and ``constrain`` for activation layouts.

``constrain(x, "logits")`` pins activation ``x`` to its rule in ``rules.ACTIVATION_RULES`` when a mesh is active
(inside ``activate``) and returns ``x`` unchanged otherwise, so model code may call it unconditionally.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
from jax.sharding import Mesh, NamedSharding

from sharding.rules import activation_spec

_ACTIVE: contextvars.ContextVar[tuple[Mesh, str] | None] = contextvars.ContextVar("sharding_active", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh, layout: str = "tp") -> Iterator[None]:
    token = _ACTIVE.set((mesh, layout))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Mesh, str] | None:
    """(mesh, layout) while a sharded model is traced, else None."""
    return _ACTIVE.get()


def constrain(x: jax.Array, activation: str) -> jax.Array:
    """``with_sharding_constraint`` by the activation rule table; identity when no mesh is active."""
    current = _ACTIVE.get()
    if current is None:
        return x
    mesh, layout = current
    spec = activation_spec(activation, x.ndim, layout)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
