"""Prefix caching for the slot engine: one-row prefill states kept at block boundaries, keyed by a hash chain.

A sequence's cache in this model is more than attention KV (sliding-window rings, compressed entries with their
open groups, index keys, and for engram models the host's hash history), so what is kept is the whole one-row
prefill state after a prompt's first ``k`` blocks: the one-row cache, its last logits [1, V] and the engram history
(numpy [1, 3] or None) — a `Snapshot`. A block is the slot engine's prefill chunk (``SlotEngine.chunk``): every
long prompt is cut at the multiples of it, so a warm start at block ``k`` runs exactly the segments a cold run
runs from there, on the same state, and its tokens are the cold run's bit for bit (the model's rounding points
make another segmentation differ in the last bits, README "Numerics").

Keys (vLLM's automatic prefix caching): ``h_0 = H(block size)``, ``h_k = H(h_{k-1}, ids of block k)`` with BLAKE2b
over the ids' int32 bytes, so a key names the whole prefix up to its block, not the block alone. A prompt of
``n`` tokens looks up blocks ``k <= (n - 1) // block`` (at least one row is left to prefill: its last segment
draws the first token) and starts from the longest match; it stores a snapshot at each block boundary it reaches
(``n`` included) that the cache lacks. Snapshots are copies (the prefill donates its cache), and so is a restore.
Eviction: least recently used first, within ``capacity_bytes``; a snapshot larger than the whole budget is not
kept. Requests with images are neither looked up nor stored (their rows are not the ids').
"""

from __future__ import annotations

import collections
import hashlib
from typing import NamedTuple

import jax
import numpy as np


class Snapshot(NamedTuple):
    """A one-row prefill state after ``tokens`` prompt tokens: cache (device), last logits [1, V] (device),
    engram history (numpy [1, 3]) or None."""

    tokens: int
    cache: object
    logits: object
    history: object
    nbytes: int


def block_hashes(ids, block: int, blocks: int) -> list[bytes]:
    """The hash chain of the first ``blocks`` full blocks of ``ids`` (``block`` ids each): key k names ids
    [0, (k + 1) * block)."""
    keys, key = [], hashlib.blake2b(str(block).encode(), digest_size=16).digest()
    arr = np.asarray(ids[:blocks * block], np.int32)
    for k in range(blocks):
        key = hashlib.blake2b(key + arr[k * block:(k + 1) * block].tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


def tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


class PrefixCache:
    """Snapshots by key, least recently used first, within ``capacity_bytes`` (module docstring). Counters in
    tokens as vLLM's: ``queries`` (prompt tokens of the requests looked up), ``hits`` (of those, the tokens a
    snapshot served). Shared by the slot engines of one server (a reset keeps it: snapshots are never donated)."""

    def __init__(self, capacity_bytes: int):
        self.capacity = int(capacity_bytes)
        self._entries: collections.OrderedDict[bytes, Snapshot] = collections.OrderedDict()
        self.bytes = 0
        self.queries = 0
        self.hits = 0
        self.stored = 0  # snapshots stored so far
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        """The keys held, least recently used first."""
        return list(self._entries)

    def lookup(self, keys: list[bytes], prompt_tokens: int) -> Snapshot | None:
        """The snapshot of the longest prefix among ``keys`` (the request's usable block keys, shortest first), or
        None; counts the query and its hit tokens."""
        self.queries += prompt_tokens
        for key in reversed(keys):
            snapshot = self._entries.get(key)
            if snapshot is not None:
                self._entries.move_to_end(key)
                self.hits += snapshot.tokens
                return snapshot
        return None

    def put(self, key: bytes, snapshot: Snapshot) -> bool:
        """Keep ``snapshot`` under ``key``, evicting the least recently used until it fits; False (nothing kept)
        when it is larger than the whole budget."""
        if snapshot.nbytes > self.capacity:
            return False
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        while self.bytes + snapshot.nbytes > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evicted += 1
        self._entries[key] = snapshot
        self.bytes += snapshot.nbytes
        self.stored += 1
        return True
