"""Test-session setup: eight simulated CPU devices, set before JAX initialises.

Single-device code places on device 0 as usual; multi-device tests build meshes over the first N devices.
"""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
