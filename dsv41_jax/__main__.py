"""``python -m dsv41_jax`` is ``python -m dsv41_jax.generate``."""

import sys

from dsv41_jax.generate import main

sys.exit(main())
