"""Pallas GPU kernels (sparse prefill attention, routed-expert MoE); each with a pure-JAX reference."""
