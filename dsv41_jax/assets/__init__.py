"""Files shipped inside the package. ``bard/``: the embedded trained model, a release-format checkpoint of
``configs/bard.json`` (docs/TRAINING.md; made by ``python -m dsv41_jax.train``)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

EMBEDDED_MODEL = "bard"


def embedded_checkpoint() -> Path:
    """The directory of the embedded trained model's checkpoint (inside the installed package)."""
    return Path(str(importlib.resources.files("dsv41_jax") / "assets" / EMBEDDED_MODEL))
