"""Per-rank splits of the sharded dimensions and their zero padding (`PLANNER.md` §C, `MODEL.md` §F.2-F.3).

A split dimension is cut into contiguous per-rank ranges (the planner's widths, uneven in 128-blocks at some
worlds). JAX shards need equal sizes, so every rank's shard is padded with zeros to the widest rank's width:
the *padded* global dimension is ``world × widest`` and rank r's real entries sit at the start of its shard.

Why zero padding is exact: padded expert columns have zero w1/w3 rows and zero w2 columns, so SwiGLU gives
silu(0)·0 = 0 there and w2 adds nothing (fp4-resident experts: zero code bytes are +0 and a zero scale byte
keeps them 0, so their padding decodes to the same zeros); padded vocabulary rows are never looked up (ids < V) and their logits
are dropped before sampling (``real_vocab_index``); padded engram table rows are never looked up either (each rank
reads only rows of its own columns, ``sharding.kernels.engram_gather``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from sharding.mesh import ShardingError
from sharding.rules import (ENGRAM_ROWS, EXPERT_MLP, EXPERT_MLP_CODES, EXPERT_MLP_SCALES, SHARED_MLP, VOCAB,
                            check_layout)


@dataclass(frozen=True)
class Split:
    """One dimension of ``sum(sizes)`` entries, rank r owning ``sizes[r]`` of them, padded to ``max(sizes)``."""

    sizes: tuple[int, ...]

    @staticmethod
    def even(total: int, world: int) -> "Split":
        if total % world:
            raise ValueError(f"{total} does not split evenly over {world} ranks")
        return Split((total // world,) * world)

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def shard(self) -> int:
        """Every rank's padded shard width (the widest rank's)."""
        return max(self.sizes)

    @property
    def padded_total(self) -> int:
        return self.shard * self.world

    @property
    def is_padded(self) -> bool:
        return self.padded_total != self.total

    def grouped(self, group: int) -> "Split":
        """The same split counted in groups of ``group`` entries (fp4 bytes: 2 codes, or 32 inputs a scale)."""
        if any(n % group for n in self.sizes):
            raise ShardingError(f"per-rank widths {self.sizes} do not split into whole groups of {group}")
        return Split(tuple(n // group for n in self.sizes))

    def start(self, rank: int) -> int:
        return sum(self.sizes[:rank])

    def real_index(self) -> np.ndarray:
        """For each real entry (in order), its position in the padded dimension: int32 ``[total]``."""
        return np.concatenate([r * self.shard + np.arange(n) for r, n in enumerate(self.sizes)]).astype(np.int32)

    def shard_of(self, array, axis: int, rank: int) -> np.ndarray:
        """Rank ``rank``'s real slice of ``array`` along ``axis``, zero-padded (on the host) to ``shard`` entries.

        ``array``: anything with basic slicing (numpy, a memory map, a lazily read ``load.CheckpointTensor``):
        only the rank's real range is asked for, so a lazy source reads just those rows; the padding is added to
        what came back.
        """
        lo = self.start(rank)
        index = (slice(None),) * axis + (slice(lo, lo + self.sizes[rank]),)
        take = np.asarray(array[index])
        missing = self.shard - self.sizes[rank]
        if not missing:
            return take
        pad = [(0, 0)] * take.ndim
        pad[axis] = (0, missing)
        return np.pad(take, pad)

    def pad_full(self, array: np.ndarray, axis: int) -> np.ndarray:
        """The whole padded array (host memory; for tests and small tensors)."""
        return np.concatenate([self.shard_of(array, axis, r) for r in range(self.world)], axis=axis)


@dataclass(frozen=True)
class ShardPlan:
    """How one world cuts the model: the layout and the two uneven (padded) splits.

    ``layout`` "tp": routed and shared experts split on F by ``expert_width``; "ep": whole routed experts a
    rank (E / world each), F unsplit, shared expert replicated (``rules.LOGICAL_TO_MESH``).
    Heads, groups and experts split evenly (the planner refuses worlds where they do not).
    """

    world: int
    layout: str
    vocab: Split
    expert_width: Split
    engram: tuple[tuple[int, Split], ...] = ()  # (engram layer id, its table rows split by hash column)

    @staticmethod
    def from_admission(cfg, world: int, admission, layout: str = "tp") -> "ShardPlan":
        """From the planner's ``Admission`` (per-rank ``vocab_rows`` and ``expert_widths``)."""
        check_layout(layout)
        vocab = Split(tuple(int(n) for n in admission.vocab_rows))
        if layout == "tp":
            width = Split(tuple(int(n) for n in admission.expert_widths))
        else:
            if cfg.n_routed_experts % world:
                raise ShardingError(
                    f"world {world} refused for expert parallelism: {cfg.n_routed_experts} routed experts do "
                    f"not split into whole experts over {world} ranks; use layout 'tp'")
            width = Split((cfg.moe_intermediate_size,))
        return ShardPlan(world, layout, vocab, width, engram_splits(cfg, world))

    def split(self, logical: str, size: int, name: str = "") -> Split:
        """The per-rank split of a dimension of logical axis ``logical`` and padded size ``size`` (``name``: the
        tensor, which picks the engram layer of an ``ENGRAM_ROWS`` split)."""
        if logical == ENGRAM_ROWS:
            layer = int(re.match(r"layers\.(\d+)\.", name).group(1))
            return dict(self.engram)[layer]
        if logical == VOCAB:
            return self.vocab
        if logical in (EXPERT_MLP, SHARED_MLP):
            return self.expert_width
        if logical in (EXPERT_MLP_CODES, EXPERT_MLP_SCALES):  # fp4 w2 packed on F: 2 or 32 inputs a byte
            return self.expert_width.grouped(2 if logical == EXPERT_MLP_CODES else 32)
        return Split.even(size, self.world)

    def run_config(self, cfg):
        """The config the sharded model is built with: vocabulary and expert width padded (zeros)."""
        out = cfg.replace(vocab_size=self.vocab.padded_total, moe_intermediate_size=self.expert_width.padded_total)
        if self.engram:  # tables of world × the largest slab (the hash columns and primes are unchanged)
            out = out.replace(engram_num_embeddings=tuple(split.padded_total for _, split in self.engram))
        return out

    def padded_token_ids(self, ids):
        """Real token ids → rows of the padded embedding (identity unless the vocab padding is interleaved)."""
        if not self.vocab_interleaved:
            return ids
        import jax.numpy as jnp
        starts = jnp.asarray([self.vocab.start(r) for r in range(self.world)], dtype=ids.dtype)
        rank = jnp.searchsorted(starts, ids, side="right") - 1
        return ids - starts[rank] + rank * self.vocab.shard

    @property
    def vocab_interleaved(self) -> bool:
        """True when some padding sits before real rows (not every rank but the last is full)."""
        return any(n != self.vocab.shard for n in self.vocab.sizes[:-1])

    def real_logits(self, logits):
        """Padded logits [.., V_pad] → [.., V] in real token order (padded columns dropped)."""
        import jax.numpy as jnp
        if not self.vocab_interleaved:
            return logits[..., : self.vocab.total]
        shard = self.vocab.shard
        parts = [logits[..., r * shard: r * shard + n] for r, n in enumerate(self.vocab.sizes)]
        return jnp.concatenate(parts, axis=-1)


def engram_splits(cfg, world: int) -> tuple[tuple[int, Split], ...]:
    """(layer id, table rows split) for every engram layer: the rows of each rank's hash columns
    (`dsv41_jax.engram.column_splits`), padded to the largest slab."""
    if not cfg.engram_layer_ids:
        return ()
    from dsv41_jax.engram import column_splits  # noqa: PLC0415

    return tuple((layer, Split(split.rows))
                 for layer, split in zip(cfg.engram_layer_ids, column_splits(cfg, world), strict=True))
