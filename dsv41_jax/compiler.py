"""The one place the engine's programs (and `profile`'s) are compiled: the XLA options, and the executable
store that lets a second run skip tracing and compiling altogether.

**Options.** On a GPU, XLA's Triton GEMM fusions are off: XLA then autotunes only among cuBLAS's algorithms instead
of compiling and timing dozens of Triton tilings per GEMM shape: a prefill compiles several times faster and runs as
fast (docs/BENCHMARKS.md "Compile time"). ``--xla_gpu_autotune_level=0`` compiles as fast but its untuned Triton
GEMMs run much slower. XLA's dot merger merges only dots of which one moves less than 4 MB (its default: 32 MB):
with 32 it joined products that share an input but whose weights are larger (the shared expert's ``w1``/``w3``;
``wq_a``/``wkv``; ``wq_b`` with the indexer's query projection), which at 2+ rows are cuBLAS GEMMs, so every step
first copied both weights into one (docs/BENCHMARKS.md "The dot merger's threshold"); a single row's products are
reductions that read both weights in one fusion without a copy. An option that ``XLA_FLAGS`` names is the user's:
the value here gives way to it. (Options XLA reads only from ``XLA_FLAGS``, not per compile, are set on import of
the package: `dsv41_jax.RUNTIME_FLAGS`.)

**Executable store** (the persistent cache, `compile_cache`). JAX's own persistent cache still traces and lowers a
program to find its entry, seconds for the 40-layer model's step before the load. When the cache is on, `compile`
keeps each compiled executable under ``<cache dir>/executables/`` (`jax.experimental.serialize_executable`), keyed
by everything the executable depends on: the caller's identity of the program (its name and the model's graph
definition), its static arguments, the abstract arguments with their shardings and devices, the source of this
project's packages, the jax/jaxlib/flax versions and jax's configuration, the backend, the compile options and
``XLA_FLAGS``; a loaded executable whose argument tree is not the call's is compiled again. A hit deserializes the
executable without tracing. A file that cannot be read or loaded is compiled again and rewritten; a store that
cannot be written is skipped (the cache is an optimisation, never a reason to fail a run).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import threading
import time
from pathlib import Path

import flax
import jax
import jaxlib
from jax.api_util import shaped_abstractify
from jax.experimental import serialize_executable

from dsv41_jax import flags_named

GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 4}
STORE_DIR = "executables"
# The store keeps at most this many bytes: the least recently used entries go first (a 40-layer step is 6-8 MB;
# every edit of the source makes new entries).
STORE_MAX_BYTES = 4 << 30
_PACKAGES = ("dsv41_jax", "sharding", "pallas_kernels")
_ROOT = Path(__file__).resolve().parent.parent


# JAX's persistent cache is off while the store is on (`compile_cache.enable`), but it may have been on before (a
# test session's shared cache, a user's JAX_COMPILATION_CACHE_DIR): an executable it loaded does not serialize
# back whole on XLA:CPU, so one compiled from its cache is run but never stored. JAX reports each of its hits as
# an event in the compiling thread.
_from_jax_cache = threading.local()


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _from_jax_cache.hit = True


jax.monitoring.register_event_listener(_on_event)


def options(platform: str | None = None) -> dict:
    """The compile options for ``platform`` (default: the default backend's), for ``Lowered.compile``."""
    platform = platform or jax.default_backend()
    if platform not in ("gpu", "cuda", "rocm"):
        return {}
    named = flags_named(os.environ.get("XLA_FLAGS", ""))
    return {name: value for name, value in GPU_OPTIONS.items() if name not in named}


def compile(jitted, args: tuple, static: dict | None = None, *, identity: str, extra_options: dict | None = None,
            timings: dict | None = None):
    """``jitted.lower(*args, **static).compile(options)``, or the same executable from the store.

    ``jitted``: a ``jax.jit`` of the program (donation and shardings set); ``identity``: what names the program
    beyond its arguments (its name, the graph definition it closes over, its out shardings). Returns
    (a ``jax.stages.Compiled``, whether it came from the store). ``timings``: a dict given the seconds of
    ``lower_s`` (trace + lower) and ``compile_s`` (XLA), or ``load_s`` for a program from the store."""
    clock = time.perf_counter()
    static = static or {}
    compile_options = {**options(), **(extra_options or {})}
    path = _store_path(identity, args, static, compile_options)
    if path is not None and path.exists():
        loaded = _load(path)
        if loaded is not None and loaded.in_tree == jax.tree.structure((tuple(args), {})):  # else: recompile
            if timings is not None:
                timings["load_s"] = time.perf_counter() - clock
            return loaded, True
    lowered = jitted.lower(*args, **static)
    lowered_at = time.perf_counter()
    _from_jax_cache.hit = False
    compiled = lowered.compile(compile_options)
    if timings is not None:
        timings.update(lower_s=lowered_at - clock, compile_s=time.perf_counter() - lowered_at)
    if path is not None and not _from_jax_cache.hit:
        _save(path, compiled)
    return compiled, False


def compiling_note(what: str) -> str:
    """The one line a CLI says before it compiles ``what``: why it can take long, and where the programs are kept."""
    store = store_dir()
    kept = (f"they are kept in {store.parent}, and later runs load them in seconds" if store is not None else
            "the compile cache is off, so every run compiles them again")
    return (f"compiling {what}: the first run of these shapes compiles each program with XLA (seconds each; "
            f"minutes for a large model on a CPU); {kept}")


def graph_digest(graphdef) -> str:
    """A digest of an NNX graph definition (its repr is deterministic: types, static attributes, the config)."""
    return hashlib.sha256(repr(graphdef).encode()).hexdigest()


_store: list[Path | None] = [None]


def use_store(directory: Path | None) -> None:
    """Keep executables under ``directory`` (None: no store). `compile_cache.enable` calls this."""
    _store[0] = directory


def store_dir() -> Path | None:
    return _store[0]


def _store_path(identity: str, args: tuple, static: dict, compile_options: dict) -> Path | None:
    directory = store_dir()
    if directory is None:
        return None
    parts = (identity, _static_key(static), _signature(args), source_digest(), _environment(),
             repr(sorted(compile_options.items())))
    if any(" at 0x" in part for part in parts):  # a repr with an address differs every run: never a hit
        return None
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return directory / f"{h.hexdigest()}.exe"


def _static_key(static: dict) -> str:
    """Static arguments by value; a module-level function by its qualified name (the source digest covers its
    body). A closure, lambda, partial or bound method keeps its repr, whose address makes the program unstored."""
    def name(value):
        qualname = getattr(value, "__qualname__", "")
        if (callable(value) and qualname and "<" not in qualname and not getattr(value, "__closure__", None)
                and not hasattr(value, "__self__")):
            return f"{value.__module__}.{qualname}"
        return repr(value)
    return repr(sorted((k, name(v)) for k, v in static.items()))


def _signature(args: tuple) -> str:
    """Tree structure, then each leaf's aval (shape, dtype, weak type), sharding and device ids."""
    leaves, treedef = jax.tree.flatten(args)
    parts = [str(treedef)]
    for x in leaves:
        aval = shaped_abstractify(x)
        sharding = getattr(x, "sharding", None)
        devices = getattr(getattr(sharding, "mesh", None), "devices", None)
        ids = [d.id for d in devices.flat] if devices is not None else sorted(
            d.id for d in getattr(sharding, "device_set", ()))
        parts.append(f"{aval.str_short()}|{aval.weak_type}|{sharding!r}|{ids}")
    return "\n".join(parts)


@functools.cache
def source_digest() -> str:
    """A digest of every ``.py`` file of the project's packages (an executable is stale once any changes)."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _environment() -> str:
    devices = jax.devices()
    return (f"jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__} {jax.default_backend()} "
            f"{[(d.id, d.device_kind) for d in devices]} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')} "
            f"{sorted(jax.config.values.items())}")  # e.g. jax_default_matmul_precision changes the program


def _load(path: Path):
    try:
        serialized, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
        by_id = {d.id: d for d in jax.devices()}
        loaded = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                           execution_devices=[by_id[i] for i in device_ids])
        os.utime(path)  # recently used: pruned last
        return loaded
    except Exception:  # noqa: BLE001 - a stale or damaged entry is compiled again and rewritten
        return None


def _save(path: Path, compiled) -> None:
    """The executable, its pytrees and the ids of the devices it runs on, in order (a program without
    arguments runs on one device, not on all of the backend's, which is what loading assumes otherwise)."""
    try:
        device_ids = [d.id for d in compiled._executable._unloaded_executable.device_list]
        blob = pickle.dumps((*serialize_executable.serialize(compiled), device_ids))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{time.monotonic_ns()}.tmp")
        tmp.write_bytes(blob)
        tmp.replace(path)
        _prune(path.parent, STORE_MAX_BYTES)
    except Exception:  # noqa: BLE001 - e.g. a full disk, or an executable the backend cannot serialize
        return


def _prune(directory: Path, max_bytes: int) -> None:
    """Delete the least recently used entries until the store holds at most ``max_bytes``."""
    stats = [(path.stat(), path) for path in directory.glob("*.exe")]
    total = 0
    for stat, path in sorted(stats, key=lambda sp: sp[0].st_mtime, reverse=True):
        total += stat.st_size
        if total > max_bytes:
            path.unlink(missing_ok=True)
