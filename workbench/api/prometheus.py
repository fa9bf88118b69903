"""The API's /metrics: Prometheus text from a registry of its own (one per server, not prometheus_client's
global one), with vLLM-like names under `runner_workbench:`, each model labelled by the name the API serves it
under (names.py: a directory's name, never its path). Gauges are read from the session when scraped; counters
and histograms count the requests this server answered, speculative decoding's too (vLLM's spec_decode_* names:
drafts, draft tokens, accepted tokens, and accepted tokens by draft position, labelled `position`; acceptance
rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from runner_core import RequestMetrics
from workbench.api.names import served_names

PREFIX = "runner_workbench:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


class ApiMetrics:
    """One server's metrics. `observe(request_metrics, model)` when a request finishes; `render(session)` for a
    scrape."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        reg, label = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, label, registry=reg)

        self.running = gauge("num_requests_running", "Requests in the model's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the KV cache blocks in use (1 = full).")
        self.blocks_used = gauge("kv_cache_blocks_used", "KV cache blocks in use.")
        self.blocks_total = gauge("kv_cache_blocks_total", "KV cache blocks in the pool.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Fraction of prompt blocks found in the prefix cache.")
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the requests served.", label,
                                     registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated for the requests served.",
                                         label, registry=reg)
        self.finished = Counter(PREFIX + "request_success", "Requests served, by finish reason.",
                                label + ["finished_reason"], registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token of served requests.",
                              label, buckets=TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per served request.", label,
                              buckets=TPOT_BUCKETS, registry=reg)
        self.spec_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Speculative drafts verified.", label,
                                   registry=reg)
        self.spec_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed.", label,
                                         registry=reg)
        self.spec_accepted = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", label,
                                     registry=reg)
        self.spec_accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their position in the draft.",
                                             label + ["position"], registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end latency of served requests.",
                             label, buckets=E2E_BUCKETS, registry=reg)

    def observe(self, metrics: RequestMetrics, model: str, spec: dict | None = None) -> None:
        """Count a finished request by its RequestMetrics (the engine's times from the session's submit) under
        `model`, the name it was served under; `spec`: its speculation figures (SpecDecodingStats.as_dict)."""
        if spec:
            self.spec_drafts.labels(model).inc(spec["num_drafts"])
            self.spec_draft_tokens.labels(model).inc(spec["num_draft_tokens"])
            self.spec_accepted.labels(model).inc(spec["num_accepted_tokens"])
            for position, accepted in enumerate(spec["num_accepted_tokens_per_pos"]):
                self.spec_accepted_per_pos.labels(model, str(position)).inc(accepted)
        n = metrics.num_output_tokens
        self.prompt_tokens.labels(model).inc(metrics.num_prompt_tokens)
        self.generation_tokens.labels(model).inc(n)
        self.finished.labels(model, metrics.finish_reason or "error").inc()
        for histogram, seconds in ((self.e2e, metrics.e2e), (self.ttft, metrics.ttft), (self.tpot, metrics.tpot)):
            if seconds is not None:
                histogram.labels(model).observe(max(0.0, seconds))

    def render(self, session) -> bytes:
        """The text exposition, gauges refreshed from the session's published state (no engine call)."""
        for g in (self.running, self.waiting, self.kv_usage, self.blocks_used, self.blocks_total,
                  self.prefix_hit_rate):
            g.clear()
        memory, served = session.memory(), served_names(session)
        for name in session.models:
            inflight, label = session.inflight(name), served.get(name, name)
            rows = session.metrics.rows(model=name, last=1) if inflight else []
            running = rows[0].get("num_running", len(inflight)) if rows else len(inflight)
            self.running.labels(label).set(running)
            self.waiting.labels(label).set(rows[0].get("num_waiting", 0) if rows else 0)
            mem = memory.get(name, {})
            used, total = mem.get("blocks_used", 0), mem.get("blocks_total", 0)
            self.blocks_used.labels(label).set(used)
            self.blocks_total.labels(label).set(total)
            self.kv_usage.labels(label).set(used / total if total else 0.0)
            self.prefix_hit_rate.labels(label).set(mem.get("prefix_cache_hit_rate") or 0.0)
        return generate_latest(self.registry)
