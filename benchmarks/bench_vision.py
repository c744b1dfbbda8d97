"""Vision tower + aligner timing on one GPU (VISION.md §V.C–§V.D, §V.G): the largest images, alone and batched.

PYTHONPATH=. python benchmarks/bench_vision.py [--config dsv41_flash] [--dtype bfloat16] [--reps 10] [--batch 4]
    [--attention auto|xla|cudnn] [--json PATH]

Random device-side weights at full width (ViT 32 × 1024, aligner 9216 → 5120 → 5120, bf16). Two images, each
padded to its bucket (`vision.batch`): a 1302×1302 square (93×93 = 8,649 patches, 961 tokens, span 994: the
largest square) and a 14,000×1 strip (its plan: 3 × 3,063 = 9,189 patches, 1,021 tokens, span 1,024: the largest
n of any image, §V.B.7); both run at the top bucket of 9,216 patches and 1,024 rows; then ``--batch`` squares
in one tower call. Prints, per case, measured / floor and their ratio, the FLOPs of the real images and of the
padded buckets (linear layers 2·n·(588·C + N_v·C·(4C + 3I)) + attention N_v·4·n²·C + aligner 2·m·(9C·D + D²)
an image), the floor = padded FLOPs / the bf16 dense peak (989 TFLOP/s for an H200 SXM). ``--attention``: the
tower's attention (auto: cuDNN's fused kernel for bf16 on a GPU, else XLA's chunked one;
`vision.tower.masked_attention`); a case whose cuDNN call fails is retried with XLA and says so.
``--config tiny_vision`` is a CPU dry run of the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsv41_jax.config import load_named
from dsv41_jax.vision import tower
from dsv41_jax.vision.batch import build_batch
from dsv41_jax.vision.preprocess import PreparedImage, plan_image
from dsv41_jax.vision.tower import Aligner, VisionTower

PEAK_FLOPS = 989e12  # H200 SXM bf16 dense


class Encoder(nnx.Module):
    """The tower and the aligner as the text model holds them (`Transformer.encode_images`)."""

    def __init__(self, cfg, dtype, rngs):
        self.vision = VisionTower(cfg.vision, dtype=dtype, rngs=rngs)
        self.aligner = Aligner(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, batch):
        return self.aligner(self.vision(batch), batch)


def flops(cfg, n: int, m: int) -> float:
    vc = cfg.vision
    c, i, d = vc.hidden_size, vc.intermediate_size, cfg.hidden_size
    linear = 2 * n * (vc.patch_dim * c + vc.num_hidden_layers * c * (4 * c + 3 * i))
    attention = vc.num_hidden_layers * 4 * n * n * c
    aligner = 2 * m * (vc.downsample_ratio**2 * c * d + d * d)
    return float(linear + attention + aligner)


def timed(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(run, encoder, cfg, images, reps: int) -> dict:
    """Compile and time one tower call over ``images`` (PreparedImage list, one bucket)."""
    batch = build_batch(images, cfg.vision)
    n_pad, m_pad = batch.patches.shape[1], batch.gather.shape[1]
    t_c = time.perf_counter()
    jax.block_until_ready(run(encoder, batch))
    compile_s = time.perf_counter() - t_c
    seconds = timed(run, encoder, batch, reps=reps)
    real = sum(flops(cfg, im.plan.n_patches, im.plan.n_tokens) for im in images)
    padded = len(images) * flops(cfg, n_pad, m_pad)
    return {"n_bucket": n_pad, "m_bucket": m_pad, "ms": seconds * 1e3, "compile_s": compile_s,
            "tflop_real": real / 1e12, "tflop_padded": padded / 1e12, "floor_ms": padded / PEAK_FLOPS * 1e3,
            "ratio": seconds / (padded / PEAK_FLOPS), "tflops_achieved": padded / seconds / 1e12}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="dsv41_flash")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="images in the batched case (default 4)")
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    cfg = load_named(args.config)
    vc = cfg.vision
    dtype = jnp.dtype(args.dtype)
    forced = None if args.attention == "auto" else args.attention  # a benchmark-only override of the model's
    print(f"device: {jax.devices()[0].device_kind} · jax {jax.__version__} · {args.config} · {args.dtype} · "
          f"attention {forced or tower.attention_impl(dtype)}")
    t0 = time.perf_counter()
    encoder = Encoder(cfg, dtype, nnx.Rngs(0))  # random init runs on the default device
    params = sum(x.size for x in jax.tree.leaves(nnx.state(encoder, nnx.Param)))
    print(f"weights: {params:,} parameters, initialised on device in {time.perf_counter() - t0:.1f} s")
    run = nnx.jit(lambda e, b: e(b))
    rng = np.random.default_rng(0)
    rows = []
    side = 31 * vc.cell  # the largest square plan (31 × 31 tokens at release)

    def image(w, h):
        plan = plan_image(w, h, vc)
        return PreparedImage(rng.uniform(-1, 1, (plan.n_patches, vc.patch_dim)).astype(ml_dtypes.bfloat16), plan)

    cases = (("square", (side, side), 1), ("strip", (vc.cell * 1000 // 3, 1), 1),
             (f"square×{args.batch}", (side, side), args.batch))
    for name, (w, h), count in cases:
        images = [image(w, h) for _ in range(count)]
        plan = images[0].plan
        impl = forced or tower.attention_impl(dtype)
        try:
            with tower.forced_attention(impl):
                row = measure(run, encoder, cfg, images, args.reps)
        except Exception as e:  # noqa: BLE001 - e.g. a cuDNN version without this attention: say so, use XLA
            print(f"{name}: attention {impl} failed ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160]}); retrying with xla")
            forced, impl, run = "xla", "xla", nnx.jit(lambda e, b: e(b))  # a fresh trace
            with tower.forced_attention(impl):
                row = measure(run, encoder, cfg, images, args.reps)
        row = {"image": name, "images": count, "wxh": f"{w}x{h}", "grid": f"{plan.Hv}x{plan.Wv}",
               "n": plan.n_patches, "m": plan.n_tokens, "span": plan.span_len, "attention": impl, **row}
        rows.append(row)
        print(f"{name:9s} {row['wxh']:>10s} grid {row['grid']:>8s} n {row['n']:5d} (bucket {row['n_bucket']}) "
              f"m {row['m']:4d} (bucket {row['m_bucket']}) span {row['span']:4d} · measured {row['ms']:8.2f} ms / "
              f"floor {row['floor_ms']:.2f} ms = {row['ratio']:.1f}× (compile {row['compile_s']:.1f} s) · "
              f"{row['tflop_real']:.2f} TFLOP real, {row['tflop_padded']:.2f} padded · "
              f"{row['tflops_achieved']:.0f} TFLOP/s ({impl} attention)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
