"""Per-rank splits of the sharded dimensions and their zero padding (`PLANNER.md` §C, `MODEL.md` §F.2-F.3).

A split dimension is cut into contiguous per-rank ranges (the planner's widths, uneven in 128-blocks at some
worlds). JAX shards need equal sizes, so every rank's shard is padded with zeros to the widest rank's width:
the *padded* global dimension is ``world × widest`` and rank r's real entries sit at the start of its shard.

Why zero padding is exact: padded expert columns have zero w1/w3 rows and zero w2 columns, so SwiGLU gives
silu(0)·0 = 0 there and w2 adds nothing (fp4-resident experts: zero code bytes are +0 and a zero scale byte keeps
them 0, so their padding decodes to the same zeros); padded vocabulary rows are never looked up (ids < V) and
their logits are dropped before sampling (``real_vocab_index``); padded engram table rows are never looked up
either (each rank reads only rows of its own columns, ``sharding.kernels.engram_gather``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from dsv41_jax.engram import column_splits
from dsv41_jax.param_specs import FP8_BLOCK, is_fp8_dense
from dsv41_jax.planner import Split
from sharding.mesh import ShardingError
from sharding.rules import (
    ALIGNER_HIDDEN,
    ENGRAM_ROWS,
    EXPERT_MLP,
    EXPERT_MLP_CODES,
    EXPERT_MLP_SCALES,
    O_GROUPS_SCALES,
    Q_HEADS_SCALES,
    SHARED_MLP,
    SHARED_MLP_SCALES,
    VISION_GATE_UP,
    VISION_HEADS,
    VISION_MLP,
    VISION_QKV,
    VOCAB,
    check_layout,
    split_axis,
)


@dataclass(frozen=True)
class BlockedSplit:
    """A fused dimension of ``blocks`` equal parts (q | k | v rows, gate | up rows), each part made of
    ``split.total`` units of ``unit`` entries (heads of d rows, MLP columns of 1), every part split by ``split``.

    Rank r's padded shard is its units of part 0, then of part 1, … (each zero-padded to ``split.shard`` units):
    the row order of a model built with ``VisionConfig.shard_groups`` = world. Same interface as ``Split``."""

    split: Split
    blocks: int
    unit: int

    @property
    def world(self) -> int:
        return self.split.world

    @property
    def total(self) -> int:
        return self.blocks * self.split.total * self.unit

    @property
    def shard(self) -> int:
        return self.blocks * self.split.shard * self.unit

    @property
    def padded_total(self) -> int:
        return self.shard * self.world

    def shard_of(self, array, axis: int, rank: int) -> np.ndarray:
        """Rank ``rank``'s rows of every part, each zero-padded, concatenated along ``axis`` (host)."""
        part = self.split.total * self.unit
        unit_split = Split(tuple(n * self.unit for n in self.split.sizes))
        pieces = []
        for b in range(self.blocks):
            index = (slice(None),) * axis + (slice(b * part, (b + 1) * part),)
            pieces.append(unit_split.shard_of(_Window(array, index), axis, rank))
        return np.concatenate(pieces, axis=axis)

    def real_index(self) -> np.ndarray:
        """For each real entry (checkpoint order), its position in the padded dimension: int32 ``[total]``."""
        unit_split = Split(tuple(n * self.unit for n in self.split.sizes))
        inner = unit_split.real_index()  # position within [world × unit shard] of one part's entries
        rank, offset = inner // unit_split.shard, inner % unit_split.shard
        return np.concatenate([rank * self.shard + b * unit_split.shard + offset for b in range(self.blocks)]
                              ).astype(np.int32)

    def pad_full(self, array: np.ndarray, axis: int) -> np.ndarray:
        return np.concatenate([self.shard_of(array, axis, r) for r in range(self.world)], axis=axis)


class _Window:
    """``array[index]`` taken lazily: slicing it slices the source once (a lazily read checkpoint tensor reads
    only the rows asked for). ``index``: basic slices."""

    def __init__(self, array, index: tuple):
        self.array, self.index = array, index

    def __getitem__(self, inner: tuple):
        combined = list(self.index) + [slice(None)] * (len(inner) - len(self.index))
        for axis, s in enumerate(inner):
            if s != slice(None):
                lo, _, _ = combined[axis].indices(10**18)
                combined[axis] = slice(lo + (s.start or 0), lo + s.stop)
        return self.array[tuple(combined)]


@dataclass(frozen=True)
class ShardPlan:
    """How one world cuts the model: the layout and the two uneven (padded) splits.

    ``layout`` "tp": routed and shared experts split on F by ``expert_width``; "ep": whole routed experts a
    rank (E / world each), F unsplit, shared expert replicated (``rules.LOGICAL_TO_MESH``).
    Heads, groups and experts split evenly (the planner refuses worlds where they do not). With a vision tower:
    its heads and MLP columns ⌈x / W⌉ a rank, zero-padded (``Split.padded``; the fused rows as ``BlockedSplit``),
    and the aligner's columns evenly.
    """

    world: int
    layout: str
    vocab: Split
    expert_width: Split
    vision_heads: Split | None = None   # ViT heads (padded when the world does not divide them)
    vision_mlp: Split | None = None     # ViT MLP columns
    aligner_width: Split | None = None  # aligner hidden columns (D, split evenly; None: this world cannot)
    engram: tuple[tuple[int, Split], ...] = ()  # (engram layer id, its table rows split by hash column)

    @staticmethod
    def from_admission(cfg, world: int, admission, layout: str = "tp") -> "ShardPlan":
        """From the planner's ``Admission`` (per-rank ``vocab_rows`` and ``expert_widths``)."""
        check_layout(layout)
        vocab = admission.vocab_split
        if layout == "tp":
            width = admission.expert_split
        else:
            if cfg.n_routed_experts % world:
                raise ShardingError(
                    f"world {world} refused for expert parallelism: {cfg.n_routed_experts} routed experts do "
                    f"not split into whole experts over {world} ranks; use layout 'tp'")
            width = Split((cfg.moe_intermediate_size,))
        vc = cfg.vision
        if vc is None:
            return ShardPlan(world, layout, vocab, width, engram=engram_splits(cfg, world))
        aligner = Split.even(cfg.hidden_size, world) if cfg.hidden_size % world == 0 else None
        return ShardPlan(world, layout, vocab, width, Split.padded(vc.num_attention_heads, world),
                         Split.padded(vc.intermediate_size, world), aligner,
                         engram=engram_splits(cfg, world))

    def split(self, logical: str, size: int, name: str = "") -> Split | BlockedSplit:
        """The per-rank split of a dimension of logical axis ``logical`` and padded size ``size`` (``name``: the
        tensor, which picks the engram layer of an ``ENGRAM_ROWS`` split)."""
        if logical == ENGRAM_ROWS:
            layer = int(re.match(r"layers\.(\d+)\.", name).group(1))
            return dict(self.engram)[layer]
        vision = {VISION_QKV: (self.vision_heads, 3), VISION_HEADS: (self.vision_heads, 1),
                  VISION_GATE_UP: (self.vision_mlp, 2), VISION_MLP: (self.vision_mlp, 1)}
        if logical in vision:
            split, blocks = vision[logical]
            return BlockedSplit(split, blocks, size // (blocks * split.padded_total))
        if logical == ALIGNER_HIDDEN:
            if self.aligner_width is None:
                raise ShardingError(f"world {self.world} does not split the aligner's columns evenly: image "
                                    f"prompts need a world that divides the hidden size")
            return self.aligner_width
        if logical == VOCAB:
            return self.vocab
        if logical in (EXPERT_MLP, SHARED_MLP):
            return self.expert_width
        if logical in (EXPERT_MLP_CODES, EXPERT_MLP_SCALES, SHARED_MLP_SCALES):  # fp4 / fp8 bytes on F
            try:
                return self.expert_width.grouped(2 if logical == EXPERT_MLP_CODES else 32)
            except ValueError as e:
                raise ShardingError(str(e)) from None
        if logical in (Q_HEADS_SCALES, O_GROUPS_SCALES) and size % self.world:  # `check_fp8_blocks` says why
            raise ShardingError(f"world {self.world} does not split the {size} fp8 scale blocks of {name} evenly")
        return Split.even(size, self.world)

    def run_config(self, cfg):
        """The config the sharded model is built with: vocabulary and expert width padded (zeros); the vision
        tower's fused rows grouped rank by rank with its heads and MLP columns padded (``VisionConfig``); engram
        tables of world × the largest slab (the hash columns and primes are unchanged)."""
        changes = {}
        if cfg.vision is not None:
            changes["vision"] = dataclasses.replace(cfg.vision, shard_groups=self.world,
                                                    group_heads=self.vision_heads.shard,
                                                    group_mlp=self.vision_mlp.shard)
        if self.engram:
            changes["engram_num_embeddings"] = tuple(split.padded_total for _, split in self.engram)
        return cfg.replace(vocab_size=self.vocab.padded_total,
                           moe_intermediate_size=self.expert_width.padded_total, **changes)

    def padded_token_ids(self, ids):
        """Real token ids → rows of the padded embedding (identity unless the vocab padding is interleaved)."""
        if not self.vocab_interleaved:
            return ids
        starts = jnp.asarray([self.vocab.start(r) for r in range(self.world)], dtype=ids.dtype)
        rank = jnp.searchsorted(starts, ids, side="right") - 1
        return ids - starts[rank] + rank * self.vocab.shard

    @property
    def vocab_interleaved(self) -> bool:
        """True when some padding sits before real rows (not every rank but the last is full)."""
        return any(n != self.vocab.shard for n in self.vocab.sizes[:-1])

    def real_logits(self, logits):
        """Padded logits [.., V_pad] → [.., V] in real token order (padded columns dropped)."""
        if not self.vocab_interleaved:
            return logits[..., : self.vocab.total]
        shard = self.vocab.shard
        parts = [logits[..., r * shard: r * shard + n] for r, n in enumerate(self.vocab.sizes)]
        return jnp.concatenate(parts, axis=-1)


def check_fp8_blocks(plan: ShardPlan, shapes: dict[str, tuple[int, ...]]) -> None:
    """ShardingError when a split fp8 dense weight held as stored (a model name in ``shapes`` with a ``.scale``
    companion) has a shard boundary inside one of its 32×32 scale blocks: a rank would hold part of a block whose
    scale byte it shares with another rank. ``shapes``: model name → the model's (padded) shape."""
    for name, shape in shapes.items():
        if not (name.endswith(".scale") and is_fp8_dense(name)):
            continue
        weight = name.removesuffix(".scale") + ".weight"
        hit = split_axis(weight, len(shapes[weight]), plan.layout)
        if hit is None:
            continue
        axis, logical = hit
        split = plan.split(logical, shapes[weight][axis], weight)
        if any(n % FP8_BLOCK for n in split.sizes):
            what = "rows" if axis == len(shapes[weight]) - 2 else "columns"
            raise ShardingError(
                f"world {plan.world} cuts the fp8 scale blocks of {weight}: its {split.total} {what} split into "
                f"shards of {sorted(set(split.sizes))} {what}, not whole {FP8_BLOCK}-{what[:-1]} blocks. Hold the "
                f"dense weights dequantized at this world (--dense-format bf16), or use a world whose shards are "
                f"whole blocks")


def engram_splits(cfg, world: int) -> tuple[tuple[int, Split], ...]:
    """(layer id, table rows split) for every engram layer: the rows of each rank's hash columns
    (`dsv41_jax.engram.column_splits`), padded to the largest slab."""
    if not cfg.engram_layer_ids:
        return ()

    return tuple((layer, Split(split.rows))
                 for layer, split in zip(cfg.engram_layer_ids, column_splits(cfg, world), strict=True))
