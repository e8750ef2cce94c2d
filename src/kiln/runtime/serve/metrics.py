"""The server's metrics in Prometheus' text format (GET /metrics): counters, gauges read when scraped, histograms.

Written here rather than with prometheus_client: a dozen series do not need a dependency, and the format is
small (https://prometheus.io/docs/instrumenting/exposition_formats/).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Sequence

from kiln.runtime.serve.engine import EngineMetrics, Generation

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{v}"'.replace("\\", "\\\\").replace("\n", "\\n") for k, v in sorted(labels.items()))
    return "{" + ",".join(escaped) + "}"


class Histogram:
    def __init__(self, buckets: Sequence[float]):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            out.append(f"{name}_bucket{_labels({**labels, 'le': le})} {total}")
        out += [f"{name}_sum{_labels(labels)} {self.sum!r}", f"{name}_count{_labels(labels)} {total}"]
        return out


class Metrics(EngineMetrics):
    """Every series the server exposes; thread-safe (the engine thread and the event loop both write)."""

    def __init__(self, model: str):
        self.model = model
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._help: dict[str, tuple[str, str]] = {}
        self._histograms: dict[str, Histogram] = {}
        self._gauges: dict[str, Callable[[], float]] = {}
        for name, text in (("kiln_time_to_first_token_seconds", "time from a request's arrival to its first token"),
                           ("kiln_inter_token_latency_seconds", "time between two tokens of one request"),
                           ("kiln_request_duration_seconds", "time from a request's arrival to its end"),
                           ("kiln_decode_step_seconds", "time of one batched decode step")):
            self._histogram(name, text, LATENCY_BUCKETS)
        self._histogram("kiln_decode_batch_size", "sequences in one batched decode step", BATCH_BUCKETS)
        self.sampled("kiln_http_process_cpu_seconds_total", "CPU time (user + system) of the server's own process: "
                     "near one second a second, it limits the server's tokens/s", time.process_time, kind="counter")

    def _histogram(self, name: str, text: str, buckets: Sequence[float]) -> None:
        self._help[name] = ("histogram", text)
        self._histograms[name] = Histogram(buckets)

    def gauge(self, name: str, text: str, read: Callable[[], float]) -> None:
        """A value read when scraped (queue depth, running sequences)."""
        self.sampled(name, text, read)

    def sampled(self, name: str, text: str, read: Callable[[], float], kind: str = "gauge") -> None:
        """A series whose value is read when scraped: a gauge, or a counter kept elsewhere (CPU seconds)."""
        self._help[name] = (kind, text)
        self._gauges[name] = read

    def count(self, name: str, text: str, amount: float = 1, **labels: str) -> None:
        with self._lock:
            self._help.setdefault(name, ("counter", text))
            key = (name, tuple(sorted(labels.items())))
            self._counters[key] = self._counters.get(key, 0) + amount

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._histograms[name].observe(value)

    # ---- EngineMetrics ----

    def step(self, batch: int, seconds: float) -> None:
        self.observe("kiln_decode_batch_size", batch)
        self.observe("kiln_decode_step_seconds", seconds)

    def token(self, first: bool, seconds: float) -> None:
        self.observe("kiln_time_to_first_token_seconds" if first else "kiln_inter_token_latency_seconds", seconds)

    def finished(self, generation: Generation) -> None:
        self.count("kiln_prompt_tokens_total", "prompt tokens of finished requests", generation.prompt_tokens)
        self.count("kiln_generation_tokens_total", "tokens generated", generation.completion_tokens)
        self.count("kiln_generations_total", "generations ended, by how", finish_reason=generation.finish_reason or "")
        if generation.last_token_at is not None:
            self.observe("kiln_request_duration_seconds", generation.last_token_at - generation.submitted)

    # ---- exposition ----

    def render(self) -> str:
        model = {"model": self.model}
        lines: list[str] = []
        with self._lock:
            names = sorted(self._help)
            for name in names:
                kind, text = self._help[name]
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                if name in self._gauges:
                    lines.append(f"{name}{_labels(model)} {self._gauges[name]():g}")
                elif kind == "counter":
                    for (n, labels), value in sorted(self._counters.items()):
                        if n == name:
                            lines.append(f"{name}{_labels({**model, **dict(labels)})} {value:g}")
                else:
                    lines += self._histograms[name].lines(name, model)
        return "\n".join(lines) + "\n"


__all__ = ["Histogram", "Metrics"]
