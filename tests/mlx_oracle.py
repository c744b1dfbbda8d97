"""The parity oracle: mlx-lm's independent ``deepseek_v41`` model (test extra), run on CPU.

It loads an official-format checkpoint directory through mlx-lm's own loader (``mlx_lm.utils.load_model``:
its ``sanitize`` maps the official names, fp8 becomes mxfp8 and fp4 mxfp4, `MODEL.md` §E.3), so nothing of
this project's loader is involved. Import from a test with::

    sys.path.insert(0, str(Path(__file__).parent))   # tests/ has no __init__.py
    from mlx_oracle import mlx_reference, fake_quant_off
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

try:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import deepseek_v41
    from mlx_lm.utils import load_model

    HAVE_MLX = True
except ImportError:  # the test extra is not installed
    HAVE_MLX = False


@contextlib.contextmanager
def fake_quant_off() -> Iterator[None]:
    """Within the block, mlx-lm's §C.2 rounding points (fp8 window KV, fp4 compressed KV / index q and k) are
    the identity. mlx-lm calls them as module globals, so patching the module is enough."""
    saved = deepseek_v41._fake_quant_fp8, deepseek_v41._fake_quant_fp4
    deepseek_v41._fake_quant_fp8 = lambda x, *a, **k: x
    deepseek_v41._fake_quant_fp4 = lambda x, *a, **k: x
    try:
        yield
    finally:
        deepseek_v41._fake_quant_fp8, deepseek_v41._fake_quant_fp4 = saved


@contextlib.contextmanager
def _gather_mm_via_f32() -> Iterator[None]:
    """MLX's CPU ``gather_mm`` (unquantised routed experts) only runs in float32. Within the block it takes
    bf16 operands by computing in float32 and rounding the result back: bf16 inputs are exact in f32, so this
    is a bf16 GEMM with f32 accumulation, which is what MLX's other bf16 matmuls do on CPU."""
    original = mx.gather_mm

    def gather_mm(a, b, *args, **kwargs):
        out_dtype = a.dtype if a.dtype == b.dtype else mx.float32
        return original(a.astype(mx.float32), b.astype(mx.float32), *args, **kwargs).astype(out_dtype)

    mx.gather_mm = gather_mm
    try:
        yield
    finally:
        mx.gather_mm = original


def load_mlx_model(ckpt_dir: str | Path, dtype: str = "float32"):
    """mlx-lm's model for ``ckpt_dir`` with float parameters cast to ``dtype``.

    "bfloat16" follows mlx-lm's own precision policy (its ``cast_predicate`` keeps ``hc``, sinks, the router
    bias and the compressor in float32, §B.1); "float32" casts every float parameter to float32. Packed
    fp8/fp4 weights stay packed (mlx-lm dequantises them exactly inside its matmuls).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', not {dtype!r}")
    mx.set_default_device(mx.cpu)
    model, _ = load_model(Path(ckpt_dir))
    keep_f32 = model.cast_predicate
    target = mx.float32 if dtype == "float32" else mx.bfloat16

    def cast(path: str, p):
        if not mx.issubdtype(p.dtype, mx.floating) or path.endswith("scales"):
            return p
        return p.astype(target if dtype == "float32" or keep_f32(path) else mx.float32)

    flat = [(k, cast(k, v)) for k, v in tree_flatten(model.parameters())]
    model.load_weights(flat, strict=False)
    mx.eval(model.parameters())
    return model


def mlx_reference(ckpt_dir: str | Path, prompt_ids: Sequence[int], decode_steps: int = 8,
                  dtype: str = "float32", chunks: Sequence[int] | None = None,
                  quant_rounding: bool = True) -> dict[str, np.ndarray]:
    """Prefill ``prompt_ids`` (one sequence) then greedy-decode ``decode_steps`` tokens with mlx-lm's cache.

    ``chunks``: prefill segment sizes summing to ``len(prompt_ids)`` (default one pass).
    ``quant_rounding=False`` runs with the §C.2 rounding points off (`fake_quant_off`).

    Returns ``prefill`` [T, V] f32 (logits at every prompt position), ``decode`` [steps, V] f32 and
    ``tokens`` [steps] int: ``tokens[0] = argmax(prefill[-1])``, ``decode[i]`` are the logits after feeding
    ``tokens[i]``, ``tokens[i+1] = argmax(decode[i])``.
    """
    if not HAVE_MLX:
        raise RuntimeError("mlx-lm is not installed (pip install -e '.[test]')")
    ids, chunks = prompt_chunks(prompt_ids, chunks)
    with contextlib.ExitStack() as stack:
        if not quant_rounding:
            stack.enter_context(fake_quant_off())
        if dtype == "bfloat16":
            stack.enter_context(_gather_mm_via_f32())
        model = load_mlx_model(ckpt_dir, dtype)
        cache = model.make_cache()
        return greedy_trace(lambda step_ids: to_numpy(model(mx.array([step_ids], dtype=mx.int32), cache)[0]),
                            ids, chunks, decode_steps)


def prompt_chunks(prompt_ids: Sequence[int], chunks: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """(ids as ints, prefill segment sizes: ``chunks`` or one pass), refusing sizes that do not split the prompt."""
    ids = [int(t) for t in prompt_ids]
    chunks = list(chunks) if chunks is not None else [len(ids)]
    if sum(chunks) != len(ids) or min(chunks) < 1:
        raise ValueError(f"chunks {chunks} do not split {len(ids)} prompt tokens")
    return ids, chunks


def greedy_trace(step, ids: list[int], chunks: list[int], decode_steps: int) -> dict[str, np.ndarray]:
    """Prefill ``ids`` in ``chunks`` then greedy-decode with ``step(ids) -> logits f32 [len(ids), V]`` (an oracle
    model bound to its own cache); returns ``prefill`` / ``decode`` / ``tokens`` as `mlx_reference` documents."""
    parts, start = [], 0
    for n in chunks:
        parts.append(step(ids[start:start + n]))
        start += n
    prefill = np.concatenate(parts, axis=0)
    token = int(np.argmax(prefill[-1]))
    decode, tokens = [], []
    for _ in range(decode_steps):
        tokens.append(token)
        row = step([token])[-1]
        decode.append(row)
        token = int(np.argmax(row))
    vocab = prefill.shape[-1]
    return {"prefill": prefill,
            "decode": np.stack(decode) if decode else np.zeros((0, vocab), np.float32),
            "tokens": np.array(tokens, dtype=np.int64)}


def to_numpy(x) -> np.ndarray:
    """An mlx array as a float32 numpy copy (evaluated)."""
    x = x.astype(mx.float32)
    mx.eval(x)
    return np.array(x, copy=True)
