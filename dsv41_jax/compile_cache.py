"""The persistent compilation cache for the CLIs: a second run of the same command loads its compiled programs
from disk instead of tracing and compiling them again (the 40-layer model compiles for tens of seconds). The
entries are whole executables (`compiler.compile`'s store, under ``<dir>/executables``).

On by default in ``generate`` and ``profile``; the directory is ``--compile-cache DIR`` (``off`` to disable), else
``$DSV41_JAX_COMPILE_CACHE`` (``off`` too), else ``$XDG_CACHE_HOME/dsv41_jax/xla`` (``~/.cache/...``). Entries are
keyed on the program, its arguments and shardings, the project's source, the jax/jaxlib/flax versions and jax's
configuration, the devices, the compile options and XLA_FLAGS (`compiler`), so a stale entry is never used for a
different program.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "DSV41_JAX_COMPILE_CACHE"
OFF = "off"


class CompileCacheError(ValueError):
    """An explicitly requested cache directory that cannot be used (a user mistake: one line, exit 2)."""


def default_dir() -> str:
    """The directory used when no ``--compile-cache`` is given: the environment's choice or the user cache."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "dsv41_jax" / "xla")


def enable(directory: str | None = None) -> Path | None:
    """Point JAX's persistent cache at ``directory`` (default ``default_dir()``); returns it, or None when off.

    An explicit directory that cannot be created or written raises ``CompileCacheError``; the default one
    failing only turns the cache off (a read-only home must not stop a run)."""
    explicit = directory is not None
    directory = default_dir() if directory is None else directory
    if directory == OFF:
        return None
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        if explicit:
            raise CompileCacheError(f"--compile-cache {directory}: {e}") from None
        return None

    # the CLIs import this module (its error) before they set XLA's flags: JAX is imported only here
    import jax  # noqa: PLC0415 - see above
    from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache  # noqa: PLC0415

    from . import compiler  # noqa: PLC0415 - brings JAX

    compiler.use_store(path / compiler.STORE_DIR)
    # JAX's own cache stays off: an executable it loads does not serialize back whole on XLA:CPU (jax 0.10.2:
    # the stored copy fails at dispatch, "Function wrapped_iota not found"), and the store needs no trace.
    # reset_cache: JAX decides once per process whether its cache is used; make it decide again.
    jax.config.update("jax_enable_compilation_cache", False)
    jax_compilation_cache.reset_cache()
    return path
