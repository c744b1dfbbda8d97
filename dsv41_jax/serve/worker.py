"""The engine thread: the one thread that owns the devices and runs `SlotEngine.step` in a loop.

The HTTP side (asyncio) hands requests over with `Worker.submit` and gets each request's events on an
``asyncio.Queue`` (put from this thread with ``loop.call_soon_threadsafe``); `Worker.cancel` stops one. The queue
bound: at most ``slots + max_queue`` requests in flight; `submit` raises `QueueFull` past it (the server's 503).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import traceback

from ..engine import Request
from .slots import Job, SlotEngine


class QueueFull(RuntimeError):
    """Every slot is taken and ``max_queue`` requests already wait."""


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
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return max(0, self._in_flight - self.slots.slots)

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Queue]:
        """Queue ``request`` (already checked by the caller); (job id, its event queue). QueueFull past the bound."""
        with self._lock:
            if self._in_flight >= self.slots.slots + self.max_queue:
                raise QueueFull(f"the server is busy: {self.slots.slots} requests running and {self.max_queue} "
                                f"waiting; retry later")
            self._in_flight += 1
        events: asyncio.Queue = asyncio.Queue()
        job_id = next(self._ids)

        def sink(kind, value):
            if kind != "token":
                with self._lock:
                    self._in_flight -= 1
            elif self._on_token is not None:
                self._on_token()
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        self._inbox.put(("add", Job(job_id, request, sink)))
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
            else:
                self.slots.cancel(value)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.slots.busy)
            try:
                self.slots.step()
            except Exception:  # noqa: BLE001 - a failed step fails its requests, never the server
                traceback.print_exc(file=sys.stderr)
                self._reset("the engine failed on this request (see the server log)")

    def _reset(self, message: str) -> None:
        """Fail every request the slot engine holds and start it afresh (its donated buffers may be gone);
        the program table is the engine's, so nothing recompiles."""
        old = self.slots
        for job in [*old.waiting, *old.prefilling, *old.running]:
            if job is not None:
                job.sink("error", message)
        self.slots = SlotEngine(old.engine, old.slots, old.short_rows)
