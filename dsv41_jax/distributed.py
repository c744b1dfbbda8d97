"""Several processes, one mesh: JAX's distributed runtime under the commands.

``--coordinator HOST:PORT --num-processes N --process-id I`` (the arguments of ``jax.distributed.initialize``;
``--coordinator auto``: the cluster's, as JAX detects SLURM, Open MPI and the like) start one process a host (or
a GPU); ``--world`` then counts the devices of every process, each giving ``world / N``. Contract:

- `initialize` joins the processes before JAX starts its backends (collectives: NCCL on GPUs, gloo on CPUs). When
  a process does not join within ``--peer-timeout`` seconds, those waiting for it end with one error line; a peer
  that dies later is noticed by the runtime's heartbeats within that time and ends the others (JAX's own message).
  From then on file descriptor 1 is stderr and only Python's ``sys.stdout`` writes to the real stdout (the
  collectives' libraries print set-up lines there).
- `agree` checks that every process runs the same command line (but ``--process-id``) on the same model files:
  a mismatch is the same `UsageError` on every process.
- `share` / `decide_once` give every process process 0's value: the host-side decisions a run makes from its
  inputs (the tokenized prompts) are made there once; the rest of the command line is the same everywhere
  (`agree`). What the engine decides on the host afterwards comes from replicated device outputs, the same bytes
  on every device; a host input that still differs between processes is refused by JAX when it is placed
  (``jax.device_put`` checks that every process passes the same value).
- `is_leader`: process 0 prints and serves; the others print nothing but errors (`cli.quiet`).

Imports no JAX at import time: the commands check their arguments before JAX starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .cli import UsageError, positive_int

AUTO = "auto"
DEFAULT_PEER_TIMEOUT_S = 120


class DistributedError(UsageError):
    """The processes could not form their mesh (the coordinator unreachable, a cluster not detected)."""


@dataclass(frozen=True)
class Processes:
    """The processes of a run: ``coordinator`` "HOST:PORT" of process 0's coordination service, "auto" (the
    cluster's) or None (one process); ``count`` and ``index`` as ``jax.distributed.initialize`` takes them
    (with "auto" the cluster's, known after `initialize`); ``timeout_s``: how long a process waits for its peers
    to join, and for a silent peer before the runtime ends the run."""

    coordinator: str | None = None
    count: int = 1
    index: int = 0
    timeout_s: int = DEFAULT_PEER_TIMEOUT_S

    @property
    def several(self) -> bool:
        return self.coordinator is not None


ONE_PROCESS = Processes()


def add_process_args(parser: argparse.ArgumentParser) -> None:
    """``--coordinator``, ``--num-processes``, ``--process-id``, ``--peer-timeout`` in their own group."""
    group = parser.add_argument_group("several processes (one mesh over hosts)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0's host and a free port every process can reach: start one process a host "
                            "with the same flags and its own --process-id; --world is then the devices of every "
                            "process together. 'auto': the cluster's (SLURM, Open MPI, ... as JAX detects them)")
    group.add_argument("--num-processes", type=positive_int, metavar="N", help="processes in all (with --coordinator)")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (0 prints and serves)")
    group.add_argument("--peer-timeout", type=positive_int, metavar="S",
                       help=f"seconds to wait for every process to join, and for a peer that stopped answering, "
                            f"before ending with an error (default {DEFAULT_PEER_TIMEOUT_S})")


def from_args(args: argparse.Namespace) -> Processes:
    """The `Processes` of a parsed command line; `UsageError` for flags that do not make one."""
    coordinator, count, index = args.coordinator, args.num_processes, args.process_id
    timeout = args.peer_timeout or DEFAULT_PEER_TIMEOUT_S
    if coordinator is None:
        given = [f for f, v in (("--num-processes", count), ("--process-id", index),
                                ("--peer-timeout", args.peer_timeout)) if v is not None]
        if given:
            raise UsageError(f"{given[0]} goes with --coordinator HOST:PORT (several processes)")
        return ONE_PROCESS
    if coordinator == AUTO:
        given = [f for f, v in (("--num-processes", count), ("--process-id", index)) if v is not None]
        if given:
            raise UsageError(f"--coordinator auto takes the processes from the cluster: drop {given[0]}")
        return Processes(AUTO, 1, 0, timeout)
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--coordinator {coordinator!r}: give HOST:PORT (a port in 1..65535), or auto")
    if count is None or index is None:
        raise UsageError("--coordinator HOST:PORT needs --num-processes N and --process-id I")
    if not 0 <= index < count:
        raise UsageError(f"--process-id must be in 0..{count - 1} (--num-processes {count}), got {index}")
    if args.world % count:
        raise UsageError(f"--world {args.world} over --num-processes {count}: each process gives the same number "
                         f"of devices, so --world must be a multiple of {count}")
    return Processes(coordinator, count, index, timeout)


def local_devices(world: int, processes: Processes) -> int:
    """The devices this process gives to a world of ``world``."""
    return world // processes.count


# ------------------------------------------------------------------------------------------------ joining
def initialize(processes: Processes) -> None:
    """Join the other processes (nothing for one process). Before JAX starts its backends."""
    if not processes.several:
        return
    import jax  # noqa: PLC0415 - JAX starts here, after the command line is checked

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _stdout_for_python_only()
    where = "the cluster's coordinator" if processes.coordinator == AUTO else f"the coordinator {processes.coordinator}"
    watchdog = threading.Timer(processes.timeout_s, _not_joined, (processes, where))
    watchdog.daemon = True
    watchdog.start()
    # JAX's own deadline is later than the watchdog's: its expiry aborts the process with a stack trace.
    timeouts = {"initialization_timeout": processes.timeout_s + 60, "heartbeat_timeout_seconds": processes.timeout_s,
                "shutdown_timeout_seconds": processes.timeout_s}
    try:
        if processes.coordinator == AUTO:
            jax.distributed.initialize(**timeouts)
        else:
            jax.distributed.initialize(processes.coordinator, processes.count, processes.index, **timeouts)
    except (RuntimeError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if processes.coordinator == AUTO:
            raise DistributedError(f"--coordinator auto: JAX found no cluster to join ({reason}); give --coordinator "
                                   f"HOST:PORT --num-processes N --process-id I") from None
        raise DistributedError(f"cannot join {where}: {reason}") from None
    finally:
        watchdog.cancel()


def _stdout_for_python_only() -> None:
    """The collectives' libraries print set-up lines on file descriptor 1 (gloo: "connected to N peer ranks"):
    from now on it is stderr, and Python's ``sys.stdout`` alone writes to the real stdout (``--json`` stays one
    JSON object)."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = open(real, "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors,
                      buffering=1 if os.isatty(real) else -1)


def _not_joined(processes: Processes, where: str) -> None:
    """The watchdog's end of a process whose peers did not all join in time: one line, exit status 1."""
    print(f"error: process {processes.index}: not every process joined {where} within {processes.timeout_s} s "
          f"(--peer-timeout): start all --num-processes {processes.count} with the same --coordinator, and let "
          f"every host reach its port", file=sys.stderr, flush=True)
    os._exit(1)


def is_leader() -> bool:
    """Whether this process prints and serves (process 0, or the only one)."""
    import jax  # noqa: PLC0415 - after `initialize`

    return jax.process_index() == 0


def several() -> bool:
    import jax  # noqa: PLC0415 - after `initialize`

    return jax.process_count() > 1


# ------------------------------------------------------------------------------------------------ agreeing
def agree(fingerprint: str, what: str = "command line or model files",
          hint: str = "start every process with the same flags (but --process-id) and the same model files") -> None:
    """`UsageError` on every process unless every process passed the same ``fingerprint`` (``what`` it holds)."""
    if not several():
        return
    import jax  # noqa: PLC0415 - after `initialize`
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415

    digest = np.frombuffer(hashlib.sha256(fingerprint.encode()).digest(), np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(digest)).reshape(jax.process_count(), -1)
    differ = [i for i in range(len(everyone)) if not np.array_equal(everyone[i], everyone[0])]
    if differ:
        who = f"process{'es' if len(differ) > 1 else ''} {', '.join(map(str, differ))} of {len(everyone)}"
        raise UsageError(f"{who}: a different {what} than process 0's: {hint}")


def decide_once(decide: Callable[[], object]):
    """``decide()`` (JSON-able) made on process 0 and shared (`share`); its user error, raised there, is raised on
    every process (the same line)."""
    if not several():
        return decide()
    from .cli import user_errors  # noqa: PLC0415 - brings JAX

    value, error = None, None
    if is_leader():
        try:
            value = decide()
        except user_errors() as e:
            error = e
    shared = share({"value": value, "error": None if error is None else str(error)})
    if error is not None:
        raise error
    if shared["error"] is not None:
        raise UsageError(shared["error"])
    return shared["value"]


def run_fingerprint(args: argparse.Namespace, skip: tuple[str, ...] = ("process_id", "compile_cache")) -> str:
    """A command line's flags (but ``skip``: what may differ between processes) and the model files it names
    (a checkpoint folder's file names, sizes and config.json; a config file's text)."""
    flags = {k: v for k, v in sorted(vars(args).items()) if k not in skip}
    parts = [json.dumps(flags, default=_plain, sort_keys=True)]
    checkpoint, config = getattr(args, "checkpoint", None), getattr(args, "config", None)
    if checkpoint and Path(checkpoint).is_dir():
        for path in sorted(Path(checkpoint).iterdir()):
            if path.is_file():
                parts.append(f"{path.name} {path.stat().st_size}")
        if (Path(checkpoint) / "config.json").is_file():
            parts.append((Path(checkpoint) / "config.json").read_text(errors="replace"))
    if config and Path(config).is_file():
        parts.append(Path(config).read_text(errors="replace"))
    return "\n".join(parts)


def _plain(value):
    """A flag's value as JSON takes it, the same in every process (a set's order is its process's hash seed's)."""
    return sorted(map(repr, value)) if isinstance(value, (set, frozenset)) else repr(value)


def share(value):
    """Process 0's ``value`` (JSON-able) on every process; the value itself with one process."""
    if not several():
        return value
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415

    blob = json.dumps(value).encode() if is_leader() else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(blob))))
    padded = np.zeros(1 << max(6, (size - 1).bit_length()), np.uint8)  # a power of two: few program shapes
    padded[:len(blob)] = np.frombuffer(blob, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(padded))[:size]
    return json.loads(got.tobytes().decode())


def cache_dir(directory: str | None) -> str | None:
    """The compile cache of one process among several (after `initialize`): a folder of its own under the run's
    (an executable holds the devices of the process that compiled it); "off" stays off."""
    from .compile_cache import OFF, default_dir  # noqa: PLC0415 - JAX-free

    if directory == OFF or not several():
        return directory
    import jax  # noqa: PLC0415 - after `initialize`

    base = default_dir() if directory is None else directory
    if base == OFF:
        return OFF
    return str(Path(base).expanduser() / f"process-{jax.process_index()}-of-{jax.process_count()}")
