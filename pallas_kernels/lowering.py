"""Lowering a program for CUDA on any host: what the kernels' tests read to check a kernel's launch shape (the
Triton / Mosaic GPU calls in the StableHLO) where no GPU is attached.

A Pallas Triton kernel needs the target's compute capability to lower. With a GPU attached it is the device's, and
jax 0.10 lowers for a default target without one; from jax 0.11 a host without a GPU must name an abstract device.
``lowered_for_cuda`` lowers as is and, where that is refused for want of a GPU, again under an abstract one-device
mesh whose device is an H200 (compute capability 9.0). Such a lowering gives the program's values that mesh's
sharding, so two calls of one jitted function lower as two functions: ``concrete=True`` refuses it instead.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

TARGET_KIND = "NVIDIA H200"
_NO_GPU = "No supported GPU devices found"


class NoConcreteTarget(RuntimeError):
    """Lowering for CUDA here needs an abstract device (jax >= 0.11 without a GPU), and the caller asked for none."""


def _lower(fn, args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def lowered_for_cuda(fn, *args, concrete: bool = False):
    """``jax.jit(fn)`` traced on ``args`` (arrays or ShapeDtypeStructs) and lowered for CUDA: the Lowered object.
    ``concrete``: raise ``NoConcreteTarget`` rather than lower for an abstract H200."""
    try:
        return _lower(fn, args)
    except RuntimeError as e:
        if _NO_GPU not in str(e):
            raise
        if concrete:
            raise NoConcreteTarget(str(e)) from None
    device = AbstractDevice(device_kind=TARGET_KIND, num_cores=None, platform="gpu")
    with use_abstract_mesh(AbstractMesh((1,), ("cuda_target",), abstract_device=device)):
        return _lower(fn, args)


def cuda_text(fn, *args, concrete: bool = False) -> str:
    """The StableHLO text of ``lowered_for_cuda(fn, *args, concrete=concrete)``."""
    return lowered_for_cuda(fn, *args, concrete=concrete).as_text()
