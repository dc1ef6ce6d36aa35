"""Prometheus metrics for /metrics, via prometheus-client on a registry of the server's own.

Counts are read from the scheduler's Stats at scrape time (a custom collector), so /metrics and
/health always agree; latency histograms are observed as generations finish."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServeMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_responses = Counter("colibri_http_responses", "HTTP responses by route and status code",
                                      ["route", "status"], registry=r)
        self.queue_wait = Histogram("colibri_queue_wait_seconds", "Time a generation waited for its turn",
                                    buckets=(0.005, 0.05, 0.25, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.ttft = Histogram("colibri_time_to_first_token_seconds", "Start of a generation to its first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.decode_rate = Histogram("colibri_decode_tokens_per_second", "Decode speed of each generation",
                                     buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)

    def attach(self, scheduler, engine) -> None:
        self.registry.register(_StateCollector(scheduler, engine))

    def attach_connections(self, guard) -> None:
        """The connection guard's counts (colibri/serve/connections.py), read at scrape time."""
        self.registry.register(_ConnectionCollector(guard))

    def observe_generation(self, g) -> None:
        if g.completion_tokens:
            self.ttft.observe(g.ttft_s)
        if g.completion_tokens > 1 and g.decode_tok_s > 0:
            self.decode_rate.observe(g.decode_tok_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    def __init__(self, scheduler, engine):
        self.scheduler, self.engine = scheduler, engine

    def describe(self):
        return []

    def collect(self):
        s = self.scheduler.stats
        gens = CounterMetricFamily("colibri_generations", "Admitted generation requests by outcome", labels=["outcome"])
        for outcome in ("completed", "cancelled", "failed"):
            gens.add_metric([outcome], getattr(s, outcome))
        yield gens
        rej = CounterMetricFamily("colibri_rejected_requests", "Requests refused by admission", labels=["reason"])
        for reason in ("queue_full", "queue_timeout", "draining"):
            rej.add_metric([reason], getattr(s, f"rejected_{reason}"))
        yield rej
        yield CounterMetricFamily("colibri_prompt_tokens", "Prompt tokens of completed generations",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("colibri_prompt_tokens_reused", "Prompt tokens served from a KV slot "
                                  "instead of prefilled", value=s.prompt_tokens_reused)
        yield CounterMetricFamily("colibri_completion_tokens", "Generated tokens of completed generations",
                                  value=s.completion_tokens)
        yield GaugeMetricFamily("colibri_queue_depth", "Requests waiting for their turn", value=self.scheduler.queued)
        yield GaugeMetricFamily("colibri_active_generations", "Generations running now",
                                value=self.scheduler.running)
        yield GaugeMetricFamily("colibri_draining", "1 while shutting down", value=int(self.scheduler.draining))
        batch = self.engine.batch_stats
        if batch is not None:  # --max-batch > 1: rows / steps is the mean batch size
            yield CounterMetricFamily("colibri_batch_steps", "Shared forward passes run", value=batch["steps"])
            yield CounterMetricFamily("colibri_batch_rows", "Decode rows those passes ran", value=batch["rows"])
        slots = GaugeMetricFamily("colibri_kv_slot_tokens", "Tokens each KV slot holds", labels=["slot"])
        for i, slot in enumerate(self.engine.slots):
            slots.add_metric([str(i)], len(slot.ids))
        yield slots
        # Expert cache: with every expert resident each lookup is a hit.
        stats = getattr(self.engine, "expert_stats", None)
        if stats:
            yield CounterMetricFamily("colibri_expert_hits", "Expert lookups served from RAM", value=stats["hits"])
            yield CounterMetricFamily("colibri_expert_misses", "Expert lookups read from disk", value=stats["misses"])
            yield CounterMetricFamily("colibri_expert_bytes_read", "Bytes of experts read from disk",
                                      value=stats["bytes_read"])
            asked = stats["hits"] + stats["misses"]
            ratio = stats["hits"] / asked if asked else 1.0
            if "worker_faults" in stats:  # --cluster (colibri/cluster/head.py)
                yield CounterMetricFamily("colibri_expert_worker_faults", "Expert workers found dead or silent: "
                                          "the head computed their experts, each was restarted",
                                          value=stats["worker_faults"])
        else:
            ratio = 1.0
        yield GaugeMetricFamily("colibri_expert_hit_ratio", "Share of expert lookups served from RAM", value=ratio)


class _ConnectionCollector:
    def __init__(self, guard):
        self.guard = guard

    def describe(self):
        return []

    def collect(self):
        g = self.guard
        yield GaugeMetricFamily("colibri_open_connections", "Open HTTP connections", value=g.total)
        refused = CounterMetricFamily("colibri_connections_refused", "Connections answered 429 / 503 and closed "
                                      "once their headers were in, by the cap they were over", labels=["limit"])
        refused.add_metric(["per_ip"], g.refused_per_ip)
        refused.add_metric(["total"], g.refused_total)
        yield refused
        yield CounterMetricFamily("colibri_header_timeouts", "Connections closed because a request's headers "
                                  "did not arrive within --header-timeout", value=g.header_timeouts)
        yield CounterMetricFamily("colibri_connections_evicted", "Connections between requests or still sending "
                                  "headers, closed to make room for a complete request", value=g.evicted)
