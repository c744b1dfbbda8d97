"""The server over several processes: process 0 serves HTTP and schedules; the others follow its slot engine.

Process 0's engine thread (`worker.Worker`) is the only caller of its slot engine, a `LeaderSlots`: each
``add`` and ``cancel`` is noted, and before each ``step`` the notes go to every other process
(`distributed.share`), which makes the same calls on its own `SlotEngine` (`follow`) and then steps too. A reset
(``release``, then a new slot engine: a failed step, the drain's end) is sent at once, since the new engine's
first program (its empty cache) runs on every process. So every process runs the same programs in the same order;
what the steps decide on the host afterwards (admissions, finished requests) comes from replicated device outputs,
the same everywhere. An idle server still steps (the worker's loop wakes every half second), so the followers
hear from process 0 at least that often. `stop_followers` ends them when the server stops.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import traceback

from .. import distributed
from ..engine import Request
from ..sampling import SamplingParams
from .slots import Job, SlotEngine


class Channel:
    """What process 0's slot engines noted since the last step (a reset makes a new engine: the channel stays)."""

    def __init__(self):
        self.notes: list = []
        self.lock = threading.Lock()  # a step (its notes sent, then run) against `stop_followers`
        self.stopped = False

    def send(self, *last) -> None:
        notes, self.notes = [*self.notes, *last], []
        distributed.share(notes)


class LeaderSlots(SlotEngine):
    """Process 0's slot engine: as `SlotEngine`, its calls noted on ``channel`` (set once by the server's setup)
    and sent to the followers before each step."""

    channel: Channel | None = None

    def add(self, job: Job) -> None:
        self.channel.notes.append(["add", job.id, _job_json(job)])
        super().add(job)

    def cancel(self, job_id: int) -> None:
        self.channel.notes.append(["cancel", job_id])
        super().cancel(job_id)

    def release(self) -> None:
        with self.channel.lock:
            if not self.channel.stopped:
                self.channel.send(["reset"])
        super().release()

    def step(self) -> None:
        with self.channel.lock:
            if self.channel.stopped:
                return
            self.channel.send()
            super().step()


def stop_followers(channel: Channel) -> None:
    """Tell the followers the server stopped (after its last step); process 0's slot engine steps no more."""
    with channel.lock:
        if not channel.stopped:
            channel.send(["stop"])
            channel.stopped = True


def follow(slots: SlotEngine) -> None:
    """A follower's loop: process 0's notes, the same calls, one step; until process 0 says stop."""
    while True:
        for note in distributed.share(None):
            kind = note[0]
            if kind == "stop":
                return
            if kind == "add":
                try:
                    slots.add(_job(note[1], note[2]))
                except Exception:  # noqa: BLE001 - refused on process 0 as well, which answers the client
                    pass
            elif kind == "cancel":
                slots.cancel(note[1])
            elif kind == "reset":
                slots.release()
                slots = slots.fresh()
        try:
            slots.step()
        except Exception:  # noqa: BLE001 - process 0's step failed as well: its reset follows
            traceback.print_exc(file=sys.stderr)


def _no_events(kind, value) -> None:
    """A follower's requests answer nobody (process 0 answers the client)."""


def _job_json(job: Job) -> dict:
    """What a follower needs of a job to run the same programs: its request and what of the job picks the step
    variant or ends it on the host (log-probs, stop ids)."""
    request = job.request
    if request.images is not None:
        raise ValueError("image prompts are not served over several processes")
    return {"prompt_ids": list(request.prompt_ids), "max_new_tokens": request.max_new_tokens,
            "sampling": dataclasses.asdict(request.sampling), "logprobs": job.logprobs,
            "stop_ids": sorted(job.stop_ids)}


def _job(job_id: int, obj: dict) -> Job:
    """`_job_json`'s job back (JSON's lists made tuples again, as `SamplingParams` holds them)."""
    sampling = {k: _tuples(v) for k, v in obj["sampling"].items()}
    request = Request(tuple(obj["prompt_ids"]), obj["max_new_tokens"], SamplingParams(**sampling))
    return Job(job_id, request, _no_events, obj["logprobs"], frozenset(obj["stop_ids"]))


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
