"""``ModelLike``: what the runtime needs of a model. `dsv41_jax.model.Transformer` (one device) and
`sharding.ShardedTransformer` (a Transformer over a mesh) both define every member themselves, so nothing
downstream asks which of the two it holds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ContextManager, Protocol, runtime_checkable

if TYPE_CHECKING:
    import jax

    from ..model.cache import Cache
    from ..model.transformer import Transformer

VocabMaps = tuple[Callable, Callable]  # (run ids of real ids, real logits of run logits)


@runtime_checkable
class ModelLike(Protocol):
    """A model the runtime runs (an ``nnx.Module``; the runtime splits it into graph and state once).

    ``vocab_size``: the real vocabulary, the last axis of the logits. ``engram_layers``: the engram layers it runs
    (each call then needs their rows). ``has_vision``: built with the image path (``encode_images`` and the
    ``images`` argument). ``has_dspark``: built with the DSpark draft stages. ``unwrap()``: the `Transformer` that
    computes, the context manager to run it in, and the vocabulary maps between real and run ids / logits, or
    None where they are the identity (for programs that call the Transformer's own parts, as speculation does).
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def engram_layers(self) -> tuple[int, ...]: ...

    @property
    def has_vision(self) -> bool: ...

    @property
    def has_dspark(self) -> bool: ...

    def __call__(self, ids: jax.Array, cache: Cache, lengths=None, *, engram=None, images=None,
                 logit_rows=None) -> tuple[jax.Array, Cache]:
        """ids [B, T] int32, cache, lengths [B] -> (logits [B, T, V] f32 ([B, V] with ``logit_rows`` [B]), cache)."""
        ...

    def encode_images(self, batch) -> jax.Array:
        """``vision.batch.ImageBatch`` -> aligner rows [B_img, M, D]."""
        ...

    def unwrap(self) -> tuple[Transformer, ContextManager, VocabMaps | None]: ...
