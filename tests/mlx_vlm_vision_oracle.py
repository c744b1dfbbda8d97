"""The vision oracle: mlx-vlm 0.7.10's independent ``deepseek_v41`` (test extra) on CPU, for the image path.

It builds mlx-vlm's ``Model`` from an official-format checkpoint directory written by ``make_tiny`` (its own
``ModelConfig.from_dict`` reads the nested ``vision_config``; its own ``sanitize`` maps the official names), so
nothing of this project's loader is involved. Everything runs in float32 with mlx-vlm's fake-quant points off
(``fake_quant_off``): mlx-vlm's V4.1 language model rounds more activations (QAT fp8 inputs of every linear)
than `MODEL.md` §C.2, so only the rounding-free model is comparable.

One deviation of mlx-vlm 0.7.10 from VISION.md §V.D is corrected here (``exact_gelu=True``, the default): its
aligner uses ``nn.GELU(approx="precise")``, which in MLX is the *tanh approximation*, while the reference (and
vLLM, fastllm) use the exact erf GELU. The difference is ~1e-4 on tiny random weights (measured 3.9e-4 on
outputs of size ~1.8), far above f32 noise (1e-6), so the tests would see it.

Import from a test with::

    sys.path.insert(0, str(Path(__file__).parent))   # tests/ has no __init__.py
    from mlx_vlm_vision_oracle import HAVE_MLX_VLM, load_vlm, vlm_encode, vlm_prefill
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

try:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_vlm.models.deepseek_v41.config import ModelConfig as VlmConfig
    from mlx_vlm.models.deepseek_v41.deepseek_v41 import Model as VlmModel
    from mlx_vlm.models.deepseek_v41.processing_deepseek_v41 import ImageInput

    HAVE_MLX_VLM = True
except ImportError:  # the test extra is not installed
    HAVE_MLX_VLM = False

# The same switch the engram oracle uses (it also covers engram's rounding); one definition.
from mlx_oracle import to_numpy
from mlx_vlm_oracle import rounding_off as fake_quant_off  # noqa: F401  (test_vision_model's)


def load_vlm(ckpt_dir: str | Path, exact_gelu: bool = True):
    """mlx-vlm's ``Model`` for ``ckpt_dir`` with every float parameter in float32 (strict weight load);
    ``exact_gelu``: the aligner's GELU is the exact erf form of VISION.md §V.D (see the module docstring)."""
    mx.set_default_device(mx.cpu)
    ckpt_dir = Path(ckpt_dir)
    config = VlmConfig.from_dict(json.loads((ckpt_dir / "config.json").read_text()))
    model = VlmModel(config)
    weights: dict = {}
    for file in sorted(ckpt_dir.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    weights = model.sanitize(weights)
    weights = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    flat = [(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating)]
    model.load_weights(flat, strict=False)
    mx.eval(model.parameters())
    if exact_gelu:
        model.aligner.act = nn.GELU(approx="none")
    return model


def vlm_encode(model, patches: np.ndarray, n_vit_h: int, n_vit_w: int) -> np.ndarray:
    """Tower + aligner of one image: patches [n, 3·ps²] → E [m, D] float32."""
    out = model.encode_image(mx.array(np.asarray(patches, np.float32)), n_vit_h, n_vit_w)
    return to_numpy(out)


def vlm_prefill(model, ids: Sequence[int], images: Sequence[tuple[int, np.ndarray, int, int, Sequence[int]]],
                chunks: Sequence[int] | None = None, image_mask: bool = True) -> np.ndarray:
    """Prefill logits [T, V] f32 of one expanded prompt. ``images``: (span start, patches [n, 3·ps²], Hv, Wv,
    span roles) each. The merged embeddings are built once for the whole prompt (mlx-vlm's
    ``get_input_embeddings``) and fed chunk by chunk with their ids (``chunks`` sizes, default one pass): a span
    then crosses chunk boundaries exactly as mlx-vlm's chunked prefill does. ``image_mask=False`` routes every
    row with the text bias (a negative control). Run inside `fake_quant_off`."""
    ids_arr = mx.array([list(map(int, ids))], dtype=mx.int32)
    records = [ImageInput(start, mx.array(np.asarray(p, np.float32)), h, w, list(map(int, types)))
               for start, p, h, w, types in images]
    embeds = model.get_input_embeddings(ids_arr, [records]).inputs_embeds
    chunks = list(chunks) if chunks is not None else [len(ids)]
    cache = model.make_cache()
    parts, start = [], 0
    for n in chunks:
        mask = None if image_mask else mx.zeros((1, n), dtype=mx.bool_)
        out = model.language_model(inputs=ids_arr[:, start:start + n], inputs_embeds=embeds[:, start:start + n],
                                   cache=cache, image_mask=mask)
        parts.append(to_numpy(out.logits[0]))
        start += n
    return np.concatenate(parts, axis=0)
