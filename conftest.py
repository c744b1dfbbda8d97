"""Test-session setup (repo root, so it runs before any test module imports JAX).

* Eight simulated CPU devices, set before JAX initialises: single-device code places on device 0 as
  usual; multi-device tests build meshes over the first N devices.
* The CLIs' persistent compilation cache off unless a test asks for it (no writes to the user's cache).
* ``tests/`` on ``sys.path`` so helpers such as ``mlx_oracle`` import from any test folder.
"""

import os
import sys
from pathlib import Path

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("DSV41_JAX_COMPILE_CACHE", "off")  # tests compile afresh; test_compile_cache turns it on

_tests = str(Path(__file__).resolve().parent / "tests")
if _tests not in sys.path:
    sys.path.insert(0, _tests)
