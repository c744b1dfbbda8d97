"""Weights straight into their shards: each device receives only its own slice, read from the host source.

The source is a mapping (or an iterator of pairs) of model name → host array in the *real* (unpadded) shape:
the flat dict of ``make_tiny.random_weights`` / ``checkpoint.load_checkpoint``, the tensor-by-tensor iterator
``Checkpoint.iter_tensors()`` (one host tensor alive at a time), or ``checkpoint_source(open_checkpoint(dir))``,
which decodes each device's slice on demand (routed experts expert by expert). No device ever holds a whole
split tensor, and no array of the padded shape is built on the host.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from dsv41_jax.checkpoint import PROGRESS_BYTES  # table reads (the release: ~25 GB a rank) show a bar above it
from dsv41_jax.param_specs import is_engram_table
from sharding.layout import ShardPlan, Split
from sharding.rules import param_spec, split_axis


def real_shape(name: str, padded_shape: tuple[int, ...], plan: ShardPlan) -> tuple[int, ...]:
    """The checkpoint shape of a parameter whose model (padded) shape is ``padded_shape``."""
    hit = split_axis(name, len(padded_shape), plan.layout)
    if hit is None:
        return tuple(padded_shape)
    axis, logical = hit
    out = list(padded_shape)
    out[axis] = plan.split(logical, padded_shape[axis], name).total
    return tuple(out)


def place(name: str, host: Any, padded_shape: tuple[int, ...], dtype: Any, mesh: Mesh,
          plan: ShardPlan) -> jax.Array:
    """One parameter as a global ``jax.Array`` of ``padded_shape`` sharded by the rule table.

    ``host``: array-like of the real shape (numpy, memory-mapped, anything with ``shape`` and basic slicing);
    a mis-shaped one is refused by name. ``dsv41_jax.loading.build_sharded`` places a whole model with it.
    """
    expected = real_shape(name, padded_shape, plan)
    if tuple(host.shape) != expected:
        raise ValueError(f"tensor {name!r} has shape {tuple(host.shape)}, expected {expected}")
    sharding = NamedSharding(mesh, param_spec(name, len(padded_shape), plan.layout))
    hit = split_axis(name, len(padded_shape), plan.layout)
    split: Split | None = plan.split(hit[1], padded_shape[hit[0]], name) if hit else None

    def shard_data(index: tuple[slice, ...]) -> np.ndarray:
        if split is None:
            return np.asarray(host[index], dtype=dtype)
        axis = hit[0]
        rank = (index[axis].start or 0) // split.shard
        return split.shard_of(host, axis, rank).astype(dtype, copy=False)

    return jax.make_array_from_callback(tuple(padded_shape), sharding, shard_data, dtype=dtype)


class CheckpointTensor:
    """One model tensor of an opened ``checkpoint.Checkpoint``, decoded only when sliced.

    A stacked routed-expert tensor ``[E, ·, ·]`` is decoded expert by expert and only for the experts and rows
    the slice asks for, so each device's shard is built without the whole stacked tensor ever existing on the
    host (expert parallelism: each device decodes only its own experts). For another tensor, a slice that
    covers it whole (a replicated tensor) is decoded once and kept until ``release`` (every device's copy comes
    from one read); a partial slice (a rank's rows of a split tensor) reads only those rows
    (``Checkpoint.read_window``).
    """

    def __init__(self, ckpt: Any, name: str, shape: tuple[int, ...], dtype: str):
        self.ckpt, self.name, self.shape, self.dtype = ckpt, name, tuple(shape), dtype
        self.stacked = ".ffn.experts." in name
        self._whole: np.ndarray | None = None

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(self.shape) - len(index))
        if not self.stacked:
            if self._whole is None and not self._covers_all(index) and is_engram_table(self.name):
                return read_table_rows(self.ckpt, self.name, index[0])[(slice(None), *index[1:])]
            if self._whole is None and not self._covers_all(index):
                return self.ckpt.read_window(self.name, index, dtype=self.dtype)
            if self._whole is None:
                self._whole = self.ckpt.read(self.name, dtype=self.dtype)
            return self._whole[index]
        experts = range(self.shape[0])[index[0]]
        rest = index[1:]
        rows = np.broadcast_to(np.empty((), np.float32), self.shape[1:])[rest].shape
        out = None
        for i, e in enumerate(experts):
            one = self.ckpt.read(self.name, dtype=self.dtype, experts=[e])[0][rest]
            out = np.empty((len(experts), *rows), one.dtype) if out is None else out
            out[i] = one
        return out if out is not None else np.empty((0, *rows), np.float32)

    def _covers_all(self, index: tuple) -> bool:
        return all(isinstance(s, slice) and s.indices(n) == (0, n, 1) for s, n in zip(index, self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def release(self) -> None:
        self._whole = None




def read_table_rows(ckpt: Any, name: str, rows: slice, chunk_rows: int = 1 << 20) -> np.ndarray:
    """Rows ``rows`` of an engram table as stored (codes or scale bytes), read from its memory map in chunks of
    ``chunk_rows``: only these rows are read from disk (a rank's slab of the split by hash column), with a
    progress bar when the read is large."""
    table = ckpt.read_table(name)  # a memory map: nothing is read yet
    lo, hi, _ = rows.indices(table.shape[0])
    out = np.empty((max(0, hi - lo), *table.shape[1:]), table.dtype)
    if out.nbytes < PROGRESS_BYTES:
        out[...] = table[lo:hi]
        return out

    with Progress(TextColumn(f"{name} rows {lo:,}–{hi:,}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("read", total=out.nbytes)
        for start in range(lo, hi, chunk_rows):
            stop = min(hi, start + chunk_rows)
            out[start - lo: stop - lo] = table[start:stop]
            bar.update(task, advance=out[0].nbytes * (stop - start))
    return out


def checkpoint_source(ckpt: Any, dtype: str = "float32") -> dict[str, CheckpointTensor]:
    """Model name → lazily decoded tensor for ``prepare`` (``ckpt`` from ``checkpoint.open_checkpoint``).

    ``dtype``: "float32" or "bfloat16" (what ``Checkpoint.read`` decodes to; f32 parameters stay f32).
    """
    return {name: CheckpointTensor(ckpt, name, shape, dtype) for name, shape in ckpt.model_shapes.items()}
