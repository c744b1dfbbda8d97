"""Static-shape batches for the tower (VISION.md §V.G): images padded to the planner's patch / token buckets
(`planner.patch_bucket`, `planner.token_bucket`), with the RoPE coordinates, the key mask and the aligner's 3×3
gather built on the host from each image's grid."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import ml_dtypes
import numpy as np

from ..config import VisionConfig
from ..planner import patch_bucket, token_bucket
from .preprocess import END, IMAGE, PreparedImage


class ImageBatch(NamedTuple):
    """B images padded to N patches and M aligner rows.

    patches bf16 [B, N, 3·ps²] (zero padding); rows, cols int32 [B, N] (patch row / column, the 2-D RoPE
    coordinates); valid bool [B, N] (real patches, a prefix of each row: the keys the ViT attends to); gather
    int32 [B, M, r²] (the source patch of each element of a 3×3 cell, `c·r² + 3·di + dj` order of VISION.md
    §V.D; 0 where invalid) and gather_valid bool [B, M, r²] (False for the zero padding of partial cells and
    padded rows).
    """

    patches: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    valid: np.ndarray
    gather: np.ndarray
    gather_valid: np.ndarray


def build_batch(images: Sequence[PreparedImage], vc: VisionConfig, n_bucket: int | None = None,
                m_bucket: int | None = None) -> ImageBatch:
    """Pad ``images`` to one (N, M) bucket (default: the planner's buckets of the largest image)."""
    n = n_bucket or patch_bucket(max(im.plan.n_patches for im in images), vc)
    m = m_bucket or token_bucket(max(im.plan.n_tokens for im in images), vc)
    r, b = vc.downsample_ratio, len(images)
    out = ImageBatch(np.zeros((b, n, vc.patch_dim), ml_dtypes.bfloat16), np.zeros((b, n), np.int32),
                     np.zeros((b, n), np.int32), np.zeros((b, n), bool), np.zeros((b, m, r * r), np.int32),
                     np.zeros((b, m, r * r), bool))
    for i, im in enumerate(images):
        p = im.plan
        if p.n_patches > n or p.n_tokens > m:
            raise ValueError(f"image {i} ({p.n_patches} patches, {p.n_tokens} tokens) exceeds the bucket ({n}, {m})")
        out.patches[i, : p.n_patches] = im.patches
        t = np.arange(p.n_patches)
        out.rows[i, : p.n_patches], out.cols[i, : p.n_patches] = t // p.Wv, t % p.Wv
        out.valid[i, : p.n_patches] = True
        # cell (a, b), element 3·di + dj ← patch (3a + di, 3b + dj) when inside the ViT grid (§V.D).
        a, bb, di, dj = np.meshgrid(np.arange(p.Hl), np.arange(p.Wl), np.arange(r), np.arange(r), indexing="ij")
        y, x = r * a + di, r * bb + dj
        inside = (y < p.Hv) & (x < p.Wv)
        out.gather[i, : p.n_tokens] = np.where(inside, y * p.Wv + x, 0).reshape(p.n_tokens, r * r)
        out.gather_valid[i, : p.n_tokens] = inside.reshape(p.n_tokens, r * r)
    return out


def image_row_index(roles: np.ndarray, first_row: Sequence[int], starts: Sequence[int]) -> np.ndarray:
    """For one expanded prompt: int32 [T], the row of the encoded-image table holding each IMAGE position's
    aligner output (−1 elsewhere). Image k's span starts at ``starts[k]``; its aligner rows are table rows
    ``first_row[k] + s`` for its s-th IMAGE slot (reading order, VISION.md §V.B.5)."""
    out = np.full(roles.shape, -1, np.int32)
    for start, first in zip(starts, first_row):
        end = start + int(np.argmax(roles[start:] == END)) + 1
        slots = np.flatnonzero(roles[start:end] == IMAGE)
        out[start + slots] = first + np.arange(len(slots), dtype=np.int32)
    return out
