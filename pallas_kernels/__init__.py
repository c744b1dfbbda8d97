"""The kernel ops, one folder each (sparse_attention, moe, indexer, hc_mix, fp8_matmul), all laid out alike:

* ``ops.py``: the public entry, one signature over the implementations of ``registry.IMPLEMENTATIONS``;
* ``xla.py``: the "xla" implementation (plain JAX; the CPU path and the fallback);
* ``kernel.py``: the "pallas" implementation;
* ``test_*.py``: one suite every implementation passes against an independent oracle (a gather ``reference.py``
  where the op has one, else a numpy oracle in the test).

The model calls ``ops`` only (directly, or through ``sharding.kernels`` under a mesh); the codecs of the quantised
formats are ``dsv41_jax.formats``."""
