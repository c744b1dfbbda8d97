"""The device programs of a model's runtime: the step (prefill segments and decode steps), the decode chunk, the
empty cache and the image encoder, each a ``Program`` of the table.

* ``STEP`` ``step[B, T]``: the model over a segment of T rows (``ids [B, T]``, ``lengths [B]``), its head applied
  only to each sequence's last real row (every row of sequence 0 when recording logits), then sampling from those
  logits and the stop flags (an end id, the max new tokens), all in one program with the cache and the logits
  donated. Rows ``t >= lengths[b]`` are padding the model ignores (DESIGN.md "Model API"), which gives ragged
  batches and lets a segment run in a larger bucket. Its outputs (``StepOut``) include the next step's inputs
  (tokens as ``[B, 1]`` ids, ``lengths = keep_going``, the step index), so decode steps chain on the device
  without the host touching them. Without sampling arrays (``sampling=None``: every sequence greedy) the step is
  a program of its own that takes the argmax and nothing else (`sampling.sample`).
* ``STEPS`` ``steps[B, k]``: k decode steps under one ``lax.scan`` (``Chunk``).
* ``INIT`` ``init[B]``: an empty cache, every leaf its own buffer.
* ``ENCODE`` ``encode[images]``: the vision tower and aligner over every image of a batch, padded to one size
  bucket (VISION.md §V.G).

The step's argument order: ``(state, cache, ids, lengths, last_logits, running, step, eos_ids, max_new, sampling,
images, engram)``; ``images``: None (text) or ``(table [R, D], row [B, T] i32 (−1: none), roles [B, T] i32)``, the
segment's slice of the request's image positions (`segment_images`); ``engram``: the call's `EngramInput` or None.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..model.transformer import ImageRows
from ..sampling import SamplingArrays, TokenLogprobs, sample, token_logprobs
from .table import Program, merge


def image_rows(images):
    """A segment's ``(table [R, D], row [B,T] i32 (−1: none), roles [B,T] i32)`` (`segment_images`) as the model's
    ``ImageRows`` (inside a program)."""
    table, row, roles = images
    return ImageRows(jnp.take(table, jnp.maximum(row, 0), axis=0), roles)


def segment_images(images, start: int, size: int, rows: int):
    """The slice [start, start + size) of the per-position image arrays (`Runtime.encode_images`), padded to
    ``rows`` rows (None when the batch has no images). A slice without span positions still goes this way (all
    TEXT), so one program per row count serves a request with images, decode steps included."""
    if images is None:
        return None
    table, row, roles = images
    seg_row = np.full((row.shape[0], rows), -1, np.int32)
    seg_roles = np.full((row.shape[0], rows), -1, np.int32)
    seg_row[:, :size], seg_roles[:, :size] = row[:, start:start + size], roles[:, start:start + size]
    return table, seg_row, seg_roles


def stop_ids(eos_ids) -> np.ndarray:
    """The end ids as the step program and the host loops take them: int32 [E], (-1,) when there are none (no
    token is −1)."""
    return np.array(tuple(eos_ids) or (-1,), np.int32)


def keeps_going(running, tokens, eos_ids, step, max_new):
    """Whether each sequence goes on after drawing ``tokens`` [B] as its token number ``step`` (scalar or [B]): it
    was running, the token is no end id (``eos_ids`` [E]) and not its ``max_new`` [B]-th -> bool [B]. The step
    program computes it on the device (jnp arrays) to chain steps; the host loop computes the same from the
    tokens it reads (numpy arrays), so it never reads the device's flags back (one transfer a step, not two)."""
    return running & ~(tokens[:, None] == eos_ids[None, :]).any(axis=-1) & (step + 1 < max_new)


def _forward(graphdef, state, cache, ids, lengths, last_logits, images, engram, keep_first_row: bool):
    """The model part of the step.

    ids [B,T] i32, lengths [B] i32, last_logits [B,V] f32, engram rows (EngramInput | None) ->
    (cache, last_logits, first [T,V] f32 | None).

    ``last_logits[b]`` becomes the logits of row ``lengths[b] - 1`` wherever ``lengths[b] > 0``; after a prompt's
    last segment it holds the logits of the prompt's last row, after a decode step those of the fed token.
    """
    model = merge(graphdef, state)
    kwargs = {} if engram is None else {"engram": engram}
    if images is not None:
        kwargs["images"] = image_rows(images)
    last_row = jnp.clip(lengths - 1, 0, ids.shape[1] - 1)
    if keep_first_row:  # every row of sequence 0 is recorded: the head runs on every row
        logits, cache = model(ids, cache, lengths=lengths, **kwargs)
        logits = logits.astype(jnp.float32)
        row_logits = jnp.take_along_axis(logits, last_row[:, None, None], axis=1)[:, 0]
    else:  # the head runs on each sequence's last real row only
        row_logits, cache = model(ids, cache, lengths=lengths, logit_rows=last_row, **kwargs)
        row_logits = row_logits.astype(jnp.float32)
    last_logits = jnp.where((lengths > 0)[:, None], row_logits, last_logits)
    return cache, last_logits, (logits[0] if keep_first_row else None)


class StepOut(NamedTuple):
    """What the step returns. The last four are the next decode step's ``ids``, ``lengths``, ``running`` and
    ``step`` as they are: the host chains steps without reading them (or changing their shapes) first."""

    cache: object
    last_logits: jax.Array  # [B,V] f32
    first: jax.Array | None  # [T,V] f32 (sequence 0's rows, only when recording)
    tokens: jax.Array  # [B,1] i32: the token each sequence drew from last_logits
    lengths: jax.Array  # [B] i32: 1 where the sequence keeps going, else 0
    keep_going: jax.Array  # [B] bool
    next_step: jax.Array  # i32 scalar
    logprobs: TokenLogprobs | None = None  # with sampling arrays: the drawn ids' and the top ids' log-probs


def _step(graphdef, state, cache, ids, lengths, last_logits, running, step, eos_ids, max_new,
          sampling: SamplingArrays | None, images, engram, keep_first_row: bool) -> StepOut:
    """One forward call and the sampling after it, as one program (prefill segments and decode steps alike).

    ids [B,T] i32, lengths [B] i32, last_logits [B,V] f32 (see ``_forward``), running [B] bool, step i32 (the
    index of the token drawn now: a scalar, or [B] when each sequence counts its own, as the server's slots do),
    eos_ids [E] i32, max_new [B] i32. Every sequence draws a token from its ``last_logits``; it keeps going unless
    that token is an end id (not where the sampling arrays' ``ignore_eos`` is set) or its ``max_new``-th. The
    host uses the tokens of a prompt's last call and of decode steps; earlier prefill calls' draws are don't-care
    (cheap: [B,V]). With sampling arrays the step also returns the log-probabilities of the draw (`sampling.
    token_logprobs`), which the host reads only when a request asks for them.
    """
    cache, last_logits, first = _forward(graphdef, state, cache, ids, lengths, last_logits, images, engram,
                                         keep_first_row)
    tokens = sample(last_logits, sampling, step, eos_ids)
    keep_going = keeps_going(running, tokens, eos_ids, step, max_new)
    logprobs = None
    if sampling is not None:
        keep_going = keep_going | (sampling.ignore_eos & running & (step + 1 < max_new))
        logprobs = token_logprobs(last_logits, tokens)
    return StepOut(cache, last_logits, first, tokens[:, None], keep_going.astype(jnp.int32), keep_going,
                   step + 1, logprobs)


class Chunk(NamedTuple):
    """What the decode chunk returns: ``last``, the last step's ``StepOut`` (the next call chains on it as on a
    step's); ``tokens`` [B, k] i32, the token of each of the k steps (whether a sequence went on after each, the
    host derives from them: `keeps_going`)."""

    last: StepOut
    tokens: jax.Array


def _steps(graphdef, state, cache, ids, lengths, last_logits, running, step, eos_ids, max_new,
           sampling: SamplingArrays | None, images, engram, keep_first_row: bool, k: int) -> Chunk:
    """``k`` decode steps in one program: ``_step`` under a ``lax.scan`` whose carry is what one step hands the
    next (cache, logits, tokens as ids, lengths, running, step), so the host dispatches and reads once per k
    tokens. Sequences that stop inside the chunk feed lengths 0 afterwards (no cache writes), as queued single
    steps do. Decode only: no engram rows (hashed on the host per step), no recorded rows."""
    if engram is not None or keep_first_row:
        raise ValueError("a decode chunk takes no engram rows and records no logits")

    def one(carry, _):
        cache, logits, ids, lengths, running, step = carry
        out = _step(graphdef, state, cache, ids, lengths, logits, running, step, eos_ids, max_new, sampling,
                    images, None, False)
        return ((out.cache, out.last_logits, out.tokens, out.lengths, out.keep_going, out.next_step),
                out.tokens[:, 0])

    carry, tokens = jax.lax.scan(one, (cache, last_logits, ids, lengths, running, step), length=k)
    cache, logits, ids, lengths, running, step = carry
    return Chunk(StepOut(cache, logits, None, ids, lengths, running, step), tokens.T)


def _fresh_cache(*, init, cfg, batch, max_context, dtype, sharding):
    """An empty cache made by a program, so every leaf is its own buffer (donation needs that); replicated over
    the mesh when ``sharding`` is given (caches are replicated, `MODEL.md` §F.1)."""
    cache = init(cfg, batch, max_context, dtype)
    return cache if sharding is None else jax.lax.with_sharding_constraint(cache, sharding)


def _encode_images(graphdef, state, batch):
    """``vision.batch.ImageBatch`` -> aligner rows [B_img, M, D] (VISION.md §V.C–§V.D), once per request."""
    return merge(graphdef, state).encode_images(batch)


# The runtime's own programs. ``step`` serves prefill segments (one per program row count T) and the decode step
# (T = 1); ``steps`` is the decode chunk; the cache and last_logits are donated.
INIT = Program("init", _fresh_cache, static=("init", "cfg", "batch", "max_context", "dtype", "sharding"), model=False)
STEP = Program("step", _step, donate=(1, 4), static=("keep_first_row",))
STEPS = Program("steps", _steps, donate=(1, 4), static=("keep_first_row", "k"))
ENCODE = Program("encode", _encode_images)
