"""The implementations every kernel op has, behind one signature (``pallas_kernels/*/ops.py``).

* ``"xla"``: plain JAX the XLA compiler fuses (row-blocked where a score matrix would not fit): the fast path on
  CPU and the fallback everywhere.
* ``"pallas"``: the Pallas kernel (interpret mode off GPU).

The simple gather ``reference.py`` of an op (where it has one) is a test oracle, not an implementation: tests and
benchmarks import it, the model never does. ``"reference"`` is accepted as a deprecated name of ``"xla"`` (what
``ModelOptions`` and ``--impl`` called the XLA path before the registry), and resolved to it on entry.
"""

from __future__ import annotations

IMPLEMENTATIONS = ("xla", "pallas")
DEPRECATED = {"reference": "xla"}
# Every kernel op: its folder under pallas_kernels/ and its public entry in that folder's ops.py.
OPS = {
    "sparse_attention": "sparse_attention",
    "moe": "routed_experts",
    "indexer": "index_topk",
    "hc_mix": "comb",
    "fp8_matmul": "fp8_matmul",
}


def resolve(impl: str, what: str = "impl") -> str:
    """``impl`` as one of IMPLEMENTATIONS (a deprecated alias mapped); ValueError naming ``what`` otherwise."""
    impl = DEPRECATED.get(impl, impl)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"{what} must be one of {' | '.join(IMPLEMENTATIONS)}, got {impl!r}")
    return impl
