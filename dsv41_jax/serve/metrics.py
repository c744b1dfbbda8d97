"""Prometheus text exposition (format 0.0.4) of the server's counters, gauges and histograms, written here
(a few dozen lines) rather than adding a dependency."""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets=LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help_text, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts):
            total += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{self.name}_sum {self.sum}", f"{self.name}_count {total}"]


class Metrics:
    """Requests by endpoint and status, tokens in/out, TTFT and inter-token histograms; gauges are read at
    scrape time from callables."""

    def __init__(self, gauges: dict):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram("dsv41_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first token.")
        self.itl = Histogram("dsv41_inter_token_latency_seconds", "Seconds between consecutive tokens of a stream.")
        self.gauges = gauges  # name -> (help, callable)

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def add_prompt_tokens(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens += n

    def add_generated_token(self) -> None:
        with self._lock:
            self.generated_tokens += 1

    def render(self) -> str:
        lines = ["# HELP dsv41_requests_total Requests answered, by endpoint and HTTP status.",
                 "# TYPE dsv41_requests_total counter"]
        with self._lock:
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'dsv41_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            counters = [("dsv41_prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens),
                        ("dsv41_generated_tokens_total", "Tokens generated.", self.generated_tokens)]
        for name, help_text, value in counters:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        for name, (help_text, read) in self.gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {read()}"]
        return "\n".join(lines + self.ttft.lines() + self.itl.lines()) + "\n"
