"""The mesh and layout while a sharded model traces, carried by JAX and Flax, and ``constrain`` for activations.

No state of our own: the mesh is JAX's context mesh (``jax.set_mesh`` outside jit, ``use_abstract_mesh`` inside
a trace; read back with ``jax.sharding.get_abstract_mesh``) and the layout is the active logical-axis rules
(``flax.nnx.logical_axis_rules``, bound to ``rules.axis_rules(layout)``: the MaxText way). ``activate`` sets
both; ``constrain(x, "logits")`` pins activation ``x`` to its rule in ``rules.ACTIVATION_RULES`` when a mesh is
set and returns ``x`` unchanged otherwise, so model code may call it unconditionally.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from sharding.rules import activation_spec, axis_rules


@contextlib.contextmanager
def activate(mesh: Mesh | AbstractMesh, layout: str = "tp") -> Iterator[None]:
    """Trace under ``mesh`` (usable inside jit: the abstract mesh) with ``layout``'s logical-axis rules."""
    abstract = mesh.abstract_mesh if isinstance(mesh, Mesh) else mesh
    with jax.sharding.use_abstract_mesh(abstract), nnx.logical_axis_rules(axis_rules(layout)):
        yield


def active_mesh() -> AbstractMesh | None:
    """JAX's context mesh (``jax.set_mesh`` / ``activate``), or None when none of more than one device is set."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def constrain(x: jax.Array, activation: str) -> jax.Array:
    """``with_sharding_constraint`` by the activation rule table; identity when no mesh is set."""
    mesh = active_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, activation_spec(activation, x.ndim)))
