"""The one model setup the CLIs and the benchmarks share: a `RunSpec` (what to run, as a command line says it)
→ `open_inputs` (the config, the weights' source, the engram hasher and table placement, speculation) →
`build` (the model and its mesh); `tokenizer` and `segment_plan` give the rest of a run.

Weights come from one of three sources (`RunSpec.weights`): ``"checkpoint"`` (``--checkpoint``: tensors read
lazily while the model is built), ``"random"`` (``--config`` / the embedded tiny model: `make_tiny.random_weights`
on the host, seed 0) or ``"random-on-device"`` (``layers``: a K-layer cut of the config keeping its layer roles,
drawn on the devices already sharded by `profiling.build`; profile and the benchmarks build their own cuts with
`device_model`). Messages for the user (notes, the engram placement) go to stderr; mistakes are `UsageError`.

Imports no JAX at import time: the CLIs check their arguments before JAX starts.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Callable

from . import distributed
from .assets import embedded_checkpoint
from .cli import UsageError, positive_int, quiet, say
from .config import ConfigError, ModelConfig, config_label, load_named
from .param_specs import is_engram_table
from .planner import MemoryBudget, PlanOptions, engram_bytes_per_rank, engram_placement
from .profiling.cut import cut_layers
from .tokenizer import load_tokenizer

WEIGHT_SOURCES = ("checkpoint", "random", "random-on-device")


@dataclass(frozen=True)
class RunSpec:
    """What to run. ``config``: a named config or a config.json path (with a checkpoint: overrides its
    config.json); ``layers``: random weights drawn on the devices for a K-layer cut of ``config`` (default the
    released dsv41_flash); ``impl`` "auto": pallas on GPU, xla elsewhere; ``expert_format`` "auto": as the
    checkpoint stores them; ``dense_format`` "fp8": the dense matrices as the checkpoint stores them (e4m3 codes
    and block scales; with ``layers``: drawn so), "auto" / "bf16": in ``dtype``; ``gemm_inputs``: the activations
    entering the dense and expert GEMMs, "exact" or "fp8" (rounded to e4m3 + ue8m0 per 32, the release's own
    inference numerics; ``ModelOptions.gemm_inputs``); ``engram_tables`` "auto": the
    planner's choice; ``images``: build the image path;
    ``speculate`` off | auto | dspark with ``draft_tokens``; ``speculation_off``: what else in the run rules
    speculation out (said when auto turns it off, refused with dspark)."""

    checkpoint: str | None = None
    config: str | None = None
    layers: int | None = None
    world: int = 1
    dtype: str = "bfloat16"
    expert_format: str = "auto"
    impl: str = "auto"
    quant_rounding: bool = True
    skip_engram: bool = False
    engram_tables: str = "auto"
    images: bool = False
    speculate: str = "off"
    draft_tokens: int = 5
    speculation_off: tuple[str, ...] = ()
    scan_layers: bool = True
    processes: distributed.Processes = distributed.ONE_PROCESS
    dense_format: str = "auto"
    gemm_inputs: str = "exact"

    @property
    def weights(self) -> str:
        """Where the weights come from (one of `WEIGHT_SOURCES`)."""
        if self.checkpoint:
            return "checkpoint"
        return "random-on-device" if self.layers else "random"


@dataclass(frozen=True)
class ModelInputs:
    """The config, the weights (model name → host array, or lazily read tensor; None when drawn on the devices)
    and how the model holds them."""

    cfg: ModelConfig
    weights: object
    description: str
    expert_format: str = "dequantized"
    vision: bool = False  # the image path is loaded (prompts have images)
    hasher: object = None  # the engram hasher (token map + layout) when engram layers run
    engram_tables: str = "device"  # where the engram tables live ("device" | "host")
    host_tables: object = None  # engram.HostTables with "host": memory maps of the tables
    dspark: bool = False  # the DSpark stages are loaded (speculative decoding runs)
    on_device: bool = False  # random weights drawn on the devices at build time (`profiling.build`)
    dense_format: str = "dequantized"  # or "fp8": the fp8 dense matrices held as stored (ModelOptions.dense_format)


@dataclass(frozen=True)
class EngramSetup:
    """How the engram layers run: the hasher (None: no engram layers, or skip_engram) and where the tables
    live ("device": split by hash column over the devices; "host": memory-mapped, rows gathered per call)."""

    hasher: object = None
    tables: str = "device"


# ------------------------------------------------------------------------------------------------ command line
def add_model_args(parser: argparse.ArgumentParser, *, cut_layers: bool = False, engram_tables: bool = True,
                   image_default: bool = False):
    """The model flags the commands share (generate's and serve's, one wording), in a "model" group that is
    returned (a command adds its own to it), then the several-processes flags (`distributed.add_process_args`).
    ``cut_layers``: ``--layers`` (a K-layer cut drawn on the devices); ``engram_tables``: ``--engram-tables``
    (else the tables live on the devices); ``image_default``: the random model's config for image prompts is said."""
    model = parser.add_argument_group("model")
    model.add_argument("--checkpoint", metavar="DIR",
                       help="official-format weights (default: the embedded trained model, dsv41_jax/assets/bard, "
                            "unless --config names a random-weight one)")
    images = " (image prompts with neither flag: tiny_vision)" if image_default else ""
    model.add_argument("--config", metavar="NAME|FILE",
                       help="a random-weight model's config: tiny, tiny_engram, tiny_vision, bard, dsv41_flash, "
                            f"or a config.json path{images}; with --checkpoint, overrides its config.json")
    if cut_layers:
        model.add_argument("--layers", type=positive_int, metavar="K",
                           help="a K-layer cut of --config (default the released dsv41_flash) keeping its layer "
                                "roles, random weights drawn on the devices, sharded (as python -m dsv41_jax.profile): "
                                "e.g. the 2-layer full-width model for serving benchmarks")
    model.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                       help="activations, weights and cache (default: bfloat16)")
    model.add_argument("--expert-format", choices=("auto", "dequantized", "fp4"), default="auto",
                       help="with --checkpoint: hold routed experts packed fp4 as stored (about a quarter of the "
                            "bytes; needs fp4 experts in the checkpoint) or dequantised; auto (default): fp4 when "
                            "the checkpoint stores fp4 experts (the official release), dequantised otherwise")
    model.add_argument("--dense-format", choices=("auto", "bf16", "fp8"), default="auto",
                       help="fp8: hold the dense matrices as the checkpoint stores them (e4m3 codes + block scales, "
                            "half the bytes of bf16; with --layers: drawn so); auto / bf16 (default): dequantised to "
                            "--dtype (the fp8 kernel is not yet faster than bf16 at decode sizes)")
    model.add_argument("--impl", choices=("auto", "xla", "pallas", "reference"), default="auto",
                       metavar="auto|xla|pallas",
                       help="attention, MoE and indexer kernels; auto (default): pallas on GPU, xla elsewhere "
                            "(pallas on CPU runs interpreted: slow; 'reference' = xla, deprecated)")
    model.add_argument("--skip-engram", action="store_true",
                       help="run a config with engram layers without them (NOT the model's output)")
    model.add_argument("--quant-rounding", action=argparse.BooleanOptionalAction, default=True,
                       help="the release's fp8/fp4 rounding points inside the model (docs/MODEL.md §C.2; default on). "
                            "--no-quant-rounding: for comparisons only — sharded and segmented float32 runs then "
                            "agree with one device to ~1e-5 (with them on, an fp4 boundary flip can move later "
                            "logits by up to ~1 on random weights)")
    model.add_argument("--gemm-inputs", choices=("exact", "fp8"), default="exact",
                       help="the activations entering the dense and expert GEMMs: exact (default: as computed, what "
                            "mlx-lm does; no extra rounding work while the GEMMs run in bf16) or fp8 (rounded to e4m3 "
                            "with a power-of-two scale per 32 first: the release's own inference numerics, the ones "
                            "the checkpoint was trained for, as mlx-vlm; README, numerics)")
    if engram_tables:
        model.add_argument("--engram-tables", choices=("auto", "device", "host"), default="auto",
                           help="where engram tables live: device (split by hash column over the devices, e4m3 + "
                                "ue8m0 as stored) or host (memory-mapped, each call's rows gathered on the host); "
                                "auto (default): device when it fits at this --world, else host (printed)")
    model.add_argument("--world", type=positive_int, default=1, metavar="N",
                       help="devices to shard over, over every process (default 1: unsharded)")
    model.add_argument("--compile-cache", metavar="DIR",
                       help="persistent compilation cache: a second run of the same command loads its programs "
                            "instead of compiling (default: $DSV41_JAX_COMPILE_CACHE or ~/.cache/dsv41_jax/xla; "
                            "'off' disables it)")
    distributed.add_process_args(parser)
    return model


# The RunSpec fields a command line gives by flags of the same name (those a command has).
_FLAG_FIELDS = ("checkpoint", "config", "layers", "world", "dtype", "expert_format", "dense_format", "impl",
                "quant_rounding", "gemm_inputs", "skip_engram", "engram_tables", "speculate", "draft_tokens")


def spec_from_args(args: argparse.Namespace, **fields) -> RunSpec:
    """The `RunSpec` of a parsed command line (`add_model_args`' flags, and ``--speculate`` / ``--draft-tokens``
    where the command has them); ``fields`` set the rest (or override)."""
    given = {name: getattr(args, name) for name in _FLAG_FIELDS if hasattr(args, name)}
    if hasattr(args, "num_processes"):
        given["processes"] = distributed.from_args(args)
    spec = dataclasses.replace(RunSpec(), **{**given, **fields})
    if spec.weights == "random" and not spec.config and not spec.images:  # the embedded trained model
        spec = dataclasses.replace(spec, checkpoint=str(embedded_checkpoint()))
    return spec


def local_devices(args: argparse.Namespace) -> int:
    """The devices this process gives to the command line's ``--world`` (`cli.cli_main`'s simulated CPU devices)."""
    return distributed.local_devices(args.world, distributed.from_args(args))


# ------------------------------------------------------------------------------------------------ devices
def start(spec: RunSpec) -> None:
    """Join the spec's processes (`distributed.initialize`; all but process 0 then print only errors) and check
    that the machines give its world (`check_world`)."""
    distributed.initialize(spec.processes)
    if not distributed.is_leader():
        quiet()
    check_world(spec.world)


def check_world(world: int) -> None:
    """`UsageError` for a world the machine (or the processes together) cannot give."""
    import jax  # noqa: PLC0415 - JAX starts here, after the CLI asked for its simulated devices

    available, backend = len(jax.devices()), jax.default_backend()
    if jax.process_count() > 1 and world != available:
        raise UsageError(f"--world {world}: {jax.process_count()} processes give {available} {backend.upper()} "
                         f"devices ({jax.local_device_count()} each) and the mesh takes all of them: give --world "
                         f"{available}, or limit the devices a process sees (CUDA_VISIBLE_DEVICES)")
    if world > available:
        hint = ("; XLA_FLAGS (or a JAX already started) fixed fewer simulated CPU devices: set "
                f"--xla_force_host_platform_device_count={world} there" if backend == "cpu" else "")
        raise UsageError(f"--world {world} asks for {world} devices but only {available} {backend.upper()} "
                         f"device{'s' if available != 1 else ''} exist{'s' if available == 1 else ''}{hint}")


def device_memory_bytes() -> int | None:
    """Bytes of the first device's memory when the backend reports it (GPUs), else None (CPU)."""
    import jax  # noqa: PLC0415 - JAX starts here, after the CLI asked for its simulated devices

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        return None
    return stats.get("bytes_limit")


def kernel_impl(impl: str) -> str:
    """``auto``: the Pallas kernels on GPU, the XLA ones elsewhere; "reference" (the deprecated name) is "xla";
    any other name as it is."""
    if impl != "auto":
        return "xla" if impl == "reference" else impl
    import jax  # noqa: PLC0415 - JAX starts here, after the CLI asked for its simulated devices

    return "pallas" if jax.default_backend() == "gpu" else "xla"


# ------------------------------------------------------------------------------------------------ inputs
def engram_setup(cfg, spec: RunSpec, checkpoint_dir=None, expert_format: str = "dequantized",
                 memory: Callable[[], int | None] = device_memory_bytes) -> EngramSetup:
    """The engram hasher and table placement for the run, before any weight is read: ``skip_engram`` gets a
    loud warning; an unusable token map or table layout is refused; ``engram_tables`` auto asks the planner
    (device when R10 holds at this world with the tables split by hash column, else host); ``device`` is
    refused when a device's slab cannot fit (``memory()``: a device's bytes, None when unknown). The choice is
    printed."""
    from .engram import Hasher  # noqa: PLC0415 - brings JAX (the codec)

    if not cfg.engram_layer_ids:
        return EngramSetup()
    layers = list(cfg.engram_layer_ids)
    if spec.skip_engram:
        say(f"WARNING: --skip-engram: running WITHOUT the engram layers {layers}; the output is NOT the model's")
        return EngramSetup()
    hasher = Hasher(cfg, checkpoint_dir=checkpoint_dir)
    limit = memory()
    tables, how = spec.engram_tables, "--engram-tables"
    if tables == "auto":
        tables, how = _planned_engram_tables(cfg, spec, expert_format, limit), "chosen by the planner"
    need = engram_bytes_per_rank(cfg, spec.world, tables="device")
    if tables == "device" and limit and need["tables"] > 0.9 * limit:
        raise UsageError(f"the engram tables need {need['tables'] / 2**30:,.1f} GiB on every device at --world "
                         f"{spec.world} (split by hash column, {need['columns']} columns a layer), more than the "
                         f"{limit / 2**30:,.1f} GiB a device has: use --engram-tables host, or a larger --world")
    if tables == "device":
        split = f", split by hash column ({need['columns']} columns a layer each)" if spec.world > 1 else ""
        where = f"tables on the devices{split}, {need['tables'] / 2**30:,.2f} GiB a device"
    else:
        host = engram_bytes_per_rank(cfg, spec.world, tables="host")
        where = (f"tables on the host (memory-mapped, {host['host_tables'] / 2**30:,.2f} GiB; each call's rows "
                 f"gathered there and sent with it)")
    say(f"engram layers {layers}: {where} ({how})")
    return EngramSetup(hasher, tables)


def _planned_engram_tables(cfg, spec: RunSpec, expert_format: str, limit: int | None) -> str:
    """The planner's placement for the weights as this run holds them (dense matrices in the dtype, experts fp4
    or in the dtype) within the device's memory (the H200 budget when the backend does not report it)."""
    held = "f32" if spec.dtype == "float32" else "bf16"
    options = PlanOptions(experts="fp4" if expert_format == "fp4" else held, dense=held)
    budget = MemoryBudget(usable_bytes=int(limit)) if limit else MemoryBudget()
    return engram_placement(cfg, spec.world, options, budget)


def _without_tables(weights):
    """The weights minus the engram tables (tables on the host: they stay memory-mapped there)."""
    return {k: v for k, v in weights.items() if not is_engram_table(k)}


def wants_speculation(spec: RunSpec, cfg, has_stages: bool, random: bool = False) -> bool:
    """Whether this run decodes with DSpark: auto = on for a checkpoint with the stages when nothing in the run
    rules it out; dspark = on or a UsageError naming why not; off (serve's slot loop) never."""
    if spec.speculate == "off" or (spec.speculate == "auto" and random):
        return False
    blockers = ([] if has_stages else ["the model has no DSpark stages (mtp.*)"]) + list(spec.speculation_off)
    if not 1 <= spec.draft_tokens <= min(5, cfg.dspark_block_size):
        raise UsageError(f"--draft-tokens must be in 1..{min(5, cfg.dspark_block_size)}, got {spec.draft_tokens}")
    if blockers and spec.speculate == "dspark":
        raise UsageError(f"--speculate dspark: {blockers[0]}")
    if blockers and has_stages:
        say(f"note: speculative decoding off: {blockers[0]}")
    return not blockers


def open_inputs(spec: RunSpec, memory: Callable[[], int | None] = device_memory_bytes) -> ModelInputs:
    """The run's config and weights' source (nothing large read yet); ``memory`` as in `engram_setup`."""
    if spec.layers and spec.checkpoint:
        raise UsageError("--layers makes a random-weight model: it does not go with --checkpoint")
    if spec.weights == "checkpoint":
        return open_checkpoint_inputs(spec, memory)
    if spec.dense_format == "fp8" and spec.weights == "random":
        raise UsageError("--dense-format fp8 needs --checkpoint (fp8 dense weights come from one) or --layers")
    if spec.expert_format == "fp4":
        raise UsageError("--expert-format fp4 needs --checkpoint (packed experts come from one)"
                         + ("; --layers draws dequantised random weights" if spec.layers else ""))
    if spec.weights == "random-on-device":
        return _device_cut_inputs(spec)
    return _random_inputs(spec, memory)


def open_checkpoint_inputs(spec: RunSpec, memory: Callable[[], int | None] = device_memory_bytes) -> ModelInputs:
    """A checkpoint: headers validated now, tensors read one at a time while the model is built (no host copy
    of the whole model); routed experts fp4 when stored so (``expert_format`` auto)."""
    # The checkpoint reader, the sharded source and the host tables bring JAX (the codec).
    from sharding.load import checkpoint_source  # noqa: PLC0415 - brings JAX (see above)

    from .checkpoint import CheckpointError, checkpoint_dir, open_checkpoint  # noqa: PLC0415 - brings JAX
    from .engram import HostTables  # noqa: PLC0415 - brings JAX (see above)
    from .loading import choose_dense_format  # noqa: PLC0415 - brings JAX (see above)

    path = checkpoint_dir(spec.checkpoint)
    cfg_override = load_named(spec.config) if spec.config else None
    vision, engram = spec.images, not spec.skip_engram
    ckpt = open_checkpoint(path, cfg_override, vision=vision, engram=engram)
    fmt = ckpt.stored_expert_format if spec.expert_format == "auto" else spec.expert_format
    try:
        dense = choose_dense_format(spec.dense_format, ckpt.stored_dense_format)
    except ValueError as e:
        raise UsageError(f"--dense-format {spec.dense_format}: {e}") from None
    setup = engram_setup(ckpt.cfg, spec, checkpoint_dir=path, expert_format=fmt, memory=memory)
    has_stages = ckpt.cfg.num_nextn_predict_layers > 0 and any(
        line.startswith("skipped") and "DSpark" in line for line in ckpt.skipped)
    dspark = wants_speculation(spec, ckpt.cfg, has_stages)
    if dspark:  # the mtp.* tensors join the inventory (all of them, or auto falls back to plain decoding)
        try:
            ckpt = open_checkpoint(path, cfg_override, expert_format=fmt, vision=vision, engram=engram, dspark=True,
                                   dense_format=dense)
        except CheckpointError as e:
            if spec.speculate == "dspark" or "fp4" in str(e):
                raise
            say(f"note: speculative decoding off: the checkpoint's DSpark stages are incomplete ({e})")
            dspark = False
    if (fmt != "dequantized" or dense != "dequantized") and not dspark:  # refuses what is not stored so
        ckpt = open_checkpoint(path, cfg_override, expert_format=fmt, vision=vision, engram=engram,
                               dense_format=dense)
    for line in ckpt.skipped:
        if not line.startswith("not run by this engine"):
            say(f"note: {line}")
    experts = (", fp4 experts" if fmt == "fp4" else "") + (", fp8 dense weights" if dense == "fp8" else "")
    weights = checkpoint_source(ckpt, dtype=spec.dtype)
    host_tables = None
    if setup.tables == "host" and setup.hasher is not None:
        weights, host_tables = _without_tables(weights), HostTables.from_checkpoint(ckpt, ckpt.cfg)
    return ModelInputs(ckpt.cfg, weights, f"checkpoint {path}{experts}", fmt, vision, setup.hasher, setup.tables,
                       host_tables, dspark, dense_format=dense)


def _random_inputs(spec: RunSpec, memory: Callable[[], int | None]) -> ModelInputs:
    """``config`` (default tiny; tiny_vision for images) with random weights drawn on the host (seed 0)."""
    # make_tiny and the host tables bring JAX (the codec).
    from .engram import HostTables  # noqa: PLC0415 - brings JAX (see above)
    from .make_tiny import check_random_size, random_weights  # noqa: PLC0415 - brings JAX (see above)

    if spec.config:
        cfg, name = load_named(spec.config), config_label(spec.config)
        if spec.images and cfg.vision is None:
            raise UsageError(f"--config {spec.config} has no vision_config: it cannot read images")
    elif spec.images:  # tiny plus a tiny vision tower (the text weights are tiny's)
        cfg, name = load_named("tiny_vision"), "configs/tiny_vision.json"
    else:
        cfg, name = load_named("tiny"), "configs/tiny.json"
    if cfg.vocab_size <= 0:
        raise ConfigError("vocab_size must be positive")
    try:
        check_random_size(cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    setup = engram_setup(cfg, spec, memory=memory)
    dspark = wants_speculation(spec, cfg, cfg.num_nextn_predict_layers > 0, random=True)
    weights = random_weights(cfg, seed=0, dspark=dspark)
    if spec.skip_engram:
        weights = {k: v for k, v in weights.items() if ".engram." not in k}
    host_tables = None
    if setup.tables == "host" and setup.hasher is not None:
        weights, host_tables = _without_tables(weights), HostTables.from_weights(weights, cfg)
    return ModelInputs(cfg, weights, f"{name} with RANDOM weights (seed 0): the output is not language",
                       vision=spec.images, hasher=setup.hasher, engram_tables=setup.tables,
                       host_tables=host_tables, dspark=dspark)


def _device_cut_inputs(spec: RunSpec) -> ModelInputs:
    """``layers``: a K-layer cut of ``config`` (default dsv41_flash), its weights drawn on the devices at build."""
    name = spec.config or "dsv41_flash"
    cfg = cut_layers(load_named(name), spec.layers)
    dense = "fp8" if spec.dense_format == "fp8" else "dequantized"
    return ModelInputs(cfg, None, f"{name} cut to {spec.layers} layers, RANDOM weights drawn on the devices"
                       + (", fp8 dense weights" if dense == "fp8" else ""), on_device=True, dense_format=dense)


# ------------------------------------------------------------------------------------------------ the model
def model_options(spec: RunSpec, expert_format: str = "dequantized", vision: bool = False,
                  engram_tables: str = "device", dspark: bool = False, tiles=None, dense_format: str | None = None):
    """`ModelOptions` for the run (engram layers unless skip_engram); says so when float32 experts would be
    computed in bf16 by the Pallas MoE."""
    from .model.transformer import ModelOptions  # noqa: PLC0415 - brings JAX

    impl = kernel_impl(spec.impl)
    if dense_format is None:  # a random cut's (the weights are drawn as the spec asks)
        dense_format = "fp8" if spec.dense_format == "fp8" else "dequantized"
    if impl == "pallas" and spec.dtype == "float32":
        say("note: --dtype float32 with the Pallas MoE kernel: routed experts are computed in bfloat16 (the kernel "
            "takes bf16 activations); use --impl xla for float32 experts")
    return ModelOptions(dtype=spec.dtype, expert_format=expert_format, attention_impl=impl, moe_impl=impl,
                        quant_rounding=spec.quant_rounding, vision=vision, indexer_impl=impl, hc_impl=impl,
                        engram=not spec.skip_engram, engram_tables=engram_tables, dspark=dspark, tiles=tiles,
                        scan_layers=spec.scan_layers, dense_format=dense_format, dense_impl=impl,
                        gemm_inputs=spec.gemm_inputs)


def build(inputs: ModelInputs, spec: RunSpec):
    """(model, mesh | None) for the spec's world: the weights placed tensor by tensor (sharded for a world > 1),
    or drawn on the devices (`device_model`)."""
    # The loader, the sharded loader and the device-drawn weights bring JAX.
    import sharding  # noqa: PLC0415 - brings JAX (see above)

    from .loading import build_model  # noqa: PLC0415 - brings JAX (see above)

    options = model_options(spec, inputs.expert_format, inputs.vision, inputs.engram_tables, inputs.dspark,
                            dense_format=inputs.dense_format)
    if inputs.on_device:
        return device_model(inputs.cfg, spec, options)
    if spec.world == 1:
        return build_model(inputs.cfg, options, inputs.weights), None
    return sharding.prepare(inputs.cfg, inputs.weights, spec.world, options)


def device_model(cfg: ModelConfig, spec: RunSpec, options=None, *, abstract: bool = False):
    """(ShardedTransformer, mesh): ``cfg`` (a cut the caller made: profile's, a benchmark's) with random weights
    drawn on the spec's ``world`` devices, already sharded (`profiling.build`); ``abstract``: shapes and
    shardings only. ``options`` default: `model_options(spec)`."""
    from .profiling import build as device_build  # noqa: PLC0415 - brings JAX

    return device_build.build_model(cfg, spec.world, options or model_options(spec), abstract=abstract)


def tokenizer(spec: RunSpec):
    """(tokenizer, description): the checkpoint's tokenizer.json when it has one, else the packaged one."""
    return load_tokenizer(spec.checkpoint)


def segment_plan(cfg, spec: RunSpec, segment_rows: int | None = None):
    """The prefill segments of a prompt length: the planner's for the spec's world, or fixed ``segment_rows``."""
    from .engine import fixed_segments, planned_segments  # noqa: PLC0415 - brings JAX

    if segment_rows:
        return lambda n: fixed_segments(n, segment_rows)
    return planned_segments(cfg, spec.world)

