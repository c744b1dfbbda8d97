"""The engine thread: the one thread that owns the devices and runs `SlotEngine.step` in a loop.

The HTTP side (asyncio) hands requests over with `Worker.submit` and gets each request's events on an
``asyncio.Queue`` (put from this thread with ``loop.call_soon_threadsafe``); `Worker.cancel` stops one. The queue
bound: at most ``slots + max_queue`` requests in flight; `submit` raises `QueueFull` past it (the server's 503).

Draining (the server's shutdown): `drain` makes `submit` raise `ShuttingDown` from then on, `wait_idle` waits for
what is in flight to finish, and `abort` ends what is left: each request gets a ``("shutdown", message)`` event.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
import traceback

from ..engine import Request
from .slots import Job, SlotEngine


class QueueFull(RuntimeError):
    """Every slot is taken and ``max_queue`` requests already wait."""


class ShuttingDown(RuntimeError):
    """The server is draining: it takes no new requests."""


class Worker:
    def __init__(self, slots: SlotEngine, max_queue: int, on_token=None):
        self.slots = slots
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", Job) | ("cancel", id)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._on_token = on_token  # metrics hook, called on this thread
        self._thread = threading.Thread(target=self._loop, name="dsv41-engine", daemon=True)
        self._stop = threading.Event()
        self._draining = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the engine thread after its current step (requests still held get no more events)."""
        self._stop.set()
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Take no new requests (`submit` raises `ShuttingDown`); those in flight go on. Safe in a signal handler:
        one store, no lock (the handler may interrupt `submit` while it holds the lock)."""
        self._draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every request in flight to end; True when none is left. Takes the
        submit lock once first: a `submit` that passed the draining check before `drain` is counted by then."""
        with self._lock:
            pass
        deadline = time.monotonic() + timeout
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._in_flight

    def abort(self, message: str) -> None:
        """End every request in flight with a ``("shutdown", message)`` event (at the engine's next step)."""
        self._inbox.put(("abort", message))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return max(0, self._in_flight - self.slots.slots)

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop, *, logprobs: int | None = None,
               stop_ids=(), constraint=None) -> tuple[int, asyncio.Queue]:
        """Queue ``request`` (already checked by the caller; ``logprobs``, ``stop_ids``, ``constraint``: its
        `Job`'s); (job id,
        its event queue). QueueFull past the bound."""
        with self._lock:
            if self._draining:
                raise ShuttingDown("the server is shutting down: it takes no new requests")
            if self._in_flight >= self.slots.slots + self.max_queue:
                raise QueueFull(f"the server is busy: {self.slots.slots} requests running and {self.max_queue} "
                                f"waiting; retry later")
            self._in_flight += 1
        events: asyncio.Queue = asyncio.Queue()
        job_id = next(self._ids)

        def sink(kind, value):
            if kind in ("done", "error", "shutdown"):  # its last event
                with self._lock:
                    self._in_flight -= 1
            elif kind == "token" and self._on_token is not None:
                self._on_token()
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        self._inbox.put(("add", Job(job_id, request, sink, logprobs, frozenset(stop_ids), constraint=constraint)))
        return job_id, events

    def cancel(self, job_id: int) -> None:
        self._inbox.put(("cancel", job_id))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "add":
                try:
                    self.slots.add(value)
                except Exception as e:  # noqa: BLE001 - refused by the engine: the request's error, not ours
                    value.sink("error", str(e))
            elif kind == "abort":
                self._reset(value, "shutdown")
            else:
                self.slots.cancel(value)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.slots.busy)
                self.slots.step()
            except Exception:  # noqa: BLE001 - a failed step fails its requests, never the server
                traceback.print_exc(file=sys.stderr)
                self._reset("the engine failed on this request (see the server log)")

    def _reset(self, message: str, kind: str = "error") -> None:
        """End every request the slot engine holds with a ``kind`` event and start it afresh (after a failed
        step its donated buffers may be gone); the program table is the engine's, so nothing recompiles."""
        old = self.slots
        for job in [*old.waiting, *old.prefilling, *old.running]:
            if job is not None and not job.finished:
                job.sink(kind, message)
                job.finished = True  # one end event a request, even if this reset is retried
        old.release()  # its cache goes before the new one is made: two would not fit a cache-sized memory
        self.slots = old.fresh()  # its kind (serve.lockstep's too), settings and prefix cache
