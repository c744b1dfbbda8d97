"""DSpark speculative decoding (`MODEL.md` §B.13, VISION.md §V.H): draft K tokens with the stages,
verify ``[b, d_0 … d_{K−1}]`` as one (K+1)-row target step, accept, roll back, draft again: one program a round.

State (`SpecState`): the target cache (``offset`` = P: positions < P are in it), each stage's context ring
(slot ``p mod W`` holds the context row of position p, written from the target forward's taps, so there is no
extra pass), the bonus token at P (not yet in the cache) and the current draft for P+1 … P+K.

A round (`_round`):

1. **Verify**: the target over ``[b, d_0 … d_{K−1}]`` at P … P+K (every row's logits; taps on).
2. **Accept** per sequence: greedy, the longest prefix of drafts equal to the target's argmax, plus the target's
   token after it; sampled, standard speculative rejection sampling (accept d_j with probability
   min(1, p_j(d_j)/q_j(d_j)), at the first rejection draw from norm(max(p_j − q_j, 0)), after K acceptances draw
   the bonus from p_K), with p and q both after temperature/top-k/top-p and q Markov-corrected, so the tokens are
   distributed exactly as the target's own sampling. Stop flags as the engine's step: an end id or the
   ``max_new``-th token ends a sequence (tokens after it in the round are dropped).
3. **Roll back** what the rows past the n+1 committed ones (b, d_0 … d_{n−1}) touched, by position: window ring
   slots written by rejected rows get their old rows back; each ratio-2 compressor's pending row is rebuilt from
   the last committed row's attention input (a tap); compressed entries and index keys a rejected row closed
   stay written but lie at positions ≥ the new offset, which no query sees before the true tokens rewrite them
   (an entry j is visible at p iff j < ⌊(p+1)/r⌋; candidates are per call); offset advances by n+1; the stage
   rings take the committed rows' context rows only.
4. **Draft** the next round from the new bonus token (``model.dspark.draft``).

Per-sequence acceptance, ragged advance: every sequence has its own offset and count. Image prompts: the prompt
segments take their image rows as the engine's prefill does (the tower runs once; VISION.md §V.E), so the stage
rings hold context rows of image positions too (taps of the target's own forward, §V.H item 3); verify rows are
generated text.

Engram layers (`MODEL.md` §B.12): their rows are hashed on the host from token ids, so the prompt segments take
their rows as the engine's prefill does (history carried across segments), and each round takes the rows of its
verify ids ``[b, d_0 … d_{K−1}]``, which the host knows only after reading the previous round (its bonus and
drafts): one round in flight at a time. The rollback of the hash history is on the host: it keeps the history
of committed tokens only, advancing each sequence by its own ``count`` (b, d_0 … d_{n−1}), not by the rejected
drafts.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .engine import Engine, EngineInputError, GenerateResult, Generation, Request, Timings, all_greedy, bucket_rows
from .model.attention import updated_ring, window_in_order
from .model.cache import Cache
from .model.dspark import Draft, context_rows, draft
from .runtime import Program, image_rows, keeps_going, merge, segment_images
from .sampling import SamplingArrays, filtered_logits, sample

MAX_DRAFT = 5  # the stages are trained for a block of 5 (dspark_block_size)
ROUNDS_AHEAD = 2  # rounds dispatched before the host reads the oldest (1 with engram layers: module docstring)
_DRAFT_TAG, _ACCEPT_TAG, _FIX_TAG = 1 << 20, 2 << 20, 3 << 20  # key-stream offsets (fold_in after the count)


@struct.dataclass
class SpecState:
    """cache: the target's (offset [B] = P); rings: per stage [B,W,d]; bonus [B] (the token at P); drafts
    [B,K] (proposals for P+1 …); draft_logits f32 [B,K,V] (what each was drawn from, before the filters);
    running [B] bool; produced [B] i32 (tokens emitted so far, bonus included)."""

    cache: Cache
    rings: tuple
    bonus: jnp.ndarray
    drafts: jnp.ndarray
    draft_logits: jnp.ndarray
    running: jnp.ndarray
    produced: jnp.ndarray


class RoundOut(NamedTuple):
    """state after the round; tokens [B,K+1] (the first ``count[b]`` are sequence b's new tokens), count [B];
    going [B] int32 (1: the sequence runs on; its own buffer, readable after ``state`` is donated)."""

    state: SpecState
    tokens: jnp.ndarray
    count: jnp.ndarray
    going: jnp.ndarray


# ---------------------------------------------------------------------------------------------- pieces
def write_ring(ring: jnp.ndarray, rows: jnp.ndarray, offset: jnp.ndarray, lengths: jnp.ndarray) -> jnp.ndarray:
    """ring [B,W,d] after ``lengths`` rows of ``rows`` [B,T,d] at positions offset … (rows past them ignored)."""
    valid = jnp.arange(rows.shape[1])[None, :] < lengths[:, None]
    rows = jnp.where(valid[..., None], rows, 0).astype(ring.dtype)
    keys = jnp.concatenate([window_in_order(ring, offset), rows], axis=1)
    return updated_ring(keys, offset, lengths, ring.shape[1])


def empty_rings(cfg, batch: int, dtype) -> tuple:
    return tuple(jnp.zeros((batch, cfg.sliding_window, cfg.head_dim), dtype)
                 for _ in range(cfg.num_nextn_predict_layers))


def _keys(sampling: SamplingArrays, count, tag):
    """One key per sequence from its stream, at ``count`` [B] and ``tag`` (an int)."""
    def one(key_data, c):
        key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        return jax.random.fold_in(jax.random.fold_in(key, c), tag)
    return jax.vmap(one)(sampling.keys, count)


def _probs(logits, sampling: SamplingArrays):
    """logits [B,...,V] -> f32 probabilities after temperature/top-k/top-p (rows flattened through the filter)."""
    shape = logits.shape
    rows = logits.reshape(shape[0], -1, shape[-1])
    k = rows.shape[1]
    rep = lambda x: jnp.repeat(x, k, axis=0)
    f = filtered_logits(rows.reshape(-1, shape[-1]), rep(sampling.temperature), rep(sampling.top_k),
                        rep(sampling.top_p))
    return jax.nn.softmax(f, axis=-1).reshape(shape)


def _pick(sampling: SamplingArrays | None, produced):
    """The draft's token picker: argmax for greedy sequences, a draw from the filtered distribution otherwise
    (``sampling`` None: every sequence greedy, the argmax only)."""
    def pick(j, row):
        greedy = jnp.argmax(row, axis=-1).astype(jnp.int32)
        if sampling is None:
            return greedy
        keys = _keys(sampling, produced, _DRAFT_TAG + j)
        masked = filtered_logits(row, sampling.temperature, sampling.top_k, sampling.top_p)
        drawn = jax.vmap(lambda k, r: jax.random.categorical(k, r))(keys, masked).astype(jnp.int32)
        return jnp.where(sampling.temperature > 0, drawn, greedy)
    return pick


def accept(logits, drafts, draft_logits, sampling: SamplingArrays | None, produced):
    """(n [B] accepted drafts, the token after them [B]).

    logits f32 [B,K+1,V] (target rows P … P+K); drafts [B,K]; draft_logits f32 [B,K,V]. Greedy sequences
    (temperature 0): longest agreeing prefix, then the target's argmax. Sampled: rejection sampling (module
    docstring). ``sampling`` None: every sequence is greedy, and the round has no filters, softmaxes or draws (the
    host chooses, as for the engine's step: a device-side branch would wait on the host, `sampling`)."""
    b, k1, _ = logits.shape
    k = k1 - 1
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B,K+1]
    agree = jnp.cumprod((drafts == target[:, :k]).astype(jnp.int32), axis=1)
    n_greedy = jnp.sum(agree, axis=1)
    tok_greedy = jnp.take_along_axis(target, n_greedy[:, None], axis=1)[:, 0]
    if sampling is None:
        return n_greedy, tok_greedy
    n_s, tok_s = _rejection(logits, drafts, draft_logits, sampling, produced)
    is_sampled = sampling.temperature > 0
    return jnp.where(is_sampled, n_s, n_greedy), jnp.where(is_sampled, tok_s, tok_greedy)


def _rejection(logits, drafts, draft_logits, sampling: SamplingArrays, produced):
    """Standard speculative rejection sampling (module docstring) -> (n [B], the token after them [B])."""
    k = drafts.shape[1]
    p = _probs(logits, sampling)  # [B,K+1,V]
    q = _probs(draft_logits, sampling)  # [B,K,V]
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jnp.stack([jax.vmap(jax.random.uniform)(_keys(sampling, produced, _ACCEPT_TAG + j)) for j in range(k)], 1)
    ok = u * q_d < p_d  # u < p/q, and q > 0 for a drawn token
    n_sampled = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_n = jnp.take_along_axis(p, n_sampled[:, None, None], axis=1)[:, 0]  # [B,V]
    q_n = jnp.take_along_axis(jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1), n_sampled[:, None, None],
                              axis=1)[:, 0]  # row K: no draft, q = 0 -> the residual is p itself
    resid = jnp.maximum(p_n - q_n, 0.0)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p_n)
    fix_keys = _keys(sampling, produced, _FIX_TAG)
    tok_sampled = jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r)))(fix_keys, resid).astype(jnp.int32)
    return n_sampled, tok_sampled


def _rollback_cache(old: Cache, new: Cache, taps, model, keep: jnp.ndarray, rows: int) -> Cache:
    """The cache after committing ``keep`` [B] of the ``rows`` rows the verify step wrote (module docstring)."""
    layers = []
    for i, (o, n) in enumerate(zip(old.layers, new.layers, strict=True)):
        w = o.window.shape[1]
        slot_row = (jnp.arange(w)[None, :] - old.offset[:, None]) % w  # [B,W]: the step row that wrote each slot
        restore = (slot_row >= keep[:, None]) & (slot_row < rows)
        lc = n.replace(window=jnp.where(restore[..., None], o.window, n.window))
        if n.pending_kv is not None:  # ratio 2: the open group's row is the last committed one
            u = jnp.take_along_axis(taps.pending[i], jnp.maximum(keep - 1, 0)[:, None, None], axis=1)
            comp = model.layers[i].attn.compressor
            h = u.astype(jnp.float32)
            moved = (keep > 0)[:, None, None]
            lc = lc.replace(pending_kv=jnp.where(moved, comp.wkv(h), o.pending_kv),
                            pending_gate=jnp.where(moved, comp.wgate(h), o.pending_gate))
        layers.append(lc)
    return Cache(offset=old.offset + keep, layers=tuple(layers))


def first_drafts(model, rings, bonus, offset, sampling, produced, k: int, vocab=None) -> Draft:
    """The stages' draft from ``bonus`` at ``offset``: its first ``k`` proposals. ``model``: the Transformer that
    computes and ``vocab`` its vocabulary maps (`ModelLike.unwrap`); ``sampling`` None: argmax drafts."""
    cfg = model.cfg
    d = draft(model.mtp, model.embed, model.head, bonus, rings, offset, cfg, cfg.dspark_block_size,
              _pick(sampling, produced), vocab)
    return Draft(d.tokens[:, :k], d.logits[:, :k], d.confidence[:, :k])


# ---------------------------------------------------------------------------------------------- programs
def _prefill(graphdef, state, spec_cache, ids, lengths, last_logits, engram, images):
    """One prompt segment with taps: (cache, rings) updated, last_logits [B,V] of each sequence's last row.
    ``engram``: the segment's rows (EngramInput) when the model runs engram layers, else None; ``images``: the
    segment's image rows (`runtime.segment_images`) for a batch with image prompts, else None."""
    model, ctx, vocab = merge(graphdef, state).unwrap()
    with ctx:
        return _prefill_in(model, vocab, spec_cache, ids, lengths, last_logits, engram, images)


def _prefill_in(model, vocab, spec_cache, ids, lengths, last_logits, engram, images):
    cache, rings = spec_cache
    last_row = jnp.clip(lengths - 1, 0, ids.shape[1] - 1)
    pad_ids, real = vocab or ((lambda x: x), (lambda x: x))
    logits, new, _, taps = model.forward(pad_ids(ids), cache, lengths, engram=engram, logit_rows=last_row,
                                         taps=True, images=None if images is None else image_rows(images))
    logits = real(logits)
    positions = cache.offset[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
    ctx = context_rows(model.mtp, taps.context, positions)
    rings = tuple(write_ring(r, c, cache.offset, lengths) for r, c in zip(rings, ctx, strict=True))
    last_logits = jnp.where((lengths > 0)[:, None], logits.astype(jnp.float32), last_logits)
    return (new, rings), last_logits


def _start(graphdef, state, cache, rings, last_logits, eos_ids, max_new, sampling, k: int):
    """After the prompt: the first token (as the engine draws it) and the first draft -> (SpecState, token,
    keep_going)."""
    model, ctx, vocab = merge(graphdef, state).unwrap()
    b = last_logits.shape[0]
    token = sample(last_logits, sampling, jnp.int32(0))
    running = keeps_going(jnp.ones((b,), bool), token, eos_ids, 0, max_new)  # token 0, as the engine's step
    produced = jnp.ones((b,), jnp.int32)
    with ctx:
        d = first_drafts(model, rings, token, cache.offset, sampling, produced, k, vocab)
    return SpecState(cache, rings, token, d.tokens, d.logits, running, produced), token


def _round(graphdef, state, spec: SpecState, eos_ids, max_new, sampling: SamplingArrays, oracle, engram=None, *,
           k: int) -> RoundOut:
    """One speculative round (module docstring) as one program. ``oracle`` (tests): None, or (tokens [B,L],
    use [B,L] bool): the proposal for position p is ``tokens[b, p]`` where ``use[b, p]`` (forced accept/reject
    paths). ``engram``: the verify rows' EngramInput ([B,K+1], hashed on the host) or None (no engram layers)."""
    model, ctx, vocab = merge(graphdef, state).unwrap()
    with ctx:
        return _round_in(model, vocab, spec, eos_ids, max_new, sampling, oracle, engram, k)


def _round_in(model, vocab, spec: SpecState, eos_ids, max_new, sampling: SamplingArrays, oracle, engram, k: int
              ) -> RoundOut:
    cache, running = spec.cache, spec.running
    ids = jnp.concatenate([spec.bonus[:, None], spec.drafts], axis=1)  # [B,K+1] at P … P+K
    lengths = (k + 1) * running.astype(jnp.int32)
    pad_ids, real = vocab or ((lambda x: x), (lambda x: x))
    logits, new_cache, _, taps = model.forward(pad_ids(ids), cache, lengths, engram=engram, taps=True)
    logits = real(logits).astype(jnp.float32)
    n, fix = accept(logits, spec.drafts, spec.draft_logits, sampling, spec.produced)
    j = jnp.arange(k + 1)[None, :]
    drafts_pad = jnp.concatenate([spec.drafts, spec.drafts[:, :1]], axis=1)
    tokens = jnp.where(j < n[:, None], drafts_pad, fix[:, None])  # [B,K+1]; valid up to row n
    # Stop flags, as the engine's step: an end id or the max_new-th token is the sequence's last.
    is_eos = jnp.any(tokens[..., None] == eos_ids[None, None, :], axis=-1)
    eos_before = jnp.cumsum(is_eos.astype(jnp.int32), axis=1) - is_eos.astype(jnp.int32)
    valid = (j <= n[:, None]) & (eos_before == 0) & (spec.produced[:, None] + j < max_new[:, None])
    valid &= running[:, None]
    count = jnp.sum(valid.astype(jnp.int32), axis=1)
    produced = spec.produced + count
    keep_going = running & ~jnp.any(valid & is_eos, axis=1) & (produced < max_new)
    keep = jnp.where(running, n + 1, 0)  # committed rows: b, d_0 … d_{n−1}
    new_cache = _rollback_cache(cache, new_cache, taps, model, keep, k + 1)
    positions = cache.offset[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    ctx = context_rows(model.mtp, taps.context, positions)
    rings = tuple(write_ring(r, c, cache.offset, keep) for r, c in zip(spec.rings, ctx, strict=True))
    bonus = jnp.where(running, fix, spec.bonus)
    d = first_drafts(model, rings, bonus, new_cache.offset, sampling, produced, k, vocab)
    drafts = d.tokens
    if oracle is not None:
        ref, use = oracle
        pos = jnp.clip(new_cache.offset[:, None] + 1 + jnp.arange(k)[None, :], 0, ref.shape[1] - 1)
        drafts = jnp.where(jnp.take_along_axis(use, pos, axis=1), jnp.take_along_axis(ref, pos, axis=1), drafts)
    out = SpecState(new_cache, rings, bonus, drafts, d.logits, keep_going, produced)
    return RoundOut(out, jnp.where(valid, tokens, -1), count, keep_going.astype(jnp.int32))


# ---------------------------------------------------------------------------------------------- driver
@dataclass
class SpecTimings(Timings):
    """Engine timings plus the speculative counts: ``rounds`` (verify steps), ``accepted`` (drafts accepted),
    ``decode_tokens`` (tokens the rounds emitted) and ``seq_rounds`` (rounds summed over running sequences)."""

    rounds: int = 0
    accepted: int = 0
    decode_tokens: int = 0
    seq_rounds: int = 0

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens a round emitted per running sequence (accepted drafts + 1, cut by stops)."""
        return self.decode_tokens / self.seq_rounds if self.seq_rounds else float("nan")


def check_speculative(engine: Engine, requests: Sequence[Request], k: int) -> None:
    """EngineInputError for what speculation cannot run."""
    cfg = engine.cfg
    if not 1 <= k <= min(MAX_DRAFT, cfg.dspark_block_size):
        raise EngineInputError(f"--draft-tokens must be in 1..{min(MAX_DRAFT, cfg.dspark_block_size)}, got {k}")
    if cfg.sliding_window < k + 1:
        raise EngineInputError(f"the sliding window ({cfg.sliding_window}) must hold a verify step's {k + 1} rows")


class Speculator:
    """Speculative generation over an `Engine`'s model (which must hold the stages: ``ModelOptions(dspark=True)``),
    its programs registered in the engine's runtime (compiled ahead of time on first use, timed apart from running).

    ``generate(requests, k)`` returns the engine's `GenerateResult` with `SpecTimings`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.runtime = engine.runtime
        self.cfg = engine.cfg
        if not self.runtime.has_dspark:
            raise EngineInputError("this model has no DSpark stages (build it with ModelOptions(dspark=True) "
                                   "from a checkpoint that has mtp.* tensors)")
        self.runtime.register(PREFILL, START, ROUND)

    def _empty(self, batch: int, k: int):
        """A fresh target cache (room for a verify step past ``max_context``) and empty rings, made by a program
        so every leaf is its own buffer (donation needs that)."""
        rt = self.runtime

        def make():
            cache = rt.empty_cache(batch, self.engine.max_context + k + 1)
            return cache, empty_rings(self.cfg, batch, cache.layers[0].window.dtype)
        return jax.jit(make, out_shardings=rt.replicated)()

    def _verify_rows(self, state: SpecState, running: np.ndarray, history, k: int):
        """(verify ids [B,K+1] ``[b, d_0 … d_{K−1}]`` read from ``state`` (before it is donated), their engram rows
        hashed after the committed ``history`` [B,H]) for the next round; (None, None) without engram layers."""
        if self.runtime.hasher is None:
            return None, None
        ids = np.concatenate([np.asarray(state.bonus)[:, None], np.asarray(state.drafts)], axis=1).astype(np.int32)
        engram, _ = self.runtime.engram_rows(ids, (k + 1) * running.astype(np.int32), history)
        return ids, engram

    def _committed(self, history, ids: np.ndarray, count: np.ndarray):
        """The engram history [B,H] after each sequence's ``count[b]`` committed verify rows of ``ids`` [B,K+1]
        (the rejected drafts never enter it: the rollback of the hash history)."""
        hasher = self.runtime.hasher
        return hasher.advance(np.concatenate([history, hasher.compress(ids)], axis=1), count)

    def generate(self, requests: Sequence[Request], k: int = MAX_DRAFT, *, on_tokens=None,
                 oracle=None) -> GenerateResult:
        eng, rt = self.engine, self.runtime
        eng.check(requests)
        check_speculative(eng, requests, k)
        batch = len(requests)
        timings = SpecTimings(prompt_tokens=sum(len(r.prompt_ids) for r in requests))
        sizes, _ = eng.plan_segments(requests)
        timings.segments = tuple(sizes)
        eos, max_new, sampling = eng.stop_inputs(requests, all_greedy(requests))
        cache, rings = self._empty(batch, k)
        compile_before, count_before, loaded_before = rt.compile_s, rt.compile_count, rt.programs_loaded
        t0 = time.perf_counter()
        lengths = np.array([len(r.prompt_ids) for r in requests], np.int32)
        padded = np.zeros((batch, int(lengths.max())), np.int32)
        for b, r in enumerate(requests):
            padded[b, : lengths[b]] = r.prompt_ids
        logits = jnp.zeros((batch, rt.vocab_size), jnp.float32)
        start, spec_cache, history = 0, (cache, rings), rt.empty_history(batch)
        images = rt.encode_images([r.images for r in requests], int(lengths.max()))
        for size in sizes:
            t = bucket_rows(size, max(sizes))
            ids = np.zeros((batch, t), np.int32)
            ids[:, :size] = padded[:, start:start + size]
            seg = np.clip(lengths - start, 0, size).astype(np.int32)
            seg_images = segment_images(images, start, size, t)
            # engram rows: history carried across segments, image positions DEAD, as the engine's prefill
            engram, history = rt.engram_rows(ids, seg, history, seg_images)
            args = (rt.state, spec_cache, ids, seg, logits, engram, seg_images)
            spec_cache, logits = rt.run(PREFILL, {}, args)
            start += size
        args = (rt.state, *spec_cache, logits, eos, max_new, sampling)
        state, first = rt.run(START, {"k": k}, args)
        first_np = rt.read(first)
        timings.prefill_s = time.perf_counter() - t0 - (rt.compile_s - compile_before)
        produced: list[list[int]] = [[int(first_np[b])] for b in range(batch)]
        if on_tokens:
            on_tokens(0, first_np, np.ones(batch, bool))
        oracle_dev = None if oracle is None else tuple(jnp.asarray(x) for x in oracle)
        running = np.asarray(state.running)
        verify_ids, engram = self._verify_rows(state, running, history, k)
        step_fn = rt.program(ROUND, {"k": k}, (rt.state, state, eos, max_new, sampling, oracle_dev, engram))
        timings.compile_s = rt.compile_s - compile_before
        timings.programs_compiled = rt.compile_count - count_before
        timings.programs_loaded = rt.programs_loaded - loaded_before
        t0 = time.perf_counter()
        ahead = ROUNDS_AHEAD if rt.hasher is None else 1  # engram: the next verify rows need this round's drafts
        pending: collections.deque = collections.deque()
        while running.any():
            # Rounds chain on the device; the host reads round r while round r+1 runs (a round queued past the
            # last stop commits nothing: every sequence has stopped, its rows have length 0).
            while len(pending) < ahead:
                if engram is None and rt.hasher is not None:
                    verify_ids, engram = self._verify_rows(state, running, history, k)
                out = step_fn(rt.state, state, eos, max_new, sampling, oracle_dev, engram)
                state, engram = out.state, None
                pending.append((out.tokens, out.count, out.going))
            tokens, count, going = (rt.read(x) for x in pending.popleft())
            if rt.hasher is not None:
                history = self._committed(history, verify_ids, count)
            timings.rounds += 1
            timings.seq_rounds += int(running.sum())
            timings.accepted += int(np.sum(np.where(running, count - 1, 0)))
            for b in np.flatnonzero(running):
                new = [int(x) for x in tokens[b, : count[b]]]
                produced[b].extend(new)
                if on_tokens:
                    for tok in new:
                        on_tokens(len(produced[b]) - 1, np.full(batch, tok), np.arange(batch) == b)
            running = going.astype(bool)
        jax.block_until_ready(state.bonus)
        timings.decode_s = time.perf_counter() - t0
        timings.generated_tokens = sum(len(p) for p in produced)
        timings.decode_tokens = timings.generated_tokens - batch
        timings.decode_steps = timings.rounds
        gens = []
        for r, p in zip(requests, produced, strict=True):
            finish = "eos" if p and p[-1] in eng.eos_ids else "length"
            gens.append(Generation(tuple(r.prompt_ids), tuple(p), finish))
        return GenerateResult(gens, timings)


# The speculative programs of the runtime's table (model programs: the state first, the graph bound by the table):
# the prefill donates its caches and logits, a round its state.
PREFILL = Program("dspark_prefill", _prefill, donate=(1, 4))
START = Program("dspark_start", _start, static=("k",))
ROUND = Program("dspark_round", _round, donate=(1,), static=("k",))
