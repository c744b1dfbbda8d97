"""Admission (PLANNER.md §C): how heads, output groups, expert width and vocabulary split over a world.


Split granularity (§C, decided here). Widths are cut into ``block``-wide blocks (default 128: kernel tiles and
the reference's Hadamard blocks); ranks r < s get q + 1 blocks, the rest q (``q, s = divmod(blocks, world)``).
When the width is not a multiple of the block, or has fewer blocks than ranks (a rank would own nothing), the
block is halved until it fits, never below 32 — the quantisation group (fp8 32×32 scale blocks, fp4 per-32
scales), so a cut never splits a scale group. The full model never falls back (2,304 = 18 × 128 columns,
129,280 = 1,010 × 128 rows: 640/640/512/512 at world 4, as §C requires); the tiny model's 256-wide experts
fall back to 64 at world 4 and 32 at world 8 (64 / 32 columns a rank, MODEL.md §A.3).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41_jax.config import ModelConfig

from .options import BMQ_MAX, MIN_BLOCK, PlanRefused


@dataclass(frozen=True)
class Split:
    """One dimension of ``sum(sizes)`` entries cut over ranks (§C): rank r owns ``sizes[r]`` contiguous entries,
    in ``block``-wide blocks (1: any width).

    Real layout: rank r owns entries ``[start(r), start(r) + sizes[r])``. Padded layout (JAX even sharding):
    every shard is ``shard`` wide (the widest rank's size), rank r's real entries come first in its shard and the
    rest is zero padding; the padded total is ``world × shard``. The planner cuts the admission's splits
    (`split_blocks`); ``sharding.layout`` places tensors with them (``shard_of``: numpy, imported on call, so
    the planner stays free of array libraries at import).
    """

    sizes: tuple[int, ...]
    block: int = 1

    @staticmethod
    def even(total: int, world: int) -> "Split":
        if total % world:
            raise ValueError(f"{total} does not split evenly over {world} ranks")
        return Split((total // world,) * world)

    @staticmethod
    def padded(total: int, world: int) -> "Split":
        """``total`` entries over ``world`` ranks, ⌈total / world⌉ a rank in order (the last ones may hold fewer,
        or none): zero-padded where the world does not divide ``total``."""
        each = -(-total // world)
        return Split(tuple(min(each, max(total - r * each, 0)) for r in range(world)))

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

    def start(self, rank: int) -> int:
        return sum(self.sizes[:rank])

    def grouped(self, group: int) -> "Split":
        """The same split counted in groups of ``group`` entries (fp4 bytes: 2 codes, or 32 inputs a scale)."""
        if any(n % group for n in self.sizes):
            raise ValueError(f"per-rank widths {self.sizes} do not split into whole groups of {group}")
        return Split(tuple(n // group for n in self.sizes), max(self.block // group, 1))

    def real_range(self, rank: int) -> tuple[int, int]:
        """Rank's entries in the unpadded (checkpoint) layout: [start, stop)."""
        start = self.start(rank)
        return start, start + self.sizes[rank]

    def padded_range(self, rank: int) -> tuple[int, int]:
        """Where rank's real entries sit in the padded layout: [start, stop); [stop, (rank+1)·shard) is padding."""
        start = rank * self.shard
        return start, start + self.sizes[rank]

    def padded_index(self) -> list[int]:
        """For each of the ``padded_total`` positions, the real entry it holds, or -1 for padding.

        Gathering a checkpoint tensor with it (and zeroing the -1 positions) gives the padded layout.
        """
        out: list[int] = []
        for r in range(self.world):
            lo, hi = self.real_range(r)
            out += list(range(lo, hi)) + [-1] * (self.shard - (hi - lo))
        return out

    def real_index(self):
        """For each real entry (in order), its position in the padded dimension: numpy int32 ``[total]``."""
        import numpy as np  # noqa: PLC0415 - the planner imports no numpy; host arrays for the sharded loader only

        return np.concatenate([r * self.shard + np.arange(n) for r, n in enumerate(self.sizes)]).astype(np.int32)

    def shard_of(self, array, axis: int, rank: int):
        """Rank ``rank``'s real slice of ``array`` along ``axis``, zero-padded (on the host) to ``shard`` entries.

        ``array``: anything with basic slicing (numpy, a memory map, a lazily read ``load.CheckpointTensor``):
        only the rank's real range is asked for, so a lazy source reads just those rows; the padding is added to
        what came back.
        """
        import numpy as np  # noqa: PLC0415 - the planner imports no numpy; host arrays for the sharded loader only

        lo, hi = self.real_range(rank)
        take = np.asarray(array[(slice(None),) * axis + (slice(lo, hi),)])
        missing = self.shard - self.sizes[rank]
        if not missing:
            return take
        pad = [(0, 0)] * take.ndim
        pad[axis] = (0, missing)
        return np.pad(take, pad)

    def pad_full(self, array, axis: int):
        """The whole padded array (host memory; for tests and small tensors)."""
        import numpy as np  # noqa: PLC0415 - the planner imports no numpy; host arrays for the sharded loader only

        return np.concatenate([self.shard_of(array, axis, r) for r in range(self.world)], axis=axis)


def split_blocks(total: int, world: int, *, block: int = 128, uneven: bool = True,
                 what: str = "width") -> Split:
    """Cut ``total`` over ``world`` ranks in blocks (§C); refuse (rule "admission") when no block ≥ 32 fits."""
    g = block
    while g >= MIN_BLOCK and (total % g or total // g < world):
        g //= 2  # fallback: a rank would own nothing, or the width is not whole blocks (module docstring)
    if g < MIN_BLOCK:
        raise PlanRefused("admission", f"world {world} refused: {what} {total:,} cannot be cut into {world} "
                          f"shards of whole {MIN_BLOCK}-column blocks (tried blocks {block} down to {MIN_BLOCK}). "
                          f"Use a smaller world.")
    blocks = total // g
    q, s = divmod(blocks, world)
    if s and not uneven:
        raise PlanRefused("admission", f"world {world} refused: {what} {total:,} is {blocks} blocks of {g}, "
                          f"which {world} ranks cannot share evenly, and block splitting is off. Turn it on "
                          f"({_describe_widths(_uneven_widths(blocks, world, g))}) or use a world dividing "
                          f"{blocks}.")
    return Split(_uneven_widths(blocks, world, g), g)


def _uneven_widths(blocks: int, world: int, g: int) -> tuple[int, ...]:
    q, s = divmod(blocks, world)
    return tuple((q + 1 if r < s else q) * g for r in range(world))


def _describe_widths(widths: tuple[int, ...]) -> str:
    return "/".join(f"{w:,}" for w in widths)


@dataclass(frozen=True)
class Admission:
    """What each rank of a world owns (§C, MODEL.md §F)."""

    world: int
    heads_per_rank: int  # H_l
    groups_per_rank: int  # G_l (wo_a output groups)
    head_tile: int  # BMQ = min(32, H_l) (R4)
    expert_split: Split  # routed and shared expert width
    vocab_split: Split  # embed / head rows

    @property
    def expert_widths(self) -> tuple[int, ...]:
        return self.expert_split.sizes

    @property
    def vocab_rows(self) -> tuple[int, ...]:
        return self.vocab_split.sizes

    @property
    def expert_width_padded(self) -> int:
        return self.expert_split.shard

    @property
    def vocab_padded(self) -> int:
        return self.vocab_split.shard

    @property
    def attention_grid(self) -> int:
        return -(-self.heads_per_rank // self.head_tile)

    @property
    def widest_rank(self) -> int:
        """The first rank with the widest expert shard (binds memory and time, §C)."""
        widths = self.expert_widths
        return widths.index(max(widths))

    def expert_columns(self, rank: int) -> tuple[int, int]:
        """Rank's real expert columns inside the padded layout (§C; padding is zero w1/w3 rows, w2 columns)."""
        return self.expert_split.padded_range(rank)

    def vocab_slice(self, rank: int) -> tuple[int, int]:
        """Rank's real vocabulary rows inside the padded layout."""
        return self.vocab_split.padded_range(rank)


def admit(cfg: ModelConfig, world: int, *, block: int = 128, uneven: bool = True) -> Admission:
    """Admit ``world`` for ``cfg`` or raise `PlanRefused` (R4 for heads/groups, "admission" for widths)."""
    H, G = cfg.num_attention_heads, cfg.o_groups
    if world < 1 or H % world or G % world:
        raise PlanRefused("R4", f"world {world} refused: {H} heads in {G} output groups of {H // G} cannot be "
                          f"split over {world} ranks (each rank must own whole groups). Use a world dividing "
                          f"{G} (e.g. {_divisors_up_to(G)}).")
    h_l, g_l = H // world, G // world
    return Admission(
        world=world, heads_per_rank=h_l, groups_per_rank=g_l, head_tile=min(BMQ_MAX, h_l),
        expert_split=split_blocks(cfg.moe_intermediate_size, world, block=block, uneven=uneven,
                                  what="expert width"),
        vocab_split=split_blocks(cfg.vocab_size, world, block=block, uneven=uneven, what="vocabulary"),
    )


def _divisors_up_to(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
