"""Token sampling: greedy, temperature, top-k, top-p and min-p, seeded with ``jax.random``; the logits
processors before them (logit bias, the end ids held back until ``min_tokens``) and the log-probabilities after.

All settings are per-sequence *arrays*, not static arguments, so one compiled decode step serves every
setting (changing ``--temperature``, ``--top-k`` or a request's ``logit_bias`` never recompiles). A batch whose
requests are all plain greedy (no processor, no log-probabilities: `SamplingParams.argmax_only`) passes no arrays
(``sample(logits, None, step)``): its step is a program of its own that takes the argmax and skips the filters'
sort of the vocabulary. The host makes that choice, knowing the settings: a ``lax.cond`` on the arrays inside the
step would make the GPU program wait on the host for its predicate, and chained steps would no longer queue
ahead (measured: see docs/BENCHMARKS.md, section "Sampling in the server's step"). Each sequence draws from its
own key stream ``fold_in(key(seed_b), step)``: its samples do not depend on which other sequences share the batch.

A processor at its neutral value changes no logit (``x + 0.0``, ``x - 0.0 * n``, ``x / 1.0`` and
``where(False, -inf, x)`` are ``x`` exactly), so a greedy sequence in the arrays' step draws what the argmax-only
step draws.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGIT_BIAS = 300  # entries of a request's logit_bias (the arrays' static width)
MAX_STOP_TOKEN_IDS = 16  # a request's own stop ids that min_tokens holds back with the end ids
TOP_LOGPROBS = 20  # the most likely ids whose log-probabilities every arrays' step returns


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
    min_p: float = 0.0  # drop ids less likely than min_p x the most likely one's probability (0: off)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, added to its logit) pairs, at most MAX_LOGIT_BIAS
    min_tokens: int = 0  # the end ids (and ``held_ids``) cannot be drawn before this many tokens
    held_ids: tuple[int, ...] = ()  # besides the end ids, what min_tokens holds back (a request's stop ids)
    ignore_eos: bool = False  # an end id does not stop the sequence (it is an ordinary token)
    presence_penalty: float = 0.0  # subtracted from the logit of every id generated so far (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted once per time an id was generated (OpenAI's)
    repetition_penalty: float = 1.0  # divides positive, multiplies negative logits of prompt and generated ids

    @property
    def penalised(self) -> bool:
        """Any penalty on: the step needs the sequence's token counts (`SamplingArrays.counts`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

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
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError(f"logit_bias takes at most {MAX_LOGIT_BIAS} ids, got {len(self.logit_bias)}")
        if len(self.held_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(f"at most {MAX_STOP_TOKEN_IDS} stop ids, got {len(self.held_ids)}")
        if self.min_tokens < 0:
            raise SamplingError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """Greedy with no processor: the argmax-only step serves it."""
        return (self.greedy and not self.logit_bias and not self.min_tokens and not self.ignore_eos
                and not self.penalised)


@dataclass(frozen=True)
class SamplingArrays:
    """Per-sequence settings as device inputs of the decode step.

    temperature [B] f32, top_k [B] i32, top_p [B] f32, keys [B, 2] u32 (raw threefry key data), min_p [B] f32,
    bias_ids [B, MAX_LOGIT_BIAS] i32 and bias_values [B, MAX_LOGIT_BIAS] f32 (unused entries: id -1, value 0),
    min_tokens [B] i32, held_ids [B, MAX_STOP_TOKEN_IDS] i32 (unused: -1), ignore_eos [B] bool, presence,
    frequency, repetition [B] f32; ``counts`` [B, V] i32 (each id's count among the generated tokens) and ``seen``
    [B, V] bool (the prompt's ids): the penalties' state, kept on the device and updated after each step by its
    driver (the server's slots; None: no penalties, `sampling_arrays` refuses them). ``allowed`` [B, ⌈V/32⌉] i32:
    each row's allowed next ids as a bitmask (bit ``t % 32`` of word ``t // 32``; -1 words allow all), set each
    step by a driver that constrains rows to a grammar (the server's structured output; None: no masks).
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    keys: np.ndarray
    min_p: np.ndarray
    bias_ids: np.ndarray
    bias_values: np.ndarray
    min_tokens: np.ndarray
    held_ids: np.ndarray
    ignore_eos: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    counts: np.ndarray | None = None
    seen: np.ndarray | None = None
    allowed: np.ndarray | None = None


def _padded(rows: list, width: int, fill, dtype) -> np.ndarray:
    out = np.full((len(rows), width), fill, dtype)
    for b, row in enumerate(rows):
        out[b, :len(row)] = row
    return out


def sampling_arrays(params: list[SamplingParams], penalties: bool = False) -> SamplingArrays:
    """Stack per-sequence ``params`` into the arrays the jitted step takes. The penalties need token counts that a
    driver keeps on the device (``penalties``: it does, and sets ``counts`` and ``seen`` itself); without,
    a penalty is refused (SamplingError), never ignored."""
    if not penalties and any(p.penalised for p in params):
        raise SamplingError("presence, frequency and repetition penalties are served by the server only (its slots "
                            "keep each request's token counts)")
    seeds = jnp.asarray([p.seed for p in params], jnp.uint32)
    keys = np.asarray(jax.random.key_data(jax.vmap(lambda s: jax.random.key(s, impl="threefry2x32"))(seeds)))
    return SamplingArrays(
        temperature=np.array([p.temperature for p in params], np.float32),
        top_k=np.array([p.top_k for p in params], np.int32),
        top_p=np.array([p.top_p for p in params], np.float32),
        keys=keys.astype(np.uint32),
        min_p=np.array([p.min_p for p in params], np.float32),
        bias_ids=_padded([[i for i, _ in p.logit_bias] for p in params], MAX_LOGIT_BIAS, -1, np.int32),
        bias_values=_padded([[v for _, v in p.logit_bias] for p in params], MAX_LOGIT_BIAS, 0, np.float32),
        min_tokens=np.array([p.min_tokens for p in params], np.int32),
        held_ids=_padded([list(p.held_ids) for p in params], MAX_STOP_TOKEN_IDS, -1, np.int32),
        ignore_eos=np.array([p.ignore_eos for p in params], bool),
        presence=np.array([p.presence_penalty for p in params], np.float32),
        frequency=np.array([p.frequency_penalty for p in params], np.float32),
        repetition=np.array([p.repetition_penalty for p in params], np.float32),
    )


jax.tree_util.register_dataclass(SamplingArrays, data_fields=[f.name for f in fields(SamplingArrays)],
                                 meta_fields=[])


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                    min_p: jax.Array | None = None) -> jax.Array:
    """Temperature-scaled logits with everything outside the top-k / top-p / min-p set at -inf.

    logits [B, V] f32; temperature, top_p, min_p [B] f32; top_k [B] i32. Top-p keeps the smallest set of most
    likely tokens whose probability reaches ``top_p`` (computed after the top-k cut); min-p keeps the tokens at
    least ``min_p`` times as likely as the most likely one (0: all). Tokens tied with the last kept value are kept
    too (thresholds, not index cuts): the kept set is what every filter keeps.
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
    if min_p is not None:  # p >= min_p * p_max  <=>  scaled >= max + log(min_p); log(0) = -inf keeps all
        threshold = jnp.maximum(threshold, ranked[:, :1] + jnp.log(min_p)[:, None])
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def processed_logits(logits: jax.Array, params: SamplingArrays, step: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """The logits after the processors: with ``counts``, the penalties as vLLM applies them (repetition on the
    ids of the prompt and of the generated tokens, then frequency x count and presence on the generated ones);
    each row's ``logit_bias`` added; its end ids (``eos_ids`` [E], -1: none) and ``held_ids`` at -inf while
    its ``step`` (the index of the token drawn now, [B]) is below its ``min_tokens``; with ``allowed``, the ids a
    row's grammar does not allow at -inf. logits [B, V] f32 -> [B, V] f32."""
    batch, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    out = logits.astype(jnp.float32)
    if params.counts is not None:
        generated = params.counts > 0
        r = params.repetition[:, None]
        out = jnp.where(generated | params.seen, jnp.where(out > 0, out / r, out * r), out)
        out = out - params.frequency[:, None] * params.counts - params.presence[:, None] * generated
    ids = jnp.where(params.bias_ids >= 0, params.bias_ids, vocab)  # unused entries: out of range, dropped
    out = out.at[rows, ids].add(params.bias_values, mode="drop")
    held = jnp.concatenate([jnp.broadcast_to(eos_ids, (batch, eos_ids.shape[0])), params.held_ids], axis=1)
    held = jnp.where((held >= 0) & (step < params.min_tokens)[:, None], held, vocab)
    hold = jnp.zeros((batch, vocab), bool).at[rows, held].set(True, mode="drop")
    out = jnp.where(hold, -jnp.inf, out)
    if params.allowed is not None:  # a grammar's allowed ids: the rest at -inf
        out = jnp.where(unpack_bitmask(params.allowed, vocab), out, -jnp.inf)
    return out


def unpack_bitmask(words: jax.Array, vocab: int) -> jax.Array:
    """Bitmask words [B, W] i32 (bit ``t % 32`` of word ``t // 32`` is id t) → bool [B, vocab]."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(bool)


def sample(logits: jax.Array, params: SamplingArrays | None, step: jax.Array, eos_ids: jax.Array | None = None
           ) -> jax.Array:
    """Next ids [B] int32 from logits [B, V]; ``step`` (int32, scalar or [B]: each sequence's own count, as the
    server's slots keep it) indexes each sequence's key stream and counts toward ``min_tokens``; ``eos_ids`` [E]:
    the end ids ``min_tokens`` holds back (None: none). ``params`` None: every sequence plain greedy (the argmax
    only; with arrays the filters sort the vocabulary whatever the settings)."""
    if params is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), logits.shape[:1])
    ends = jnp.full((1,), -1, jnp.int32) if eos_ids is None else eos_ids
    logits = processed_logits(logits, params, steps, ends)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    masked = filtered_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)

    def draw(key_data: jax.Array, row: jax.Array, seq_step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl="threefry2x32"), seq_step)
        return jax.random.categorical(key, row).astype(jnp.int32)

    drawn = jax.vmap(draw)(params.keys, masked, steps)
    return jnp.where(params.temperature > 0, drawn, greedy_ids)


class TokenLogprobs(NamedTuple):
    """The model's log-probabilities (log-softmax of its logits, before any processor or filter) at one step:
    token [B] f32 of the drawn ids, top_ids [B, TOP_LOGPROBS] i32 and top [B, TOP_LOGPROBS] f32, the most likely
    ids first (ties: the lower id)."""

    token: jax.Array
    top_ids: jax.Array
    top: jax.Array


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """`TokenLogprobs` of logits [B, V] and the drawn ``tokens`` [B]."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, top_ids = jax.lax.top_k(logprobs, min(TOP_LOGPROBS, logits.shape[-1]))
    token = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return TokenLogprobs(token, top_ids.astype(jnp.int32), top)
