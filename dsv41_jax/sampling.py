"""Token sampling: greedy, temperature, top-k and top-p, seeded with ``jax.random``.

All settings are per-sequence *arrays*, not static arguments, so one compiled decode step serves every
sampled setting (changing ``--temperature``, ``--top-k`` or ``--top-p`` never recompiles). A batch whose requests
are all greedy passes no arrays (``sample(logits, None, step)``): its step is a program of its own that takes
the argmax and skips the filters' sort of the vocabulary. The host makes that choice, knowing the settings: a
``lax.cond`` on the arrays inside the step would make the GPU program wait on the host for its predicate, and
chained steps would no longer queue ahead (measured: see docs/BENCHMARKS.md, section "Sampling in the server's
step"). Each sequence draws from its own key stream ``fold_in(key(seed_b), step)``: its samples
do not depend on which other sequences share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


class SamplingError(ValueError):
    """Sampling settings out of range."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. ``temperature == 0`` (or ``greedy``) means argmax.

    ``top_k == 0`` and ``top_p == 1`` switch those filters off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        for flag, value in (("--temperature", self.temperature), ("--top-p", self.top_p)):
            if not np.isfinite(value):
                raise SamplingError(f"{flag} must be a finite number, got {value}")
        if self.temperature < 0:
            raise SamplingError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**32:
            raise SamplingError(f"--seed must be in 0 .. 2^32 - 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SamplingArrays:
    """Per-sequence settings as device inputs of the decode step.

    temperature [B] f32, top_k [B] i32, top_p [B] f32, keys [B, 2] u32 (raw threefry key data).
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    keys: np.ndarray


def sampling_arrays(params: list[SamplingParams]) -> SamplingArrays:
    """Stack per-sequence ``params`` into the arrays the jitted step takes."""
    seeds = jnp.asarray([p.seed for p in params], jnp.uint32)
    keys = np.asarray(jax.random.key_data(jax.vmap(lambda s: jax.random.key(s, impl="threefry2x32"))(seeds)))
    return SamplingArrays(
        temperature=np.array([p.temperature for p in params], np.float32),
        top_k=np.array([p.top_k for p in params], np.int32),
        top_p=np.array([p.top_p for p in params], np.float32),
        keys=keys.astype(np.uint32),
    )


jax.tree_util.register_dataclass(
    SamplingArrays, data_fields=["temperature", "top_k", "top_p", "keys"], meta_fields=[]
)


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits with everything outside the top-k / top-p set at -inf.

    logits [B, V] f32; temperature, top_p [B] f32; top_k [B] i32. Top-p keeps the smallest set of most likely
    tokens whose probability reaches ``top_p`` (computed after the top-k cut). Tokens tied with the last kept
    value are kept too (a threshold, not an index cut).
    """
    vocab = logits.shape[-1]
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits.astype(jnp.float32) / safe_t[:, None]
    ranked = -jnp.sort(-scaled, axis=-1)  # [B, V] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(ranked, (k - 1)[:, None], axis=-1)  # [B, 1]
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    ranked_probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(ranked_probs, axis=-1) - ranked_probs
    # Always keeps rank 0; top_p 1 keeps the whole top-k (a float32 cumsum can reach 1 before the tail).
    kept = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))
    n_kept = jnp.sum(kept, axis=-1)
    p_value = jnp.take_along_axis(ranked, (n_kept - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth_value, p_value)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, params: SamplingArrays | None, step: jax.Array) -> jax.Array:
    """Next ids [B] int32 from logits [B, V]; ``step`` (int32, scalar or [B]: each sequence's own count, as the
    server's slots keep it) indexes each sequence's key stream. ``params`` None: every sequence is greedy (the
    argmax only; with arrays the filters sort the vocabulary whatever the settings)."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if params is None:
        return greedy_ids
    masked = filtered_logits(logits, params.temperature, params.top_k, params.top_p)
    steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), greedy_ids.shape)

    def draw(key_data: jax.Array, row: jax.Array, seq_step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), seq_step)
        return jax.random.categorical(key, row).astype(jnp.int32)

    drawn = jax.vmap(draw)(params.keys, masked, steps)
    return jnp.where(params.temperature > 0, drawn, greedy_ids)
