"""The OpenAI server's Prometheus metrics: requests by route and status, requests in flight and queued, time
to first token and time per output token, and the engine's tokens per decoding row step (tau), each app
with its own CollectorRegistry so two servers in one process never share counts.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The server's metrics in their own registry; `render()` is the body of `GET /metrics`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, tau: Callable[[], float]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("specpilot_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.in_flight = Gauge("specpilot_requests_in_flight", "Generation requests admitted and not finished",
                               registry=r)
        self.queue_depth = Gauge("specpilot_queue_depth", "Generation requests admitted that have no token yet "
                                 "(waiting for a slot or in prefill)", registry=r)
        self.ttft = Histogram("specpilot_time_to_first_token_seconds", "From a request's arrival to its first "
                              "token", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("specpilot_time_per_output_token_seconds", "A request's mean time per token after "
                              "its first", buckets=TPOT_BUCKETS, registry=r)
        self.tokens = Counter("specpilot_generated_tokens", "Tokens the engine generated for requests",
                              registry=r)
        self.tau = Gauge("specpilot_tau", "Mean tokens a decoding row gains per engine step (AR: 1; "
                         "speculative plans: the acceptance length)", registry=r)
        self.tau.set_function(tau)

    def count(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def finished(self, ttft_s: float | None, tokens: int, last_token_s: float | None) -> None:
        """One generation ended: its first-token latency and, with 2+ tokens, its time per later token."""
        self.tokens.inc(tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if tokens > 1 and last_token_s is not None:
                self.tpot.observe((last_token_s - ttft_s) / (tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
