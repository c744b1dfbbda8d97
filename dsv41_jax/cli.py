"""What the command-line programs share: the one-line argument errors, argparse types, the user-error mapping and
the entry wrapper (``cli_main``: exit status 2 and one line on stderr for a user mistake, 130 on Ctrl-C).

Imports no JAX at import time: a command parses and checks its arguments (and asks for simulated devices)
before JAX starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from .compile_cache import CompileCacheError
from .config import ConfigError
from .planner import PlanRefused
from .textfile import TextFileError
from .tokenizer import TokenizerError
from .vision.preprocess import ImageError
from .xla_log import hide_slow_compile_banners


class UsageError(ValueError):
    """A user mistake: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """Argument mistakes print one line and exit 2, not argparse's usage block."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


_quiet = [False]  # a follower of several processes: `say` prints nothing


def say(message: str) -> None:
    """One line on stderr (announcements, notes); nothing once `quiet`."""
    if not _quiet[0]:
        print(message, file=sys.stderr, flush=True)


def quiet() -> None:
    """From now on `say` prints nothing and stdout goes nowhere: a process that follows another's run (several
    processes: process 0 prints). Errors still print (`cli_main`)."""
    _quiet[0] = True
    sys.stdout = open(os.devnull, "w")  # for the rest of the process


def quieted() -> bool:
    return _quiet[0]


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (one line, exit 2)."""
    # Each of these brings JAX: imported once the command line is parsed, so a bad flag is refused at once.
    from sharding.mesh import ShardingError  # noqa: PLC0415 - brings JAX (see above)

    from .checkpoint import CheckpointError  # noqa: PLC0415 - brings JAX (see above)
    from .engine import EngineInputError  # noqa: PLC0415 - brings JAX (see above)
    from .engram import EngramError  # noqa: PLC0415 - brings JAX (see above)
    from .model.transformer import WeightsError  # noqa: PLC0415 - brings JAX (see above)
    from .sampling import SamplingError  # noqa: PLC0415 - brings JAX (see above)

    return (UsageError, ConfigError, EngineInputError, SamplingError, TokenizerError, CompileCacheError,
            TextFileError, CheckpointError, PlanRefused, ImageError, EngramError, WeightsError, ShardingError)


def cli_main(parser, run_args, argv: Sequence[str] | None, interrupted: str | None = "interrupted",
             local_devices: Callable[[argparse.Namespace], int] = lambda args: args.world) -> int:
    """A command's entry (generate, serve): parse ``argv``, ask for ``local_devices(args)`` simulated devices
    (default ``--world``; `UsageError` allowed), ``run_args(args)``; returns the exit status (2 for bad input,
    with one line on stderr; 130 on Ctrl-C, saying ``interrupted``). ``argv`` None (this process's own command
    line): XLA's slow-compile banners are kept off its stderr (`xla_log`)."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or an argument error (2, one line already printed)
        return int(e.code or 0)
    if argv is None:  # after parsing: --help and a bad flag start no filter process
        hide_slow_compile_banners()
    try:
        devices = local_devices(args)
        if devices > 1:  # CPU: simulated devices, only effective before JAX initialises (sharding.mesh)
            from sharding.mesh import request_host_devices  # noqa: PLC0415 - brings JAX: only when asked for

            request_host_devices(devices)
        return run_args(args)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr, flush=True)  # a follower's too (`quiet`)
        return 2
    except KeyboardInterrupt:
        if interrupted:
            say(interrupted)
        return 130
