"""The V4.1 text model: embedding, hyper-connected decoder layers with the lagged pre, final norm and head
(`MODEL.md` §B.2–§B.4, §B.11); weight loading in model names (docs/DESIGN.md)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import registry
from sharding.context import active_mesh, constrain

from ..config import ModelConfig
from ..param_specs import unit_name
from ..planner import KernelTiles
from ..vision.preprocess import END, IMAGE, NEWLINE, START
from .attention import Attention, CsaState, Segment
from .cache import Cache
from .dense import FORMATS as _DENSE_FORMATS
from .dense import Dense, Fp8Param
from .dspark import Stage
from .engram import Engram, EngramInput
from .hc import collapse, expand, hc_mix, mix_kwargs, mix_params
from .moe import MoE
from .norms import HIGHEST, RMSNorm, random_normal
from .quant import GEMM_INPUTS

_DTYPES = ("bfloat16", "float32")
_EXPERT_FORMATS = ("dequantized", "fp4")


@dataclass(frozen=True)
class ModelOptions:
    """dtype of activations and non-f32 parameters; the §C.2 rounding points; kernel choices; how routed experts
    are held: "dequantized" (stacked floats in ``dtype``) or "fp4" (packed codes + ue8m0 scales as stored,
    MODEL.md §E.1; decoded inside the kernel, or on the fly per layer on the reference path); ``engram``: run
    the config's engram layers (§B.12; their rows are a call input), or leave them and their tensors out.
    ``dense_format``: how the dense matrices the release stores in fp8 are held: "dequantized" (in ``dtype``) or
    "fp8" (e4m3 codes + ue8m0 block scales as stored, MODEL.md §E.1; computed by the block-scaled fp8 matmul op,
    ``dense_impl``; `model/dense.py`).
    ``gemm_inputs``: the activations entering the dense and expert GEMMs: "exact" (as computed, in ``dtype``; what
    mlx-lm does) or "fp8" (rounded to e4m3 with a ue8m0 scale per 32 along K first: the release's own inference
    numerics, mlx-vlm's default; ``quant.round_gemm_input``, `MODEL.md` §C.2). The DSpark stages stay exact.

    ``moe_impl="pallas"`` computes the routed experts in bfloat16 whatever ``dtype`` is (the kernel casts its
    activations to bf16, f32 accumulation): a float32 model then has float32 everything except the expert
    matmuls. Use ``moe_impl="xla"`` for float32 experts.

    The ``*_impl`` fields name an implementation of a kernel op (``pallas_kernels.registry``: "xla" | "pallas");
    the deprecated "reference" is accepted and stored as "xla"."""

    dtype: str = "bfloat16"
    quant_rounding: bool = True
    attention_impl: str = "xla"
    moe_impl: str = "xla"
    indexer_impl: str = "xla"  # "pallas": the fused scores + top-k kernel (pallas_kernels/indexer)
    hc_impl: str = "xla"  # "pallas": the HC comb's softmax + Sinkhorn in one kernel (pallas_kernels/hc_mix)
    dense_impl: str = "xla"  # the fp8 dense projections' op (pallas_kernels/fp8_matmul), with dense_format="fp8"
    expert_format: str = "dequantized"
    vision: bool = False  # build the image path (VISION.md): tower, aligner, span delimiters, gate.bias_vl
    engram: bool = True  # run the config's engram layers (False = --skip-engram: no engram parameters either)
    engram_tables: str = "device"  # "host": no table parameters; each call brings its gathered rows (§B.12)
    tiles: KernelTiles | None = None  # the plan's kernel tiles (planner.kernel_tiles); None: the ops' defaults
    dspark: bool = False  # build the config's DSpark draft stages ``mtp.*`` (§B.13; `model/dspark.py`)
    scan_layers: bool = True  # run a stacked run of layers with one lax.scan (False: unrolled, same weights)
    dense_format: str = "dequantized"  # "fp8": the release's fp8 dense matrices held as stored (model/dense.py)
    gemm_inputs: str = "exact"  # "fp8": GEMM inputs rounded to e4m3 + ue8m0 per 32 (the release's numerics)

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelOptions.dtype {self.dtype!r} must be one of {_DTYPES}")
        for name in ("attention_impl", "moe_impl", "indexer_impl", "hc_impl", "dense_impl"):
            object.__setattr__(self, name, registry.resolve(getattr(self, name), f"ModelOptions.{name}"))
        if self.expert_format not in _EXPERT_FORMATS:
            raise ValueError(f"ModelOptions.expert_format {self.expert_format!r} must be one of {_EXPERT_FORMATS}")
        if self.dense_format not in _DENSE_FORMATS:
            raise ValueError(f"ModelOptions.dense_format {self.dense_format!r} must be one of {_DENSE_FORMATS}")
        if self.gemm_inputs not in GEMM_INPUTS:
            raise ValueError(f"ModelOptions.gemm_inputs {self.gemm_inputs!r} must be one of {GEMM_INPUTS}")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def dense(self) -> Dense:
        """How the fp8-stored dense projections are held and computed (`model/dense.py`)."""
        return Dense(self.dense_format, self.dense_impl)


class Taps(NamedTuple):
    """What ``Transformer.forward(..., taps=True)`` hands DSpark and the speculative rollback (§B.13).

    ``context`` [B,T,n·D] (model dtype): τ_t, the mean of the 4 streams entering each ``dspark_target_layer_ids``
    layer (after its engram), concatenated in that order. ``pending`` {layer: u [B,T,D]}: the normed attention
    input of every ratio-2 compressor layer, from which a rolled-back cache rebuilds its pending row.
    """

    context: jnp.ndarray
    pending: dict


class ImageRows(NamedTuple):
    """The image part of one segment's input (VISION.md §V.E.1).

    ``embeds`` [B, T, D]: at IMAGE positions the aligner row of that slot (elsewhere don't-care);
    ``roles`` int32 [B, T]: TEXT (−1) or START / IMAGE / NEWLINE / END (`vision.preprocess`).
    ``is_image = roles >= 0`` (every span position) is the mask the router uses and engram's DEAD marking can use.
    """

    embeds: jnp.ndarray
    roles: jnp.ndarray

    @property
    def is_image(self) -> jnp.ndarray:
        return self.roles >= 0


class Embed(nnx.Module):
    """``embed.weight [V, D]``."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(random_normal(rngs, (vocab, dim), 1.0, dtype))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


class Head(nnx.Module):
    """``head.weight [V, D]``; logits in f32 (f32 accumulation of the model-dtype product, not rounded)."""

    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(random_normal(rngs, (vocab, dim), dim**-0.5, dtype))

    def __call__(self, h):
        return jnp.einsum("...d,vd->...v", h, self.weight[...].astype(h.dtype), precision=HIGHEST,
                          preferred_element_type=jnp.float32)


class Block(nnx.Module):
    """``layers.L``: the attention and MoE sublayers with their hyper-connection mixes."""

    def __init__(self, cfg: ModelConfig, layer: int, options: ModelOptions, *, rngs: nnx.Rngs):
        dtype = options.jnp_dtype
        self.hc_kwargs = mix_kwargs(cfg, options.hc_impl)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = mix_params(cfg, rngs)  # the two HC mixes (§B.3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = mix_params(cfg, rngs)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, layer, dtype=dtype, rounding=options.quant_rounding,
                              impl=options.attention_impl, rngs=rngs, indexer_impl=options.indexer_impl,
                              tiles=options.tiles, dense=options.dense, gemm_inputs=options.gemm_inputs)
        self.ffn = MoE(cfg, dtype=dtype, moe_impl=options.moe_impl, rngs=rngs, expert_format=options.expert_format,
                       image_bias=options.vision, tiles=options.tiles, dense=options.dense,
                       gemm_inputs=options.gemm_inputs)
        if options.engram and layer in cfg.engram_layer_ids:
            self.engram = Engram(cfg, layer, dtype=dtype, rngs=rngs, tables=options.engram_tables,
                                 dense=options.dense, gemm_inputs=options.gemm_inputs)
        self.tiles = options.tiles

    def _row_split(self, rows: int) -> bool:
        """A row-parallel segment (the plan's ``KernelTiles.row_parallel``) under a mesh of more than one device."""
        mesh = active_mesh()
        return self.tiles is not None and mesh is not None and self.tiles.row_parallel(rows, mesh.size)

    def __call__(self, streams, pre_prev, seg: Segment, cache, csa: CsaState, is_image=None,
                 engram: EngramInput | None = None, taps: dict | None = None, expert_row=None):
        """streams [B,T,S,D], pre_prev f32 [B,T,S] (the previous sublayer's pre, §B.4), the CSA state of the
        layers before, is_image bool [B,T] or None (all text), engram rows (engram layers) -> (streams, pre of
        the FFN mix, new LayerCache, CSA state with this layer's entries). ``taps``: a dict this layer adds its
        taps to ("entering": the stream mean after the engram; "u": the normed attention input).
        ``expert_row``: int32 scalar when this Block's routed experts (and fp8 dense weights) are its unit's whole
        stack (``_scan_run``)."""
        if hasattr(self, "engram"):
            with jax.named_scope("engram"):  # §B.4: before the attention HC mix
                streams = self.engram(streams, engram)
        if taps is not None:  # §B.13 / VISION.md §V.H item 1: the mean of the streams entering the layer
            taps["entering"] = jnp.mean(streams.astype(jnp.float32), axis=-2).astype(streams.dtype)
        # Row-parallel segment: the per-row work (mixes, collapse, norms, expand) on each rank's rows; the sublayer
        # input is gathered for attention and the MoE, whose outputs come back whole.
        split = self._row_split(streams.shape[1])
        rows = (lambda x: constrain(x, "stream_rows")) if split else (lambda x: x)
        whole = (lambda x: constrain(x, "replicated")) if split else (lambda x: x)
        streams = rows(streams)
        with jax.named_scope("attn"):
            pre_a, post_a, comb_a = hc_mix(streams, self.hc_attn_fn[...], self.hc_attn_base[...],
                                           self.hc_attn_scale[...], split_rows=split, **self.hc_kwargs)
            u = whole(self.attn_norm(collapse(streams, pre_prev)))
            if taps is not None:
                taps["u"] = u
            y, cache, csa = self.attn(u, seg, cache, csa, expert_row)
            streams = rows(expand(y, streams, post_a, comb_a))
        with jax.named_scope("moe"):
            pre_f, post_f, comb_f = hc_mix(streams, self.hc_ffn_fn[...], self.hc_ffn_base[...],
                                           self.hc_ffn_scale[...], split_rows=split, **self.hc_kwargs)
            y = self.ffn(whole(self.ffn_norm(collapse(streams, pre_a))), is_image, expert_row, seg.valid)
            return rows(expand(y, streams, post_f, comb_f)), pre_f, cache, csa


def _stacked_block(cfg: ModelConfig, unit: tuple[int, ...], options: ModelOptions, rngs: nnx.Rngs) -> Block:
    """One ``Block`` whose every Variable is its layers' values stacked ``[n, ...]`` (the unit's layers share
    one signature, so one graph definition serves them all; ``cfg.layer_units``)."""
    blocks = [Block(cfg, layer, options, rngs=rngs) for layer in unit]
    graphdef, _ = nnx.split(blocks[0])
    return nnx.merge(graphdef, jax.tree.map(lambda *w: jnp.stack(w), *(nnx.state(b) for b in blocks)))


class Layers(nnx.Module):
    """``layers.*``: one ``Block`` per unit of ``cfg.layer_units()``, named ``unit_name(unit)``; a unit of n
    layers holds their weights stacked (docs/DESIGN.md "Scanned layers"). ``layers[L]`` is layer L's own Block
    (a layer alone; a layer of a stacked unit has none: ``units``/``unit`` reach the unit)."""

    def __init__(self, cfg: ModelConfig, options: ModelOptions, *, rngs: nnx.Rngs):
        self.steps = cfg.layer_steps()
        self.units = cfg.layer_units()
        for unit in self.units:
            block = Block(cfg, unit[0], options, rngs=rngs) if len(unit) == 1 else _stacked_block(
                cfg, unit, options, rngs)
            setattr(self, unit_name(unit), block)

    def unit(self, unit: tuple[int, ...]) -> Block:
        return getattr(self, unit_name(unit))

    def __len__(self) -> int:
        return sum(len(u) for u in self.units)

    def __getitem__(self, layer: int) -> Block:
        if not 0 <= layer < len(self):
            raise IndexError(f"layer {layer} out of range (the model has {len(self)} layers)")
        unit = next(u for u in self.units if layer in u)
        if len(unit) > 1:
            raise KeyError(f"layer {layer} is row {unit.index(layer)} of the stacked unit layers.{unit_name(unit)}")
        return self.unit(unit)


def _stack(trees: list):
    return jax.tree.map(lambda *c: jnp.stack(c), *trees)


def _unstack(tree, n: int) -> list:
    """The n rows of a tree stacked [n, ...] (``_stack``'s inverse)."""
    return [jax.tree.map(lambda a: a[i], tree) for i in range(n)]


def _loop(body, carry, xs, n: int, scan: bool):
    """``lax.scan(body, carry, xs)`` over n rows, or the same body unrolled n times (ys stacked alike)."""
    if scan:
        return jax.lax.scan(body, carry, xs)
    ys = []
    for x in _unstack(xs, n):
        carry, y = body(carry, x)
        ys.append(y)
    return carry, _stack(ys)


def _split_routed(block: Block):
    """(graphdef, routed experts and fp8 dense weights, other weights) of a stacked unit's Block. The loop slices
    the other weights a layer a step; the routed experts stay the unit's whole stack [n, E, ...], which each
    layer's MoE op reads in place at its row (``expert_row``): a loop-sliced layer of them is a copy of all E
    experts a layer every step (measured: see docs/BENCHMARKS.md, section "Scanned layers read their experts in
    place"). fp8 dense weights held as stored (``dense.Fp8Param``) stay stacked for the same reason."""
    return nnx.split(block, nnx.Any(nnx.PathContains("experts"), Fp8Param), ...)


def _scan_run(graphdef, routed, weights, rows, caches, streams, pre, seg: Segment, csa: CsaState, is_image,
              taps: bool, scan: bool):
    """A run of n reuse layers: ``weights``, ``caches`` stacked [n, ...], ``rows`` int32 [n] the layers' rows of
    the ``routed`` experts' stack (``_split_routed``). A reuse layer reads ``csa`` (published before the run)
    and publishes nothing. Returns (streams, pre, new caches [n, ...], entering [n,B,T,D] or None)."""
    def body(carry, xs):
        row, layer_weights, layer_cache = xs
        tap = {} if taps else None
        block = nnx.merge(graphdef, routed, layer_weights)
        s, p, layer_cache, _ = block(*carry, seg, layer_cache, csa, is_image, None, tap, row)
        return (s, p), (layer_cache, tap["entering"] if taps else None)

    n = jax.tree.leaves(caches)[0].shape[0]
    (streams, pre), (new, entering) = _loop(body, (streams, pre), (rows, weights, caches), n, scan)
    return streams, pre, new, entering


def _run_stacked(block: Block, caches: list, streams, pre, seg: Segment, csa: CsaState, is_image, taps: bool,
                 scan: bool):
    """The stacked run ``block`` (n layers) with its layers' caches (their rings are stacked on entry and split on
    exit). Returns (streams, pre, the n new LayerCaches, entering [n,B,T,D] or None)."""
    graphdef, routed, weights = _split_routed(block)
    rows = jnp.arange(len(caches), dtype=jnp.int32)
    streams, pre, new, entering = _scan_run(graphdef, routed, weights, rows, _stack(caches), streams, pre, seg,
                                            csa, is_image, taps, scan)
    return streams, pre, _unstack(new, len(caches)), entering


def _run_groups(leads: Block, runs: Block, lead_caches: list, run_caches: list, streams, pre, seg: Segment,
                csa: CsaState, is_image, taps: bool, scan: bool):
    """A group scan (``ModelConfig.layer_steps``): G repeats of (a reindex layer, its run of n reuse layers), one
    loop over the repeats with the run unrolled inside; ``leads`` holds the G reindex layers stacked, ``runs``
    the G·n reuse layers. One graph definition serves every repeat: the first repeat's, whose lead publishes
    its selections under its own layer id and whose run reads them there — consistent within a repeat, which
    is all a repeat reads (§B.9).

    Returns (streams, pre, G new lead caches, G·n new run caches, selections [G,B,T,K], entering of the leads
    [G,B,T,D] and of the run layers [G·n,B,T,D], or None)."""
    g = len(lead_caches)
    n = len(run_caches) // g
    lead_def, lead_routed, lead_weights = _split_routed(leads)
    run_def, run_routed, run_weights = _split_routed(runs)
    lead_id = leads.attn.layer
    per_repeat = lambda tree: jax.tree.map(lambda a: a.reshape(g, n, *a.shape[1:]), tree)  # [G·n] -> [G, n]
    per_layer = lambda tree: jax.tree.map(lambda a: a.reshape(g * n, *a.shape[2:]), tree)  # [G, n] -> [G·n]

    def body(carry, xs):
        lead_row, lw, run_rows, rw, lc, rc = xs
        tap = {} if taps else None
        lead = nnx.merge(lead_def, lead_routed, lw)
        s, p, lc, repeat_csa = lead(*carry, seg, lc, csa, is_image, None, tap, lead_row)
        # the run unrolled in the repeat (scan=False): a loop here would take the repeat's rows of the run's
        # stacks as its input, a copy of n layers' weights every repeat (measured: see docs/BENCHMARKS.md, section
        # "A group scan's loop inside a loop"); unrolled, each layer's products read its row of the stacks in
        # place at an offset of the repeats' loop counter
        s, p, rc, run_entering = _scan_run(run_def, run_routed, rw, run_rows, rc, s, p, seg, repeat_csa, is_image,
                                           taps, scan=False)
        return (s, p), (lc, rc, repeat_csa.topk[lead_id], tap["entering"] if taps else None, run_entering)

    rows = jnp.arange(g * n, dtype=jnp.int32).reshape(g, n)   # repeat r's run layers: rows r·n .. r·n + n - 1
    xs = (jnp.arange(g, dtype=jnp.int32), lead_weights, rows, per_repeat(run_weights), _stack(lead_caches),
          per_repeat(_stack(run_caches)))
    (streams, pre), (lc, rc, topk, lead_entering, run_entering) = _loop(body, (streams, pre), xs, g, scan)
    return (streams, pre, _unstack(lc, g), _unstack(per_layer(rc), g * n), topk, lead_entering,
            per_layer(run_entering))


class Transformer(nnx.Module):
    """The text model. ``logits, cache = model(ids [B,T], cache, lengths=None)``; logits [B,T,V] f32.

    Row t of sequence b is at position ``cache.offset[b] + t``; rows ``t >= lengths[b]`` are padding: they do
    not change sequence b's cache and their logits are don't-care. Implements `dsv41_jax.runtime.ModelLike`.
    """

    def __init__(self, cfg: ModelConfig, options: ModelOptions = ModelOptions(), *, rngs: nnx.Rngs = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        dtype = options.jnp_dtype
        self.cfg = cfg
        self.options = options
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = Layers(cfg, options, rngs=rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.head = Head(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        if options.vision:
            self._init_vision(cfg, dtype, rngs)
        if options.dspark and cfg.num_nextn_predict_layers:
            self.mtp = nnx.List([Stage(cfg, s, options, rngs=rngs) for s in range(cfg.num_nextn_predict_layers)])

    def _init_vision(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> None:
        """``vision.*`` (ViT), ``aligner.*`` and the span delimiters ``image_start/newline/end`` [D] (§V.F)."""
        from ..vision.tower import Aligner, VisionTower  # noqa: PLC0415 - a cycle: vision.tower imports the model package

        if cfg.vision is None:
            raise ValueError("ModelOptions.vision needs a config with a vision_config")
        self.vision = VisionTower(cfg.vision, dtype=dtype, rngs=rngs)
        self.aligner = Aligner(cfg, dtype=dtype, rngs=rngs)
        for name in ("image_start", "image_newline", "image_end"):
            setattr(self, name, nnx.Param(random_normal(rngs, (cfg.hidden_size,), 1.0, dtype)))

    def encode_images(self, batch):
        """``vision.batch.ImageBatch`` → aligner rows E [B, M, D] in the model dtype (VISION.md §V.C–§V.D)."""
        return self.aligner(self.vision(batch), batch)

    def merge_images(self, e, images: ImageRows):
        """e [B,T,D] token embeddings → the same with image positions replaced (VISION.md §V.E.1)."""
        roles = images.roles[..., None]
        e = jnp.where(roles == IMAGE, images.embeds.astype(e.dtype), e)
        for role, vec in ((START, self.image_start), (NEWLINE, self.image_newline), (END, self.image_end)):
            e = jnp.where(roles == role, vec[...].astype(e.dtype), e)
        return e

    @property
    def engram_layers(self) -> tuple[int, ...]:
        """The engram layers this model runs (they need ``engram=`` rows in every call)."""
        return tuple(self.cfg.engram_layer_ids) if self.options.engram else ()

    @property
    def vocab_size(self) -> int:
        """The vocabulary the logits cover."""
        return self.cfg.vocab_size

    @property
    def has_vision(self) -> bool:
        """Built with the image path (``ModelOptions.vision``)."""
        return self.options.vision

    @property
    def has_dspark(self) -> bool:
        """Built with the DSpark draft stages ``mtp.*`` (``ModelOptions.dspark`` and a config that has them)."""
        return self.options.dspark and bool(self.cfg.num_nextn_predict_layers)

    def unwrap(self):
        """(this model, no context, no vocabulary maps): one device runs the model as it is (`ModelLike`)."""
        return self, contextlib.nullcontext(), None

    def __call__(self, ids, cache: Cache, lengths=None, images: ImageRows | None = None,
                 engram: EngramInput | None = None, logit_rows=None):
        logits, cache, _ = self.forward(ids, cache, lengths, images, engram, logit_rows)
        return logits, cache

    def forward(self, ids, cache: Cache, lengths=None, images: ImageRows | None = None,
                engram: EngramInput | None = None, logit_rows=None, taps: bool = False):
        """``__call__`` plus the per-call selections (for tests and diagnostics): returns
        (logits [B,T,V] f32, new Cache, {index-source layer: top-k [B,T,K] int32, −1 = none}), and with
        ``taps=True`` a fourth item, the ``Taps`` of this call (DSpark context and rollback rows, no extra pass).

        ``images``: the segment's image rows and roles (None: text only; needs ``ModelOptions.vision``).
        ``engram``: the host-hashed rows of this call (`dsv41_jax.engram.Hasher`), required when the model runs
        engram layers. ``logit_rows`` int32 [B]: apply the head to row ``logit_rows[b]`` of each sequence only
        (logits [B,V]; a decode step or a prefill segment needs one row per sequence); None: every row."""
        if self.engram_layers and engram is None:
            raise ValueError(f"this model runs engram layers {list(self.engram_layers)}: pass their rows "
                             f"(engram=EngramInput), or build it with ModelOptions(engram=False)")
        b, t = ids.shape
        s = self.cfg.hc_mult
        lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        offset = cache.offset
        rows = jnp.arange(t, dtype=jnp.int32)[None, :]
        seg = Segment(positions=offset[:, None] + rows, valid=rows < lengths[:, None], offset=offset,
                      lengths=lengths)
        e = self.embed(ids)
        is_image = None
        if images is not None:
            e, is_image = self.merge_images(e, images), images.is_image
        streams = jnp.broadcast_to(e[:, :, None, :], (b, t, s, e.shape[-1]))
        pre = jnp.broadcast_to(jax.nn.one_hot(0, s, dtype=jnp.float32), (b, t, s))  # §B.2: pre⁻¹ = stream 0
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"the cache holds {len(cache.layers)} layers, the model {len(self.layers)}")
        csa = CsaState.empty(len(self.layers))
        new_layers: dict[int, object] = {}
        entering, pending, group_topk = {}, {}, {}
        scan = self.options.scan_layers
        for step in self.layers.steps:
            if len(step) == 2:  # a group scan: (leads, runs)
                leads, runs = step
                with jax.named_scope(f"layers_{unit_name(leads)}"):
                    streams, pre, lead_caches, run_caches, topk, lead_in, run_in = _run_groups(
                        self.layers.unit(leads), self.layers.unit(runs), [cache.layers[j] for j in leads],
                        [cache.layers[j] for j in runs], streams, pre, seg, csa, is_image, taps, scan)
                new_layers.update(zip(leads, lead_caches))
                new_layers.update(zip(runs, run_caches))
                group_topk.update({j: topk[k] for k, j in enumerate(leads)})
                if taps:
                    entering.update({j: lead_in[k] for k, j in enumerate(leads)})
                    entering.update({j: run_in[k] for k, j in enumerate(runs)})
                continue
            unit = step[0]
            block, i = self.layers.unit(unit), unit[0]
            if len(unit) > 1:
                with jax.named_scope(f"layers_{unit_name(unit)}"):
                    streams, pre, caches, run_entering = _run_stacked(
                        block, [cache.layers[j] for j in unit], streams, pre, seg, csa, is_image, taps, scan)
                new_layers.update(zip(unit, caches))
                if taps:
                    entering.update({j: run_entering[k] for k, j in enumerate(unit)})
                continue
            tap = {} if taps else None
            with jax.named_scope(f"layer_{i}"):  # per-layer op names for traces (profiling/trace.py)
                streams, pre, layer_cache, csa = block(streams, pre, seg, cache.layers[i], csa, is_image, engram,
                                                       tap)
            new_layers[i] = layer_cache
            if taps:
                entering[i] = tap["entering"]
                if layer_cache.pending_kv is not None:
                    pending[i] = tap["u"]
        hidden = collapse(streams, pre)  # [B,T,D]
        if logit_rows is not None:
            rows = jnp.clip(jnp.asarray(logit_rows, jnp.int32), 0, t - 1)
            hidden = jnp.take_along_axis(hidden, rows[:, None, None], axis=1)[:, 0]  # [B,D]
        logits = self.head(self.norm(hidden))
        selections = {layer: topk for layer, topk in enumerate(csa.topk) if topk is not None}
        selections = dict(sorted({**selections, **group_topk}.items()))
        new_cache = Cache(offset=offset + lengths, layers=tuple(new_layers[i] for i in range(len(self.layers))))
        if not taps:
            return logits, new_cache, selections
        ids_ = self.cfg.dspark_target_layer_ids
        context = jnp.concatenate([entering[i] for i in ids_], axis=-1) if ids_ else None
        return logits, new_cache, selections, Taps(context, pending)


class WeightsError(ValueError):
    """A weight dict that does not fit the model; the message names the tensor."""


def param_shapes(model: Transformer) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """Model name -> (shape, dtype) of every parameter."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): (tuple(var.shape), var.dtype) for path, var in flat}
