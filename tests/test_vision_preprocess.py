"""Image preprocessing (VISION.md §V.B) against mlx-vlm 0.7.10's independent ``processing_deepseek_v41``
(called directly with ids and PIL images: no tokenizer, nothing downloaded), and against §V.A / §V.B.6's
worked examples.

Tolerances: plans, span lengths and roles exactly. Pixels: mlx-vlm keeps the normalised values in float32, we
round them to bf16 (§V.B.4: the reference's tower input is bf16), computed by the same f32 formula; so each of
our values must be mlx-vlm's rounded to nearest bf16 (|diff| ≤ half a bf16 ulp of |v| ≤ 1, i.e. ≤ 2⁻⁹), and
equal after the same rounding.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from dsv41_jax.config import load_named
from dsv41_jax.vision.preprocess import (
    END,
    IMAGE,
    NEWLINE,
    START,
    TEXT,
    ImageError,
    expand_prompt,
    load_image,
    open_image,
    plan_image,
    prepare_image,
    span_roles,
)

P = pytest.importorskip("mlx_vlm.models.deepseek_v41.processing_deepseek_v41")
from mlx_vlm.models.deepseek_v41.config import ModelConfig as MlxConfig  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "test_image.png"
TINY = load_named("tiny_vision")
FULL = load_named("dsv41_flash")


def mlx_config(cfg):
    return MlxConfig.from_dict(cfg.to_dict())


def synthetic(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A deterministic image with structure (gradients + noise) in ``mode``."""
    rng = np.random.default_rng(seed + w * 7919 + h)
    x = np.arange(w, dtype=np.int32)[None, :]
    y = np.arange(h, dtype=np.int32)[:, None]
    noise = rng.integers(0, 64, (min(h, 64), min(w, 64)), dtype=np.int32)
    noise = np.tile(noise, (-(-h // noise.shape[0]), -(-w // noise.shape[1])))[:h, :w]
    base = [x * 255 // max(w - 1, 1) + 0 * y, y * 255 // max(h - 1, 1) + 0 * x, (x ^ y) & 255]
    pixels = np.stack([np.clip(c + noise - 32, 0, 255) for c in base], -1).astype(np.uint8)
    rgb = Image.fromarray(pixels, "RGB")
    if mode == "RGB":
        return rgb
    if mode == "RGBA":
        rgba = rgb.convert("RGBA")
        rgba.putalpha(Image.fromarray(rng.integers(0, 256, (h, w)).astype(np.uint8)))
        return rgba
    if mode == "P":
        return rgb.quantize(colors=16)
    return rgb.convert(mode)  # "L", "LA", "I;16" ...


SIZES = [(1, 1), (3, 2), (20, 40), (40, 20), (56, 56), (100, 70), (30, 300), (300, 30), (544, 544),
         (640, 480), (450, 308), (1024, 701), (2000, 3), (3, 2000), (1500, 1500), (4000, 1000)]
MODES = ["RGB", "RGBA", "L", "P", "LA", "CMYK"]


@pytest.mark.parametrize("cfg", [TINY, FULL], ids=["tiny_vision", "release"])
def test_plan_spans_and_pixels_equal_mlx_vlm(cfg):
    vc, mcfg = cfg.vision, mlx_config(cfg)
    for i, (w, h) in enumerate(SIZES):
        image = synthetic(w, h, MODES[i % len(MODES)] if w * h < 500_000 else "RGB", seed=i)
        ours = prepare_image(image, vc)
        patches, vh, vw, lh, lw = P.load_image(image, mcfg)
        assert (ours.plan.Hv, ours.plan.Wv, ours.plan.Hl, ours.plan.Wl) == (vh, vw, lh, lw), (w, h)
        assert ours.plan.span_len == P.num_image_tokens(lh, lw) <= vc.max_image_tokens
        ref = np.array(patches, dtype=np.float32).reshape(vh * vw, -1)
        got = ours.patches.astype(np.float32)
        assert ours.patches.dtype == ml_dtypes.bfloat16 and got.shape == ref.shape
        assert np.abs(got - ref).max() <= 2.0**-9, (w, h)
        np.testing.assert_array_equal(got, ref.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_prompt_expansion_equals_mlx_vlm():
    vc, mcfg, tok = TINY.vision, mlx_config(TINY), TINY.image_token_id
    images = [synthetic(100, 70, "RGB", 1), synthetic(30, 300, "P", 2), synthetic(56, 56, "L", 3)]
    ids = [0, 5, tok, 7, 8, tok, tok, 9]  # two adjacent images: only the roles tell them apart
    ours = expand_prompt(ids, [prepare_image(im, vc) for im in images], tok)
    tokens, types, inputs = P.prepare_vl_inputs(ids, images, mcfg)
    assert list(ours.ids) == tokens and ours.roles.tolist() == types
    assert list(ours.starts) == [inp.start for inp in inputs]
    assert ours.is_image.tolist() == [t >= 0 for t in types]
    with pytest.raises(ValueError, match="2 image placeholder"):
        expand_prompt([tok, tok], [ours.images[0]], tok)


def test_tiny_examples_of_spec():
    # VISION.md §V.A (TINY-V): W×H → ViT grid (Wv×Hv as written there, i.e. columns × rows) and span.
    table = {(20, 40): ((3, 6), 6), (40, 20): ((6, 3), 5), (56, 56): ((4, 4), 8), (100, 70): ((8, 5), 10),
             (30, 300): ((3, 22), 18)}
    for (w, h), ((a, b), span) in table.items():
        plan = plan_image(w, h, TINY.vision)
        assert {(plan.Hv, plan.Wv), (plan.Wv, plan.Hv)} >= {(a, b)} and plan.span_len == span, (w, h, plan)
    assert (plan_image(20, 40, TINY.vision).Hv, plan_image(20, 40, TINY.vision).Wv) == (6, 3)  # HF test


@pytest.mark.parametrize("wh, padded, grid, llm, span", [
    ((100, 100), (546, 546), (39, 39), (13, 13), 184), ((544, 544), (546, 546), (39, 39), (13, 13), 184),
    ((640, 480), (644, 490), (35, 46), (12, 16), 206), ((450, 308), (658, 462), (33, 47), (11, 16), 189),
    ((1024, 701), (1036, 714), (51, 74), (17, 25), 444), ((1920, 1080), (1708, 966), (69, 122), (23, 41), 968),
    ((1080, 1920), (966, 1708), (122, 69), (41, 23), 986), ((1302, 1302), (1302, 1302), (93, 93), (31, 31), 994),
    ((5000, 5000), (1302, 1302), (93, 93), (31, 31), 994), ((4000, 1000), (2520, 630), (45, 180), (15, 60), 917),
    ((10000, 100), (10010, 112), (8, 715), (3, 239), 722)])
def test_release_worked_examples(wh, padded, grid, llm, span):
    plan = plan_image(*wh, FULL.vision)  # VISION.md §V.B.6
    assert ((plan.Wb, plan.Hb), (plan.Hv, plan.Wv), (plan.Hl, plan.Wl), plan.span_len) == (padded, grid, llm, span)
    assert plan.n_patches == grid[0] * grid[1]


def test_letterbox_offsets_of_spec():
    # VISION.md §V.B.3: 640×480 → fit 644×483 at rows 4…486 of 490 (gray 127 above and below).
    image = Image.new("RGB", (640, 480), (255, 0, 0))
    prepared = prepare_image(image, FULL.vision)
    rows = prepared.patches.astype(np.float32)[:, 0].reshape(35, 46)  # red channel, pixel (0, 0) of each patch
    gray = float(np.float32(127 / 255 - 0.5) / np.float32(0.5))
    assert rows[0, 0] == pytest.approx(gray, abs=2**-8)  # patch row 0 starts at pixel row 0: padding
    assert rows[1, 0] == 1.0  # pixel row 14 is inside the fitted image


def test_span_roles_layout():
    assert span_roles(2, 3).tolist() == [START, IMAGE, IMAGE, IMAGE, NEWLINE, IMAGE, IMAGE, IMAGE, NEWLINE, END]
    assert TEXT == -1


def test_fixture_image_and_bad_images(tmp_path):
    prepared = load_image(FIXTURE, TINY.vision)
    assert (prepared.plan.Hv, prepared.plan.Wv, prepared.plan.span_len) == (5, 8, 10)  # 100×70, §V.A
    with pytest.raises(ImageError, match="does not exist"):
        open_image(tmp_path / "missing.png")
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ImageError, match="not a readable image"):
        open_image(tmp_path / "text.png")
    (tmp_path / "cut.png").write_bytes(FIXTURE.read_bytes()[:200])
    with pytest.raises(ImageError, match="not a readable image"):
        open_image(tmp_path / "cut.png")
    with pytest.raises(ImageError, match="cannot read|not a readable"):
        open_image(tmp_path)  # a directory
    huge = tmp_path / "huge.png"  # 10000×10000 1-bit image: tiny file, absurd size (checked before decoding)
    Image.new("1", (10000, 10000)).save(huge)
    with pytest.raises(ImageError, match="pixels"):
        open_image(huge)
