"""The server's Prometheus metrics, in a registry of its own (one per app, never the process-global one).

Gauges and counters that the backends keep (queue depth, active slots, tokens generated, compiles) are read
from their `stats()` when Prometheus scrapes; latencies are observed by the server per request.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)


class _BackendCollector:
    """Reads each backend's `stats()` at scrape time."""

    def __init__(self, backends: Callable[[], dict[str, object]]):
        self._backends = backends

    def collect(self):
        gauges = {"queue_depth": GaugeMetricFamily("xlagen_queue_depth", "Requests waiting for a slot or a batch",
                                                   labels=["backend"]),
                  "active_slots": GaugeMetricFamily("xlagen_active_slots", "Requests being decoded",
                                                    labels=["backend"])}
        counters = {"tokens_generated": CounterMetricFamily("xlagen_tokens_generated", "Tokens generated",
                                                            labels=["backend"]),
                    "compiles": CounterMetricFamily("xlagen_compiles", "XLA programs traced and compiled",
                                                    labels=["backend"])}
        for name, backend in self._backends().items():
            stats = backend.stats()
            for key, family in (*gauges.items(), *counters.items()):
                if key in stats:
                    family.add_metric([name], float(stats[key]))
        yield from gauges.values()
        yield from counters.values()


class ServingMetrics:
    """The app's registry and the metrics the server observes.

    Args:
        backends: Returns {name: backend with `stats()`} for the backend metrics.
    """

    def __init__(self, backends: Callable[[], dict[str, object]]):
        self.registry = CollectorRegistry()
        self.registry.register(_BackendCollector(backends))
        self.requests = Counter("xlagen_requests", "HTTP requests by route and status code", ["route", "status"],
                                registry=self.registry)
        self.time_to_first_token = Histogram("xlagen_time_to_first_token_seconds",
                                             "From the request's arrival to its first token",
                                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("xlagen_inter_token_seconds", "Between consecutive tokens of a request",
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        """The Prometheus text format of everything."""
        return generate_latest(self.registry)
