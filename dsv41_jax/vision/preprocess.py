"""Host preprocessing of image prompts with Pillow (VISION.md §V.B): decode, resize plan, letterbox, normalise,
patchify, and the expansion of each image placeholder into its span with per-position roles.

Everything here is numpy + Pillow (no JAX): the letterbox is Pillow's bicubic resampler, reproduced by calling it.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import ml_dtypes
import numpy as np
from PIL import Image, ImageOps

from ..config import VisionConfig

# Per-position roles (VISION.md §V.B.5): TEXT outside spans; a span is START, rows of IMAGE + NEWLINE, END.
TEXT, START, IMAGE, NEWLINE, END = -1, 0, 1, 2, 3
MAX_IMAGE_PIXELS = 1 << 26  # 67 M pixels (e.g. 8192²): larger files are refused as absurd, before decoding
PAD_GRAY = (127, 127, 127)


class ImageError(ValueError):
    """An image the engine cannot use (missing, unreadable, not an image, absurd size); one-line message."""


@dataclass(frozen=True)
class ImagePlan:
    """The resize plan of one image (VISION.md §V.B.2): padded pixel size ``Wb × Hb``, ViT patch grid
    ``Hv × Wv`` and LLM token grid ``Hl × Wl``."""

    Hv: int
    Wv: int
    Hl: int
    Wl: int
    Hb: int
    Wb: int

    @property
    def n_patches(self) -> int:
        return self.Hv * self.Wv

    @property
    def n_tokens(self) -> int:
        """m = Hl·Wl aligner rows (IMAGE slots)."""
        return self.Hl * self.Wl

    @property
    def span_len(self) -> int:
        """S = Hl·(Wl + 1) + 2 prompt positions."""
        return span_len(self.Hl, self.Wl)


def span_len(Hl: int, Wl: int) -> int:
    return Hl * (Wl + 1) + 2


def _llm_grid(Hb: int, Wb: int, vc: VisionConfig) -> tuple[int, int]:
    r, ps = vc.downsample_ratio, vc.patch_size
    return -(-(Hb // ps) // r), -(-(Wb // ps) // r)


def plan_image(W0: int, H0: int, vc: VisionConfig) -> ImagePlan:
    """VISION.md §V.B.2 for an image of ``W0 × H0`` pixels."""
    ps, t_max = vc.patch_size, vc.max_image_tokens
    w, h = W0, H0
    if vc.max_wh_ratio is not None and w > h * vc.max_wh_ratio:
        w = int(h * vc.max_wh_ratio)
    if 0 < w * h < vc.min_pixels:  # upscale to at least min_pixels (float scale, both sides truncated)
        s = (vc.min_pixels / (w * h)) ** 0.5
        w, h = int(w * s), int(h * s)
    Wb, Hb = math.ceil(w / ps) * ps, math.ceil(h / ps) * ps
    Hl, Wl = _llm_grid(Hb, Wb, vc)
    if span_len(Hl, Wl) > t_max:  # shrink, aspect preserved, from the (upscaled) w, h
        a = h / w
        wf = math.sqrt((t_max - 2) / a + 0.25) - 0.5  # real root of a·x·(x+1) = T_max − 2
        hf = wf * a
        if wf < 1.0:
            Hb, Wb = (t_max - 2) // 2 * vc.cell, vc.cell
        elif hf < 1.0:
            Hb, Wb = vc.cell, (t_max - 3) * vc.cell
        else:
            beta = min(math.floor(wf) * vc.cell / w, math.floor(hf) * vc.cell / h)
            Hb, Wb = math.floor(h * beta / ps) * ps, math.floor(w * beta / ps) * ps
        Hl, Wl = _llm_grid(Hb, Wb, vc)
        assert span_len(Hl, Wl) <= t_max
    return ImagePlan(Hv=Hb // ps, Wv=Wb // ps, Hl=Hl, Wl=Wl, Hb=Hb, Wb=Wb)


def letterbox(image: Image.Image, plan: ImagePlan, vc: VisionConfig) -> Image.Image:
    """VISION.md §V.B.3: fit (bicubic) and pad with gray 127 to ``Wb × Hb``; the inactive cap path stretches."""
    size = (plan.Wb, plan.Hb)
    if vc.max_wh_ratio is not None and image.width >= vc.max_wh_ratio * image.height:
        return image.resize(size)
    return ImageOps.pad(image, size, method=Image.Resampling.BICUBIC, color=PAD_GRAY)


# v(q) = bf16((q/255 − 0.5)/0.5), f32 arithmetic (VISION.md §V.B.4): a table over the 256 byte values.
_NORMALISED = ((np.arange(256, dtype=np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
               ).astype(ml_dtypes.bfloat16)


def patchify(pixels: np.ndarray, ps: int) -> np.ndarray:
    """uint8 pixels [Hb, Wb, 3] → normalised patches bf16 [n, 3·ps²], row-major patches, each channel-major
    (element ``c·ps² + dy·ps + dx``, VISION.md §V.B.4)."""
    Hb, Wb, _ = pixels.shape
    v = _NORMALISED[pixels]  # [Hb, Wb, 3]
    v = v.reshape(Hb // ps, ps, Wb // ps, ps, 3).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(v.reshape((Hb // ps) * (Wb // ps), 3 * ps * ps))


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: ``patches`` bf16 [n, 3·ps²] and its plan."""

    patches: np.ndarray
    plan: ImagePlan


def open_image(source: str | Path | bytes) -> Image.Image:
    """Decode a file path or encoded bytes to RGB (alpha dropped, no EXIF rotation, VISION.md §V.B.1).

    Raises ImageError (one line) for a missing or unreadable file, a non-image, or an absurd size."""
    name = "the image" if isinstance(source, bytes) else str(source)
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
    except FileNotFoundError:
        raise ImageError(f"image {name} does not exist") from None
    except OSError as e:
        raise ImageError(f"cannot read image {name}: {e.strerror or e}") from None
    try:
        with warnings.catch_warnings():  # the size is checked below, before decoding: no bomb warning needed
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        with img:
            w, h = img.size
            if w < 1 or h < 1 or w * h > MAX_IMAGE_PIXELS:
                raise ImageError(f"image {name} is {w}×{h} pixels: sizes from 1 pixel up to "
                                 f"{MAX_IMAGE_PIXELS:,} pixels are accepted")
            return img.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError:
        raise ImageError(f"image {name} is larger than {MAX_IMAGE_PIXELS:,} pixels") from None
    except (OSError, ValueError, SyntaxError) as e:  # PIL's "cannot identify image file", truncated data, ...
        raise ImageError(f"{name} is not a readable image ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                         ) from None


def prepare_image(image: Image.Image, vc: VisionConfig) -> PreparedImage:
    """An RGB image → patches and plan (VISION.md §V.B.2–§V.B.4)."""
    image = image.convert("RGB")
    plan = plan_image(image.width, image.height, vc)
    pixels = np.asarray(letterbox(image, plan, vc), dtype=np.uint8)
    return PreparedImage(patchify(pixels, vc.patch_size), plan)


def load_image(source: str | Path | bytes, vc: VisionConfig) -> PreparedImage:
    return prepare_image(open_image(source), vc)


# ---------------------------------------------------------------------------------------------- prompt spans
def span_roles(Hl: int, Wl: int) -> np.ndarray:
    """[START] + ([IMAGE]·Wl + [NEWLINE])·Hl + [END] as int8 [S] (VISION.md §V.B.5)."""
    row = [IMAGE] * Wl + [NEWLINE]
    return np.array([START] + row * Hl + [END], dtype=np.int8)


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with its image spans expanded: ``ids`` [T] (every span position holds the image token id),
    ``roles`` int8 [T] (TEXT = −1 outside spans, START/IMAGE/NEWLINE/END inside), the images in order and the
    position of each span's START. ``is_image = roles >= 0`` is the per-position mask the router (and engram's
    DEAD marking) reads (VISION.md §V.E.3–§V.E.4)."""

    ids: tuple[int, ...]
    roles: np.ndarray
    images: tuple[PreparedImage, ...]
    starts: tuple[int, ...]

    @property
    def is_image(self) -> np.ndarray:
        return self.roles >= 0


def expand_prompt(ids: Sequence[int], images: Sequence[PreparedImage], image_token_id: int) -> ImagePrompt:
    """Replace the k-th ``image_token_id`` of ``ids`` by image k's span. ValueError if the counts differ."""
    n_marks = sum(int(t) == image_token_id for t in ids)
    if n_marks != len(images):
        raise ValueError(f"the prompt has {n_marks} image placeholder(s) (id {image_token_id}) for "
                         f"{len(images)} image(s)")
    out_ids: list[int] = []
    roles: list[np.ndarray] = []
    starts = []
    pending = iter(images)
    for t in ids:
        if int(t) != image_token_id:
            out_ids.append(int(t))
            roles.append(np.array([TEXT], np.int8))
            continue
        plan = next(pending).plan
        starts.append(len(out_ids))
        span = span_roles(plan.Hl, plan.Wl)
        out_ids += [image_token_id] * len(span)
        roles.append(span)
    roles_arr = np.concatenate(roles) if roles else np.zeros((0,), np.int8)
    return ImagePrompt(tuple(out_ids), roles_arr, tuple(images), tuple(starts))
