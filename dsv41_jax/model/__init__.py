"""Flax NNX modules of the V4.1 text model, one module per concept (docs/DESIGN.md)."""

from .cache import Cache, LayerCache, init_cache
from .engram import EngramInput
from .transformer import ModelOptions, Transformer, WeightsError, param_shapes

__all__ = ["Cache", "EngramInput", "LayerCache", "ModelOptions", "Transformer", "WeightsError", "init_cache",
           "param_shapes"]
