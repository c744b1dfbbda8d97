"""The bf16 tower against the f32 tower on the same weights, on whatever backend runs the suite (no mlx needed:
on a GPU this is the check of cuDNN's fused attention, `vision.tower.masked_attention`).

Reference: the f32 model (XLA attention, HIGHEST-precision dots), itself equal to mlx-vlm's tower to 1e-5
(`test_vision_model.py`). Tolerance: the bound `test_vision_model.py` holds our bf16 tower to against mlx-vlm's
f32 one (every row's cosine ≥ 0.9995 and at most 0.05 absolute on rows of size ~2: a few bf16 ulps).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from dsv41_jax.config import load_named
from dsv41_jax.loading import build_model
from dsv41_jax.make_tiny import random_weights
from dsv41_jax.model.transformer import ModelOptions
from dsv41_jax.vision import tower
from dsv41_jax.vision.batch import build_batch
from dsv41_jax.vision.preprocess import prepare_image

CFG = load_named("tiny_vision")


def test_bf16_tower_matches_f32_tower():
    flat = random_weights(CFG, seed=5)
    rng = np.random.default_rng(0)
    images = [prepare_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), CFG.vision)
              for w, h in ((4666, 1), (800, 800), (100, 70))]  # 549, 441 and 40 patches: one 1,024-patch bucket
    batch = build_batch(images, CFG.vision)
    assert batch.patches.shape[1] == 1024  # the largest bucket: the XLA path's query chunks are used too
    encode = nnx.jit(lambda m, b: m.encode_images(b))
    f32 = np.asarray(encode(build_model(CFG, ModelOptions(dtype="float32", quant_rounding=False, vision=True),
                                        flat), batch))
    bf16 = np.asarray(encode(build_model(CFG, ModelOptions(vision=True), flat), batch)).astype(np.float32)
    for i, im in enumerate(images):
        ref, got = f32[i, : im.plan.n_tokens], bf16[i, : im.plan.n_tokens]
        cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
        assert cos.min() >= 0.9995 and np.abs(got - ref).max() <= 0.05, (i, cos.min(), np.abs(got - ref).max(),
                                                                          tower.attention_impl(jnp.bfloat16))
