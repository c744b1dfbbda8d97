"""A second parity oracle: mlx-vlm's independent ``deepseek_v41`` (test extra, 0.7.10), run on CPU.

mlx-vlm's V4.1 model has what mlx-lm's lacks: engram (`MODEL.md` §B.12; hashing from the checkpoint
directory's ``engram_token_map.json`` or ``tokenizer.json``, tables e4m3 + ue8m0 read row-wise from the shards)
and the vision path. It loads an official-format directory through its own loader (``mlx_vlm.utils.load_model``
and its ``sanitize``), so nothing of this project's loader or hash is involved. Import from a test with::

    sys.path.insert(0, str(Path(__file__).parent))   # tests/ has no __init__.py
    from mlx_vlm_oracle import vlm_reference

Differences from the official numerics that the oracle switches off or that tests account for:

* mlx-vlm rounds the inputs of its dense GEMMs (and the engram rows before ``wkv``) to fp8, like the official
  inference and unlike mlx-lm (`MODEL.md` §C.2); `rounding_off` makes every one of its fake-quant calls the
  identity — GEMM inputs and the §C.2 cache points alike (they share functions), so compare with this
  project's ``quant_rounding=False``.
* its engram gate takes ``+sqrt(1e-6) = +1e-3`` at a dot product of exactly 0 where §B.12 has sign(0) = 0
  (never met on random weights).
* it treats every ``image_token_id`` in the ids as an image position (engram DEAD, gate 0, ``bias_vl``
  routing): text-only parity prompts must avoid that id.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from mlx_oracle import greedy_trace, prompt_chunks, to_numpy  # tests/ is on sys.path (conftest)

try:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.deepseek_v41 import engram as vlm_engram
    from mlx_vlm.models.deepseek_v41 import language as vlm_language
    from mlx_vlm.utils import load_model

    HAVE_MLX_VLM = True
except ImportError:  # the test extra is not installed
    HAVE_MLX_VLM = False

_FAKE_QUANT = ("fake_quant_fp8_ue8m0", "fake_quant_fp4_ue8m0", "fake_quant_fp4_e4m3")


@contextlib.contextmanager
def rounding_off() -> Iterator[None]:
    """Within the block, every mlx-vlm fake-quant call (GEMM inputs, engram rows, window / compressed KV, index
    q and k) is the identity. They are module globals of ``language`` and ``engram``, so patching is enough."""
    saved = [(mod, name, getattr(mod, name)) for mod in (vlm_language, vlm_engram) for name in _FAKE_QUANT
             if hasattr(mod, name)]
    for mod, name, _ in saved:
        setattr(mod, name, lambda x, *a, **k: x)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def load_vlm_model(ckpt_dir: str | Path, dtype: str = "float32"):
    """mlx-vlm's ``deepseek_v41`` Model for ``ckpt_dir`` (vision modules disabled when the directory has no
    vision weights), float parameters cast to float32 with ``dtype="float32"`` (packed weights stay packed;
    mlx-vlm dequantises them exactly). ``"bfloat16"`` keeps the checkpoint's own dtypes."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', not {dtype!r}")
    mx.set_default_device(mx.cpu)
    # strict=False: a text-only tiny checkpoint has no image_start / image_end / image_newline (unused by text).
    model = load_model(Path(ckpt_dir), strict=False)
    if dtype == "float32":
        flat = [(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())
                if mx.issubdtype(v.dtype, mx.floating) and not k.endswith(("scales", "biases"))]
        model.load_weights(flat, strict=False)
    mx.eval(model.parameters())
    return model


def vlm_reference(ckpt_dir: str | Path, prompt_ids: Sequence[int], decode_steps: int = 8,
                  dtype: str = "float32", chunks: Sequence[int] | None = None,
                  quant_rounding: bool = False) -> dict[str, np.ndarray]:
    """Prefill ``prompt_ids`` (one sequence, in ``chunks``, default one pass) then greedy-decode
    ``decode_steps`` tokens with mlx-vlm's own cache (which carries its engram history).

    Returns ``prefill`` [T, V] f32, ``decode`` [steps, V] f32 and ``tokens`` [steps] as `mlx_oracle.mlx_reference`:
    ``tokens[0] = argmax(prefill[-1])``, ``decode[i]`` are the logits after feeding ``tokens[i]``.
    """
    if not HAVE_MLX_VLM:
        raise RuntimeError("mlx-vlm is not installed (pip install -e '.[test]')")
    ids, chunks = prompt_chunks(prompt_ids, chunks)
    with contextlib.ExitStack() as stack:
        if not quant_rounding:
            stack.enter_context(rounding_off())
        lm = load_vlm_model(ckpt_dir, dtype).language_model
        cache = lm.make_cache()
        return greedy_trace(lambda step_ids: to_numpy(lm(input_ids=mx.array([step_ids]), cache=cache).logits[0]),
                            ids, chunks, decode_steps)
