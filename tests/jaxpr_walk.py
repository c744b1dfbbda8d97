"""Reading jaxprs in tests the same way on every supported jax (0.10.2 to 0.12): no equation parameter is read by
name, since the names change between versions (jax 0.11's scan has no ``num_consts`` / ``num_carry``).

* ``sub_jaxprs(eqn)``: the jaxprs nested in an equation (a scan's or loop's body, a jit's call, a cond's branches,
  a shard_map's body), found by type among its parameters, whatever they are called.
* ``scan_xs(eqn)``: the inputs a scan slices along its leading axis, found by their types: the body sees each one
  a row (one axis less), where it sees a constant or a carry as it is.
"""

from __future__ import annotations

from collections.abc import Iterator


def sub_jaxprs(eqn) -> list:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            item = getattr(item, "jaxpr", item)  # a ClosedJaxpr holds its Jaxpr
            if hasattr(item, "eqns") and hasattr(item, "invars"):
                found.append(item)
    return found


def equations(jaxpr, loop_depth: int = 0) -> Iterator[tuple[object, int]]:
    """(equation, loop depth) of every equation, nested jaxprs included; depth 1 = inside one scan's body."""
    for eqn in jaxpr.eqns:
        yield eqn, loop_depth
        inner = loop_depth + (eqn.primitive.name == "scan")
        for sub in sub_jaxprs(eqn):
            yield from equations(sub, inner)


def _same_type(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def scan_xs(eqn) -> list:
    """The avals of a scan equation's sliced inputs (its xs), in order."""
    assert eqn.primitive.name == "scan", eqn.primitive
    bodies = [j for j in sub_jaxprs(eqn) if len(j.invars) == len(eqn.invars)]
    assert len(bodies) == 1, f"a scan whose body does not take its inputs one for one: {eqn.params.keys()}"
    xs = []
    for outer, inner in zip(eqn.invars, bodies[0].invars):
        whole, row = outer.aval, inner.aval
        if _same_type(whole, row):
            continue  # a constant or a carry
        assert tuple(whole.shape[1:]) == tuple(row.shape) and whole.dtype == row.dtype, (whole, row)
        xs.append(whole)
    return xs
