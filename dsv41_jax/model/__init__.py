"""Flax NNX modules of the V4.1 text model, one module per concept."""
