"""Prometheus text exposition (format 0.0.4) of the server's counters, gauges and histograms, written here
(a few dozen lines) rather than adding a dependency.

Where a metric means what one of vLLM's means, it has vLLM's name and its ``model_name`` label (dashboards
built for vLLM read it): ``vllm:num_requests_running`` (requests holding a slot), ``vllm:num_requests_waiting``
(queued for one), ``vllm:kv_cache_usage_perc`` (the fraction of the cache's positions, slots x context, holding a
request's tokens), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total{finished_reason}`` (``stop``, ``length``; ``abort``: cancelled, failed or ended by
the drain), and the histograms ``vllm:time_to_first_token_seconds`` (arrival to the first token),
``vllm:inter_token_latency_seconds`` (between consecutive tokens of a request) and
``vllm:e2e_request_latency_seconds`` (arrival to the last token). The server's own: ``dsv41_requests_total``
(every response by endpoint and HTTP status, 4xx and 5xx included), ``dsv41_slots``, ``dsv41_decode_steps``,
``dsv41_programs_compiled``, ``dsv41_compile_events``.

Prefix caching (`serve.prefix`), vLLM's counters in tokens: ``vllm:prefix_cache_queries_total`` (prompt tokens
of the long prompts looked up) and ``vllm:prefix_cache_hits_total`` (of those, the tokens served by a snapshot;
hits / queries is vLLM's hit rate); the server's own ``dsv41_prefix_cache_bytes`` (held by snapshots),
``dsv41_prefix_cache_snapshots`` and ``dsv41_prefill_rows_total`` (prompt tokens computed by long prefills: a hit's
are not); all kept across a reset of the slot engine.
"""

from __future__ import annotations

import bisect
import threading

# vLLM's TTFT and end-to-end buckets, and inter-token buckets from 1 ms (a decode step on a GPU is a few ms)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort")


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Histogram:
    def __init__(self, name: str, help_text: str, buckets, labels: str = ""):
        self.name, self.help, self.buckets, self.labels = name, help_text, tuple(buckets), labels
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        sep = "," if self.labels else ""
        total = 0
        with self._lock:
            counts, value_sum = list(self.counts), self.sum
        for bound, count in zip((*map(str, self.buckets), "+Inf"), counts):
            total += count
            out.append(f'{self.name}_bucket{{{self.labels}{sep}le="{bound}"}} {total}')
        tail = f"{{{self.labels}}}" if self.labels else ""
        return out + [f"{self.name}_sum{tail} {value_sum}", f"{self.name}_count{tail} {total}"]


class Metrics:
    """Responses by endpoint and status, tokens in and out, requests by how they finished, the latency
    histograms; gauges are read at scrape time from callables (``gauges``: name -> (help, callable), vLLM's
    names labelled with ``model_name``)."""

    def __init__(self, gauges: dict, model_name: str = ""):
        self._lock = threading.Lock()
        self.model_label = f'model_name="{_escaped(model_name)}"'
        self.requests: dict[tuple[str, int], int] = {}
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token.", TTFT_BUCKETS, self.model_label)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Seconds between consecutive tokens of a request.",
                             ITL_BUCKETS, self.model_label)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Seconds from a request's arrival to its end (finished requests).", E2E_BUCKETS,
                             self.model_label)
        self.gauges = gauges
        self.counters: dict = {}  # name -> (help, callable), read at scrape time (`server_counters`)

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def request_finished(self, reason: str) -> None:
        """A generation ended: ``stop``, ``length`` or ``abort``."""
        with self._lock:
            self.finished[reason] += 1

    def add_prompt_tokens(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens += n

    def add_generated_token(self) -> None:
        with self._lock:
            self.generated_tokens += 1

    def _labelled(self, name: str) -> str:
        return f"{name}{{{self.model_label}}}" if name.startswith("vllm:") else name

    def render(self) -> str:
        lines = ["# HELP dsv41_requests_total Responses sent, by endpoint and HTTP status.",
                 "# TYPE dsv41_requests_total counter"]
        with self._lock:
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'dsv41_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            lines += ["# HELP vllm:request_success_total Generations ended, by how: stop (an end id or a stop "
                      "string), length, abort (cancelled, failed or ended by the drain).",
                      "# TYPE vllm:request_success_total counter"]
            lines += [f'vllm:request_success_total{{{self.model_label},finished_reason="{reason}"}} {n}'
                      for reason, n in self.finished.items()]
            counters = [("vllm:prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens),
                        ("vllm:generation_tokens_total", "Tokens generated.", self.generated_tokens)]
        counters += [(name, help_text, read()) for name, (help_text, read) in self.counters.items()]
        for name, help_text, value in counters:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{self._labelled(name)} {value}"]
        for name, (help_text, read) in self.gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{self._labelled(name)} {read()}"]
        return "\n".join(lines + self.ttft.lines() + self.itl.lines() + self.e2e.lines()) + "\n"


def server_counters(worker) -> dict:
    """The counters a running server reads from its slot engine (`worker.Worker`) at each scrape: the prefix
    cache's (kept across a reset) and the long prefills' rows."""

    def prefix(name):
        return lambda: getattr(worker.slots.prefix_cache, name, 0)

    return {
        "vllm:prefix_cache_queries_total": ("Prefix cache queries, in prompt tokens looked up.", prefix("queries")),
        "vllm:prefix_cache_hits_total": ("Prefix cache hits, in prompt tokens served by a cached prefix.",
                                         prefix("hits")),
        "dsv41_prefill_rows_total": ("Prompt tokens computed by long-prompt prefills (a prefix hit's are not).",
                                     lambda: worker.slots.prefill_rows),
    }


def server_gauges(worker, compile_events) -> dict:
    """The gauges of a running server over its engine thread (`worker.Worker`; its slot engine is read at each
    scrape: a reset replaces it) and a callable counting JAX's backend compiles."""
    return {
        "vllm:num_requests_running": ("Requests holding a slot (prefilling or decoding).",
                                      lambda: worker.slots.active),
        "vllm:num_requests_waiting": ("Requests waiting for a slot.", lambda: worker.queued),
        "vllm:kv_cache_usage_perc": ("Fraction of the cache's positions (slots x context) holding tokens, 0..1.",
                                     lambda: round(worker.slots.cache_usage, 6)),
        "dsv41_slots": ("Decode slots.", lambda: worker.slots.slots),
        "dsv41_prefix_cache_bytes": ("Bytes held by prefix cache snapshots.",
                                     lambda: getattr(worker.slots.prefix_cache, "bytes", 0)),
        "dsv41_prefix_cache_snapshots": ("Prefix cache snapshots held.",
                                         lambda: len(worker.slots.prefix_cache or ())),
        "dsv41_decode_steps": ("Decode steps run.", lambda: worker.slots.decode_steps),
        "dsv41_programs_compiled": ("Programs in the engine's table.", lambda: worker.slots.engine.compile_count),
        "dsv41_compile_events": ("JAX backend compiles since start-up (precompile included).", compile_events),
    }
