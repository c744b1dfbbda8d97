"""Pieces of ``python -m dsv41_jax.profile`` (docs/DESIGN.md).

* ``cut.py``: ``cut_layers`` — a K-layer model of a config that keeps its interesting layer roles.
* ``flops.py``: the spec's arithmetic per segment (``MODEL.md`` shapes), per device.
* ``build.py``: random weights and a filled cache made on the devices, already sharded (JAX).
* ``measure.py``: compile, XLA cost / memory analysis and timed runs of one step (JAX).
* ``args.py``: command-line helpers the benchmark scripts share.
* ``floors.py``: the read and compute floors of a step (weights and cache it must read, H200 rates).
* ``trace.py``: a ``jax.profiler`` Perfetto trace parsed into a per-op / per-component time table (stdlib).

``cut``, ``flops`` and ``args`` import no JAX, so the CLI can set ``XLA_FLAGS`` before JAX starts.
"""
